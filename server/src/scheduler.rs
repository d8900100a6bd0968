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
//! - `system`: one alloc per ready, eligible node that passes feasibility
//!   (a failed one is replaced after `reschedule_delay` too).
//! - Allocs the servers stopped (desired stop: job stopped, updated, or a
//!   node drain) count as gone: their index is placed again.
//! - An ineligible node (an operator's choice, or a drain) gets no new
//!   allocs; what runs there is left alone by the scheduler (the drainer
//!   moves it).
//! - A changed job (anything but server-managed fields differs) gets a new
//!   version; allocs of older versions are stopped and new ones placed
//!   (a destructive update; no rolling or in-place updates).
//!
//! Feasibility on a node: status ready, eligible, the job's datacenter,
//! every task's driver, cpu and memory left after the allocs that are not
//! terminal there, and for each CSI volume of the group: the volume exists
//! and has the requested capability, a healthy node plugin for it runs on
//! the node, and `CsiVolume::claim_conflict` finds no conflict. Claims
//! counted are the volume's real claims (freed only after unpublish,
//! whatever the alloc's state) plus an expected claim for every alloc that
//! is not terminal and asks for the volume but has not claimed it yet.
//! Last, once every other check passed: each volume with an accessible
//! topology is reachable from the node, i.e. the topology of the node's
//! plugin for it (NodeGetInfo) holds every segment of one of the volume's
//! topologies (a node plugin without a topology holds none).
//!
//! A job with placements that could not be made is blocked; blocked jobs are
//! evaluated again whenever nodes, plugins, volumes or allocs change, and
//! every `scheduler_retry_interval`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// Placements that could not be made (the job waits for them): one
    /// line per group and distinct reason, with how many allocs it holds
    /// back.
    pub placement_failures: Vec<String>,
    /// The allocs the job wants: the groups' counts (for a system job, one
    /// per ready node).
    pub desired_allocs: u64,
    /// How many of them could not be placed now.
    pub unplaced_allocs: u64,
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
        job_modify_index: 0,
        purge: false,
        ..j.clone()
    };
    norm(a) == norm(b)
}

/// The index a submission with `enforce_index` must name: the stored job's
/// `job_modify_index` (its `modify_index` for a job stored before that
/// existed), 0 when there is no such job.
pub(crate) fn spec_index(job: Option<&Job>) -> u64 {
    job.map_or(0, |j| {
        if j.job_modify_index > 0 {
            j.job_modify_index
        } else {
            j.modify_index
        }
    })
}

/// A submission with `enforce_index`: refused unless the stored job's
/// index is `want` (0: the job must not exist yet).
fn check_enforced_index(id: &str, stored: Option<&Job>, want: u64) -> Result<(), ServerError> {
    let have = spec_index(stored);
    if have == want {
        return Ok(());
    }
    Err(ServerError::Conflict(if want == 0 {
        format!(
            "job {id:?} already exists (job modify index {have}); enforce_index with index 0 \
             registers only a new job"
        )
    } else if have == 0 {
        format!("job {id:?} does not exist; enforce_index gave job modify index {want}")
    } else {
        format!(
            "job {id:?} has job modify index {have}, not the {want} given with enforce_index: \
             it changed since"
        )
    }))
}

/// What registering `job` makes of it beside the stored `old`: the job to
/// store and whether it is a change (a new job, a changed spec, or a run
/// of a stopped job: a new version). `index` is the index the write will
/// have.
pub(crate) fn registration(old: Option<&Job>, mut job: Job, index: u64) -> (Job, bool) {
    job.purge = false;
    match old {
        Some(old) if same_spec(old, &job) && !old.stop => (old.clone(), false),
        Some(old) => {
            job.version = old.version.saturating_add(1);
            job.stop = false;
            job.status = old.status;
            job.job_modify_index = index;
            (job, true)
        }
        None => {
            job.version = 0;
            job.stop = false;
            job.status = JobStatus::Pending;
            job.job_modify_index = index;
            (job, true)
        }
    }
}

impl Server {
    /// Register (or update) a job and evaluate it.
    pub async fn register_job(&self, job: Job) -> Result<JobRegisterResponse, ServerError> {
        self.register_job_checked(job, None).await
    }

    /// Register a job; with `enforce_index`, only while the stored job's
    /// job modify index is that (0: only while no such job exists), so
    /// that a submission planned against one version does not overwrite a
    /// later one.
    pub async fn register_job_checked(
        &self,
        job: Job,
        enforce_index: Option<u64>,
    ) -> Result<JobRegisterResponse, ServerError> {
        job.validate()?;
        let job_id = job.id.clone();
        let ((changed, version), _) = self.store.write(|t, changes| {
            let old = t.jobs.get(&job.id);
            if let Some(want) = enforce_index {
                check_enforced_index(&job.id, old, want)?;
            }
            let (next, changed) = registration(old, job, t.index.saturating_add(1));
            let version = next.version;
            if changed {
                changes.push(Change::PutJob(next));
            }
            Ok::<_, ServerError>((changed, version))
        })?;
        if changed {
            tracing::info!(job_id = %job_id, version, "job registered");
        }
        let placement = self.evaluate_job(&job_id).await;
        let job_modify_index = self.store.read(|t| spec_index(t.jobs.get(&job_id)));
        Ok(JobRegisterResponse {
            index: self.store.index(),
            job_modify_index,
            version,
            changed,
            placement_failures: self.job_placement_failures(&job_id),
            desired_allocs: placement.desired,
            unplaced_allocs: placement.unplaced,
        })
    }

    /// Stop a job: every alloc of it is asked to stop. Returns the index.
    pub async fn stop_job(&self, id: &str) -> Result<u64, ServerError> {
        self.stop_job_with(id, false).await
    }

    /// Stop a job and, with `purge`, have it leave the state as soon as
    /// every alloc of it is done and holds no volume claim (garbage
    /// collection's rules, without its thresholds). Returns the index.
    pub async fn stop_job_with(&self, id: &str, purge: bool) -> Result<u64, ServerError> {
        self.store.write(|t, changes| {
            let job = t
                .jobs
                .get(id)
                .ok_or_else(|| ServerError::not_found(format!("job {id:?} not found")))?;
            if !job.stop || (purge && !job.purge) {
                let mut job = job.clone();
                if !job.stop {
                    job.job_modify_index = t.index.saturating_add(1);
                }
                job.stop = true;
                job.purge |= purge;
                changes.push(Change::PutJob(job));
            }
            Ok::<_, ServerError>(())
        })?;
        tracing::info!(job_id = id, purge, "job stopped");
        self.evaluate_job(id).await;
        if purge {
            self.collect_purged_job(id)?;
        }
        Ok(self.store.index())
    }

    /// Evaluate one job; failures are logged and the job stays blocked.
    /// Returns how many allocs the job wants and how many could not be
    /// placed.
    ///
    /// A job's placement failures are part of its answer (`GET
    /// /v1/job/{id}`), so a change of them is a write to the jobs table
    /// (the job's modify index, not its spec index): a blocking read of the
    /// job wakes for it. They are set before the write commits, so a read
    /// woken by it sees them.
    ///
    /// Concurrent calls for one job coalesce (see [`Coalesced`]): when a
    /// call returns, an evaluation of the job that started after the call
    /// was made has completed, and its counts are returned; n calls made
    /// while an evaluation runs share the one that follows it.
    pub(crate) async fn evaluate_job(&self, job_id: &str) -> PlacementCounts {
        self.job_evaluations
            .run(job_id, || async { self.evaluate_job_now(job_id) })
            .await
    }

    /// One evaluation of job `job_id`, now (not coalesced).
    fn evaluate_job_now(&self, job_id: &str) -> PlacementCounts {
        let now = berth_structs::now_ms();
        let result = self.store.write(|t, changes| {
            let outcome = plan_job(t, job_id, &self.config, now, changes);
            let shown_before = self.set_blocked(job_id, &outcome);
            if shown_before != outcome.failures
                && !changes
                    .iter()
                    .any(|c| matches!(c, Change::PutJob(j) if j.id == job_id))
            {
                if let Some(job) = t.jobs.get(job_id) {
                    let mut job = job.clone();
                    job.job_modify_index = spec_index(Some(&job));
                    changes.push(Change::PutJob(job));
                }
            }
            Ok::<_, ServerError>(outcome)
        });
        match result {
            Ok((outcome, _)) => {
                if let Some(due) = outcome.due_ms {
                    self.retry_due.at(due);
                }
                if !outcome.failures.is_empty() {
                    tracing::info!(job_id, unplaced = outcome.counts.unplaced, failures = ?outcome.failures, "placements blocked");
                }
                outcome.counts
            }
            Err(e) => {
                tracing::error!(job_id, error = %e, "evaluation failed");
                self.blocked
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(job_id.to_string(), vec![format!("evaluation failed: {e}")]);
                PlacementCounts::default()
            }
        }
    }

