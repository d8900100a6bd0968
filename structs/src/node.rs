//! Nodes and their events.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::csi::CsiInfo;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    #[default]
    Initializing,
    Ready,
    Down,
}

impl NodeStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            NodeStatus::Initializing => "initializing",
            NodeStatus::Ready => "ready",
            NodeStatus::Down => "down",
        }
    }
}

/// Whether the scheduler may place new allocs on a node. An operator sets
/// it (`berth node eligibility`); a drain makes the node ineligible and
/// leaves it so when the drain ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SchedulingEligibility {
    #[default]
    Eligible,
    Ineligible,
}

impl SchedulingEligibility {
    pub fn as_str(&self) -> &'static str {
        match self {
            SchedulingEligibility::Eligible => "eligible",
            SchedulingEligibility::Ineligible => "ineligible",
        }
    }
}

/// A drain in progress: its allocs are moved off the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainStrategy {
    /// How long the drain waits for the node's service and batch allocs to
    /// stop before it stops waiting (zero: a forced drain).
    #[serde(with = "crate::job::humantime_serde_compat")]
    pub deadline: Duration,
    /// Unix milliseconds when the drain stops waiting: the start plus the
    /// deadline.
    pub force_deadline_ms: i64,
    /// Unix milliseconds when the drain started.
    pub started_at_ms: i64,
}

impl DrainStrategy {
    /// A drain starting at `now_ms` with `deadline` (the sum saturates).
    pub fn new(deadline: Duration, now_ms: i64) -> DrainStrategy {
        let deadline_ms = i64::try_from(deadline.as_millis()).unwrap_or(i64::MAX);
        DrainStrategy {
            deadline,
            force_deadline_ms: now_ms.saturating_add(deadline_ms),
            started_at_ms: now_ms,
        }
    }

    /// The deadline has passed at `now_ms`.
    pub fn deadline_passed(&self, now_ms: i64) -> bool {
        now_ms >= self.force_deadline_ms
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeResources {
    /// MHz in total.
    pub cpu: u64,
    /// MiB in total.
    pub memory_mb: u64,
    /// MiB free for allocs on the filesystem of the client's data dir when
    /// the node registered, less `client { reserved { disk } }`. Shown to
    /// operators; no job asks for disk yet, so the scheduler does not
    /// count it.
    #[serde(default)]
    pub disk_mb: u64,
}

impl NodeResources {
    /// Both together, each saturating.
    pub fn plus(&self, other: &NodeResources) -> NodeResources {
        NodeResources {
            cpu: self.cpu.saturating_add(other.cpu),
            memory_mb: self.memory_mb.saturating_add(other.memory_mb),
            disk_mb: self.disk_mb.saturating_add(other.disk_mb),
        }
    }
}

/// A task driver as the client fingerprinted it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DriverInfo {
    /// The driver can run on this node at all.
    pub detected: bool,
    /// It can start tasks now.
    pub healthy: bool,
    /// Why it is (un)healthy, for operators.
    #[serde(default)]
    pub health_description: String,
    /// Unix milliseconds of the fingerprint.
    #[serde(default)]
    pub update_time_ms: i64,
}

impl DriverInfo {
    /// A detected driver that can start tasks.
    pub fn healthy(description: impl Into<String>) -> DriverInfo {
        DriverInfo {
            detected: true,
            healthy: true,
            health_description: description.into(),
            update_time_ms: crate::now_ms(),
        }
    }

    /// A detected driver that cannot start tasks, and why.
    pub fn unhealthy(description: impl Into<String>) -> DriverInfo {
        DriverInfo {
            detected: true,
            healthy: false,
            health_description: description.into(),
            update_time_ms: crate::now_ms(),
        }
    }

