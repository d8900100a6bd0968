//! Node drain and eligibility: the operator's requests, and the drainer
//! that moves allocs off draining nodes.
//!
//! A draining node is ineligible: the scheduler places nothing new there.
//! The drainer is one task (run by the leader; a single server always is)
//! that looks at every draining node whenever the state changes, and
//! otherwise sleeps until the earliest drain deadline. On a draining node:
//!
//! 1. Service and batch allocs are stopped at once (desired stop, "node is
//!    draining"); the scheduler places their replacements on other nodes,
//!    since a stopped alloc no longer holds its index in the group.
//! 2. System allocs are stopped last: once every service and batch alloc
//!    there is terminal on the client, or the deadline has passed (the
//!    drain stops waiting for migrations). A system alloc that runs a CSI
//!    plugin is stopped only when no alloc on the node still uses a volume
//!    of that plugin (not terminal on the client) and no claim of such a
//!    volume is held for the node: volumes are unmounted and released
//!    while their plugin still runs. The deadline does not lift this rule.
//! 3. The drain is complete when every alloc on the node is terminal on
//!    the client (after the deadline: stopped by the servers is enough):
//!    the strategy is cleared, the node stays ineligible until an operator
//!    makes it eligible again, and the node gets a "Node drain complete"
//!    event.
//!
//! Disabling a drain clears the strategy and leaves the node ineligible;
//! allocs already stopped stay stopped.

use berth_sync::Shutdown;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use berth_structs::{
    AllocDesiredStatus, Allocation, DrainStrategy, JobType, NodeEvent, SchedulingEligibility,
};

use berth_structs::limits::{too_large, MAX_DURATION};

use crate::error::ServerError;
use crate::liveness::EvaluateJob;
use crate::prefix::resolve_node;
use crate::state::{Change, ClusterIndexes, StateStore, Tables};

/// The drainer: the operator's drain and eligibility requests, and the
/// loop that moves allocs off draining nodes. What it needs of the rest of
/// the server, evaluating the jobs whose allocs it stopped, is handed to
/// its loop as an [`EvaluateJob`].
pub(crate) struct Drainer {
    store: Arc<StateStore>,
}

pub use berth_structs::node::{DRAIN_COMPLETE_EVENT, DRAIN_STOP_DESCRIPTION};

/// What one look at the draining nodes decided.
#[derive(Debug, Default)]
struct DrainPass {
    /// Allocs to stop, already marked.
    stops: Vec<Allocation>,
    /// Nodes whose drain is complete.
    complete: Vec<String>,
    /// The earliest drain deadline still ahead (unix ms).
    next_deadline_ms: Option<i64>,
}

fn is_system(a: &Allocation) -> bool {
    a.job.job_type == JobType::System
}

/// The CSI plugins the alloc's tasks serve.
fn plugin_ids(a: &Allocation) -> BTreeSet<&str> {
    a.group()
        .into_iter()
        .flat_map(|g| g.tasks.iter())
        .filter_map(|t| t.csi_plugin.as_ref())
        .map(|p| p.id.as_str())
        .collect()
}

/// Why the plugin alloc `plugin` on `node_id` must keep running, if it
/// must: a claim of a volume of one of `ids` is held for the node, or an
/// alloc there that uses such a volume is not terminal on the client.
fn plugin_still_needed(
    t: &Tables,
    node_id: &str,
    plugin: &Allocation,
    ids: &BTreeSet<&str>,
) -> Option<String> {
    for v in t
        .volumes_claimed_on_node(node_id)
        .filter(|v| ids.contains(v.plugin_id.as_str()))
    {
        if let Some(c) = v.claims().find(|c| c.node_id == node_id) {
            return Some(format!(
                "volume {:?} is still claimed by alloc {} on the node",
                v.id, c.alloc_id
            ));
        }
    }
    for a in t.allocs_on_node(node_id) {
        if a.id == plugin.id || a.client_status.is_terminal() {
            continue;
        }
        let Some(g) = a.group() else { continue };
        for req in g.volumes.values() {
            let vid = req.source_for(a.index);
            if t.volumes
                .get(&vid)
                .is_some_and(|v| ids.contains(v.plugin_id.as_str()))
            {
                return Some(format!(
                    "alloc {} still uses volume {vid:?} ({})",
                    a.id,
                    a.client_status.as_str()
                ));
            }
        }
    }
    None
}

