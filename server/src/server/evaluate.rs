//! Evaluations: a job's plan computed on a snapshot of the tables and
//! committed in a store write that checks the snapshot still holds, the
//! job's blocked state and failures kept, and the passes over the blocked
//! and system jobs.

use berth_sync::MutexExt;
use std::collections::BTreeSet;

use berth_structs::JobType;

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::server::Server;
use crate::state::{Change, Table, Tables};

use crate::scheduler::{
    log_plan, plan_job, plan_still_fits, plan_stored_job, tables_read, PlacementCounts, PlanOutcome,
};

use super::jobs::spec_index;

/// How many times an evaluation plans on a snapshot of the tables that a
/// write then moved before it plans inside the store's writer.
const SNAPSHOT_PLANS: u32 = 3;

/// A plan of one job made on a snapshot of the tables (a read of them),
/// with what it read.
struct SnapshotPlan {
    /// The tables the plan read, but for the job's own record.
    read: Vec<Table>,
    /// Their last write when the plan read them.
    seen: u64,
    /// The job's modify index then (every write of a job sets it).
    job_index: Option<u64>,
    /// The job's allocs then, by ID, with their modify indexes.
    job_allocs: Vec<(String, u64)>,
    outcome: PlanOutcome,
    changes: Vec<Change>,
    /// The job's deployments and versions when the plan read them.
    deployments_seen: (usize, u64),
}

impl SnapshotPlan {
    /// Whether the tables `t` are still what the plan read.
    fn holds_in(&self, t: &Tables, job_id: &str) -> bool {
        t.last_write_to(&self.read) == self.seen
            && t.jobs.get(job_id).map(|j| j.modify_index) == self.job_index
            && deployments_mark(t, job_id) == self.deployments_seen
    }

    /// Whether the plan can be committed on `t` though a table it read
    /// moved: the job and its allocs are as the plan read them, the plan
    /// placed everything it was asked for (a failure or a delay it found
    /// may be gone in `t`, and a blocked job is only evaluated again on
    /// the next change), and every alloc it places still fits where it
    /// put it ([`plan_still_fits`]). Writes of other jobs' allocs, other
    /// nodes and other volumes then cost the plan nothing.
    fn still_fits(&self, t: &Tables, job_id: &str) -> bool {
        let Some(job) = t.jobs.get(job_id) else {
            return false;
        };
        Some(job.modify_index) == self.job_index
            && self.outcome.failures.is_empty()
            && !self.outcome.delayed
            && self.outcome.counts.unplaced == 0
            && self.outcome.revert_to.is_none()
            && deployments_mark(t, job_id) == self.deployments_seen
            && job_allocs(t, job_id) == self.job_allocs
            && plan_still_fits(t, job, &self.changes)
    }

    fn make(t: &Tables, job_id: &str, cfg: &ServerConfig, now: i64) -> SnapshotPlan {
        let job = t.jobs.get(job_id);
        let read = tables_read(job);
        let seen = t.last_write_to(&read);
        let deployments_seen = deployments_mark(t, job_id);
        let job_index = job.map(|j| j.modify_index);
        let job_allocs = job_allocs(t, job_id);
        let mut changes = Vec::new();
        let outcome = plan_stored_job(t, job_id, cfg, now, &mut changes);
        SnapshotPlan {
            read,
            seen,
            job_index,
            job_allocs,
            outcome,
            changes,
            deployments_seen,
        }
    }
}

/// In the write of a plan whose deployment failed with `auto_revert`:
/// the job goes back to `spec` (its stable version) as a new version,
/// evaluated again right after.
fn revert_in(
    t: &Tables,
    job_id: &str,
    spec: berth_structs::Job,
    changes: &mut Vec<Change>,
    outcome: &mut PlanOutcome,
) {
    let base = changes
        .iter()
        .rev()
        .find_map(|c| match c {
            Change::PutJob(j) if j.id == job_id => Some(j.clone()),
            _ => None,
        })
        .or_else(|| t.jobs.get(job_id).cloned());
    let Some(base) = base else {
        return;
    };
    let from = base.version;
    let to = spec.version;
    let (next, changed) = super::jobs::registration(Some(&base), spec, t.index.saturating_add(1));
    if changed {
        tracing::warn!(
            job_id,
            from,
            to,
            version = next.version,
            "deployment failed: reverting the job to its last stable version"
        );
        crate::state::job_versions::record_version(t, &next, changes);
        changes.push(Change::PutJob(next));
        outcome.delay_until(berth_structs::now_ms());
    }
}

