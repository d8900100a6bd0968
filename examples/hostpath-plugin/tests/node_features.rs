//! Runs the real `hostpath-plugin` binary and drives its node-side features
//! over CSI: volume stats and condition, image-backed volumes on loop
//! devices, block volumes handed out as device files, node expansion.
//! Needs root; the image tests return early (saying why) where loop devices
//! cannot be used.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use berth_proto::csi::v1::controller_client::ControllerClient;
use berth_proto::csi::v1::node_client::NodeClient;
use berth_proto::csi::v1::volume_capability::access_mode::Mode;
use berth_proto::csi::v1::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use berth_proto::csi::v1::volume_usage::Unit;
use berth_proto::csi::v1::*;
use nix::mount::{umount2, MntFlags};
use tonic::transport::Channel;
use tonic::Code;

use common::*;

/// The loop device attached to `image`, from sysfs.
fn loop_of(image: &Path) -> Option<PathBuf> {
    let image = fs::canonicalize(image).ok()?;
    fs::read_dir("/sys/block").ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        let backing = fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
        (name.starts_with("loop") && Path::new(backing.trim_end()) == image)
            .then(|| PathBuf::from("/dev").join(name))
    })
}

/// Whether loop devices can be attached here; prints why not.
fn loop_devices_usable() -> bool {
    tools_usable(&[("losetup", "--find")])
}