    /// The driver can place tasks: detected and healthy.
    pub fn usable(&self) -> bool {
        self.detected && self.healthy
    }
}

/// A CSI volume claimed by an alloc placed on a node: one row of the node
/// view's `csi_volumes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCsiVolume {
    pub volume_id: String,
    pub plugin_id: String,
    pub alloc_id: String,
    pub mode: crate::csi::ClaimMode,
    /// The claim's state (`taken`, `node-detached`, ...).
    pub state: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Node {
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub datacenter: String,
    /// The node's region (`global` when empty: a node of a berth that
    /// did not send one).
    #[serde(default)]
    pub region: String,
    #[serde(default)]
    pub status: NodeStatus,
    #[serde(default)]
    pub resources: NodeResources,
    /// Drivers the client can run: the detected and healthy ones of
    /// `driver_info` (what the scheduler places on).
    #[serde(default)]
    pub drivers: Vec<String>,
    /// Each driver the client knows with its fingerprint: detected,
    /// healthy, why not, and when that was found.
    #[serde(default)]
    pub driver_info: BTreeMap<String, DriverInfo>,
    /// What the node keeps for itself (`client { reserved }`), already
    /// taken off `resources`: the node's total is the sum of the two.
    #[serde(default)]
    pub reserved: NodeResources,
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    /// The operator's class for the node (`client { node_class }`); empty
    /// when none is set.
    #[serde(default)]
    pub node_class: String,
    /// The operator's key/value pairs for the node (`client { meta }`).
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// Fingerprinted CSI node plugins by plugin ID.
    #[serde(default)]
    pub csi_node_plugins: BTreeMap<String, CsiInfo>,
    /// Fingerprinted CSI controller plugins by plugin ID.
    #[serde(default)]
    pub csi_controller_plugins: BTreeMap<String, CsiInfo>,
    #[serde(default)]
    pub events: Vec<NodeEvent>,
    /// Unix milliseconds of the last heartbeat the servers saw.
    #[serde(default)]
    pub last_heartbeat_ms: i64,
    /// Whether new allocs may be placed here (kept by the servers).
    #[serde(default)]
    pub scheduling_eligibility: SchedulingEligibility,
    /// The drain in progress, if any (kept by the servers).
    #[serde(default)]
    pub drain_strategy: Option<DrainStrategy>,
    /// A drain is in progress: `drain_strategy` is set. Shown in the API;
    /// set only through [`Node::set_drain`].
    #[serde(default)]
    pub drain: bool,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

/// Nodes keep at most this many events; older ones are dropped.
pub const MAX_NODE_EVENTS: usize = 50;

/// The desired description of an alloc a drain stopped.
pub const DRAIN_STOP_DESCRIPTION: &str = "node is draining";

/// The node event of a finished drain.
pub const DRAIN_COMPLETE_EVENT: &str = "Node drain complete";

impl Node {
    /// Record events, newest last. An event equal to one already recorded
    /// (same subsystem, message and details) is folded into the newest such
    /// one, which moves to the end with the new time and the counts added:
    /// a path that keeps failing the same way (a retried unmount) leaves one
    /// event, not one per attempt. The oldest beyond [`MAX_NODE_EVENTS`]
    /// are dropped.
    pub fn push_events(&mut self, events: impl IntoIterator<Item = NodeEvent>) {
        for event in events {
            fold_event(&mut self.events, event);
        }
        let extra = self.events.len().saturating_sub(MAX_NODE_EVENTS);
        self.events.drain(..extra);
    }

    /// Take the client's driver fingerprints: `drivers` becomes the
    /// usable ones (detected and healthy), which the scheduler places on.
    pub fn set_driver_info(&mut self, info: BTreeMap<String, DriverInfo>) {
        self.drivers = info
            .iter()
            .filter(|(_, d)| d.usable())
            .map(|(name, _)| name.clone())
            .collect();
        self.driver_info = info;
        // `${attr.driver.NAME}` is "1" for each driver the node can run.
        self.attributes.retain(|k, _| !k.starts_with("driver."));
        for d in &self.drivers {
            self.attributes.insert(format!("driver.{d}"), "1".into());
        }
    }

    /// The node's region: `global` when it sent none.
    pub fn region(&self) -> &str {
        if self.region.is_empty() {
            crate::job::DEFAULT_REGION
        } else {
            &self.region
        }
    }

    /// New allocs may be placed here: eligible and not draining.
    pub fn is_eligible(&self) -> bool {
        self.scheduling_eligibility == SchedulingEligibility::Eligible
            && self.drain_strategy.is_none()
    }

    /// Start, update (`Some`) or end (`None`) a drain. A draining node is
    /// ineligible; ending a drain leaves it ineligible.
    pub fn set_drain(&mut self, strategy: Option<DrainStrategy>) {
        if strategy.is_some() {
            self.scheduling_eligibility = SchedulingEligibility::Ineligible;
        }
        self.drain = strategy.is_some();
        self.drain_strategy = strategy;
    }

    /// Take the fields the servers own (eligibility, drain) from `old`, the
    /// servers' copy of this node.
    pub fn keep_server_fields(&mut self, old: &Node) {
        self.scheduling_eligibility = old.scheduling_eligibility;
        self.drain_strategy = old.drain_strategy;
        self.drain = old.drain_strategy.is_some();
    }

    /// A healthy node plugin for `plugin_id` runs here.
    pub fn has_healthy_node_plugin(&self, plugin_id: &str) -> bool {
        self.csi_node_plugins
            .get(plugin_id)
            .is_some_and(|p| p.healthy)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeEvent {
    /// `Cluster`, `Driver`, `CSI`, `Storage`, ...
    pub subsystem: String,
    pub message: String,
    #[serde(default)]
    pub details: BTreeMap<String, String>,
    /// Unix milliseconds (of the latest occurrence).
    pub timestamp: i64,
    /// How many times this event occurred (equal events are folded).
    #[serde(default = "one")]
    pub count: u64,
}

fn one() -> u64 {
    1
}

/// Append `event` to `events`, or fold it into the newest equal event (see
/// [`NodeEvent::same_as`]), which moves to the end.
pub fn fold_event(events: &mut Vec<NodeEvent>, event: NodeEvent) {
    match events.iter().rposition(|e| e.same_as(&event)) {
        Some(i) => {
            let mut folded = events.remove(i);
            folded.count = folded.count.saturating_add(event.count.max(1));
            folded.timestamp = folded.timestamp.max(event.timestamp);
            events.push(folded);
        }
        None => events.push(event),
    }
}

impl NodeEvent {
    pub const SUBSYSTEM_STORAGE: &'static str = "Storage";
    pub const SUBSYSTEM_CSI: &'static str = "CSI";
    pub const SUBSYSTEM_CLUSTER: &'static str = "Cluster";
    pub const SUBSYSTEM_DRAIN: &'static str = "Drain";
    pub const SUBSYSTEM_DRIVER: &'static str = "Driver";

    pub fn new(subsystem: &str, message: impl Into<String>) -> NodeEvent {
        NodeEvent {
            subsystem: subsystem.to_string(),
            message: message.into(),
            details: BTreeMap::new(),
            timestamp: crate::now_ms(),
            count: 1,
        }
    }

    /// The same event, apart from when and how often it occurred.
    pub fn same_as(&self, other: &NodeEvent) -> bool {
        self.subsystem == other.subsystem
            && self.message == other.message
            && self.details == other.details
    }

    pub fn with_detail(mut self, k: &str, v: impl Into<String>) -> NodeEvent {
        self.details.insert(k.to_string(), v.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(message: &str, error: &str, at: i64) -> NodeEvent {
        NodeEvent {
            timestamp: at,
            ..NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, message)
                .with_detail("volume_id", "data")
                .with_detail("error", error)
        }
    }

    #[test]
    fn equal_events_fold_into_the_newest_with_a_count() {
        let mut node = Node::default();
        node.push_events([event("Unmount volume", "boom", 1)]);
        node.push_events([event("Mount volume", "", 2)]);
        for at in 3..1000 {
            node.push_events([event("Unmount volume", "boom", at)]);
        }
        node.push_events([event("Unmount volume", "other", 1000)]);
        assert_eq!(node.events.len(), 3, "{:?}", node.events);
        let folded = &node.events[1];
        assert_eq!(folded.message, "Unmount volume");
        assert_eq!(folded.details["error"], "boom");
        assert_eq!(folded.count, 998);
        assert_eq!(folded.timestamp, 999, "the time of the latest occurrence");
        assert_eq!(node.events[0].message, "Mount volume");
        assert_eq!(node.events[2].details["error"], "other");
        assert_eq!(node.events[2].count, 1);
    }

    #[test]
    fn distinct_events_beyond_the_cap_drop_the_oldest() {
        let mut node = Node::default();
        node.push_events(
            (0..MAX_NODE_EVENTS + 7).map(|i| event("Unmount volume", &i.to_string(), 0)),
        );
        assert_eq!(node.events.len(), MAX_NODE_EVENTS);
        assert_eq!(node.events[0].details["error"], "7");
    }

    #[test]
    fn an_old_node_record_loads_eligible_and_not_draining() {
        let old: Node = serde_json::from_str(r#"{"id":"n1","name":"n1"}"#).unwrap();
        assert_eq!(old.scheduling_eligibility, SchedulingEligibility::Eligible);
        assert_eq!(old.drain_strategy, None);
        assert!(!old.drain);
        assert!(old.is_eligible());
    }

    #[test]
    fn a_drain_makes_the_node_ineligible_and_its_end_keeps_it_so() {
        let mut node = Node::default();
        let strategy = DrainStrategy::new(Duration::from_secs(3600), 1_000);
        assert_eq!(strategy.force_deadline_ms, 3_601_000);
        node.set_drain(Some(strategy));
        assert!(node.drain);
        assert!(!node.is_eligible());
        let v = serde_json::to_value(&node).unwrap();
        assert_eq!(v["drain"], true);
        assert_eq!(v["scheduling_eligibility"], "ineligible");
        assert_eq!(v["drain_strategy"]["deadline"], "1h");
        node.set_drain(None);
        assert!(!node.drain);
        assert_eq!(
            node.scheduling_eligibility,
            SchedulingEligibility::Ineligible
        );
        // A deadline too far to add saturates.
        let far = DrainStrategy::new(Duration::MAX, i64::MAX - 1);
        assert_eq!(far.force_deadline_ms, i64::MAX);
        assert!(!far.deadline_passed(i64::MAX - 1));
    }

    #[test]
    fn an_old_node_record_loads_without_driver_info_or_reservations() {
        let old: Node =
            serde_json::from_str(r#"{"id":"n1","name":"n1","drivers":["raw_exec"]}"#).unwrap();
        assert_eq!(old.drivers, ["raw_exec"]);
        assert!(old.driver_info.is_empty());
        assert_eq!(old.reserved, NodeResources::default());
        let info = DriverInfo::unhealthy("no executor");
        assert!(!info.usable());
        let mut node = old.clone();
        node.set_driver_info(BTreeMap::from([
            ("raw_exec".to_string(), info.clone()),
            ("exec".to_string(), DriverInfo::healthy("Healthy")),
        ]));
        assert_eq!(node.drivers, ["exec"], "only usable drivers get tasks");
        let v = serde_json::to_value(&info).unwrap();
        assert_eq!(v["detected"], true);
        assert_eq!(v["healthy"], false);
        assert_eq!(v["health_description"], "no executor");
    }

    #[test]
    fn count_defaults_to_one_and_is_serialized() {
        let old: NodeEvent = serde_json::from_str(
            r#"{"subsystem":"Cluster","message":"Node registered","timestamp":5}"#,
        )
        .unwrap();
        assert_eq!(old.count, 1);
        let v = serde_json::to_value(&old).unwrap();
        assert_eq!(v["count"], 1);
    }
}
