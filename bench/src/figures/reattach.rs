//! `reattach`: a client agent (client-only, its servers in another agent)
//! runs N tasks, one service job of N allocs each running `sleep 3600`
//! under its executor; the client is SIGKILLed and started again on the
//! same data dir. Measured from the moment the new process is spawned:
//!
//! - until the client's own view (`GET /v1/client/allocations`, followed
//!   with blocking queries) has every alloc running, each task with a
//!   `Reattached` event of this restart;
//! - until the servers' view (`GET /v1/job/JOB/allocations`, blocking)
//!   has the same: every task reattached and reported running.
//!
//! Each round checks that nothing restarted: every task's restart count
//! is unchanged, no task has a `Started` event since the kill, and every
//! task's PID (its executor's record) is the one before the kill and
//! still alive.
//!
//! Baseline, interleaved round by round: a client with no allocs, on a
//! cluster of its own, SIGKILLed and started again, until it has
//! registered with its servers (its `/v1/agent/self`): the fixed cost of a
//! client start that reattaches nothing.
//!
//! Target (release build): N = 200, servers' view ≤ 1 s, 0 restarts. The
//! growth table shows the servers' view's median over `--sizes`.
//!
//! ```text
//! scripts/bench reattach                          # --sizes 20,100,200 --rounds 3
//! scripts/bench reattach --sizes 200 --rounds 10
//! ```

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::cluster::{self, BenchClient, BenchServer};
use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Running tasks on the client, one alloc each; measured at each size,
    /// ascending. The target applies to the largest.
    #[arg(long, value_delimiter = ',', default_value = "20,100,200")]
    pub sizes: Vec<u32>,
    /// Kill-and-restart rounds at each size.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
}

const JOB: &str = "sleepers";
const TASK: &str = "t";

/// Unix milliseconds now.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Whether `task` of `alloc` (API JSON) has an event of `kind` at or
/// after `since_ms`.
fn has_event_since(alloc: &Value, task: &str, kind: &str, since_ms: i64) -> bool {
    berth_tests::task_events(alloc, task)
        .iter()
        .any(|(t, _, at)| t == kind && *at >= since_ms)
}

/// Whether every one of `ids` is in `allocs` (API JSON), running, with its
/// task reattached at or after `since_ms`.
fn all_reattached(allocs: &Value, ids: &BTreeMap<String, i32>, since_ms: i64) -> bool {
    let list = allocs.as_array().map(Vec::as_slice).unwrap_or_default();
    let done = list
        .iter()
        .filter(|a| {
            a["id"].as_str().is_some_and(|id| ids.contains_key(id))
                && a["client_status"] == "running"
                && cluster::all_tasks_running(a)
                && has_event_since(a, TASK, "Reattached", since_ms)
        })
        .count();
    done == ids.len()
}

/// What one kill-and-restart took.
struct Round {
    client_view: Duration,
    servers_view: Duration,
}

/// Kills `client` and starts it again; times its allocs (`pids`: alloc ID
/// to task PID before the kill) back to running in the client's and the
/// servers' views, and checks that none restarted.
fn reattach_round(
    server: &BenchServer,
    client: &mut BenchClient,
    pids: &BTreeMap<String, i32>,
    restarts: &BTreeMap<String, u64>,
) -> Result<Round> {
    client.agent.kill()?;
    let killed_ms = now_ms();
    let start = Instant::now();
    client.agent.start_again()?;
    let deadline = start + Duration::from_secs(120);
    let client_at =
        cluster::wait_until(client.http_port, "/v1/client/allocations", deadline, |v| {
            Ok(all_reattached(v, pids, killed_ms))
        })
        .with_context(|| {
            format!(
                "the client's allocs reattached; log:\n{}",
                tail(&client.agent.log())
            )
        })?;
    let mut last = Value::Null;
    let servers_at = cluster::wait_until(
        server.http_port,
        &format!("/v1/job/{JOB}/allocations"),
        deadline,
        |v| {
            last = v.clone();
            Ok(all_reattached(v, pids, killed_ms))
        },
    )
    .context("the servers seeing every alloc reattached")?;

    // Nothing restarted: same counts, no start since the kill, same PIDs.
    for a in last.as_array().into_iter().flatten() {
        let id = a["id"].as_str().unwrap_or_default();
        let Some(before) = restarts.get(id) else {
            continue;
        };
        let now = a["task_states"][TASK]["restarts"].as_u64().unwrap_or(0);
        if now != *before {
            bail!(
                "alloc {id}: its task restarted ({before} restarts before the kill, {now} after)"
            );
        }
        if has_event_since(a, TASK, "Started", killed_ms) {
            bail!("alloc {id}: its task was started again after the kill");
        }
    }
    let data = client.agent.data_path();
    for (id, pid) in pids {
        let now = berth_tests::recorded_task_pid(&data, id, TASK)?;
        if now != *pid {
            bail!("alloc {id}: task PID {pid} before the kill, {now} after");
        }
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), None).is_err() {
            bail!("alloc {id}: task PID {pid} no longer runs");
        }
    }
    Ok(Round {
        client_view: client_at - start,
        servers_view: servers_at - start,
    })
}

