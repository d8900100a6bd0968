//! `berth-executor`, the executor-only binary: its `--version` answer is
//! the one the agent looks for, so the agent built with it picks it, bad
//! arguments are a usage error, and it reports on its stdout once its task's
//! state is recorded.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use berth_allocrunner::driver::{executor_version_line, ExecutorCommand};
use berth_allocrunner::executor::{self, ExecutorSpec, ExecutorState};

fn berth_executor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_berth-executor"))
        .args(args)
        .output()
        .expect("running berth-executor")
}

#[test]
fn berth_executor_answers_version_with_the_agents_version_and_protocol() {
    let out = berth_executor(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        executor_version_line(env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn the_agent_picks_the_berth_executor_built_beside_it() {
    let agent = Path::new(env!("CARGO_BIN_EXE_berth"));
    let (command, fallback) = ExecutorCommand::choose(agent, env!("CARGO_PKG_VERSION"));
    assert_eq!(fallback, None);
    assert_eq!(
        command.program,
        Path::new(env!("CARGO_BIN_EXE_berth-executor"))
    );
    assert!(command.args.is_empty(), "{command:?}");
}

#[test]
fn berth_executor_rejects_bad_arguments_with_its_usage() {
    for args in [&[][..], &["a", "b"], &["--help"], &["-x"]] {
        let out = berth_executor(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("usage: berth-executor"),
            "{args:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
}

/// The report the agent waits on: one [`executor::STATE_WRITTEN`] byte on
/// stdout, written only once `state.json` records the running task, and
/// nothing after it (its stdout is let go while the task still runs).
#[test]
fn berth_executor_reports_on_stdout_once_the_tasks_state_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("executor");
    std::fs::create_dir(&state_dir).unwrap();
    let spec = ExecutorSpec {
        command: "/bin/sleep".into(),
        args: vec!["1000".into()],
        env: Default::default(),
        cwd: dir.path().to_path_buf(),
        stdout_path: dir.path().join("t.stdout"),
        stderr_path: dir.path().join("t.stderr"),
        logs: Default::default(),
        cgroup_procs: Vec::new(),
        isolation: None,
        run_as: None,
        disconnect: None,
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_berth-executor"))
        .arg(&state_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("running berth-executor");
    /// Kills the task's group and the executor, also when the test fails.
    struct Cleanup(std::process::Child, std::path::PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Ok(Some(ExecutorState::Running { pgid, .. })) =
                executor::read_record::<ExecutorState>(&self.1, executor::STATE_FILE)
            {
                if pgid > 1 {
                    let _ = nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(pgid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut child = Cleanup(child, state_dir.clone());
    stdin
        .write_all(&serde_json::to_vec(&spec).unwrap())
        .unwrap();
    drop(stdin);

    // Returns once the executor has written its report or let go of its
    // stdout; the task (sleep 1000) runs on either way.
    let mut report = Vec::new();
    stdout.read_to_end(&mut report).unwrap();
    assert_eq!(
        report,
        [executor::STATE_WRITTEN],
        "one report byte, nothing else"
    );
    let state = executor::read_record::<ExecutorState>(&state_dir, executor::STATE_FILE)
        .unwrap()
        .expect("state.json is written before the report");
    let ExecutorState::Running { executor_pid, .. } = state else {
        panic!("the task did not start: {state:?}");
    };
    assert_eq!(executor_pid, child.0.id());
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the executor still runs its task"
    );
}
