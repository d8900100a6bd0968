//! `berth-executor`: the per-task executor alone, the program the agent
//! runs under every `raw_exec` task when it is installed next to the
//! agent's binary (see `ExecutorCommand::for_agent`). It runs the same
//! [`berth_allocrunner::executor::run_executor`] as the agent's hidden
//! `berth executor` subcommand, but links only that: a small binary, so
//! each task's executor holds less memory than the agent's binary would.
//!
//! ```text
//! berth-executor STATE_DIR    (internal; the spec is read from stdin)
//! berth-executor --version    berth-executor VERSION protocol N
//! ```

use std::process::exit;

use berth_allocrunner::driver::executor_version_line;

fn main() {
    let mut args = Vec::new();
    for arg in std::env::args_os().skip(1) {
        match arg.into_string() {
            Ok(a) => args.push(a),
            Err(a) => usage(&format!("argument {a:?} is not UTF-8")),
        }
    }
    match args.as_slice() {
        [flag] if flag == "--version" || flag == "-V" => {
            println!("{}", executor_version_line(env!("CARGO_PKG_VERSION")));
        }
        // The init of an isolated task, which its executor starts.
        [flag] if flag == berth_allocrunner::isolation::INIT_FLAG => {
            exit(berth_allocrunner::executor::run_executor(&args))
        }
        [flag] if flag.starts_with('-') => usage(&format!("unknown flag {flag:?}")),
        [_state_dir] => exit(berth_allocrunner::executor::run_executor(&args)),
        [] => usage("no state dir given"),
        _ => usage(&format!("one argument expected, got {}", args.len())),
    }
}

fn usage(error: &str) -> ! {
    eprintln!(
        "berth-executor: {error}\n\
         usage: berth-executor STATE_DIR  (internal: the agent runs it under each task, the spec on stdin)\n\
         \x20      berth-executor --version"
    );
    exit(2)
}
