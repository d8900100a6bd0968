//! The volume watcher: one task (run by the leader; a single server always
//! is) that frees claims nobody released.
//!
//! It scans every volume at start and again whenever the state changes, and
//! releases a claim when:
//! - the claim is already being released (a release that failed, or a
//!   server restart in the middle of one);
//! - its alloc is gone (garbage collected);
//! - its alloc is lost (its node went down): by the rule in [`lost_claim`]
//!   ("never two writers": a write claim is kept while the node may still
//!   write, unless the group's `disconnect { stop_on_client_after }` window has
//!   passed); so is a claim of an alloc held `unknown` (its node is down)
//!   that the servers stopped meanwhile (a claim of one still desired
//!   `run` is kept);
//! - its alloc is terminal otherwise and its node is down or gone;
//! - its alloc is terminal on the client for longer than `claim_reap_grace`
//!   (the client had its chance to unpublish itself);
//!
//! never a write claim kept by a purge without `-force` (its node's tasks
//! may still write; an operator frees it), unless already being released.
//!
//! Failed releases are retried with exponential backoff. No task is held per
//! volume: the watcher sleeps until the state changes, a grace period ends
//! or a retry is due.

use berth_sync::Shutdown;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use berth_structs::{AllocClientStatus, Allocation, ClaimMode, Node, NodeStatus};
use tokio::time::Instant;

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::scheduler::disconnect_window_end_ms;
use crate::state::{ClusterIndexes, StateStore, Tables};

/// What the volume watcher needs from the rest of the server: releasing a
/// claim it reaps (node detach, controller detach, free).
#[async_trait::async_trait]
pub(crate) trait ReleaseClaim: Send + Sync {
    /// Release the claim of `alloc_id` on `volume_id`, as the watcher.
    async fn release_claim(&self, volume_id: &str, alloc_id: &str) -> Result<(), ServerError>;
}

/// The volume watcher: the store, the two grace periods it counts with,
/// and its loop.
pub(crate) struct VolumeWatcher {
    store: Arc<StateStore>,
    claim_reap_grace: Duration,
    heartbeat_grace: Duration,
}

type ClaimKey = (String, String);

struct Retry {
    at: Instant,
    backoff: ExponentialBackoff,
}

/// Claims to release now, and how long until the next one comes due by its
/// grace period or disconnect window.
fn reapable(
    t: &Tables,
    now_ms: i64,
    reap_grace: Duration,
    heartbeat_grace: Duration,
) -> (Vec<ClaimKey>, Option<Duration>) {
    let grace_ms = i64::try_from(reap_grace.as_millis()).unwrap_or(i64::MAX);
    let mut due = Vec::new();
    let mut next: Option<i64> = None;
    let mut wake_at = |at: i64| next = Some(next.map_or(at, |n: i64| n.min(at)));
    for v in t.volumes.values() {
        for c in v.claims() {
            let key = (v.id.clone(), c.alloc_id.clone());
            if c.releasing {
                due.push(key);
                continue;
            }
            if c.kept_after_purge {
                // Its node was purged without -force: an operator frees it.
                continue;
            }
            let Some(a) = t.allocs.get(&c.alloc_id) else {
                due.push(key);
                continue;
            };
            if a.client_status == AllocClientStatus::Unknown && !a.server_terminal() {
                // Held for its node's return, which may still run it: kept,
                // unless its group's stop_on_client_after window has passed
                // (its client has stopped it by then).
                match a
                    .group()
                    .and_then(|g| disconnect_window_end_ms(a, g, heartbeat_grace))
                {
                    Some(end) if now_ms >= end => due.push(key),
                    Some(end) => wake_at(end),
                    None => {}
                }
                continue;
            }
            if !a.is_terminal() {
                continue;
            }
            let node = t.nodes.get(&a.node_id);
            // Lost, or held unknown and stopped by the servers meanwhile:
            // its node may still run it.
            if matches!(
                a.client_status,
                AllocClientStatus::Lost | AllocClientStatus::Unknown
            ) {
                match lost_claim(a, c.mode, node, now_ms, heartbeat_grace) {
                    LostClaim::Release => due.push(key),
                    LostClaim::At(end) => wake_at(end),
                    LostClaim::Keep => {}
                }
                continue;
            }
            if node.is_none_or(|n| n.status == NodeStatus::Down) {
                due.push(key);
                continue;
            }
            if !a.client_status.is_terminal() {
                // Asked to stop; the client has not stopped it yet.
                continue;
            }
            let ready_at = a.modify_time_ms.saturating_add(grace_ms);
            if now_ms >= ready_at {
                due.push(key);
            } else {
                wake_at(ready_at);
            }
        }
    }
    let wait =
        next.map(|at| Duration::from_millis(u64::try_from(at.saturating_sub(now_ms)).unwrap_or(0)));
    (due, wait)
}

