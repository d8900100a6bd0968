//! CSI plugins across the cluster, derived on read from node fingerprints
//! and the allocs of plugin jobs. Nothing about plugins is stored.
//!
//! Expected counts follow Nomad: the number of allocs (not terminal) of jobs
//! whose tasks run the plugin as a node or controller, or the number of
//! fingerprinted instances when that is larger (a plugin run outside berth).

use std::collections::BTreeMap;

use berth_structs::{AllocClientStatus, CsiInfo, CsiPlugin, Node, NodeEvent, NodeStatus};
use serde::Serialize;

use crate::error::ServerError;
use crate::state::Tables;

/// Every plugin, from the state's indexes of the nodes that run one and
/// the allocs that run one: the cost is theirs, not the fleet's.
pub(crate) fn derive_plugins(t: &Tables) -> BTreeMap<String, CsiPlugin> {
    t.plugin_ids()
        .into_iter()
        .map(|id| (id.to_string(), derive_plugin(t, id)))
        .collect()
}

/// Plugin `id` as its node and controller instances and the allocs of
/// plugin jobs show it.
pub(crate) fn derive_plugin(t: &Tables, id: &str) -> CsiPlugin {
    let mut p = CsiPlugin {
        id: id.to_string(),
        ..Default::default()
    };
    let (mut expected_controllers, mut expected_nodes) = (0u32, 0u32);
    for a in t.allocs_running_plugin(id).filter(|a| !a.is_terminal()) {
        let Some(g) = a.group() else { continue };
        for task in &g.tasks {
            if let Some(c) = task.csi_plugin.as_ref().filter(|c| c.id == id) {
                if c.plugin_type.has_controller() {
                    expected_controllers = expected_controllers.saturating_add(1);
                }
                if c.plugin_type.has_node() {
                    expected_nodes = expected_nodes.saturating_add(1);
                }
            }
        }
    }
    for node in t.nodes_with_plugin(id) {
        if let Some(info) = node
            .csi_controller_plugins
            .get(id)
            .filter(|_| t.plugin_instance_allowed(&node.id, id, true))
        {
            p.controllers.insert(node.id.clone(), info.clone());
            absorb(&mut p, node, info);
        }
        if let Some(info) = node
            .csi_node_plugins
            .get(id)
            .filter(|_| t.plugin_instance_allowed(&node.id, id, false))
        {
            p.nodes.insert(node.id.clone(), info.clone());
            absorb(&mut p, node, info);
        }
    }
    let up = |i: &&CsiInfo, node_id: &String| {
        i.healthy
            && t.nodes
                .get(node_id)
                .is_some_and(|n| n.status == NodeStatus::Ready)
    };
    p.controllers_healthy = count_u32(p.controllers.iter().filter(|(n, i)| up(i, n)).count());
    p.nodes_healthy = count_u32(p.nodes.iter().filter(|(n, i)| up(i, n)).count());
    p.controllers_expected = expected_controllers.max(count_u32(p.controllers.len()));
    p.nodes_expected = expected_nodes.max(count_u32(p.nodes.len()));
    // Nomad's meaning: a controller must publish a volume to a node
    // (PUBLISH_UNPUBLISH_VOLUME) before the node can mount it.
    p.controller_required = p
        .controllers
        .values()
        .any(|c| c.requires_controller_publish);
    p
}

/// A count as the API's u32, saturating.
fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
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
    t.nodes_with_plugin(plugin_id).any(|n| {
        n.csi_controller_plugins
            .get(plugin_id)
            .is_some_and(|c| c.requires_controller_publish)
            && t.plugin_instance_allowed(&n.id, plugin_id, true)
    })
}

/// Nodes that run a healthy controller of `plugin_id` and are ready, best
/// first (deterministic order).
pub(crate) fn controller_nodes(t: &Tables, plugin_id: &str) -> Vec<String> {
    t.nodes_with_plugin(plugin_id)
        .filter(|n| n.status == NodeStatus::Ready)
        .filter(|n| {
            n.csi_controller_plugins
                .get(plugin_id)
                .is_some_and(|c| c.healthy)
                && t.plugin_instance_allowed(&n.id, plugin_id, true)
        })
        .map(|n| n.id.clone())
        .collect()
}

