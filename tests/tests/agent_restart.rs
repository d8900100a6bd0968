//! Restarting the agent never runs a task twice: a dev agent runs the
//! hostpath plugin and a service that keeps writing to a CSI volume; after
//! SIGTERM and a new agent on the same data dir, the very same processes
//! run (one of each), the plugin is healthy and registered again, the claim
//! is still the service's, its mount is still in place and it still
//! writes. A bind mount that vanished while the agent was down is made
//! again. Stopping the service afterwards frees the claim and the mounts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::{
    csi_volume_service_job, mounts_under, only_alloc, processes_with_cmdline, recorded_task_pid,
    strs, task_events, wait_alloc_running as wait_running, wait_for, DevAgent,
};
use serde_json::Value;

/// Marks the holder's shell in its command line (`$0`).
const HOLDER_MARK: &str = "berth-restart-holder";

/// A service that holds the `data` volume and keeps writing ticks to it.
fn holder_job() -> String {
    csi_volume_service_job(
        "holder",
        "hold",
        &[
            "-c",
            "while true; do date +%s%N >> ${BERTH_TASK_DIR}/data/ticks; sleep 0.2; done",
            HOLDER_MARK,
        ],
    )
}

fn count_events(alloc: &Value, task: &str, event_type: &str) -> usize {
    task_events(alloc, task)
        .iter()
        .filter(|(t, _, _)| t == event_type)
        .count()
}

/// How often the node's CSI events say a plugin became healthy (an event
/// seen again counts up its `count`).
fn node_plugin_healthy_events(agent: &DevAgent) -> Result<u64> {
    Ok(agent
        .csi_node_events()?
        .into_iter()
        .filter(|(message, _)| message == "Plugin became healthy")
        .map(|(_, count)| count)
        .sum())
}

/// How often the agent's log says a reattached plugin was found healthy
/// and registered again.
fn supervised_again(agent: &DevAgent) -> usize {
    agent
        .log()
        .matches("plugin is still healthy; registered it again")
        .count()
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .count()
}

