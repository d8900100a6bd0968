//! A node that misses its heartbeat TTL goes down; its allocs are lost and
//! replaced elsewhere.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_sync::{Shutdown, ShutdownSender};
use std::sync::Arc;
use std::time::Duration;

use berth_server::{Server, ServerConfig, ServerError};
use berth_structs::{AllocClientStatus, Allocation, JobType, NodeEvent, NodeStatus};
use support::*;

/// The test config on `dir` with Nomad's 10 s minimum heartbeat TTL and
/// 10 s grace.
fn ten_second_ttl(dir: &std::path::Path) -> ServerConfig {
    let mut cfg = test_config(dir);
    cfg.min_heartbeat_ttl = Duration::from_secs(10);
    cfg.heartbeat_grace = Duration::from_secs(10);
    cfg
}

/// Runs `server`'s loops until the sender says stop.
fn run_loops(server: &Arc<Server>) -> (ShutdownSender, tokio::task::JoinHandle<()>) {
    let (stop, rx) = Shutdown::channel();
    (stop, tokio::spawn(server.clone().run(rx)))
}

/// Stops the loops [`run_loops`] started and waits for them to end.
async fn stop_loops(stop: ShutdownSender, run: tokio::task::JoinHandle<()>) {
    stop.shutdown();
    run.await.expect("the server's loops end without a panic");
}

#[tokio::test(start_paused = true)]
async fn node_that_misses_its_ttl_goes_down_and_its_allocs_are_lost() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ten_second_ttl(dir.path());
    let server: Arc<Server> = Server::open(cfg).unwrap();
    let (stop, run) = run_loops(&server);

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

    stop_loops(stop, run).await;
}

#[tokio::test]
async fn heartbeat_of_a_ready_node_writes_nothing_to_the_store_and_the_node_shows_it() {
    let ts = support::TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    let registered = s.node("n1").unwrap().last_heartbeat_ms;
    let index = s.index();
    std::thread::sleep(Duration::from_millis(3));
    let before = berth_structs::now_ms();
    // Over gRPC, as a client heartbeats.
    let mut nc = ts.node_client().await;
    for _ in 0..3 {
        nc.heartbeat(berth_proto::berth::v1::HeartbeatRequest {
            node_id: "n1".into(),
        })
        .await
        .expect("heartbeat");
    }
    assert_eq!(
        s.index(),
        index,
        "a heartbeat of a ready node writes nothing"
    );
    let shown = s.node("n1").unwrap().last_heartbeat_ms;
    assert!(
        shown >= before && shown > registered,
        "the node shows the last heartbeat ({shown}), not the registration ({registered})"
    );
    assert_eq!(
        s.nodes()
            .into_iter()
            .find(|n| n.id == "n1")
            .unwrap()
            .last_heartbeat_ms,
        shown
    );

    // A down node's heartbeat is a status change: written, with an event.
    s.mark_node_down("n1", "test").await.unwrap();
    let down = s.node("n1").unwrap();
    assert_eq!(
        down.last_heartbeat_ms, shown,
        "stored with the status change"
    );
    let index = s.index();
    s.node_heartbeat("n1").await.unwrap();
    assert!(s.index() > index);
    let n1 = s.node("n1").unwrap();
    assert_eq!(n1.status, NodeStatus::Ready);
    assert_eq!(
        n1.events.last().unwrap().message,
        "Node heartbeat received; node ready"
    );
}

#[tokio::test]
async fn ttl_is_stretched_by_the_nodes_not_down() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = test_config(dir.path());
    cfg.min_heartbeat_ttl = Duration::from_secs(10);
    cfg.max_heartbeats_per_second = 0.1;
    let server = Server::open(cfg).unwrap();
    for n in ["n1", "n2", "n3"] {
        register(&server, node(n)).await;
    }
    // 3 nodes / 0.1 per second: 30 s, plus at most half as jitter.
    let ttl = server.heartbeat_ttl();
    assert!(
        ttl >= Duration::from_secs(30) && ttl <= Duration::from_secs(45),
        "{ttl:?}"
    );
    server.mark_node_down("n2", "test").await.unwrap();
    server.mark_node_down("n3", "test").await.unwrap();
    let ttl = server.heartbeat_ttl();
    assert!(
        ttl >= Duration::from_secs(10) && ttl <= Duration::from_secs(15),
        "{ttl:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_server_that_was_paused_gives_every_node_a_fresh_ttl_instead_of_marking_it_down() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ten_second_ttl(dir.path());
    let server: Arc<Server> = Server::open(cfg).unwrap();
    let (stop, run) = run_loops(&server);
    register(&server, node("n1")).await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The whole process stops for a minute (SIGSTOP): the monotonic clock
    // jumps past every deadline at once.
    tokio::time::advance(Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        server.node("n1").unwrap().status,
        NodeStatus::Ready,
        "not marked down for the time the server itself was away"
    );

    // The fresh TTL (10 s + 10 s grace) runs out as any other.
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert_eq!(server.node("n1").unwrap().status, NodeStatus::Down);

    stop_loops(stop, run).await;
}

#[tokio::test(start_paused = true)]
async fn a_restarted_server_gives_every_node_a_fresh_ttl() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ten_second_ttl(dir.path());
    {
        let server: Arc<Server> = Server::open(cfg.clone()).unwrap();
        register(&server, node("n1")).await;
    }
    // Away for a minute, then started again.
    tokio::time::advance(Duration::from_secs(60)).await;
    let server: Arc<Server> = Server::open(cfg).unwrap();
    let (stop, run) = run_loops(&server);
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(server.node("n1").unwrap().status, NodeStatus::Ready);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(server.node("n1").unwrap().status, NodeStatus::Down);
    stop_loops(stop, run).await;
}

