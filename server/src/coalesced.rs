//! Runs of one piece of work per key, coalesced: n concurrent calls for a
//! key cost two runs, and each call returns after a run that started after
//! it (a job's evaluation, a pass over the blocked jobs).

use berth_sync::MutexExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

///
/// Per key, a requested and a done generation. A call takes the next
/// requested generation; if no run for the key is under way it becomes the
/// runner: it notes the requested generation, runs the work once, sets done
/// to what it noted and wakes the waiters. Otherwise it waits until done
/// reaches its generation, or until no run is under way, and then runs
/// itself. So a run covers every call made before it started, a call
/// returns after a run that started after it, and n calls arriving during a
/// run cost two runs, not n. Keys run independently of each other.
///
/// A key's entry lives only while calls for it are under way. A call that
/// ends without finishing its run (its work panicked, or the call was
/// dropped) gives up the runner's role on its way out (a drop guard) and
/// wakes the waiters, one of which runs instead.
pub(crate) struct Coalesced<T> {
    keys: Mutex<HashMap<String, Arc<KeyRuns<T>>>>,
    /// Runs started, for every key.
    runs: std::sync::atomic::AtomicU64,
}

struct KeyRuns<T> {
    gens: Mutex<Generations<T>>,
    /// Woken when a run ends or a runner gives up.
    ended: tokio::sync::Notify,
}

struct Generations<T> {
    requested: u64,
    done: u64,
    running: bool,
    /// Calls under way (running or waiting): the entry goes at 0.
    calls: usize,
    /// What the run that set `done` returned (none before the first).
    last: Option<T>,
}

impl<T> Default for Coalesced<T> {
    fn default() -> Self {
        Coalesced {
            keys: Mutex::default(),
            runs: Default::default(),
        }
    }
}

impl<T: Clone> Coalesced<T> {
    /// Run `work` for `key`, or wait for a run of it that starts after
    /// this call; returns what that run returned.
    pub(crate) async fn run<F, Fut>(&self, key: &str, work: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let (runs, generation) = {
            let mut keys = self.keys.locked();
            let runs = keys
                .entry(key.to_string())
                .or_insert_with(|| {
                    Arc::new(KeyRuns {
                        gens: Mutex::new(Generations {
                            requested: 0,
                            done: 0,
                            running: false,
                            calls: 0,
                            last: None,
                        }),
                        ended: tokio::sync::Notify::new(),
                    })
                })
                .clone();
            let mut gens = runs.gens.locked();
            gens.requested += 1;
            gens.calls += 1;
            let generation = gens.requested;
            drop(gens);
            (runs, generation)
        };
        let mut call = Call {
            coalesced: self,
            key,
            runs: &runs,
            running: false,
        };
        loop {
            // Registered before the check: a run ending after it wakes us.
            let ended = runs.ended.notified();
            let noted = {
                let mut gens = runs.gens.locked();
                if let (true, Some(last)) = (gens.done >= generation, &gens.last) {
                    return last.clone();
                }
                if gens.running {
                    None
                } else {
                    gens.running = true;
                    call.running = true;
                    Some(gens.requested)
                }
            };
            let Some(noted) = noted else {
                ended.await;
                continue;
            };
            self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let out = work().await;
            let mut gens = runs.gens.locked();
            gens.done = noted;
            gens.last = Some(out.clone());
            gens.running = false;
            call.running = false;
            drop(gens);
            runs.ended.notify_waiters();
            return out;
        }
    }

    /// How many runs started, for every key.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many calls for `key` are under way.
    #[cfg(test)]
    pub(crate) fn calls(&self, key: &str) -> usize {
        let keys = self.keys.locked();
        keys.get(key).map_or(0, |r| r.gens.locked().calls)
    }
}

/// One call of [`Coalesced::run`]: on its way out (returned, panicked or
/// dropped) it is counted off, gives up the runner's role if it still
/// holds it, and removes the key's entry when it was the last call.
struct Call<'a, T> {
    coalesced: &'a Coalesced<T>,
    key: &'a str,
    runs: &'a Arc<KeyRuns<T>>,
    running: bool,
}