/// The last lines of a log, for an error.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Kills the empty client and starts it again: the time to registered.
fn baseline_round(empty: &mut BenchClient) -> Result<Duration> {
    empty.agent.kill()?;
    let start = Instant::now();
    empty.agent.start_again()?;
    let at = empty.wait_registered(start + Duration::from_secs(60))?;
    Ok(at - start)
}

pub fn run(args: &Args) -> Result<()> {
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.is_empty() || sizes[0] == 0 {
        bail!("--sizes: give one or more sizes of at least 1 task");
    }
    if args.rounds == 0 {
        bail!("--rounds: at least 1");
    }
    report::heading(
        "reattach",
        &format!(
            "client SIGKILLed with N running tasks and started again, to every task reattached and reported running (N = {}, {} rounds each)",
            sizes.iter().map(u32::to_string).collect::<Vec<_>>().join("/"),
            args.rounds
        ),
    );
    let server = BenchServer::start()?;
    let mut client = BenchClient::start(&server, "reattach")?;
    let base_server = BenchServer::start()?;
    let mut empty = BenchClient::start(&base_server, "reattach-empty")?;

    let mut baseline = Samples::new();
    let mut points = Vec::new();
    let mut largest = (Samples::new(), Samples::new());
    for &n in &sizes {
        server.run_job(JOB, &cluster::sleep_job(JOB, n, None))?;
        let allocs =
            server.wait_job_running(JOB, n as usize, Duration::from_secs(60 + u64::from(n) / 2))?;
        let data = client.agent.data_path();
        let mut pids = BTreeMap::new();
        let mut restarts = BTreeMap::new();
        for a in &allocs {
            let id = a["id"].as_str().unwrap_or_default().to_string();
            let pid = berth_tests::recorded_task_pid(&data, &id, TASK)?;
            restarts.insert(
                id.clone(),
                a["task_states"][TASK]["restarts"].as_u64().unwrap_or(0),
            );
            pids.insert(id, pid);
        }
        let mut client_view = Samples::new();
        let mut servers_view = Samples::new();
        for _ in 0..args.rounds {
            baseline.push(baseline_round(&mut empty)?);
            let r = reattach_round(&server, &mut client, &pids, &restarts)?;
            client_view.push(r.client_view);
            servers_view.push(r.servers_view);
        }
        report::samples(&format!("n={n}: client's view"), &client_view);
        report::samples(&format!("n={n}: servers' view"), &servers_view);
        points.push((f64::from(n), servers_view.median().as_secs_f64() * 1000.0));
        largest = (client_view, servers_view);
    }
    report::samples("baseline: empty client registered", &baseline);
    let n = sizes[sizes.len() - 1];
    report::ratio_line(
        &format!("n={n} servers' view / baseline"),
        &largest.1,
        &baseline,
    );
    if points.len() >= 2 {
        report::growth_table("the servers' view (median)", "ms", &points);
    }
    report::value(
        "restarts, new starts, changed PIDs",
        "0 (checked each round)",
    );
    let worst = largest.1.max();
    report::target(
        &format!(
            "n={n}: every task reattached and reported running <= 1 s (max {:.0} ms), 0 restarts",
            worst.as_secs_f64() * 1000.0
        ),
        worst <= Duration::from_secs(1),
    );
    Ok(())
}

pub fn smoke() -> Result<()> {
    run(&Args {
        sizes: vec![1, 2],
        rounds: 1,
    })
}
