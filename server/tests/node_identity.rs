//! Node identity over real gRPC: a node registers with a secret, and every
//! node RPC that presents another secret (or none) is refused and changes
//! nothing; a node acts on volume claims only for its own allocs.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_proto::berth::v1 as pb;
use berth_server::{Server, ServerError};
use berth_structs::{AccessMode, AllocClientStatus, ClaimState, NodeSecret};
use support::*;
use tokio_stream::wrappers::ReceiverStream;

const GOOD: &str = "good-secret-of-n1-0123456789abcdef";
const FORGED: &str = "forged-secret-0123456789abcdef0123";

fn register_request(node: &berth_structs::Node) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node_json: serde_json::to_vec(node).unwrap(),
        ..Default::default()
    }
}

/// Registers `node` over a connection of its own presenting `secret`.
async fn register_with(
    ts: &TestServer,
    secret: Option<&str>,
    node: &berth_structs::Node,
) -> Result<tonic::Response<pb::RegisterResponse>, tonic::Status> {
    ts.node_client_with(secret)
        .await
        .register(register_request(node))
        .await
}

/// A heartbeat of `node_id` over a connection of its own presenting
/// `secret`.
async fn heartbeat_with(
    ts: &TestServer,
    secret: Option<&str>,
    node_id: &str,
) -> Result<tonic::Response<pb::HeartbeatResponse>, tonic::Status> {
    ts.node_client_with(secret)
        .await
        .heartbeat(pb::HeartbeatRequest {
            node_id: node_id.into(),
        })
        .await
}

/// One storage event of `node_id` saying `message`.
fn events_request(node_id: &str, message: &str) -> pb::EmitEventsRequest {
    pb::EmitEventsRequest {
        node_id: node_id.into(),
        events: vec![pb::NodeEvent {
            subsystem: "Storage".into(),
            message: message.into(),
            details: Default::default(),
            timestamp_ms: 1,
        }],
    }
}

/// The refusal a forged call gets: PermissionDenied, naming the node (or,
/// for a call with no secret, refused from its headers before the body
/// that names the node is read, saying so) and neither secret.
fn assert_refused(what: &str, err: tonic::Status, node_id: &str) {
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "{what}: {}",
        err.message()
    );
    let msg = err.message();
    assert!(
        msg.contains(node_id) || msg.contains("the request carries no node secret"),
        "{what}: {msg}"
    );
    assert!(
        !msg.contains(GOOD) && !msg.contains(FORGED) && !msg.contains(TEST_SECRET),
        "{what}: {msg}"
    );
}

#[tokio::test]
async fn register_of_a_known_node_with_another_secret_is_refused_and_changes_nothing() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut owner = ts.node_client_with(Some(GOOD)).await;
    owner.register(register_request(&node("n1"))).await.unwrap();
    let before = s.node("n1").unwrap();
    let index = s.index();

    let mut impostor = node("n1");
    impostor.name = "impostor".into();
    for secret in [Some(FORGED), None] {
        let err = register_with(&ts, secret, &impostor)
            .await
            .expect_err("a registration with another secret");
        assert_refused("register", err, "n1");
    }
    assert_eq!(s.index(), index, "a refused registration writes nothing");
    assert_eq!(s.node("n1").unwrap().name, before.name);

    // The owner registers again, with its secret.
    let mut renamed = node("n1");
    renamed.name = "renamed".into();
    let reg = owner.register(register_request(&renamed)).await.unwrap();
    assert!(reg.into_inner().index > index);
    assert_eq!(s.node("n1").unwrap().name, "renamed");
}

