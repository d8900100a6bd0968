//! The plugin's controller features over real gRPC, against the real
//! `hostpath-plugin` binary: topology (two instances on one state directory,
//! each serving its own node's segment), snapshots and volumes made from
//! them or cloned from a volume (the data is copied, through real bind
//! mounts), controller expansion, capacity and volume condition, and fault
//! injection on the new RPCs. Needs root (to mount).

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use berth_proto::csi::v1::controller_service_capability::rpc;
use berth_proto::csi::v1::plugin_capability::{self, service, volume_expansion};
use berth_proto::csi::v1::volume_content_source::{SnapshotSource, Type, VolumeSource};
use berth_proto::csi::v1::*;
use tonic::Code;

use common::*;

const NODE_KEY: &str = "topology.hostpath.csi/node";

/// Whether loop devices and mkfs.ext4 can be used here; prints why not.
fn images_usable() -> bool {
    tools_usable(&[("losetup", "--find"), ("mkfs.ext4", "-V")])
}

impl Instance {
    async fn create(&mut self, req: CreateVolumeRequest) -> Result<Volume, tonic::Status> {
        self.controller
            .create_volume(req)
            .await
            .map(|r| r.into_inner().volume.expect("a volume"))
    }

    async fn stage(&mut self, volume_id: &str, staging: &Path) -> Result<(), tonic::Status> {
        self.node
            .node_stage_volume(stage_request(volume_id, staging))
            .await
            .map(drop)
    }

    async fn unstage(&mut self, volume_id: &str, staging: &Path) {
        self.node
            .node_unstage_volume(unstage_request(volume_id, staging))
            .await
            .expect("unstage");
    }

    async fn snapshot(&mut self, name: &str, source: &str) -> Result<Snapshot, tonic::Status> {
        self.controller
            .create_snapshot(CreateSnapshotRequest {
                name: name.to_owned(),
                source_volume_id: source.to_owned(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().snapshot.expect("a snapshot"))
    }

    async fn plugin_capabilities(&mut self) -> Vec<PluginCapability> {
        self.identity
            .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities
    }
}

fn segments(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn requiring(name: &str, node: &str) -> CreateVolumeRequest {
    CreateVolumeRequest {
        accessibility_requirements: Some(TopologyRequirement {
            requisite: vec![Topology {
                segments: segments(&[(NODE_KEY, node)]),
            }],
            preferred: Vec::new(),
        }),
        ..create_request(name, MIB, 0)
    }
}

fn topologies(volume: &Volume) -> Vec<BTreeMap<String, String>> {
    volume
        .accessible_topology
        .iter()
        .map(|t| t.segments.clone().into_iter().collect())
        .collect()
}

fn from_source(name: &str, required: i64, source: Type) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: Some(VolumeContentSource {
            r#type: Some(source),
        }),
        ..create_request(name, required, 0)
    }
}

#[tokio::test]
async fn topology_places_volumes_and_keeps_them_on_their_node() {
    let a = PluginProcess::start(&[
        "--node-id",
        "node-a",
        "--topology",
        &format!("{NODE_KEY}=node-a"),
    ]);
    let b = a.start_sibling(
        "b",
        &[
            "--node-id",
            "node-b",
            &format!("--topology={NODE_KEY}=node-b"),
        ],
    );
    let mut a = Instance::connect(a).await;
    let mut b = Instance::connect(b).await;

    // Both report the constraint and their own segment.
    for (instance, node) in [(&mut a, "node-a"), (&mut b, "node-b")] {
        let caps = instance.plugin_capabilities().await;
        assert!(
            caps.iter().any(|c| c.r#type
                == Some(plugin_capability::Type::Service(
                    plugin_capability::Service {
                        r#type: service::Type::VolumeAccessibilityConstraints as i32
                    }
                ))),
            "{caps:?}"
        );
        let info = instance
            .node
            .node_get_info(NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.node_id, node);
        assert_eq!(
            info.accessible_topology.unwrap().segments,
            segments(&[(NODE_KEY, node)])
        );
    }

    // A volume that must live on node-b cannot be made through node-a.
    let err = a.create(requiring("vol", "node-b")).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("node-b") && err.message().contains("node-a"),
        "the message names both topologies: {}",
        err.message()
    );

