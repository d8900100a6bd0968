//! What clients tell the servers about their nodes: registration,
//! heartbeats, node events, CSI plugin fingerprints and alloc status.

use berth_sync::MutexExt;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use berth_structs::{
    AllocClientStatus, Allocation, CsiInfo, Node, NodeEvent, NodeStatus, TaskState, ValidationError,
};
use tokio::sync::oneshot;

use crate::csi::ReleaseOrigin;
use crate::error::ServerError;
use crate::prefix::resolve_node;
use crate::server::Server;
use crate::state::{Change, Tables};

/// The answer to a node registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRegistration {
    pub heartbeat_ttl: Duration,
    pub index: u64,
}

/// One alloc status report from a client.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AllocUpdate {
    pub alloc_id: String,
    pub client_status: AllocClientStatus,
    pub client_description: String,
    /// None keeps the task states the servers have.
    pub task_states: Option<BTreeMap<String, TaskState>>,
    /// The stats of the alloc's CSI volumes, by the group's volume name;
    /// None keeps those the servers have.
    pub csi_volume_stats: Option<BTreeMap<String, berth_structs::CsiVolumeStats>>,
    /// The report carries volume stats only: the status, its description
    /// and the task states are not set and stay as they are.
    pub volume_stats_only: bool,
}

impl Server {
    /// Register (or re-register) a node; it becomes `ready`. Plugin
    /// fingerprints and events the servers already have are kept when the
    /// registration carries none.
    /// In-process callers only: it neither checks nor sets the node secret
    /// (`Node.Register` goes through `register_node_with_secret`).
    pub async fn register_node(&self, node: Node) -> Result<NodeRegistration, ServerError> {
        self.register_node_as(node, None).await
    }

    /// Register `node`; with `secret`, the registration must match the
    /// node's secret (see `node_secrets`), checked in the same write.
    pub(crate) async fn register_node_as(
        &self,
        mut node: Node,
        secret: Option<(&berth_structs::NodeSecret, super::node_secrets::Enrollment)>,
    ) -> Result<NodeRegistration, ServerError> {
        let bad_names: Vec<String> = [("node ID", &node.id), ("node name", &node.name)]
            .into_iter()
            .filter_map(|(field, value)| berth_structs::check_name(field, value).err())
            .map(|e| format!("node: {e}"))
            .collect();
        if !bad_names.is_empty() {
            return Err(ValidationError(bad_names).into());
        }
        if node.region() != self.config.region {
            return Err(ValidationError(vec![format!(
                "node {:?} is in region {:?}, these servers in {:?}: point it at the servers \
                 of its region, or set its agent's `region`",
                node.name,
                node.region(),
                self.config.region
            )])
            .into());
        }
        let (enrolled_with, index) = self
            .store
            .write_async(|t, changes| {
                let mut event = NodeEvent::new(NodeEvent::SUBSYSTEM_CLUSTER, "Node registered");
                let mut enrolled_with = None;
                if let Some((secret, enrollment)) = &secret {
                    enrolled_with = super::node_secrets::admit_registration(
                        t, &node.id, secret, enrollment, changes,
                    )?;
                }
                // The registration's events join the stored ones as any
                // others do: folded and capped.
                let carried = std::mem::take(&mut node.events);
                // Eligibility and drain are the servers': a client's
                // (re-)registration neither undoes an operator's drain nor sets
                // its own (a new node is eligible).
                let fresh = Node::default();
                node.keep_server_fields(t.nodes.get(&node.id).unwrap_or(&fresh));
                if let Some(old) = t.nodes.get(&node.id) {
                    node.events = old.events.clone();
                    if node.csi_node_plugins.is_empty() {
                        node.csi_node_plugins = old.csi_node_plugins.clone();
                    }
                    if node.csi_controller_plugins.is_empty() {
                        node.csi_controller_plugins = old.csi_controller_plugins.clone();
                    }
                    if old.status == NodeStatus::Down {
                        event = NodeEvent::new(NodeEvent::SUBSYSTEM_CLUSTER, "Node re-registered");
                        event = resume_allocs(t, &node.id, event, changes);
                    }
                }
                node.push_events(carried);
                node.push_events([event]);
                node.status = NodeStatus::Ready;
                node.last_heartbeat_ms = berth_structs::now_ms();
                changes.push(Change::PutNode(node.clone()));
                Ok::<_, ServerError>(enrolled_with)
            })
            .await?;
        if let Some(accessor) = enrolled_with {
            tracing::info!(node_id = %node.id, intro_token = %accessor, "node enrolled with an introduction token");
        }
        self.liveness
            .record_heartbeat(&node.id, node.last_heartbeat_ms);
        let ttl = self.heartbeat_ttl();
        self.liveness.reset_heartbeat_timer(&node.id, ttl);
        tracing::info!(node_id = %node.id, name = %node.name, ttl_ms = ttl.as_millis() as u64, "node registered");
        self.evaluate_after_cluster_change().await;
        Ok(NodeRegistration {
            heartbeat_ttl: ttl,
            index,
        })
    }

