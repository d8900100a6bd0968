//! One operation in flight per volume.
//!
//! A second call for a volume that already has one in flight is answered
//! `ABORTED` at once instead of queueing, as the CSI spec allows; the CO
//! retries with backoff. The slot is held by an RAII guard and given back
//! when the guard drops, whatever way the operation ends.
//!
//! The guard is per process, not shared with other instances on the same
//! state directory: node calls for one volume on two nodes (a multi-node
//! volume) are independent and must not turn each other away, and
//! controller calls through two instances are serialised by the state lock,
//! under which each one re-reads the state, checks and applies its change.
//! A repeated call through another instance therefore finds the work done
//! and answers as an idempotent retry.

use berth_sync::MutexExt;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Error;

/// The set of volumes with an operation in flight.
#[derive(Debug, Clone, Default)]
pub struct VolumeLocks {
    busy: Arc<Mutex<HashSet<String>>>,
}

impl VolumeLocks {
    /// Claims `volume_id` for one operation, or answers `Busy` if another
    /// operation holds it.
    pub fn try_lock(&self, volume_id: &str) -> Result<VolumeGuard, Error> {
        if !self.set().insert(volume_id.to_owned()) {
            return Err(Error::Busy(volume_id.to_owned()));
        }
        Ok(VolumeGuard {
            locks: self.clone(),
            volume_id: volume_id.to_owned(),
        })
    }

    fn set(&self) -> MutexGuard<'_, HashSet<String>> {
        // The set stays consistent even if a holder panicked.
        self.busy.locked()
    }
}

/// Holds a volume's slot; frees it on drop.
#[derive(Debug)]
#[must_use = "the volume is unlocked as soon as the guard is dropped"]
pub struct VolumeGuard {
    locks: VolumeLocks,
    volume_id: String,
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        self.locks.set().remove(&self.volume_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_is_refused_until_guard_drops() {
        let locks = VolumeLocks::default();
        let guard = locks.try_lock("v1").unwrap();
        assert!(matches!(locks.try_lock("v1"), Err(Error::Busy(v)) if v == "v1"));
        let other = locks.try_lock("v2").unwrap();
        drop(guard);
        let _again = locks.try_lock("v1").unwrap();
        drop(other);
    }
}
