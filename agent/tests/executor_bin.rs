//! `berth-executor`, the executor-only binary: its `--version` answer is
//! the one the agent looks for, so the agent built with it picks it, and
//! bad arguments are a usage error.

use std::path::Path;
use std::process::{Command, Output};

use berth_allocrunner::driver::{executor_version_line, ExecutorCommand};

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
