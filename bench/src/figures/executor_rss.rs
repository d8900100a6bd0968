//! The memory of a task's executor.
//!
//! A release dev agent runs one service job of `--tasks N` (default 20)
//! raw_exec tasks `sleep 3600`, one group of count N. Once every alloc
//! runs, the figure finds each task's executor through its state record
//! (`<alloc_dir>/.executor/<task>/state.json`, which names the executor's
//! and the task's pids; the task's parent must be the executor), and reads,
//! `--rounds R` times (default 5) a quarter second apart, each executor's
//! memory and, in the same round, its `sleep` task's:
//!
//! - VmRSS (`/proc/PID/status`), the number the target is on;
//! - Pss (`/proc/PID/smaps_rollup`): pages shared with other processes
//!   (the agent maps the same binary, every process maps libc) counted by
//!   their share, the more honest cost of one more executor;
//! - RssAnon and RssFile: private memory against mapped file pages.
//!
//! The baseline is the `sleep` task itself, measured in the same run: the
//! least any process that maps libc costs. Target: every executor's VmRSS
//! at most 3 MiB (Nomad's executor takes 15-20 MiB). `--mappings` also
//! prints the largest mappings of one executor (from `/proc/PID/smaps`),
//! to see where its memory goes.
//!
//! The executor measured is the one the agent picks: `berth-executor`,
//! the small executor-only binary next to `berth`, when its version
//! matches. `--agent-binary` measures the fallback instead, the agent's
//! own `berth executor`: the agent runs from a copy of `berth` in a temp
//! dir, with no `berth-executor` beside it. The figure prints the program
//! the executors run and fails unless it is the one the mode expects.
//!
//! With `--driver exec` the tasks run under the `exec` driver: each in
//! its cgroup and namespaces, under a small init (the executor program
//! with `--task-init`, PID 1 of the task's PID namespace) that the
//! executor starts and that starts `sleep`. The figure then reads the
//! init in the task's place: the executor and the init are what an exec
//! task costs beyond its own process.
//!
//! ```text
//! scripts/bench executor-rss [--tasks 20] [--rounds 5] [--mappings] [--agent-binary]
//!                            [--driver exec]
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{binary, wait_for, DevAgent};
use serde_json::Value;

use crate::report::{self, Mib, Sizes};

/// 3 MiB, in KiB.
const TARGET_KIB: u64 = 3 * 1024;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// How many tasks (and so executors) run at once.
    #[arg(long, default_value_t = 20)]
    pub tasks: u32,
    /// How many times every process is read, a quarter second apart.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// Also print the largest mappings of the executor with the median RSS.
    #[arg(long)]
    pub mappings: bool,
    /// Measure the fallback, the agent's own `berth executor`, instead of
    /// `berth-executor`.
    #[arg(long)]
    pub agent_binary: bool,
    /// The tasks' driver: raw_exec, or exec (the init is read in the
    /// task's place).
    #[arg(long, default_value = "raw_exec", value_parser = ["raw_exec", "exec"])]
    pub driver: String,
}

pub fn run(args: &Args) -> Result<()> {
    if args.tasks == 0 || args.rounds == 0 {
        bail!("--tasks and --rounds must be at least 1");
    }
    // Dropped after the agent (declared before it): the agent's binary
    // when it runs from a copy.
    let copy_dir = tempfile::Builder::new()
        .prefix("berth-bench-agent-")
        .tempdir()?;
    let (agent, expected) = start_agent(args, copy_dir.path())?;
    let pairs = run_sleepers(&agent, args.tasks, &args.driver)?;
    let program = checked_program(&pairs, &expected)?;
    let (exec, task) = measure_rounds(&pairs, args.rounds)?;
    report_memory(args, &program, &pairs, &exec, &task);
    if args.mappings {
        print_median_and_largest(&pairs)?;
    }
    Ok(())
}

/// A dev agent, from a copy of `berth` in `copy_dir` with
/// `--agent-binary`, and the program its executors are expected to run.
fn start_agent(args: &Args, copy_dir: &Path) -> Result<(DevAgent, String)> {
    Ok(if args.agent_binary {
        let copy = copy_dir.join("berth");
        std::fs::copy(binary("berth"), &copy)
            .with_context(|| format!("copying berth to {}", copy.display()))?;
        let agent = DevAgent::start_program(&copy, &[]).context("starting a dev agent")?;
        (
            agent,
            format!("{} executor", copy.canonicalize()?.display()),
        )
    } else {
        let agent = DevAgent::start().context("starting a dev agent")?;
        let program = binary("berth")
            .canonicalize()?
            .with_file_name("berth-executor");
        (agent, program.display().to_string())
    })
}

