//! `berth job run|plan|inspect|stop|status` against a dev agent: the
//! progress `job run` shows, plans that place nothing, check-index and
//! variables, `job stop` that waits, purge, summaries, ID prefixes, and
//! snapshots of the human outputs.

use anyhow::Result;
use berth_tests::cli_text::{stderr, stdout};
use berth_tests::snapshot::settings;
use berth_tests::{cli_at, quick_batch_job, DevAgent};
use serde_json::Value;

/// A service job whose count is a variable (default 2).
const WEB: &str = r#"
variable "count" {
  type    = number
  default = 2
}

variable "seconds" {
  default = "300"
}

job "web" {
  group "g" {
    count = var.count
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["${var.seconds}"]
      }
      resources {
        cpu    = 10
        memory = 8
      }
    }
  }
}
"#;

/// A batch job whose task fails at once and is not restarted.
const FAILING: &str = r#"
job "failing" {
  type = "batch"
  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "echo boom; exit 3"]
      }
      resources {
        cpu    = 10
        memory = 8
      }
    }
  }
}
"#;

/// The dev agent's node name, fixed so that snapshots of tables keep
/// their column widths on every host.
const NODE: &str = "dev-node";

fn start_agent() -> Result<DevAgent> {
    DevAgent::start_with_args(&["-node", NODE])
}

#[test]
fn job_run_follows_the_allocs_and_status_stop_and_inspect_show_them() -> Result<()> {
    let agent = start_agent()?;
    let file = agent.write_file("web.hcl", WEB)?;
    let out = agent.cli(&["job", "run", &file])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.contains("==> Job \"web\" submitted: version 0"),
        "{text}"
    );
    assert!(text.contains("==> Placed 2 allocs: web.g[0] on "), "{text}");
    assert_eq!(
        text.matches(": pending -> running").count(),
        2,
        "each alloc's transition is shown: {text}"
    );
    assert!(
        text.contains("==> Job \"web\" is done: 2 allocs running"),
        "{text}"
    );
    for a in agent.job_allocs("web")? {
        assert_eq!(a["client_status"], "running", "{a}");
    }

    // Status: the summary per group, by a unique prefix of the ID.
    let status = agent.cli_json(&["job", "status", "we"])?;
    assert_eq!(status["id"], "web");
    assert_eq!(status["summary"]["g"]["running"], 2, "{status}");
    assert_eq!(status["summary"]["g"]["queued"], 0, "{status}");
    let text = agent.cli_ok(&["job", "status", "web"])?;
    settings().bind(|| insta::assert_snapshot!("job_status_running", text));
    let list = agent.cli_ok(&["job", "status"])?;
    settings().bind(|| insta::assert_snapshot!("job_status_list", list));

    // An ambiguous prefix names the matches.
    agent.cli_ok(&[
        "job",
        "run",
        &agent.write_file("web2.hcl", &quick_batch_job("web2", 1))?,
    ])?;
    let out = agent.cli(&["job", "status", "web"])?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "an exact ID wins: {}",
        stderr(&out)
    );
    let out = agent.cli(&["job", "status", "we"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("matches 2 jobs: \"web\", \"web2\""),
        "{}",
        stderr(&out)
    );

    // Inspect: the job as submitted (what `job run -output` would send).
    let submitted: Value = serde_json::from_str(&agent.cli_ok(&["job", "run", "-output", &file])?)?;
    let stored: Value = serde_json::from_str(&agent.cli_ok(&["job", "inspect", "web"])?)?;
    for key in [
        "id",
        "name",
        "type",
        "priority",
        "datacenters",
        "task_groups",
        "meta",
    ] {
        assert_eq!(stored[key], submitted["job"][key], "{key}");
    }
    assert_eq!(
        stored["task_groups"][0]["tasks"][0]["config"]["args"][0],
        "300"
    );
    let t = agent.cli_ok(&["job", "inspect", "-t", "{{ id }} v{{ version }}", "web"])?;
    assert_eq!(t.trim(), "web v0");
    // -json, as Nomad's users type it, prints the same JSON.
    let json: Value = serde_json::from_str(&agent.cli_ok(&["job", "inspect", "-json", "web"])?)?;
    assert_eq!(json, stored);

    // Stop waits: every alloc is terminal when it returns.
    let out = agent.cli(&["job", "stop", "web"])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    for a in agent.job_allocs("web")? {
        assert_eq!(a["client_status"], "complete", "{a}");
        assert_eq!(a["desired_status"], "stop", "{a}");
    }
    assert_eq!(text.matches(": running -> complete").count(), 2, "{text}");
    // Allocs that stop in separate answers may be printed in either order.
    let mut transitions: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("    Alloc "))
        .collect();
    // By what follows the alloc's ID: its name.
    transitions.sort_by_key(|l| l.split_whitespace().skip(2).collect::<Vec<_>>());
    let mut ordered = Vec::new();
    let mut pending = transitions.into_iter();
    for line in text.lines() {
        ordered.push(if line.starts_with("    Alloc ") {
            pending.next().unwrap_or(line)
        } else {
            line
        });
    }
    let text = ordered.join("\n");
    settings().bind(|| insta::assert_snapshot!("job_stop", text));
    let status = agent.cli_json(&["job", "status", "web"])?;
    assert_eq!(status["status"], "dead");
    assert_eq!(status["summary"]["g"]["complete"], 2, "{status}");
    Ok(())
}

