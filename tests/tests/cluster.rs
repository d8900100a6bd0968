//! A cluster of separate processes: one `berth agent -server` and two
//! `berth agent -client`, each on its own data dir and ports.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::{
    cli_json_at, cli_ok_at, example, free_port, quick_batch_job, run_job_at, wait_for, Agent,
};

#[test]
fn a_server_and_two_clients_in_separate_processes_run_system_and_batch_jobs() -> Result<()> {
    let http = format!("127.0.0.1:{}", free_port());
    let addr = format!("http://{http}");
    let (mut server, rpc) = Agent::start_server(&http)?;
    // c1 takes a class and meta from a config file.
    let c1_config = tempfile::tempdir()?;
    let c1_file = c1_config.path().join("client.hcl");
    std::fs::write(
        &c1_file,
        "client {\n  node_class = \"storage\"\n  meta {\n    rack = \"r1\"\n  }\n}\n",
    )?;
    let c1_file = c1_file.to_str().context("a UTF-8 temp path")?;
    // Each client serves its own HTTP API, on a port of its own.
    let c1_http = format!("127.0.0.1:{}", free_port());
    let c2_http = format!("127.0.0.1:{}", free_port());
    let mut c1 = Agent::start_client(&["-config", c1_file], &rpc, "c1", &c1_http)?;
    let mut c2 = Agent::start_client(&[], &rpc, "c2", &c2_http)?;
    let logs = |s: &Agent, a: &Agent, b: &Agent| {
        format!(
            "server log:\n{}\nc1 log:\n{}\nc2 log:\n{}",
            s.log(),
            a.log(),
            b.log()
        )
    };

    // Both nodes register with the server and become ready.
    let nodes = wait_for("both nodes ready", Duration::from_secs(30), || {
        server.check_running()?;
        c1.check_running()?;
        c2.check_running()?;
        let nodes = cli_json_at(&addr, &["node", "status", "-json"])?;
        let ready: BTreeSet<(String, String)> = nodes
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["status"] == "ready")
            .map(|n| {
                (
                    n["name"].as_str().unwrap_or_default().to_string(),
                    n["id"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        Ok((ready.len() == 2).then_some(ready))
    })
    .with_context(|| logs(&server, &c1, &c2))?;
    let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["c1", "c2"]);
    // Each node shows the class and meta its config gave it.
    let shown = cli_json_at(&addr, &["node", "status", "-json"])?;
    let class_and_meta = |name: &str| {
        shown
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["name"] == name)
            .map(|n| (n["node_class"].clone(), n["meta"].clone()))
    };
    assert_eq!(
        class_and_meta("c1"),
        Some((
            serde_json::json!("storage"),
            serde_json::json!({"rack": "r1"})
        ))
    );
    assert_eq!(
        class_and_meta("c2"),
        Some((serde_json::json!(""), serde_json::json!({})))
    );
    let node_ids: BTreeSet<String> = nodes.into_iter().map(|(_, id)| id).collect();

    // The plugin system job runs on both clients.
    let plugin_job = example("jobs/hostpath-plugin.hcl");
    cli_ok_at(&addr, &["job", "run", "-detach", &plugin_job])?;
    wait_for(
        "the plugin healthy on both nodes",
        Duration::from_secs(60),
        || {
            let p = cli_json_at(&addr, &["plugin", "status", "-json", "hostpath"])?;
            Ok((p["nodes_healthy"] == 2).then_some(()))
        },
    )
    .with_context(|| logs(&server, &c1, &c2))?;

    // A batch job of two allocs: placed, run by the clients, complete.
    run_job_at(
        &addr,
        server.data_dir.path(),
        "pair",
        &quick_batch_job("pair", 2),
    )?;
    let allocs = wait_for(
        "both batch allocs complete",
        Duration::from_secs(60),
        || {
            let status = cli_json_at(&addr, &["job", "status", "-json", "pair"])?;
            let allocs = status["allocations"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let done = allocs.len() == 2 && allocs.iter().all(|a| a["client_status"] == "complete");
            Ok(done.then_some(allocs))
        },
    )
    .with_context(|| logs(&server, &c1, &c2))?;
    let placed_on: BTreeSet<String> = allocs
        .iter()
        .map(|a| a["node_id"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(
        placed_on.is_subset(&node_ids),
        "allocs on unknown nodes: {placed_on:?} vs {node_ids:?}"
    );
    // The scheduler spreads a group's allocs across the nodes that fit.
    assert_eq!(placed_on, node_ids, "one batch alloc on each node");
    Ok(())
}
