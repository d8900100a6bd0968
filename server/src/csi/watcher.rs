//! The volume watcher: one task (run by the leader; a single server always
//! is) that frees claims nobody released.
//!
//! It scans every volume at start and again whenever the state changes, and
//! releases a claim when:
//! - the claim is already being released (a release that failed, or a
//!   server restart in the middle of one);
//! - its alloc is gone (garbage collected);
//! - its alloc is terminal and its node is down or gone, except that a lost
//!   alloc whose group sets `stop_after_client_disconnect` keeps its claims
//!   until that window has passed (its partitioned client may still run it
//!   and write; the same rule holds back its replacement);
//! - its alloc is terminal on the client for longer than `claim_reap_grace`
//!   (the client had its chance to unpublish itself).
//!
//! Failed releases are retried with exponential backoff. No task is held per
//! volume: the watcher sleeps until the state changes, a grace period ends
//! or a retry is due.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use berth_structs::NodeStatus;
use tokio::time::Instant;

use super::ReleaseOrigin;
use crate::scheduler::disconnect_window_end_ms;
use crate::server::Server;
use crate::state::Tables;

type ClaimKey = (String, String);

struct Retry {
    at: Instant,
    backoff: ExponentialBackoff,
}

/// Claims to release now, and how long until the next one comes due by its
/// grace period.
fn reapable(t: &Tables, now_ms: i64, grace: Duration) -> (Vec<ClaimKey>, Option<Duration>) {
    let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
    let mut due = Vec::new();
    let mut next: Option<i64> = None;
    for v in t.volumes.values() {
        for c in v.claims() {
            let key = (v.id.clone(), c.alloc_id.clone());
            if c.releasing {
                due.push(key);
                continue;
            }
            let Some(a) = t.allocs.get(&c.alloc_id) else {
                due.push(key);
                continue;
            };
            if !a.is_terminal() {
                continue;
            }
            if let Some(end) = a.group().and_then(|g| disconnect_window_end_ms(a, g)) {
                if now_ms < end {
                    next = Some(next.map_or(end, |n: i64| n.min(end)));
                    continue;
                }
            }
            let node_down = t
                .nodes
                .get(&a.node_id)
                .is_none_or(|n| n.status == NodeStatus::Down);
            if node_down {
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
                next = Some(next.map_or(ready_at, |n: i64| n.min(ready_at)));
            }
        }
    }
    let wait =
        next.map(|at| Duration::from_millis(u64::try_from(at.saturating_sub(now_ms)).unwrap_or(0)));
    (due, wait)
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

impl Server {
    pub(crate) async fn volume_watcher_loop(self: Arc<Self>) {
        let mut shutdown = self.shutdown_rx();
        let mut index_rx = self.store.subscribe();
        let mut retries: HashMap<ClaimKey, Retry> = HashMap::new();
        tracing::info!("volume watcher running");
        loop {
            index_rx.borrow_and_update();
            let now = Instant::now();
            let (due, grace_wait) = self
                .store
                .read(|t| reapable(t, berth_structs::now_ms(), self.config.claim_reap_grace));
            // Forget retries of claims that are gone.
            retries.retain(|k, _| due.contains(k));
            for key in due {
                if retries.get(&key).is_some_and(|r| r.at > now) {
                    continue;
                }
                let (volume_id, alloc_id) = (&key.0, &key.1);
                match self
                    .unpublish_claim(volume_id, alloc_id, ReleaseOrigin::Watcher)
                    .await
                {
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
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                r = index_rx.changed() => if r.is_err() { return },
                _ = async {
                    match wake {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}
