//! A running task's usage, sampled from its driver (an `exec` task's
//! cgroup) every [`crate::config::AllocRunnerConfig::stats_interval`], and
//! reported only when it moves materially (or once a minute, so that it
//! is never stale for long): a busy node's tasks do not each send an
//! update every second.

use std::time::Duration;

use berth_structs::TaskUsage;

use crate::cgroups::Usage;

/// A sample is reported at least this often while the task runs.
const REPORT_AT_LEAST_EVERY: Duration = Duration::from_secs(60);

/// What the sampler keeps between two samples.
#[derive(Debug, Default)]
pub(crate) struct Sampler {
    /// The last sample, and when it was taken (unix ms).
    last: Option<(Usage, i64)>,
    /// The last sample reported.
    reported: Option<TaskUsage>,
}

impl Sampler {
    /// A new sample `now` taken at `now_ms`, and whether it is to be
    /// reported.
    pub(crate) fn sample(&mut self, now: Usage, limit: u64, now_ms: i64) -> (TaskUsage, bool) {
        let cpu_millicores = match self.last {
            Some((before, at)) if now_ms > at => {
                let used = now.cpu_ns.saturating_sub(before.cpu_ns);
                let elapsed_ns = u64::try_from(now_ms - at)
                    .unwrap_or(0)
                    .saturating_mul(1_000_000);
                used.saturating_mul(1000)
                    .checked_div(elapsed_ns)
                    .unwrap_or(0)
            }
            _ => 0,
        };
        self.last = Some((now, now_ms));
        let usage = TaskUsage {
            memory_bytes: now.memory_bytes,
            memory_peak_bytes: now.memory_peak_bytes,
            memory_limit_bytes: limit,
            cpu_total_ns: now.cpu_ns,
            cpu_millicores,
            throttled_periods: now.throttled_periods,
            at_ms: now_ms,
        };
        let report = match &self.reported {
            None => true,
            Some(r) => material(r, &usage),
        };
        if report {
            self.reported = Some(usage);
        }
        (usage, report)
    }
}

/// Whether `now` differs enough from what was `reported` to report it:
/// memory by a tenth or 4 MiB, CPU by a fifth or 50 millicores, or a
/// minute has passed.
fn material(reported: &TaskUsage, now: &TaskUsage) -> bool {
    let apart =
        |a: u64, b: u64, share: u64, floor: u64| a.abs_diff(b) >= floor.max(a.max(b) / share);
    let stale = now.at_ms.saturating_sub(reported.at_ms)
        >= i64::try_from(REPORT_AT_LEAST_EVERY.as_millis()).unwrap_or(i64::MAX);
    stale
        || apart(reported.memory_bytes, now.memory_bytes, 10, 4 << 20)
        || apart(reported.cpu_millicores, now.cpu_millicores, 5, 50)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(memory_mib: u64, cpu_ms: u64) -> Usage {
        Usage {
            memory_bytes: memory_mib << 20,
            cpu_ns: cpu_ms * 1_000_000,
            ..Usage::default()
        }
    }

    #[test]
    fn samples_are_reported_when_they_move_materially_or_a_minute_passed() {
        let mut s = Sampler::default();
        let (first, reported) = s.sample(usage(10, 0), 64 << 20, 1_000);
        assert!(reported, "the first is reported");
        assert_eq!(
            (first.memory_bytes, first.memory_limit_bytes),
            (10 << 20, 64 << 20)
        );
        // Half a core over a second: 500 millicores, a material change.
        let (busy, reported) = s.sample(usage(10, 500), 64 << 20, 2_000);
        assert!(reported, "cpu moved");
        assert_eq!(busy.cpu_millicores, 500);
        // The same again, and a little more memory: nothing to say.
        let (quiet, reported) = s.sample(usage(11, 1_000), 64 << 20, 3_000);
        assert!(!reported);
        assert_eq!(quiet.memory_bytes, 11 << 20, "kept, though not reported");
        // 100 MiB more: said.
        let (grown, reported) = s.sample(usage(111, 1_500), 64 << 20, 4_000);
        assert!(reported, "memory moved");
        assert_eq!(grown.memory_bytes, 111 << 20);
        // Still, a minute on: said again.
        assert!(!s.sample(usage(111, 2_000), 64 << 20, 5_000).1);
        assert!(s.sample(usage(111, 61_500), 64 << 20, 64_000).1);
    }
}
