//! Growing a published volume on the node (`NodeExpandVolume`) against the
//! real `hostpath-plugin`: the volume manager finds the publish target of a
//! claiming alloc and refuses a volume that is not published here.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use berth_csimanager::{CsiError, ExpandRequest};
use common::*;

fn expand_req(m: &berth_csimanager::MountRequest, allocs: &[&str]) -> ExpandRequest {
    ExpandRequest {
        plugin_id: m.plugin_id.clone(),
        volume_id: m.volume_id.clone(),
        external_id: m.external_id.clone(),
        alloc_ids: allocs.iter().map(|a| a.to_string()).collect(),
        capacity_min: 1 << 20,
        capacity_max: 0,
        access_mode: m.access_mode,
        attachment_mode: m.attachment_mode,
        mount_options: m.mount_options.clone(),
        secrets: m.secrets.clone(),
    }
}

#[tokio::test]
async fn a_published_volume_is_expanded_through_a_claiming_allocs_target() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("grow").await;
    let m = mount_req("grow", &ext, "alloc-1");

    // Not published here yet: nothing to expand, said so.
    let err = h
        .manager
        .expand_volume(expand_req(&m, &["alloc-1"]))
        .await
        .expect_err("not published");
    assert!(matches!(err, CsiError::Volume { .. }), "{err:?}");
    assert!(
        err.to_string().contains("not published on this node"),
        "{err}"
    );

    h.manager.mount_volume(m.clone()).await.expect("mount");
    h.manager
        .expand_volume(expand_req(&m, &["alloc-1"]))
        .await
        .expect("expand through alloc-1's target");
    // Any alloc using it when none is named.
    h.manager
        .expand_volume(expand_req(&m, &[]))
        .await
        .expect("expand through any target");
    // An alloc that does not use it here is no way in.
    let err = h
        .manager
        .expand_volume(expand_req(&m, &["alloc-9"]))
        .await
        .expect_err("alloc-9 has no target");
    assert!(err.to_string().contains("alloc-9"), "{err}");

    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount");
}
