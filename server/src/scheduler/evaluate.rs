//! Evaluations: a job's plan computed and committed in one store write,
//! the job's blocked state and failures kept, and the passes over the
//! blocked and system jobs.

use std::collections::BTreeSet;

use berth_structs::JobType;

use crate::error::ServerError;
use crate::server::Server;
use crate::state::Change;

use super::reconcile::{plan_job, PlacementCounts, PlanOutcome};
use super::register::spec_index;

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
