//! Scheduling: system jobs on every ready node, CSI feasibility, claims
//! that block a second writer until freed.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_structs::{
    AccessMode, AllocClientStatus, AllocDesiredStatus, JobStatus, JobType, NodeStatus,
};
use support::*;

#[tokio::test]
async fn system_job_runs_on_every_ready_node() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    for id in ["n1", "n2", "n3"] {
        register(s, node(id)).await;
    }
    let mut no_driver = node("n4");
    no_driver.drivers.clear();
    register(s, no_driver).await;
    s.mark_node_down("n3", "test").await.unwrap();

    let resp = s
        .register_job(job("sys", JobType::System, 1))
        .await
        .unwrap();
    assert!(resp.changed);
    let mut on: Vec<String> = live_allocs(s, "sys")
        .into_iter()
        .map(|a| a.node_id)
        .collect();
    on.sort();
    assert_eq!(on, vec!["n1", "n2"]);
    assert!(
        resp.placement_failures
            .iter()
            .any(|f| f.contains("missing driver")),
        "{:?}",
        resp.placement_failures
    );
    assert_eq!(s.job("sys").unwrap().status, JobStatus::Running);

    // A node that joins gets one too; re-registering the same job changes nothing.
    register(s, node("n5")).await;
    assert_eq!(live_allocs(s, "sys").len(), 3);
    let again = s
        .register_job(job("sys", JobType::System, 1))
        .await
        .unwrap();
    assert!(!again.changed);
    assert_eq!(again.version, 0);
    assert_eq!(live_allocs(s, "sys").len(), 3);
    for a in live_allocs(s, "sys") {
        assert_eq!(a.name, "sys.g[0]");
    }

    // Stop: every alloc is asked to stop; dead once the clients report.
    s.stop_job("sys").await.unwrap();
    let allocs = s.job_allocations("sys").unwrap();
    assert!(allocs
        .iter()
        .all(|a| a.desired_status == AllocDesiredStatus::Stop));
    assert_eq!(
        s.job("sys").unwrap().status,
        JobStatus::Dead,
        "never-started allocs count as stopped"
    );
}