#[tokio::test]
async fn every_node_rpc_with_a_wrong_secret_is_refused_and_changes_nothing() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    // n1 is a real client: registered with TEST_SECRET, its call stream
    // open, its alloc running and holding nothing yet. n2 has no stream.
    register(&s, node("n1")).await;
    register(&s, node("n2")).await;
    let _client = TestClient::connect(&ts, "n1", ok_handler()).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    let alloc = place_on_data(&s, volume_job("db", "data", AccessMode::SingleNodeWriter)).await;
    assert_eq!(alloc.node_id, "n1");
    report(&s, &alloc, AllocClientStatus::Running).await;

    let index = s.index();
    let n1 = s.node("n1").unwrap();
    for secret in [Some(FORGED), None] {
        let mut nc = ts.node_client_with(secret).await;
        let mut csi = ts.csi_client_with(secret).await;

        let err = nc
            .heartbeat(pb::HeartbeatRequest {
                node_id: "n1".into(),
            })
            .await
            .unwrap_err();
        assert_refused("heartbeat", err, "n1");

        let err = nc
            .watch_allocations(pb::WatchAllocationsRequest {
                node_id: "n1".into(),
                deltas: false,
            })
            .await
            .unwrap_err();
        assert_refused("watch", err, "n1");

        let err = nc
            .update_allocations(status_update("n1", &alloc.id, "failed", "forged"))
            .await
            .unwrap_err();
        assert_refused("update allocs", err, "n1");

        let err = nc
            .emit_events(events_request("n1", "forged"))
            .await
            .unwrap_err();
        assert_refused("events", err, "n1");

        let err = nc
            .update_plugins(pb::UpdatePluginsRequest {
                node_id: "n1".into(),
                plugins: vec![],
            })
            .await
            .unwrap_err();
        assert_refused("plugins", err, "n1");

        let (out, rx) = tokio::sync::mpsc::channel(1);
        out.send(hello("n2")).await.unwrap();
        let err = nc
            .open_call_stream(ReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert_refused("call stream", err, "n2");
        assert!(!s.node_connected("n2"), "a forged stream is not attached");

        let err = csi
            .claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
            .await
            .unwrap_err();
        assert_refused("claim", err, "n1");
        assert_eq!(s.index(), index, "forged calls write nothing");
        assert!(s.volume("data").unwrap().write_claims.is_empty());
    }
    assert_eq!(s.node("n1").unwrap(), n1);
    assert_eq!(
        s.allocation(&alloc.id).unwrap().client_status,
        AllocClientStatus::Running
    );

    // The real client claims; a forged Unpublish does not release it.
    ts.csi_client()
        .await
        .claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    let index = s.index();
    for secret in [Some(FORGED), None] {
        let err = ts
            .csi_client_with(secret)
            .await
            .unpublish(pb::UnpublishRequest {
                volume_id: "data".into(),
                alloc_id: alloc.id.clone(),
                node_id: "n1".into(),
            })
            .await
            .unwrap_err();
        assert_refused("unpublish", err, "n1");
    }
    assert_eq!(s.index(), index);
    let claim = s.volume("data").unwrap().write_claims[&alloc.id].clone();
    assert_eq!((claim.state, claim.releasing), (ClaimState::Taken, false));

    // With the right secret, all of it works.
    let mut nc = ts.node_client().await;
    nc.heartbeat(pb::HeartbeatRequest {
        node_id: "n1".into(),
    })
    .await
    .expect("heartbeat with the node's secret");
    nc.emit_events(events_request("n1", "real"))
        .await
        .expect("events with the node's secret");
    assert!(s
        .node("n1")
        .unwrap()
        .events
        .iter()
        .any(|e| e.message == "real"));
    assert!(!s
        .node("n1")
        .unwrap()
        .events
        .iter()
        .any(|e| e.message == "forged"));
}

