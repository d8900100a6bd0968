//! Job plans, registration with enforce_index, purge, summaries and job ID
//! prefixes.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use berth_server::{DiffKind, DiffOp, JobPlan, ServerError};
use berth_structs::{AccessMode, AllocClientStatus, JobType};
use support::*;

/// (alloc name, node) of each placement of a plan.
fn planned(plan: &JobPlan) -> BTreeSet<(String, String)> {
    plan.groups
        .iter()
        .flat_map(|g| g.placements.iter())
        .map(|p| (p.name.clone(), p.node_id.clone()))
        .collect()
}

/// (alloc name, node) of each live alloc of the job.
fn placed(s: &berth_server::Server, job_id: &str) -> BTreeSet<(String, String)> {
    live_allocs(s, job_id)
        .into_iter()
        .map(|a| (a.name, a.node_id))
        .collect()
}

#[tokio::test]
async fn a_plan_writes_nothing_and_its_placements_are_what_registration_does() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    for id in ["n1", "n2"] {
        register(s, node(id)).await;
    }
    // n1 is busier: the scheduler prefers n2, then spreads.
    s.register_job(job("other", JobType::Service, 1))
        .await
        .unwrap();
    let before = s.index();

    let plan = s.plan_job(job("web", JobType::Service, 3)).unwrap();
    assert_eq!(s.index(), before, "a plan writes nothing");
    assert!(s.job("web").is_err(), "nor stores the job");
    assert!(s.job_allocations("web").is_err());
    assert_eq!(plan.diff.kind, DiffKind::Added);
    assert_eq!(plan.job_modify_index, 0);
    assert!(plan.allocs_change);
    assert_eq!(plan.groups.len(), 1);
    assert_eq!((plan.groups[0].place, plan.groups[0].keep), (3, 0));
    assert!(plan.placement_failures.is_empty());

    s.register_job(job("web", JobType::Service, 3))
        .await
        .unwrap();
    assert_eq!(placed(s, "web"), planned(&plan));

    // The same job again: nothing to do.
    let again = s.plan_job(job("web", JobType::Service, 3)).unwrap();
    assert_eq!(again.diff.kind, DiffKind::Unchanged);
    assert!(again.diff.fields.is_empty());
    assert!(!again.allocs_change);
    assert_eq!(again.groups[0].keep, 3);
    assert_eq!(
        again.job_modify_index,
        s.job("web").unwrap().job_modify_index
    );

    // A higher count: a field diff and one more placement, the rest kept.
    let before = s.index();
    let more = s.plan_job(job("web", JobType::Service, 4)).unwrap();
    assert_eq!(s.index(), before);
    assert_eq!(more.diff.kind, DiffKind::Edited);
    assert_eq!(more.diff.fields.len(), 1, "{:?}", more.diff.fields);
    let f = &more.diff.fields[0];
    assert_eq!(f.path, "task_groups[g].count");
    assert_eq!(f.op, DiffOp::Edited);
    assert_eq!(
        (f.old.clone(), f.new.clone()),
        (Some(3.into()), Some(4.into()))
    );
    // A count change: the three allocs take the new version in place
    // (same IDs), and one more is placed.
    let g = &more.groups[0];
    assert_eq!(
        (g.place, g.stop, g.update, g.in_place, g.keep),
        (1, 0, 0, 3, 0)
    );
    let kept: Vec<String> = live_allocs(s, "web").into_iter().map(|a| a.id).collect();
    s.register_job(job("web", JobType::Service, 4))
        .await
        .unwrap();
    let new: BTreeSet<(String, String)> = live_allocs(s, "web")
        .into_iter()
        .filter(|a| !kept.contains(&a.id))
        .map(|a| (a.name, a.node_id))
        .collect();
    assert_eq!(new, planned(&more));
    let now: Vec<String> = live_allocs(s, "web").into_iter().map(|a| a.id).collect();
    assert_eq!(now.len(), 4);
    assert!(kept.iter().all(|id| now.contains(id)), "{kept:?} {now:?}");
    let version = s.job("web").unwrap().version;
    assert!(live_allocs(s, "web")
        .iter()
        .all(|a| a.job.version == version));

    // A changed task: every alloc is stopped and placed anew.
    let mut changed = job("web", JobType::Service, 4);
    changed.task_groups[0].tasks[0].config.args = vec!["2000".into()];
    let update = s.plan_job(changed).unwrap();
    let g = &update.groups[0];
    assert_eq!(
        (g.place, g.stop, g.update, g.in_place, g.keep),
        (4, 4, 4, 0, 0)
    );
    assert!(g.stops.iter().all(|st| st.reason == "job updated"));
    assert_eq!(
        update.diff.fields[0].path,
        "task_groups[g].tasks[t].config.args"
    );
    assert_eq!(live_allocs(s, "web").len(), 4, "the plan stopped nothing");
}

