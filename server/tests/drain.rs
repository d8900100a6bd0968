//! Node drain and eligibility on a real server (state in a temp dir, the
//! drainer, the scheduler and the volume watcher running): allocs move
//! off a draining node, a CSI plugin there stops only after the volumes it
//! serves are released, the drain completes, and eligibility is the
//! operator's.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use berth_server::{
    ReleaseOrigin, Server, ServerError, VolumeClaimRequest, DRAIN_COMPLETE_EVENT,
    DRAIN_STOP_DESCRIPTION,
};
use berth_structs::{
    AccessMode, AllocClientStatus, AllocDesiredStatus, Allocation, AttachmentMode, ClaimMode,
    CsiPluginType, Job, JobType, NodeEvent, SchedulingEligibility, TaskCsiPluginConfig,
};
use support::*;

const WAIT: Duration = Duration::from_secs(10);

/// A system job whose task is a CSI plugin.
fn plugin_job(plugin_id: &str) -> Job {
    let mut j = job("plugin", JobType::System, 1);
    j.task_groups[0].tasks[0].csi_plugin = Some(TaskCsiPluginConfig {
        id: plugin_id.into(),
        plugin_type: CsiPluginType::Monolith,
        mount_dir: "/csi".into(),
        stage_publish_base_dir: None,
        health_timeout: TaskCsiPluginConfig::DEFAULT_HEALTH_TIMEOUT,
    });
    j
}

/// The one alloc of `job_id` on `node_id` that is not stopped.
fn alloc_on(s: &Server, job_id: &str, node_id: &str) -> Allocation {
    let mut found: Vec<Allocation> = s
        .job_allocations(job_id)
        .unwrap()
        .into_iter()
        .filter(|a| a.node_id == node_id && !a.server_terminal())
        .collect();
    assert_eq!(found.len(), 1, "{job_id} on {node_id}: {found:?}");
    found.pop().unwrap()
}

/// Register node n1 and the jobs `(id, type)` (one alloc each, placed on
/// n1), and report every alloc running; the allocs in the order given.
async fn running_on_n1<const N: usize>(s: &Server, jobs: [(&str, JobType); N]) -> [Allocation; N] {
    s.register_node(node("n1")).await.unwrap();
    for (id, job_type) in jobs {
        s.register_job(job(id, job_type, 1)).await.unwrap();
    }
    let allocs = jobs.map(|(id, _)| alloc_on(s, id, "n1"));
    for a in &allocs {
        report(s, a, AllocClientStatus::Running).await;
    }
    allocs
}

fn current(s: &Server, a: &Allocation) -> Allocation {
    s.allocation(&a.id).unwrap()
}

fn drain_stopped(s: &Server, a: &Allocation) -> bool {
    let a = current(s, a);
    a.desired_status == AllocDesiredStatus::Stop && a.desired_description == DRAIN_STOP_DESCRIPTION
}

async fn drain_complete(s: &Server, node_id: &str) {
    wait_until("the drain completes", WAIT, || {
        s.node(node_id).unwrap().drain_strategy.is_none()
    })
    .await;
    let n = s.node(node_id).unwrap();
    assert!(!n.drain);
    assert_eq!(
        n.scheduling_eligibility,
        SchedulingEligibility::Ineligible,
        "a drained node stays ineligible"
    );
    let ev = n
        .events
        .iter()
        .rfind(|e| e.subsystem == NodeEvent::SUBSYSTEM_DRAIN)
        .expect("a drain event");
    assert_eq!(ev.message, DRAIN_COMPLETE_EVENT);
}

#[tokio::test]
async fn drain_moves_a_service_alloc_to_another_node_and_completes() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let [web] = running_on_n1(&s, [("web", JobType::Service)]).await;
    s.register_node(node("n2")).await.unwrap();

    let n = s
        .update_node_drain("n1", Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    assert!(n.drain);
    let strategy = n.drain_strategy.expect("draining");
    assert_eq!(strategy.deadline, Duration::from_secs(3600));
    assert_eq!(
        strategy.force_deadline_ms,
        strategy.started_at_ms + 3_600_000
    );
    assert_eq!(n.scheduling_eligibility, SchedulingEligibility::Ineligible);

    wait_until("web is stopped on n1", WAIT, || drain_stopped(&s, &web)).await;
    wait_until("web is replaced on n2", WAIT, || {
        live_allocs(&s, "web").iter().any(|a| a.node_id == "n2")
    })
    .await;
    let live = live_allocs(&s, "web");
    assert_eq!(live.len(), 1, "{live:?}");
    assert_eq!(live[0].index, web.index);
    // Still stopping on the client: the drain waits for it.
    assert!(s.node("n1").unwrap().drain_strategy.is_some());

    report(&s, &web, AllocClientStatus::Complete).await;
    drain_complete(&s, "n1").await;

    // A new job goes to n2 only.
    s.register_job(job("more", JobType::Service, 3))
        .await
        .unwrap();
    let more = live_allocs(&s, "more");
    assert_eq!(more.len(), 3);
    assert!(more.iter().all(|a| a.node_id == "n2"), "{more:?}");
}

