//! What a client's alloc watch (`Node.WatchAllocations`) reads of the
//! state: the node's own wake-ups, whether it is still the node the watch
//! was opened for, and its allocs when they changed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use berth_structs::{Allocation, Job};
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
    /// With `delta`: the allocs in `allocs` whose job is the one sent with
    /// them before, left out (an empty job in its place).
    pub(crate) same_job: Vec<String>,
    /// Only what changed since the last message; the rest is as sent.
    pub(crate) delta: bool,
}

/// What an alloc watch has sent: each alloc's ID, the modify index it was
/// sent at and the job it was sent with. None before the first message.
#[derive(Debug, Default)]
pub(crate) struct SentAllocs {
    sent: Option<HashMap<String, (u64, Arc<Job>)>>,
}

impl SentAllocs {
    /// The message that brings the client from what was sent to `allocs`,
    /// None when nothing changed (a write of the node alone, or of an
    /// alloc's volume stats). The first message is all of them; then all
    /// of them again when the client did not ask for `deltas`, or only
    /// the new and changed ones (without their job when it is the one
    /// sent before: a change of the alloc's status, most often) and the
    /// IDs of those gone.
    pub(crate) fn next<'a>(
        &self,
        allocs: impl Iterator<Item = &'a Allocation>,
        deltas: bool,
    ) -> Option<WatchUpdate> {
        let full = |allocs: Vec<&Allocation>| WatchUpdate {
            allocs: allocs.into_iter().cloned().collect(),
            removed: Vec::new(),
            same_job: Vec::new(),
            delta: false,
        };
        let Some(sent) = &self.sent else {
            return Some(full(allocs.collect()));
        };
        let mut now: HashSet<&str> = HashSet::new();
        let mut all = Vec::new();
        let mut changed = Vec::new();
        for a in allocs {
            let before = sent.get(&a.id);
            if before.map(|(at, _)| *at) != Some(a.modify_index) {
                changed.push((a, before.map(|(_, job)| job)));
            }
            if before.is_some() {
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
        let mut same_job = Vec::new();
        let allocs = changed
            .into_iter()
            .map(|(a, job_sent)| {
                let mut a = a.clone();
                if job_sent.is_some_and(|j| Arc::ptr_eq(j, &a.job) || *j == a.job) {
                    same_job.push(a.id.clone());
                    a.job = Arc::default();
                }
                a
            })
            .collect();
        Some(WatchUpdate {
            allocs,
            removed,
            same_job,
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
        let same_job: HashSet<&str> = update.same_job.iter().map(String::as_str).collect();
        for a in &update.allocs {
            match sent.get_mut(&a.id) {
                Some((at, _)) if same_job.contains(a.id.as_str()) => *at = a.modify_index,
                Some(entry) => *entry = (a.modify_index, a.job.clone()),
                None => {
                    sent.insert(a.id.clone(), (a.modify_index, a.job.clone()));
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
    fn a_changed_alloc_goes_without_its_job_when_that_is_the_one_sent() {
        let job = |version| {
            Arc::new(Job {
                id: "web".into(),
                version,
                ..Job::default()
            })
        };
        let with_job = |modify_index, job: &Arc<Job>| Allocation {
            job: job.clone(),
            ..alloc("a", modify_index)
        };
        let mut sent = SentAllocs::default();
        let v0 = job(0);
        let update = sent.next([with_job(1, &v0)].iter(), true).expect("first");
        assert_eq!(update.allocs[0].job, v0, "the full set carries the job");
        sent.sent(&update);

        // Its status moved; the job is the same (an equal copy, too).
        let update = sent
            .next([with_job(2, &job(0))].iter(), true)
            .expect("a change");
        assert_eq!(update.same_job, ["a"]);
        assert_eq!(*update.allocs[0].job, Job::default(), "left out");
        sent.sent(&update);

        // A new version of the job goes with it, and is then the one sent.
        let v1 = job(1);
        let update = sent
            .next([with_job(3, &v1)].iter(), true)
            .expect("a change");
        assert!(update.same_job.is_empty());
        assert_eq!(update.allocs[0].job, v1);
        sent.sent(&update);
        let update = sent
            .next([with_job(4, &v1)].iter(), true)
            .expect("a change");
        assert_eq!(update.same_job, ["a"]);
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
