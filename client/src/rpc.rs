//! The client's side of the agent protocol: one gRPC channel to the servers,
//! and the traits the lower crates define (claims, heartbeats, fingerprints,
//! node events, alloc updates) implemented on it. Node events and alloc
//! updates are queued (callers never wait on the network) and sent by one
//! flusher: at once when it is idle, and, while a request is in flight,
//! gathered into the next one, so that they batch only under load. A node
//! event alone waits up to [`EVENT_LINGER`] for an alloc update to go with
//! (and after) it: each request is a synced write on the servers, and an
//! event sent by itself would hold back the alloc update right behind it
//! (a volume's `Unmount volume` and the alloc's terminal status).

use berth_sync::MutexExt;
use berth_sync::Shutdown;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_allocrunner::{AllocStateUpdater, ClaimError, ClaimGrant, ClaimRequest, VolumeClaimer};
use berth_csimanager::{FingerprintSink, NodeEventSink};
use berth_heartbeat::{HeartbeatError, HeartbeatRpc, NodeRegistrar};
use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::csi_volume_client::CsiVolumeClient;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_structs::{
    AllocClientStatus, CsiInfo, CsiMountOptions, Node, NodeEvent, NodeSecret, TaskState,
};
use tokio::sync::{watch, Notify};
use tonic::service::interceptor::InterceptedService;
use tonic::Code;

use super::servers::ServerChannels;

/// Deadline of unary calls to the servers.
const RPC_TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline of a heartbeat: well below the heartbeat loop's own (10s,
/// `HeartbeatConfig::rpc_timeout`), so that a server that takes the
/// connection but never answers (a paused process) fails the request
/// here, which moves the client on to the next server; a heartbeat the
/// loop gives up on first is dropped unseen, and the client would stay
/// with that server round after round.
const HEARTBEAT_DEADLINE: Duration = Duration::from_secs(5);
/// Node events kept while the servers are unreachable; older ones are
/// dropped first (the servers keep only the newest events of a node too).
const MAX_PENDING_EVENTS: usize = 1000;

/// How long a queued node event waits for an alloc update to go with;
/// after that it is sent alone. Node events only inform: a tenth of a
/// second late is nothing to an operator.
pub const EVENT_LINGER: Duration = Duration::from_millis(100);
/// Alloc updates go in requests of at most about this many bytes, well
/// below the 4 MiB the servers accept in one message: a backlog gathered
/// while they were unreachable must not become one request they refuse
/// for good.
const MAX_UPDATE_BATCH_BYTES: usize = 1 << 20;
/// The longest wait between attempts to send plugin fingerprints.
const MAX_PLUGINS_RETRY_WAIT: Duration = Duration::from_secs(5);
/// Allocs sent in one alloc watch message can be many; the client accepts
/// far more than tonic's 4 MiB default.
const MAX_WATCH_MESSAGE_BYTES: usize = 256 << 20;

/// About how large `u` is on the wire.
fn update_size(u: &pb::AllocStatusUpdate) -> usize {
    // Field tags and lengths: a few bytes per field.
    [
        u.alloc_id.len(),
        u.client_status.len(),
        u.client_description.len(),
        u.task_states_json.len(),
        u.csi_volume_stats_json.len(),
        16,
    ]
    .into_iter()
    .fold(0usize, usize::saturating_add)
}

/// `updates` in batches of at most `max_bytes` each (an update larger
/// than that goes alone), in order.
fn update_batches(
    updates: Vec<pb::AllocStatusUpdate>,
    max_bytes: usize,
) -> Vec<Vec<pb::AllocStatusUpdate>> {
    let mut batches = Vec::new();
    let mut batch = Vec::new();
    let mut size = 0usize;
    for u in updates {
        let len = update_size(&u);
        if !batch.is_empty() && size.saturating_add(len) > max_bytes {
            batches.push(std::mem::take(&mut batch));
            size = 0;
        }
        size = size.saturating_add(len);
        batch.push(u);
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches
}

/// `newer` with what it does not carry taken from `older`, an update of
/// the same alloc not sent yet: a status update keeps the volume stats
/// waiting before it, and volume stats keep the status.
fn merge_update(
    mut newer: pb::AllocStatusUpdate,
    older: pb::AllocStatusUpdate,
) -> pb::AllocStatusUpdate {
    if newer.volume_stats_only && !older.volume_stats_only {
        newer.client_status = older.client_status;
        newer.client_description = older.client_description;
        newer.task_states_json = older.task_states_json;
        newer.volume_stats_only = false;
    }
    if newer.csi_volume_stats_json.is_empty() {
        newer.csi_volume_stats_json = older.csi_volume_stats_json;
    }
    newer
}

/// Queues `update` in `pending`, merged with the one already waiting for
/// its alloc.
fn queue_update(
    pending: &mut HashMap<String, pb::AllocStatusUpdate>,
    update: pb::AllocStatusUpdate,
) {
    let merged = match pending.remove(&update.alloc_id) {
        Some(older) => merge_update(update, older),
        None => update,
    };
    pending.insert(merged.alloc_id.clone(), merged);
}

/// Appends `new` to `pending`, keeping at most the newest
/// [`MAX_PENDING_EVENTS`]. Returns how many were dropped.
fn push_bounded(pending: &mut Vec<NodeEvent>, new: impl IntoIterator<Item = NodeEvent>) -> usize {
    pending.extend(new);
    let extra = pending.len().saturating_sub(MAX_PENDING_EVENTS);
    pending.drain(..extra);
    extra
}

/// Puts the node secret in the metadata of every call to the servers, so
/// that they can tell this client from anyone else naming its node ID.
#[derive(Clone)]
pub struct NodeSecretInterceptor(NodeSecret);

impl std::fmt::Debug for NodeSecretInterceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NodeSecretInterceptor")
            .field(&self.0)
            .finish()
    }
}

impl tonic::service::Interceptor for NodeSecretInterceptor {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let mut value = tonic::metadata::MetadataValue::try_from(self.0.expose())
            .map_err(|_| tonic::Status::internal("the node secret is not valid gRPC metadata"))?;
        // Never indexed by HTTP/2 header compression.
        value.set_sensitive(true);
        req.metadata_mut().insert(pb::NODE_SECRET_METADATA, value);
        Ok(req)
    }
}

/// The channel to the servers with the node secret on every call.
pub type NodeChannel = InterceptedService<ServerChannels, NodeSecretInterceptor>;

