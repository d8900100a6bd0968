//! The client role: registers the node, keeps it alive with heartbeats,
//! watches the allocs the servers place here and runs them, and answers the
//! servers' calls. Its durable state lives in one database file under
//! `<data_dir>/client/`.
//!
//! The client knows nothing of the agent around it: what it needs from it
//! comes through small traits, the TLS it dials with
//! ([`servers::ServerTls`]) and the node-local HTTP API that answers the
//! servers' forwarded requests ([`calls::LocalApi`]).

pub mod calls;
mod cluster_acl;
mod config;
mod fingerprint;
pub mod gc;
mod heap;
pub mod logs;
pub mod probe;
pub mod rpc;
pub mod servers;
pub mod state;

use berth_sync::Shutdown;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_allocrunner::{AllocRunner, AllocRunnerConfig};
use berth_csimanager::{CsiManager, ManagerConfig, PluginRegistry};
use berth_proto::berth::v1 as pb;
use berth_structs::{Allocation, Node};
use tokio::sync::{watch, Mutex, Notify};
use tokio_stream::StreamExt;

pub use config::ClientConfig;
pub use fingerprint::node_fingerprint;
use fingerprint::{driver_health_events, fingerprint_drivers, DRIVER_FINGERPRINT_INTERVAL};
use heap::trim_heap_after_changes;
pub use heap::HEAP_TRIM_INTERVAL;
use rpc::ServerConn;
use state::ClientState;

/// How long a starting client tries to register before it counts as
/// ready anyway (see [`Client::ready`]).
pub const READY_WITHOUT_SERVERS_AFTER: Duration = Duration::from_secs(5);

/// How long the removal of orphaned mounts at start waits for a plugin
/// (plugins are restored tasks themselves) before it unmounts without it.
pub const ORPHAN_PLUGIN_WAIT: Duration = Duration::from_secs(30);

/// An alloc as the client running it sees it: what the node-local HTTP
/// API answers, also while the servers are unreachable.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClientAllocView {
    pub id: String,
    pub name: String,
    pub job_id: String,
    pub task_group: String,
    pub desired_status: berth_structs::AllocDesiredStatus,
    pub client_status: berth_structs::AllocClientStatus,
    pub task_states: BTreeMap<String, berth_structs::TaskState>,
}

impl ClientAllocView {
    fn of(r: &AllocRunner) -> ClientAllocView {
        let alloc = r.alloc();
        ClientAllocView {
            id: alloc.id.clone(),
            name: alloc.name.clone(),
            job_id: alloc.job_id.clone(),
            task_group: alloc.task_group.clone(),
            desired_status: alloc.desired_status,
            client_status: r.client_status(),
            task_states: r.task_states(),
        }
    }
}

