//! The [`Server`]: opening the store, the background loops, the RPC services
//! and the read side of the public API. The write side lives with its
//! concern: jobs in `scheduler.rs`, nodes in `nodes.rs`, volumes and claims
//! under `csi/`.
//!
//! The background loops are parts of their own, each holding the store and
//! only what it needs of the rest of the server: node liveness
//! ([`Liveness`], handed an [`EvaluateJob`]), the drainer ([`Drainer`], the
//! same), the volume watcher ([`VolumeWatcher`], handed a
//! [`ReleaseClaim`]) and garbage collection ([`Gc`], which tells liveness
//! of the nodes it removed). The server constructs them in
//! [`Server::open`], runs them in [`Server::run`], and its public methods
//! for them (`mark_node_down`, `update_node_drain`, `garbage_collect`,
//! ...) delegate.

pub(crate) mod acl;
pub(crate) mod alloc_stop;
pub(crate) mod alloc_watch;
mod claims;
pub(crate) mod client_routes;
pub(crate) mod deployments;
mod evaluate;
mod expand;
pub(crate) mod jobs;
pub(crate) mod node_secrets;
pub(crate) mod nodes;
pub(crate) mod page;
pub(crate) mod plan;
mod retry;
mod snapshots;
pub(crate) mod versions;
mod volumes;

use berth_sync::MutexExt;
use berth_sync::{Shutdown, ShutdownSender};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use berth_structs::{Allocation, Job, Node};

use crate::calls::CallRegistry;
use crate::config::ServerConfig;
use crate::csi::{ReleaseClaim, ReleaseOrigin, VolumeLocks, VolumeWatcher};
use crate::drainer::Drainer;
use crate::error::ServerError;
use crate::gc::{Gc, GcConfig, GcReport};
use crate::leader::{Election, Fence, Role};
use crate::liveness::{EvaluateJob, Liveness, LivenessConfig};
use crate::state::{
    EtcdBackend, Follower, Freshness, QuarantinedRecord, RedbBackend, StateStore, Table,
};

/// The server role: cluster state, scheduling, node liveness, CSI claims.
pub struct Server {
    config: ServerConfig,
    store: Arc<StateStore>,
    calls: CallRegistry,
    /// Jobs with placements that could not be made, and why.
    blocked: Mutex<BTreeMap<String, Vec<String>>>,
    /// When a delayed replacement becomes due.
    retry_due: retry::RetryDue,
    /// Concurrent evaluations of one job, coalesced.
    job_evaluations: crate::scheduler::Coalesced<crate::scheduler::PlacementCounts>,
    /// Concurrent passes over the blocked jobs, coalesced.
    blocked_evaluations: crate::scheduler::Coalesced<()>,
    /// Node liveness: heartbeat deadlines and marking silent nodes down.
    liveness: Arc<Liveness>,
    /// Garbage collection.
    gc: Gc,
    /// Node drains and eligibility.
    drainer: Drainer,
    /// Frees the claims nobody released.
    volume_watcher: VolumeWatcher,
    volume_locks: VolumeLocks,
    /// Alloc status reports of clients waiting to be written together.
    alloc_reports: nodes::AllocReports,
    /// `Node.Register` calls per peer address (`config.register_rate`).
    register_limiter: Option<crate::register_rate::RegisterLimiter>,
    /// The bytes of agent-protocol messages announced and not yet
    /// received, per peer and in all (see [`crate::partial_budget`]).
    partial_budget: Arc<crate::partial_budget::PartialBudget>,
    /// Set when `run` is told to shut down; streams end on it.
    shutdown: ShutdownSender,
    /// The cluster this server belongs to ([`crate::cluster_id`]), and
    /// the layer that names it on the agent protocol.
    cluster_id: String,
    cluster_layer: crate::ClusterIdLayer,
    /// The election among the servers that share etcd; `None` for the
    /// embedded store's one server, which always leads.
    election: Option<Arc<Election>>,
    /// What this server is now (see [`crate::leader`]).
    role: watch::Receiver<Role>,
    /// Keeps `role` open for the embedded store's server.
    _embedded_role: Option<watch::Sender<Role>>,
    /// What keeps the tables current with the leader's writes in etcd,
    /// until `run` starts it.
    follower: Mutex<Option<Follower>>,
    /// Whether the tables are known to be current, on etcd; `None` for
    /// the embedded store, whose one server writes them.
    freshness: Option<Arc<Freshness>>,
}

