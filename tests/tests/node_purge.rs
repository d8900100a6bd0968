//! `berth node purge` on a dev agent with the real binary: the node is
//! forgotten and its alloc lost; the client, still alive, finds itself
//! unknown at its next heartbeat, registers again, stops the lost alloc
//! through the normal path and runs its replacement.

use std::time::Duration;

use anyhow::{ensure, Result};
use berth_tests::{sleeping_service_job, wait_for, DevAgent};
use serde_json::Value;

#[test]
fn purging_a_live_node_loses_its_alloc_and_the_client_registers_again_and_replaces_it() -> Result<()>
{
    // A short TTL: the client heartbeats about every second.
    let agent = DevAgent::start_with_args(&["-heartbeat-ttl", "2s"])?;
    let job = sleeping_service_job("purged", 1, 0).replace(r#"["300"]"#, r#"["3071"]"#);
    let file = agent.write_file("purged.hcl", &job)?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let first = wait_for("the alloc to run", Duration::from_secs(60), || {
        let allocs = agent.api_get("/v1/job/purged/allocations")?;
        Ok(allocs
            .as_array()
            .and_then(|a| a.iter().find(|a| a["client_status"] == "running"))
            .map(|a| a["id"].as_str().unwrap_or_default().to_string()))
    })?;
    let first_pids = wait_for("its task process", Duration::from_secs(30), || {
        let pids = agent.processes_with_cmdline("sleep 3071");
        Ok((!pids.is_empty()).then_some(pids))
    })?;
    let nodes = agent.api_get("/v1/nodes")?;
    let node = &nodes[0];
    let (node_id, name) = (
        node["id"].as_str().unwrap_or_default().to_string(),
        node["name"].as_str().unwrap_or_default().to_string(),
    );

    let out = agent.cli_ok(&["node", "purge", &name])?;
    ensure!(
        out.contains(&format!("Purged node {name:?} ({node_id}): 1 alloc lost")),
        "purge output: {out}"
    );
    let a = agent.api_get(&format!("/v1/allocation/{first}"))?;
    ensure!(
        a["client_status"] == "lost" && a["desired_status"] == "stop",
        "the purged node's alloc is lost and desired stop: {a}"
    );

    // The client registers again under its own ID, stops the lost alloc's
    // task and runs the replacement.
    wait_for("the node ready again", Duration::from_secs(30), || {
        let nodes = agent.api_get("/v1/nodes")?;
        Ok(nodes
            .as_array()
            .is_some_and(|n| {
                n.iter()
                    .any(|n| n["id"] == node_id.as_str() && n["status"] == "ready")
            })
            .then_some(()))
    })
    .map_err(|e| e.context(agent.log()))?;
    let next = wait_for(
        "the lost task stopped and a replacement running",
        Duration::from_secs(60),
        || {
            let allocs = agent.api_get("/v1/job/purged/allocations")?;
            let running: Vec<&Value> = allocs
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["client_status"] == "running")
                .collect();
            let pids = agent.processes_with_cmdline("sleep 3071");
            let old_gone = first_pids.iter().all(|p| !pids.contains(p));
            Ok(match running.as_slice() {
                [one] if one["id"] != first.as_str() && old_gone && pids.len() == 1 => {
                    Some(one["id"].as_str().unwrap_or_default().to_string())
                }
                _ => None,
            })
        },
    )
    .map_err(|e| e.context(agent.log()))?;
    ensure!(next != first);
    let old = agent.api_get(&format!("/v1/allocation/{first}"))?;
    ensure!(
        old["desired_status"] == "stop"
            && ["lost", "complete"].contains(&old["client_status"].as_str().unwrap_or_default()),
        "the purged alloc stays stopped: {old}"
    );
    Ok(())
}
