//! IDs by exact ID or unique prefix, for every kind people name on the
//! command line: jobs, allocs, nodes, volumes, plugins. An exact ID wins
//! over a longer one it is a prefix of; an ambiguous prefix lists the
//! matches.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_server::ServerError;
use berth_structs::{AccessMode, JobType};
use support::*;

fn bad_request(r: Result<impl std::fmt::Debug, ServerError>) -> String {
    match r {
        Err(e @ ServerError::BadRequest(_)) => e.to_string(),
        other => panic!("expected an ambiguous prefix, got {other:?}"),
    }
}

fn not_found(r: Result<impl std::fmt::Debug, ServerError>) {
    assert!(matches!(r, Err(ServerError::NotFound(_))), "{r:?}");
}

#[tokio::test]
async fn jobs_by_id_or_prefix() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    for id in ["amb", "amb-one", "amb-two", "db"] {
        s.register_job(job(id, JobType::Service, 1)).await.unwrap();
    }
    assert_eq!(s.job("amb").unwrap().id, "amb", "the exact ID wins");
    assert_eq!(s.job("d").unwrap().id, "db");
    assert_eq!(s.job("amb-o").unwrap().id, "amb-one");
    let allocs = s.job_allocations("amb-t").unwrap();
    assert!(
        !allocs.is_empty() && allocs.iter().all(|a| a.job_id == "amb-two"),
        "{allocs:?}"
    );
    let e = bad_request(s.job("amb-"));
    assert!(
        e.contains("job ID prefix \"amb-\" matches 2 jobs: \"amb-one\", \"amb-two\""),
        "{e}"
    );
    bad_request(s.job_allocations("amb-"));
    not_found(s.job("zzz"));
    not_found(s.job(""));
}

#[tokio::test]
async fn allocs_by_id_or_prefix() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    // 17 allocs: two of them share at least their first hex digit.
    s.register_job(job("many", JobType::Batch, 17))
        .await
        .unwrap();
    let mut ids: Vec<String> = s
        .job_allocations("many")
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    ids.sort();
    assert_eq!(ids.len(), 17);
    let one = &ids[0];
    assert_eq!(s.allocation(one).unwrap().id, *one);
    let unique = (1..=one.len())
        .map(|n| &one[..n])
        .find(|p| ids.iter().filter(|i| i.starts_with(p)).count() == 1)
        .unwrap();
    assert_eq!(s.allocation(unique).unwrap().id, *one);
    let shared = ids
        .windows(2)
        .find(|w| w[0][..1] == w[1][..1])
        .map(|w| &w[0][..1])
        .unwrap();
    let e = bad_request(s.allocation(shared));
    assert!(
        e.contains(&format!("alloc ID prefix {shared:?} matches")),
        "{e}"
    );
    assert!(e.contains(" allocs: "), "{e}");
    not_found(s.allocation("not-an-alloc"));
}

#[tokio::test]
async fn nodes_by_id_name_or_prefix() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    for id in ["node-a1", "node-a2", "node-b"] {
        register(s, node(id)).await;
    }
    assert_eq!(s.node("node-b").unwrap().id, "node-b");
    assert_eq!(s.node("node-a2").unwrap().id, "node-a2");
    assert_eq!(s.node("node-b").unwrap().id, "node-b");
    let e = bad_request(s.node("node-a"));
    assert!(
        e.contains("node ID prefix \"node-a\" matches 2 nodes: \"node-a1\" ("),
        "{e}"
    );
    not_found(s.node("other"));
}

#[tokio::test]
async fn volumes_and_plugins_by_id_or_prefix() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    // One fingerprint with every plugin: each replaces the node's last.
    let plugins = ["hostpath", "hostpath-b", "nfs"]
        .map(|p| (p.to_string(), plugin_info(p, true, false)))
        .into();
    s.update_node_plugins("n1", plugins, Default::default())
        .await
        .unwrap();
    for (vol, plugin) in [
        ("data", "hostpath"),
        ("data-2", "hostpath"),
        ("logs", "nfs"),
    ] {
        s.register_volume(volume(vol, plugin, &[AccessMode::SingleNodeWriter]))
            .await
            .unwrap();
    }
    assert_eq!(s.volume("data").unwrap().id, "data", "the exact ID wins");
    assert_eq!(s.volume("l").unwrap().id, "logs");
    assert_eq!(s.resolve_volume_id("data-").unwrap(), "data-2");
    let e = bad_request(s.volume("d"));
    assert!(
        e.contains("volume ID prefix \"d\" matches 2 volumes: \"data\", \"data-2\""),
        "{e}"
    );
    not_found(s.volume("x"));

    assert_eq!(s.plugin("hostpath").unwrap().id, "hostpath");
    assert_eq!(s.plugin("n").unwrap().id, "nfs");
    let e = bad_request(s.plugin("host"));
    assert!(
        e.contains("CSI plugin ID prefix \"host\" matches 2 plugins: \"hostpath\", \"hostpath-b\""),
        "{e}"
    );
    not_found(s.plugin("x"));
}