pub struct Client {
    conn: ServerConn,
    csi: Arc<CsiManager>,
    state: ClientState,
    runner_config: Arc<AllocRunnerConfig>,
    runners: Mutex<HashMap<String, AllocRunner>>,
    /// Where the `exec` tasks' cgroups are (None: the host has none to
    /// use).
    cgroups: Option<berth_allocrunner::cgroups::Cgroups>,
    gc_policy: gc::GcPolicy,
    gc_interval: Duration,
    /// See [`ClientConfig::disconnect_startup_grace`].
    disconnect_startup_grace: Duration,
    /// See [`ClientConfig::csi_volume_stats_interval`].
    csi_volume_stats_interval: Duration,
    /// See [`ClientConfig::local_api`].
    local_api: Option<calls::LocalApiFactory>,
    /// Wakes the garbage collector (the servers' view of the allocs
    /// changed: some may have become collectable).
    gc_wake: Notify,
    /// See [`Client::ready`].
    ready: watch::Sender<bool>,
    /// True once the node registered with the servers.
    registered: watch::Sender<bool>,
    /// True once the client is told to stop: requests that wait (a log
    /// read that follows) answer at once.
    shutdown: Shutdown,
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
                let window = alloc.group()?.stop_on_client_after()?;
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

/// The stats csimanager collects for an alloc's volumes (by volume ID) go
/// to the servers by the group's volume names: a volume the group asks for
/// under two names is reported under both.
#[async_trait::async_trait]
impl berth_csimanager::VolumeStatsSink for Client {
    async fn volume_stats_changed(
        &self,
        alloc_id: &str,
        stats: BTreeMap<String, berth_structs::CsiVolumeStats>,
    ) {
        let alloc = {
            let runners = self.runners.lock().await;
            // Not for an alloc on its way out: its volumes are being
            // unmounted, and the servers keep what they last heard.
            match runners.get(alloc_id) {
                Some(r) if !r.client_status().is_terminal() && !r.alloc().server_terminal() => {
                    r.alloc()
                }
                _ => return,
            }
        };
        let by_name = volume_stats_by_name(&alloc, stats);
        if !by_name.is_empty() {
            self.conn.volume_stats_updated(alloc_id, &by_name);
        }
    }
}

/// `stats` (by volume ID) keyed by the names under which `alloc`'s group
/// asks for those volumes.
fn volume_stats_by_name(
    alloc: &Allocation,
    stats: BTreeMap<String, berth_structs::CsiVolumeStats>,
) -> BTreeMap<String, berth_structs::CsiVolumeStats> {
    let Some(group) = alloc.group() else {
        return BTreeMap::new();
    };
    group
        .volumes
        .iter()
        .filter(|(_, v)| v.volume_type == "csi")
        .filter_map(|(name, v)| {
            stats
                .get(&v.source_for(alloc.index))
                .map(|s| (name.clone(), s.clone()))
        })
        .collect()
}

impl Client {
    pub async fn start(config: ClientConfig, shutdown: Shutdown) -> Result<Arc<Client>> {
        let client_dir = config.data_dir.join("client");
        let state = ClientState::open(&client_dir)?;
        let quarantined = state.quarantined()?;
        if !quarantined.is_empty() {
            tracing::warn!(records = ?quarantined, "client state holds quarantined records that did not decode");
        }
        let identity = state.node_identity()?;
        let node_id = identity.node_id.clone();
        let node = node_fingerprint(&config, node_id.clone());
        tracing::info!(node_id = %node.id, name = %node.name, "client starting");
        let channels = servers::ServerChannels::with_tls(&config.servers, config.tls.clone())?;
        channels.pin_cluster_of(&state)?;
        let conn = ServerConn::new(channels, node, identity.secret);
        // Until the servers say again, what they said before a restart.
        if let Some(enabled) = state.cluster_acl()? {
            conn.note_cluster_acl(enabled);
        }
        if let Some(token) = &config.intro_token {
            conn.set_intro_token(token.clone());
        }
        let store = Arc::new(state.clone());
        let csi = CsiManager::new(
            ManagerConfig {
                root_dir: client_dir.join("csi"),
                node_id: node_id.clone(),
                call_timeout: config.csi_call_timeout,
                fingerprint_interval: config.csi_fingerprint_interval,
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
        let settings = config.driver_settings();
        runner_config.drivers = AllocRunnerConfig::drivers_for(&settings);
        runner_config.heartbeat_lease = Some(client_dir.join(berth_allocrunner::lease::LEASE_FILE));
        let runner_config = Arc::new(runner_config);
        Ok(Arc::new(Client {
            conn,
            csi,
            state,
            runner_config,
            runners: Mutex::new(HashMap::new()),
            cgroups: settings.cgroups.ok(),
            gc_policy: gc::GcPolicy {
                max_allocs: config.gc_max_allocs,
                alloc_threshold: config.gc_alloc_threshold,
            },
            gc_interval: config.gc_interval,
            disconnect_startup_grace: config.disconnect_startup_grace,
            csi_volume_stats_interval: config.csi_volume_stats_interval,
            local_api: config.local_api.clone(),
            gc_wake: Notify::new(),
            ready: watch::channel(false).0,
            registered: watch::channel(false).0,
            shutdown,
        }))
    }

    /// Becomes true once the allocs that ran before a restart are picked
    /// up again and the node has registered, or registering has failed for
    /// [`READY_WITHOUT_SERVERS_AFTER`]: a client comes up during a
    /// partition, and keeps registering in the background.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// The servers this client dials, and which one is in use.
    pub fn servers(&self) -> &servers::ServerChannels {
        self.conn.servers()
    }

    /// The servers' channel with the node secret on every call: what any
    /// client of the agent protocol this agent makes is built on.
    pub fn node_channel(&self) -> rpc::NodeChannel {
        self.conn.node_channel()
    }

    /// The node as this client registers it.
    pub fn node(&self) -> Node {
        self.conn.node()
    }

    /// When the last heartbeat succeeded (Unix milliseconds), also before
    /// a restart; `None` if none ever did.
    pub fn last_heartbeat_ms(&self) -> Option<i64> {
        berth_heartbeat::LastHeartbeatStore::load(&self.state)
    }

    /// The allocs this client runs, as it sees them (not as the servers
    /// last heard), in id order.
    pub async fn alloc_views(&self) -> Vec<ClientAllocView> {
        let runners = self.runners.lock().await;
        let mut views: Vec<ClientAllocView> = runners.values().map(ClientAllocView::of).collect();
        views.sort_by(|a, b| a.id.cmp(&b.id));
        views
    }

    /// How many of the allocs this client runs have each client status,
    /// every status named (zeros too).
    pub async fn alloc_status_counts(&self) -> Vec<(&'static str, i64)> {
        use berth_structs::AllocClientStatus as S;
        let statuses = [S::Pending, S::Running, S::Complete, S::Failed, S::Lost];
        let mut counts = [0i64; 5];
        for r in self.runners.lock().await.values() {
            let status = r.client_status();
            if let Some(i) = statuses.iter().position(|s| *s == status) {
                counts[i] += 1;
            }
        }
        statuses
            .iter()
            .zip(counts)
            .map(|(s, n)| (s.as_str(), n))
            .collect()
    }

    /// Waits as a blocking read of the allocs asks: with `index` above 0,
    /// until the client's view of its allocs changes past it, `wait`
    /// passes, or the client stops. Returns the index the answer reflects,
    /// read before the answer is, so that a change between the two is seen
    /// by the next read rather than lost.
    pub async fn wait_alloc_change(&self, index: Option<u64>, wait: Duration) -> u64 {
        let mut changes = self.conn.alloc_changes();
        if let Some(min) = index.filter(|i| *i > 0) {
            let mut shutdown = self.shutdown.clone();
            tokio::select! {
                _ = tokio::time::timeout(wait, changes.wait_for(|i| *i > min)) => {}
                _ = shutdown.wait() => {}
            }
        }
        let index = *changes.borrow();
        index
    }

    /// One alloc this client runs, as it sees it.
    pub async fn alloc_view(&self, id: &str) -> Option<ClientAllocView> {
        self.runners.lock().await.get(id).map(ClientAllocView::of)
    }

    /// The latest usage sample of every running task its driver measures:
    /// `(alloc ID, job ID, task, sample)`.
    pub async fn task_samples(&self) -> Vec<(String, String, String, berth_structs::TaskUsage)> {
        let runners = self.runners.lock().await;
        let mut rows = Vec::new();
        for r in runners.values() {
            let alloc = r.alloc();
            for (task, usage) in r.task_samples() {
                rows.push((alloc.id.clone(), alloc.job_id.clone(), task, usage));
            }
        }
        rows
    }

    /// The runner of an alloc this client runs, by ID or unique ID prefix;
    /// else the IDs that match (none, or several).
    pub async fn alloc_runner(&self, id: &str) -> Result<AllocRunner, Vec<String>> {
        let runners = self.runners.lock().await;
        if let Some(r) = runners.get(id) {
            return Ok(r.clone());
        }
        let mut matches: Vec<&AllocRunner> = runners
            .values()
            .filter(|r| !id.is_empty() && r.alloc_id().starts_with(id))
            .collect();
        if matches.len() == 1 {
            return Ok(matches.remove(0).clone());
        }
        let mut ids: Vec<String> = matches.iter().map(|r| r.alloc_id().to_string()).collect();
        ids.sort();
        Err(ids)
    }

    /// Whether the node has registered with the servers since the client
    /// started.
    pub fn registered(&self) -> bool {
        *self.registered.borrow()
    }

    /// Runs the client until `shutdown`. Allocs keep running after it
    /// returns.
    pub async fn run(self: Arc<Self>, shutdown: Shutdown) {
        let mut tasks = tokio::task::JoinSet::new();
        self.spawn_background(&mut tasks, &shutdown);
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
                berth_heartbeat::DisconnectConfig {
                    startup_grace: self.disconnect_startup_grace,
                    ..berth_heartbeat::DisconnectConfig::default()
                },
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
        if shutdown.is_shutdown() || !restored {
            while tasks.join_next().await.is_some() {}
            return;
        }
        // Mounts that no restored alloc owns are removed in the background;
        // the alloc watch, which brings new allocs, waits for it.
        let orphans = self.spawn_orphan_cleanup().await;
        {
            let this = self.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { this.run_gc(rx).await });
        }
        self.register_or_ready_anyway(shutdown.clone()).await;
        if shutdown.is_shutdown() {
            while tasks.join_next().await.is_some() {}
            return;
        }
        // The servers count the registration as the node's heartbeat (and
        // would place replacements from it): so does the client, or with
        // no heartbeat on record its allocs with a disconnect window would
        // never stop should no heartbeat succeed from here on.
        heartbeater.record_success();
        {
            let conn = self.conn.clone();
            let csi = self.csi.clone();
            let local_api = calls::LocalApiFactory::make(self.local_api.as_ref(), &self);
            let rx = shutdown.clone();
            tasks.spawn(async move { calls::run_call_stream(conn, csi, local_api, rx).await });
        }
        {
            let rx = shutdown.clone();
            tasks.spawn(async move { heartbeater.run(rx).await });
        }
        {
            let mut rx = shutdown.clone();
            let stopping = async move {
                let _ = rx.wait().await;
            };
            let stopped = tokio::select! {
                _ = orphans => false,
                _ = stopping => true,
            };
            if stopped {
                while tasks.join_next().await.is_some() {}
                return;
            }
        }
        {
            let this = self.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { this.watch_allocs(rx).await });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// The loops that run from the start, whether or not the servers
    /// answer: the update flusher, CSI, the drivers' health, the heap
    /// trimmer and the volume stats.
    fn spawn_background(
        self: &Arc<Self>,
        tasks: &mut tokio::task::JoinSet<()>,
        shutdown: &Shutdown,
    ) {
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
        {
            let me = self.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { me.watch_drivers(rx).await });
        }
        {
            let changes = self.conn.alloc_changes();
            let rx = shutdown.clone();
            tasks.spawn(async move { trim_heap_after_changes(changes, rx).await });
        }
        {
            let changes = self.conn.cluster_acl_changes();
            let state = self.state.clone();
            let rx = shutdown.clone();
            tasks.spawn(async move { cluster_acl::record(changes, state, rx).await });
        }
        {
            let csi = self.csi.clone();
            let sink: Arc<dyn berth_csimanager::VolumeStatsSink> = self.clone();
            let interval = self.csi_volume_stats_interval;
            let rx = shutdown.clone();
            tasks.spawn(async move { csi.run_volume_stats(sink, interval, rx).await });
        }
    }

    /// Registers the node. Servers that do not answer do not keep the
    /// client from coming up: after a while it is ready anyway, and
    /// registering goes on.
    async fn register_or_ready_anyway(&self, shutdown: Shutdown) {
        let register = self.register_until_done(shutdown);
        tokio::pin!(register);
        tokio::select! {
            _ = &mut register => {}
            _ = tokio::time::sleep(READY_WITHOUT_SERVERS_AFTER) => {
                tracing::warn!(
                    waited = ?READY_WITHOUT_SERVERS_AFTER,
                    "the servers do not answer; the client is up and keeps registering"
                );
                self.ready.send_replace(true);
                register.await;
            }
        }
    }

    /// Picks up the allocs this node ran before the agent restarted, before
    /// the alloc watch reconciles: their runners reattach to the tasks that
    /// still run, so the watch does not start them a second time. Reading
    /// the state database is retried: without it the client cannot know
    /// what runs here, and starting allocs blind could run a task twice.
    /// Returns false only at shutdown.
    async fn restore_allocs(&self, mut shutdown: Shutdown) -> bool {
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
                        _ = shutdown.wait() => return false,
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

    /// Removes the cgroups of allocs none of the allocs restored at start
    /// is (with what runs in them), then, in a task of its own, the mounts
    /// below the CSI root and the alloc root that none of them owns (see
    /// `berth_csimanager::orphans`), waiting at most
    /// [`ORPHAN_PLUGIN_WAIT`] for the plugins it needs.
    async fn spawn_orphan_cleanup(&self) -> tokio::task::JoinHandle<()> {
        let known: std::collections::BTreeSet<String> =
            self.runners.lock().await.keys().cloned().collect();
        let csi = self.csi.clone();
        let alloc_root = self.runner_config.alloc_root.clone();
        if let Some(cgroups) = self.cgroups.clone() {
            let known = known.clone();
            let swept = tokio::task::spawn_blocking(move || cgroups.remove_orphans(&known)).await;
            let (removed, failed) = swept.unwrap_or_default();
            for alloc in removed {
                tracing::info!(alloc_id = %alloc, "removed the cgroups of an alloc this node does not know");
            }
            for (alloc, error) in failed {
                tracing::warn!(alloc_id = %alloc, %error, "removing the cgroups of an alloc this node does not know failed");
            }
        }
        tokio::spawn(async move {
            let removed = csi
                .remove_orphaned_mounts(&alloc_root, &known, ORPHAN_PLUGIN_WAIT)
                .await;
            if !removed.is_empty() {
                tracing::info!(mounts = removed.len(), "orphaned mounts handled");
            }
        })
    }

    /// Fingerprints the drivers every [`DRIVER_FINGERPRINT_INTERVAL`]
    /// until `shutdown`. A change of a driver's health is a `Driver` node
    /// event, and the node registers again with the new fingerprints (the
    /// scheduler places only on usable drivers); a failed registration is
    /// retried at the next round.
    async fn watch_drivers(&self, mut shutdown: Shutdown) {
        let mut unsent = false;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(DRIVER_FINGERPRINT_INTERVAL) => {}
                _ = shutdown.wait() => return,
            }
            let found = fingerprint_drivers(&self.runner_config.drivers);
            let events = driver_health_events(&self.conn.node().driver_info, &found);
            self.conn.set_driver_info(found);
            if events.is_empty() && !unsent {
                continue;
            }
            for event in events {
                tracing::warn!(message = %event.message, details = ?event.details, "driver health changed");
                berth_csimanager::NodeEventSink::emit(&self.conn, event);
            }
            unsent = match self.conn.register().await {
                Ok(_) => false,
                Err(e) => {
                    tracing::warn!(error = %e, "registering the node's new driver health failed; retrying at the next fingerprint");
                    true
                }
            };
        }
    }

