//! The disconnect tracker: stops the allocs whose group sets
//! `disconnect { stop_on_client_after }` once the client has gone that long
//! without a successful heartbeat, so that a workload the servers replace
//! elsewhere never runs twice.
//!
//! Time is counted from the last successful heartbeat, which the
//! [`crate::Heartbeater`] restores from disk after an agent restart; a
//! short startup grace keeps a freshly started agent from stopping allocs
//! before it has had a chance to reach the servers. The tasks' executors
//! hold them to the same window through the heartbeat lease, grace or not
//! (see `berth_allocrunner::lease`); this tracker also covers what they
//! do not (an executor started by an older agent), and stops the alloc as
//! a whole, hooks and all.

use berth_sync::Shutdown;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

/// What the tracker acts on; the agent implements it over its alloc
/// runners.
#[async_trait::async_trait]
pub trait DisconnectTarget: Send + Sync {
    /// The live allocs on this node whose group sets a disconnect window,
    /// with that window.
    async fn allocs_with_window(&self) -> Vec<(String, Duration)>;
    /// Stops the alloc: its tasks are killed and its postrun hooks run.
    async fn stop_alloc(&self, alloc_id: &str, reason: &str);
}

#[derive(Debug, Clone)]
pub struct DisconnectConfig {
    /// No alloc is stopped sooner than this after the tracker starts.
    pub startup_grace: Duration,
    /// How often the set of allocs is looked at again when nothing else
    /// wakes the tracker (allocs come and go).
    pub recheck_interval: Duration,
}

impl Default for DisconnectConfig {
    fn default() -> Self {
        DisconnectConfig {
            startup_grace: Duration::from_secs(10),
            recheck_interval: Duration::from_secs(1),
        }
    }
}

pub struct DisconnectTracker {
    config: DisconnectConfig,
    target: Arc<dyn DisconnectTarget>,
    last_success: watch::Receiver<Option<Instant>>,
}

impl DisconnectTracker {
    pub fn new(
        config: DisconnectConfig,
        target: Arc<dyn DisconnectTarget>,
        last_success: watch::Receiver<Option<Instant>>,
    ) -> DisconnectTracker {
        DisconnectTracker {
            config,
            target,
            last_success,
        }
    }

