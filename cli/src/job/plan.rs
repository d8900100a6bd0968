//! `berth job plan`: what registering a job would change, as Nomad prints
//! it; exit 0 when nothing, 1 when allocs would be created or stopped,
//! 255 on error.

use super::*;

pub(super) fn job_plan(a: PlanArgs, api: &ApiClient) -> Result<i32> {
    match plan(&a, api) {
        Ok(code) => Ok(code),
        // A command line clap could not judge is still a usage error.
        Err(e) if e.downcast_ref::<UsageError>().is_some() => Err(e),
        Err(e) => {
            eprintln!("Error: {}", one_line(&e));
            Ok(255)
        }
    }
}

fn plan(a: &PlanArgs, api: &ApiClient) -> Result<i32> {
    let job = load_job("plan", &a.file, &a.vars)?;
    let resp = api.put(
        &format!("/v1/job/{}/plan", enc(&job.id)),
        &json!({ "job": job }),
    )?;
    let changes = resp["allocs_change"].as_bool() == Some(true);
    if a.json {
        print_json(&resp)?;
        return Ok(i32::from(changes));
    }
    let mut args: Vec<String> = a.vars.iter().map(|v| format!("-var {v}")).collect();
    args.push(a.file.clone());
    print!("{}", plan_text(&resp, &args.join(" "), a.verbose));
    Ok(i32::from(changes))
}

/// The width a line of the diff is wrapped at.
const DIFF_WIDTH: usize = 100;

/// `line` wrapped at `width` characters (at the last space or comma
/// before it when there is one), each further line starting with
/// `indent`: nothing is cut off.
fn wrapped(line: &str, width: usize, indent: &str) -> String {
    let mut out = String::new();
    let mut rest: Vec<char> = line.chars().collect();
    let mut first = true;
    loop {
        let room = if first {
            width
        } else {
            width.saturating_sub(indent.len()).max(20)
        };
        if !first {
            out.push('\n');
            out.push_str(indent);
        }
        if rest.len() <= room {
            out.extend(rest);
            return out;
        }
        let at = rest[..room]
            .iter()
            .rposition(|c| *c == ' ' || *c == ',')
            .filter(|&i| i > room / 2)
            .map_or(room, |i| i + 1);
        let tail = rest.split_off(at);
        out.push_str(rest.iter().collect::<String>().trim_end());
        rest = tail;
        first = false;
    }
}

/// One field of a diff (`+ path: new`, `- path: old`, `~ path: old =>
/// new`), as `job plan` and `job history -p` show it.
pub(super) fn diff_line(f: &Value) -> String {
    let path = s(f, "path");
    match s(f, "op") {
        "+" => format!("+ {path}: {}", shown(&f["new"])),
        "-" => format!("- {path}: {}", shown(&f["old"])),
        _ => format!("~ {path}: {} => {}", shown(&f["old"]), shown(&f["new"])),
    }
}

/// A value of a diff, on one line.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// The human text of a plan answer; `args` are what the hint's `job run`
/// repeats (the `-var` flags and the file).
pub fn plan_text(plan: &Value, args: &str, verbose: bool) -> String {
    let mut out = String::new();
    let job_id = s(plan, "job_id");
    let kind = s(&plan["diff"], "kind");
    let (mark, note) = match kind {
        "added" => ("+", " (new job)"),
        "edited" => ("+/-", ""),
        "restarted" => ("+", " (stopped: submitting it runs it again)"),
        _ => ("", " (unchanged)"),
    };
    out.push_str(&format!(
        "{}Job: {job_id:?}{note}\n",
        if mark.is_empty() {
            String::new()
        } else {
            format!("{mark} ")
        }
    ));
    for f in plan["diff"]["fields"].as_array().into_iter().flatten() {
        let line = format!("  {}", diff_line(f));
        out.push_str(&wrapped(&line, DIFF_WIDTH, "      "));
        out.push('\n');
    }

    out.push_str("\nScheduler dry-run:\n");
    let groups = plan["groups"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    for g in groups {
        // Counts that add up: an alloc replaced by a destructive update is
        // one "create/destroy update", not also a create and a destroy.
        let update = n(g, "update");
        let counts = [
            (n(g, "place").saturating_sub(update), "create"),
            (n(g, "stop").saturating_sub(update), "destroy"),
            (update, "create/destroy update"),
            (n(g, "in_place"), "in-place update"),
            (n(g, "keep"), "ignore"),
        ];
        let mut parts: Vec<String> = counts
            .iter()
            .filter(|(count, _)| *count > 0)
            .map(|(count, word)| format!("{count} {word}"))
            .collect();
        if n(g, "unplaced") > 0 {
            parts.push(format!("{} not placed", n(g, "unplaced")));
        }
        if parts.is_empty() {
            parts.push("no change".into());
        }
        out.push_str(&format!(
            "- Task group {:?}: {}\n",
            s(g, "name"),
            parts.join(", ")
        ));
        for p in g["placements"].as_array().into_iter().flatten() {
            let node = match s(p, "node_name") {
                "" => s(p, "node_id"),
                name => name,
            };
            out.push_str(&format!("    + {} on {node}\n", s(p, "name")));
        }
        for st in g["stops"].as_array().into_iter().flatten() {
            let id = s(st, "id");
            out.push_str(&format!(
                "    - {} {} ({})\n",
                if verbose { id } else { short_id(id) },
                s(st, "name"),
                s(st, "reason")
            ));
        }
    }
    for w in strs(&plan["waiting"]) {
        out.push_str(&format!("- {w}\n"));
    }
    let failures = strs(&plan["placement_failures"]);
    if failures.is_empty() {
        out.push_str("- All tasks successfully allocated.\n");
    } else {
        out.push_str("- WARNING: Failed to place all allocations.\n");
        for f in &failures {
            out.push_str(&format!("    {f}\n"));
        }
    }
    let index = n(plan, "job_modify_index");
    out.push_str(&format!(
        "\nJob Modify Index: {index}\n\
         To submit the job with version verification run:\n\
         \n\
         berth job run -check-index {index} {args}\n\
         \n\
         When running the job with the check-index flag, the job will only be run if the\n\
         job modify index given matches the server-side version. If the index has\n\
         changed, another user has modified the job and the plan's results are\n\
         potentially invalid.\n"
    ));
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_long_diff_line_is_wrapped_not_cut() {
        let args: Vec<String> = (0..40).map(|i| format!("\"argument-{i}\"")).collect();
        let line = format!(
            "  ~ task_groups[g].tasks[t].config.args: [{}]",
            args.join(",")
        );
        let text = wrapped(&line, 100, "      ");
        assert!(text.lines().all(|l| l.chars().count() <= 100), "{text}");
        assert!(
            text.lines().skip(1).all(|l| l.starts_with("      ")),
            "{text}"
        );
        let squeezed = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
        assert_eq!(squeezed(&text), squeezed(&line), "nothing lost");
        assert!(text.contains("argument-39"), "{text}");
    }

    #[test]
    fn the_counts_of_a_group_add_up() {
        let plan = json!({
            "job_id": "web",
            "diff": { "kind": "edited", "fields": [] },
            "groups": [{
                "name": "g", "place": 3, "stop": 2, "update": 2, "in_place": 0, "keep": 1,
                "unplaced": 0, "placements": [], "stops": []
            }],
            "placement_failures": [],
            "job_modify_index": 7
        });
        let text = plan_text(&plan, "web.hcl", false);
        assert!(
            text.contains("- Task group \"g\": 1 create, 2 create/destroy update, 1 ignore\n"),
            "{text}"
        );
    }
}
