//! `client-rss`: the resident memory of a client agent, alone in its
//! process (a separate server agent holds the cluster state), in three
//! states:
//!
//! 1. idle: registered with the servers and heartbeating, no alloc;
//! 2. with N running tasks: one service job of N allocs, each one raw_exec
//!    task (`sleep 3600`), all running in the servers' view;
//! 3. with N tasks sharing M CSI volumes: a fresh cluster, the example
//!    hostpath plugin running on the client, M multi-node-multi-writer
//!    volumes created through it, and N/M jobs of M allocs each, alloc i of
//!    every job mounting volume `v[i]` (each volume staged once and
//!    published N/M times), all running.
//!
//! Each state is measured once the servers see every alloc running and the
//! client has settled (6 s, past the moment it trims its heap after a
//! change): VmRSS and Pss (`/proc/PID/smaps_rollup`; Pss shares
//! out the pages of the berth binary that the tasks' executors map too)
//! are sampled five times over two seconds and the highest is printed.
//! The baseline is the idle client of the same run; the growth table over
//! `--sizes` shows the state each running task costs (KiB per task above
//! idle).
//!
//! Target (release build): idle ≤ 25 MiB; with 200 tasks ≤ 60 MiB; with 200
//! tasks on 50 volumes ≤ 60 MiB.
//!
//! ```text
//! scripts/bench client-rss                       # --tasks 200 --volumes 50
//! scripts/bench client-rss --sizes 20,100,200    # growth, tasks only
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cluster::{self, BenchClient, BenchServer};
use crate::report::{self, Mib};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Running tasks (one alloc each).
    #[arg(long, default_value_t = 200)]
    pub tasks: u32,
    /// CSI volumes the tasks share in the third state (0 skips it); must
    /// divide --tasks.
    #[arg(long, default_value_t = 50)]
    pub volumes: u32,
    /// Task counts for the growth table (the tasks state is measured at
    /// each, ascending); defaults to --tasks alone.
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<u32>,
}

/// Memory of one process, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    pub rss_kib: u64,
    pub pss_kib: u64,
}

/// VmRSS and Pss of `pid`, from `/proc/PID/smaps_rollup`.
pub fn memory_of(pid: u32) -> Result<Memory> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |name: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no {name} in {path}"))
    };
    Ok(Memory {
        rss_kib: field("Rss:")?,
        pss_kib: field("Pss:")?,
    })
}

/// How long a client is left to settle after the last change before its
/// memory is sampled: longer than the 5 s after which a client whose
/// allocs changed gives the heap's free pages back to the kernel.
const SETTLE: Duration = Duration::from_secs(6);

/// The highest of five samples over two seconds, once the client has
/// settled ([`SETTLE`]) after the last change.
fn settled_memory(client: &mut BenchClient) -> Result<Memory> {
    std::thread::sleep(SETTLE);
    let mut high = Memory::default();
    for i in 0..5 {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(500));
        }
        client.agent.check_running()?;
        let m = memory_of(client.pid()?)?;
        high.rss_kib = high.rss_kib.max(m.rss_kib);
        high.pss_kib = high.pss_kib.max(m.pss_kib);
    }
    Ok(high)
}

fn show(label: &str, m: Memory, extra: &str) {
    report::value(
        label,
        format!("RSS {}  Pss {}{extra}", Mib(m.rss_kib), Mib(m.pss_kib)),
    );
}

/// `  (all running N.N s after the job was submitted)`.
fn running_after(started: Instant) -> String {
    format!(
        "  (all running {:.1} s after submitting)",
        started.elapsed().as_secs_f64()
    )
}

/// How long the allocs of `count` tasks may take to run on a loaded
/// machine.
fn run_timeout(count: u32) -> Duration {
    Duration::from_secs(60 + u64::from(count) / 2)
}

pub fn run(args: &Args) -> Result<()> {
    let sizes = checked_sizes(args)?;
    report::heading(
        "client-rss",
        &format!(
            "client agent RSS: idle, with {} tasks, with {} tasks on {} CSI volumes",
            sizes
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            args.tasks,
            args.volumes
        ),
    );
    let (idle, with_tasks) = measure_idle_and_tasks(args, &sizes)?;
    let with_volumes = if args.volumes > 0 {
        Some(measure_shared_volumes(args)?)
    } else {
        None
    };
    report_against_targets(args, idle, with_tasks, with_volumes);
    Ok(())
}

/// The task counts to measure (`--sizes`, else `--tasks`), ascending and
/// distinct; an error when one is 0 or `--volumes` does not divide
/// `--tasks`.
fn checked_sizes(args: &Args) -> Result<Vec<u32>> {
    let mut sizes = if args.sizes.is_empty() {
        vec![args.tasks]
    } else {
        args.sizes.clone()
    };
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.first() == Some(&0) {
        bail!("--sizes: a size is at least 1 task");
    }
    if args.volumes > 0 && !args.tasks.is_multiple_of(args.volumes) {
        bail!(
            "--volumes {} must divide --tasks {}: each volume is shared by the same number of allocs",
            args.volumes,
            args.tasks
        );
    }
    Ok(sizes)
}

