//! The client role: registers the node, keeps it alive with heartbeats,
//! watches the allocs the servers place here and runs them, and answers the
//! servers' calls. Its durable state lives in one database file under
//! `<data_dir>/client/`.

pub mod calls;
pub mod rpc;
pub mod state;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_allocrunner::{AllocRunner, AllocRunnerConfig};
use berth_csimanager::{CsiManager, ManagerConfig, PluginRegistry};
use berth_proto::berth::v1 as pb;
use berth_structs::{Allocation, Node, NodeResources, NodeStatus};
use tokio::sync::{watch, Mutex};
use tokio_stream::StreamExt;

use rpc::ServerConn;
use state::ClientState;

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub data_dir: PathBuf,
    /// `http://HOST:PORT` of a server's agent protocol.
    pub server_addr: String,
    pub node_name: Option<String>,
}

pub struct Client {
    conn: ServerConn,
    csi: Arc<CsiManager>,
    state: ClientState,
    runner_config: Arc<AllocRunnerConfig>,
    runners: Mutex<HashMap<String, AllocRunner>>,
}

#[async_trait::async_trait]
impl berth_heartbeat::DisconnectTarget for Client {
    async fn allocs_with_window(&self) -> Vec<(String, Duration)> {
        let runners = self.runners.lock().await;
        runners
            .values()
            .filter(|r| !r.client_status().is_terminal())
            .filter_map(|r| {
                let alloc = r.alloc();
                let window = alloc.group()?.stop_after_client_disconnect?;
                Some((alloc.id.clone(), window))
            })
            .collect()
    }

    async fn stop_alloc(&self, alloc_id: &str, reason: &str) {
        if let Some(r) = self.runners.lock().await.get(alloc_id) {
            tracing::warn!(alloc_id, reason, "stopping alloc");
            r.stop();
        }
    }
}

fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "berth-node".to_string())
}

/// What this machine offers.
fn fingerprint_resources() -> NodeResources {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let memory_mb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(1024, |kb| kb / 1024);
    NodeResources {
        cpu: cpus * 1000,
        memory_mb,
    }
}

impl Client {
    pub async fn start(
        config: ClientConfig,
        _shutdown: watch::Receiver<bool>,
    ) -> Result<Arc<Client>> {
        let client_dir = config.data_dir.join("client");
        let state = ClientState::open(&client_dir)?;
        let quarantined = state.quarantined()?;
        if !quarantined.is_empty() {
            tracing::warn!(records = ?quarantined, "client state holds quarantined records that did not decode");
        }
        let node_id = match state.meta("node_id")? {
            Some(id) => id,
            None => {
                let id = berth_structs::generate_id();
                state.set_meta("node_id", &id)?;
                id
            }
        };
        let node = Node {
            id: node_id.clone(),
            name: config.node_name.clone().unwrap_or_else(host_name),
            datacenter: "dc1".into(),
            status: NodeStatus::Initializing,
            resources: fingerprint_resources(),
            drivers: berth_structs::SUPPORTED_DRIVERS
                .iter()
                .map(|d| d.to_string())
                .collect(),
            attributes: [
                ("os.name".to_string(), std::env::consts::OS.to_string()),
                ("cpu.arch".to_string(), std::env::consts::ARCH.to_string()),
                (
                    "berth.version".to_string(),
                    env!("CARGO_PKG_VERSION").to_string(),
                ),
            ]
            .into(),
            ..Node::default()
        };
        tracing::info!(node_id = %node.id, name = %node.name, "client starting");
        let channel = tonic::transport::Endpoint::from_shared(config.server_addr.clone())
            .with_context(|| format!("server address {:?}", config.server_addr))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .connect_lazy();
        let conn = ServerConn::new(channel, node);
        let store = Arc::new(state.clone());
        let csi = CsiManager::new(
            ManagerConfig {
                root_dir: client_dir.join("csi"),
                node_id: node_id.clone(),
                call_timeout: Duration::from_secs(30),
                fingerprint_interval: Duration::from_secs(30),
            },
            PluginRegistry::new(),
            store,
            Arc::new(conn.clone()),
            Arc::new(conn.clone()),
        )
        .context("starting the CSI manager")?;
        let mut runner_config = AllocRunnerConfig::new(
            config.data_dir.join("alloc"),
            client_dir.join("plugins"),
            node_id,
            csi.clone(),
            Arc::new(conn.clone()),
            Arc::new(conn.clone()),
        );
        runner_config.store = Arc::new(state.clone());
        let runner_config = Arc::new(runner_config);
        Ok(Arc::new(Client {
            conn,
            csi,
            state,
            runner_config,
            runners: Mutex::new(HashMap::new()),
        }))
    }

