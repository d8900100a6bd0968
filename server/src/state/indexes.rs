//! Secondary indexes of the tables: what the servers look up by something
//! other than an object's ID (the allocs of a node or a job, the volumes
//! claimed on a node or by an alloc, the nodes that run a plugin, ...), so
//! that heartbeats, alloc watches, scheduling and reads cost what they
//! touch, not the size of the fleet.
//!
//! They are kept in one place: [`Indexes::put_alloc`] and its siblings,
//! which each record's `Record::index` and `Record::unindex` call as the
//! store applies a change, and [`Indexes::build`], which the store runs
//! over the tables it loads.
//! Each entry is a set of IDs, in ID order, so an indexed lookup yields
//! its objects in the order a scan of the table would.

use std::collections::{BTreeMap, BTreeSet};

use berth_structs::{Allocation, CsiVolume, Node};

use super::Tables;

/// IDs by a key: a key with no ID left is removed.
type Multi = BTreeMap<String, BTreeSet<String>>;

pub(super) fn link(map: &mut Multi, key: &str, id: &str) {
    match map.get_mut(key) {
        Some(ids) => {
            ids.insert(id.to_string());
        }
        None => {
            map.insert(key.to_string(), BTreeSet::from([id.to_string()]));
        }
    }
}

pub(super) fn unlink(map: &mut Multi, key: &str, id: &str) {
    if let Some(ids) = map.get_mut(key) {
        ids.remove(id);
        if ids.is_empty() {
            map.remove(key);
        }
    }
}

/// The IDs `key` has in `map` (none when it has none).
pub(crate) fn ids<'a>(map: &'a Multi, key: &str) -> impl Iterator<Item = &'a String> + 'a {
    map.get(key).into_iter().flatten()
}

/// The secondary indexes of [`Tables`]. Built from the tables and kept up
/// to date by the store's writes; nothing else changes them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Indexes {
    /// Alloc IDs by node ID.
    pub(crate) allocs_by_node: Multi,
    /// Alloc IDs by job ID.
    pub(crate) allocs_by_job: Multi,
    /// Alloc IDs of allocs with a task that runs a CSI plugin, by plugin ID
    /// (every alloc, terminal or not).
    pub(crate) plugin_allocs: Multi,
    /// Volume IDs with a claim (read or write) made on a node, by node ID.
    pub(crate) claims_by_node: Multi,
    /// Volume IDs with a claim of an alloc, by alloc ID.
    pub(crate) claims_by_alloc: Multi,
    /// Volume IDs by plugin ID.
    pub(crate) volumes_by_plugin: Multi,
    /// Node IDs by node name (names need not be unique).
    pub(crate) nodes_by_name: Multi,
    /// Node IDs of nodes that report a node or a controller instance of a
    /// plugin, by plugin ID.
    pub(crate) nodes_by_plugin: Multi,
    /// Deployment IDs by job ID.
    pub(crate) deployments_by_job: Multi,
    /// Node IDs of nodes with a drain strategy.
    pub(crate) draining_nodes: BTreeSet<String>,
    /// What the allocs that are not terminal on each node ask for, by
    /// node ID (nodes with none are left out).
    pub(crate) node_usage: BTreeMap<String, NodeUse>,
}

/// The sums of what a node's allocs that are not terminal ask for (their
/// groups' tasks), in u128 where sums of u64 asks cannot wrap, and how
/// many allocs they are.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NodeUse {
    pub allocs: u64,
    /// MHz.
    pub cpu: u128,
    /// MiB.
    pub memory_mb: u128,
}

impl NodeUse {
    /// What `a` asks for (its group's tasks), as one alloc.
    fn of(a: &Allocation) -> NodeUse {
        let tasks = a.group().into_iter().flat_map(|g| &g.tasks);
        tasks.fold(
            NodeUse {
                allocs: 1,
                ..NodeUse::default()
            },
            |u, t| NodeUse {
                allocs: u.allocs,
                cpu: u.cpu.saturating_add(u128::from(t.resources.cpu)),
                memory_mb: u
                    .memory_mb
                    .saturating_add(u128::from(t.resources.memory_mb)),
            },
        )
    }
}

