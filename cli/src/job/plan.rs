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
        let path = s(f, "path");
        let line = match s(f, "op") {
            "+" => format!("  + {path}: {}", shown(&f["new"])),
            "-" => format!("  - {path}: {}", shown(&f["old"])),
            _ => format!("  ~ {path}: {} => {}", shown(&f["old"]), shown(&f["new"])),
        };
        if verbose || line.chars().count() <= 160 {
            out.push_str(&line);
        } else {
            let cut: String = line.chars().take(157).collect();
            out.push_str(&cut);
            out.push_str("...");
        }
        out.push('\n');
    }

    out.push_str("\nScheduler dry-run:\n");
    let groups = plan["groups"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    for g in groups {
        let mut parts = Vec::new();
        for (key, word) in [("place", "create"), ("stop", "destroy")] {
            if n(g, key) > 0 {
                parts.push(format!("{} {word}", n(g, key)));
            }
        }
        if n(g, "update") > 0 {
            parts.push(format!("{} create/destroy update", n(g, "update")));
        }
        if n(g, "in_place") > 0 {
            parts.push(format!("{} in-place update", n(g, "in_place")));
        }
        if n(g, "keep") > 0 {
            parts.push(format!("{} ignore", n(g, "keep")));
        }
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
