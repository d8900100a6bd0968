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
//! TTL, as the servers cannot know when it was last heard from.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use berth_structs::{AllocClientStatus, AllocDesiredStatus, NodeEvent, NodeStatus};
use tokio::time::Instant;

use crate::error::ServerError;
use crate::server::Server;
use crate::state::Change;

/// A random fraction in [0, 1), from the std hasher's random keys.
fn random_fraction() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(berth_structs::now_ms() as u64);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

impl Server {
    fn heartbeat_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.heartbeats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The TTL to hand to a node now, jitter included.
    pub fn heartbeat_ttl(&self) -> Duration {
        let live_nodes = self.store.read(|t| {
            t.nodes
                .values()
                .filter(|n| n.status != NodeStatus::Down)
                .count()
        });
        let base = base_ttl(
            live_nodes,
            self.config.min_heartbeat_ttl,
            self.config.max_heartbeats_per_second,
        );
        with_jitter(base, random_fraction())
    }

    /// Expect the next heartbeat of `node_id` within `ttl` (plus grace).
    pub(crate) fn reset_heartbeat_timer(&self, node_id: &str, ttl: Duration) {
        let now = Instant::now();
        let window = ttl.saturating_add(self.config.heartbeat_grace);
        // A window too long to represent is a deadline a year away (the
        // node is heard from long before).
        let deadline = now
            .checked_add(window)
            .or_else(|| now.checked_add(ONE_YEAR))
            .unwrap_or(now);
        self.heartbeat_map().insert(node_id.to_string(), deadline);
        self.heartbeats_changed.notify_one();
    }

    pub(crate) fn clear_heartbeat_timer(&self, node_id: &str) {
        self.heartbeat_map().remove(node_id);
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
        for id in ready {
            self.reset_heartbeat_timer(&id, ttl);
        }
    }

    pub(crate) async fn liveness_loop(self: Arc<Self>) {
        let mut shutdown = self.shutdown_rx();
        loop {
            let next = self.heartbeat_map().values().min().copied();
            let notified = self.heartbeats_changed.notified();
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                _ = notified => continue,
                _ = sleep_until_opt(next) => {}
            }
            let now = Instant::now();
            let expired: Vec<String> = {
                let mut map = self.heartbeat_map();
                let ids: Vec<String> = map
                    .iter()
                    .filter(|(_, d)| **d <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in &ids {
                    map.remove(id);
                }
                ids
            };
            for node_id in expired {
                if let Err(e) = self.mark_node_down(&node_id, "Node heartbeat missed").await {
                    tracing::error!(node_id, error = %e, "marking node down failed; retrying");
                    self.reset_heartbeat_timer(&node_id, Duration::from_secs(1));
                }
            }
        }
    }

    /// Mark a node down: its live allocs become lost and their jobs are
    /// evaluated.
    pub async fn mark_node_down(&self, node_id: &str, why: &str) -> Result<(), ServerError> {
        self.clear_heartbeat_timer(node_id);
        let (jobs, _) = self.store.write(|t, changes| {
            let Some(node) = t.nodes.get(node_id) else {
                return Ok::<_, ServerError>(BTreeSet::new());
            };
            if node.status == NodeStatus::Down {
                return Ok(BTreeSet::new());
            }
            let mut node = node.clone();
            node.status = NodeStatus::Down;
            node.push_events([NodeEvent::new(NodeEvent::SUBSYSTEM_CLUSTER, why)
                .with_detail("status", NodeStatus::Down.as_str())]);
            changes.push(Change::PutNode(node));
            let mut jobs = BTreeSet::new();
            for a in t.allocs_on_node(node_id) {
                if a.client_status.is_terminal() {
                    continue;
                }
                let mut a = a.clone();
                a.client_status = AllocClientStatus::Lost;
                a.client_description = "alloc is lost since its node is down".into();
                a.desired_status = AllocDesiredStatus::Stop;
                a.desired_description = "alloc is lost since its node is down".into();
                tracing::info!(alloc_id = %a.id, node_id, job_id = %a.job_id, "alloc lost");
                jobs.insert(a.job_id.clone());
                changes.push(Change::PutAlloc(a));
            }
            Ok(jobs)
        })?;
        tracing::warn!(node_id, reason = why, lost_jobs = jobs.len(), "node down");
        for job_id in jobs {
            self.evaluate_job(&job_id).await;
        }
        Ok(())
    }
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

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn jitter_fraction_is_in_range() {
        for _ in 0..100 {
            let f = random_fraction();
            assert!((0.0..1.0).contains(&f));
        }
    }
}
