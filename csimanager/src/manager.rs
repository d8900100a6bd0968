//! The CSI manager: ties the registry, clients, fingerprinting and the
//! volume manager together.

use berth_sync::MutexExt;
use berth_sync::Shutdown;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_proto::csi::v1 as csi;
use berth_structs::{CsiInfo, CsiPluginType, NodeEvent};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::client::CsiClient;
use crate::error::CsiError;
use crate::fingerprint::{
    fingerprint, node_supports_stage_unstage, unhealthy_fingerprint, PluginFingerprint,
};
use crate::registry::{PluginRegistration, PluginRegistry, RegistryEntry};
use crate::repair::Repairs;
use crate::sinks::{FingerprintSink, NodeEventSink, VolumeStateStore};
use crate::volume::{ExpandRequest, MountInfo, MountRequest, UnmountRequest};
use crate::volume_manager::{RetryPolicy, VolumeManager};

#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// `<data_dir>/client/csi`: staging and per-alloc publish paths live
    /// below it, per plugin.
    pub root_dir: PathBuf,
    pub node_id: String,
    /// Deadline of each CSI call.
    pub call_timeout: Duration,
    /// How often registered plugins are probed and fingerprinted again.
    pub fingerprint_interval: Duration,
}

/// A cached client, valid for one plugin instance.
struct CachedClient {
    registration: PluginRegistration,
    client: CsiClient,
}

/// The node's plugin fingerprints as the sink receives them: (node,
/// controller), keyed by plugin ID.
type PluginMaps = (BTreeMap<String, CsiInfo>, BTreeMap<String, CsiInfo>);

#[derive(Default)]
struct FingerprintState {
    /// The last fingerprint of each registered plugin.
    plugins: BTreeMap<String, PluginFingerprint>,
    /// The last healthy entries of each registered plugin, whose capability
    /// flags an unhealthy fingerprint keeps.
    last_good: BTreeMap<String, PluginFingerprint>,
    /// What was last handed to the fingerprint sender.
    sent: Option<PluginMaps>,
    /// Plugins restored from the store at the start and not fingerprinted
    /// since: they were healthy when registered, so a first fingerprint
    /// that finds them healthy is no change (an agent restart records no
    /// health event of a plugin healthy all along).
    restored: std::collections::BTreeSet<String>,
}

pub struct CsiManager {
    config: ManagerConfig,
    pub(crate) registry: PluginRegistry,
    store: Arc<dyn VolumeStateStore>,
    pub(crate) events: Arc<dyn NodeEventSink>,
    fingerprints: Arc<dyn FingerprintSink>,
    clients: Mutex<HashMap<String, CachedClient>>,
    state: Mutex<FingerprintState>,
    /// What the store holds of the registry.
    saved_plugins: Mutex<Option<Vec<PluginRegistration>>>,
    /// Serializes fingerprint rounds (the run loop and explicit calls).
    refresh_lock: tokio::sync::Mutex<()>,
    /// The newest fingerprint set for the sender task, which sends it to
    /// `fingerprints` without holding up fingerprint rounds; sets that arrive
    /// while one is being sent collapse into the newest.
    latest_fingerprints: watch::Sender<Option<PluginMaps>>,
    /// Whether the sender task was started (on the first set).
    sender_started: AtomicBool,
    pub(crate) volumes: VolumeManager,
    /// What lost mounts are repaired with, and who hears of it.
    pub(crate) repairs: Arc<Repairs>,
}