    /// Runs the client until `shutdown`. Allocs keep running after it
    /// returns.
    pub async fn run(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        let mut tasks = tokio::task::JoinSet::new();
        {
            let conn = self.conn.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { conn.run_flusher(rx).await });
        }
        {
            let csi = self.csi.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { csi.run(rx).await });
        }
        // The heartbeater restores the time of the last successful heartbeat
        // from disk; from it, the disconnect tracker stops the allocs that
        // must not outlive a partition, also while the servers are still
        // unreachable after a restart.
        let heartbeater = berth_heartbeat::Heartbeater::new(
            berth_heartbeat::HeartbeatConfig::default(),
            Arc::new(self.conn.clone()),
            Arc::new(self.conn.clone()),
            Arc::new(self.state.clone()),
        );
        {
            let tracker = berth_heartbeat::DisconnectTracker::new(
                berth_heartbeat::DisconnectConfig::default(),
                self.clone(),
                heartbeater.last_success(),
            );
            let rx = shutdown.clone();
            tasks.spawn(async move { tracker.run(rx).await });
        }
        // The allocs that ran before a restart are picked up first, whether
        // or not the servers answer: their tasks are supervised again (and
        // their plugins registered again) at once.
        let restored = self.restore_allocs(shutdown.clone()).await;
        self.register_until_done(shutdown.clone()).await;
        if *shutdown.borrow() || !restored {
            while tasks.join_next().await.is_some() {}
            return;
        }
        {
            let conn = self.conn.clone();
            let csi = self.csi.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { calls::run_call_stream(conn, csi, rx).await });
        }
        {
            let rx = shutdown.clone();
            tasks.spawn(async move { heartbeater.run(rx).await });
        }
        {
            let this = self.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { this.watch_allocs(rx).await });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// Picks up the allocs this node ran before the agent restarted, before
    /// the alloc watch reconciles: their runners reattach to the tasks that
    /// still run, so the watch does not start them a second time. Reading
    /// the state database is retried: without it the client cannot know
    /// what runs here, and starting allocs blind could run a task twice.
    /// Returns false only at shutdown.
    async fn restore_allocs(&self, mut shutdown: watch::Receiver<bool>) -> bool {
        let mut failures: u32 = 0;
        let restored = loop {
            match berth_allocrunner::AllocStateStore::load_allocs(&self.state) {
                Ok(r) => break r,
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_millis(500 * 2u64.pow(failures.min(6)));
                    tracing::error!(error = %e, retry_in = ?wait, "reading the allocs to restore failed; no alloc starts until it succeeds");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.wait_for(|v| *v) => return false,
                    }
                }
            }
        };
        let mut runners = self.runners.lock().await;
        for r in restored {
            let id = r.alloc.id.clone();
            if runners.contains_key(&id) {
                continue;
            }
            tracing::info!(alloc_id = %id, job = %r.alloc.job_id, tasks = r.handles.len(), "restoring alloc");
            let runner = AllocRunner::restore(self.runner_config.clone(), r);
            runner.run();
            runners.insert(id, runner);
        }
        true
    }

    async fn register_until_done(&self, mut shutdown: watch::Receiver<bool>) {
        let mut failures: u32 = 0;
        loop {
            match self.conn.register().await {
                Ok(ttl) => {
                    tracing::info!(ttl = ?ttl, "node registered");
                    return;
                }
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_millis(100 * 2u64.pow(failures.min(6)));
                    tracing::warn!(error = %e, retry_in = ?wait, "registering the node failed");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.wait_for(|v| *v) => return,
                    }
                }
            }
        }
    }

    /// Follows the servers' view of this node's allocs and reconciles the
    /// runners with it.
    async fn watch_allocs(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut failures: u32 = 0;
        loop {
            let req = pb::WatchAllocationsRequest {
                node_id: self.conn.node_id(),
            };
            let mut node_client = self.conn.node_client();
            let stream = tokio::select! {
                r = node_client.watch_allocations(req) => r,
                _ = shutdown.wait_for(|v| *v) => return,
            };
            match stream {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    loop {
                        let next = tokio::select! {
                            n = stream.next() => n,
                            _ = shutdown.wait_for(|v| *v) => return,
                        };
                        match next {
                            Some(Ok(update)) => {
                                failures = 0;
                                self.reconcile(update).await;
                            }
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "alloc watch failed");
                                break;
                            }
                            None => break,
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "opening the alloc watch failed"),
            }
            failures += 1;
            let wait = Duration::from_millis(100 * 2u64.pow(failures.min(6)));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.wait_for(|v| *v) => return,
            }
        }
    }

    async fn reconcile(&self, update: pb::AllocationsUpdate) {
        let (allocs, undecodable) = decode_allocs(&update.allocs_json);
        let mut runners = self.runners.lock().await;
        let seen: HashSet<String> = allocs.iter().map(|a| a.id.clone()).collect();
        for alloc in allocs {
            match runners.get(&alloc.id) {
                Some(r) => r.update(alloc),
                None => {
                    if alloc.client_status.is_terminal() || alloc.server_terminal() {
                        continue;
                    }
                    tracing::info!(alloc_id = %alloc.id, job = %alloc.job_id, group = %alloc.task_group, "starting alloc");
                    let id = alloc.id.clone();
                    let runner = AllocRunner::new(self.runner_config.clone(), alloc);
                    runner.run();
                    runners.insert(id, runner);
                }
            }
        }
        let gone = allocs_to_collect(runners.keys(), &seen, undecodable);
        for id in gone {
            if let Some(r) = runners.remove(&id) {
                tracing::info!(alloc_id = %id, "alloc garbage collected; destroying");
                // Destroying waits for every volume of the alloc to be
                // unmounted; until it is, the alloc's records are kept and
                // destroying is tried again.
                tokio::spawn(async move {
                    let mut wait = Duration::from_secs(1);
                    while let Err(e) = r.destroy().await {
                        tracing::error!(alloc_id = %id, error = %e, retry_in = ?wait, "destroying the alloc failed");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(60));
                    }
                });
            }
        }
    }
}

