//! The heartbeat loop.

use berth_sync::Shutdown;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Why a heartbeat did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeartbeatError {
    /// The servers do not know this node (e.g. it was garbage-collected
    /// while partitioned): the node must register again.
    #[error("the servers do not know this node; it must register again")]
    NodeUnknown,
    /// The round trip failed; retrying may succeed.
    #[error("heartbeat failed: {0}")]
    Transient(String),
}

/// The heartbeat round trip to the servers.
#[async_trait::async_trait]
pub trait HeartbeatRpc: Send + Sync {
    /// Heartbeats once; returns the TTL within which the servers expect the
    /// next heartbeat.
    async fn heartbeat(&self) -> Result<Duration, HeartbeatError>;
}

/// Registers the node again after the servers answered
/// [`HeartbeatError::NodeUnknown`].
#[async_trait::async_trait]
pub trait NodeRegistrar: Send + Sync {
    async fn reregister(&self) -> Result<(), HeartbeatError>;
}

/// Durable record of the last successful heartbeat (wall clock, Unix
/// milliseconds), so that a restarted client can count a disconnect window
/// from the last heartbeat before the restart. Implementations log their
/// own storage failures.
pub trait LastHeartbeatStore: Send + Sync {
    fn save(&self, unix_ms: i64);
    fn load(&self) -> Option<i64>;
}

#[derive(Debug, Clone)]
pub struct HeartbeatConfig {
    /// Heartbeat after this fraction of the TTL has passed.
    pub ttl_fraction: f64,
    /// The interval is shortened by a random amount up to this fraction of
    /// itself, so that nodes that started together spread out.
    pub jitter_fraction: f64,
    /// Never heartbeat more often than this, whatever the TTL.
    pub min_interval: Duration,
    /// Deadline of one heartbeat round trip.
    pub rpc_timeout: Duration,
    /// First delay after a failure; it doubles with each further failure.
    pub backoff_min: Duration,
    /// Longest delay after failures. The delay is also kept within half of
    /// the last known TTL, so that a brief outage does not cost the node its
    /// liveness.
    pub backoff_max: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        HeartbeatConfig {
            ttl_fraction: 0.5,
            jitter_fraction: 0.1,
            min_interval: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(10),
            backoff_min: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
        }
    }
}

impl HeartbeatConfig {
    /// How long to wait after a successful heartbeat that returned `ttl`.
    fn interval(&self, ttl: Duration) -> Duration {
        let base = ttl.mul_f64(self.ttl_fraction.clamp(0.0, 1.0));
        let jitter = base.mul_f64(self.jitter_fraction.clamp(0.0, 1.0) * random_fraction());
        base.saturating_sub(jitter).max(self.min_interval)
    }

    /// How long to wait after the `failures`th failure in a row.
    fn backoff(&self, failures: u32, last_ttl: Option<Duration>) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let mut max = self.backoff_max;
        if let Some(ttl) = last_ttl {
            max = max.min((ttl / 2).max(self.backoff_min));
        }
        self.backoff_min.saturating_mul(1u32 << exp).min(max)
    }
}

/// A number in `[0, 1)`, random enough for jitter.
fn random_fraction() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(berth_structs::now_ms() as u64);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// The heartbeat loop. Build it with [`Heartbeater::new`], hand out
/// [`Heartbeater::last_success`] receivers, then drive it with
/// [`Heartbeater::run`].
pub struct Heartbeater {
    config: HeartbeatConfig,
    rpc: Arc<dyn HeartbeatRpc>,
    registrar: Arc<dyn NodeRegistrar>,
    store: Arc<dyn LastHeartbeatStore>,
    last_success: watch::Sender<Option<Instant>>,
}

impl Heartbeater {
    /// The last success starts as what `store` recorded before a restart
    /// (mapped onto the monotonic clock), or `None`.
    pub fn new(
        config: HeartbeatConfig,
        rpc: Arc<dyn HeartbeatRpc>,
        registrar: Arc<dyn NodeRegistrar>,
        store: Arc<dyn LastHeartbeatStore>,
    ) -> Heartbeater {
        let restored = store
            .load()
            .map(|ms| instant_of_unix_ms(ms, berth_structs::now_ms()));
        if let Some(at) = restored {
            info!(
                ago_ms = at.elapsed().as_millis() as u64,
                "restored the time of the last successful heartbeat"
            );
        }
        let (last_success, _) = watch::channel(restored);
        Heartbeater {
            config,
            rpc,
            registrar,
            store,
            last_success,
        }
    }

    /// The time of the last successful heartbeat; changes on every success.
    pub fn last_success(&self) -> watch::Receiver<Option<Instant>> {
        self.last_success.subscribe()
    }

