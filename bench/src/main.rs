//! `berth-bench`: berth's performance figures, one subcommand each. Every
//! figure runs the real release binaries (next to this one in
//! `target/release/`), prints its median and p99 and, where it has a
//! baseline, measures the baseline in the same run and prints the ratio:
//! this kind of machine is noisy, ratios hold where absolute times do not.
//!
//! ```text
//! scripts/bench job-run            # builds the release binaries, then runs
//! scripts/bench smoke              # every figure at a tiny size
//! scripts/bench ab main~3 job-run  # against main~3's binaries, in turn
//! ```
//!
//! Nothing here is part of `cargo test`; CI runs `smoke` (debug build) so
//! that no figure can rot.

mod ab;
mod cluster;
mod figures;
mod report;
mod sim;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use figures::*;

#[derive(Parser)]
#[command(name = "berth-bench", about = "berth's performance figures")]
struct Cli {
    #[command(subcommand)]
    figure: Figure,
}

#[derive(Subcommand)]
enum Figure {
    /// `berth job run` of a batch job to its completion, no volume, against
    /// one CLI read round trip plus a fork/exec of the task's command.
    JobRun(job_run::Args),
    /// The same batch job with one CSI volume (example plugin), against the
    /// job without a volume.
    JobRunCsi(job_run_csi::Args),
    /// `job stop` to the volume's claim freed on the servers, with and
    /// without controller attach.
    StopClaimFree(stop_claim_free::Args),
    /// RSS of a task's executor, against the RSS of `sleep`.
    ExecutorRss(executor_rss::Args),
    /// RSS of a client agent: idle, with N running tasks, and with N tasks
    /// sharing M CSI volumes.
    ClientRss(client_rss::Args),
    /// A client agent SIGKILLed with N running tasks: time until every task
    /// is reattached and reported running again.
    Reattach(reattach::Args),
    /// A server with N simulated nodes heartbeating, their allocs and
    /// volumes: heartbeat latency and the server's RSS.
    ServerScale(server_scale::Args),
    /// N volume claims released at once (their allocs stopped together):
    /// time until all are free, and the rate.
    ClaimsRelease(claims_release::Args),
    /// The scheduler placing an N-alloc job on N nodes.
    Scheduler(scheduler::Args),
    /// Job submissions while N volume claims are released at once, with
    /// the scheduler planning on a snapshot and inside the store's writer.
    ConcurrentWriters(concurrent_writers::Args),
    /// Job submit latency and placement throughput of a server on the
    /// embedded store against one on etcd, in one run.
    Stores(stores::Args),
    /// What one CLI process costs: `berth version` and a read round trip,
    /// spawn to exit, CPU time and page faults, against /bin/true.
    CliStart(cli_start::Args),
    /// Every figure at a tiny size, so that none can rot (CI runs this).
    Smoke,
    /// One figure against an older build's binaries and this build's, in
    /// turn, side by side (`scripts/bench ab REV FIGURE` builds REV's).
    Ab(ab::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.figure {
        Figure::JobRun(a) => job_run::run(&a),
        Figure::JobRunCsi(a) => job_run_csi::run(&a),
        Figure::StopClaimFree(a) => stop_claim_free::run(&a),
        Figure::ExecutorRss(a) => executor_rss::run(&a),
        Figure::ClientRss(a) => client_rss::run(&a),
        Figure::Reattach(a) => reattach::run(&a),
        Figure::ServerScale(a) => server_scale::run(&a),
        Figure::ClaimsRelease(a) => claims_release::run(&a),
        Figure::Scheduler(a) => scheduler::run(&a),
        Figure::ConcurrentWriters(a) => concurrent_writers::run(&a),
        Figure::Stores(a) => stores::run(&a),
        Figure::CliStart(a) => cli_start::run(&a),
        Figure::Smoke => smoke(),
        Figure::Ab(a) => ab::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Every figure at its smoke size, one after another; the first failure
/// ends the run.
fn smoke() -> anyhow::Result<()> {
    type SmokeRun = fn() -> anyhow::Result<()>;
    let figures: [(&str, SmokeRun); 12] = [
        ("job-run", job_run::smoke),
        ("job-run-csi", job_run_csi::smoke),
        ("stop-claim-free", stop_claim_free::smoke),
        ("executor-rss", executor_rss::smoke),
        ("client-rss", client_rss::smoke),
        ("reattach", reattach::smoke),
        ("server-scale", server_scale::smoke),
        ("claims-release", claims_release::smoke),
        ("scheduler", scheduler::smoke),
        ("concurrent-writers", concurrent_writers::smoke),
        ("stores", stores::smoke),
        ("cli-start", cli_start::smoke),
    ];
    for (name, run) in figures {
        println!("== smoke: {name}");
        run().map_err(|e| e.context(format!("smoke run of {name}")))?;
    }
    Ok(())
}
