//! Tasks outlive the agent: the per-task executor records the task's exit,
//! a restored alloc runner reattaches to a task left running instead of
//! starting it again, sees its real exit, stops it, and does not trust a
//! pid whose process is not the one recorded.
//!
//! An "agent" here is a tokio runtime: shutting it down drops every runner
//! task and waiter, as an agent that exits does, while the executors (and
//! their tasks) keep running.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth_allocrunner::executor::{self, ExecutorExit};
use berth_allocrunner::{AllocRunner, Driver, RawExecDriver, TaskHandleRecord, TaskSpec};
use berth_structs::{AllocClientStatus, JobType, TaskStateKind};
use common::*;

const WITHIN: Duration = Duration::from_secs(20);

/// Polls `cond` from a plain thread until it holds or `within` passes.
fn wait_blocking(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|s| s.ends_with('\n'))
        .and_then(|s| s.trim().parse().ok())
}

fn process_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

/// A task that records its pid and each start, then waits for `go` in its
/// local dir and exits 3.
fn waiting_task() -> berth_structs::Task {
    sh_task(
        "web",
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; echo started >> "$BERTH_TASK_DIR/local/starts"
           while [ ! -e "$BERTH_TASK_DIR/local/go" ]; do sleep 0.05; done; exit 3"#,
    )
}

struct Setup {
    h: Harness,
    store: Arc<MemAllocStore>,
    alloc_id: String,
    local: PathBuf,
    pid: i32,
    _killer: PidFileKiller,
}

/// Runs `task` on a first "agent" until it runs and its handle is
/// persisted, then shuts that agent down without stopping anything.
fn run_then_lose_the_agent(job_type: JobType, task: berth_structs::Task) -> Setup {
    let store = Arc::new(MemAllocStore::default());
    let s = store.clone();
    let h = Harness::with(move |c| c.store = s);
    let alloc = alloc(job_type, vec![task]);
    let alloc_id = alloc.id.clone();
    let local = h.data_dir().join("alloc").join(&alloc_id).join("web/local");
    let killer = PidFileKiller(local.join("pid"));
    let first = runtime();
    first.block_on(async {
        let runner = h.runner(alloc);
        runner.run();
        wait_for("the task to run", WITHIN, || {
            runner
                .task_states()
                .get("web")
                .is_some_and(|s| s.state == TaskStateKind::Running)
                && read_pid(&local.join("pid")).is_some()
        })
        .await;
    });
    first.shutdown_timeout(Duration::from_secs(5));
    assert!(
        store.handle(&alloc_id, "web").is_some(),
        "the task's handle was persisted"
    );
    let pid = read_pid(&local.join("pid")).expect("the task wrote its pid");
    assert!(process_alive(pid), "the task outlives the agent");
    Setup {
        h,
        store,
        alloc_id,
        local,
        pid,
        _killer: killer,
    }
}

fn restored_runner(s: &Setup) -> AllocRunner {
    let mut restored = s.store.load_allocs_for_test();
    assert_eq!(restored.len(), 1, "one alloc persisted");
    AllocRunner::restore(s.h.config_with_store(s.store.clone()), restored.remove(0))
}

trait LoadForTest {
    fn load_allocs_for_test(&self) -> Vec<berth_allocrunner::RestoredAlloc>;
}

impl LoadForTest for MemAllocStore {
    fn load_allocs_for_test(&self) -> Vec<berth_allocrunner::RestoredAlloc> {
        berth_allocrunner::AllocStateStore::load_allocs(self).expect("load allocs")
    }
}

fn starts(local: &Path) -> usize {
    std::fs::read_to_string(local.join("starts"))
        .unwrap_or_default()
        .lines()
        .count()
}

#[test]
fn a_restored_runner_reattaches_to_the_running_task_and_sees_its_real_exit() {
    let s = run_then_lose_the_agent(JobType::Service, waiting_task());
    let second = runtime();
    second.block_on(async {
        let runner = restored_runner(&s);
        runner.run();
        wait_reattached(&runner, "web", WITHIN).await;
        // Reattached, not started again.
        assert_eq!(starts(&s.local), 1, "the task was started exactly once");
        assert_eq!(read_pid(&s.local.join("pid")), Some(s.pid));
        assert!(process_alive(s.pid));
        assert_eq!(runner.client_status(), AllocClientStatus::Running);

        std::fs::write(s.local.join("go"), "").unwrap();
        wait_done(&runner, WITHIN).await;
        let state = &runner.task_states()["web"];
        let terminated = state
            .events
            .iter()
            .find(|e| e.event_type == "Terminated")
            .expect("a Terminated event");
        assert_eq!(terminated.exit_code, Some(3), "{state:?}");
        assert_eq!(runner.client_status(), AllocClientStatus::Failed);
        assert_eq!(
            starts(&s.local),
            1,
            "no restart under the no-restart policy"
        );
    });
}