/// What becomes of a claim of a lost alloc.
#[derive(Debug, PartialEq, Eq)]
enum LostClaim {
    Release,
    /// Release at this unix ms.
    At(i64),
    /// Keep until something changes (the node comes back, is purged, or an
    /// operator detaches the volume).
    Keep,
}

/// The rule for claims of lost allocs, "never two writers": the node may
/// still run a lost alloc, out of the servers' reach.
/// - Its node is gone (purged): release.
/// - Its node is up again: the client stops the alloc (it is desired
///   `stop`) and releases the claim itself; once it reports the alloc
///   stopped the alloc is no longer `lost` and the usual rules apply. Kept
///   until then, window or not: a client that heartbeats again no longer
///   counts its window, and its stop may outlast it.
/// - Its node is down and the group sets `stop_after_client_disconnect`:
///   release once its window has passed (the client has stopped it by
///   then), counted from the node's last heartbeat plus `heartbeat_grace`.
/// - Its node is down otherwise: a read claim is released at once (with
///   no node detach, the node is unreachable); a write claim is kept.
fn lost_claim(
    a: &Allocation,
    mode: ClaimMode,
    node: Option<&Node>,
    now_ms: i64,
    heartbeat_grace: Duration,
) -> LostClaim {
    let Some(node) = node else {
        return LostClaim::Release;
    };
    if node.status != NodeStatus::Down {
        return LostClaim::Keep;
    }
    if let Some(end) = a
        .group()
        .and_then(|g| disconnect_window_end_ms(a, g, heartbeat_grace))
    {
        return if now_ms >= end {
            LostClaim::Release
        } else {
            LostClaim::At(end)
        };
    }
    match mode {
        ClaimMode::Read => LostClaim::Release,
        ClaimMode::Write => LostClaim::Keep,
    }
}

/// The longest a failing release waits before its next try.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);

/// `at + d`, or a day after `at` when that is not representable.
fn far_or(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(at)
}

fn backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(MAX_RETRY_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
}

impl VolumeWatcher {
    pub(crate) fn new(store: Arc<StateStore>, config: &ServerConfig) -> VolumeWatcher {
        VolumeWatcher {
            store,
            claim_reap_grace: config.claim_reap_grace,
            heartbeat_grace: config.heartbeat_grace,
        }
    }

