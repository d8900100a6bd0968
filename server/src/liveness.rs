//! Node liveness: heartbeat TTLs and marking silent nodes down.
//!
//! The TTL handed to a node is `max(min_heartbeat_ttl, nodes /
//! max_heartbeats_per_second)` plus up to half of that as jitter, so that the
//! servers see a bounded rate of heartbeats however many nodes there are. A
//! node that is not heard from within its TTL plus `heartbeat_grace` is
//! marked `down`: it gets a `Cluster` node event, its allocs that are not
//! terminal become `lost` (and desired `stop`, so that a returning client
//! stops them), and their jobs are evaluated so replacements are placed.
//! Deadlines live in memory; after a restart every ready node gets a fresh
//! TTL, as the servers cannot know when it was last heard from. For the
//! same reason a node not heard from since the restart that goes down
//! gives its lost allocs no last heartbeat: their disconnect windows count
//! from when they were marked lost.

use berth_sync::MutexExt;
use berth_sync::Shutdown;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_structs::{AllocClientStatus, AllocDesiredStatus, Allocation, NodeEvent, NodeStatus};
use tokio::time::Instant;

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::state::{Change, StateStore, Tables};

/// What node liveness needs from the rest of the server: evaluating the
/// jobs whose allocs a down node lost.
#[async_trait::async_trait]
pub(crate) trait EvaluateJob: Send + Sync {
    /// Evaluate `job_id` (place replacements for lost allocs).
    async fn evaluate_job(&self, job_id: &str);
}

/// The liveness settings of the server's config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LivenessConfig {
    pub(crate) min_heartbeat_ttl: Duration,
    pub(crate) max_heartbeats_per_second: f64,
    pub(crate) heartbeat_grace: Duration,
    pub(crate) default_lost_after: Duration,
}

impl LivenessConfig {
    pub(crate) fn of(config: &ServerConfig) -> LivenessConfig {
        LivenessConfig {
            min_heartbeat_ttl: config.min_heartbeat_ttl,
            max_heartbeats_per_second: config.max_heartbeats_per_second,
            heartbeat_grace: config.heartbeat_grace,
            default_lost_after: config.default_lost_after,
        }
    }
}

/// Node liveness: the heartbeat deadlines and last heartbeats of the nodes
/// (memory only), and the loop that marks silent nodes down.
pub(crate) struct Liveness {
    store: Arc<StateStore>,
    config: LivenessConfig,
    heartbeats: Mutex<Heartbeats>,
}

/// A random fraction in [0, 1), from the std hasher's random keys.
fn random_fraction() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(berth_structs::now_ms() as u64);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// What the servers know of each node's heartbeats, in memory only: a
/// heartbeat writes nothing to the store (a write would bump the index,
/// wake every alloc watch and sync the database, per heartbeat). The store
/// is written when a node's status changes.
#[derive(Debug, Default)]
pub(crate) struct Heartbeats {
    /// When each node not down must be heard from next (TTL + grace). Its
    /// length is the number of live nodes the TTL is stretched by.
    deadlines: HashMap<String, Instant>,
    /// Unix ms of each node's last heartbeat (or registration) since this
    /// server started; the stored `last_heartbeat_ms` is older.
    last_ms: HashMap<String, i64>,
    /// Nodes a write is marking down right now.
    marking_down: HashSet<String>,
}

/// How often the liveness loop looks at the clock even when no deadline is
/// due: the pause detector's resolution.
pub(crate) const LIVENESS_TICK: Duration = Duration::from_millis(500);

/// A liveness-loop wake-up this much later than asked for means the server
/// itself was away (stopped, swapped out, its disk hung): the nodes are
/// given a fresh TTL rather than marked down for that time.
pub(crate) const PAUSE_THRESHOLD: Duration = Duration::from_secs(3);

impl Liveness {
    pub(crate) fn new(store: Arc<StateStore>, config: LivenessConfig) -> Liveness {
        Liveness {
            store,
            config,
            heartbeats: Mutex::default(),
        }
    }

