//! Runs the real `hostpath-plugin` binary on a temporary unix socket and
//! drives volumes through their whole life over CSI, with real bind mounts.
//! Needs root (to mount).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::process::Command;
use std::time::Duration;

use berth_proto::csi::v1::controller_client::ControllerClient;
use berth_proto::csi::v1::controller_service_capability::rpc;
use berth_proto::csi::v1::identity_client::IdentityClient;
use berth_proto::csi::v1::node_client::NodeClient;
use berth_proto::csi::v1::volume_capability::access_mode::Mode;
use berth_proto::csi::v1::volume_usage::Unit;
use berth_proto::csi::v1::*;
use tonic::Code;

use common::*;

#[tokio::test]
async fn volume_lifecycle_with_read_only_publish() {
    let mut plugin = PluginProcess::start(&["--node-id", "node-a"]);
    let channel = plugin.connect().await;
    let mut identity = IdentityClient::new(channel.clone());
    let mut controller = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel);

    let info = identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "hostpath.csi.berth.dev");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    let probe = identity.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
    let node_info = node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node_info.node_id, "node-a");

    // Create, idempotently.
    let volume = controller
        .create_volume(create_request("vol-1", 10 * MIB, 0))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(volume.capacity_bytes, 10 * MIB);
    let again = controller
        .create_volume(create_request("vol-1", 10 * MIB, 20 * MIB))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, volume.volume_id);
    assert_eq!(
        code(
            controller
                .create_volume(create_request("vol-1", 0, MIB))
                .await
        ),
        Code::AlreadyExists
    );
    let volume_id = volume.volume_id;
    let volume_dir = plugin.state_dir.join("volumes").join(&volume_id);
    assert!(volume_dir.is_dir());

    // Stage (the staging path does not exist yet), twice.
    let staging = plugin.path("staging/vol-1");
    let target = plugin.path("pods/p1/vol-1");
    for _ in 0..2 {
        node.node_stage_volume(stage_request(&volume_id, &staging))
            .await
            .unwrap();
    }
    // Publish read-only, twice; a read-write publish at the same target clashes.
    for _ in 0..2 {
        node.node_publish_volume(publish_request(&volume_id, &staging, &target, true))
            .await
            .unwrap();
    }
    assert_eq!(
        code(
            node.node_publish_volume(publish_request(&volume_id, &staging, &target, false))
                .await
        ),
        Code::AlreadyExists
    );

    let staged = mount_options(&plugin.root, &staging).expect("staging path is mounted");
    assert!(staged.contains(&"rw".to_owned()), "{staged:?}");
    let published = mount_options(&plugin.root, &target).expect("target path is mounted");
    assert!(published.contains(&"ro".to_owned()), "{published:?}");

    // Data written through the staging mount lands in the volume and shows
    // through the target; the target itself refuses writes.
    fs::write(staging.join("hello.txt"), b"hello").unwrap();
    assert_eq!(fs::read(volume_dir.join("hello.txt")).unwrap(), b"hello");
    assert_eq!(fs::read(target.join("hello.txt")).unwrap(), b"hello");
    let err = fs::write(target.join("nope.txt"), b"x").expect_err("target is read-only");
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");

    let stats = node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: volume_id.clone(),
            volume_path: target.display().to_string(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == Unit::Bytes as i32)
        .expect("byte usage");
    assert!(bytes.total > 0 && bytes.used >= 0 && bytes.available >= 0);

    // Deleting a mounted volume is refused.
    assert_eq!(
        code(
            controller
                .delete_volume(DeleteVolumeRequest {
                    volume_id: volume_id.clone(),
                    ..Default::default()
                })
                .await
        ),
        Code::FailedPrecondition
    );

    // Unpublish, twice.
    for _ in 0..2 {
        node.node_unpublish_volume(unpublish_request(&volume_id, &target))
            .await
            .unwrap();
    }
    assert!(mount_options(&plugin.root, &target).is_none());
    assert!(!target.exists(), "target directory is removed");
    assert_eq!(
        code(
            node.node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: volume_id.clone(),
                volume_path: target.display().to_string(),
                staging_target_path: String::new(),
            })
            .await
        ),
        Code::NotFound
    );

    // Unstage, twice.
    for _ in 0..2 {
        node.node_unstage_volume(unstage_request(&volume_id, &staging))
            .await
            .unwrap();
    }
    assert!(!staging.exists(), "staging directory is removed");

    // Delete, twice.
    for _ in 0..2 {
        controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(!volume_dir.exists());
    assert!(
        mounts_under(&plugin.root).is_empty(),
        "nothing is left mounted"
    );

    let status = plugin.stop();
    assert!(status.success(), "{status}");
    assert!(!plugin.socket.exists(), "socket removed on shutdown");
    let logs = plugin.logs();
    assert!(!logs.contains("hunter2"), "secrets must never be logged");
}