    /// Records whether `outcome` leaves job `job_id` blocked, and with
    /// which failures; returns the failures shown for it before.
    fn set_blocked(&self, job_id: &str, outcome: &PlanOutcome) -> Vec<String> {
        let mut blocked = self.blocked.lock().unwrap_or_else(|p| p.into_inner());
        let before = if outcome.failures.is_empty() && !outcome.delayed {
            blocked.remove(job_id)
        } else {
            blocked.insert(job_id.to_string(), outcome.failures.clone())
        };
        before.unwrap_or_default()
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
    /// Concurrent calls coalesce like [`Server::evaluate_job`]'s: a call
    /// returns once a pass over the blocked jobs that started after it
    /// has completed.
    pub(crate) async fn evaluate_blocked(&self) {
        self.blocked_evaluations
            .run("", || self.evaluate_blocked_now())
            .await
    }

    async fn evaluate_blocked_now(&self) {
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

    /// Evaluate the blocked jobs every `scheduler_retry_interval`, and
    /// when a delayed replacement becomes due (a lost alloc's disconnect
    /// window, a reschedule delay), so that it does not wait for an
    /// unrelated event.
    pub(crate) async fn scheduler_retry_loop(self: Arc<Self>) {
        let mut shutdown = self.shutdown_rx();
        loop {
            let changed = self.retry_due.changed.notified();
            let interval = self.config.scheduler_retry_interval;
            let sleep = match self.retry_due.next() {
                Some(due) => {
                    let wait =
                        u64::try_from(due.saturating_sub(berth_structs::now_ms())).unwrap_or(0);
                    interval.min(Duration::from_millis(wait))
                }
                None => interval,
            };
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = changed => continue,
                _ = tokio::time::sleep(sleep) => {}
            }
            self.retry_due.take_due(berth_structs::now_ms());
            self.evaluate_blocked().await;
        }
    }
}

/// When the next delayed replacement becomes due (unix ms).
#[derive(Debug, Default)]
pub(crate) struct RetryDue {
    due: Mutex<Option<i64>>,
    changed: tokio::sync::Notify,
}

impl RetryDue {
    /// Evaluate the blocked jobs again at `due_ms` (or sooner).
    fn at(&self, due_ms: i64) {
        let mut due = self.due.lock().unwrap_or_else(|p| p.into_inner());
        if due.is_none_or(|d| due_ms < d) {
            *due = Some(due_ms);
            drop(due);
            self.changed.notify_one();
        }
    }

    fn next(&self) -> Option<i64> {
        *self.due.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forget a due time that has come (the evaluation it asked for is
    /// about to run; a delay still pending sets it again).
    fn take_due(&self, now_ms: i64) {
        let mut due = self.due.lock().unwrap_or_else(|p| p.into_inner());
        if due.is_some_and(|d| d <= now_ms) {
            *due = None;
        }
    }
}

/// Runs of one piece of work per key (a job's evaluation), coalesced.
///
/// Per key, a requested and a done generation. A call takes the next
/// requested generation; if no run for the key is under way it becomes the
/// runner: it notes the requested generation, runs the work once, sets done
/// to what it noted and wakes the waiters. Otherwise it waits until done
/// reaches its generation, or until no run is under way, and then runs
/// itself. So a run covers every call made before it started, a call
/// returns after a run that started after it, and n calls arriving during a
/// run cost two runs, not n. Keys run independently of each other.
///
/// A key's entry lives only while calls for it are under way. A call that
/// ends without finishing its run (its work panicked, or the call was
/// dropped) gives up the runner's role on its way out (a drop guard) and
/// wakes the waiters, one of which runs instead.
pub(crate) struct Coalesced<T> {
    keys: Mutex<HashMap<String, Arc<KeyRuns<T>>>>,
    /// Runs started, for every key.
    runs: std::sync::atomic::AtomicU64,
}

struct KeyRuns<T> {
    gens: Mutex<Generations<T>>,
    /// Woken when a run ends or a runner gives up.
    ended: tokio::sync::Notify,
}

struct Generations<T> {
    requested: u64,
    done: u64,
    running: bool,
    /// Calls under way (running or waiting): the entry goes at 0.
    calls: usize,
    /// What the run that set `done` returned (none before the first).
    last: Option<T>,
}

impl<T> Default for Coalesced<T> {
    fn default() -> Self {
        Coalesced {
            keys: Mutex::default(),
            runs: Default::default(),
        }
    }
}

impl<T: Clone> Coalesced<T> {
    /// Run `work` for `key`, or wait for a run of it that starts after
    /// this call; returns what that run returned.
    pub(crate) async fn run<F, Fut>(&self, key: &str, work: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let (runs, generation) = {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            let runs = keys
                .entry(key.to_string())
                .or_insert_with(|| {
                    Arc::new(KeyRuns {
                        gens: Mutex::new(Generations {
                            requested: 0,
                            done: 0,
                            running: false,
                            calls: 0,
                            last: None,
                        }),
                        ended: tokio::sync::Notify::new(),
                    })
                })
                .clone();
            let mut gens = runs.lock();
            gens.requested += 1;
            gens.calls += 1;
            let generation = gens.requested;
            drop(gens);
            (runs, generation)
        };
        let mut call = Call {
            coalesced: self,
            key,
            runs: &runs,
            running: false,
        };
        loop {
            // Registered before the check: a run ending after it wakes us.
            let ended = runs.ended.notified();
            let noted = {
                let mut gens = runs.lock();
                if let (true, Some(last)) = (gens.done >= generation, &gens.last) {
                    return last.clone();
                }
                if gens.running {
                    None
                } else {
                    gens.running = true;
                    call.running = true;
                    Some(gens.requested)
                }
            };
            let Some(noted) = noted else {
                ended.await;
                continue;
            };
            self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let out = work().await;
            let mut gens = runs.lock();
            gens.done = noted;
            gens.last = Some(out.clone());
            gens.running = false;
            call.running = false;
            drop(gens);
            runs.ended.notify_waiters();
            return out;
        }
    }

    /// How many runs started, for every key.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many calls for `key` are under way.
    #[cfg(test)]
    pub(crate) fn calls(&self, key: &str) -> usize {
        let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.get(key).map_or(0, |r| r.lock().calls)
    }
}

impl<T> KeyRuns<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Generations<T>> {
        self.gens.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One call of [`Coalesced::run`]: on its way out (returned, panicked or
/// dropped) it is counted off, gives up the runner's role if it still
/// holds it, and removes the key's entry when it was the last call.
struct Call<'a, T> {
    coalesced: &'a Coalesced<T>,
    key: &'a str,
    runs: &'a Arc<KeyRuns<T>>,
    running: bool,
}

impl<T> Drop for Call<'_, T> {
    fn drop(&mut self) {
        let mut keys = self
            .coalesced
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut gens = self.runs.lock();
        gens.calls -= 1;
        let gave_up = std::mem::take(&mut self.running);
        if gave_up {
            gens.running = false;
        }
        if gens.calls == 0 {
            keys.remove(self.key);
        }
        drop(gens);
        drop(keys);
        if gave_up {
            self.runs.ended.notify_waiters();
        }
    }
}

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
    /// How many allocs of each group could not be placed (groups with
    /// none are left out).
    pub unplaced_by_group: BTreeMap<String, u64>,
    /// A replacement waits for a delay to pass.
    pub delayed: bool,
    /// When (unix ms) the first delay passes: the job is evaluated again
    /// then.
    pub due_ms: Option<i64>,
    pub counts: PlacementCounts,
}

impl PlanOutcome {
    fn note_unplaced(&mut self, group: &TaskGroup, unplaced: u64) {
        self.counts.unplaced = self.counts.unplaced.saturating_add(unplaced);
        if unplaced > 0 {
            self.unplaced_by_group.insert(group.name.clone(), unplaced);
        }
    }

