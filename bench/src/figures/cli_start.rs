//! `cli-start`: what one `berth` CLI process costs before and around its
//! work.
//!
//! Measured, round by round in turn: `berth version` (no request: the
//! process's start, argument parsing and exit) and `berth node status
//! -json` against a release `berth agent -dev` of this build (one read
//! round trip), each from spawn to exit, and for each the CPU time (user
//! and system) and the page faults the process took, from `wait4`'s
//! resource usage. Every CLI call an operator or a script makes pays
//! this start.
//!
//! Baseline, interleaved: a spawn of `/bin/true`, the floor of any
//! process.
//!
//! Target: `berth version` median ≤ 1 ms above the baseline's.
//!
//! ```text
//! scripts/bench cli-start [--rounds 200] [--warmup 10]
//! scripts/bench ab REV cli-start
//! ```

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use berth_tests::{binary, DevAgent};

use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured rounds (each one process of every kind)
    #[arg(long, default_value_t = 200)]
    pub rounds: usize,
    /// Unmeasured rounds first (warm the page cache and the agent)
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
}

/// One process, run to its exit: wall time, CPU time, page faults.
struct Run {
    wall: Duration,
    cpu: Duration,
    faults: u64,
}

/// Spawns `cmd` (stdout and stderr to /dev/null) and reaps it with
/// `wait4` for its resource usage; an error unless it exits 0.
fn timed(cmd: &mut Command) -> Result<Run> {
    let start = Instant::now();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let pid = libc::pid_t::try_from(child.id()).context("a pid")?;
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is this process's child, not yet reaped (the Child is
    // never waited on); both pointers are to live locals.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let wall = start.elapsed();
    ensure!(
        reaped == pid,
        "wait4 of {cmd:?}: {}",
        std::io::Error::last_os_error()
    );
    ensure!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} ended with wait status {status:#x}"
    );
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    Ok(Run {
        wall,
        cpu: time(usage.ru_utime) + time(usage.ru_stime),
        faults: u64::try_from(usage.ru_minflt + usage.ru_majflt).unwrap_or(0),
    })
}

/// One kind of process's rounds.
#[derive(Default)]
struct Kind {
    wall: Samples,
    cpu: Samples,
    faults: Vec<u64>,
}

impl Kind {
    fn push(&mut self, run: Run) {
        self.wall.push(run.wall);
        self.cpu.push(run.cpu);
        self.faults.push(run.faults);
    }

    fn print(&mut self, label: &str) {
        report::samples(label, &self.wall);
        report::samples(&format!("{label} CPU time"), &self.cpu);
        self.faults.sort_unstable();
        let median = self.faults.get(self.faults.len() / 2).copied();
        report::value(
            &format!("{label} page faults"),
            format!("{} (median)", median.unwrap_or(0)),
        );
    }
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let berth = binary("berth");
    report::heading(
        "cli-start",
        &format!(
            "`berth version` and `berth node status -json` against /bin/true, spawn to exit; {} rounds after {} warm-up ({})",
            args.rounds,
            args.warmup,
            berth.display()
        ),
    );
    // The agent is this build's whatever CLI is measured (`berth-bench
    // ab` points `binary` at an older build's): both CLIs ask the same
    // agent, and an older CLI need not start an agent of today's flags.
    let exe = std::env::current_exe().context("the bench's own path")?;
    let agent = DevAgent::start_program(&exe.with_file_name("berth"), &[])?;
    let (mut floor, mut version, mut status) = (Kind::default(), Kind::default(), Kind::default());
    for round in 0..args.warmup + args.rounds {
        let t = timed(&mut Command::new("/bin/true"))?;
        let v = timed(Command::new(&berth).arg("version"))?;
        let s = timed(
            Command::new(&berth)
                .args(["node", "status", "-json"])
                .env("BERTH_ADDR", &agent.http_addr),
        )
        .with_context(|| format!("round {round}; agent log:\n{}", agent.log()))?;
        if round >= args.warmup {
            floor.push(t);
            version.push(v);
            status.push(s);
        }
    }
    floor.print("true (baseline)");
    version.print("version");
    status.print("node status");
    report::ratio_line("version / baseline", &version.wall, &floor.wall);
    let above = version.wall.median().saturating_sub(floor.wall.median());
    report::value("version above baseline", report::Ms(above));
    report::target(
        "berth version <= 1 ms above the baseline",
        above <= Duration::from_millis(1),
    );
    Ok(())
}

pub fn smoke() -> Result<()> {
    run(&Args {
        rounds: 3,
        warmup: 1,
    })
}
