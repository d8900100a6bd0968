//! What a job needs: the plan of one stored job (its stops, placements and
//! status), which allocs hold their index and which are to be replaced
//! (and when), and the job's status after the plan.

use std::collections::BTreeMap;
use std::time::Duration;

use berth_structs::{
    AllocClientStatus, Allocation, Job, JobStatus, JobType, ReconcileStrategy, TaskGroup,
};

use crate::config::ServerConfig;
use crate::state::{Change, Table, Tables};

use super::place::place;

/// How many allocs a job wants and how many of them could not be placed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PlacementCounts {
    /// The groups' counts (a system group: one per ready node).
    pub desired: u64,
    pub unplaced: u64,
}

#[derive(Debug, Default)]
pub(crate) struct PlanOutcome {
    /// One line per group and distinct reason.
    pub failures: Vec<String>,
    /// One line per alloc placed that waits for the claims of the allocs
    /// it replaces.
    pub waiting: Vec<String>,
    /// How many allocs of each group could not be placed (groups with
    /// none are left out).
    pub unplaced_by_group: BTreeMap<String, u64>,
    /// A replacement waits for a delay to pass.
    pub delayed: bool,
    /// When (unix ms) the first delay passes: the job is evaluated again
    /// then.
    pub due_ms: Option<i64>,
    pub counts: PlacementCounts,
    /// The job's deployment failed and asks for `auto_revert`: the spec
    /// of the stable version the job goes back to.
    pub revert_to: Option<Job>,
}

impl PlanOutcome {
    pub(super) fn note_unplaced(&mut self, group: &TaskGroup, unplaced: u64) {
        self.counts.unplaced = self.counts.unplaced.saturating_add(unplaced);
        if unplaced > 0 {
            self.unplaced_by_group.insert(group.name.clone(), unplaced);
        }
    }

    pub(crate) fn delay_until(&mut self, until_ms: i64) {
        self.delayed = true;
        self.due_ms = Some(self.due_ms.map_or(until_ms, |d| d.min(until_ms)));
    }
}

/// Plan one stored job: the stops and placements it needs, and its status.
pub(crate) fn plan_job(
    t: &Tables,
    job_id: &str,
    cfg: &ServerConfig,
    now_ms: i64,
    changes: &mut Vec<Change>,
) -> PlanOutcome {
    let outcome = plan_stored_job(t, job_id, cfg, now_ms, changes);
    log_plan(t, job_id, changes);
    outcome
}

/// [`plan_job`] without its log lines: for a plan that may be thrown away
/// (one made on a snapshot that a write moved before it committed).
pub(crate) fn plan_stored_job(
    t: &Tables,
    job_id: &str,
    cfg: &ServerConfig,
    now_ms: i64,
    changes: &mut Vec<Change>,
) -> PlanOutcome {
    match t.jobs.get(job_id) {
        Some(job) => place(t, job, cfg, now_ms, changes),
        None => PlanOutcome::default(),
    }
}

/// The tables a plan of `job` reads beside the job itself (of the jobs
/// table it reads no other job): the allocs (the job's, and every node's
/// usage and plugin allocs), the nodes, and the volumes only when a
/// group of the job asks for one (a plan looks at no other volume). Of
/// the deployments and the job versions it reads only the job's own,
/// which the evaluation checks apart. A plan made
/// on a snapshot is valid while none of them moved and the job did not.
pub(crate) fn tables_read(job: Option<&Job>) -> Vec<Table> {
    let mut read = vec![Table::Allocs, Table::Nodes];
    if job.is_some_and(|j| j.task_groups.iter().any(|g| !g.volumes.is_empty())) {
        read.push(Table::Volumes);
    }
    read
}

/// The log lines of a plan of job `job_id` about to be committed: each
/// alloc placed and a change of the job's status.
pub(crate) fn log_plan(t: &Tables, job_id: &str, changes: &[Change]) {
    for c in changes {
        match c {
            Change::PutAlloc(a) if !t.allocs.contains_key(&a.id) => {
                tracing::info!(job_id, alloc_id = %a.id, node_id = %a.node_id, name = %a.name, "placed alloc");
            }
            Change::PutJob(j) => {
                tracing::info!(job_id, status = ?j.status, "job status changed");
            }
            _ => {}
        }
    }
}

