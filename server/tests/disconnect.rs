//! The group `disconnect` block: allocs of a down node held `unknown`
//! (kept with `replace = false`, replaced with `replace = true`), what
//! they are when the node comes back (the same alloc, no stop), which of
//! an original and its replacement `reconcile` keeps, `lost_after` ending
//! the wait, system jobs held by `default_lost_after`, and write claims
//! of unknown allocs kept.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use berth_server::Server;
use berth_structs::{
    AccessMode, AllocClientStatus, AllocDesiredStatus, Allocation, ClaimState, DisconnectPolicy,
    Job, JobType, ReconcileStrategy,
};
use support::*;

fn with_disconnect(mut job: Job, policy: DisconnectPolicy) -> Job {
    job.task_groups[0].disconnect = Some(policy);
    job
}

fn policy(lost_after: Duration, replace: bool, reconcile: ReconcileStrategy) -> DisconnectPolicy {
    DisconnectPolicy {
        lost_after: Some(lost_after),
        replace,
        reconcile,
        stop_on_client_after: None,
    }
}

/// Every alloc of `job_id`, stopped ones too.
fn all_allocs(s: &Server, job_id: &str) -> Vec<Allocation> {
    s.job_allocations(job_id).unwrap()
}

/// n1 and n2; `job` registered while only n1 is, so its alloc runs there
/// (reported running); that alloc.
async fn running_on_n1(s: &Server, job: Job) -> Allocation {
    register(s, node("n1")).await;
    let id = job.id.clone();
    s.register_job(job).await.unwrap();
    let a = live_allocs(s, &id).pop().expect("placed");
    assert_eq!(a.node_id, "n1");
    report(s, &a, AllocClientStatus::Running).await;
    register(s, node("n2")).await;
    a
}

#[tokio::test]
async fn an_alloc_held_unknown_without_replace_resumes_when_its_node_returns() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let job = with_disconnect(
        job("web", JobType::Service, 1),
        policy(Duration::from_secs(60), false, ReconcileStrategy::BestScore),
    );
    let original = running_on_n1(s, job).await;

    s.mark_node_down("n1", "test").await.unwrap();
    let held = s.allocation(&original.id).unwrap();
    assert_eq!(held.client_status, AllocClientStatus::Unknown);
    assert_eq!(held.desired_status, AllocDesiredStatus::Run);
    let d = held.disconnected.clone().expect("the disconnect record");
    assert_eq!(d.previous_status, AllocClientStatus::Running);
    assert!(d.lost_at_ms - d.since_ms == 60_000, "{d:?}");
    assert!(held.client_description.contains("unknown"), "{held:?}");
    assert_eq!(s.job_summary("web").unwrap().groups["g"].unknown, 1);
    // No replacement, even after the scheduler's retries.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(all_allocs(s, "web").len(), 1, "{:?}", all_allocs(s, "web"));

    // The node is back: the same alloc runs on, nothing is stopped or placed.
    s.node_heartbeat("n1").await.unwrap();
    let back = s.allocation(&original.id).unwrap();
    assert_eq!(back.client_status, AllocClientStatus::Running);
    assert_eq!(back.desired_status, AllocDesiredStatus::Run);
    assert!(back.disconnected.is_none());
    tokio::time::sleep(Duration::from_millis(600)).await;
    let allocs = all_allocs(s, "web");
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    let event = s.node("n1").unwrap().events.last().cloned().unwrap();
    assert_eq!(
        event.details.get("allocs_resumed").map(String::as_str),
        Some("1"),
        "{event:?}"
    );
}

#[tokio::test]
async fn an_alloc_without_a_disconnect_block_is_lost_at_once() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let original = running_on_n1(s, job("web", JobType::Service, 1)).await;
    s.mark_node_down("n1", "test").await.unwrap();
    let lost = s.allocation(&original.id).unwrap();
    assert_eq!(lost.client_status, AllocClientStatus::Lost);
    assert_eq!(lost.desired_status, AllocDesiredStatus::Stop);
    wait_for_live_on(s, "web", "n2").await;
}

/// With `replace = true` a replacement runs on n2 while n1 is down; when
/// n1 comes back, `reconcile` stops one of the two; the one kept.
async fn reconcile_after_return(strategy: ReconcileStrategy) -> (Allocation, Allocation, String) {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let job = with_disconnect(
        job("web", JobType::Service, 1),
        policy(Duration::from_secs(60), true, strategy),
    );
    let original = running_on_n1(s, job).await;
    s.mark_node_down("n1", "test").await.unwrap();
    assert_eq!(
        s.allocation(&original.id).unwrap().client_status,
        AllocClientStatus::Unknown
    );
    let replacement = wait_for_live_on(s, "web", "n2").await;
    report(s, &replacement, AllocClientStatus::Running).await;
    assert_eq!(
        s.allocation(&original.id).unwrap().desired_status,
        AllocDesiredStatus::Run,
        "the original is not stopped while its node is away"
    );

    s.node_heartbeat("n1").await.unwrap();
    let mut kept = String::new();
    wait_until("one of the two stopped", Duration::from_secs(10), || {
        let running: Vec<Allocation> = all_allocs(s, "web")
            .into_iter()
            .filter(|a| a.desired_status == AllocDesiredStatus::Run)
            .collect();
        if running.len() == 1 {
            kept = running[0].id.clone();
            true
        } else {
            false
        }
    })
    .await;
    assert_eq!(all_allocs(s, "web").len(), 2, "nothing else is placed");
    let stopped = all_allocs(s, "web")
        .into_iter()
        .find(|a| a.id != kept)
        .unwrap();
    assert!(
        stopped.desired_description.contains(strategy.as_str()),
        "{stopped:?}"
    );
    (original, replacement, kept)
}