/// Run the sleepers job of `tasks` allocs on `agent`, wait until all run,
/// and find one executor and task per alloc.
fn run_sleepers(agent: &DevAgent, tasks: u32, driver: &str) -> Result<Vec<Pair>> {
    let job = agent.write_file("sleepers.hcl", &sleepers_job(tasks, driver))?;
    agent.cli_ok(&["job", "run", "-detach", &job])?;
    let n = tasks as usize;
    wait_for(
        &format!("{n} sleepers to run"),
        Duration::from_secs(60 + 3 * u64::from(tasks)),
        || {
            let running = agent
                .job_allocs("sleepers")?
                .iter()
                .filter(|a| a["client_status"] == "running")
                .count();
            Ok((running == n).then_some(()))
        },
    )
    .with_context(|| agent.log())?;
    let pairs = executors(agent.data_dir.path())?;
    if pairs.len() != n {
        bail!(
            "{n} tasks run but {} executors were found under {}",
            pairs.len(),
            agent.data_dir.path().display()
        );
    }
    Ok(pairs)
}

/// The program every executor of `pairs` runs; an error unless they all
/// run the same one and it is `expected`.
fn checked_program(pairs: &[Pair], expected: &str) -> Result<String> {
    let program = executor_program(pairs[0].executor)?;
    for p in pairs {
        let other = executor_program(p.executor)?;
        if other != program {
            bail!("executors run different programs: {program:?} and {other:?}");
        }
    }
    if program != expected {
        bail!("the executors run {program:?}, not {expected:?}");
    }
    Ok(program)
}

/// The memory of every executor and of its task, read `rounds` times a
/// quarter second apart.
fn measure_rounds(pairs: &[Pair], rounds: u32) -> Result<(Measured, Measured)> {
    let mut exec = Measured::default();
    let mut task = Measured::default();
    for round in 0..rounds {
        if round > 0 {
            std::thread::sleep(Duration::from_millis(250));
        }
        // Each executor, then at once its task: the two of a pair see the
        // same machine.
        for p in pairs {
            exec.push(read_memory(p.executor).with_context(|| format!("executor {p:?}"))?);
            task.push(read_memory(p.task).with_context(|| format!("task {p:?}"))?);
        }
    }
    Ok((exec, task))
}

/// The figure: the executors' memory against their tasks' and the target.
fn report_memory(args: &Args, program: &str, pairs: &[Pair], exec: &Measured, task: &Measured) {
    let n = args.tasks as usize;
    report::heading(
        "executor-rss",
        &format!(
            "memory of each task's executor, {n} {} `sleep 3600` tasks running, read {} times each",
            args.driver, args.rounds
        ),
    );
    // An exec task's executor runs an init, which runs `sleep`.
    let task_name = if args.driver == "exec" {
        "init"
    } else {
        "sleep"
    };
    report::value("executor program", program);
    report::sizes("executor VmRSS", &exec.rss);
    report::sizes("executor Pss", &exec.pss);
    report::sizes("executor RssAnon", &exec.anon);
    report::sizes("executor RssFile", &exec.file);
    report::sizes(&format!("{task_name} VmRSS (baseline)"), &task.rss);
    report::sizes(&format!("{task_name} Pss (baseline)"), &task.pss);
    report::value(
        "executor threads",
        threads(pairs[0].executor).map_or("?".to_string(), |t| t.to_string()),
    );
    report::value(
        &format!("executor over {task_name}, VmRSS"),
        format!(
            "{} ({:.2}x)",
            Mib(exec.rss.median().saturating_sub(task.rss.median())),
            exec.rss.median() as f64 / task.rss.median().max(1) as f64
        ),
    );
    report::value(
        &format!("executor over {task_name}, Pss"),
        format!(
            "{} ({:.2}x)",
            Mib(exec.pss.median().saturating_sub(task.pss.median())),
            exec.pss.median() as f64 / task.pss.median().max(1) as f64
        ),
    );
    report::target(
        &format!("every executor's VmRSS <= {}", Mib(TARGET_KIB)),
        exec.rss.max() <= TARGET_KIB,
    );
}

/// The largest mappings of the executors with the median and the largest
/// RSS, as they are now.
fn print_median_and_largest(pairs: &[Pair]) -> Result<()> {
    let mut now: Vec<(u64, u32)> = pairs
        .iter()
        .filter_map(|p| Some((read_memory(p.executor).ok()?.rss, p.executor)))
        .collect();
    now.sort_unstable();
    let mut shown = vec![now.get(now.len() / 2), now.last()];
    shown.dedup();
    for (_, pid) in shown.into_iter().flatten() {
        print_mappings(*pid)?;
    }
    Ok(())
}

pub fn smoke() -> Result<()> {
    run(&Args {
        tasks: 2,
        rounds: 2,
        mappings: false,
        agent_binary: false,
        driver: "raw_exec".into(),
    })
}

/// The program executor `pid` runs and its arguments before the state dir
/// (the last one): `/path/berth-executor` or `/path/berth executor`.
fn executor_program(pid: u32) -> Result<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("reading the program of executor {pid}"))?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("reading the command line of executor {pid}"))?;
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let middle = args
        .get(1..args.len().saturating_sub(1))
        .unwrap_or_default();
    let mut program = exe.display().to_string();
    for a in middle {
        program.push(' ');
        program.push_str(a);
    }
    Ok(program)
}

