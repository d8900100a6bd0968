//! The agent dies (SIGKILL) right after the plugin unstaged the volume of
//! its last user, before the agent heard the answer and removed its record
//! of the staging: the record says "staged" while nothing is. After a
//! restart, the stopped alloc's teardown finishes, the claim is freed, a
//! new alloc of the volume gets the volume's data, and once everything
//! stops no mount is left.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{
    csi_volume_service_job, example, example_with, mounts_under, only_alloc, plugin_stderr,
    wait_alloc_running, wait_for, DevAgent,
};

/// The example plugin job, holding each NodeUnstageVolume answer (the
/// unstage done) until `go` exists.
fn plugin_job(agent: &DevAgent, go: &Path) -> Result<String> {
    let patched = example_with(
        "jobs/hostpath-plugin.hcl",
        "\"--state-dir=${BERTH_NODE_DATA_DIR}\",",
        &format!(
            "\"--state-dir=${{BERTH_NODE_DATA_DIR}}\",\n          \"--hold-after=NodeUnstageVolume={}\",",
            go.display()
        ),
    )?;
    agent.write_file("hostpath-plugin.hcl", &patched)
}

/// The staging mounts of the hostpath plugin below `csi_dir`.
fn staging_mounts(csi_dir: &Path) -> Vec<PathBuf> {
    mounts_under(csi_dir)
        .into_iter()
        .filter(|m| m.to_string_lossy().contains("/staging/"))
        .collect()
}

#[test]
fn a_crash_right_after_the_last_unstage_leaves_no_mount_and_the_volume_usable() -> Result<()> {
    // Dropping the agent kills its processes and unmounts everything below
    // its data dir, also when an assertion fails.
    let mut agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().canonicalize()?;
    let csi_dir = data_dir.join("client/csi/hostpath");
    let go = data_dir.join("unstage-go");
    agent.cli_ok(&["job", "run", "-detach", &plugin_job(&agent, &go)?])?;
    agent.wait_plugin_healthy("hostpath")?;
    let plugin_alloc = wait_alloc_running(&agent, "hostpath-plugin")?;
    let plugin_alloc = plugin_alloc["id"]
        .as_str()
        .context("plugin alloc id")?
        .to_string();
    agent.cli_ok(&["volume", "create", &example("volumes/hostpath.hcl")])?;

    // The first user writes to the volume and keeps it.
    let first = csi_volume_service_job(
        "first",
        "first",
        &[
            "-c",
            "echo from-first > $BERTH_TASK_DIR/data/note && sleep 3600",
        ],
    );
    agent.run_job("first", &first)?;
    let first_alloc = wait_alloc_running(&agent, "first")?;
    let first_id = first_alloc["id"].as_str().context("alloc id")?.to_string();
    let note = data_dir
        .join("alloc")
        .join(&first_id)
        .join("first/data/note");
    wait_for("the first user to write", Duration::from_secs(30), || {
        Ok(note.is_file().then_some(()))
    })?;
    assert_eq!(staging_mounts(&csi_dir).len(), 1, "staged once");

    // The first user stops: the plugin unstages and holds its answer; the
    // agent dies before it hears it.
    agent.cli_ok(&["job", "stop", "-detach", "first"])?;
    wait_for(
        "the plugin to unstage and hold its answer",
        Duration::from_secs(60),
        || {
            Ok((staging_mounts(&csi_dir).is_empty()
                && plugin_stderr(&data_dir, &plugin_alloc).contains("injected hold"))
            .then_some(()))
        },
    )
    .with_context(|| agent.log())?;
    agent.kill_agent()?;
    std::fs::write(&go, "")?;

    // After the restart the stopped alloc's teardown finishes: its claim
    // is freed, and nothing of it stays mounted.
    agent.start_again()?;
    agent.wait_volume_unclaimed("data")?;
    wait_for(
        "the first user's mounts to be gone",
        Duration::from_secs(60),
        || Ok(mounts_under(&csi_dir).is_empty().then_some(())),
    )
    .with_context(|| format!("mounts: {:?}\n{}", mounts_under(&csi_dir), agent.log()))?;

    // A new user of the volume finds the first one's data.
    let second = csi_volume_service_job(
        "second",
        "second",
        &["-c", "cat $BERTH_TASK_DIR/data/note && sleep 3600"],
    );
    agent.run_job("second", &second)?;
    let second_alloc = wait_alloc_running(&agent, "second")?;
    let second_id = second_alloc["id"].as_str().context("alloc id")?.to_string();
    let stdout = data_dir
        .join("alloc")
        .join(&second_id)
        .join("alloc/logs/second.stdout.0");
    wait_for(
        "the second user to read the volume",
        Duration::from_secs(30),
        || {
            Ok(std::fs::read_to_string(&stdout)
                .unwrap_or_default()
                .contains("from-first")
                .then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "second's stderr: {}",
            std::fs::read_to_string(stdout.with_file_name("second.stderr.0")).unwrap_or_default()
        )
    })?;
    assert_eq!(staging_mounts(&csi_dir).len(), 1, "staged again");

    // Everything stops: no mount is left, no claim.
    agent.cli_ok(&["job", "stop", "-detach", "second"])?;
    agent.wait_volume_unclaimed("data")?;
    wait_for("every volume mount to go", Duration::from_secs(60), || {
        Ok(mounts_under(&csi_dir).is_empty().then_some(()))
    })
    .with_context(|| format!("mounts: {:?}\n{}", mounts_under(&csi_dir), agent.log()))?;
    let stopped = only_alloc(&agent, "second")?;
    if stopped["desired_status"] != "stop" {
        bail!("second should be stopped: {stopped}");
    }
    Ok(())
}
