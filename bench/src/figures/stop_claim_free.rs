//! `stop-claim-free`: how soon after a job stop the servers show its CSI
//! volume's claim free.
//!
//! Measured: a service job whose one raw_exec task (`sleep`) has the CSI
//! volume `data` of the example hostpath plugin mounted (single-node-writer)
//! runs on a release `berth agent -dev`, its claim taken. A blocking query
//! on the volume (`GET /v1/volume/csi/data?index=N`, N the index of the
//! volume as read with the claim taken) is sent and waits; then the clock
//! starts and the bench sends the stop (`DELETE /v1/job/<id>`, what
//! `berth job stop -detach` sends). The clock stops when a blocking query
//! answers the volume with no read and no write claim. Between the two:
//! the stop reaching the client, the task killed, the unbind, the
//! `NodeUnpublishVolume` and `NodeUnstageVolume` calls, the client's
//! `CSIVolume.Unpublish` and the servers' release of the claim (with
//! controller attach, a `ControllerUnpublishVolume` through the client
//! running the plugin's controller too).
//!
//! Run twice, on two dev agents that run side by side, their rounds
//! interleaved: the plugin as shipped, and the plugin with
//! `--enable-attach` (the servers publish through the controller on claim
//! and unpublish on release).
//!
//! Baseline, in the same run and interleaved round by round, on the agent
//! without attach: the same service job without the volume, from its stop
//! to a blocking query on its allocs (`GET /v1/job/<id>/allocations`)
//! answering the alloc `complete`: the stop reaching the client and the
//! task's end reported, without any volume.
//!
//! Target: median ≤ 50 ms each.
//!
//! ```text
//! scripts/bench stop-claim-free [--rounds 30] [--warmup 3]
//! ```

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use berth_tests::{
    csi_volume_service_job, example, example_with, http_send_at, mounts_under, plugin_stderr,
    wait_for, DevAgent, HttpSent,
};
use serde_json::Value;

use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured rounds per configuration
    #[arg(long, default_value_t = 30)]
    pub rounds: usize,
    /// Unmeasured rounds first
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
}

/// The longest a round waits for anything before it fails.
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);

/// A dev agent running the example plugin (with `--enable-attach` when
/// asked) and volume `data` created through it.
fn agent_with_volume(enable_attach: bool) -> Result<DevAgent> {
    let agent = DevAgent::start()?;
    let path = "jobs/hostpath-plugin.hcl";
    let spec = if enable_attach {
        example_with(path, "args = [", "args = [\"--enable-attach\", ")?
    } else {
        std::fs::read_to_string(example(path))?
    };
    let file = agent.write_file("hostpath-plugin.hcl", &spec)?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    agent.wait_plugin_healthy("hostpath")?;
    agent.cli_ok(&["volume", "create", &example("volumes/hostpath.hcl")])?;
    Ok(agent)
}

/// The API's port of `agent` (from `http://127.0.0.1:PORT`).
fn port(agent: &DevAgent) -> Result<u16> {
    agent
        .http_addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {}", agent.http_addr))
}

/// A GET sent on its own connection, answered later: the request is on
/// the wire when [`PendingGet::send`] returns.
struct PendingGet {
    sent: HttpSent,
    path: String,
}

impl PendingGet {
    fn send(port: u16, path: &str) -> Result<PendingGet> {
        let sent = http_send_at(
            port,
            &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
            ROUND_TIMEOUT,
        )
        .with_context(|| format!("GET {path}"))?;
        Ok(PendingGet {
            sent,
            path: path.to_string(),
        })
    }

    /// The answer's `X-Berth-Index` and JSON body; an error for any status
    /// but 200.
    fn answer(self) -> Result<(u64, Value)> {
        let path = self.path;
        let answer = self.sent.answer().with_context(|| format!("GET {path}"))?;
        if answer.status != 200 {
            bail!(
                "GET {path}: {}\n{}",
                answer.head,
                String::from_utf8_lossy(&answer.body)
            );
        }
        let index = answer
            .header("x-berth-index")
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("GET {path}: no X-Berth-Index in {}", answer.head))?;
        let body = serde_json::from_slice(&answer.body)
            .with_context(|| format!("GET {path}: decoding the answer"))?;
        Ok((index, body))
    }
}

fn get(port: u16, path: &str) -> Result<(u64, Value)> {
    PendingGet::send(port, path)?.answer()
}

