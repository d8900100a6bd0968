//! A node that misses its heartbeat TTL goes down; its allocs are lost and
//! replaced elsewhere.

mod support;

use std::sync::Arc;
use std::time::Duration;

use berth_server::{Server, ServerError};
use berth_structs::{AllocClientStatus, JobType, NodeEvent, NodeStatus};
use support::*;
use tokio::sync::watch;

#[tokio::test(start_paused = true)]
async fn node_that_misses_its_ttl_goes_down_and_its_allocs_are_lost() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = test_config(dir.path());
    cfg.min_heartbeat_ttl = Duration::from_secs(10);
    cfg.heartbeat_grace = Duration::from_secs(10);
    let server: Arc<Server> = Server::open(cfg).unwrap();
    let (stop, rx) = watch::channel(false);
    let run = tokio::spawn(server.clone().run(rx));

    let reg = server.register_node(node("n1")).await.unwrap();
    assert!(reg.heartbeat_ttl >= Duration::from_secs(10));
    assert!(
        reg.heartbeat_ttl <= Duration::from_secs(15),
        "jitter at most half: {:?}",
        reg.heartbeat_ttl
    );
    server.register_node(node("n2")).await.unwrap();
    server
        .register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    let first = live_allocs(&server, "web").pop().unwrap();
    let (silent, chatty) = if first.node_id == "n1" {
        ("n1", "n2")
    } else {
        ("n2", "n1")
    };

    // Within TTL + grace both stay ready; the chatty node keeps beating.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        server.node_heartbeat(chatty).await.unwrap();
        if server.node(silent).unwrap().status == NodeStatus::Down {
            break;
        }
    }
    // 30s have passed: more than the silent node's TTL (<= 15s) + grace.
    let node = server.node(silent).unwrap();
    assert_eq!(node.status, NodeStatus::Down);
    let ev = node.events.last().unwrap();
    assert_eq!(ev.subsystem, NodeEvent::SUBSYSTEM_CLUSTER);
    assert_eq!(ev.message, "Node heartbeat missed");
    assert_eq!(server.node(chatty).unwrap().status, NodeStatus::Ready);

    let lost = server.allocation(&first.id).unwrap();
    assert_eq!(lost.client_status, AllocClientStatus::Lost);
    let replacement = live_allocs(&server, "web").pop().expect("replaced");
    assert_eq!(replacement.node_id, chatty);

    // An unknown node's heartbeat is NotFound (it must register).
    assert!(matches!(
        server.node_heartbeat("ghost").await,
        Err(ServerError::NotFound(_))
    ));
    // The silent node comes back with a heartbeat: ready again, its lost alloc stays lost.
    server.node_heartbeat(silent).await.unwrap();
    assert_eq!(server.node(silent).unwrap().status, NodeStatus::Ready);
    assert_eq!(
        server.allocation(&first.id).unwrap().client_status,
        AllocClientStatus::Lost
    );

    stop.send_replace(true);
    run.await.unwrap();
}
