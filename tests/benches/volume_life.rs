//! How long a volume's life takes on a dev agent, and what the agent costs
//! in memory while it runs it: the real binary, the real plugin, real
//! mounts.
//!
//! For each of N rounds a batch job claims the volume, mounts it, writes to
//! it and exits; the round is timed from `job run` to the job's completion
//! (claim, ControllerPublish when attached, stage, publish, bind, task,
//! unbind, unpublish, unstage) and to the claim being freed on the servers.
//!
//!     cargo build --release --workspace --bins
//!     cargo bench -p berth-tests --bench volume_life [-- ROUNDS]

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_tests::{repo_root, rss_kib, wait_for, DevAgent};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn claims_free(agent: &DevAgent) -> Result<bool> {
    let v = agent.cli_json(&["volume", "status", "data"])?;
    let empty = |k: &str| v[k].as_array().is_none_or(|a| a.is_empty());
    Ok(empty("read_allocs") && empty("write_allocs"))
}

fn main() -> Result<()> {
    let rounds: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(|a| a.parse().context("ROUNDS must be a number"))
        .transpose()?
        .unwrap_or(20);
    let examples = repo_root().join("examples");
    let agent = DevAgent::start()?;
    let dir = agent.data_dir.path().to_path_buf();

    agent.cli_ok(&[
        "job",
        "run",
        "-detach",
        &examples
            .join("jobs/hostpath-plugin.hcl")
            .display()
            .to_string(),
    ])?;
    agent.wait_plugin_healthy("hostpath")?;
    agent.cli_ok(&[
        "volume",
        "create",
        &examples.join("volumes/hostpath.hcl").display().to_string(),
    ])?;
    let writer = std::fs::read_to_string(examples.join("jobs/writer.hcl"))?;
    let rss_before = agent.pid().and_then(rss_kib);

    let mut to_complete = Vec::with_capacity(rounds);
    let mut to_free = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let job = dir.join(format!("writer-{round}.hcl"));
        let src = writer.replacen("job \"writer\"", &format!("job \"writer-{round}\""), 1);
        if src == writer {
            bail!("the writer example has no job \"writer\" to rename");
        }
        std::fs::write(&job, src)?;
        let start = Instant::now();
        agent.cli_ok(&["job", "run", &job.display().to_string()])?;
        to_complete.push(start.elapsed());
        wait_for("the claim to be freed", Duration::from_secs(30), || {
            Ok(claims_free(&agent)?.then_some(()))
        })?;
        to_free.push(start.elapsed());
    }
    let rss_after = agent.pid().and_then(rss_kib);

    to_complete.sort();
    to_free.sort();
    println!("volume life on a dev agent, {rounds} rounds (job run -> complete / -> claim freed)");
    for (name, v) in [("complete", &to_complete), ("claim freed", &to_free)] {
        println!(
            "  {name:<12} p50 {:>7.1} ms   p95 {:>7.1} ms   max {:>7.1} ms",
            percentile(v, 0.5).as_secs_f64() * 1e3,
            percentile(v, 0.95).as_secs_f64() * 1e3,
            v.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        );
    }
    let executors: Vec<u64> = agent
        .processes_with_cmdline(&format!("executor {}", dir.display()))
        .into_iter()
        .filter_map(|p| rss_kib(p as u32))
        .collect();
    println!(
        "  agent RSS    {} KiB before, {} KiB after the rounds; {} executor(s), {} KiB RSS each at most",
        rss_before.map_or("?".into(), |v| v.to_string()),
        rss_after.map_or("?".into(), |v| v.to_string()),
        executors.len(),
        executors.iter().max().copied().unwrap_or(0),
    );
    Ok(())
}
