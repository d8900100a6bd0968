//! CSI claims over real gRPC, their release through the checkpointed
//! states, calls to clients over real call streams, and the volume watcher.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_proto::berth::v1 as pb;
use berth_server::ServerError;
use berth_structs::{AccessMode, AllocClientStatus, ClaimState};
use support::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

#[tokio::test]
async fn claim_refuses_an_access_mode_the_volume_does_not_list() {
    let ts = TestServer::start(|_| {}).await;
    let alloc = place_db_on_n1(&ts, false, &[AccessMode::SingleNodeWriter]).await;
    let mut csi = ts.csi_client().await;
    let err = csi
        .claim(claim_request(
            "data",
            &alloc,
            AccessMode::MultiNodeMultiWriter,
        ))
        .await
        .expect_err("claim must be refused");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        err.message(),
        "volume \"data\" does not have capability multi-node-multi-writer/file-system"
    );
    assert!(ts.server.volume("data").unwrap().write_claims.is_empty());

    // The listed mode works; a claim of an unknown volume is NotFound.
    let ok = csi
        .claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.external_id, "ext-data");
    assert_eq!(ok.secrets.get("token").map(String::as_str), Some("s3cret"));
    let err = csi
        .claim(claim_request("nope", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn unpublish_drives_the_claim_states_and_frees_it_through_controller_detach() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let alloc = place_db_on_n1(&ts, true, &[AccessMode::SingleNodeWriter]).await;
    let client = TestClient::connect(&ts, "n1", ok_handler()).await;
    let mut csi = ts.csi_client().await;

    let grant = csi
        .claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        grant.publish_context.get("device").map(String::as_str),
        Some("/dev/test0")
    );
    // Persisted before the answer, with the publish context.
    let vol = s.volume("data").unwrap();
    let c = vol.claim_for(&alloc.id).expect("claim stored");
    assert_eq!(c.state, ClaimState::Taken);
    assert_eq!(
        c.publish_context.get("device").map(String::as_str),
        Some("/dev/test0")
    );
    assert_eq!(c.external_node_id, "ext-node");
    {
        let calls = client.calls.lock().unwrap();
        let Some(pb::server_call::Call::ControllerPublish(p)) = &calls[0].call else {
            panic!("expected ControllerPublish, got {:?}", calls[0]);
        };
        assert_eq!(p.external_node_id, "ext-node");
        assert_eq!(p.external_id, "ext-data");
        assert_eq!(p.secrets.get("token").map(String::as_str), Some("s3cret"));
    }
    // A repeated claim by the same alloc is answered, not doubled.
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(s.volume("data").unwrap().write_claims.len(), 1);

    // The alloc stops; the controller is unavailable: the claim stops at
    // node-detached (the client unpublished locally) and the call fails.
    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;
    client.set_handler(Arc::new(|call| match call.call {
        Some(pb::server_call::Call::ControllerUnpublish(_)) => {
            pb::call_reply::Result::Error(pb::CallError {
                code: tonic::Code::Unavailable as i32,
                message: "controller is restarting".into(),
            })
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    }));
    let unpublish = pb::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: alloc.id.clone(),
        node_id: "n1".into(),
    };
    let err = csi
        .unpublish(unpublish.clone())
        .await
        .expect_err("controller detach must fail");
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(
        err.message().contains("controller is restarting"),
        "{}",
        err.message()
    );
    assert_eq!(
        claim_of(&s, "data", &alloc.id),
        Some((ClaimState::NodeDetached, true))
    );

    // The controller comes back: the claim is freed.
    client.set_handler(ok_handler());
    csi.unpublish(unpublish.clone()).await.unwrap();
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
    let kinds = client.call_kinds();
    assert!(
        !kinds.contains(&"NodeDetach"),
        "the client detached itself: {kinds:?}"
    );
    assert_eq!(kinds.last(), Some(&"ControllerUnpublish"));
    assert!(
        kinds
            .iter()
            .filter(|k| **k == "ControllerUnpublish")
            .count()
            >= 2,
        "{kinds:?}"
    );
    // Unknown claims are released already.
    csi.unpublish(unpublish).await.unwrap();
}