    // Made through node-a, it is placed there, and every instance answers
    // that placement.
    let volume = a.create(requiring("vol", "node-a")).await.unwrap();
    let on_a = vec![BTreeMap::from([(NODE_KEY.to_owned(), "node-a".to_owned())])];
    assert_eq!(topologies(&volume), on_a);
    let again = b.create(create_request("vol", MIB, 0)).await.unwrap();
    assert_eq!(again, volume);
    let listed = b
        .controller
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(topologies(listed.entries[0].volume.as_ref().unwrap()), on_a);

    // node-b refuses to stage it; node-a stages it.
    let staging_b = b.process.path("b-staging/vol");
    let err = b.stage(&volume.volume_id, &staging_b).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("node-a") && err.message().contains("node-b"),
        "{}",
        err.message()
    );
    assert!(mount_options(&b.process.root, &staging_b).is_none());
    let staging_a = a.process.path("a-staging/vol");
    a.stage(&volume.volume_id, &staging_a).await.unwrap();
    assert!(mount_options(&a.process.root, &staging_a).is_some());
    a.unstage(&volume.volume_id, &staging_a).await;

    // Capacity is offered for the served topology only.
    let capacity = |node: &str| GetCapacityRequest {
        accessible_topology: Some(Topology {
            segments: segments(&[(NODE_KEY, node)]),
        }),
        ..Default::default()
    };
    let here = a.controller.get_capacity(capacity("node-a")).await.unwrap();
    assert!(here.into_inner().available_capacity > 0);
    let there = a.controller.get_capacity(capacity("node-b")).await.unwrap();
    assert_eq!(there.into_inner().available_capacity, 0);
}

