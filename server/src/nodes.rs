//! What clients tell the servers about their nodes: registration,
//! heartbeats, node events, CSI plugin fingerprints and alloc status.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use berth_structs::{
    AllocClientStatus, CsiInfo, Node, NodeEvent, NodeStatus, TaskState, ValidationError,
};

use crate::csi::ReleaseOrigin;
use crate::error::ServerError;
use crate::server::Server;
use crate::state::{Change, Tables};

/// The node `given` names: its ID, its name, or a unique prefix of its ID
/// (what `node status` and `volume detach` accept), in that order.
pub(crate) fn resolve_node<'a>(t: &'a Tables, given: &str) -> Result<&'a Node, ServerError> {
    if let Some(n) = t.nodes.get(given) {
        return Ok(n);
    }
    let named: Vec<&Node> = t.nodes_named(given).collect();
    match named.as_slice() {
        [one] => return Ok(one),
        [] => {}
        many => {
            let ids: Vec<&str> = many.iter().map(|n| n.id.as_str()).collect();
            return Err(ServerError::BadRequest(format!(
                "node name {given:?} matches {} nodes ({}); give the node ID",
                many.len(),
                ids.join(", ")
            )));
        }
    }
    crate::prefix::resolve(&t.nodes, given, crate::prefix::NODE, |k, n| {
        format!("{k:?} ({})", n.name)
    })?
    .map(|(_, n)| n)
    .ok_or_else(|| {
        ServerError::not_found(format!(
            "node {given:?} not found: give a node ID, a unique ID prefix or a node name (see `berth node status`)"
        ))
    })
}

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
        secret: Option<&berth_structs::NodeSecret>,
    ) -> Result<NodeRegistration, ServerError> {
        let bad_names: Vec<String> = [("node ID", &node.id), ("node name", &node.name)]
            .into_iter()
            .filter_map(|(field, value)| berth_structs::check_name(field, value).err())
            .map(|e| format!("node: {e}"))
            .collect();
        if !bad_names.is_empty() {
            return Err(ValidationError(bad_names).into());
        }
        let ((), index) = self.store.write(|t, changes| {
            let mut event = NodeEvent::new(NodeEvent::SUBSYSTEM_CLUSTER, "Node registered");
            if let Some(secret) = secret {
                crate::node_secrets::admit_registration(t, &node.id, secret, changes)?;
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
                }
            }
            node.push_events(carried);
            node.push_events([event]);
            node.status = NodeStatus::Ready;
            node.last_heartbeat_ms = berth_structs::now_ms();
            changes.push(Change::PutNode(node.clone()));
            Ok::<_, ServerError>(())
        })?;
        self.record_heartbeat(&node.id, node.last_heartbeat_ms);
        let ttl = self.heartbeat_ttl();
        self.reset_heartbeat_timer(&node.id, ttl);
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
        self.record_heartbeat(node_id, now_ms);
        let ttl = self.heartbeat_ttl();
        let marking_down = self.rearm_heartbeat_timer(node_id, ttl);
        let ready = self
            .store
            .read(|t| t.nodes.get(node_id).map(|n| n.status == NodeStatus::Ready));
        let was_down = match ready {
            Some(true) if !marking_down => false,
            Some(_) => {
                self.store
                    .write(|t, changes| {
                        let node = t.nodes.get(node_id).ok_or_else(unknown)?;
                        if node.status == NodeStatus::Ready {
                            return Ok::<_, ServerError>(false);
                        }
                        let mut node = node.clone();
                        node.status = NodeStatus::Ready;
                        node.push_events([NodeEvent::new(
                            NodeEvent::SUBSYSTEM_CLUSTER,
                            "Node heartbeat received; node ready",
                        )
                        .with_detail("status", NodeStatus::Ready.as_str())]);
                        node.last_heartbeat_ms = now_ms;
                        changes.push(Change::PutNode(node));
                        Ok(true)
                    })
                    .inspect_err(|e| {
                        if matches!(e, ServerError::NotFound(_)) {
                            self.forget_heartbeats(node_id);
                        }
                    })?
                    .0
            }
            None => {
                // Purged meanwhile.
                self.forget_heartbeats(node_id);
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
        let (changed, _) = self.store.write(|t, changes| {
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
        })?;
        if changed {
            tracing::info!(node_id, "node CSI plugins updated");
            self.evaluate_after_cluster_change().await;
        }
        Ok(())
    }

    /// Apply alloc status reports of `node_id`. A terminal alloc never
    /// becomes non-terminal again; reports about allocs of another node are
    /// ignored. Returns the index.
    pub async fn update_allocations(
        &self,
        node_id: &str,
        updates: Vec<AllocUpdate>,
    ) -> Result<u64, ServerError> {
        let (jobs, index) = self.store.write(|t, changes| {
            let mut jobs = BTreeSet::new();
            for u in updates {
                let Some(a) = t.allocs.get(&u.alloc_id) else {
                    tracing::debug!(alloc_id = %u.alloc_id, node_id, "status update of an unknown alloc");
                    continue;
                };
                if a.node_id != node_id {
                    tracing::warn!(alloc_id = %u.alloc_id, node_id, owner = %a.node_id,
                        "status update of an alloc placed on another node; ignored");
                    continue;
                }
                if u.volume_stats_only && a.client_status.is_terminal() {
                    // Its volumes are unmounted; a write would also move the
                    // modify time the volume watcher's reap grace counts from.
                    tracing::debug!(alloc_id = %a.id, node_id, status = a.client_status.as_str(),
                        "volume stats of a terminal alloc; ignored");
                    continue;
                }
                let mut a = a.clone();
                if let Some(mut stats) = u.csi_volume_stats {
                    // Only the group's own volumes.
                    let group = a.group();
                    stats.retain(|name, _| group.is_some_and(|g| g.volumes.contains_key(name)));
                    a.csi_volume_stats = stats;
                }
                if u.volume_stats_only {
                    // Nothing an evaluation looks at changes.
                    if t.allocs[&a.id] != a {
                        changes.push(Change::PutAlloc(a));
                    }
                    continue;
                }
                let was_terminal = a.client_status.is_terminal();
                if was_terminal && !u.client_status.is_terminal() {
                    tracing::debug!(alloc_id = %a.id, from = a.client_status.as_str(),
                        to = u.client_status.as_str(), "refusing to make a terminal alloc live again");
                } else {
                    a.client_status = u.client_status;
                    a.client_description = u.client_description;
                }
                if let Some(ts) = u.task_states {
                    a.task_states = ts;
                }
                if !was_terminal && a.client_status.is_terminal() {
                    tracing::info!(alloc_id = %a.id, node_id, status = a.client_status.as_str(), "alloc terminal");
                }
                let old = &t.allocs[&a.id];
                // Only a change that makes the alloc terminal on its client,
                // or from one terminal status to another, can change what
                // its job's evaluation does (what the alloc holds, a
                // replacement, the job's status). Pending to running
                // changes none of it, and evaluating a large job for each
                // of its allocs starting would cost the whole job's
                // placement once per alloc.
                if old.client_status != a.client_status
                    && (old.client_status.is_terminal() || a.client_status.is_terminal())
                {
                    jobs.insert(a.job_id.clone());
                }
                if *old != a {
                    changes.push(Change::PutAlloc(a));
                }
            }
            Ok::<_, ServerError>(jobs)
        })?;
        if !jobs.is_empty() {
            for job_id in &jobs {
                self.evaluate_job(job_id).await;
            }
            self.evaluate_blocked().await;
        }
        Ok(index)
    }
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
    /// The volume claims of the node's allocs that were freed.
    pub released: Vec<ReleasedClaim>,
    /// Detach steps that could not be done on the way (the node is gone and
    /// was not told to unmount); the claims were freed anyway.
    pub warnings: Vec<String>,
}