/// Where the state is kept, as `berth operator store` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreHealth {
    /// `embedded` or `etcd`.
    pub store: &'static str,
    /// The key prefix on etcd.
    pub prefix: Option<String>,
    /// Each etcd member's health.
    pub members: Vec<crate::etcd::MemberHealth>,
}

/// The state store `config.store` names, loaded, and what comes with it.
struct OpenedStore {
    store: StateStore,
    cluster_id: String,
    /// The election and what follows the leader's writes, for servers
    /// that share etcd.
    etcd: Option<(Arc<Election>, Follower)>,
}

/// How long a server that does not lead waits for its tables to catch
/// up with etcd before a request that needs them current is refused.
const READ_BARRIER_WITHIN: Duration = Duration::from_secs(5);

fn open_store(config: &ServerConfig) -> Result<OpenedStore, ServerError> {
    let state_dir = RedbBackend::path_in(&config.data_dir)
        .parent()
        .map_or_else(|| config.data_dir.clone(), Path::to_path_buf);
    match &config.store {
        crate::StoreConfig::Embedded => {
            let backend = RedbBackend::open(&RedbBackend::path_in(&config.data_dir))?;
            // Beside the state it names (`<data_dir>/server/cluster-id`).
            let cluster_id = crate::cluster_id::load_or_create(&state_dir)?;
            Ok(OpenedStore {
                store: StateStore::open(Box::new(backend))?,
                cluster_id,
                etcd: None,
            })
        }
        crate::StoreConfig::Etcd(etcd) => {
            let client = crate::etcd::EtcdClient::new(etcd.clone())
                .map_err(|e| ServerError::BadRequest(format!("etcd: {e}")))?;
            let keyring_dir = etcd
                .keyring_dir
                .clone()
                .unwrap_or_else(|| state_dir.join(crate::keyring::KEYRING_DIR));
            let fence = Arc::new(Fence::default());
            let backend = EtcdBackend::open(client.clone(), &keyring_dir)?.fenced(fence.clone());
            backend.check_keyring()?;
            let cluster_id = backend.cluster_id()?;
            let follower = backend.follower();
            let election = Election::new(client, config.identity.clone(), fence);
            Ok(OpenedStore {
                store: StateStore::open(Box::new(backend))?,
                cluster_id,
                etcd: Some((Arc::new(election), follower)),
            })
        }
    }
}

impl Server {
    /// Open the state under `config.data_dir` (created if missing) and load
    /// it. Nothing runs until [`Server::run`].
    pub fn open(config: ServerConfig) -> Result<Arc<Server>, ServerError> {
        if config.data_dir.as_os_str().is_empty() {
            return Err(ServerError::BadRequest(
                "server config: data_dir is required".into(),
            ));
        }
        let OpenedStore {
            store,
            cluster_id,
            etcd,
        } = open_store(&config)?;
        let (election, follower) = etcd.unzip();
        let freshness = follower.as_ref().map(Follower::freshness);
        let mut cluster_layer = crate::ClusterIdLayer::new(&cluster_id)?;
        if let Some(f) = &freshness {
            cluster_layer = cluster_layer.watching_locally_while(f.subscribe());
        }
        // The one server of an embedded store always leads.
        let (embedded_role, role) = match &election {
            Some(e) => {
                cluster_layer = cluster_layer.leader_only(e.subscribe());
                (None, e.subscribe())
            }
            None => {
                let (tx, rx) = watch::channel(Role::Leader { term: 0 });
                (Some(tx), rx)
            }
        };
        let store = Arc::new(store);
        // With enrollment on, nodes are not trusted to say which plugins
        // they run: only plugin allocs placed on them count.
        store.set_plugin_instances_need_allocs(config.node_enrollment);
        let (shutdown, _) = Shutdown::channel();
        let register_limiter = config
            .register_rate
            .map(crate::register_rate::RegisterLimiter::new);
        let liveness = Arc::new(Liveness::new(store.clone(), LivenessConfig::of(&config)));
        let gc = Gc::new(store.clone(), GcConfig::of(&config), liveness.clone());
        let drainer = Drainer::new(store.clone());
        let volume_watcher = VolumeWatcher::new(store.clone(), &config);
        let server = Arc::new(Server {
            register_limiter,
            partial_budget: crate::partial_budget::PartialBudget::new(
                crate::partial_budget::PEER_PARTIAL_BYTES,
                crate::partial_budget::TOTAL_PARTIAL_BYTES,
            ),
            config,
            store,
            calls: CallRegistry::default(),
            blocked: Mutex::new(BTreeMap::new()),
            retry_due: Default::default(),
            job_evaluations: Default::default(),
            blocked_evaluations: Default::default(),
            liveness,
            gc,
            drainer,
            volume_watcher,
            volume_locks: VolumeLocks::default(),
            alloc_reports: Default::default(),
            shutdown,
            cluster_id,
            cluster_layer,
            election,
            role,
            _embedded_role: embedded_role,
            follower: Mutex::new(follower),
            freshness,
        });
        server.liveness.arm_heartbeats_after_restore();
        Ok(server)
    }