#[tokio::test]
async fn a_plan_blocked_on_a_plugin_says_why_for_each_node() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", false, false, false).await;
    register_data_volume(s).await;
    let before = s.index();
    let plan = s
        .plan_job(volume_job("db", "data", AccessMode::SingleNodeWriter))
        .unwrap();
    assert_eq!(s.index(), before);
    assert_eq!(plan.unplaced_allocs, 1);
    assert_eq!(plan.groups[0].unplaced, 1);
    assert_eq!(plan.groups[0].place, 0);
    assert!(!plan.allocs_change);
    assert_eq!(plan.placement_failures.len(), 1);
    assert!(
        plan.placement_failures[0]
            .contains("node n1: no healthy node plugin \"hostpath\" for volume \"data\""),
        "{:?}",
        plan.placement_failures
    );
}

#[tokio::test]
async fn enforce_index_refuses_a_stale_registration_naming_both_indexes() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;

    // 0: only a new job.
    let first = s
        .register_job_checked(job("web", JobType::Service, 1), Some(0))
        .await
        .unwrap();
    assert!(first.job_modify_index > 0);
    let err = s
        .register_job_checked(job("web", JobType::Service, 2), Some(0))
        .await
        .unwrap_err();
    assert!(matches!(err, ServerError::Conflict(_)), "{err:?}");
    assert_eq!(err.http_status(), 409);
    assert!(
        err.to_string()
            .contains(&format!("job modify index {}", first.job_modify_index)),
        "{err}"
    );

    // A status change (the alloc runs) does not move the index.
    let a = wait_for_live(s, "web").await;
    report(s, &a, AllocClientStatus::Running).await;
    assert_eq!(
        s.job("web").unwrap().job_modify_index,
        first.job_modify_index
    );

    let planned = s.plan_job(job("web", JobType::Service, 2)).unwrap();
    assert_eq!(planned.job_modify_index, first.job_modify_index);
    let second = s
        .register_job_checked(
            job("web", JobType::Service, 2),
            Some(planned.job_modify_index),
        )
        .await
        .unwrap();
    assert!(second.changed);
    assert!(second.job_modify_index > first.job_modify_index);

    // Planned against the first version, submitted after the second.
    let before = s.index();
    let err = s
        .register_job_checked(
            job("web", JobType::Service, 3),
            Some(first.job_modify_index),
        )
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&second.job_modify_index.to_string())
            && msg.contains(&first.job_modify_index.to_string()),
        "{msg}"
    );
    assert_eq!(s.index(), before, "a refused registration writes nothing");
    assert_eq!(s.job("web").unwrap().task_groups[0].count, 2);
}

#[tokio::test]
async fn a_purged_job_leaves_once_its_allocs_are_done() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    s.register_job(job("web", JobType::Service, 2))
        .await
        .unwrap();
    let allocs = live_allocs(s, "web");
    for a in &allocs {
        report(s, a, AllocClientStatus::Running).await;
    }

    s.stop_job_with("web", true).await.unwrap();
    let stopped = s.job("web").expect("kept while its allocs run");
    assert!(stopped.stop && stopped.purge);

    report(s, &allocs[0], AllocClientStatus::Complete).await;
    assert!(s.job("web").is_ok(), "one alloc still runs");
    report(s, &allocs[1], AllocClientStatus::Complete).await;
    wait_until("the purged job is gone", Duration::from_secs(10), || {
        s.job("web").is_err()
    })
    .await;
    assert!(
        s.allocation(&allocs[0].id).is_err(),
        "its allocs go with it"
    );

    // A new run of the same ID is a new job.
    let again = s
        .register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    assert_eq!(again.version, 0);
}

#[tokio::test]
async fn a_summary_counts_allocs_per_group_and_what_waits_to_be_placed() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    let mut small = node("n1");
    small.resources.memory_mb = 300; // two tasks of 128 MiB fit
    register(s, small).await;
    s.register_job(job("web", JobType::Service, 3))
        .await
        .unwrap();
    let allocs = live_allocs(s, "web");
    assert_eq!(allocs.len(), 2);
    report(s, &allocs[0], AllocClientStatus::Running).await;

    let sum = s.job_summary("web").unwrap();
    let g = sum.groups["g"];
    assert_eq!(
        (g.queued, g.starting, g.running, g.failed, g.complete, g.lost),
        (1, 1, 1, 0, 0, 0)
    );
}

