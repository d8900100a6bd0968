//! Two real `hostpath-plugin` processes, each on its own unix socket and with
//! its own node ID, share one state directory the way two nodes share network
//! storage: a volume created through either is served by both, no change made
//! through one is lost to a change made through the other, and the mount and
//! publication rules hold across them. Needs root (to mount).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use berth_proto::csi::v1::volume_capability::access_mode::Mode;
use berth_proto::csi::v1::*;
use tokio::task::JoinSet;
use tonic::Code;

use common::*;

impl Instance {
    async fn create(&mut self, name: &str) -> String {
        self.controller
            .create_volume(create_request(name, MIB, 0))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap()
            .volume_id
    }

    async fn listed(&mut self) -> Vec<String> {
        let entries = self
            .controller
            .list_volumes(ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries;
        entries
            .into_iter()
            .map(|e| e.volume.unwrap().volume_id)
            .collect()
    }

    /// Stages and publishes `volume_id` under `<root>/<dir>/`; returns the
    /// target path.
    async fn mount(&mut self, volume_id: &str, dir: &str) -> std::path::PathBuf {
        let staging = self.process.path(&format!("{dir}/staging"));
        let target = self.process.path(&format!("{dir}/target"));
        self.node
            .node_stage_volume(stage_request(volume_id, &staging))
            .await
            .unwrap();
        self.node
            .node_publish_volume(publish_request(volume_id, &staging, &target, false))
            .await
            .unwrap();
        target
    }

    async fn unmount(&mut self, volume_id: &str, dir: &str) {
        let staging = self.process.path(&format!("{dir}/staging"));
        let target = self.process.path(&format!("{dir}/target"));
        unpublish_and_unstage(&mut self.node, volume_id, &staging, &target).await;
        assert!(mount_options(&self.process.root, &target).is_none());
        assert!(mount_options(&self.process.root, &staging).is_none());
    }

    async fn delete(&mut self, volume_id: &str) -> Result<(), tonic::Status> {
        self.controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: volume_id.to_owned(),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }
}

/// Two instances, node-a and node-b, on one state directory.
async fn two_instances(extra: &[&str]) -> (Instance, Instance) {
    let mut args_a = vec!["--node-id=node-a"];
    args_a.extend_from_slice(extra);
    let mut args_b = vec!["--node-id=node-b"];
    args_b.extend_from_slice(extra);
    let a = PluginProcess::start(&args_a);
    let b = a.start_sibling("b", &args_b);
    (Instance::connect(a).await, Instance::connect(b).await)
}

fn same_dir(a: &Path, b: &Path) -> bool {
    let (ma, mb) = (fs::metadata(a).unwrap(), fs::metadata(b).unwrap());
    ma.dev() == mb.dev() && ma.ino() == mb.ino()
}

#[tokio::test]
async fn a_volume_created_through_one_instance_is_served_by_the_other() {
    let (mut a, mut b) = two_instances(&[]).await;

    // Neither instance reports a topology: the storage is reachable from
    // every node that shares the state directory.
    for (instance, id) in [(&mut a, "node-a"), (&mut b, "node-b")] {
        let info = instance
            .node
            .node_get_info(NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.node_id, id);
        assert_eq!(info.accessible_topology, None);
    }

    let volume_id = a.create("shared-1").await;
    assert_eq!(
        b.listed().await,
        std::slice::from_ref(&volume_id),
        "B lists the volume created through A at once"
    );
    let volume_dir = a.process.state_dir.join("volumes").join(&volume_id);

    // Mounted through B, written through B.
    let target_b = b.mount(&volume_id, "b/pod").await;
    assert!(same_dir(&target_b, &volume_dir));
    fs::write(target_b.join("from-b.txt"), b"written on node b").unwrap();
    b.unmount(&volume_id, "b/pod").await;

    // Then mounted through A: the same backing directory, with B's data.
    let target_a = a.mount(&volume_id, "a/pod").await;
    assert!(same_dir(&target_a, &volume_dir));
    assert_eq!(
        fs::read(target_a.join("from-b.txt")).unwrap(),
        b"written on node b"
    );
    a.unmount(&volume_id, "a/pod").await;

    // Deleted through B, gone for A.
    b.delete(&volume_id).await.unwrap();
    assert!(!volume_dir.exists());
    assert!(a.listed().await.is_empty());
    assert!(mounts_under(&a.process.root).is_empty());
    assert!(a.process.stop().success());
    assert!(b.process.stop().success());
}

#[tokio::test]
async fn concurrent_creates_through_both_instances_lose_no_volume() {
    let (mut a, mut b) = two_instances(&[]).await;
    const VOLUMES: usize = 20;

    let mut creates = JoinSet::new();
    for i in 0..VOLUMES {
        let mut controller = if i % 2 == 0 {
            a.controller.clone()
        } else {
            b.controller.clone()
        };
        creates.spawn(async move {
            controller
                .create_volume(create_request(&format!("vol-{i}"), MIB, 0))
                .await
                .map(|r| r.into_inner().volume.unwrap().volume_id)
        });
    }
    // Reads through B while the creates run: never a torn or failed read,
    // and never a volume that disappears again.
    let mut seen = 0;
    while !creates.is_empty() {
        let now = b.listed().await.len();
        assert!(now >= seen, "B listed {now} volumes after {seen}");
        seen = now;
        if let Some(done) = creates.try_join_next() {
            done.unwrap().unwrap();
        }
    }

    let mut want: Vec<String> = (0..VOLUMES)
        .map(|i| hostpath_plugin::state::volume_id_for(&format!("vol-{i}")))
        .collect();
    want.sort();
    assert_eq!(a.listed().await, want, "A lists every volume");
    assert_eq!(b.listed().await, want, "B lists every volume");

    // Every name created again through both instances at once: each call
    // answers the one existing volume, and nothing is added.
    let mut retries = JoinSet::new();
    for i in 0..VOLUMES {
        for mut controller in [a.controller.clone(), b.controller.clone()] {
            retries.spawn(async move {
                let name = format!("vol-{i}");
                let id = controller
                    .create_volume(create_request(&name, MIB, 0))
                    .await
                    .map(|r| r.into_inner().volume.unwrap().volume_id);
                (name, id)
            });
        }
    }
    while let Some(done) = retries.join_next().await {
        let (name, id) = done.unwrap();
        assert_eq!(
            id.unwrap(),
            hostpath_plugin::state::volume_id_for(&name),
            "{name}"
        );
    }
    assert_eq!(a.listed().await, want);
    let text = fs::read_to_string(a.process.state_dir.join("state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(state["volumes"].as_object().unwrap().len(), VOLUMES);
    for id in &want {
        assert!(a.process.state_dir.join("volumes").join(id).is_dir());
    }
}

#[tokio::test]
async fn deleting_a_volume_mounted_through_the_other_instance_is_refused() {
    let (mut a, mut b) = two_instances(&[]).await;
    let volume_id = a.create("busy").await;
    let target_b = b.mount(&volume_id, "b/pod").await;
    fs::write(target_b.join("data"), b"keep me").unwrap();

    let err = a.delete(&volume_id).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains(&target_b.display().to_string()),
        "{err:?}"
    );
    assert_eq!(fs::read(target_b.join("data")).unwrap(), b"keep me");
    assert_eq!(a.listed().await, std::slice::from_ref(&volume_id));

    b.unmount(&volume_id, "b/pod").await;
    a.delete(&volume_id).await.unwrap();
    assert!(b.listed().await.is_empty());
}

#[tokio::test]
async fn controller_publication_is_shared_between_instances() {
    let (mut a, mut b) = two_instances(&["--enable-attach"]).await;
    let volume_id = a.create("attached").await;
    let publish = |node: &str| ControllerPublishVolumeRequest {
        volume_id: volume_id.clone(),
        node_id: node.to_owned(),
        volume_capability: Some(capability(Mode::SingleNodeWriter)),
        ..Default::default()
    };

    // A's controller publishes to B's node; a node that no instance serves
    // does not exist.
    let context = a
        .controller
        .controller_publish_volume(publish("node-b"))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let err = a
        .controller
        .controller_publish_volume(publish("node-c"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("node-c"), "{err:?}");

    // B sees the publication: it stages, and its controller refuses a
    // second node for a single-node volume.
    let staging = b.process.path("b/staging");
    let mut stage = stage_request(&volume_id, &staging);
    stage.publish_context = context;
    b.node.node_stage_volume(stage).await.unwrap();
    let err = b
        .controller
        .controller_publish_volume(publish("node-a"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let err = b.delete(&volume_id).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("node-b"), "{err:?}");

    b.node
        .node_unstage_volume(unstage_request(&volume_id, &staging))
        .await
        .unwrap();
    b.controller
        .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: volume_id.clone(),
            node_id: "node-b".into(),
            ..Default::default()
        })
        .await
        .unwrap();

    // Two controllers publishing a single-node volume to different nodes at
    // once: exactly one wins.
    let (mut ca, mut cb) = (a.controller.clone(), b.controller.clone());
    let (to_a, to_b) = tokio::join!(
        cb.controller_publish_volume(publish("node-a")),
        ca.controller_publish_volume(publish("node-b")),
    );
    let codes = [&to_a, &to_b].map(|r| r.as_ref().err().map(|e| e.code()));
    assert!(
        codes == [None, Some(Code::FailedPrecondition)]
            || codes == [Some(Code::FailedPrecondition), None],
        "{to_a:?} {to_b:?}"
    );
    let winner = if to_a.is_ok() { "node-a" } else { "node-b" };
    let listed = a
        .controller
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(
        listed[0].status.as_ref().unwrap().published_node_ids,
        [winner]
    );
    a.controller
        .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: volume_id.clone(),
            node_id: winner.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    a.delete(&volume_id).await.unwrap();
}