    /// Run the background loops (node liveness, the volume watcher, the
    /// drainer, scheduler retries, garbage collection) while this server
    /// leads, and the election that says whether it does, until
    /// `shutdown` turns true.
    pub async fn run(self: Arc<Self>, mut shutdown: Shutdown) {
        tracing::info!(index = self.store.index(), "server running");
        let (stop_election, election_stopped) = watch::channel(false);
        if let Some(follower) = self.follower.locked().take() {
            follower.start(self.store.clone(), election_stopped.clone());
        }
        let election_done = self.election.as_ref().map(|election| {
            let (done, done_rx) = tokio::sync::oneshot::channel();
            let (running, announcing) = (election.clone(), election.clone());
            let stopped = election_stopped.clone();
            election.clone().spawn(async move {
                let members = announcing.announce(stopped);
                tokio::join!(running.run(election_stopped), members);
                let _ = done.send(());
            });
            done_rx
        });
        let mut role = self.role.clone();
        loop {
            let term = tokio::select! {
                term = role.wait_for(Role::is_leader) => match *term.as_deref().unwrap_or(&Role::Standby { leader: None }) {
                    Role::Leader { term } => term,
                    Role::Standby { .. } => break,
                },
                _ = shutdown.wait() => break,
            };
            if !self.take_up_leadership(term) {
                continue;
            }
            berth_metrics::set_leader(true);
            let (term_end, term_shutdown) = Shutdown::channel();
            let tasks = self.clone().start_leader_work(term_shutdown).await;
            let stopping = tokio::select! {
                _ = role.wait_for(|r| *r != Role::Leader { term }) => false,
                _ = shutdown.wait() => true,
            };
            term_end.shutdown();
            for t in tasks {
                let _ = t.await;
            }
            berth_metrics::set_leader(false);
            if stopping {
                break;
            }
            tracing::warn!(term, "leader work stopped: this server no longer leads");
        }
        tracing::info!("server shutting down");
        self.shutdown.shutdown();
        let _ = stop_election.send(true);
        if let Some(done) = election_done {
            let _ = tokio::time::timeout(Duration::from_secs(5), done).await;
        }
    }

    /// Takes up the leadership of `term`: the state the previous leader
    /// left is loaded, every node gets a fresh TTL (none is marked down
    /// for the change of leader) and the fence is armed. False when the
    /// term ended meanwhile, or the state did not load (the term is given
    /// up, and the election campaigns again).
    fn take_up_leadership(&self, term: i64) -> bool {
        let Some(election) = &self.election else {
            return true;
        };
        match self.store.reload() {
            Ok(index) => tracing::info!(term, index, "took up the state as the leader"),
            Err(e) => {
                tracing::error!(term, error = %e, "loading the state as the new leader failed; giving leadership up");
                election.give_up(term);
                return false;
            }
        }
        self.liveness.arm_heartbeats_after_restore();
        election.confirm(term)
    }

    /// Starts the leader work, after one evaluation of everything (a
    /// restart or a change of leader may have left work undone); it runs
    /// until `shutdown`.
    async fn start_leader_work(self: Arc<Self>, shutdown: Shutdown) -> Vec<JoinHandle<()>> {
        self.evaluate_all().await;
        vec![
            tokio::spawn({
                let (server, shutdown) = (self.clone(), shutdown.clone());
                async move { server.liveness.run(&*server, shutdown).await }
            }),
            tokio::spawn({
                let (server, shutdown) = (self.clone(), shutdown.clone());
                async move { server.volume_watcher.run(&*server, shutdown).await }
            }),
            tokio::spawn({
                let (server, shutdown) = (self.clone(), shutdown.clone());
                async move { server.drainer.run(&*server, shutdown).await }
            }),
            tokio::spawn(self.clone().scheduler_retry_loop(shutdown.clone())),
            tokio::spawn({
                let server = self.clone();
                async move { server.gc.run(shutdown).await }
            }),
        ]
    }