/// A plugin with what an operator reads in `plugin status PLUGIN`: what
/// its instances can do, where they run, the allocs that run it and how
/// many volumes use it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PluginStatus {
    #[serde(flatten)]
    pub plugin: CsiPlugin,
    /// What the controller instances can do, in CSI's terms
    /// (`ControllerPublish`, `CreateDelete`, ...): the union over them.
    pub controller_capabilities: Vec<&'static str>,
    /// What the node instances can do (`StageUnstage`, ...).
    pub node_capabilities: Vec<&'static str>,
    /// The nodes that run an instance, by node ID.
    pub instance_nodes: BTreeMap<String, InstanceNode>,
    /// The allocs of the jobs that run the plugin, newest first.
    pub allocations: Vec<PluginAlloc>,
    /// How many volumes name this plugin.
    pub volume_count: usize,
}

/// A node that runs an instance of a plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InstanceNode {
    pub name: String,
    pub status: NodeStatus,
    /// When the node last reported a health change of the plugin (its
    /// last `CSI` node event for it), unix milliseconds; `None` when the
    /// node's kept events have none.
    pub health_changed_ms: Option<i64>,
}

/// An alloc that runs a plugin task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PluginAlloc {
    pub id: String,
    pub name: String,
    pub job_id: String,
    pub task: String,
    pub node_id: String,
    pub node_name: String,
    pub client_status: AllocClientStatus,
    pub create_time_ms: i64,
}

/// The capabilities of a controller instance, in CSI's terms.
pub fn controller_capabilities(info: &CsiInfo) -> Vec<&'static str> {
    [
        (info.requires_controller_publish, "ControllerPublish"),
        (info.supports_create_delete, "CreateDelete"),
        (info.supports_expand, "Expand"),
        (info.supports_snapshots, "Snapshots"),
    ]
    .into_iter()
    .filter_map(|(has, name)| has.then_some(name))
    .collect()
}

/// The capabilities of a node instance, in CSI's terms.
pub fn node_capabilities(info: &CsiInfo) -> Vec<&'static str> {
    [
        (info.supports_stage_unstage, "StageUnstage"),
        (info.supports_expand, "Expand"),
        (info.supports_volume_stats, "VolumeStats"),
        (info.supports_volume_condition, "VolumeCondition"),
    ]
    .into_iter()
    .filter_map(|(has, name)| has.then_some(name))
    .collect()
}

/// What any of `infos` can do, named by `of` in its order.
fn union_of(
    infos: &BTreeMap<String, CsiInfo>,
    of: fn(&CsiInfo) -> Vec<&'static str>,
) -> Vec<&'static str> {
    let any = infos.values().fold(CsiInfo::default(), |mut all, i| {
        all.requires_controller_publish |= i.requires_controller_publish;
        all.supports_create_delete |= i.supports_create_delete;
        all.supports_expand |= i.supports_expand;
        all.supports_snapshots |= i.supports_snapshots;
        all.supports_stage_unstage |= i.supports_stage_unstage;
        all.supports_volume_stats |= i.supports_volume_stats;
        all.supports_volume_condition |= i.supports_volume_condition;
        all
    });
    of(&any)
}

/// The ID of the plugin `given` names among `plugins`: its ID or a
/// unique prefix of it.
fn resolve_plugin<V>(plugins: &BTreeMap<String, V>, given: &str) -> Result<String, ServerError> {
    crate::prefix::resolve(plugins, given, crate::prefix::PLUGIN, crate::prefix::key)?
        .map(|(k, _)| k.clone())
        .ok_or_else(|| {
            ServerError::not_found(format!(
                "CSI plugin {given:?} not found (see `berth plugin status`)"
            ))
        })
}

/// The plugin `given` names in `t` (its ID or a unique prefix), derived
/// alone.
pub(crate) fn resolve_plugin_in(t: &Tables, given: &str) -> Result<CsiPlugin, ServerError> {
    let ids: BTreeMap<String, ()> = t
        .plugin_ids()
        .into_iter()
        .map(|id| (id.to_string(), ()))
        .collect();
    let id = resolve_plugin(&ids, given)?;
    Ok(derive_plugin(t, &id))
}