    /// A heartbeat from `node_id`; returns the next TTL. An unknown node
    /// gets NotFound and must register again. A heartbeat of a ready node
    /// is kept in memory only; the store is written when the node's status
    /// changes (a down node is ready again).
    pub async fn node_heartbeat(&self, node_id: &str) -> Result<Duration, ServerError> {
        let now_ms = berth_structs::now_ms();
        let unknown = || ServerError::not_found(format!("node {node_id:?} is not registered"));
        if !self.store.read(|t| t.nodes.contains_key(node_id)) {
            return Err(unknown());
        }
        // The deadline first, the status second: a liveness pass marking
        // the node down at this moment either finds the deadline and leaves
        // the node, or is seen marking it, and the node is made ready again
        // below (see `mark_silent_node_down`).
        self.liveness.record_heartbeat(node_id, now_ms);
        let ttl = self.heartbeat_ttl();
        let marking_down = self.liveness.rearm_heartbeat_timer(node_id, ttl);
        let ready = self
            .store
            .read(|t| t.nodes.get(node_id).map(|n| n.status == NodeStatus::Ready));
        let was_down = match ready {
            Some(true) if !marking_down => false,
            Some(_) => {
                self.store
                    .write_async(|t, changes| {
                        let node = t.nodes.get(node_id).ok_or_else(unknown)?;
                        if node.status == NodeStatus::Ready {
                            return Ok::<_, ServerError>(false);
                        }
                        let mut node = node.clone();
                        node.status = NodeStatus::Ready;
                        let event = NodeEvent::new(
                            NodeEvent::SUBSYSTEM_CLUSTER,
                            "Node heartbeat received; node ready",
                        )
                        .with_detail("status", NodeStatus::Ready.as_str());
                        node.push_events([resume_allocs(t, node_id, event, changes)]);
                        node.last_heartbeat_ms = now_ms;
                        changes.push(Change::PutNode(node));
                        Ok(true)
                    })
                    .await
                    .inspect_err(|e| {
                        if matches!(e, ServerError::NotFound(_)) {
                            self.liveness.forget_heartbeats(node_id);
                        }
                    })?
                    .0
            }
            None => {
                // Purged meanwhile.
                self.liveness.forget_heartbeats(node_id);
                return Err(unknown());
            }
        };
        if was_down {
            tracing::info!(node_id, "node ready again");
            self.evaluate_after_cluster_change().await;
        }
        Ok(ttl)
    }

    /// Record node events (the oldest beyond the cap are dropped).
    pub fn emit_node_events(
        &self,
        node_id: &str,
        events: Vec<NodeEvent>,
    ) -> Result<(), ServerError> {
        if events.is_empty() {
            return Ok(());
        }
        self.store.write(|t, changes| {
            let mut node = t
                .nodes
                .get(node_id)
                .ok_or_else(|| {
                    ServerError::not_found(format!("node {node_id:?} is not registered"))
                })?
                .clone();
            node.push_events(events);
            changes.push(Change::PutNode(node));
            Ok::<_, ServerError>(())
        })?;
        Ok(())
    }

    /// Replace the CSI plugins fingerprinted on `node_id`.
    pub async fn update_node_plugins(
        &self,
        node_id: &str,
        node_plugins: BTreeMap<String, CsiInfo>,
        controller_plugins: BTreeMap<String, CsiInfo>,
    ) -> Result<(), ServerError> {
        let (changed, _) = self
            .store
            .write_async(|t, changes| {
                let node = t.nodes.get(node_id).ok_or_else(|| {
                    ServerError::not_found(format!("node {node_id:?} is not registered"))
                })?;
                if node.csi_node_plugins == node_plugins
                    && node.csi_controller_plugins == controller_plugins
                {
                    return Ok::<_, ServerError>(false);
                }
                let mut node = node.clone();
                node.csi_node_plugins = node_plugins;
                node.csi_controller_plugins = controller_plugins;
                changes.push(Change::PutNode(node));
                Ok(true)
            })
            .await?;
        if changed {
            tracing::info!(node_id, "node CSI plugins updated");
            self.evaluate_after_cluster_change().await;
        }
        Ok(())
    }