#[tokio::test]
async fn job_ids_resolve_by_unique_prefix_and_an_ambiguous_one_lists_the_matches() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    for id in ["web-a", "web-b", "db"] {
        s.register_job(job(id, JobType::Service, 0)).await.unwrap();
    }
    assert_eq!(s.resolve_job_id("d").unwrap(), "db");
    assert_eq!(s.resolve_job_id("web-a").unwrap(), "web-a");
    let err = s.resolve_job_id("web").unwrap_err().to_string();
    assert!(
        err.contains("matches 2 jobs") && err.contains("\"web-a\", \"web-b\""),
        "{err}"
    );
    assert!(matches!(
        s.resolve_job_id("zzz"),
        Err(ServerError::NotFound(_))
    ));
    assert!(matches!(
        s.resolve_job_id(""),
        Err(ServerError::NotFound(_)) | Err(ServerError::BadRequest(_))
    ));
}

#[tokio::test]
async fn a_purged_job_stays_while_a_volume_claim_holds_one_of_its_allocs() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", true, false, false).await;
    let alloc = place_on_data(s, volume_job("db", "data", AccessMode::SingleNodeWriter)).await;
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", &alloc, AccessMode::SingleNodeWriter))
        .await
        .expect("claim");
    report(s, &alloc, AllocClientStatus::Running).await;

    s.stop_job_with("db", true).await.unwrap();
    report(s, &alloc, AllocClientStatus::Complete).await;
    // Done, but its claim is not released yet: the job and alloc stay,
    // even through a forced collection.
    let collected = s.garbage_collect(true).await.unwrap();
    assert!(
        collected.jobs.is_empty() && collected.allocs.is_empty(),
        "{collected:?}"
    );
    assert!(s.job("db").is_ok(), "a claimed alloc keeps its purged job");
    assert!(s.allocation(&alloc.id).is_ok());

    // The client unpublishes; the claim is freed, then the job goes.
    csi.unpublish(berth_proto::berth::v1::UnpublishRequest {
        volume_id: "data".into(),
        alloc_id: alloc.id.clone(),
        node_id: "n1".into(),
    })
    .await
    .expect("unpublish");
    wait_until("the purged job is gone", Duration::from_secs(10), || {
        s.job("db").is_err()
    })
    .await;
    assert!(s.allocation(&alloc.id).is_err());
    assert!(s.volume("data").unwrap().write_claims.is_empty());
}

#[tokio::test]
async fn a_job_keeps_its_last_six_versions_and_they_leave_with_it() {
    let ts = TestServer::start(|_| {}).await;
    let s = &ts.server;
    register(s, node("n1")).await;
    for count in 1..=8 {
        s.register_job(job("web", JobType::Service, count))
            .await
            .unwrap();
    }
    let versions = s.job_versions("web").unwrap();
    let numbers: Vec<u64> = versions.iter().map(|v| v.version).collect();
    assert_eq!(numbers, [7, 6, 5, 4, 3, 2], "newest first, six kept");
    assert_eq!(versions[0].job.task_groups[0].count, 8);
    assert_eq!(versions[0].diff.len(), 1, "{:?}", versions[0].diff);
    assert_eq!(versions[0].diff[0].path, "task_groups[g].count");
    assert!(versions[5].diff.is_empty(), "the oldest kept has no diff");

    // A revert submits a kept version's spec as a new version.
    let reverted = s.revert_job("web", 3, Some(7)).await.unwrap();
    assert_eq!(reverted.version, 8);
    assert_eq!(s.job("web").unwrap().task_groups[0].count, 4);
    let stale = s.revert_job("web", 3, Some(7)).await.unwrap_err();
    assert!(matches!(stale, ServerError::Conflict(_)), "{stale}");
    let gone = s.revert_job("web", 1, None).await.unwrap_err();
    assert!(
        gone.to_string().contains("kept: 3, 4, 5, 6, 7, 8"),
        "{gone}"
    );

    // Purged, the job takes its versions with it.
    let allocs = s.job_allocations("web").unwrap();
    s.stop_job_with("web", true).await.unwrap();
    for a in &allocs {
        report(s, a, AllocClientStatus::Complete).await;
    }
    wait_until("the purged job is gone", Duration::from_secs(10), || {
        s.job("web").is_err()
    })
    .await;
    s.register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    let fresh: Vec<u64> = s
        .job_versions("web")
        .unwrap()
        .iter()
        .map(|v| v.version)
        .collect();
    assert_eq!(
        fresh,
        [0],
        "a new job of the same ID starts its history anew"
    );
}