#[test]
fn a_task_whose_handle_was_not_persisted_is_found_through_its_executor() {
    let s = run_then_lose_the_agent(JobType::Service, waiting_task());
    s.store.forget_handles(&s.alloc_id);
    let second = runtime();
    second.block_on(async {
        let runner = restored_runner(&s);
        runner.run();
        wait_reattached(&runner, "web", WITHIN).await;
        assert_eq!(starts(&s.local), 1, "reattached, not started again");
        assert!(process_alive(s.pid));
        runner.stop();
        wait_done(&runner, WITHIN).await;
        assert!(!process_alive(s.pid), "the stop reached the task");
    });
}

#[test]
fn a_task_that_exited_while_the_agent_was_down_gets_its_recorded_exit() {
    let s = run_then_lose_the_agent(JobType::Batch, waiting_task());
    std::fs::write(s.local.join("go"), "").unwrap();
    let record = s.store.handle(&s.alloc_id, "web").unwrap();
    wait_blocking("the executor to record the exit", WITHIN, || {
        record.executor_dir.join(executor::EXIT_FILE).exists()
    });
    let exit: ExecutorExit = executor::read_record(&record.executor_dir, executor::EXIT_FILE)
        .unwrap()
        .unwrap();
    assert_eq!(exit.exit_code, Some(3));
    let second = runtime();
    second.block_on(async {
        let runner = restored_runner(&s);
        runner.run();
        wait_done(&runner, WITHIN).await;
        let state = &runner.task_states()["web"];
        assert!(
            state
                .events
                .iter()
                .any(|e| e.event_type == "Terminated" && e.exit_code == Some(3)),
            "{state:?}"
        );
        assert!(state.failed);
        assert_eq!(starts(&s.local), 1, "not started again");
        // Destroying the alloc forgets it.
        runner.destroy().await.unwrap();
        assert!(!s.store.contains(&s.alloc_id));
    });
}

#[test]
fn stopping_a_reattached_task_kills_its_process_group() {
    let task = sh_task(
        "web",
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; echo started >> "$BERTH_TASK_DIR/local/starts"; sleep 1000 & sleep 1000; wait"#,
    );
    let s = run_then_lose_the_agent(JobType::Service, task);
    wait_blocking("the task's children", WITHIN, || {
        live_group_members(s.pid).len() >= 3
    });
    let second = runtime();
    second.block_on(async {
        let runner = restored_runner(&s);
        runner.run();
        wait_reattached(&runner, "web", WITHIN).await;
        runner.stop();
        wait_done(&runner, WITHIN).await;
        assert!(
            live_group_members(s.pid).is_empty(),
            "the whole process group is gone"
        );
        assert_eq!(runner.client_status(), AllocClientStatus::Complete);
        assert_eq!(starts(&s.local), 1);
    });
}

#[test]
fn a_restored_alloc_stopped_while_the_agent_was_down_kills_its_task_and_completes() {
    let s = run_then_lose_the_agent(JobType::Service, waiting_task());
    let second = runtime();
    second.block_on(async {
        let mut restored = s.store.load_allocs_for_test();
        let mut r = restored.remove(0);
        // The servers stopped it meanwhile; the store has that version.
        r.alloc.desired_status = berth_structs::AllocDesiredStatus::Stop;
        let runner = AllocRunner::restore(s.h.config_with_store(s.store.clone()), r);
        runner.run();
        wait_done(&runner, WITHIN).await;
        assert!(!process_alive(s.pid), "the restored task was stopped");
        assert_eq!(runner.client_status(), AllocClientStatus::Complete);
        let state = &runner.task_states()["web"];
        let last = state.events.last().expect("events");
        // It ran before the restart: killed, not "never started".
        assert_eq!(last.event_type, "Killed", "{state:?}");
        assert_eq!(last.message, "The alloc was stopped");
        assert_eq!(starts(&s.local), 1, "not started again");
    });
}

