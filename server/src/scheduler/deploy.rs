//! Deployments in a plan: the deployment of the job's version, opened
//! when the plan places (or moves in place) an alloc of a group with an
//! `update` block; the allocs it tags and their health; its end
//! (successful, failed, cancelled); and the stable version a failed one
//! with `auto_revert` goes back to. A plan reads and writes them like the
//! allocs, so a plan made for `job plan` shows nothing of them and an
//! evaluation commits them with its allocs.

use std::collections::{BTreeMap, BTreeSet};

use berth_structs::deployment::{
    DESC_NEEDS_PROMOTION, DESC_NEWER_JOB, DESC_PROGRESS, DESC_STOPPED_JOB, DESC_SUCCESSFUL,
    DESC_UNHEALTHY,
};
use berth_structs::{
    AllocClientStatus, AllocDeployment, Allocation, Deployment, DeploymentGroup, DeploymentStatus,
    Job, JobType, JobVersion, TaskGroup, UpdateStrategy,
};

use crate::state::job_versions::{old_deployments, same_spec, versions_of};
use crate::state::{Change, Tables};

use super::reconcile::PlanOutcome;

fn ms(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The deployment of the job's version as the plan sees it.
pub(super) struct Rollout {
    /// The deployment of this version: stored, or opened by this plan
    /// (written only if it tags an alloc).
    pub deployment: Option<Deployment>,
    stored: Option<Deployment>,
}

impl Rollout {
    /// The deployment of `job`'s version; an active deployment of an
    /// older version (or of a stopped job) is cancelled in `changes`.
    pub fn open(t: &Tables, job: &Job, changes: &mut Vec<Change>) -> Rollout {
        let mut stored = None;
        for d in t.deployments_of_job(&job.id) {
            if d.job_version == job.version && !job.stop {
                stored = Some(d.clone());
            } else if d.status.is_active() {
                let mut d = d.clone();
                d.status = DeploymentStatus::Cancelled;
                d.status_description = if job.stop {
                    DESC_STOPPED_JOB
                } else {
                    DESC_NEWER_JOB
                }
                .into();
                changes.push(Change::PutDeployment(d));
            }
        }
        let deployment = match &stored {
            Some(d) => Some(d.clone()),
            None if !job.stop && job.job_type == JobType::Service => new_deployment(job),
            None => None,
        };
        Rollout { deployment, stored }
    }

    /// Whether the rollout of `group` is halted: its deployment failed
    /// (or was cancelled), so no more allocs of the older version are
    /// replaced.
    pub fn halted(&self) -> bool {
        self.stored.as_ref().is_some_and(|d| {
            matches!(
                d.status,
                DeploymentStatus::Failed | DeploymentStatus::Cancelled
            )
        })
    }

    /// The deployment's ID (it may be opened by this plan).
    pub fn id(&self) -> Option<String> {
        self.deployment.as_ref().map(|d| d.id.clone())
    }

    /// A deployment this plan opens asks for canaries in a group only
    /// when the group has `live` old allocs to replace: at most that many.
    pub fn settle_canaries(&mut self, group: &str, live: usize) {
        if self.stored.is_some() {
            return;
        }
        if let Some(g) = self
            .deployment
            .as_mut()
            .and_then(|d| d.groups.get_mut(group))
        {
            g.desired_canaries = g
                .desired_canaries
                .min(u32::try_from(live).unwrap_or(u32::MAX));
            g.promoted = g.desired_canaries == 0;
        }
    }

    /// How many canaries `group` runs before its deployment is promoted;
    /// None once promoted (or without canaries).
    pub fn canary_phase(&self, group: &str) -> Option<u32> {
        let d = self.deployment.as_ref().filter(|d| d.status.is_active())?;
        let g = d.groups.get(group)?;
        (g.desired_canaries > 0 && !g.promoted).then_some(g.desired_canaries)
    }

    /// The indexes of `group` that still need a canary: those of the
    /// first old allocs (`olds`, by index) without a live one, up to
    /// `want` canaries in all.
    pub fn canary_indexes(
        &self,
        group: &TaskGroup,
        olds: &[&Allocation],
        after: &BTreeMap<String, Allocation>,
        want: u32,
    ) -> Vec<u32> {
        let held = self.canaries_held(&group.name, after);
        let missing = (want as usize).saturating_sub(held.len());
        olds.iter()
            .filter(|a| !a.is_terminal() && a.index < group.count && !held.contains(&a.index))
            .map(|a| a.index)
            .take(missing)
            .collect()
    }

    /// The indexes of `group` a live canary of the deployment holds.
    pub fn canaries_held(
        &self,
        group: &str,
        after: &BTreeMap<String, Allocation>,
    ) -> BTreeSet<u32> {
        let Some(d) = &self.deployment else {
            return BTreeSet::new();
        };
        after
            .values()
            .filter(|a| a.task_group == group && !a.is_terminal())
            .filter(|a| {
                a.deployment
                    .as_ref()
                    .is_some_and(|x| x.id == d.id && x.canary)
            })
            .map(|a| a.index)
            .collect()
    }

    /// After the placements: tag the allocs of this version that the plan
    /// wrote, note the health of the tagged ones, and end the deployment
    /// when it is done or failed. A failed deployment with `auto_revert`
    /// sets `outcome.revert_to`.
    pub fn finish(
        mut self,
        t: &Tables,
        job: &Job,
        now_ms: i64,
        after: &BTreeMap<String, Allocation>,
        changes: &mut Vec<Change>,
        outcome: &mut PlanOutcome,
    ) {
        let Some(mut d) = self.deployment.take() else {
            return;
        };
        if !d.status.is_active() {
            // Ended: no alloc to tag or time (and no copy of the allocs
            // made for it); a failed one may still revert the job.
            if d.status == DeploymentStatus::Failed && d.job_version == job.version {
                revert_if_asked(t, job, &mut d, outcome);
            }
            if self.stored.as_ref() != Some(&d) {
                changes.push(Change::PutDeployment(d));
            }
            return;
        }
        let written: BTreeSet<&str> = changes
            .iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) => Some(a.id.as_str()),
                _ => None,
            })
            .collect();
        let mut tagged: Vec<Allocation> = Vec::new();
        let mut touched = false;
        for a in after.values() {
            if a.job.version != job.version
                || a.server_terminal()
                || !written.contains(a.id.as_str())
                || !d.groups.contains_key(&a.task_group)
            {
                continue;
            }
            touched = true;
            if a.deployment.as_ref().is_none_or(|x| x.id != d.id) {
                let mut a = a.clone();
                a.deployment = Some(AllocDeployment {
                    id: d.id.clone(),
                    ..AllocDeployment::default()
                });
                tagged.push(a);
            }
        }
        if self.stored.is_none() && !touched {
            return;
        }
        let mut after = after.clone();
        for a in tagged {
            after.insert(a.id.clone(), a);
        }
        let moved: Vec<Allocation> = after
            .values()
            .filter_map(|a| note_health(job, &d, a, now_ms, outcome))
            .collect();
        for a in moved {
            after.insert(a.id.clone(), a);
        }
        count(job, &mut d, &after, now_ms);
        end_if_done(t, job, &mut d, &after, now_ms, changes, outcome);
        // The allocs tagged or given a health: the plan's own write of one
        // takes it, else it is written.
        for a in after.values().filter(|a| {
            a.deployment.as_ref().is_some_and(|x| x.id == d.id)
                && t.allocs
                    .get(&a.id)
                    .is_none_or(|s| s.deployment != a.deployment)
        }) {
            match changes
                .iter_mut()
                .find(|c| matches!(c, Change::PutAlloc(w) if w.id == a.id))
            {
                Some(Change::PutAlloc(w)) => w.deployment = a.deployment.clone(),
                _ => changes.push(Change::PutAlloc(a.clone())),
            }
        }
        if d.status == DeploymentStatus::Failed {
            revert_if_asked(t, job, &mut d, outcome);
        }
        if d.status.is_active() {
            // Evaluated again when a deadline passes.
            outcome.delayed = true;
        }
        if self.stored.is_none() {
            changes.extend(
                old_deployments(t, &job.id)
                    .into_iter()
                    .map(Change::DeleteDeployment),
            );
        }
        if self.stored.as_ref() != Some(&d) {
            changes.push(Change::PutDeployment(d));
        }
    }
}

