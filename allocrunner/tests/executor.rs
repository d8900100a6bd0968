//! The raw_exec driver and its executor against real processes: the
//! executor is detached from the agent's session and group from its first
//! instruction, kills what its task leaves behind in its group, and a
//! reattach that cannot get a pidfd polls the executor instead of taking it
//! for dead (and killing its task).

mod common;

use std::path::Path;
use std::time::Duration;

use berth_allocrunner::{Driver, ExecutorCommand, RawExecDriver, TaskSpec};
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