#[tokio::test]
async fn garbage_collection_keeps_an_alloc_until_its_claim_is_freed() {
    let ts = TestServer::start(|c| c.alloc_gc_threshold = Duration::ZERO).await;
    let s = ts.server.clone();
    let (alloc, client, mut csi) = claimed_db_on_n1(&ts, false, ok_handler()).await;

    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;
    // Terminal, past its threshold, but a claim names it: it stays, forced
    // or not, so that the claim is released through its normal path and
    // never because its alloc vanished.
    for force in [false, true] {
        let gc = s.garbage_collect(force).await.unwrap();
        assert!(!gc.allocs.contains(&alloc.id), "force = {force}: {gc:?}");
        assert!(gc.jobs.is_empty(), "force = {force}: {gc:?}");
        assert!(s.allocation(&alloc.id).is_ok());
    }
    assert!(claim_of(&s, "data", &alloc.id).is_some());

    // The client unpublishes; then the alloc and its stopped job go.
    csi.unpublish(pb::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: alloc.id.clone(),
        node_id: "n1".into(),
    })
    .await
    .unwrap();
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
    let gc = s.garbage_collect(true).await.unwrap();
    assert_eq!(gc.allocs, vec![alloc.id.clone()]);
    assert_eq!(gc.jobs, vec!["db".to_string()]);
    assert!(s.allocation(&alloc.id).is_err());
    assert!(s.job("db").is_err());
    assert!(
        !client.call_kinds().contains(&"NodeDetach"),
        "the client detached itself"
    );
}

#[tokio::test]
async fn volume_watcher_reaps_claims_of_terminal_allocs_and_keeps_write_claims_of_lost_allocs() {
    let ts = TestServer::start(|c| c.claim_reap_grace = Duration::from_millis(200)).await;
    let s = ts.server.clone();
    let (alloc, client, mut csi) = claimed_db_on_n1(&ts, false, ok_handler()).await;
    report(&s, &alloc, AllocClientStatus::Failed).await;
    wait_until(
        "claim of the failed alloc freed",
        Duration::from_secs(10),
        || claim_of(&s, "data", &alloc.id).is_none(),
    )
    .await;
    assert_eq!(client.call_kinds(), vec!["NodeDetach"]);

    // The replacement claims; its node goes down: the alloc is lost, but
    // its node may still run it and write, so the watcher keeps the write
    // claim (lost_claims.rs proves it over a watcher pass) until the node
    // comes back, is purged, or an operator detaches the volume, which
    // needs no detach call (nobody to call).
    let next = wait_for_live(&s, "db").await;
    assert_ne!(next.id, alloc.id);
    csi.claim(claim_request("data", &next, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    s.mark_node_down("n1", "test").await.unwrap();
    assert_eq!(
        s.allocation(&next.id).unwrap().client_status,
        AllocClientStatus::Lost
    );
    assert_eq!(
        claim_of(&s, "data", &next.id),
        Some((ClaimState::Taken, false))
    );
    s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(claim_of(&s, "data", &next.id), None);
    assert_eq!(client.call_kinds(), vec!["NodeDetach"]);
}

#[tokio::test]
async fn pending_call_fails_unavailable_when_the_stream_drops_and_new_stream_replaces_old() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    give_plugin(&s, "n1", "hostpath", true, true, true).await;

    // A raw stream that never answers.
    let mut nc = ts.node_client().await;
    let (out, rx) = mpsc::channel(4);
    out.send(hello("n1")).await.unwrap();
    let mut inbound = nc
        .open_call_stream(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    wait_until("stream registered", Duration::from_secs(5), || {
        s.node_connected("n1")
    })
    .await;

    let s2 = s.clone();
    let create = tokio::spawn(async move {
        let mut v = volume("new", "hostpath", &[AccessMode::SingleNodeWriter]);
        v.external_id.clear();
        s2.create_volume(v).await
    });
    let call = inbound.message().await.unwrap().expect("a call");
    assert!(matches!(
        call.call,
        Some(pb::server_call::Call::CreateVolume(_))
    ));
    assert!(call.deadline_ms > 0);
    drop(inbound);
    drop(out);
    let started = tokio::time::Instant::now();
    let err = create.await.unwrap().expect_err("the stream dropped");
    assert!(matches!(err, ServerError::Unavailable(_)), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "failed by the drop, not the deadline"
    );
    wait_until("stream forgotten", Duration::from_secs(5), || {
        !s.node_connected("n1")
    })
    .await;

    // Two streams of the same node: the newer wins, the older ends.
    let (out_a, rx_a) = mpsc::channel(4);
    out_a.send(hello("n1")).await.unwrap();
    let mut old = nc
        .open_call_stream(ReceiverStream::new(rx_a))
        .await
        .unwrap()
        .into_inner();
    wait_until("old stream registered", Duration::from_secs(5), || {
        s.node_connected("n1")
    })
    .await;
    let newer = TestClient::connect(&ts, "n1", ok_handler()).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), old.message())
        .await
        .expect("old stream ends");
    assert!(matches!(ended, Ok(None)), "{ended:?}");
    let mut v = volume("new", "hostpath", &[AccessMode::SingleNodeWriter]);
    v.external_id.clear();
    v.capacity_min = Some(1 << 20);
    let created = s.create_volume(v).await.unwrap();
    assert_eq!(created.external_id, "ext-new");
    assert_eq!(created.capacity, 1 << 20);
    assert!(created.secrets.is_empty(), "secrets never returned");
    assert_eq!(newer.call_kinds(), vec!["CreateVolume"]);
    drop(out_a);

    s.delete_volume("new").await.unwrap();
    assert!(matches!(s.volume("new"), Err(ServerError::NotFound(_))));
    assert_eq!(newer.call_kinds(), vec!["CreateVolume", "DeleteVolume"]);
}