/// The client's connection to the servers. Cheap to clone.
#[derive(Clone)]
pub struct ServerConn {
    inner: Arc<Inner>,
}

struct Inner {
    channel: ServerChannels,
    secret: NodeSecretInterceptor,
    node: Mutex<Node>,
    pending_updates: Mutex<HashMap<String, pb::AllocStatusUpdate>>,
    pending_events: Mutex<Vec<NodeEvent>>,
    /// Wakes the flusher at once: an alloc update that moves a status is
    /// queued.
    flush: Notify,
    /// Wakes the flusher after `event_linger`: a node event or an alloc
    /// update that informs only is queued.
    event_queued: Notify,
    event_linger: Duration,
    /// Bumped whenever the client's view of its allocs changes: the index
    /// of its blocking reads (see [`ServerConn::alloc_changes`]).
    alloc_changes: watch::Sender<u64>,
    /// Sent with each registration, for servers that do not know the node
    /// yet.
    intro_token: Mutex<Option<berth_structs::secret::ConfigSecret>>,
    /// Whether the servers enforce ACL tokens, as they last said (with a
    /// registration or a heartbeat); `None` until one says.
    cluster_acl: watch::Sender<Option<bool>>,
    /// The servers' index of their last change to ACL tokens and
    /// policies, as they last said (0 before they did).
    acl_index: std::sync::atomic::AtomicU64,
    /// Whether this connection has registered the node: until it has, a
    /// server that does not know the node yet is the expected answer.
    registered: std::sync::atomic::AtomicBool,
}

fn status_retryable(code: Code) -> bool {
    berth_csimanager::error::is_uncertain(code)
}

