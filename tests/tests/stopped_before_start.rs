//! Allocs stopped before they started, end to end: a job submitted and at
//! once stopped while a changed version is submitted concurrently, many
//! times, leaves no alloc pending: every alloc ends terminal, and each one
//! that never started says so in a `Not Started` event of every task, also
//! after the agent restarted.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{sleeping_service_job, task_events, wait_for, DevAgent};
use serde_json::Value;

const JOB: &str = "stop-at-once";
const ROUNDS: usize = 12;

/// The job's spec file for `version` (each one a changed spec).
fn job_file(agent: &DevAgent, version: usize) -> Result<String> {
    agent.write_file(
        &format!("{JOB}-{version}.hcl"),
        &sleeping_service_job(JOB, 8, version),
    )
}

/// Every alloc of the job the servers keep.
fn allocs(agent: &DevAgent) -> Result<Vec<Value>> {
    agent.job_allocs(JOB)
}

fn is_terminal(a: &Value) -> bool {
    matches!(
        a["client_status"].as_str(),
        Some("complete" | "failed" | "lost")
    )
}

/// Checks that every alloc is terminal and that each one whose tasks never
/// started has a `Not Started` event on every task. Returns how many never
/// started.
fn check_allocs(all: &[Value]) -> Result<usize> {
    let mut never_started = 0;
    for a in all {
        let id = a["id"].as_str().unwrap_or_default();
        if !is_terminal(a) {
            bail!(
                "alloc {id} is {} (desired {})",
                a["client_status"],
                a["desired_status"]
            );
        }
        let tasks = a["task_states"].as_object().cloned().unwrap_or_default();
        if tasks.is_empty() {
            bail!("terminal alloc {id} has no task states: {a}");
        }
        let started = tasks.keys().any(|name| {
            task_events(a, name)
                .iter()
                .any(|(kind, _, _)| kind == "Started")
        });
        if started {
            continue;
        }
        never_started += 1;
        for name in tasks.keys() {
            let evs = task_events(a, name);
            let said = evs.iter().any(|(kind, msg, _)| {
                kind == "Not Started" && msg == "the alloc was stopped before it started"
            });
            if !said {
                bail!("task {name} of never-started alloc {id} has no Not Started event: {evs:?}");
            }
        }
        if a["client_status"] != "complete" {
            bail!("never-started alloc {id} is {}", a["client_status"]);
        }
    }
    Ok(never_started)
}

#[test]
fn allocs_stopped_before_they_start_end_complete_and_say_so() -> Result<()> {
    let mut agent = DevAgent::start()?;
    for round in 0..ROUNDS {
        let first = job_file(&agent, round * 2)?;
        let changed = job_file(&agent, round * 2 + 1)?;
        agent.cli_ok(&["job", "run", "-detach", &first])?;
        // Stop it at once while a changed version comes in.
        std::thread::scope(|s| -> Result<()> {
            let resubmit = s.spawn(|| agent.cli(&["job", "run", "-detach", &changed]));
            let stop = s.spawn(|| agent.cli(&["job", "stop", "-detach", JOB]));
            for h in [resubmit, stop] {
                let out = h
                    .join()
                    .map_err(|_| anyhow::anyhow!("a CLI thread panicked"))??;
                // Either may lose the race (a stop of a job already
                // stopped, say); neither may crash.
                if out.status.code().is_none() {
                    bail!("the CLI was killed: {out:?}");
                }
            }
            Ok(())
        })?;
        // Whatever won, the job ends the round stopped.
        agent.cli_ok(&["job", "stop", "-detach", JOB])?;
    }

    let never_started = wait_for(
        "every alloc of the job to be terminal",
        Duration::from_secs(90),
        || Ok(Some(check_allocs(&allocs(&agent)?)?)),
    )
    .with_context(|| agent.log())?;
    eprintln!("{never_started} allocs were stopped before their tasks started");
    assert!(
        never_started > 0,
        "some allocs were stopped before their tasks started"
    );

    // A restarted agent keeps them so.
    agent.restart()?;
    let after = wait_for(
        "the allocs after a restart",
        Duration::from_secs(60),
        || Ok(Some(check_allocs(&allocs(&agent)?)?)),
    )
    .with_context(|| agent.log())?;
    assert_eq!(after, never_started);
    Ok(())
}
