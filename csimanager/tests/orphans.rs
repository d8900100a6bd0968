//! Orphaned mounts at start: usages of allocs that were not restored are
//! released through their plugin (or, without it, unmounted lazily with
//! the unstage left for later), mounts below the CSI root that no record
//! explains and mounts in the dirs of allocs that were not restored are
//! unmounted, and nothing else is touched. Against the real
//! `hostpath-plugin` with real mounts (the tests run as root).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_csimanager::{OrphanRemoval, RemovedHow, EVENT_ORPHANED_MOUNT_REMOVED};
use berth_structs::NodeEvent;
use berth_testutil::bind_mount;
use common::*;

fn mounted(path: &Path) -> bool {
    mount_count_at(&path.canonicalize().unwrap_or_else(|_| path.to_path_buf())) > 0
}

fn removal_at<'a>(removed: &'a [OrphanRemoval], path: &Path) -> &'a OrphanRemoval {
    removed
        .iter()
        .find(|r| r.path == path)
        .unwrap_or_else(|| panic!("no removal of {}: {removed:?}", path.display()))
}

fn known(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn orphaned_usages_go_through_the_plugin_and_stray_mounts_are_unmounted() {
    let mut h = Harness::start(&[]).await;
    let dir = h.dir.path().canonicalize().unwrap();
    let alloc_root = dir.join("alloc");
    let gone_ext = h.create_volume("gone-vol").await;
    let kept_ext = h.create_volume("kept-vol").await;
    let gone = h
        .manager
        .mount_volume(mount_req("gone-vol", &gone_ext, "gone"))
        .await
        .unwrap();
    let kept = h
        .manager
        .mount_volume(mount_req("kept-vol", &kept_ext, "kept"))
        .await
        .unwrap();
    let gone_staging = h
        .manager
        .staging_path(&mount_req("gone-vol", &gone_ext, "gone"));
    let gone_target = gone.source.canonicalize().unwrap();
    let gone_staging = gone_staging.canonicalize().unwrap();
    // What the task runners bound into the task dirs.
    let gone_bind = alloc_root.join("gone/t/data");
    let kept_bind = alloc_root.join("kept/t/data");
    bind_mount(&gone_target, &gone_bind);
    bind_mount(&kept.source, &kept_bind);
    // A staging mount that no record explains, and a mount outside the roots.
    let stray = dir.join("csi/hostpath/staging/stray/single-node-writer-file-system");
    bind_mount(&dir.join("stray-src"), &stray);
    let outside = dir.join("outside/m");
    bind_mount(&dir.join("outside-src"), &outside);

    // A restart that restores only "kept".
    h.restart();
    let removed = h
        .manager
        .remove_orphaned_mounts(&alloc_root, &known(&["kept"]), Duration::from_secs(5))
        .await;

    for (path, how, volume) in [
        (&gone_bind, RemovedHow::Unmount, None),
        (&gone_target, RemovedHow::Plugin, Some("gone-vol")),
        (&gone_staging, RemovedHow::Plugin, Some("gone-vol")),
        (&stray, RemovedHow::Unmount, Some("stray")),
    ] {
        let r = removal_at(&removed, path);
        assert_eq!(r.how, how, "{r:?}");
        assert_eq!(r.volume_id.as_deref(), volume, "{r:?}");
        assert_eq!(r.error, None, "{r:?}");
        assert!(!mounted(path), "{} still mounted", path.display());
    }
    assert_eq!(removed.len(), 4, "{removed:?}");
    assert!(h.store.volumes().keys().all(|k| !k.contains("gone-vol")));
    // The backing data is untouched.
    assert!(h.backing_dir(&gone_ext).is_dir());
    // What a restored alloc owns, and what lies outside, stays.
    assert!(mounted(&kept.source));
    assert!(mounted(&kept_bind));
    assert!(mounted(&outside));

    let events = h
        .events
        .with_message(NodeEvent::SUBSYSTEM_STORAGE, EVENT_ORPHANED_MOUNT_REMOVED);
    assert_eq!(events.len(), 4, "{events:?}");
    let staging_event = events
        .iter()
        .find(|e| e.details["path"] == gone_staging.display().to_string())
        .expect("an event for the staging mount");
    assert_eq!(staging_event.details["how"], "plugin");
    assert_eq!(staging_event.details["volume_id"], "gone-vol");
    assert_eq!(staging_event.details["error"], "");
}

#[tokio::test]
async fn without_the_plugin_orphaned_usages_are_unmounted_and_the_unstage_waits() {
    let mut h = Harness::start(&[]).await;
    let dir = h.dir.path().canonicalize().unwrap();
    let ext = h.create_volume("vol").await;
    let req = mount_req("vol", &ext, "gone");
    let target: PathBuf = h
        .manager
        .mount_volume(req.clone())
        .await
        .unwrap()
        .source
        .canonicalize()
        .unwrap();
    let staging = h.manager.staging_path(&req).canonicalize().unwrap();
    h.plugin.kill();
    h.restart();
    let removed = h
        .manager
        .remove_orphaned_mounts(&dir.join("alloc"), &known(&[]), Duration::from_secs(1))
        .await;
    for path in [&target, &staging] {
        let r = removal_at(&removed, path);
        assert_eq!(r.how, RemovedHow::Unmount, "{r:?}");
        assert!(
            r.error
                .as_deref()
                .is_some_and(|e| e.contains("not through the plugin")),
            "{r:?}"
        );
        assert!(!mounted(path), "{} still mounted", path.display());
    }
    // The usage is forgotten, the unstage is still to be made once the
    // plugin is back.
    let stubs: Vec<_> = h.store.volumes().into_values().collect();
    assert_eq!(stubs.len(), 1, "{stubs:?}");
    assert!(stubs[0].allocs.is_empty() && stubs[0].staged, "{stubs:?}");
}