#[tokio::test]
async fn a_node_claims_and_releases_volumes_only_for_its_own_allocs() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    let n2_secret = "secret-of-n2-0123456789abcdef0123";
    s.register_node_with_secret(node("n2"), &NodeSecret::parse(n2_secret).unwrap())
        .await
        .unwrap();
    let _client = TestClient::connect(&ts, "n1", ok_handler()).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    give_plugin(&s, "n2", "hostpath", true, false, false).await;
    let alloc = place_on_data(&s, volume_job("db", "data", AccessMode::SingleNodeWriter)).await;
    let (owner, other) = if alloc.node_id == "n1" {
        ("n1", "n2")
    } else {
        ("n2", "n1")
    };
    let secret_of = |n: &str| if n == "n1" { TEST_SECRET } else { n2_secret };

    // The other node, with its own secret, names itself and the alloc.
    let mut stolen = claim_request("data", &alloc, AccessMode::SingleNodeWriter);
    stolen.node_id = other.into();
    let mut other_csi = ts.csi_client_with(Some(secret_of(other))).await;
    let err = other_csi.claim(stolen).await.unwrap_err();
    assert_refused("claim of another node's alloc", err, other);
    assert!(s.volume("data").unwrap().write_claims.is_empty());

    // Connect the owner's call stream when the owner is n2 too, so the
    // claim it makes can be answered.
    let _owner_stream = if owner == "n2" {
        Some(connect_with(&ts, "n2", n2_secret).await)
    } else {
        None
    };
    ts.csi_client_with(Some(secret_of(owner)))
        .await
        .claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .expect("the owner claims");
    let index = s.index();
    let err = other_csi
        .unpublish(pb::UnpublishRequest {
            volume_id: "data".into(),
            alloc_id: alloc.id.clone(),
            node_id: other.into(),
        })
        .await
        .unwrap_err();
    assert_refused("release of another node's claim", err, other);
    assert_eq!(s.index(), index);
    let claim = s.volume("data").unwrap().write_claims[&alloc.id].clone();
    assert_eq!((claim.state, claim.releasing), (ClaimState::Taken, false));
}

/// The claim request of `alloc` for `volume_id` in `mode` with `access`.
fn claim_as(
    volume_id: &str,
    alloc: &berth_structs::Allocation,
    mode: &str,
    access: AccessMode,
) -> pb::ClaimRequest {
    let mut r = claim_request(volume_id, alloc, access);
    r.mode = mode.into();
    r
}

