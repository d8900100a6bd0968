//! A volume record that says "staged" while nothing is staged (a crash
//! between a finished NodeUnstageVolume and the removal of the record, or
//! the staging unmounted by someone else), against the real
//! `hostpath-plugin` and real mounts: a new user of the volume stages it
//! again instead of publishing from the bare staging directory.
//!
//! The tests count the NodeStageVolume calls in berth's metrics, which
//! every test of a binary shares: they run one at a time.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use berth_csimanager::volume_manager::volume_capability;
use berth_proto::csi::v1 as csi;
use berth_structs::{AccessMode, AttachmentMode, CsiMountOptions, NodeEvent};
use berth_testutil::loops::{loop_devices_unusable, loops_backed_under};
use common::*;
use nix::mount::{umount2, MntFlags};

/// Held by each test: one at a time counts NodeStageVolume calls.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    let _one = ONE_AT_A_TIME.lock().await;
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

/// Detaches the loop devices backed below its directory when dropped,
/// also when the test fails (after the harness took its mounts away).
struct LoopCleanup(std::path::PathBuf);

impl Drop for LoopCleanup {
    fn drop(&mut self) {
        for dev in loops_backed_under(&self.0) {
            let _ = std::process::Command::new("losetup")
                .arg("-d")
                .arg(&dev)
                .status();
        }
    }
}

#[tokio::test]
async fn a_block_volume_is_staged_again_when_its_staged_device_is_gone() {
    let _one = ONE_AT_A_TIME.lock().await;
    if let Some(why) = loop_devices_unusable() {
        eprintln!("skipping: image-backed block volumes cannot work here: {why}");
        return;
    }
    let loops;
    let h = Harness::start(&[]).await;
    loops = LoopCleanup(h.dir.path().to_path_buf());
    h.manager.refresh_fingerprints().await;
    let (access, attach) = (
        AccessMode::MultiNodeMultiWriter,
        AttachmentMode::BlockDevice,
    );
    let ext = h
        .client()
        .create_volume(csi::CreateVolumeRequest {
            name: "disk".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 16 << 20,
                limit_bytes: 16 << 20,
            }),
            volume_capabilities: vec![volume_capability(
                access,
                attach,
                &CsiMountOptions::default(),
            )],
            parameters: [("backing".to_string(), "image".to_string())].into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .volume
        .expect("volume")
        .volume_id;
    let block_req = |alloc_id: &str| {
        let mut m = mount_req("disk", &ext, alloc_id);
        m.access_mode = access;
        m.attachment_mode = attach;
        m
    };
    let (a, b) = (block_req("alloc-a"), block_req("alloc-b"));
    let staging = h.manager.staging_path(&a);

    let info_a = h.manager.mount_volume(a.clone()).await.expect("mount A");
    let staged_below = mounts_under(&staging);
    assert!(
        !staged_below.is_empty() && mount_count_at(&staging) == 0,
        "the block staging is a mount inside the staging directory: {staged_below:?}"
    );

    // A live block staging is not taken for lost: a repair round leaves it.
    let _watch = h.manager.watch_repairs("alloc-a");
    h.manager.repair_lost_mounts().await;
    assert!(
        h.events
            .with_message(NodeEvent::SUBSYSTEM_STORAGE, "Volume repaired")
            .is_empty(),
        "nothing was lost: {:?}",
        h.events.all()
    );

    // The staged device goes behind the manager's back.
    for m in &staged_below {
        unmount_behind_the_managers_back(m);
    }
    let stages_before = node_stage_calls();
    let info_b = h.manager.mount_volume(b.clone()).await.expect("mount B");
    assert_eq!(
        node_stage_calls() - stages_before,
        1.0,
        "B's mount staged the volume again"
    );
    assert!(!mounts_under(&staging).is_empty(), "staged again");

    // Bytes written through A's device are read through B's.
    let block = b"the same block device\n";
    {
        use std::io::Write;
        let mut dev = std::fs::OpenOptions::new()
            .write(true)
            .open(&info_a.source)
            .expect("open A's device");
        dev.write_all(block).unwrap();
        dev.sync_all().unwrap();
    }
    let mut read = vec![0u8; block.len()];
    {
        use std::io::Read;
        std::fs::File::open(&info_b.source)
            .expect("open B's device")
            .read_exact(&mut read)
            .unwrap();
    }
    assert_eq!(read, block);

    for m in [&a, &b] {
        h.manager
            .unmount_volume(unmount_req(m))
            .await
            .unwrap_or_else(|e| panic!("unmount {}: {e}", m.alloc_id));
    }
    assert!(mounts_under(&h.root).is_empty(), "no mount left behind");
    assert!(h.store.volumes().is_empty(), "the record is gone");
    wait_for(
        "the loop device to be detached",
        Duration::from_secs(10),
        || loops_backed_under(&loops.0).is_empty(),
    )
    .await;
}