    /// Tracks until `shutdown` becomes true.
    pub async fn run(mut self, mut shutdown: Shutdown) {
        let started = Instant::now();
        let not_before = started + self.config.startup_grace;
        let mut stopped: HashSet<String> = HashSet::new();
        loop {
            let now = Instant::now();
            let last = *self.last_success.borrow_and_update();
            let allocs = self.target.allocs_with_window().await;
            stopped.retain(|id| allocs.iter().any(|(a, _)| a == id));
            let mut next_wake = now + self.config.recheck_interval;
            if let Some(last) = last {
                let mut due = Vec::new();
                for (alloc_id, window) in &allocs {
                    if stopped.contains(alloc_id) {
                        continue;
                    }
                    // A window too long to add to an instant never ends.
                    let Some(end) = last.checked_add(*window) else {
                        continue;
                    };
                    let deadline = end.max(not_before);
                    if deadline <= now {
                        due.push((alloc_id.clone(), *window));
                    } else {
                        next_wake = next_wake.min(deadline);
                    }
                }
                if !due.is_empty() {
                    let silent = now.saturating_duration_since(last);
                    warn!(
                        allocs = due.len(),
                        silent_ms = silent.as_millis() as u64,
                        "no successful heartbeat for longer than the allocs' disconnect stop_on_client_after; stopping them"
                    );
                }
                // All due allocs stop together, not one after another.
                let mut stops = tokio::task::JoinSet::new();
                for (alloc_id, window) in &due {
                    let reason = format!(
                        "the client has had no successful heartbeat for {:?} (disconnect stop_on_client_after = {:?})",
                        now.saturating_duration_since(last),
                        window
                    );
                    let target = self.target.clone();
                    let alloc_id = alloc_id.clone();
                    stops.spawn(async move {
                        info!(alloc_id = %alloc_id, "stopping alloc after client disconnect");
                        target.stop_alloc(&alloc_id, &reason).await;
                    });
                }
                while stops.join_next().await.is_some() {}
                stopped.extend(due.into_iter().map(|(id, _)| id));
            }
            let heartbeat_gone = tokio::select! {
                _ = tokio::time::sleep_until(next_wake) => false,
                r = self.last_success.changed() => r.is_err(),
                _ = shutdown.wait() => return,
            };
            if heartbeat_gone {
                // The heartbeater is gone: only time moves on.
                tokio::select! {
                    _ = tokio::time::sleep_until(next_wake) => {}
                    _ = shutdown.wait() => return,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_sync::ShutdownSender;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// A node's allocs as the tracker sees them, recording stops with the
    /// (paused) time they happened at.
    #[derive(Default)]
    struct Node {
        allocs: Mutex<BTreeMap<String, Duration>>,
        stops: Mutex<Vec<(String, Instant)>>,
    }

    #[async_trait::async_trait]
    impl DisconnectTarget for Node {
        async fn allocs_with_window(&self) -> Vec<(String, Duration)> {
            self.allocs
                .lock()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        }
        async fn stop_alloc(&self, alloc_id: &str, _reason: &str) {
            self.allocs.lock().unwrap().remove(alloc_id);
            self.stops
                .lock()
                .unwrap()
                .push((alloc_id.to_string(), Instant::now()));
        }
    }

    fn node(allocs: &[(&str, u64)]) -> Arc<Node> {
        let n = Node::default();
        for (id, secs) in allocs {
            n.allocs
                .lock()
                .unwrap()
                .insert(id.to_string(), Duration::from_secs(*secs));
        }
        Arc::new(n)
    }

    fn start(
        n: &Arc<Node>,
        last: Option<Instant>,
        grace: Duration,
    ) -> (watch::Sender<Option<Instant>>, ShutdownSender) {
        let (hb_tx, hb_rx) = watch::channel(last);
        let (stop_tx, stop_rx) = Shutdown::channel();
        let tracker = DisconnectTracker::new(
            DisconnectConfig {
                startup_grace: grace,
                recheck_interval: Duration::from_secs(1),
            },
            n.clone(),
            hb_rx,
        );
        tokio::spawn(tracker.run(stop_rx));
        (hb_tx, stop_tx)
    }

    async fn advance(d: Duration) {
        tokio::time::sleep(d).await;
    }

    #[tokio::test(start_paused = true)]
    async fn allocs_stop_once_their_window_passes_without_a_heartbeat() {
        let n = node(&[("short", 5), ("long", 30), ("other", 5)]);
        let t0 = Instant::now();
        let (_hb, _stop) = start(&n, Some(t0), Duration::ZERO);
        advance(Duration::from_millis(4900)).await;
        assert!(n.stops.lock().unwrap().is_empty(), "nothing before 5s");
        advance(Duration::from_millis(200)).await;
        let stops = n.stops.lock().unwrap().clone();
        let ids: Vec<&str> = stops.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, vec!["other", "short"], "both 5s allocs stop together");
        for (_, at) in &stops {
            assert!(
                *at - t0 < Duration::from_millis(5100),
                "promptly: {:?}",
                *at - t0
            );
        }
        advance(Duration::from_secs(30)).await;
        assert_eq!(n.stops.lock().unwrap().len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_too_long_to_count_never_ends_and_stops_no_other_alloc_from_ending() {
        // "huge" comes first: a tracker that panicked on it would never
        // stop "short".
        let n = node(&[("huge", u64::MAX), ("short", 5)]);
        let (_hb, _stop) = start(&n, Some(Instant::now()), Duration::ZERO);
        advance(Duration::from_secs(6)).await;
        let stops = n.stops.lock().unwrap().clone();
        let ids: Vec<&str> = stops.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, vec!["short"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_pushes_the_deadline_back() {
        let n = node(&[("a", 5)]);
        let (hb, _stop) = start(&n, Some(Instant::now()), Duration::ZERO);
        advance(Duration::from_secs(4)).await;
        hb.send_replace(Some(Instant::now()));
        advance(Duration::from_secs(4)).await;
        assert!(
            n.stops.lock().unwrap().is_empty(),
            "the heartbeat at 4s counts"
        );
        advance(Duration::from_millis(1100)).await;
        assert_eq!(n.stops.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_restart_the_window_counts_from_the_last_heartbeat_but_not_before_the_grace() {
        // The last heartbeat was long ago (restored from disk): the window
        // has passed, yet nothing stops within the startup grace.
        let n = node(&[("a", 5)]);
        advance(Duration::from_secs(60)).await;
        let long_ago = Instant::now() - Duration::from_secs(60);
        let started = Instant::now();
        let (_hb, _stop) = start(&n, Some(long_ago), Duration::from_secs(10));
        advance(Duration::from_millis(9900)).await;
        assert!(n.stops.lock().unwrap().is_empty(), "not within the grace");
        advance(Duration::from_millis(200)).await;
        let stops = n.stops.lock().unwrap().clone();
        assert_eq!(stops.len(), 1);
        assert!(stops[0].1 - started < Duration::from_millis(10_100));
    }

    #[tokio::test(start_paused = true)]
    async fn without_any_heartbeat_on_record_nothing_stops() {
        let n = node(&[("a", 1)]);
        let (_hb, _stop) = start(&n, None, Duration::ZERO);
        advance(Duration::from_secs(60)).await;
        assert!(n.stops.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn many_allocs_that_expire_together_all_stop_promptly() {
        let ids: Vec<String> = (0..500).map(|i| format!("a{i:03}")).collect();
        let n = node(&ids.iter().map(|s| (s.as_str(), 3)).collect::<Vec<_>>());
        let t0 = Instant::now();
        let (_hb, _stop) = start(&n, Some(t0), Duration::ZERO);
        advance(Duration::from_millis(3100)).await;
        let stops = n.stops.lock().unwrap().clone();
        assert_eq!(stops.len(), 500);
        assert!(stops
            .iter()
            .all(|(_, at)| *at - t0 < Duration::from_millis(3100)));
    }
}
