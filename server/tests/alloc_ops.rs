//! An operator's actions on one alloc, on a real server: `alloc stop`
//! marks it stopped and places its replacement (service and batch, as
//! Nomad does); the node-local routes of an alloc reach its node over the
//! call stream (`ClientHttp`), and a node without one is unavailable.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use berth_proto::berth::v1 as pb;
use berth_server::ALLOC_STOP_DESCRIPTION;
use berth_structs::{AccessMode, AllocClientStatus, AllocDesiredStatus, JobType};
use support::*;

async fn stop_replaces(job_type: JobType) {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    s.register_job(job("j", job_type, 1))
        .await
        .expect("register");
    let first = wait_for_live(s, "j").await;
    report(s, &first, AllocClientStatus::Running).await;

    let answer = s.stop_alloc(&first.id[..6]).await.expect("alloc stop");
    assert_eq!(answer.alloc_id, first.id);
    let stopped = s.allocation(&first.id).expect("the alloc");
    assert_eq!(stopped.desired_status, AllocDesiredStatus::Stop);
    assert_eq!(stopped.desired_description, ALLOC_STOP_DESCRIPTION);
    let replacement = answer.replacement.expect("a replacement");
    let next = s.allocation(&replacement).expect("the replacement");
    assert_ne!(next.id, first.id);
    assert_eq!(next.index, first.index);
    assert_eq!(next.desired_status, AllocDesiredStatus::Run);
    assert_eq!(answer.index, s.index());

    // Stopping it again changes nothing and places nothing.
    let again = s.stop_alloc(&first.id).await.expect("alloc stop again");
    assert_eq!(again.replacement, None);
    assert_eq!(again.index, answer.index);
    assert_eq!(live_allocs(s, "j").len(), 1);
}

#[tokio::test]
async fn stopping_a_service_alloc_places_its_replacement() {
    stop_replaces(JobType::Service).await;
}

#[tokio::test]
async fn stopping_a_running_batch_alloc_places_its_replacement() {
    stop_replaces(JobType::Batch).await;
}

/// An alloc whose task is already done has nothing to stop: stopping it
/// changes nothing and, for a batch job, does not run its work again.
#[tokio::test]
async fn stopping_a_finished_alloc_changes_nothing() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    s.register_job(job("b", JobType::Batch, 1))
        .await
        .expect("register");
    let done = wait_for_live(s, "b").await;
    report(s, &done, AllocClientStatus::Complete).await;
    let before = s.index();

    let answer = s.stop_alloc(&done.id).await.expect("alloc stop");
    assert_eq!(answer.replacement, None);
    assert_eq!(answer.index, before, "nothing written");
    let after = s.allocation(&done.id).expect("the alloc");
    assert_eq!(after.desired_status, AllocDesiredStatus::Run);
    assert_eq!(
        s.job_allocations("b").expect("allocs").len(),
        1,
        "the batch job's work is not run again"
    );
}

/// The replacement of a stopped single-node writer waits for the stopped
/// alloc's write claim to be freed: the two never hold the volume at once.
#[tokio::test]
async fn a_stopped_writers_replacement_waits_for_its_claim_to_be_freed() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", true, false, false).await;
    register_data_volume(s).await;
    s.register_job(volume_job("db", "data", AccessMode::SingleNodeWriter))
        .await
        .expect("register");
    let first = wait_for_live(s, "db").await;
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &first, AccessMode::SingleNodeWriter))
        .await
        .expect("claim");
    report(s, &first, AllocClientStatus::Running).await;

    // The replacement is placed at once, but held back from its node
    // while the stopped alloc's claim holds.
    let answer = s.stop_alloc(&first.id).await.expect("alloc stop");
    let next_id = answer.replacement.expect("a replacement placed");
    let waiting = |s: &berth_server::Server| {
        s.allocation(&next_id)
            .expect("replacement")
            .waits_for_claims()
    };
    assert!(waiting(s));
    assert_eq!(
        s.allocation(&next_id).unwrap().waiting_for_claims_of,
        vec![first.id.clone()]
    );
    assert!(s.job_placement_failures("db").is_empty());
    assert!(
        s.allocations_on_node("n1").iter().any(|a| a.id == next_id),
        "placed on n1"
    );

    // The client stops it; the claim still holds until it is freed.
    report(s, &first, AllocClientStatus::Complete).await;
    assert!(waiting(s), "sent to its node before the claim was freed");

    csi.unpublish(pb::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: first.id.clone(),
        node_id: first.node_id.clone(),
    })
    .await
    .expect("unpublish");
    assert!(s.volume("data").expect("volume").write_claims.is_empty());
    assert!(!waiting(s), "released once the claim is freed");
    let next = live_allocs(s, "db");
    assert_eq!(next.len(), 1);
    assert_eq!(
        (next[0].id.as_str(), next[0].index),
        (next_id.as_str(), first.index)
    );
}

#[tokio::test]
async fn an_unknown_alloc_cannot_be_stopped() {
    let ts = TestServer::start(|_| {}).await;
    let e = ts.server.stop_alloc("nope").await.unwrap_err();
    assert_eq!(e.http_status(), 404, "{e}");
    assert!(e.to_string().contains("\"nope\""), "{e}");
}

#[tokio::test]
async fn a_client_http_request_reaches_the_node_and_its_answer_comes_back_as_is() {
    let ts = TestServer::start(|_| {}).await;
    register(&ts.server, node("n1")).await;
    let handler: CallHandler = Arc::new(|call| match &call.call {
        Some(pb::server_call::Call::ClientHttp(h)) => {
            pb::call_reply::Result::ClientHttp(pb::ClientHttpReply {
                status: 200,
                headers: vec![pb::HttpHeader {
                    name: "x-berth-log-offset".into(),
                    value: b"42".to_vec(),
                }],
                // The request as the node saw it, in a raw body.
                body: format!("{} {} {}", h.method, h.path_and_query, h.content_type)
                    .into_bytes()
                    .into_iter()
                    .chain(h.body.iter().copied())
                    .chain([0u8, 255])
                    .collect(),
            })
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    });
    let client = TestClient::connect(&ts, "n1", handler).await;
    let reply = ts
        .server
        .client_http(
            "n1",
            pb::ClientHttp {
                method: "POST".into(),
                path_and_query: "/v1/client/allocation/a/signal?x=1".into(),
                content_type: "application/json".into(),
                body: b"{}".to_vec(),
            },
            Duration::from_secs(5),
        )
        .await
        .expect("the node answers");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers[0].name, "x-berth-log-offset");
    let mut want = b"POST /v1/client/allocation/a/signal?x=1 application/json{}".to_vec();
    want.extend([0u8, 255]);
    assert_eq!(reply.body, want);
    assert_eq!(client.call_kinds(), vec!["ClientHttp"]);

    // Gone: the request is refused at once, naming the node.
    client.disconnect();
    wait_until("the call stream dropped", Duration::from_secs(5), || {
        !ts.server.node_connected("n1")
    })
    .await;
    let e = ts
        .server
        .client_http("n1", pb::ClientHttp::default(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(e.http_status(), 503, "{e}");
    assert_eq!(e.to_string(), "node n1 is not connected");
}
