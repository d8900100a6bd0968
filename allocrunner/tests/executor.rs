//! The raw_exec driver and its executor against real processes: the
//! executor is detached from the agent's session and group from its first
//! instruction, kills what its task leaves behind in its group, and a
//! reattach that cannot get a pidfd polls the executor instead of taking it
//! for dead (and killing its task). A start is learned from the executor's
//! report, not by looking for its state record, and an executor that dies
//! or hangs before it reports fails the start with a clear error, promptly
//! or at the deadline.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use berth_allocrunner::{Driver, DriverError, ExecutorCommand, RawExecDriver, TaskSpec};
use berth_structs::{AllocClientStatus, JobType};
use common::*;

const WITHIN: Duration = Duration::from_secs(20);

fn spec(dir: &Path, script: &str) -> TaskSpec {
    sh_task_spec(dir, script)
}

/// Fields 5 and 6 (pgrp, session) of a `/proc/<pid>/stat` text.
fn pgrp_and_session(stat: &str) -> (i32, i32) {
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    (fields[2].parse().unwrap(), fields[3].parse().unwrap())
}

fn process_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|s| s.ends_with('\n'))
        .and_then(|s| s.trim().parse().ok())
}

/// Kills a pid on drop.
struct PidKiller(Option<i32>);

impl Drop for PidKiller {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// The executor is in a session and process group of its own already when
/// it starts (before it reads its spec): a Ctrl-C to the agent's group
/// never reaches it.
#[tokio::test]
async fn the_executor_has_its_own_session_and_group_from_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let real = test_executor();
    // Records its own stat at exec time, then becomes the real executor.
    let wrapper = ExecutorCommand {
        program: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            format!(
                r#"cat /proc/$$/stat > "$0/../pre.stat"; exec {} "$0""#,
                real.program.display()
            ),
        ],
    };
    let driver = RawExecDriver::with_executor(wrapper);
    let spec = spec(dir.path(), "exit 0");
    let handle = driver.start(&spec).await.unwrap();
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    assert!(exit.successful(), "{exit}");
    let pre = std::fs::read_to_string(dir.path().join("pre.stat")).expect("the wrapper ran");
    let (pgrp, session) = pgrp_and_session(&pre);
    let mine = std::process::id() as i32;
    let (my_pgrp, my_session) =
        pgrp_and_session(&std::fs::read_to_string(format!("/proc/{mine}/stat")).unwrap());
    assert_ne!(pgrp, my_pgrp, "the executor is not in the agent's group");
    assert_ne!(
        session, my_session,
        "the executor is not in the agent's session"
    );
    let record = handle.record().unwrap();
    assert_eq!(
        pgrp, record.executor_pid as i32,
        "it leads its own group from the start"
    );
}

/// A task that exits on its own leaves no process of its group behind: the
/// executor kills the group while the leader's zombie still holds its id.
#[tokio::test]
async fn a_task_that_exits_leaves_no_background_children() {
    let h = Harness::new();
    let a = alloc(
        JobType::Batch,
        vec![sh_task(
            "web",
            r#"sleep 1000 & echo $! > "$BERTH_TASK_DIR/local/bg"; exit 0"#,
        )],
    );
    let bg_file = h.data_dir().join("alloc").join(&a.id).join("web/local/bg");
    let runner = h.runner(a);
    runner.run();
    wait_done(&runner, WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    let bg = read_pid(&bg_file).expect("the task recorded its child");
    let _killer = PidKiller(Some(bg));
    wait_for("the background child to be gone", WITHIN, || {
        !process_alive(bg)
    })
    .await;
}

/// Makes `pidfd_open` fail with EPERM in the calling thread (as a seccomp
/// profile may do for the agent).
fn deny_pidfd_open_in_this_thread() {
    let filter = [
        // Load the syscall number (offset 0 of seccomp_data).
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_pidfd_open as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: plain prctl calls; `prog` and `filter` outlive them and the
    // kernel copies the filter.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog
            ),
            0,
            "installing the seccomp filter: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: pidfd_open of our own pid; any fd it returned is closed.
        let fd = libc::syscall(libc::SYS_pidfd_open, std::process::id() as libc::pid_t, 0);
        assert_eq!(fd, -1, "pidfd_open is denied in this thread");
    }
}