/// A deployment for `job`'s version, if a group of it rolls.
fn new_deployment(job: &Job) -> Option<Deployment> {
    let groups: BTreeMap<String, DeploymentGroup> = job
        .task_groups
        .iter()
        .filter_map(|g| {
            let s = job.update_strategy(g).filter(|s| s.rolls())?;
            Some((
                g.name.clone(),
                DeploymentGroup {
                    desired_total: g.count,
                    desired_canaries: s.canary,
                    promoted: s.canary == 0,
                    auto_revert: s.auto_revert,
                    auto_promote: s.auto_promote,
                    ..DeploymentGroup::default()
                },
            ))
        })
        .collect();
    if groups.is_empty() {
        return None;
    }
    Some(Deployment {
        id: berth_structs::generate_id(),
        job_id: job.id.clone(),
        job_version: job.version,
        status: DeploymentStatus::Running,
        status_description: "Deployment is running".into(),
        groups,
        ..Deployment::default()
    })
}

fn strategy<'a>(job: &'a Job, group: &str) -> Option<&'a UpdateStrategy> {
    job.update_strategy(job.lookup_group(group)?)
}

/// `a` with its health in deployment `d` once that is known (None when
/// nothing changes): unhealthy once it failed or missed its
/// `healthy_deadline`, healthy once every task ran `min_healthy_time`.
/// The next moment either can change is noted in `outcome`.
fn note_health(
    job: &Job,
    d: &Deployment,
    a: &Allocation,
    now_ms: i64,
    outcome: &mut PlanOutcome,
) -> Option<Allocation> {
    let tag = a.deployment.as_ref().filter(|x| x.id == d.id)?;
    if tag.healthy.is_some() || a.server_terminal() {
        return None;
    }
    let s = strategy(job, &a.task_group)?;
    let placed_at = if a.create_time_ms > 0 {
        a.create_time_ms
    } else {
        now_ms
    };
    let deadline = placed_at.saturating_add(ms(s.healthy_deadline));
    let failed = matches!(
        a.client_status,
        AllocClientStatus::Failed | AllocClientStatus::Lost | AllocClientStatus::Complete
    ) || a.task_states.values().any(|t| t.failed);
    let healthy = match s.healthy_at_ms(a) {
        _ if failed => Some(false),
        Some(at) if at <= now_ms => Some(true),
        _ if deadline <= now_ms => Some(false),
        Some(at) => {
            outcome.delay_until(at.min(deadline));
            None
        }
        None => {
            outcome.delay_until(deadline);
            None
        }
    }?;
    let mut a = a.clone();
    a.deployment = Some(AllocDeployment {
        healthy: Some(healthy),
        health_at_ms: now_ms,
        ..tag.clone()
    });
    Some(a)
}

