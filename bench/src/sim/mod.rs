//! A fleet of simulated nodes for the server figures: each one a berth
//! client as the servers see it, speaking the real agent protocol
//! (`berth.v1`) over gRPC to a real server agent, with its own node ID and
//! node secret. A node
//! - registers (`Node.Register`, its secret in the metadata);
//! - reports a CSI node plugin when asked (`Node.UpdatePlugins`);
//! - opens its call stream (`Node.OpenCallStream`) and answers the
//!   servers' `NodeDetach` and `ControllerUnpublish` as done, as a client
//!   whose plugin unmounted;
//! - heartbeats at the TTL the server returns, half of it less up to 10 %
//!   jitter (the client's defaults), starting somewhere in its first
//!   interval as in a cluster that has run for a while, and records each
//!   round trip;
//! - watches its allocs (`Node.WatchAllocations`): a new alloc has its CSI
//!   volumes claimed (`CSIVolume.Claim`) and is reported running; an alloc
//!   the servers stop is released (`CSIVolume.Unpublish` for each volume,
//!   unless the fleet is told not to, as if the node had gone away before
//!   its postrun) and reported complete, as a client's CSI hook postrun and
//!   alloc runner do. Reports are batched per node, as a client's are.
//!
//! The nodes share a pool of gRPC channels (HTTP/2 connections): ten
//! thousand sockets per side would measure the kernel, not berth.

mod node;
mod server;

use berth_sync::MutexExt;
use berth_sync::{Shutdown, ShutdownSender};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::csi_volume_client::CsiVolumeClient;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_structs::NodeSecret;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub use server::{How, ServerAgent, Servers};

/// The CSI plugin the simulated nodes report.
pub const PLUGIN: &str = "sim";

/// How a fleet behaves.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub nodes: usize,
    /// Each node's CPU in MHz; with tasks of [`TASK_CPU`] MHz it holds
    /// `cpu / TASK_CPU` allocs, so that the scheduler spreads them.
    pub node_cpu: u64,
    /// Nodes (the first ones) that report a healthy node plugin [`PLUGIN`].
    pub plugin_nodes: usize,
    /// Release claims with `CSIVolume.Unpublish` when an alloc stops.
    pub unpublish: bool,
    /// gRPC channels shared by the nodes.
    pub channels: usize,
}

/// The CPU a task of the figures' jobs asks for, in MHz.
pub const TASK_CPU: u64 = 100;

/// How often something happened, and the first few reasons why.
#[derive(Default)]
pub struct Tally {
    count: AtomicUsize,
    first: Mutex<Vec<String>>,
}

impl Tally {
    fn note(&self, why: String) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first.locked();
        if first.len() < 5 {
            first.push(why);
        }
    }

    /// How many, and the first reasons.
    pub fn read(&self) -> (usize, Vec<String>) {
        let first = self.first.locked();
        (self.count.load(Ordering::Relaxed), first.clone())
    }
}

/// What the fleet saw, shared by its nodes.
#[derive(Default)]
pub struct FleetStats {
    /// Each heartbeat round trip and when it started.
    heartbeats: Mutex<Vec<(Instant, Duration)>>,
    /// Each `CSIVolume.Unpublish` round trip, and when it ended.
    unpublishes: Mutex<Vec<(Instant, Duration)>>,
    failures: Mutex<Vec<String>>,
    /// Alloc watches and call streams that broke or ended and were
    /// reopened (as a client does).
    pub reopened: Tally,
    /// RPCs that failed as a client retries them (the connection broke
    /// or went away) and were retried.
    pub retried: Tally,
    /// Allocs reported running, and reported complete.
    pub running: AtomicUsize,
    pub complete: AtomicUsize,
    /// Claims granted, and released by `Unpublish`.
    pub claimed: AtomicUsize,
    pub unpublished: AtomicUsize,
}

impl FleetStats {
    fn fail(&self, what: String) {
        let mut f = self.failures.locked();
        if f.len() < 1000 {
            f.push(what);
        }
    }

