//! `berth alloc stop` of an alloc that is already done: the servers write
//! nothing and place no replacement, so the CLI says so and returns at once
//! instead of waiting for a replacement that cannot come.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::{quick_batch_job, wait_for, DevAgent};
use serde_json::Value;

/// The allocs of job `once`, as the servers have them.
fn allocs(agent: &DevAgent) -> Result<Vec<Value>> {
    Ok(agent
        .api_get("/v1/job/once/allocations")?
        .as_array()
        .cloned()
        .unwrap_or_default())
}

#[test]
fn alloc_stop_of_a_finished_alloc_says_already_stopped_at_once() -> Result<()> {
    let agent = DevAgent::start()?;
    let file = agent.write_file("once.hcl", &quick_batch_job("once", 1))?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let done = wait_for("the batch alloc complete", Duration::from_secs(60), || {
        Ok(allocs(&agent)?
            .into_iter()
            .find(|a| a["client_status"] == "complete"))
    })
    .with_context(|| agent.log())?;
    let id = done["id"].as_str().unwrap_or_default().to_string();

    let started = Instant::now();
    let out = agent.cli(&["alloc", "stop", &id[..8]])?;
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), format!("Alloc {id} is already stopped"));
    assert!(
        took < Duration::from_secs(10),
        "the CLI waited {took:?} for a replacement that cannot come"
    );

    let answer: Value = serde_json::from_str(&agent.cli_ok(&["alloc", "stop", "-json", &id])?)?;
    assert_eq!(answer["already_stopped"], true, "{answer}");
    assert!(answer["replacement"].is_null(), "{answer}");
    // Nothing was stopped: the finished alloc keeps its desired status.
    let after = agent.api_get(&format!("/v1/allocation/{id}"))?;
    assert_eq!(after["desired_status"], "run", "{after}");
    assert_eq!(allocs(&agent)?.len(), 1, "no work run again");
    Ok(())
}