    /// The servers of the cluster, the leader marked: those that said
    /// they are there in etcd, or this one alone on the embedded store.
    pub async fn members(&self) -> Result<Vec<crate::leader::Member>, ServerError> {
        match &self.election {
            Some(election) => election
                .members()
                .await
                .map_err(|e| ServerError::Unavailable(format!("listing the servers in etcd: {e}"))),
            None => Ok(vec![crate::leader::Member {
                identity: self.config.identity.clone(),
                leader: true,
                last_contact_ms: berth_structs::now_ms(),
            }]),
        }
    }

    /// Where the state is kept and, on etcd, each member's health.
    pub async fn store_health(&self) -> StoreHealth {
        match (&self.config.store, &self.election) {
            (crate::StoreConfig::Etcd(etcd), Some(election)) => StoreHealth {
                store: "etcd",
                prefix: Some(etcd.prefix.clone()),
                members: election.member_health().await,
            },
            _ => StoreHealth {
                store: "embedded",
                prefix: None,
                members: Vec::new(),
            },
        }
    }

    /// What this server is now: the leader, or a standby.
    pub fn role(&self) -> Role {
        self.role.borrow().clone()
    }

    /// Waits, on a server that does not lead, until its tables hold every
    /// write the leader made before this call (`what` names the request
    /// that needs it); at once on the leader.
    pub(crate) async fn read_barrier(&self, what: &str) -> Result<(), ServerError> {
        match &self.freshness {
            Some(f) if !self.role().is_leader() => f
                .confirm(&self.store, READ_BARRIER_WITHIN)
                .await
                .map_err(|why| {
                    ServerError::Unavailable(format!(
                        "{what}: this server does not lead, and its copy of the state is \
                             not current: {why}"
                    ))
                }),
            _ => Ok(()),
        }
    }

    /// Resolves once this server's tables may no longer be current: it
    /// does not lead, and it has not confirmed them against etcd within
    /// [`crate::state::FRESH_FOR`]. Never on the embedded store's server.
    pub(crate) async fn tables_stale(&self) {
        let Some(f) = &self.freshness else {
            return std::future::pending().await;
        };
        let (mut fresh, mut role) = (f.subscribe(), self.role.clone());
        loop {
            if !*fresh.borrow_and_update() && !role.borrow_and_update().is_leader() {
                return;
            }
            tokio::select! {
                r = fresh.changed() => if r.is_err() { return std::future::pending().await },
                r = role.changed() => if r.is_err() { return std::future::pending().await },
            }
        }
    }

