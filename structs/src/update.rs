//! The `update` block: how a destructive change of a job rolls through a
//! group's allocs (Nomad's names and defaults). Without one, the old
//! allocs are all replaced at once.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::job::humantime_serde_compat;
use crate::Allocation;

/// The health check berth runs: every task running for
/// `min_healthy_time` (berth has no service checks).
pub const HEALTH_CHECK_TASK_STATES: &str = "task_states";

/// A group's (or a job's) `update` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateStrategy {
    /// How many allocs are replaced at a time; 0 replaces them all at
    /// once.
    pub max_parallel: u32,
    /// How long every task of a new alloc must run before it is healthy.
    #[serde(with = "humantime_serde_compat")]
    pub min_healthy_time: Duration,
    /// A new alloc not healthy this long after it was placed is
    /// unhealthy.
    #[serde(with = "humantime_serde_compat")]
    pub healthy_deadline: Duration,
    /// The update fails when no alloc turned healthy for this long.
    #[serde(with = "humantime_serde_compat")]
    pub progress_deadline: Duration,
    pub auto_revert: bool,
    pub auto_promote: bool,
    pub canary: u32,
    #[serde(with = "humantime_serde_compat")]
    pub stagger: Duration,
    pub health_check: String,
}

impl Default for UpdateStrategy {
    fn default() -> Self {
        UpdateStrategy {
            max_parallel: 1,
            min_healthy_time: Duration::from_secs(10),
            healthy_deadline: Duration::from_secs(5 * 60),
            progress_deadline: Duration::from_secs(10 * 60),
            auto_revert: false,
            auto_promote: false,
            canary: 0,
            stagger: Duration::from_secs(30),
            health_check: HEALTH_CHECK_TASK_STATES.into(),
        }
    }
}

impl UpdateStrategy {
    /// Whether the update rolls (replaces at most `max_parallel` at a
    /// time).
    pub fn rolls(&self) -> bool {
        self.max_parallel > 0
    }

    /// When (unix ms) alloc `a` is or will be healthy: every task of it
    /// running since that long ago; None while a task is not running.
    pub fn healthy_at_ms(&self, a: &Allocation) -> Option<i64> {
        if a.client_status != crate::AllocClientStatus::Running || a.task_states.is_empty() {
            return None;
        }
        let mut latest = 0i64;
        for s in a.task_states.values() {
            if s.state != crate::TaskStateKind::Running {
                return None;
            }
            latest = latest.max(s.started_at_ms?);
        }
        let wait = i64::try_from(self.min_healthy_time.as_millis()).unwrap_or(i64::MAX);
        Some(latest.saturating_add(wait))
    }

    /// The problems of the block, as `{at}: update: why`.
    pub fn validate(&self, at: &str, errs: &mut Vec<String>) {
        let mut problem = |why: &str| errs.push(format!("{at}: update: {why}"));
        if self.health_check != HEALTH_CHECK_TASK_STATES {
            problem("health_check must be \"task_states\" (berth runs no service checks)");
        }
        if self.auto_promote && self.canary == 0 {
            problem("auto_promote needs canary > 0 (it promotes the canaries)");
        }
        if self.canary > 0 && !self.rolls() {
            problem("canary needs max_parallel > 0");
        }
        if self.rolls() && self.healthy_deadline <= self.min_healthy_time {
            problem("healthy_deadline must be longer than min_healthy_time");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AllocClientStatus, TaskState, TaskStateKind};

    #[test]
    fn an_alloc_is_healthy_once_every_task_ran_for_min_healthy_time() {
        let u = UpdateStrategy {
            min_healthy_time: Duration::from_secs(2),
            ..UpdateStrategy::default()
        };
        let task = |state, started| TaskState {
            state,
            failed: false,
            restarts: 0,
            started_at_ms: started,
            finished_at_ms: None,
            events: Vec::new(),
            usage: None,
        };
        let mut a = Allocation {
            client_status: AllocClientStatus::Running,
            ..Allocation::default()
        };
        a.task_states
            .insert("a".into(), task(TaskStateKind::Running, Some(1_000)));
        a.task_states
            .insert("b".into(), task(TaskStateKind::Running, Some(4_000)));
        assert_eq!(u.healthy_at_ms(&a), Some(6_000));
        a.task_states
            .insert("c".into(), task(TaskStateKind::Pending, None));
        assert_eq!(u.healthy_at_ms(&a), None);
        let mut errs = Vec::new();
        UpdateStrategy {
            auto_promote: true,
            health_check: "checks".into(),
            ..u
        }
        .validate("group \"g\"", &mut errs);
        assert_eq!(errs.len(), 2, "{errs:?}");
    }
}
