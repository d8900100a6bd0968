//! Heartbeat benchmark: one real server (state in a temp dir, the `Node`
//! service on loopback gRPC) and N simulated nodes in the same process.
//! Each node registers with its own node secret, then heartbeats as a
//! client agent does, at half the TTL the server hands it less up to 10 %
//! jitter, starting at a random point of its first interval (as if the
//! cluster had been running for a while). The nodes share a few gRPC
//! channels.
//!
//! ```text
//! cargo bench -p berth-server --bench heartbeat -- --nodes 2000
//! cargo bench -p berth-server --bench heartbeat -- --nodes 10000 --duration 120s
//! ```
//!
//! Flags: `--nodes N` (2000), `--duration D` (60s), `--channels C` (16),
//! `--min-ttl D` and `--max-heartbeats-per-second R` (the server's
//! `min_heartbeat_ttl` and `max_heartbeats_per_second`, Nomad's 10s and 50
//! by default), `--grace D` (`heartbeat_grace`, 10s). Durations are `500ms`,
//! `3s`, `2m` or plain seconds. Prints the heartbeat RPC latency (median,
//! p99, max), the process RSS (server and simulated nodes together, one
//! process) and how many nodes the server marked down, which must be 0: the
//! run fails otherwise.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

#[path = "../tests/support/mod.rs"]
mod support;

use berth_sync::Shutdown;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_server::{Server, ServerConfig};
use berth_structs::{Node, NodeSecret, NodeStatus};
use tokio::sync::watch;
use tonic::transport::Channel;

#[derive(Debug, Clone)]
struct Args {
    nodes: usize,
    duration: Duration,
    channels: usize,
    min_ttl: Duration,
    max_per_second: f64,
    grace: Duration,
}

fn parse_duration(flag: &str, text: &str) -> Result<Duration, String> {
    let bad = || format!("{flag}: {text:?} is not a duration (e.g. 500ms, 3s, 2m)");
    let (num, unit) = match text.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let n: f64 = num.parse().map_err(|_| bad())?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(secs).map_err(|_| bad())
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        nodes: 2000,
        duration: Duration::from_secs(60),
        channels: 16,
        min_ttl: Duration::from_secs(10),
        max_per_second: 50.0,
        grace: Duration::from_secs(10),
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        // `cargo bench` adds `--bench`; nothing to do with it.
        if flag == "--bench" {
            continue;
        }
        let mut value = || it.next().ok_or_else(|| format!("{flag}: needs a value"));
        match flag.as_str() {
            "--nodes" => {
                let v = value()?;
                a.nodes = v
                    .parse()
                    .map_err(|_| format!("--nodes: {v:?} is not a number of nodes"))?;
            }
            "--channels" => {
                let v = value()?;
                a.channels = v
                    .parse()
                    .ok()
                    .filter(|c| *c > 0)
                    .ok_or_else(|| format!("--channels: {v:?} is not a positive number"))?;
            }
            "--duration" => a.duration = parse_duration("--duration", &value()?)?,
            "--min-ttl" => a.min_ttl = parse_duration("--min-ttl", &value()?)?,
            "--grace" => a.grace = parse_duration("--grace", &value()?)?,
            "--max-heartbeats-per-second" => {
                let v = value()?;
                a.max_per_second = v
                    .parse()
                    .ok()
                    .filter(|r: &f64| r.is_finite() && *r > 0.0)
                    .ok_or_else(|| {
                        format!("--max-heartbeats-per-second: {v:?} is not a positive rate")
                    })?;
            }
            other => {
                return Err(format!(
                    "unknown flag {other:?}; flags: --nodes N, --duration D, --channels C, --min-ttl D, --max-heartbeats-per-second R, --grace D"
                ))
            }
        }
    }
    Ok(a)
}

/// The resident set size of this process, in KiB.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A number in [0, 1) from the std hasher's random keys.
fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// When a client heartbeats after being handed `ttl`: half of it, less up
/// to 10 % (the agent's default).
fn interval(ttl: Duration) -> Duration {
    ttl.mul_f64(0.5 * (1.0 - 0.1 * random_fraction()))
        .max(Duration::from_millis(500))
}

fn with_secret<T>(msg: T, secret: &NodeSecret) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(v) = secret.expose().parse() {
        req.metadata_mut().insert(pb::NODE_SECRET_METADATA, v);
    }
    req
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Sim {
    /// Heartbeat RPC round trips.
    latencies: Mutex<Vec<Duration>>,
    failures: Mutex<Vec<String>>,
}