    /// Release the claims nobody released, on every write that moved the
    /// nodes, volumes or allocs and when a grace period ends or a retry is
    /// due, until `shutdown` turns true.
    pub(crate) async fn run(&self, claims: &dyn ReleaseClaim, mut shutdown: Shutdown) {
        let mut index_rx = self.store.subscribe();
        let mut retries: HashMap<ClaimKey, Retry> = HashMap::new();
        // What the last pass read, and when it wanted to look again: a
        // write that changed none of it (an alloc's volume stats, which
        // nodes report all the time) needs no pass over every volume.
        let mut passed: Option<(ClusterIndexes, Option<Instant>)> = None;
        tracing::info!("volume watcher running");
        loop {
            index_rx.borrow_and_update();
            let now = Instant::now();
            let inputs = self.store.read(Tables::cluster_indexes);
            if let Some((seen, wake)) = passed {
                if seen == inputs && wake.is_none_or(|at| at > now) {
                    tokio::select! {
                        _ = shutdown.wait() => return,
                        r = index_rx.changed() => if r.is_err() { return },
                        _ = sleep_until_or_forever(wake) => {}
                    }
                    continue;
                }
            }
            let (due, grace_wait) = self.store.read(|t| {
                reapable(
                    t,
                    berth_structs::now_ms(),
                    self.claim_reap_grace,
                    self.heartbeat_grace,
                )
            });
            // Forget retries of claims that are gone.
            retries.retain(|k, _| due.contains(k));
            for key in due {
                if retries.get(&key).is_some_and(|r| r.at > now) {
                    continue;
                }
                let (volume_id, alloc_id) = (&key.0, &key.1);
                match claims.release_claim(volume_id, alloc_id).await {
                    Ok(()) => {
                        retries.remove(&key);
                    }
                    Err(e) => {
                        let r = retries.entry(key.clone()).or_insert_with(|| Retry {
                            at: now,
                            backoff: backoff(),
                        });
                        let delay = r.backoff.next().unwrap_or(MAX_RETRY_DELAY);
                        r.at = far_or(Instant::now(), delay);
                        tracing::warn!(volume_id, alloc_id, error = %e, retry_in_ms = delay.as_millis() as u64,
                            "reaping claim failed");
                    }
                }
            }
            let retry_at = retries.values().map(|r| r.at).min();
            let grace_at = grace_wait.map(|w| far_or(Instant::now(), w));
            let wake = match (retry_at, grace_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            passed = Some((inputs, wake));
            tokio::select! {
                _ = shutdown.wait() => return,
                r = index_rx.changed() => if r.is_err() { return },
                _ = sleep_until_or_forever(wake) => {}
            }
        }
    }
}

async fn sleep_until_or_forever(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use berth_structs::{
        AllocClientStatus, Allocation, ClaimMode, Job, Node, NodeStatus, TaskGroup,
    };

    use super::{lost_claim, LostClaim};

    fn lost(window: Option<Duration>, last_heartbeat_ms: i64) -> Allocation {
        Allocation {
            id: "a".into(),
            node_id: "n".into(),
            task_group: "g".into(),
            job: Job {
                task_groups: vec![TaskGroup {
                    name: "g".into(),
                    stop_after_client_disconnect: window,
                    ..TaskGroup::default()
                }],
                ..Job::default()
            }
            .into(),
            client_status: AllocClientStatus::Lost,
            node_last_heartbeat_ms: last_heartbeat_ms,
            modify_time_ms: last_heartbeat_ms + 20_000,
            ..Allocation::default()
        }
    }

    fn node(status: NodeStatus) -> Node {
        Node {
            id: "n".into(),
            status,
            ..Node::default()
        }
    }

    const GRACE: Duration = Duration::from_secs(10);

    #[test]
    fn write_claim_of_a_lost_alloc_without_window_is_kept_until_the_node_is_gone() {
        let a = lost(None, 1_000);
        let down = node(NodeStatus::Down);
        let ready = node(NodeStatus::Ready);
        let later = i64::MAX / 2;
        assert_eq!(
            lost_claim(&a, ClaimMode::Write, Some(&down), later, GRACE),
            LostClaim::Keep
        );
        // Back, not yet reported stopped: the client releases it itself.
        assert_eq!(
            lost_claim(&a, ClaimMode::Write, Some(&ready), later, GRACE),
            LostClaim::Keep
        );
        assert_eq!(
            lost_claim(&a, ClaimMode::Read, Some(&ready), later, GRACE),
            LostClaim::Keep
        );
        // Purged.
        assert_eq!(
            lost_claim(&a, ClaimMode::Write, None, later, GRACE),
            LostClaim::Release
        );
    }

    #[test]
    fn read_claim_of_a_lost_alloc_is_released_at_once_while_down() {
        let a = lost(None, 1_000);
        let down = node(NodeStatus::Down);
        assert_eq!(
            lost_claim(&a, ClaimMode::Read, Some(&down), 1_001, GRACE),
            LostClaim::Release
        );
    }

    #[test]
    fn windowed_write_claim_is_released_at_last_heartbeat_plus_window_plus_grace() {
        let a = lost(Some(Duration::from_secs(5)), 1_000);
        let down = node(NodeStatus::Down);
        let end = 1_000 + 5_000 + 10_000;
        assert_eq!(
            lost_claim(&a, ClaimMode::Write, Some(&down), end - 1, GRACE),
            LostClaim::At(end)
        );
        assert_eq!(
            lost_claim(&a, ClaimMode::Write, Some(&down), end, GRACE),
            LostClaim::Release
        );
        // The node is back: its client stops the alloc and reports it,
        // however long that takes past the window.
        assert_eq!(
            lost_claim(
                &a,
                ClaimMode::Write,
                Some(&node(NodeStatus::Ready)),
                end,
                GRACE
            ),
            LostClaim::Keep
        );
        // Without the node's last heartbeat on record: from when it was
        // marked lost, which is later.
        let a = lost(Some(Duration::from_secs(5)), 0);
        assert_eq!(
            lost_claim(&a, ClaimMode::Write, Some(&down), 0, GRACE),
            LostClaim::At(20_000 + 15_000)
        );
    }
}