    /// Apply alloc status reports of `node_id`. A terminal alloc never
    /// becomes non-terminal again; reports about allocs of another node are
    /// ignored. Returns the index of the write that holds the reports
    /// (the current index when they changed nothing), once it is durable
    /// and the jobs it calls for are evaluated.
    ///
    /// Reports that arrive while another write of reports is in flight
    /// wait for it and go, together, in the next one: one commit for many
    /// nodes' reports, however many clients report at once. A report that
    /// arrives when none is in flight is written at once.
    pub async fn update_allocations(
        &self,
        node_id: &str,
        updates: Vec<AllocUpdate>,
    ) -> Result<u64, ServerError> {
        let (queued, mut written) = self.alloc_reports.enqueue(node_id, updates);
        let outcome = loop {
            tokio::select! {
                biased;
                outcome = &mut written => break outcome,
                _writing = self.alloc_reports.writing.lock() => {
                    // The writer's turn first; then no await until
                    // `_writing` is dropped: the batch taken is written
                    // and answered whatever becomes of this call.
                    let _turn = self.store.write_turn().await;
                    self.write_alloc_reports();
                }
            }
        };
        // Taken from the queue by the write that answered it.
        queued.taken();
        let written = outcome
            .map_err(|_| ServerError::Internal("alloc status report dropped unwritten".into()))??;
        if let Some(evaluations) = written.evaluations {
            evaluations
                .done
                .get_or_init(|| async {
                    for job_id in &evaluations.jobs {
                        self.evaluate_job(job_id).await;
                    }
                    self.evaluate_blocked().await;
                })
                .await;
        }
        Ok(written.index)
    }

    /// Write the oldest queued alloc status reports (at most
    /// [`MAX_REPORTS_PER_WRITE`]) in one store write and answer each.
    /// Called with `alloc_reports.writing` held.
    fn write_alloc_reports(&self) {
        let batch = self.alloc_reports.take_batch();
        if batch.is_empty() {
            return;
        }
        let result = self
            .store
            .write(|t, changes| Ok::<_, ServerError>(apply_alloc_reports(t, &batch, changes)));
        match result {
            Ok(((evaluate, jobs), index)) => {
                tracing::debug!(
                    reports = batch.len(),
                    index,
                    jobs = jobs.len(),
                    "alloc status reports written"
                );
                let evaluations = (!jobs.is_empty()).then(|| {
                    Arc::new(BatchEvaluations {
                        jobs,
                        done: tokio::sync::OnceCell::new(),
                    })
                });
                for (report, evaluate) in batch.into_iter().zip(evaluate) {
                    let _ = report.written.send(Ok(ReportWritten {
                        index,
                        evaluations: evaluations.clone().filter(|_| evaluate),
                    }));
                }
            }
            Err(e) => {
                tracing::error!(reports = batch.len(), error = %e, "writing alloc status reports failed");
                let message = e.to_string();
                for report in batch {
                    let _ = report
                        .written
                        .send(Err(ServerError::Internal(message.clone())));
                }
            }
        }
    }
}

/// The most alloc status reports one store write takes; more wait for the
/// next write.
pub(crate) const MAX_REPORTS_PER_WRITE: usize = 256;

/// Alloc status reports waiting to be written, oldest first, and the
/// token of the write of reports in flight: whoever holds `writing` writes
/// the oldest queued reports, its own or others'.
#[derive(Default)]
pub(crate) struct AllocReports {
    queue: Mutex<VecDeque<QueuedReport>>,
    writing: tokio::sync::Mutex<()>,
    next_id: AtomicU64,
}

struct QueuedReport {
    id: u64,
    node_id: String,
    updates: Vec<AllocUpdate>,
    written: oneshot::Sender<Result<ReportWritten, ServerError>>,
}

/// What a report's caller learns once the write that holds it is durable.
struct ReportWritten {
    index: u64,
    /// The evaluations of the write's batch, when this report calls for one.
    evaluations: Option<Arc<BatchEvaluations>>,
}

/// The jobs a batch of reports calls to be evaluated; run once, by
/// whichever of the batch's callers that wait for them gets there first.
struct BatchEvaluations {
    jobs: BTreeSet<String>,
    done: tokio::sync::OnceCell<()>,
}

/// A queued report; dropped before its report is answered (its caller
/// went away), it takes the report out of the queue unwritten, if it is
/// still there.
pub(crate) struct QueuedGuard<'a> {
    reports: &'a AllocReports,
    id: u64,
}

impl QueuedGuard<'_> {
    /// The report was answered: it is no longer queued, and dropping the
    /// guard need not look for it.
    fn taken(self) {
        std::mem::forget(self);
    }
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        self.reports.queue().retain(|r| r.id != self.id);
    }
}

type Written = oneshot::Receiver<Result<ReportWritten, ServerError>>;

