//! `berth-chaos`: faults at random moments against a real berth cluster
//! on this machine, and berth's promises checked after each (see
//! `checks`). The cluster is the one `world` describes; the faults are
//! `faults`'; every choice comes from one seeded generator, so a run's
//! seed replays its schedule.
//!
//! ```text
//! berth-chaos [--seed S] [--faults N] [--duration D] [--report FILE] [--only KINDS]
//! ```
//!
//! A run ends after `--faults` faults or `--duration`, whichever comes
//! first, or after the fault in progress on SIGINT or SIGTERM (the cluster
//! is taken down either way). It exits 0 when no promise was broken; else it prints the seed,
//! the schedule so far and each violation, with the agents' logs, and
//! exits 1. `--report` writes the run as JSON: the seed, the faults by
//! kind, the settle times, the checks made and the violations.

mod checks;
mod corrupt;
mod faults;
mod rng;
mod sampler;
mod workload;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::json;

use crate::faults::Fault;
use crate::rng::Rng;
use crate::world::{World, SETTLE_WITHIN};

#[derive(Parser, Debug)]
#[command(
    name = "berth-chaos",
    about = "Faults at random moments against a real berth cluster"
)]
struct Args {
    /// The seed of the schedule (default: a fresh one, printed)
    #[arg(long)]
    seed: Option<u64>,
    /// How many faults to inject
    #[arg(long, default_value_t = 40)]
    faults: usize,
    /// Stop after this long even if faults are left (e.g. 10m)
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Write the run's report (JSON) here
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Inject only faults of these kinds (comma separated: kill_client,
    /// corrupt_record, ...)
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(Fault::KINDS))]
    only: Vec<String>,
    /// Run `berth system gc` every this many faults, as the operator of a
    /// long-lived cluster would: the batch job's versions and done allocs
    /// are collected, not carried by every settle (0: never)
    #[arg(long, default_value_t = 100, value_name = "FAULTS")]
    gc_every: usize,
}

/// One fault of the run, as the report and the schedule show it.
struct Done {
    fault: Fault,
    /// What the fault and the workload did, in words.
    what: Vec<String>,
    at: Duration,
    settle: Option<Duration>,
}

/// Set by SIGINT or SIGTERM: the run ends after the fault in progress,
/// and the cluster is taken down (its agents, tasks and mounts).
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn interrupt(_: nix::libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to [`interrupt`]: sigaction(2), which nix
/// leaves unsafe.
#[allow(unsafe_code)]
fn catch_interrupts() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(interrupt),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is
        // async-signal-safe.
        if let Err(e) = unsafe { sigaction(signal, &action) } {
            eprintln!("berth-chaos: catching {signal}: {e}");
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    catch_interrupts();
    let seed = args.seed.unwrap_or_else(rng::fresh_seed);
    println!(
        "berth-chaos: seed {seed} (replay with --seed {seed}), {} faults",
        args.faults
    );
    let started = Instant::now();
    let mut done = Vec::new();
    let mut violations = Vec::new();
    let outcome = run(&args, seed, &mut done, &mut violations);
    let report = report(
        seed,
        started.elapsed(),
        &done,
        &violations,
        outcome.as_ref().err(),
    );
    if let Some(path) = &args.report {
        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("berth-chaos: writing the report to {}: {e}", path.display());
        }
    }
    println!("{}", summary(&report));
    if outcome.is_ok() && violations.is_empty() {
        return ExitCode::SUCCESS;
    }
    eprintln!("berth-chaos: FAILED with seed {seed} (replay with --seed {seed})");
    eprintln!("schedule:");
    for (i, d) in done.iter().enumerate() {
        eprintln!(
            "  {i:>4} at {:>7.1?} {}: {}",
            d.at,
            d.fault,
            d.what.join("; ")
        );
    }
    for (fault, v) in &violations {
        eprintln!("violation after fault {fault}: {v}");
    }
    if let Err(e) = &outcome {
        eprintln!("the run stopped: {e:#}");
    }
    ExitCode::FAILURE
}