#[tokio::test]
async fn csi_group_waits_for_a_healthy_node_plugin() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    // The plugin is known (fingerprinted) but not healthy yet.
    give_plugin(s, "n1", "hostpath", false, false, false).await;
    register_data_volume(s).await;
    assert!(!s.volume("data").unwrap().schedulable);

    // An unhealthy fingerprint is not enough.
    let resp = s
        .register_job(volume_job("db", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert!(live_allocs(s, "db").is_empty());
    assert!(
        resp.placement_failures
            .iter()
            .any(|f| f.contains("no healthy node plugin \"hostpath\"")),
        "{:?}",
        resp.placement_failures
    );
    assert_eq!(s.job("db").unwrap().status, JobStatus::Pending);

    give_plugin(s, "n1", "hostpath", true, false, false).await;
    let allocs = live_allocs(s, "db");
    assert_eq!(allocs.len(), 1);
    assert_eq!(allocs[0].node_id, "n1");
    assert_eq!(allocs[0].name, "db.g[0]");
    assert!(s.job_placement_failures("db").is_empty());
    assert!(s.volume("data").unwrap().schedulable);
    let plugin = s.plugin("hostpath").unwrap();
    assert_eq!((plugin.nodes_healthy, plugin.nodes_expected), (1, 1));
}

#[tokio::test]
async fn second_single_node_writer_waits_until_the_first_claim_is_freed() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    register(s, node("n2")).await;
    give_plugin(s, "n1", "hostpath", true, false, false).await;
    give_plugin(s, "n2", "hostpath", true, false, false).await;
    register_data_volume(s).await;

    s.register_job(volume_job("first", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    let first = live_allocs(s, "first").pop().expect("first placed");
    // The second writer is infeasible even before the first claims.
    let resp = s
        .register_job(volume_job("second", "data", AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert!(live_allocs(s, "second").is_empty());
    assert!(
        resp.placement_failures
            .iter()
            .any(|f| f.contains("already has a writer")),
        "{:?}",
        resp.placement_failures
    );

    // The first claims over real gRPC.
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &first, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(s.volume("data").unwrap().write_claims.len(), 1);

    // The first stops and its client says so: the claim still holds.
    s.stop_job("first").await.unwrap();
    report(s, &first, AllocClientStatus::Complete).await;
    // (The status report evaluated the blocked jobs synchronously.)
    assert!(
        live_allocs(s, "second").is_empty(),
        "placed before the claim was freed"
    );

    // Freed: the second is placed at once.
    let mut csi2 = ts.csi_client().await;
    csi2.unpublish(berth_proto::berth::v1::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: first.id.clone(),
        node_id: first.node_id.clone(),
    })
    .await
    .unwrap();
    assert!(s.volume("data").unwrap().write_claims.is_empty());
    assert_eq!(live_allocs(s, "second").len(), 1);
    assert!(s.job_placement_failures("second").is_empty());
}

#[tokio::test]
async fn failed_service_alloc_is_replaced_and_batch_completes() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;

    s.register_job(job("svc", JobType::Service, 2))
        .await
        .unwrap();
    let allocs = live_allocs(s, "svc");
    assert_eq!(allocs.len(), 2);
    report(s, &allocs[0], AllocClientStatus::Failed).await;
    let now = live_allocs(s, "svc");
    assert_eq!(now.len(), 2);
    assert!(now.iter().all(|a| a.id != allocs[0].id));
    // The replacement is a reschedule: linked both ways, with the attempt.
    let next = now.iter().find(|a| a.index == allocs[0].index).unwrap();
    assert_eq!(next.previous_allocation, allocs[0].id);
    assert_eq!(next.reschedule_events.len(), 1);
    assert_eq!(next.reschedule_events[0].prev_alloc_id, allocs[0].id);
    assert_eq!(
        s.allocation(&allocs[0].id).unwrap().next_allocation,
        next.id
    );

    // A terminal alloc never becomes live again.
    report(s, &allocs[0], AllocClientStatus::Running).await;
    assert_eq!(
        s.allocation(&allocs[0].id).unwrap().client_status,
        AllocClientStatus::Failed
    );

    s.register_job(job("once", JobType::Batch, 1))
        .await
        .unwrap();
    let b = live_allocs(s, "once").pop().unwrap();
    report(s, &b, AllocClientStatus::Complete).await;
    assert!(
        live_allocs(s, "once").is_empty(),
        "completed batch alloc replaced"
    );
    assert_eq!(s.job("once").unwrap().status, JobStatus::Dead);
}

#[tokio::test]
async fn a_limited_reschedule_policy_gives_up_and_the_job_is_failed() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    let mut svc = job("limited", JobType::Service, 1);
    svc.reschedule = Some(berth_structs::ReschedulePolicy {
        attempts: 2,
        interval: std::time::Duration::from_secs(3600),
        unlimited: false,
        ..svc.reschedule.clone().unwrap()
    });
    s.register_job(svc).await.unwrap();
    let mut failed = Vec::new();
    for attempt in 0..3 {
        let live = live_allocs(s, "limited");
        assert_eq!(live.len(), 1, "attempt {attempt}: {live:?}");
        assert_eq!(live[0].reschedule_events.len(), attempt);
        report(s, &live[0], AllocClientStatus::Failed).await;
        failed.push(live[0].id.clone());
    }
    // Two reschedules, then none: the index stays failed.
    assert!(live_allocs(s, "limited").is_empty());
    let last = s.allocation(&failed[2]).unwrap();
    assert!(last.next_allocation.is_empty());
    assert_eq!(
        last.reschedule_events
            .iter()
            .map(|e| e.prev_alloc_id.as_str())
            .collect::<Vec<_>>(),
        [failed[0].as_str(), failed[1].as_str()]
    );
    assert_eq!(s.job("limited").unwrap().status, JobStatus::Failed);
}

#[tokio::test]
async fn resources_limit_placements() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let mut small = node("n1");
    small.resources.memory_mb = 300; // two 128 MiB allocs fit, not three
    register(s, small).await;
    let resp = s
        .register_job(job("web", JobType::Service, 3))
        .await
        .unwrap();
    assert_eq!(live_allocs(s, "web").len(), 2);
    assert!(
        resp.placement_failures
            .iter()
            .any(|f| f.contains("memory exhausted")),
        "{:?}",
        resp.placement_failures
    );
    // A second node unblocks the third.
    register(s, node("n2")).await;
    assert_eq!(live_allocs(s, "web").len(), 3);
    assert_eq!(s.node("n1").unwrap().status, NodeStatus::Ready);
}