/// A service job of `count` allocs of one `driver` task, `sleep 3600`.
fn sleepers_job(count: u32, driver: &str) -> String {
    format!(
        r#"
job "sleepers" {{
  type = "service"
  group "g" {{
    count = {count}
    task "sleep" {{
      driver = "{driver}"
      config {{
        command = "/bin/sleep"
        args    = ["3600"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// One task's executor and the task it runs.
#[derive(Debug, Clone, Copy)]
struct Pair {
    executor: u32,
    task: u32,
}

/// Every running executor under agent data dir `data_dir`, with its task,
/// from the executors' state records; checked against the process tree
/// (the task is the executor's child).
fn executors(data_dir: &Path) -> Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    for alloc in read_dir(&data_dir.join("alloc"))? {
        for dir in read_dir(&alloc.join(".executor")).unwrap_or_default() {
            let path = dir.join("state.json");
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let state: Value = serde_json::from_slice(&bytes)
                .with_context(|| format!("decoding {}", path.display()))?;
            if state["status"] != "running" {
                continue;
            }
            let pid = |key: &str| {
                state[key]
                    .as_u64()
                    .and_then(|p| u32::try_from(p).ok())
                    .with_context(|| format!("{} has no {key}", path.display()))
            };
            let pair = Pair {
                executor: pid("executor_pid")?,
                task: pid("task_pid")?,
            };
            let parent = parent_pid(pair.task)
                .with_context(|| format!("the task of {} is not running", path.display()))?;
            if parent != pair.executor {
                bail!(
                    "{}: task {} has parent {parent}, not its executor {}",
                    path.display(),
                    pair.task,
                    pair.executor
                );
            }
            pairs.push(pair);
        }
    }
    Ok(pairs)
}

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        paths.push(entry?.path());
    }
    Ok(paths)
}

/// A field of `/proc/PID/status` in KiB (`VmRSS:  1234 kB`) or a count.
fn status_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn parent_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&status, "PPid").and_then(|p| u32::try_from(p).ok())
}

fn threads(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&status, "Threads")
}

/// One reading of one process, in KiB.
#[derive(Debug, Clone, Copy)]
struct Memory {
    rss: u64,
    pss: u64,
    anon: u64,
    file: u64,
}

#[derive(Default)]
struct Measured {
    rss: Sizes,
    pss: Sizes,
    anon: Sizes,
    file: Sizes,
}

impl Measured {
    fn push(&mut self, m: Memory) {
        self.rss.push(m.rss);
        self.pss.push(m.pss);
        self.anon.push(m.anon);
        self.file.push(m.file);
    }
}

fn read_memory(pid: u32) -> Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("process {pid} is gone"))?;
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .with_context(|| format!("reading the smaps of process {pid}"))?;
    let field = |text: &str, name: &str| {
        status_field(text, name).with_context(|| format!("process {pid} shows no {name}"))
    };
    Ok(Memory {
        rss: field(&status, "VmRSS")?,
        pss: field(&rollup, "Pss")?,
        anon: field(&status, "RssAnon")?,
        file: field(&status, "RssFile")?,
    })
}

/// Prints the mappings of `pid` that hold the most resident memory.
fn print_mappings(pid: u32) -> Result<()> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .with_context(|| format!("reading the smaps of process {pid}"))?;
    // (rss, pss, anon, name)
    let mut maps: Vec<(u64, u64, u64, String)> = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            let perms = words.next().unwrap_or_default();
            let name = words.nth(3).unwrap_or("[anon]");
            maps.push((0, 0, 0, format!("{perms} {name}")));
        } else if let Some(m) = maps.last_mut() {
            let mut value = || words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            match first {
                "Rss:" => m.0 = value(),
                "Pss:" => m.1 = value(),
                "Anonymous:" => m.2 = value(),
                _ => {}
            }
        }
    }
    maps.sort_by_key(|m| std::cmp::Reverse(m.0));
    println!("  largest mappings of executor {pid} (KiB):");
    println!("    {:>6} {:>6} {:>6}  mapping", "rss", "pss", "anon");
    for (rss, pss, anon, name) in maps.iter().take(16).filter(|m| m.0 > 0) {
        println!("    {rss:>6} {pss:>6} {anon:>6}  {name}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read_by_name() {
        let status = "Name:\tsleep\nPPid:\t42\nVmRSS:\t    1560 kB\nRssAnon:\t  100 kB\n";
        assert_eq!(status_field(status, "VmRSS"), Some(1560));
        assert_eq!(status_field(status, "PPid"), Some(42));
        assert_eq!(status_field(status, "Rss"), None);
        assert_eq!(status_field(status, "RssFile"), None);
    }
}