#[tokio::test]
async fn a_plugin_on_a_drained_node_stops_only_after_the_volume_there_is_released() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    s.register_node(node("n1")).await.unwrap();
    give_plugin(&s, "n1", "hostpath", true, false, false).await;
    s.register_job(plugin_job("hostpath")).await.unwrap();
    s.register_job(job("logger", JobType::System, 1))
        .await
        .unwrap();
    register_data_volume(&s).await;
    s.register_job(volume_job("db", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    s.register_node(node("n2")).await.unwrap();
    give_plugin(&s, "n2", "hostpath", true, false, false).await;

    let plugin = alloc_on(&s, "plugin", "n1");
    let logger = alloc_on(&s, "logger", "n1");
    let db = alloc_on(&s, "db", "n1");
    alloc_on(&s, "plugin", "n2");
    for a in [&plugin, &logger, &db] {
        report(&s, a, AllocClientStatus::Running).await;
    }
    s.claim_volume(VolumeClaimRequest {
        volume_id: "data".into(),
        alloc_id: db.id.clone(),
        node_id: "n1".into(),
        mode: ClaimMode::Write,
        access_mode: AccessMode::SingleNodeWriter,
        attachment_mode: AttachmentMode::FileSystem,
        mount_options: Default::default(),
    })
    .await
    .unwrap();

    s.update_node_drain("n1", Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    wait_until("db is stopped on n1", WAIT, || drain_stopped(&s, &db)).await;
    assert_eq!(current(&s, &plugin).desired_status, AllocDesiredStatus::Run);
    assert_eq!(current(&s, &logger).desired_status, AllocDesiredStatus::Run);

    // db is done on the client, its claim still held: the other system
    // alloc goes, the plugin stays.
    report(&s, &db, AllocClientStatus::Complete).await;
    wait_until("logger is stopped on n1", WAIT, || {
        drain_stopped(&s, &logger)
    })
    .await;
    assert_eq!(
        current(&s, &plugin).desired_status,
        AllocDesiredStatus::Run,
        "the plugin must outlive the claim of the volume it serves"
    );
    assert!(s.volume("data").unwrap().claim_for(&db.id).is_some());

    // The client unpublishes and releases the claim: now the plugin goes.
    s.unpublish_claim(
        "data",
        &db.id,
        ReleaseOrigin::Client {
            node_id: "n1".into(),
        },
    )
    .await
    .unwrap();
    let released = s.volume("data").unwrap();
    assert!(released.claim_for(&db.id).is_none());
    wait_until("the plugin is stopped on n1", WAIT, || {
        drain_stopped(&s, &plugin)
    })
    .await;
    let stopped_plugin = current(&s, &plugin);
    assert!(
        stopped_plugin.modify_index > released.modify_index,
        "the plugin was stopped at index {} before the claim was freed at index {}",
        stopped_plugin.modify_index,
        released.modify_index
    );

    // db runs on n2 with the volume; n1's drain completes.
    wait_until("db is replaced on n2", WAIT, || {
        live_allocs(&s, "db").iter().any(|a| a.node_id == "n2")
    })
    .await;
    for a in [&plugin, &logger] {
        report(&s, a, AllocClientStatus::Complete).await;
    }
    drain_complete(&s, "n1").await;
}

#[tokio::test]
async fn a_forced_drain_stops_everything_at_once_and_completes_without_waiting() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let [web, logger] =
        running_on_n1(&s, [("web", JobType::Service), ("logger", JobType::System)]).await;

    s.update_node_drain("n1", Some(Duration::ZERO))
        .await
        .unwrap();
    drain_complete(&s, "n1").await;
    assert!(drain_stopped(&s, &web));
    assert!(drain_stopped(&s, &logger));
    // Nowhere else to go: the replacement waits, saying why.
    let failures = s.job_placement_failures("web");
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].contains("node n1: node ineligible"),
        "{failures:?}"
    );
}

#[tokio::test]
async fn disabling_a_drain_keeps_the_node_ineligible_until_an_operator_says_otherwise() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let [web] = running_on_n1(&s, [("web", JobType::Service)]).await;

    s.update_node_drain("n1", Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    wait_until("web is stopped on n1", WAIT, || drain_stopped(&s, &web)).await;

    // A draining node cannot be made eligible.
    let err = s.set_node_eligibility("n1", true).await.unwrap_err();
    assert!(matches!(err, ServerError::Conflict(_)), "{err:?}");
    assert!(err.to_string().contains("is draining"), "{err}");

    let n = s.update_node_drain("n1", None).await.unwrap();
    assert!(!n.drain);
    assert!(n.drain_strategy.is_none());
    assert_eq!(n.scheduling_eligibility, SchedulingEligibility::Ineligible);
    assert_eq!(n.events.last().unwrap().message, "Node drain disabled");
    // What the drain stopped stays stopped; nothing new comes to n1.
    assert!(drain_stopped(&s, &web));
    assert!(live_allocs(&s, "web").is_empty());

    let n = s.set_node_eligibility("n1", true).await.unwrap();
    assert_eq!(n.scheduling_eligibility, SchedulingEligibility::Eligible);
    wait_until("web is placed on n1 again", WAIT, || {
        live_allocs(&s, "web").iter().any(|a| a.node_id == "n1")
    })
    .await;
}