/// The counts of each group of `d` from the allocs, and its progress
/// deadline moved on when an alloc turned healthy.
fn count(job: &Job, d: &mut Deployment, after: &BTreeMap<String, Allocation>, now_ms: i64) {
    let id = d.id.clone();
    for (name, g) in d.groups.iter_mut() {
        let (mut placed, mut good, mut bad) = (0u32, 0u32, 0u32);
        g.placed_canaries.clear();
        for a in after.values().filter(|a| a.task_group == *name) {
            let Some(tag) = a.deployment.as_ref().filter(|x| x.id == id) else {
                continue;
            };
            if tag.canary {
                g.placed_canaries.push(a.id.clone());
            }
            placed = placed.saturating_add(1);
            match tag.healthy {
                Some(true) => good = good.saturating_add(1),
                Some(false) => bad = bad.saturating_add(1),
                None => {}
            }
        }
        let deadline = strategy(job, name).map_or(0, |s| ms(s.progress_deadline));
        if deadline > 0 && (g.require_progress_by_ms == 0 || good > g.healthy_allocs) {
            g.require_progress_by_ms = now_ms.saturating_add(deadline);
        }
        g.placed_allocs = placed;
        g.healthy_allocs = good;
        g.unhealthy_allocs = bad;
        if let Some(grp) = job.lookup_group(name) {
            g.desired_total = grp.count;
        }
    }
}