#[tokio::test]
async fn deregister_refuses_a_claimed_volume_unless_forced_and_force_reaps_first() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (alloc, client, _csi) = claimed_db_on_n1(&ts, false, ok_handler()).await;

    let err = s.deregister_volume("data", false).await.unwrap_err();
    assert!(matches!(err, ServerError::Conflict(_)), "{err:?}");
    assert!(matches!(
        s.delete_volume("data").await,
        Err(ServerError::Conflict(_))
    ));
    // Removing a claimed capability is refused too.
    let mut changed = volume("data", "hostpath", &[AccessMode::MultiNodeReader]);
    changed.external_id = "ext-data".into();
    assert!(matches!(
        s.register_volume(changed).await,
        Err(ServerError::Conflict(_))
    ));

    // Forced or not, a claim of an alloc still running on its node is
    // refused: detaching would pull the volume from under its task.
    let err = s.deregister_volume("data", true).await.unwrap_err();
    assert!(matches!(err, ServerError::Conflict(_)), "{err:?}");
    assert!(err.to_string().contains(&alloc.id), "{err}");
    assert!(client.call_kinds().is_empty());

    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;
    let released = s.deregister_volume("data", true).await.unwrap();
    assert_eq!(released.released, vec![alloc.id.clone()]);
    assert!(released.warnings.is_empty(), "{:?}", released.warnings);
    assert!(matches!(s.volume("data"), Err(ServerError::NotFound(_))));
    assert_eq!(client.call_kinds(), vec!["NodeDetach"]);
}

/// Set n1's fingerprints: a healthy node plugin, and a controller with the
/// given health and `requires_controller_publish`.
async fn set_controller(s: &berth_server::Server, healthy: bool, requires_publish: bool) {
    s.update_node_plugins(
        "n1",
        BTreeMap::from([("hostpath".to_string(), plugin_info("hostpath", true, true))]),
        BTreeMap::from([(
            "hostpath".to_string(),
            plugin_info("hostpath", healthy, requires_publish),
        )]),
    )
    .await
    .expect("update plugins");
}