impl AllocReports {
    fn queue(&self) -> MutexGuard<'_, VecDeque<QueuedReport>> {
        self.queue.locked()
    }

    fn enqueue(&self, node_id: &str, updates: Vec<AllocUpdate>) -> (QueuedGuard<'_>, Written) {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.queue().push_back(QueuedReport {
            id,
            node_id: node_id.to_string(),
            updates,
            written: tx,
        });
        (QueuedGuard { reports: self, id }, rx)
    }

    fn take_batch(&self) -> Vec<QueuedReport> {
        let mut queue = self.queue();
        let n = queue.len().min(MAX_REPORTS_PER_WRITE);
        queue.drain(..n).collect()
    }

    /// How many reports wait for a write.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.queue().len()
    }
}

/// Apply `batch` to `t` in order, as if each report were a write of its
/// own: a later report of an alloc sees what an earlier one made of it.
/// Returns, for each report, whether it calls for evaluations, and the
/// jobs to evaluate.
fn apply_alloc_reports(
    t: &Tables,
    batch: &[QueuedReport],
    changes: &mut Vec<Change>,
) -> (Vec<bool>, BTreeSet<String>) {
    // Each alloc as the reports so far left it.
    let mut reported: BTreeMap<String, Allocation> = BTreeMap::new();
    let mut jobs = BTreeSet::new();
    let mut evaluate = Vec::with_capacity(batch.len());
    for report in batch {
        let mut any = false;
        for u in &report.updates {
            let Some(old) = reported
                .get(&u.alloc_id)
                .or_else(|| t.allocs.get(&u.alloc_id))
            else {
                tracing::debug!(alloc_id = %u.alloc_id, node_id = %report.node_id, "status update of an unknown alloc");
                continue;
            };
            if let Some(a) = apply_alloc_update(old, &report.node_id, u, &mut |job_id| {
                any = true;
                jobs.insert(job_id.to_string());
            }) {
                reported.insert(a.id.clone(), a);
            }
        }
        evaluate.push(any);
    }
    // The job's status moves with the allocs that decide it (failed as
    // soon as its last alloc failed), not an evaluation later.
    for job in jobs.iter().filter_map(|id| t.jobs.get(id)) {
        let allocs = t
            .allocs_of_job(&job.id)
            .map(|a| reported.get(&a.id).unwrap_or(a));
        match crate::scheduler::status_of_allocs(job, allocs) {
            Some(status) if status != job.status => {
                let mut job = job.clone();
                job.status = status;
                changes.push(Change::PutJob(job));
            }
            _ => {}
        }
    }
    for (id, a) in reported {
        if t.allocs.get(&id) != Some(&a) {
            changes.push(Change::PutAlloc(a));
        }
    }
    (evaluate, jobs)
}

/// A node back from down: its allocs held `unknown` are what their client
/// last reported again (it keeps running them: no stop, no replacement),
/// noted in `event`.
fn resume_allocs(
    t: &crate::state::Tables,
    node_id: &str,
    event: NodeEvent,
    changes: &mut Vec<Change>,
) -> NodeEvent {
    let resumed = crate::liveness::resume_unknown(t, node_id, berth_structs::now_ms());
    if resumed.is_empty() {
        return event;
    }
    tracing::info!(
        node_id,
        allocs = resumed.len(),
        "node back; its unknown allocs resume"
    );
    let event = event.with_detail("allocs_resumed", resumed.len().to_string());
    changes.extend(resumed.into_iter().map(Change::PutAlloc));
    event
}

