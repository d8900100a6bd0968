//! The volume manager against the real `hostpath-plugin`: real unix
//! sockets, real gRPC, real bind mounts (the tests run as root).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use berth_sync::Shutdown;
use std::time::{Duration, Instant};

use berth_csimanager::CsiError;
use berth_structs::NodeEvent;
use common::*;
use tonic::Code;

#[tokio::test]
async fn two_allocs_share_one_stage_and_only_the_last_unmount_unstages() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("shared").await;
    let m1 = mount_req("shared", &ext, "alloc-1");
    let m2 = mount_req("shared", &ext, "alloc-2");
    let staging = h.manager.staging_path(&m1);

    let info1 = h
        .manager
        .mount_volume(m1.clone())
        .await
        .expect("mount alloc-1");
    // From now on the plugin refuses to stage: the second mount must not
    // stage again (the plugin keeps its state and mounts across restarts).
    h.restart_plugin(&["--fail", "NodeStageVolume=failedprecondition"])
        .await;
    let info2 = h
        .manager
        .mount_volume(m2.clone())
        .await
        .expect("mount alloc-2");
    assert_eq!(info1.source, h.manager.target_path(&m1));
    assert_eq!(info2.source, h.manager.target_path(&m2));
    assert_ne!(info1.source, info2.source);
    assert!(!info1.read_only);

    // One stage, two publishes.
    assert_eq!(mount_count_at(&staging), 1, "the usage is staged once");
    assert_eq!(mount_count_at(&info1.source), 1);
    assert_eq!(mount_count_at(&info2.source), 1);
    let stubs = h.store.volumes();
    assert_eq!(stubs.len(), 1);
    let stub = stubs.values().next().unwrap();
    assert!(stub.staged);
    assert_eq!(stub.allocs.len(), 2);

    // Both targets are the same volume.
    std::fs::write(info1.source.join("hello"), "from alloc-1").unwrap();
    assert_eq!(
        std::fs::read_to_string(info2.source.join("hello")).unwrap(),
        "from alloc-1"
    );
    assert!(h.backing_dir(&ext).join("hello").is_file());

    // The first unmount leaves the stage for alloc-2.
    h.manager
        .unmount_volume(unmount_req(&m1))
        .await
        .expect("unmount alloc-1");
    assert_eq!(mount_count_at(&info1.source), 0);
    assert_eq!(mount_count_at(&staging), 1, "alloc-2 still uses the stage");
    assert_eq!(mount_count_at(&info2.source), 1);
    assert_eq!(
        std::fs::read_to_string(info2.source.join("hello")).unwrap(),
        "from alloc-1"
    );
    let stub = h.store.volumes().into_values().next().expect("stub kept");
    assert_eq!(stub.allocs.keys().collect::<Vec<_>>(), vec!["alloc-2"]);

    // The last unmount unstages and leaves nothing behind.
    h.manager
        .unmount_volume(unmount_req(&m2))
        .await
        .expect("unmount alloc-2");
    assert_eq!(mounts_under(&h.root), Vec::<std::path::PathBuf>::new());
    assert!(h.store.volumes().is_empty());
    assert!(h.manager.volume_stubs().is_empty());
    assert!(!info1.source.exists() && !info2.source.exists());

    // Unmount is idempotent.
    h.manager
        .unmount_volume(unmount_req(&m2))
        .await
        .expect("unmount again");
}