fn drain_stop(a: &Allocation) -> Allocation {
    let mut a = a.clone();
    a.desired_status = AllocDesiredStatus::Stop;
    a.desired_description = DRAIN_STOP_DESCRIPTION.to_string();
    a
}

/// Decide the stops and completions of every draining node at `now_ms`.
fn plan_drains(t: &Tables, now_ms: i64) -> DrainPass {
    let mut pass = DrainPass::default();
    for node in t.draining_nodes() {
        let Some(strategy) = node.drain_strategy else {
            continue;
        };
        let past_deadline = strategy.deadline_passed(now_ms);
        if !past_deadline {
            let at = strategy.force_deadline_ms;
            pass.next_deadline_ms = Some(pass.next_deadline_ms.map_or(at, |n| n.min(at)));
        }
        let allocs: Vec<&Allocation> = t.allocs_on_node(&node.id).collect();
        let mut stopped: BTreeSet<&str> = BTreeSet::new();
        for a in allocs.iter().filter(|a| !is_system(a)) {
            if !a.server_terminal() && !a.client_status.is_terminal() {
                stopped.insert(&a.id);
                pass.stops.push(drain_stop(a));
            }
        }
        let migrated = allocs
            .iter()
            .filter(|a| !is_system(a))
            .all(|a| a.client_status.is_terminal());
        if migrated || past_deadline {
            for a in allocs.iter().filter(|a| is_system(a)) {
                if a.server_terminal() || a.client_status.is_terminal() {
                    continue;
                }
                let ids = plugin_ids(a);
                if !ids.is_empty() {
                    if let Some(why) = plugin_still_needed(t, &node.id, a, &ids) {
                        tracing::debug!(node_id = %node.id, alloc_id = %a.id, why, "drain: plugin alloc waits");
                        continue;
                    }
                }
                stopped.insert(&a.id);
                pass.stops.push(drain_stop(a));
            }
        }
        let done = allocs.iter().all(|a| {
            a.client_status.is_terminal()
                || (past_deadline && (a.server_terminal() || stopped.contains(a.id.as_str())))
        });
        if done {
            pass.complete.push(node.id.clone());
        }
    }
    pass
}

/// Unix ms `at` as a time to sleep until, from `now_ms`.
fn until(at_ms: i64, now_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(at_ms.saturating_sub(now_ms)).unwrap_or(0))
}

/// How long the drainer waits before it retries a pass that failed.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);

impl Drainer {
    pub(crate) fn new(store: Arc<StateStore>) -> Drainer {
        Drainer { store }
    }

    /// Start or update (`Some(deadline)`) or disable (`None`) the drain of
    /// `node` (an ID, a unique ID prefix or a name). A drain makes the node
    /// ineligible; disabling it leaves the node ineligible. A zero deadline
    /// is a forced drain; one above a year is refused. Returns the node's
    /// ID.
    pub(crate) fn update_node_drain(
        &self,
        node: &str,
        deadline: Option<Duration>,
    ) -> Result<String, ServerError> {
        if let Some(d) = deadline {
            if d > MAX_DURATION {
                return Err(ServerError::BadRequest(format!(
                    "drain deadline: {}",
                    too_large(
                        humantime::format_duration(d),
                        humantime::format_duration(MAX_DURATION)
                    )
                )));
            }
        }
        let now = berth_structs::now_ms();
        let (node_id, _) = self.store.write(|t, changes| {
            let mut n = resolve_node(t, node)?.clone();
            match deadline {
                Some(deadline) => {
                    let mut strategy = DrainStrategy::new(deadline, now);
                    if let Some(old) = n.drain_strategy {
                        strategy.started_at_ms = old.started_at_ms;
                    }
                    n.set_drain(Some(strategy));
                    n.push_events([NodeEvent::new(
                        NodeEvent::SUBSYSTEM_DRAIN,
                        "Node drain strategy set",
                    )
                    .with_detail(
                        "deadline",
                        humantime::format_duration(deadline).to_string(),
                    )]);
                    tracing::info!(node_id = %n.id, deadline_ms = deadline.as_millis() as u64, "node drain enabled");
                }
                None if n.drain_strategy.is_some() => {
                    n.set_drain(None);
                    n.push_events([NodeEvent::new(
                        NodeEvent::SUBSYSTEM_DRAIN,
                        "Node drain disabled",
                    )]);
                    tracing::info!(node_id = %n.id, "node drain disabled; the node stays ineligible");
                }
                None => return Ok::<_, ServerError>(n.id),
            }
            let id = n.id.clone();
            changes.push(Change::PutNode(n));
            Ok(id)
        })?;
        Ok(node_id)
    }

