//! What a client's alloc watch (`Node.WatchAllocations`) reads of the
//! state: the node's own wake-ups, whether it is still the node the watch
//! was opened for, and its allocs when they changed.

use berth_structs::Allocation;
use tokio::sync::watch;

use crate::server::Server;

/// A node's allocs as of one write.
pub(crate) struct NodeAllocs {
    /// The index of the last write of one of the node's allocs.
    pub(crate) at: u64,
    /// The state's index when they were read.
    pub(crate) index: u64,
    pub(crate) allocs: Vec<Allocation>,
}

impl Server {
    /// Woken by writes of `node_id` and of its allocs only: not by other
    /// nodes' (ten thousand watches are not all woken by each write), not
    /// by the volume stats every node reports, nor by jobs and volumes.
    pub(crate) fn subscribe_node(&self, node_id: &str) -> watch::Receiver<u64> {
        self.store.subscribe_node(node_id)
    }

    /// The create index of `node_id`'s registration, None when it is not
    /// registered: a node purged, or purged and registered anew, has
    /// another (or none).
    pub(crate) fn node_registered_at(&self, node_id: &str) -> Option<u64> {
        self.store
            .read(|t| t.nodes.get(node_id).map(|n| n.create_index))
    }

    /// The allocs of `node_id`, unless none of them was written since
    /// `scanned_at` (a scan is of all its allocs). An alloc that waits
    /// for the claims of the allocs it replaces is not the node's yet.
    pub(crate) fn node_allocs_since(
        &self,
        node_id: &str,
        scanned_at: Option<u64>,
    ) -> Option<NodeAllocs> {
        self.store.read(|t| {
            let at = t.node_allocs_index.get(node_id).copied().unwrap_or(0);
            if scanned_at == Some(at) {
                return None;
            }
            Some(NodeAllocs {
                at,
                index: t.index,
                allocs: t
                    .allocs_on_node(node_id)
                    .filter(|a| !a.waits_for_claims())
                    .cloned()
                    .collect(),
            })
        })
    }
}
