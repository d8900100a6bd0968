//! Garbage collection on the servers: allocs, jobs and nodes that are done
//! leave the state store once they have been done for a while, so that the
//! tables (and every scan of them) stay the size of what is live.
//!
//! Rules, each a threshold from [`ServerConfig`](crate::ServerConfig):
//! - an alloc terminal for `alloc_gc_threshold` goes, unless a volume claim
//!   still names it: the claim is released through its normal path first
//!   (an alloc that disappeared would make the volume watcher free a claim
//!   that must be kept, such as the write claim of a lost alloc); and
//!   unless it stands for its index in a job that still runs (a complete
//!   batch alloc, a failed alloc not replaced yet), which goes with its
//!   job (without it the scheduler would run its index again);
//! - of the failed allocs that were replaced, a job keeps the newest
//!   [`REPLACED_FAILED_KEPT`]; older ones go at the next pass, whatever
//!   their age (unless a claim still names them);
//! - a job that is stopped, dead (a batch job whose allocs all finished),
//!   or failed for good (no failed alloc is to be rescheduled) goes with
//!   all its allocs once it and every alloc have been unchanged for
//!   `job_gc_threshold` and none is held by a claim;
//! - a node that has been down, without a heartbeat, for
//!   `node_gc_threshold` goes once no alloc is left on it.
//!
//! `berth system gc` runs a forced pass: every threshold counts as zero, as
//! Nomad's does. What is live, claimed or not yet terminal is never
//! collected, forced or not.

use berth_sync::Shutdown;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use berth_structs::{AllocClientStatus, Allocation, JobStatus, JobType, NodeStatus};

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::state::{Change, StateStore, Tables};

/// What garbage collection needs from the rest of the server: forgetting
/// what is kept in memory of the nodes it removed.
pub(crate) trait CollectedNodes: Send + Sync {
    /// `node_id` was garbage collected.
    fn node_collected(&self, node_id: &str);
}

impl CollectedNodes for crate::liveness::Liveness {
    fn node_collected(&self, node_id: &str) {
        self.forget_last_heartbeat(node_id);
    }
}

/// The garbage collection settings of the server's config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GcConfig {
    pub(crate) alloc_gc_threshold: Duration,
    pub(crate) job_gc_threshold: Duration,
    pub(crate) node_gc_threshold: Duration,
    pub(crate) gc_interval: Duration,
}

impl GcConfig {
    pub(crate) fn of(config: &ServerConfig) -> GcConfig {
        GcConfig {
            alloc_gc_threshold: config.alloc_gc_threshold,
            job_gc_threshold: config.job_gc_threshold,
            node_gc_threshold: config.node_gc_threshold,
            gc_interval: config.gc_interval,
        }
    }
}

/// The garbage collector: its passes, on an interval and forced, and the
/// removal of purged jobs once they are done.
pub(crate) struct Gc {
    store: Arc<StateStore>,
    config: GcConfig,
    nodes: Arc<dyn CollectedNodes>,
}

/// What a garbage collection removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    pub allocs: Vec<String>,
    pub jobs: Vec<String>,
    pub nodes: Vec<String>,
    /// Accessor IDs of the ACL tokens removed: past their expiry, they can
    /// never be used again. (Spent and expired introduction tokens go
    /// too, unlisted.)
    pub acl_tokens: Vec<String>,
}

impl GcReport {
    pub fn is_empty(&self) -> bool {
        self.allocs.is_empty()
            && self.jobs.is_empty()
            && self.nodes.is_empty()
            && self.acl_tokens.is_empty()
    }
}

/// The thresholds of one pass, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Thresholds {
    alloc_ms: i64,
    job_ms: i64,
    node_ms: i64,
}

