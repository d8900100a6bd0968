//! Growing a volume by creating it again with a larger capacity, and volume
//! snapshots: the servers' decisions, over real gRPC call streams to a test
//! client that answers like a client running the plugin.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use berth_proto::berth::v1 as pb;
use berth_server::{ServerError, SnapshotRequest};
use berth_structs::{AccessMode, CsiVolume};
use support::*;

const MIB: u64 = 1 << 20;

/// How the test client answers expand calls: whether the controller and
/// the node plugin can expand, and whether the controller asks for the
/// node step. Every other call as `ok_handler` does.
fn expand_handler(controller: bool, node: bool, node_required: bool) -> CallHandler {
    let ok = ok_handler();
    Arc::new(move |call| match &call.call {
        Some(pb::server_call::Call::ExpandVolume(e)) => {
            pb::call_reply::Result::ExpandVolume(pb::ExpandVolumeReply {
                controller_supported: controller,
                capacity_bytes: if controller { e.capacity_min } else { 0 },
                node_expansion_required: controller && node_required,
            })
        }
        Some(pb::server_call::Call::ExpandVolumeOnNode(e)) => {
            pb::call_reply::Result::ExpandVolumeOnNode(pb::ExpandVolumeOnNodeReply {
                node_supported: node,
                // The filesystem may be a little larger than asked.
                capacity_bytes: if node { e.capacity_min + 4096 } else { 0 },
            })
        }
        _ => ok(call),
    })
}

fn spec(capacity_min: u64) -> CsiVolume {
    let mut v = volume("data", "hostpath", &[AccessMode::SingleNodeWriter]);
    v.external_id.clear();
    v.capacity_min = Some(capacity_min);
    v
}