#[tokio::test]
async fn eligibility_toggles_and_decides_where_new_allocs_go() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    s.register_node(node("n1")).await.unwrap();
    s.register_node(node("n2")).await.unwrap();

    let n = s.set_node_eligibility("n1", false).await.unwrap();
    assert_eq!(n.scheduling_eligibility, SchedulingEligibility::Ineligible);
    assert_eq!(
        n.events.last().unwrap().message,
        "Node marked as ineligible for scheduling"
    );
    s.register_job(job("web", JobType::Service, 2))
        .await
        .unwrap();
    s.register_job(job("logger", JobType::System, 1))
        .await
        .unwrap();
    assert!(live_allocs(&s, "web").iter().all(|a| a.node_id == "n2"));
    let loggers = live_allocs(&s, "logger");
    assert_eq!(loggers.len(), 1, "{loggers:?}");
    assert_eq!(loggers[0].node_id, "n2");
    assert!(s.job_placement_failures("logger").is_empty());

    // A client's re-registration does not make it eligible again.
    s.register_node(node("n1")).await.unwrap();
    assert_eq!(
        s.node("n1").unwrap().scheduling_eligibility,
        SchedulingEligibility::Ineligible
    );

    // Eligible again: the system job comes to n1; the service allocs stay
    // where they are.
    s.set_node_eligibility("n1", true).await.unwrap();
    wait_until("logger runs on n1", WAIT, || {
        live_allocs(&s, "logger").iter().any(|a| a.node_id == "n1")
    })
    .await;
    assert!(live_allocs(&s, "web").iter().all(|a| a.node_id == "n2"));

    // A deadline past the limit is refused, naming it.
    let err = s
        .update_node_drain("n1", Some(Duration::from_secs(100 * 31_557_600)))
        .await
        .unwrap_err();
    assert!(matches!(err, ServerError::BadRequest(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "drain deadline: 100years is too large (at most 1year)"
    );
    assert!(s.node("n1").unwrap().drain_strategy.is_none());

    // Unknown nodes are named.
    let err = s.set_node_eligibility("nope", false).await.unwrap_err();
    assert!(matches!(err, ServerError::NotFound(_)), "{err:?}");
    assert!(err.to_string().contains("node \"nope\" not found"), "{err}");
}

#[tokio::test]
async fn a_drain_survives_the_nodes_re_registration() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    running_on_n1(&s, [("web", JobType::Service)]).await;
    s.update_node_drain("n1", Some(Duration::from_secs(3600)))
        .await
        .unwrap();

    s.register_node(node("n1")).await.unwrap();
    let n = s.node("n1").unwrap();
    assert!(n.drain, "{n:?}");
    assert!(n.drain_strategy.is_some());
    assert_eq!(n.scheduling_eligibility, SchedulingEligibility::Ineligible);
    s.node_heartbeat("n1").await.unwrap();
    assert!(s.node("n1").unwrap().drain);

    // A new node's own claim to be draining or ineligible is ignored.
    let mut forged = node("n2");
    forged.set_drain(Some(berth_structs::DrainStrategy::new(
        Duration::from_secs(60),
        0,
    )));
    s.register_node(forged).await.unwrap();
    let n2 = s.node("n2").unwrap();
    assert!(!n2.drain && n2.drain_strategy.is_none(), "{n2:?}");
    assert_eq!(n2.scheduling_eligibility, SchedulingEligibility::Eligible);
}

#[tokio::test]
async fn at_the_deadline_the_drain_stops_waiting_for_migrations_by_itself() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let [web, logger] =
        running_on_n1(&s, [("web", JobType::Service), ("logger", JobType::System)]).await;

    let started = std::time::Instant::now();
    s.update_node_drain("n1", Some(Duration::from_secs(2)))
        .await
        .unwrap();
    wait_until("web is stopped on n1", WAIT, || drain_stopped(&s, &web)).await;
    // web never reports that it stopped; nothing else changes. The drainer
    // wakes at the deadline by itself.
    wait_until("logger is stopped at the deadline", WAIT, || {
        drain_stopped(&s, &logger)
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "stopped {:?} after the drain started, before its deadline",
        started.elapsed()
    );
    drain_complete(&s, "n1").await;
    assert_eq!(current(&s, &web).client_status, AllocClientStatus::Running);
}