#[tokio::test]
async fn concurrent_mounts_of_one_volume_are_serialized() {
    let h = Harness::start(&[]).await;
    // The plugin answers Aborted to a second operation on a volume while one
    // is in flight; without retries, any overlap would fail a mount.
    h.manager.set_retry_policy(berth_csimanager::RetryPolicy {
        max_retries: 0,
        ..fast_retry()
    });
    let ext = h.create_volume("busy").await;
    let reqs: Vec<_> = (0..4)
        .map(|i| mount_req("busy", &ext, &format!("alloc-{i}")))
        .collect();
    let results = tokio::join!(
        h.manager.mount_volume(reqs[0].clone()),
        h.manager.mount_volume(reqs[1].clone()),
        h.manager.mount_volume(reqs[2].clone()),
        h.manager.mount_volume(reqs[3].clone()),
    );
    for r in [results.0, results.1, results.2, results.3] {
        r.expect("mount");
    }
    assert_eq!(mount_count_at(&h.manager.staging_path(&reqs[0])), 1);
    assert_eq!(h.store.volumes().values().next().unwrap().allocs.len(), 4);

    let results = tokio::join!(
        h.manager.unmount_volume(unmount_req(&reqs[0])),
        h.manager.unmount_volume(unmount_req(&reqs[1])),
        h.manager.unmount_volume(unmount_req(&reqs[2])),
        h.manager.unmount_volume(unmount_req(&reqs[3])),
    );
    for r in [results.0, results.1, results.2, results.3] {
        r.expect("unmount");
    }
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn a_failed_stage_gives_the_usage_back_and_failed_precondition_is_not_retried() {
    // Only the first NodeStageVolume fails: a retry would succeed.
    let h = Harness::start(&["--fail", "NodeStageVolume=failedprecondition:1"]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");

    let err = h
        .manager
        .mount_volume(m.clone())
        .await
        .expect_err("stage fails");
    match &err {
        CsiError::Final { code, op, .. } => {
            assert_eq!(*code, Code::FailedPrecondition);
            assert_eq!(*op, "NodeStageVolume");
        }
        other => panic!("want a final FailedPrecondition, got {other:?}"),
    }
    assert!(h.store.volumes().is_empty(), "the usage is given back");
    assert!(h.manager.volume_stubs().is_empty());
    assert!(mounts_under(&h.root).is_empty());

    // Nothing was left half-taken: the next mount stages afresh.
    let info = h
        .manager
        .mount_volume(m.clone())
        .await
        .expect("second mount");
    assert_eq!(mount_count_at(&h.manager.staging_path(&m)), 1);
    assert_eq!(mount_count_at(&info.source), 1);
    h.manager.unmount_volume(unmount_req(&m)).await.unwrap();
    assert!(mounts_under(&h.root).is_empty());
}

#[tokio::test]
async fn a_failed_publish_is_undone_including_the_stage() {
    let h = Harness::start(&["--fail", "NodePublishVolume=permissiondenied"]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let err = h
        .manager
        .mount_volume(m.clone())
        .await
        .expect_err("publish fails");
    assert_eq!(err.code(), Code::PermissionDenied);
    // The stage was undone too: alloc-1 was its only user.
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn unavailable_is_retried_until_it_succeeds() {
    let h = Harness::start(&["--fail", "NodeStageVolume=unavailable:2"]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let info = h
        .manager
        .mount_volume(m.clone())
        .await
        .expect("mount after retries");
    assert_eq!(mount_count_at(&h.manager.staging_path(&m)), 1);
    assert_eq!(mount_count_at(&info.source), 1);
    h.manager.unmount_volume(unmount_req(&m)).await.unwrap();
    assert!(mounts_under(&h.root).is_empty());
}

#[tokio::test]
async fn a_hanging_plugin_hits_the_deadline_and_the_undo_is_kept() {
    let timeout = Duration::from_millis(300);
    let mut h = Harness::start_with(&["--delay", "NodePublishVolume=30s"], timeout).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let started = Instant::now();
    let err = h
        .manager
        .mount_volume(m.clone())
        .await
        .expect_err("publish hangs");
    let took = started.elapsed();
    // The first attempt hits the deadline; the plugin, still busy with it,
    // answers the retries with Aborted. Either way the outcome is unknown.
    match &err {
        CsiError::Uncertain { code, op, .. } => {
            assert!(
                matches!(code, Code::DeadlineExceeded | Code::Aborted),
                "{err:?}"
            );
            assert_eq!(*op, "NodePublishVolume");
        }
        other => panic!("want an uncertain error, got {other:?}"),
    }
    assert!(
        took < Duration::from_secs(6),
        "took {took:?}, not bounded by the deadline"
    );
    let failed = h
        .events
        .with_message(NodeEvent::SUBSYSTEM_STORAGE, "Mount volume");
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].details["success"], "false");

    // The undo could not be made while the plugin was busy: the stub keeps
    // the alloc, so the undo is not forgotten.
    let stub = h.store.volumes().into_values().next().expect("stub kept");
    assert!(stub.staged);
    assert!(stub.allocs.contains_key("alloc-1"));

    // Once the plugin answers again, the later unmount finishes the undo.
    h.restart_plugin(&[]).await;
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount");
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn state_restored_after_a_restart_still_unstages_correctly() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let m1 = mount_req("v", &ext, "alloc-1");
    let m2 = mount_req("v", &ext, "alloc-2");
    let staging = h.manager.staging_path(&m1);
    let t1 = h.manager.mount_volume(m1.clone()).await.unwrap().source;
    let t2 = h.manager.mount_volume(m2.clone()).await.unwrap().source;

    // The agent restarts: a new manager, an empty registry, the same store.
    h.restart();
    assert!(
        h.manager.registry().get(PLUGIN_ID).is_some(),
        "the plugin registration is restored from the store"
    );
    assert_eq!(h.manager.volume_stubs().len(), 1);

    // alloc-2 still uses the stage: unmounting alloc-1 must not unstage.
    h.manager.unmount_volume(unmount_req(&m1)).await.unwrap();
    assert!(h.manager.volume_stubs_of("alloc-1").is_empty());
    let of_2 = h.manager.volume_stubs_of("alloc-2");
    assert_eq!(of_2.len(), 1);
    assert_eq!(of_2[0].allocs.keys().collect::<Vec<_>>(), ["alloc-2"]);
    assert_eq!(mount_count_at(&t1), 0);
    assert_eq!(mount_count_at(&staging), 1);
    assert_eq!(mount_count_at(&t2), 1);

    h.restart();
    // The restarted client remembers what it mounted for alloc-2.
    h.manager.unmount_volume(unmount_req(&m2)).await.unwrap();
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn a_remount_after_restart_keeps_one_stage() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let target = h.manager.mount_volume(m.clone()).await.unwrap().source;
    h.restart();
    // Restore mode re-runs the mount for the same alloc.
    let again = h.manager.mount_volume(m.clone()).await.unwrap().source;
    assert_eq!(again, target);
    assert_eq!(mount_count_at(&h.manager.staging_path(&m)), 1);
    assert_eq!(mount_count_at(&target), 1);
    h.manager.unmount_volume(unmount_req(&m)).await.unwrap();
    assert!(mounts_under(&h.root).is_empty());
}

#[tokio::test]
async fn mounts_and_unmounts_emit_storage_node_events() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.unwrap();
    h.manager.unmount_volume(unmount_req(&m)).await.unwrap();
    // A mount of a volume the plugin does not know fails, with an event.
    let bad = mount_req("missing", "00000000-0000-0000-0000-000000000000", "alloc-2");
    h.manager
        .mount_volume(bad)
        .await
        .expect_err("unknown volume");

    let storage: Vec<_> = h
        .events
        .all()
        .into_iter()
        .filter(|e| e.subsystem == NodeEvent::SUBSYSTEM_STORAGE)
        .collect();
    assert_eq!(storage.len(), 3, "{storage:?}");
    let keys = |e: &NodeEvent| e.details.keys().cloned().collect::<Vec<_>>();
    for e in &storage {
        assert_eq!(keys(e), vec!["alloc_id", "error", "success", "volume_id"]);
        assert!(e.timestamp > 0);
    }
    assert_eq!(storage[0].message, "Mount volume");
    assert_eq!(storage[0].details["volume_id"], "v");
    assert_eq!(storage[0].details["alloc_id"], "alloc-1");
    assert_eq!(storage[0].details["success"], "true");
    assert_eq!(storage[0].details["error"], "");
    assert_eq!(storage[1].message, "Unmount volume");
    assert_eq!(storage[1].details["success"], "true");
    assert_eq!(storage[1].details["error"], "");
    assert_eq!(storage[2].message, "Mount volume");
    assert_eq!(storage[2].details["volume_id"], "missing");
    assert_eq!(storage[2].details["alloc_id"], "alloc-2");
    assert_eq!(storage[2].details["success"], "false");
    assert!(!storage[2].details["error"].is_empty());
    // Secrets never reach an event.
    assert!(!format!("{:?}", h.events.all()).contains("s3cr3t"));
}

#[tokio::test]
async fn a_failed_unstage_is_kept_and_finished_by_a_later_unmount() {
    let h = Harness::start(&["--fail", "NodeUnstageVolume=internal:1"]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let target = h.manager.mount_volume(m.clone()).await.unwrap().source;
    let staging = h.manager.staging_path(&m);

    let err = h
        .manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect_err("unstage fails");
    assert_eq!(err.code(), Code::Internal);
    assert_eq!(mount_count_at(&target), 0, "the alloc's publish is gone");
    assert_eq!(mount_count_at(&staging), 1, "the stage remains");
    let stub = h
        .store
        .volumes()
        .into_values()
        .next()
        .expect("stub records the stage");
    assert!(stub.staged && stub.allocs.is_empty());

    // The caller retries later.
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("retry");
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn ids_that_would_escape_the_mount_root_are_refused() {
    let h = Harness::start(&[]).await;
    let m = mount_req("../../etc", "x", "alloc-1");
    let err = h.manager.mount_volume(m).await.expect_err("refused");
    assert!(matches!(err, CsiError::Volume { .. }), "{err:?}");
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn unmounting_what_was_never_mounted_succeeds_whatever_the_ids() {
    // Every node call fails: none may be needed.
    let h = Harness::start(&[
        "--fail",
        "NodeUnpublishVolume=internal",
        "--fail",
        "NodeUnstageVolume=internal",
    ])
    .await;
    // A mount refused for its IDs leaves nothing behind, so its unmount
    // (the servers' node detach of the claim) is done, not refused again.
    let refused = mount_req("../../../../../escape_target", "x", "alloc-1");
    h.manager
        .mount_volume(refused.clone())
        .await
        .expect_err("refused");
    for m in [
        refused,
        mount_req("data", "x", "../alloc"),
        mount_req("data", "x", "alloc-2"),
    ] {
        h.manager
            .unmount_volume(unmount_req(&m))
            .await
            .unwrap_or_else(|e| panic!("nothing of {m:?} is mounted: {e}"));
    }
    assert!(h.store.volumes().is_empty());
    assert!(mounts_under(&h.root).is_empty());
}

#[tokio::test]
async fn a_reader_only_access_mode_is_published_read_only() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    std::fs::write(h.backing_dir(&ext).join("data"), "x").unwrap();
    let mut m = mount_req("v", &ext, "alloc-1");
    m.access_mode = berth_structs::AccessMode::MultiNodeReader;
    let info = h.manager.mount_volume(m.clone()).await.expect("mount");
    assert!(info.read_only);
    assert_eq!(
        std::fs::read_to_string(info.source.join("data")).unwrap(),
        "x"
    );
    let err = std::fs::write(info.source.join("data"), "y").expect_err("read-only");
    assert_eq!(err.raw_os_error(), Some(libc_erofs()));
    h.manager.unmount_volume(unmount_req(&m)).await.unwrap();
    assert!(mounts_under(&h.root).is_empty());
}

fn libc_erofs() -> i32 {
    nix::errno::Errno::EROFS as i32
}

#[tokio::test]
async fn an_unfinished_unstage_is_finished_by_the_manager_after_a_restart() {
    let mut h = Harness::start(&["--fail", "NodeUnstageVolume=internal:1"]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.unwrap();
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect_err("unstage fails");
    let staging = h.manager.staging_path(&m);
    assert_eq!(mount_count_at(&staging), 1);

    // The agent restarts; nobody asks for this volume again.
    h.restart();
    let (stop, rx) = Shutdown::channel();
    let task = tokio::spawn(h.manager.clone().run(rx));
    wait_for("the stage to be undone", Duration::from_secs(10), || {
        h.store.volumes().is_empty()
    })
    .await;
    assert!(mounts_under(&h.root).is_empty());
    stop.shutdown();
    task.await.unwrap();
}

#[tokio::test]
async fn an_unmount_fails_while_an_unstage_is_unfinished_and_the_plugin_is_gone() {
    let h = Harness::start(&["--fail", "NodeUnstageVolume=internal:1"]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let target = h.manager.mount_volume(m.clone()).await.unwrap().source;
    let staging = h.manager.staging_path(&m);
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect_err("unstage fails");
    assert_eq!(mount_count_at(&target), 0, "the unpublish was made");

    // The plugin goes away before the caller retries: the volume is still
    // staged, so the retry must not report the node detach as done.
    assert!(h.registry.deregister(PLUGIN_ID, PLUGIN_ALLOC));
    let err = h
        .manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect_err("the unstage is still to do");
    assert!(matches!(err, CsiError::PluginNotFound(_)), "{err:?}");
    assert_eq!(err.code(), Code::Unavailable, "callers retry it");
    assert_eq!(mount_count_at(&staging), 1, "still staged");
    let stub = h.store.volumes().into_values().next().expect("stub kept");
    assert!(stub.staged && stub.allocs.is_empty());
    let unmounts = h
        .events
        .with_message(NodeEvent::SUBSYSTEM_STORAGE, "Unmount volume");
    assert_eq!(unmounts.last().unwrap().details["success"], "false");

    // Once the plugin is back the retry finishes the unstage.
    h.registry.register(registration(
        &h.plugin.socket,
        berth_structs::CsiPluginType::Monolith,
    ));
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount once the plugin is back");
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn an_unfinished_unstage_is_retried_by_every_round_of_the_run_loop() {
    let h = Harness::start(&["--fail", "NodeUnstageVolume=internal:1"]).await;
    let (stop, rx) = Shutdown::channel();
    let task = tokio::spawn(h.manager.clone().run(rx));
    // The loop has made its first round before the unstage fails.
    wait_for("a first round", Duration::from_secs(10), || {
        h.fingerprints.last().is_some()
    })
    .await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    h.manager.mount_volume(m.clone()).await.unwrap();
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect_err("unstage fails");

    // Nobody asks for the volume again: a later round unstages it.
    wait_for("the stage to be undone", Duration::from_secs(10), || {
        h.store.volumes().is_empty()
    })
    .await;
    assert!(mounts_under(&h.root).is_empty());
    stop.shutdown();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("run stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn a_failed_stage_on_remount_keeps_the_alloc_and_its_published_target() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let target = h.manager.mount_volume(m.clone()).await.unwrap().source;
    let staging = h.manager.staging_path(&m);
    std::fs::write(target.join("data"), "kept").unwrap();

    // The staging mount goes (the target, a bind of it, stays), the agent
    // restarts and re-runs the alloc's hooks; staging again fails now.
    nix::mount::umount2(&staging, nix::mount::MntFlags::MNT_DETACH).unwrap();
    h.restart();
    h.restart_plugin(&["--fail", "NodeStageVolume=failedprecondition"])
        .await;
    let err = h
        .manager
        .mount_volume(m.clone())
        .await
        .expect_err("the stage fails");
    assert_eq!(err.code(), Code::FailedPrecondition);

    // The alloc's target is still published: the stub must keep the alloc,
    // and the stage must stay under it.
    let stub = h.store.volumes().into_values().next().expect("stub kept");
    assert!(stub.staged);
    assert_eq!(stub.allocs.get("alloc-1"), Some(&target));
    assert_eq!(mount_count_at(&target), 1, "not unpublished");
    assert_eq!(
        std::fs::read_to_string(target.join("data")).unwrap(),
        "kept"
    );

    // The alloc's unmount undoes it all, publish first.
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount");
    assert!(mounts_under(&h.root).is_empty());
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn mount_persists_the_registry_before_its_csi_calls() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    // A manager started before the plugin registered, whose run loop has
    // not persisted the registration (it is not running).
    let store = std::sync::Arc::new(MemStore::default());
    let events = std::sync::Arc::new(EventLog::default());
    let fingerprints = std::sync::Arc::new(FingerprintLog::default());
    let registry = berth_csimanager::PluginRegistry::new();
    let manager = new_manager(
        &h.root,
        Duration::from_secs(5),
        registry.clone(),
        &store,
        &events,
        &fingerprints,
    );
    let reg = registration(&h.plugin.socket, berth_structs::CsiPluginType::Monolith);
    registry.register(reg.clone());
    assert!(store.plugins().is_empty());

    // The plugin is paused: no CSI call of the mount can be answered
    // until it resumes, so whatever the store holds meanwhile was written
    // before any of them.
    let paused = Paused::new(h.plugin.pid());
    let m = mount_req("v", &ext, "alloc-1");
    let mount = tokio::spawn({
        let manager = manager.clone();
        let m = m.clone();
        async move { manager.mount_volume(m).await }
    });
    wait_for(
        "the registration persisted while the plugin cannot answer",
        Duration::from_secs(30),
        || store.plugins() == vec![reg.clone()],
    )
    .await;
    assert!(
        !mount.is_finished(),
        "the mount finished while its plugin was paused: {:?}",
        mount.await
    );
    drop(paused);
    mount.await.unwrap().expect("mount");

    // A restarted client knows the plugin, so it can unmount.
    let manager = new_manager(
        &h.root,
        Duration::from_secs(5),
        berth_csimanager::PluginRegistry::new(),
        &store,
        &events,
        &fingerprints,
    );
    manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount after a restart");
    assert!(mounts_under(&h.root).is_empty());
    assert!(store.volumes().is_empty());
}

/// Mounts `m` and then undoes its publish and stage straight through the
/// plugin, leaving the record as it is: what a crash right after the last
/// user's NodeUnstageVolume, before its record was removed, leaves behind
/// (the record still lists the alloc, staged).
async fn crash_after_the_last_unstage(h: &Harness, m: &berth_csimanager::MountRequest) {
    use berth_proto::csi::v1 as csi;
    let target = h.manager.mount_volume(m.clone()).await.unwrap().source;
    let staging = h.manager.staging_path(m);
    let client = h.client();
    client
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: m.external_id.clone(),
            target_path: target.display().to_string(),
        })
        .await
        .expect("NodeUnpublishVolume");
    client
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: m.external_id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume");
    assert!(mounts_under(&h.root).is_empty());
    let stub = h.store.volumes().into_values().next().expect("record kept");
    assert!(stub.staged);
    assert_eq!(stub.allocs.keys().collect::<Vec<_>>(), [&m.alloc_id]);
}

#[tokio::test]
async fn a_teardown_after_a_crash_after_the_last_unstage_removes_the_record() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    crash_after_the_last_unstage(&h, &m).await;

    h.restart();
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("the alloc's teardown finishes");
    assert!(h.store.volumes().is_empty(), "the record is gone");
    assert!(h.manager.volume_stubs().is_empty());
    assert!(mounts_under(&h.root).is_empty());
    assert!(
        !h.root.join(PLUGIN_ID).join("staging").join("v").exists(),
        "the staging directory is removed"
    );
}

#[tokio::test]
async fn a_new_user_after_a_crash_after_the_last_unstage_stages_again() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let old = mount_req("v", &ext, "alloc-old");
    crash_after_the_last_unstage(&h, &old).await;

    // After the restart a new alloc of the volume comes before the old
    // alloc's teardown has run.
    h.restart();
    let new = mount_req("v", &ext, "alloc-new");
    let target = h
        .manager
        .mount_volume(new.clone())
        .await
        .expect("mount the new alloc")
        .source;
    assert_eq!(mount_count_at(&h.manager.staging_path(&new)), 1, "staged");
    std::fs::write(h.backing_dir(&ext).join("data"), "the volume").unwrap();
    assert_eq!(
        std::fs::read_to_string(target.join("data")).unwrap(),
        "the volume"
    );

    // The old alloc's teardown leaves the new alloc's mounts alone.
    h.manager
        .unmount_volume(unmount_req(&old))
        .await
        .expect("the old alloc's teardown");
    assert_eq!(mount_count_at(&h.manager.staging_path(&new)), 1);
    assert_eq!(mount_count_at(&target), 1);
    let stub = h.store.volumes().into_values().next().expect("record kept");
    assert_eq!(stub.allocs.keys().collect::<Vec<_>>(), ["alloc-new"]);

    h.manager.unmount_volume(unmount_req(&new)).await.unwrap();
    assert!(mounts_under(&h.root).is_empty(), "no mount left behind");
    assert!(h.store.volumes().is_empty());
}

#[tokio::test]
async fn a_restore_with_its_staging_in_place_does_not_stage_again() {
    let mut h = Harness::start(&[]).await;
    let ext = h.create_volume("v").await;
    let m = mount_req("v", &ext, "alloc-1");
    let target = h.manager.mount_volume(m.clone()).await.unwrap().source;
    let staging = h.manager.staging_path(&m);

    // The agent restarts; a NodeStageVolume now would fail, so a restore
    // that succeeds made none: the staging was there.
    h.restart();
    h.restart_plugin(&["--fail", "NodeStageVolume=failedprecondition"])
        .await;
    let again = h.manager.mount_volume(m.clone()).await.expect("restored");
    assert_eq!(again.source, target);
    assert_eq!(mount_count_at(&staging), 1);
    assert_eq!(mount_count_at(&target), 1);
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount");
    assert!(mounts_under(&h.root).is_empty());
}