#[tokio::test]
async fn attach_faults_concurrency_and_restart() {
    let mut plugin = PluginProcess::start(&[
        "--node-id=node-b",
        "--enable-attach",
        "--fail",
        "NodeStageVolume=unavailable:1",
        "--delay=NodePublishVolume=1s",
    ]);
    let (mut controller, mut node) = plugin.clients().await;

    let types = controller_rpcs(&mut controller).await;
    assert!(
        types.contains(&rpc::Type::PublishUnpublishVolume),
        "{types:?}"
    );

    let mut ids = Vec::new();
    for name in ["a", "b", "c"] {
        let v = controller
            .create_volume(create_request(name, 0, 0))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        ids.push(v.volume_id);
    }
    let volume_id = ids[0].clone();
    let staging = plugin.path("staging/a");
    let target = plugin.path("target/a");

    // The first stage call gets the injected failure; the second is refused
    // because the volume is not controller-published yet.
    assert_eq!(
        code(
            node.node_stage_volume(stage_request(&volume_id, &staging))
                .await
        ),
        Code::Unavailable
    );
    assert_eq!(
        code(
            node.node_stage_volume(stage_request(&volume_id, &staging))
                .await
        ),
        Code::FailedPrecondition
    );

    let publish = |node_id: &str, readonly: bool| ControllerPublishVolumeRequest {
        volume_id: volume_id.clone(),
        node_id: node_id.to_owned(),
        volume_capability: Some(capability(Mode::SingleNodeWriter)),
        readonly,
        ..Default::default()
    };
    assert_eq!(
        code(
            controller
                .controller_publish_volume(publish("elsewhere", false))
                .await
        ),
        Code::NotFound
    );
    let context = controller
        .controller_publish_volume(publish("node-b", false))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(
        context.get("published_by").map(String::as_str),
        Some("node-b")
    );
    controller
        .controller_publish_volume(publish("node-b", false))
        .await
        .unwrap();
    assert_eq!(
        code(
            controller
                .controller_publish_volume(publish("node-b", true))
                .await
        ),
        Code::AlreadyExists
    );
    let mut stage = stage_request(&volume_id, &staging);
    stage.publish_context = context;
    node.node_stage_volume(stage).await.unwrap();

    // Two publishes of one volume at once: the second is turned away while
    // the first (delayed by a second) is in flight.
    let mut node2 = node.clone();
    let req = publish_request(&volume_id, &staging, &target, false);
    let (first, second) = tokio::join!(node.node_publish_volume(req.clone()), async {
        // Let the first call claim the volume.
        tokio::time::sleep(Duration::from_millis(200)).await;
        node2.node_publish_volume(req.clone()).await
    });
    first.unwrap();
    assert_eq!(code(second), Code::Aborted);
    assert!(mount_options(&plugin.root, &target).is_some());

    // State survives a restart.
    assert!(plugin.stop().success());
    plugin.spawn(&["--node-id=node-b", "--enable-attach"]);
    let (mut controller, mut node) = plugin.clients().await;

    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = controller
            .list_volumes(ListVolumesRequest {
                max_entries: 2,
                starting_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 2);
        for entry in page.entries {
            let volume = entry.volume.unwrap();
            let published = entry.status.unwrap().published_node_ids;
            if volume.volume_id == volume_id {
                assert_eq!(published, ["node-b"]);
            } else {
                assert!(published.is_empty());
            }
            seen.push(volume.volume_id);
        }
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    let mut want = ids.clone();
    want.sort();
    assert_eq!(seen, want);
    assert_eq!(
        code(
            controller
                .list_volumes(ListVolumesRequest {
                    max_entries: 0,
                    starting_token: "not-a-token".into(),
                })
                .await
        ),
        Code::Aborted
    );

    // Tear down in order; unpublishing twice is fine.
    unpublish_and_unstage(&mut node, &volume_id, &staging, &target).await;
    assert_eq!(
        code(
            controller
                .delete_volume(DeleteVolumeRequest {
                    volume_id: volume_id.clone(),
                    ..Default::default()
                })
                .await
        ),
        Code::FailedPrecondition,
        "a controller-published volume cannot be deleted"
    );
    for _ in 0..2 {
        controller
            .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
                volume_id: volume_id.clone(),
                node_id: "node-b".into(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    for id in &ids {
        controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(mounts_under(&plugin.root).is_empty());
    assert!(plugin.stop().success());
}

#[test]
fn bad_flags_exit_2() {
    for args in [
        &["--bogus"][..],
        &[
            "--endpoint=unix:///tmp/x.sock",
            "--state-dir=/tmp/x",
            "--fail",
            "Probe=nope",
        ],
        &["--endpoint=tcp://x", "--state-dir=/tmp/x"],
    ] {
        let out = Command::new(BIN)
            .args(args)
            .env_remove("CSI_ENDPOINT")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--help"), "{stderr}");
    }
    let help = Command::new(BIN).arg("--help").output().unwrap();
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--fail RPC=CODE[:COUNT]"));
    assert!(help.contains("SHARED STATE"), "{help}");
}

#[test]
fn refuses_to_replace_a_non_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-a-socket");
    fs::write(&path, b"data").unwrap();
    let out = Command::new(BIN)
        .arg(format!("--endpoint=unix://{}", path.display()))
        .arg(format!(
            "--state-dir={}",
            dir.path().join("state").display()
        ))
        .arg("--node-id=n")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(fs::read(&path).unwrap(), b"data");
    assert!(!fs::symlink_metadata(&path).unwrap().file_type().is_socket());
}
