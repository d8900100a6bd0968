//! When a plugin instance may stop: not while another alloc on the node has
//! one of its volumes staged or published, unless another healthy instance
//! of the plugin serves the unmounts. Against the real `hostpath-plugin`
//! with real mounts (the tests run as root).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_structs::CsiPluginType;
use common::*;

const WITHIN: Duration = Duration::from_secs(10);

/// The wait must wake on the change itself: it has no timer to fall back
/// on, so this bounds only how long a loaded machine takes to run it.
const PROMPTLY: Duration = Duration::from_secs(5);

/// Waits in a task of its own until the plugin instance of `PLUGIN_ALLOC`
/// is unneeded; the counts of volumes it reported on the way are kept in
/// the returned list.
fn spawn_wait_until_unneeded(h: &Harness) -> (Arc<Mutex<Vec<usize>>>, tokio::task::JoinHandle<()>) {
    let reported: Arc<Mutex<Vec<usize>>> = Arc::default();
    let manager = h.manager.clone();
    let into = reported.clone();
    let wait = tokio::spawn(async move {
        manager
            .wait_until_plugin_instance_unneeded(PLUGIN_ID, PLUGIN_ALLOC, |n| {
                into.lock().unwrap().push(n)
            })
            .await
    });
    (reported, wait)
}

#[tokio::test]
async fn a_plugin_instance_is_needed_while_its_volumes_are_mounted_for_other_allocs() {
    let h = Harness::start(&[]).await;
    let a = h.create_volume("a").await;
    let b = h.create_volume("b").await;
    let ma = mount_req("a", &a, "alloc-1");
    let mb = mount_req("b", &b, "alloc-2");
    h.manager.mount_volume(ma.clone()).await.expect("mount a");
    h.manager.mount_volume(mb.clone()).await.expect("mount b");
    let needed = || {
        h.manager
            .volumes_needing_plugin_instance(PLUGIN_ID, PLUGIN_ALLOC)
    };
    assert_eq!(needed(), 2);
    assert_eq!(
        h.manager
            .volumes_needing_plugin_instance("other-plugin", PLUGIN_ALLOC),
        0,
        "only the plugin's own volumes count"
    );

    let (reported, wait) = spawn_wait_until_unneeded(&h);
    wait_for("the wait to report 2 volumes", WITHIN, || {
        *reported.lock().unwrap() == [2]
    })
    .await;

    // One volume unmounted: one left, reported once more.
    h.manager
        .unmount_volume(unmount_req(&ma))
        .await
        .expect("unmount a");
    wait_for("the wait to report 1 volume", WITHIN, || {
        *reported.lock().unwrap() == [2, 1]
    })
    .await;
    assert!(!wait.is_finished(), "volume b still needs the plugin");

    // A new healthy instance of the plugin serves the unmounts: the old
    // one is free to stop at once.
    let mut newer = registration(&h.plugin.socket, CsiPluginType::Monolith);
    newer.alloc_id = "plugin-alloc-2".into();
    h.registry.register(newer);
    tokio::time::timeout(PROMPTLY, wait)
        .await
        .expect("the wait ends as soon as another instance registers")
        .expect("wait task");
    assert_eq!(*reported.lock().unwrap(), [2, 1]);
    assert_eq!(needed(), 0);

    // An unhealthy instance serves nothing.
    assert!(h
        .registry
        .mark_unhealthy(PLUGIN_ID, "plugin-alloc-2", "probe failed"));
    assert_eq!(needed(), 1);
    // A controller-only instance does not serve node unmounts.
    let mut controller = registration(&h.plugin.socket, CsiPluginType::Controller);
    controller.alloc_id = "plugin-alloc-3".into();
    h.registry.register(controller);
    assert_eq!(needed(), 1);

    // Back to the one instance: the wait ends when the last volume is
    // unmounted.
    h.registry
        .register(registration(&h.plugin.socket, CsiPluginType::Monolith));
    let (reported, wait) = spawn_wait_until_unneeded(&h);
    wait_for("the wait to report 1 volume", WITHIN, || {
        *reported.lock().unwrap() == [1]
    })
    .await;
    h.manager
        .unmount_volume(unmount_req(&mb))
        .await
        .expect("unmount b");
    tokio::time::timeout(PROMPTLY, wait)
        .await
        .expect("the wait ends as soon as the last volume is unmounted")
        .expect("wait task");
    assert_eq!(needed(), 0);
    assert!(mounts_under(&h.root).is_empty());

    // Nothing mounted: no wait, no report.
    let mut calls = 0;
    h.manager
        .wait_until_plugin_instance_unneeded(PLUGIN_ID, PLUGIN_ALLOC, |_| calls += 1)
        .await;
    assert_eq!(calls, 0);
}

/// An unstage left unfinished (the volume is still staged though no alloc
/// uses it) still needs the plugin; a volume of the plugin instance's own
/// alloc does not.
#[tokio::test]
async fn an_unfinished_unstage_still_needs_the_plugin_instance() {
    let h = Harness::start(&["--fail", "NodeUnstageVolume=internal:1"]).await;
    let needed = || {
        h.manager
            .volumes_needing_plugin_instance(PLUGIN_ID, PLUGIN_ALLOC)
    };
    let v = h.create_volume("v").await;
    let m = mount_req("v", &v, "alloc-1");
    h.manager.mount_volume(m.clone()).await.expect("mount");
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect_err("the unstage fails");
    assert!(h
        .manager
        .volume_stubs()
        .iter()
        .any(|s| s.allocs.is_empty() && s.staged));
    assert_eq!(needed(), 1, "the stage is left to undo");

    let own = mount_req("w", &h.create_volume("w").await, PLUGIN_ALLOC);
    h.manager
        .mount_volume(own.clone())
        .await
        .expect("mount own");
    assert_eq!(needed(), 1, "the instance's own alloc does not count");

    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("the unstage is finished");
    assert_eq!(needed(), 0);
    h.manager
        .unmount_volume(unmount_req(&own))
        .await
        .expect("unmount own");
    assert!(mounts_under(&h.root).is_empty());
}
