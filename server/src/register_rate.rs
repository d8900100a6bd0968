//! How often one peer address may call `Node.Register`: a token bucket per
//! address (`limits { node_register_rate_per_client,
//! node_register_burst_per_client }`).
//!
//! A registration that passes the checks is a durable write of the node,
//! and one that fails them still costs a secret comparison; a peer that
//! registers in a loop (a stranger trying IDs, an enrolled node gone
//! wrong) would otherwise hold the store's writer for as long as it
//! pleases. A real client registers when it starts, when its drivers
//! change and when the servers forget it: a burst of a few, then seldom.
//! The limit is checked first, before anything of the request is looked
//! at. A refused call is `ResourceExhausted` with the wait, which clients
//! retry after their backoff.
//!
//! Memory is bounded: a bucket that has refilled is worth nothing (a new
//! one is the same), so such buckets are dropped whenever the map grows
//! past [`SWEEP_AT`] entries; the map holds only addresses that
//! registered recently.

use berth_sync::MutexExt;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Past this many tracked addresses, refilled buckets are dropped.
const SWEEP_AT: usize = 4096;

/// The limit: `burst` registrations at once, then `rate` per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RegisterRate {
    pub rate: f64,
    pub burst: u32,
}

impl Default for RegisterRate {
    /// Generous for one node (a restart, a driver change, a server that
    /// forgot it), tight for a loop.
    fn default() -> Self {
        RegisterRate {
            rate: 10.0,
            burst: 100,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The buckets of the peers that registered lately.
#[derive(Debug)]
pub(crate) struct RegisterLimiter {
    limit: RegisterRate,
    buckets: Mutex<HashMap<IpAddr, Bucket>>,
}

impl RegisterLimiter {
    pub(crate) fn new(limit: RegisterRate) -> RegisterLimiter {
        RegisterLimiter {
            limit,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one registration for `peer` at `now`; `Err(wait)` when its
    /// bucket is empty, with how long until the next one is allowed.
    pub(crate) fn take(&self, peer: IpAddr, now: Instant) -> Result<(), Duration> {
        let burst = f64::from(self.limit.burst.max(1));
        let rate = self.limit.rate.max(f64::MIN_POSITIVE);
        let mut buckets = self.buckets.locked();
        if buckets.len() >= SWEEP_AT && !buckets.contains_key(&peer) {
            buckets.retain(|_, b| refilled(b, now, rate, burst) < burst);
        }
        let b = buckets.entry(peer).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        b.tokens = refilled(b, now, rate, burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / rate))
        }
    }

    /// The limit in force.
    pub(crate) fn limit(&self) -> RegisterRate {
        self.limit
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.buckets.lock().map(|b| b.len()).unwrap_or(0)
    }
}

/// The tokens of `b` at `now`.
fn refilled(b: &Bucket, now: Instant, rate: f64, burst: f64) -> f64 {
    let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
    (b.tokens + elapsed * rate).min(burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_peer_gets_its_burst_then_the_rate() {
        let l = RegisterLimiter::new(RegisterRate {
            rate: 2.0,
            burst: 3,
        });
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(l.take(ip(1), t0), Ok(()));
        }
        let wait = l.take(ip(1), t0).expect_err("the burst is spent");
        assert!(
            wait > Duration::from_millis(400) && wait <= Duration::from_millis(500),
            "{wait:?}"
        );
        // Another address has its own bucket.
        assert_eq!(l.take(ip(2), t0), Ok(()));
        // Half a second later one more is allowed, and only one.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(l.take(ip(1), t1), Ok(()));
        assert!(l.take(ip(1), t1).is_err());
        // A long pause refills to the burst, not beyond.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..3 {
            assert_eq!(l.take(ip(1), t2), Ok(()));
        }
        assert!(l.take(ip(1), t2).is_err());
    }

    #[test]
    fn refilled_buckets_are_dropped_when_many_peers_registered() {
        let l = RegisterLimiter::new(RegisterRate {
            rate: 1.0,
            burst: 2,
        });
        let t0 = Instant::now();
        for i in 0..SWEEP_AT {
            let peer = IpAddr::from([10, 1, (i / 256) as u8, (i % 256) as u8]);
            l.take(peer, t0).expect("a first registration");
        }
        // The last peer spends its whole burst: its bucket is worth keeping.
        let busy = IpAddr::from([10, 9, 9, 9]);
        l.take(busy, t0).expect("first");
        l.take(busy, t0).expect("second");
        let later = t0 + Duration::from_millis(1500);
        l.take(ip(7), later).expect("a new peer");
        // Everyone who had refilled by then is gone: the new peer and the
        // busy one (at 1.5 of 2 tokens) stay.
        assert_eq!(l.tracked(), 2);
        assert!(l.take(busy, later).is_ok());
        assert!(
            l.take(busy, later).is_err(),
            "the busy peer's bucket survived the sweep"
        );
    }
}