/// Ends `d` when it is done (every group runs its count of healthy
/// allocs of the version, none of an older one, canaries promoted) or has
/// failed (an unhealthy alloc, a progress deadline passed); marks the
/// version stable on success; notes the progress deadline in `outcome`.
fn end_if_done(
    t: &Tables,
    job: &Job,
    d: &mut Deployment,
    after: &BTreeMap<String, Allocation>,
    now_ms: i64,
    changes: &mut Vec<Change>,
    outcome: &mut PlanOutcome,
) {
    if d.groups.values().any(|g| g.unhealthy_allocs > 0) {
        d.status = DeploymentStatus::Failed;
        d.status_description = DESC_UNHEALTHY.into();
        return;
    }
    let missed = d
        .groups
        .values()
        .filter(|g| g.require_progress_by_ms > 0)
        .any(|g| g.require_progress_by_ms <= now_ms && g.healthy_allocs < g.desired_total);
    if missed {
        d.status = DeploymentStatus::Failed;
        d.status_description = DESC_PROGRESS.into();
        return;
    }
    let done = d.groups.iter().all(|(name, g)| {
        g.promoted && g.healthy_allocs >= g.desired_total && no_older(job, name, after)
    });
    if done {
        d.status = DeploymentStatus::Successful;
        d.status_description = DESC_SUCCESSFUL.into();
        let key = JobVersion::key_of(&job.id, job.version);
        if let Some(v) = t.job_versions.get(&key).filter(|v| !v.stable) {
            let mut v = v.clone();
            v.stable = true;
            changes.push(Change::PutJobVersion(v));
        }
        return;
    }
    if promote_healthy_canaries(d, after) {
        // The rest of the roll goes on in the next evaluation.
        outcome.delay_until(now_ms);
    }
    if d.needs_promotion() && canaries_healthy(d, after).iter().all(|(_, ok)| *ok) {
        d.status_description = DESC_NEEDS_PROMOTION.into();
    }
    for g in d.groups.values().filter(|g| g.require_progress_by_ms > 0) {
        outcome.delay_until(g.require_progress_by_ms);
    }
}

/// Per group that waits for promotion: whether every one of its
/// canaries is placed and healthy.
pub(crate) fn canaries_healthy(
    d: &Deployment,
    after: &BTreeMap<String, Allocation>,
) -> Vec<(String, bool)> {
    d.groups
        .iter()
        .filter(|(_, g)| g.desired_canaries > 0 && !g.promoted)
        .map(|(name, g)| {
            let healthy = g
                .placed_canaries
                .iter()
                .filter(|id| {
                    after
                        .get(*id)
                        .and_then(|a| a.deployment.as_ref())
                        .and_then(|x| x.healthy)
                        == Some(true)
                })
                .count();
            (name.clone(), healthy >= g.desired_canaries as usize)
        })
        .collect()
}

/// Promotes the groups with `auto_promote` whose canaries are all
/// healthy; whether any was.
fn promote_healthy_canaries(d: &mut Deployment, after: &BTreeMap<String, Allocation>) -> bool {
    let ready: Vec<String> = canaries_healthy(d, after)
        .into_iter()
        .filter(|(name, ok)| *ok && d.groups[name].auto_promote)
        .map(|(name, _)| name)
        .collect();
    for name in &ready {
        if let Some(g) = d.groups.get_mut(name) {
            g.promoted = true;
        }
        d.status_description = "Deployment is running".into();
    }
    !ready.is_empty()
}

/// Whether no live alloc of an older version is left in `group`.
fn no_older(job: &Job, group: &str, after: &BTreeMap<String, Allocation>) -> bool {
    !after
        .values()
        .any(|a| a.task_group == group && a.job.version != job.version && !a.is_terminal())
}