/// Idle, then the tasks at each size: the idle memory and the memory with
/// `--tasks` tasks (when that is one of `sizes`).
fn measure_idle_and_tasks(args: &Args, sizes: &[u32]) -> Result<(Memory, Option<Memory>)> {
    let server = BenchServer::start()?;
    let mut client = BenchClient::start(&server, "rss-tasks")?;
    let idle = settled_memory(&mut client)?;
    show("idle (baseline)", idle, "");
    let mut points = Vec::new();
    let mut at_tasks = None;
    for &n in sizes {
        let started = Instant::now();
        server.run_job("sleepers", &cluster::sleep_job("sleepers", n, None))?;
        server.wait_job_running("sleepers", n as usize, run_timeout(n))?;
        let took = running_after(started);
        let m = settled_memory(&mut client)?;
        show(&format!("{n} tasks"), m, &took);
        let per_task = m.rss_kib.saturating_sub(idle.rss_kib) as f64 / f64::from(n);
        report::value(
            &format!("  per task above idle ({n})"),
            format!("{per_task:.1} KiB"),
        );
        points.push((f64::from(n), m.rss_kib as f64 / 1024.0));
        if n == args.tasks {
            at_tasks = Some(m);
        }
    }
    if points.len() >= 2 {
        report::growth_table("client RSS over running tasks", "MiB", &points);
    }
    Ok((idle, at_tasks))
}

/// Tasks sharing CSI volumes, on a fresh cluster: the memory with
/// `--tasks` tasks on `--volumes` volumes.
fn measure_shared_volumes(args: &Args) -> Result<Memory> {
    let server = BenchServer::start()?;
    let mut client = BenchClient::start(&server, "rss-volumes")?;
    server.run_example_job("jobs/hostpath-plugin.hcl")?;
    server.wait_plugin_nodes("hostpath", 1)?;
    for i in 0..args.volumes {
        let id = format!("v[{i}]");
        server.create_volume(&format!("v{i}"), &cluster::shared_volume(&id))?;
    }
    let plugin_only = settled_memory(&mut client)?;
    show(
        &format!("plugin running, {} volumes", args.volumes),
        plugin_only,
        "",
    );
    let jobs = args.tasks / args.volumes;
    let started = Instant::now();
    for j in 0..jobs {
        let job = format!("shared-{j}");
        server.run_job(&job, &cluster::sleep_job(&job, args.volumes, Some("v")))?;
    }
    for j in 0..jobs {
        let job = format!("shared-{j}");
        server.wait_job_running(&job, args.volumes as usize, run_timeout(args.tasks))?;
    }
    let took = running_after(started);
    let m = settled_memory(&mut client)?;
    show(
        &format!("{} tasks on {} volumes", args.tasks, args.volumes),
        m,
        &took,
    );
    Ok(m)
}

/// The ratios to idle and the targets: idle <= 25 MiB, with tasks and
/// with volumes <= 60 MiB.
fn report_against_targets(
    args: &Args,
    idle: Memory,
    with_tasks: Option<Memory>,
    with_volumes: Option<Memory>,
) {
    let mib = |kib: u64| kib as f64 / 1024.0;
    report::value(
        "ratio to idle",
        match (with_tasks, with_volumes) {
            (Some(t), Some(v)) => format!(
                "{:.2}x with tasks, {:.2}x with volumes",
                mib(t.rss_kib) / mib(idle.rss_kib),
                mib(v.rss_kib) / mib(idle.rss_kib)
            ),
            (Some(t), None) => format!("{:.2}x with tasks", mib(t.rss_kib) / mib(idle.rss_kib)),
            (None, Some(v)) => format!("{:.2}x with volumes", mib(v.rss_kib) / mib(idle.rss_kib)),
            (None, None) => "-".into(),
        },
    );
    let mut met = mib(idle.rss_kib) <= 25.0;
    let mut text = format!("idle <= 25 MiB ({:.2})", mib(idle.rss_kib));
    if let Some(t) = with_tasks {
        met &= mib(t.rss_kib) <= 60.0;
        text.push_str(&format!(
            ", {} tasks <= 60 MiB ({:.2})",
            args.tasks,
            mib(t.rss_kib)
        ));
    }
    if let Some(v) = with_volumes {
        met &= mib(v.rss_kib) <= 60.0;
        text.push_str(&format!(
            ", {} tasks on {} volumes <= 60 MiB ({:.2})",
            args.tasks,
            args.volumes,
            mib(v.rss_kib)
        ));
    }
    report::target(&text, met);
}

pub fn smoke() -> Result<()> {
    run(&Args {
        tasks: 2,
        volumes: 1,
        sizes: Vec::new(),
    })
}
