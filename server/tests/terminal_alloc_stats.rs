//! Volume stats that reach the servers after the alloc ended (a report
//! queued before the alloc stopped) are not stored: they would move the
//! modify time that the volume watcher's reap grace counts from.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;

use berth_server::AllocUpdate;
use berth_structs::{AccessMode, AllocClientStatus, CsiVolumeStats};
use support::*;

#[tokio::test]
async fn stats_only_updates_of_a_terminal_alloc_are_not_written() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    let alloc = place_on_data(&s, volume_job("app", "data", AccessMode::SingleNodeWriter)).await;
    s.update_allocations(
        "n1",
        vec![AllocUpdate {
            alloc_id: alloc.id.clone(),
            client_status: AllocClientStatus::Complete,
            client_description: "All tasks have completed".into(),
            ..AllocUpdate::default()
        }],
    )
    .await
    .unwrap();
    let done = s.allocation(&alloc.id).unwrap();
    assert_eq!(done.client_status, AllocClientStatus::Complete);

    let index = s.index();
    let late = BTreeMap::from([(
        "data".to_string(),
        CsiVolumeStats {
            volume_id: "data".into(),
            bytes_used: Some(1 << 20),
            ..Default::default()
        },
    )]);
    s.update_allocations(
        "n1",
        vec![AllocUpdate {
            alloc_id: alloc.id.clone(),
            csi_volume_stats: Some(late),
            volume_stats_only: true,
            ..AllocUpdate::default()
        }],
    )
    .await
    .unwrap();
    assert_eq!(s.index(), index, "no write");
    let after = s.allocation(&alloc.id).unwrap();
    assert_eq!(after.modify_time_ms, done.modify_time_ms);
    assert!(after.csi_volume_stats.is_empty(), "{after:?}");
}