    /// Heartbeat round trips that started in `[from, to)`.
    pub fn heartbeats_between(&self, from: Instant, to: Instant) -> crate::report::Samples {
        self.heartbeats
            .locked()
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, d)| *d)
            .collect()
    }

    pub fn unpublishes(&self) -> crate::report::Samples {
        self.unpublishes.locked().iter().map(|(_, d)| *d).collect()
    }

    /// When the last `CSIVolume.Unpublish` was answered.
    pub fn last_unpublish(&self) -> Option<Instant> {
        self.unpublishes.locked().iter().map(|(at, _)| *at).max()
    }

    /// The first failures (at most `n`) and how many there were.
    pub fn failures(&self, n: usize) -> (Vec<String>, usize) {
        let f = self.failures.locked();
        (f.iter().take(n).cloned().collect(), f.len())
    }

    /// An error naming the first failures, if any.
    pub fn check(&self) -> Result<()> {
        let (first, count) = self.failures(5);
        if count == 0 {
            return Ok(());
        }
        Err(anyhow!(
            "{count} simulated node RPCs failed, the first: {}",
            first.join("; ")
        ))
    }
}

/// A running fleet; dropping it ends every node's tasks.
pub struct Fleet {
    pub stats: Arc<FleetStats>,
    stop: ShutdownSender,
    tasks: Vec<JoinHandle<()>>,
    /// How long registering every node took (all at once).
    pub registration: Duration,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop.shutdown();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One simulated node's identity and clients.
#[derive(Clone)]
struct SimNode {
    index: usize,
    id: String,
    secret: NodeSecret,
    node: NodeClient<Channel>,
    csi: CsiVolumeClient<Channel>,
    stats: Arc<FleetStats>,
    unpublish: bool,
}

fn with_secret<T>(msg: T, secret: &NodeSecret) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(v) = secret.expose().parse() {
        req.metadata_mut().insert(pb::NODE_SECRET_METADATA, v);
    }
    req
}

/// A number in [0, 1) from the std hasher's random keys.
pub fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// When a client heartbeats after being handed `ttl`: half of it, less up
/// to 10 % (the client's defaults), at least half a second.
fn interval(ttl: Duration) -> Duration {
    ttl.mul_f64(0.5 * (1.0 - 0.1 * random_fraction()))
        .max(Duration::from_millis(500))
}

/// Whether a client retries an RPC that failed with `s`: its
/// connection broke, went away or could not be made (the answer of a
/// server that refused the request is not retried).
fn retryable(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
    ) || s.message().contains("h2 protocol error")
        || s.message().contains("transport error")
}

/// How long a client waits before reopening a stream after the
/// `failures`th failure in a row: 100 ms doubling up to 6.4 s, each wait
/// drawn from its upper half (the client's `retry_delay`).
fn retry_delay(failures: u32) -> Duration {
    let full = Duration::from_millis(100).saturating_mul(1u32 << failures.min(6));
    let half = full / 2;
    half.saturating_add(half.mul_f64(random_fraction()))
}

/// Channels to the agent protocol of `server`, set up as a client's are
/// (HTTP/2 keepalive pings every 5 s, also while idle, the connection
/// dropped when one is not answered in 5 s), over mutual TLS with a
/// client certificate when the server has TLS on. A channel dials again
/// by itself after its connection is lost.
pub async fn connect(server: &ServerAgent, channels: usize) -> Result<Vec<Channel>> {
    let rpc = &server.rpc;
    let mut out = Vec::with_capacity(channels.max(1));
    for _ in 0..channels.max(1) {
        let endpoint = Channel::from_shared(format!("http://{rpc}"))
            .context("the server's agent protocol address")?
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        let ch = match &server.tls {
            Some(pki) => {
                let config = pki.client_config(Some(berth_tests::pki::CLIENT_CERT))?;
                berth_tests::pki::grpc_channel_on(endpoint, config, rpc, "server.global.berth")
                    .await?
            }
            None => endpoint
                .connect()
                .await
                .with_context(|| format!("connecting to the server at {rpc}"))?,
        };
        out.push(ch);
    }
    Ok(out)
}

