//! Rescheduling: when a failed alloc of a service or batch job is replaced
//! by a new one (on any node), as Nomad's `reschedule` block says. Each
//! replacement carries the history of the attempts before it, so that
//! the delay grows from one to the next and a limited policy stops.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::job::{humantime_serde_compat, JobType};
use crate::Allocation;

/// How the delay grows from one attempt to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DelayFunction {
    /// The same `delay` every time.
    #[default]
    Constant,
    /// Twice the last delay, up to `max_delay`.
    Exponential,
    /// The sum of the last two delays, up to `max_delay`.
    Fibonacci,
}

impl DelayFunction {
    pub fn as_str(self) -> &'static str {
        match self {
            DelayFunction::Constant => "constant",
            DelayFunction::Exponential => "exponential",
            DelayFunction::Fibonacci => "fibonacci",
        }
    }
}

impl std::str::FromStr for DelayFunction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "constant" => Ok(DelayFunction::Constant),
            "exponential" => Ok(DelayFunction::Exponential),
            "fibonacci" => Ok(DelayFunction::Fibonacci),
            other => Err(format!(
                "delay function {other:?} is not supported (want constant, exponential or fibonacci)"
            )),
        }
    }
}

/// A group's (or a job's) `reschedule` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReschedulePolicy {
    /// Attempts within `interval` (unless `unlimited`).
    pub attempts: u32,
    #[serde(with = "humantime_serde_compat")]
    pub interval: Duration,
    #[serde(with = "humantime_serde_compat")]
    pub delay: Duration,
    pub delay_function: DelayFunction,
    #[serde(with = "humantime_serde_compat")]
    pub max_delay: Duration,
    pub unlimited: bool,
}

impl ReschedulePolicy {
    /// Nomad's defaults: a service job's allocs are replaced without end,
    /// 30 s after the first failure and twice as long after each next one,
    /// up to an hour; a batch job's once a day, after 5 s.
    pub fn default_for(job_type: JobType) -> ReschedulePolicy {
        match job_type {
            JobType::Batch => ReschedulePolicy {
                attempts: 1,
                interval: Duration::from_secs(24 * 60 * 60),
                delay: Duration::from_secs(5),
                delay_function: DelayFunction::Constant,
                max_delay: Duration::from_secs(60 * 60),
                unlimited: false,
            },
            JobType::Service | JobType::System => ReschedulePolicy {
                attempts: 0,
                interval: Duration::ZERO,
                delay: Duration::from_secs(30),
                delay_function: DelayFunction::Exponential,
                max_delay: Duration::from_secs(60 * 60),
                unlimited: true,
            },
        }
    }

    /// Whether an alloc that failed at `failed_at_ms`, after the attempts
    /// `history`, may be replaced: always when unlimited, else while
    /// fewer than `attempts` were made within `interval` before.
    pub fn allows_another(&self, history: &[RescheduleEvent], failed_at_ms: i64) -> bool {
        if self.unlimited {
            return true;
        }
        let since = failed_at_ms.saturating_sub(millis(self.interval));
        let recent = history.iter().filter(|e| e.time_ms > since).count();
        recent < self.attempts as usize
    }

    /// The delay before the next attempt after `history`, for an alloc
    /// that failed at `failed_at_ms`. At `max_delay`, an alloc that ran
    /// longer than that since the last attempt starts again from `delay`
    /// (it had recovered).
    pub fn next_delay(&self, history: &[RescheduleEvent], failed_at_ms: i64) -> Duration {
        let last = |back: usize| {
            history
                .len()
                .checked_sub(back)
                .and_then(|i| history.get(i))
                .map(|e| Duration::from_millis(e.delay_ms))
        };
        let grown = match (self.delay_function, last(1), last(2)) {
            (DelayFunction::Constant, _, _) | (_, None, _) => return self.delay,
            (DelayFunction::Exponential, Some(d), _) => d.saturating_mul(2),
            (DelayFunction::Fibonacci, Some(d), None) => d.saturating_add(self.delay),
            (DelayFunction::Fibonacci, Some(d), Some(e)) => d.saturating_add(e),
        };
        if grown < self.max_delay {
            return grown.max(self.delay);
        }
        let since_last = history
            .last()
            .map_or(0, |e| failed_at_ms.saturating_sub(e.time_ms));
        if since_last > millis(self.max_delay) {
            self.delay
        } else {
            self.max_delay
        }
    }