async fn simulate_node(
    i: usize,
    mut client: NodeClient<Channel>,
    sim: Arc<Sim>,
    registered: Arc<tokio::sync::Barrier>,
    mut end_rx: watch::Receiver<Option<Instant>>,
) {
    let id = berth_structs::generate_id();
    let secret = NodeSecret::generate();
    let node = Node {
        name: format!("bench-{i}"),
        ..support::node(&id)
    };
    let node_json = serde_json::to_vec(&node).expect("a node encodes");
    let ttl = match client
        .register(with_secret(
            pb::RegisterRequest {
                node_json,
                ..Default::default()
            },
            &secret,
        ))
        .await
    {
        Ok(r) => Duration::from_millis(r.into_inner().heartbeat_ttl_ms),
        Err(e) => {
            sim.failures
                .lock()
                .unwrap()
                .push(format!("register of node {i}: {e}"));
            registered.wait().await;
            return;
        }
    };
    registered.wait().await;
    // The run ends a fixed time after every node has registered.
    let end = match end_rx.wait_for(|e| e.is_some()).await {
        Ok(e) => (*e).unwrap_or_else(Instant::now),
        Err(_) => return,
    };
    // Somewhere in its first interval, as in a cluster that has run for a
    // while.
    let mut next = interval(ttl).mul_f64(random_fraction());
    loop {
        let wake = Instant::now().checked_add(next).map_or(end, |w| w.min(end));
        tokio::time::sleep_until(wake.into()).await;
        if Instant::now() >= end {
            return;
        }
        let started = Instant::now();
        let r = client
            .heartbeat(with_secret(
                pb::HeartbeatRequest {
                    node_id: id.clone(),
                },
                &secret,
            ))
            .await;
        let took = started.elapsed();
        match r {
            Ok(r) => {
                sim.latencies.lock().unwrap().push(took);
                next = interval(Duration::from_millis(r.into_inner().heartbeat_ttl_ms));
            }
            Err(e) => {
                sim.failures
                    .lock()
                    .unwrap()
                    .push(format!("heartbeat of node {i}: {e}"));
                next = Duration::from_secs(1);
            }
        }
    }
}

async fn run(args: Args) -> Result<bool, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let mut cfg = ServerConfig::new(dir.path());
    cfg.min_heartbeat_ttl = args.min_ttl;
    cfg.max_heartbeats_per_second = args.max_per_second;
    cfg.heartbeat_grace = args.grace;
    // The whole simulated fleet registers from one loopback address.
    cfg.register_rate = None;
    let server = Server::open(cfg).map_err(|e| format!("opening the server: {e}"))?;
    let (stop, rx) = Shutdown::channel();
    let (addr, grpc) = support::serve_grpc(&server, rx.clone())
        .await
        .map_err(|e| format!("serving gRPC on loopback: {e}"))?;
    let run = tokio::spawn(server.clone().run(rx));
    let rss_server = rss_kib();

    let mut channels = Vec::with_capacity(args.channels);
    for _ in 0..args.channels {
        let ch = Channel::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("endpoint: {e}"))?
            .connect()
            .await
            .map_err(|e| format!("connecting to the server: {e}"))?;
        channels.push(ch);
    }

    let sim = Arc::new(Sim {
        latencies: Mutex::new(Vec::new()),
        failures: Mutex::new(Vec::new()),
    });
    let barrier = Arc::new(tokio::sync::Barrier::new(args.nodes.saturating_add(1)));
    let started = Instant::now();
    // The end is set once every node has registered; until then it is far.
    let (end_tx, end_rx) = watch::channel(None::<Instant>);
    let mut tasks = Vec::with_capacity(args.nodes);
    for i in 0..args.nodes {
        let client = NodeClient::new(channels[i % channels.len()].clone());
        let (sim, barrier, end_rx) = (sim.clone(), barrier.clone(), end_rx.clone());
        tasks.push(tokio::spawn(simulate_node(i, client, sim, barrier, end_rx)));
    }
    barrier.wait().await;
    let registration = started.elapsed();
    let registered_nodes = server.nodes().len();
    let rss_registered = rss_kib();
    let end = Instant::now() + args.duration;
    end_tx.send_replace(Some(end));
    println!(
        "{} nodes registered in {:.1}s over {} channel(s); heartbeating for {:?} (min TTL {:?}, {} heartbeats/s, grace {:?}; TTL now {:?} before jitter)",
        registered_nodes,
        registration.as_secs_f64(),
        args.channels,
        args.duration,
        args.min_ttl,
        args.max_per_second,
        args.grace,
        berth_ttl_base(registered_nodes, &args),
    );
    for t in tasks {
        let _ = t.await;
    }
    let down = server
        .nodes()
        .iter()
        .filter(|n| n.status == NodeStatus::Down)
        .count();
    let rss_end = rss_kib();
    stop.shutdown();
    let _ = run.await;
    let _ = grpc.await;

    let mut lat = std::mem::take(&mut *sim.latencies.lock().unwrap());
    lat.sort();
    let failures = std::mem::take(&mut *sim.failures.lock().unwrap());
    let kib =
        |k: Option<u64>| k.map_or("?".to_string(), |k| format!("{:.1} MiB", k as f64 / 1024.0));
    println!(
        "heartbeats: {} ({:.1}/s); latency median {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        lat.len(),
        lat.len() as f64 / args.duration.as_secs_f64().max(0.001),
        percentile(&lat, 0.5).as_secs_f64() * 1000.0,
        percentile(&lat, 0.99).as_secs_f64() * 1000.0,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1000.0,
    );
    println!(
        "RSS (whole process: server and simulated nodes): {} with the server alone, {} once registered, {} at the end",
        kib(rss_server),
        kib(rss_registered),
        kib(rss_end)
    );
    println!("nodes marked down: {down}");
    for f in failures.iter().take(10) {
        println!("failure: {f}");
    }
    if failures.len() > 10 {
        println!("... and {} more failures", failures.len() - 10);
    }
    Ok(down == 0 && failures.is_empty() && registered_nodes == args.nodes)
}

fn berth_ttl_base(nodes: usize, args: &Args) -> Duration {
    Duration::try_from_secs_f64(nodes as f64 / args.max_per_second)
        .unwrap_or(Duration::MAX)
        .max(args.min_ttl)
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("heartbeat bench: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("heartbeat bench: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("heartbeat bench: FAILED (nodes marked down, failed RPCs or missing nodes; see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("heartbeat bench: {e}");
            ExitCode::FAILURE
        }
    }
}