#[tokio::test]
async fn release_controller_detaches_a_published_claim_while_the_controller_reports_unhealthy() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let alloc = place_db_on_n1(&ts, true, &[AccessMode::SingleNodeWriter]).await;
    // ControllerPublish answers without a publish context, so only the
    // claim's record of the publish can call for the detach. The handler
    // notes whether that record was persisted before the call arrived.
    let flag_at_publish: Arc<Mutex<Option<bool>>> = Arc::default();
    let (s2, seen, aid) = (s.clone(), flag_at_publish.clone(), alloc.id.clone());
    let handler: CallHandler = Arc::new(move |call| match call.call {
        Some(pb::server_call::Call::ControllerPublish(_)) => {
            let flag = s2
                .volume("data")
                .ok()
                .and_then(|v| v.claim_for(&aid).map(|c| c.controller_published));
            *seen.lock().unwrap() = flag;
            pb::call_reply::Result::ControllerPublish(pb::ControllerPublishReply::default())
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    });
    let (client, mut csi) = connect_and_claim_data(&ts, &alloc, handler).await;
    assert_eq!(
        *flag_at_publish.lock().unwrap(),
        Some(true),
        "controller_published is stored before ControllerPublish is sent"
    );
    assert_eq!(client.call_kinds(), vec!["ControllerPublish"]);

    // The controller restarts: unhealthy, and its fingerprint no longer
    // says it needs publishing. The alloc stops and its client unpublishes.
    set_controller(&s, false, false).await;
    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;
    let err = csi
        .unpublish(pb::UnpublishRequest {
            volume_id: "data".into(),
            alloc_id: alloc.id.clone(),
            node_id: "n1".into(),
        })
        .await
        .expect_err("no controller can detach the volume now");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{}", err.message());
    assert_eq!(
        claim_of(&s, "data", &alloc.id),
        Some((ClaimState::NodeDetached, true)),
        "the claim is kept, not freed while the volume is attached"
    );
    assert_eq!(client.call_kinds(), vec!["ControllerPublish"]);

    // The controller is healthy again (its fingerprint still says nothing
    // about publishing): the watcher retries and the volume is detached
    // from the controller before the claim is freed.
    set_controller(&s, true, false).await;
    wait_until("claim freed by a retry", Duration::from_secs(15), || {
        claim_of(&s, "data", &alloc.id).is_none()
    })
    .await;
    let calls = client.calls.lock().unwrap().clone();
    let unpublish = calls
        .iter()
        .find_map(|c| match &c.call {
            Some(pb::server_call::Call::ControllerUnpublish(u)) => Some(u.clone()),
            _ => None,
        })
        .expect("ControllerUnpublish was sent");
    assert_eq!(unpublish.external_id, "ext-data");
    assert_eq!(unpublish.external_node_id, "ext-node");
}

#[tokio::test]
async fn controller_unpublish_not_found_counts_as_detached_and_frees_the_claim() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (alloc, client, mut csi) = claimed_db_on_n1(&ts, true, ok_handler()).await;
    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;
    client.set_handler(Arc::new(|call| match call.call {
        Some(pb::server_call::Call::ControllerUnpublish(_)) => {
            pb::call_reply::Result::Error(pb::CallError {
                code: tonic::Code::NotFound as i32,
                message: "volume ext-data not found".into(),
            })
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    }));
    csi.unpublish(pb::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: alloc.id.clone(),
        node_id: "n1".into(),
    })
    .await
    .expect("NotFound means not published: the release succeeds");
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
    assert_eq!(
        client.call_kinds(),
        vec!["ControllerPublish", "ControllerUnpublish"]
    );
}

#[tokio::test]
async fn watcher_keeps_the_claim_of_a_lost_alloc_until_its_stop_after_client_disconnect_window_passes(
) {
    let window = Duration::from_secs(2);
    let grace = Duration::from_secs(1);
    // No periodic retry: the replacement is placed by the timer set for
    // the window's end, not by an unrelated evaluation.
    let ts = TestServer::start(|c| {
        c.heartbeat_grace = grace;
        c.scheduler_retry_interval = Duration::from_secs(3600);
    })
    .await;
    let s = ts.server.clone();
    for n in ["n1", "n2"] {
        register(&s, node(n)).await;
        give_plugin(&s, n, "hostpath", true, false, false).await;
    }
    let alloc = place_on_data(&s, windowed_db_job(window)).await;
    let (lost_node, other_node) = if alloc.node_id == "n1" {
        ("n1", "n2")
    } else {
        ("n2", "n1")
    };
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();

    // The node is partitioned: its client may still run the alloc and
    // write to the volume until the window, counted from the node's last
    // heartbeat, plus the heartbeat grace has passed.
    let last_heartbeat = s.node(lost_node).unwrap().last_heartbeat_ms;
    let rule_ms = last_heartbeat + i64::try_from((window + grace).as_millis()).unwrap();
    s.mark_node_down(lost_node, "test").await.unwrap();
    let lost = s.allocation(&alloc.id).unwrap();
    assert_eq!(lost.client_status, AllocClientStatus::Lost);
    assert_eq!(lost.node_last_heartbeat_ms, last_heartbeat);
    let mut freed_at = 0;
    wait_until(
        "claim of the lost alloc freed",
        Duration::from_secs(15),
        || {
            freed_at = berth_structs::now_ms();
            claim_of(&s, "data", &alloc.id).is_none()
        },
    )
    .await;
    assert!(
        freed_at >= rule_ms,
        "the claim was freed at {freed_at}, before last heartbeat + window + grace ({rule_ms})"
    );

    // Then the replacement is placed on the other node, by the timer, and
    // not before the rule either.
    let next = wait_for_live(&s, "db").await;
    assert_eq!(next.node_id, other_node);
    assert!(
        next.create_time_ms >= rule_ms,
        "replacement placed at {}, before {rule_ms}",
        next.create_time_ms
    );
    // The periodic retry is an hour away: a placement within seconds of
    // the rule is the timer's, however loaded the machine.
    assert!(
        next.create_time_ms < rule_ms + 3_000,
        "replacement placed at {}, long after the window ended at {rule_ms}",
        next.create_time_ms
    );
    replacement_claims_data(&ts, &next).await;
}

