//! An operator's restarts and signals on real task processes: a restart
//! starts the task again in place even under a policy that allows no
//! restart, and a signal reaches the task's process; what does not run
//! refuses both.

mod common;

use std::time::Duration;

use berth_allocrunner::TaskOpError;
use berth_structs::{AllocClientStatus, JobType, TaskStateKind};
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