/// Sends the stop of `job` (`DELETE /v1/job/<job>`); an error unless 200.
fn stop(agent: &DevAgent, job: &str) -> Result<()> {
    let answer = agent.http(&format!(
        "DELETE /v1/job/{job} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    ))?;
    ensure!(
        answer.status == 200,
        "stopping {job}: {}\n{}",
        answer.head,
        String::from_utf8_lossy(&answer.body)
    );
    Ok(())
}

fn claims(vol: &Value) -> usize {
    ["read_allocs", "write_allocs"]
        .iter()
        .map(|k| vol[k].as_array().map_or(0, Vec::len))
        .sum()
}

/// Runs `spec` (job `job`) detached and waits until its alloc runs; with
/// `volume`, also until the volume's claim is taken. Answers the index to
/// block on: the volume's, or the job's allocs'.
fn run_until_running(agent: &DevAgent, job: &str, spec: &str, volume: bool) -> Result<u64> {
    let file = agent.write_file(&format!("{job}.hcl"), spec)?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let port = port(agent)?;
    wait_for(&format!("job {job} to run"), ROUND_TIMEOUT, || {
        let (index, allocs) = get(port, &format!("/v1/job/{job}/allocations"))?;
        let running = allocs
            .as_array()
            .is_some_and(|a| a.len() == 1 && a[0]["client_status"] == "running");
        if !running {
            return Ok(None);
        }
        if !volume {
            return Ok(Some(index));
        }
        let (index, vol) = get(port, "/v1/volume/csi/data")?;
        Ok((claims(&vol) == 1).then_some(index))
    })
    .with_context(|| agent.log())
}

/// One round on `agent`: job `job` (with the volume, or without) running,
/// then the time from its stop to the claim free (with the volume) or to
/// its alloc complete (without), as blocking queries see them.
fn round(agent: &DevAgent, job: &str, volume: bool) -> Result<Duration> {
    let spec = if volume {
        csi_volume_service_job(job, "t", &["-c", "exec sleep 300"])
    } else {
        berth_tests::sleeping_service_job(job, 1, 0)
    };
    let index = run_until_running(agent, job, &spec, volume)?;
    let port = port(agent)?;
    let job_owned = job.to_string();
    let path = move |index: u64| {
        if volume {
            format!("/v1/volume/csi/data?index={index}&wait=30s")
        } else {
            format!("/v1/job/{job_owned}/allocations?index={index}&wait=30s")
        }
    };
    let done = move |v: &Value| {
        if volume {
            claims(v) == 0
        } else {
            v.as_array()
                .is_some_and(|a| a.iter().all(|x| x["client_status"] == "complete"))
        }
    };
    // The first blocking query waits on its own connection before the stop
    // is sent; later ones follow each answer until the one that shows it.
    let first = PendingGet::send(port, &path(index))?;
    let waiter = std::thread::spawn(move || -> Result<Instant> {
        let mut pending = first;
        let deadline = Instant::now() + ROUND_TIMEOUT;
        loop {
            let (next, v) = pending.answer()?;
            let at = Instant::now();
            if done(&v) {
                return Ok(at);
            }
            if at >= deadline {
                bail!("not done {ROUND_TIMEOUT:?} after the stop: {v}");
            }
            pending = PendingGet::send(port, &path(next))?;
        }
    });
    let started = Instant::now();
    stop(agent, job)?;
    let ended = waiter
        .join()
        .map_err(|_| anyhow!("the blocking query's thread panicked"))?
        .with_context(|| format!("job {job}; agent log:\n{}", agent.log()))?;
    Ok(ended.saturating_duration_since(started))
}

struct Measured {
    plain: Samples,
    attach: Samples,
    baseline: Samples,
}

fn measure(rounds: usize, warmup: usize) -> Result<Measured> {
    let plain_agent = agent_with_volume(false)?;
    let attach_agent = agent_with_volume(true)?;
    let mut m = Measured {
        plain: Samples::new(),
        attach: Samples::new(),
        baseline: Samples::new(),
    };
    for n in 0..warmup + rounds {
        let base = round(&plain_agent, &format!("base-{n}"), false)
            .with_context(|| format!("baseline round {n}"))?;
        let plain = round(&plain_agent, &format!("vol-{n}"), true)
            .with_context(|| format!("round {n} without attach"))?;
        let attach = round(&attach_agent, &format!("vol-{n}"), true)
            .with_context(|| format!("round {n} with attach"))?;
        if n >= warmup {
            m.baseline.push(base);
            m.plain.push(plain);
            m.attach.push(attach);
        }
    }
    check(&plain_agent, false, warmup + rounds)?;
    check(&attach_agent, true, warmup + rounds)?;
    Ok(m)
}

/// After `stops` rounds on `agent`: nothing is mounted below its data dir,
/// and the plugin's controller unpublished the volume once per stop with
/// attach, never without (the path measured is the one named).
fn check(agent: &DevAgent, enable_attach: bool, stops: usize) -> Result<()> {
    let left = mounts_under(agent.data_dir.path());
    ensure!(left.is_empty(), "mounts left behind: {left:?}");
    let plugin = agent.job_allocs("hostpath-plugin")?;
    let alloc_id = plugin
        .first()
        .and_then(|a| a["id"].as_str())
        .context("no alloc of the plugin job")?;
    let log = plugin_stderr(agent.data_dir.path(), alloc_id);
    let unpublished = log.matches("unpublished volume").count();
    let want = if enable_attach { stops } else { 0 };
    ensure!(
        unpublished == want,
        "the plugin's controller unpublished {unpublished} times in {stops} stops (attach: {enable_attach}), not {want}"
    );
    Ok(())
}

fn print(m: &Measured) -> bool {
    report::samples("stop to claim free", &m.plain);
    report::samples("stop to claim free, attach", &m.attach);
    report::samples("baseline: no volume, to complete", &m.baseline);
    report::ratio_line("claim free / baseline", &m.plain, &m.baseline);
    report::ratio_line("claim free, attach / baseline", &m.attach, &m.baseline);
    let limit = Duration::from_millis(50);
    let met = m.plain.median() <= limit && m.attach.median() <= limit;
    report::target("median <= 50 ms, with and without attach", met)
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    report::heading(
        "stop-claim-free",
        &format!(
            "job stop of a service job with a CSI volume (example hostpath plugin) to the servers showing its claim free, without and with controller attach; {} rounds after {} warm-up",
            args.rounds, args.warmup
        ),
    );
    let m = measure(args.rounds, args.warmup)?;
    print(&m);
    Ok(())
}

/// One round of each after none warm-up: every stop must end with the
/// claim free.
pub fn smoke() -> Result<()> {
    let m = measure(1, 0)?;
    print(&m);
    Ok(())
}