    /// Make `node` eligible or ineligible for new allocs. A draining node
    /// cannot be made eligible: disable the drain first. Returns the node's
    /// ID, and whether it was made eligible (the cluster is to be
    /// evaluated again then).
    pub(crate) fn set_node_eligibility(
        &self,
        node: &str,
        eligible: bool,
    ) -> Result<(String, bool), ServerError> {
        let wanted = if eligible {
            SchedulingEligibility::Eligible
        } else {
            SchedulingEligibility::Ineligible
        };
        let ((node_id, changed), _) = self.store.write(|t, changes| {
            let n = resolve_node(t, node)?;
            if eligible && n.drain_strategy.is_some() {
                return Err(ServerError::Conflict(format!(
                    "node {:?} is draining; disable the drain first (berth node drain -disable {})",
                    n.name, n.id
                )));
            }
            if n.scheduling_eligibility == wanted {
                return Ok((n.id.clone(), false));
            }
            let mut n = n.clone();
            n.scheduling_eligibility = wanted;
            n.push_events([NodeEvent::new(
                NodeEvent::SUBSYSTEM_CLUSTER,
                format!("Node marked as {} for scheduling", wanted.as_str()),
            )]);
            let id = n.id.clone();
            changes.push(Change::PutNode(n));
            Ok((id, true))
        })?;
        if changed {
            tracing::info!(
                node_id,
                eligibility = wanted.as_str(),
                "node eligibility changed"
            );
        }
        Ok((node_id, changed && eligible))
    }

    /// One look at the draining nodes: stop what is due, complete what is
    /// done, evaluate the jobs whose allocs were stopped. Returns the
    /// earliest deadline still ahead.
    async fn drain_pass(&self, jobs: &dyn EvaluateJob) -> Result<Option<i64>, ServerError> {
        let draining = self.store.read(|t| t.draining_nodes().next().is_some());
        if !draining {
            return Ok(None);
        }
        let now = berth_structs::now_ms();
        let (pass, _) = self
            .store
            .write_async(|t, changes| {
                let pass = plan_drains(t, now);
                for a in &pass.stops {
                    changes.push(Change::PutAlloc(a.clone()));
                }
                for id in &pass.complete {
                    if let Some(n) = t.nodes.get(id) {
                        let mut n = n.clone();
                        n.set_drain(None);
                        n.push_events([NodeEvent::new(
                            NodeEvent::SUBSYSTEM_DRAIN,
                            DRAIN_COMPLETE_EVENT,
                        )]);
                        changes.push(Change::PutNode(n));
                    }
                }
                Ok::<_, ServerError>(pass)
            })
            .await?;
        let mut stopped_jobs = BTreeSet::new();
        for a in &pass.stops {
            tracing::info!(node_id = %a.node_id, alloc_id = %a.id, job_id = %a.job_id, name = %a.name, "drain: alloc stopped");
            stopped_jobs.insert(a.job_id.clone());
        }
        for id in &pass.complete {
            tracing::info!(node_id = %id, "node drain complete");
        }
        for job_id in &stopped_jobs {
            jobs.evaluate_job(job_id).await;
        }
        Ok(pass.next_deadline_ms)
    }

