//! A volume record that says "staged" while nothing is staged (a crash
//! between a finished NodeUnstageVolume and the removal of the record, or
//! the staging unmounted by someone else), against the real
//! `hostpath-plugin` and real mounts: a new user of the volume stages it
//! again instead of publishing from the bare staging directory.
//!
//! The only test of this binary: it counts the NodeStageVolume calls in
//! berth's metrics, which every test of a binary shares.

mod common;

use std::path::Path;

use common::*;
use nix::mount::{umount2, MntFlags};

/// NodeStageVolume calls made to the harness plugin so far.
fn node_stage_calls() -> f64 {
    let series = format!(
        r#"berth_csi_rpc_duration_seconds_count{{plugin="{PLUGIN_ID}",method="NodeStageVolume"}}"#
    );
    berth_metrics::encode()
        .lines()
        .find_map(|l| {
            l.strip_prefix(series.as_str())?
                .strip_prefix(' ')?
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// Detaches every mount at `path`, behind the manager's back.
fn unmount_behind_the_managers_back(path: &Path) {
    while umount2(path, MntFlags::MNT_DETACH).is_ok() {}
    assert_eq!(mount_count_at(path), 0, "{} still mounted", path.display());
}

#[tokio::test]
async fn a_new_user_stages_again_when_the_recorded_staging_is_gone() {
    let h = Harness::start(&[]).await;
    h.manager.refresh_fingerprints().await;
    let ext = h.create_volume("shared").await;
    let a = mount_req("shared", &ext, "alloc-a");
    let b = mount_req("shared", &ext, "alloc-b");
    let staging = h.manager.staging_path(&a);

    let info_a = h.manager.mount_volume(a.clone()).await.expect("mount A");
    assert_eq!(mount_count_at(&staging), 1);

    // What a lost removal of the record leaves: the record says staged
    // (for alloc-a), nothing is mounted at the staging path.
    unmount_behind_the_managers_back(&staging);
    assert!(h.store.volumes().values().all(|s| s.staged));
    let stages_before = node_stage_calls();

    let info_b = h.manager.mount_volume(b.clone()).await.expect("mount B");
    assert_eq!(
        node_stage_calls() - stages_before,
        1.0,
        "B's mount staged the volume again"
    );
    assert_eq!(mount_count_at(&staging), 1, "staged again");
    assert_eq!(mount_count_at(&info_b.source), 1);

    // B's target is the volume, both ways.
    std::fs::write(h.backing_dir(&ext).join("written-at-the-source"), "data").unwrap();
    assert_eq!(
        std::fs::read_to_string(info_b.source.join("written-at-the-source")).unwrap(),
        "data",
        "B's target shows the volume's data"
    );
    std::fs::write(info_b.source.join("written-by-b"), "from b").unwrap();
    assert_eq!(
        std::fs::read_to_string(h.backing_dir(&ext).join("written-by-b")).unwrap(),
        "from b",
        "B's writes land in the volume"
    );

    // A third user finds the staging there: no stage.
    let c = mount_req("shared", &ext, "alloc-c");
    let stages_before = node_stage_calls();
    let info_c = h.manager.mount_volume(c.clone()).await.expect("mount C");
    assert_eq!(node_stage_calls(), stages_before, "a live staging is used");
    assert_eq!(
        std::fs::read_to_string(info_c.source.join("written-by-b")).unwrap(),
        "from b"
    );

    for (m, info) in [(&a, &info_a), (&b, &info_b), (&c, &info_c)] {
        h.manager
            .unmount_volume(unmount_req(m))
            .await
            .unwrap_or_else(|e| panic!("unmount {}: {e}", m.alloc_id));
        assert_eq!(mount_count_at(&info.source), 0);
    }
    assert!(mounts_under(&h.root).is_empty(), "no mount left behind");
    assert!(h.store.volumes().is_empty(), "the record is gone");
}
