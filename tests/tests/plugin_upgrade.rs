//! Replacing the CSI plugin while a volume is mounted, on a dev agent with
//! the real binary, the example hostpath plugin and real mounts.
//!
//! A reader holds the `data` volume and reads it in a loop, appending a
//! line per read to a marker file. The plugin job is then replaced, either
//! by a changed spec (a new version: the servers stop the old alloc and
//! place a new one at once) or by `job stop` followed by `job run` (the old
//! instance waits, "Waiting for volumes", until the new one is registered).
//! Either way the reader keeps reading, the new instance takes over, the
//! old one completes, the reader's unpublish and unstage go through the new
//! instance (the old one is gone), nothing stays mounted, and a writer and
//! a reader afterwards see the data written before the upgrade: the plugin
//! keeps its volumes in its node data dir, which every alloc of the plugin
//! job shares.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{
    csi_volume_service_job, example, example_with, mounts_under, node_events, only_alloc,
    plugin_stderr, processes_with_cmdline, task_events, wait_alloc_running, wait_for, DevAgent,
};
use serde_json::Value;

const PLUGIN_JOB: &str = "hostpath-plugin";

/// Writes `pre-upgrade` into the volume, then reads it back every 100 ms,
/// appending `read <what it read>` (or `failed`) to `<alloc dir>/reads`.
fn reader_job() -> String {
    csi_volume_service_job(
        "reading",
        "read",
        &[
            "-c",
            "echo pre-upgrade > ${BERTH_TASK_DIR}/data/pre || exit 1; \
             while :; do \
               if v=$(cat ${BERTH_TASK_DIR}/data/pre); then echo \"read $v\"; else echo failed; fi \
                 >> ${BERTH_ALLOC_DIR}/reads; \
               sleep 0.1; \
             done",
        ],
    )
}

/// A batch job that checks the volume holds what was written before the
/// upgrade and adds a line of its own; fails otherwise.
fn writer_after_job() -> String {
    csi_volume_service_job(
        "after",
        "write",
        &[
            "-c",
            "test \"$(cat ${BERTH_TASK_DIR}/data/pre)\" = pre-upgrade || exit 3; \
             echo post-upgrade > ${BERTH_TASK_DIR}/data/post || exit 4; \
             exec sleep 1000",
        ],
    )
}

/// The plugin job with an extra fault-injection flag that changes nothing
/// but the spec: a new version.
fn changed_plugin_job() -> Result<String> {
    example_with(
        "jobs/hostpath-plugin.hcl",
        "\"--node-id=${BERTH_NODE_ID}\",",
        "\"--node-id=${BERTH_NODE_ID}\",\n          \"--delay=NodeGetInfo=1ms\",",
    )
}

/// Every alloc of the plugin job, as the API shows them.
fn plugin_allocs(agent: &DevAgent) -> Result<Vec<Value>> {
    agent.job_allocs(PLUGIN_JOB)
}

fn id_of(a: &Value) -> String {
    a["id"].as_str().unwrap_or_default().to_string()
}

/// The plugin process of the alloc `alloc_id` (its socket path names it).
fn plugin_pids(alloc_id: &str) -> Vec<i32> {
    processes_with_cmdline(&format!("/hostpath/{alloc_id}/csi.sock"))
}

