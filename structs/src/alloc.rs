//! Allocations: a task group of a job placed on a node.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::job::{Job, TaskGroup};

/// The words of a claim the servers refuse because they hold the alloc
/// terminal (lost, say, while its node was away): its client ends such an
/// alloc as not started rather than failed.
pub const CLAIM_REFUSED_ALLOC_TERMINAL: &str = "is terminal and cannot claim volume";

/// What the servers want of an alloc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllocDesiredStatus {
    #[default]
    Run,
    Stop,
    Evict,
}

/// What the client reports of an alloc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllocClientStatus {
    #[default]
    Pending,
    Running,
    Complete,
    Failed,
    Lost,
    /// The alloc's node is disconnected (down) and its group holds it
    /// for a while (`disconnect { lost_after }`): it may still run.
    Unknown,
}

impl AllocClientStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            AllocClientStatus::Pending => "pending",
            AllocClientStatus::Running => "running",
            AllocClientStatus::Complete => "complete",
            AllocClientStatus::Failed => "failed",
            AllocClientStatus::Lost => "lost",
            AllocClientStatus::Unknown => "unknown",
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            AllocClientStatus::Complete | AllocClientStatus::Failed | AllocClientStatus::Lost
        )
    }
}

impl std::str::FromStr for AllocClientStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "pending" => AllocClientStatus::Pending,
            "running" => AllocClientStatus::Running,
            "complete" => AllocClientStatus::Complete,
            "failed" => AllocClientStatus::Failed,
            "lost" => AllocClientStatus::Lost,
            "unknown" => AllocClientStatus::Unknown,
            other => return Err(format!("unknown client status {other:?}")),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Allocation {
    pub id: String,
    /// `<job>.<group>[<index>]`.
    pub name: String,
    pub job_id: String,
    /// The job as it was when the alloc was placed; shared by the allocs
    /// placed with one version of it (in memory, not on the wire or on
    /// disk), so that a 10,000-alloc job is held once, not 10,000 times.
    pub job: Arc<Job>,
    pub task_group: String,
    /// The index within its group, used by `per_alloc` volumes.
    #[serde(default)]
    pub index: u32,
    pub node_id: String,
    #[serde(default)]
    pub desired_status: AllocDesiredStatus,
    #[serde(default)]
    pub desired_description: String,
    #[serde(default)]
    pub client_status: AllocClientStatus,
    #[serde(default)]
    pub client_description: String,
    #[serde(default)]
    pub task_states: BTreeMap<String, TaskState>,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
    /// Unix milliseconds.
    #[serde(default)]
    pub create_time_ms: i64,
    #[serde(default)]
    pub modify_time_ms: i64,
    /// For an alloc lost with its node: when (unix ms) the servers last
    /// heard from that node before marking it down; 0 when not known
    /// (`modify_time_ms` is used then, which is later).
    #[serde(default)]
    pub node_last_heartbeat_ms: i64,
    /// While the alloc is `unknown`: see [`crate::Disconnected`].
    #[serde(default)]
    pub disconnected: Option<crate::disconnect::Disconnected>,
    /// Stats of the alloc's CSI volumes as its node last reported them,
    /// by the group's volume name.
    #[serde(default)]
    pub csi_volume_stats: BTreeMap<String, crate::csi::CsiVolumeStats>,
    /// The failed alloc this one replaced, if it is a reschedule.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub previous_allocation: String,
    /// The alloc that replaced this failed one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub next_allocation: String,
    /// The reschedules of its index up to this alloc, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reschedule_events: Vec<crate::reschedule::RescheduleEvent>,
    /// The allocs whose volume claims this one waits for (the allocs it
    /// replaces, stopping): placed, it goes to its node once they are
    /// released.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_for_claims_of: Vec<String>,
    /// The deployment that placed the alloc (or moved it in place), and
    /// its health in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<crate::deployment::AllocDeployment>,
}

impl Allocation {
    pub fn group(&self) -> Option<&TaskGroup> {
        self.job.lookup_group(&self.task_group)
    }

    /// When (unix ms) the alloc's tasks last finished: its failure, for a
    /// failed alloc; the last change when no task says.
    pub fn failed_at_ms(&self) -> i64 {
        self.task_states
            .values()
            .filter_map(|s| s.finished_at_ms)
            .max()
            .unwrap_or(self.modify_time_ms)
    }

    /// Placed, but held back from its node until the volume claims of
    /// the allocs it replaces are released.
    pub fn waits_for_claims(&self) -> bool {
        !self.waiting_for_claims_of.is_empty() && !self.server_terminal()
    }

    /// Terminal on the servers' side or on the client's.
    pub fn is_terminal(&self) -> bool {
        self.client_status.is_terminal() || self.server_terminal()
    }

    /// The servers want it stopped.
    pub fn server_terminal(&self) -> bool {
        matches!(
            self.desired_status,
            AllocDesiredStatus::Stop | AllocDesiredStatus::Evict
        )
    }

