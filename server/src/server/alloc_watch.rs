//! What a client's alloc watch (`Node.WatchAllocations`) reads of the
//! state: the node's own wake-ups, whether it is still the node the watch
//! was opened for, and its allocs when they changed.

use std::collections::{HashMap, HashSet};

use berth_structs::Allocation;
use tokio::sync::watch;

use crate::server::Server;

/// What a scan of a node's allocs found to send.
pub(crate) struct NodeAllocs {
    /// The index of the last write of one of the node's allocs.
    pub(crate) at: u64,
    /// The state's index when they were read.
    pub(crate) index: u64,
    /// The message that brings the watch's client to them; None when
    /// nothing it was sent changed.
    pub(crate) update: Option<WatchUpdate>,
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

    /// What to send the alloc watch of `node_id` that has sent `sent`,
    /// unless none of the node's allocs was written since `scanned_at` (a
    /// scan is of all its allocs; only those sent are copied). An alloc
    /// that waits for the claims of the allocs it replaces is not the
    /// node's yet.
    pub(crate) fn node_allocs_since(
        &self,
        node_id: &str,
        scanned_at: Option<u64>,
        sent: &SentAllocs,
        deltas: bool,
    ) -> Option<NodeAllocs> {
        self.store.read(|t| {
            let at = t.node_allocs_index.get(node_id).copied().unwrap_or(0);
            if scanned_at == Some(at) {
                return None;
            }
            let allocs = t.allocs_on_node(node_id).filter(|a| !a.waits_for_claims());
            Some(NodeAllocs {
                at,
                index: t.index,
                update: sent.next(allocs, deltas),
            })
        })
    }
}

/// What one message of an alloc watch carries.
#[derive(Debug)]
pub(crate) struct WatchUpdate {
    pub(crate) allocs: Vec<Allocation>,
    /// With `delta`: the allocs sent before that are no longer the node's.
    pub(crate) removed: Vec<String>,
    /// Only what changed since the last message; the rest is as sent.
    pub(crate) delta: bool,
}

/// What an alloc watch has sent: each alloc's ID and the modify index it
/// was sent at. None before the first message.
#[derive(Debug, Default)]
pub(crate) struct SentAllocs {
    sent: Option<HashMap<String, u64>>,
}

impl SentAllocs {
    /// The message that brings the client from what was sent to `allocs`,
    /// None when nothing changed (a write of the node alone, or of an
    /// alloc's volume stats). The first message is all of them; then all
    /// of them again when the client did not ask for `deltas`, or only
    /// the new and changed ones and the IDs of those gone.
    pub(crate) fn next<'a>(
        &self,
        allocs: impl Iterator<Item = &'a Allocation>,
        deltas: bool,
    ) -> Option<WatchUpdate> {
        let full = |allocs: Vec<&Allocation>| WatchUpdate {
            allocs: allocs.into_iter().cloned().collect(),
            removed: Vec::new(),
            delta: false,
        };
        let Some(sent) = &self.sent else {
            return Some(full(allocs.collect()));
        };
        let mut now: HashSet<&str> = HashSet::new();
        let mut all = Vec::new();
        let mut changed = Vec::new();
        for a in allocs {
            if sent.get(&a.id) != Some(&a.modify_index) {
                changed.push(a);
            }
            if sent.contains_key(&a.id) {
                now.insert(a.id.as_str());
            }
            if !deltas {
                all.push(a);
            }
        }
        // Every ID sent before that is not among the node's allocs now is
        // gone.
        let removed: Vec<String> = if now.len() == sent.len() {
            Vec::new()
        } else {
            sent.keys()
                .filter(|id| !now.contains(id.as_str()))
                .cloned()
                .collect()
        };
        if changed.is_empty() && removed.is_empty() {
            return None;
        }
        if !deltas {
            return Some(full(all));
        }
        Some(WatchUpdate {
            allocs: changed.into_iter().cloned().collect(),
            removed,
            delta: true,
        })
    }

    /// Records `update` as sent.
    pub(crate) fn sent(&mut self, update: &WatchUpdate) {
        let sent = self.sent.get_or_insert_with(HashMap::new);
        if !update.delta {
            sent.clear();
        }
        for id in &update.removed {
            sent.remove(id);
        }
        for a in &update.allocs {
            match sent.get_mut(&a.id) {
                Some(at) => *at = a.modify_index,
                None => {
                    sent.insert(a.id.clone(), a.modify_index);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(id: &str, modify_index: u64) -> Allocation {
        Allocation {
            id: id.to_string(),
            modify_index,
            ..Allocation::default()
        }
    }

    fn ids(update: &WatchUpdate) -> Vec<String> {
        let mut ids: Vec<String> = update.allocs.iter().map(|a| a.id.clone()).collect();
        ids.sort();
        ids
    }

    #[test]
    fn a_delta_names_the_new_the_changed_and_the_gone_and_nothing_else() {
        let mut sent = SentAllocs::default();
        let first = [alloc("a", 1), alloc("b", 1), alloc("c", 1)];
        let update = sent.next(first.iter(), true).expect("the first message");
        assert!(!update.delta, "the first message is the full set");
        assert_eq!(ids(&update), ["a", "b", "c"]);
        sent.sent(&update);

        assert!(sent.next(first.iter(), true).is_none(), "nothing changed");

        // b changed, c went, d is new.
        let second = [alloc("a", 1), alloc("b", 2), alloc("d", 2)];
        let update = sent.next(second.iter(), true).expect("a change");
        assert!(update.delta);
        assert_eq!(ids(&update), ["b", "d"]);
        assert_eq!(update.removed, ["c"]);
        sent.sent(&update);

        // Gone alone, with the count unchanged by a new one before it.
        let third = [alloc("b", 2), alloc("d", 2)];
        let update = sent.next(third.iter(), true).expect("a removal");
        assert!(update.allocs.is_empty());
        assert_eq!(update.removed, ["a"]);
        sent.sent(&update);
        assert!(sent.next(third.iter(), true).is_none());
    }

    #[test]
    fn without_deltas_every_change_sends_the_full_set() {
        let mut sent = SentAllocs::default();
        let first = [alloc("a", 1), alloc("b", 1)];
        let update = sent.next(first.iter(), false).expect("the first message");
        sent.sent(&update);
        let second = [alloc("b", 2)];
        let update = sent.next(second.iter(), false).expect("a change");
        assert!(!update.delta);
        assert_eq!(ids(&update), ["b"]);
        assert!(update.removed.is_empty(), "a full set names no removals");
        sent.sent(&update);
        assert!(sent.next(second.iter(), false).is_none());
    }
}
