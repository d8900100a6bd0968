//! `berth`: one binary for every role. `berth agent -dev` runs a server and
//! a client in one process; `berth executor` (hidden) is the per-task
//! executor that the client starts under every task; `berth config
//! validate` checks agent config files; every other command talks to the
//! HTTP API.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("agent") {
        // A CLI command piped into `head` ends quietly, as other Unix tools
        // do, instead of failing on a closed stdout.
        // SAFETY: resetting a signal's disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // Hidden: the per-task executor the raw_exec driver starts. Its
    // arguments are internal, so clap never sees them.
    if args.first().map(String::as_str) == Some("executor") {
        std::process::exit(berth_allocrunner::executor::run_executor(&args[1..]));
    }
    let code = match berth_cli::run(args, &berth::AgentHost) {
        Ok(code) => code,
        Err(e) => berth_cli::errors::report(&e),
    };
    std::process::exit(code);
}
