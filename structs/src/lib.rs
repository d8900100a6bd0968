//! The berth data model: jobs, allocations, nodes, CSI volumes, claims and
//! plugins; the checks they pass; and the HCL job and volume specs.
//! [`names`] holds the one rule for names that become paths on a node (the
//! servers and the client both check it) and [`limits`] the largest numbers
//! a job or volume may carry.
//!
//! This crate is plain data. It knows nothing of the client, the servers, the
//! wire protocol or the HTTP API: every other crate speaks in its types.

pub mod acl;
pub mod alloc;
pub mod api;
pub mod constraint;
pub mod csi;
pub mod deployment;
pub mod disconnect;
pub mod durations;
pub mod job;
pub mod limits;
pub mod names;
pub mod node;
pub mod node_secret;
pub mod reschedule;
pub mod secret;
pub mod spec;
pub mod stats;
pub mod task;
pub mod text;
pub mod update;

pub use alloc::*;
pub use constraint::{datacenter_matches, Affinity, Constraint, Operator, Spread, SpreadTarget};
pub use csi::*;
pub use deployment::{AllocDeployment, Deployment, DeploymentGroup, DeploymentStatus};
pub use disconnect::*;
pub use job::*;
pub use names::{check_name, is_valid_name, NameError, NameProblem};
pub use node::*;
pub use node_secret::{NodeSecret, NodeSecretError};
pub use reschedule::{DelayFunction, RescheduleEvent, ReschedulePolicy};
pub use stats::AllocStats;
pub use update::UpdateStrategy;

/// A job or volume that fails its checks. Each entry names what is wrong and
/// where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.join("; "))]
pub struct ValidationError(pub Vec<String>);

/// Unix time in milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A new random ID, as a UUID string.
pub fn generate_id() -> String {
    uuid::Uuid::new_v4().to_string()
}
