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
    pub fn push_events(&mut self, events: impl IntoIterator<Item = NodeEvent>) {
        self.events.extend(events);
        if self.events.len() > MAX_NODE_EVENTS {
            let extra = self.events.len() - MAX_NODE_EVENTS;
            self.events.drain(..extra);
        }
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
    /// Unix milliseconds.
    pub timestamp: i64,
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
        }
    }

    pub fn with_detail(mut self, k: &str, v: impl Into<String>) -> NodeEvent {
        self.details.insert(k.to_string(), v.into());
        self
    }
}