impl Thresholds {
    /// A forced pass: whatever is done goes now.
    const ZERO: Thresholds = Thresholds {
        alloc_ms: 0,
        job_ms: 0,
        node_ms: 0,
    };
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Whether `since_ms` lies at least `threshold_ms` before `now_ms`.
fn older_than(now_ms: i64, since_ms: i64, threshold_ms: i64) -> bool {
    now_ms.saturating_sub(since_ms) >= threshold_ms
}

/// Done for good: terminal on the client, or stopped by the servers before
/// its client ever ran it when that client is gone.
fn alloc_done(t: &Tables, a: &Allocation) -> bool {
    a.client_status.is_terminal()
        || (a.server_terminal()
            && a.client_status == AllocClientStatus::Pending
            && !t.nodes.contains_key(&a.node_id))
}

/// A finished alloc of the current version of a job that still runs and
/// that stands for its index: a complete batch alloc (the index is done),
/// or a failed alloc not replaced yet (it waits for its reschedule, or
/// its policy allows no more and the index stays failed). It goes only
/// with its job: collected alone, the scheduler would run that index
/// again, with no count of the attempts before.
fn holds_index(t: &Tables, a: &Allocation) -> bool {
    t.jobs.get(&a.job_id).is_some_and(|j| {
        let stands = match a.client_status {
            AllocClientStatus::Complete => j.job_type == JobType::Batch,
            AllocClientStatus::Failed => {
                j.job_type != JobType::System && a.next_allocation.is_empty()
            }
            _ => false,
        };
        stands && !j.stop && a.job.version == j.version && !a.server_terminal()
    })
}

/// Failed allocs that were replaced, kept per job (the newest) whatever
/// their age: a job that fails over and over leaves no more than these
/// beside its live allocs (each replacement carries the history of the
/// attempts before it).
pub(crate) const REPLACED_FAILED_KEPT: usize = 5;

/// The replaced failed allocs of each job beyond the newest
/// [`REPLACED_FAILED_KEPT`].
fn replaced_beyond_bound(t: &Tables) -> Vec<&Allocation> {
    let mut by_job: BTreeMap<&str, Vec<&Allocation>> = BTreeMap::new();
    for a in t
        .allocs
        .values()
        .filter(|a| a.client_status == AllocClientStatus::Failed && !a.next_allocation.is_empty())
    {
        by_job.entry(a.job_id.as_str()).or_default().push(a);
    }
    let mut out = Vec::new();
    for mut replaced in by_job.into_values() {
        if replaced.len() > REPLACED_FAILED_KEPT {
            replaced.sort_by_key(|a| std::cmp::Reverse((a.create_index, a.modify_index)));
            out.extend(replaced.split_off(REPLACED_FAILED_KEPT));
        }
    }
    out
}

/// Plan one pass over the tables: the changes and what they remove.
fn plan(t: &Tables, now_ms: i64, th: Thresholds, changes: &mut Vec<Change>) -> GcReport {
    let mut report = GcReport::default();
    let collectable = |a: &Allocation, threshold_ms: i64| -> bool {
        alloc_done(t, a)
            && !t.alloc_has_claims(&a.id)
            && older_than(now_ms, a.modify_time_ms, threshold_ms)
    };
    let mut gone: BTreeSet<&str> = BTreeSet::new();

    // Jobs that are done go with all their allocs; a purged job as soon
    // as they are.
    for j in t.jobs.values() {
        let done = match j.status {
            JobStatus::Dead => true,
            JobStatus::Failed => j.stop || crate::scheduler::given_up(j, t.allocs_of_job(&j.id)),
            JobStatus::Pending | JobStatus::Running => j.stop,
        };
        let threshold_ms = if j.purge { 0 } else { th.job_ms };
        if !done || !older_than(now_ms, j.modify_time_ms, threshold_ms) {
            continue;
        }
        if t.allocs_of_job(&j.id).all(|a| collectable(a, threshold_ms)) {
            for a in t.allocs_of_job(&j.id) {
                gone.insert(&a.id);
            }
            report.jobs.push(j.id.clone());
            crate::state::job_versions::forget_versions(t, &j.id, changes);
            changes.push(Change::DeleteJob(j.id.clone()));
        }
    }
    // Allocs done for long enough, of jobs that stay.
    for a in t.allocs.values() {
        if !gone.contains(a.id.as_str()) && collectable(a, th.alloc_ms) && !holds_index(t, a) {
            gone.insert(&a.id);
        }
    }
    for a in replaced_beyond_bound(t) {
        if !t.alloc_has_claims(&a.id) {
            gone.insert(&a.id);
        }
    }
    for id in &gone {
        report.allocs.push(id.to_string());
        changes.push(Change::DeleteAlloc(id.to_string()));
    }
    // Nodes down for long enough with nothing left on them.
    for n in t.nodes.values() {
        if n.status != NodeStatus::Down || !older_than(now_ms, n.last_heartbeat_ms, th.node_ms) {
            continue;
        }
        if t.allocs_on_node(&n.id)
            .all(|a| gone.contains(a.id.as_str()))
        {
            report.nodes.push(n.id.clone());
            changes.push(Change::DeleteNode(n.id.clone()));
        }
    }
    // Tokens that can never be used again, whatever the thresholds: an
    // expired ACL token is refused, a spent or expired introduction token
    // too.
    for token in t.acl.tokens.values().filter(|tok| tok.expired_at(now_ms)) {
        report.acl_tokens.push(token.accessor_id.clone());
        changes.push(Change::DeleteAcl(crate::state::acl_token_key(
            &token.accessor_id,
        )));
    }
    for intro in t.acl.intros.values().filter(|i| !i.usable_at(now_ms)) {
        changes.push(Change::DeleteAcl(crate::state::acl_intro_key(
            &intro.accessor_id,
        )));
    }
    report
}

/// A purged job leaves with its allocs once every one is done and none is
/// held by a volume claim (what a forced pass would take of it).
fn plan_purge(t: &Tables, job_id: &str, changes: &mut Vec<Change>) -> bool {
    let Some(job) = t.jobs.get(job_id).filter(|j| j.purge && j.stop) else {
        return false;
    };
    let allocs: Vec<&Allocation> = t.allocs_of_job(job_id).collect();
    if !allocs
        .iter()
        .all(|a| alloc_done(t, a) && !t.alloc_has_claims(&a.id))
    {
        return false;
    }
    for a in allocs {
        changes.push(Change::DeleteAlloc(a.id.clone()));
    }
    crate::state::job_versions::forget_versions(t, &job.id, changes);
    changes.push(Change::DeleteJob(job.id.clone()));
    true
}

impl Gc {
    pub(crate) fn new(
        store: Arc<StateStore>,
        config: GcConfig,
        nodes: Arc<dyn CollectedNodes>,
    ) -> Gc {
        Gc {
            store,
            config,
            nodes,
        }
    }

