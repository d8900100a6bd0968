//! Live repair of lost mounts against the real `hostpath-plugin`: real
//! mounts taken away behind the manager's back, made again by a repair
//! round once the plugin is healthy, reported as node events and to the
//! alloc's watchers.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use berth_csimanager::{LostMount, MountInfo, MountRequest, RepairWatch, VolumeRepair};
use berth_structs::NodeEvent;
use common::*;
use nix::mount::{umount2, MntFlags};

/// Detaches every mount at `path`, as a plugin that died would lose it.
fn lose_mount(path: &Path) {
    while umount2(path, MntFlags::MNT_DETACH).is_ok() {}
    assert_eq!(mount_count_at(path), 0, "{} still mounted", path.display());
}

/// The next repair the watch hears of, within a deadline.
async fn next_repair(watch: &mut RepairWatch) -> VolumeRepair {
    tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("a repair notice within 10 s")
        .expect("the manager is alive")
}

fn repair_events(h: &Harness, message: &str) -> Vec<NodeEvent> {
    h.events.with_message(NodeEvent::SUBSYSTEM_STORAGE, message)
}

/// A harness whose plugin is fingerprinted and the volume "data" created
/// and mounted for alloc-1: its external ID, the mount request and what
/// was mounted.
async fn start_with_data_mounted() -> (Harness, String, MountRequest, MountInfo) {
    let h = Harness::start(&[]).await;
    h.manager.refresh_fingerprints().await;
    let ext = h.create_volume("data").await;
    let req = mount_req("data", &ext, "alloc-1");
    let info = h.manager.mount_volume(req.clone()).await.expect("mount");
    (h, ext, req, info)
}

#[tokio::test]
async fn lost_staging_and_publish_mounts_of_a_watched_alloc_are_made_again() {
    let (h, ext, req, info) = start_with_data_mounted().await;
    let staging = h.manager.staging_path(&req);
    let mut watch = h.manager.watch_repairs("alloc-1");

    // Nothing lost: a round does nothing.
    h.manager.repair_lost_mounts().await;
    assert!(repair_events(&h, "Volume repaired").is_empty());

    lose_mount(&info.source);
    lose_mount(&staging);
    h.manager.repair_lost_mounts().await;

    assert_eq!(mount_count_at(&staging), 1, "staged again");
    assert_eq!(mount_count_at(&info.source), 1, "published again");
    std::fs::write(info.source.join("after"), "repaired").unwrap();
    assert_eq!(
        std::fs::read_to_string(h.backing_dir(&ext).join("after")).unwrap(),
        "repaired",
        "the new target is the volume"
    );

    let staged = next_repair(&mut watch).await;
    assert_eq!(
        (staged.what, staged.error.as_deref()),
        (LostMount::Staging, None)
    );
    let published = next_repair(&mut watch).await;
    assert_eq!(
        (published.what, published.error.as_deref()),
        (LostMount::Publish, None)
    );
    assert_eq!(published.target, info.source);
    assert_eq!(published.volume_id, "data");

    let events = repair_events(&h, "Volume repaired");
    let whats: Vec<&str> = events.iter().map(|e| e.details["what"].as_str()).collect();
    assert_eq!(whats, ["staging", "publish"], "{events:?}");
    for e in &events {
        assert_eq!(e.details["volume_id"], "data");
        assert_eq!(e.details["alloc_id"], "alloc-1");
    }
    // The secrets the volume was mounted with are never in an event.
    assert!(!format!("{:?}", h.events.all()).contains("s3cr3t"));

    h.manager
        .unmount_volume(unmount_req(&req))
        .await
        .expect("unmount after the repair");
    assert_eq!(mount_count_at(&staging), 0);
    assert_eq!(mount_count_at(&info.source), 0);
}