pub(super) enum Occupancy {
    /// The alloc's index needs a new alloc.
    Free,
    /// The alloc holds its index (live, or a batch alloc that is done).
    Held,
    /// The alloc holds its index until a delay passes, at this unix ms.
    Delayed(i64),
    /// The index needs a new alloc, and the job is evaluated again at this
    /// unix ms (an `unknown` alloc whose group replaces it becomes lost).
    FreeUntil(i64),
}

/// Whether an alloc of the current version of `job` holds its index in
/// the group. A failed alloc of a service or batch job is replaced as the
/// group's reschedule policy says: once (an alloc that was replaced holds
/// nothing), after the policy's delay, and not at all once the policy
/// allows no more attempts (it holds its index, failed). A failed alloc
/// of a system job is replaced after `reschedule_delay`.
pub(super) fn occupancy(
    a: &Allocation,
    job: &Job,
    group: &TaskGroup,
    cfg: &ServerConfig,
    now_ms: i64,
) -> Occupancy {
    let job_type = job.job_type;
    if a.client_status == AllocClientStatus::Unknown && !a.server_terminal() {
        // Its node is down and may still run it.
        let lost_at = a.disconnected.as_ref().map_or(now_ms, |d| d.lost_at_ms);
        return if group
            .on_disconnect(job_type, cfg.default_lost_after)
            .replace
        {
            Occupancy::FreeUntil(lost_at)
        } else {
            Occupancy::Delayed(lost_at)
        };
    }
    if !a.is_terminal() {
        return Occupancy::Held;
    }
    let batch = job_type == JobType::Batch;
    match a.client_status {
        AllocClientStatus::Complete if batch => Occupancy::Held,
        AllocClientStatus::Failed if job_type != JobType::System => {
            if !a.next_allocation.is_empty() || a.server_terminal() {
                return Occupancy::Free;
            }
            match job.reschedule_policy(group).next_attempt_ms(a) {
                None => Occupancy::Held,
                Some(at) if now_ms < at => Occupancy::Delayed(at),
                Some(_) => Occupancy::Free,
            }
        }
        AllocClientStatus::Lost => match disconnect_window_end_ms(a, group, cfg.heartbeat_grace) {
            Some(end) if now_ms < end => Occupancy::Delayed(end),
            _ => Occupancy::Free,
        },
        AllocClientStatus::Failed
            if now_ms
                < a.modify_time_ms.saturating_add(
                    i64::try_from(cfg.reschedule_delay.as_millis()).unwrap_or(i64::MAX),
                ) =>
        {
            Occupancy::Delayed(a.modify_time_ms.saturating_add(
                i64::try_from(cfg.reschedule_delay.as_millis()).unwrap_or(i64::MAX),
            ))
        }
        _ => Occupancy::Free,
    }
}

/// For a lost alloc whose group sets `disconnect { stop_on_client_after }`: when
/// (unix ms) the window ends: the node's last heartbeat before it was
/// marked down (when the alloc was marked lost, later, if that is not
/// known) + the window + `heartbeat_grace`, as the client counts from its
/// own last heartbeat, a later moment. Until then its client may still run
/// it (and write to its volumes), so no replacement is placed and its write
/// claims are not reaped.
pub(crate) fn disconnect_window_end_ms(
    a: &Allocation,
    group: &TaskGroup,
    grace: Duration,
) -> Option<i64> {
    if !matches!(
        a.client_status,
        AllocClientStatus::Lost | AllocClientStatus::Unknown
    ) {
        return None;
    }
    let window = group.stop_on_client_after()?;
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let from = if a.node_last_heartbeat_ms > 0 {
        a.node_last_heartbeat_ms
    } else {
        a.modify_time_ms
    };
    Some(from.saturating_add(ms(window)).saturating_add(ms(grace)))
}

