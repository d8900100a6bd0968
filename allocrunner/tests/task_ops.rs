//! An operator's restarts and signals on real task processes: a restart
//! starts the task again in place even under a policy that allows no
//! restart, and a signal reaches the task's process; what does not run
//! refuses both.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use berth_allocrunner::TaskOpError;
use berth_structs::{AccessMode, AllocClientStatus, JobType, TaskStateKind};
use berth_testutil::mount_count_at;
use common::*;
use nix::sys::signal::Signal;

const WITHIN: Duration = Duration::from_secs(30);

/// Lines of `local/<file>` in the task dir of `task`.
fn lines(h: &Harness, alloc_id: &str, task: &str, file: &str) -> Vec<String> {
    std::fs::read_to_string(
        h.data_dir()
            .join("alloc")
            .join(alloc_id)
            .join(task)
            .join("local")
            .join(file),
    )
    .map(|s| s.lines().map(str::to_string).collect())
    .unwrap_or_default()
}

async fn wait_lines(h: &Harness, alloc_id: &str, task: &str, file: &str, n: usize) {
    wait_for(&format!("{n} lines in {file}"), WITHIN, || {
        lines(h, alloc_id, task, file).len() >= n
    })
    .await;
}

#[tokio::test]
async fn a_restart_starts_the_task_again_without_counting_against_the_policy() {
    let h = Harness::new();
    // No restart allowed: a restart the policy counted would fail the task.
    let alloc = alloc(
        JobType::Service,
        vec![sh_task(
            "t",
            r#"echo $$ >> "$BERTH_TASK_DIR/local/pids"; exec sleep 300"#,
        )],
    );
    let id = alloc.id.clone();
    let runner = h.runner(alloc);
    runner.run();
    wait_running(&runner, "t", WITHIN).await;
    wait_lines(&h, &id, "t", "pids", 1).await;

    assert_eq!(runner.restart_tasks(None).await, Ok(vec!["t".to_string()]));
    wait_lines(&h, &id, "t", "pids", 2).await;
    wait_running(&runner, "t", WITHIN).await;
    let pids = lines(&h, &id, "t", "pids");
    assert_ne!(pids[0], pids[1]);
    assert_eq!(runner.task_state_kind("t"), Some(TaskStateKind::Running));
    assert_eq!(runner.task_state_kind("nope"), None);
    let state = runner.task_states()["t"].clone();
    assert_eq!(state.restarts, 0);
    assert!(!state.failed);
    let events: Vec<&str> = state.events.iter().map(|e| e.event_type.as_str()).collect();
    let from = events
        .iter()
        .position(|e| *e == "Restart Signaled")
        .expect("a Restart Signaled event");
    assert_eq!(
        events[from..],
        [
            "Restart Signaled",
            "Terminated",
            "Restarting",
            "Task Setup",
            "Started"
        ],
        "{events:?}"
    );
    assert_eq!(state.events[from].message, "user requested restart");

    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert_eq!(
        runner.restart_tasks(Some("t")).await,
        Err(TaskOpError::AllocTerminal("complete".into()))
    );
}

#[tokio::test]
async fn a_signal_reaches_the_task_and_what_does_not_run_refuses_it() {
    let h = Harness::new();
    let alloc = alloc(
        JobType::Batch,
        vec![
            sh_task(
                "trap",
                r#"trap 'echo usr1 >> "$BERTH_TASK_DIR/local/usr1"' USR1; while true; do sleep 0.1; done"#,
            ),
            sh_task("quick", "exit 0"),
        ],
    );
    let id = alloc.id.clone();
    let runner = h.runner(alloc);
    runner.run();
    wait_running(&runner, "trap", WITHIN).await;
    wait_for("task quick to be dead", WITHIN, || {
        runner.task_states()["quick"].state == TaskStateKind::Dead
    })
    .await;

    // Every running task: the dead one is not among them.
    assert_eq!(
        runner.signal_tasks(None, Signal::SIGUSR1).await,
        Ok(vec!["trap".to_string()])
    );
    wait_lines(&h, &id, "trap", "usr1", 1).await;
    let signaling = runner.task_states()["trap"]
        .events
        .iter()
        .find(|e| e.event_type == "Signaling")
        .cloned()
        .expect("a Signaling event");
    assert_eq!(signaling.signal, Some(Signal::SIGUSR1 as i32));
    assert!(signaling.message.contains("SIGUSR1"), "{signaling:?}");

    assert_eq!(
        runner.signal_tasks(Some("quick"), Signal::SIGUSR1).await,
        Err(TaskOpError::NotRunning {
            task: "quick".into(),
            state: "dead".into()
        })
    );
    let unknown = runner
        .signal_tasks(Some("nope"), Signal::SIGUSR1)
        .await
        .unwrap_err();
    assert_eq!(unknown.http_status(), 404);
    assert!(unknown.to_string().contains("\"nope\""), "{unknown}");

    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    let e = runner
        .signal_tasks(None, Signal::SIGUSR1)
        .await
        .unwrap_err();
    assert_eq!(e.http_status(), 409, "{e}");
}