    /// Remove a purged job now if it is done (see [`plan_purge`]);
    /// returns whether it went.
    pub(crate) fn collect_purged_job(&self, job_id: &str) -> Result<bool, ServerError> {
        let (gone, _) = self
            .store
            .write(|t, changes| Ok::<_, ServerError>(plan_purge(t, job_id, changes)))?;
        if gone {
            tracing::info!(job_id, "purged job removed");
        }
        Ok(gone)
    }

    /// Remove every purged job that is done.
    fn collect_purged_jobs(&self) {
        let purged: Vec<String> = self.store.read(|t| {
            t.jobs
                .values()
                .filter(|j| j.purge)
                .map(|j| j.id.clone())
                .collect()
        });
        for id in purged {
            if let Err(e) = self.collect_purged_job(&id) {
                tracing::warn!(job_id = %id, error = %e, "removing a purged job failed");
            }
        }
    }

    /// One garbage collection pass with the configured thresholds; `force`
    /// (`berth system gc`) takes every threshold as zero.
    pub(crate) async fn garbage_collect(&self, force: bool) -> Result<GcReport, ServerError> {
        let th = if force {
            Thresholds::ZERO
        } else {
            Thresholds {
                alloc_ms: millis(self.config.alloc_gc_threshold),
                job_ms: millis(self.config.job_gc_threshold),
                node_ms: millis(self.config.node_gc_threshold),
            }
        };
        let now = berth_structs::now_ms();
        let (report, _) = self
            .store
            .write_async(|t, changes| Ok::<_, ServerError>(plan(t, now, th, changes)))
            .await?;
        for node_id in &report.nodes {
            self.nodes.node_collected(node_id);
        }
        if !report.is_empty() {
            tracing::info!(
                allocs = report.allocs.len(),
                jobs = report.jobs.len(),
                nodes = report.nodes.len(),
                force,
                "garbage collected"
            );
        }
        Ok(report)
    }

