//! CSI plugins across the cluster, derived on read from node fingerprints
//! and the allocs of plugin jobs. Nothing about plugins is stored.
//!
//! Expected counts follow Nomad: the number of allocs (not terminal) of jobs
//! whose tasks run the plugin as a node or controller, or the number of
//! fingerprinted instances when that is larger (a plugin run outside berth).

use std::collections::BTreeMap;

use berth_structs::{CsiInfo, CsiPlugin, Node, NodeStatus};

use crate::error::ServerError;
use crate::server::Server;
use crate::state::Tables;

pub(crate) fn derive_plugins(t: &Tables) -> BTreeMap<String, CsiPlugin> {
    let mut plugins: BTreeMap<String, CsiPlugin> = BTreeMap::new();
    let mut expected: BTreeMap<String, (u32, u32)> = BTreeMap::new();
    for a in t.allocs.values().filter(|a| !a.is_terminal()) {
        let Some(g) = a.group() else { continue };
        for task in &g.tasks {
            if let Some(p) = &task.csi_plugin {
                let e = expected.entry(p.id.clone()).or_default();
                if p.plugin_type.has_controller() {
                    e.0 = e.0.saturating_add(1);
                }
                if p.plugin_type.has_node() {
                    e.1 = e.1.saturating_add(1);
                }
            }
        }
    }
    for node in t.nodes.values() {
        for (id, info) in &node.csi_controller_plugins {
            let p = plugin_entry(&mut plugins, id);
            p.controllers.insert(node.id.clone(), info.clone());
            absorb(p, node, info);
        }
        for (id, info) in &node.csi_node_plugins {
            let p = plugin_entry(&mut plugins, id);
            p.nodes.insert(node.id.clone(), info.clone());
            absorb(p, node, info);
        }
    }
    for id in expected.keys() {
        plugin_entry(&mut plugins, id);
    }
    for p in plugins.values_mut() {
        let up = |i: &&CsiInfo, node_id: &String| {
            i.healthy
                && t.nodes
                    .get(node_id)
                    .is_some_and(|n| n.status == NodeStatus::Ready)
        };
        p.controllers_healthy = count_u32(p.controllers.iter().filter(|(n, i)| up(i, n)).count());
        p.nodes_healthy = count_u32(p.nodes.iter().filter(|(n, i)| up(i, n)).count());
        let (ec, en) = expected.get(&p.id).copied().unwrap_or_default();
        p.controllers_expected = ec.max(count_u32(p.controllers.len()));
        p.nodes_expected = en.max(count_u32(p.nodes.len()));
        p.controller_required = p
            .controllers
            .values()
            .any(|c| c.requires_controller_publish || c.supports_create_delete);
    }
    plugins
}

/// A count as the API's u32, saturating.
fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn plugin_entry<'a>(plugins: &'a mut BTreeMap<String, CsiPlugin>, id: &str) -> &'a mut CsiPlugin {
    plugins.entry(id.to_string()).or_insert_with(|| CsiPlugin {
        id: id.to_string(),
        ..Default::default()
    })
}

fn absorb(p: &mut CsiPlugin, node: &Node, info: &CsiInfo) {
    if p.provider.is_empty() || (info.healthy && !info.provider.is_empty()) {
        p.provider = info.provider.clone();
        p.version = info.version.clone();
    }
    p.create_index = if p.create_index == 0 {
        node.create_index
    } else {
        p.create_index.min(node.create_index)
    };
    p.modify_index = p.modify_index.max(node.modify_index);
}

/// Whether volumes of `plugin_id` must be published through a controller:
/// some controller instance says so in its fingerprint.
pub(crate) fn requires_controller_publish(t: &Tables, plugin_id: &str) -> bool {
    t.nodes.values().any(|n| {
        n.csi_controller_plugins
            .get(plugin_id)
            .is_some_and(|c| c.requires_controller_publish)
    })
}

/// Nodes that run a healthy controller of `plugin_id` and are ready, best
/// first (deterministic order).
pub(crate) fn controller_nodes(t: &Tables, plugin_id: &str) -> Vec<String> {
    t.nodes
        .values()
        .filter(|n| n.status == NodeStatus::Ready)
        .filter(|n| {
            n.csi_controller_plugins
                .get(plugin_id)
                .is_some_and(|c| c.healthy)
        })
        .map(|n| n.id.clone())
        .collect()
}

impl Server {
    pub fn plugins(&self) -> Vec<CsiPlugin> {
        self.store
            .read(|t| derive_plugins(t).into_values().collect())
    }

    pub fn plugin(&self, id: &str) -> Result<CsiPlugin, ServerError> {
        self.store
            .read(|t| derive_plugins(t).remove(id))
            .ok_or_else(|| ServerError::not_found(format!("CSI plugin {id:?} not found")))
    }
}