/// n1 runs the plugin (node and controller) and answers with `handler`;
/// "data" is created with 20 MiB and, with `claimed`, claimed by an alloc
/// of job "db" on n1 (whose ID is returned).
async fn setup(ts: &TestServer, handler: CallHandler, claimed: bool) -> (TestClient, String) {
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", true, true, false).await;
    let client = TestClient::connect(ts, "n1", handler).await;
    let created = s.create_volume(spec(20 * MIB)).await.expect("create");
    assert_eq!(created.capacity, 20 * MIB);
    if !claimed {
        return (client, String::new());
    }
    s.register_job(volume_job("db", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    let alloc = wait_for_live(s, "db").await;
    ts.csi_client()
        .await
        .claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .expect("claim");
    (client, alloc.id)
}

fn calls_of(client: &TestClient, kind: &str) -> Vec<pb::ServerCall> {
    let kinds = client.call_kinds();
    let calls = client.calls.lock().unwrap().clone();
    calls
        .into_iter()
        .zip(kinds)
        .filter(|(_, k)| *k == kind)
        .map(|(c, _)| c)
        .collect()
}

#[tokio::test]
async fn a_larger_capacity_expands_through_the_controller_then_on_the_node_that_publishes_it() {
    let ts = TestServer::start(|_| {}).await;
    let (client, alloc_id) = setup(&ts, expand_handler(true, true, true), true).await;
    let s = &ts.server;

    let grown = s.create_volume(spec(40 * MIB)).await.expect("expand");
    assert_eq!(
        grown.capacity,
        40 * MIB,
        "the controller's answer is stored"
    );
    assert_eq!(grown.capacity_min, Some(40 * MIB));
    assert!(grown.secrets.is_empty(), "secrets never returned");
    assert_eq!(
        client.call_kinds(),
        vec!["CreateVolume", "ExpandVolume", "ExpandVolumeOnNode"]
    );
    let Some(pb::server_call::Call::ExpandVolume(e)) = &calls_of(&client, "ExpandVolume")[0].call
    else {
        unreachable!()
    };
    assert_eq!(e.external_id, "ext-data");
    assert_eq!(e.capacity_min, (40 * MIB) as i64);
    assert_eq!(e.secrets.get("token").map(String::as_str), Some("s3cret"));
    let Some(pb::server_call::Call::ExpandVolumeOnNode(n)) =
        &calls_of(&client, "ExpandVolumeOnNode")[0].call
    else {
        unreachable!()
    };
    assert_eq!(n.alloc_ids, vec![alloc_id]);
    assert_eq!(n.volume_id, "data");
    assert_eq!(
        n.capability.as_ref().map(|c| c.access_mode.as_str()),
        Some("single-node-writer")
    );

    // The same spec again changes nothing and calls nobody.
    let same = s.create_volume(spec(40 * MIB)).await.expect("no-op");
    assert_eq!(same.capacity, 40 * MIB);
    assert_eq!(client.call_kinds().len(), 3);

    // Less is refused, and so is any other change.
    let err = s.create_volume(spec(10 * MIB)).await.unwrap_err();
    assert!(err.to_string().contains("volumes cannot shrink"), "{err}");
    assert_eq!(err.http_status(), 400);
    let mut changed = spec(80 * MIB);
    changed.parameters.insert("backing".into(), "image".into());
    let err = s.create_volume(changed).await.unwrap_err();
    assert!(matches!(err, ServerError::Conflict(_)), "{err:?}");
    assert!(err.to_string().contains("already exists"), "{err}");
    assert!(err.to_string().contains("parameters"), "{err}");
    assert_eq!(client.call_kinds().len(), 3, "nothing was called");
    assert_eq!(s.volume("data").unwrap().capacity, 40 * MIB);
}

#[tokio::test]
async fn without_the_node_step_asked_for_only_the_controller_expands() {
    let ts = TestServer::start(|_| {}).await;
    let (client, _) = setup(&ts, expand_handler(true, true, false), true).await;
    let grown = ts.server.create_volume(spec(64 * MIB)).await.unwrap();
    assert_eq!(grown.capacity, 64 * MIB);
    assert_eq!(client.call_kinds(), vec!["CreateVolume", "ExpandVolume"]);
}

#[tokio::test]
async fn a_controller_that_cannot_expand_leaves_it_to_the_nodes_that_publish_the_volume() {
    let ts = TestServer::start(|_| {}).await;
    let (client, _) = setup(&ts, expand_handler(false, true, false), true).await;
    let grown = ts.server.create_volume(spec(40 * MIB)).await.unwrap();
    assert_eq!(
        client.call_kinds(),
        vec!["CreateVolume", "ExpandVolume", "ExpandVolumeOnNode"]
    );
    assert_eq!(
        grown.capacity,
        40 * MIB + 4096,
        "the node's answer is stored"
    );
}

#[tokio::test]
async fn a_volume_nobody_can_expand_is_refused_naming_the_capability() {
    let ts = TestServer::start(|_| {}).await;
    // Not in use: no node to expand it on.
    let (_client, _) = setup(&ts, expand_handler(false, true, false), false).await;
    let err = ts.server.create_volume(spec(40 * MIB)).await.unwrap_err();
    assert_eq!(err.http_status(), 400, "{err}");
    assert!(err.to_string().contains("EXPAND_VOLUME"), "{err}");
    assert_eq!(ts.server.volume("data").unwrap().capacity, 20 * MIB);

    // In use, but its node plugin cannot expand either.
    let ts = TestServer::start(|_| {}).await;
    let (_client, _) = setup(&ts, expand_handler(false, false, false), true).await;
    let err = ts.server.create_volume(spec(40 * MIB)).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("node n1: NodeExpandVolume"), "{msg}");
    assert!(msg.contains("EXPAND_VOLUME"), "{msg}");
    assert_eq!(ts.server.volume("data").unwrap().capacity, 20 * MIB);
}

#[tokio::test]
async fn a_failing_node_step_names_the_step_and_node_and_keeps_the_controllers_capacity() {
    let ts = TestServer::start(|_| {}).await;
    let (client, _) = setup(&ts, expand_handler(true, true, true), true).await;
    let expand = expand_handler(true, true, true);
    client.set_handler(Arc::new(move |call| match &call.call {
        Some(pb::server_call::Call::ExpandVolumeOnNode(_)) => {
            pb::call_reply::Result::Error(pb::CallError {
                code: tonic::Code::Internal as i32,
                message: "NodeExpandVolume on plugin hostpath: Internal: resize2fs failed".into(),
            })
        }
        _ => expand(call),
    }));
    let err = ts.server.create_volume(spec(40 * MIB)).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("node n1: NodeExpandVolume"), "{msg}");
    assert!(msg.contains("resize2fs failed"), "{msg}");
    assert!(msg.contains("controller on node n1 expanded it"), "{msg}");
    let vol = ts.server.volume("data").unwrap();
    assert_eq!(vol.capacity, 40 * MIB, "the controller did grow it");
    assert_eq!(vol.capacity_min, Some(20 * MIB), "the request waits");

    // The same spec again retries the expansion, node step included.
    client.set_handler(expand_handler(true, true, true));
    let before = client.call_kinds().len();
    let grown = ts.server.create_volume(spec(40 * MIB)).await.unwrap();
    assert_eq!(
        client.call_kinds()[before..],
        ["ExpandVolume", "ExpandVolumeOnNode"]
    );
    assert_eq!(grown.capacity_min, Some(40 * MIB));
    assert_eq!(grown.capacity, 40 * MIB);
}