#[tokio::test]
async fn an_unwatched_alloc_or_an_unhealthy_plugin_gets_no_repair() {
    let (mut h, _, req, info) = start_with_data_mounted().await;

    // Nobody watches alloc-1 (its tasks do not run): left alone.
    lose_mount(&info.source);
    h.manager.repair_lost_mounts().await;
    assert_eq!(mount_count_at(&info.source), 0);

    // Watched, but the plugin died: left alone until it is back.
    let mut watch = h.manager.watch_repairs("alloc-1");
    h.manager
        .plugin_unhealthy(PLUGIN_ID, PLUGIN_ALLOC, "the plugin task exited");
    h.plugin.kill();
    h.manager.repair_lost_mounts().await;
    assert_eq!(mount_count_at(&info.source), 0);
    assert!(repair_events(&h, "Volume repaired").is_empty());
    assert!(repair_events(&h, "Volume repair failed").is_empty());

    // Healthy again (it registers anew): repaired.
    h.restart_plugin(&[]).await;
    h.registry.register(registration(
        &h.plugin.socket,
        berth_structs::CsiPluginType::Monolith,
    ));
    // Its first probe may come before it answers on a loaded machine:
    // the repair waits for a healthy fingerprint, as the manager's own
    // rounds do.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        h.manager.refresh_fingerprints().await;
        h.manager.repair_lost_mounts().await;
        if mount_count_at(&info.source) > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no repair within 10 s of the plugin's return: {:?}",
            h.events.all()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(mount_count_at(&info.source), 1);
    let r = next_repair(&mut watch).await;
    assert_eq!((r.what, r.error), (LostMount::Publish, None));

    drop(watch);
    h.manager
        .unmount_volume(unmount_req(&req))
        .await
        .expect("unmount");
}

#[tokio::test]
async fn a_failed_repair_is_reported_and_tried_again_later_not_every_round() {
    let (mut h, _, req, info) = start_with_data_mounted().await;
    let staging = h.manager.staging_path(&req);
    let mut watch = h.manager.watch_repairs("alloc-1");

    h.restart_plugin(&["--fail", "NodeStageVolume=failedprecondition"])
        .await;
    lose_mount(&info.source);
    lose_mount(&staging);
    h.manager.repair_lost_mounts().await;

    let r = next_repair(&mut watch).await;
    assert_eq!(r.what, LostMount::Staging);
    let error = r.error.expect("the repair failed");
    assert!(error.contains("NodeStageVolume"), "{error}");
    let failed = repair_events(&h, "Volume repair failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].details["what"], "staging");
    assert!(!failed[0].details["error"].is_empty());

    // The next round comes before the backoff (the fingerprint interval,
    // 200 ms here) has passed: not tried again yet.
    h.manager.repair_lost_mounts().await;
    assert_eq!(repair_events(&h, "Volume repair failed").len(), 1);

    // The plugin stages again; after the backoff the repair succeeds.
    h.restart_plugin(&[]).await;
    h.manager.refresh_fingerprints().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while mount_count_at(&info.source) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the repair was not tried again within 10 s: {:?}",
            h.events.all()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        h.manager.repair_lost_mounts().await;
    }
    assert_eq!(mount_count_at(&staging), 1);
    assert_eq!(repair_events(&h, "Volume repaired").len(), 2);

    drop(watch);
    h.manager
        .unmount_volume(unmount_req(&req))
        .await
        .expect("unmount");
}

#[tokio::test]
async fn the_volume_record_keeps_what_the_staging_was_made_with() {
    let h = Harness::start(&[]).await;
    h.manager.refresh_fingerprints().await;
    let ext = h.create_volume("data").await;
    let mut first = mount_req("data", &ext, "alloc-1");
    first.mount_options.mount_flags = vec!["noatime".into()];
    let second = mount_req("data", &ext, "alloc-2");
    h.manager.mount_volume(first.clone()).await.expect("mount");
    h.manager.mount_volume(second.clone()).await.expect("mount");
    // The second alloc only published: a staging made again must use the
    // options it was made with, not the second alloc's.
    let stubs = h.manager.volume_stubs();
    assert_eq!(stubs.len(), 1);
    assert_eq!(stubs[0].mounted_with.mount_options.mount_flags, ["noatime"]);
    for r in [&second, &first] {
        h.manager
            .unmount_volume(unmount_req(r))
            .await
            .expect("unmount");
    }
}