    /// Look at the draining nodes on every write that moved the nodes,
    /// volumes or allocs and at each drain deadline, until `shutdown`
    /// turns true.
    pub(crate) async fn run(&self, jobs: &dyn EvaluateJob, mut shutdown: Shutdown) {
        let mut index_rx = self.store.subscribe();
        // What the last pass read and when it wanted to look again: a write
        // that moved none of it (the volume stats nodes report all the
        // time) needs no pass over the draining nodes' allocs.
        let mut passed: Option<(ClusterIndexes, Option<tokio::time::Instant>)> = None;
        tracing::info!("drainer running");
        loop {
            index_rx.borrow_and_update();
            let inputs = self.store.read(Tables::cluster_indexes);
            let now = tokio::time::Instant::now();
            let unchanged =
                passed.is_some_and(|(seen, due)| seen == inputs && due.is_none_or(|at| at > now));
            if !unchanged {
                let wait = match self.drain_pass(jobs).await {
                    Ok(next) => next.map(|at| until(at, berth_structs::now_ms())),
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in_ms = RETRY_AFTER_FAILURE.as_millis() as u64, "drain pass failed");
                        Some(RETRY_AFTER_FAILURE)
                    }
                };
                passed = Some((inputs, wait.and_then(|d| now.checked_add(d))));
            }
            let due = passed.and_then(|(_, due)| due);
            tokio::select! {
                _ = shutdown.wait() => return,
                r = index_rx.changed() => if r.is_err() { return },
                _ = async {
                    match due {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use berth_structs::{
        AllocClientStatus, CsiPluginType, Job, Node, Task, TaskCsiPluginConfig, TaskGroup,
    };

    use super::*;

    fn alloc(id: &str, job_type: JobType, node: &str, status: AllocClientStatus) -> Allocation {
        Allocation {
            id: id.into(),
            job_id: id.into(),
            job: Job {
                id: id.into(),
                job_type,
                task_groups: vec![TaskGroup {
                    name: "g".into(),
                    count: 1,
                    tasks: vec![Task {
                        name: "t".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }
            .into(),
            task_group: "g".into(),
            node_id: node.into(),
            client_status: status,
            ..Default::default()
        }
    }

    /// Gives `a`'s group the CSI volume `vol`, as `data`.
    fn use_volume(a: &mut Allocation) {
        std::sync::Arc::make_mut(&mut a.job).task_groups[0]
            .volumes
            .insert(
                "data".into(),
                berth_structs::VolumeRequest {
                    name: "data".into(),
                    volume_type: "csi".into(),
                    source: "vol".into(),
                    ..Default::default()
                },
            );
    }

    fn plugin_alloc(id: &str, node: &str) -> Allocation {
        let mut a = alloc(id, JobType::System, node, AllocClientStatus::Running);
        std::sync::Arc::make_mut(&mut a.job).task_groups[0].tasks[0].csi_plugin =
            Some(TaskCsiPluginConfig {
                id: "hostpath".into(),
                plugin_type: CsiPluginType::Monolith,
                mount_dir: "/csi".into(),
                stage_publish_base_dir: None,
                health_timeout: TaskCsiPluginConfig::DEFAULT_HEALTH_TIMEOUT,
            });
        a
    }

    fn draining(id: &str, deadline: Duration, now_ms: i64) -> Node {
        let mut n = Node {
            id: id.into(),
            name: id.into(),
            ..Default::default()
        };
        n.set_drain(Some(DrainStrategy::new(deadline, now_ms)));
        n
    }

    fn tables(nodes: Vec<Node>, allocs: Vec<Allocation>) -> Tables {
        Tables {
            nodes: nodes.into_iter().map(|n| (n.id.clone(), n)).collect(),
            allocs: allocs.into_iter().map(|a| (a.id.clone(), a)).collect(),
            ..Default::default()
        }
        .with_indexes()
    }

    fn stopped_ids(pass: &DrainPass) -> Vec<&str> {
        pass.stops.iter().map(|a| a.id.as_str()).collect()
    }

    #[test]
    fn service_allocs_stop_first_and_system_ones_after_they_are_terminal() {
        let now = 1_000_000;
        let mut t = tables(
            vec![draining("n1", Duration::from_secs(60), now)],
            vec![
                alloc("web", JobType::Service, "n1", AllocClientStatus::Running),
                alloc("sys", JobType::System, "n1", AllocClientStatus::Running),
                alloc(
                    "elsewhere",
                    JobType::Service,
                    "n2",
                    AllocClientStatus::Running,
                ),
            ],
        );
        let pass = plan_drains(&t, now);
        assert_eq!(stopped_ids(&pass), vec!["web"]);
        assert_eq!(pass.stops[0].desired_description, DRAIN_STOP_DESCRIPTION);
        assert!(pass.complete.is_empty());
        assert_eq!(pass.next_deadline_ms, Some(now + 60_000));

        // Stopped but still running on the client: the system alloc waits.
        t.allocs.insert("web".into(), pass.stops[0].clone());
        assert!(plan_drains(&t, now).stops.is_empty());

        // Past the deadline the drain stops waiting for it.
        let late = plan_drains(&t, now + 60_000);
        assert_eq!(stopped_ids(&late), vec!["sys"]);
        assert_eq!(late.complete, vec!["n1".to_string()]);
        assert_eq!(late.next_deadline_ms, None);

        // Before it, the system alloc goes once the service alloc is done,
        // and the drain completes when that is done too.
        t.allocs.get_mut("web").unwrap().client_status = AllocClientStatus::Complete;
        let pass = plan_drains(&t, now);
        assert_eq!(stopped_ids(&pass), vec!["sys"]);
        assert!(pass.complete.is_empty());
        t.allocs.insert("sys".into(), pass.stops[0].clone());
        t.allocs.get_mut("sys").unwrap().client_status = AllocClientStatus::Complete;
        let pass = plan_drains(&t, now);
        assert!(pass.stops.is_empty());
        assert_eq!(pass.complete, vec!["n1".to_string()]);
    }

    #[test]
    fn a_plugin_alloc_waits_for_the_volume_users_and_their_claims_even_past_the_deadline() {
        let now = 1_000_000;
        let mut user = alloc("db", JobType::Service, "n1", AllocClientStatus::Running);
        use_volume(&mut user);
        let mut volume = berth_structs::CsiVolume {
            id: "vol".into(),
            plugin_id: "hostpath".into(),
            ..Default::default()
        };
        volume.write_claims.insert(
            "db".into(),
            berth_structs::CsiVolumeClaim {
                alloc_id: "db".into(),
                node_id: "n1".into(),
                external_node_id: String::new(),
                mode: berth_structs::ClaimMode::Write,
                access_mode: berth_structs::AccessMode::SingleNodeWriter,
                attachment_mode: berth_structs::AttachmentMode::FileSystem,
                state: berth_structs::ClaimState::Taken,
                publish_context: Default::default(),
                releasing: false,
                controller_published: false,
                kept_after_purge: false,
            },
        );
        let mut t = tables(
            vec![draining("n1", Duration::ZERO, now)],
            vec![
                user,
                plugin_alloc("plugin", "n1"),
                alloc("logger", JobType::System, "n1", AllocClientStatus::Running),
            ],
        );
        t.volumes.insert("vol".into(), volume);
        t.reindex();

        // A forced drain: everything but the plugin stops at once.
        let pass = plan_drains(&t, now);
        assert_eq!(stopped_ids(&pass), vec!["db", "logger"]);
        assert!(pass.complete.is_empty());

        // The user is done on the client but its claim is still held.
        for a in &pass.stops {
            let mut a = a.clone();
            a.client_status = AllocClientStatus::Complete;
            t.allocs.insert(a.id.clone(), a);
        }
        t.reindex();
        let pass = plan_drains(&t, now);
        assert!(pass.stops.is_empty(), "{:?}", stopped_ids(&pass));

        // The claim is released: the plugin stops.
        t.volumes.get_mut("vol").unwrap().write_claims.clear();
        t.reindex();
        let pass = plan_drains(&t, now);
        assert_eq!(stopped_ids(&pass), vec!["plugin"]);
        assert_eq!(pass.complete, vec!["n1".to_string()]);
    }

    /// One alloc of a random drain: its kind (0 service, 1 batch, 2 system,
    /// 3 plugin), client status, whether the servers stopped it, whether
    /// it uses the plugin's volume and whether it holds a claim of it.
    type AllocCase = (u8, u8, bool, bool, bool);

    fn client_status(i: u8) -> AllocClientStatus {
        [
            AllocClientStatus::Pending,
            AllocClientStatus::Running,
            AllocClientStatus::Complete,
            AllocClientStatus::Failed,
            AllocClientStatus::Lost,
        ][usize::from(i % 5)]
    }

    fn random_drain(cases: &[AllocCase], orphan_claim: bool, deadline_passed: bool) -> Tables {
        let now = 1_000_000;
        let deadline = if deadline_passed {
            Duration::ZERO
        } else {
            Duration::from_secs(60)
        };
        let mut volume = berth_structs::CsiVolume {
            id: "vol".into(),
            plugin_id: "hostpath".into(),
            ..Default::default()
        };
        let claim = |alloc_id: &str| berth_structs::CsiVolumeClaim {
            alloc_id: alloc_id.into(),
            node_id: "n1".into(),
            external_node_id: String::new(),
            mode: berth_structs::ClaimMode::Read,
            access_mode: berth_structs::AccessMode::MultiNodeReader,
            attachment_mode: berth_structs::AttachmentMode::FileSystem,
            state: berth_structs::ClaimState::Taken,
            publish_context: Default::default(),
            releasing: false,
            controller_published: false,
            kept_after_purge: false,
        };
        if orphan_claim {
            volume.read_claims.insert("gone".into(), claim("gone"));
        }
        let mut allocs = Vec::new();
        for (i, (kind, status, stopped, uses, claimed)) in cases.iter().enumerate() {
            let id = format!("a{i}");
            let mut a = match kind % 4 {
                0 => alloc(&id, JobType::Service, "n1", client_status(*status)),
                1 => alloc(&id, JobType::Batch, "n1", client_status(*status)),
                2 => alloc(&id, JobType::System, "n1", client_status(*status)),
                _ => {
                    let mut p = plugin_alloc(&id, "n1");
                    p.client_status = client_status(*status);
                    p
                }
            };
            if *stopped {
                a.desired_status = AllocDesiredStatus::Stop;
            }
            if *uses && kind % 4 != 3 {
                use_volume(&mut a);
                if *claimed {
                    volume.read_claims.insert(id.clone(), claim(&id));
                }
            }
            allocs.push(a);
        }
        let mut t = tables(vec![draining("n1", deadline, now)], allocs);
        t.volumes.insert("vol".into(), volume);
        t.with_indexes()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 512,
            failure_persistence: None,
            ..Default::default()
        })]

        /// Whatever runs on a draining node: only live allocs are stopped,
        /// every live service and batch alloc is; a system alloc only after
        /// the service and batch allocs are done (or the deadline passed);
        /// a plugin only when nothing on the node uses or claims its
        /// volume; and the drain completes only when nothing is left
        /// running (before the deadline) or left unstopped (after it).
        #[test]
        fn a_drain_pass_keeps_the_order(
            cases in proptest::collection::vec(
                (0..4u8, 0..5u8, proptest::bool::ANY, proptest::bool::ANY, proptest::bool::ANY),
                0..8,
            ),
            orphan_claim in proptest::bool::ANY,
            deadline_passed in proptest::bool::ANY,
        ) {
            let t = random_drain(&cases, orphan_claim, deadline_passed);
            let pass = plan_drains(&t, 1_000_000);
            let stopped: BTreeSet<&str> = pass.stops.iter().map(|a| a.id.as_str()).collect();
            let live = |a: &Allocation| !a.server_terminal() && !a.client_status.is_terminal();
            let migrated = t.allocs.values().filter(|a| !is_system(a)).all(|a| a.client_status.is_terminal());
            let vol = &t.volumes["vol"];
            for a in t.allocs.values() {
                let is_stopped = stopped.contains(a.id.as_str());
                if is_stopped {
                    proptest::prop_assert!(live(a), "{} stopped but not live", a.id);
                }
                if !is_system(a) && live(a) {
                    proptest::prop_assert!(is_stopped, "live {} not stopped", a.id);
                }
                if is_system(a) && is_stopped {
                    proptest::prop_assert!(migrated || deadline_passed, "{} stopped early", a.id);
                }
                if is_stopped && !plugin_ids(a).is_empty() {
                    proptest::prop_assert!(vol.claims().next().is_none(), "plugin {} stopped with a claim held", a.id);
                    let users_done = t.allocs.values().filter(|u| u.id != a.id && u.group().is_some_and(|g| !g.volumes.is_empty())).all(|u| u.client_status.is_terminal());
                    proptest::prop_assert!(users_done, "plugin {} stopped with a user running", a.id);
                }
            }
            if !pass.complete.is_empty() {
                for a in t.allocs.values() {
                    let done = a.client_status.is_terminal()
                        || (deadline_passed && (a.server_terminal() || stopped.contains(a.id.as_str())));
                    proptest::prop_assert!(done, "drain complete with {} left", a.id);
                }
            }
        }
    }
}
