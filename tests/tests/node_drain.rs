//! `berth node drain` and `berth node eligibility` on a dev agent with the
//! real binary, the example hostpath plugin and real mounts: the drain
//! stops the volume user, which unmounts and releases its volume while the
//! plugin still runs, then stops the plugin; the command follows it to the
//! end, and nothing is left mounted.

use std::time::Duration;

use anyhow::Result;
use berth_tests::{
    example_with, mounts_under, node_events, only_alloc, strs, wait_alloc_running, wait_for,
    DevAgent,
};
use serde_json::Value;

#[test]
fn draining_the_node_unmounts_the_volume_before_the_plugin_stops_and_follows_to_the_end(
) -> Result<()> {
    let agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().to_path_buf();
    agent.run_plugin_and_create_volume()?;

    // A writer that keeps its volume mounted.
    let writer = example_with(
        "jobs/writer.hcl",
        "echo 'hello from berth' > ${BERTH_TASK_DIR}/data/hello",
        "echo 'hello from berth' > ${BERTH_TASK_DIR}/data/hello; exec sleep 1000",
    )?;
    let writer_file = agent.write_file("writer.hcl", &writer)?;
    agent.cli_ok(&["job", "run", "-detach", &writer_file])?;
    let writer_id = wait_alloc_running(&agent, "writer")?["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let plugin = only_alloc(&agent, "hostpath-plugin")?;
    let node_id = plugin["node_id"].as_str().unwrap_or_default().to_string();
    assert!(
        !mounts_under(&data_dir).is_empty(),
        "the writer's volume is mounted"
    );

    // Without -detach the command returns when the drain is complete.
    let out = agent.cli_ok(&["node", "drain", "-enable", "-deadline", "5m", &node_id])?;
    assert!(out.contains("is draining (deadline 5m)"), "{out}");
    assert!(
        out.contains(&format!(
            "Alloc {} (writer.writer[0]): stopping (node is draining)",
            &writer_id[..8]
        )),
        "{out}"
    );
    assert!(out.trim_end().ends_with("drain complete"), "{out}");

    // The writer unmounted and released its volume; the plugin stopped
    // after that, and no unmount failed.
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert!(strs(&vol["write_allocs"]).is_empty(), "{vol}");
    let node = agent.cli_json(&["node", "status", &node_id])?;
    let storage = node_events(&node, "Storage");
    assert!(
        storage.iter().any(|e| e["message"] == "Unmount volume"
            && e["details"]["alloc_id"] == writer_id.as_str()
            && e["details"]["success"] == "true"),
        "{storage:?}"
    );
    assert!(
        !storage.iter().any(|e| e["details"]["success"] == "false"),
        "no mount or unmount failed: {storage:?}"
    );
    let plugin = only_alloc(&agent, "hostpath-plugin")?;
    assert_eq!(plugin["desired_status"], "stop");
    assert_eq!(plugin["desired_description"], "node is draining");
    let left = mounts_under(&data_dir);
    assert!(left.is_empty(), "mounts left after the drain: {left:?}");

    // The node stays ineligible, its drain done, until an operator says so.
    assert_eq!(node["drain"], false);
    assert_eq!(node["drain_strategy"], Value::Null);
    assert_eq!(node["scheduling_eligibility"], "ineligible");
    let table = agent.cli_ok(&["node", "status"])?;
    let row = table.lines().nth(1).unwrap_or_default().to_string();
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[0], &node_id[..8], "{table}");
    assert!(
        cols.contains(&"ineligible") && cols.contains(&"false"),
        "{table}"
    );

    agent.cli_ok(&["job", "stop", "writer"])?;
    let out = agent.cli_ok(&["node", "eligibility", "-enable", &node_id])?;
    assert!(out.contains("is eligible for scheduling"), "{out}");
    // The plugin's system job comes back to the node.
    wait_for("the plugin to run again", Duration::from_secs(60), || {
        let status = agent.cli_json(&["job", "status", "hostpath-plugin"])?;
        let running = status["allocations"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a["client_status"] == "running" && a["desired_status"] == "run");
        Ok(running.then_some(()))
    })?;
    Ok(())
}