impl Indexes {
    /// The indexes of `t`, from a scan of its tables.
    pub fn build(t: &Tables) -> Indexes {
        let mut idx = Indexes::default();
        t.index_all(&mut idx);
        idx
    }

    /// `a` is in the allocs table (call [`Indexes::remove_alloc`] with
    /// the old version first when it replaces one).
    pub(crate) fn put_alloc(&mut self, a: &Allocation) {
        link(&mut self.allocs_by_node, &a.node_id, &a.id);
        link(&mut self.allocs_by_job, &a.job_id, &a.id);
        for p in plugins_run_by(a) {
            link(&mut self.plugin_allocs, p, &a.id);
        }
        if !a.is_terminal() {
            let add = NodeUse::of(a);
            let u = self.node_usage.entry(a.node_id.clone()).or_default();
            u.allocs = u.allocs.saturating_add(add.allocs);
            u.cpu = u.cpu.saturating_add(add.cpu);
            u.memory_mb = u.memory_mb.saturating_add(add.memory_mb);
        }
    }

    pub(crate) fn remove_alloc(&mut self, a: &Allocation) {
        unlink(&mut self.allocs_by_node, &a.node_id, &a.id);
        unlink(&mut self.allocs_by_job, &a.job_id, &a.id);
        for p in plugins_run_by(a) {
            unlink(&mut self.plugin_allocs, p, &a.id);
        }
        if !a.is_terminal() {
            let gone = NodeUse::of(a);
            if let Some(u) = self.node_usage.get_mut(&a.node_id) {
                u.allocs = u.allocs.saturating_sub(gone.allocs);
                u.cpu = u.cpu.saturating_sub(gone.cpu);
                u.memory_mb = u.memory_mb.saturating_sub(gone.memory_mb);
                if u.allocs == 0 {
                    self.node_usage.remove(&a.node_id);
                }
            }
        }
    }

    pub(crate) fn put_node(&mut self, n: &Node) {
        link(&mut self.nodes_by_name, &n.name, &n.id);
        for p in n
            .csi_node_plugins
            .keys()
            .chain(n.csi_controller_plugins.keys())
        {
            link(&mut self.nodes_by_plugin, p, &n.id);
        }
        if n.drain_strategy.is_some() {
            self.draining_nodes.insert(n.id.clone());
        }
    }

    pub(crate) fn remove_node(&mut self, n: &Node) {
        unlink(&mut self.nodes_by_name, &n.name, &n.id);
        for p in n
            .csi_node_plugins
            .keys()
            .chain(n.csi_controller_plugins.keys())
        {
            unlink(&mut self.nodes_by_plugin, p, &n.id);
        }
        self.draining_nodes.remove(&n.id);
    }

    pub(crate) fn put_volume(&mut self, v: &CsiVolume) {
        link(&mut self.volumes_by_plugin, &v.plugin_id, &v.id);
        for c in v.claims() {
            link(&mut self.claims_by_node, &c.node_id, &v.id);
            link(&mut self.claims_by_alloc, &c.alloc_id, &v.id);
        }
    }

    pub(crate) fn remove_volume(&mut self, v: &CsiVolume) {
        unlink(&mut self.volumes_by_plugin, &v.plugin_id, &v.id);
        for c in v.claims() {
            unlink(&mut self.claims_by_node, &c.node_id, &v.id);
            unlink(&mut self.claims_by_alloc, &c.alloc_id, &v.id);
        }
    }
}

/// The IDs of the CSI plugins that tasks of `a`'s group run.
fn plugins_run_by(a: &Allocation) -> impl Iterator<Item = &str> {
    a.group()
        .into_iter()
        .flat_map(|g| &g.tasks)
        .filter_map(|t| t.csi_plugin.as_ref().map(|p| p.id.as_str()))
}
