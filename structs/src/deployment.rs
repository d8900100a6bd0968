//! Deployments: how one version of a service job with an `update` block
//! rolls out (Nomad's object and names). The scheduler opens one when a
//! version places allocs, tags the allocs it places (and the ones it
//! moves in place) with it, notes each one's health, and ends it:
//! successful once every group runs its count of healthy allocs of the
//! version, failed on an unhealthy alloc, a missed progress deadline or
//! an operator's `deployment fail`, cancelled when a newer version or a
//! stop supersedes it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DeploymentStatus {
    #[default]
    Running,
    Successful,
    Failed,
    Cancelled,
}

impl DeploymentStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            DeploymentStatus::Running => "running",
            DeploymentStatus::Successful => "successful",
            DeploymentStatus::Failed => "failed",
            DeploymentStatus::Cancelled => "cancelled",
        }
    }

    /// Whether the deployment still rolls (no end reached).
    pub fn is_active(&self) -> bool {
        *self == DeploymentStatus::Running
    }
}

/// The description of a deployment that succeeded.
pub const DESC_SUCCESSFUL: &str = "Deployment completed successfully";
/// The description of a deployment that an unhealthy alloc failed.
pub const DESC_UNHEALTHY: &str = "Failed due to unhealthy allocations";
/// The description of a deployment that missed its progress deadline.
pub const DESC_PROGRESS: &str = "Failed due to progress deadline";
/// The description of a deployment an operator failed.
pub const DESC_FAILED_BY_USER: &str = "Deployment marked as failed";
/// The description of a deployment a newer version superseded.
pub const DESC_NEWER_JOB: &str = "Cancelled because a newer version of the job was submitted";
/// The description of a deployment of a stopped job.
pub const DESC_STOPPED_JOB: &str = "Cancelled because the job is stopped";
/// The description while canaries wait for `deployment promote`.
pub const DESC_NEEDS_PROMOTION: &str = "Deployment is running but requires manual promotion";

/// One rollout of a job version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Deployment {
    pub id: String,
    pub job_id: String,
    pub job_version: u64,
    pub status: DeploymentStatus,
    pub status_description: String,
    /// The groups with an `update` block, by name.
    pub groups: BTreeMap<String, DeploymentGroup>,
    /// The version the job was reverted to when this deployment failed
    /// with `auto_revert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverted_to: Option<u64>,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
    /// Unix milliseconds.
    #[serde(default)]
    pub create_time_ms: i64,
    #[serde(default)]
    pub modify_time_ms: i64,
}

/// What a deployment tracks of one group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DeploymentGroup {
    /// The group's count.
    pub desired_total: u32,
    pub desired_canaries: u32,
    /// The canary allocs placed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placed_canaries: Vec<String>,
    /// Canaries were promoted (or none were asked for).
    pub promoted: bool,
    pub auto_revert: bool,
    pub auto_promote: bool,
    /// Allocs of the deployment placed (or moved in place) so far.
    pub placed_allocs: u32,
    pub healthy_allocs: u32,
    pub unhealthy_allocs: u32,
    /// Unix ms by which an alloc must turn healthy (0: no deadline).
    pub require_progress_by_ms: i64,
}

impl Deployment {
    /// Whether a group still waits for `deployment promote`.
    pub fn needs_promotion(&self) -> bool {
        self.status.is_active()
            && self
                .groups
                .values()
                .any(|g| g.desired_canaries > 0 && !g.promoted)
    }

    /// Whether any group reverts the job when the deployment fails.
    pub fn auto_reverts(&self) -> bool {
        self.groups.values().any(|g| g.auto_revert)
    }
}

/// An alloc's part in a deployment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct AllocDeployment {
    pub id: String,
    /// A canary: placed beside the allocs of the older version, which
    /// stay until the deployment is promoted.
    #[serde(default)]
    pub canary: bool,
    /// Healthy (`Some(true)`) or unhealthy, once it is known.
    #[serde(default)]
    pub healthy: Option<bool>,
    /// Unix ms the health was known.
    #[serde(default)]
    pub health_at_ms: i64,
}
