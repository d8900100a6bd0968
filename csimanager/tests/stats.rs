//! The volume stats loop against the real `hostpath-plugin`: real unix
//! sockets, real gRPC, real bind mounts (the tests run as root).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use berth_sync::{Shutdown, ShutdownSender};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_csimanager::stats::{CONDITION_ABNORMAL, CONDITION_NORMAL};
use berth_csimanager::VolumeStatsSink;
use berth_structs::{CsiVolumeStats, NodeEvent};
use common::*;
use tokio::task::JoinHandle;

/// Every report the loop handed on, in order.
#[derive(Default)]
struct StatsLog(Mutex<Vec<(String, BTreeMap<String, CsiVolumeStats>)>>);

impl StatsLog {
    fn all(&self) -> Vec<(String, BTreeMap<String, CsiVolumeStats>)> {
        self.0.lock().unwrap().clone()
    }

    /// The stats of `volume` in the reports of `alloc`, in order.
    fn of(&self, alloc: &str, volume: &str) -> Vec<CsiVolumeStats> {
        self.all()
            .into_iter()
            .filter(|(a, _)| a == alloc)
            .filter_map(|(_, m)| m.get(volume).cloned())
            .collect()
    }
}

#[async_trait::async_trait]
impl VolumeStatsSink for StatsLog {
    async fn volume_stats_changed(&self, alloc_id: &str, stats: BTreeMap<String, CsiVolumeStats>) {
        self.0.lock().unwrap().push((alloc_id.to_string(), stats));
    }
}

/// The stats loop of `h`, every second, until the sender flips.
struct StatsLoop {
    log: Arc<StatsLog>,
    stop: ShutdownSender,
    task: JoinHandle<()>,
}

impl StatsLoop {
    async fn start(h: &Harness) -> StatsLoop {
        // The loop asks only plugins fingerprinted with GET_VOLUME_STATS.
        h.manager.refresh_fingerprints().await;
        let node = h
            .manager
            .plugin_fingerprint(PLUGIN_ID)
            .and_then(|fp| fp.node)
            .expect("node fingerprint");
        assert!(node.supports_volume_stats, "{node:?}");
        let log = Arc::new(StatsLog::default());
        let (stop, rx) = Shutdown::channel();
        let task = tokio::spawn(h.manager.clone().run_volume_stats(
            log.clone(),
            Duration::from_secs(1),
            rx,
        ));
        StatsLoop { log, stop, task }
    }

    async fn stop(self) {
        self.stop.shutdown();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the stats loop stops")
            .expect("the stats loop does not panic");
    }
}

fn condition_events(h: &Harness, message: &str) -> Vec<NodeEvent> {
    h.events.with_message(NodeEvent::SUBSYSTEM_STORAGE, message)
}

#[tokio::test]
async fn stats_of_a_mounted_volume_are_reported_and_unchanged_ones_are_not() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("stats").await;
    let m = mount_req("stats", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.expect("mount");
    let stats = StatsLoop::start(&h).await;

    wait_for("the first report", Duration::from_secs(10), || {
        !stats.log.of("alloc-1", "stats").is_empty()
    })
    .await;
    let first = stats.log.of("alloc-1", "stats").remove(0);
    assert_eq!(first.volume_id, "stats");
    assert_eq!(first.plugin_id, PLUGIN_ID);
    assert_eq!(first.error, None, "{first:?}");
    let total = first.bytes_total.expect("bytes total");
    let used = first.bytes_used.expect("bytes used");
    let available = first.bytes_available.expect("bytes available");
    assert!(
        total > 0 && used <= total && available <= total,
        "{first:?}"
    );
    let inodes = first.inodes_total.expect("inodes total");
    assert!(inodes > 0 && first.inodes_used.expect("inodes used") <= inodes);
    assert!(first.inodes_available.is_some());
    let condition = first
        .condition
        .as_ref()
        .expect("the plugin reports a condition");
    assert!(!condition.abnormal, "{condition:?}");
    assert!(first.collected_at_ms > 0);

    // Three more rounds of a volume that does not change: nothing more is
    // reported (a bounded wait for something that must not happen).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(stats.log.all().len(), 1, "{:#?}", stats.log.all());
    assert!(condition_events(&h, CONDITION_ABNORMAL).is_empty());
    assert!(condition_events(&h, CONDITION_NORMAL).is_empty());

    // Once unmounted, the volume is no longer asked about.
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount");
    assert!(h.manager.volume_stubs().is_empty());
    stats.stop().await;
}