pub(crate) fn plugin_status_in(t: &Tables, plugin: CsiPlugin) -> PluginStatus {
    let instance_nodes = plugin
        .controllers
        .keys()
        .chain(plugin.nodes.keys())
        .filter_map(|id| t.nodes.get(id))
        .map(|n| {
            let changed = n
                .events
                .iter()
                .filter(|e| {
                    e.subsystem == NodeEvent::SUBSYSTEM_CSI
                        && e.details.get("plugin_id") == Some(&plugin.id)
                })
                .map(|e| e.timestamp)
                .max();
            let node = InstanceNode {
                name: n.name.clone(),
                status: n.status,
                health_changed_ms: changed,
            };
            (n.id.clone(), node)
        })
        .collect();
    let mut allocations: Vec<PluginAlloc> = t
        .allocs_running_plugin(&plugin.id)
        .filter_map(|a| {
            let task = a
                .group()?
                .tasks
                .iter()
                .find(|task| task.csi_plugin.as_ref().is_some_and(|p| p.id == plugin.id))?;
            Some(PluginAlloc {
                id: a.id.clone(),
                name: a.name.clone(),
                job_id: a.job_id.clone(),
                task: task.name.clone(),
                node_id: a.node_id.clone(),
                node_name: t
                    .nodes
                    .get(&a.node_id)
                    .map(|n| n.name.clone())
                    .unwrap_or_default(),
                client_status: a.client_status,
                create_time_ms: a.create_time_ms,
            })
        })
        .collect();
    allocations.sort_by(|a, b| {
        b.create_time_ms
            .cmp(&a.create_time_ms)
            .then_with(|| a.id.cmp(&b.id))
    });
    PluginStatus {
        controller_capabilities: union_of(&plugin.controllers, controller_capabilities),
        node_capabilities: union_of(&plugin.nodes, node_capabilities),
        instance_nodes,
        allocations,
        volume_count: t.volumes_of_plugin(&plugin.id).count(),
        plugin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugins(ids: &[&str]) -> BTreeMap<String, CsiPlugin> {
        ids.iter()
            .map(|id| {
                let p = CsiPlugin {
                    id: id.to_string(),
                    ..Default::default()
                };
                (id.to_string(), p)
            })
            .collect()
    }

    #[test]
    fn a_plugin_is_found_by_id_or_unique_prefix() {
        let all = plugins(&["hostpath", "hostpath-b", "nfs"]);
        assert_eq!(resolve_plugin(&all, "hostpath").unwrap(), "hostpath");
        assert_eq!(resolve_plugin(&all, "nf").unwrap(), "nfs");
        let many = resolve_plugin(&all, "host").unwrap_err();
        assert!(
            many.to_string()
                .contains("matches 2 plugins: \"hostpath\", \"hostpath-b\""),
            "{many}"
        );
        let none = resolve_plugin(&all, "ceph").unwrap_err();
        assert!(matches!(none, ServerError::NotFound(_)), "{none}");
        assert!(matches!(
            resolve_plugin(&all, ""),
            Err(ServerError::NotFound(_))
        ));
    }

    #[test]
    fn capabilities_are_named_and_joined_over_instances() {
        let ctrl = |publish: bool, snapshots: bool| CsiInfo {
            requires_controller_publish: publish,
            supports_snapshots: snapshots,
            supports_create_delete: true,
            ..Default::default()
        };
        let infos: BTreeMap<String, CsiInfo> = [
            ("n1".to_string(), ctrl(false, true)),
            ("n2".to_string(), ctrl(true, false)),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            union_of(&infos, controller_capabilities),
            vec!["ControllerPublish", "CreateDelete", "Snapshots"]
        );
        let node = CsiInfo {
            supports_stage_unstage: true,
            supports_volume_condition: true,
            ..Default::default()
        };
        assert_eq!(
            node_capabilities(&node),
            vec!["StageUnstage", "VolumeCondition"]
        );
    }
}
