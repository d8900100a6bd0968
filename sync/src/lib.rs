//! berth's two synchronisation rules, each written once: how a std lock
//! whose holder panicked is taken ([`MutexExt`], [`RwLockExt`]), and how
//! a long-running loop is told to stop ([`Shutdown`]).
//!
//! A std lock is poisoned when a thread panics while it holds it, and
//! every later `lock()` returns an error. berth takes the guard anyway:
//! what its locks guard is kept whole by each holder (a map changed by one
//! insert or remove, a value replaced at once; the state store applies
//! changes that were already durable), so a panic in one request or task
//! leaves the last good value, and spreading that panic to every later
//! caller would turn one bug into a stopped agent. Every lock in the
//! workspace is taken through these traits.
//!
//! ```
//! use std::sync::{Mutex, RwLock};
//! use berth_sync::{MutexExt, RwLockExt};
//!
//! let m = Mutex::new(1);
//! *m.locked() += 1;
//! let rw = RwLock::new(vec![1]);
//! rw.write_locked().push(2);
//! assert_eq!((*m.locked(), rw.read_locked().len()), (2, 2));
//! ```

mod shutdown;

pub use shutdown::{Shutdown, ShutdownSender};

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// [`Mutex::lock`] that takes the guard of a poisoned mutex too.
pub trait MutexExt<T: ?Sized> {
    /// The guard, waiting for the mutex; poisoning is ignored.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// [`RwLock::read`] and [`RwLock::write`] that take the guard of a
/// poisoned lock too.
pub trait RwLockExt<T: ?Sized> {
    /// A shared guard, waiting for writers; poisoning is ignored.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// The exclusive guard, waiting for every other holder; poisoning is
    /// ignored.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, RwLock};

    use super::*;

    #[test]
    fn a_mutex_poisoned_by_a_panic_still_gives_its_last_value() {
        let m = Arc::new(Mutex::new(vec![1]));
        let m2 = m.clone();
        let panicked = std::thread::spawn(move || {
            let mut g = m2.locked();
            g.push(2);
            panic!("a holder panics");
        })
        .join();
        assert!(panicked.is_err());
        assert!(m.is_poisoned());
        assert_eq!(*m.locked(), vec![1, 2]);
    }

    #[test]
    fn a_rwlock_poisoned_by_a_panic_still_reads_and_writes() {
        let rw = Arc::new(RwLock::new(0));
        let rw2 = rw.clone();
        let panicked = std::thread::spawn(move || {
            *rw2.write_locked() = 7;
            let _g = rw2.write_locked();
            panic!("a writer panics");
        })
        .join();
        assert!(panicked.is_err());
        assert!(rw.is_poisoned());
        assert_eq!(*rw.read_locked(), 7);
        *rw.write_locked() += 1;
        assert_eq!(*rw.read_locked(), 8);
    }
}
