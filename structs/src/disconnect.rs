//! What becomes of a group's allocs while their node is disconnected: the
//! group `disconnect` block (Nomad's), and the record an alloc keeps while
//! the servers hold it `unknown`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::alloc::{AllocClientStatus, AllocDesiredStatus, Allocation};
use crate::job::{opt_duration, JobType, TaskGroup};

/// A group's `disconnect` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisconnectPolicy {
    /// How long the servers hold an alloc of a disconnected (down) node as
    /// `unknown`, counted from when they mark the node down; then it is
    /// `lost`. None: lost at once (`max_client_disconnect` is its alias).
    #[serde(default, with = "opt_duration")]
    pub lost_after: Option<Duration>,
    /// Whether a replacement is placed while an alloc is `unknown`.
    #[serde(default = "replace_default")]
    pub replace: bool,
    /// Which of an original and its replacement keeps running once the
    /// original's node is back.
    #[serde(default)]
    pub reconcile: ReconcileStrategy,
    /// The client stops the group's allocs once it has been without a
    /// successful heartbeat this long (`stop_after_client_disconnect` is
    /// its alias).
    #[serde(default, with = "opt_duration")]
    pub stop_on_client_after: Option<Duration>,
}

fn replace_default() -> bool {
    true
}

impl Default for DisconnectPolicy {
    fn default() -> DisconnectPolicy {
        DisconnectPolicy {
            lost_after: None,
            replace: true,
            reconcile: ReconcileStrategy::default(),
            stop_on_client_after: None,
        }
    }
}

/// `disconnect { reconcile }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReconcileStrategy {
    /// The one on the node the scheduler ranks higher now; on a tie, the
    /// original.
    #[default]
    BestScore,
    KeepOriginal,
    KeepReplacement,
    /// The one whose tasks have run the longest without a restart.
    LongestRunning,
}

impl ReconcileStrategy {
    pub const ALL: [&'static str; 4] = [
        "best_score",
        "keep_original",
        "keep_replacement",
        "longest_running",
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            ReconcileStrategy::BestScore => "best_score",
            ReconcileStrategy::KeepOriginal => "keep_original",
            ReconcileStrategy::KeepReplacement => "keep_replacement",
            ReconcileStrategy::LongestRunning => "longest_running",
        }
    }
}

impl std::str::FromStr for ReconcileStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "best_score" => ReconcileStrategy::BestScore,
            "keep_original" => ReconcileStrategy::KeepOriginal,
            "keep_replacement" => ReconcileStrategy::KeepReplacement,
            "longest_running" => ReconcileStrategy::LongestRunning,
            other => {
                return Err(format!(
                    "reconcile {other:?} is not one of {}",
                    Self::ALL.join(", ")
                ))
            }
        })
    }
}

/// What the servers do with an alloc of a group whose node went down, as
/// [`TaskGroup::on_disconnect`] works it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnDisconnect {
    /// Held `unknown` this long, then `lost`; None: `lost` at once.
    pub lost_after: Option<Duration>,
    /// A replacement is placed while it is `unknown`.
    pub replace: bool,
    pub reconcile: ReconcileStrategy,
}

impl TaskGroup {
    /// `disconnect { stop_on_client_after }`, or its alias.
    pub fn stop_on_client_after(&self) -> Option<Duration> {
        self.disconnect
            .as_ref()
            .and_then(|d| d.stop_on_client_after)
            .or(self.stop_after_client_disconnect)
    }

    /// What becomes of the group's allocs while their node is down. A
    /// system group is never replaced (it has nowhere else to go) and,
    /// without a `lost_after` of its own, is held `unknown` for
    /// `system_lost_after` (the servers' `default_lost_after`; zero: lost
    /// at once).
    pub fn on_disconnect(&self, job_type: JobType, system_lost_after: Duration) -> OnDisconnect {
        let policy = self.disconnect.clone().unwrap_or_default();
        let own = policy.lost_after.or(self.max_client_disconnect);
        let system = job_type == JobType::System;
        let lost_after = if system {
            own.or(Some(system_lost_after))
        } else {
            own
        };
        OnDisconnect {
            lost_after: lost_after.filter(|d| !d.is_zero()),
            replace: policy.replace && !system,
            reconcile: policy.reconcile,
        }
    }
}

/// While an alloc is `unknown`: since when, until when, and what its
/// client last reported, which it is again when its node comes back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Disconnected {
    /// When (unix ms) the servers marked it `unknown`.
    pub since_ms: i64,
    /// When (unix ms) it becomes `lost` if its node is still down.
    pub lost_at_ms: i64,
    pub previous_status: AllocClientStatus,
    #[serde(default)]
    pub previous_description: String,
}

impl Allocation {
    /// Its node went down (or was purged): it is `lost`. Its client may
    /// still run it, out of the servers' reach, so it is desired `stop`
    /// and replaced (its write claims follow the volume watcher's rule for
    /// lost allocs).
    pub fn mark_lost(&mut self, why: &str) {
        self.client_status = AllocClientStatus::Lost;
        self.client_description = why.into();
        self.desired_status = AllocDesiredStatus::Stop;
        self.desired_description = why.into();
        self.disconnected = None;
    }

    /// Its node went down at `now_ms`: it is held `unknown` for
    /// `lost_after`, keeping its index and its claims, and is what its
    /// client last reported again if the node comes back in time.
    pub fn hold_unknown(&mut self, now_ms: i64, lost_after: Duration) {
        let lost_at_ms =
            now_ms.saturating_add(i64::try_from(lost_after.as_millis()).unwrap_or(i64::MAX));
        self.disconnected = Some(Disconnected {
            since_ms: now_ms,
            lost_at_ms,
            previous_status: self.client_status,
            previous_description: std::mem::take(&mut self.client_description),
        });
        self.client_status = AllocClientStatus::Unknown;
        self.client_description = format!(
            "its node is down; held unknown for up to {} (disconnect lost_after), then lost",
            humantime::format_duration(lost_after)
        );
    }

    /// This `unknown` alloc as it is once its node is back: what its
    /// client last reported (which reports any change since).
    pub fn resumed(&self) -> Allocation {
        let mut a = self.clone();
        match a.disconnected.take() {
            Some(d) => {
                a.client_status = d.previous_status;
                a.client_description = d.previous_description;
            }
            None => {
                a.client_status = AllocClientStatus::Pending;
                a.client_description.clear();
            }
        }
        a
    }
}
