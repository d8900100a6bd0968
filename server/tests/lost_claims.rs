//! Claims of lost allocs keep the promise "never two writers": a write
//! claim of an alloc whose node went down is kept while the node may still
//! run it, and freed when the node comes back and stops it, when the node
//! is purged or when an operator detaches the volume; read claims are freed
//! at once. Over real gRPC and call streams.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use berth_proto::berth::v1 as pb;
use berth_server::{Server, ServerError};
use berth_structs::{
    AccessMode, AllocClientStatus, AllocDesiredStatus, Allocation, ClaimState, NodeEvent,
    NodeStatus,
};
use support::*;

/// n1 runs "db" (write claim on single-node-writer volume "data") and
/// "reader" (read claim on multi-node-reader-only volume "logs"); n2 is
/// registered afterwards, so both are on n1. Returns (db, reader).
async fn two_claims_on_n1(ts: &TestServer) -> (Allocation, Allocation) {
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", true, false, false).await;
    register_data_volume(s).await;
    s.register_volume(volume("logs", "hostpath", &[AccessMode::MultiNodeReader]))
        .await
        .unwrap();
    s.register_job(volume_job("db", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    s.register_job(volume_job("reader", "logs", AccessMode::MultiNodeReader))
        .await
        .unwrap();
    let db = live_allocs(s, "db").pop().expect("db placed");
    let reader = live_allocs(s, "reader").pop().expect("reader placed");
    assert_eq!((db.node_id.as_str(), reader.node_id.as_str()), ("n1", "n1"));
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &db, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    csi.claim(claim_request("logs", &reader, AccessMode::MultiNodeReader))
        .await
        .unwrap();
    register(s, node("n2")).await;
    give_plugin(s, "n2", "hostpath", true, false, false).await;
    (db, reader)
}

/// n1 goes down; waits until the watcher has freed the read claim (which
/// proves it has looked at the claims since) and checks that the write
/// claim is kept and the replacement of db is blocked by it.
async fn down_keeps_the_write_claim(s: &Server, db: &Allocation, reader: &Allocation) {
    s.mark_node_down("n1", "test").await.unwrap();
    assert_eq!(
        s.allocation(&db.id).unwrap().client_status,
        AllocClientStatus::Lost
    );
    wait_until(
        "read claim of the lost alloc freed",
        Duration::from_secs(10),
        || claim_of(s, "logs", &reader.id).is_none(),
    )
    .await;
    // The reader's replacement runs on n2 at once.
    wait_until("reader replaced", Duration::from_secs(10), || {
        live_allocs(s, "reader").iter().any(|a| a.node_id == "n2")
    })
    .await;
    assert_eq!(
        claim_of(s, "data", &db.id),
        Some((ClaimState::Taken, false)),
        "the write claim of the lost alloc is kept while its node is down"
    );
    // db's replacement is refused by the claim, with a reason naming it.
    wait_placement_failure(s, "db", "data").await;
    assert!(live_allocs(s, "db").is_empty(), "no second writer placed");
    let failures = s.job_placement_failures("db");
    assert!(
        failures.iter().any(|f| f.contains(&format!(
            "volume \"data\" already has a writer (alloc {})",
            db.id
        ))),
        "the placement failure names the lost alloc that holds the claim: {failures:?}"
    );
}

#[tokio::test]
async fn write_claim_of_a_lost_alloc_is_kept_while_down_and_freed_when_the_node_is_purged() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (db, reader) = two_claims_on_n1(&ts).await;
    let client = TestClient::connect(&ts, "n1", ok_handler()).await;
    down_keeps_the_write_claim(&s, &db, &reader).await;

    let purge = s.purge_node("n1", true).await.unwrap();
    assert_eq!(purge.node_id, "n1");
    assert_eq!(purge.released.len(), 1, "{purge:?}");
    assert_eq!(purge.released[0].volume_id, "data");
    assert_eq!(purge.released[0].alloc_id, db.id);
    assert_eq!(claim_of(&s, "data", &db.id), None);
    assert!(client.call_kinds().is_empty(), "nobody to tell");
    let next = wait_for_live_on(&s, "db", "n2").await;
    replacement_claims_data(&ts, &next).await;
}

#[tokio::test]
async fn write_claim_of_a_lost_alloc_is_freed_by_volume_detach() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (db, reader) = two_claims_on_n1(&ts).await;
    down_keeps_the_write_claim(&s, &db, &reader).await;

    let r = s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(r.released, vec![db.id.clone()]);
    assert_eq!(claim_of(&s, "data", &db.id), None);
    let next = wait_for_live_on(&s, "db", "n2").await;
    replacement_claims_data(&ts, &next).await;
}

