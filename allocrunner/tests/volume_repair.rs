//! Repairs of lost volume mounts as a running task sees them, with the real
//! `hostpath-plugin` run as a plugin task: a repaired volume is bound into
//! the task dir again while the task keeps running; a repair that fails
//! kills the task for a restart per its restart policy.
//!
//! Needs `cargo build -p hostpath-plugin` first.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_allocrunner::AllocRunner;
use berth_structs::{AccessMode, RestartPolicy};
use berth_testutil::mount_count_at;
use common::*;
use nix::mount::{umount2, MntFlags};

const WITHIN: Duration = Duration::from_secs(30);

/// Runs the hostpath plugin as a plugin task until it registers; its
/// state dir (where volumes live) and the killer of its process.
async fn start_plugin(h: &Harness) -> (AllocRunner, PathBuf, PidFileKiller) {
    let plugin = run_hostpath_plugin(h, WITHIN).await;
    // Fingerprinted healthy: repairs wait for that.
    h.csi.refresh_fingerprints().await;
    plugin
}

/// Creates the volume "vol" and grants its claims; its external ID.
async fn create_volume(h: &Harness) -> String {
    create_granted_volume(h, "vol", AccessMode::SingleNodeWriter).await
}

/// An alloc whose task "web" records its pid and sleeps, with "vol" bound
/// at `data`; restarted once, at once, when it fails.
fn volume_user() -> berth_structs::Allocation {
    let task = sh_task(
        "web",
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; exec sleep 1000"#,
    );
    let mut a = csi_volume_user(task, "vol", AccessMode::SingleNodeWriter);
    let group = group_mut(&mut a);
    group.restart = RestartPolicy {
        attempts: 1,
        interval: Duration::from_secs(600),
        delay: Duration::ZERO,
        mode: "fail".into(),
    };
    a
}

fn event_types(runner: &AllocRunner, task: &str) -> Vec<String> {
    runner
        .task_states()
        .get(task)
        .map(|s| s.events.iter().map(|e| e.event_type.clone()).collect())
        .unwrap_or_default()
}

fn lose_mount(path: &Path) {
    while umount2(path, MntFlags::MNT_DETACH).is_ok() {}
    assert_eq!(mount_count_at(path), 0, "{} still mounted", path.display());
}

fn read_pid(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

#[tokio::test]
async fn a_repaired_volume_is_bound_again_and_a_failed_repair_restarts_the_task() {
    let h = Harness::new();
    let (_plugin, state_dir, _plugin_killer) = start_plugin(&h).await;
    let ext = create_volume(&h).await;
    let a = volume_user();
    let task_dir = h.data_dir().join("alloc").join(&a.id).join("web");
    let pid_file = task_dir.join("local/pid");
    let _killer = PidFileKiller(pid_file.clone());
    let runner = h.runner(a.clone());
    runner.run();
    wait_running(&runner, "web", WITHIN).await;
    wait_for("the task to record its pid", WITHIN, || {
        read_pid(&pid_file).is_some_and(|p| !p.is_empty())
    })
    .await;
    let pid = read_pid(&pid_file).unwrap();
    let bind = task_dir.join("data");
    assert_eq!(
        mount_count_at(&bind),
        1,
        "the volume is bound in the task dir"
    );
    let stub = h
        .csi
        .volume_stubs_of(&a.id)
        .pop()
        .expect("the volume's record");
    let target = stub.allocs[&a.id].clone();

    // Lost: the staging mount and the publish target. The volume's
    // directory is replaced meanwhile, so that only a new bind shows the
    // new one (the old bind keeps showing the directory it was made of).
    lose_mount(&target);
    lose_mount(&stub.staging_path);
    let backing = state_dir.join("volumes").join(&ext);
    std::fs::rename(
        &backing,
        state_dir.join("volumes").join(format!("{ext}.gen1")),
    )
    .unwrap();
    std::fs::create_dir(&backing).unwrap();
    std::fs::write(backing.join("generation"), "2").unwrap();
    assert!(!bind.join("generation").exists());
    h.csi.repair_lost_mounts().await;
    // One event for the stage, one for the publish, which binds again.
    wait_for("the task events of the repair", WITHIN, || {
        event_types(&runner, "web")
            .iter()
            .filter(|t| *t == "Volume Repaired")
            .count()
            == 2
    })
    .await;
    assert_eq!(mount_count_at(&target), 1, "published again");
    assert_eq!(
        std::fs::read_to_string(bind.join("generation")).unwrap(),
        "2",
        "the task dir shows the repaired mount"
    );
    assert_eq!(mount_count_at(&bind), 1, "the old bind is gone");
    std::fs::write(target.join("after"), "repaired").unwrap();
    assert_eq!(
        std::fs::read_to_string(bind.join("after")).unwrap(),
        "repaired"
    );
    assert_eq!(read_pid(&pid_file).as_deref(), Some(pid.as_str()));
    let events = event_types(&runner, "web");
    assert!(!events.contains(&"Restarting".to_string()), "{events:?}");

    // Lost again, and this time the volume cannot be staged: its backing
    // directory is away. The task is killed and restarted (same alloc).
    let away = state_dir.join("volumes").join(format!("{ext}.away"));
    std::fs::rename(&backing, &away).unwrap();
    lose_mount(&target);
    lose_mount(&stub.staging_path);
    h.csi.repair_lost_mounts().await;
    wait_for("the task to be restarted", WITHIN, || {
        read_pid(&pid_file).is_some_and(|p| !p.is_empty() && p != pid)
    })
    .await;
    let events = event_types(&runner, "web");
    let failed_at = events
        .iter()
        .position(|t| t == "Volume Repair Failed")
        .unwrap_or_else(|| panic!("a repair failure event: {events:?}"));
    assert!(
        events[failed_at..].contains(&"Restarting".to_string()),
        "{events:?}"
    );
    let node_failures: Vec<_> = h
        .node_events
        .all()
        .iter()
        .filter(|e| e.subsystem == "Storage" && e.message == "Volume repair failed")
        .cloned()
        .collect();
    assert_eq!(node_failures.len(), 1, "{node_failures:?}");
    assert_eq!(node_failures[0].details["what"], "staging");
    assert_eq!(node_failures[0].details["alloc_id"], a.id);

    std::fs::rename(&away, &backing).unwrap();
    runner.stop();
    wait_done(&runner, WITHIN).await;
}