/// Of the allocs of one index that run at once after a reconnect, the one
/// `strategy` keeps: `keep_original` the oldest (first created),
/// `keep_replacement` the newest, `longest_running` the one whose tasks
/// last (re)started the earliest, `best_score` the one on the node `rank`
/// puts first (smaller is better); a tie goes to the original.
pub(super) fn keeper<'a, R: Ord>(
    live: &[&'a Allocation],
    strategy: ReconcileStrategy,
    rank: impl Fn(&Allocation) -> R,
) -> &'a Allocation {
    let mut by_age: Vec<&'a Allocation> = live.to_vec();
    by_age.sort_by_key(|a| (a.create_index, a.create_time_ms));
    let original = by_age[0];
    let last_start = |a: &Allocation| a.task_states.values().filter_map(|s| s.started_at_ms).max();
    match strategy {
        ReconcileStrategy::KeepOriginal => original,
        ReconcileStrategy::KeepReplacement => by_age[by_age.len() - 1],
        ReconcileStrategy::LongestRunning => by_age
            .iter()
            .copied()
            .min_by_key(|a| last_start(a).unwrap_or(i64::MAX))
            .unwrap_or(original),
        ReconcileStrategy::BestScore => by_age
            .iter()
            .copied()
            .min_by_key(|a| rank(a))
            .unwrap_or(original),
    }
}

/// An alloc that counts as running for the job's status: not terminal on
/// the client, and not a stopped alloc the client never started.
fn still_running(a: &Allocation) -> bool {
    let never_started = a.server_terminal() && a.client_status == AllocClientStatus::Pending;
    !a.client_status.is_terminal() && !never_started
}

pub(super) fn job_status(
    job: &Job,
    allocs: &BTreeMap<String, Allocation>,
    outcome: &PlanOutcome,
) -> JobStatus {
    if let Some(status) = status_of_allocs(job, allocs.values()) {
        return status;
    }
    // Nothing runs, nothing waits to be placed or replaced: done.
    if job.job_type != JobType::System
        && !allocs.is_empty()
        && outcome.failures.is_empty()
        && !outcome.delayed
    {
        return JobStatus::Dead;
    }
    JobStatus::Pending
}

/// The job's status where its allocs alone decide it, without the plan's
/// outcome: running while any runs; dead once stopped and nothing runs;
/// failed when nothing runs and the current version's allocs failed, as
/// `job run` says, whether a reschedule is due or the policy allows no
/// more (see `given_up`). An alloc status report writes it with the
/// allocs it changes, so the job's status never lags behind them.
pub(crate) fn status_of_allocs<'a>(
    job: &Job,
    allocs: impl IntoIterator<Item = &'a Allocation>,
) -> Option<JobStatus> {
    let mut failed = false;
    for a in allocs {
        if still_running(a) {
            return Some(JobStatus::Running);
        }
        failed |= failed_unreplaced(job, a);
    }
    if job.stop {
        Some(JobStatus::Dead)
    } else if failed {
        Some(JobStatus::Failed)
    } else {
        None
    }
}

/// An alloc of `job`'s current version that failed or was lost and has
/// no replacement yet.
pub(crate) fn failed_unreplaced(job: &Job, a: &Allocation) -> bool {
    matches!(
        a.client_status,
        AllocClientStatus::Failed | AllocClientStatus::Lost
    ) && a.next_allocation.is_empty()
        && a.job.version == job.version
        && !a.server_terminal()
}

/// Whether a failed job is failed for good: none of its failed allocs
/// is to be replaced (their reschedule policies allow no more; a lost
/// alloc is replaced whenever a node fits). A system job's allocs are
/// not rescheduled: it is never given up on.
pub(crate) fn given_up<'a>(job: &Job, mut allocs: impl Iterator<Item = &'a Allocation>) -> bool {
    job.job_type != JobType::System
        && allocs.all(|a| {
            !failed_unreplaced(job, a)
                || (a.client_status == AllocClientStatus::Failed
                    && job
                        .lookup_group(&a.task_group)
                        .is_none_or(|g| job.reschedule_policy(g).next_attempt_ms(a).is_none()))
        })
}