#[test]
fn an_agent_restart_reattaches_to_running_tasks_and_keeps_their_volume() -> Result<()> {
    let mut agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().canonicalize()?;

    // The plugin, the volume, and a service that holds it and writes.
    agent.run_plugin_and_create_volume()?;
    let holder_file = data_dir.join("holder.hcl");
    std::fs::write(&holder_file, holder_job())?;
    agent.cli_ok(&["job", "run", "-detach", &holder_file.display().to_string()])?;
    let plugin = wait_running(&agent, "hostpath-plugin")?;
    let holder = wait_running(&agent, "holder")?;
    let plugin_id = plugin["id"].as_str().unwrap_or_default().to_string();
    let holder_id = holder["id"].as_str().unwrap_or_default().to_string();
    let holder_dir = data_dir.join("alloc").join(&holder_id);
    let ticks: PathBuf = holder_dir.join("hold/data/ticks");
    wait_for("the holder to write", Duration::from_secs(30), || {
        Ok((lines(&ticks) >= 2).then_some(()))
    })?;

    let plugin_needle = format!("--state-dir={}", data_dir.display());
    let plugin_pids = processes_with_cmdline(&plugin_needle);
    let holder_pids = processes_with_cmdline(HOLDER_MARK);
    assert_eq!(plugin_pids.len(), 1, "one plugin process: {plugin_pids:?}");
    assert_eq!(holder_pids.len(), 1, "one holder process: {holder_pids:?}");
    assert_eq!(
        recorded_task_pid(&data_dir, &plugin_id, "plugin")?,
        plugin_pids[0]
    );
    assert_eq!(
        recorded_task_pid(&data_dir, &holder_id, "hold")?,
        holder_pids[0]
    );
    let mounts_before = mounts_under(&holder_dir);
    assert!(
        !mounts_before.is_empty(),
        "the volume is bound into the holder's task dir"
    );
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert_eq!(strs(&vol["write_allocs"]), vec![holder_id.clone()], "{vol}");
    let healthy_before = count_events(&plugin, "plugin", "Plugin became healthy");
    let node_healthy_before = node_plugin_healthy_events(&agent)?;
    assert!(node_healthy_before >= 1, "the new plugin's health event");
    let supervised_before = supervised_again(&agent);

    // Restart the agent.
    agent.restart()?;

    // The plugin is supervised again: probed, healthy, registered; it was
    // healthy all along, so no health event.
    wait_for(
        "the restored plugin to be supervised again",
        Duration::from_secs(60),
        || Ok((supervised_again(&agent) > supervised_before).then_some(())),
    )
    .with_context(|| agent.log())?;
    // Plugin fingerprints found before the node has registered (at the
    // first start, and restored at this one) wait for it without a
    // warning: a WARN is for what an operator should look at.
    let early: Vec<String> = agent
        .log()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("is not registered"))
        .map(str::to_string)
        .collect();
    assert!(early.is_empty(), "warnings of a start: {early:#?}");
    let plugin = only_alloc(&agent, "hostpath-plugin")?;
    assert_eq!(plugin["client_status"], "running", "{plugin}");
    assert_eq!(
        count_events(&plugin, "plugin", "Plugin became healthy"),
        healthy_before,
        "a reattached healthy plugin records no health change: {plugin}"
    );
    // Nor does the node: its CSI events say nothing new of the plugin,
    // watched for 3 s past the plugin's first fingerprint after the start
    // (where a new health event would come from).
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(3) {
        assert_eq!(
            node_plugin_healthy_events(&agent)?,
            node_healthy_before,
            "the node recorded the reattached healthy plugin as newly healthy\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.wait_plugin_healthy("hostpath")?;
    let holder = wait_running(&agent, "holder")?;
    assert_eq!(holder["id"], holder_id.as_str());
    assert_eq!(holder["task_states"]["hold"]["state"], "running");
    assert_eq!(holder["task_states"]["hold"]["restarts"], 0, "{holder}");

    // The same processes, one of each.
    assert_eq!(
        processes_with_cmdline(&plugin_needle),
        plugin_pids,
        "the plugin was not started again; log:\n{}",
        agent.log()
    );
    assert_eq!(
        processes_with_cmdline(HOLDER_MARK),
        holder_pids,
        "the holder was not started again; log:\n{}",
        agent.log()
    );
    // The claim is still the holder's, the mount still there, and the
    // holder still writes through it.
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert_eq!(strs(&vol["write_allocs"]), vec![holder_id.clone()], "{vol}");
    assert_eq!(mounts_under(&holder_dir), mounts_before);
    let written = lines(&ticks);
    wait_for(
        "the holder to keep writing after the restart",
        Duration::from_secs(10),
        || Ok((lines(&ticks) >= written + 3).then_some(())),
    )?;

    // A bind mount that vanished while the agent was down is made again;
    // the holder writes through it to the volume once more.
    agent.stop_agent()?;
    let bind = holder_dir.join("hold/data");
    assert!(mounts_before.contains(&bind), "{mounts_before:?}");
    nix::mount::umount2(&bind, nix::mount::MntFlags::MNT_DETACH)?;
    assert!(!mounts_under(&holder_dir).contains(&bind));
    let supervised_before = supervised_again(&agent);
    agent.start_again()?;
    wait_for(
        "the plugin to be supervised again after the second restart",
        Duration::from_secs(60),
        || Ok((supervised_again(&agent) > supervised_before).then_some(())),
    )
    .with_context(|| agent.log())?;
    wait_for(
        "the bind mount to be made again",
        Duration::from_secs(30),
        || Ok((mounts_under(&holder_dir) == mounts_before).then_some(())),
    )
    .with_context(|| agent.log())?;
    let written = lines(&ticks);
    wait_for(
        "the holder to write to the volume again",
        Duration::from_secs(10),
        || Ok((lines(&ticks) >= written + 3).then_some(())),
    )?;
    assert_eq!(processes_with_cmdline(&plugin_needle), plugin_pids);
    assert_eq!(processes_with_cmdline(HOLDER_MARK), holder_pids);
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert_eq!(strs(&vol["write_allocs"]), vec![holder_id.clone()], "{vol}");

    // Stopping the holder frees the claim and unmounts everything of it.
    agent.cli_ok(&["job", "stop", "holder"])?;
    wait_for(
        "the holder's claim to be freed",
        Duration::from_secs(30),
        || {
            let v = agent.cli_json(&["volume", "status", "data"])?;
            Ok(
                (strs(&v["read_allocs"]).is_empty() && strs(&v["write_allocs"]).is_empty())
                    .then_some(()),
            )
        },
    )
    .with_context(|| agent.log())?;
    wait_for("the holder's mounts to go", Duration::from_secs(30), || {
        Ok(mounts_under(&holder_dir).is_empty().then_some(()))
    })?;
    wait_for("the holder process to go", Duration::from_secs(30), || {
        Ok(processes_with_cmdline(HOLDER_MARK).is_empty().then_some(()))
    })?;

    agent.cli_ok(&["job", "stop", "hostpath-plugin"])?;
    wait_for("the plugin process to go", Duration::from_secs(30), || {
        Ok(processes_with_cmdline(&plugin_needle)
            .is_empty()
            .then_some(()))
    })?;
    agent.stop_agent()?;
    let left = mounts_under(&data_dir);
    assert!(left.is_empty(), "mounts left: {left:?}");
    Ok(())
}
