//! The scheduler: job registration and stop, and the evaluation that
//! turns a job into allocations.
//!
//! An evaluation reads the tables and writes its plan in one store write, so
//! it never races another write. Rules:
//!
//! - `service`: keep `count` allocs per group that are not terminal. Failed,
//!   complete and lost allocs are replaced (a failed one after
//!   `reschedule_delay`, a lost one whose group sets
//!   `stop_after_client_disconnect` only after that window, so two copies of
//!   a single-writer workload never run at once).
//! - `batch`: like service, but an alloc that completed or failed is done
//!   and not replaced; lost ones are. The job is dead once every alloc is.
//! - `system`: one alloc per ready node that passes feasibility (a failed one
//!   is replaced after `reschedule_delay` too).
//! - A changed job (anything but server-managed fields differs) gets a new
//!   version; allocs of older versions are stopped and new ones placed
//!   (a destructive update; no rolling or in-place updates).
//!
//! Feasibility on a node: status ready, the job's datacenter, every task's
//! driver, cpu and memory left after the allocs that are not terminal there,
//! and for each CSI volume of the group: the volume exists and has the
//! requested capability, a healthy node plugin for it runs on the node, and
//! `CsiVolume::claim_conflict` finds no conflict. Claims counted are the
//! volume's real claims (freed only after unpublish, whatever the alloc's
//! state) plus an expected claim for every alloc that is not terminal and
//! asks for the volume but has not claimed it yet.
//!
//! A job with placements that could not be made is blocked; blocked jobs are
//! evaluated again whenever nodes, plugins, volumes or allocs change, and
//! every `scheduler_retry_interval`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use berth_structs::{
    AllocClientStatus, AllocDesiredStatus, Allocation, ClaimMode, ClaimState, CsiVolume,
    CsiVolumeClaim, Job, JobStatus, JobType, Node, NodeStatus, TaskGroup,
};

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::server::Server;
use crate::state::{Change, Tables};

/// The answer to a job registration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct JobRegisterResponse {
    /// The state index after the registration and its evaluation.
    pub index: u64,
    /// The job's modify index.
    pub job_modify_index: u64,
    /// The job's version (bumped on each change).
    pub version: u64,
    /// False when the job was already registered unchanged.
    pub changed: bool,
    /// Placements that could not be made (the job waits for them).
    pub placement_failures: Vec<String>,
}

/// Whether two submissions of a job are the same, ignoring fields the
/// servers manage.
fn same_spec(a: &Job, b: &Job) -> bool {
    let norm = |j: &Job| Job {
        stop: false,
        status: JobStatus::Pending,
        version: 0,
        create_index: 0,
        modify_index: 0,
        modify_time_ms: 0,
        ..j.clone()
    };
    norm(a) == norm(b)
}

impl Server {
    /// Register (or update) a job and evaluate it.
    pub async fn register_job(&self, mut job: Job) -> Result<JobRegisterResponse, ServerError> {
        job.validate()?;
        let ((changed, version), _) = self.store.write(|t, changes| {
            match t.jobs.get(&job.id) {
                Some(old) if same_spec(old, &job) && !old.stop => {
                    Ok::<_, ServerError>((false, old.version))
                }
                Some(old) => {
                    // A change, or a run of a stopped job: a new version.
                    job.version = old.version + 1;
                    job.stop = false;
                    job.status = old.status;
                    changes.push(Change::PutJob(job.clone()));
                    Ok((true, job.version))
                }
                None => {
                    job.version = 0;
                    job.stop = false;
                    job.status = JobStatus::Pending;
                    changes.push(Change::PutJob(job.clone()));
                    Ok((true, 0))
                }
            }
        })?;
        if changed {
            tracing::info!(job_id = %job.id, version, "job registered");
        }
        self.evaluate_job(&job.id).await;
        let job_modify_index = self
            .job(&job.id)
            .map(|j| j.modify_index)
            .unwrap_or_default();
        Ok(JobRegisterResponse {
            index: self.store.index(),
            job_modify_index,
            version,
            changed,
            placement_failures: self.job_placement_failures(&job.id),
        })
    }