impl ServerConn {
    pub fn new(channel: ServerChannels, node: Node, secret: NodeSecret) -> ServerConn {
        ServerConn {
            inner: Arc::new(Inner {
                channel,
                secret: NodeSecretInterceptor(secret),
                node: Mutex::new(node),
                pending_updates: Mutex::default(),
                pending_events: Mutex::default(),
                flush: Notify::new(),
                event_queued: Notify::new(),
                event_linger: EVENT_LINGER,
                alloc_changes: watch::Sender::new(1),
                intro_token: Mutex::new(None),
                cluster_acl: watch::Sender::new(None),
                acl_index: std::sync::atomic::AtomicU64::new(0),
                registered: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    pub fn node_id(&self) -> String {
        self.node().id
    }

    /// Whether the servers enforce ACL tokens, as they last said; `None`
    /// until they have.
    pub fn cluster_acl(&self) -> Option<bool> {
        *self.inner.cluster_acl.borrow()
    }

    /// What the servers said (or, at start, what they last said before a
    /// restart) of enforcing ACL tokens.
    pub fn note_cluster_acl(&self, enabled: bool) {
        self.inner.cluster_acl.send_if_modified(|v| {
            let changed = *v != Some(enabled);
            *v = Some(enabled);
            changed
        });
    }

    /// The servers' index of their last change to ACL tokens and
    /// policies, as they last said with a registration or a heartbeat.
    pub fn acl_index(&self) -> u64 {
        self.inner
            .acl_index
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn note_acl_index(&self, index: u64) {
        self.inner
            .acl_index
            .store(index, std::sync::atomic::Ordering::Relaxed);
    }

    /// Changes of [`Self::cluster_acl`].
    pub fn cluster_acl_changes(&self) -> watch::Receiver<Option<bool>> {
        self.inner.cluster_acl.subscribe()
    }

    /// The introduction token sent with registrations from now on.
    pub fn set_intro_token(&self, token: berth_structs::secret::ConfigSecret) {
        *self.inner.intro_token.locked() = Some(token);
    }

    pub fn node(&self) -> Node {
        self.inner.node.locked().clone()
    }

    /// Take new driver fingerprints into the node the client registers:
    /// its drivers are then the usable ones of `info`.
    pub fn set_driver_info(&self, info: BTreeMap<String, berth_structs::DriverInfo>) {
        self.inner.node.locked().set_driver_info(info);
    }

    /// The servers this client dials, and which one is in use.
    pub fn servers(&self) -> &ServerChannels {
        &self.inner.channel
    }

    /// The channel to the servers, every call carrying the node secret:
    /// what every client of the agent protocol is built on.
    pub fn node_channel(&self) -> NodeChannel {
        InterceptedService::new(self.inner.channel.clone(), self.inner.secret.clone())
    }

    pub fn node_client(&self) -> NodeClient<NodeChannel> {
        NodeClient::new(self.node_channel()).max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES)
    }

    fn volume_client(&self) -> CsiVolumeClient<NodeChannel> {
        CsiVolumeClient::new(self.node_channel())
    }

    /// Registers the node (with its current fingerprints); returns the TTL.
    pub async fn register(&self) -> Result<Duration, tonic::Status> {
        let node_json = serde_json::to_vec(&self.node())
            .map_err(|e| tonic::Status::internal(format!("encoding the node: {e}")))?;
        let mut req = tonic::Request::new(pb::RegisterRequest {
            node_json,
            node_id: self.node_id(),
        });
        req.set_timeout(RPC_TIMEOUT);
        let intro = self.inner.intro_token.locked().clone();
        if let Some(token) = intro {
            let mut value =
                tonic::metadata::MetadataValue::try_from(token.expose()).map_err(|_| {
                    tonic::Status::invalid_argument("client { intro_token } is not printable ASCII")
                })?;
            value.set_sensitive(true);
            req.metadata_mut().insert(pb::INTRO_TOKEN_METADATA, value);
        }
        let resp = self.node_client().register(req).await?.into_inner();
        self.inner
            .registered
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.note_cluster_acl(resp.acl_enabled);
        self.note_acl_index(resp.acl_index);
        Ok(Duration::from_millis(resp.heartbeat_ttl_ms))
    }

    /// A counter of the changes of the client's view of its allocs (never
    /// 0): a blocking read of them waits for it to pass the index it was
    /// given.
    pub fn alloc_changes(&self) -> watch::Receiver<u64> {
        self.inner.alloc_changes.subscribe()
    }

    /// Bumps [`Self::alloc_changes`]: an alloc's view changed (its state,
    /// or the set of allocs the client runs).
    pub fn alloc_changed(&self) {
        self.inner
            .alloc_changes
            .send_modify(|i| *i = i.saturating_add(1));
    }

    /// The alloc update waiting to be sent for `alloc_id`, if any.
    #[cfg(test)]
    pub(crate) fn pending_update(&self, alloc_id: &str) -> Option<pb::AllocStatusUpdate> {
        self.inner.pending_updates.locked().get(alloc_id).cloned()
    }

    /// Sends queued alloc updates and node events until `shutdown`. An
    /// update that moves an alloc's status and finds the flusher idle goes
    /// at once: an alloc's end reaches the servers without waiting out a
    /// window (one that informs only waits for one, at most the linger).
    /// Updates queued while a request is in flight wait for it and go
    /// together in the next one (the wake-up [`Notify`] keeps one permit),
    /// so a busy client sends fewer, larger requests, one at a time.
    pub async fn run_flusher(&self, mut shutdown: Shutdown) {
        let mut failures: u32 = 0;
        loop {
            // An update that moves a status goes at once, and what
            // informs only (events, other updates) with it (events after
            // it, see `flush_once`); that alone waits out the linger.
            let lingered = async {
                self.inner.event_queued.notified().await;
                tokio::time::sleep(self.inner.event_linger).await;
            };
            tokio::select! {
                _ = self.inner.flush.notified() => {}
                _ = lingered => {}
                _ = shutdown.wait() => return,
            }
            // What the task that woke us queues right after (a runner
            // reports several changes of one transition in a row) goes in
            // the same request.
            tokio::task::yield_now().await;
            match self.flush_once().await {
                Ok(()) => failures = 0,
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_millis(200 * 2u64.pow(failures.min(5)));
                    tracing::warn!(error = %e, retry_in = ?wait, "sending updates to the servers failed");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.wait() => return,
                    }
                    self.inner.flush.notify_one();
                }
            }
        }
    }

    /// Sends the queued alloc updates, then the queued node events.
    async fn flush_once(&self) -> Result<(), tonic::Status> {
        let node_id = self.node_id();
        let updates: Vec<pb::AllocStatusUpdate> = {
            let mut p = self.inner.pending_updates.locked();
            p.drain().map(|(_, v)| v).collect()
        };
        let mut batches = update_batches(updates, MAX_UPDATE_BATCH_BYTES).into_iter();
        while let Some(batch) = batches.next() {
            let mut req = tonic::Request::new(pb::UpdateAllocationsRequest {
                node_id: node_id.clone(),
                updates: batch.clone(),
            });
            req.set_timeout(RPC_TIMEOUT);
            if let Err(e) = self.node_client().update_allocations(req).await {
                // Put back what was not sent, under any newer update
                // that arrived meanwhile.
                let mut p = self.inner.pending_updates.locked();
                for u in batch.into_iter().chain(batches.flatten()) {
                    let merged = match p.remove(&u.alloc_id) {
                        Some(newer) => merge_update(newer, u),
                        None => u,
                    };
                    p.insert(merged.alloc_id.clone(), merged);
                }
                return Err(e);
            }
        }
        let events: Vec<NodeEvent> = std::mem::take(&mut *self.inner.pending_events.locked());
        if !events.is_empty() {
            let pb_events = events
                .iter()
                .map(|e| pb::NodeEvent {
                    subsystem: e.subsystem.clone(),
                    message: e.message.clone(),
                    details: e.details.clone().into_iter().collect(),
                    timestamp_ms: e.timestamp,
                })
                .collect();
            let mut req = tonic::Request::new(pb::EmitEventsRequest {
                node_id,
                events: pb_events,
            });
            req.set_timeout(RPC_TIMEOUT);
            if let Err(e) = self.node_client().emit_events(req).await {
                let mut p = self.inner.pending_events.locked();
                let newer = std::mem::take(&mut *p);
                *p = events;
                let dropped = push_bounded(&mut p, newer);
                if dropped > 0 {
                    tracing::warn!(
                        dropped,
                        "servers unreachable; dropped the oldest node events"
                    );
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl AllocStateUpdater for ServerConn {
    fn alloc_updated(
        &self,
        alloc_id: &str,
        client_status: AllocClientStatus,
        description: &str,
        task_states: &BTreeMap<String, TaskState>,
        status_moved: bool,
    ) {
        let update = pb::AllocStatusUpdate {
            alloc_id: alloc_id.to_string(),
            client_status: client_status.as_str().to_string(),
            client_description: description.to_string(),
            task_states_json: serde_json::to_vec(task_states).unwrap_or_default(),
            ..Default::default()
        };
        self.send_update(update, status_moved);
    }
}

impl ServerConn {
    /// Queues `update` (merged with the one waiting for its alloc) and
    /// wakes the flusher: at once when `urgent`, or else after the
    /// linger, unless something urgent takes it along first. An update
    /// that leaves the alloc's status as it was (a task's events, one
    /// task's end while others run) informs only, and the status change
    /// that usually follows within milliseconds (the task runs, the
    /// alloc is done) takes it along: one write on the servers for the
    /// two, and no request in flight for the second to wait behind.
    fn send_update(&self, update: pb::AllocStatusUpdate, urgent: bool) {
        queue_update(&mut self.inner.pending_updates.locked(), update);
        self.alloc_changed();
        if urgent {
            self.inner.flush.notify_one();
        } else {
            self.inner.event_queued.notify_one();
        }
    }

    /// Queues the stats of all of `alloc_id`'s CSI volumes, by the group's
    /// volume name, for the servers (with its status update when one is
    /// waiting).
    pub fn volume_stats_updated(
        &self,
        alloc_id: &str,
        stats: &BTreeMap<String, berth_structs::CsiVolumeStats>,
    ) {
        let json = match serde_json::to_vec(stats) {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(alloc_id, error = %e, "encoding volume stats failed");
                return;
            }
        };
        let update = pb::AllocStatusUpdate {
            alloc_id: alloc_id.to_string(),
            csi_volume_stats_json: json,
            volume_stats_only: true,
            ..Default::default()
        };
        self.send_update(update, true);
    }
}

impl NodeEventSink for ServerConn {
    fn emit(&self, event: NodeEvent) {
        tracing::info!(
            subsystem = %event.subsystem,
            message = %event.message,
            details = ?event.details,
            "node event"
        );
        let dropped = push_bounded(&mut self.inner.pending_events.locked(), [event]);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "servers unreachable; dropped the oldest node events"
            );
        }
        self.inner.event_queued.notify_one();
    }
}

#[async_trait::async_trait]
impl FingerprintSink for ServerConn {
    async fn update_plugins(
        &self,
        node_plugins: BTreeMap<String, CsiInfo>,
        controller_plugins: BTreeMap<String, CsiInfo>,
    ) {
        {
            let mut node = self.inner.node.locked();
            node.csi_node_plugins = node_plugins.clone();
            node.csi_controller_plugins = controller_plugins.clone();
        }
        let fp = |kind: &str, info: &CsiInfo| pb::PluginFingerprint {
            plugin_id: info.plugin_id.clone(),
            kind: kind.to_string(),
            provider: info.provider.clone(),
            version: info.version.clone(),
            healthy: info.healthy,
            health_description: info.health_description.clone(),
            alloc_id: info.alloc_id.clone(),
            external_node_id: info.external_node_id.clone(),
            max_volumes: info.max_volumes,
            requires_controller_publish: info.requires_controller_publish,
            supports_stage_unstage: info.supports_stage_unstage,
            supports_create_delete: info.supports_create_delete,
            accessible_topology: info
                .accessible_topology
                .as_ref()
                .map(|t| t.segments.clone().into_iter().collect())
                .unwrap_or_default(),
            supports_volume_stats: info.supports_volume_stats,
            supports_volume_condition: info.supports_volume_condition,
            supports_expand: info.supports_expand,
            supports_snapshots: info.supports_snapshots,
        };
        let plugins: Vec<_> = node_plugins
            .values()
            .map(|i| fp("node", i))
            .chain(controller_plugins.values().map(|i| fp("controller", i)))
            .collect();
        self.send_plugins(plugins, MAX_PLUGINS_RETRY_WAIT).await;
    }
}

impl ServerConn {
    /// Sends the node's plugin fingerprints, retrying with backoff (at
    /// most `max_wait` between attempts) for as long as the servers are
    /// unreachable: nothing sends them again until a plugin changes, so
    /// a set given up on would leave the servers with a stale view for
    /// good (a plugin that became healthy during a partition would never
    /// get a volume placed). Newer sets wait behind this one. A node the
    /// servers do not know (yet, or again after a purge) is retried too:
    /// a registration already on its way may carry an older set; so is
    /// any other failure but a set found malformed.
    async fn send_plugins(&self, plugins: Vec<pb::PluginFingerprint>, max_wait: Duration) {
        let mut failures: u32 = 0;
        loop {
            let mut req = tonic::Request::new(pb::UpdatePluginsRequest {
                node_id: self.node_id(),
                plugins: plugins.clone(),
            });
            req.set_timeout(RPC_TIMEOUT);
            match self.node_client().update_plugins(req).await {
                Ok(_) => {
                    if failures > 0 {
                        tracing::info!(failures, "plugin fingerprints sent");
                    }
                    return;
                }
                // Only a set the servers find malformed is never taken;
                // any other refusal may pass on another attempt or server.
                Err(s) if s.code() == Code::InvalidArgument => {
                    tracing::error!(error = %s, "the servers refused the plugin fingerprints");
                    return;
                }
                Err(s) => {
                    failures = failures.saturating_add(1);
                    let wait = Duration::from_millis(100)
                        .saturating_mul(1u32 << failures.min(10))
                        .min(max_wait);
                    // Before the node's first registration (plugins
                    // restored at a start are found first) a server that
                    // does not know the node is no news: the set goes
                    // once it does.
                    let early = s.code() == Code::NotFound
                        && !self
                            .inner
                            .registered
                            .load(std::sync::atomic::Ordering::SeqCst);
                    if early {
                        tracing::debug!(error = %s, failures, retry_in = ?wait, "plugin fingerprints wait for the node's registration");
                    } else {
                        tracing::warn!(error = %s, failures, retry_in = ?wait, "sending plugin fingerprints failed; retrying");
                    }
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl VolumeClaimer for ServerConn {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimGrant, ClaimError> {
        let pb_req = pb::ClaimRequest {
            volume_id: req.volume_id.clone(),
            alloc_id: req.alloc_id.clone(),
            node_id: self.node_id(),
            mode: req.mode.as_str().to_string(),
            capability: Some(pb::VolumeCapability {
                access_mode: req.access_mode.as_str().to_string(),
                attachment_mode: req.attachment_mode.as_str().to_string(),
                fs_type: req.mount_options.fs_type.clone(),
                mount_flags: req.mount_options.mount_flags.clone(),
            }),
        };
        let mut r = tonic::Request::new(pb_req);
        // Claims may wait for a controller publish on another node.
        r.set_timeout(Duration::from_secs(120));
        let resp = self
            .volume_client()
            .claim(r)
            .await
            .map_err(|s| ClaimError {
                retryable: status_retryable(s.code()),
                message: format!("claiming volume {:?}: {}", req.volume_id, s.message()),
                alloc_terminal: s
                    .message()
                    .contains(berth_structs::CLAIM_REFUSED_ALLOC_TERMINAL),
            })?
            .into_inner();
        Ok(ClaimGrant {
            volume_id: resp.volume_id,
            external_id: resp.external_id,
            plugin_id: resp.plugin_id,
            publish_context: resp.publish_context.into_iter().collect(),
            volume_context: resp.volume_context.into_iter().collect(),
            secrets: resp.secrets.into_iter().collect(),
            mount_options: CsiMountOptions {
                fs_type: resp.fs_type,
                mount_flags: resp.mount_flags,
            },
        })
    }

    async fn unpublish(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError> {
        let mut r = tonic::Request::new(pb::UnpublishRequest {
            volume_id: volume_id.to_string(),
            alloc_id: alloc_id.to_string(),
            node_id: self.node_id(),
        });
        r.set_timeout(Duration::from_secs(120));
        self.volume_client()
            .unpublish(r)
            .await
            .map_err(|s| ClaimError {
                retryable: status_retryable(s.code()),
                message: format!(
                    "releasing the claim on volume {volume_id:?}: {}",
                    s.message()
                ),
                alloc_terminal: false,
            })?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl HeartbeatRpc for ServerConn {
    async fn heartbeat(&self) -> Result<Duration, HeartbeatError> {
        let mut r = tonic::Request::new(pb::HeartbeatRequest {
            node_id: self.node_id(),
        });
        r.set_timeout(HEARTBEAT_DEADLINE);
        match self.node_client().heartbeat(r).await {
            Ok(resp) => {
                let resp = resp.into_inner();
                self.note_cluster_acl(resp.acl_enabled);
                self.note_acl_index(resp.acl_index);
                Ok(Duration::from_millis(resp.heartbeat_ttl_ms))
            }
            Err(s) if s.code() == Code::NotFound => Err(HeartbeatError::NodeUnknown),
            Err(s) => Err(HeartbeatError::Transient(s.to_string())),
        }
    }
}

#[async_trait::async_trait]
impl NodeRegistrar for ServerConn {
    async fn reregister(&self) -> Result<(), HeartbeatError> {
        self.register()
            .await
            .map(|ttl| tracing::info!(ttl = ?ttl, "node registered again"))
            .map_err(|s| HeartbeatError::Transient(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_sync::ShutdownSender;

    /// An update whose task states take about `json_bytes`.
    fn update(id: &str, json_bytes: usize) -> pb::AllocStatusUpdate {
        let mut state = TaskState::default();
        state.push_event(berth_structs::TaskEvent::new(
            "Terminated",
            "x".repeat(json_bytes),
        ));
        let states = BTreeMap::from([("t".to_string(), state)]);
        pb::AllocStatusUpdate {
            alloc_id: id.to_string(),
            client_status: "complete".into(),
            client_description: String::new(),
            task_states_json: serde_json::to_vec(&states).unwrap(),
            ..Default::default()
        }
    }

    /// A node of its own ID, named "n".
    fn test_node() -> Node {
        Node {
            id: berth_structs::generate_id(),
            name: "n".into(),
            ..Node::default()
        }
    }

    /// A [`test_node`] registered through `channels` with a new secret;
    /// the node and its secret.
    async fn registered_node(channels: &ServerChannels) -> (Node, NodeSecret) {
        let node = test_node();
        let secret = NodeSecret::generate();
        ServerConn::new(channels.clone(), node.clone(), secret.clone())
            .register()
            .await
            .expect("the node registers");
        (node, secret)
    }

    /// The fingerprint of a healthy node plugin "p".
    fn healthy_plugin_p() -> Vec<pb::PluginFingerprint> {
        vec![pb::PluginFingerprint {
            plugin_id: "p".into(),
            kind: "node".into(),
            healthy: true,
            ..Default::default()
        }]
    }

    /// Sends [`healthy_plugin_p`] through `conn` in a task of its own,
    /// at most 20ms between attempts.
    fn spawn_send_plugin_p(conn: &ServerConn) -> tokio::task::JoinHandle<()> {
        let conn = conn.clone();
        tokio::spawn(async move {
            conn.send_plugins(healthy_plugin_p(), Duration::from_millis(20))
                .await
        })
    }

    /// The server knows node `node_id` and its healthy plugin "p".
    fn assert_knows_healthy_plugin_p(server: &berth_server::Server, node_id: &str) {
        let known = server.node(node_id).expect("the node is known");
        assert!(
            known.csi_node_plugins.get("p").is_some_and(|p| p.healthy),
            "the server knows the healthy plugin: {:?}",
            known.csi_node_plugins
        );
    }

    /// A real server on a temp dir serving the `Node` service on loopback,
    /// and a channel to it. The temp dir goes with the first value.
    async fn serve_node_service() -> (
        tempfile::TempDir,
        std::sync::Arc<berth_server::Server>,
        tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
        ServerChannels,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let server = berth_server::Server::open(berth_server::ServerConfig::new(dir.path()))
            .expect("the server opens");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(berth_server::node_service(&server))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let channel = ServerChannels::new(&[format!("http://{addr}")]).unwrap();
        (dir, server, serving, channel)
    }

    /// Every call carries the node secret: the client that registered a
    /// node is served, another one naming the same node ID is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_carry_the_node_secret_and_another_secret_is_refused() {
        let (_dir, server, serving, channel) = serve_node_service().await;
        let node = test_node();
        let conn = ServerConn::new(channel.clone(), node.clone(), NodeSecret::generate());
        conn.register().await.expect("the node registers");
        conn.heartbeat().await.expect("its heartbeat is served");
        let index = server.index();

        let impostor = ServerConn::new(channel, node, NodeSecret::generate());
        let err = impostor.register().await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{}", err.message());
        let err = impostor
            .node_client()
            .heartbeat(pb::HeartbeatRequest {
                node_id: impostor.node_id(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{}", err.message());
        assert_eq!(server.index(), index, "the impostor changed nothing");
        serving.abort();
    }

    /// A backlog of alloc updates larger than the servers take in one
    /// message (gathered while they were unreachable) still reaches them:
    /// a real server over a real connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backlog_larger_than_one_message_reaches_the_servers() {
        let (_dir, _server, serving, channel) = serve_node_service().await;
        let conn = ServerConn::new(channel, test_node(), NodeSecret::generate());
        conn.register().await.expect("the node registers");
        // About 6 MiB of updates, of allocs the servers do not know (they
        // are skipped there, which is all this needs).
        for i in 0..3000 {
            let u = update(&format!("alloc-{i}"), 2000);
            conn.inner
                .pending_updates
                .lock()
                .unwrap()
                .insert(u.alloc_id.clone(), u);
        }
        conn.flush_once().await.expect("the backlog is sent");
        assert!(conn.inner.pending_updates.lock().unwrap().is_empty());
        serving.abort();
    }

    /// A node with the raw_exec driver and `capacity` MHz and MB,
    /// registered through `channel`.
    async fn registered_raw_exec_node(channel: ServerChannels, capacity: u64) -> ServerConn {
        let conn = ServerConn::new(
            channel,
            Node {
                id: berth_structs::generate_id(),
                name: "n".into(),
                datacenter: "dc1".into(),
                status: berth_structs::NodeStatus::Ready,
                drivers: vec!["raw_exec".into()],
                resources: berth_structs::NodeResources {
                    cpu: capacity,
                    memory_mb: capacity,
                    disk_mb: 0,
                },
                ..Node::default()
            },
            NodeSecret::generate(),
        );
        conn.register().await.expect("the node registers");
        conn
    }

    /// A service job `id` of `count` allocs whose one raw_exec task runs
    /// `/bin/true` with `env`, at 1 MHz and 1 MB.
    fn true_job(id: &str, count: u32, env: BTreeMap<String, String>) -> berth_structs::Job {
        use berth_structs::{Job, JobType, Resources, Task, TaskConfig, TaskGroup};
        Job {
            id: id.into(),
            name: id.into(),
            job_type: JobType::Service,
            datacenters: vec!["dc1".into()],
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count,
                tasks: vec![Task {
                    name: "t".into(),
                    driver: "raw_exec".into(),
                    config: TaskConfig {
                        command: "/bin/true".into(),
                        args: Vec::new(),
                        ..berth_structs::TaskConfig::default()
                    },
                    env,
                    resources: Resources {
                        cpu: 1,
                        memory_mb: 1,
                        ..berth_structs::Resources::default()
                    },
                    ..Task::default()
                }],
                ..TaskGroup::default()
            }],
            ..Job::default()
        }
    }

    /// Registers a job of one `/bin/true` alloc; its alloc's ID.
    async fn one_true_alloc(server: &berth_server::Server) -> String {
        let job = true_job("one", 1, BTreeMap::new());
        server.register_job(job).await.expect("the job registers");
        server.job_allocations("one").expect("the job's allocs")[0]
            .id
            .clone()
    }

    /// Runs `conn`'s flusher until `true` is sent on the sender returned.
    fn spawn_flusher(conn: &ServerConn) -> (ShutdownSender, tokio::task::JoinHandle<()>) {
        let (stop, shutdown) = Shutdown::channel();
        let conn = conn.clone();
        let flusher = tokio::spawn(async move { conn.run_flusher(shutdown).await });
        (stop, flusher)
    }

    /// The servers send every alloc of the node in one watch message: a
    /// node with many allocs gets a message far larger than tonic's 4 MiB
    /// default, and must still read it (or it would never see a change).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_alloc_watch_message_larger_than_4_mib_is_read() {
        let (_dir, server, serving, channel) = serve_node_service().await;
        let conn = registered_raw_exec_node(channel, 1_000_000).await;
        // 1,500 allocs of about 4 KiB each: some 6 MiB in one message.
        const COUNT: usize = 1500;
        let job = true_job(
            "big",
            COUNT as u32,
            BTreeMap::from([("PAD".to_string(), "x".repeat(4096))]),
        );
        server.register_job(job).await.expect("the job registers");
        let mut stream = conn
            .node_client()
            .watch_allocations(pb::WatchAllocationsRequest {
                node_id: conn.node_id(),
                deltas: false,
            })
            .await
            .expect("the watch opens")
            .into_inner();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let update = tokio_stream::StreamExt::next(&mut stream)
                .await
                .expect("the watch goes on")
                .expect("the message is read");
            let size: usize = update.allocs_json.iter().map(Vec::len).sum();
            if update.allocs_json.len() == COUNT {
                assert!(size > 4 << 20, "{size} bytes");
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "all allocs placed in time"
            );
        }
        serving.abort();
    }

    /// An alloc update that finds the flusher idle is sent at once, not
    /// after a batch window: of five updates, each sent once the one
    /// before has reached the server, the fastest reaches it well within
    /// the 50 ms window updates used to wait out (one round trip and a
    /// write of the real server).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_update_to_an_idle_flusher_is_sent_at_once() {
        let (_dir, server, serving, channel) = serve_node_service().await;
        let conn = registered_raw_exec_node(channel, 1000).await;
        let alloc_id = one_true_alloc(&server).await;
        let (stop, flusher) = spawn_flusher(&conn);
        let mut fastest = Duration::MAX;
        for round in 0..5 {
            let description = format!("round {round}");
            let sent = std::time::Instant::now();
            conn.alloc_updated(
                &alloc_id,
                AllocClientStatus::Running,
                &description,
                &BTreeMap::new(),
                true,
            );
            let deadline = sent + Duration::from_secs(30);
            loop {
                let a = server.allocation(&alloc_id).expect("the alloc");
                if a.client_description == description {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "update {round} reaches the server"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            fastest = fastest.min(sent.elapsed());
        }
        assert!(
            fastest < Duration::from_millis(40),
            "the fastest of five updates took {fastest:?}"
        );
        stop.shutdown();
        flusher.await.expect("the flusher ends on shutdown");
        serving.abort();
    }

    /// An update that leaves the alloc's status as it was waits (up to the
    /// linger) for one that moves it, and goes with it: with a linger far
    /// longer than the test, it reaches the servers only once the status
    /// change is queued, in the same write.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_update_that_informs_only_goes_with_the_next_status_change() {
        let (_dir, server, serving, channel) = serve_node_service().await;
        let mut conn = registered_raw_exec_node(channel, 1000).await;
        Arc::get_mut(&mut conn.inner)
            .expect("the only handle")
            .event_linger = Duration::from_secs(600);
        server
            .register_job(true_job("two", 2, BTreeMap::new()))
            .await
            .expect("the job registers");
        let allocs = server.job_allocations("two").expect("the job's allocs");
        let (alloc_id, other) = (allocs[0].id.clone(), allocs[1].id.clone());
        let (stop, flusher) = spawn_flusher(&conn);
        let events = BTreeMap::from([(
            "t".to_string(),
            TaskState {
                events: vec![berth_structs::TaskEvent::new("Task Setup", "building")],
                ..TaskState::default()
            },
        )]);
        let before = server.allocation(&alloc_id).expect("the alloc");
        conn.alloc_updated(
            &alloc_id,
            AllocClientStatus::Pending,
            "setting up",
            &events,
            false,
        );
        // Not sent on its own (an update sent at once is there in
        // milliseconds, see above).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let waiting = server.allocation(&alloc_id).expect("the alloc");
        assert_eq!(waiting.modify_index, before.modify_index, "it waits");
        // A status change of another alloc goes at once and takes it along.
        conn.alloc_updated(
            &other,
            AllocClientStatus::Running,
            "Tasks are running",
            &BTreeMap::new(),
            true,
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let (informed, moved) = loop {
            let (a, b) = (
                server.allocation(&alloc_id).expect("the alloc"),
                server.allocation(&other).expect("the other alloc"),
            );
            if b.client_status == AllocClientStatus::Running {
                break (a, b);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the status change reaches the servers"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        assert_ne!(informed.modify_index, before.modify_index, "sent along");
        assert_eq!(informed.client_description, "setting up");
        assert_eq!(informed.task_states, events);
        assert_eq!(informed.modify_index, moved.modify_index, "in one write");
        stop.shutdown();
        flusher.await.expect("the flusher ends on shutdown");
        serving.abort();
    }

    /// A node event queued just before an alloc update waits for it and
    /// reaches the servers after it (a later write), not as a write of its
    /// own in front of it; an event with no update to go with reaches them
    /// once the linger is over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_event_goes_after_the_alloc_update_that_follows_it() {
        let (_dir, server, serving, channel) = serve_node_service().await;
        let mut conn = registered_raw_exec_node(channel, 1000).await;
        // Long enough that the update below certainly comes within it.
        Arc::get_mut(&mut conn.inner)
            .expect("the only handle")
            .event_linger = Duration::from_secs(30);
        let alloc_id = one_true_alloc(&server).await;
        let (stop, flusher) = spawn_flusher(&conn);
        let node_id = conn.node_id();
        let has_event = |message: &str| {
            let node = server.node(&node_id).expect("the node");
            node.events
                .iter()
                .any(|e| e.message == message)
                .then_some(node.modify_index)
        };
        conn.emit(NodeEvent::new(
            NodeEvent::SUBSYSTEM_STORAGE,
            "Unmount volume",
        ));
        // Time for an event sent at once to reach the servers.
        tokio::time::sleep(Duration::from_millis(200)).await;
        conn.alloc_updated(
            &alloc_id,
            AllocClientStatus::Complete,
            "done",
            &BTreeMap::new(),
            true,
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let event_index = loop {
            if let Some(i) = has_event("Unmount volume") {
                break i;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the event reaches the servers with the update"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let alloc = server.allocation(&alloc_id).expect("the alloc");
        assert_eq!(alloc.client_description, "done");
        assert!(
            alloc.modify_index < event_index,
            "the update (index {}) is written before the event (index {event_index})",
            alloc.modify_index
        );

        // Alone, an event goes once the linger is over.
        stop.shutdown();
        flusher.await.expect("the flusher ends on shutdown");
        Arc::get_mut(&mut conn.inner)
            .expect("the only handle")
            .event_linger = Duration::from_millis(20);
        let (stop, flusher) = spawn_flusher(&conn);
        conn.emit(NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, "Mount volume"));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while has_event("Mount volume").is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "an event alone reaches the servers after the linger"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        stop.shutdown();
        flusher.await.expect("the flusher ends on shutdown");
        serving.abort();
    }

    /// Plugin fingerprints sent while the servers are down (or cut off)
    /// reach them once they are back, however long that takes: nothing
    /// else sends them again until a plugin changes, and a node whose
    /// servers never heard that its plugin became healthy gets no volume.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plugin_fingerprints_reach_servers_that_were_down_for_many_attempts() {
        let (_dir, server, serving, direct) = serve_node_service().await;
        let (node, secret) = registered_node(&direct).await;
        let addr = direct
            .current_addr()
            .strip_prefix("http://")
            .and_then(|a| a.parse().ok())
            .expect("the server's address");

        // The client reaches the server through a relay that is down.
        let relay = berth_testutil::relay::Relay::start(addr).expect("the relay starts");
        relay.refuse(true);
        let channel = ServerChannels::new(&[format!("http://{}", relay.addr())]).unwrap();
        let conn = ServerConn::new(channel, node.clone(), secret);
        let sending = spawn_send_plugin_p(&conn);
        // Far more attempts than a bounded retry would make.
        berth_testutil::wait_for("many attempts to fail", Duration::from_secs(20), || {
            relay.refused() >= 30
        })
        .await;
        relay.refuse(false);
        tokio::time::timeout(Duration::from_secs(10), sending)
            .await
            .expect("the fingerprints are sent once the server is back")
            .expect("no panic");
        assert_knows_healthy_plugin_p(&server, &node.id);
        serving.abort();
    }

    /// Plugin fingerprints sent before the servers know the node (its
    /// registration, carrying an older set, still on its way) reach them
    /// once it has registered, and are not dropped on the first "unknown
    /// node" answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plugin_fingerprints_sent_before_registration_reach_the_servers() {
        let (_dir, server, serving, channel) = serve_node_service().await;
        let node = test_node();
        let conn = ServerConn::new(channel, node.clone(), NodeSecret::generate());
        let mut sending = spawn_send_plugin_p(&conn);
        // The node is unknown: the fingerprints are not given up on.
        let early = tokio::time::timeout(Duration::from_secs(1), &mut sending).await;
        assert!(early.is_err(), "still sending while the node is unknown");
        // The registration brings the node without the plugin.
        conn.register().await.expect("the node registers");
        tokio::time::timeout(Duration::from_secs(10), sending)
            .await
            .expect("the fingerprints are sent once the node is known")
            .expect("no panic");
        assert_knows_healthy_plugin_p(&server, &node.id);
        serving.abort();
    }

    /// The server in use takes connections but never answers (a paused
    /// process: the kernel still completes the handshake). A heartbeat to
    /// it fails, within the heartbeat loop's own deadline, as a failed
    /// request, which moves the client on to the next server, where the
    /// next heartbeat is served: had the loop's deadline dropped it first,
    /// nothing would have moved the client on, round after round.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_heartbeat_to_a_server_that_never_answers_moves_the_client_on() {
        let (_dir, _server, serving, live) = serve_node_service().await;
        let (node, secret) = registered_node(&live).await;
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let silent_addr = format!("http://{}", silent.local_addr().unwrap());
        let live_addr = live.current_addr().to_string();
        let channels = ServerChannels::new(&[silent_addr.clone(), live_addr.clone()]).unwrap();
        let conn = ServerConn::new(channels, node, secret);
        let loop_deadline = berth_heartbeat::HeartbeatConfig::default().rpc_timeout;
        let first = tokio::time::timeout(loop_deadline, conn.heartbeat()).await;
        assert!(
            matches!(first, Ok(Err(HeartbeatError::Transient(_)))),
            "the heartbeat to the silent server fails as a request: {first:?}"
        );
        assert_eq!(conn.servers().current_addr(), live_addr);
        tokio::time::timeout(loop_deadline, conn.heartbeat())
            .await
            .expect("answered in time")
            .expect("the live server serves the heartbeat");
        drop(silent);
        serving.abort();
    }

    /// A real server's agent protocol, and an HTTP API on another port (one
    /// that answers as the agent's does, without the agent); both
    /// addresses. The temp dir goes with the first value.
    async fn serve_agent_protocol_and_http_api() -> (
        tempfile::TempDir,
        std::sync::Arc<berth_server::Server>,
        std::net::SocketAddr,
        std::net::SocketAddr,
        ShutdownSender,
    ) {
        let (dir, server, _serving, _) = serve_node_service().await;
        let rpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let rpc_addr = rpc.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(berth_server::node_service(&server))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(rpc)),
        );
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_addr = http.local_addr().unwrap();
        let (stop, mut stop_rx) = Shutdown::channel();
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    c = http.accept() => c,
                    _ = stop_rx.wait() => return,
                };
                let Ok((conn, _)) = conn else { return };
                tokio::spawn(serve_http_api_answer(conn));
            }
        });
        (dir, server, rpc_addr, http_addr, stop)
    }

    /// One connection of an HTTP API as a server's HTTP port serves it
    /// (HTTP/1 and HTTP/2): every request gets the API's JSON 404.
    async fn serve_http_api_answer(conn: tokio::net::TcpStream) {
        let service = hyper::service::service_fn(|_req| async {
            hyper::Response::builder()
                .status(404)
                .header("content-type", "application/json")
                .body(String::from(r#"{"error":"unknown API path"}"#))
        });
        let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
            .serve_connection(hyper_util::rt::TokioIo::new(conn), service)
            .await;
    }

    /// The first of the client's servers is a server's HTTP API port (an
    /// easy slip: both are a server's), which answers, but not in the
    /// agent protocol: the client moves on to the next server, where the
    /// node registers, instead of staying with the wrong port for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_address_that_does_not_speak_the_agent_protocol_is_moved_on_from() {
        let (_dir, server, rpc_addr, http_addr, _stop) = serve_agent_protocol_and_http_api().await;
        let channels =
            ServerChannels::new(&[format!("http://{http_addr}"), format!("http://{rpc_addr}")])
                .unwrap();
        let node = test_node();
        let conn = ServerConn::new(channels, node.clone(), NodeSecret::generate());
        let first = conn.register().await;
        assert!(first.is_err(), "the HTTP API does not register nodes");
        assert_eq!(conn.servers().current_addr(), format!("http://{rpc_addr}"));
        conn.register()
            .await
            .expect("the node registers on the next server");
        server.node(&node.id).expect("the server knows the node");
    }

    /// Plugin fingerprints whose attempt got an answer that is not the
    /// agent protocol's are sent again (on the next server), not given up
    /// on as refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plugin_fingerprints_are_sent_again_after_an_answer_not_in_the_agent_protocol() {
        let (_dir, server, rpc_addr, http_addr, _stop) = serve_agent_protocol_and_http_api().await;
        let direct = ServerChannels::new(&[format!("http://{rpc_addr}")]).unwrap();
        let (node, secret) = registered_node(&direct).await;
        let channels =
            ServerChannels::new(&[format!("http://{http_addr}"), format!("http://{rpc_addr}")])
                .unwrap();
        let conn = ServerConn::new(channels, node.clone(), secret);
        let plugins = healthy_plugin_p();
        tokio::time::timeout(
            Duration::from_secs(10),
            conn.send_plugins(plugins, Duration::from_millis(20)),
        )
        .await
        .expect("sent in time");
        assert_knows_healthy_plugin_p(&server, &node.id);
    }

    #[test]
    fn updates_go_in_batches_below_the_size_limit_in_order() {
        let updates: Vec<_> = (0..10).map(|i| update(&i.to_string(), 300)).collect();
        let batches = update_batches(updates.clone(), 1000);
        assert!(batches.len() > 1, "{}", batches.len());
        for b in &batches {
            let size = b.iter().map(update_size).sum::<usize>();
            assert!(size <= 1000, "{size}");
        }
        let flat: Vec<_> = batches.into_iter().flatten().collect();
        assert_eq!(flat, updates);

        // One update larger than the limit goes alone; nothing is lost.
        let big = vec![update("a", 10), update("huge", 5000), update("b", 10)];
        let batches = update_batches(big, 1000);
        let ids: Vec<Vec<&str>> = batches
            .iter()
            .map(|b| b.iter().map(|u| u.alloc_id.as_str()).collect())
            .collect();
        assert_eq!(ids, vec![vec!["a"], vec!["huge"], vec!["b"]]);
        assert!(update_batches(Vec::new(), 1000).is_empty());
    }

    #[test]
    fn volume_stats_and_status_updates_of_an_alloc_merge_while_waiting() {
        let status = |desc: &str| pb::AllocStatusUpdate {
            alloc_id: "a".into(),
            client_status: "running".into(),
            client_description: desc.into(),
            task_states_json: b"{}".to_vec(),
            ..Default::default()
        };
        let stats = |json: &str| pb::AllocStatusUpdate {
            alloc_id: "a".into(),
            csi_volume_stats_json: json.as_bytes().to_vec(),
            volume_stats_only: true,
            ..Default::default()
        };
        let mut pending = HashMap::new();
        // Stats after a status: the status is kept, the stats ride along.
        queue_update(&mut pending, status("first"));
        queue_update(&mut pending, stats("{\"v\":1}"));
        let u = &pending["a"];
        assert!(!u.volume_stats_only);
        assert_eq!(u.client_description, "first");
        assert_eq!(u.csi_volume_stats_json, b"{\"v\":1}");
        // A newer status keeps the waiting stats; newer stats replace them.
        queue_update(&mut pending, status("second"));
        queue_update(&mut pending, stats("{\"v\":2}"));
        let u = &pending["a"];
        assert_eq!(u.client_description, "second");
        assert_eq!(u.csi_volume_stats_json, b"{\"v\":2}");
        assert_eq!(pending.len(), 1);
        // Stats alone stay stats only.
        let mut pending = HashMap::new();
        queue_update(&mut pending, stats("{}"));
        queue_update(&mut pending, stats("{\"v\":3}"));
        assert!(pending["a"].volume_stats_only);
        assert_eq!(pending["a"].client_status, "");
        // A failed send put back under a newer stats-only update keeps
        // its status.
        let merged = merge_update(stats("{\"v\":4}"), status("unsent"));
        assert!(!merged.volume_stats_only);
        assert_eq!(merged.client_description, "unsent");
        assert_eq!(merged.csi_volume_stats_json, b"{\"v\":4}");
    }

    #[test]
    fn pending_events_keep_the_newest() {
        let mut pending = Vec::new();
        let events = (0..MAX_PENDING_EVENTS + 5).map(|i| NodeEvent::new("Storage", i.to_string()));
        assert_eq!(push_bounded(&mut pending, events), 5);
        assert_eq!(pending.len(), MAX_PENDING_EVENTS);
        assert_eq!(pending[0].message, "5");
        assert_eq!(
            pending.last().map(|e| e.message.clone()),
            Some((MAX_PENDING_EVENTS + 4).to_string())
        );
    }
}
