//! `berth job run` against a dev agent: what it waits for and how it ends.

use std::time::{Duration, Instant};

use anyhow::Result;
use berth_tests::{quick_batch_job, DevAgent};

#[test]
fn job_run_waits_for_a_batch_job_and_returns_at_once_when_it_is_unchanged() -> Result<()> {
    let agent = DevAgent::start()?;
    let file = agent.write_file("once.hcl", &quick_batch_job("once", 1))?;
    let out = agent.cli_ok(&["job", "run", &file])?;
    assert!(out.contains("done"), "{out}");
    let status = agent.cli_json(&["job", "status", "once"])?;
    assert_eq!(status["allocations"][0]["client_status"], "complete");

    let started = Instant::now();
    let out = agent.cli_ok(&["job", "run", &file])?;
    assert!(out.contains("unchanged"), "{out}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "an unchanged job returns without waiting: {:?}",
        started.elapsed()
    );
    Ok(())
}

#[test]
fn job_run_reports_placement_failures_and_exits_2() -> Result<()> {
    let agent = DevAgent::start()?;
    let file = agent.write_file(
        "big.hcl",
        &quick_batch_job("big", 1).replace("memory = 8", "memory = 60000000"),
    )?;
    let out = agent.cli(&["job", "run", &file])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("Placement failures"), "{stdout}");
    assert!(
        stdout.contains("memory"),
        "the failure names the resource: {stdout}"
    );
    Ok(())
}