#[tokio::test]
async fn a_volume_whose_data_is_removed_behind_the_plugin_turns_abnormal_once() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("fragile").await;
    let m = mount_req("fragile", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.expect("mount");
    let node = {
        h.manager.refresh_fingerprints().await;
        h.manager
            .plugin_fingerprint(PLUGIN_ID)
            .unwrap()
            .node
            .unwrap()
    };
    assert!(
        node.supports_volume_condition,
        "the plugin advertises VOLUME_CONDITION: {node:?}"
    );
    let stats = StatsLoop::start(&h).await;
    wait_for("a normal report", Duration::from_secs(10), || {
        stats
            .log
            .of("alloc-1", "fragile")
            .iter()
            .any(|s| s.condition.as_ref().is_some_and(|c| !c.abnormal))
    })
    .await;

    // The volume's data directory goes away under the mounts.
    std::fs::remove_dir_all(h.backing_dir(&ext)).expect("remove the volume's data");
    wait_for("an abnormal report", Duration::from_secs(10), || {
        stats
            .log
            .of("alloc-1", "fragile")
            .iter()
            .any(|s| s.condition.as_ref().is_some_and(|c| c.abnormal))
    })
    .await;
    let abnormal = stats
        .log
        .of("alloc-1", "fragile")
        .into_iter()
        .find(|s| s.condition.as_ref().is_some_and(|c| c.abnormal))
        .unwrap();
    let message = abnormal.condition.unwrap().message;
    assert!(!message.is_empty());
    assert_eq!(
        abnormal.error, None,
        "an abnormal volume is not a failed call"
    );

    wait_for("the abnormal event", Duration::from_secs(5), || {
        !condition_events(&h, CONDITION_ABNORMAL).is_empty()
    })
    .await;
    // More rounds, still abnormal: still one event, one report of it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let events = condition_events(&h, CONDITION_ABNORMAL);
    assert_eq!(events.len(), 1, "{events:#?}");
    let e = &events[0];
    assert_eq!(e.details["volume_id"], "fragile");
    assert_eq!(e.details["alloc_id"], "alloc-1");
    assert_eq!(e.details["message"], message);
    let abnormal_reports = stats
        .log
        .of("alloc-1", "fragile")
        .iter()
        .filter(|s| s.condition.as_ref().is_some_and(|c| c.abnormal))
        .count();
    assert_eq!(abnormal_reports, 1);
    assert!(condition_events(&h, CONDITION_NORMAL).is_empty());
    stats.stop().await;
}

#[tokio::test]
async fn a_failing_stats_call_is_reported_as_unavailable_and_the_loop_goes_on() {
    let h = Harness::start(&["--fail", "NodeGetVolumeStats=internal:2"]).await;
    let ext = h.create_volume("flaky").await;
    let m = mount_req("flaky", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.expect("mount");
    let stats = StatsLoop::start(&h).await;

    wait_for("an error report", Duration::from_secs(10), || {
        stats
            .log
            .of("alloc-1", "flaky")
            .iter()
            .any(|s| s.error.is_some())
    })
    .await;
    let failed = stats.log.of("alloc-1", "flaky").remove(0);
    let error = failed.error.clone().unwrap();
    assert!(error.contains("NodeGetVolumeStats"), "{error}");
    assert_eq!(failed.bytes_total, None);
    // The second failure is the same error: not reported again. Then the
    // plugin answers and the figures follow.
    wait_for(
        "figures after the failures",
        Duration::from_secs(10),
        || {
            stats
                .log
                .of("alloc-1", "flaky")
                .iter()
                .any(|s| s.error.is_none() && s.bytes_total.is_some())
        },
    )
    .await;
    let reports = stats.log.of("alloc-1", "flaky");
    assert_eq!(reports.len(), 2, "{reports:#?}");
    stats.stop().await;
}

#[tokio::test]
async fn a_plugin_slower_than_the_call_deadline_is_reported_as_unavailable() {
    let h = Harness::start_with(
        &["--delay", "NodeGetVolumeStats=30s"],
        Duration::from_millis(500),
    )
    .await;
    let ext = h.create_volume("slow").await;
    let m = mount_req("slow", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.expect("mount");
    let stats = StatsLoop::start(&h).await;
    wait_for("a deadline report", Duration::from_secs(10), || {
        !stats.log.of("alloc-1", "slow").is_empty()
    })
    .await;
    let r = stats.log.of("alloc-1", "slow").remove(0);
    let error = r.error.expect("an error");
    assert!(
        error.contains("DeadlineExceeded") || error.contains("no answer"),
        "{error}"
    );
    // The loop still stops promptly with a call hanging in the plugin.
    stats.stop().await;
}

#[tokio::test]
async fn the_volumes_of_a_round_are_asked_concurrently_but_at_most_eight_at_a_time() {
    let h = Harness::start(&["--delay", "NodeGetVolumeStats=1s"]).await;
    let ext = h.create_volume("many").await;
    // Twelve allocs publishing one volume: twelve calls a round.
    for i in 0..12 {
        h.manager
            .mount_volume(mount_req("many", &ext, &format!("alloc-{i}")))
            .await
            .expect("mount");
    }
    let started = std::time::Instant::now();
    let stats = StatsLoop::start(&h).await;
    wait_for("all twelve reported", Duration::from_secs(20), || {
        stats.log.all().len() == 12
    })
    .await;
    let took = started.elapsed();
    println!("the first round of 12 volumes (1 s each) took {took:?}");
    // One at a time would take 12 s, all at once 1 s: two waves of 8 and 4.
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "the first round took {took:?}"
    );
    assert!(stats
        .log
        .all()
        .iter()
        .all(|(_, m)| m["many"].error.is_none() && m["many"].bytes_total.is_some()));
    stats.stop().await;
}