fn block_capability(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

fn ext4_capability(flags: &[&str]) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            volume_mount_group: String::new(),
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

async fn create_image_volume(
    controller: &mut ControllerClient<Channel>,
    name: &str,
    bytes: i64,
    cap: VolumeCapability,
) -> String {
    let mut req = create_request(name, bytes, 0);
    req.parameters.insert("backing".into(), "image".into());
    req.volume_capabilities = vec![cap];
    controller
        .create_volume(req)
        .await
        .expect("create an image-backed volume")
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

async fn stats(
    node: &mut NodeClient<Channel>,
    volume_id: &str,
    path: &Path,
) -> Result<NodeGetVolumeStatsResponse, tonic::Status> {
    node.node_get_volume_stats(NodeGetVolumeStatsRequest {
        volume_id: volume_id.into(),
        volume_path: path.display().to_string(),
        staging_target_path: String::new(),
    })
    .await
    .map(|r| r.into_inner())
}

fn byte_usage(stats: &NodeGetVolumeStatsResponse) -> VolumeUsage {
    stats
        .usage
        .iter()
        .find(|u| u.unit == Unit::Bytes as i32)
        .cloned()
        .expect("byte usage")
}

#[tokio::test]
async fn stats_report_condition_and_spec_error_codes() {
    let mut plugin = PluginProcess::start(&["--node-id=node-s"]);
    let (mut controller, mut node) = plugin.clients().await;

    let caps = node
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let types: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match c.r#type {
            Some(node_service_capability::Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    for t in [
        node_service_capability::rpc::Type::GetVolumeStats,
        node_service_capability::rpc::Type::VolumeCondition,
        node_service_capability::rpc::Type::ExpandVolume,
    ] {
        assert!(types.contains(&(t as i32)), "{t:?} advertised");
    }

    let volume_id = controller
        .create_volume(create_request("dir", 0, 0))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let staging = plugin.path("staging/dir");
    node.node_stage_volume(stage_request(&volume_id, &staging))
        .await
        .unwrap();

    // Conformance of the error codes.
    let relative = node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: volume_id.clone(),
            volume_path: "some/path".into(),
            staging_target_path: String::new(),
        })
        .await;
    assert_eq!(code(relative), Code::NotFound);
    assert_eq!(
        code(stats(&mut node, &volume_id, &plugin.path("nowhere")).await),
        Code::NotFound
    );
    assert_eq!(
        code(stats(&mut node, "", &staging).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(stats(&mut node, &volume_id, Path::new("")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(stats(&mut node, "00000000-0000-5000-8000-000000000000", &staging).await),
        Code::NotFound
    );

    // A live mount: healthy, with usage.
    let live = stats(&mut node, &volume_id, &staging).await.unwrap();
    assert!(!live.volume_condition.as_ref().unwrap().abnormal);
    assert!(byte_usage(&live).total > 0);

    // The mount disappears behind the plugin's back: abnormal.
    umount2(&staging, MntFlags::MNT_DETACH).unwrap();
    let gone = stats(&mut node, &volume_id, &staging).await.unwrap();
    let condition = gone.volume_condition.unwrap();
    assert!(condition.abnormal, "{condition:?}");
    assert!(
        condition.message.contains("no longer mounted"),
        "{condition:?}"
    );

    // Block access on a directory volume is refused, naming why.
    let mut block = stage_request(&volume_id, &plugin.path("staging/block"));
    block.volume_capability = Some(block_capability(Mode::SingleNodeWriter));
    let err = node.node_stage_volume(block).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("image-backed"), "{}", err.message());

    node.node_unstage_volume(unstage_request(&volume_id, &staging))
        .await
        .unwrap();
    assert!(mounts_under(&plugin.root).is_empty());
}

#[tokio::test]
async fn image_volume_is_an_ext4_filesystem_that_expands() {
    if !loop_devices_usable() {
        return;
    }
    let mut plugin = PluginProcess::start(&["--node-id=node-i"]);
    let (mut controller, mut node) = plugin.clients().await;

    let cap = ext4_capability(&["noatime"]);
    let volume_id = create_image_volume(&mut controller, "img", 32 * MIB, cap.clone()).await;
    let image = plugin
        .state_dir
        .join("images")
        .join(format!("{volume_id}.img"));
    assert_eq!(fs::metadata(&image).unwrap().len(), 32 * MIB as u64);

    let staging = plugin.path("staging/img");
    let target = plugin.path("pods/p1/img");
    let mut stage = stage_request(&volume_id, &staging);
    stage.volume_capability = Some(cap.clone());
    node.node_stage_volume(stage.clone()).await.unwrap();
    let options = mount_options(&plugin.root, &staging).expect("staged");
    assert!(options.contains(&"noatime".to_owned()), "{options:?}");
    let mut publish = publish_request(&volume_id, &staging, &target, false);
    publish.volume_capability = Some(cap.clone());
    node.node_publish_volume(publish).await.unwrap();
    fs::write(target.join("hello"), b"on ext4").unwrap();

    let before = stats(&mut node, &volume_id, &target).await.unwrap();
    assert!(!before.volume_condition.as_ref().unwrap().abnormal);
    let before_total = byte_usage(&before).total;
    assert!(
        before_total > 16 * MIB && before_total <= 32 * MIB,
        "the image's own filesystem: {before_total}"
    );

    // Expand: the controller grows the image, the node grows the filesystem.
    let expanded = controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expanded.capacity_bytes, 64 * MIB);
    assert!(expanded.node_expansion_required);
    let node_expand = node
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: volume_id.clone(),
            volume_path: target.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await;
    match node_expand {
        Ok(r) => assert_eq!(r.into_inner().capacity_bytes, 64 * MIB),
        Err(status) => {
            // Online growth needs CAP_SYS_RESOURCE; without it the plugin
            // says so, and the filesystem grows at the next stage.
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            assert!(status.message().contains("CAP_SYS_RESOURCE"), "{status:?}");
            unpublish_and_unstage(&mut node, &volume_id, &staging, &target).await;
            assert_eq!(loop_of(&image), None, "detached on unstage");
            node.node_stage_volume(stage.clone()).await.unwrap();
            let mut publish = publish_request(&volume_id, &staging, &target, false);
            publish.volume_capability = Some(cap.clone());
            node.node_publish_volume(publish).await.unwrap();
        }
    }
    let after = stats(&mut node, &volume_id, &target).await.unwrap();
    assert!(
        byte_usage(&after).total > before_total + 24 * MIB,
        "{before_total} -> {}",
        byte_usage(&after).total
    );
    assert_eq!(fs::read(target.join("hello")).unwrap(), b"on ext4");

    // A restarted plugin still finds the loop device of the image.
    plugin.stop();
    plugin.spawn(&["--node-id=node-i"]);
    let (mut controller, mut node) = plugin.clients().await;
    unpublish_and_unstage(&mut node, &volume_id, &staging, &target).await;
    assert_eq!(loop_of(&image), None, "detached after the restart");
    assert!(mounts_under(&plugin.root).is_empty());
    controller
        .delete_volume(DeleteVolumeRequest {
            volume_id,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!image.exists());
}

#[tokio::test]
async fn block_volume_bytes_survive_from_one_publish_to_the_next() {
    if !loop_devices_usable() {
        return;
    }
    let mut plugin = PluginProcess::start(&["--node-id=node-b"]);
    let (mut controller, mut node) = plugin.clients().await;

    let cap = block_capability(Mode::SingleNodeWriter);
    let volume_id = create_image_volume(&mut controller, "blk", 8 * MIB, cap.clone()).await;
    let image = plugin
        .state_dir
        .join("images")
        .join(format!("{volume_id}.img"));
    let staging = plugin.path("staging/blk");
    let mut stage = stage_request(&volume_id, &staging);
    stage.volume_capability = Some(cap.clone());
    node.node_stage_volume(stage.clone()).await.unwrap();
    node.node_stage_volume(stage.clone()).await.unwrap();
    assert!(loop_of(&image).is_some(), "attached at stage");

    let publish_at = |target: &Path, readonly: bool| {
        let mut p = publish_request(&volume_id, &staging, target, readonly);
        p.volume_capability = Some(cap.clone());
        p
    };
    let unpublish = |target: &Path| unpublish_request(&volume_id, target);
    let first = plugin.path("pods/a/disk");
    let second = plugin.path("pods/b/disk");
    let payload = b"berth block volume";

    node.node_publish_volume(publish_at(&first, false))
        .await
        .unwrap();
    assert!(fs::metadata(&first).unwrap().file_type().is_block_device());
    let stats_first = stats(&mut node, &volume_id, &first).await.unwrap();
    assert!(!stats_first.volume_condition.as_ref().unwrap().abnormal);
    assert_eq!(byte_usage(&stats_first).total, 8 * MIB);
    {
        let mut dev = fs::OpenOptions::new().write(true).open(&first).unwrap();
        dev.seek(SeekFrom::Start(4096)).unwrap();
        dev.write_all(payload).unwrap();
        dev.sync_all().unwrap();
    }
    node.node_unpublish_volume(unpublish(&first)).await.unwrap();
    assert!(!first.exists(), "the device file is removed");

    node.node_publish_volume(publish_at(&second, true))
        .await
        .unwrap();
    let mut read_back = vec![0; payload.len()];
    let mut dev = fs::File::open(&second).unwrap();
    dev.seek(SeekFrom::Start(4096)).unwrap();
    dev.read_exact(&mut read_back).unwrap();
    drop(dev);
    assert_eq!(read_back, payload);
    let options = mount_options(&plugin.root, &second).unwrap();
    assert!(options.contains(&"ro".to_owned()), "{options:?}");
    // A read-only publish is a read-only device: writes are refused.
    let written = fs::OpenOptions::new()
        .write(true)
        .open(&second)
        .and_then(|mut dev| dev.write_all(b"overwrite"));
    assert!(written.is_err(), "a read-only block publish took a write");

    node.node_unpublish_volume(unpublish(&second))
        .await
        .unwrap();
    for _ in 0..2 {
        node.node_unstage_volume(unstage_request(&volume_id, &staging))
            .await
            .unwrap();
    }
    assert_eq!(loop_of(&image), None, "detached on unstage");
    assert!(mounts_under(&plugin.root).is_empty());
    assert!(!staging.exists());
}