/// The agent lost the alloc's records, and the servers stopped the alloc
/// meanwhile: the fresh runner that reports it must still stop the task
/// the previous agent left running, and say it was killed.
#[test]
fn a_fresh_runner_of_a_stopped_alloc_stops_a_task_whose_records_were_lost() {
    let s = run_then_lose_the_agent(JobType::Service, waiting_task());
    let mut alloc = s
        .store
        .load_allocs_for_test()
        .pop()
        .expect("the alloc was persisted")
        .alloc;
    alloc.desired_status = berth_structs::AllocDesiredStatus::Stop;
    let lost = Arc::new(MemAllocStore::default());
    let second = runtime();
    second.block_on(async {
        let runner = AllocRunner::new(s.h.config_with_store(lost.clone()), alloc);
        runner.run();
        wait_done(&runner, WITHIN).await;
        assert!(!process_alive(s.pid), "the left-over task was stopped");
        assert_eq!(runner.client_status(), AllocClientStatus::Complete);
        let state = &runner.task_states()["web"];
        let last = state.events.last().expect("events");
        assert_eq!(last.event_type, "Killed", "{state:?}");
        assert_eq!(starts(&s.local), 1, "not started again");
    });
}

#[tokio::test]
async fn the_executor_records_the_exit_code_of_its_task() {
    let dir = tempfile::tempdir().unwrap();
    let driver = RawExecDriver::with_executor(test_executor());
    let spec = TaskSpec {
        alloc_id: "a".into(),
        task: "t".into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), "echo out; exit 42".into()],
        env: [("PATH".to_string(), "/usr/bin:/bin".to_string())].into(),
        task_dir: dir.path().to_path_buf(),
        stdout_path: dir.path().join("stdout"),
        stderr_path: dir.path().join("stderr"),
        logs: Default::default(),
        executor_dir: dir.path().join("executor"),
        limits: Default::default(),
        cgroup_procs: Vec::new(),
        isolation: None,
        user: None,
        disconnect: None,
    };
    let handle = driver.start(&spec).await.unwrap();
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    assert_eq!(exit.exit_code, Some(42), "{exit}");
    let recorded: ExecutorExit = executor::read_record(&spec.executor_dir, executor::EXIT_FILE)
        .unwrap()
        .expect("exit.json");
    assert_eq!(recorded.exit_code, Some(42));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("stdout.0")).unwrap(),
        "out\n"
    );
    let record = handle.record().expect("a persistable handle");
    assert_eq!(record.task_pid, handle.pid());
    assert_eq!(record.pgid, handle.pid() as i32);

    // A command that does not exist is reported as such.
    let missing = TaskSpec {
        command: "/nonexistent/berth-test".into(),
        ..spec.clone()
    };
    assert!(matches!(
        driver.start(&missing).await.err(),
        Some(berth_allocrunner::DriverError::CommandNotFound { .. })
    ));
}

#[tokio::test]
async fn a_handle_whose_executor_start_time_differs_is_treated_as_dead() {
    let driver = RawExecDriver::with_executor(test_executor());
    // A live process stands in for the executor.
    let mut stand_in = std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let pid = stand_in.id();
    let _kill = Kill(&mut stand_in);
    let ticks = executor::process_start_ticks(pid).expect("start time of a live process");
    let dir = tempfile::tempdir().unwrap();
    let record = TaskHandleRecord {
        driver: "raw_exec".into(),
        executor_dir: dir.path().to_path_buf(),
        executor_pid: pid,
        executor_start_ticks: ticks,
        // No task to kill: pid 0 is never a task.
        task_pid: 0,
        pgid: 0,
        task_start_ticks: 0,
        started_at_ms: 0,
        cgroup: Vec::new(),
    };
    let live = driver.reattach(&record).await.unwrap();
    assert!(
        live.try_exit().is_none(),
        "the recorded process runs: reattached"
    );

    let reused = TaskHandleRecord {
        executor_start_ticks: ticks + 1,
        ..record
    };
    let dead = driver.reattach(&reused).await.unwrap();
    let exit = dead.try_exit().expect("a reused pid is not our executor");
    assert!(
        exit.error.as_deref().is_some_and(|e| e.contains("died")),
        "{exit:?}"
    );
    assert!(
        process_alive(pid as i32),
        "the unrelated process is left alone"
    );
}