    /// Stop a job: every alloc of it is asked to stop. Returns the index.
    pub async fn stop_job(&self, id: &str) -> Result<u64, ServerError> {
        self.store.write(|t, changes| {
            let job = t
                .jobs
                .get(id)
                .ok_or_else(|| ServerError::not_found(format!("job {id:?} not found")))?;
            if !job.stop {
                let mut job = job.clone();
                job.stop = true;
                changes.push(Change::PutJob(job));
            }
            Ok::<_, ServerError>(())
        })?;
        tracing::info!(job_id = id, "job stopped");
        self.evaluate_job(id).await;
        Ok(self.store.index())
    }

    /// Evaluate one job; failures are logged and the job stays blocked.
    pub(crate) async fn evaluate_job(&self, job_id: &str) {
        let now = berth_structs::now_ms();
        let result = self.store.write(|t, changes| {
            Ok::<_, ServerError>(plan_job(t, job_id, &self.config, now, changes))
        });
        let mut blocked = self.blocked.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok((outcome, _)) => {
                if outcome.failures.is_empty() && !outcome.delayed {
                    blocked.remove(job_id);
                } else {
                    if !outcome.failures.is_empty() {
                        tracing::info!(job_id, failures = ?outcome.failures, "placements blocked");
                    }
                    blocked.insert(job_id.to_string(), outcome.failures);
                }
            }
            Err(e) => {
                tracing::error!(job_id, error = %e, "evaluation failed");
                blocked.insert(job_id.to_string(), vec![format!("evaluation failed: {e}")]);
            }
        }
    }

    /// Evaluate the blocked jobs and every system job: nodes, plugins,
    /// volumes or allocs changed.
    pub(crate) async fn evaluate_after_cluster_change(&self) {
        let mut ids: BTreeSet<String> = self
            .blocked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        ids.extend(self.store.read(|t| {
            t.jobs
                .values()
                .filter(|j| j.job_type == JobType::System && !j.stop)
                .map(|j| j.id.clone())
                .collect::<Vec<_>>()
        }));
        for id in ids {
            self.evaluate_job(&id).await;
        }
    }

    /// Evaluate only the blocked jobs: capacity or a claim was freed.
    pub(crate) async fn evaluate_blocked(&self) {
        let ids: Vec<String> = self
            .blocked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        for id in ids {
            self.evaluate_job(&id).await;
        }
    }

    /// Evaluate every job (at start).
    pub(crate) async fn evaluate_all(&self) {
        let ids: Vec<String> = self.store.read(|t| t.jobs.keys().cloned().collect());
        for id in ids {
            self.evaluate_job(&id).await;
        }
    }

    pub(crate) async fn scheduler_retry_loop(self: Arc<Self>) {
        let mut shutdown = self.shutdown_rx();
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = tokio::time::sleep(self.config.scheduler_retry_interval) => {}
            }
            self.evaluate_blocked().await;
        }
    }
}

pub(crate) struct PlanOutcome {
    pub failures: Vec<String>,
    /// A replacement waits for a delay to pass.
    pub delayed: bool,
}

/// The resources a group needs.
fn group_resources(g: &TaskGroup) -> (u64, u64) {
    g.tasks.iter().fold((0, 0), |(c, m), t| {
        (c + t.resources.cpu, m + t.resources.memory_mb)
    })
}

/// What an evaluation sees of the cluster, updated as it plans.
struct PlanContext<'a> {
    tables: &'a Tables,
    /// cpu, memory in use per node.
    used: HashMap<String, (u64, u64)>,
    /// Volumes with expected claims added.
    volumes: BTreeMap<String, CsiVolume>,
}

fn expected_claim(a: &Allocation, req: &berth_structs::VolumeRequest) -> Option<CsiVolumeClaim> {
    let access = req.access_mode?;
    let attach = req.attachment_mode?;
    Some(CsiVolumeClaim {
        alloc_id: a.id.clone(),
        node_id: a.node_id.clone(),
        external_node_id: String::new(),
        mode: if req.read_only {
            ClaimMode::Read
        } else {
            ClaimMode::Write
        },
        access_mode: access,
        attachment_mode: attach,
        state: ClaimState::Taken,
        publish_context: BTreeMap::new(),
        releasing: false,
        controller_published: false,
    })
}