    /// Whether `other` is this alloc but for the volume stats and task
    /// usage its node reported and the modify stamps: what its client is
    /// sent of it is the same.
    pub fn same_but_volume_stats(&self, other: &Allocation) -> bool {
        self.same_but(other, false)
    }

    /// Whether `other` is this alloc but for what its node reports of it
    /// (client status and description, task states, volume stats) and
    /// the modify stamps: the servers changed nothing of their own.
    pub fn same_but_node_reports(&self, other: &Allocation) -> bool {
        self.same_but(other, true)
    }

    /// Equal but for the volume stats, the tasks' usage and the modify
    /// stamps, and with `reports` all else the node reports.
    fn same_but(&self, other: &Allocation, reports: bool) -> bool {
        // Destructured so that a new field must say whether it counts.
        let Allocation {
            id,
            name,
            job_id,
            job,
            task_group,
            index,
            node_id,
            desired_status,
            desired_description,
            client_status,
            client_description,
            task_states,
            create_index,
            modify_index: _,
            create_time_ms,
            modify_time_ms: _,
            node_last_heartbeat_ms,
            disconnected,
            csi_volume_stats: _,
            previous_allocation,
            next_allocation,
            reschedule_events,
            waiting_for_claims_of,
            deployment,
        } = self;
        *id == other.id
            && *name == other.name
            && *job_id == other.job_id
            && *task_group == other.task_group
            && *index == other.index
            && *node_id == other.node_id
            && *desired_status == other.desired_status
            && *desired_description == other.desired_description
            && (reports
                || (*client_status == other.client_status
                    && *client_description == other.client_description
                    && same_but_usage(task_states, &other.task_states)))
            && *create_index == other.create_index
            && *create_time_ms == other.create_time_ms
            && *node_last_heartbeat_ms == other.node_last_heartbeat_ms
            && *disconnected == other.disconnected
            && *job == other.job
            && *previous_allocation == other.previous_allocation
            && *next_allocation == other.next_allocation
            && *reschedule_events == other.reschedule_events
            && *waiting_for_claims_of == other.waiting_for_claims_of
            && *deployment == other.deployment
    }
}

/// Whether two sets of task states differ in nothing but the tasks'
/// usage.
fn same_but_usage(a: &BTreeMap<String, TaskState>, b: &BTreeMap<String, TaskState>) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|((na, sa), (nb, sb))| {
            // Destructured so that a new field must say whether it counts.
            let TaskState {
                state,
                failed,
                restarts,
                started_at_ms,
                finished_at_ms,
                events,
                usage: _,
            } = sa;
            na == nb
                && *state == sb.state
                && *failed == sb.failed
                && *restarts == sb.restarts
                && *started_at_ms == sb.started_at_ms
                && *finished_at_ms == sb.finished_at_ms
                && *events == sb.events
        })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TaskStateKind {
    #[default]
    Pending,
    Running,
    Dead,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TaskState {
    pub state: TaskStateKind,
    pub failed: bool,
    #[serde(default)]
    pub restarts: u32,
    #[serde(default)]
    pub started_at_ms: Option<i64>,
    #[serde(default)]
    pub finished_at_ms: Option<i64>,
    #[serde(default)]
    pub events: Vec<TaskEvent>,
    /// What the running task uses, as its cgroup last said (an `exec`
    /// task), reported when it moves materially.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<TaskUsage>,
}

/// What a task uses, sampled from its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TaskUsage {
    pub memory_bytes: u64,
    /// The most it held at once (0 where the kernel does not say).
    pub memory_peak_bytes: u64,
    /// Its hard limit.
    pub memory_limit_bytes: u64,
    /// CPU time since the task started, in nanoseconds.
    pub cpu_total_ns: u64,
    /// CPU it used over the last sample, in thousandths of a core.
    pub cpu_millicores: u64,
    /// Periods the kernel held it back for its CPU share.
    pub throttled_periods: u64,
    /// Unix ms of the sample.
    pub at_ms: i64,
}

/// Task events keep at most this many entries; older ones are dropped.
pub const MAX_TASK_EVENTS: usize = 20;

impl TaskState {
    pub fn push_event(&mut self, event: TaskEvent) {
        self.events.push(event);
        if self.events.len() > MAX_TASK_EVENTS {
            let extra = self.events.len() - MAX_TASK_EVENTS;
            self.events.drain(..extra);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TaskEvent {
    /// `Received`, `Started`, `Terminated`, `Plugin became healthy`, ...
    #[serde(rename = "type")]
    pub event_type: String,
    pub message: String,
    pub time_ms: i64,
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub signal: Option<i32>,
}

impl TaskEvent {
    pub fn new(event_type: impl Into<String>, message: impl Into<String>) -> TaskEvent {
        TaskEvent {
            event_type: event_type.into(),
            message: message.into(),
            time_ms: crate::now_ms(),
            exit_code: None,
            signal: None,
        }
    }
}