    /// Collect on every interval, and purged jobs on every write, until
    /// `shutdown` turns true.
    pub(crate) async fn run(&self, mut shutdown: Shutdown) {
        // Purged jobs go as soon as they are done: look again on each write.
        let mut writes = self.store.subscribe();
        // A purge asked before this loop ran (or before a restart).
        self.collect_purged_jobs();
        let mut next_pass = tokio::time::Instant::now() + self.config.gc_interval;
        loop {
            tokio::select! {
                _ = shutdown.wait() => return,
                changed = writes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.collect_purged_jobs();
                    continue;
                }
                _ = tokio::time::sleep_until(next_pass) => {}
            }
            next_pass = tokio::time::Instant::now() + self.config.gc_interval;
            if let Err(e) = self.garbage_collect(false).await {
                tracing::warn!(error = %e, "garbage collection failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use berth_structs::{
        AccessMode, AllocDesiredStatus, AttachmentMode, ClaimMode, ClaimState, CsiVolume,
        CsiVolumeClaim, Job, JobType, Node,
    };

    use super::*;

    const HOUR_MS: i64 = 3_600_000;
    const TH: Thresholds = Thresholds {
        alloc_ms: HOUR_MS,
        job_ms: 4 * HOUR_MS,
        node_ms: 24 * HOUR_MS,
    };

    fn job(id: &str, stop: bool, status: JobStatus, modified: i64) -> Job {
        Job {
            id: id.into(),
            job_type: JobType::Batch,
            stop,
            status,
            modify_time_ms: modified,
            ..Job::default()
        }
    }

    fn alloc(
        id: &str,
        job: &str,
        node: &str,
        status: AllocClientStatus,
        modified: i64,
    ) -> Allocation {
        Allocation {
            id: id.into(),
            job_id: job.into(),
            node_id: node.into(),
            client_status: status,
            modify_time_ms: modified,
            ..Allocation::default()
        }
    }

    fn node(id: &str, status: NodeStatus, last_heartbeat_ms: i64) -> Node {
        Node {
            id: id.into(),
            status,
            last_heartbeat_ms,
            ..Node::default()
        }
    }

    fn tables(jobs: Vec<Job>, allocs: Vec<Allocation>, nodes: Vec<Node>) -> Tables {
        Tables {
            jobs: jobs.into_iter().map(|j| (j.id.clone(), j)).collect(),
            allocs: allocs.into_iter().map(|a| (a.id.clone(), a)).collect(),
            nodes: nodes.into_iter().map(|n| (n.id.clone(), n)).collect(),
            ..Tables::default()
        }
        .with_indexes()
    }

    fn claim_by(alloc_id: &str, node_id: &str) -> CsiVolume {
        let claim = CsiVolumeClaim {
            alloc_id: alloc_id.into(),
            node_id: node_id.into(),
            external_node_id: String::new(),
            mode: ClaimMode::Write,
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
            state: ClaimState::Taken,
            publish_context: Default::default(),
            releasing: false,
            controller_published: false,
            kept_after_purge: false,
        };
        CsiVolume {
            id: "data".into(),
            write_claims: [(alloc_id.to_string(), claim)].into(),
            ..CsiVolume::default()
        }
    }

    fn run(t: &Tables, now: i64, th: Thresholds) -> (GcReport, Vec<Change>) {
        let mut changes = Vec::new();
        let report = plan(t, now, th, &mut changes);
        (report, changes)
    }

    #[test]
    fn terminal_allocs_go_after_the_threshold_and_live_ones_never() {
        let now = 10 * HOUR_MS;
        let t = tables(
            vec![Job {
                job_type: JobType::Service,
                ..job("web", false, JobStatus::Running, 0)
            }],
            vec![
                alloc(
                    "old",
                    "web",
                    "n1",
                    AllocClientStatus::Complete,
                    now - 2 * HOUR_MS,
                ),
                // Failed, and replaced by "live".
                Allocation {
                    next_allocation: "live".into(),
                    ..alloc("new", "web", "n1", AllocClientStatus::Failed, now - 60_000)
                },
                alloc("live", "web", "n1", AllocClientStatus::Running, 0),
            ],
            vec![node("n1", NodeStatus::Ready, now)],
        );
        let (report, _) = run(&t, now, TH);
        assert_eq!(report.allocs, vec!["old"]);
        assert!(report.jobs.is_empty(), "a running job stays");

        let (forced, _) = run(&t, now, Thresholds::ZERO);
        assert_eq!(
            forced.allocs,
            vec!["new", "old"],
            "forced: every terminal alloc, no live one"
        );
    }

    #[test]
    fn a_finished_alloc_of_a_batch_job_that_still_runs_goes_only_with_its_job() {
        let now = 10 * HOUR_MS;
        let mut running = job("batch", false, JobStatus::Running, 0);
        running.version = 1;
        let mut done = alloc("done", "batch", "n1", AllocClientStatus::Complete, 0);
        done.job = std::sync::Arc::new(running.clone());
        let mut failed = alloc("failed", "batch", "n1", AllocClientStatus::Failed, 0);
        failed.job = std::sync::Arc::new(running.clone());
        let live = {
            let mut a = alloc("live", "batch", "n1", AllocClientStatus::Running, 0);
            a.job = std::sync::Arc::new(running.clone());
            a
        };
        // An alloc of the previous version holds no index of this one.
        let mut old_version = alloc("v0", "batch", "n1", AllocClientStatus::Complete, 0);
        old_version.job = std::sync::Arc::new(job("batch", false, JobStatus::Running, 0));
        let t = tables(
            vec![running],
            vec![done, failed, live, old_version],
            vec![node("n1", NodeStatus::Ready, now)],
        );
        let (report, _) = run(&t, now, Thresholds::ZERO);
        assert_eq!(report.allocs, vec!["v0"]);
        assert!(report.jobs.is_empty());
    }

    #[test]
    fn a_stopped_or_dead_job_goes_with_its_allocs_once_all_are_done() {
        let now = 10 * HOUR_MS;
        let old = now - 5 * HOUR_MS;
        let t = tables(
            vec![
                job("stopped", true, JobStatus::Dead, old),
                job("batch-done", false, JobStatus::Dead, old),
                job("stopping", true, JobStatus::Running, old),
                job("no-allocs", true, JobStatus::Dead, old),
                job("recent", true, JobStatus::Dead, now - HOUR_MS),
            ],
            vec![
                alloc("s1", "stopped", "n1", AllocClientStatus::Complete, old),
                alloc("b1", "batch-done", "n1", AllocClientStatus::Complete, old),
                alloc("r1", "stopping", "n1", AllocClientStatus::Running, old),
                alloc("x1", "recent", "n1", AllocClientStatus::Complete, old),
            ],
            vec![node("n1", NodeStatus::Ready, now)],
        );
        let (report, changes) = run(&t, now, TH);
        assert_eq!(report.jobs, vec!["batch-done", "no-allocs", "stopped"]);
        // "recent" stays (job threshold), but its alloc is past the alloc one.
        assert_eq!(report.allocs, vec!["b1", "s1", "x1"]);
        assert_eq!(changes.len(), 6);
    }

    #[test]
    fn a_failed_job_goes_once_its_policy_allows_no_more_attempts() {
        let now = 10 * HOUR_MS;
        let old = now - 5 * HOUR_MS;
        let failed = |id: &str| Job {
            task_groups: vec![berth_structs::TaskGroup {
                name: "g".into(),
                ..Default::default()
            }],
            ..job(id, false, JobStatus::Failed, old)
        };
        let in_group = |a: Allocation| Allocation {
            task_group: "g".into(),
            ..a
        };
        // A batch group's default policy: one attempt a day. "waits" has
        // its attempt to come; "given-up" was its attempt.
        let given_up = Allocation {
            reschedule_events: vec![berth_structs::RescheduleEvent {
                time_ms: old - 1,
                ..Default::default()
            }],
            ..in_group(alloc(
                "g1",
                "given-up",
                "n1",
                AllocClientStatus::Failed,
                old,
            ))
        };
        let waits = in_group(alloc("w1", "waits", "n1", AllocClientStatus::Failed, old));
        let t = tables(
            vec![failed("given-up"), failed("waits")],
            vec![given_up, waits],
            vec![node("n1", NodeStatus::Ready, now)],
        );
        let (report, _) = run(&t, now, Thresholds::ZERO);
        assert_eq!(report.jobs, vec!["given-up"]);
        assert_eq!(report.allocs, vec!["g1"]);
    }

    #[test]
    fn replaced_failed_allocs_beyond_the_bound_go_at_once_and_the_last_stays() {
        let now = 10 * HOUR_MS;
        let web = Job {
            job_type: JobType::Service,
            ..job("web", false, JobStatus::Pending, now)
        };
        // Eight failures in a row, each replaced by the next; the last
        // waits for its reschedule.
        let mut allocs: Vec<Allocation> = (0..8u64)
            .map(|i| Allocation {
                create_index: i + 1,
                next_allocation: format!("f{}", i + 1),
                ..alloc(
                    &format!("f{i}"),
                    "web",
                    "n1",
                    AllocClientStatus::Failed,
                    now,
                )
            })
            .collect();
        allocs.push(Allocation {
            create_index: 9,
            ..alloc("f8", "web", "n1", AllocClientStatus::Failed, 0)
        });
        let t = tables(vec![web], allocs, vec![node("n1", NodeStatus::Ready, now)]);
        let (report, _) = run(&t, now, TH);
        // Of the eight replaced, the newest five stay; the unreplaced one
        // stands for its index although it is past the threshold.
        assert_eq!(report.allocs, vec!["f0", "f1", "f2"]);
    }

    #[test]
    fn an_alloc_that_a_claim_names_is_kept_and_so_is_its_job() {
        let now = 10 * HOUR_MS;
        let mut t = tables(
            vec![job("db", true, JobStatus::Dead, 0)],
            vec![alloc("lost", "db", "n1", AllocClientStatus::Lost, 0)],
            vec![node("n1", NodeStatus::Down, 0)],
        );
        t.volumes.insert("data".into(), claim_by("lost", "n1"));
        t.reindex();
        let (report, changes) = run(&t, now, Thresholds::ZERO);
        assert_eq!(report, GcReport::default(), "nothing a claim names goes");
        assert!(changes.is_empty());
    }

    #[test]
    fn a_down_node_goes_once_nothing_is_left_on_it() {
        let now = 100 * HOUR_MS;
        let t = tables(
            vec![job("web", false, JobStatus::Running, 0)],
            vec![
                alloc("a1", "web", "gone-soon", AllocClientStatus::Lost, 0),
                alloc("a2", "web", "busy", AllocClientStatus::Running, 0),
            ],
            vec![
                node("gone-soon", NodeStatus::Down, 0),
                node("busy", NodeStatus::Down, 0),
                node("recent", NodeStatus::Down, now - HOUR_MS),
                node("ready", NodeStatus::Ready, 0),
            ],
        );
        let (report, _) = run(&t, now, TH);
        assert_eq!(report.allocs, vec!["a1"]);
        assert_eq!(report.nodes, vec!["gone-soon"]);
    }

    #[test]
    fn a_stopped_alloc_that_never_ran_goes_only_once_its_node_is_gone() {
        let now = 10 * HOUR_MS;
        let mut never = alloc("never", "web", "n1", AllocClientStatus::Pending, 0);
        never.desired_status = AllocDesiredStatus::Stop;
        let t = tables(
            vec![job("web", false, JobStatus::Running, 0)],
            vec![never.clone()],
            vec![node("n1", NodeStatus::Ready, now)],
        );
        assert!(
            run(&t, now, TH).0.allocs.is_empty(),
            "its client may still report it"
        );
        let t = tables(
            vec![job("web", false, JobStatus::Running, 0)],
            vec![never],
            vec![],
        );
        assert_eq!(run(&t, now, TH).0.allocs, vec!["never"]);
    }

    #[test]
    fn thresholds_near_the_limits_do_not_wrap() {
        let t = tables(
            vec![job("j", true, JobStatus::Dead, i64::MIN)],
            vec![alloc("a", "j", "n1", AllocClientStatus::Complete, i64::MIN)],
            vec![node("n1", NodeStatus::Down, i64::MIN)],
        );
        let th = Thresholds {
            alloc_ms: i64::MAX,
            job_ms: i64::MAX,
            node_ms: i64::MAX,
        };
        let (report, _) = run(&t, i64::MAX, th);
        assert_eq!(report.jobs, vec!["j"]);
        let (report, _) = run(&t, i64::MIN, th);
        assert!(report.is_empty());
    }
}