#[tokio::test]
async fn unknown_volume_ids_sent_to_claim_and_unpublish_leave_no_lock_entries() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let alloc = place_db_on_n1(&ts, false, &[AccessMode::SingleNodeWriter]).await;
    let _client = TestClient::connect(&ts, "n1", ok_handler()).await;
    let mut csi = ts.csi_client().await;
    for i in 0..50 {
        let err = csi
            .claim(claim_request(
                &format!("nope-{i}"),
                &alloc,
                AccessMode::SingleNodeWriter,
            ))
            .await
            .expect_err("unknown volume");
        assert_eq!(err.code(), tonic::Code::NotFound);
        csi.unpublish(pb::UnpublishRequest {
            volume_id: format!("gone-{i}"),
            alloc_id: alloc.id.clone(),
            node_id: "n1".into(),
        })
        .await
        .expect("an unknown claim is released already");
    }
    // A real claim and its release leave nothing either.
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;
    csi.unpublish(pb::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: alloc.id.clone(),
        node_id: "n1".into(),
    })
    .await
    .unwrap();
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
    wait_until("no volume lock entries", Duration::from_secs(10), || {
        s.volume_locks_in_use() == 0
    })
    .await;
}

#[tokio::test]
async fn detach_names_a_node_that_does_not_exist_and_accepts_a_name_or_id_prefix() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let alloc = place_db_on_n1(&ts, false, &[AccessMode::SingleNodeWriter]).await;
    let _client = TestClient::connect(&ts, "n1", ok_handler()).await;
    let mut other = node("7f3c2a10-0000-4000-8000-000000000002");
    other.name = "worker-2".into();
    register(&s, other).await;

    let err = s.detach_volume("data", "nosuchnode").await.unwrap_err();
    assert!(matches!(err, ServerError::NotFound(_)), "{err:?}");
    assert!(err.to_string().contains("\"nosuchnode\""), "{err}");
    assert!(matches!(
        s.detach_volume("nope", "n1").await,
        Err(ServerError::NotFound(_))
    ));

    // A known node (by name or by ID prefix) with no claim of the volume:
    // nothing to release, and not an error.
    for given in ["worker-2", "7f3c2a10"] {
        let r = s.detach_volume("data", given).await.unwrap();
        assert_eq!(r.node_id, "7f3c2a10-0000-4000-8000-000000000002");
        assert_eq!(r.node_name, "worker-2");
        assert!(r.released.is_empty() && r.warnings.is_empty(), "{r:?}");
    }

    // The claim of a live alloc stays refused.
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert!(matches!(
        s.detach_volume("data", "n1").await,
        Err(ServerError::Conflict(_))
    ));
    report(&s, &alloc, AllocClientStatus::Failed).await;
    let r = s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(r.released, vec![alloc.id.clone()]);
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
}

