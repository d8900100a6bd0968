//! CSI volume stats reported with alloc updates over real gRPC: stored on
//! the alloc, without an evaluation and without being streamed back to the
//! client that sent them.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_server::Table;
use berth_structs::{
    AccessMode, AllocClientStatus, Allocation, CsiVolumeCondition, CsiVolumeStats,
};
use support::*;

fn stats(used: u64) -> CsiVolumeStats {
    CsiVolumeStats {
        volume_id: "data".into(),
        plugin_id: "hostpath".into(),
        bytes_total: Some(64 << 20),
        bytes_used: Some(used),
        bytes_available: Some((64 << 20) - used),
        inodes_total: Some(16384),
        inodes_used: Some(11),
        inodes_available: Some(16373),
        condition: Some(CsiVolumeCondition {
            abnormal: false,
            message: String::new(),
        }),
        error: None,
        collected_at_ms: 1,
    }
}

fn stats_only(
    alloc_id: &str,
    by_name: &BTreeMap<String, CsiVolumeStats>,
) -> pb::UpdateAllocationsRequest {
    pb::UpdateAllocationsRequest {
        node_id: "n1".into(),
        updates: vec![pb::AllocStatusUpdate {
            alloc_id: alloc_id.into(),
            csi_volume_stats_json: serde_json::to_vec(by_name).unwrap(),
            volume_stats_only: true,
            ..Default::default()
        }],
    }
}

/// Whether the watch sends anything within `within`.
async fn watch_sends(
    watch: &mut tonic::Streaming<pb::AllocationsUpdate>,
    within: Duration,
) -> bool {
    tokio::time::timeout(within, watch.message()).await.is_ok()
}

/// A server with node n1 serving the hostpath plugin and job "app"'s
/// alloc placed there with the volume "data"; a client of node n1.
async fn start_with_alloc_on_data() -> (TestServer, Allocation, NodeClient<SecretChannel>) {
    let ts = TestServer::start(|_| {}).await;
    register(&ts.server, node("n1")).await;
    give_plugin(&ts.server, "n1", "hostpath", true, false, false).await;
    let job = volume_job("app", "data", AccessMode::SingleNodeWriter);
    let alloc = place_on_data(&ts.server, job).await;
    let nc = ts.node_client().await;
    (ts, alloc, nc)
}

#[tokio::test]
async fn a_stats_only_update_is_stored_without_an_evaluation_or_a_watch_message() {
    let (ts, alloc, mut nc) = start_with_alloc_on_data().await;
    let s = ts.server.clone();
    let mut watch = open_watch(&mut nc, "n1").await;
    watch.message().await.unwrap().expect("the first set");

    // The client reports its alloc running: streamed back, as always.
    nc.update_allocations(running_update("n1", &alloc.id))
        .await
        .unwrap();
    assert!(watch_sends(&mut watch, Duration::from_secs(5)).await);
    let running = s.allocation(&alloc.id).unwrap();
    assert_eq!(running.client_status, AllocClientStatus::Running);

    // Stats only: one write (the alloc), nothing else.
    let index = s.index();
    let jobs_index = s.table_index(Table::Jobs);
    let by_name = BTreeMap::from([("data".to_string(), stats(5 << 20))]);
    nc.update_allocations(stats_only(&alloc.id, &by_name))
        .await
        .unwrap();
    let stored = s.allocation(&alloc.id).unwrap();
    assert_eq!(stored.csi_volume_stats, by_name);
    assert_eq!(s.index(), index + 1, "one write, no evaluation writes");
    assert_eq!(s.table_index(Table::Jobs), jobs_index);
    assert_eq!(s.table_index(Table::Allocs), index + 1);
    // The status, its description and the task states are kept.
    assert_eq!(stored.client_status, AllocClientStatus::Running);
    assert_eq!(stored.client_description, "Tasks are running");
    assert_eq!(stored.task_states, running.task_states);
    assert_eq!(stored.desired_status, running.desired_status);
    assert!(s.job_placement_failures("app").is_empty());
    // Nothing the client needs changed: the watch stays quiet.
    assert!(
        !watch_sends(&mut watch, Duration::from_secs(1)).await,
        "a stats-only write is not streamed back"
    );

    // The same stats again change nothing at all.
    nc.update_allocations(stats_only(&alloc.id, &by_name))
        .await
        .unwrap();
    assert_eq!(s.index(), index + 1);

    // Stats of a volume the group does not have are dropped.
    let mut bogus = by_name.clone();
    bogus.insert("bogus".into(), stats(1));
    nc.update_allocations(stats_only(&alloc.id, &bogus))
        .await
        .unwrap();
    assert_eq!(s.allocation(&alloc.id).unwrap().csi_volume_stats, by_name);

    // A real change after stats-only writes is streamed, with them.
    s.stop_job("app").await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the stop is streamed")
        .unwrap()
        .unwrap();
    let sent: Vec<berth_structs::Allocation> = next
        .allocs_json
        .iter()
        .map(|b| serde_json::from_slice(b).unwrap())
        .collect();
    assert!(sent[0].server_terminal());
    assert_eq!(sent[0].csi_volume_stats, by_name);
    ts.stop().await;
}

#[tokio::test]
async fn stats_sent_with_a_status_update_are_stored_with_it_and_old_records_decode() {
    let (ts, alloc, mut nc) = start_with_alloc_on_data().await;
    let s = ts.server.clone();
    let by_name = BTreeMap::from([("data".to_string(), stats(7))]);
    nc.update_allocations(pb::UpdateAllocationsRequest {
        node_id: "n1".into(),
        updates: vec![pb::AllocStatusUpdate {
            alloc_id: alloc.id.clone(),
            client_status: "running".into(),
            csi_volume_stats_json: serde_json::to_vec(&by_name).unwrap(),
            ..Default::default()
        }],
    })
    .await
    .unwrap();
    let stored = s.allocation(&alloc.id).unwrap();
    assert_eq!(stored.client_status, AllocClientStatus::Running);
    assert_eq!(stored.csi_volume_stats, by_name);

    // A status update without stats keeps them.
    nc.update_allocations(status_update("n1", &alloc.id, "running", "still"))
        .await
        .unwrap();
    assert_eq!(s.allocation(&alloc.id).unwrap().csi_volume_stats, by_name);

    // Undecodable stats are refused as InvalidArgument.
    let mut bad = stats_only(&alloc.id, &by_name);
    bad.updates[0].csi_volume_stats_json = b"{\"data\": 7}".to_vec();
    let err = nc.update_allocations(bad).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // An alloc recorded before volume stats existed decodes without them.
    let mut old = serde_json::to_value(&stored).unwrap();
    old.as_object_mut().unwrap().remove("csi_volume_stats");
    let decoded: berth_structs::Allocation = serde_json::from_value(old).unwrap();
    assert!(decoded.csi_volume_stats.is_empty());
    ts.stop().await;
}