#[tokio::test]
async fn node_that_comes_back_stops_its_lost_alloc_and_the_write_claim_is_freed_once_it_reports_it_stopped(
) {
    let ts = TestServer::start(|c| c.claim_reap_grace = Duration::from_millis(200)).await;
    let s = ts.server.clone();
    let (db, reader) = two_claims_on_n1(&ts).await;
    down_keeps_the_write_claim(&s, &db, &reader).await;

    // The node comes back: a heartbeat over gRPC.
    let mut nc = ts.node_client().await;
    nc.heartbeat(pb::HeartbeatRequest {
        node_id: "n1".into(),
    })
    .await
    .expect("heartbeat of the returning node");
    let n1 = s.node("n1").unwrap();
    assert_eq!(n1.status, NodeStatus::Ready);
    let ev = n1.events.last().unwrap();
    assert_eq!(ev.subsystem, NodeEvent::SUBSYSTEM_CLUSTER);
    assert_eq!(ev.message, "Node heartbeat received; node ready");

    // Its watch hands it the lost alloc with desired stop.
    let mut watch = open_watch(&mut nc, "n1").await;
    let update = watch.message().await.unwrap().expect("an alloc set");
    let mine: Vec<Allocation> = update
        .allocs_json
        .iter()
        .map(|j| serde_json::from_slice(j).unwrap())
        .collect();
    let lost = mine
        .iter()
        .find(|a| a.id == db.id)
        .expect("db in the watch");
    assert_eq!(lost.desired_status, AllocDesiredStatus::Stop);
    assert_eq!(lost.client_status, AllocClientStatus::Lost);

    // Still running there, as far as the servers know: the claim stays,
    // and a late `running` report does not make the alloc live again.
    report(&s, &db, AllocClientStatus::Running).await;
    assert_eq!(
        s.allocation(&db.id).unwrap().client_status,
        AllocClientStatus::Lost
    );
    let client = TestClient::connect(&ts, "n1", ok_handler()).await;
    assert_eq!(
        claim_of(&s, "data", &db.id),
        Some((ClaimState::Taken, false))
    );

    // The client stops it and reports it: the claim is freed (the client
    // is told to unmount, as it did not release it itself).
    nc.update_allocations(status_update("n1", &db.id, "complete", "stopped"))
        .await
        .unwrap();
    assert_eq!(
        s.allocation(&db.id).unwrap().client_status,
        AllocClientStatus::Complete
    );
    wait_until(
        "the write claim freed once the alloc stopped",
        Duration::from_secs(10),
        || claim_of(&s, "data", &db.id).is_none(),
    )
    .await;
    assert_eq!(client.call_kinds(), vec!["NodeDetach"]);
    // Exactly the replacement holds the write claim then.
    let next = wait_for_live(&s, "db").await;
    replacement_claims_data(&ts, &next).await;
    let vol = s.volume("data").unwrap();
    let writers: Vec<&String> = vol.write_claims.keys().collect();
    assert_eq!(writers, vec![&next.id]);
}

#[tokio::test]
async fn purge_removes_the_node_loses_its_allocs_and_a_later_heartbeat_is_not_found() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (db, reader) = two_claims_on_n1(&ts).await;
    // Purged while ready: the operator says it is gone.
    let by_prefix = s.purge_node("n1", true).await.unwrap();
    assert_eq!(by_prefix.node_name, "n1");
    let mut lost = by_prefix.lost_allocs.clone();
    lost.sort();
    let mut want = vec![db.id.clone(), reader.id.clone()];
    want.sort();
    assert_eq!(lost, want);
    assert_eq!(by_prefix.released.len(), 2, "{by_prefix:?}");
    assert!(matches!(s.node("n1"), Err(ServerError::NotFound(_))));
    for a in [&db, &reader] {
        let a = s.allocation(&a.id).unwrap();
        assert_eq!(a.client_status, AllocClientStatus::Lost);
        assert_eq!(a.desired_status, AllocDesiredStatus::Stop);
    }
    wait_for_live_on(&s, "db", "n2").await;
    wait_for_live_on(&s, "reader", "n2").await;
    assert!(matches!(
        s.node_heartbeat("n1").await,
        Err(ServerError::NotFound(_))
    ));
    assert!(matches!(
        s.purge_node("n1", true).await,
        Err(ServerError::NotFound(_))
    ));
    // A node that was never heard of is NotFound as well.
    assert!(matches!(
        s.purge_node("ghost", true).await,
        Err(ServerError::NotFound(_))
    ));
}