#[tokio::test]
async fn the_largest_asks_a_job_may_make_place_what_fits_and_summarize_the_rest() {
    use berth_structs::limits::{MAX_COUNT, MAX_CPU_MHZ, MAX_MEMORY_MB};
    use berth_structs::{NodeResources, Resources};
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let mut n1 = node("n1");
    // Room for two allocs of the largest memory ask, and all the cpu there is.
    n1.resources = NodeResources {
        cpu: u64::MAX,
        memory_mb: MAX_MEMORY_MB * 3 - 1,
        disk_mb: 0,
    };
    register(s, n1).await;
    let mut j = job("huge", JobType::Service, MAX_COUNT);
    j.task_groups[0].tasks[0].resources = Resources {
        cpu: MAX_CPU_MHZ,
        memory_mb: MAX_MEMORY_MB,
        ..berth_structs::Resources::default()
    };
    let resp = s.register_job(j).await.unwrap();

    assert_eq!(live_allocs(s, "huge").len(), 2);
    let unplaced = u64::from(MAX_COUNT) - 2;
    assert_eq!(
        (resp.desired_allocs, resp.unplaced_allocs),
        (u64::from(MAX_COUNT), unplaced)
    );
    let used = MAX_MEMORY_MB * 2;
    let total = MAX_MEMORY_MB * 3 - 1;
    assert_eq!(
        resp.placement_failures,
        vec![format!(
            "group \"g\": {unplaced} of {MAX_COUNT} allocs not placed: node n1: memory exhausted \
             ({used} of {total} MiB in use, {MAX_MEMORY_MB} MiB asked) \
             ({unplaced} allocs: index 2-{})",
            MAX_COUNT - 1
        )]
    );
    // The job shows the same summary while it waits.
    assert_eq!(s.job_placement_failures("huge"), resp.placement_failures);
    assert_eq!(s.job("huge").unwrap().status, JobStatus::Running);
}

/// A job's placement failures are in its answer, so a blocking read of the
/// jobs table wakes when they appear and when they go; the job's spec index
/// (what a check-index names) does not move for them.
#[tokio::test]
async fn placement_failures_that_change_are_a_write_to_the_jobs_table() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let resp = s
        .register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    assert!(!resp.placement_failures.is_empty(), "no node: blocked");
    let registered = s.job("web").unwrap();
    assert!(
        registered.modify_index > registered.job_modify_index,
        "the failures were written after the job: {registered:?}"
    );
    assert_eq!(resp.job_modify_index, registered.job_modify_index);

    // The same failures again write nothing.
    let before = s.tables_index(&[berth_server::Table::Jobs]);
    let again = s
        .register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    assert!(!again.changed);
    assert_eq!(again.placement_failures, resp.placement_failures);
    assert_eq!(s.tables_index(&[berth_server::Table::Jobs]), before);

    // A node joins: the job places and its failures go; a read waiting
    // on the jobs table wakes for it.
    let waiting = {
        let s = s.clone();
        tokio::spawn(async move {
            s.wait_for_tables(
                &[berth_server::Table::Jobs],
                before,
                std::time::Duration::from_secs(30),
            )
            .await
        })
    };
    register(s, node("n1")).await;
    assert_eq!(live_allocs(s, "web").len(), 1);
    assert!(s.job_placement_failures("web").is_empty());
    let woke_at = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
        .await
        .expect("the jobs table was written")
        .unwrap();
    assert!(woke_at > before);
    assert_eq!(
        s.job("web").unwrap().job_modify_index,
        registered.job_modify_index
    );
}