impl Fleet {
    /// Register `cfg.nodes` nodes with `server`, all at once, and start
    /// each one's heartbeats, alloc watch and call stream.
    pub async fn start(server: &ServerAgent, cfg: &FleetConfig) -> Result<Fleet> {
        let channels = connect(server, cfg.channels).await?;
        let stats = Arc::new(FleetStats::default());
        let (stop, stop_rx) = Shutdown::channel();
        let started = Instant::now();
        let mut registering = Vec::with_capacity(cfg.nodes);
        for i in 0..cfg.nodes {
            let ch = channels[i % channels.len()].clone();
            let sim = SimNode {
                index: i,
                id: berth_structs::generate_id(),
                secret: NodeSecret::generate(),
                node: NodeClient::new(ch.clone()),
                csi: CsiVolumeClient::new(ch),
                stats: stats.clone(),
                unpublish: cfg.unpublish,
            };
            let (cpu, plugin) = (cfg.node_cpu, i < cfg.plugin_nodes);
            registering.push(tokio::spawn(async move {
                let ttl = sim.register(cpu, plugin).await?;
                Ok::<_, anyhow::Error>((sim, ttl))
            }));
        }
        let mut nodes = Vec::with_capacity(cfg.nodes);
        for r in registering {
            nodes.push(r.await.context("a registering node panicked")??);
        }
        let registration = started.elapsed();
        let mut tasks = Vec::with_capacity(cfg.nodes * 3);
        for (sim, ttl) in nodes {
            tasks.push(tokio::spawn(
                sim.clone().heartbeat_loop(ttl, stop_rx.clone()),
            ));
            tasks.push(tokio::spawn(sim.clone().watch_allocs(stop_rx.clone())));
            tasks.push(tokio::spawn(sim.call_stream(stop_rx.clone())));
        }
        Ok(Fleet {
            stats,
            stop,
            tasks,
            registration,
        })
    }
}

/// A service job of `count` allocs of one task ([`TASK_CPU`] MHz, 64 MB);
/// with `volume`, each alloc claims volume `<volume>[<index>]` for writing.
pub fn job(id: &str, count: u32, volume: Option<&str>) -> berth_structs::Job {
    use berth_structs::*;
    let mut group = TaskGroup {
        name: "g".into(),
        count,
        tasks: vec![Task {
            name: "t".into(),
            driver: "raw_exec".into(),
            config: TaskConfig {
                command: "/bin/sleep".into(),
                args: vec!["1000".into()],
                ..berth_structs::TaskConfig::default()
            },
            resources: Resources {
                cpu: TASK_CPU,
                memory_mb: 64,
                ..berth_structs::Resources::default()
            },
            ..Default::default()
        }],
        ..Default::default()
    };
    if let Some(source) = volume {
        group.volumes.insert(
            "data".into(),
            VolumeRequest {
                name: "data".into(),
                volume_type: "csi".into(),
                source: source.into(),
                per_alloc: true,
                access_mode: Some(AccessMode::SingleNodeWriter),
                attachment_mode: Some(AttachmentMode::FileSystem),
                ..Default::default()
            },
        );
        group.tasks[0].volume_mounts.push(VolumeMount {
            volume: "data".into(),
            destination: "data".into(),
            ..Default::default()
        });
    }
    Job {
        id: id.into(),
        name: id.into(),
        job_type: JobType::Service,
        datacenters: vec!["dc1".into()],
        task_groups: vec![group],
        ..Default::default()
    }
}

/// Wait until `cond` holds, polling every 50 ms; an error after `timeout`
/// naming `what` and what `progress` says then.
pub async fn wait_until(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> bool,
    progress: impl Fn() -> String,
) -> Result<Duration> {
    let started = Instant::now();
    while !cond() {
        if started.elapsed() > timeout {
            return Err(anyhow!("{what}: not within {timeout:?} ({})", progress()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(started.elapsed())
}