/// What one status update of `node_id` makes of `old`: the changed alloc,
/// or None when it changes nothing or is ignored. `evaluate` is given the
/// job to evaluate when the change calls for it.
fn apply_alloc_update(
    old: &Allocation,
    node_id: &str,
    u: &AllocUpdate,
    evaluate: &mut dyn FnMut(&str),
) -> Option<Allocation> {
    if old.node_id != node_id {
        tracing::warn!(alloc_id = %u.alloc_id, node_id, owner = %old.node_id,
            "status update of an alloc placed on another node; ignored");
        return None;
    }
    if u.volume_stats_only && old.client_status.is_terminal() {
        // Its volumes are unmounted; a write would also move the
        // modify time the volume watcher's reap grace counts from.
        tracing::debug!(alloc_id = %old.id, node_id, status = old.client_status.as_str(),
            "volume stats of a terminal alloc; ignored");
        return None;
    }
    let mut a = old.clone();
    if let Some(stats) = &u.csi_volume_stats {
        // Only the group's own volumes.
        let group = a.group();
        let mut stats = stats.clone();
        stats.retain(|name, _| group.is_some_and(|g| g.volumes.contains_key(name)));
        a.csi_volume_stats = stats;
    }
    if u.volume_stats_only {
        // Nothing an evaluation looks at changes.
        return (a != *old).then_some(a);
    }
    let was_terminal = a.client_status.is_terminal();
    // The client speaks for an alloc held unknown: it is what it says.
    a.disconnected = None;
    if was_terminal && !u.client_status.is_terminal() {
        tracing::debug!(alloc_id = %a.id, from = a.client_status.as_str(),
            to = u.client_status.as_str(), "refusing to make a terminal alloc live again");
    } else {
        a.client_status = u.client_status;
        a.client_description = u.client_description.clone();
    }
    if let Some(ts) = &u.task_states {
        a.task_states = ts.clone();
    }
    if !was_terminal && a.client_status.is_terminal() {
        tracing::info!(alloc_id = %a.id, node_id, status = a.client_status.as_str(), "alloc terminal");
    }
    // Only a change that makes the alloc terminal on its client, or from
    // one terminal status to another, can change what its job's
    // evaluation does (what the alloc holds, a replacement, the job's
    // status). Pending to running changes none of it, and evaluating a
    // large job for each of its allocs starting would cost the whole
    // job's placement once per alloc. But for an alloc of a running
    // deployment whose health is not known yet: from its start, the
    // deployment counts the time to its health.
    let health_pending = a.deployment.as_ref().is_some_and(|d| d.healthy.is_none());
    if old.client_status != a.client_status
        && (old.client_status.is_terminal()
            || a.client_status.is_terminal()
            || old.client_status == AllocClientStatus::Unknown
            || health_pending)
    {
        evaluate(&a.job_id);
    }
    (a != *old).then_some(a)
}

/// A claim freed by a purge.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReleasedClaim {
    pub volume_id: String,
    pub alloc_id: String,
}

/// What `node purge` did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct NodePurge {
    pub node_id: String,
    pub node_name: String,
    /// The node's allocs that were not terminal and are now lost.
    pub lost_allocs: Vec<String>,
    /// The volume claims of the node's allocs that were freed (by the
    /// purge, or by the volume watcher meanwhile).
    pub released: Vec<ReleasedClaim>,
    /// Without `force`: the write claims kept, since the node's tasks may
    /// still write (see [`Server::purge_node`]).
    pub kept: Vec<ReleasedClaim>,
    /// Detach steps that could not be done on the way (the node is gone and
    /// was not told to unmount); the claims were freed anyway.
    pub warnings: Vec<String>,
}

