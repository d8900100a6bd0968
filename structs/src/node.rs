//! Nodes and their events.

use std::collections::BTreeMap;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeResources {
    /// MHz in total.
    pub cpu: u64,
    /// MiB in total.
    pub memory_mb: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Node {
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub datacenter: String,
    #[serde(default)]
    pub status: NodeStatus,
    #[serde(default)]
    pub resources: NodeResources,
    /// Drivers the client can run.
    #[serde(default)]
    pub drivers: Vec<String>,
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
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

/// Nodes keep at most this many events; older ones are dropped.
pub const MAX_NODE_EVENTS: usize = 50;

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
