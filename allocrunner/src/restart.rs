//! The restart policy of a task group, applied to one task's exits.

use std::time::Duration;

use berth_structs::{JobType, RestartPolicy};
use tokio::time::Instant;

use crate::driver::ExitResult;

/// What to do after a task exited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestartDecision {
    /// Start it again after the delay.
    Restart(Duration),
    /// The task is done and did what it should (a batch task exiting 0).
    Complete,
    /// The task is done and failed; the message says why it is not
    /// restarted.
    Fail(String),
}

/// Counts restarts within the policy's interval.
#[derive(Debug)]
pub struct RestartTracker {
    policy: RestartPolicy,
    job_type: JobType,
    interval_start: Option<Instant>,
    count: u32,
}

impl RestartTracker {
    pub fn new(policy: RestartPolicy, job_type: JobType) -> RestartTracker {
        RestartTracker {
            policy,
            job_type,
            interval_start: None,
            count: 0,
        }
    }

    /// Batch tasks that exit 0 are complete; every other exit counts
    /// against `attempts` within `interval`. Beyond it, mode `fail` fails
    /// the task and mode `delay` waits out the interval and restarts.
    pub fn on_exit(&mut self, exit: &ExitResult, now: Instant) -> RestartDecision {
        if self.job_type == JobType::Batch && exit.successful() {
            return RestartDecision::Complete;
        }
        let start = *self.interval_start.get_or_insert(now);
        if now.duration_since(start) >= self.policy.interval {
            self.interval_start = Some(now);
            self.count = 0;
        }
        self.count += 1;
        if self.count <= self.policy.attempts {
            return RestartDecision::Restart(self.policy.delay);
        }
        if self.policy.mode == "delay" {
            let start = self.interval_start.unwrap_or(now);
            // An interval too long to add (a huge configured value) waits
            // as long as an Instant can say.
            let wait = start
                .checked_add(self.policy.interval)
                .map_or(self.policy.interval, |end| {
                    end.saturating_duration_since(now)
                })
                .max(self.policy.delay);
            self.interval_start = None;
            self.count = 0;
            return RestartDecision::Restart(wait);
        }
        RestartDecision::Fail(format!(
            "Exceeded allowed attempts {} in interval {} and mode is \"{}\"",
            self.policy.attempts,
            humanize(self.policy.interval),
            self.policy.mode
        ))
    }

    /// A failure that restarting will not fix (the command is missing).
    pub fn unrecoverable(&self) -> RestartDecision {
        RestartDecision::Fail("Error was unrecoverable".into())
    }
}

fn humanize(d: Duration) -> String {
    let minutes = d.as_secs() / 60;
    if minutes > 0 && Duration::from_secs(minutes * 60) == d {
        format!("{minutes}m")
    } else {
        format!("{d:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(code: i32) -> ExitResult {
        ExitResult {
            exit_code: Some(code),
            ..ExitResult::default()
        }
    }

    fn policy(attempts: u32, mode: &str) -> RestartPolicy {
        RestartPolicy {
            attempts,
            interval: Duration::from_secs(60),
            delay: Duration::from_secs(1),
            mode: mode.into(),
        }
    }

    #[test]
    fn batch_success_completes_and_failures_count() {
        let mut t = RestartTracker::new(policy(2, "fail"), JobType::Batch);
        let now = Instant::now();
        assert_eq!(t.on_exit(&exit(0), now), RestartDecision::Complete);
        let d = Duration::from_secs(1);
        assert_eq!(t.on_exit(&exit(1), now), RestartDecision::Restart(d));
        assert_eq!(t.on_exit(&exit(1), now), RestartDecision::Restart(d));
        assert!(
            matches!(t.on_exit(&exit(1), now), RestartDecision::Fail(m) if m.contains("Exceeded allowed attempts 2"))
        );
    }

    #[test]
    fn service_exits_restart_and_the_interval_resets_the_count() {
        let mut t = RestartTracker::new(policy(1, "fail"), JobType::Service);
        let now = Instant::now();
        assert!(matches!(
            t.on_exit(&exit(0), now),
            RestartDecision::Restart(_)
        ));
        let later = now + Duration::from_secs(61);
        assert!(matches!(
            t.on_exit(&exit(1), later),
            RestartDecision::Restart(_)
        ));
        assert!(matches!(
            t.on_exit(&exit(1), later),
            RestartDecision::Fail(_)
        ));
    }

    #[test]
    fn delay_mode_waits_out_the_interval() {
        let mut t = RestartTracker::new(policy(0, "delay"), JobType::Service);
        let now = Instant::now();
        assert_eq!(
            t.on_exit(&exit(1), now),
            RestartDecision::Restart(Duration::from_secs(60))
        );
    }

    #[test]
    fn a_huge_interval_in_delay_mode_does_not_overflow() {
        let huge = RestartPolicy {
            interval: Duration::MAX,
            ..policy(0, "delay")
        };
        let mut t = RestartTracker::new(huge, JobType::Service);
        let now = Instant::now();
        assert!(matches!(
            t.on_exit(&exit(1), now),
            RestartDecision::Restart(d) if d >= Duration::from_secs(1)
        ));
    }
}