impl Server {
    /// Purge a node (`berth node purge`): the operator says it is gone. It
    /// is removed from the state, its allocs that are not terminal become
    /// lost (desired stop) and their jobs are evaluated, and the volume
    /// claims made on it are freed, with no node detach. Its write claims
    /// are freed only with `force` (the operator says its tasks are gone
    /// too): a node whose client came back under another data dir still
    /// runs its old tasks, and freeing their write claims would let a
    /// replacement write beside them. Without it they are kept (marked in
    /// the same write that removes the node, so the volume watcher leaves
    /// them) and listed; `volume detach VOLUME NODE-ID` frees one.
    /// Should the node heartbeat again it gets NotFound and registers anew.
    pub async fn purge_node(&self, given: &str, force: bool) -> Result<NodePurge, ServerError> {
        let last_heartbeat = {
            let id = self
                .store
                .read(|t| resolve_node(t, given).map(|n| n.id.clone()))?;
            self.liveness.last_heartbeat_ms(&id)
        };
        let ((mut report, jobs), _) = self
            .store
            .write_async(|t, changes| {
                let node = resolve_node(t, given)?;
                let last_heartbeat_ms = last_heartbeat
                    .unwrap_or(node.last_heartbeat_ms)
                    .max(node.last_heartbeat_ms);
                let mut report = NodePurge {
                    node_id: node.id.clone(),
                    node_name: node.name.clone(),
                    ..NodePurge::default()
                };
                let mut jobs = BTreeSet::new();
                for a in t.allocs_on_node(&node.id) {
                    if a.client_status.is_terminal() {
                        continue;
                    }
                    let mut a = a.clone();
                    a.mark_lost("alloc is lost since its node was purged");
                    a.node_last_heartbeat_ms = last_heartbeat_ms;
                    report.lost_allocs.push(a.id.clone());
                    jobs.insert(a.job_id.clone());
                    changes.push(Change::PutAlloc(a));
                }
                if !force {
                    report.kept = keep_write_claims(t, &node.id, changes);
                }
                changes.push(Change::DeleteNode(node.id.clone()));
                Ok::<_, ServerError>((report, jobs))
            })
            .await?;
        self.liveness.forget_heartbeats(&report.node_id);
        tracing::warn!(node_id = %report.node_id, name = %report.node_name,
            lost_allocs = report.lost_allocs.len(), "node purged");
        let claims: Vec<ReleasedClaim> = self.store.read(|t| {
            t.volumes_claimed_on_node(&report.node_id)
                .flat_map(|v| {
                    v.claims()
                        .filter(|c| c.node_id == report.node_id && !c.kept_after_purge)
                        .map(|c| ReleasedClaim {
                            volume_id: v.id.clone(),
                            alloc_id: c.alloc_id.clone(),
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        });
        for claim in &claims {
            let _lock = self.volume_locks.lock(&claim.volume_id).await;
            self.release_claim_locked(
                &claim.volume_id,
                &claim.alloc_id,
                &ReleaseOrigin::Operator,
                Some(&mut report.warnings),
            )
            .await?;
        }
        // Freed by this purge or by the volume watcher meanwhile: gone.
        report.released = self.store.read(|t| {
            claims
                .into_iter()
                .filter(|c| {
                    t.volumes
                        .get(&c.volume_id)
                        .and_then(|v| v.claim_for(&c.alloc_id))
                        .is_none()
                })
                .collect()
        });
        if !report.kept.is_empty() {
            tracing::warn!(node_id = %report.node_id, kept = report.kept.len(),
                "node purged without -force: its write claims are kept, since its tasks may still write");
        }
        for job_id in &jobs {
            self.evaluate_job(job_id).await;
        }
        self.evaluate_after_cluster_change().await;
        Ok(report)
    }
}

/// Marks the write claims held on `node_id` as kept after its purge; the
/// claims marked.
fn keep_write_claims(
    t: &crate::state::Tables,
    node_id: &str,
    changes: &mut Vec<Change>,
) -> Vec<ReleasedClaim> {
    let mut kept = Vec::new();
    for v in t.volumes_claimed_on_node(node_id) {
        let mut v = v.clone();
        let mut changed = false;
        for c in v.write_claims.values_mut().filter(|c| c.node_id == node_id) {
            changed |= !c.kept_after_purge;
            c.kept_after_purge = true;
            kept.push(ReleasedClaim {
                volume_id: v.id.clone(),
                alloc_id: c.alloc_id.clone(),
            });
        }
        if changed {
            changes.push(Change::PutVolume(v));
        }
    }
    kept
}

/// What the API shows of a node beside the node itself: what its allocs
/// ask for and the CSI volumes they hold.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct NodeUsage {
    /// The sums of what the node's allocs that are not terminal ask for
    /// (what the scheduler counts against the node); disk stays 0, as no
    /// job asks for disk yet.
    pub allocated: berth_structs::NodeResources,
    /// The claims held on the node, by volume then alloc.
    pub csi_volumes: Vec<berth_structs::NodeCsiVolume>,
}

impl Server {
    /// How many allocs their clients report running on each of
    /// `node_ids` (the node list's count), from the index of allocs by
    /// node: the cost is those nodes' allocs, not every alloc.
    pub fn running_allocs_on_nodes(&self, node_ids: &[&str]) -> Vec<usize> {
        self.store.read(|t| {
            node_ids
                .iter()
                .map(|id| {
                    t.allocs_on_node(id)
                        .filter(|a| a.client_status == AllocClientStatus::Running)
                        .count()
                })
                .collect()
        })
    }

    /// What `node_id`'s allocs use and which CSI volumes they claim, from
    /// the state's indexes of allocs and claims by node: the cost is the
    /// node's, not the fleet's.
    pub fn node_usage(&self, node_id: &str) -> NodeUsage {
        self.store.read(|t| {
            let mut allocated = berth_structs::NodeResources::default();
            for a in t.allocs_on_node(node_id).filter(|a| !a.is_terminal()) {
                for task in a.group().into_iter().flat_map(|g| &g.tasks) {
                    allocated.cpu = allocated.cpu.saturating_add(task.resources.cpu);
                    allocated.memory_mb =
                        allocated.memory_mb.saturating_add(task.resources.memory_mb);
                }
            }
            let csi_volumes = t
                .volumes_claimed_on_node(node_id)
                .flat_map(|v| {
                    v.claims().filter(|c| c.node_id == node_id).map(|c| {
                        berth_structs::NodeCsiVolume {
                            volume_id: v.id.clone(),
                            plugin_id: v.plugin_id.clone(),
                            alloc_id: c.alloc_id.clone(),
                            mode: c.mode,
                            state: c.state.as_str().to_string(),
                        }
                    })
                })
                .collect();
            NodeUsage {
                allocated,
                csi_volumes,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use berth_structs::{AllocClientStatus, Allocation};

    use super::{AllocUpdate, MAX_REPORTS_PER_WRITE};
    use crate::server::Server;
    use crate::state::Change;

    /// A server whose state holds `per_node` pending allocs on each of
    /// the nodes `n0`..`n{nodes-1}`, alloc `a{node}-{i}`.
    fn server_with_allocs(dir: &std::path::Path, nodes: usize, per_node: usize) -> Arc<Server> {
        let server = Server::open(crate::ServerConfig::new(dir)).unwrap();
        server
            .store
            .write(|_, changes| {
                for n in 0..nodes {
                    for i in 0..per_node {
                        changes.push(Change::PutAlloc(Allocation {
                            id: format!("a{n}-{i}"),
                            node_id: format!("n{n}"),
                            job_id: "web".into(),
                            ..Allocation::default()
                        }));
                    }
                }
                Ok::<_, crate::ServerError>(())
            })
            .unwrap();
        server
    }

    fn status(alloc_id: &str, status: AllocClientStatus) -> AllocUpdate {
        AllocUpdate {
            alloc_id: alloc_id.into(),
            client_status: status,
            client_description: format!("{} by its client", status.as_str()),
            ..AllocUpdate::default()
        }
    }

    fn client_status(server: &Server, alloc_id: &str) -> AllocClientStatus {
        server.allocation(alloc_id).unwrap().client_status
    }

    /// Poll `cond` until it holds; panic after `timeout`.
    async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !cond() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Start a report of `node_id` on its own task.
    fn spawn_report(
        server: &Arc<Server>,
        node_id: String,
        updates: Vec<AllocUpdate>,
    ) -> tokio::task::JoinHandle<Result<u64, crate::ServerError>> {
        let server = server.clone();
        tokio::spawn(async move { server.update_allocations(&node_id, updates).await })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reports_that_arrive_during_a_write_share_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = MAX_REPORTS_PER_WRITE + 44;
        let server = server_with_allocs(dir.path(), nodes, 2);
        let before = server.index();
        // A write of reports in flight: every report that arrives meanwhile
        // is queued.
        let in_flight = server.alloc_reports.writing.lock().await;
        let reports: Vec<_> = (0..nodes)
            .map(|n| {
                let updates = vec![
                    status(&format!("a{n}-0"), AllocClientStatus::Running),
                    status(&format!("a{n}-1"), AllocClientStatus::Running),
                ];
                spawn_report(&server, format!("n{n}"), updates)
            })
            .collect();
        wait_until("every report queued", Duration::from_secs(30), || {
            server.alloc_reports.queued() == nodes
        })
        .await;
        drop(in_flight);
        let mut indexes = Vec::new();
        for r in reports {
            indexes.push(r.await.unwrap().unwrap());
        }
        // Two writes: a full batch and the rest.
        assert_eq!(
            server.index(),
            before + 2,
            "one commit per batch of reports"
        );
        // Queued in whatever order the tasks ran: count, not position.
        let first = indexes.iter().filter(|&&i| i == before + 1).count();
        let second = indexes.iter().filter(|&&i| i == before + 2).count();
        assert_eq!(
            (first, second),
            (MAX_REPORTS_PER_WRITE, nodes - MAX_REPORTS_PER_WRITE)
        );
        for n in 0..nodes {
            for i in 0..2 {
                let id = format!("a{n}-{i}");
                assert_eq!(
                    client_status(&server, &id),
                    AllocClientStatus::Running,
                    "{id}"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rejected_report_in_a_batch_leaves_the_others_applied() {
        let dir = tempfile::tempdir().unwrap();
        let server = server_with_allocs(dir.path(), 3, 1);
        let before = server.index();
        let in_flight = server.alloc_reports.writing.lock().await;
        let reports = vec![
            spawn_report(
                &server,
                "n0".into(),
                vec![status("a0-0", AllocClientStatus::Running)],
            ),
            // n1 reports n2's alloc (and one no one knows): both ignored.
            spawn_report(
                &server,
                "n1".into(),
                vec![
                    status("a2-0", AllocClientStatus::Failed),
                    status("no-such-alloc", AllocClientStatus::Running),
                ],
            ),
            spawn_report(
                &server,
                "n2".into(),
                vec![status("a2-0", AllocClientStatus::Running)],
            ),
        ];
        wait_until("every report queued", Duration::from_secs(30), || {
            server.alloc_reports.queued() == 3
        })
        .await;
        drop(in_flight);
        for r in reports {
            assert_eq!(r.await.unwrap().unwrap(), before + 1);
        }
        assert_eq!(client_status(&server, "a0-0"), AllocClientStatus::Running);
        assert_eq!(client_status(&server, "a2-0"), AllocClientStatus::Running);
        assert_eq!(client_status(&server, "a1-0"), AllocClientStatus::Pending);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reports_of_one_alloc_in_a_batch_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let server = server_with_allocs(dir.path(), 1, 1);
        let in_flight = server.alloc_reports.writing.lock().await;
        let mut reports = Vec::new();
        for (i, s) in [
            AllocClientStatus::Running,
            AllocClientStatus::Failed,
            AllocClientStatus::Running,
        ]
        .into_iter()
        .enumerate()
        {
            reports.push(spawn_report(&server, "n0".into(), vec![status("a0-0", s)]));
            wait_until("the report queued", Duration::from_secs(30), || {
                server.alloc_reports.queued() == i + 1
            })
            .await;
        }
        drop(in_flight);
        for r in reports {
            r.await.unwrap().unwrap();
        }
        // Failed, then never live again.
        let a = server.allocation("a0-0").unwrap();
        assert_eq!(a.client_status, AllocClientStatus::Failed);
        assert_eq!(a.client_description, "failed by its client");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_report_that_fails_a_jobs_last_alloc_writes_the_job_failed() {
        use berth_structs::{Job, JobStatus, JobType, ReschedulePolicy, TaskGroup};
        let dir = tempfile::tempdir().unwrap();
        let server = Server::open(crate::ServerConfig::new(dir.path())).unwrap();
        // A batch job of two allocs whose policy replaces no failed one.
        let job = Job {
            id: "web".into(),
            job_type: JobType::Batch,
            status: JobStatus::Running,
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count: 2,
                reschedule: Some(ReschedulePolicy {
                    attempts: 0,
                    ..ReschedulePolicy::default_for(JobType::Batch)
                }),
                ..TaskGroup::default()
            }],
            ..Job::default()
        };
        server
            .store
            .write(|_, changes| {
                for i in 0..2 {
                    changes.push(Change::PutAlloc(Allocation {
                        id: format!("a0-{i}"),
                        node_id: "n0".into(),
                        job_id: "web".into(),
                        task_group: "g".into(),
                        job: std::sync::Arc::new(job.clone()),
                        ..Allocation::default()
                    }));
                }
                changes.push(Change::PutJob(job.clone()));
                Ok::<_, crate::ServerError>(())
            })
            .unwrap();
        let job = |server: &Server| server.job("web").unwrap();
        // One of two fails: the other still runs.
        let running = vec![
            status("a0-0", AllocClientStatus::Running),
            status("a0-1", AllocClientStatus::Running),
        ];
        server.update_allocations("n0", running).await.unwrap();
        let failed = vec![status("a0-0", AllocClientStatus::Failed)];
        server.update_allocations("n0", failed).await.unwrap();
        assert_eq!(job(&server).status, JobStatus::Running);
        // The last one fails: the job is failed in the report's own write,
        // whatever the evaluation after it does.
        let last = vec![status("a0-1", AllocClientStatus::Failed)];
        let index = server.update_allocations("n0", last).await.unwrap();
        let j = job(&server);
        assert_eq!(j.status, JobStatus::Failed);
        assert_eq!(j.modify_index, index, "written with the report");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_report_is_written_without_waiting_for_another() {
        let dir = tempfile::tempdir().unwrap();
        let server = server_with_allocs(dir.path(), 1, 1);
        let before = server.index();
        let report = spawn_report(
            &server,
            "n0".into(),
            vec![status("a0-0", AllocClientStatus::Running)],
        );
        wait_until("the lone report answered", Duration::from_secs(30), || {
            report.is_finished()
        })
        .await;
        assert_eq!(report.await.unwrap().unwrap(), before + 1);
        assert_eq!(client_status(&server, "a0-0"), AllocClientStatus::Running);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_report_whose_caller_went_away_before_its_write_is_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let server = server_with_allocs(dir.path(), 1, 1);
        let before = server.index();
        let in_flight = server.alloc_reports.writing.lock().await;
        let report = spawn_report(
            &server,
            "n0".into(),
            vec![status("a0-0", AllocClientStatus::Running)],
        );
        wait_until("the report queued", Duration::from_secs(30), || {
            server.alloc_reports.queued() == 1
        })
        .await;
        report.abort();
        wait_until(
            "the report taken out of the queue",
            Duration::from_secs(30),
            || server.alloc_reports.queued() == 0,
        )
        .await;
        drop(in_flight);
        // The next report is written alone.
        let next = spawn_report(&server, "n0".into(), vec![]);
        assert_eq!(next.await.unwrap().unwrap(), before);
        assert_eq!(client_status(&server, "a0-0"), AllocClientStatus::Pending);
    }
}