/// The agent lost the alloc's records (a quarantined database): the alloc
/// comes back as new, with a fresh runner, while its task still runs under
/// the executor of the previous agent. The runner reattaches to it instead
/// of starting a second copy next to it.
#[test]
fn a_fresh_runner_reattaches_to_a_task_whose_records_were_lost() {
    let s = run_then_lose_the_agent(JobType::Service, waiting_task());
    let alloc = s
        .store
        .load_allocs_for_test()
        .pop()
        .expect("the alloc was persisted")
        .alloc;
    let lost = Arc::new(MemAllocStore::default());
    let second = runtime();
    second.block_on(async {
        let runner = AllocRunner::new(s.h.config_with_store(lost.clone()), alloc);
        runner.run();
        wait_running(&runner, "web", WITHIN).await;
        assert_eq!(starts(&s.local), 1, "not started a second time");
        assert!(process_alive(s.pid), "the running task was kept");
        assert_eq!(
            lost.handle(&s.alloc_id, "web").map(|r| r.task_pid),
            Some(s.pid as u32),
            "the reattached task's handle is persisted again"
        );
        runner.stop();
        wait_done(&runner, WITHIN).await;
        assert!(!process_alive(s.pid), "the stop reached the task");
    });
}

/// The persisted handle says it is newer (its wall clock ran ahead) than
/// the executor's own record of the latest run; the executor's record wins,
/// since the executor dir is cleared before each start.
#[test]
fn the_executors_record_wins_over_a_persisted_handle_with_a_later_clock() {
    let s = run_then_lose_the_agent(JobType::Service, waiting_task());
    let stale = s.store.handle(&s.alloc_id, "web").expect("a handle");
    // A previous run's handle, stamped by a clock that ran ahead.
    let stale = TaskHandleRecord {
        executor_pid: 0,
        executor_start_ticks: 0,
        task_pid: 0,
        pgid: 0,
        task_start_ticks: 0,
        started_at_ms: stale.started_at_ms + 3_600_000,
        ..stale
    };
    berth_allocrunner::AllocStateStore::put_task_handle(&*s.store, &s.alloc_id, "web", &stale)
        .unwrap();
    let second = runtime();
    second.block_on(async {
        let runner = restored_runner(&s);
        runner.run();
        wait_reattached(&runner, "web", WITHIN).await;
        assert!(process_alive(s.pid));
        assert_eq!(runner.client_status(), AllocClientStatus::Running);
        assert_eq!(starts(&s.local), 1);
        runner.stop();
        wait_done(&runner, WITHIN).await;
        assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    });
}

/// Servers that send full sets send every alloc of the node on each
/// change to any of them; an alloc that did not change is not written to
/// the state DB again, nor one whose only change is what this node
/// reported of it.
#[tokio::test]
async fn an_unchanged_alloc_from_the_servers_is_not_written_again() {
    let allocs = Arc::new(MemAllocStore::default());
    let s = allocs.clone();
    let h = Harness::with(move |c| c.store = s);
    let a = alloc(JobType::Service, vec![sh_task("web", "exec sleep 1000")]);
    let runner = h.runner(a.clone());
    runner.run();
    wait_running(&runner, "web", WITHIN).await;
    let before = allocs.alloc_writes();
    for _ in 0..10 {
        runner.update(a.clone());
    }
    assert_eq!(allocs.alloc_writes(), before, "unchanged: no write");
    let mut reported = a.clone();
    reported.modify_index += 1;
    reported.client_status = AllocClientStatus::Running;
    reported.client_description = "Tasks are running".into();
    reported.task_states = runner.task_states();
    runner.update(reported.clone());
    assert_eq!(
        allocs.alloc_writes(),
        before,
        "the node's own report sent back: no write"
    );
    assert_eq!(*runner.alloc(), reported, "but kept");
    let mut changed = reported;
    changed.modify_index += 1;
    changed.desired_description = "moved by the servers".into();
    runner.update(changed);
    assert_eq!(allocs.alloc_writes(), before + 1, "changed: one write");
    runner.stop();
    wait_done(&runner, WITHIN).await;
}