    async fn register_until_done(&self, mut shutdown: Shutdown) {
        let mut failures: u32 = 0;
        loop {
            match self.conn.register().await {
                Ok(ttl) => {
                    tracing::info!(ttl = ?ttl, server = %self.conn.servers().current_addr(), "node registered");
                    self.registered.send_replace(true);
                    self.ready.send_replace(true);
                    return;
                }
                Err(e) => {
                    failures += 1;
                    let wait = servers::retry_delay(failures);
                    tracing::warn!(error = %e, retry_in = ?wait, "registering the node failed");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.wait() => return,
                    }
                }
            }
        }
    }

    /// Follows the servers' view of this node's allocs and reconciles the
    /// runners with it.
    async fn watch_allocs(self: Arc<Self>, mut shutdown: Shutdown) {
        let mut failures: u32 = 0;
        loop {
            let req = pb::WatchAllocationsRequest {
                node_id: self.conn.node_id(),
                deltas: true,
            };
            // The server this attempt goes to, moved on from if it fails.
            let server = self.conn.servers().current();
            let mut node_client = self.conn.node_client();
            let stream = tokio::select! {
                r = node_client.watch_allocations(req) => r,
                _ = shutdown.wait() => return,
            };
            match stream {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    loop {
                        let next = tokio::select! {
                            n = stream.next() => n,
                            _ = shutdown.wait() => return,
                        };
                        match next {
                            Some(Ok(update)) => {
                                failures = 0;
                                if let Err(why) = self.reconcile(update).await {
                                    tracing::warn!(%why, "alloc watch update not applied; opening the watch anew");
                                    break;
                                }
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
            // The server may be gone: the next attempt goes to the next one.
            self.conn.servers().failover_from(server);
            failures += 1;
            let wait = servers::retry_delay(failures);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.wait() => return,
            }
        }
    }

    /// Brings the runners to the servers' view in `update`: the node's
    /// allocs, or (a delta) those that changed and the IDs of those gone.
    ///
    /// Fails, applying nothing, when a delta leaves out the job of an
    /// alloc this client keeps none of: the watch is then opened anew,
    /// and starts with the full set.
    async fn reconcile(&self, update: pb::AllocationsUpdate) -> Result<(), String> {
        let (mut allocs, undecodable) = decode_allocs(&update.allocs_json);
        let mut runners = self.runners.lock().await;
        if update.delta && !update.same_job_ids.is_empty() {
            let same_job: HashSet<&str> = update.same_job_ids.iter().map(String::as_str).collect();
            for alloc in allocs
                .iter_mut()
                .filter(|a| same_job.contains(a.id.as_str()))
            {
                match runners.get(&alloc.id) {
                    Some(r) => alloc.job = r.alloc().job.clone(),
                    None if alloc.client_status.is_terminal() => {}
                    None => {
                        return Err(format!(
                            "the servers sent alloc {} without its job, which this client does not have",
                            alloc.id
                        ))
                    }
                }
            }
        }
        let gone = if update.delta {
            update.removed_ids
        } else {
            let seen: HashSet<String> = allocs.iter().map(|a| a.id.clone()).collect();
            allocs_to_collect(runners.keys(), &seen, undecodable)
        };
        for alloc in allocs {
            match runners.get(&alloc.id) {
                Some(r) => r.update(alloc),
                None => {
                    if alloc.client_status.is_terminal() {
                        continue;
                    }
                    if alloc.server_terminal() {
                        // Stopped before this node started it. Its runner
                        // starts nothing: it reports the alloc complete,
                        // each task with a Not Started event, and keeps that
                        // in the state database until it reaches the
                        // servers, also across a restart.
                        tracing::info!(alloc_id = %alloc.id, job = %alloc.job_id, group = %alloc.task_group, "alloc stopped before it started; reporting it complete");
                    } else {
                        tracing::info!(alloc_id = %alloc.id, job = %alloc.job_id, group = %alloc.task_group, "starting alloc");
                    }
                    let id = alloc.id.clone();
                    let runner = AllocRunner::new(self.runner_config.clone(), alloc);
                    runner.run();
                    runners.insert(id, runner);
                }
            }
        }
        for id in gone {
            if let Some(r) = runners.remove(&id) {
                tracing::info!(alloc_id = %id, "alloc garbage collected by the servers; destroying");
                tokio::spawn(destroy_until_done(id, r, self.conn.clone()));
            }
        }
        drop(runners);
        self.conn.alloc_changed();
        // The servers' view changed: terminal allocs they now know about
        // may be collected here.
        self.gc_wake.notify_one();
        Ok(())
    }

    /// Collects garbage every `gc_interval` and whenever the servers' view
    /// of the allocs changes, until `shutdown`.
    async fn run_gc(self: Arc<Self>, mut shutdown: Shutdown) {
        // A zero period would make the interval panic, an enormous one
        // overflow the clock.
        let period = self.gc_interval.clamp(
            Duration::from_millis(100),
            Duration::from_secs(365 * 24 * 3600),
        );
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.gc_wake.notified() => {}
                _ = shutdown.wait() => return,
            }
            self.collect_garbage().await;
        }
    }

    /// Destroys the terminal allocs the policy picks (see [`gc`]): their
    /// runners go, their alloc dirs are removed (never through a mount)
    /// and their records leave the state database. Only allocs whose
    /// postrun is done, with no volume still mounted, and whose end the
    /// servers have recorded are candidates: the servers would otherwise
    /// send a collected alloc as still running, and it would be started
    /// again.
    async fn collect_garbage(&self) {
        let victims: Vec<(String, AllocRunner)> = {
            let mut runners = self.runners.lock().await;
            let terminal = runners
                .values()
                .filter(|r| r.client_status().is_terminal())
                .count();
            let candidates: Vec<gc::GcCandidate> = runners
                .values()
                .filter(|r| r.alloc().client_status.is_terminal())
                .filter_map(|r| {
                    if let Some(why) = r.gc_blocker() {
                        tracing::trace!(alloc_id = %r.alloc_id(), reason = %why, "not collecting alloc yet");
                        return None;
                    }
                    Some(gc::GcCandidate {
                        alloc_id: r.alloc_id().to_string(),
                        terminal_at_ms: r.terminal_at_ms()?,
                    })
                })
                .collect();
            let picked =
                self.gc_policy
                    .allocs_to_destroy(candidates, terminal, berth_structs::now_ms());
            picked
                .into_iter()
                .filter_map(|id| runners.remove(&id).map(|r| (id, r)))
                .collect()
        };
        if !victims.is_empty() {
            self.conn.alloc_changed();
        }
        for (id, r) in victims {
            tracing::info!(alloc_id = %id, job = %r.alloc().job_id, "garbage collecting terminal alloc");
            if let Err(e) = r.destroy().await {
                tracing::warn!(alloc_id = %id, error = %e, "destroying the alloc failed; retrying");
                tokio::spawn(destroy_until_done(id, r, self.conn.clone()));
            }
        }
    }
}

/// Destroys the alloc, retrying with backoff. Destroying waits for every
/// volume of the alloc to be unmounted; until it is, the alloc's records
/// are kept (a restarted agent picks it up again) and destroying is tried
/// again.
/// An alloc dir kept because something is still mounted below it is
/// reported as a node event (again when what is mounted changes).
async fn destroy_until_done(id: String, r: AllocRunner, events: ServerConn) {
    let mut wait = Duration::from_secs(1);
    let mut reported: Option<String> = None;
    while let Err(e) = r.destroy().await {
        tracing::error!(alloc_id = %id, error = %e, retry_in = ?wait, "destroying the alloc failed");
        if let Some(event) = gc::alloc_dir_kept_event(&id, &e) {
            if reported.as_deref() != Some(event.details["mounts"].as_str()) {
                reported = Some(event.details["mounts"].clone());
                berth_csimanager::NodeEventSink::emit(&events, event);
            }
        }
        tokio::time::sleep(wait).await;
        wait = wait.saturating_mul(2).min(Duration::from_secs(60));
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
    use berth_allocrunner::AllocStateStore;
    use berth_structs::DriverInfo;
    use berth_structs::{
        AllocClientStatus, AllocDesiredStatus, Job, JobType, Task, TaskGroup, TaskState,
        TaskStateKind,
    };
    use berth_sync::ShutdownSender;
    use berth_testutil::wait_for;
    use std::collections::BTreeMap;

    #[test]
    fn a_change_of_a_drivers_health_is_a_driver_event_and_a_new_time_is_none() {
        let healthy = DriverInfo::healthy("Healthy");
        let broken = DriverInfo::unhealthy("the executor /x cannot be read: gone");
        let at = |info: &DriverInfo, ms| DriverInfo {
            update_time_ms: ms,
            ..info.clone()
        };
        let map = |info: DriverInfo| BTreeMap::from([("raw_exec".to_string(), info)]);

        let same = driver_health_events(&map(at(&healthy, 1)), &map(at(&healthy, 2)));
        assert!(same.is_empty(), "{same:?}");

        let down = driver_health_events(&map(healthy.clone()), &map(broken.clone()));
        assert_eq!(down.len(), 1);
        assert_eq!(down[0].subsystem, "Driver");
        assert_eq!(down[0].message, "Driver raw_exec is unhealthy");
        assert_eq!(down[0].details["driver"], "raw_exec");
        assert_eq!(down[0].details["description"], broken.health_description);

        let up = driver_health_events(&map(broken.clone()), &map(healthy.clone()));
        assert_eq!(up[0].message, "Driver raw_exec is healthy");

        // A driver first seen is news only when it cannot run tasks.
        assert!(driver_health_events(&BTreeMap::new(), &map(healthy)).is_empty());
        assert_eq!(
            driver_health_events(&BTreeMap::new(), &map(broken)).len(),
            1
        );
    }

    #[test]
    fn the_registered_node_has_its_drivers_health_and_reservations() {
        let dir = tempfile::tempdir().unwrap();
        let config = ClientConfig {
            reserved_cpu: 100,
            reserved_memory_mb: 64,
            ..ClientConfig::new(dir.path().to_path_buf(), vec![])
        };
        let node = node_fingerprint(&config, "n1".into());
        let raw_exec = &node.driver_info["raw_exec"];
        assert!(raw_exec.detected && raw_exec.healthy, "{raw_exec:?}");
        assert!(raw_exec.update_time_ms > 0);
        // This host has cgroups: exec is healthy too.
        let exec = &node.driver_info["exec"];
        assert!(exec.detected && exec.healthy, "{exec:?}");
        assert_eq!(node.drivers, ["exec", "raw_exec"]);
        assert_eq!(node.reserved.cpu, 100);
        assert_eq!(node.reserved.memory_mb, 64);
        assert_eq!(node.reserved.disk_mb, 0);
    }

    /// A client on `dir` whose servers never answer (the connection is
    /// lazy): enough to reconcile, run allocs that start nothing, collect
    /// garbage, and queue updates for the servers.
    async fn offline_client(dir: &std::path::Path, gc_max_allocs: usize) -> Arc<Client> {
        let config = ClientConfig {
            gc_max_allocs,
            ..ClientConfig::new(dir.to_path_buf(), vec!["http://127.0.0.1:1".into()])
        };
        Client::start(config, Shutdown::channel().1)
            .await
            .expect("the client starts")
    }

    /// An alloc of a batch job with two tasks, placed on `node_id`.
    fn placed_alloc(node_id: &str) -> Allocation {
        let task = |name: &str| Task {
            name: name.into(),
            driver: "raw_exec".into(),
            ..Task::default()
        };
        Allocation {
            id: berth_structs::generate_id(),
            name: "j.g[0]".into(),
            job_id: "j".into(),
            job: Job {
                id: "j".into(),
                name: "j".into(),
                job_type: JobType::Batch,
                task_groups: vec![TaskGroup {
                    name: "g".into(),
                    count: 1,
                    tasks: vec![task("web"), task("db")],
                    ..TaskGroup::default()
                }],
                ..Job::default()
            }
            .into(),
            task_group: "g".into(),
            node_id: node_id.into(),
            ..Allocation::default()
        }
    }

    fn stopped(mut a: Allocation) -> Allocation {
        a.desired_status = AllocDesiredStatus::Stop;
        a
    }

    fn update_of(allocs: &[Allocation]) -> pb::AllocationsUpdate {
        pb::AllocationsUpdate {
            index: 1,
            allocs_json: allocs
                .iter()
                .map(|a| serde_json::to_vec(a).expect("an alloc encodes"))
                .collect(),
            ..pb::AllocationsUpdate::default()
        }
    }

    /// The update queued for the servers, once it says the alloc is
    /// complete; its task states.
    async fn reported_complete(client: &Client, alloc_id: &str) -> BTreeMap<String, TaskState> {
        wait_for(
            "the alloc to be reported complete",
            Duration::from_secs(10),
            || {
                client
                    .conn
                    .pending_update(alloc_id)
                    .is_some_and(|u| u.client_status == AllocClientStatus::Complete.as_str())
            },
        )
        .await;
        let update = client.conn.pending_update(alloc_id).expect("an update");
        serde_json::from_slice(&update.task_states_json).expect("task states decode")
    }

    fn assert_never_started(tasks: &BTreeMap<String, TaskState>) {
        assert_eq!(tasks.len(), 2, "{tasks:?}");
        for (name, t) in tasks {
            assert_eq!(t.state, TaskStateKind::Dead, "{name}: {t:?}");
            assert!(!t.failed, "{name}: {t:?}");
            assert!(t.started_at_ms.is_none(), "{name} never started: {t:?}");
            let last = t.events.last().expect("events");
            assert_eq!(last.event_type, "Not Started", "{name}: {t:?}");
            assert_eq!(last.message, "the alloc was stopped before it started");
            assert!(
                !t.events.iter().any(|e| e.event_type == "Started"),
                "{name}: {t:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_alloc_stopped_before_it_started_is_reported_complete_also_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let alloc_id;
        {
            let client = offline_client(dir.path(), 50).await;
            // The servers placed the alloc and stopped it before this node
            // ever saw it running.
            let a = stopped(placed_alloc(&client.conn.node_id()));
            alloc_id = a.id.clone();
            client
                .reconcile(update_of(&[a]))
                .await
                .expect("the update applies");
            let tasks = reported_complete(&client, &alloc_id).await;
            assert_never_started(&tasks);
            assert!(
                !dir.path().join("alloc").join(&alloc_id).exists(),
                "nothing was set up for it"
            );
            let runner = client.runners.lock().await.get(&alloc_id).cloned();
            let runner = runner.expect("a runner reports it");
            wait_for("the runner to finish", Duration::from_secs(10), || {
                runner.is_done()
            })
            .await;
        }
        // The agent stops before the report reached the servers. The
        // restarted agent reports the alloc complete again, from its state
        // database, before the servers even answer.
        let client = offline_client(dir.path(), 50).await;
        assert!(client.conn.pending_update(&alloc_id).is_none());
        assert!(client.restore_allocs(Shutdown::channel().1).await);
        let tasks = reported_complete(&client, &alloc_id).await;
        assert_never_started(&tasks);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delta_keeps_the_allocs_it_does_not_name_and_drops_those_it_names_gone() {
        let dir = tempfile::tempdir().unwrap();
        let client = offline_client(dir.path(), 50).await;
        let node = client.conn.node_id();
        // Stopped before they started: their runners start nothing.
        let (a, b, c) = (
            stopped(placed_alloc(&node)),
            stopped(placed_alloc(&node)),
            stopped(placed_alloc(&node)),
        );
        let runners = || async {
            let mut ids: Vec<String> = client.runners.lock().await.keys().cloned().collect();
            ids.sort();
            ids
        };
        let sorted = |mut ids: Vec<String>| {
            ids.sort();
            ids
        };
        client
            .reconcile(update_of(&[a.clone(), b.clone()]))
            .await
            .expect("the update applies");
        assert_eq!(runners().await, sorted(vec![a.id.clone(), b.id.clone()]));

        // A delta that names c alone: a and b stay.
        let mut delta = update_of(std::slice::from_ref(&c));
        delta.delta = true;
        client.reconcile(delta).await.expect("the update applies");
        assert_eq!(
            runners().await,
            sorted(vec![a.id.clone(), b.id.clone(), c.id.clone()])
        );

        // A delta that names a gone: a alone goes.
        let mut delta = update_of(&[]);
        delta.delta = true;
        delta.removed_ids = vec![a.id.clone()];
        client.reconcile(delta).await.expect("the update applies");
        assert_eq!(runners().await, sorted(vec![b.id.clone(), c.id.clone()]));

        // A full set that leaves out c: c goes.
        client
            .reconcile(update_of(std::slice::from_ref(&b)))
            .await
            .expect("the update applies");
        assert_eq!(runners().await, vec![b.id.clone()]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delta_without_a_job_keeps_the_runners_and_one_it_lacks_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let client = offline_client(dir.path(), 50).await;
        let node = client.conn.node_id();
        let a = stopped(placed_alloc(&node));
        client
            .reconcile(update_of(std::slice::from_ref(&a)))
            .await
            .expect("the update applies");

        // The same alloc, moved on, without its job: the runner keeps its
        // job.
        let mut moved = a.clone();
        moved.modify_index += 1;
        moved.desired_description = "moved".into();
        let mut slim = moved.clone();
        slim.job = Default::default();
        let mut delta = update_of(&[slim]);
        delta.delta = true;
        delta.same_job_ids = vec![a.id.clone()];
        client.reconcile(delta).await.expect("the update applies");
        let runner = client.runners.lock().await.get(&a.id).cloned();
        assert_eq!(*runner.expect("its runner").alloc(), moved);

        // An alloc this client has no runner of, sent without its job:
        // refused, nothing started.
        let mut unknown = placed_alloc(&node);
        unknown.job = Default::default();
        let mut delta = update_of(std::slice::from_ref(&unknown));
        delta.delta = true;
        delta.same_job_ids = vec![unknown.id.clone()];
        assert!(client.reconcile(delta).await.is_err());
        assert!(!client.runners.lock().await.contains_key(&unknown.id));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn alloc_status_counts_name_every_status() {
        let dir = tempfile::tempdir().unwrap();
        let client = offline_client(dir.path(), 50).await;
        let zeros = [
            ("pending", 0),
            ("running", 0),
            ("complete", 0),
            ("failed", 0),
            ("lost", 0),
        ];
        assert_eq!(client.alloc_status_counts().await, zeros);
        let a = stopped(placed_alloc(&client.conn.node_id()));
        let id = a.id.clone();
        client
            .reconcile(update_of(&[a]))
            .await
            .expect("the update applies");
        reported_complete(&client, &id).await;
        let mut want = zeros;
        want[2].1 = 1;
        assert_eq!(client.alloc_status_counts().await, want);
    }

    /// A log read that waits for new bytes answers as soon as the client
    /// is told to stop: the agent's shutdown waits for no follower.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_log_read_answers_at_once_when_the_client_stops() {
        let dir = tempfile::tempdir().unwrap();
        let (stop, stopped_rx) = Shutdown::channel();
        let config = ClientConfig::new(dir.path().to_path_buf(), vec!["http://127.0.0.1:1".into()]);
        let client = Client::start(config, stopped_rx)
            .await
            .expect("the client starts");
        // The volume's claim never gets through to the servers: the task
        // stays pending, and has written nothing.
        let mut a = placed_alloc(&client.conn.node_id());
        let group = &mut std::sync::Arc::make_mut(&mut a.job).task_groups[0];
        group.tasks.truncate(1);
        group.volumes = [(
            "vol".to_string(),
            berth_structs::VolumeRequest {
                name: "vol".into(),
                volume_type: "csi".into(),
                source: "vol".into(),
                access_mode: Some(berth_structs::AccessMode::SingleNodeWriter),
                attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                ..Default::default()
            },
        )]
        .into();
        let id = a.id.clone();
        client
            .reconcile(update_of(&[a]))
            .await
            .expect("the update applies");
        let req = logs::LogsRequest {
            task: None,
            stream: berth_allocrunner::logs::LogStream::Stdout,
            start: logs::LogStart::FromStart(0),
            limit: 100,
            wait: Duration::from_secs(120),
        };
        let mut read = tokio::spawn({
            let client = client.clone();
            async move { client.read_task_logs(&id, &req).await }
        });
        if let Ok(early) = tokio::time::timeout(Duration::from_millis(500), &mut read).await {
            panic!("the read did not wait: {early:?}");
        }
        stop.shutdown();
        let answer = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("the read answers once the client stops")
            .unwrap()
            .expect("an answer");
        assert!(answer.read.data.is_empty());
        assert_ne!(answer.task_state, TaskStateKind::Dead);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn beyond_gc_max_allocs_the_oldest_terminal_allocs_are_destroyed_once_the_servers_know() {
        let dir = tempfile::tempdir().unwrap();
        let client = offline_client(dir.path(), 2).await;
        let node_id = client.conn.node_id();
        // Five allocs end one after another, each in a later millisecond.
        let mut allocs = Vec::new();
        for _ in 0..5 {
            let a = stopped(placed_alloc(&node_id));
            let logs = dir.path().join("alloc").join(&a.id).join("alloc/logs");
            std::fs::create_dir_all(&logs).unwrap();
            std::fs::write(logs.join("web.stdout.0"), "output").unwrap();
            allocs.push(a);
            client
                .reconcile(update_of(&allocs))
                .await
                .expect("the update applies");
            let id = allocs.last().map(|a| a.id.clone()).unwrap_or_default();
            reported_complete(&client, &id).await;
            let ended = client.runners.lock().await[&id].terminal_at_ms();
            let ended = ended.expect("a terminal time");
            wait_for("the clock to move on", Duration::from_secs(5), || {
                berth_structs::now_ms() > ended
            })
            .await;
        }
        let dir_of = |a: &Allocation| dir.path().join("alloc").join(&a.id);

        // The servers do not know yet that they ended: were they collected,
        // the servers would send them as still to run, and they would run.
        client.collect_garbage().await;
        assert_eq!(client.runners.lock().await.len(), 5);
        assert!(allocs.iter().all(|a| dir_of(a).exists()));

        // The servers record them complete.
        let acknowledged: Vec<Allocation> = allocs
            .iter()
            .cloned()
            .map(|mut a| {
                a.client_status = AllocClientStatus::Complete;
                a
            })
            .collect();
        client
            .reconcile(update_of(&acknowledged))
            .await
            .expect("the update applies");
        client.collect_garbage().await;

        let (oldest, newest) = allocs.split_at(3);
        for a in oldest {
            assert!(!dir_of(a).exists(), "alloc dir of {} is gone", a.id);
        }
        for a in newest {
            assert!(dir_of(a).exists(), "alloc dir of {} is kept", a.id);
        }
        let mut left: Vec<String> = client.runners.lock().await.keys().cloned().collect();
        left.sort();
        let mut want: Vec<String> = newest.iter().map(|a| a.id.clone()).collect();
        want.sort();
        assert_eq!(left, want);
        let mut recorded: Vec<String> = client
            .state
            .load_allocs()
            .unwrap()
            .into_iter()
            .map(|r| r.alloc.id)
            .collect();
        recorded.sort();
        assert_eq!(recorded, want, "the collected allocs' records are gone");

        // The servers still send the collected allocs (complete): none is
        // started again.
        client
            .reconcile(update_of(&acknowledged))
            .await
            .expect("the update applies");
        assert_eq!(client.runners.lock().await.len(), 2);
    }

    /// The client comes up while its servers do not answer: it is ready
    /// once registering has failed for a while, not registered, and keeps
    /// trying.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_whose_servers_do_not_answer_becomes_ready_unregistered() {
        let dir = tempfile::tempdir().unwrap();
        let client = offline_client(dir.path(), 50).await;
        let mut ready = client.ready();
        assert!(!*ready.borrow());
        let (stop_tx, run) = run_client(&client);
        tokio::time::timeout(
            READY_WITHOUT_SERVERS_AFTER + Duration::from_secs(10),
            ready.wait_for(|r| *r),
        )
        .await
        .expect("ready in time")
        .expect("the client lives");
        assert!(!client.registered());
        assert!(!run.is_finished(), "registering goes on");
        stop(stop_tx, run, "the client").await;
    }

    /// A client on `dir`/client with `servers`.
    async fn client_of(dir: &std::path::Path, servers: Vec<String>) -> Arc<Client> {
        let config = ClientConfig::new(dir.join("client"), servers);
        Client::start(config, Shutdown::channel().1)
            .await
            .expect("the client starts")
    }

    /// Runs `client` until told to stop through the sender.
    fn run_client(client: &Arc<Client>) -> (ShutdownSender, tokio::task::JoinHandle<()>) {
        let (stop_tx, stop_rx) = Shutdown::channel();
        (stop_tx, tokio::spawn(client.clone().run(stop_rx)))
    }

    /// Tells `what` (a task run with `stop_tx`) to stop, and waits for it to
    /// end without a panic.
    async fn stop(stop_tx: ShutdownSender, task: tokio::task::JoinHandle<()>, what: &str) {
        stop_tx.shutdown();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap_or_else(|_| panic!("{what} stops"))
            .expect("no panic");
    }

    /// A client's servers: `dead` first, `live` second.
    fn servers_dead_first(dead: std::net::SocketAddr, live: std::net::SocketAddr) -> Vec<String> {
        vec![format!("http://{dead}"), format!("http://{live}")]
    }

    /// A loopback address where nothing listens.
    fn dead_addr() -> std::net::SocketAddr {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        dead.local_addr().unwrap()
    }

    /// A real server on a temp dir serving the agent protocol on loopback
    /// (answering every heartbeat with Unavailable when
    /// `refuse_heartbeats`); its address.
    async fn serve_agent_protocol(
        dir: &std::path::Path,
        refuse_heartbeats: bool,
    ) -> (
        Arc<berth_server::Server>,
        std::net::SocketAddr,
        tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    ) {
        let server = berth_server::Server::open(berth_server::ServerConfig::new(dir))
            .expect("the server opens");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = tokio::spawn(
            tonic::transport::Server::builder()
                .layer(tower::layer::layer_fn(move |s| {
                    RefuseHeartbeats(s, refuse_heartbeats)
                }))
                .add_service(berth_server::node_service(&server))
                .add_service(berth_server::csi_volume_service(&server))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (server, addr, serving)
    }

    /// With a server that answers, the client is ready as soon as it has
    /// registered, well before the wait for absent servers ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_is_ready_once_registered() {
        let dir = tempfile::tempdir().unwrap();
        let (_server, addr, serving) =
            serve_agent_protocol(&dir.path().join("server"), false).await;
        let client = client_of(dir.path(), vec![format!("http://{addr}")]).await;
        let mut ready = client.ready();
        let (stop_tx, run) = run_client(&client);
        tokio::time::timeout(READY_WITHOUT_SERVERS_AFTER / 2, ready.wait_for(|r| *r))
            .await
            .expect("ready soon")
            .expect("the client lives");
        assert!(client.registered());
        stop(stop_tx, run, "the client").await;
        serving.abort();
    }

    /// The first of the client's servers is an address where nothing
    /// listens: the client moves on to the next, registers there, and gets
    /// the alloc that server places on it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_whose_first_server_is_dead_fails_over_registers_and_gets_its_alloc() {
        let dir = tempfile::tempdir().unwrap();
        let (server, addr, serving) = serve_agent_protocol(&dir.path().join("server"), false).await;
        let dead_addr = dead_addr();
        let client = client_of(dir.path(), servers_dead_first(dead_addr, addr)).await;
        let (stop_tx, run) = run_client(&client);
        wait_for("the node to register", Duration::from_secs(20), || {
            client.registered()
        })
        .await;
        assert_eq!(
            client.conn.servers().current_addr(),
            format!("http://{addr}")
        );

        place_and_receive(&server, &client, "j", Duration::from_secs(30)).await;
        stop(stop_tx, run, "the client").await;
        serving.abort();
    }

    /// The alloc watch opens while the server in use is dead and the next
    /// one lives: the failed attempt moves the client on once, to the live
    /// one, and the watch opens there; it does not move on a second time
    /// for the same failure and land on the dead server again, round after
    /// round.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_alloc_watch_opened_on_a_dead_server_settles_on_the_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let (server, addr, serving) = serve_agent_protocol(&dir.path().join("server"), false).await;
        let dead_addr = dead_addr();
        let client = client_of(dir.path(), servers_dead_first(dead_addr, addr)).await;
        // Registered on the live server; then the dead one is in use
        // again, as after the live one's connection once broke.
        let mut registered = false;
        for _ in 0..client.servers().count() {
            registered = client.conn.register().await.is_ok();
            if registered {
                break;
            }
        }
        assert!(registered, "the node registers on the live server");
        client.servers().failover_from(client.servers().current());
        assert_eq!(
            client.servers().current_addr(),
            format!("http://{dead_addr}")
        );

        let (stop_tx, stop_rx) = Shutdown::channel();
        let watching = tokio::spawn(client.clone().watch_allocs(stop_rx));
        place_and_receive(&server, &client, "j", Duration::from_secs(15)).await;
        assert_eq!(client.servers().current_addr(), format!("http://{addr}"));
        stop(stop_tx, watching, "the watch").await;
        serving.abort();
    }

    /// The agent protocol of a server that, when the flag says so, answers
    /// every heartbeat with Unavailable, and everything else as it would.
    #[derive(Clone)]
    struct RefuseHeartbeats<S>(S, bool);

    impl<S> tower::Service<tonic::codegen::http::Request<tonic::body::Body>> for RefuseHeartbeats<S>
    where
        S: tower::Service<
                tonic::codegen::http::Request<tonic::body::Body>,
                Response = tonic::codegen::http::Response<tonic::body::Body>,
            > + Send
            + 'static,
        S::Future: Send + 'static,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>,
        >;

        fn poll_ready(
            &mut self,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), S::Error>> {
            self.0.poll_ready(cx)
        }

        fn call(&mut self, req: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
            if self.1 && req.uri().path() == "/berth.v1.Node/Heartbeat" {
                return Box::pin(async {
                    Ok(
                        tonic::Status::unavailable("heartbeats are refused in this test")
                            .into_http(),
                    )
                });
            }
            Box::pin(self.0.call(req))
        }
    }

    /// The node registers, then not one heartbeat succeeds: the
    /// registration, which the servers count as the node's last heartbeat
    /// (and would place replacements from), is the client's last contact
    /// too, on disk and for the disconnect tracker, so that its allocs
    /// with `stop_after_client_disconnect` stop once that window has
    /// passed, instead of running on for good for want of a heartbeat on
    /// record.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registration_counts_as_the_last_contact_when_no_heartbeat_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let (_server, addr, serving) = serve_agent_protocol(&dir.path().join("server"), true).await;
        let client = client_of(dir.path(), vec![format!("http://{addr}")]).await;
        let before = berth_structs::now_ms();
        let (stop_tx, run) = run_client(&client);
        wait_for("the node to register", Duration::from_secs(20), || {
            client.registered()
        })
        .await;
        wait_for(
            "the registration to be recorded as the last contact",
            Duration::from_secs(5),
            || client.last_heartbeat_ms().is_some(),
        )
        .await;
        assert!(client.last_heartbeat_ms().is_some_and(|ms| ms >= before));
        stop(stop_tx, run, "the client").await;
        serving.abort();
    }

    /// A batch job `id` of one task that exits at once.
    fn quick_job(id: &str) -> Job {
        let mut job = Job::clone(&placed_alloc("").job);
        job.id = id.into();
        job.name = id.into();
        job.datacenters = vec!["dc1".into()];
        job.task_groups[0].tasks.truncate(1);
        job.task_groups[0].tasks[0].config = berth_structs::TaskConfig {
            command: "/bin/true".into(),
            args: Vec::new(),
            ..berth_structs::TaskConfig::default()
        };
        job
    }

    /// Registers [`quick_job`] `job_id` on `server` and waits until the
    /// client runs its alloc.
    async fn place_and_receive(
        server: &berth_server::Server,
        client: &Client,
        job_id: &str,
        within: Duration,
    ) {
        server
            .register_job(quick_job(job_id))
            .await
            .expect("the job registers");
        received(client, job_id, within).await;
    }

    /// Waits until the client runs an alloc of `job_id` (the alloc watch
    /// brought it; whether its task starts does not matter here).
    async fn received(client: &Client, job_id: &str, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let got = client
                .runners
                .lock()
                .await
                .values()
                .any(|r| r.alloc().job_id == job_id);
            if got {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "an alloc of {job_id} reached the client within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A partition that drops packets without closing anything, after
    /// which the old connection stays silent: the client's keepalive
    /// notices the dead connection, it dials again, and the alloc watch
    /// brings the alloc placed after the partition healed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_silent_partition_the_client_reconnects_and_sees_new_allocs() {
        let dir = tempfile::tempdir().unwrap();
        let (server, addr, serving) = serve_agent_protocol(&dir.path().join("server"), false).await;
        let relay = berth_testutil::relay::Relay::start(addr).expect("the relay starts");
        let client = client_of(dir.path(), vec![format!("http://{}", relay.addr())]).await;
        let (stop_tx, run) = run_client(&client);
        wait_for("the node to register", Duration::from_secs(20), || {
            client.registered()
        })
        .await;
        place_and_receive(&server, &client, "before", Duration::from_secs(30)).await;

        relay.partition();
        tokio::time::sleep(Duration::from_secs(1)).await;
        relay.heal_new_only();
        server
            .register_job(quick_job("after"))
            .await
            .expect("the job registers");
        // Keepalive gives up on the silent connection within its interval
        // and timeout; the watch reopens on a new one after its backoff.
        let within =
            servers::KEEPALIVE_INTERVAL + servers::KEEPALIVE_TIMEOUT + Duration::from_secs(20);
        received(&client, "after", within).await;

        stop(stop_tx, run, "the client").await;
        serving.abort();
    }

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
