//! The per-task executor alone, for this crate's own tests: the agent runs
//! the same [`berth_allocrunner::executor::run_executor`] as its hidden
//! `berth executor` subcommand, but this crate cannot depend on the agent,
//! and cargo builds this binary before the crate's integration tests and
//! tells them where it is (`CARGO_BIN_EXE_berth-allocrunner-executor`).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(berth_allocrunner::executor::run_executor(&args));
}