impl<'a> PlanContext<'a> {
    fn new(tables: &'a Tables) -> PlanContext<'a> {
        let mut ctx = PlanContext {
            tables,
            used: HashMap::new(),
            volumes: tables.volumes.clone(),
        };
        for a in tables.allocs.values().filter(|a| !a.is_terminal()) {
            ctx.add(a);
        }
        ctx
    }

    fn add(&mut self, a: &Allocation) {
        let Some(g) = a.group() else { return };
        let (c, m) = group_resources(g);
        let u = self.used.entry(a.node_id.clone()).or_default();
        u.0 += c;
        u.1 += m;
        for req in g.volumes.values() {
            let vid = req.source_for(a.index);
            let Some(v) = self.volumes.get_mut(&vid) else {
                continue;
            };
            if v.claim_for(&a.id).is_some() {
                continue;
            }
            if let Some(claim) = expected_claim(a, req) {
                match claim.mode {
                    ClaimMode::Read => v.read_claims.insert(a.id.clone(), claim),
                    ClaimMode::Write => v.write_claims.insert(a.id.clone(), claim),
                };
            }
        }
    }

    fn remove(&mut self, a: &Allocation) {
        let Some(g) = a.group() else { return };
        let (c, m) = group_resources(g);
        if let Some(u) = self.used.get_mut(&a.node_id) {
            u.0 = u.0.saturating_sub(c);
            u.1 = u.1.saturating_sub(m);
        }
        // Expected claims go; real claims stay until they are freed.
        for req in g.volumes.values() {
            let vid = req.source_for(a.index);
            let (Some(v), Some(real)) = (self.volumes.get_mut(&vid), self.tables.volumes.get(&vid))
            else {
                continue;
            };
            if real.claim_for(&a.id).is_none() {
                v.read_claims.remove(&a.id);
                v.write_claims.remove(&a.id);
            }
        }
    }

    /// Why `group` of `job` (alloc `index`) cannot run on `node`, if it
    /// cannot.
    fn infeasible(
        &self,
        job: &Job,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
        node: &Node,
    ) -> Option<String> {
        if node.status != NodeStatus::Ready {
            return Some(format!("node is {}", node.status.as_str()));
        }
        if !job.datacenters.is_empty()
            && !job
                .datacenters
                .iter()
                .any(|d| d == "*" || d == &node.datacenter)
        {
            return Some(format!(
                "datacenter {:?} not in the job's datacenters",
                node.datacenter
            ));
        }
        for t in &group.tasks {
            if !node.drivers.contains(&t.driver) {
                return Some(format!("missing driver {:?} (task {:?})", t.driver, t.name));
            }
        }
        let (c, m) = group_resources(group);
        let (uc, um) = self.used.get(&node.id).copied().unwrap_or_default();
        if uc + c > node.resources.cpu {
            return Some(format!(
                "cpu exhausted ({uc} + {c} MHz > {} MHz)",
                node.resources.cpu
            ));
        }
        if um + m > node.resources.memory_mb {
            return Some(format!(
                "memory exhausted ({um} + {m} MiB > {} MiB)",
                node.resources.memory_mb
            ));
        }
        for (name, req) in &group.volumes {
            let vid = req.source_for(index);
            let Some(v) = self.volumes.get(&vid) else {
                return Some(format!(
                    "volume {vid:?} (group volume {name:?}) does not exist"
                ));
            };
            if !node.has_healthy_node_plugin(&v.plugin_id) {
                return Some(format!(
                    "no healthy node plugin {:?} for volume {vid:?}",
                    v.plugin_id
                ));
            }
            let (Some(access), Some(attach)) = (req.access_mode, req.attachment_mode) else {
                return Some(format!(
                    "volume {name:?} lacks access_mode or attachment_mode"
                ));
            };
            if !v.has_capability(access, attach) {
                return Some(format!(
                    "volume {vid:?} does not have capability {access}/{attach}"
                ));
            }
            let mode = if req.read_only {
                ClaimMode::Read
            } else {
                ClaimMode::Write
            };
            if let Some(conflict) = v.claim_conflict(alloc_id, &node.id, access, mode) {
                return Some(conflict);
            }
        }
        None
    }
}

fn new_alloc(job: &Job, group: &TaskGroup, index: u32, node_id: &str) -> Allocation {
    Allocation {
        id: berth_structs::generate_id(),
        name: format!("{}.{}[{}]", job.id, group.name, index),
        job_id: job.id.clone(),
        job: job.clone(),
        task_group: group.name.clone(),
        index,
        node_id: node_id.to_string(),
        desired_status: AllocDesiredStatus::Run,
        ..Default::default()
    }
}

fn stop(a: &Allocation, why: &str) -> Allocation {
    let mut a = a.clone();
    a.desired_status = AllocDesiredStatus::Stop;
    a.desired_description = why.to_string();
    a
}

/// Plan one job: the stops and placements it needs, and its status.
pub(crate) fn plan_job(
    t: &Tables,
    job_id: &str,
    cfg: &ServerConfig,
    now_ms: i64,
    changes: &mut Vec<Change>,
) -> PlanOutcome {
    let mut outcome = PlanOutcome {
        failures: Vec::new(),
        delayed: false,
    };
    let Some(job) = t.jobs.get(job_id) else {
        return outcome;
    };
    let mut ctx = PlanContext::new(t);
    let allocs: Vec<&Allocation> = t.allocs_of_job(job_id).collect();
    // The allocs of the job as they will be after this plan.
    let mut after: BTreeMap<String, Allocation> = allocs
        .iter()
        .map(|a| (a.id.clone(), (*a).clone()))
        .collect();
    let mut put = |a: Allocation, after: &mut BTreeMap<String, Allocation>| {
        after.insert(a.id.clone(), a.clone());
        changes.push(Change::PutAlloc(a));
    };

    if job.stop {
        for a in &allocs {
            if !a.server_terminal() {
                put(stop(a, "job stopped"), &mut after);
            }
        }
    } else {
        for a in &allocs {
            if a.server_terminal() {
                continue;
            }
            let outdated = a.job.version != job.version;
            let gone = job.lookup_group(&a.task_group).is_none();
            if outdated || gone {
                let why = if gone {
                    "group removed from the job"
                } else {
                    "job updated"
                };
                ctx.remove(a);
                put(stop(a, why), &mut after);
            }
        }
        let nodes: Vec<&Node> = t
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Ready)
            .collect();
        for group in &job.task_groups {
            let current: Vec<Allocation> = after
                .values()
                .filter(|a| a.task_group == group.name && a.job.version == job.version)
                .cloned()
                .collect();
            match job.job_type {
                JobType::System => {
                    if group.count == 0 {
                        for a in current.iter().filter(|a| !a.is_terminal()) {
                            ctx.remove(a);
                            put(stop(a, "count is 0"), &mut after);
                        }
                        continue;
                    }
                    let mut reasons = Vec::new();
                    for node in &nodes {
                        let mut held = false;
                        for a in current.iter().filter(|a| a.node_id == node.id) {
                            match occupancy(a, false, group, cfg, now_ms) {
                                Occupancy::Free => {}
                                Occupancy::Held => held = true,
                                Occupancy::Delayed => {
                                    outcome.delayed = true;
                                    held = true;
                                }
                            }
                        }
                        if held {
                            continue;
                        }
                        let alloc = new_alloc(job, group, 0, &node.id);
                        match ctx.infeasible(job, group, 0, &alloc.id, node) {
                            Some(why) => reasons.push(format!("node {}: {why}", node.name_or_id())),
                            None => {
                                ctx.add(&alloc);
                                tracing::info!(job_id, alloc_id = %alloc.id, node_id = %node.id, "placed system alloc");
                                put(alloc, &mut after);
                            }
                        }
                    }
                    if !reasons.is_empty() {
                        outcome.failures.push(format!(
                            "group {:?} cannot run on: {}",
                            group.name,
                            reasons.join("; ")
                        ));
                    }
                }
                JobType::Service | JobType::Batch => {
                    let batch = job.job_type == JobType::Batch;
                    let mut occupied = BTreeSet::new();
                    for a in &current {
                        let occupies = match occupancy(a, batch, group, cfg, now_ms) {
                            Occupancy::Free => false,
                            Occupancy::Held => true,
                            Occupancy::Delayed => {
                                outcome.delayed = true;
                                true
                            }
                        };
                        if occupies {
                            occupied.insert(a.index);
                        }
                    }
                    // Count lowered: stop the live allocs above it.
                    for a in current
                        .iter()
                        .filter(|a| !a.is_terminal() && a.index >= group.count)
                    {
                        ctx.remove(a);
                        put(stop(a, "count reduced"), &mut after);
                    }
                    for index in 0..group.count {
                        if occupied.contains(&index) {
                            continue;
                        }
                        let mut alloc = new_alloc(job, group, index, "");
                        let mut reasons = Vec::new();
                        let mut best: Option<(&Node, (usize, u64))> = None;
                        for node in &nodes {
                            match ctx.infeasible(job, group, index, &alloc.id, node) {
                                Some(why) => {
                                    reasons.push(format!("node {}: {why}", node.name_or_id()))
                                }
                                None => {
                                    // Spread the job's allocs, then prefer free memory.
                                    let same_job = after
                                        .values()
                                        .filter(|a| a.node_id == node.id && !a.is_terminal())
                                        .count();
                                    let free = node
                                        .resources
                                        .memory_mb
                                        .saturating_sub(ctx.used.get(&node.id).map_or(0, |u| u.1));
                                    let score = (same_job, u64::MAX - free);
                                    if best.as_ref().is_none_or(|(_, s)| score < *s) {
                                        best = Some((node, score));
                                    }
                                }
                            }
                        }
                        match best {
                            Some((node, _)) => {
                                alloc.node_id = node.id.clone();
                                ctx.add(&alloc);
                                tracing::info!(job_id, alloc_id = %alloc.id, node_id = %node.id, name = %alloc.name, "placed alloc");
                                put(alloc, &mut after);
                            }
                            None => {
                                if nodes.is_empty() {
                                    reasons.push("no ready nodes".into());
                                }
                                outcome.failures.push(format!(
                                    "{}[{index}]: {}",
                                    group.name,
                                    reasons.join("; ")
                                ));
                            }
                        }
                    }
                }
            }
        }
    }

