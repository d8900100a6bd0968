//! CSI topology on the servers: the controller chosen to create a volume
//! with a required topology, what `CreateVolume` carries and what is kept
//! of its answer, a registered volume's topology, placement only where a
//! volume is reachable, and the reasons shown when it is nowhere.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_proto::berth::v1 as pb;
use berth_structs::{AccessMode, AttachmentMode, CsiTopology, CsiTopologyRequest, VolumeRequest};
use support::*;

fn zone(z: &str) -> CsiTopology {
    CsiTopology::new(BTreeMap::from([("zone".to_string(), z.to_string())]))
}

/// Node `id` running a healthy monolith "hp" that can create volumes, its
/// node plugin in `zone`.
async fn register_in_zone(server: &berth_server::Server, id: &str, z: &str) {
    register(server, node(id)).await;
    let mut info = plugin_info("hp", true, false);
    info.accessible_topology = Some(zone(z));
    server
        .update_node_plugins(
            id,
            BTreeMap::from([("hp".to_string(), info.clone())]),
            BTreeMap::from([("hp".to_string(), info)]),
        )
        .await
        .expect("update plugins");
}

fn requires(v: &mut berth_structs::CsiVolume, zones: &[&str]) {
    v.requested_topologies = CsiTopologyRequest {
        required: zones.iter().map(|z| zone(z)).collect(),
        preferred: Vec::new(),
    };
}

fn create_calls(c: &TestClient) -> Vec<pb::CreateVolume> {
    c.calls
        .lock()
        .unwrap()
        .iter()
        .filter_map(|call| match &call.call {
            Some(pb::server_call::Call::CreateVolume(cv)) => Some(cv.clone()),
            _ => None,
        })
        .collect()
}

fn zones_of(topologies: &[pb::Topology]) -> Vec<String> {
    topologies
        .iter()
        .map(|t| t.segments.get("zone").cloned().unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn a_volume_is_created_by_a_controller_in_its_topology_and_used_only_there() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register_in_zone(s, "n1", "a").await;
    register_in_zone(s, "n2", "b").await;
    let c1 = TestClient::connect(&ts, "n1", ok_handler()).await;
    let c2 = TestClient::connect(&ts, "n2", ok_handler()).await;

    // Required zone b: the controller on n2 creates it, asked for zone b
    // as requisite and (no preferred given) as preferred.
    let mut v = volume("vb", "hp", &[AccessMode::MultiNodeMultiWriter]);
    requires(&mut v, &["b"]);
    let created = s.create_volume(v).await.expect("create");
    assert!(create_calls(&c1).is_empty(), "n1 is not in zone b");
    let calls = create_calls(&c2);
    assert_eq!(calls.len(), 1);
    assert_eq!(zones_of(&calls[0].requisite), vec!["b"]);
    assert_eq!(zones_of(&calls[0].preferred), vec!["b"]);
    assert_eq!(created.accessible_topology, vec![zone("b")]);
    assert_eq!(created.requested_topologies.required, vec![zone("b")]);

    // Its allocs go to n2 only, though the scheduler spreads a job's
    // allocs over the nodes.
    let mut web = volume_job("web", "vb", AccessMode::MultiNodeMultiWriter);
    web.task_groups[0].count = 4;
    let resp = s.register_job(web).await.unwrap();
    assert!(resp.placement_failures.is_empty(), "{resp:?}");
    let placed = live_allocs(s, "web");
    assert_eq!(placed.len(), 4);
    assert!(placed.iter().all(|a| a.node_id == "n2"), "{placed:?}");

    // A registered volume is reachable from its required topology.
    let mut va = volume("va", "hp", &[AccessMode::MultiNodeMultiWriter]);
    requires(&mut va, &["a"]);
    let registered = s.register_volume(va).await.expect("register");
    assert_eq!(registered.accessible_topology, vec![zone("a")]);
    s.register_job(volume_job("on-a", "va", AccessMode::MultiNodeMultiWriter))
        .await
        .unwrap();
    assert_eq!(wait_for_live(s, "on-a").await.node_id, "n1");

    // A group needing both is placed nowhere; the reason names each
    // volume's topology.
    let mut both = volume_job("both", "va", AccessMode::MultiNodeMultiWriter);
    both.task_groups[0].volumes.insert(
        "other".into(),
        VolumeRequest {
            name: "other".into(),
            volume_type: "csi".into(),
            source: "vb".into(),
            access_mode: Some(AccessMode::MultiNodeMultiWriter),
            attachment_mode: Some(AttachmentMode::FileSystem),
            ..Default::default()
        },
    );
    let resp = s.register_job(both).await.unwrap();
    assert!(live_allocs(s, "both").is_empty());
    let failures = resp.placement_failures.join("\n");
    assert!(
        failures.contains("node n1: volume \"vb\" is reachable only from topology {zone=b}"),
        "{failures}"
    );
    assert!(
        failures.contains("node n2: volume \"va\" is reachable only from topology {zone=a}"),
        "{failures}"
    );
    assert_eq!(s.job_placement_failures("both"), resp.placement_failures);
}

#[tokio::test]
async fn a_create_refused_for_its_topology_says_so() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register_in_zone(s, "n1", "a").await;
    let refuse: CallHandler = Arc::new(|_| {
        pb::call_reply::Result::Error(pb::CallError {
            code: tonic::Code::ResourceExhausted as i32,
            message: "requisite topology cannot be met".into(),
        })
    });
    let _c1 = TestClient::connect(&ts, "n1", refuse).await;
    let mut v = volume("vz", "hp", &[AccessMode::SingleNodeWriter]);
    requires(&mut v, &["z"]);
    let e = s.create_volume(v).await.expect_err("refused");
    let msg = e.to_string();
    assert!(
        msg.contains("cannot create volume \"vz\" in the requested topology (required {zone=z}")
            && msg.contains("requisite topology cannot be met"),
        "{msg}"
    );
    assert!(s.volume("vz").is_err(), "nothing stored");
}

#[tokio::test]
async fn a_new_claim_from_outside_the_topology_is_refused_and_schedulable_follows_it() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register_in_zone(s, "n1", "a").await;
    register_in_zone(s, "n2", "b").await;
    // Placed while the volume has no topology; then registered again as
    // reachable only from the other node's zone (no claim yet, so that is
    // allowed).
    let v = volume("vx", "hp", &[AccessMode::SingleNodeWriter]);
    s.register_volume(v.clone()).await.unwrap();
    s.register_job(volume_job("x", "vx", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    let alloc = wait_for_live(s, "x").await;
    let mut elsewhere = v.clone();
    requires(
        &mut elsewhere,
        &[if alloc.node_id == "n1" { "b" } else { "a" }],
    );
    s.register_volume(elsewhere).await.unwrap();
    assert!(
        s.volume("vx").unwrap().schedulable,
        "the other node reaches it"
    );

    let mut csi = ts.csi_client().await;
    let err = csi
        .claim(claim_request("vx", &alloc, AccessMode::SingleNodeWriter))
        .await
        .expect_err("claim from outside the topology");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message()
            .contains("is reachable only from topology {zone="),
        "{}",
        err.message()
    );

    // Reachable from no node: not schedulable.
    let mut nowhere = v;
    requires(&mut nowhere, &["z"]);
    s.register_volume(nowhere).await.unwrap();
    assert!(!s.volume("vx").unwrap().schedulable);
}
