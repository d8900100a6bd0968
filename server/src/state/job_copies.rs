//! One in-memory copy of a job for all the allocs that hold the same: an
//! alloc holds the job it was placed with, and a 10,000-alloc job held
//! once per alloc cost the servers most of their memory per alloc. On
//! disk and on the wire each alloc still carries its copy; in memory the
//! allocs whose copies are equal (those one plan placed, or loaded from
//! disk) share one.

use std::collections::HashMap;
use std::sync::Arc;

use berth_structs::{Allocation, Job};

use super::Tables;

/// Where to look for an equal copy first: the same registration of the
/// same job (an equal copy has these equal, too).
type Key = (String, u64, u64);

fn key_of(job: &Job) -> Key {
    (job.id.clone(), job.version, job.job_modify_index)
}

/// Whether two copies are of one registration of one job.
fn same_registration(a: &Job, b: &Job) -> bool {
    a.version == b.version && a.job_modify_index == b.job_modify_index && a.id == b.id
}

/// How many stored allocs of the same registration are compared with a
/// new copy at most: they hold one copy or a few, so when the first few
/// are not equal the rest are not either, and a write never compares a
/// copy with every alloc of a large job.
const SEARCHED: usize = 4;

/// The shared copies seen so far (one write's, or one load's), one per
/// registration: an alloc whose copy is not equal to it keeps its own.
#[derive(Default)]
pub(super) struct JobCopies(HashMap<Key, Arc<Job>>);

impl JobCopies {
    /// Makes `a` hold an equal copy of its job that other allocs hold:
    /// one seen so far, or with `tables`, the stored alloc's it replaces
    /// or another stored alloc's of the same registration; else its own
    /// becomes the one the next ones share.
    pub(super) fn share(&mut self, tables: Option<&Tables>, a: &mut Allocation) {
        let key = key_of(&a.job);
        if !self.0.contains_key(&key) {
            let equal = |s: &&Allocation| Arc::ptr_eq(&s.job, &a.job) || s.job == a.job;
            let stored = tables.and_then(|t| {
                t.allocs.get(&a.id).filter(equal).or_else(|| {
                    t.allocs_of_job(&a.job_id)
                        .filter(|s| same_registration(&s.job, &a.job))
                        .take(SEARCHED)
                        .find(equal)
                })
            });
            let shared = stored.map_or_else(|| Arc::clone(&a.job), |s| Arc::clone(&s.job));
            self.0.insert(key.clone(), shared);
        }
        if let Some(shared) = self.0.get(&key) {
            if !Arc::ptr_eq(shared, &a.job) && *shared == a.job {
                a.job = Arc::clone(shared);
            }
        }
    }

    /// The allocs of freshly loaded `tables` whose copies are equal
    /// share one.
    pub(super) fn share_loaded(tables: &mut Tables) {
        let mut copies = JobCopies::default();
        for a in tables.allocs.values_mut() {
            copies.share(None, a);
        }
    }
}

/// The copy of `job` the allocs a plan places hold: an equal one its stored
/// allocs share (among the first few of the same registration), else a
/// new one, which all the allocs this plan places share.
pub(crate) fn shared_copy(job: &Job, stored: &[&Allocation]) -> Arc<Job> {
    stored
        .iter()
        .filter(|a| same_registration(&a.job, job))
        .take(SEARCHED)
        .find(|a| *a.job == *job)
        .map_or_else(|| Arc::new(job.clone()), |a| Arc::clone(&a.job))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use berth_structs::{Allocation, Job};

    use crate::state::{Change, RedbBackend, StateStore, StoreError};

    fn job(version: u64) -> Job {
        Job {
            id: "web".into(),
            version,
            job_modify_index: version + 1,
            ..Job::default()
        }
    }

    /// Alloc `id` of `job`, with a copy of its own.
    fn alloc(id: &str, job: &Job) -> Allocation {
        Allocation {
            id: id.into(),
            job_id: job.id.clone(),
            job: Arc::new(job.clone()),
            ..Allocation::default()
        }
    }

    fn put(store: &StateStore, allocs: Vec<Allocation>) {
        store
            .write(|_, changes| {
                changes.extend(allocs.into_iter().map(Change::PutAlloc));
                Ok::<_, StoreError>(())
            })
            .unwrap();
    }

    fn shared(store: &StateStore, a: &str, b: &str) -> bool {
        store.read(|t| Arc::ptr_eq(&t.allocs[a].job, &t.allocs[b].job))
    }

    #[test]
    fn allocs_of_one_registration_hold_one_copy_of_their_job() {
        let dir = tempfile::tempdir().unwrap();
        let path = RedbBackend::path_in(dir.path());
        let store = StateStore::open(Box::new(RedbBackend::open(&path).unwrap())).unwrap();
        // Each with its own copy, in one write and in two.
        put(&store, vec![alloc("a1", &job(0)), alloc("a2", &job(0))]);
        put(&store, vec![alloc("a3", &job(0)), alloc("b1", &job(1))]);
        assert!(shared(&store, "a1", "a2"));
        assert!(shared(&store, "a1", "a3"));
        // Another version of the job is another copy.
        assert!(!shared(&store, "a1", "b1"));
        assert_eq!(*store.read(|t| t.allocs["b1"].job.clone()), job(1));
        drop(store);
        // Loaded from disk, where each alloc has its copy: shared again.
        let store = StateStore::open(Box::new(RedbBackend::open(&path).unwrap())).unwrap();
        assert!(shared(&store, "a1", "a2") && shared(&store, "a2", "a3"));
        assert!(!shared(&store, "a1", "b1"));
        assert_eq!(*store.read(|t| t.allocs["a3"].job.clone()), job(0));
    }
}