    let status = job_status(job, &after, &outcome);
    if status != job.status {
        let mut j = job.clone();
        j.status = status;
        tracing::info!(job_id, status = ?status, "job status changed");
        changes.push(Change::PutJob(j));
    }
    outcome
}

enum Occupancy {
    /// The alloc's index needs a new alloc.
    Free,
    /// The alloc holds its index (live, or a batch alloc that is done).
    Held,
    /// The alloc holds its index until a delay passes.
    Delayed,
}

/// Whether an alloc of the current version holds its index in the group.
fn occupancy(
    a: &Allocation,
    batch: bool,
    group: &TaskGroup,
    cfg: &ServerConfig,
    now_ms: i64,
) -> Occupancy {
    if !a.is_terminal() {
        return Occupancy::Held;
    }
    match a.client_status {
        AllocClientStatus::Complete | AllocClientStatus::Failed if batch => Occupancy::Held,
        AllocClientStatus::Lost => match disconnect_window_end_ms(a, group) {
            Some(end) if now_ms < end => Occupancy::Delayed,
            _ => Occupancy::Free,
        },
        AllocClientStatus::Failed
            if now_ms < a.modify_time_ms + cfg.reschedule_delay.as_millis() as i64 =>
        {
            Occupancy::Delayed
        }
        _ => Occupancy::Free,
    }
}