    fn delay_until(&mut self, until_ms: i64) {
        self.delayed = true;
        self.due_ms = Some(self.due_ms.map_or(until_ms, |d| d.min(until_ms)));
    }
}

/// Resources in use on a node or asked for by a group. Sums of the u64
/// asks of tasks and allocs are kept in u128, where they cannot wrap, and
/// compared with a node's u64 totals there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    /// MHz.
    cpu: u128,
    /// MiB.
    memory_mb: u128,
}

impl Usage {
    /// What a group asks for: the sums over its tasks.
    fn of_group(g: &TaskGroup) -> Usage {
        g.tasks.iter().fold(Usage::default(), |u, t| {
            u.plus(Usage {
                cpu: u128::from(t.resources.cpu),
                memory_mb: u128::from(t.resources.memory_mb),
            })
        })
    }

    fn plus(self, o: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_add(o.cpu),
            memory_mb: self.memory_mb.saturating_add(o.memory_mb),
        }
    }

    fn minus(self, o: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(o.cpu),
            memory_mb: self.memory_mb.saturating_sub(o.memory_mb),
        }
    }
}

/// Why `asked` more of a resource does not fit beside `used` within
/// `total`, if it does not.
fn exhausted(what: &str, unit: &str, used: u128, asked: u128, total: u64) -> Option<String> {
    if used.saturating_add(asked) <= u128::from(total) {
        return None;
    }
    if asked > u128::from(u64::MAX) {
        return Some(format!(
            "the group asks for {asked} {unit} of {what} in total, more than any node can have"
        ));
    }
    Some(format!(
        "{what} exhausted ({used} of {total} {unit} in use, {asked} {unit} asked)"
    ))
}

