//! The Node service over real gRPC: register, heartbeat, the alloc watch,
//! status updates, plugin fingerprints and events.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use berth_proto::berth::v1 as pb;
use berth_structs::{AllocClientStatus, Allocation, JobType, TaskStateKind};
use support::*;

fn decode(update: &pb::AllocationsUpdate) -> Vec<Allocation> {
    update
        .allocs_json
        .iter()
        .map(|b| serde_json::from_slice(b).expect("alloc JSON"))
        .collect()
}

#[tokio::test]
async fn client_registers_watches_its_allocs_and_reports_status() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut nc = ts.node_client().await;

    // Unknown node: heartbeat and watch say NotFound.
    let err = nc
        .heartbeat(pb::HeartbeatRequest {
            node_id: "n1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let err = nc
        .watch_allocations(pb::WatchAllocationsRequest {
            node_id: "n1".into(),
            deltas: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);

    let reg = nc
        .register(pb::RegisterRequest {
            node_json: serde_json::to_vec(&node("n1")).unwrap(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(reg.heartbeat_ttl_ms >= 10_000);
    assert!(reg.index > 0);
    let hb = nc
        .heartbeat(pb::HeartbeatRequest {
            node_id: "n1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(hb.heartbeat_ttl_ms >= 10_000);

    let mut watch = open_watch(&mut nc, "n1").await;
    let first = watch.message().await.unwrap().unwrap();
    assert!(first.allocs_json.is_empty());

    s.register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let allocs = decode(&next);
    assert_eq!(allocs.len(), 1);
    assert_eq!(allocs[0].name, "web.g[0]");
    assert!(next.index >= allocs[0].modify_index);

    // A status report is applied and streamed back.
    nc.update_allocations(running_update("n1", &allocs[0].id))
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let a = &decode(&next)[0];
    assert_eq!(a.client_status, AllocClientStatus::Running);
    assert_eq!(a.task_states["t"].state, TaskStateKind::Running);

    // A bad status is refused as InvalidArgument.
    let err = nc
        .update_allocations(status_update("n1", &allocs[0].id, "sleeping", ""))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Stop: the stream carries desired_status stop.
    s.stop_job("web").await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(decode(&next)[0].server_terminal());
}

#[tokio::test]
async fn plugin_fingerprints_and_events_reach_the_node_and_plugin_table() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut nc = ts.node_client().await;
    nc.register(pb::RegisterRequest {
        node_json: serde_json::to_vec(&node("n1")).unwrap(),
        ..Default::default()
    })
    .await
    .unwrap();
    let fp = |kind: &str, healthy: bool| pb::PluginFingerprint {
        plugin_id: "hostpath".into(),
        kind: kind.into(),
        provider: "hostpath.csi.berth".into(),
        version: "0.1.0".into(),
        healthy,
        external_node_id: "node-ext".into(),
        requires_controller_publish: true,
        supports_volume_stats: kind == "node",
        supports_volume_condition: kind == "node",
        supports_expand: true,
        supports_snapshots: kind == "controller",
        ..Default::default()
    };
    nc.update_plugins(pb::UpdatePluginsRequest {
        node_id: "n1".into(),
        plugins: vec![fp("node", true), fp("controller", false)],
    })
    .await
    .unwrap();
    let n = s.node("n1").unwrap();
    assert_eq!(n.csi_node_plugins["hostpath"].external_node_id, "node-ext");
    // The optional RPCs a plugin serves reach the servers with it.
    let node_info = &n.csi_node_plugins["hostpath"];
    let ctrl_info = &n.csi_controller_plugins["hostpath"];
    assert!(node_info.supports_volume_stats && node_info.supports_volume_condition);
    assert!(node_info.supports_expand && !node_info.supports_snapshots);
    assert!(ctrl_info.supports_expand && ctrl_info.supports_snapshots);
    let p = s.plugin("hostpath").unwrap();
    assert_eq!(p.provider, "hostpath.csi.berth");
    assert_eq!((p.nodes_healthy, p.nodes_expected), (1, 1));
    assert_eq!((p.controllers_healthy, p.controllers_expected), (0, 1));
    assert!(p.controller_required);

    // A re-registration without plugins keeps the fingerprints.
    nc.register(pb::RegisterRequest {
        node_json: serde_json::to_vec(&node("n1")).unwrap(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(s.node("n1").unwrap().has_healthy_node_plugin("hostpath"));

    // Plugins missing from the full set are gone.
    nc.update_plugins(pb::UpdatePluginsRequest {
        node_id: "n1".into(),
        plugins: vec![],
    })
    .await
    .unwrap();
    assert!(s.plugin("hostpath").is_err());

    nc.emit_events(pb::EmitEventsRequest {
        node_id: "n1".into(),
        events: vec![pb::NodeEvent {
            subsystem: "Storage".into(),
            message: "Mount volume".into(),
            details: [("volume_id".to_string(), "data".to_string())].into(),
            timestamp_ms: 42,
        }],
    })
    .await
    .unwrap();
    let ev = s.node("n1").unwrap().events.last().cloned().unwrap();
    assert_eq!(
        (ev.subsystem.as_str(), ev.message.as_str(), ev.timestamp),
        ("Storage", "Mount volume", 42)
    );
    assert_eq!(ev.details["volume_id"], "data");
}

#[tokio::test]
async fn events_a_registration_carries_fold_like_any_others() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let failed_unmount = |at| berth_structs::NodeEvent {
        timestamp: at,
        ..berth_structs::NodeEvent::new("Storage", "Unmount volume")
            .with_detail("volume_id", "data")
            .with_detail("error", "target is busy")
    };
    let unmounts = |n: usize| {
        let mut registering = node("n1");
        registering.events = (0..n).map(|i| failed_unmount(i as i64)).collect();
        registering
    };
    // First registration, then a re-registration that repeats them.
    s.register_node(unmounts(3)).await.unwrap();
    s.register_node(unmounts(2)).await.unwrap();
    let events = s.node("n1").unwrap().events;
    let folded: Vec<_> = events
        .iter()
        .filter(|e| e.message == "Unmount volume")
        .collect();
    assert_eq!(folded.len(), 1, "{events:?}");
    assert_eq!(folded[0].count, 5);
    assert_eq!(folded[0].timestamp, 2);
    // So do the servers' own "Node registered" events.
    let registered: Vec<_> = events
        .iter()
        .filter(|e| e.message == "Node registered")
        .collect();
    assert_eq!(registered.len(), 1, "{events:?}");
    assert_eq!(registered[0].count, 2);
}

/// The watch's next message, within 5 s.
async fn next(watch: &mut tonic::Streaming<pb::AllocationsUpdate>) -> pb::AllocationsUpdate {
    tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("a watch message within 5 s")
        .unwrap()
        .expect("the watch is open")
}

#[tokio::test]
async fn after_a_report_of_one_alloc_the_watch_sends_every_alloc_as_it_is_now() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut nc = ts.node_client().await;
    register(&s, node("n1")).await;
    let mut watch = open_watch(&mut nc, "n1").await;
    assert!(next(&mut watch).await.allocs_json.is_empty());
    s.register_job(job("web", JobType::Service, 2))
        .await
        .unwrap();
    let placed = next(&mut watch).await;
    let allocs = decode(&placed);
    assert_eq!(allocs.len(), 2);
    let by_id = |u: &pb::AllocationsUpdate, id: &str| -> (Allocation, Vec<u8>) {
        let i = decode(u)
            .iter()
            .position(|a| a.id == id)
            .expect("alloc in the update");
        (decode(u).remove(i), u.allocs_json[i].clone())
    };
    let (first, second) = (allocs[0].id.clone(), allocs[1].id.clone());

    // One alloc changes: it is sent as it is now, the other as before.
    nc.update_allocations(running_update("n1", &first))
        .await
        .unwrap();
    let after_first = next(&mut watch).await;
    let (a, _) = by_id(&after_first, &first);
    assert_eq!(a.client_status, AllocClientStatus::Running);
    assert_eq!(by_id(&after_first, &second).1, by_id(&placed, &second).1);

    // Then the other: both are sent as they are now.
    nc.update_allocations(status_update("n1", &second, "failed", "exit 1"))
        .await
        .unwrap();
    let after_second = loop {
        let u = next(&mut watch).await;
        if by_id(&u, &second).0.client_status != AllocClientStatus::Pending {
            break u;
        }
    };
    let (b, _) = by_id(&after_second, &second);
    assert_eq!(b.client_status, AllocClientStatus::Failed);
    assert_eq!(b.client_description, "exit 1");
    assert_eq!(
        by_id(&after_second, &first).0,
        s.allocation(&first).unwrap(),
        "the first alloc as the servers have it"
    );
    assert_eq!(
        by_id(&after_second, &second).0,
        s.allocation(&second).unwrap()
    );
    ts.stop().await;
}

#[tokio::test]
async fn a_delta_watch_sends_only_the_allocs_that_changed_and_the_ids_of_those_gone() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut nc = ts.node_client().await;
    register(&s, node("n1")).await;
    let mut watch = open_watch_with(&mut nc, "n1", true).await;
    let first = next(&mut watch).await;
    assert!(!first.delta, "the first message is the full set");
    assert!(first.allocs_json.is_empty());

    s.register_job(job("web", JobType::Service, 2))
        .await
        .unwrap();
    let placed = next(&mut watch).await;
    assert!(placed.delta);
    assert!(placed.removed_ids.is_empty());
    let allocs = decode(&placed);
    assert_eq!(allocs.len(), 2);
    let (one, two) = (allocs[0].id.clone(), allocs[1].id.clone());

    // One alloc changes: it alone is sent, as the servers have it now
    // but for its job, the one sent with it before.
    nc.update_allocations(running_update("n1", &one))
        .await
        .unwrap();
    let changed = next(&mut watch).await;
    assert!(changed.delta);
    assert_eq!(changed.same_job_ids, std::slice::from_ref(&one));
    let mut now = s.allocation(&one).unwrap();
    assert_eq!(now.job, allocs[0].job, "the job sent before");
    now.job = Default::default();
    assert_eq!(decode(&changed), vec![now]);

    // Both stop, are done, and the purged job's allocs leave the state:
    // their IDs are sent as gone.
    s.stop_job_with("web", true).await.unwrap();
    for id in [&one, &two] {
        nc.update_allocations(status_update("n1", id, "complete", "stopped"))
            .await
            .unwrap();
    }
    let mut gone: Vec<String> = Vec::new();
    while gone.len() < 2 {
        let u = next(&mut watch).await;
        assert!(u.delta, "every message after the first is a delta");
        for a in decode(&u) {
            assert!(a.id == one || a.id == two, "an alloc of another job: {a:?}");
        }
        gone.extend(u.removed_ids);
    }
    gone.sort();
    let mut both = vec![one, two];
    both.sort();
    assert_eq!(gone, both);
    ts.stop().await;
}
