//! The bytes of agent-protocol messages that peers announced and have not
//! yet wholly sent, per peer address and in all: what
//! [`crate::rpc::limits`] charges as a message's header arrives and gives
//! back once its last byte has (or its stream ends). A message that does
//! not fit is refused, so no peer, and no crowd of them, makes the agent
//! hold more than these budgets.

use berth_sync::MutexExt;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// The largest reply of a call on the call stream (a node-local HTTP
/// answer), with its envelope.
pub const CALL_REPLY: usize = berth_proto::berth::v1::MAX_CLIENT_HTTP_ANSWER + 64 * KIB;

/// How many bytes of announced, not yet received messages one peer
/// address may hold: the largest update of allocs and some more.
pub const PEER_PARTIAL_BYTES: usize = 24 * MIB;
/// How many all peers together may hold: a few call-stream replies (which
/// count here only) besides the peers' messages.
pub const TOTAL_PARTIAL_BYTES: usize = 4 * CALL_REPLY;

/// The bytes of messages announced and not yet wholly received, per peer
/// address and in all.
#[derive(Debug)]
pub struct PartialBudget {
    per_peer: usize,
    total: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    by_peer: HashMap<IpAddr, usize>,
    total: usize,
}

impl PartialBudget {
    pub fn new(per_peer: usize, total: usize) -> Arc<PartialBudget> {
        Arc::new(PartialBudget {
            per_peer,
            total,
            held: Mutex::new(Held::default()),
        })
    }

    /// `bytes` more for `peer` (`None`: counted in the total only), held until the charge is dropped; or why not.
    pub(crate) fn charge(
        self: &Arc<Self>,
        peer: Option<IpAddr>,
        bytes: usize,
    ) -> Result<Charge, String> {
        let mut held = self.held.locked();
        if held.total.saturating_add(bytes) > self.total {
            return Err(format!(
                "the agent already holds {} of partly received messages (at most {})",
                describe(held.total),
                describe(self.total)
            ));
        }
        if let Some(ip) = peer {
            let mine = held.by_peer.get(&ip).copied().unwrap_or(0);
            if mine.saturating_add(bytes) > self.per_peer {
                return Err(format!(
                    "{ip} already has {} of partly sent messages here (at most {} a peer)",
                    describe(mine),
                    describe(self.per_peer)
                ));
            }
            held.by_peer.insert(ip, mine + bytes);
        }
        held.total += bytes;
        Ok(Charge {
            budget: self.clone(),
            peer,
            bytes,
        })
    }

    /// The bytes all peers hold now.
    #[cfg(test)]
    pub fn total_held(&self) -> usize {
        self.held.locked().total
    }

    /// The bytes `peer` holds now.
    #[cfg(test)]
    pub fn held_by(&self, peer: IpAddr) -> usize {
        self.held.locked().by_peer.get(&peer).copied().unwrap_or(0)
    }
}

fn describe(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes.div_ceil(KIB))
    }
}

/// Bytes held against a [`PartialBudget`] until dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    budget: Arc<PartialBudget>,
    peer: Option<IpAddr>,
    bytes: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut held = self.budget.held.locked();
        held.total = held.total.saturating_sub(self.bytes);
        if let Some(ip) = self.peer {
            if let Some(n) = held.by_peer.get_mut(&ip) {
                *n = n.saturating_sub(self.bytes);
                if *n == 0 {
                    held.by_peer.remove(&ip);
                }
            }
        }
    }
}
