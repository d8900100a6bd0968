//! Allocs stopped before they started, end to end, on a server and a client
//! agent in separate processes.
//!
//! A job submitted and at once stopped while a changed version is submitted
//! concurrently, many times, leaves no alloc pending: every alloc ends
//! terminal, and each one that never started says so in a `Not Started`
//! event of every task. Whether the race leaves any alloc unstarted depends
//! on how fast the client is, so the test also makes sure of it: the
//! client is cut off (packets dropped, as a broken switch would) while a
//! job is placed on it and stopped, and reconnects to find its allocs
//! already stopped. Those never start, and say so, also after the client
//! agent restarted.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::cluster::{Client, Server};
use berth_tests::{cli_at, sleeping_service_job, task_events, wait_for};
use serde_json::Value;

const JOB: &str = "stop-at-once";
const ROUNDS: usize = 12;
/// The allocs of the job placed while the client is cut off.
const CUT_OFF_COUNT: usize = 8;

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

/// Runs the CLI against the server; any exit code is fine, a killed CLI is
/// not.
fn cli_survives(server: &Server, args: &[&str]) -> Result<()> {
    let out = cli_at(&server.addr(), args)?;
    if out.status.code().is_none() {
        bail!("the CLI was killed: {out:?}");
    }
    Ok(())
}

/// Waits until every alloc of the job is terminal and checked; returns how
/// many never started.
fn wait_checked(server: &Server, client: &Client, what: &str) -> Result<usize> {
    wait_for(what, Duration::from_secs(90), || {
        Ok(Some(check_allocs(&server.allocs(JOB)?)?))
    })
    .with_context(|| {
        format!(
            "server log:\n{}\nclient log:\n{}",
            server.agent.log(),
            client.agent.log()
        )
    })
}

#[test]
fn allocs_stopped_before_they_start_end_complete_and_say_so() -> Result<()> {
    let mut server = Server::start("")?;
    let mut client = Client::start(&server, "c1", true, "")?;
    server.wait_nodes_ready(&["c1"])?;
    let specs = tempfile::tempdir()?;
    let job_file = |version: usize| -> Result<String> {
        let path = specs.path().join(format!("{JOB}-{version}.hcl"));
        std::fs::write(&path, sleeping_service_job(JOB, 8, version))?;
        Ok(path.to_str().context("a UTF-8 temp path")?.to_string())
    };

    // The race: a stop and a changed version right behind a new one.
    for round in 0..ROUNDS {
        let first = job_file(round * 2)?;
        let changed = job_file(round * 2 + 1)?;
        server.cli(&["job", "run", "-detach", &first])?;
        std::thread::scope(|s| -> Result<()> {
            let resubmit = s.spawn(|| cli_survives(&server, &["job", "run", "-detach", &changed]));
            // Either may lose the race (a stop of a job already stopped,
            // say); neither may crash.
            let stop = s.spawn(|| cli_survives(&server, &["job", "stop", "-detach", JOB]));
            for h in [resubmit, stop] {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a CLI thread panicked"))??;
            }
            Ok(())
        })?;
        // Whatever won, the job ends the round stopped.
        server.cli(&["job", "stop", "-detach", JOB])?;
    }
    let raced = wait_checked(&server, &client, "every alloc of the raced job terminal")?;
    eprintln!("{raced} allocs were stopped before their tasks started in the race");

    // Certainly stopped before started: placed and stopped while the client
    // hears nothing. When the relay heals, it closes the connections that
    // lost bytes; the client's new alloc watch starts with the allocs
    // already stopped.
    client.relay()?.partition();
    let version = ROUNDS * 2;
    let ids = |allocs: &[Value]| -> BTreeSet<String> {
        allocs
            .iter()
            .filter_map(|a| a["id"].as_str().map(str::to_string))
            .collect()
    };
    let raced_ids = ids(&server.allocs(JOB)?);
    server.cli(&["job", "run", "-detach", &job_file(version)?])?;
    wait_for("the cut-off allocs placed", Duration::from_secs(30), || {
        Ok((server.allocs(JOB)?.len() == raced_ids.len() + CUT_OFF_COUNT).then_some(()))
    })?;
    let cut_off: BTreeSet<String> = ids(&server.allocs(JOB)?)
        .difference(&raced_ids)
        .cloned()
        .collect();
    server.cli(&["job", "stop", "-detach", JOB])?;
    wait_for(
        "the cut-off allocs stopped by the server",
        Duration::from_secs(30),
        || {
            let allocs = server.allocs(JOB)?;
            Ok(allocs
                .iter()
                .all(|a| a["desired_status"] == "stop")
                .then_some(()))
        },
    )?;
    let pending = server
        .allocs(JOB)?
        .iter()
        .filter(|a| a["client_status"] == "pending")
        .count();
    assert_eq!(
        pending, CUT_OFF_COUNT,
        "the cut-off allocs wait for the client"
    );
    client.relay()?.heal();
    let never_started = wait_checked(&server, &client, "every alloc terminal after the heal")?;
    eprintln!("{never_started} allocs were stopped before their tasks started in all");
    assert!(
        never_started >= raced + CUT_OFF_COUNT,
        "the {CUT_OFF_COUNT} cut-off allocs never started: {never_started} never-started allocs, {raced} of them from the race"
    );

    // A restarted client keeps them so: it restores them, never started,
    // and the servers' view stays as it was.
    client.agent.stop()?;
    client.agent.start_again()?;
    let restored = wait_for(
        "the restarted client's view of the cut-off allocs",
        Duration::from_secs(60),
        || {
            client.agent.check_running()?;
            let Ok(views) = client.get("/v1/client/allocations") else {
                return Ok(None);
            };
            let views: Vec<Value> = views
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["id"].as_str().is_some_and(|id| cut_off.contains(id)))
                .cloned()
                .collect();
            Ok((views.len() == CUT_OFF_COUNT).then_some(views))
        },
    )
    .with_context(|| client.agent.log())?;
    assert_eq!(
        check_allocs(&restored)?,
        CUT_OFF_COUNT,
        "the client's own view"
    );
    server.wait_nodes_ready(&["c1"])?;
    let after = wait_checked(&server, &client, "the allocs after a restart")?;
    assert_eq!(after, never_started);
    Ok(())
}