/// A restart is of the task, not of the alloc: its CSI volume stays
/// claimed, staged, published and bound in the task dir the whole time,
/// and the new run finds what the old one wrote. Needs
/// `cargo build -p hostpath-plugin` first.
#[tokio::test]
async fn a_restarted_task_keeps_its_csi_volume_mounted_throughout() {
    let h = Harness::new();
    let (_plugin, _state_dir, _plugin_killer) = run_hostpath_plugin(&h, WITHIN).await;
    h.csi.refresh_fingerprints().await;
    create_granted_volume(&h, "vol", AccessMode::SingleNodeWriter).await;
    let task = sh_task(
        "web",
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; echo $$ >> "$BERTH_TASK_DIR/local/pids"; echo run >> "$BERTH_TASK_DIR/data/runs"; exec sleep 300"#,
    );
    let mut a = csi_volume_user(task, "vol", AccessMode::SingleNodeWriter);
    group_mut(&mut a).restart = no_restarts();
    let id = a.id.clone();
    let task_dir = h.data_dir().join("alloc").join(&id).join("web");
    let _killer = PidFileKiller(task_dir.join("local/pid"));
    let runner = h.runner(a);
    runner.run();
    wait_running(&runner, "web", WITHIN).await;
    wait_lines(&h, &id, "web", "pids", 1).await;
    let bind = task_dir.join("data");
    let stub = h
        .csi
        .volume_stubs_of(&id)
        .pop()
        .expect("the volume's record");
    let target = stub.allocs[&id].clone();
    let staging = stub.staging_path.clone();
    assert_eq!(mount_count_at(&bind), 1, "bound in the task dir");

    // Watches the three mounts while the task restarts: the least of each
    // seen, and the most of the bind (a second bind would stack on it).
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (watching, bind, target, staging) = (
            watching.clone(),
            bind.clone(),
            target.clone(),
            staging.clone(),
        );
        std::thread::spawn(move || {
            let (mut least, mut most_binds) = (usize::MAX, 0);
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                let binds = mount_count_at(&bind);
                most_binds = most_binds.max(binds);
                least = least
                    .min(binds)
                    .min(mount_count_at(&target))
                    .min(mount_count_at(&staging));
                std::thread::sleep(Duration::from_millis(5));
            }
            (least, most_binds)
        })
    };
    assert_eq!(
        runner.restart_tasks(None).await,
        Ok(vec!["web".to_string()])
    );
    wait_lines(&h, &id, "web", "pids", 2).await;
    wait_running(&runner, "web", WITHIN).await;
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    let (least, most_binds) = watcher.join().unwrap();
    assert_eq!(
        least, 1,
        "a mount of the volume went away during the restart"
    );
    assert_eq!(most_binds, 1, "the volume was bound twice in the task dir");

    // The second run writes its pid line before its run line.
    let runs = bind.join("runs");
    wait_for("both runs to write to the one volume", WITHIN, || {
        std::fs::read_to_string(&runs).is_ok_and(|r| r == "run\nrun\n")
    })
    .await;
    assert!(h.claimer.unpublishes().is_empty(), "the claim was let go");
    assert_eq!(h.csi.volume_stubs_of(&id).len(), 1);
    assert_eq!(runner.task_states()["web"].restarts, 0);

    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert_eq!(mount_count_at(&bind), 0, "unbound once the alloc stopped");
    assert_eq!(
        mount_count_at(&target),
        0,
        "unpublished once the alloc stopped"
    );
}