    pub(crate) fn shutdown_rx(&self) -> Shutdown {
        self.shutdown.subscribe()
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Where the calls of servers to clients (over each client's call
    /// stream) are routed.
    pub(crate) fn calls(&self) -> &CallRegistry {
        &self.calls
    }

    /// The cluster this server belongs to, made at its first start.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The layer that names this server's cluster on every answer of the
    /// agent protocol and refuses requests of another cluster's nodes.
    pub fn cluster_id_layer(&self) -> crate::ClusterIdLayer {
        self.cluster_layer.clone()
    }

    /// Node liveness, for the tests of its loop.
    #[cfg(test)]
    pub(crate) fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// The limit on node registrations per peer, when one is set.
    pub(crate) fn register_limiter(&self) -> Option<&crate::register_rate::RegisterLimiter> {
        self.register_limiter.as_ref()
    }

    /// What agent-protocol peers hold of partly received messages.
    pub(crate) fn partial_budget(&self) -> &Arc<crate::partial_budget::PartialBudget> {
        &self.partial_budget
    }

    /// The index of the last write.
    pub fn index(&self) -> u64 {
        self.store.index()
    }

    /// The index of the last change to ACL tokens and policies; 0 with
    /// ACLs off. Client agents drop the tokens they resolved when it
    /// moves, so a deleted token is refused within a heartbeat.
    pub fn acl_index(&self) -> u64 {
        if self.acl_enabled() {
            self.store.table_index(Table::Acl)
        } else {
            0
        }
    }

    /// The index of the last write to `table` (for blocking-query headers).
    pub fn table_index(&self, table: Table) -> u64 {
        self.store.table_index(table)
    }

    /// Wait until the state index is greater than `min_index` or `timeout`
    /// passes; returns the index then (Nomad's blocking-query rule).
    pub async fn wait_for_index(&self, min_index: u64, timeout: Duration) -> u64 {
        self.store.wait_for_index(min_index, timeout).await
    }

    /// The index of the last write to any of `tables` (for the
    /// `X-Berth-Index` of an answer read from them).
    pub fn tables_index(&self, tables: &[Table]) -> u64 {
        self.store.tables_index(tables)
    }

    /// A blocking query on `tables`: wait until one of them is written at
    /// an index greater than `min_index` or `timeout` passes; writes to
    /// other tables do not end the wait. Returns the tables' index then.
    pub async fn wait_for_tables(
        &self,
        tables: &[Table],
        min_index: u64,
        timeout: Duration,
    ) -> u64 {
        self.store.wait_for_tables(tables, min_index, timeout).await
    }

    /// Records of the state database that failed to decode at open and were
    /// set aside.
    pub fn quarantined_records(&self) -> Result<Vec<QuarantinedRecord>, ServerError> {
        Ok(self.store.quarantined()?)
    }

    pub fn jobs(&self) -> Vec<Job> {
        self.store.read(|t| t.jobs.values().cloned().collect())
    }

    /// A job by ID, or by a unique ID prefix.
    pub fn job(&self, id: &str) -> Result<Job, ServerError> {
        self.store.read(|t| Ok(job_in(t, id)?.clone()))
    }

    /// The allocs of the job `id` (an ID or a unique ID prefix) names.
    pub fn job_allocations(&self, id: &str) -> Result<Vec<Allocation>, ServerError> {
        self.store.read(|t| {
            let job = job_in(t, id)?;
            Ok(t.allocs_of_job(&job.id).cloned().collect())
        })
    }

    pub fn allocations(&self) -> Vec<Allocation> {
        self.store.read(|t| t.allocs.values().cloned().collect())
    }

    /// An alloc by ID, or by a unique ID prefix.
    pub fn allocation(&self, id: &str) -> Result<Allocation, ServerError> {
        self.store.read(|t| {
            let found = crate::prefix::resolve(&t.allocs, id, crate::prefix::ALLOC, |k, a| {
                format!("{k:?} ({})", a.name)
            })?;
            found.map(|(_, a)| a.clone()).ok_or_else(|| {
                ServerError::not_found(format!(
                    "alloc {id:?} not found (see `berth job status JOB`)"
                ))
            })
        })
    }

    pub fn allocations_on_node(&self, node_id: &str) -> Vec<Allocation> {
        self.store
            .read(|t| t.allocs_on_node(node_id).cloned().collect())
    }

    /// The nodes, each with the last heartbeat this server heard.
    pub fn nodes(&self) -> Vec<Node> {
        self.store
            .read(|t| t.nodes.values().cloned().collect::<Vec<_>>())
            .into_iter()
            .map(|n| self.liveness.with_live_heartbeat(n))
            .collect()
    }

    /// How many nodes the state holds; a cheap read of the state tables
    /// (the agent's watchdog uses it to prove they are not locked up).
    pub fn node_count(&self) -> usize {
        self.store.read(|t| t.nodes.len())
    }

    /// How many allocs have each client status, every status named (zeros
    /// too), counted in one read of the state without copying it: a
    /// metrics scrape reports it.
    pub fn alloc_status_counts(&self) -> Vec<(&'static str, i64)> {
        use berth_structs::AllocClientStatus as S;
        let all = [
            S::Pending,
            S::Running,
            S::Complete,
            S::Failed,
            S::Lost,
            S::Unknown,
        ];
        self.store
            .read(|t| status_counts(&all, S::as_str, t.allocs.values().map(|a| a.client_status)))
    }

    /// How many nodes have each status, every status named (zeros too).
    pub fn node_status_counts(&self) -> Vec<(&'static str, i64)> {
        use berth_structs::NodeStatus as S;
        let all = [S::Initializing, S::Ready, S::Down];
        self.store
            .read(|t| status_counts(&all, S::as_str, t.nodes.values().map(|n| n.status)))
    }

    /// A node by ID, name, or unique ID prefix, with the last heartbeat
    /// this server heard.
    pub fn node(&self, id: &str) -> Result<Node, ServerError> {
        self.store
            .read(|t| crate::prefix::resolve_node(t, id).cloned())
            .map(|n| self.liveness.with_live_heartbeat(n))
    }

    /// Whether `node_id` has a call stream open (the server can call it).
    pub fn node_connected(&self, node_id: &str) -> bool {
        self.calls.is_connected(node_id)
    }

    /// The heartbeat TTL to hand to a node now, jitter included.
    pub fn heartbeat_ttl(&self) -> Duration {
        self.liveness.heartbeat_ttl()
    }

    /// Mark a node down: its live allocs become lost and their jobs are
    /// evaluated.
    pub async fn mark_node_down(&self, node_id: &str, why: &str) -> Result<(), ServerError> {
        self.liveness.mark_node_down(node_id, why, self).await
    }

    /// One garbage collection pass with the configured thresholds; `force`
    /// (`berth system gc`) takes every threshold as zero.
    pub async fn garbage_collect(&self, force: bool) -> Result<GcReport, ServerError> {
        self.gc.garbage_collect(force).await
    }

    /// Remove a purged job now if it is done; returns whether it went.
    pub(crate) fn collect_purged_job(&self, job_id: &str) -> Result<bool, ServerError> {
        self.gc.collect_purged_job(job_id)
    }

    /// Start or update (`Some(deadline)`) or disable (`None`) the drain of
    /// `node` (an ID, a unique ID prefix or a name). A drain makes the node
    /// ineligible; disabling it leaves the node ineligible. A zero deadline
    /// is a forced drain; one above a year is refused. Returns the node.
    pub async fn update_node_drain(
        &self,
        node: &str,
        deadline: Option<Duration>,
    ) -> Result<Node, ServerError> {
        let node_id = self.drainer.update_node_drain(node, deadline)?;
        self.node(&node_id)
    }

    /// Make `node` eligible or ineligible for new allocs. A draining node
    /// cannot be made eligible: disable the drain first. Returns the node.
    pub async fn set_node_eligibility(
        &self,
        node: &str,
        eligible: bool,
    ) -> Result<Node, ServerError> {
        let (node_id, made_eligible) = self.drainer.set_node_eligibility(node, eligible)?;
        if made_eligible {
            self.evaluate_after_cluster_change().await;
        }
        self.node(&node_id)
    }

    /// Placement failures of a job that is waiting for capacity, a plugin
    /// or a volume claim (empty when nothing is blocked).
    pub fn job_placement_failures(&self, job_id: &str) -> Vec<String> {
        self.blocked
            .locked()
            .get(job_id)
            .cloned()
            .unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl EvaluateJob for Server {
    async fn evaluate_job(&self, job_id: &str) {
        Server::evaluate_job(self, job_id).await;
    }
}

#[async_trait::async_trait]
impl ReleaseClaim for Server {
    async fn release_claim(&self, volume_id: &str, alloc_id: &str) -> Result<(), ServerError> {
        self.unpublish_claim(volume_id, alloc_id, ReleaseOrigin::Watcher)
            .await
    }
}

/// `(name, how many of `of` have it)` for each status in `all`.
fn status_counts<S: Copy>(
    all: &[S],
    name: fn(&S) -> &'static str,
    of: impl Iterator<Item = S>,
) -> Vec<(&'static str, i64)> {
    let mut counts: Vec<(&'static str, i64)> = all.iter().map(|s| (name(s), 0)).collect();
    for s in of {
        let name = name(&s);
        if let Some(c) = counts.iter_mut().find(|(n, _)| *n == name) {
            c.1 += 1;
        }
    }
    counts
}

/// The job `id` names in `t`: its ID or a unique prefix of one (quoted in
/// the list of an ambiguous prefix's matches).
pub(crate) fn job_in<'a>(t: &'a crate::state::Tables, id: &str) -> Result<&'a Job, ServerError> {
    crate::prefix::resolve(&t.jobs, id, crate::prefix::JOB, crate::prefix::key)?
        .map(|(_, j)| j)
        .ok_or_else(|| ServerError::not_found(format!("job {id:?} not found")))
}

impl Server {
    /// Make a new keyring key, seal every stored secret again with it in
    /// one store write, and remove the old keys. Answers the new key's ID
    /// (never key material).
    pub fn rotate_keyring(&self) -> Result<crate::keyring::KeyRotation, ServerError> {
        Ok(self.store.rotate_keyring()?)
    }
}