impl Server {
    /// Purge a node (`berth node purge`): the operator says it is gone. It
    /// is removed from the state, its allocs that are not terminal become
    /// lost (desired stop) and their jobs are evaluated, and every volume
    /// claim made on it is freed, write claims too, with no node detach.
    /// Should it heartbeat again it gets NotFound and registers anew.
    pub async fn purge_node(&self, given: &str) -> Result<NodePurge, ServerError> {
        let last_heartbeat = {
            let id = self
                .store
                .read(|t| resolve_node(t, given).map(|n| n.id.clone()))?;
            self.last_heartbeat_ms(&id)
        };
        let ((mut report, jobs), _) = self.store.write(|t, changes| {
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
                a.client_status = AllocClientStatus::Lost;
                a.client_description = "alloc is lost since its node was purged".into();
                a.desired_status = berth_structs::AllocDesiredStatus::Stop;
                a.desired_description = "alloc is lost since its node was purged".into();
                a.node_last_heartbeat_ms = last_heartbeat_ms;
                report.lost_allocs.push(a.id.clone());
                jobs.insert(a.job_id.clone());
                changes.push(Change::PutAlloc(a));
            }
            changes.push(Change::DeleteNode(node.id.clone()));
            Ok::<_, ServerError>((report, jobs))
        })?;
        self.forget_heartbeats(&report.node_id);
        tracing::warn!(node_id = %report.node_id, name = %report.node_name,
            lost_allocs = report.lost_allocs.len(), "node purged");
        let claims: Vec<ReleasedClaim> = self.store.read(|t| {
            t.volumes_claimed_on_node(&report.node_id)
                .flat_map(|v| {
                    v.claims()
                        .filter(|c| c.node_id == report.node_id)
                        .map(|c| ReleasedClaim {
                            volume_id: v.id.clone(),
                            alloc_id: c.alloc_id.clone(),
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        });
        for claim in claims {
            let _lock = self.volume_locks.lock(&claim.volume_id).await;
            let freed = self
                .release_claim_locked(
                    &claim.volume_id,
                    &claim.alloc_id,
                    &ReleaseOrigin::Operator,
                    Some(&mut report.warnings),
                )
                .await?;
            if freed {
                report.released.push(claim);
            }
        }
        for job_id in &jobs {
            self.evaluate_job(job_id).await;
        }
        self.evaluate_after_cluster_change().await;
        Ok(report)
    }
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