#[tokio::test]
async fn write_claim_of_a_windowed_lost_alloc_is_kept_past_the_window_once_its_node_is_back_until_it_reports_it_stopped(
) {
    let window = Duration::from_secs(2);
    let grace = Duration::from_millis(500);
    let ts = TestServer::start(|c| {
        c.heartbeat_grace = grace;
        c.claim_reap_grace = Duration::from_millis(200);
    })
    .await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    let db = place_on_data(&s, windowed_db_job(window)).await;
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &db, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    register(&s, node("n2")).await;
    give_plugin(&s, "n2", "hostpath", true, false, false).await;
    let client = TestClient::connect(&ts, "n1", ok_handler()).await;

    // The window counts from this heartbeat, not from the registration,
    // so the set-up above, however slow, does not use it up.
    s.node_heartbeat("n1").await.unwrap();
    s.mark_node_down("n1", "Node heartbeat missed")
        .await
        .unwrap();
    let lost = s.allocation(&db.id).unwrap();
    assert_eq!(lost.client_status, AllocClientStatus::Lost);
    let back_by =
        lost.node_last_heartbeat_ms + i64::try_from((window + grace).as_millis()).unwrap();
    // The node comes back inside the window: its client no longer counts
    // the window (its heartbeats succeed) and stops the alloc because it
    // is desired stop, which may take longer than the rest of the window.
    let mut nc = ts.node_client().await;
    nc.heartbeat(pb::HeartbeatRequest {
        node_id: "n1".into(),
    })
    .await
    .expect("heartbeat of the returning node");
    assert_eq!(s.node("n1").unwrap().status, NodeStatus::Ready);
    assert!(
        berth_structs::now_ms() < back_by,
        "the node came back after its window ended: the test did not test a return inside it"
    );

    // Past the window's end, the claim stays the stopping alloc's.
    let end_ms = lost.node_last_heartbeat_ms + i64::try_from((window + grace).as_millis()).unwrap();
    let watch_until = end_ms + 1_500;
    while berth_structs::now_ms() < watch_until {
        assert_eq!(
            claim_of(&s, "data", &db.id),
            Some((ClaimState::Taken, false)),
            "the write claim of an alloc its returned node has not reported stopped is kept"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(client.call_kinds().is_empty(), "{:?}", client.call_kinds());
    assert!(
        live_allocs(&s, "db").is_empty(),
        "no second writer is placed while the claim is held"
    );

    // The client reports it stopped: the claim is freed and the
    // replacement takes it.
    report(&s, &db, AllocClientStatus::Complete).await;
    wait_until(
        "the write claim freed once the alloc stopped",
        Duration::from_secs(10),
        || claim_of(&s, "data", &db.id).is_none(),
    )
    .await;
    let next = wait_for_live(&s, "db").await;
    replacement_claims_data(&ts, &next).await;
}

#[tokio::test]
async fn a_purge_without_force_keeps_the_write_claim_until_an_operator_detaches_it() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (db, reader) = two_claims_on_n1(&ts).await;
    // The node is gone from the servers' view while its tasks may run on
    // (a client that came back under another data dir).
    let purge = s.purge_node("n1", false).await.unwrap();
    assert_eq!(purge.kept.len(), 1, "{purge:?}");
    assert_eq!(purge.kept[0].volume_id, "data");
    assert_eq!(purge.kept[0].alloc_id, db.id);
    assert_eq!(
        purge.released.len(),
        1,
        "the read claim is freed: {purge:?}"
    );
    assert_eq!(purge.released[0].alloc_id, reader.id);
    assert_eq!(claim_of(&s, "logs", &reader.id), None);

    // The volume watcher leaves it: the replacement of db stays blocked.
    wait_placement_failure(&s, "db", "already has a writer").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        claim_of(&s, "data", &db.id),
        Some((ClaimState::Taken, false)),
        "the kept write claim outlives the node"
    );
    assert!(live_allocs(&s, "db").is_empty(), "no second writer");

    // The operator, the old tasks stopped, frees it by the node's ID.
    let r = s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(r.released, vec![db.id.clone()]);
    let next = wait_for_live_on(&s, "db", "n2").await;
    replacement_claims_data(&ts, &next).await;
}

#[tokio::test]
async fn a_forced_purge_frees_the_write_claim_and_reports_what_it_held() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (db, reader) = two_claims_on_n1(&ts).await;
    s.mark_node_down("n1", "test").await.unwrap();
    // The watcher frees the lost reader's read claim by itself.
    wait_until("the read claim freed", Duration::from_secs(10), || {
        claim_of(&s, "logs", &reader.id).is_none()
    })
    .await;
    let purge = s.purge_node("n1", true).await.unwrap();
    assert!(purge.kept.is_empty(), "{purge:?}");
    let freed: Vec<&str> = purge.released.iter().map(|c| c.alloc_id.as_str()).collect();
    assert_eq!(freed, vec![db.id.as_str()], "{purge:?}");
    assert_eq!(claim_of(&s, "data", &db.id), None);
}