/// What an evaluation sees of the cluster, updated as it plans.
struct PlanContext<'a> {
    tables: &'a Tables,
    /// Resources in use on the nodes this evaluation placed on or stopped
    /// allocs of; every other node's are the state's (its index of what
    /// the allocs that are not terminal use per node).
    used: HashMap<String, Usage>,
    /// The volumes the job being planned asks for, with expected claims
    /// added (no other volume is looked at, so no other is copied).
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
    fn new(tables: &'a Tables, job: &Job) -> PlanContext<'a> {
        let mut volumes = BTreeMap::new();
        for g in &job.task_groups {
            for req in g.volumes.values() {
                let ids: Box<dyn Iterator<Item = String>> = if req.per_alloc {
                    Box::new((0..g.count).map(|i| req.source_for(i)))
                } else {
                    Box::new(std::iter::once(req.source.clone()))
                };
                for id in ids {
                    if let Some(v) = tables.volumes.get(&id) {
                        volumes.insert(id, v.clone());
                    }
                }
            }
        }
        let mut ctx = PlanContext {
            tables,
            used: HashMap::new(),
            volumes,
        };
        // Only a job that asks for volumes needs the expected claims of
        // the allocs that ask for them too.
        if !ctx.volumes.is_empty() {
            for a in tables.allocs.values().filter(|a| !a.is_terminal()) {
                ctx.expect_claims(a);
            }
        }
        ctx
    }

    /// The resources in use on `node_id`.
    fn used(&self, node_id: &str) -> Usage {
        self.used.get(node_id).copied().unwrap_or_else(|| {
            let u = self.tables.node_use(node_id);
            Usage {
                cpu: u.cpu,
                memory_mb: u.memory_mb,
            }
        })
    }

    fn used_mut(&mut self, node_id: &str) -> &mut Usage {
        let base = self.used(node_id);
        self.used.entry(node_id.to_string()).or_insert(base)
    }

    fn add(&mut self, a: &Allocation) {
        let Some(g) = a.group() else { return };
        let u = self.used_mut(&a.node_id);
        *u = u.plus(Usage::of_group(g));
        self.expect_claims(a);
    }

    /// An expected claim of `a` on each volume of the job's it asks for
    /// and has not claimed yet.
    fn expect_claims(&mut self, a: &Allocation) {
        let Some(g) = a.group() else { return };
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
        let u = self.used_mut(&a.node_id);
        *u = u.minus(Usage::of_group(g));
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
    /// cannot. Reasons name a per_alloc volume as `source[<index>]`, so
    /// that allocs held back by the same cause give the same reason.
    fn infeasible(
        &self,
        job: &Job,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
        node: &Node,
    ) -> Option<String> {
        self.node_infeasible(job, group, node)
            .or_else(|| self.volumes_infeasible(group, index, alloc_id, node))
    }

    /// The checks of [`Self::infeasible`] that do not depend on the alloc's
    /// index: the node's status, eligibility, datacenter and drivers, and
    /// the cpu and memory left on it. Within one group's placements these
    /// only ever turn from fit to no fit (placements only add usage).
    fn node_infeasible(&self, job: &Job, group: &TaskGroup, node: &Node) -> Option<String> {
        if node.status != NodeStatus::Ready {
            return Some(format!("node is {}", node.status.as_str()));
        }
        if !node.is_eligible() {
            return Some(if node.drain_strategy.is_some() {
                "node ineligible (draining)".to_string()
            } else {
                "node ineligible".to_string()
            });
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
        let asked = Usage::of_group(group);
        let used = self.used(&node.id);
        if let Some(why) = exhausted("cpu", "MHz", used.cpu, asked.cpu, node.resources.cpu) {
            return Some(why);
        }
        if let Some(why) = exhausted(
            "memory",
            "MiB",
            used.memory_mb,
            asked.memory_mb,
            node.resources.memory_mb,
        ) {
            return Some(why);
        }
        None
    }

    /// The volume checks of [`Self::infeasible`]: a per_alloc volume's
    /// depend on the alloc's index; every other one's only ever turn from
    /// fit to no fit within one group's placements (claims are only added).
    fn volumes_infeasible(
        &self,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
        node: &Node,
    ) -> Option<String> {
        for (name, req) in &group.volumes {
            let vid = req.source_for(index);
            let shown = if req.per_alloc {
                format!("{}[<index>]", req.source)
            } else {
                vid.clone()
            };
            let Some(v) = self.volumes.get(&vid) else {
                return Some(format!(
                    "volume {shown:?} (group volume {name:?}) does not exist"
                ));
            };
            if !node.has_healthy_node_plugin(&v.plugin_id)
                || !self
                    .tables
                    .plugin_instance_allowed(&node.id, &v.plugin_id, false)
            {
                return Some(format!(
                    "no healthy node plugin {:?} for volume {shown:?}",
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
                    "volume {shown:?} does not have capability {access}/{attach}"
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
        // Topology last: a node that fails only here is one that passes
        // every other check.
        for req in group.volumes.values() {
            let vid = req.source_for(index);
            let Some(v) = self.volumes.get(&vid) else {
                continue;
            };
            let here = node
                .csi_node_plugins
                .get(&v.plugin_id)
                .and_then(|p| p.accessible_topology.as_ref());
            if !v.reachable_from(here) {
                let shown = if req.per_alloc {
                    format!("{}[<index>]", req.source)
                } else {
                    vid.clone()
                };
                let node_at = match here {
                    Some(t) => format!("is in topology {t}"),
                    None => "has no topology".to_string(),
                };
                return Some(format!(
                    "volume {shown:?} is reachable only from topology {}; node plugin {:?} here {node_at}",
                    berth_structs::topologies_text(&v.accessible_topology),
                    v.plugin_id
                ));
            }
        }
        None
    }
}

/// At most this many nodes' reasons are spelled out in one failure line.
const MAX_NODES_SHOWN: usize = 8;
/// At most this many index ranges or node names are listed in one line.
const MAX_ITEMS_SHOWN: usize = 5;

/// Items (alloc indices, node names) held back, collapsed by reason in the
/// order the reasons were first seen.
struct Tally<T> {
    reasons: Vec<(String, Vec<T>)>,
    position: HashMap<String, usize>,
    total: u64,
}

impl<T> Tally<T> {
    fn new() -> Tally<T> {
        Tally {
            reasons: Vec::new(),
            position: HashMap::new(),
            total: 0,
        }
    }

    fn add(&mut self, reason: &str, item: T) {
        self.total = self.total.saturating_add(1);
        match self.position.get(reason) {
            Some(&i) => self.reasons[i].1.push(item),
            None => {
                self.position.insert(reason.to_string(), self.reasons.len());
                self.reasons.push((reason.to_string(), vec![item]));
            }
        }
    }
}

/// Ascending alloc indices as ranges: `0-2, 5, 7-9`, the first few only.
fn index_ranges(indices: &[u32]) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &i in indices {
        match ranges.last_mut() {
            Some((_, end)) if end.checked_add(1) == Some(i) => *end = i,
            _ => ranges.push((i, i)),
        }
    }
    let mut shown: Vec<String> = ranges
        .iter()
        .take(MAX_ITEMS_SHOWN)
        .map(|(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    if ranges.len() > MAX_ITEMS_SHOWN {
        shown.push("...".into());
    }
    shown.join(", ")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Why an alloc fits no node: each node's reason, the first few only.
fn per_node_reasons(reasons: &[String], ready_nodes: usize) -> String {
    if ready_nodes == 0 {
        return "no ready nodes".into();
    }
    let mut out = reasons
        .iter()
        .take(MAX_NODES_SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if reasons.len() > MAX_NODES_SHOWN {
        out.push_str(&format!(
            "; and {} more",
            plural(reasons.len() - MAX_NODES_SHOWN, "node", "nodes")
        ));
    }
    out
}

/// One line per distinct reason of a service or batch group.
fn service_failure_lines(group: &TaskGroup, tally: &Tally<u32>) -> Vec<String> {
    tally
        .reasons
        .iter()
        .map(|(reason, indices)| {
            format!(
                "group {:?}: {} of {} allocs not placed: {reason} ({}: index {})",
                group.name,
                tally.total,
                group.count,
                plural(indices.len(), "alloc", "allocs"),
                index_ranges(indices)
            )
        })
        .collect()
}

/// One line per distinct reason of a system group.
fn system_failure_lines(group: &TaskGroup, tally: &Tally<String>, ready: usize) -> Vec<String> {
    tally
        .reasons
        .iter()
        .map(|(reason, nodes)| {
            let mut names = nodes
                .iter()
                .take(MAX_ITEMS_SHOWN)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if nodes.len() > MAX_ITEMS_SHOWN {
                names.push_str(&format!(" and {} more", nodes.len() - MAX_ITEMS_SHOWN));
            }
            format!(
                "group {:?}: not placed on {} of {} ready nodes: {reason} ({}: {names})",
                group.name,
                tally.total,
                ready,
                plural(nodes.len(), "node", "nodes"),
            )
        })
        .collect()
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

/// Plan one stored job: the stops and placements it needs, and its status.
pub(crate) fn plan_job(
    t: &Tables,
    job_id: &str,
    cfg: &ServerConfig,
    now_ms: i64,
    changes: &mut Vec<Change>,
) -> PlanOutcome {
    let Some(job) = t.jobs.get(job_id) else {
        return PlanOutcome::default();
    };
    let outcome = place(t, job, cfg, now_ms, changes);
    for c in changes.iter() {
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
    outcome
}

/// The placement computation of one job against the tables: the stops and
/// placements `job` needs (as changes), and its status. `job` is the
/// stored job, or (for a plan) the job as a registration would store it;
/// nothing here writes or logs, so that a plan runs exactly what a
/// registration's evaluation runs.
pub(crate) fn place(
    t: &Tables,
    job: &Job,
    cfg: &ServerConfig,
    now_ms: i64,
    changes: &mut Vec<Change>,
) -> PlanOutcome {
    let mut outcome = PlanOutcome::default();
    let job_id = job.id.as_str();
    let mut ctx = PlanContext::new(t, job);
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
                    // A system job runs on every eligible ready node; an
                    // ineligible one is no target (its allocs there stay
                    // until a drain stops them).
                    let targets: Vec<&Node> =
                        nodes.iter().copied().filter(|n| n.is_eligible()).collect();
                    let ready = targets.len();
                    outcome.counts.desired = outcome.counts.desired.saturating_add(ready as u64);
                    let mut tally = Tally::new();
                    let mut current_on: HashMap<&str, Vec<&Allocation>> = HashMap::new();
                    for a in &current {
                        current_on.entry(a.node_id.as_str()).or_default().push(a);
                    }
                    for node in &targets {
                        let mut held = false;
                        let here = current_on
                            .get(node.id.as_str())
                            .map_or(&[][..], Vec::as_slice);
                        for a in here {
                            match occupancy(a, false, group, cfg, now_ms) {
                                Occupancy::Free => {}
                                Occupancy::Held => held = true,
                                Occupancy::Delayed(until) => {
                                    outcome.delay_until(until);
                                    held = true;
                                }
                            }
                        }
                        if held {
                            continue;
                        }
                        let alloc = new_alloc(job, group, 0, &node.id);
                        match ctx.infeasible(job, group, 0, &alloc.id, node) {
                            Some(why) => tally.add(&why, node.name_or_id().to_string()),
                            None => {
                                ctx.add(&alloc);
                                put(alloc, &mut after);
                            }
                        }
                    }
                    outcome.note_unplaced(group, tally.total);
                    outcome
                        .failures
                        .extend(system_failure_lines(group, &tally, ready));
                }
                JobType::Service | JobType::Batch => {
                    let batch = job.job_type == JobType::Batch;
                    outcome.counts.desired = outcome
                        .counts
                        .desired
                        .saturating_add(u64::from(group.count));
                    let mut occupied = BTreeSet::new();
                    for a in &current {
                        let occupies = match occupancy(a, batch, group, cfg, now_ms) {
                            Occupancy::Free => false,
                            Occupancy::Held => true,
                            Occupancy::Delayed(until) => {
                                outcome.delay_until(until);
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
                    // The job's live allocs per node, for spreading.
                    let mut job_on_node: HashMap<String, usize> = HashMap::new();
                    for a in after.values().filter(|a| !a.is_terminal()) {
                        let n = job_on_node.entry(a.node_id.clone()).or_default();
                        *n = n.saturating_add(1);
                    }
                    // Without per_alloc volumes every index of the group
                    // asks the same: once one fits no node (and nothing was
                    // placed since), the rest fit none, for the same reason.
                    let same_for_every_index = !group.volumes.values().any(|r| r.per_alloc);
                    let mut group_blocked: Option<String> = None;
                    let mut tally = Tally::new();
                    // The nodes in the order the group prefers them (the
                    // job's allocs spread, then free memory, then the
                    // nodes' order): the first that fits is the best, and
                    // one that fails a check no later placement of the
                    // group can undo leaves the set, so that a placement
                    // costs what it looks at, not every node.
                    let mut candidates: BTreeSet<(usize, Reverse<u64>, usize)> = nodes
                        .iter()
                        .enumerate()
                        .map(|(pos, node)| preference(&ctx, &job_on_node, node, pos))
                        .collect();
                    for index in 0..group.count {
                        if occupied.contains(&index) {
                            continue;
                        }
                        if let Some(reason) = &group_blocked {
                            tally.add(reason, index);
                            continue;
                        }
                        let mut alloc = new_alloc(job, group, index, "");
                        let mut best = None;
                        let mut gone = Vec::new();
                        for &key in &candidates {
                            let node = nodes[key.2];
                            if ctx.node_infeasible(job, group, node).is_some() {
                                gone.push(key);
                            } else if ctx
                                .volumes_infeasible(group, index, &alloc.id, node)
                                .is_some()
                            {
                                // A per_alloc volume's check is this
                                // index's: the node may fit the next one.
                                if same_for_every_index {
                                    gone.push(key);
                                }
                            } else {
                                best = Some(key);
                                break;
                            }
                        }
                        for key in gone {
                            candidates.remove(&key);
                        }
                        match best {
                            Some(key) => {
                                let node = nodes[key.2];
                                candidates.remove(&key);
                                alloc.node_id = node.id.clone();
                                ctx.add(&alloc);
                                let n = job_on_node.entry(node.id.clone()).or_default();
                                *n = n.saturating_add(1);
                                candidates.insert(preference(&ctx, &job_on_node, node, key.2));
                                put(alloc, &mut after);
                            }
                            None => {
                                // Nothing fits: every node's reason, as
                                // the failure shows them.
                                let reasons: Vec<String> = nodes
                                    .iter()
                                    .filter_map(|node| {
                                        let why =
                                            ctx.infeasible(job, group, index, &alloc.id, node)?;
                                        Some(format!("node {}: {why}", node.name_or_id()))
                                    })
                                    .collect();
                                let reason = per_node_reasons(&reasons, nodes.len());
                                tally.add(&reason, index);
                                if same_for_every_index {
                                    group_blocked = Some(reason);
                                }
                            }
                        }
                    }
                    outcome.note_unplaced(group, tally.total);
                    outcome
                        .failures
                        .extend(service_failure_lines(group, &tally));
                }
            }
        }
    }

    let status = job_status(job, &after, &outcome);
    if status != job.status {
        let mut j = job.clone();
        j.status = status;
        changes.push(Change::PutJob(j));
    }
    outcome
}

/// Where `node` (at `pos` in the ready nodes) stands for the next
/// placement of a group: fewer of the job's allocs first (spread), then
/// more free memory, then the nodes' order. Smaller is better.
fn preference(
    ctx: &PlanContext<'_>,
    job_on_node: &HashMap<String, usize>,
    node: &Node,
    pos: usize,
) -> (usize, Reverse<u64>, usize) {
    let same_job = job_on_node.get(&node.id).copied().unwrap_or_default();
    let used = ctx.used(&node.id).memory_mb;
    let free = u128::from(node.resources.memory_mb).saturating_sub(used);
    (
        same_job,
        Reverse(u64::try_from(free).unwrap_or(u64::MAX)),
        pos,
    )
}

enum Occupancy {
    /// The alloc's index needs a new alloc.
    Free,
    /// The alloc holds its index (live, or a batch alloc that is done).
    Held,
    /// The alloc holds its index until a delay passes, at this unix ms.
    Delayed(i64),
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

/// For a lost alloc whose group sets `stop_after_client_disconnect`: when
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
    if a.client_status != AllocClientStatus::Lost {
        return None;
    }
    let window = group.stop_after_client_disconnect?;
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let from = if a.node_last_heartbeat_ms > 0 {
        a.node_last_heartbeat_ms
    } else {
        a.modify_time_ms
    };
    Some(from.saturating_add(ms(window)).saturating_add(ms(grace)))
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

#[cfg(test)]
mod tests {
    use berth_structs::{NodeResources, Resources, Task};
    use proptest::prelude::*;

    use super::*;

    fn node(id: &str, cpu: u64, memory_mb: u64) -> Node {
        Node {
            id: id.into(),
            name: id.into(),
            status: NodeStatus::Ready,
            resources: NodeResources {
                cpu,
                memory_mb,
                disk_mb: 0,
            },
            drivers: vec!["raw_exec".into()],
            ..Default::default()
        }
    }

    fn task(name: &str, cpu: u64, memory_mb: u64) -> Task {
        Task {
            name: name.into(),
            driver: "raw_exec".into(),
            resources: Resources { cpu, memory_mb },
            ..Default::default()
        }
    }

    fn job(id: &str, count: u32, tasks: Vec<Task>) -> Job {
        Job {
            id: id.into(),
            name: id.into(),
            job_type: JobType::Service,
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count,
                tasks,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// A live alloc of `job` on `node_id`.
    fn running(job: &Job, index: u32, node_id: &str) -> Allocation {
        Allocation {
            client_status: AllocClientStatus::Running,
            ..new_alloc(job, &job.task_groups[0], index, node_id)
        }
    }

    fn tables(nodes: Vec<Node>, jobs: Vec<Job>, allocs: Vec<Allocation>) -> Tables {
        Tables {
            nodes: nodes.into_iter().map(|n| (n.id.clone(), n)).collect(),
            jobs: jobs.into_iter().map(|j| (j.id.clone(), j)).collect(),
            allocs: allocs.into_iter().map(|a| (a.id.clone(), a)).collect(),
            ..Default::default()
        }
        .with_indexes()
    }

    /// Plan `job_id` and return the outcome and the allocs it placed.
    fn plan(t: &Tables, job_id: &str) -> (PlanOutcome, Vec<Allocation>) {
        let cfg = ServerConfig::new("/nonexistent");
        let mut changes = Vec::new();
        let outcome = plan_job(t, job_id, &cfg, berth_structs::now_ms(), &mut changes);
        let placed = changes
            .into_iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) if !t.allocs.contains_key(&a.id) => Some(a),
                _ => None,
            })
            .collect();
        (outcome, placed)
    }

    #[test]
    fn asks_that_would_wrap_the_node_sums_place_nothing() {
        // The dev node runs a 100 MHz plugin alloc; an ask of u64::MAX
        // used to wrap the node's sum around to 99 MHz and fit, twice.
        let plugin = job("plugin", 1, vec![task("p", 100, 64)]);
        let plugin_alloc = running(&plugin, 0, "n1");
        for (cpu, memory_mb, what) in [(u64::MAX, 64, "cpu"), (100, u64::MAX, "memory")] {
            let big = job("big", 2, vec![task("t", cpu, memory_mb)]);
            let t = tables(
                vec![node("n1", 2000, 4096)],
                vec![plugin.clone(), big],
                vec![plugin_alloc.clone()],
            );
            let (outcome, placed) = plan(&t, "big");
            assert!(placed.is_empty(), "{what}: placed {placed:?}");
            assert_eq!(
                outcome.counts,
                PlacementCounts {
                    desired: 2,
                    unplaced: 2
                }
            );
            assert_eq!(outcome.failures.len(), 1, "{:?}", outcome.failures);
            assert!(
                outcome.failures[0].contains(&format!("{what} exhausted")),
                "{:?}",
                outcome.failures
            );
        }
    }

    #[test]
    fn a_group_whose_tasks_sum_past_u64_is_refused_with_a_clear_reason() {
        let half = u64::MAX / 2 + 1;
        let big = job("big", 1, vec![task("a", half, 1), task("b", half, 1)]);
        let t = tables(vec![node("n1", u64::MAX, u64::MAX)], vec![big], vec![]);
        let (outcome, placed) = plan(&t, "big");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 1 of 1 allocs not placed: node n1: the group asks for \
                 18446744073709551616 MHz of cpu in total, more than any node can have \
                 (1 alloc: index 0)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn identical_failures_collapse_into_one_line_with_a_count() {
        let web = job("web", 100_000, vec![task("t", 100, 10)]);
        let t = tables(vec![node("n1", 2000, 1 << 20)], vec![web], vec![]);
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 20);
        assert_eq!(
            outcome.counts,
            PlacementCounts {
                desired: 100_000,
                unplaced: 99_980
            }
        );
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 99980 of 100000 allocs not placed: node n1: cpu exhausted \
                 (2000 of 2000 MHz in use, 100 MHz asked) (99980 allocs: index 20-99999)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn per_alloc_volume_reasons_do_not_vary_with_the_index() {
        let mut j = job("db", 4, vec![task("t", 1, 1)]);
        j.task_groups[0].volumes.insert(
            "data".into(),
            berth_structs::VolumeRequest {
                name: "data".into(),
                volume_type: "csi".into(),
                source: "data".into(),
                per_alloc: true,
                access_mode: Some(berth_structs::AccessMode::SingleNodeWriter),
                attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                ..Default::default()
            },
        );
        let t = tables(vec![node("n1", 2000, 2000)], vec![j], vec![]);
        let (outcome, placed) = plan(&t, "db");
        assert!(placed.is_empty());
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 4 of 4 allocs not placed: node n1: volume \"data[<index>]\" \
                 (group volume \"data\") does not exist (4 allocs: index 0-3)"
                    .to_string()
            ]
        );
    }

    fn ineligible(mut n: Node) -> Node {
        n.scheduling_eligibility = berth_structs::SchedulingEligibility::Ineligible;
        n
    }

    fn topology(k: &str, v: &str) -> berth_structs::CsiTopology {
        berth_structs::CsiTopology::new([(k.to_string(), v.to_string())].into())
    }

    /// A node running a healthy node plugin "hp" at `at` (none: the plugin
    /// answers no topology).
    fn node_at(id: &str, at: Option<berth_structs::CsiTopology>) -> Node {
        let mut n = node(id, 4000, 4096);
        n.csi_node_plugins.insert(
            "hp".into(),
            berth_structs::CsiInfo {
                plugin_id: "hp".into(),
                healthy: true,
                accessible_topology: at,
                ..Default::default()
            },
        );
        n
    }

    /// A multi-node-multi-writer volume of plugin "hp" reachable from
    /// `accessible` (empty: everywhere).
    fn volume_in(id: &str, accessible: Vec<berth_structs::CsiTopology>) -> CsiVolume {
        CsiVolume {
            id: id.into(),
            plugin_id: "hp".into(),
            capabilities: vec![berth_structs::VolumeCapability {
                access_mode: berth_structs::AccessMode::MultiNodeMultiWriter,
                attachment_mode: berth_structs::AttachmentMode::FileSystem,
            }],
            accessible_topology: accessible,
            ..Default::default()
        }
    }

    /// Job `id` whose group of `count` uses each of `volumes`.
    fn job_using(id: &str, count: u32, volumes: &[&str]) -> Job {
        let mut j = job(id, count, vec![task("t", 1, 1)]);
        for v in volumes {
            j.task_groups[0].volumes.insert(
                v.to_string(),
                berth_structs::VolumeRequest {
                    name: v.to_string(),
                    volume_type: "csi".into(),
                    source: v.to_string(),
                    access_mode: Some(berth_structs::AccessMode::MultiNodeMultiWriter),
                    attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                    ..Default::default()
                },
            );
        }
        j
    }

    fn with_volumes(mut t: Tables, volumes: Vec<CsiVolume>) -> Tables {
        t.volumes = volumes.into_iter().map(|v| (v.id.clone(), v)).collect();
        t.with_indexes()
    }

    #[test]
    fn a_volume_with_a_topology_is_placed_only_on_nodes_in_it() {
        let nodes = vec![
            node_at("a", Some(topology("zone", "a"))),
            node_at("b", Some(topology("zone", "b"))),
            node_at("none", None),
        ];
        let t = with_volumes(
            tables(nodes.clone(), vec![job_using("web", 6, &["data"])], vec![]),
            vec![volume_in("data", vec![topology("zone", "a")])],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(placed.len(), 6);
        assert!(placed.iter().all(|a| a.node_id == "a"), "{placed:?}");

        // A node with more segments than the volume names is in it too; one
        // of several topologies is enough.
        let mut wide = node_at("wide", None);
        wide.csi_node_plugins
            .get_mut("hp")
            .unwrap()
            .accessible_topology = Some(berth_structs::CsiTopology::new(
            [
                ("zone".to_string(), "c".to_string()),
                ("rack".to_string(), "r1".to_string()),
            ]
            .into(),
        ));
        let t = with_volumes(
            tables(
                vec![wide, node_at("b", Some(topology("zone", "b")))],
                vec![job_using("web", 1, &["data"])],
                vec![],
            ),
            vec![volume_in(
                "data",
                vec![topology("zone", "a"), topology("zone", "c")],
            )],
        );
        let (_, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 1);
        assert_eq!(placed[0].node_id, "wide");

        // A volume without a topology is reachable from every node.
        let t = with_volumes(
            tables(
                vec![node_at("none", None)],
                vec![job_using("web", 1, &["data"])],
                vec![],
            ),
            vec![volume_in("data", vec![])],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(placed.len(), 1);
    }

    #[test]
    fn volumes_in_disjoint_topologies_place_nothing_and_the_failure_names_them() {
        let t = with_volumes(
            tables(
                vec![
                    node_at("a", Some(topology("zone", "a"))),
                    node_at("b", Some(topology("zone", "b"))),
                    node_at("none", None),
                ],
                vec![job_using("web", 1, &["va", "vb"])],
                vec![],
            ),
            vec![
                volume_in("va", vec![topology("zone", "a")]),
                volume_in("vb", vec![topology("zone", "b")]),
            ],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec!["group \"g\": 1 of 1 allocs not placed: \
                 node a: volume \"vb\" is reachable only from topology {zone=b}; \
                 node plugin \"hp\" here is in topology {zone=a}; \
                 node b: volume \"va\" is reachable only from topology {zone=a}; \
                 node plugin \"hp\" here is in topology {zone=b}; \
                 node none: volume \"va\" is reachable only from topology {zone=a}; \
                 node plugin \"hp\" here has no topology (1 alloc: index 0)"
                .to_string()]
        );
    }

    #[test]
    fn topology_is_checked_after_the_other_checks() {
        // Node "a" is in the volume's topology but out of memory; "b" is
        // not in it: each node says its own reason.
        let mut a = node_at("a", Some(topology("zone", "a")));
        a.resources.memory_mb = 0;
        let t = with_volumes(
            tables(
                vec![a, node_at("b", Some(topology("zone", "b")))],
                vec![job_using("web", 1, &["data"])],
                vec![],
            ),
            vec![volume_in("data", vec![topology("zone", "a")])],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty());
        assert_eq!(outcome.failures.len(), 1);
        let f = &outcome.failures[0];
        assert!(f.contains("node a: memory exhausted"), "{f}");
        assert!(
            f.contains("node b: volume \"data\" is reachable only from topology {zone=a}"),
            "{f}"
        );
    }

    #[test]
    fn an_ineligible_node_gets_no_new_allocs_and_the_failure_says_why() {
        let web = job("web", 2, vec![task("t", 100, 64)]);
        let t = tables(
            vec![ineligible(node("n1", 4000, 4096)), node("n2", 4000, 4096)],
            vec![web.clone()],
            vec![],
        );
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 2);
        assert!(placed.iter().all(|a| a.node_id == "n2"), "{placed:?}");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);

        let mut draining = node("n2", 4000, 4096);
        draining.set_drain(Some(berth_structs::DrainStrategy::new(
            std::time::Duration::from_secs(60),
            0,
        )));
        let t = tables(
            vec![ineligible(node("n1", 4000, 4096)), draining],
            vec![web],
            vec![],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 2 of 2 allocs not placed: node n1: node ineligible; \
                 node n2: node ineligible (draining) (2 allocs: index 0-1)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn a_system_job_skips_an_ineligible_node_and_leaves_its_alloc_there() {
        let mut sys = job("sys", 1, vec![task("t", 100, 64)]);
        sys.job_type = JobType::System;
        let on_n1 = running(&sys, 0, "n1");
        let t = tables(
            vec![
                ineligible(node("n1", 4000, 4096)),
                node("n2", 4000, 4096),
                ineligible(node("n3", 4000, 4096)),
            ],
            vec![sys.clone()],
            vec![on_n1.clone()],
        );
        let cfg = ServerConfig::new("/nonexistent");
        let mut changes = Vec::new();
        let outcome = plan_job(&t, "sys", &cfg, berth_structs::now_ms(), &mut changes);
        let put: Vec<&Allocation> = changes
            .iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) => Some(a),
                _ => None,
            })
            .collect();
        assert_eq!(put.len(), 1, "only a placement on n2: {put:?}");
        assert_eq!(put[0].node_id, "n2");
        assert_ne!(put[0].id, on_n1.id, "the alloc on n1 is not touched");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(
            outcome.counts,
            PlacementCounts {
                desired: 1,
                unplaced: 0
            }
        );
    }

    #[test]
    fn an_alloc_stopped_by_a_drain_is_replaced_on_another_node() {
        let web = job("web", 1, vec![task("t", 100, 64)]);
        let stopping = stop(&running(&web, 0, "n1"), "node is draining");
        let mut n1 = node("n1", 4000, 4096);
        n1.set_drain(Some(berth_structs::DrainStrategy::new(
            std::time::Duration::from_secs(60),
            0,
        )));
        let t = tables(vec![n1, node("n2", 4000, 4096)], vec![web], vec![stopping]);
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 1, "{placed:?}");
        assert_eq!(placed[0].node_id, "n2");
        assert_eq!(placed[0].index, 0);
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    }

    #[test]
    fn index_ranges_are_compact() {
        assert_eq!(index_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(index_ranges(&[1, 3, 5, 7, 9, 11, 13]), "1, 3, 5, 7, 9, ...");
        assert_eq!(
            index_ranges(&[u32::MAX - 1, u32::MAX]),
            "4294967294-4294967295"
        );
    }

    /// Resource amounts that hit the edges: zero, small, near and at u64::MAX.
    fn amount() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0),
            1..5000u64,
            (0..5000u64).prop_map(|d| u64::MAX - d),
            Just(u64::MAX / 2 + 1),
            any::<u64>(),
        ]
    }

    fn tasks() -> impl Strategy<Value = Vec<Task>> {
        prop::collection::vec((amount(), amount()), 1..4).prop_map(|rs| {
            rs.into_iter()
                .enumerate()
                .map(|(i, (c, m))| task(&format!("t{i}"), c, m))
                .collect()
        })
    }

    /// Number of cases of the property below (bounded: it runs in CI).
    const PLAN_CASES: u32 = 1024;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: PLAN_CASES,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// With any resources, nodes and allocs already placed, planning
        /// never panics, never puts more on a node than it has (sums in
        /// u128), accounts for every index, and says each distinct reason
        /// once.
        #[test]
        fn plan_never_places_more_than_fits(
            node_res in prop::collection::vec((amount(), amount()), 1..4),
            existing in prop::collection::vec((tasks(), 0..4usize), 0..4),
            group_tasks in tasks(),
            count in 1..30u32,
        ) {
            let nodes: Vec<Node> = node_res
                .iter()
                .enumerate()
                .map(|(i, (c, m))| node(&format!("n{i}"), *c, *m))
                .collect();
            let mut jobs = Vec::new();
            let mut allocs = Vec::new();
            for (i, (ts, on)) in existing.into_iter().enumerate() {
                let other = job(&format!("other{i}"), 1, ts);
                allocs.push(running(&other, 0, &nodes[on % nodes.len()].id));
                jobs.push(other);
            }
            let under_test = job("j", count, group_tasks);
            jobs.push(under_test.clone());
            let t = tables(nodes.clone(), jobs, allocs.clone());

            let (outcome, placed) = plan(&t, "j");

            let demand = Usage::of_group(&under_test.task_groups[0]);
            for n in &nodes {
                let before = allocs
                    .iter()
                    .filter(|a| a.node_id == n.id)
                    .fold(Usage::default(), |u, a| u.plus(Usage::of_group(a.group().unwrap())));
                let new = placed.iter().filter(|a| a.node_id == n.id).count() as u128;
                if new == 0 {
                    continue;
                }
                prop_assert!(before.cpu + demand.cpu * new <= u128::from(n.resources.cpu),
                    "cpu over on {}: {before:?} + {new} x {demand:?} > {:?}", n.id, n.resources);
                prop_assert!(before.memory_mb + demand.memory_mb * new <= u128::from(n.resources.memory_mb),
                    "memory over on {}: {before:?} + {new} x {demand:?} > {:?}", n.id, n.resources);
            }
            prop_assert_eq!(outcome.counts.desired, u64::from(count));
            prop_assert_eq!(outcome.counts.unplaced + placed.len() as u64, u64::from(count));
            // One group, no per_alloc volumes: one reason at most.
            prop_assert_eq!(outcome.failures.len(), usize::from(outcome.counts.unplaced > 0));
        }
    }

    /// Where the placement of every index of group 0 goes when each one
    /// looks at every ready node and takes the best fit (fewest allocs of
    /// the job, then most free memory, then the first in ID order): the
    /// rule the ordered candidates of [`place`] must give, without them.
    fn every_node_placement(t: &Tables, job: &Job) -> Vec<Option<String>> {
        let mut ctx = PlanContext::new(t, job);
        let group = &job.task_groups[0];
        let nodes: Vec<&Node> = t
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Ready)
            .collect();
        let mut job_on_node: HashMap<String, usize> = HashMap::new();
        let mut out = Vec::new();
        for index in 0..group.count {
            let mut alloc = new_alloc(job, group, index, "");
            let mut best: Option<(&Node, (usize, Reverse<u64>))> = None;
            for node in &nodes {
                if ctx.infeasible(job, group, index, &alloc.id, node).is_none() {
                    let (same, free, _) = preference(&ctx, &job_on_node, node, 0);
                    if best.as_ref().is_none_or(|(_, s)| (same, free) < *s) {
                        best = Some((node, (same, free)));
                    }
                }
            }
            match best {
                Some((node, _)) => {
                    alloc.node_id = node.id.clone();
                    ctx.add(&alloc);
                    *job_on_node.entry(node.id.clone()).or_default() += 1;
                    out.push(Some(node.id.clone()));
                }
                None => out.push(None),
            }
        }
        out
    }

    /// A node of the placement property: its capacity, whether it is
    /// ready and eligible, and whether it runs plugin "hp".
    fn varied_node() -> impl Strategy<Value = (u64, u64, bool, bool, bool)> {
        (
            prop_oneof![Just(0u64), 1..400u64, Just(4000)],
            prop_oneof![Just(0u64), 1..400u64, Just(4096)],
            prop::bool::weighted(0.85),
            prop::bool::weighted(0.85),
            any::<bool>(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// The ordered candidates place every index where a look at every
        /// node would: nodes that do not fit, fill up, or lose a volume
        /// to a claim, per_alloc volumes (some missing) or none.
        #[test]
        fn placement_by_ordered_candidates_is_placement_by_every_node(
            specs in prop::collection::vec(varied_node(), 1..12),
            existing in prop::collection::vec((1..300u64, 1..300u64, 0..12usize), 0..8),
            ask in (1..200u64, 1..200u64),
            count in 1..24u32,
            volume in prop::option::of((any::<bool>(), any::<bool>(), 0..3u8)),
            missing in prop::collection::vec(prop::bool::weighted(0.2), 24),
        ) {
            let nodes: Vec<Node> = specs
                .iter()
                .enumerate()
                .map(|(i, &(cpu, mem, ready, eligible, plugin))| {
                    let mut n = if plugin {
                        node_at(&format!("n{i:02}"), None)
                    } else {
                        node(&format!("n{i:02}"), 0, 0)
                    };
                    n.resources.cpu = cpu;
                    n.resources.memory_mb = mem;
                    if !ready {
                        n.status = NodeStatus::Down;
                    }
                    if eligible { n } else { ineligible(n) }
                })
                .collect();
            let mut jobs = Vec::new();
            let mut allocs = Vec::new();
            for (i, (cpu, mem, on)) in existing.into_iter().enumerate() {
                let other = job(&format!("other{i}"), 1, vec![task("t", cpu, mem)]);
                allocs.push(running(&other, 0, &nodes[on % nodes.len()].id));
                jobs.push(other);
            }
            let mut under_test = job("j", count, vec![task("t", ask.0, ask.1)]);
            let mut volumes = Vec::new();
            if let Some((per_alloc, read_only, access)) = volume {
                let access = [
                    berth_structs::AccessMode::SingleNodeWriter,
                    berth_structs::AccessMode::MultiNodeReader,
                    berth_structs::AccessMode::MultiNodeMultiWriter,
                ][usize::from(access)];
                let mut ids = vec!["data".to_string()];
                if per_alloc {
                    // Some indices' volumes do not exist: those fit no
                    // node, the others may.
                    ids = (0..count)
                        .filter(|&i| !missing[i as usize])
                        .map(|i| format!("data[{i}]"))
                        .collect();
                }
                for id in ids {
                    let mut v = volume_in(&id, vec![]);
                    v.capabilities[0].access_mode = access;
                    volumes.push(v);
                }
                under_test.task_groups[0].volumes.insert(
                    "data".into(),
                    berth_structs::VolumeRequest {
                        name: "data".into(),
                        volume_type: "csi".into(),
                        source: "data".into(),
                        per_alloc,
                        read_only,
                        access_mode: Some(access),
                        attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                        ..Default::default()
                    },
                );
            }
            jobs.push(under_test.clone());
            let t = with_volumes(tables(nodes, jobs, allocs), volumes);

            let want = every_node_placement(&t, &under_test);
            let (outcome, placed) = plan(&t, "j");
            let mut got: Vec<Option<String>> = vec![None; count as usize];
            for a in &placed {
                got[a.index as usize] = Some(a.node_id.clone());
            }
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(
                outcome.counts.unplaced,
                want.iter().filter(|w| w.is_none()).count() as u64
            );
        }
    }
}

#[cfg(test)]
mod coalescing_tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    use berth_structs::{NodeResources, Resources, Task};
    use tokio::sync::watch;

    use super::*;

    const DEADLINE: Duration = Duration::from_secs(10);

    /// Poll `cond` until it holds; fail after [`DEADLINE`].
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A gate runs wait at until it is opened.
    fn gate() -> (watch::Sender<bool>, watch::Receiver<bool>) {
        watch::channel(false)
    }

    async fn pass(mut gate: watch::Receiver<bool>) {
        let _ = gate.wait_for(|open| *open).await;
    }

    #[tokio::test]
    async fn concurrent_calls_share_two_runs_and_each_returns_after_a_run_that_started_after_it() {
        let coalesced = Arc::new(Coalesced::<u64>::default());
        // One clock for calls and run starts: a run's start must come after
        // the call it answers.
        let clock = Arc::new(AtomicU64::new(1));
        let (open, gated) = gate();
        let call = |set: &mut tokio::task::JoinSet<(u64, u64)>| {
            let (coalesced, clock, gated) = (coalesced.clone(), clock.clone(), gated.clone());
            set.spawn(async move {
                let called = clock.fetch_add(1, Ordering::SeqCst);
                let started = coalesced
                    .run("web", || async {
                        let started = clock.fetch_add(1, Ordering::SeqCst);
                        pass(gated).await;
                        started
                    })
                    .await;
                (called, started)
            });
        };
        let mut calls = tokio::task::JoinSet::new();
        call(&mut calls);
        until("the first run to start", || coalesced.runs() == 1).await;
        for _ in 0..49 {
            call(&mut calls);
        }
        until("50 calls under way", || coalesced.calls("web") == 50).await;
        open.send_replace(true);
        let mut answered = 0;
        while let Some(done) = calls.join_next().await {
            let (called, started) = done.unwrap();
            assert!(
                started > called,
                "a call made at {called} was answered by a run started at {started}"
            );
            answered += 1;
        }
        assert_eq!(answered, 50);
        assert_eq!(coalesced.runs(), 2, "50 calls, one run under way: two runs");
        assert!(coalesced.keys.lock().unwrap().is_empty(), "no entry left");

        // A call after the runs ended does not take their answer: it runs.
        let called = clock.fetch_add(1, Ordering::SeqCst);
        let started = coalesced
            .run("web", || async { clock.fetch_add(1, Ordering::SeqCst) })
            .await;
        assert!(started > called);
        assert_eq!(coalesced.runs(), 3);
    }

    #[tokio::test]
    async fn different_keys_run_independently() {
        let coalesced = Arc::new(Coalesced::<u64>::default());
        let (open, gated) = gate();
        let a = tokio::spawn({
            let coalesced = coalesced.clone();
            async move {
                coalesced
                    .run("a", || async {
                        pass(gated).await;
                        1
                    })
                    .await
            }
        });
        until("the run of a to start", || coalesced.runs() == 1).await;
        // "b" runs and answers while a run of "a" is under way.
        let b = tokio::time::timeout(DEADLINE, coalesced.run("b", || async { 2 }))
            .await
            .expect("a call for b waits for no run of a");
        assert_eq!(b, 2);
        assert_eq!(coalesced.runs(), 2);
        assert!(!a.is_finished());
        open.send_replace(true);
        assert_eq!(a.await.unwrap(), 1);
        assert!(coalesced.keys.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_failing_run_answers_its_waiters_and_a_panicking_or_dropped_one_hands_over() {
        let coalesced = Arc::new(Coalesced::<Result<u64, String>>::default());
        let waiters = |n: usize, set: &mut tokio::task::JoinSet<Result<u64, String>>| {
            for _ in 0..n {
                let coalesced = coalesced.clone();
                set.spawn(async move { coalesced.run("j", || async { Ok(7) }).await });
            }
        };

        // A run that fails: the calls it covers get its failure, and the
        // ones after it a run of their own.
        let (open, gated) = gate();
        let failing = tokio::spawn({
            let coalesced = coalesced.clone();
            async move {
                coalesced
                    .run("j", || async {
                        pass(gated).await;
                        Err("store closed".to_string())
                    })
                    .await
            }
        });
        until("the failing run to start", || coalesced.runs() == 1).await;
        let mut set = tokio::task::JoinSet::new();
        waiters(5, &mut set);
        until("6 calls under way", || coalesced.calls("j") == 6).await;
        open.send_replace(true);
        assert_eq!(failing.await.unwrap(), Err("store closed".into()));
        while let Some(answer) = tokio::time::timeout(DEADLINE, set.join_next())
            .await
            .expect("the waiters of a failed run are answered")
        {
            assert_eq!(answer.unwrap(), Ok(7));
        }
        assert_eq!(coalesced.runs(), 2);

        // A run that panics, then one whose call is dropped: each time a
        // waiter takes over and every waiter is answered.
        for how in ["panics", "is dropped"] {
            let before = coalesced.runs();
            let (open, gated) = gate();
            let runner = tokio::spawn({
                let coalesced = coalesced.clone();
                async move {
                    coalesced
                        .run("j", || async {
                            pass(gated).await;
                            panic!("evaluation panicked");
                        })
                        .await
                }
            });
            until("the run to start", || coalesced.runs() == before + 1).await;
            let mut set = tokio::task::JoinSet::new();
            waiters(5, &mut set);
            until("6 calls under way", || coalesced.calls("j") == 6).await;
            if how == "panics" {
                open.send_replace(true);
                assert!(runner.await.unwrap_err().is_panic());
            } else {
                runner.abort();
                assert!(runner.await.unwrap_err().is_cancelled());
            }
            let mut answered = 0;
            while let Some(answer) = tokio::time::timeout(DEADLINE, set.join_next())
                .await
                .unwrap_or_else(|_| panic!("the waiters of a run that {how} are answered"))
            {
                assert_eq!(answer.unwrap(), Ok(7));
                answered += 1;
            }
            assert_eq!(answered, 5);
            assert_eq!(coalesced.runs(), before + 2, "one waiter ran instead");
        }
        assert!(coalesced.keys.lock().unwrap().is_empty());
    }

    fn web_job(count: u32) -> Job {
        Job {
            id: "web".into(),
            name: "web".into(),
            job_type: JobType::Service,
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count,
                tasks: vec![Task {
                    name: "t".into(),
                    driver: "raw_exec".into(),
                    config: berth_structs::TaskConfig {
                        command: "/bin/true".into(),
                        args: vec![],
                    },
                    resources: Resources {
                        cpu: 10,
                        memory_mb: 10,
                    },
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    async fn server_with_web(count: u32) -> (tempfile::TempDir, Arc<Server>) {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::open(ServerConfig::new(dir.path())).unwrap();
        server
            .register_node(Node {
                id: "n1".into(),
                name: "n1".into(),
                status: NodeStatus::Ready,
                resources: NodeResources {
                    cpu: 100_000,
                    memory_mb: 100_000,
                    disk_mb: 0,
                },
                drivers: vec!["raw_exec".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        let placed = server.register_job(web_job(count)).await.unwrap();
        assert_eq!(placed.unplaced_allocs, 0);
        (dir, server)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_evaluations_of_one_job_run_twice() {
        let (_dir, server) = server_with_web(3).await;
        let before = server.job_evaluations.runs();
        // Hold the first evaluation in its write (it records the job's
        // blocked state under this lock) until every call is made. The
        // lock is held on a thread of its own, which lets go when told or
        // when this test ends.
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let holder = std::thread::spawn({
            let server = server.clone();
            move || {
                let _held = server.blocked.lock().unwrap_or_else(|p| p.into_inner());
                let _ = locked.send(());
                let _ = released.recv();
            }
        });
        is_locked.recv().unwrap();
        let calls: Vec<_> = (0..30)
            .map(|_| {
                let server = server.clone();
                tokio::spawn(async move { server.evaluate_job("web").await })
            })
            .collect();
        until("30 evaluations asked for", || {
            server.job_evaluations.calls("web") == 30
        })
        .await;
        drop(release);
        holder.join().unwrap();
        for call in calls {
            let counts = call.await.unwrap();
            assert_eq!(
                counts,
                PlacementCounts {
                    desired: 3,
                    unplaced: 0
                }
            );
        }
        let runs = server.job_evaluations.runs() - before;
        assert!((1..=2).contains(&runs), "30 calls ran {runs} evaluations");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_of_concurrent_alloc_stops_finds_its_replacement() {
        let (_dir, server) = server_with_web(20).await;
        let ids: Vec<String> = server
            .store
            .read(|t| t.allocs_of_job("web").map(|a| a.id.clone()).collect());
        assert_eq!(ids.len(), 20);
        let before = server.job_evaluations.runs();
        let stops: Vec<_> = ids
            .into_iter()
            .map(|id| {
                let server = server.clone();
                tokio::spawn(async move { server.stop_alloc(&id).await })
            })
            .collect();
        for stop in stops {
            let stopped = stop.await.unwrap().unwrap();
            assert!(
                stopped.replacement.is_some(),
                "alloc {} was stopped and its job evaluated, but no replacement was found",
                stopped.alloc_id
            );
        }
        let runs = server.job_evaluations.runs() - before;
        assert!((1..=20).contains(&runs), "20 stops ran {runs} evaluations");
        let live = server
            .store
            .read(|t| t.allocs_of_job("web").filter(|a| !a.is_terminal()).count());
        assert_eq!(live, 20);
    }
}