/// The lines the reader appended so far.
fn reads(reads: &Path) -> Vec<String> {
    std::fs::read_to_string(reads)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Waits until the reader has read `more` more times after now, and checks
/// that no read failed.
fn assert_reader_keeps_reading(reads_file: &Path, more: usize) -> Result<()> {
    let before = reads(reads_file).len();
    wait_for(
        "the reader to go on reading",
        Duration::from_secs(60),
        || Ok((reads(reads_file).len() >= before + more).then_some(())),
    )?;
    let all = reads(reads_file);
    let bad: Vec<&String> = all.iter().filter(|l| *l != "read pre-upgrade").collect();
    if !bad.is_empty() {
        bail!("the reader failed to read: {bad:?}");
    }
    Ok(())
}

/// The running reader and what the test checks about it.
struct Reader {
    alloc_id: String,
    reads: PathBuf,
    node_id: String,
}

/// Starts the plugin, creates the volume, starts the reader and waits
/// until it reads.
fn start_reader(agent: &DevAgent, data_dir: &Path) -> Result<(Reader, String)> {
    agent.run_plugin_and_create_volume()?;
    let old = plugin_allocs(agent)?;
    let [old] = old.as_slice() else {
        bail!("one plugin alloc expected: {old:?}");
    };
    let old_id = id_of(old);
    let file = agent.write_file("reading.hcl", &reader_job())?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let reader = wait_alloc_running(agent, "reading")?;
    let alloc_id = id_of(&reader);
    let reads_file = data_dir.join("alloc").join(&alloc_id).join("alloc/reads");
    assert_reader_keeps_reading(&reads_file, 3).with_context(|| agent.log())?;
    Ok((
        Reader {
            alloc_id,
            reads: reads_file,
            node_id: reader["node_id"].as_str().unwrap_or_default().to_string(),
        },
        old_id,
    ))
}

/// Waits until a new plugin alloc runs and the old one is complete, its
/// process gone; the new alloc's ID.
fn wait_taken_over(agent: &DevAgent, old_id: &str) -> Result<String> {
    let new_id = wait_for(
        "a new plugin alloc running and the old one complete",
        Duration::from_secs(60),
        || {
            let allocs = plugin_allocs(agent)?;
            let old_done = allocs
                .iter()
                .any(|a| id_of(a) == old_id && a["client_status"] == "complete");
            let new = allocs
                .iter()
                .find(|a| id_of(a) != old_id && a["client_status"] == "running");
            Ok(match (old_done, new) {
                (true, Some(new)) => Some(id_of(new)),
                _ => None,
            })
        },
    )
    .with_context(|| agent.log())?;
    wait_for(
        "the old plugin process to go",
        Duration::from_secs(60),
        || Ok(plugin_pids(old_id).is_empty().then_some(())),
    )?;
    assert_eq!(plugin_pids(&new_id).len(), 1, "the new plugin runs");
    let plugin = agent.cli_json(&["plugin", "status", "hostpath"])?;
    assert_eq!(plugin["nodes_healthy"], 1, "{plugin}");
    // The old instance was stopped only once the new one ran (the new one
    // registers just before it records its healthy event, and the old
    // one's stop follows the registration: the two events may come in
    // either order within a moment).
    let old = task_events(&agent.cli_json(&["alloc", "status", old_id])?, "plugin");
    let new = task_events(&agent.cli_json(&["alloc", "status", &new_id])?, "plugin");
    let at = |events: &[(String, String, i64)], kind: &str| {
        events
            .iter()
            .find(|(t, _, _)| t == kind)
            .map(|e| e.2)
            .with_context(|| format!("no {kind:?} event: {events:?}"))
    };
    let killed_at = at(&old, "Killing")?;
    assert!(
        at(&new, "Started")? <= killed_at,
        "the old plugin was killed before the new one started: {old:?} {new:?}"
    );
    at(&new, "Plugin became healthy")?;
    Ok(new_id)
}

/// Stops the reader and checks its volume was unmounted through the new
/// plugin instance, with nothing left mounted; then a writer and a reader
/// see the data written before the upgrade.
fn finish(
    agent: &DevAgent,
    data_dir: &Path,
    reader: &Reader,
    old_id: &str,
    new_id: &str,
) -> Result<()> {
    let old_log_before = plugin_stderr(data_dir, old_id);
    agent.cli_ok(&["job", "stop", "reading"])?;
    wait_for("the reader to finish", Duration::from_secs(60), || {
        let a = agent.cli_json(&["alloc", "status", &reader.alloc_id])?;
        Ok((a["client_status"] == "complete").then_some(()))
    })
    .with_context(|| agent.log())?;
    // Node events reach the servers a moment after the alloc ends.
    let storage = wait_for(
        "a successful unmount of the reader's volume among the node events",
        Duration::from_secs(60),
        || {
            let node = agent.cli_json(&["node", "status", &reader.node_id])?;
            let storage: Vec<Value> = node_events(&node, "Storage").into_iter().cloned().collect();
            let unmounted = storage.iter().any(|e| {
                e["message"] == "Unmount volume"
                    && e["details"]["alloc_id"] == reader.alloc_id.as_str()
                    && e["details"]["success"] == "true"
            });
            Ok(unmounted.then_some(storage))
        },
    )?;
    assert!(
        !storage.iter().any(|e| e["details"]["success"] == "false"),
        "a mount or unmount failed: {storage:?}"
    );
    // Unpublish and unstage went through the new instance.
    let new_log = plugin_stderr(data_dir, new_id);
    let unmounts = new_log.matches("unmounted volume").count();
    assert!(
        unmounts >= 2,
        "the new plugin instance should have unpublished and unstaged: {new_log}"
    );
    assert_eq!(
        plugin_stderr(data_dir, old_id),
        old_log_before,
        "the old instance, gone, logged nothing more"
    );
    let left = mounts_under(data_dir);
    assert!(left.is_empty(), "mounts left: {left:?}");

    // A writer sees what was written before the upgrade and adds to it.
    let file = agent.write_file("after.hcl", &writer_after_job())?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let after = wait_alloc_running(agent, "after")?;
    let after_id = id_of(&after);
    let post = data_dir
        .join("alloc")
        .join(&after_id)
        .join("write/data/post");
    wait_for("the writer to write", Duration::from_secs(60), || {
        Ok(post.is_file().then_some(()))
    })
    .with_context(|| format!("{:?}", task_events(&after, "write")))?;
    assert_eq!(
        std::fs::read_to_string(
            data_dir
                .join("alloc")
                .join(&after_id)
                .join("write/data/pre")
        )?,
        "pre-upgrade\n"
    );
    agent.cli_ok(&["job", "stop", "after"])?;
    wait_for("the writer to finish", Duration::from_secs(60), || {
        let a = agent.cli_json(&["alloc", "status", &after_id])?;
        Ok((a["client_status"] == "complete").then_some(()))
    })?;
    // The example reader, read-only, finds both lines.
    let check = example_with(
        "jobs/reader.hcl",
        r#"data/hello)\" = \"hello from berth\""#,
        r#"data/pre)\" = pre-upgrade && test \"$(cat ${BERTH_TASK_DIR}/data/post)\" = post-upgrade"#,
    )?;
    let file = agent.write_file("check.hcl", &check)?;
    agent.cli_ok(&["job", "run", &file])?;
    let check = wait_for("the reader to finish", Duration::from_secs(60), || {
        let a = only_alloc(agent, "reader")?;
        Ok(a["client_status"]
            .as_str()
            .is_some_and(|s| s != "pending" && s != "running")
            .then_some(a))
    })?;
    assert_eq!(check["client_status"], "complete", "{check}");
    let left = mounts_under(data_dir);
    assert!(left.is_empty(), "mounts left: {left:?}");
    Ok(())
}

#[test]
fn a_changed_plugin_spec_takes_over_a_mounted_volume() -> Result<()> {
    let agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().canonicalize()?;
    let (reader, old_id) = start_reader(&agent, &data_dir)?;

    let file = agent.write_file("plugin-v2.hcl", &changed_plugin_job()?)?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let new_id = wait_taken_over(&agent, &old_id)?;
    assert_reader_keeps_reading(&reader.reads, 10).with_context(|| agent.log())?;
    let new = agent.cli_json(&["alloc", "status", &new_id])?;
    assert_eq!(
        new["job"]["version"], 1,
        "the new alloc runs the new version"
    );

    finish(&agent, &data_dir, &reader, &old_id, &new_id)
}

#[test]
fn a_stopped_plugin_waits_for_its_volume_until_it_runs_again() -> Result<()> {
    let agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().canonicalize()?;
    let (reader, old_id) = start_reader(&agent, &data_dir)?;

    // The stop waits: the reader's volume needs the plugin (-detach: so
    // would `job stop`).
    agent.cli_ok(&["job", "stop", "-detach", PLUGIN_JOB])?;
    wait_for(
        "the plugin to say it waits for the volume",
        Duration::from_secs(60),
        || {
            let a = agent.cli_json(&["alloc", "status", &old_id])?;
            Ok(task_events(&a, "plugin")
                .iter()
                .any(|(t, _, _)| t == "Waiting for volumes")
                .then_some(()))
        },
    )
    .with_context(|| agent.log())?;
    assert_eq!(plugin_pids(&old_id).len(), 1, "the old plugin still runs");
    assert_reader_keeps_reading(&reader.reads, 5)?;

    // Running the job again starts a new instance, which takes over; then
    // the old one completes.
    agent.cli_ok(&[
        "job",
        "run",
        "-detach",
        &example("jobs/hostpath-plugin.hcl"),
    ])?;
    let new_id = wait_taken_over(&agent, &old_id)?;
    assert_reader_keeps_reading(&reader.reads, 10).with_context(|| agent.log())?;

    finish(&agent, &data_dir, &reader, &old_id, &new_id)
}