#[tokio::test]
async fn a_lost_allocs_delayed_replacement_is_placed_when_its_window_ends() {
    let window = Duration::from_secs(2);
    let grace = Duration::from_secs(1);
    // No periodic retry: only the timer for the window's end places it.
    let ts = support::TestServer::start(|c| {
        c.heartbeat_grace = grace;
        c.scheduler_retry_interval = Duration::from_secs(3600);
    })
    .await;
    let s = ts.server.clone();
    let first = windowed_web_on_n1(&s, window).await;
    // A heartbeat later than the registration: the window counts from it.
    std::thread::sleep(Duration::from_millis(5));
    s.node_heartbeat("n1").await.unwrap();
    let last_heartbeat = s.node("n1").unwrap().last_heartbeat_ms;
    s.mark_node_down("n1", "Node heartbeat missed")
        .await
        .unwrap();
    let lost = s.allocation(&first.id).unwrap();
    assert_eq!(lost.node_last_heartbeat_ms, last_heartbeat);
    assert!(
        live_allocs(&s, "web").is_empty(),
        "no replacement inside the window"
    );

    let (next, rule_ms) =
        replacement_after_window(&s, last_heartbeat, window + grace, Duration::from_secs(10)).await;
    // The periodic retry is an hour away: a placement within seconds of
    // the rule is the timer's, however loaded the machine.
    assert!(
        next.create_time_ms < rule_ms + 3_000,
        "placed at {}, long after the window ended ({rule_ms})",
        next.create_time_ms
    );
}

/// Register n1, place job "web" there with `window` as its
/// stop_after_client_disconnect, then register n2; the alloc on n1.
async fn windowed_web_on_n1(s: &Server, window: Duration) -> Allocation {
    register(s, node("n1")).await;
    let mut j = job("web", JobType::Service, 1);
    j.task_groups[0].stop_after_client_disconnect = Some(window);
    s.register_job(j).await.unwrap();
    let first = live_allocs(s, "web").pop().expect("placed");
    assert_eq!(first.node_id, "n1");
    register(s, node("n2")).await;
    first
}

/// Waits up to `timeout` for the replacement of web's lost alloc and
/// checks it is on n2, placed no earlier than the rule: the client's last
/// heartbeat + window + grace, until which the lost copy may still run.
/// The replacement and the rule in unix milliseconds.
async fn replacement_after_window(
    s: &Server,
    last_heartbeat_ms: i64,
    window_and_grace: Duration,
    timeout: Duration,
) -> (Allocation, i64) {
    let rule_ms = last_heartbeat_ms + i64::try_from(window_and_grace.as_millis()).unwrap();
    let mut next = None;
    wait_until("the replacement", timeout, || {
        next = live_allocs(s, "web").pop();
        next.is_some()
    })
    .await;
    let next = next.expect("the replacement");
    assert_eq!(next.node_id, "n2");
    assert!(
        next.create_time_ms >= rule_ms,
        "replacement placed at {}, before the client's last heartbeat + window + grace ({rule_ms}): \
         its copy may still run",
        next.create_time_ms
    );
    (next, rule_ms)
}

/// Heartbeat `node_id` every 100ms until the task is aborted.
fn keep_beating(server: Arc<Server>, node_id: &'static str) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let _ = server.node_heartbeat(node_id).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

#[tokio::test]
async fn a_node_lost_after_a_server_restart_without_a_heartbeat_since_is_not_replaced_before_its_window(
) {
    init_tracing();
    let window = Duration::from_secs(2);
    let grace = Duration::from_millis(500);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = test_config(dir.path());
    cfg.min_heartbeat_ttl = Duration::from_millis(500);
    cfg.heartbeat_grace = grace;
    // No periodic retry: only the timer for the window's end places it.
    cfg.scheduler_retry_interval = Duration::from_secs(3600);

    // First server: n1 runs the window alloc and heartbeats (in memory
    // only) for 3 s, longer than window + grace, so the heartbeat stored
    // with its registration is older than the window.
    let first_alloc;
    let last_heartbeat_ms;
    {
        let server: Arc<Server> = Server::open(cfg.clone()).unwrap();
        let (stop, run) = run_loops(&server);
        first_alloc = windowed_web_on_n1(&server, window).await;
        let beats = [
            keep_beating(server.clone(), "n1"),
            keep_beating(server.clone(), "n2"),
        ];
        tokio::time::sleep(Duration::from_secs(3)).await;
        for b in beats {
            b.abort();
            let _ = b.await;
        }
        // The client counts its window from its last successful heartbeat.
        last_heartbeat_ms = berth_structs::now_ms();
        stop_loops(stop, run).await;
    }

    // The server starts again; n1 is never heard from again (it was cut
    // off while the server was away), n2 keeps beating.
    let server: Arc<Server> = Server::open(cfg).unwrap();
    let (stop, run) = run_loops(&server);
    let beat = keep_beating(server.clone(), "n2");
    wait_until("n1 marked down", Duration::from_secs(10), || {
        server.node("n1").unwrap().status == NodeStatus::Down
    })
    .await;
    assert_eq!(
        server.allocation(&first_alloc.id).unwrap().client_status,
        AllocClientStatus::Lost
    );
    replacement_after_window(
        &server,
        last_heartbeat_ms,
        window + grace,
        Duration::from_secs(15),
    )
    .await;
    beat.abort();
    stop_loops(stop, run).await;
}