#[tokio::test]
async fn snapshots_go_through_the_controller_and_name_their_source_volume() {
    let ts = TestServer::start(|_| {}).await;
    let (client, _) = setup(&ts, ok_handler(), false).await;
    let ok = ok_handler();
    client.set_handler(Arc::new(move |call| match &call.call {
        Some(pb::server_call::Call::CreateSnapshot(c)) => {
            pb::call_reply::Result::CreateSnapshot(pb::Snapshot {
                snapshot_id: format!("snap-{}", c.name),
                source_external_id: c.source_external_id.clone(),
                size_bytes: 1234,
                create_time_ms: 1_000,
                ready_to_use: true,
            })
        }
        Some(pb::server_call::Call::ListSnapshots(_)) => {
            pb::call_reply::Result::ListSnapshots(pb::ListSnapshotsReply {
                snapshots: vec![
                    pb::Snapshot {
                        snapshot_id: "snap-b".into(),
                        source_external_id: "ext-data".into(),
                        create_time_ms: 2_000,
                        ..Default::default()
                    },
                    pb::Snapshot {
                        snapshot_id: "snap-a".into(),
                        source_external_id: "ext-unknown".into(),
                        create_time_ms: 1_000,
                        ..Default::default()
                    },
                ],
            })
        }
        _ => ok(call),
    }));
    let s = &ts.server;
    let snap = s
        .create_snapshot(SnapshotRequest {
            volume_id: "data".into(),
            name: "nightly".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(snap.id, "snap-nightly");
    assert_eq!(snap.name, "nightly");
    assert_eq!(snap.source_volume_id, "data");
    assert!(snap.ready_to_use);
    let Some(pb::server_call::Call::CreateSnapshot(c)) =
        &calls_of(&client, "CreateSnapshot")[0].call
    else {
        unreachable!()
    };
    assert_eq!(c.source_external_id, "ext-data");
    assert_eq!(
        c.secrets.get("token").map(String::as_str),
        Some("s3cret"),
        "the volume's secrets when the request brings none"
    );

    let list = s.list_snapshots(Some("hostpath")).await.unwrap();
    let ids: Vec<_> = list.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, vec!["snap-a", "snap-b"], "oldest first");
    assert_eq!(list[1].source_volume_id, "data");
    assert_eq!(list[0].source_volume_id, "", "a volume berth does not know");
    assert_eq!(list[0].external_source_volume_id, "ext-unknown");
    assert_eq!(s.list_snapshots(None).await.unwrap().len(), 2);
    let err = s.list_snapshots(Some("NOPE")).await.unwrap_err();
    assert_eq!(err.http_status(), 404, "{err}");
    assert!(
        err.to_string().contains("CSI plugin \"NOPE\" not found"),
        "{err}"
    );

    s.delete_snapshot("hostpath", "snap-a").await.unwrap();
    assert_eq!(calls_of(&client, "DeleteSnapshot").len(), 1);
    let err = s
        .create_snapshot(SnapshotRequest {
            volume_id: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.http_status(), 404);
}

#[tokio::test]
async fn a_plugin_without_snapshots_is_a_bad_request_naming_it() {
    let ts = TestServer::start(|_| {}).await;
    let (client, _) = setup(&ts, ok_handler(), false).await;
    let ok = ok_handler();
    client.set_handler(Arc::new(move |call| match &call.call {
        Some(
            pb::server_call::Call::CreateSnapshot(_)
            | pb::server_call::Call::ListSnapshots(_)
            | pb::server_call::Call::DeleteSnapshot(_),
        ) => pb::call_reply::Result::Error(pb::CallError {
            code: tonic::Code::Unimplemented as i32,
            message: "CSI plugin \"hostpath\" does not support snapshots: its controller lacks the CREATE_DELETE_SNAPSHOT capability".into(),
        }),
        _ => ok(call),
    }));
    let s = &ts.server;
    let err = s
        .create_snapshot(SnapshotRequest {
            volume_id: "data".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.http_status(), 400, "{err}");
    assert!(err.to_string().contains("CREATE_DELETE_SNAPSHOT"), "{err}");
    assert!(err.to_string().contains("hostpath"), "{err}");
    let err = s.list_snapshots(Some("hostpath")).await.unwrap_err();
    assert_eq!(err.http_status(), 400, "{err}");
    // Listing every plugin skips the ones that cannot list.
    assert!(s.list_snapshots(None).await.unwrap().is_empty());
    let err = s.delete_snapshot("hostpath", "x").await.unwrap_err();
    assert_eq!(err.http_status(), 400, "{err}");
}

#[tokio::test]
async fn a_volume_from_a_snapshot_or_a_clone_carries_its_content_source() {
    let ts = TestServer::start(|_| {}).await;
    let (client, _) = setup(&ts, ok_handler(), false).await;
    let s = &ts.server;
    let mut from_snap = volume("restored", "hostpath", &[AccessMode::SingleNodeWriter]);
    from_snap.external_id.clear();
    from_snap.snapshot_id = "snap-1".into();
    let created = s.create_volume(from_snap).await.unwrap();
    assert_eq!(created.snapshot_id, "snap-1");
    let mut clone = volume("copy", "hostpath", &[AccessMode::SingleNodeWriter]);
    clone.external_id.clear();
    clone.clone_id = "ext-data".into();
    s.create_volume(clone).await.unwrap();
    let creates = calls_of(&client, "CreateVolume");
    let sources: Vec<(String, String)> = creates
        .iter()
        .filter_map(|c| match &c.call {
            Some(pb::server_call::Call::CreateVolume(c)) => {
                Some((c.snapshot_id.clone(), c.clone_id.clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        sources,
        vec![
            (String::new(), String::new()),
            ("snap-1".into(), String::new()),
            (String::new(), "ext-data".into()),
        ]
    );
    let mut both = volume("both", "hostpath", &[AccessMode::SingleNodeWriter]);
    both.snapshot_id = "s".into();
    both.clone_id = "c".into();
    let err = s.create_volume(both).await.unwrap_err();
    assert!(err.to_string().contains("exclusive"), "{err}");
    assert_eq!(err.http_status(), 400);
}

/// A plugin the servers know whose controller no connected client runs is
/// unavailable (503); one they do not know is not found (404).
#[tokio::test]
async fn snapshots_of_a_known_plugin_without_a_controller_are_unavailable_of_an_unknown_one_not_found(
) {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    // Fingerprinted, but no client of n1 is connected to run its calls.
    give_plugin(s, "n1", "hostpath", true, true, false).await;
    let err = s.list_snapshots(Some("hostpath")).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    assert!(err.to_string().contains("healthy controller"), "{err}");
    let err = s.list_snapshots(Some("NOPE")).await.unwrap_err();
    assert_eq!(err.http_status(), 404, "{err}");
    assert!(
        err.to_string().contains("CSI plugin \"NOPE\" not found"),
        "{err}"
    );
}