/// A failed deployment of the job's version whose group asks for
/// `auto_revert`: the job goes back to its newest stable version older
/// than this one (one whose spec differs, so that a stable version that
/// fails again is not reverted to itself), once.
fn revert_if_asked(t: &Tables, job: &Job, d: &mut Deployment, outcome: &mut PlanOutcome) {
    if !d.auto_reverts() || d.reverted_to.is_some() {
        return;
    }
    let target = versions_of(t, &job.id)
        .filter(|v| v.stable && v.version < job.version)
        .filter(|v| !same_spec(&v.job, job))
        .last();
    match target {
        Some(v) => {
            d.reverted_to = Some(v.version);
            d.status_description = format!(
                "{}; rolling back to job version {}",
                d.status_description, v.version
            );
            outcome.revert_to = Some(v.job.clone());
        }
        None if !d.status_description.contains("no stable") => {
            d.status_description = format!(
                "{}; no stable job version to auto revert to",
                d.status_description
            );
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use berth_structs::{
        AllocClientStatus, JobStatus, Node, NodeResources, NodeStatus, Resources, Task, TaskGroup,
        TaskState, TaskStateKind,
    };

    use super::*;
    use crate::config::ServerConfig;
    use crate::scheduler::reconcile::plan_job;

    fn node() -> Node {
        Node {
            id: "n1".into(),
            name: "n1".into(),
            status: NodeStatus::Ready,
            resources: NodeResources {
                cpu: 8000,
                memory_mb: 8192,
                disk_mb: 0,
            },
            drivers: vec!["raw_exec".into()],
            ..Default::default()
        }
    }

    /// Version `version` of a service job of `count` allocs that rolls
    /// one at a time, healthy after 2 s; `arg` makes versions differ.
    fn web(version: u64, count: u32, arg: &str, auto_revert: bool) -> Job {
        Job {
            id: "web".into(),
            name: "web".into(),
            job_type: JobType::Service,
            version,
            status: JobStatus::Running,
            update: Some(UpdateStrategy {
                max_parallel: 1,
                min_healthy_time: Duration::from_secs(2),
                healthy_deadline: Duration::from_secs(60),
                progress_deadline: Duration::from_secs(120),
                auto_revert,
                ..UpdateStrategy::default()
            }),
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count,
                tasks: vec![Task {
                    name: "t".into(),
                    driver: "raw_exec".into(),
                    config: berth_structs::TaskConfig {
                        command: "/bin/sleep".into(),
                        args: vec![arg.into()],
                        ..berth_structs::TaskConfig::default()
                    },
                    resources: Resources {
                        cpu: 10,
                        memory_mb: 10,
                        ..berth_structs::Resources::default()
                    },
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// The store as a cluster of one node sees it: `job` (recorded as a
    /// version too) and its allocs.
    fn tables(job: &Job) -> Tables {
        let mut t = Tables {
            nodes: [("n1".to_string(), node())].into(),
            jobs: [(job.id.clone(), job.clone())].into(),
            ..Tables::default()
        };
        put_version(&mut t, job);
        t.with_indexes()
    }

    fn put_version(t: &mut Tables, job: &Job) {
        let v = JobVersion {
            job_id: job.id.clone(),
            version: job.version,
            job: job.clone(),
            ..JobVersion::default()
        };
        t.job_versions
            .insert(JobVersion::key_of(&job.id, job.version), v);
    }

    /// Plans the job at `now` and applies what the plan writes.
    fn step(t: &mut Tables, now: i64) -> PlanOutcome {
        let mut changes = Vec::new();
        let outcome = plan_job(
            t,
            "web",
            &ServerConfig::new("/nonexistent"),
            now,
            &mut changes,
        );
        for c in changes {
            match c {
                Change::PutAlloc(mut a) => {
                    if a.create_time_ms == 0 {
                        a.create_time_ms = now;
                    }
                    t.allocs.insert(a.id.clone(), a);
                }
                Change::PutDeployment(d) => {
                    t.deployments.insert(d.id.clone(), d);
                }
                Change::PutJobVersion(v) => {
                    t.job_versions
                        .insert(JobVersion::key_of(&v.job_id, v.version), v);
                }
                Change::PutJob(j) => {
                    t.jobs.insert(j.id.clone(), j);
                }
                Change::DeleteDeployment(id) => {
                    t.deployments.remove(&id);
                }
                other => panic!("unexpected change {other:?}"),
            }
        }
        t.reindex();
        outcome
    }

    /// Every alloc the servers want running runs, its task since `since`;
    /// those of `failing_version` fail instead.
    fn clients_run(t: &mut Tables, since: i64, failing_version: Option<u64>) {
        for a in t.allocs.values_mut() {
            if a.server_terminal() {
                a.client_status = AllocClientStatus::Complete;
                continue;
            }
            if a.client_status != AllocClientStatus::Pending {
                continue;
            }
            let fails = failing_version == Some(a.job.version);
            a.client_status = if fails {
                AllocClientStatus::Failed
            } else {
                AllocClientStatus::Running
            };
            a.task_states.insert(
                "t".into(),
                TaskState {
                    state: if fails {
                        TaskStateKind::Dead
                    } else {
                        TaskStateKind::Running
                    },
                    failed: fails,
                    started_at_ms: Some(since),
                    ..TaskState::default()
                },
            );
        }
        t.reindex();
    }

    fn only_deployment(t: &Tables, version: u64) -> Deployment {
        let ds: Vec<&Deployment> = t
            .deployments
            .values()
            .filter(|d| d.job_version == version)
            .collect();
        assert_eq!(ds.len(), 1, "{ds:?}");
        ds[0].clone()
    }

    /// Runs version 0 of `web` to a successful deployment; returns the
    /// tables and the time then.
    fn deployed_v0(count: u32, auto_revert: bool) -> (Tables, i64) {
        let mut t = tables(&web(0, count, "1", auto_revert));
        step(&mut t, 1_000);
        let d = only_deployment(&t, 0);
        assert_eq!(d.status, DeploymentStatus::Running);
        assert_eq!(d.groups["g"].placed_allocs, count);
        assert!(t
            .allocs
            .values()
            .all(|a| a.deployment.as_ref().is_some_and(|x| x.id == d.id)));
        clients_run(&mut t, 1_500, None);
        let outcome = step(&mut t, 2_000);
        assert_eq!(outcome.due_ms, Some(3_500), "healthy 2 s after the start");
        step(&mut t, 3_500);
        let d = only_deployment(&t, 0);
        assert_eq!(d.status, DeploymentStatus::Successful, "{d:?}");
        assert_eq!(d.groups["g"].healthy_allocs, count);
        assert!(t.job_versions[&JobVersion::key_of("web", 0)].stable);
        (t, 3_500)
    }

    #[test]
    fn a_version_whose_allocs_turn_healthy_deploys_and_is_stable() {
        deployed_v0(2, false);
    }

    #[test]
    fn an_unhealthy_alloc_fails_the_deployment_and_halts_the_roll() {
        let (mut t, now) = deployed_v0(3, false);
        let v1 = web(1, 3, "2", false);
        t.jobs.insert("web".into(), v1.clone());
        put_version(&mut t, &v1);
        step(&mut t, now);
        assert_eq!(only_deployment(&t, 1).groups["g"].placed_allocs, 1);
        clients_run(&mut t, now, Some(1));
        step(&mut t, now + 100);
        let d = only_deployment(&t, 1);
        assert_eq!(d.status, DeploymentStatus::Failed);
        assert_eq!(d.status_description, DESC_UNHEALTHY);
        // No further old alloc is replaced.
        for later in [now + 10_000, now + 100_000] {
            step(&mut t, later);
            let old_live = t
                .allocs
                .values()
                .filter(|a| a.job.version == 0 && !a.is_terminal())
                .count();
            assert_eq!(old_live, 2, "at {later}");
        }
    }

    #[test]
    fn a_failed_deployment_with_auto_revert_goes_back_to_the_stable_version() {
        let (mut t, now) = deployed_v0(2, true);
        let v1 = web(1, 2, "2", true);
        t.jobs.insert("web".into(), v1.clone());
        put_version(&mut t, &v1);
        step(&mut t, now);
        clients_run(&mut t, now, Some(1));
        let outcome = step(&mut t, now + 100);
        let d = only_deployment(&t, 1);
        assert_eq!(d.status, DeploymentStatus::Failed);
        assert_eq!(d.reverted_to, Some(0));
        let spec = outcome.revert_to.expect("a revert");
        assert_eq!(spec.task_groups[0].tasks[0].config.args, ["1"]);
        // Once: the next plan asks for no second revert.
        assert!(step(&mut t, now + 200).revert_to.is_none());
    }

    #[test]
    fn a_new_alloc_that_never_turns_healthy_fails_the_deployment() {
        let (mut t, now) = deployed_v0(1, false);
        let v1 = web(1, 1, "2", false);
        t.jobs.insert("web".into(), v1.clone());
        put_version(&mut t, &v1);
        step(&mut t, now);
        // The new alloc never starts; its healthy deadline (60 s) passes
        // first and fails it.
        let outcome = step(&mut t, now + 1_000);
        assert_eq!(outcome.due_ms, Some(now + 60_000));
        step(&mut t, now + 60_000);
        let d = only_deployment(&t, 1);
        assert_eq!(d.status, DeploymentStatus::Failed);
        assert_eq!(d.status_description, DESC_UNHEALTHY);
    }

    #[test]
    fn canaries_run_beside_the_old_allocs_until_promoted() {
        let (mut t, now) = deployed_v0(3, false);
        let mut v1 = web(1, 3, "2", false);
        if let Some(u) = v1.update.as_mut() {
            u.canary = 1;
        }
        t.jobs.insert("web".into(), v1.clone());
        put_version(&mut t, &v1);
        step(&mut t, now);
        let live = |t: &Tables, v: u64| {
            t.allocs
                .values()
                .filter(|a| a.job.version == v && !a.is_terminal())
                .count()
        };
        assert_eq!(
            (live(&t, 0), live(&t, 1)),
            (3, 1),
            "one canary beside the three"
        );
        let d = only_deployment(&t, 1);
        assert_eq!(d.groups["g"].placed_canaries.len(), 1);
        assert!(d.needs_promotion());
        // Healthy, it waits: nothing more is placed or stopped.
        clients_run(&mut t, now, None);
        step(&mut t, now + 5_000);
        step(&mut t, now + 10_000);
        assert_eq!((live(&t, 0), live(&t, 1)), (3, 1));
        let d = only_deployment(&t, 1);
        assert_eq!(d.status_description, DESC_NEEDS_PROMOTION);
        assert!(canaries_healthy(&d, &t.allocs).iter().all(|(_, ok)| *ok));
        // Promoted: the old alloc of the canary's index goes with no
        // budget spent, then the others one at a time.
        let mut d = d;
        d.groups.get_mut("g").expect("g").promoted = true;
        t.deployments.insert(d.id.clone(), d);
        step(&mut t, now + 10_000);
        assert_eq!((live(&t, 0), live(&t, 1)), (1, 2));
        let mut at = now + 10_000;
        while only_deployment(&t, 1).status == DeploymentStatus::Running {
            clients_run(&mut t, at, None);
            at += 2_000;
            step(&mut t, at);
            assert!(at < now + 60_000, "{:?}", only_deployment(&t, 1));
        }
        assert_eq!(only_deployment(&t, 1).status, DeploymentStatus::Successful);
        assert_eq!((live(&t, 0), live(&t, 1)), (0, 3));
    }

    #[test]
    fn auto_promote_promotes_healthy_canaries() {
        let (mut t, now) = deployed_v0(2, false);
        let mut v1 = web(1, 2, "2", false);
        if let Some(u) = v1.update.as_mut() {
            u.canary = 1;
            u.auto_promote = true;
        }
        t.jobs.insert("web".into(), v1.clone());
        put_version(&mut t, &v1);
        step(&mut t, now);
        clients_run(&mut t, now, None);
        let outcome = step(&mut t, now + 2_000);
        assert!(!only_deployment(&t, 1).needs_promotion());
        assert_eq!(outcome.due_ms, Some(now + 2_000), "evaluated again at once");
        step(&mut t, now + 2_000);
        let old_live = t
            .allocs
            .values()
            .filter(|a| a.job.version == 0 && !a.is_terminal())
            .count();
        assert_eq!(old_live, 0, "the canary's and one more replaced");
    }

    #[test]
    fn a_newer_version_cancels_the_running_deployment() {
        let (mut t, now) = deployed_v0(2, false);
        for (v, arg) in [(1, "2"), (2, "3")] {
            let job = web(v, 2, arg, false);
            t.jobs.insert("web".into(), job.clone());
            put_version(&mut t, &job);
            step(&mut t, now);
        }
        assert_eq!(only_deployment(&t, 1).status, DeploymentStatus::Cancelled);
        assert_eq!(only_deployment(&t, 1).status_description, DESC_NEWER_JOB);
        assert_eq!(only_deployment(&t, 2).status, DeploymentStatus::Running);
        // The ended ones beyond the last six leave as new ones open.
        for v in 3..12 {
            let job = web(v, 2, &v.to_string(), false);
            t.jobs.insert("web".into(), job.clone());
            put_version(&mut t, &job);
            step(&mut t, now);
        }
        assert_eq!(t.deployments.len(), 6, "{:?}", t.deployments);
        assert_eq!(only_deployment(&t, 11).status, DeploymentStatus::Running);
    }
}
