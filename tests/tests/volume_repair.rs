//! A node plugin that dies takes its mounts with it: its task is killed
//! with SIGKILL and the volume's staging and publish mounts are taken away
//! behind the agent's back. Once the plugin is healthy again, the next
//! fingerprint round stages and publishes the volume again and binds it
//! into the running task's directory: the task (same pid) goes on writing
//! to it, and the node and the task record the repair.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_tests::{
    csi_volume_service_job, example, example_with, node_events, only_alloc, recorded_task_pid,
    task_events, wait_alloc_running, wait_for, DevAgent,
};
use berth_testutil::{mount_count_at, mounts_under};
use serde_json::Value;

/// How often the agent fingerprints plugins (and repairs mounts) here.
const FINGERPRINT_INTERVAL: Duration = Duration::from_secs(2);
/// The plugin task's restart delay.
const PLUGIN_RESTART_DELAY: Duration = Duration::from_secs(1);

/// Appends a counter to `data/counter` every 200 ms, checks it reads it
/// back, and says so on stdout.
const WRITER: &str = r#"i=0
while true; do
  i=$((i+1))
  if echo "$i" >> "$BERTH_TASK_DIR/data/counter" && [ "$(tail -n 1 "$BERTH_TASK_DIR/data/counter")" = "$i" ]; then
    echo "wrote $i"
  else
    echo "failed $i"
  fi
  sleep 0.2
done"#;

/// The example plugin job, restarting its task 1 s after it dies.
fn plugin_job(agent: &DevAgent) -> Result<String> {
    let patched = example_with(
        "jobs/hostpath-plugin.hcl",
        "group \"plugin\" {",
        &format!("group \"plugin\" {{\n    restart {{\n      attempts = 3\n      interval = \"10m\"\n      delay    = \"{}s\"\n      mode     = \"fail\"\n    }}\n", PLUGIN_RESTART_DELAY.as_secs()),
    )?;
    agent.write_file("hostpath-plugin.hcl", &patched)
}

/// The one mount below `dir` whose path holds `part`.
fn mount_with(dir: &Path, part: &str) -> Result<PathBuf> {
    let found: Vec<PathBuf> = mounts_under(dir)
        .into_iter()
        .filter(|m| m.to_string_lossy().contains(part))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!(
            "want one mount with {part:?} below {}, found {other:?}",
            dir.display()
        ),
    }
}

/// The largest counter the writer says it wrote.
fn last_written(stdout: &Path) -> u64 {
    std::fs::read_to_string(stdout)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("wrote ")?.parse().ok())
        .max()
        .unwrap_or(0)
}

fn node(agent: &DevAgent) -> Result<Value> {
    let nodes = agent.api_get("/v1/nodes")?;
    let id = nodes[0]["id"].as_str().unwrap_or_default().to_string();
    agent.api_get(&format!("/v1/node/{id}"))
}

fn pid_alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

