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

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::csi_volume_client::CsiVolumeClient;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_structs::{AllocClientStatus, Allocation, Node, NodeResources, NodeSecret};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

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

/// What the fleet saw, shared by its nodes.
#[derive(Default)]
pub struct FleetStats {
    /// Each heartbeat round trip and when it started.
    heartbeats: Mutex<Vec<(Instant, Duration)>>,
    /// Each `CSIVolume.Unpublish` round trip, and when it ended.
    unpublishes: Mutex<Vec<(Instant, Duration)>>,
    failures: Mutex<Vec<String>>,
    /// Alloc watches and call streams that broke or ended and were
    /// reopened (as a client does), and the first reasons why.
    pub reopened: AtomicUsize,
    reopen_reasons: Mutex<Vec<String>>,
    /// Allocs reported running, and reported complete.
    pub running: AtomicUsize,
    pub complete: AtomicUsize,
    /// Claims granted, and released by `Unpublish`.
    pub claimed: AtomicUsize,
    pub unpublished: AtomicUsize,
}

impl FleetStats {
    fn fail(&self, what: String) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() < 1000 {
            f.push(what);
        }
    }

    fn reopen(&self, what: String) {
        self.reopened.fetch_add(1, Ordering::Relaxed);
        let mut r = self
            .reopen_reasons
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if r.len() < 5 {
            r.push(what);
        }
    }

    /// How many streams were reopened, and the first reasons.
    pub fn reopens(&self) -> (usize, Vec<String>) {
        let r = self
            .reopen_reasons
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        (self.reopened.load(Ordering::Relaxed), r.clone())
    }

    /// Heartbeat round trips that started in `[from, to)`.
    pub fn heartbeats_between(&self, from: Instant, to: Instant) -> crate::report::Samples {
        self.heartbeats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, d)| *d)
            .collect()
    }

    pub fn unpublishes(&self) -> crate::report::Samples {
        self.unpublishes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(_, d)| *d)
            .collect()
    }

    /// When the last `CSIVolume.Unpublish` was answered.
    pub fn last_unpublish(&self) -> Option<Instant> {
        self.unpublishes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(at, _)| *at)
            .max()
    }

    /// The first failures (at most `n`) and how many there were.
    pub fn failures(&self, n: usize) -> (Vec<String>, usize) {
        let f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
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
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// How long registering every node took (all at once).
    pub registration: Duration,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop.send_replace(true);
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
        let (stop, stop_rx) = watch::channel(false);
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

impl SimNode {
    fn node_struct(&self, cpu: u64) -> Node {
        Node {
            id: self.id.clone(),
            name: format!("sim-{}", self.index),
            datacenter: "dc1".into(),
            resources: NodeResources {
                cpu,
                memory_mb: 64 * 1024,
                disk_mb: 0,
            },
            drivers: vec!["raw_exec".into()],
            ..Default::default()
        }
    }

    /// Register; report the node plugin when `plugin`. Returns the TTL.
    async fn register(&self, cpu: u64, plugin: bool) -> Result<Duration> {
        let node_json = serde_json::to_vec(&self.node_struct(cpu))?;
        let ttl = self
            .node
            .clone()
            .register(with_secret(
                pb::RegisterRequest {
                    node_json,
                    ..Default::default()
                },
                &self.secret,
            ))
            .await
            .with_context(|| format!("register of node {}", self.index))?
            .into_inner()
            .heartbeat_ttl_ms;
        if plugin {
            let fingerprint = pb::PluginFingerprint {
                plugin_id: PLUGIN.into(),
                kind: "node".into(),
                provider: "sim.csi.berth.dev".into(),
                version: "1.0.0".into(),
                healthy: true,
                health_description: "healthy".into(),
                alloc_id: format!("sim-plugin-{}", self.index),
                external_node_id: format!("sim-{}", self.index),
                supports_stage_unstage: true,
                ..Default::default()
            };
            self.node
                .clone()
                .update_plugins(with_secret(
                    pb::UpdatePluginsRequest {
                        node_id: self.id.clone(),
                        plugins: vec![fingerprint],
                    },
                    &self.secret,
                ))
                .await
                .with_context(|| format!("plugins of node {}", self.index))?;
        }
        Ok(Duration::from_millis(ttl))
    }

    async fn heartbeat_loop(self, ttl: Duration, mut stop: watch::Receiver<bool>) {
        let mut client = self.node.clone();
        let mut next = interval(ttl).mul_f64(random_fraction());
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(next) => {}
            }
            let started = Instant::now();
            let r = client
                .heartbeat(with_secret(
                    pb::HeartbeatRequest {
                        node_id: self.id.clone(),
                    },
                    &self.secret,
                ))
                .await;
            let took = started.elapsed();
            match r {
                Ok(r) => {
                    self.stats
                        .heartbeats
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((started, took));
                    next = interval(Duration::from_millis(r.into_inner().heartbeat_ttl_ms));
                }
                Err(e) => {
                    if *stop.borrow() {
                        return;
                    }
                    self.stats
                        .fail(format!("heartbeat of node {}: {e}", self.index));
                    next = Duration::from_secs(1);
                }
            }
        }
    }

    /// Answer the servers' calls: node and controller detaches succeed.
    /// A stream that fails to open, breaks or ends is reopened after the
    /// client's backoff, as a client does.
    async fn call_stream(self, mut stop: watch::Receiver<bool>) {
        let mut failures = 0u32;
        loop {
            let Some(why) = self.call_stream_once(&mut stop, &mut failures).await else {
                return;
            };
            if !self.back_off_to_reopen(&mut stop, &mut failures, why).await {
                return;
            }
        }
    }

    /// After a stream of this node broke (`why`): counts the reopen and
    /// waits out the client's backoff. False when told to stop meanwhile.
    async fn back_off_to_reopen(
        &self,
        stop: &mut watch::Receiver<bool>,
        failures: &mut u32,
        why: String,
    ) -> bool {
        if *stop.borrow() {
            return false;
        }
        self.stats.reopen(why);
        *failures += 1;
        tokio::select! {
            _ = stop.wait_for(|s| *s) => false,
            _ = tokio::time::sleep(retry_delay(*failures)) => true,
        }
    }

    /// One call stream, until told to stop (None) or it breaks (why).
    async fn call_stream_once(
        &self,
        stop: &mut watch::Receiver<bool>,
        failures: &mut u32,
    ) -> Option<String> {
        let (tx, rx) = mpsc::channel::<pb::ClientMessage>(16);
        let hello = pb::ClientMessage {
            msg: Some(pb::client_message::Msg::Hello(pb::ClientHello {
                node_id: self.id.clone(),
            })),
        };
        if tx.send(hello).await.is_err() {
            return Some("the call stream's outbound queue closed".into());
        }
        let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
        let mut calls = match self
            .node
            .clone()
            .open_call_stream(with_secret(outbound, &self.secret))
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => {
                return Some(format!(
                    "opening the call stream of node {}: {e}",
                    self.index
                ))
            }
        };
        loop {
            let call = tokio::select! {
                _ = stop.wait_for(|s| *s) => return None,
                c = calls.message() => c,
            };
            let call = match call {
                Ok(Some(c)) => c,
                Ok(None) => return Some(format!("the call stream of node {} ended", self.index)),
                Err(e) => {
                    return Some(format!("the call stream of node {} broke: {e}", self.index))
                }
            };
            *failures = 0;
            use pb::server_call::Call;
            let result = match call.call {
                Some(Call::NodeDetach(_)) | Some(Call::ControllerUnpublish(_)) => {
                    pb::call_reply::Result::Empty(pb::Empty {})
                }
                _ => pb::call_reply::Result::Error(pb::CallError {
                    code: tonic::Code::Unimplemented as i32,
                    message: "a simulated node answers detaches only".into(),
                }),
            };
            let reply = pb::ClientMessage {
                msg: Some(pb::client_message::Msg::Reply(pb::CallReply {
                    call_id: call.call_id,
                    result: Some(result),
                })),
            };
            if tx.send(reply).await.is_err() {
                return Some("the call stream's outbound queue closed".into());
            }
        }
    }

    /// Follow the node's allocs: claim and report new ones running;
    /// release and report stopped ones complete. A watch that fails to
    /// open, breaks or ends is reopened after the client's backoff, as a
    /// client does; the first update on the new watch lists every alloc
    /// again and only what changed is reported.
    async fn watch_allocs(self, mut stop: watch::Receiver<bool>) {
        // What this node reported of each alloc.
        let mut reported: HashMap<String, AllocClientStatus> = HashMap::new();
        let mut failures = 0u32;
        loop {
            let Some(why) = self
                .watch_allocs_once(&mut stop, &mut reported, &mut failures)
                .await
            else {
                return;
            };
            if !self.back_off_to_reopen(&mut stop, &mut failures, why).await {
                return;
            }
        }
    }

    /// One alloc watch, until told to stop (None) or it breaks (why).
    async fn watch_allocs_once(
        &self,
        stop: &mut watch::Receiver<bool>,
        reported: &mut HashMap<String, AllocClientStatus>,
        failures: &mut u32,
    ) -> Option<String> {
        let mut stream = match self
            .node
            .clone()
            .watch_allocations(with_secret(
                pb::WatchAllocationsRequest {
                    node_id: self.id.clone(),
                },
                &self.secret,
            ))
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => {
                return Some(format!(
                    "opening the alloc watch of node {}: {e}",
                    self.index
                ))
            }
        };
        loop {
            let update = tokio::select! {
                _ = stop.wait_for(|s| *s) => return None,
                u = stream.message() => u,
            };
            let update = match update {
                Ok(Some(u)) => u,
                Ok(None) => return Some(format!("the alloc watch of node {} ended", self.index)),
                Err(e) => {
                    return Some(format!("the alloc watch of node {} broke: {e}", self.index))
                }
            };
            *failures = 0;
            let mut allocs = Vec::with_capacity(update.allocs_json.len());
            for raw in &update.allocs_json {
                match serde_json::from_slice::<Allocation>(raw) {
                    Ok(a) => allocs.push(a),
                    Err(e) => self.stats.fail(format!(
                        "node {}: an alloc that does not decode: {e}",
                        self.index
                    )),
                }
            }
            let mut updates = Vec::new();
            let mut releases = Vec::new();
            for a in &allocs {
                let was = reported.get(&a.id).copied();
                if a.server_terminal() {
                    if was == Some(AllocClientStatus::Running) {
                        releases.push(a.clone());
                        updates.push(status(a, AllocClientStatus::Complete, "Tasks stopped"));
                    }
                } else if was.is_none() && !a.client_status.is_terminal() {
                    match self.claim_volumes(a).await {
                        Ok(()) => {
                            updates.push(status(a, AllocClientStatus::Running, "Tasks are running"))
                        }
                        Err(e) => {
                            self.stats.fail(format!("{e:#}"));
                            updates.push(status(a, AllocClientStatus::Failed, "claim failed"));
                        }
                    }
                }
            }
            // The CSI hook's postrun (unpublish) runs before the alloc is
            // reported terminal.
            if self.unpublish {
                let releasing = releases.iter().map(|a| self.unpublish_volumes(a));
                for r in futures_util::future::join_all(releasing).await {
                    if let Err(e) = r {
                        self.stats.fail(format!("{e:#}"));
                    }
                }
            }
            if updates.is_empty() {
                continue;
            }
            let r = self
                .node
                .clone()
                .update_allocations(with_secret(
                    pb::UpdateAllocationsRequest {
                        node_id: self.id.clone(),
                        updates: updates.clone(),
                    },
                    &self.secret,
                ))
                .await;
            match r {
                Ok(_) => {
                    for u in updates {
                        let s: AllocClientStatus = match u.client_status.parse() {
                            Ok(s) => s,
                            Err(_) => continue,
                        };
                        let counter = match s {
                            AllocClientStatus::Running => &self.stats.running,
                            _ => &self.stats.complete,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        reported.insert(u.alloc_id, s);
                    }
                }
                Err(e) => self
                    .stats
                    .fail(format!("alloc updates of node {}: {e}", self.index)),
            }
        }
    }

    /// `CSIVolume.Claim` for each CSI volume of the alloc's group.
    async fn claim_volumes(&self, a: &Allocation) -> Result<()> {
        let Some(group) = a.group() else {
            return Ok(());
        };
        for req in group.volumes.values().filter(|v| v.volume_type == "csi") {
            let access = req
                .access_mode
                .unwrap_or(berth_structs::AccessMode::SingleNodeWriter);
            let claim = pb::ClaimRequest {
                volume_id: req.source_for(a.index),
                alloc_id: a.id.clone(),
                node_id: self.id.clone(),
                mode: access.claim_mode().as_str().into(),
                capability: Some(pb::VolumeCapability {
                    access_mode: access.as_str().into(),
                    attachment_mode: "file-system".into(),
                    fs_type: String::new(),
                    mount_flags: vec![],
                }),
            };
            self.csi
                .clone()
                .claim(with_secret(claim, &self.secret))
                .await
                .with_context(|| {
                    format!(
                        "claim of volume {} for alloc {} on node {}",
                        req.source_for(a.index),
                        a.id,
                        self.index
                    )
                })?;
            self.stats.claimed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `CSIVolume.Unpublish` for each CSI volume of the alloc's group.
    async fn unpublish_volumes(&self, a: &Allocation) -> Result<()> {
        let Some(group) = a.group() else {
            return Ok(());
        };
        for req in group.volumes.values().filter(|v| v.volume_type == "csi") {
            let volume_id = req.source_for(a.index);
            let started = Instant::now();
            self.csi
                .clone()
                .unpublish(with_secret(
                    pb::UnpublishRequest {
                        volume_id: volume_id.clone(),
                        alloc_id: a.id.clone(),
                        node_id: self.id.clone(),
                    },
                    &self.secret,
                ))
                .await
                .with_context(|| {
                    format!(
                        "unpublish of volume {volume_id} for alloc {} on node {}",
                        a.id, self.index
                    )
                })?;
            self.stats
                .unpublishes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((Instant::now(), started.elapsed()));
            self.stats.unpublished.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

fn status(a: &Allocation, s: AllocClientStatus, description: &str) -> pb::AllocStatusUpdate {
    pb::AllocStatusUpdate {
        alloc_id: a.id.clone(),
        client_status: s.as_str().into(),
        client_description: description.into(),
        ..Default::default()
    }
}

/// How long a set-up request (a job registered, a volume) may take: at
/// ten thousand nodes placing a job is slow.
const SETUP_TIMEOUT: Duration = Duration::from_secs(600);

/// A real server agent (`berth agent -server`, its own process, the
/// default log level) on free loopback ports; killed on drop. The whole
/// simulated fleet registers from one loopback address, so its limit of
/// registrations and connections per address are raised.
pub struct ServerAgent {
    pub agent: berth_tests::Agent,
    pub http_port: u16,
    pub rpc: String,
    /// With mutual TLS on the agent protocol: the certificates.
    pub tls: Option<berth_tests::pki::Pki>,
    _config: tempfile::TempDir,
}

/// The `limits` block of a server a simulated fleet registers with.
const FLEET_LIMITS: &str = "limits {\n  node_register_rate_per_client = 1000000\n  \
                            node_register_burst_per_client = 1000000\n  \
                            rpc_max_conns_per_client = 10000\n}\n";

impl ServerAgent {
    pub fn start() -> Result<ServerAgent> {
        Self::start_with_tls(false)
    }

    /// With `tls`, mutual TLS on the agent protocol (certificates made by
    /// `berth tls` in a temp dir); the HTTP API stays plain.
    pub fn start_with_tls(tls: bool) -> Result<ServerAgent> {
        let config = tempfile::tempdir()?;
        let file = config.path().join("server.hcl");
        let pki = tls.then(berth_tests::pki::Pki::new).transpose()?;
        let tls_block = pki.as_ref().map_or(String::new(), |p| {
            p.tls_block(berth_tests::pki::SERVER_CERT, false)
        });
        std::fs::write(&file, format!("{FLEET_LIMITS}{tls_block}"))?;
        let file = file.to_str().context("the temp dir is not UTF-8")?;
        let http_port = berth_tests::free_port();
        let rpc = format!("127.0.0.1:{}", berth_tests::free_port());
        let http = format!("127.0.0.1:{http_port}");
        let mut agent = berth_tests::Agent::start_with_env(
            &[
                "-server",
                "-config",
                file,
                "-http-addr",
                &http,
                "-rpc-addr",
                &rpc,
            ],
            &[("BERTH_LOG", None)],
        )?;
        berth_tests::wait_for(
            "the server agent's HTTP API",
            Duration::from_secs(60),
            || {
                agent.check_running()?;
                Ok(berth_tests::api_get_at(http_port, "/v1/agent/self").ok())
            },
        )?;
        Ok(ServerAgent {
            agent,
            http_port,
            rpc,
            tls: pki,
            _config: config,
        })
    }

    pub fn pid(&self) -> Result<u32> {
        self.agent.pid().context("the server agent is not running")
    }

    /// The server process's resident set, in KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        berth_tests::rss_kib(self.pid()?).context("reading the server's RSS")
    }

    /// User plus system CPU time the server process has used.
    pub fn cpu_time(&self) -> Result<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?))?;
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        // Fields 14 and 15 of the whole line; 12 and 13 after the name.
        let ticks = |i: usize| -> Result<u64> {
            fields
                .get(i)
                .and_then(|f| f.parse().ok())
                .context("a /proc stat without CPU times")
        };
        // SAFETY: sysconf reads a system constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        Ok(Duration::from_secs_f64(
            (ticks(11)? + ticks(12)?) as f64 / hz,
        ))
    }

    /// One gauge or counter of the server's `/v1/metrics`, by its exact
    /// series (`berth_runtime_alive_tasks`, `berth_nodes{status="down"}`).
    pub fn metric(&self, series: &str) -> Result<f64> {
        let a = berth_tests::http_at(
            self.http_port,
            "GET /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        )?;
        let text = String::from_utf8_lossy(&a.body);
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {series} in the server's metrics"))
    }

    /// `PUT path` with a JSON body; the answer's JSON, an error unless 200.
    pub fn put(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        self.send("PUT", path, &body.to_string())
    }

    pub fn delete(&self, path: &str) -> Result<serde_json::Value> {
        self.send("DELETE", path, "")
    }

    fn send(&self, method: &str, path: &str, body: &str) -> Result<serde_json::Value> {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let a = berth_tests::http_at_within(self.http_port, &request, SETUP_TIMEOUT)
            .with_context(|| format!("{method} {path}"))?;
        if a.status != 200 {
            return Err(anyhow!(
                "{method} {path}: {} {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            ));
        }
        serde_json::from_slice(&a.body).with_context(|| format!("{method} {path}: the answer"))
    }

    /// `GET path`, its JSON and `X-Berth-Index`.
    pub fn get_indexed(&self, path: &str) -> Result<(serde_json::Value, u64)> {
        crate::cluster::get_indexed(self.http_port, path, 0, Duration::ZERO)
    }

    /// Run `each(i)` for `0..count` on `workers` threads (HTTP requests
    /// of the set-up, a few at a time as several operators would).
    pub fn parallel(
        &self,
        count: usize,
        workers: usize,
        each: impl Fn(&ServerAgent, usize) -> Result<()> + Sync,
    ) -> Result<()> {
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..workers.max(1))
                .map(|_| {
                    s.spawn(|| loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= count {
                            return Ok::<(), anyhow::Error>(());
                        }
                        each(self, i)?;
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow!("a set-up thread panicked"))??;
            }
            Ok(())
        })
    }

    /// Register a CSI volume of [`PLUGIN`] through the API.
    pub fn register_volume(&self, id: &str) -> Result<()> {
        let vol = berth_structs::CsiVolume {
            id: id.into(),
            name: id.into(),
            external_id: format!("ext-{id}"),
            plugin_id: PLUGIN.into(),
            capabilities: vec![berth_structs::VolumeCapability {
                access_mode: berth_structs::AccessMode::SingleNodeWriter,
                attachment_mode: berth_structs::AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        self.put(
            &format!(
                "/v1/volume/csi/{}",
                id.replace('[', "%5B").replace(']', "%5D")
            ),
            &serde_json::json!({ "volume": vol }),
        )?;
        Ok(())
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
            },
            resources: Resources {
                cpu: TASK_CPU,
                memory_mb: 64,
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