/// Starts the world and runs the faults; what each did goes to `done`,
/// each broken promise (with the fault's number) to `violations`. An error
/// is a run that could not go on (the harness, not a promise).
fn run(
    args: &Args,
    seed: u64,
    done: &mut Vec<Done>,
    violations: &mut Vec<(usize, String)>,
) -> Result<()> {
    let mut rng = Rng::new(seed);
    let started = Instant::now();
    let mut world = World::start().context("starting the cluster")?;
    if let Err(why) = checks::settle(&mut world, SETTLE_WITHIN) {
        anyhow::bail!("the cluster did not settle before the first fault: {why}");
    }
    println!("berth-chaos: the cluster runs; faults start");
    let mut failed_at = None;
    for i in 0..args.faults {
        if args.duration.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            println!("berth-chaos: interrupted; taking the cluster down");
            break;
        }
        let at = started.elapsed();
        let fault = loop {
            let f = Fault::pick(&mut rng, world.clients.len());
            if args.only.is_empty() || args.only.iter().any(|k| k == f.kind()) {
                break f;
            }
        };
        let mut what = Vec::new();
        if i > 0 && args.gc_every > 0 && i % args.gc_every == 0 {
            what.push(world.collect_garbage().context("the garbage collection")?);
        }
        if rng.below(2) == 0 {
            what.push(world.churn(&mut rng).context("the workload")?);
        }
        what.push(
            fault
                .apply(&mut world, &mut rng)
                .with_context(|| format!("fault {i}: {fault}"))?,
        );
        let settled = checks::settle(&mut world, SETTLE_WITHIN);
        let found = checks::after_fault(&mut world, &settled);
        println!(
            "{i:>4} {:>8.1?} {:<14} settled in {:>6} {}",
            at,
            fault.kind(),
            settled
                .as_ref()
                .map_or("-".into(), |d| format!("{:.1?}", d)),
            what.join("; ")
        );
        done.push(Done {
            fault,
            what,
            at,
            settle: settled.ok(),
        });
        if !found.is_empty() {
            violations.extend(found.into_iter().map(|v| (i, v)));
            failed_at = Some(i);
            break;
        }
    }
    if let Some(i) = failed_at {
        eprintln!("the agents' logs after fault {i}:\n{}", world.logs());
    }
    Ok(())
}

/// The run as JSON.
fn report(
    seed: u64,
    took: Duration,
    done: &[Done],
    violations: &[(usize, String)],
    stopped: Option<&anyhow::Error>,
) -> serde_json::Value {
    let mut settles: Vec<u128> = done
        .iter()
        .filter_map(|d| d.settle)
        .map(|d| d.as_millis())
        .collect();
    settles.sort_unstable();
    let quantile = |q: f64| -> Option<u128> {
        (!settles.is_empty()).then(|| settles[((settles.len() - 1) as f64 * q).round() as usize])
    };
    let by_kind: serde_json::Map<String, serde_json::Value> = Fault::KINDS
        .iter()
        .map(|k| {
            (
                k.to_string(),
                json!(done.iter().filter(|d| d.fault.kind() == *k).count()),
            )
        })
        .collect();
    json!({
        "seed": seed,
        "duration_s": took.as_secs_f64(),
        "faults": done.len(),
        "faults_by_kind": by_kind,
        "settle_ms": { "median": quantile(0.5), "p99": quantile(0.99), "max": settles.last() },
        "checks": done.len(),
        "violations": violations.iter().map(|(i, v)| json!({ "after_fault": i, "what": v })).collect::<Vec<_>>(),
        "stopped": stopped.map(|e| format!("{e:#}")),
        "schedule": done.iter().map(|d| json!({
            "at_ms": d.at.as_millis(),
            "fault": d.fault.to_string(),
            "what": d.what,
            "settle_ms": d.settle.map(|s| s.as_millis()),
        })).collect::<Vec<_>>(),
    })
}

/// One line of the report.
fn summary(r: &serde_json::Value) -> String {
    format!(
        "berth-chaos: seed {} {} faults in {:.0} s {} settle median {} ms p99 {} ms; {} violations",
        r["seed"],
        r["faults"],
        r["duration_s"].as_f64().unwrap_or(0.0),
        r["faults_by_kind"],
        r["settle_ms"]["median"],
        r["settle_ms"]["p99"],
        r["violations"].as_array().map_or(0, Vec::len),
    )
}