#[test]
fn lost_mounts_are_repaired_for_the_running_task_after_the_plugin_restarts() -> Result<()> {
    // Dropping the agent kills its processes and unmounts everything below
    // its data dir, also when an assertion fails.
    let interval = format!("{}s", FINGERPRINT_INTERVAL.as_secs());
    let agent = DevAgent::start_with_args(&["-csi-fingerprint-interval", &interval])?;
    let data_dir = agent.data_dir.path().to_path_buf();
    agent.cli_ok(&["job", "run", "-detach", &plugin_job(&agent)?])?;
    agent.wait_plugin_healthy("hostpath")?;
    agent.cli_ok(&["volume", "create", &example("volumes/hostpath.hcl")])?;
    let job = csi_volume_service_job("writer", "writer", &["-c", WRITER]);
    agent.cli_ok(&[
        "job",
        "run",
        "-detach",
        &agent.write_file("writer.hcl", &job)?,
    ])?;
    let alloc = wait_alloc_running(&agent, "writer")?;
    let alloc_id = alloc["id"].as_str().context("alloc id")?.to_string();
    let task_pid = recorded_task_pid(&data_dir, &alloc_id, "writer")?;
    let alloc_dir = data_dir.join("alloc").join(&alloc_id);
    let stdout = alloc_dir.join("alloc/logs/writer.stdout.0");
    let task_mount = alloc_dir.join("writer/data");
    wait_for("the writer to write", Duration::from_secs(60), || {
        Ok((last_written(&stdout) > 0).then_some(()))
    })?;

    let csi_dir = data_dir.join("client/csi/hostpath");
    let staging = mount_with(&csi_dir, "/staging/")?;
    let target = mount_with(&csi_dir, &format!("/per-alloc/{alloc_id}/"))?;

    // The volume's directory is replaced: the task's old bind keeps
    // showing the old one, only a new bind shows the new one. Done before
    // the plugin dies, so no repair can come before it.
    let volumes = data_dir.join("node_data/hostpath-plugin/plugin/plugin/volumes");
    let backing = match std::fs::read_dir(&volumes)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()?
        .as_slice()
    {
        [one] => one.clone(),
        other => bail!(
            "want one volume dir in {}, found {other:?}",
            volumes.display()
        ),
    };
    std::fs::rename(&backing, backing.with_extension("gen1"))?;
    std::fs::create_dir(&backing)?;
    std::fs::write(backing.join("generation"), "2")?;

    // The plugin dies, and its mounts with it.
    let needle = format!("--endpoint=unix://{}", data_dir.display());
    let plugin_pids = agent.processes_with_cmdline(&needle);
    let [plugin_pid] = plugin_pids.as_slice() else {
        bail!("want one plugin process, found {plugin_pids:?}");
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(*plugin_pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    for m in [&target, &staging] {
        while nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
        assert_eq!(mount_count_at(m), 0, "{} still mounted", m.display());
    }
    let lost_at = Instant::now();

    // The plugin restarts (1 s), is found healthy, and the next round (at
    // most 2 s later) repairs; the slack covers the plugin's start and a
    // busy machine.
    let within = PLUGIN_RESTART_DELAY + FINGERPRINT_INTERVAL + Duration::from_secs(60);
    wait_for(
        "the volume to be staged and published again",
        within,
        || Ok((mount_count_at(&staging) == 1 && mount_count_at(&target) == 1).then_some(())),
    )
    .with_context(|| agent.log())?;
    let repaired_in = lost_at.elapsed();

    let repaired = wait_for(
        "the Storage node events of the repair",
        Duration::from_secs(60),
        || {
            let node = node(&agent)?;
            let whats: Vec<String> = node_events(&node, "Storage")
                .into_iter()
                .filter(|e| {
                    e["message"] == "Volume repaired"
                        && e["details"]["alloc_id"] == alloc_id.as_str()
                })
                .map(|e| {
                    e["details"]["what"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string()
                })
                .collect();
            Ok(
                (whats.contains(&"staging".to_string()) && whats.contains(&"publish".to_string()))
                    .then_some(whats),
            )
        },
    )
    .with_context(|| format!("node: {}", node(&agent).unwrap_or_default()))?;
    assert!(!repaired.is_empty());

    let events = wait_for(
        "the task event of the repair",
        Duration::from_secs(60),
        || {
            let a = only_alloc(&agent, "writer")?;
            let ev = task_events(&a, "writer");
            Ok(ev
                .iter()
                .any(|(t, _, _)| t == "Volume Repaired")
                .then_some(ev))
        },
    )?;
    assert!(
        !events
            .iter()
            .any(|(t, _, _)| t == "Volume Repair Failed" || t == "Restarting"),
        "{events:?}"
    );

    // The same task goes on writing, to the repaired mount: its task-dir
    // bind shows the new publish target.
    assert_eq!(recorded_task_pid(&data_dir, &alloc_id, "writer")?, task_pid);
    assert!(pid_alive(task_pid), "the writer task died");
    assert_eq!(mount_count_at(&task_mount), 1, "one bind in the task dir");
    assert_eq!(
        std::fs::read_to_string(task_mount.join("generation"))?,
        "2",
        "the task dir bind was made again from the repaired target"
    );
    let before = last_written(&stdout);
    let after = wait_for(
        "the writer to write after the repair",
        Duration::from_secs(60),
        || {
            let n = last_written(&stdout);
            Ok((n > before + 2).then_some(n))
        },
    )?;
    let through_target = std::fs::read_to_string(target.join("counter"))?;
    let seen: Vec<u64> = through_target
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert!(
        seen.iter().any(|n| *n > before && *n <= after + 5),
        "the new publish target does not show the writes after the repair (after {before}: {seen:?})"
    );
    std::fs::write(target.join("marker"), "through the repaired target")?;
    assert_eq!(
        std::fs::read_to_string(task_mount.join("marker"))?,
        "through the repaired target",
        "the task dir sees the repaired target"
    );
    assert!(
        !std::fs::read_to_string(&stdout)?.contains("failed"),
        "the writer failed a write"
    );

    // The plugin task: unhealthy when it died, healthy again after.
    let plugin = only_alloc(&agent, "hostpath-plugin")?;
    let kinds: Vec<String> = task_events(&plugin, "plugin")
        .into_iter()
        .map(|(t, _, _)| t)
        .filter(|t| t.starts_with("Plugin became"))
        .collect();
    assert_eq!(
        kinds,
        [
            "Plugin became healthy",
            "Plugin became unhealthy",
            "Plugin became healthy"
        ],
        "plugin task events"
    );
    eprintln!("repaired {repaired_in:?} after the mounts were lost");
    Ok(())
}
