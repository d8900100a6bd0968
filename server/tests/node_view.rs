//! What the servers show of a node beside the node itself: what its allocs
//! that are not terminal ask for, and the CSI volumes they claim there.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_structs::{AccessMode, AllocClientStatus, ClaimMode, JobType, NodeCsiVolume};
use support::*;

#[tokio::test]
async fn a_nodes_usage_counts_its_live_allocs_and_lists_their_claims() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    assert_eq!(s.node_usage("n1"), Default::default(), "nothing placed yet");

    // A writer of volume "data" (one task of 100 MHz, 128 MiB), claimed as
    // its client does, and a batch job of two allocs.
    let writer = place_on_data(&s, volume_job("db", "data", AccessMode::SingleNodeWriter)).await;
    ts.csi_client()
        .await
        .claim(claim_request("data", &writer, AccessMode::SingleNodeWriter))
        .await
        .expect("claim");
    s.register_job(job("batch", JobType::Batch, 2))
        .await
        .unwrap();
    let batch = live_allocs(&s, "batch");
    assert_eq!(batch.len(), 2);

    let usage = s.node_usage("n1");
    assert_eq!(usage.allocated.cpu, 300);
    assert_eq!(usage.allocated.memory_mb, 384);
    assert_eq!(usage.allocated.disk_mb, 0);
    assert_eq!(
        usage.csi_volumes,
        vec![NodeCsiVolume {
            volume_id: "data".into(),
            plugin_id: "hostpath".into(),
            alloc_id: writer.id.clone(),
            mode: ClaimMode::Write,
            state: "taken".into(),
        }]
    );

    // A terminal alloc asks for nothing any more.
    report(&s, &batch[0], AllocClientStatus::Complete).await;
    let usage = s.node_usage("n1");
    assert_eq!(usage.allocated.cpu, 200);
    assert_eq!(usage.allocated.memory_mb, 256);

    // Another node has neither.
    register(&s, node("n2")).await;
    assert_eq!(s.node_usage("n2"), Default::default());
}
