//! A plugin whose NodeStageVolume mounts nothing at the staging path (the
//! CSI spec allows it; `hostpath-plugin --stage-noop`) is staged once per
//! usage on a node, as the kubelet and Nomad do: a writer then five readers
//! of one volume cause exactly two NodeStageVolume calls (the writer's
//! usage and the readers'), also across an agent SIGKILL with the readers
//! running and a sixth reader after it, and the readers' usage is unstaged
//! once, after the last reader.

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use berth_tests::{
    csi_volume_service_job, example, example_with, plugin_stderr, strs, wait_alloc_running,
    wait_for, DevAgent,
};

/// The example plugin job with `--stage-noop`.
fn plugin_job(agent: &DevAgent) -> Result<String> {
    let patched = example_with(
        "jobs/hostpath-plugin.hcl",
        "\"--state-dir=${BERTH_NODE_DATA_DIR}\",",
        "\"--state-dir=${BERTH_NODE_DATA_DIR}\",\n          \"--stage-noop\",",
    )?;
    agent.write_file("hostpath-plugin.hcl", &patched)
}

/// Reader `job` of volume "data", read-only (a single-node volume's
/// group of more than one alloc needs per_alloc, so each reader is a job
/// of its own), printing the writer's note and staying.
fn reader_job(job: &str) -> String {
    format!(
        r#"
job "{job}" {{
  type        = "service"
  datacenters = ["dc1"]

  group "read" {{

    volume "data" {{
      type            = "csi"
      source          = "data"
      read_only       = true
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}

    task "read" {{
      driver = "raw_exec"

      config {{
        command = "/bin/sh"
        args    = ["-c", "cat $BERTH_TASK_DIR/data/note && sleep 3600"]
      }}

      volume_mount {{
        volume      = "data"
        destination = "data"
        read_only   = true
      }}

      resources {{
        cpu    = 10
        memory = 16
      }}
    }}
  }}
}}
"#
    )
}

/// How many calls of `rpc` the plugin has logged.
fn calls(data_dir: &Path, plugin_alloc: &str, rpc: &str) -> usize {
    plugin_stderr(data_dir, plugin_alloc)
        .lines()
        .filter(|l| l.contains(&format!("rpc={rpc} ")))
        .count()
}

const READERS: [&str; 5] = ["reader-1", "reader-2", "reader-3", "reader-4", "reader-5"];

/// Waits until `n` allocs of `job` run.
fn wait_running(agent: &DevAgent, job: &str, n: usize) -> Result<()> {
    wait_for(
        &format!("{n} {job} allocs running"),
        Duration::from_secs(90),
        || {
            let running = agent
                .job_allocs(job)?
                .iter()
                .filter(|a| a["client_status"] == "running")
                .count();
            Ok((running == n).then_some(()))
        },
    )
    .with_context(|| agent.log())
}

#[test]
fn a_stage_that_mounts_nothing_is_made_once_per_usage_also_across_a_crash() -> Result<()> {
    let mut agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().canonicalize()?;
    agent.cli_ok(&["job", "run", "-detach", &plugin_job(&agent)?])?;
    agent.wait_plugin_healthy("hostpath")?;
    let plugin = wait_alloc_running(&agent, "hostpath-plugin")?;
    let plugin = plugin["id"]
        .as_str()
        .context("plugin alloc id")?
        .to_string();
    agent.cli_ok(&["volume", "create", &example("volumes/hostpath.hcl")])?;

    let writer = csi_volume_service_job(
        "writer",
        "write",
        &["-c", "echo hello > $BERTH_TASK_DIR/data/note && sleep 3600"],
    );
    agent.run_job("writer", &writer)?;
    wait_running(&agent, "writer", 1)?;
    for reader in READERS {
        agent.run_job(reader, &reader_job(reader))?;
    }
    for reader in READERS {
        wait_running(&agent, reader, 1)?;
    }
    let stages = calls(&data_dir, &plugin, "NodeStageVolume");
    ensure!(
        stages == 2,
        "a writer and five readers: {stages} NodeStageVolume calls, want 2\n{}",
        plugin_stderr(&data_dir, &plugin)
    );
    ensure!(
        plugin_stderr(&data_dir, &plugin).contains("nothing mounted: --stage-noop"),
        "the plugin staged without a mount"
    );

    // The agent dies with everything running and comes back: its allocs
    // are restored, and nothing is staged again. A sixth reader, which
    // starts only once the restore is done, uses the staged usage too.
    agent.kill_agent()?;
    agent.start_again()?;
    agent.run_job("reader-6", &reader_job("reader-6"))?;
    wait_running(&agent, "reader-6", 1)?;
    let stages = calls(&data_dir, &plugin, "NodeStageVolume");
    ensure!(
        stages == 2,
        "after the restart: {stages} NodeStageVolume calls, want still 2\n{}",
        plugin_stderr(&data_dir, &plugin)
    );

    // The readers stop: their usage is unstaged once, after the last one;
    // the writer's stays staged.
    for reader in READERS.iter().chain(&["reader-6"]) {
        agent.cli_ok(&["job", "stop", "-detach", reader])?;
    }
    wait_for(
        "the readers' usage unstaged",
        Duration::from_secs(60),
        || {
            let unstages = calls(&data_dir, &plugin, "NodeUnstageVolume");
            Ok((unstages >= 1).then_some(unstages))
        },
    )
    .with_context(|| agent.log())?;
    wait_for("the readers' claims freed", Duration::from_secs(60), || {
        let v = agent.cli_json(&["volume", "status", "data"])?;
        Ok(
            (strs(&v["read_allocs"]).is_empty() && strs(&v["write_allocs"]).len() == 1)
                .then_some(()),
        )
    })
    .with_context(|| agent.log())?;
    let unstages = calls(&data_dir, &plugin, "NodeUnstageVolume");
    ensure!(
        unstages == 1,
        "{unstages} NodeUnstageVolume calls after the readers stopped, want 1\n{}",
        plugin_stderr(&data_dir, &plugin)
    );
    Ok(())
}