    fn heartbeat_map(&self) -> std::sync::MutexGuard<'_, Heartbeats> {
        self.heartbeats.locked()
    }

    /// The TTL to hand to a node now, jitter included.
    pub(crate) fn heartbeat_ttl(&self) -> Duration {
        let live_nodes = self.heartbeat_map().deadlines.len();
        let base = base_ttl(
            live_nodes,
            self.config.min_heartbeat_ttl,
            self.config.max_heartbeats_per_second,
        );
        with_jitter(base, random_fraction())
    }

    /// Expect the next heartbeat of `node_id` within `ttl` (plus grace).
    pub(crate) fn reset_heartbeat_timer(&self, node_id: &str, ttl: Duration) {
        let deadline = self.deadline_after(ttl, Instant::now());
        self.heartbeat_map()
            .deadlines
            .insert(node_id.to_string(), deadline);
    }

    /// `now + ttl + grace`; a window too long to represent is a deadline a
    /// year away (the node is heard from long before).
    fn deadline_after(&self, ttl: Duration, now: Instant) -> Instant {
        let window = ttl.saturating_add(self.config.heartbeat_grace);
        now.checked_add(window)
            .or_else(|| now.checked_add(ONE_YEAR))
            .unwrap_or(now)
    }

    /// A heartbeat of `node_id`: expect the next within `ttl` (plus
    /// grace). Returns whether a write is marking the node down meanwhile
    /// (the heartbeat then makes it ready again once that write is done).
    pub(crate) fn rearm_heartbeat_timer(&self, node_id: &str, ttl: Duration) -> bool {
        let deadline = self.deadline_after(ttl, Instant::now());
        let mut map = self.heartbeat_map();
        map.deadlines.insert(node_id.to_string(), deadline);
        map.marking_down.contains(node_id)
    }

    /// Record that `node_id` was heard from at `now_ms` (unix ms).
    pub(crate) fn record_heartbeat(&self, node_id: &str, now_ms: i64) {
        self.heartbeat_map()
            .last_ms
            .insert(node_id.to_string(), now_ms);
    }

    /// When `node_id` was last heard from by this server since it started
    /// (unix ms); None when not since then.
    pub(crate) fn last_heartbeat_ms(&self, node_id: &str) -> Option<i64> {
        self.heartbeat_map().last_ms.get(node_id).copied()
    }

    /// `node` as the API shows it: with the last heartbeat this server
    /// heard, which is newer than the stored one.
    pub(crate) fn with_live_heartbeat(&self, mut node: berth_structs::Node) -> berth_structs::Node {
        if let Some(ms) = self.last_heartbeat_ms(&node.id) {
            node.last_heartbeat_ms = node.last_heartbeat_ms.max(ms);
        }
        node
    }

    pub(crate) fn clear_heartbeat_timer(&self, node_id: &str) {
        self.heartbeat_map().deadlines.remove(node_id);
    }

    /// Forget the last heartbeat of a node that is gone (garbage
    /// collected once down long enough; it has no deadline then).
    pub(crate) fn forget_last_heartbeat(&self, node_id: &str) {
        self.heartbeat_map().last_ms.remove(node_id);
    }

    /// Forget a node entirely (it was purged).
    pub(crate) fn forget_heartbeats(&self, node_id: &str) {
        let mut map = self.heartbeat_map();
        map.deadlines.remove(node_id);
        map.last_ms.remove(node_id);
    }

    /// After a restart every node that was up gets a fresh TTL.
    pub(crate) fn arm_heartbeats_after_restore(&self) {
        let ready: Vec<String> = self.store.read(|t| {
            t.nodes
                .values()
                .filter(|n| n.status != NodeStatus::Down)
                .map(|n| n.id.clone())
                .collect()
        });
        let ttl = base_ttl(
            ready.len(),
            self.config.min_heartbeat_ttl,
            self.config.max_heartbeats_per_second,
        );
        let now = Instant::now();
        let deadline = self.deadline_after(ttl, now);
        let mut map = self.heartbeat_map();
        for id in ready {
            map.deadlines.insert(id, deadline);
        }
    }

    /// The server was away for `gap`: every node it is waiting for gets a
    /// fresh TTL (as after a restart), so none is marked down for the time
    /// the server itself did not listen.
    fn rearm_after_pause(&self, gap: Duration) {
        let mut map = self.heartbeat_map();
        let ttl = base_ttl(
            map.deadlines.len(),
            self.config.min_heartbeat_ttl,
            self.config.max_heartbeats_per_second,
        );
        let deadline = self.deadline_after(ttl, Instant::now());
        let nodes = map.deadlines.len();
        for d in map.deadlines.values_mut() {
            *d = (*d).max(deadline);
        }
        drop(map);
        tracing::warn!(
            gap_ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX),
            nodes,
            ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            "server was paused; every node gets a fresh heartbeat TTL"
        );
    }

    /// Mark down the nodes not heard from in time until `shutdown` turns
    /// true.
    pub(crate) async fn run(&self, jobs: &dyn EvaluateJob, mut shutdown: Shutdown) {
        // Deadlines set when the state was opened count from now: the
        // time between opening and running is not the nodes' fault.
        self.arm_heartbeats_after_restore();
        loop {
            let now = Instant::now();
            let tick = now.checked_add(LIVENESS_TICK).unwrap_or(now);
            let next = self
                .heartbeat_map()
                .deadlines
                .values()
                .min()
                .copied()
                .map_or(tick, |d| d.min(tick))
                .max(now);
            tokio::select! {
                _ = shutdown.wait() => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            let now = Instant::now();
            let late = now.saturating_duration_since(next);
            if late > PAUSE_THRESHOLD {
                self.rearm_after_pause(late);
                continue;
            }
            let expired: Vec<String> = {
                let mut map = self.heartbeat_map();
                let ids: Vec<String> = map
                    .deadlines
                    .iter()
                    .filter(|(_, d)| **d <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in &ids {
                    map.deadlines.remove(id);
                }
                ids
            };
            for node_id in expired {
                if let Err(e) = self.mark_silent_node_down(&node_id, jobs).await {
                    tracing::error!(node_id, error = %e, "marking node down failed; retrying");
                    self.reset_heartbeat_timer(&node_id, Duration::from_secs(1));
                }
            }
            // Stopped (or stuck on a slow disk) while marking nodes down
            // rather than while asleep: the same gap for the others.
            let busy = Instant::now().saturating_duration_since(now);
            if busy > PAUSE_THRESHOLD {
                self.rearm_after_pause(busy);
            }
        }
    }

    /// Mark down a node whose deadline passed (the liveness loop has taken
    /// it off the deadlines), unless it was heard from since (nodes expired
    /// together are marked one after the other, which takes a while). A
    /// heartbeat sets the deadline again before it looks at the node's
    /// status; this looks for one inside the write that marks the node down
    /// and flags the node as being marked down there, and a heartbeat that
    /// sees the flag makes the node ready again after that write. So a node
    /// whose heartbeat was answered does not stay down.
    async fn mark_silent_node_down(
        &self,
        node_id: &str,
        jobs: &dyn EvaluateJob,
    ) -> Result<(), ServerError> {
        self.mark_down(node_id, "Node heartbeat missed", true, jobs)
            .await
    }

    /// Mark a node down: its live allocs become lost and their jobs are
    /// evaluated.
    pub(crate) async fn mark_node_down(
        &self,
        node_id: &str,
        why: &str,
        jobs: &dyn EvaluateJob,
    ) -> Result<(), ServerError> {
        self.clear_heartbeat_timer(node_id);
        self.mark_down(node_id, why, false, jobs).await
    }

    async fn mark_down(
        &self,
        node_id: &str,
        why: &str,
        only_if_silent: bool,
        jobs: &dyn EvaluateJob,
    ) -> Result<(), ServerError> {
        let last_heartbeat = self.last_heartbeat_ms(node_id);
        let written = self.store.write_async(|t, changes| {
            let Some(node) = t.nodes.get(node_id) else {
                return Ok::<_, ServerError>(None);
            };
            if node.status == NodeStatus::Down {
                return Ok(None);
            }
            {
                let mut map = self.heartbeat_map();
                if only_if_silent && map.deadlines.contains_key(node_id) {
                    tracing::info!(
                        node_id,
                        "node heard from after its deadline passed; not marked down"
                    );
                    return Ok(None);
                }
                map.marking_down.insert(node_id.to_string());
            }
            let mut node = node.clone();
            node.status = NodeStatus::Down;
            // The heartbeats were kept in memory; the last one is stored
            // with the status change (garbage collection counts from it).
            if let Some(ms) = last_heartbeat {
                node.last_heartbeat_ms = node.last_heartbeat_ms.max(ms);
            }
            // The lost allocs' disconnect windows count from a heartbeat
            // this server heard. The stored one is older when the server
            // restarted since (heartbeats are not stored): the client has
            // heartbeated after it, with the server that was stopped, so a
            // window counted from it would end before the client's own.
            // Not known then: the windows count from now, which is later.
            let last_heartbeat_ms = last_heartbeat.unwrap_or(0);
            node.push_events([NodeEvent::new(NodeEvent::SUBSYSTEM_CLUSTER, why)
                .with_detail("status", NodeStatus::Down.as_str())]);
            changes.push(Change::PutNode(node));
            let mut jobs = BTreeSet::new();
            let now_ms = berth_structs::now_ms();
            for a in t.allocs_on_node(node_id) {
                if a.client_status.is_terminal() || a.client_status == AllocClientStatus::Unknown {
                    continue;
                }
                let mut a = a.clone();
                a.node_last_heartbeat_ms = last_heartbeat_ms;
                let held = a
                    .group()
                    .and_then(|g| {
                        g.on_disconnect(a.job.job_type, self.config.default_lost_after)
                            .lost_after
                    })
                    .filter(|_| !a.server_terminal());
                match held {
                    Some(lost_after) => {
                        a.hold_unknown(now_ms, lost_after);
                        tracing::info!(alloc_id = %a.id, node_id, job_id = %a.job_id,
                            lost_after = ?lost_after, "alloc unknown");
                    }
                    None => {
                        a.mark_lost("alloc is lost since its node is down");
                        tracing::info!(alloc_id = %a.id, node_id, job_id = %a.job_id, "alloc lost");
                    }
                }
                jobs.insert(a.job_id.clone());
                changes.push(Change::PutAlloc(a));
            }
            Ok(Some(jobs))
        }).await;
        self.heartbeat_map().marking_down.remove(node_id);
        let Some(lost_jobs) = written?.0 else {
            return Ok(());
        };
        tracing::warn!(
            node_id,
            reason = why,
            lost_jobs = lost_jobs.len(),
            "node down"
        );
        for job_id in lost_jobs {
            jobs.evaluate_job(&job_id).await;
        }
        Ok(())
    }
}

/// The allocs of `node_id` held `unknown`, as they are once the node is
/// back at `now_ms` (see [`Allocation::resumed`]). One whose group's
/// `stop_on_client_after` window passed while the node was away has been
/// stopped by its client (which reports so next): the servers stop it
/// too, so that it is not taken for a running alloc beside its
/// replacement.
pub(crate) fn resume_unknown(t: &Tables, node_id: &str, now_ms: i64) -> Vec<Allocation> {
    t.allocs_on_node(node_id)
        .filter(|a| a.client_status == AllocClientStatus::Unknown)
        .map(|a| {
            let mut back = a.resumed();
            let window = a.group().and_then(|g| g.stop_on_client_after());
            let from = a.node_last_heartbeat_ms;
            if let Some(w) = window.filter(|_| from > 0) {
                let end = from.saturating_add(i64::try_from(w.as_millis()).unwrap_or(i64::MAX));
                if now_ms >= end && !back.server_terminal() {
                    back.desired_status = AllocDesiredStatus::Stop;
                    back.desired_description =
                        "stopped on its node after disconnect stop_on_client_after".into();
                }
            }
            back
        })
        .collect()
}

const ONE_YEAR: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// `max(min_ttl, nodes / max_per_second)`, at most a year.
pub(crate) fn base_ttl(nodes: usize, min_ttl: Duration, max_per_second: f64) -> Duration {
    if max_per_second <= 0.0 || !max_per_second.is_finite() {
        return min_ttl;
    }
    let scaled = Duration::try_from_secs_f64(nodes as f64 / max_per_second)
        .unwrap_or(ONE_YEAR)
        .min(ONE_YEAR);
    scaled.max(min_ttl)
}

/// `base` plus `fraction` (in [0, 1)) of half of it, saturating.
fn with_jitter(base: Duration, fraction: f64) -> Duration {
    let jitter =
        Duration::try_from_secs_f64(base.as_secs_f64() * fraction / 2.0).unwrap_or(Duration::ZERO);
    base.saturating_add(jitter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::Server;

    #[test]
    fn ttl_stretches_with_nodes() {
        let min = Duration::from_secs(10);
        assert_eq!(base_ttl(1, min, 50.0), min);
        assert_eq!(base_ttl(500, min, 50.0), min);
        assert_eq!(base_ttl(5000, min, 50.0), Duration::from_secs(100));
    }

    #[test]
    fn ttl_math_saturates_instead_of_panicking() {
        let min = Duration::from_secs(10);
        assert_eq!(base_ttl(usize::MAX, min, f64::MIN_POSITIVE), ONE_YEAR);
        assert_eq!(base_ttl(usize::MAX, Duration::MAX, 50.0), Duration::MAX);
        assert_eq!(with_jitter(Duration::MAX, 0.99), Duration::MAX);
        assert_eq!(with_jitter(min, 0.5), Duration::from_millis(12_500));
    }

    #[tokio::test]
    async fn a_node_garbage_collected_or_purged_leaves_no_heartbeat_behind() {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::open(crate::ServerConfig::new(dir.path())).unwrap();
        for id in ["n1", "n2"] {
            server
                .register_node(berth_structs::Node {
                    id: id.into(),
                    name: id.into(),
                    ..Default::default()
                })
                .await
                .unwrap();
            assert!(server.liveness().last_heartbeat_ms(id).is_some());
        }
        server.mark_node_down("n1", "test").await.unwrap();
        let gc = server.garbage_collect(true).await.unwrap();
        assert_eq!(gc.nodes, vec!["n1".to_string()]);
        assert_eq!(server.liveness().last_heartbeat_ms("n1"), None);
        server.purge_node("n2", true).await.unwrap();
        assert_eq!(server.liveness().last_heartbeat_ms("n2"), None);
        assert_eq!(server.liveness().heartbeat_map().deadlines.len(), 0);
    }

    #[tokio::test]
    async fn a_node_heard_from_after_its_deadline_passed_is_not_marked_down() {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::open(crate::ServerConfig::new(dir.path())).unwrap();
        server
            .register_node(berth_structs::Node {
                id: "n1".into(),
                name: "n1".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        // The liveness loop found the deadline passed and took it off; the
        // node is marked down after the nodes expired before it, and its
        // heartbeat arrives meanwhile (it answered "ready").
        server.liveness().heartbeat_map().deadlines.remove("n1");
        server.node_heartbeat("n1").await.unwrap();
        server
            .liveness()
            .mark_silent_node_down("n1", &*server)
            .await
            .unwrap();
        let n1 = server.node("n1").unwrap();
        assert_eq!(
            n1.status,
            NodeStatus::Ready,
            "a node whose heartbeat was answered is not marked down for the deadline before it"
        );
        assert!(server
            .liveness()
            .heartbeat_map()
            .deadlines
            .contains_key("n1"));
        // Silent after that: marked down.
        server.liveness().heartbeat_map().deadlines.remove("n1");
        server
            .liveness()
            .mark_silent_node_down("n1", &*server)
            .await
            .unwrap();
        assert_eq!(server.node("n1").unwrap().status, NodeStatus::Down);
    }

    #[test]
    fn jitter_fraction_is_in_range() {
        for _ in 0..100 {
            let f = random_fraction();
            assert!((0.0..1.0).contains(&f));
        }
    }
}
