//! [`Sampler`]: a thread that samples the task processes of some
//! [`crate::cluster::marked_job`] jobs every 20 ms, so that a test can say
//! that two writers of one volume never ran at once, and when each task
//! was first seen gone.

use berth_sync::MutexExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cluster::marker_pids;

/// What a background sampler saw of the task processes of some jobs.
#[derive(Default)]
pub struct Seen {
    /// Per job, the most task processes alive at one sample.
    pub most_alive: BTreeMap<String, usize>,
    /// Per pid, when it was first seen gone.
    pub gone_at: BTreeMap<i32, Instant>,
    /// Every pid seen alive.
    pub alive: BTreeSet<i32>,
}

/// Samples the task processes of `jobs` every 20 ms until dropped.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    pub fn start(jobs: &[&str]) -> Sampler {
        let jobs: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                let now = Instant::now();
                let mut alive_now = BTreeSet::new();
                let mut counts = Vec::new();
                for j in &jobs {
                    let pids = marker_pids(j);
                    counts.push((j.clone(), pids.len()));
                    alive_now.extend(pids);
                }
                let mut seen = s.locked();
                for (j, n) in counts {
                    let m = seen.most_alive.entry(j).or_default();
                    *m = (*m).max(n);
                }
                let gone: Vec<i32> = seen.alive.difference(&alive_now).copied().collect();
                for pid in gone {
                    seen.gone_at.entry(pid).or_insert(now);
                }
                seen.alive.extend(alive_now);
                drop(seen);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Sampler {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    pub fn with<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.locked())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