/// The review's attack and its neighbours: a node claims a volume only for
/// an alloc whose group asks for it, in the modes the group asks for; a
/// refusal returns no secret and takes no claim.
#[tokio::test]
async fn a_node_claims_only_the_volumes_its_allocs_groups_ask_for() {
    use berth_structs::{JobType, VolumeRequest};
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    let _client = TestClient::connect(&ts, "n1", ok_handler()).await;
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    let writer = AccessMode::SingleNodeWriter;
    let shared = AccessMode::MultiNodeMultiWriter;
    for (id, caps) in [
        ("payroll-db", vec![writer]),
        ("shared", vec![shared, AccessMode::MultiNodeReader]),
    ] {
        s.register_volume(volume(id, "hostpath", &caps))
            .await
            .unwrap();
    }
    let mut csi = ts.csi_client().await;
    let refused = |what: &str, err: tonic::Status, needle: &str| {
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{what}: {err:?}");
        assert!(err.message().contains(needle), "{what}: {}", err.message());
        assert!(
            !err.message().contains("s3cret"),
            "{what}: {}",
            err.message()
        );
    };

    // A plain job's alloc, which mounts nothing, asks for the payroll
    // volume with a write claim.
    s.register_job(job("plain", JobType::Service, 1))
        .await
        .unwrap();
    let plain = live_allocs(&s, "plain").pop().unwrap();
    let err = csi
        .claim(claim_as("payroll-db", &plain, "write", writer))
        .await
        .unwrap_err();
    refused(
        "an alloc that mounts nothing",
        err,
        "asks for no CSI volume",
    );
    assert!(s.volume("payroll-db").unwrap().write_claims.is_empty());
    // The volume's own job still gets it.
    let payroll = place_on_data_like(&s, volume_job("payroll", "payroll-db", writer)).await;
    csi.claim(claim_request("payroll-db", &payroll, writer))
        .await
        .expect("the payroll job claims its volume");

    // A group that mounts "shared" read-only asks for a write claim, then
    // for the read claim it is placed for.
    let mut reader = volume_job("reader", "shared", shared);
    reader.task_groups[0]
        .volumes
        .get_mut("data")
        .unwrap()
        .read_only = true;
    reader.task_groups[0].tasks[0].volume_mounts[0].read_only = true;
    let reader = place_on_data_like(&s, reader).await;
    let err = csi
        .claim(claim_as("shared", &reader, "write", shared))
        .await
        .unwrap_err();
    refused(
        "a write claim of a read-only group",
        err,
        "not a write claim",
    );
    assert!(s.volume("shared").unwrap().write_claims.is_empty());
    // ...or with another access mode than its group's.
    let err = csi
        .claim(claim_as(
            "shared",
            &reader,
            "read",
            AccessMode::MultiNodeReader,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    csi.claim(claim_as("shared", &reader, "read", shared))
        .await
        .expect("the read claim the group asks for");

    // Two groups of one job: only the group that asks for "shared" claims
    // it.
    let mut two = volume_job("two", "shared", shared);
    let mut other = two.task_groups[0].clone();
    other.name = "other".into();
    other.volumes = [(
        "scratch".to_string(),
        VolumeRequest {
            name: "scratch".into(),
            volume_type: "csi".into(),
            source: "payroll-db".into(),
            access_mode: Some(writer),
            attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
            read_only: true,
            ..Default::default()
        },
    )]
    .into();
    other.tasks[0].volume_mounts[0].volume = "scratch".into();
    other.tasks[0].volume_mounts[0].read_only = true;
    two.task_groups.push(other);
    s.register_job(two).await.unwrap();
    let other_alloc = live_allocs(&s, "two")
        .into_iter()
        .find(|a| a.task_group == "other")
        .unwrap();
    let err = csi
        .claim(claim_as("shared", &other_alloc, "write", shared))
        .await
        .unwrap_err();
    refused(
        "a volume of another group",
        err,
        "asks for no CSI volume \"shared\"",
    );
}

/// Registers `job` and returns its one live alloc.
async fn place_on_data_like(s: &Server, job: berth_structs::Job) -> berth_structs::Allocation {
    let id = job.id.clone();
    s.register_job(job).await.unwrap();
    live_allocs(s, &id).pop().unwrap()
}

/// A bare call stream of `node_id` presenting `secret`, answering nothing.
async fn connect_with(
    ts: &TestServer,
    node_id: &str,
    secret: &str,
) -> (
    tokio::sync::mpsc::Sender<pb::ClientMessage>,
    tonic::Streaming<pb::ServerCall>,
) {
    let (out, rx) = tokio::sync::mpsc::channel(4);
    out.send(hello(node_id)).await.unwrap();
    let inbound = ts
        .node_client_with(Some(secret))
        .await
        .open_call_stream(ReceiverStream::new(rx))
        .await
        .expect("open call stream")
        .into_inner();
    (out, inbound)
}

#[tokio::test]
async fn two_clients_with_the_same_name_are_two_nodes() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut a = node("id-a");
    a.name = "web".into();
    let mut b = node("id-b");
    b.name = "web".into();
    register_with(&ts, Some(GOOD), &a).await.unwrap();
    register_with(&ts, Some(FORGED), &b)
        .await
        .expect("a second node with the same name registers");
    let mut ids: Vec<String> = s.nodes().into_iter().map(|n| n.id).collect();
    ids.sort();
    assert_eq!(ids, ["id-a", "id-b"]);
    // Each heartbeats with its own secret only.
    let err = heartbeat_with(&ts, Some(GOOD), "id-b").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    heartbeat_with(&ts, Some(FORGED), "id-b")
        .await
        .expect("id-b with its own secret");
}

#[tokio::test]
async fn the_node_secret_survives_a_server_restart() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let good = NodeSecret::parse(GOOD).unwrap();
    let forged = NodeSecret::parse(FORGED).unwrap();
    {
        let s = Server::open(test_config(dir.path())).unwrap();
        s.register_node_with_secret(node("n1"), &good)
            .await
            .unwrap();
    }
    let s = Server::open(test_config(dir.path())).unwrap();
    let err = s
        .register_node_with_secret(node("n1"), &forged)
        .await
        .unwrap_err();
    assert!(matches!(err, ServerError::Forbidden(_)), "{err:?}");
    s.register_node_with_secret(node("n1"), &good)
        .await
        .expect("the node's own secret still works");
}