/// Without pidfd_open (seccomp, an old kernel, no fds left) a running
/// executor is still taken for running: its task is not killed, and its
/// real exit is seen by polling.
#[test]
fn a_reattach_without_pidfd_open_polls_the_executor_and_keeps_its_task() {
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let spec = spec(
        dir.path(),
        r#"echo $$ > pid; while [ ! -e go ]; do sleep 0.05; done; exit 7"#,
    );
    let starter = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let driver = RawExecDriver::with_executor(test_executor());
    let record = starter.block_on(async {
        let handle = driver.start(&spec).await.unwrap();
        handle.record().unwrap()
    });
    let _killer = GroupKiller(Some(record.pgid));
    let task_pid = record.task_pid as i32;

    let watcher = std::thread::spawn(move || {
        deny_pidfd_open_in_this_thread();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let driver = RawExecDriver::with_executor(test_executor());
            let handle = driver.reattach(&record).await.unwrap();
            assert!(
                handle.try_exit().is_none(),
                "a running executor is not gone: {:?}",
                handle.try_exit()
            );
            assert!(process_alive(task_pid), "its task was left running");
            std::fs::write(&go, "").unwrap();
            tokio::time::timeout(WITHIN, handle.wait())
                .await
                .expect("the exit is seen by polling")
        })
    });
    let exit = watcher.join().expect("the watcher thread");
    assert_eq!(exit.exit_code, Some(7), "{exit}");
}

/// An executor run as `/bin/sh -c SCRIPT STATE_DIR`: `$0` is its state dir.
fn sh_executor(script: &str) -> ExecutorCommand {
    ExecutorCommand {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
    }
}

/// The start waits on the executor's report, not on its state record: with
/// the report held back, a start whose `state.json` is written and whose
/// task runs is still waiting; once the report comes, the start completes.
#[tokio::test]
async fn a_start_is_learned_from_the_executors_report_not_its_state_file() {
    let dir = tempfile::tempdir().unwrap();
    let real = test_executor();
    let release = dir.path().join("release");
    // The real executor, its report held in `report` until `release` exists.
    let wrapper = sh_executor(&format!(
        r#"{} "$0" | {{ head -c 1 > "$0/../report"; while [ ! -e "$0/../release" ]; do sleep 0.01; done; cat "$0/../report"; }}"#,
        real.program.display()
    ));
    let driver = RawExecDriver::with_executor(wrapper);
    let spec = spec(dir.path(), r#"echo $$ > pid; exec sleep 1000"#);
    let _task = PidFileKiller(dir.path().join("pid"));
    let state = spec.executor_dir.join("state.json");
    let report = dir.path().join("report");
    let mut start = std::pin::pin!(driver.start(&spec));

    // Runs the start until the executor has recorded the task and sent
    // its report (held back by the wrapper).
    let recorded = tokio::time::timeout(WITHIN, async {
        tokio::select! {
            started = &mut start => panic!("the start completed before the report: {:?}", started.map(|h| h.pid())),
            () = wait_for("state.json and the held-back report", WITHIN, || {
                state.exists() && std::fs::metadata(&report).is_ok_and(|m| m.len() == 1)
            }) => {}
        }
    })
    .await;
    assert!(recorded.is_ok(), "the executor never recorded its task");
    assert_eq!(
        std::fs::read(&report).unwrap(),
        b"\n",
        "the report is one newline"
    );
    // A start that looked for the file would see it within a millisecond.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut start)
            .await
            .is_err(),
        "the start completed on the state file alone"
    );

    std::fs::write(&release, "").unwrap();
    let released = Instant::now();
    let handle = tokio::time::timeout(WITHIN, &mut start)
        .await
        .expect("the start completes once the report comes")
        .expect("the task starts");
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "the start took {:?} after the report",
        released.elapsed()
    );
    let pid_file = dir.path().join("pid");
    wait_for("the task to record its pid", WITHIN, || {
        read_pid(&pid_file).is_some()
    })
    .await;
    assert_eq!(read_pid(&pid_file), Some(handle.pid() as i32));
    let exit = handle.stop(Duration::from_secs(5)).await;
    assert_eq!(exit.signal, Some(libc::SIGTERM), "{exit}");
}

