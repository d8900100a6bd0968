//! The heartbeat loop against a scripted RPC, on paused time.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use berth_sync::{Shutdown, ShutdownSender};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_heartbeat::{
    HeartbeatConfig, HeartbeatError, HeartbeatRpc, Heartbeater, LastHeartbeatStore, NodeRegistrar,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(10);

/// Answers from a script, then `Ok(TTL)`; reports the instant of each call.
/// A `None` in the script never answers.
struct ScriptedRpc {
    script: Mutex<VecDeque<Option<Result<Duration, HeartbeatError>>>>,
    calls: mpsc::UnboundedSender<Instant>,
}

#[async_trait::async_trait]
impl HeartbeatRpc for ScriptedRpc {
    async fn heartbeat(&self) -> Result<Duration, HeartbeatError> {
        let _ = self.calls.send(Instant::now());
        let next = self.script.lock().unwrap().pop_front();
        match next {
            Some(Some(r)) => r,
            Some(None) => std::future::pending().await,
            None => Ok(TTL),
        }
    }
}

#[derive(Default)]
struct CountingRegistrar {
    calls: AtomicU32,
}

#[async_trait::async_trait]
impl NodeRegistrar for CountingRegistrar {
    async fn reregister(&self) -> Result<(), HeartbeatError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[derive(Default)]
struct MemStore {
    saved: Mutex<Option<i64>>,
}

impl LastHeartbeatStore for MemStore {
    fn save(&self, unix_ms: i64) {
        *self.saved.lock().unwrap() = Some(unix_ms);
    }
    fn load(&self) -> Option<i64> {
        *self.saved.lock().unwrap()
    }
}

struct Harness {
    calls: mpsc::UnboundedReceiver<Instant>,
    registrar: Arc<CountingRegistrar>,
    store: Arc<MemStore>,
    last: watch::Receiver<Option<Instant>>,
    shutdown: ShutdownSender,
    task: tokio::task::JoinHandle<()>,
}

fn config() -> HeartbeatConfig {
    HeartbeatConfig {
        jitter_fraction: 0.0,
        ..HeartbeatConfig::default()
    }
}

fn start(script: Vec<Option<Result<Duration, HeartbeatError>>>, store: Arc<MemStore>) -> Harness {
    let (tx, calls) = mpsc::unbounded_channel();
    let rpc = Arc::new(ScriptedRpc {
        script: Mutex::new(script.into()),
        calls: tx,
    });
    let registrar = Arc::new(CountingRegistrar::default());
    let hb = Heartbeater::new(config(), rpc, registrar.clone(), store.clone());
    let last = hb.last_success();
    let (shutdown, shutdown_rx) = Shutdown::channel();
    let task = tokio::spawn(hb.run(shutdown_rx));
    Harness {
        calls,
        registrar,
        store,
        last,
        shutdown,
        task,
    }
}

impl Harness {
    async fn next_call(&mut self) -> Instant {
        tokio::time::timeout(Duration::from_secs(3600), self.calls.recv())
            .await
            .expect("a heartbeat within an hour")
            .expect("the loop is running")
    }

    async fn gaps(&mut self, n: usize) -> Vec<Duration> {
        let mut prev = self.next_call().await;
        let mut gaps = Vec::new();
        for _ in 0..n {
            let at = self.next_call().await;
            gaps.push(at - prev);
            prev = at;
        }
        gaps
    }

    async fn stop(self) {
        self.shutdown.shutdown();
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("the loop stops on shutdown")
            .expect("the loop does not panic");
    }
}

#[tokio::test(start_paused = true)]
async fn heartbeats_at_half_the_ttl_and_records_last_success() {
    let mut h = start(vec![], Arc::default());
    assert!(h.last.borrow().is_none());
    let gaps = h.gaps(3).await;
    assert_eq!(gaps, vec![TTL / 2; 3]);
    // The success of the last answered heartbeat is recorded in memory and
    // in the store.
    h.last
        .wait_for(|l| l.is_some())
        .await
        .expect("last success is published");
    assert!(h.store.load().is_some());
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn backs_off_on_failure_and_recovers() {
    let fail = || Some(Err(HeartbeatError::Transient("connection refused".into())));
    let mut h = start(vec![fail(), fail(), fail()], Arc::default());
    let gaps = h.gaps(4).await;
    assert_eq!(
        gaps,
        vec![
            Duration::from_secs(1),
            Duration::from_secs(2),
            Duration::from_secs(4),
            TTL / 2
        ]
    );
    assert!(h.last.borrow().is_some(), "the 4th heartbeat succeeded");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn no_success_is_recorded_while_heartbeats_fail() {
    let fail = || Some(Err(HeartbeatError::Transient("down".into())));
    let mut h = start(vec![fail(), fail(), fail(), fail()], Arc::default());
    h.gaps(3).await;
    assert!(h.last.borrow().is_none());
    assert!(h.store.load().is_none());
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_heartbeat_without_answer_times_out_and_backs_off() {
    let mut h = start(vec![None], Arc::default());
    let gaps = h.gaps(1).await;
    assert_eq!(
        gaps,
        vec![HeartbeatConfig::default().rpc_timeout + Duration::from_secs(1)]
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn reregisters_when_the_node_is_unknown() {
    let mut h = start(vec![Some(Err(HeartbeatError::NodeUnknown))], Arc::default());
    let gaps = h.gaps(2).await;
    // Registered again, then heartbeated right away.
    assert_eq!(h.registrar.calls.load(Ordering::SeqCst), 1);
    assert_eq!(gaps, vec![Duration::ZERO, TTL / 2]);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn restores_the_last_success_from_the_store() {
    let store = Arc::new(MemStore::default());
    store.save(berth_structs::now_ms() - 60_000);
    let mut h = start(
        vec![Some(Err(HeartbeatError::Transient("down".into())))],
        store,
    );
    let restored = h.last.borrow().expect("restored from the store");
    assert!(restored.elapsed() >= Duration::from_secs(59));
    h.next_call().await;
    h.stop().await;
}