#[tokio::test]
async fn register_refuses_a_plugin_no_node_has_fingerprinted() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    let err = s
        .register_volume(volume(
            "data",
            "nosuchplugin",
            &[AccessMode::SingleNodeWriter],
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, ServerError::BadRequest(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("no CSI plugin named \"nosuchplugin\""),
        "{msg}"
    );
    assert!(msg.contains("run the plugin's job first"), "{msg}");
    assert!(s.volumes().is_empty());

    // Once a node fingerprints it (healthy or not), the volume registers.
    give_plugin(&s, "n1", "nosuchplugin", false, false, false).await;
    s.register_volume(volume(
        "data",
        "nosuchplugin",
        &[AccessMode::SingleNodeWriter],
    ))
    .await
    .unwrap();
}

/// A client whose node detach always fails the same way.
fn failing_detach(message: &'static str) -> CallHandler {
    Arc::new(move |call| match call.call {
        Some(pb::server_call::Call::NodeDetach(_)) => {
            pb::call_reply::Result::Error(pb::CallError {
                code: tonic::Code::Internal as i32,
                message: message.into(),
            })
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    })
}

fn forced_release_events(s: &berth_server::Server) -> Vec<berth_structs::NodeEvent> {
    s.node("n1")
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.message == berth_server::FORCED_RELEASE_EVENT)
        .collect()
}

#[tokio::test]
async fn operator_detach_frees_a_stopped_allocs_claim_when_the_node_cannot_unmount() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (alloc, client, mut csi) =
        claimed_db_on_n1(&ts, false, failing_detach("target is busy")).await;
    report(&s, &alloc, AllocClientStatus::Failed).await;

    let r = s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(r.released, vec![alloc.id.clone()]);
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(
        r.warnings[0].starts_with(&format!(
            "node n1 could not unmount volume \"data\" for alloc {}:",
            alloc.id
        )) && r.warnings[0].contains("target is busy"),
        "{:?}",
        r.warnings
    );
    assert_eq!(claim_of(&s, "data", &alloc.id), None, "the claim is freed");
    assert_eq!(client.call_kinds(), vec!["NodeDetach"], "the node was told");
    let events = forced_release_events(&s);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].subsystem, "Storage");
    assert_eq!(events[0].details["volume_id"], "data");
    assert_eq!(events[0].details["alloc_id"], alloc.id);
    assert_eq!(events[0].details["success"], "false");
    assert_eq!(events[0].details["error"], r.warnings[0]);
    // The replacement is placed and can claim the freed volume.
    let next = wait_for_live(&s, "db").await;
    csi.claim(claim_request("data", &next, AccessMode::SingleNodeWriter))
        .await
        .expect("the freed volume can be claimed again");
}

#[tokio::test]
async fn an_unpublish_that_names_no_node_is_refused_and_keeps_the_claim() {
    // Every Unpublish comes from a node, which proves itself with its
    // secret. Only volume detach and a forced deregister, which first
    // check that the alloc has stopped, release a claim without one.
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (alloc, client, mut csi) =
        claimed_db_on_n1(&ts, false, failing_detach("target is busy")).await;

    let err = csi
        .unpublish(pb::UnpublishRequest {
            volume_id: "data".into(),
            alloc_id: alloc.id.clone(),
            node_id: String::new(),
        })
        .await
        .expect_err("no node named");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("node_id"), "{}", err.message());
    assert!(client.call_kinds().is_empty(), "{:?}", client.call_kinds());
    assert_eq!(
        claim_of(&s, "data", &alloc.id),
        Some((ClaimState::Taken, false)),
        "the claim is untouched"
    );
    assert!(forced_release_events(&s).is_empty());
}