    /// Records a round trip to the servers that they count as a heartbeat
    /// (a registration) as the last success, in memory and on disk, as a
    /// heartbeat would be.
    pub fn record_success(&self) {
        self.last_success.send_replace(Some(Instant::now()));
        self.store.save(berth_structs::now_ms());
    }

    /// Heartbeats until `shutdown` becomes true (or its sender is dropped).
    /// The first heartbeat is sent right away.
    pub async fn run(self, mut shutdown: Shutdown) {
        let mut last_ttl: Option<Duration> = None;
        let mut failures: u32 = 0;
        loop {
            if shutdown.is_shutdown() {
                break;
            }
            let started = Instant::now();
            let outcome =
                match tokio::time::timeout(self.config.rpc_timeout, self.rpc.heartbeat()).await {
                    Ok(r) => r,
                    Err(_) => Err(HeartbeatError::Transient(format!(
                        "no answer within {:?}",
                        self.config.rpc_timeout
                    ))),
                };
            let m = berth_metrics::metrics();
            m.heartbeat_duration
                .observe(started.elapsed().as_secs_f64());
            if outcome.is_err() {
                m.heartbeat_failures.inc();
            }
            let next = match outcome {
                Ok(ttl) => {
                    if failures > 0 {
                        info!(failures, "heartbeat succeeded again");
                    }
                    failures = 0;
                    last_ttl = Some(ttl);
                    self.record_success();
                    let next = self.config.interval(ttl);
                    debug!(
                        ttl_ms = ttl.as_millis() as u64,
                        next_ms = next.as_millis() as u64,
                        "heartbeat"
                    );
                    next
                }
                Err(HeartbeatError::NodeUnknown) => {
                    failures += 1;
                    warn!("the servers do not know this node; registering again");
                    match self.registrar.reregister().await {
                        // Heartbeat right away after the first re-registration;
                        // if the node is still unknown after that, back off.
                        Ok(()) if failures == 1 => Duration::ZERO,
                        Ok(()) => self.config.backoff(failures, last_ttl),
                        Err(e) => {
                            let next = self.config.backoff(failures, last_ttl);
                            warn!(error = %e, failures, retry_in_ms = next.as_millis() as u64, "re-registration failed");
                            next
                        }
                    }
                }
                Err(e @ HeartbeatError::Transient(_)) => {
                    failures += 1;
                    let next = self.config.backoff(failures, last_ttl);
                    warn!(error = %e, failures, retry_in_ms = next.as_millis() as u64, "heartbeat failed");
                    next
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                _ = shutdown.wait() => break,
            }
        }
        debug!("heartbeat loop stopped");
    }
}

/// The monotonic instant of wall-clock time `unix_ms`, as seen at `now_ms`.
/// A time before the monotonic clock's origin (the host rebooted since) is
/// clamped to the oldest instant the clock can represent.
fn instant_of_unix_ms(unix_ms: i64, now_ms: i64) -> Instant {
    let ago = Duration::from_millis(now_ms.saturating_sub(unix_ms).max(0) as u64);
    let now = Instant::now();
    if let Some(at) = now.checked_sub(ago) {
        return at;
    }
    // Binary search for the largest representable distance into the past.
    let (mut lo, mut hi) = (0u64, ago.as_millis() as u64);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if now.checked_sub(Duration::from_millis(mid)).is_some() {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    now.checked_sub(Duration::from_millis(lo)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_is_a_jittered_fraction_of_the_ttl() {
        let cfg = HeartbeatConfig::default();
        for _ in 0..100 {
            let i = cfg.interval(Duration::from_secs(10));
            assert!(i <= Duration::from_secs(5), "{i:?}");
            assert!(i >= Duration::from_millis(4500), "{i:?}");
        }
        assert_eq!(cfg.interval(Duration::ZERO), cfg.min_interval);
    }

    #[test]
    fn backoff_doubles_and_stays_within_half_the_ttl() {
        let cfg = HeartbeatConfig::default();
        assert_eq!(cfg.backoff(1, None), Duration::from_secs(1));
        assert_eq!(cfg.backoff(2, None), Duration::from_secs(2));
        assert_eq!(cfg.backoff(3, None), Duration::from_secs(4));
        assert_eq!(cfg.backoff(30, None), Duration::from_secs(30));
        assert_eq!(
            cfg.backoff(30, Some(Duration::from_secs(10))),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn restored_unix_time_maps_to_the_past() {
        let at = instant_of_unix_ms(1_000, 61_000);
        let ago = at.elapsed();
        assert!(ago >= Duration::from_secs(60), "{ago:?}");
        // Far before boot: clamped, not a panic.
        let _ = instant_of_unix_ms(0, i64::MAX / 2);
    }
}