impl CsiManager {
    /// Restores the plugin registry and the volume usage stubs from `store`.
    pub fn new(
        config: ManagerConfig,
        registry: PluginRegistry,
        store: Arc<dyn VolumeStateStore>,
        events: Arc<dyn NodeEventSink>,
        fingerprints: Arc<dyn FingerprintSink>,
    ) -> Result<Arc<CsiManager>, CsiError> {
        let plugins = store.load_plugins().map_err(CsiError::Store)?;
        let restored = plugins.iter().map(|r| r.plugin_id.clone()).collect();
        for reg in plugins {
            // A plugin task that registered again before us wins.
            if registry.get(&reg.plugin_id).is_none() {
                tracing::info!(plugin_id = %reg.plugin_id, alloc_id = %reg.alloc_id, "restored CSI plugin registration");
                registry.register(reg);
            }
        }
        let stubs = store.load_volumes().map_err(CsiError::Store)?;
        for s in &stubs {
            tracing::info!(plugin_id = %s.plugin_id, volume_id = %s.volume_id, allocs = s.allocs.len(), staged = s.staged, "restored CSI volume usage");
        }
        let volumes = VolumeManager::new(
            config.root_dir.clone(),
            store.clone(),
            events.clone(),
            stubs,
        );
        let repairs = Repairs::new(config.fingerprint_interval);
        let manager = Arc::new(CsiManager {
            config,
            registry,
            store,
            events,
            fingerprints,
            clients: Mutex::default(),
            state: Mutex::new(FingerprintState {
                restored,
                ..FingerprintState::default()
            }),
            saved_plugins: Mutex::default(),
            refresh_lock: tokio::sync::Mutex::new(()),
            latest_fingerprints: watch::Sender::new(None),
            sender_started: AtomicBool::new(false),
            volumes,
            repairs,
        });
        manager.persist_registry()?;
        Ok(manager)
    }