impl<T> Drop for Call<'_, T> {
    fn drop(&mut self) {
        let mut keys = self.coalesced.keys.locked();
        let mut gens = self.runs.gens.locked();
        gens.calls -= 1;
        let gave_up = std::mem::take(&mut self.running);
        if gave_up {
            gens.running = false;
        }
        if gens.calls == 0 {
            keys.remove(self.key);
        }
        drop(gens);
        drop(keys);
        if gave_up {
            self.runs.ended.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use tokio::sync::watch;

    use super::*;

    const DEADLINE: Duration = Duration::from_secs(10);

    /// Poll `cond` until it holds; fail after [`DEADLINE`].
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A gate runs wait at until it is opened.
    fn gate() -> (watch::Sender<bool>, watch::Receiver<bool>) {
        watch::channel(false)
    }

    async fn pass(mut gate: watch::Receiver<bool>) {
        let _ = gate.wait_for(|open| *open).await;
    }

    #[tokio::test]
    async fn concurrent_calls_share_two_runs_and_each_returns_after_a_run_that_started_after_it() {
        let coalesced = Arc::new(Coalesced::<u64>::default());
        // One clock for calls and run starts: a run's start must come after
        // the call it answers.
        let clock = Arc::new(AtomicU64::new(1));
        let (open, gated) = gate();
        let call = |set: &mut tokio::task::JoinSet<(u64, u64)>| {
            let (coalesced, clock, gated) = (coalesced.clone(), clock.clone(), gated.clone());
            set.spawn(async move {
                let called = clock.fetch_add(1, Ordering::SeqCst);
                let started = coalesced
                    .run("web", || async {
                        let started = clock.fetch_add(1, Ordering::SeqCst);
                        pass(gated).await;
                        started
                    })
                    .await;
                (called, started)
            });
        };
        let mut calls = tokio::task::JoinSet::new();
        call(&mut calls);
        until("the first run to start", || coalesced.runs() == 1).await;
        for _ in 0..49 {
            call(&mut calls);
        }
        until("50 calls under way", || coalesced.calls("web") == 50).await;
        open.send_replace(true);
        let mut answered = 0;
        while let Some(done) = calls.join_next().await {
            let (called, started) = done.unwrap();
            assert!(
                started > called,
                "a call made at {called} was answered by a run started at {started}"
            );
            answered += 1;
        }
        assert_eq!(answered, 50);
        assert_eq!(coalesced.runs(), 2, "50 calls, one run under way: two runs");
        assert!(coalesced.keys.lock().unwrap().is_empty(), "no entry left");

        // A call after the runs ended does not take their answer: it runs.
        let called = clock.fetch_add(1, Ordering::SeqCst);
        let started = coalesced
            .run("web", || async { clock.fetch_add(1, Ordering::SeqCst) })
            .await;
        assert!(started > called);
        assert_eq!(coalesced.runs(), 3);
    }

    #[tokio::test]
    async fn different_keys_run_independently() {
        let coalesced = Arc::new(Coalesced::<u64>::default());
        let (open, gated) = gate();
        let a = tokio::spawn({
            let coalesced = coalesced.clone();
            async move {
                coalesced
                    .run("a", || async {
                        pass(gated).await;
                        1
                    })
                    .await
            }
        });
        until("the run of a to start", || coalesced.runs() == 1).await;
        // "b" runs and answers while a run of "a" is under way.
        let b = tokio::time::timeout(DEADLINE, coalesced.run("b", || async { 2 }))
            .await
            .expect("a call for b waits for no run of a");
        assert_eq!(b, 2);
        assert_eq!(coalesced.runs(), 2);
        assert!(!a.is_finished());
        open.send_replace(true);
        assert_eq!(a.await.unwrap(), 1);
        assert!(coalesced.keys.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_failing_run_answers_its_waiters_and_a_panicking_or_dropped_one_hands_over() {
        let coalesced = Arc::new(Coalesced::<Result<u64, String>>::default());
        let waiters = |n: usize, set: &mut tokio::task::JoinSet<Result<u64, String>>| {
            for _ in 0..n {
                let coalesced = coalesced.clone();
                set.spawn(async move { coalesced.run("j", || async { Ok(7) }).await });
            }
        };

        // A run that fails: the calls it covers get its failure, and the
        // ones after it a run of their own.
        let (open, gated) = gate();
        let failing = tokio::spawn({
            let coalesced = coalesced.clone();
            async move {
                coalesced
                    .run("j", || async {
                        pass(gated).await;
                        Err("store closed".to_string())
                    })
                    .await
            }
        });
        until("the failing run to start", || coalesced.runs() == 1).await;
        let mut set = tokio::task::JoinSet::new();
        waiters(5, &mut set);
        until("6 calls under way", || coalesced.calls("j") == 6).await;
        open.send_replace(true);
        assert_eq!(failing.await.unwrap(), Err("store closed".into()));
        while let Some(answer) = tokio::time::timeout(DEADLINE, set.join_next())
            .await
            .expect("the waiters of a failed run are answered")
        {
            assert_eq!(answer.unwrap(), Ok(7));
        }
        assert_eq!(coalesced.runs(), 2);

        // A run that panics, then one whose call is dropped: each time a
        // waiter takes over and every waiter is answered.
        for how in ["panics", "is dropped"] {
            let before = coalesced.runs();
            let (open, gated) = gate();
            let runner = tokio::spawn({
                let coalesced = coalesced.clone();
                async move {
                    coalesced
                        .run("j", || async {
                            pass(gated).await;
                            panic!("evaluation panicked");
                        })
                        .await
                }
            });
            until("the run to start", || coalesced.runs() == before + 1).await;
            let mut set = tokio::task::JoinSet::new();
            waiters(5, &mut set);
            until("6 calls under way", || coalesced.calls("j") == 6).await;
            if how == "panics" {
                open.send_replace(true);
                assert!(runner.await.unwrap_err().is_panic());
            } else {
                runner.abort();
                assert!(runner.await.unwrap_err().is_cancelled());
            }
            let mut answered = 0;
            while let Some(answer) = tokio::time::timeout(DEADLINE, set.join_next())
                .await
                .unwrap_or_else(|_| panic!("the waiters of a run that {how} are answered"))
            {
                assert_eq!(answer.unwrap(), Ok(7));
                answered += 1;
            }
            assert_eq!(answered, 5);
            assert_eq!(coalesced.runs(), before + 2, "one waiter ran instead");
        }
        assert!(coalesced.keys.lock().unwrap().is_empty());
    }
}