#[tokio::test]
async fn a_purged_node_registers_again_with_the_secret_it_brings() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register_with(&ts, Some(GOOD), &node("n1")).await.unwrap();
    s.purge_node("n1", true).await.expect("purge");
    // Unknown again: whoever registers it first sets its secret.
    register_with(&ts, Some(FORGED), &node("n1"))
        .await
        .expect("a purged node registers with a new secret");
    let err = heartbeat_with(&ts, Some(GOOD), "n1").await.unwrap_err();
    assert_refused("the old secret after purge", err, "n1");
}

/// Servers upgraded under running clients know their nodes but hold no
/// secret for them: a call for such a node is answered NotFound, so that
/// its client registers again (recording the secret it brings) instead of
/// being refused until the node is marked down.
#[tokio::test]
async fn a_node_known_from_before_node_secrets_is_told_to_register_again() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    // Registered in-process: no secret on record, as after an upgrade.
    s.register_node(node("old")).await.expect("register");
    let err = heartbeat_with(&ts, Some(GOOD), "old").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains("register again"), "{err:?}");
    register_with(&ts, Some(GOOD), &node("old"))
        .await
        .expect("the node registers with the secret it brings");
    heartbeat_with(&ts, Some(GOOD), "old")
        .await
        .expect("its heartbeats pass from then on");
    let err = heartbeat_with(&ts, Some(FORGED), "old").await.unwrap_err();
    assert_refused("another secret once one is on record", err, "old");
}

/// A watch opened by a node ends once that node is purged: a client
/// cut off by the operator (or one that registers the ID anew) gets no
/// more of its allocs through a stream authenticated before.
#[tokio::test]
async fn the_alloc_watch_of_a_purged_node_ends() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut nc = ts.node_client_with(Some(GOOD)).await;
    nc.register(register_request(&node("n1"))).await.unwrap();
    let mut watch = open_watch(&mut nc, "n1").await;
    watch
        .message()
        .await
        .expect("the first update")
        .expect("open");
    s.purge_node("n1", true).await.expect("purge");
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        }
    })
    .await
    .expect("the watch ends within 5s of the purge");
    let err = end.expect("it ends with an error saying why");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}

/// One peer address registers at most its burst at once: the next call is
/// refused before anything of it is looked at (its node is not written)
/// with `ResourceExhausted` that says the limit and the wait, and a call
/// is allowed again once the bucket refilled.
#[tokio::test]
async fn registrations_of_one_peer_are_rate_limited() {
    let ts = TestServer::start(|c| {
        c.register_rate = Some(berth_server::RegisterRate {
            rate: 2.0,
            burst: 3,
        })
    })
    .await;
    let n1 = node("n1");
    for _ in 0..3 {
        register_with(&ts, Some(GOOD), &n1)
            .await
            .expect("a registration within the burst");
    }
    let stranger = node("stranger");
    let err = register_with(&ts, Some(FORGED), &stranger)
        .await
        .expect_err("past the burst");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    let msg = err.message();
    assert!(
        msg.contains("127.0.0.1")
            && msg.contains("node_register_burst_per_client")
            && msg.contains("retry in"),
        "{msg}"
    );
    assert!(
        ts.server.node("stranger").is_err(),
        "a refused registration wrote its node"
    );
    // Two per second: within a second (polled) a registration is allowed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match register_with(&ts, Some(GOOD), &n1).await {
            Ok(_) => break,
            Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the bucket did not refill: {e:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}