/// The allocs of an update that decode, and how many did not (each logged).
fn decode_allocs(raw: &[Vec<u8>]) -> (Vec<Allocation>, usize) {
    let mut allocs = Vec::with_capacity(raw.len());
    let mut undecodable = 0;
    for bytes in raw {
        match serde_json::from_slice::<Allocation>(bytes) {
            Ok(a) => allocs.push(a),
            Err(e) => {
                undecodable += 1;
                tracing::error!(error = %e, "the servers sent an alloc that does not decode; skipped")
            }
        }
    }
    (allocs, undecodable)
}

/// The running allocs the servers no longer know, which were garbage
/// collected. When some of the update did not decode, absence proves
/// nothing: a running alloc is never destroyed over a message this client
/// cannot read, so none are.
fn allocs_to_collect<'a>(
    running: impl Iterator<Item = &'a String>,
    seen: &HashSet<String>,
    undecodable: usize,
) -> Vec<String> {
    if undecodable > 0 {
        tracing::warn!(
            undecodable,
            "not collecting allocs missing from an update that did not fully decode"
        );
        return Vec::new();
    }
    running.filter(|id| !seen.contains(*id)).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc_json(id: &str) -> Vec<u8> {
        let a = Allocation {
            id: id.to_string(),
            ..Allocation::default()
        };
        serde_json::to_vec(&a).expect("an alloc encodes")
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn decode_allocs_keeps_what_decodes_and_counts_the_rest() {
        let raw = vec![alloc_json("a"), b"{not json".to_vec(), alloc_json("b")];
        let (allocs, undecodable) = decode_allocs(&raw);
        let decoded: Vec<&str> = allocs.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(decoded, vec!["a", "b"]);
        assert_eq!(undecodable, 1);

        let (allocs, undecodable) = decode_allocs(&[alloc_json("a")]);
        assert_eq!(allocs.len(), 1);
        assert_eq!(undecodable, 0);
    }

    #[test]
    fn an_update_with_an_undecodable_alloc_collects_nothing() {
        let running = ids(&["a", "b", "c"]);
        // The update names only "a"; "b" may be the entry that did not decode.
        let (allocs, undecodable) = decode_allocs(&[alloc_json("a"), b"garbage".to_vec()]);
        let seen: HashSet<String> = allocs.iter().map(|a| a.id.clone()).collect();
        assert!(allocs_to_collect(running.iter(), &seen, undecodable).is_empty());
    }

    #[test]
    fn a_fully_decoded_update_collects_the_allocs_it_no_longer_names() {
        let running = ids(&["a", "b", "c"]);
        let (allocs, undecodable) = decode_allocs(&[alloc_json("b")]);
        let seen: HashSet<String> = allocs.iter().map(|a| a.id.clone()).collect();
        let mut gone = allocs_to_collect(running.iter(), &seen, undecodable);
        gone.sort();
        assert_eq!(gone, ids(&["a", "c"]));

        // An empty update that decoded fully: the servers know none of them.
        let mut gone = allocs_to_collect(running.iter(), &HashSet::new(), 0);
        gone.sort();
        assert_eq!(gone, ids(&["a", "b", "c"]));
    }
}