#[test]
fn a_failing_batch_job_exits_1_and_says_why() -> Result<()> {
    let agent = start_agent()?;
    let file = agent.write_file("failing.hcl", FAILING)?;
    let out = agent.cli(&["job", "run", &file])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    let line = text
        .lines()
        .find(|l| l.contains("-> failed"))
        .unwrap_or_else(|| panic!("no failure line: {text}"));
    assert!(line.contains("failing.g[0]"), "{line}");
    assert!(
        line.contains("Exit Code: 3"),
        "the task event's reason: {line}"
    );
    assert!(
        text.contains("==> Job \"failing\" failed: 1 alloc of 1 failed"),
        "{text}"
    );

    // A batch job that succeeds ends with its allocs complete.
    let ok = agent.write_file("once.hcl", &quick_batch_job("once", 2))?;
    let text = agent.cli_ok(&["job", "run", &ok])?;
    assert_eq!(text.matches("-> complete").count(), 2, "{text}");
    assert!(
        text.contains("==> Job \"once\" is done: 2 allocs complete"),
        "{text}"
    );
    let status = agent.cli_json(&["job", "status", "once"])?;
    assert_eq!(status["summary"]["g"]["complete"], 2, "{status}");
    Ok(())
}

#[test]
fn plan_shows_the_diff_and_the_placements_and_places_nothing() -> Result<()> {
    let agent = start_agent()?;
    let file = agent.write_file("web.hcl", WEB)?;

    // A new job: exit 1 (allocs would be created), nothing placed.
    let out = agent.cli(&["job", "plan", &file])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(text.starts_with("+ Job: \"web\" (new job)"), "{text}");
    assert_eq!(text.matches("    + web.g[").count(), 2, "{text}");
    assert!(text.contains("berth job run -check-index 0 "), "{text}");
    let out = agent.cli(&["job", "status", "web"])?;
    assert_eq!(out.status.code(), Some(1), "the plan stored no job");

    agent.cli_ok(&["job", "run", &file])?;
    let before: Vec<Value> = agent.job_allocs("web")?;

    // The same job: exit 0, nothing to do.
    let out = agent.cli(&["job", "plan", &file])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(text.contains("Job: \"web\" (unchanged)"), "{text}");
    assert!(text.contains("Task group \"g\": 2 ignore"), "{text}");

    // A changed count: the field diff and the dry run.
    let out = agent.cli(&["job", "plan", "-var", "count=3", &file])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(text.contains("  ~ task_groups[g].count: 2 => 3"), "{text}");
    settings().bind(|| insta::assert_snapshot!("job_plan_count", text));
    let out = agent.cli(&["job", "plan", "-json", "-var", "count=3", &file])?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out))?;
    // One more placed; the two that run take the new count in place.
    assert_eq!(json["groups"][0]["place"], 1, "{json}");
    assert_eq!(json["groups"][0]["in_place"], 2, "{json}");
    assert_eq!(json["diff"]["kind"], "edited");

    // In place (a group meta), destructive (the task's args) and both
    // with a count change.
    let with_meta = agent.write_file(
        "web-meta.hcl",
        &WEB.replacen(
            "  group \"g\" {\n",
            "  group \"g\" {\n    meta {\n      tier = \"gold\"\n    }\n",
            1,
        ),
    )?;
    for (name, file, vars) in [
        ("job_plan_in_place", &with_meta, vec![]),
        ("job_plan_destructive", &file, vec!["-var", "seconds=400"]),
        (
            "job_plan_mixed",
            &file,
            vec!["-var", "seconds=400", "-var", "count=3"],
        ),
    ] {
        let mut args = vec!["job", "plan"];
        args.extend(vars);
        args.push(file);
        let out = agent.cli(&args)?;
        let text = stdout(&out);
        assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
        settings().bind(|| insta::assert_snapshot!(name, text));
    }

    let after = agent.job_allocs("web")?;
    assert_eq!(after, before, "plans change no alloc");

    // An error is exit 255.
    let out = agent.cli(&["job", "plan", "/nonexistent/job.hcl"])?;
    assert_eq!(out.status.code(), Some(255), "{}", stderr(&out));
    assert!(stderr(&out).starts_with("Error: "), "{}", stderr(&out));
    Ok(())
}