/// How many deployments and kept versions job `job_id` has in `t`, and
/// the last write of one: a plan that read them is valid while they stay
/// (a `deployment fail` or `promote` moves them; other jobs' do not
/// count).
fn deployments_mark(t: &Tables, job_id: &str) -> (usize, u64) {
    let deployments = t.deployments_of_job(job_id).map(|d| d.modify_index);
    let versions = crate::state::job_versions::versions_of(t, job_id).map(|v| v.modify_index);
    deployments
        .chain(versions)
        .fold((0, 0), |(n, at), i| (n + 1, at.max(i)))
}

/// The allocs of job `job_id` in `t`, by ID, with their modify indexes.
fn job_allocs(t: &Tables, job_id: &str) -> Vec<(String, u64)> {
    let mut allocs: Vec<(String, u64)> = t
        .allocs_of_job(job_id)
        .map(|a| (a.id.clone(), a.modify_index))
        .collect();
    allocs.sort_unstable();
    allocs
}

/// Run `f`, which may take a while, telling a multi-threaded tokio runtime
/// so (as a store write does), so that the worker's other tasks move to
/// another thread meanwhile.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Server {
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
            .run(job_id, || async {
                // Planned inside the writer: the pass waits for its turn
                // at it parked, as other async writers do.
                let _turn = if self.config.scheduler_plans_in_writer {
                    Some(self.store.write_turn().await)
                } else {
                    None
                };
                self.evaluate_job_now(job_id)
            })
            .await
    }

    /// One evaluation of job `job_id`, now (not coalesced).
    fn evaluate_job_now(&self, job_id: &str) -> PlacementCounts {
        self.evaluate_job_between(job_id, &mut || {})
    }

    /// [`Self::evaluate_job_now`], running `between` after each plan made
    /// on a snapshot and before its commit (where a test writes what
    /// conflicts with the plan).
    fn evaluate_job_between(&self, job_id: &str, between: &mut dyn FnMut()) -> PlacementCounts {
        let now = berth_structs::now_ms();
        match self.plan_and_commit(job_id, now, between) {
            Ok(outcome) => {
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
                    .locked()
                    .insert(job_id.to_string(), vec![format!("evaluation failed: {e}")]);
                PlacementCounts::default()
            }
        }
    }

    /// Plan job `job_id` and commit the plan. The plan is made on a
    /// snapshot of the tables, outside the store's writer, so that other
    /// writes (their closures and their commits to disk) go on meanwhile;
    /// it commits if no write moved the job or a table it read since
    /// (see [`tables_read`]), or if one did but the job and its allocs are
    /// as they were and every alloc it places still fits on the tables as
    /// they are now ([`SnapshotPlan::still_fits`]), which is what keeps two
    /// plans from both claiming a single-writer volume or the last room on
    /// a node. A plan that a
    /// write moved is made again on a new snapshot, [`SNAPSHOT_PLANS`]
    /// times at most; then it is made inside the writer, where nothing can
    /// move the tables, so that an evaluation always ends.
    fn plan_and_commit(
        &self,
        job_id: &str,
        now: i64,
        between: &mut dyn FnMut(),
    ) -> Result<PlanOutcome, ServerError> {
        if !self.config.scheduler_plans_in_writer {
            for _ in 0..SNAPSHOT_PLANS {
                let plan = blocking(|| {
                    self.store
                        .read(|t| SnapshotPlan::make(t, job_id, &self.config, now))
                });
                between();
                let (committed, _) = self.store.write(|t, changes| {
                    if !plan.holds_in(t, job_id) && !plan.still_fits(t, job_id) {
                        return Ok::<_, ServerError>(None);
                    }
                    log_plan(t, job_id, &plan.changes);
                    changes.extend(plan.changes);
                    Ok(Some(self.record_outcome(t, job_id, plan.outcome, changes)))
                })?;
                match committed {
                    Some(outcome) => return Ok(outcome),
                    None => tracing::debug!(job_id, "tables moved since the plan; planning again"),
                }
            }
        }
        let (outcome, _) = self.store.write(|t, changes| {
            let outcome = plan_job(t, job_id, &self.config, now, changes);
            Ok::<_, ServerError>(self.record_outcome(t, job_id, outcome, changes))
        })?;
        Ok(outcome)
    }

    /// In the write that commits a plan of job `job_id` (its `changes`):
    /// record whether the job is blocked, and write the job when the
    /// failures shown for it change (see [`Self::evaluate_job`]).
    fn record_outcome(
        &self,
        t: &Tables,
        job_id: &str,
        outcome: PlanOutcome,
        changes: &mut Vec<Change>,
    ) -> PlanOutcome {
        let mut outcome = outcome;
        if let Some(spec) = outcome.revert_to.take() {
            revert_in(t, job_id, spec, changes, &mut outcome);
        }
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
        outcome
    }

    /// Records whether `outcome` leaves job `job_id` blocked, and with
    /// which failures; returns the failures shown for it before.
    fn set_blocked(&self, job_id: &str, outcome: &PlanOutcome) -> Vec<String> {
        let mut blocked = self.blocked.locked();
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
        let mut ids: BTreeSet<String> = self.blocked.locked().keys().cloned().collect();
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
        let ids: Vec<String> = self.blocked.locked().keys().cloned().collect();
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
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use berth_structs::{Job, Node, NodeResources, NodeStatus, Resources, Task, TaskGroup};

    use super::*;
    use crate::config::ServerConfig;

    const DEADLINE: Duration = Duration::from_secs(10);

    /// Poll `cond` until it holds; fail after [`DEADLINE`].
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
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

    /// A server that plans on a snapshot, with one node and the job
    /// "web" of `count` allocs.
    async fn server_with_web(count: u32) -> (tempfile::TempDir, Arc<Server>) {
        let dir = tempfile::tempdir().unwrap();
        let mut config = ServerConfig::new(dir.path());
        config.scheduler_plans_in_writer = false;
        let server = Server::open(config).unwrap();
        register_big_node(&server).await;
        let placed = server.register_job(web_job(count)).await.unwrap();
        assert_eq!(placed.unplaced_allocs, 0);
        (dir, server)
    }

    /// Node n1, ready, with room for anything the tests place.
    async fn register_big_node(server: &Server) {
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
                let _held = server.blocked.locked();
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

    /// A job of one alloc asking for `cpu` MHz.
    fn cpu_job(id: &str, cpu: u64) -> Job {
        let mut job = web_job(1);
        job.id = id.into();
        job.name = id.into();
        job.task_groups[0].tasks[0].resources.cpu = cpu;
        job
    }

    /// A server with `node` and `volumes`, and `jobs` stored but not
    /// evaluated.
    async fn server_with(
        node: Node,
        volumes: Vec<berth_structs::CsiVolume>,
        jobs: Vec<Job>,
        plans_in_writer: bool,
    ) -> (tempfile::TempDir, Arc<Server>) {
        let dir = tempfile::tempdir().unwrap();
        let mut config = ServerConfig::new(dir.path());
        config.scheduler_plans_in_writer = plans_in_writer;
        let server = Server::open(config).unwrap();
        server.register_node(node).await.unwrap();
        server
            .store
            .write(|_, changes| {
                changes.extend(volumes.into_iter().map(Change::PutVolume));
                changes.extend(jobs.into_iter().map(Change::PutJob));
                Ok::<_, ServerError>(())
            })
            .unwrap();
        (dir, server)
    }

    fn node_of(cpu: u64) -> Node {
        Node {
            id: "n1".into(),
            name: "n1".into(),
            status: NodeStatus::Ready,
            resources: NodeResources {
                cpu,
                memory_mb: 1000,
                disk_mb: 0,
            },
            drivers: vec!["raw_exec".into()],
            ..Default::default()
        }
    }

    /// A server with one ready node of 1000 MHz and jobs `a` and `b` of
    /// 600 MHz each, stored but not evaluated: the node fits one of them.
    async fn server_fitting_one_of_two(plans_in_writer: bool) -> (tempfile::TempDir, Arc<Server>) {
        let jobs = vec![cpu_job("a", 600), cpu_job("b", 600)];
        server_with(node_of(1000), Vec::new(), jobs, plans_in_writer).await
    }

    /// A server with a node of plugin `hp`, a single-node-writer volume
    /// `v` of it, and jobs `a` and `b` that each write to `v`, stored but
    /// not evaluated: one of them gets the volume.
    async fn server_with_one_writer_volume(
        plans_in_writer: bool,
    ) -> (tempfile::TempDir, Arc<Server>) {
        use berth_structs::{AccessMode, AttachmentMode};
        let mut node = node_of(100_000);
        node.csi_node_plugins.insert(
            "hp".into(),
            berth_structs::CsiInfo {
                plugin_id: "hp".into(),
                healthy: true,
                ..Default::default()
            },
        );
        let volume = berth_structs::CsiVolume {
            id: "v".into(),
            plugin_id: "hp".into(),
            capabilities: vec![berth_structs::VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        let writer = |id: &str| {
            let mut job = cpu_job(id, 10);
            job.task_groups[0].volumes.insert(
                "data".into(),
                berth_structs::VolumeRequest {
                    name: "data".into(),
                    volume_type: "csi".into(),
                    source: "v".into(),
                    access_mode: Some(AccessMode::SingleNodeWriter),
                    attachment_mode: Some(AttachmentMode::FileSystem),
                    ..Default::default()
                },
            );
            job
        };
        server_with(
            node,
            vec![volume],
            vec![writer("a"), writer("b")],
            plans_in_writer,
        )
        .await
    }

    fn live_allocs(server: &Server, job_id: &str) -> usize {
        server
            .store
            .read(|t| t.allocs_of_job(job_id).filter(|a| !a.is_terminal()).count())
    }

    fn failures(server: &Server, job_id: &str) -> Vec<String> {
        server
            .blocked
            .lock()
            .unwrap()
            .get(job_id)
            .cloned()
            .unwrap_or_default()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_between_the_snapshot_and_the_commit_makes_the_plan_again() {
        let (_dir, server) = server_fitting_one_of_two(false).await;
        // Job a plans on a snapshot where n1 is free; then b takes n1
        // before a commits. a's plan must not land (n1 would be over
        // committed): it is made again, and finds no room.
        let mut plans = 0;
        let counts = server.evaluate_job_between("a", &mut || {
            plans += 1;
            if plans == 1 {
                assert_eq!(server.evaluate_job_now("b").unplaced, 0);
            }
        });
        assert_eq!(plans, 2, "the plan the write moved was made again");
        assert_eq!(
            counts,
            PlacementCounts {
                desired: 1,
                unplaced: 1
            }
        );
        assert_eq!(live_allocs(&server, "a"), 0);
        assert_eq!(live_allocs(&server, "b"), 1);
        assert_eq!(server.store.read(|t| t.node_use("n1").cpu), 600);

        // The same as planning inside the writer, b first.
        let (_dir, old) = server_fitting_one_of_two(true).await;
        let mut plans = 0;
        assert_eq!(old.evaluate_job_now("b").unplaced, 0);
        let old_counts = old.evaluate_job_between("a", &mut || plans += 1);
        assert_eq!(plans, 0, "planned inside the writer, on no snapshot");
        assert_eq!(old_counts, counts);
        assert_eq!(live_allocs(&old, "a"), 0);
        assert!(!failures(&old, "a").is_empty());
        assert_eq!(failures(&server, "a"), failures(&old, "a"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deployment_failed_between_the_snapshot_and_the_commit_stays_failed() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = ServerConfig::new(dir.path());
        config.scheduler_plans_in_writer = false;
        let server = Server::open(config).unwrap();
        let mut job = web_job(2);
        job.update = Some(berth_structs::UpdateStrategy::default());
        // The job's deployment runs (its allocs are not healthy yet);
        // an operator fails it while a plan is being made.
        register_big_node(&server).await;
        server.register_job(job).await.unwrap();
        let id = server.job_deployments("web").unwrap()[0].id.clone();
        // Its allocs have run long enough: the plan would end it
        // successful.
        server
            .store
            .write(|t, changes| {
                for a in t.allocs_of_job("web") {
                    let mut a = a.clone();
                    a.client_status = berth_structs::AllocClientStatus::Running;
                    a.task_states.insert(
                        "t".into(),
                        berth_structs::TaskState {
                            state: berth_structs::TaskStateKind::Running,
                            started_at_ms: Some(1),
                            ..Default::default()
                        },
                    );
                    changes.push(Change::PutAlloc(a));
                }
                Ok::<_, ServerError>(())
            })
            .unwrap();
        let mut plans = 0;
        server.evaluate_job_between("web", &mut || {
            plans += 1;
            if plans == 1 {
                server
                    .store
                    .write(|t, changes| {
                        let mut d = t.deployments[&id].clone();
                        d.status = berth_structs::DeploymentStatus::Failed;
                        changes.push(Change::PutDeployment(d));
                        Ok::<_, ServerError>(())
                    })
                    .unwrap();
            }
        });
        assert_eq!(plans, 2, "the plan the fail moved was made again");
        assert_eq!(
            server.deployment(&id).unwrap().status,
            berth_structs::DeploymentStatus::Failed
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_to_a_table_the_plan_did_not_read_lets_it_commit() {
        let (_dir, server) = server_fitting_one_of_two(false).await;
        // Job a asks for no volume: a volume's write does not move its
        // plan, nor does another job's.
        let mut plans = 0;
        let counts = server.evaluate_job_between("a", &mut || {
            plans += 1;
            server
                .store
                .write(|_, changes| {
                    changes.push(Change::PutJob(cpu_job("c", 1)));
                    changes.push(Change::PutVolume(berth_structs::CsiVolume {
                        id: format!("v{plans}"),
                        plugin_id: "p".into(),
                        ..Default::default()
                    }));
                    Ok::<_, ServerError>(())
                })
                .unwrap();
        });
        assert_eq!(plans, 1);
        assert_eq!(counts.unplaced, 0);
        assert_eq!(live_allocs(&server, "a"), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_leaves_room_lets_the_plan_commit_unmade_again() {
        let (_dir, server) = server_fitting_one_of_two(false).await;
        server
            .store
            .write(|_, changes| {
                changes.push(Change::PutJob(cpu_job("c", 300)));
                Ok::<_, ServerError>(())
            })
            .unwrap();
        // c takes 300 of n1's 1000 MHz between a's snapshot and its
        // commit: the allocs and nodes tables moved, but a's 600 still
        // fit, so its plan lands as it was made.
        let mut plans = 0;
        let counts = server.evaluate_job_between("a", &mut || {
            plans += 1;
            assert_eq!(server.evaluate_job_now("c").unplaced, 0);
        });
        assert_eq!(plans, 1, "a plan that still fits is not made again");
        assert_eq!(counts.unplaced, 0);
        assert_eq!(live_allocs(&server, "a"), 1);
        assert_eq!(server.store.read(|t| t.node_use("n1").cpu), 900);
        assert!(failures(&server, "a").is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plan_that_placed_nothing_is_made_again_after_any_write() {
        // a asks for more than n1 has: its plan is a failure, which a
        // write of the tables it read may have made wrong (here c's write
        // frees nothing, but the plan cannot tell): made again.
        let jobs = vec![cpu_job("a", 1200), cpu_job("c", 100)];
        let (_dir, server) = server_with(node_of(1000), Vec::new(), jobs, false).await;
        let mut plans = 0;
        let counts = server.evaluate_job_between("a", &mut || {
            plans += 1;
            if plans == 1 {
                assert_eq!(server.evaluate_job_now("c").unplaced, 0);
            }
        });
        assert_eq!(plans, 2);
        assert_eq!(counts.unplaced, 1);
        assert!(!failures(&server, "a").is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plan_whose_job_moved_every_time_is_made_inside_the_writer() {
        let (_dir, server) = server_fitting_one_of_two(false).await;
        let job = server.store.read(|t| t.jobs["a"].clone());
        let mut plans = 0;
        let counts = server.evaluate_job_between("a", &mut || {
            plans += 1;
            server
                .store
                .write(|_, changes| {
                    changes.push(Change::PutJob(job.clone()));
                    Ok::<_, ServerError>(())
                })
                .unwrap();
        });
        assert_eq!(plans, SNAPSHOT_PLANS);
        assert_eq!(counts.unplaced, 0);
        assert_eq!(live_allocs(&server, "a"), 1);
        assert!(failures(&server, "a").is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_plans_never_both_take_a_single_writer_volume() {
        let (_dir, server) = server_with_one_writer_volume(false).await;
        // a plans on a snapshot where v is free; b takes it before a
        // commits: a's plan is made again and finds v taken.
        let mut plans = 0;
        let counts = server.evaluate_job_between("a", &mut || {
            plans += 1;
            if plans == 1 {
                assert_eq!(server.evaluate_job_now("b").unplaced, 0);
            }
        });
        assert_eq!(plans, 2, "the plan the write moved was made again");
        assert_eq!(counts.unplaced, 1);
        assert_eq!(live_allocs(&server, "a"), 0);
        assert_eq!(live_allocs(&server, "b"), 1);

        let (_dir, old) = server_with_one_writer_volume(true).await;
        assert_eq!(old.evaluate_job_now("b").unplaced, 0);
        assert_eq!(old.evaluate_job_now("a"), counts);
        // The failure names b's alloc, which differs between the servers.
        let shown = |s: &Server| {
            let b = s
                .store
                .read(|t| t.allocs_of_job("b").next().unwrap().id.clone());
            failures(s, "a")
                .iter()
                .map(|f| f.replace(&b, "<b>"))
                .collect::<Vec<_>>()
        };
        assert!(shown(&old)[0].contains("already has a writer (alloc <b>)"));
        assert_eq!(shown(&server), shown(&old));
    }
}