/// An executor that dies before it records a state fails the start at
/// once, with its exit and its last words, long before the deadline; also
/// when something it left behind keeps its stdout open (its exit, not the
/// end of its report pipe, wakes the start).
#[tokio::test]
async fn an_executor_that_dies_before_recording_a_state_fails_the_start_promptly() {
    for (what, script) in [
        (
            "alone",
            r#"cat > /dev/null; echo "executor: cannot go on" >&2; exit 3"#,
        ),
        (
            "leaving its stdout open",
            r#"cat > /dev/null; echo $$ > "$0/../holder"; sleep 1000 & echo "executor: cannot go on" >&2; exit 3"#,
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let _holder = PidFileKiller(dir.path().join("holder"));
        let driver = RawExecDriver::with_executor(sh_executor(script))
            .with_start_timeout(Duration::from_secs(60));
        let spec = spec(dir.path(), "exit 0");
        let began = Instant::now();
        let started = tokio::time::timeout(WITHIN, driver.start(&spec))
            .await
            .unwrap_or_else(|_| panic!("{what}: the start hung"));
        let took = began.elapsed();
        let Err(DriverError::ExecutorFailed { message, .. }) = started.as_ref().map(|h| h.pid())
        else {
            panic!(
                "{what}: not an executor failure: {:?}",
                started.map(|h| h.pid())
            );
        };
        assert!(
            message.contains("exited (exit status: 3) before the task started"),
            "{what}: {message}"
        );
        assert!(
            message.contains("executor: cannot go on"),
            "{what}: {message}"
        );
        assert!(
            took < Duration::from_secs(5),
            "{what}: the failure took {took:?}"
        );
    }
}

/// An executor that neither reports nor exits is given up on at the
/// deadline: the start fails saying so, and the executor is killed.
#[tokio::test]
async fn an_executor_that_hangs_fails_the_start_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("executor.pid");
    let _executor = PidFileKiller(pid_file.clone());
    let timeout = Duration::from_millis(500);
    let driver = RawExecDriver::with_executor(sh_executor(
        r#"cat > /dev/null; echo $$ > "$0/../executor.pid"; exec sleep 1000"#,
    ))
    .with_start_timeout(timeout);
    let spec = spec(dir.path(), "exit 0");
    let began = Instant::now();
    let started = tokio::time::timeout(WITHIN, driver.start(&spec))
        .await
        .expect("the start hung past its deadline");
    let took = began.elapsed();
    let Err(DriverError::ExecutorFailed { message, .. }) = started.as_ref().map(|h| h.pid()) else {
        panic!("not an executor failure: {:?}", started.map(|h| h.pid()));
    };
    assert!(
        message.contains("the task did not start within 500ms"),
        "{message}"
    );
    assert!(
        took >= timeout,
        "gave up after {took:?}, before the deadline"
    );
    assert!(took < Duration::from_secs(5), "gave up only after {took:?}");
    let pid = read_pid(&pid_file).expect("the executor ran");
    assert!(!process_alive(pid), "the hung executor was left running");
}

/// An executor killed while its task runs: the task is killed too, and
/// its exit is known only once it is gone, so nothing it held (a volume's
/// claim, its mounts) is let go while it still runs.
#[tokio::test]
async fn a_task_whose_executor_dies_is_gone_when_its_exit_is_known() {
    let dir = tempfile::tempdir().unwrap();
    let driver = RawExecDriver::with_executor(test_executor());
    // Many processes in the task's group, so its death takes a moment.
    let spec = spec(
        dir.path(),
        "for i in $(seq 50); do sleep 1000 & done; exec sleep 1000",
    );
    let handle = driver.start(&spec).await.unwrap();
    let record = handle.record().unwrap();
    let task = record.task_pid as i32;
    let _killer = PidKiller(Some(task));
    wait_for("the task's children", WITHIN, || {
        std::fs::read_to_string(format!("/proc/{task}/stat")).is_ok()
    })
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(record.executor_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    assert!(
        !process_alive(task),
        "the task still runs once its exit is known"
    );
    assert!(
        exit.error
            .as_deref()
            .is_some_and(|e| e.contains("died without recording the task's exit")),
        "{exit:?}"
    );
}

/// A task whose group sets a disconnect window is stopped by its executor
/// once the client's heartbeat lease is that old, with no agent about:
/// not while the lease is renewed, and with SIGKILL after the kill
/// timeout when it ignores SIGTERM. Its exit says why.
#[tokio::test]
async fn the_executor_stops_its_task_once_the_heartbeat_lease_runs_out() {
    let dir = tempfile::tempdir().unwrap();
    let lease_dir = dir.path().join("client");
    std::fs::create_dir_all(&lease_dir).unwrap();
    berth_allocrunner::lease::renew(&lease_dir).unwrap();
    let window = Duration::from_millis(1500);
    let kill_timeout = Duration::from_millis(500);
    let mut spec = spec(dir.path(), "trap '' TERM; while :; do sleep 0.1; done");
    spec.disconnect = Some(berth_allocrunner::lease::DisconnectWatch {
        lease: lease_dir.join(berth_allocrunner::lease::LEASE_FILE),
        window_ms: window.as_millis() as u64,
        kill_timeout_ms: kill_timeout.as_millis() as u64,
    });
    let driver = RawExecDriver::with_executor(test_executor());
    let handle = driver.start(&spec).await.unwrap();
    let task = handle.record().unwrap().task_pid as i32;
    let _killer = PidKiller(Some(task));
    // Renewed for twice the window: the task runs on.
    let renewing = Instant::now();
    while renewing.elapsed() < window * 2 {
        berth_allocrunner::lease::renew(&lease_dir).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            handle.try_exit().is_none(),
            "stopped while the lease was renewed"
        );
    }
    berth_allocrunner::lease::renew(&lease_dir).unwrap();
    let last = Instant::now();
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    let took = last.elapsed();
    assert!(
        took >= window + kill_timeout - Duration::from_millis(100),
        "stopped {took:?} after the last renewal, before the window and kill timeout"
    );
    assert!(
        took < window + kill_timeout + Duration::from_secs(3),
        "stopped only {took:?} after the last renewal"
    );
    assert!(exit.disconnected, "{exit:?}");
    assert_eq!(exit.signal, Some(9), "{exit:?}");
    assert!(!process_alive(task));
}