#[test]
fn check_index_refuses_a_stale_submission_and_vars_set_variables() -> Result<()> {
    let agent = start_agent()?;
    let file = agent.write_file("web.hcl", WEB)?;

    // 0: only while the job does not exist.
    agent.cli_ok(&[
        "job",
        "run",
        "-check-index",
        "0",
        "-var",
        "seconds=200",
        &file,
    ])?;
    let job = agent.cli_json(&["job", "status", "web"])?;
    let index = job["job_modify_index"].as_u64().expect("job_modify_index");
    assert_eq!(
        agent.api_get("/v1/job/web")?["task_groups"][0]["tasks"][0]["config"]["args"][0],
        "200"
    );

    let out = agent.cli(&["job", "run", "-check-index", "0", &file])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains(&format!("already exists (job modify index {index})")),
        "{}",
        stderr(&out)
    );

    // Planned at `index`, changed meanwhile: refused, naming both.
    agent.cli_ok(&[
        "job",
        "run",
        "-var",
        "count=1",
        "-var",
        "seconds=200",
        &file,
    ])?;
    let now = agent.cli_json(&["job", "status", "web"])?["job_modify_index"]
        .as_u64()
        .unwrap_or_default();
    assert!(now > index);
    let stale = index.to_string();
    let out = agent.cli(&[
        "job",
        "run",
        "-check-index",
        &stale,
        "-var",
        "count=3",
        &file,
    ])?;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "has job modify index {now}, not the {index} given"
        )),
        "{err}"
    );
    assert_eq!(
        agent
            .job_allocs("web")?
            .iter()
            .filter(|a| a["desired_status"] == "run")
            .count(),
        1
    );

    // The current index goes through.
    let current = now.to_string();
    agent.cli_ok(&[
        "job",
        "run",
        "-check-index",
        &current,
        "-var",
        "count=3",
        &file,
    ])?;
    let live = agent
        .job_allocs("web")?
        .into_iter()
        .filter(|a| a["desired_status"] == "run")
        .count();
    assert_eq!(live, 3);

    // An unknown variable is refused before anything is sent.
    let out = agent.cli(&["job", "run", "-var", "colour=red", &file])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains(
            "no variable \"colour\" is declared (the job file declares \"count\", \"seconds\")"
        ),
        "{}",
        stderr(&out)
    );
    let out = agent.cli(&["job", "run", "-var", "count", &file])?;
    assert_eq!(
        out.status.code(),
        Some(2),
        "a -var without = is a usage error"
    );
    Ok(())
}

#[test]
fn stop_purge_waits_and_the_job_is_gone() -> Result<()> {
    let agent = start_agent()?;
    let file = agent.write_file("web.hcl", WEB)?;
    agent.cli_ok(&["job", "run", &file])?;
    let ids: Vec<String> = agent
        .job_allocs("web")?
        .iter()
        .filter_map(|a| a["id"].as_str().map(str::to_string))
        .collect();
    let text = agent.cli_ok(&["job", "stop", "-purge", "web"])?;
    assert!(text.contains("the job is purged"), "{text}");
    let out = agent.cli(&["job", "status", "web"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("job \"web\" not found"),
        "{}",
        stderr(&out)
    );
    for id in ids {
        let out = agent.cli(&["alloc", "status", &id])?;
        assert_eq!(out.status.code(), Some(1), "alloc {id} went with its job");
    }

    // -detach returns at once, before the allocs stop.
    agent.cli_ok(&["job", "run", &file])?;
    let text = agent.cli_ok(&["job", "stop", "-detach", "web"])?;
    assert_eq!(text.lines().count(), 1, "{text}");
    Ok(())
}

#[test]
fn every_job_command_has_help() -> Result<()> {
    // Help needs no agent.
    let nowhere = "http://127.0.0.1:1";
    for cmd in ["run", "plan", "inspect", "stop", "status"] {
        let out = cli_at(nowhere, &["job", cmd, "-h"])?;
        assert_eq!(out.status.code(), Some(0), "job {cmd} -h");
        let text = stdout(&out);
        assert!(text.contains(&format!("Usage: berth job {cmd}")), "{text}");
    }
    let text = stdout(&cli_at(nowhere, &["job", "run", "-h"])?);
    // Flags are listed as Nomad writes them, with one dash.
    for flag in ["-detach", "-var <NAME=VALUE>", "-check-index <INDEX>"] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(flag)),
            "{flag}: {text}"
        );
    }
    assert!(!text.contains("--"), "{text}");
    Ok(())
}
