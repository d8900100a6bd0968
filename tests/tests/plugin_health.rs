//! A plugin task killed with SIGKILL on a dev agent: its death is recorded
//! as `Plugin became unhealthy` (a task event of the plugin task and a CSI
//! node event) before the task restarts and becomes healthy again, and
//! `plugin status` keeps naming the provider all along.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{binary, example_with, only_alloc, task_events, wait_for, DevAgent};
use serde_json::Value;

const PROVIDER: &str = "hostpath.csi.berth.dev";

/// The example plugin job, restarting its task 3 s after it dies; a task
/// started while `hold` exists waits for it to go before the plugin runs,
/// so the plugin stays down until the test has seen it unhealthy.
fn plugin_job(agent: &DevAgent, hold: &Path) -> Result<String> {
    let restart = example_with(
        "jobs/hostpath-plugin.hcl",
        "group \"plugin\" {",
        "group \"plugin\" {\n    restart {\n      attempts = 3\n      interval = \"10m\"\n      delay    = \"3s\"\n      mode     = \"fail\"\n    }\n",
    )?;
    let command = "command = \"hostpath-plugin\"\n        args = [";
    if !restart.contains(command) {
        bail!("the example plugin job has no {command:?}");
    }
    let held = restart.replacen(
        command,
        &format!(
            "command = \"/bin/sh\"\n        args = [\"-c\", \"while [ -e {} ]; do sleep 0.05; done; exec \\\"$0\\\" \\\"$@\\\"\", \"{}\",",
            hold.display(),
            binary("hostpath-plugin").display()
        ),
        1,
    );
    agent.write_file("hostpath-plugin.hcl", &held)
}

/// `plugin status` of the hostpath plugin; an error if it fails or no
/// longer names the provider.
fn plugin_status(agent: &DevAgent) -> Result<Value> {
    let out = agent.cli(&["plugin", "status", "-json", "hostpath"])?;
    if !out.status.success() {
        bail!(
            "plugin status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let p: Value = serde_json::from_slice(&out.stdout)?;
    if p["provider"] != PROVIDER {
        bail!("plugin status lost the provider: {p}");
    }
    Ok(p)
}

/// The plugin task's events, `(type, message)`.
fn plugin_task_events(agent: &DevAgent) -> Result<Vec<(String, String)>> {
    let alloc = only_alloc(agent, "hostpath-plugin")?;
    Ok(task_events(&alloc, "plugin")
        .into_iter()
        .map(|(kind, message, _)| (kind, message))
        .collect())
}

/// Whether `seq` holds `want` in order (not necessarily adjacent).
fn in_order(seq: &[String], want: &[&str]) -> bool {
    let mut it = seq.iter();
    want.iter().all(|w| it.any(|s| s == w))
}

#[test]
fn a_killed_plugin_is_unhealthy_then_healthy_again_and_keeps_its_provider() -> Result<()> {
    let agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().to_path_buf();
    let hold = data_dir.join("hold-plugin");
    agent.cli_ok(&["job", "run", "-detach", &plugin_job(&agent, &hold)?])?;
    agent.wait_plugin_healthy("hostpath")?;

    let needle = format!("--endpoint=unix://{}", data_dir.display());
    let pids = agent.processes_with_cmdline(&needle);
    let [pid] = pids.as_slice() else {
        bail!("want one plugin process, found {pids:?}");
    };
    std::fs::write(&hold, "")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(*pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;

    // Until it is healthy again, every look at the plugin names its
    // provider. Held down, it is seen unhealthy (within its 30 s health
    // timeout, after which the waiting task would be restarted); then it
    // may start.
    wait_for(
        "the plugin to be unhealthy",
        Duration::from_secs(20),
        || {
            let p = plugin_status(&agent)?;
            Ok((p["nodes_healthy"] != 1 || p["controllers_healthy"] != 1).then_some(()))
        },
    )
    .with_context(|| agent.log())?;
    std::fs::remove_file(&hold)?;
    wait_for(
        "the plugin to be healthy again",
        Duration::from_secs(60),
        || {
            let p = plugin_status(&agent)?;
            if p["nodes_healthy"] != 1 || p["controllers_healthy"] != 1 {
                return Ok(None);
            }
            let restarted = !agent.processes_with_cmdline(&needle).contains(pid);
            let events = plugin_task_events(&agent)?;
            let kinds: Vec<String> = events.iter().map(|(t, _)| t.clone()).collect();
            let back = in_order(
                &kinds,
                &[
                    "Plugin became healthy",
                    "Plugin became unhealthy",
                    "Plugin became healthy",
                ],
            );
            Ok((restarted && back).then_some(()))
        },
    )
    .with_context(|| agent.log())?;

    let events = plugin_task_events(&agent)?;
    let unhealthy = events
        .iter()
        .find(|(t, _)| t == "Plugin became unhealthy")
        .expect("an unhealthy event");
    assert_eq!(unhealthy.1, "the plugin task exited", "{events:?}");
    let kinds: Vec<String> = events.iter().map(|(t, _)| t.clone()).collect();
    assert!(
        in_order(
            &kinds,
            &[
                "Plugin became healthy",
                "Plugin became unhealthy",
                "Restarting",
                "Started",
                "Plugin became healthy"
            ]
        ),
        "{events:?}"
    );

    // Healthy, unhealthy, healthy again: the second healthy folds into the
    // first, which moves after the unhealthy one.
    let node_events = wait_for(
        "the node's CSI events to show the restart",
        Duration::from_secs(30),
        || {
            let ev = agent.csi_node_events()?;
            let want = [
                ("Plugin became unhealthy".to_string(), 1),
                ("Plugin became healthy".to_string(), 2),
            ];
            Ok((ev == want).then_some(ev))
        },
    )
    .with_context(|| format!("node events: {:?}", agent.csi_node_events()))?;
    assert_eq!(node_events.len(), 2);
    Ok(())
}