    /// When (unix ms) failed alloc `a` is to be replaced; None when the
    /// policy allows no more attempts.
    pub fn next_attempt_ms(&self, a: &Allocation) -> Option<i64> {
        let failed_at = a.failed_at_ms();
        if !self.allows_another(&a.reschedule_events, failed_at) {
            return None;
        }
        let delay = self.next_delay(&a.reschedule_events, failed_at);
        Some(failed_at.saturating_add(millis(delay)))
    }

    /// The problems of the policy, as `{at}: reschedule: why`.
    pub fn validate(&self, at: &str, errs: &mut Vec<String>) {
        if !self.unlimited && self.attempts > 0 && self.interval.is_zero() {
            errs.push(format!(
                "{at}: reschedule: attempts need an interval to count them in"
            ));
        }
        if self.delay_function != DelayFunction::Constant && self.max_delay < self.delay {
            errs.push(format!(
                "{at}: reschedule: max_delay must be at least delay for a {} delay",
                self.delay_function.as_str()
            ));
        }
    }
}

/// One replacement of a failed alloc, as the replacement records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RescheduleEvent {
    /// Unix ms of the replacement.
    pub time_ms: i64,
    /// The alloc it replaced, and that alloc's node.
    pub prev_alloc_id: String,
    pub prev_node_id: String,
    /// The delay it waited after the failure.
    pub delay_ms: u64,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(time_ms: i64, delay_s: u64) -> RescheduleEvent {
        RescheduleEvent {
            time_ms,
            delay_ms: delay_s * 1000,
            ..RescheduleEvent::default()
        }
    }

    #[test]
    fn delays_grow_by_their_function_up_to_the_maximum() {
        let mut p = ReschedulePolicy::default_for(JobType::Service);
        let mut history = Vec::new();
        let mut seen = Vec::new();
        for i in 0..10 {
            let d = p.next_delay(&history, i * 1000);
            seen.push(d.as_secs());
            history.push(event(i * 1000, d.as_secs()));
        }
        assert_eq!(seen, [30, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]);
        // Past max_delay since the last attempt: back to the start.
        let later = history.last().unwrap().time_ms + 3_700_000;
        assert_eq!(p.next_delay(&history, later).as_secs(), 30);

        p.delay_function = DelayFunction::Fibonacci;
        let mut history = Vec::new();
        let mut seen = Vec::new();
        for i in 0..6 {
            let d = p.next_delay(&history, i);
            seen.push(d.as_secs());
            history.push(event(i, d.as_secs()));
        }
        assert_eq!(seen, [30, 60, 90, 150, 240, 390]);
        p.delay_function = DelayFunction::Constant;
        assert_eq!(p.next_delay(&history, 0).as_secs(), 30);
    }

    #[test]
    fn a_limited_policy_counts_the_attempts_within_its_interval() {
        let p = ReschedulePolicy::default_for(JobType::Batch);
        let day = 24 * 60 * 60 * 1000;
        assert!(p.allows_another(&[], 0));
        assert!(!p.allows_another(&[event(10, 5)], 20));
        // An attempt older than the interval no longer counts.
        assert!(p.allows_another(&[event(10, 5)], 10 + day + 1));
        let none = ReschedulePolicy {
            attempts: 0,
            ..p.clone()
        };
        assert!(!none.allows_another(&[], 0));
        let mut errs = Vec::new();
        ReschedulePolicy {
            interval: Duration::ZERO,
            ..p
        }
        .validate("group \"g\"", &mut errs);
        assert!(errs[0].contains("need an interval"), "{errs:?}");
    }
}