#[tokio::test]
async fn forced_deregister_frees_claims_when_the_node_is_unreachable_or_cannot_unmount() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let alloc = place_db_on_n1(&ts, false, &[AccessMode::SingleNodeWriter]).await;
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    s.stop_job("db").await.unwrap();
    report(&s, &alloc, AllocClientStatus::Complete).await;

    // No call stream: the node is up but cannot be told.
    let r = s.deregister_volume("data", true).await.unwrap();
    assert_eq!(r.released, vec![alloc.id.clone()]);
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(
        r.warnings[0].starts_with("node n1 could not unmount volume \"data\""),
        "{:?}",
        r.warnings
    );
    assert!(matches!(s.volume("data"), Err(ServerError::NotFound(_))));

    // With a client whose unmount fails: the same.
    let client = TestClient::connect(&ts, "n1", failing_detach("device busy")).await;
    register_data_volume(&s).await;
    s.register_job(volume_job("db2", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    let second = live_allocs(&s, "db2").pop().expect("db2 placed");
    csi.claim(claim_request("data", &second, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    report(&s, &second, AllocClientStatus::Failed).await;
    let r = s.deregister_volume("data", true).await.unwrap();
    assert_eq!(r.released, vec![second.id.clone()]);
    assert!(r.warnings[0].contains("device busy"), "{:?}", r.warnings);
    assert!(matches!(s.volume("data"), Err(ServerError::NotFound(_))));
    assert_eq!(client.call_kinds(), vec!["NodeDetach"]);
    assert_eq!(forced_release_events(&s).len(), 2);
}

#[tokio::test]
async fn a_failing_reap_backs_off_and_its_node_keeps_one_event_per_distinct_error() {
    let ts = TestServer::start(|c| c.claim_reap_grace = Duration::from_millis(100)).await;
    let s = ts.server.clone();
    let alloc = place_db_on_n1(&ts, false, &[AccessMode::SingleNodeWriter]).await;
    // The client fails each detach and, as csimanager does, records a
    // Storage event for it; each event is a store write that wakes the
    // watcher.
    let s2 = s.clone();
    let handler: CallHandler = Arc::new(move |call| match &call.call {
        Some(pb::server_call::Call::NodeDetach(d)) => {
            let event = berth_structs::NodeEvent::new("Storage", "Unmount volume")
                .with_detail("volume_id", d.volume_id.as_str())
                .with_detail("alloc_id", d.alloc_id.as_str())
                .with_detail("success", "false")
                .with_detail("error", "NodeUnpublishVolume: Internal: target is busy");
            s2.emit_node_events("n1", vec![event]).unwrap();
            pb::call_reply::Result::Error(pb::CallError {
                code: tonic::Code::Internal as i32,
                message: "target is busy".into(),
            })
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    });
    let (client, _csi) = connect_and_claim_data(&ts, &alloc, handler).await;
    report(&s, &alloc, AllocClientStatus::Failed).await;

    let detaches = || {
        client
            .call_kinds()
            .iter()
            .filter(|k| **k == "NodeDetach")
            .count()
    };
    wait_until("the watcher tries twice", Duration::from_secs(10), || {
        detaches() >= 2
    })
    .await;
    let started = tokio::time::Instant::now();
    let tried = detaches();
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Backoff from 0.5 s, doubling (with jitter): a handful of tries, not
    // one per state change.
    let more = detaches() - tried;
    assert!(
        more <= 4,
        "{more} more tries in {:?}: the retry does not back off",
        started.elapsed()
    );
    assert_eq!(
        claim_of(&s, "data", &alloc.id),
        Some((ClaimState::Taken, true)),
        "kept while the node cannot unmount"
    );
    let unmounts: Vec<_> = s
        .node("n1")
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.message == "Unmount volume")
        .collect();
    assert_eq!(unmounts.len(), 1, "{unmounts:?}");
    assert_eq!(unmounts[0].count as usize, detaches());

    // An operator ends it.
    let r = s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(r.released, vec![alloc.id.clone()]);
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
}

#[tokio::test]
async fn operator_detach_of_a_down_nodes_claim_says_the_node_was_not_told() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    // The window keeps the watcher off the lost alloc's claim for an hour:
    // only the operator ends it.
    let alloc = place_on_data(&s, windowed_db_job(Duration::from_secs(3600))).await;
    let client = TestClient::connect(&ts, "n1", ok_handler()).await;
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    s.mark_node_down("n1", "test").await.unwrap();
    let r = s.detach_volume("data", "n1").await.unwrap();
    assert_eq!(r.released, vec![alloc.id.clone()]);
    assert_eq!(
        r.warnings,
        vec![format!(
            "node n1 is down or gone and was not told to unmount volume \"data\" for alloc {}",
            alloc.id
        )]
    );
    assert_eq!(claim_of(&s, "data", &alloc.id), None);
    assert!(client.call_kinds().is_empty(), "nobody to call");
}

/// Releases a claim of a running alloc as its client does after unmounting
/// (no other writer is busy then) and answers how many writes it took.
async fn writes_of_a_clients_release(controller: bool) -> u64 {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let (alloc, client, mut csi) = claimed_db_on_n1(&ts, controller, ok_handler()).await;
    let before = s.index();
    csi.unpublish(pb::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: alloc.id.clone(),
        node_id: "n1".into(),
    })
    .await
    .unwrap();
    assert_eq!(claim_of(&s, "data", &alloc.id), None, "the claim is freed");
    let kinds = client.call_kinds();
    assert!(!kinds.contains(&"NodeDetach"), "{kinds:?}");
    assert_eq!(
        kinds.contains(&"ControllerUnpublish"),
        controller,
        "{kinds:?}"
    );
    s.index() - before
}

#[tokio::test]
async fn a_clients_release_frees_the_claim_in_one_write_or_two_around_a_controller_detach() {
    assert_eq!(
        writes_of_a_clients_release(false).await,
        1,
        "nothing to detach: the claim is freed in one write"
    );
    assert_eq!(
        writes_of_a_clients_release(true).await,
        2,
        "node-detached before ControllerUnpublish, then the free"
    );
}