    /// How uncertain errors of volume operations are retried (the default
    /// gives up within about half a minute).
    pub fn set_retry_policy(&self, policy: RetryPolicy) {
        self.volumes.set_retry_policy(policy);
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// On every registry change and every interval, until `shutdown` flips
    /// to true: persists the registry, fingerprints the plugins, and finishes
    /// unstages left unfinished (in the background).
    pub async fn run(self: Arc<Self>, mut shutdown: Shutdown) {
        let mut changes = self.registry.subscribe();
        let mut tick = tokio::time::interval(self.config.fingerprint_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reaper: Option<JoinHandle<()>> = None;
        let mut repairer: Option<JoinHandle<()>> = None;
        loop {
            if shutdown.is_shutdown() {
                break;
            }
            tokio::select! {
                _ = shutdown.wait() => break,
                r = changes.changed() => {
                    if r.is_err() {
                        break;
                    }
                    changes.borrow_and_update();
                }
                _ = tick.tick() => {}
            }
            // Also catches changes made before this loop subscribed.
            if let Err(e) = self.persist_registry() {
                tracing::error!(error = %e, "persisting the CSI plugin registry failed");
            }
            self.refresh_fingerprints().await;
            // An unstage that failed (or waited for its plugin) is tried
            // again on every round, in its own task: retries against a
            // hanging plugin must not hold up this loop. One at a time.
            if reaper.as_ref().is_none_or(JoinHandle::is_finished)
                && !self.volumes.unused_stubs().is_empty()
            {
                let manager = self.clone();
                reaper = Some(tokio::spawn(async move {
                    manager.reap_unused_volumes().await;
                }));
            }
            // Lost mounts of running allocs are made again once their
            // plugin is healthy; in a task of its own for the same reason.
            if repairer.as_ref().is_none_or(JoinHandle::is_finished) {
                let manager = self.clone();
                repairer = Some(tokio::spawn(async move {
                    manager.repair_lost_mounts().await;
                }));
            }
        }
        // An unstage cut short stays recorded in its stub; the next start
        // finishes it.
        if let Some(reaper) = reaper {
            reaper.abort();
        }
        if let Some(repairer) = repairer {
            repairer.abort();
        }
        tracing::debug!("CSI manager stopped");
    }

    /// The registry plugin tasks register into.
    pub fn registry(&self) -> &PluginRegistry {
        &self.registry
    }

    /// The last fingerprint of a registered plugin.
    pub fn plugin_fingerprint(&self, plugin_id: &str) -> Option<PluginFingerprint> {
        self.lock_state().plugins.get(plugin_id).cloned()
    }

    /// A client for a registered plugin; connections are cached and reused.
    pub async fn client(&self, plugin_id: &str) -> Result<CsiClient, CsiError> {
        let reg = self
            .registry
            .get(plugin_id)
            .ok_or_else(|| CsiError::PluginNotFound(plugin_id.to_string()))?;
        self.client_for(&reg)
    }

    fn client_for(&self, reg: &PluginRegistration) -> Result<CsiClient, CsiError> {
        let mut clients = self.clients.locked();
        if let Some(c) = clients.get(&reg.plugin_id) {
            if c.registration.socket_path == reg.socket_path {
                return Ok(c.client.clone());
            }
        }
        let client =
            CsiClient::connect(&reg.plugin_id, &reg.socket_path, self.config.call_timeout)?;
        clients.insert(
            reg.plugin_id.clone(),
            CachedClient {
                registration: reg.clone(),
                client: client.clone(),
            },
        );
        Ok(client)
    }

    /// Stages (once per volume and usage on the node) and publishes (once
    /// per alloc) a volume.
    pub async fn mount_volume(&self, req: MountRequest) -> Result<MountInfo, CsiError> {
        // A restarted client must know the plugin of every volume it mounted.
        if let Err(e) = self.persist_registry() {
            self.emit_storage_failure("Mount volume", &req.volume_id, &req.alloc_id, &e);
            return Err(e);
        }
        let client = match self.client(&req.plugin_id).await {
            Ok(c) => c,
            Err(e) => {
                self.emit_storage_failure("Mount volume", &req.volume_id, &req.alloc_id, &e);
                return Err(e);
            }
        };
        let supports_stage = match self.supports_stage_unstage(&client).await {
            Ok(s) => s,
            Err(e) => {
                self.emit_storage_failure("Mount volume", &req.volume_id, &req.alloc_id, &e);
                return Err(e);
            }
        };
        let mounted = self
            .volumes
            .mount_volume(&client, supports_stage, &req)
            .await;
        if mounted.is_ok() {
            // In memory only: a lost mount is made again with them.
            self.repairs.remember(&req);
        }
        mounted
    }

    /// Unpublishes the alloc's target and unstages when it was the last user
    /// of that usage on the node. Idempotent. Fails while any undo of the
    /// usage is unfinished (the alloc's unpublish, or an unstage left over
    /// with no alloc using the volume), also when the plugin is gone: the
    /// volume is still staged or published here, so the caller must retry
    /// rather than let the servers detach it.
    pub async fn unmount_volume(&self, req: UnmountRequest) -> Result<(), CsiError> {
        let (alloc_uses, unfinished_undo) = self.volumes.unmount_work(&req);
        let client = if alloc_uses || unfinished_undo {
            match self.client(&req.plugin_id).await {
                Ok(c) => Some(c),
                Err(e) => {
                    self.emit_storage_failure("Unmount volume", &req.volume_id, &req.alloc_id, &e);
                    return Err(e);
                }
            }
        } else {
            None
        };
        self.volumes.unmount_volume(client.as_ref(), &req).await
    }

    /// Grows the filesystem of a volume published on this node
    /// (`NodeExpandVolume`, see [`crate::volume::ExpandRequest`]). Answers
    /// the capacity the plugin reports.
    pub async fn expand_volume(&self, req: ExpandRequest) -> Result<i64, CsiError> {
        let client = self.client(&req.plugin_id).await?;
        self.volumes.expand_volume(&client, &req).await
    }

    /// Staging and publish paths of a usage (for callers that inspect them).
    pub fn staging_path(&self, req: &MountRequest) -> PathBuf {
        self.volumes.staging_path(
            &req.plugin_id,
            &req.volume_id,
            req.access_mode,
            req.attachment_mode,
            req.read_only,
        )
    }

    pub fn target_path(&self, req: &MountRequest) -> PathBuf {
        self.volumes.target_path(
            &req.plugin_id,
            &req.alloc_id,
            &req.volume_id,
            req.access_mode,
            req.attachment_mode,
            req.read_only,
        )
    }

    /// The volume usages recorded on this node.
    pub fn volume_stubs(&self) -> Vec<crate::volume::VolumeStub> {
        self.volumes.stubs()
    }

    /// The volume usages recorded on this node for `alloc_id`: those it
    /// still has mounted.
    pub fn volume_stubs_of(&self, alloc_id: &str) -> Vec<crate::volume::VolumeStub> {
        self.volumes.stubs_of(alloc_id)
    }

    /// How many volumes of `plugin_id` on this node still need the plugin
    /// instance that `alloc_id` runs before it may stop: volumes another
    /// alloc has staged or published (or whose unstage is unfinished), whose
    /// unpublish and unstage go through the plugin. None when another
    /// healthy node instance of the plugin is registered: that one serves
    /// the unmounts (a plugin upgrade).
    pub fn volumes_needing_plugin_instance(&self, plugin_id: &str, alloc_id: &str) -> usize {
        let other_instance_serves = self.registry.entry(plugin_id).is_some_and(|e| {
            e.registration.alloc_id != alloc_id
                && e.unhealthy.is_none()
                && e.registration.plugin_type != CsiPluginType::Controller
        });
        if other_instance_serves {
            return 0;
        }
        self.volumes
            .volumes_needing_plugin(plugin_id, alloc_id)
            .len()
    }

    /// Waits, without a deadline, until no volume needs the plugin
    /// instance that `alloc_id` runs (see
    /// [`Self::volumes_needing_plugin_instance`]): a mount is never left
    /// behind a stopped plugin. Wakes on every change of the volume usage
    /// records and of the plugin registry, not on a timer. `waiting` is
    /// called with the number of volumes when the wait starts and each
    /// time that number changes; not at all when none needs the instance.
    pub async fn wait_until_plugin_instance_unneeded(
        &self,
        plugin_id: &str,
        alloc_id: &str,
        mut waiting: impl FnMut(usize),
    ) {
        let mut volumes = self.volumes.subscribe();
        let mut registry = self.registry.subscribe();
        let mut reported = None;
        loop {
            // Marked seen before the count, so no change slips between.
            volumes.borrow_and_update();
            registry.borrow_and_update();
            let needed = self.volumes_needing_plugin_instance(plugin_id, alloc_id);
            if needed == 0 {
                return;
            }
            if reported != Some(needed) {
                reported = Some(needed);
                waiting(needed);
            }
            tokio::select! {
                r = volumes.changed() => {
                    if r.is_err() {
                        // Cannot happen while `self` lives; never spin.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                r = registry.changed() => {
                    if r.is_err() {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }
    }

    /// From the last fingerprint when there is one, else asked.
    async fn supports_stage_unstage(&self, client: &CsiClient) -> Result<bool, CsiError> {
        if let Some(node) = self
            .lock_state()
            .plugins
            .get(client.plugin_id())
            .and_then(|fp| fp.node.as_ref())
            .filter(|n| n.healthy)
        {
            return Ok(node.supports_stage_unstage);
        }
        let caps = self
            .volumes
            .with_retry("NodeGetCapabilities", || {
                client.node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
            })
            .await?;
        Ok(node_supports_stage_unstage(&caps))
    }

    /// Records at once that the plugin's supervisor found the instance of
    /// `alloc_id` unhealthy (its task died, a probe failed): a CSI node
    /// event when it was healthy, and the unhealthy fingerprint, keeping
    /// what the plugin last was (provider, capabilities), for the servers.
    /// Not left to the next fingerprint round: the task may restart and be
    /// healthy again before it, and the failure would go unrecorded. The
    /// plugin stays registered, unhealthy, until it registers again.
    pub fn plugin_unhealthy(&self, plugin_id: &str, alloc_id: &str, reason: &str) {
        let (update, event) = {
            // Marked under the state lock: a round that reads the registry
            // under it too sees either both the mark and this record, or
            // neither.
            let mut state = self.lock_state();
            if !self.registry.mark_unhealthy(plugin_id, alloc_id, reason) {
                return;
            }
            // Not fingerprinted yet: the round the mark starts reports it.
            let Some(fp) = state.plugins.get_mut(plugin_id) else {
                return;
            };
            let was_healthy = fp.healthy();
            fp.set_unhealthy(reason);
            let event = was_healthy.then(|| health_event(plugin_id, fp));
            (Self::fingerprints_to_send(&mut state), event)
        };
        if let Some(e) = event {
            tracing::warn!(plugin_id, alloc_id, error = %reason, "CSI plugin became unhealthy");
            self.events.emit(e);
        }
        if let Some(maps) = update {
            self.start_fingerprint_sender();
            self.latest_fingerprints.send_replace(Some(maps));
        }
    }

    /// Fingerprints every registered plugin, emits CSI node events for
    /// health changes, and hands the full set to the fingerprint sender when
    /// it changed (always the first time). Does not wait for the sink: the
    /// sender task delivers the newest set, one at a time. A plugin its
    /// supervisor marked unhealthy is not asked: it is reported unhealthy.
    pub async fn refresh_fingerprints(&self) {
        let _round = self.refresh_lock.lock().await;
        let entries = self.registry.entries();

        // Forget clients of plugins that are gone or moved.
        {
            let mut clients = self.clients.locked();
            clients.retain(|id, c| {
                entries.iter().any(|e| {
                    &e.registration.plugin_id == id
                        && e.registration.socket_path == c.registration.socket_path
                })
            });
        }

        let mut fresh: BTreeMap<String, (RegistryEntry, PluginFingerprint)> = BTreeMap::new();
        let mut set = JoinSet::new();
        for entry in entries {
            let reg = &entry.registration;
            if let Some(why) = &entry.unhealthy {
                let fp = unhealthy_fingerprint(reg, why);
                fresh.insert(reg.plugin_id.clone(), (entry, fp));
                continue;
            }
            let client = match self.client_for(reg) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(plugin_id = %reg.plugin_id, error = %e, "cannot make a CSI client");
                    continue;
                }
            };
            set.spawn(async move {
                let fp = fingerprint(&client, &entry.registration).await;
                (entry, fp)
            });
        }
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((entry, fp)) => {
                    fresh.insert(entry.registration.plugin_id.clone(), (entry, fp));
                }
                Err(e) => tracing::error!(error = %e, "CSI fingerprint task failed"),
            }
        }

        let (update, events) = {
            // What the registry says now: a plugin that changed during the
            // round (its task died, it registered again) keeps what was
            // recorded of it; the change starts another round.
            let mut state = self.lock_state();
            let now: BTreeMap<String, RegistryEntry> = self
                .registry
                .entries()
                .into_iter()
                .map(|e| (e.registration.plugin_id.clone(), e))
                .collect();
            let mut stale = Vec::new();
            let mut fresh: BTreeMap<String, PluginFingerprint> = fresh
                .into_iter()
                .filter_map(|(id, (entry, fp))| match now.get(&id) {
                    Some(current) if *current == entry => Some((id, fp)),
                    Some(_) => {
                        stale.push(id);
                        None
                    }
                    None => None,
                })
                .collect();
            // An unhealthy entry keeps the capability flags of the plugin's
            // last healthy one: the servers still need to know, say, that
            // its volumes are controller-published.
            for id in stale {
                if let Some(old) = state.plugins.get(&id) {
                    fresh.insert(id, old.clone());
                }
            }
            state.last_good.retain(|id, _| fresh.contains_key(id));
            for (id, fp) in fresh.iter_mut() {
                let last_good = state.last_good.entry(id.clone()).or_default();
                fp.keep_capabilities_of(last_good);
                last_good.remember_healthy(fp);
            }
            let mut events = Vec::new();
            for (id, fp) in &fresh {
                let was = state
                    .plugins
                    .get(id)
                    .map(PluginFingerprint::healthy)
                    .or_else(|| state.restored.contains(id).then_some(true));
                let now = fp.healthy();
                if was != Some(now) {
                    if now {
                        tracing::info!(plugin_id = %id, "CSI plugin became healthy");
                    } else {
                        tracing::warn!(plugin_id = %id, error = %fp.health_error(), "CSI plugin became unhealthy");
                    }
                    events.push(health_event(id, fp));
                }
            }
            for id in fresh.keys() {
                state.restored.remove(id);
            }
            state.plugins = fresh;
            (Self::fingerprints_to_send(&mut state), events)
        };
        for e in events {
            self.events.emit(e);
        }
        if let Some(maps) = update {
            self.start_fingerprint_sender();
            self.latest_fingerprints.send_replace(Some(maps));
        }
    }

    /// The node and controller maps of the current fingerprints, when they
    /// differ from what was last handed to the sender (recorded as sent).
    fn fingerprints_to_send(state: &mut FingerprintState) -> Option<PluginMaps> {
        let mut nodes = BTreeMap::new();
        let mut controllers = BTreeMap::new();
        for (id, fp) in &state.plugins {
            if let Some(n) = &fp.node {
                nodes.insert(id.clone(), n.clone());
            }
            if let Some(c) = &fp.controller {
                controllers.insert(id.clone(), c.clone());
            }
        }
        let maps = (nodes, controllers);
        if state.sent.as_ref() == Some(&maps) {
            return None;
        }
        state.sent = Some(maps.clone());
        Some(maps)
    }

    /// Starts the task that sends fingerprint sets to the sink, once. It
    /// ends when the manager is dropped.
    fn start_fingerprint_sender(&self) {
        if self.sender_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let sink = self.fingerprints.clone();
        let mut latest = self.latest_fingerprints.subscribe();
        tokio::spawn(async move {
            while latest.changed().await.is_ok() {
                let Some((nodes, controllers)) = latest.borrow_and_update().clone() else {
                    continue;
                };
                sink.update_plugins(nodes, controllers).await;
            }
        });
    }

    /// Finishes undoing usages that no alloc uses any more (an unstage that
    /// failed, or whose plugin was away, maybe before a restart).
    async fn reap_unused_volumes(&self) {
        for stub in self.volumes.unused_stubs() {
            let Ok(client) = self.client(&stub.plugin_id).await else {
                continue;
            };
            if let Err(e) = self.volumes.reap_unused(&client, &stub).await {
                tracing::warn!(plugin_id = %stub.plugin_id, volume_id = %stub.volume_id, error = %e, "unstaging an unused volume failed");
            }
        }
    }

    /// Saves the registry when it differs from what was saved last.
    fn persist_registry(&self) -> Result<(), CsiError> {
        let plugins = self.registry.list();
        let mut saved = self.saved_plugins.locked();
        if saved.as_ref() == Some(&plugins) {
            return Ok(());
        }
        self.store.save_plugins(&plugins).map_err(CsiError::Store)?;
        *saved = Some(plugins);
        Ok(())
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, FingerprintState> {
        self.state.locked()
    }

    /// Sends a node event (orphaned mounts, volume condition transitions).
    pub(crate) fn emit_event(&self, event: NodeEvent) {
        self.events.emit(event);
    }

    /// Forgets `alloc_id`'s usage of the volume usage `key` without a CSI
    /// call (its target was unmounted without the plugin); how many allocs
    /// still use it. The caller holds the volume's lock.
    pub(crate) fn forget_volume_usage(&self, key: &str, alloc_id: &str) -> Result<usize, CsiError> {
        self.volumes.forget_alloc(key, alloc_id)
    }

    fn emit_storage_failure(&self, message: &str, volume_id: &str, alloc_id: &str, e: &CsiError) {
        tracing::warn!(volume_id, alloc_id, error = %e, "{message} failed");
        self.events.emit(
            NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, message)
                .with_detail("volume_id", volume_id)
                .with_detail("alloc_id", alloc_id)
                .with_detail("success", "false")
                .with_detail("error", e.to_string()),
        );
    }
}

/// The CSI node event of a plugin's health change to what `fp` says.
fn health_event(plugin_id: &str, fp: &PluginFingerprint) -> NodeEvent {
    let message = if fp.healthy() {
        "Plugin became healthy"
    } else {
        "Plugin became unhealthy"
    };
    NodeEvent::new(NodeEvent::SUBSYSTEM_CSI, message)
        .with_detail("plugin_id", plugin_id)
        .with_detail("error", fp.health_error())
}