#[tokio::test]
async fn snapshots_restores_and_clones_copy_the_data() {
    let mut plugin = Instance::connect(PluginProcess::start(&["--node-id", "node-a"])).await;
    let rpcs = controller_rpcs(&mut plugin.controller).await;
    for wanted in [
        rpc::Type::CreateDeleteSnapshot,
        rpc::Type::ListSnapshots,
        rpc::Type::GetSnapshot,
        rpc::Type::CloneVolume,
    ] {
        assert!(rpcs.contains(&wanted), "{wanted:?} missing from {rpcs:?}");
    }

    // Data written through a staged mount of the source.
    let source = plugin
        .create(create_request("source", 4 * MIB, 0))
        .await
        .unwrap();
    let staging = plugin.process.path("staging/source");
    plugin.stage(&source.volume_id, &staging).await.unwrap();
    fs::create_dir(staging.join("dir")).unwrap();
    fs::write(staging.join("dir/data.txt"), b"first").unwrap();

    let snap = plugin.snapshot("snap-1", &source.volume_id).await.unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, source.volume_id);
    assert_eq!(snap.size_bytes, 4 * MIB);
    assert!(snap.creation_time.is_some());
    // Idempotent by name; the same name for another volume clashes.
    assert_eq!(
        plugin.snapshot("snap-1", &source.volume_id).await.unwrap(),
        snap
    );
    let other = plugin
        .create(create_request("other", MIB, 0))
        .await
        .unwrap();
    let err = plugin
        .snapshot("snap-1", &other.volume_id)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let of_other = plugin.snapshot("snap-2", &other.volume_id).await.unwrap();

    // The source changes after the snapshot.
    fs::write(staging.join("dir/data.txt"), b"second").unwrap();

    // Listing: paged, and filtered by snapshot or by source volume.
    let list = |max: i32, token: &str, source: &str, id: &str| ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.to_owned(),
        source_volume_id: source.to_owned(),
        snapshot_id: id.to_owned(),
        ..Default::default()
    };
    let ids = |r: ListSnapshotsResponse| -> Vec<String> {
        r.entries
            .into_iter()
            .map(|e| e.snapshot.unwrap().snapshot_id)
            .collect()
    };
    let first = plugin
        .controller
        .list_snapshots(list(1, "", "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.entries.len(), 1);
    assert!(!first.next_token.is_empty());
    let rest = plugin
        .controller
        .list_snapshots(list(0, &first.next_token, "", ""))
        .await
        .unwrap()
        .into_inner();
    let mut all = ids(first);
    all.extend(ids(rest));
    let mut want = vec![snap.snapshot_id.clone(), of_other.snapshot_id.clone()];
    want.sort();
    assert_eq!(all, want);
    let by_source = plugin
        .controller
        .list_snapshots(list(0, "", &source.volume_id, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(by_source), std::slice::from_ref(&snap.snapshot_id));
    let by_id = plugin
        .controller
        .list_snapshots(list(0, "", "", &of_other.snapshot_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(by_id), std::slice::from_ref(&of_other.snapshot_id));
    assert_eq!(
        code(
            plugin
                .controller
                .list_snapshots(list(0, "not-a-token", "", ""))
                .await
        ),
        Code::Aborted
    );

    // A volume from the snapshot holds the data as it was; a clone of the
    // source holds it as it is.
    let by_snapshot = Type::Snapshot(SnapshotSource {
        snapshot_id: snap.snapshot_id.clone(),
    });
    let restored = plugin
        .create(from_source("restored", 0, by_snapshot.clone()))
        .await
        .unwrap();
    assert_eq!(restored.capacity_bytes, 4 * MIB);
    assert_eq!(
        restored
            .content_source
            .as_ref()
            .and_then(|s| s.r#type.clone()),
        Some(by_snapshot.clone())
    );
    let by_volume = Type::Volume(VolumeSource {
        volume_id: source.volume_id.clone(),
    });
    let clone = plugin
        .create(from_source("clone", 8 * MIB, by_volume.clone()))
        .await
        .unwrap();
    assert_eq!(clone.capacity_bytes, 8 * MIB);
    assert_eq!(
        clone.content_source.as_ref().and_then(|s| s.r#type.clone()),
        Some(by_volume)
    );
    for (volume, want) in [(&restored, "first"), (&clone, "second")] {
        let path = plugin
            .process
            .path(&format!("staging/{}", volume.volume_id));
        plugin.stage(&volume.volume_id, &path).await.unwrap();
        assert_eq!(
            fs::read_to_string(path.join("dir/data.txt")).unwrap(),
            want,
            "volume {}",
            volume.volume_id
        );
        plugin.unstage(&volume.volume_id, &path).await;
    }
    // Unknown sources are NOT_FOUND.
    let unknown = plugin
        .create(from_source(
            "nothing",
            0,
            Type::Snapshot(SnapshotSource {
                snapshot_id: "00000000-0000-0000-0000-000000000000".into(),
            }),
        ))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    // The source volume can go while it has snapshots; the snapshot stays
    // usable, and deleting it twice is fine.
    plugin.unstage(&source.volume_id, &staging).await;
    plugin
        .controller
        .delete_volume(DeleteVolumeRequest {
            volume_id: source.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let late = plugin
        .create(from_source("late", 0, by_snapshot))
        .await
        .unwrap();
    let late_dir = plugin
        .process
        .state_dir
        .join("volumes")
        .join(&late.volume_id);
    assert_eq!(
        fs::read_to_string(late_dir.join("dir/data.txt")).unwrap(),
        "first"
    );
    for _ in 0..2 {
        plugin
            .controller
            .delete_snapshot(DeleteSnapshotRequest {
                snapshot_id: snap.snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let gone = plugin
        .controller
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(gone), Code::NotFound);
    assert!(!plugin
        .process
        .state_dir
        .join("snapshots")
        .join(&snap.snapshot_id)
        .exists());
}

#[tokio::test]
async fn expand_grows_the_recorded_capacity_and_get_volume_reports_it() {
    let mut plugin = Instance::connect(PluginProcess::start(&["--node-id", "node-a"])).await;
    let caps = plugin.plugin_capabilities().await;
    assert!(
        caps.iter().any(|c| c.r#type
            == Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: volume_expansion::Type::Online as i32
                }
            ))),
        "{caps:?}"
    );
    let rpcs = controller_rpcs(&mut plugin.controller).await;
    for wanted in [
        rpc::Type::ExpandVolume,
        rpc::Type::GetCapacity,
        rpc::Type::GetVolume,
        rpc::Type::VolumeCondition,
    ] {
        assert!(rpcs.contains(&wanted), "{wanted:?} missing from {rpcs:?}");
    }

    let volume = plugin.create(create_request("vol", MIB, 0)).await.unwrap();
    // Online: while staged.
    let staging = plugin.process.path("staging/vol");
    plugin.stage(&volume.volume_id, &staging).await.unwrap();
    let expand = |required: i64, limit: i64| ControllerExpandVolumeRequest {
        volume_id: volume.volume_id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
        ..Default::default()
    };
    let grown = plugin
        .controller
        .controller_expand_volume(expand(3 * MIB, 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 3 * MIB);
    assert!(!grown.node_expansion_required);
    let smaller = plugin
        .controller
        .controller_expand_volume(expand(MIB, 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(smaller.capacity_bytes, 3 * MIB, "volumes never shrink");
    assert_eq!(
        code(
            plugin
                .controller
                .controller_expand_volume(expand(0, 2 * MIB))
                .await
        ),
        Code::OutOfRange
    );
    let mut unknown = expand(3 * MIB, 0);
    unknown.volume_id = "00000000-0000-0000-0000-000000000000".into();
    assert_eq!(
        code(plugin.controller.controller_expand_volume(unknown).await),
        Code::NotFound
    );

    let got = plugin
        .controller
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: volume.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 3 * MIB);
    let condition = got.status.unwrap().volume_condition.unwrap();
    assert!(!condition.abnormal, "{condition:?}");
    plugin.unstage(&volume.volume_id, &staging).await;

    // The volume's data gone from under the plugin: abnormal.
    fs::remove_dir(
        plugin
            .process
            .state_dir
            .join("volumes")
            .join(&volume.volume_id),
    )
    .unwrap();
    let got = plugin
        .controller
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: volume.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(got.status.unwrap().volume_condition.unwrap().abnormal);
}

#[tokio::test]
async fn faults_apply_to_the_new_rpcs() {
    let mut plugin = Instance::connect(PluginProcess::start(&[
        "--fail",
        "CreateSnapshot=unavailable:1",
        "--fail=ControllerExpandVolume=resource_exhausted:1",
        "--fail=GetCapacity=internal:1",
        "--fail=ControllerGetVolume=unavailable:1",
        "--fail=ListSnapshots=aborted:1",
    ]))
    .await;
    let volume = plugin.create(create_request("vol", MIB, 0)).await.unwrap();
    let err = plugin
        .snapshot("snap", &volume.volume_id)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    plugin.snapshot("snap", &volume.volume_id).await.unwrap();

    let expand = ControllerExpandVolumeRequest {
        volume_id: volume.volume_id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 2 * MIB,
            limit_bytes: 0,
        }),
        ..Default::default()
    };
    assert_eq!(
        code(
            plugin
                .controller
                .controller_expand_volume(expand.clone())
                .await
        ),
        Code::ResourceExhausted
    );
    plugin
        .controller
        .controller_expand_volume(expand)
        .await
        .unwrap();

    assert_eq!(
        code(
            plugin
                .controller
                .get_capacity(GetCapacityRequest::default())
                .await
        ),
        Code::Internal
    );
    plugin
        .controller
        .get_capacity(GetCapacityRequest::default())
        .await
        .unwrap();

    let get = ControllerGetVolumeRequest {
        volume_id: volume.volume_id.clone(),
    };
    assert_eq!(
        code(plugin.controller.controller_get_volume(get.clone()).await),
        Code::Unavailable
    );
    plugin.controller.controller_get_volume(get).await.unwrap();

    assert_eq!(
        code(
            plugin
                .controller
                .list_snapshots(ListSnapshotsRequest::default())
                .await
        ),
        Code::Aborted
    );
    let listed = plugin
        .controller
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
}

#[tokio::test]
async fn image_volumes_snapshot_restore_bigger_and_expand() {
    if !images_usable() {
        return;
    }
    let process = PluginProcess::start(&["--node-id", "node-a"]);
    let mut plugin = Instance::connect(process).await;
    let image = |name: &str, bytes: i64, source: Option<Type>| {
        let mut req = create_request(name, bytes, 0);
        req.parameters.insert("backing".into(), "image".into());
        req.volume_content_source = source.map(|t| VolumeContentSource { r#type: Some(t) });
        req
    };
    let total_bytes = |path: &Path| {
        let st = nix::sys::statvfs::statvfs(path).unwrap();
        st.blocks() as i64 * st.fragment_size() as i64
    };

    // Data written into the image's filesystem through its staged mount,
    // snapshotted while it is mounted.
    let source = plugin.create(image("img", 16 * MIB, None)).await.unwrap();
    let staging = plugin.process.path("staging/img");
    plugin.stage(&source.volume_id, &staging).await.unwrap();
    fs::write(staging.join("data.txt"), b"in the image").unwrap();
    let snap = plugin
        .snapshot("img-snap", &source.volume_id)
        .await
        .unwrap();
    assert_eq!(snap.size_bytes, 16 * MIB);
    let copy = plugin
        .process
        .state_dir
        .join("snapshots")
        .join(&snap.snapshot_id);
    assert!(copy.is_file(), "an image snapshot is an image file");
    fs::write(staging.join("data.txt"), b"changed later").unwrap();
    plugin.unstage(&source.volume_id, &staging).await;

    // Restored into a bigger volume: the data of the snapshot, in a
    // filesystem grown to the new size.
    let restored = plugin
        .create(image(
            "img-restored",
            32 * MIB,
            Some(Type::Snapshot(SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            })),
        ))
        .await
        .unwrap();
    assert_eq!(restored.capacity_bytes, 32 * MIB);
    let staging = plugin.process.path("staging/img-restored");
    plugin.stage(&restored.volume_id, &staging).await.unwrap();
    assert_eq!(
        fs::read_to_string(staging.join("data.txt")).unwrap(),
        "in the image"
    );
    assert!(
        total_bytes(&staging) > 16 * MIB,
        "the filesystem grew past the snapshot's size: {} bytes",
        total_bytes(&staging)
    );

    // A clone of the source: its data as it is now.
    let clone = plugin
        .create(image(
            "img-clone",
            0,
            Some(Type::Volume(VolumeSource {
                volume_id: source.volume_id.clone(),
            })),
        ))
        .await
        .unwrap();
    assert_eq!(clone.capacity_bytes, 16 * MIB);
    let clone_staging = plugin.process.path("staging/img-clone");
    plugin
        .stage(&clone.volume_id, &clone_staging)
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(clone_staging.join("data.txt")).unwrap(),
        "changed later"
    );
    plugin.unstage(&clone.volume_id, &clone_staging).await;

    // Expanding an image-backed volume grows its file and asks the node to
    // grow the filesystem.
    let grown = plugin
        .controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: restored.volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 48 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 48 * MIB);
    assert!(grown.node_expansion_required);
    let image_file = plugin
        .process
        .state_dir
        .join("images")
        .join(format!("{}.img", restored.volume_id));
    assert_eq!(fs::metadata(&image_file).unwrap().len(), 48 * MIB as u64);
    plugin.unstage(&restored.volume_id, &staging).await;
}