/// For a lost alloc whose group sets `stop_after_client_disconnect`: when
/// (unix ms) the window ends, counted from when the alloc was marked lost.
/// Until then its client may still run it (and write to its volumes), so
/// no replacement is placed and its volume claims are not reaped.
pub(crate) fn disconnect_window_end_ms(a: &Allocation, group: &TaskGroup) -> Option<i64> {
    if a.client_status != AllocClientStatus::Lost {
        return None;
    }
    let window = group.stop_after_client_disconnect?;
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    Some(a.modify_time_ms.saturating_add(window_ms))
}

/// An alloc that counts as running for the job's status: not terminal on
/// the client, and not a stopped alloc the client never started.
fn still_running(a: &Allocation) -> bool {
    let never_started = a.server_terminal() && a.client_status == AllocClientStatus::Pending;
    !a.client_status.is_terminal() && !never_started
}

fn job_status(
    job: &Job,
    allocs: &BTreeMap<String, Allocation>,
    outcome: &PlanOutcome,
) -> JobStatus {
    if allocs.values().any(still_running) {
        return JobStatus::Running;
    }
    if job.stop {
        return JobStatus::Dead;
    }
    if job.job_type == JobType::Batch
        && !allocs.is_empty()
        && outcome.failures.is_empty()
        && !outcome.delayed
    {
        return JobStatus::Dead;
    }
    JobStatus::Pending
}

trait NodeName {
    fn name_or_id(&self) -> &str;
}

impl NodeName for Node {
    fn name_or_id(&self) -> &str {
        if self.name.is_empty() {
            &self.id
        } else {
            &self.name
        }
    }
}