#[tokio::test]
async fn keep_original_stops_the_replacement_when_the_node_returns() {
    let (original, _, kept) = reconcile_after_return(ReconcileStrategy::KeepOriginal).await;
    assert_eq!(kept, original.id);
}

#[tokio::test]
async fn keep_replacement_stops_the_original_when_the_node_returns() {
    let (_, replacement, kept) = reconcile_after_return(ReconcileStrategy::KeepReplacement).await;
    assert_eq!(kept, replacement.id);
}

#[tokio::test]
async fn an_unknown_alloc_is_lost_once_lost_after_passes() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let job = with_disconnect(
        job("web", JobType::Service, 1),
        policy(
            Duration::from_millis(500),
            false,
            ReconcileStrategy::BestScore,
        ),
    );
    let original = running_on_n1(s, job).await;
    s.mark_node_down("n1", "test").await.unwrap();
    let held = s.allocation(&original.id).unwrap();
    assert_eq!(held.client_status, AllocClientStatus::Unknown);
    let lost_at = held.disconnected.unwrap().lost_at_ms;
    let replacement = wait_for_live_on(s, "web", "n2").await;
    assert!(
        replacement.create_time_ms >= lost_at,
        "no replacement before lost_after has passed"
    );
    let lost = s.allocation(&original.id).unwrap();
    assert_eq!(lost.client_status, AllocClientStatus::Lost);
    assert_eq!(lost.desired_status, AllocDesiredStatus::Stop);
    assert!(lost.client_description.contains("lost_after"), "{lost:?}");
}

#[tokio::test]
async fn a_system_alloc_is_held_by_default_lost_after_and_resumes() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    s.register_job(job("agentd", JobType::System, 1))
        .await
        .unwrap();
    let original = live_allocs(s, "agentd").pop().expect("placed");
    report(s, &original, AllocClientStatus::Running).await;
    s.mark_node_down("n1", "test").await.unwrap();
    let held = s.allocation(&original.id).unwrap();
    assert_eq!(held.client_status, AllocClientStatus::Unknown);
    let d = held.disconnected.unwrap();
    assert_eq!(d.lost_at_ms - d.since_ms, 3_600_000, "the default: 1h");
    s.node_heartbeat("n1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let allocs = all_allocs(s, "agentd");
    assert_eq!(allocs.len(), 1, "no new system alloc: {allocs:?}");
    assert_eq!(allocs[0].client_status, AllocClientStatus::Running);
    assert_eq!(allocs[0].desired_status, AllocDesiredStatus::Run);
}

#[tokio::test]
async fn default_lost_after_zero_keeps_system_allocs_lost_at_once() {
    let ts = TestServer::start(|c| c.default_lost_after = Duration::ZERO).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    s.register_job(job("agentd", JobType::System, 1))
        .await
        .unwrap();
    let original = live_allocs(s, "agentd").pop().expect("placed");
    s.mark_node_down("n1", "test").await.unwrap();
    assert_eq!(
        s.allocation(&original.id).unwrap().client_status,
        AllocClientStatus::Lost
    );
}

#[tokio::test]
async fn an_unknown_writer_keeps_its_write_claim_and_blocks_its_replacement() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", true, false, false).await;
    register_data_volume(s).await;
    let db = with_disconnect(
        volume_job("db", "data", AccessMode::SingleNodeWriter),
        policy(
            Duration::from_secs(60),
            true,
            ReconcileStrategy::KeepOriginal,
        ),
    );
    s.register_job(db).await.unwrap();
    let original = live_allocs(s, "db").pop().expect("db placed");
    ts.csi_client()
        .await
        .claim(claim_request(
            "data",
            &original,
            AccessMode::SingleNodeWriter,
        ))
        .await
        .unwrap();
    register(s, node("n2")).await;
    give_plugin(s, "n2", "hostpath", true, false, false).await;

    s.mark_node_down("n1", "test").await.unwrap();
    assert_eq!(
        s.allocation(&original.id).unwrap().client_status,
        AllocClientStatus::Unknown
    );
    wait_placement_failure(s, "db", "data").await;
    assert_eq!(
        claim_of(s, "data", &original.id),
        Some((ClaimState::Taken, false)),
        "the write claim of an unknown alloc is kept"
    );
    let placed: Vec<Allocation> = all_allocs(s, "db")
        .into_iter()
        .filter(|a| a.id != original.id)
        .collect();
    assert!(placed.is_empty(), "no second writer is placed: {placed:?}");
    let failures = s.job_placement_failures("db");
    assert!(
        failures.iter().any(|f| f.contains(&format!(
            "volume \"data\" already has a writer (alloc {})",
            original.id
        ))),
        "the job says which alloc it waits for: {failures:?}"
    );
}
