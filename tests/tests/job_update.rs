//! Changing a running job, on one server and two clients: a count change
//! places or stops only the difference and leaves the other allocs (their
//! IDs, their task processes) alone; a change the tasks do not see (group
//! `meta`) moves the allocs to the new version in place, restarting
//! nothing; `job plan` says which kind of update a change is; `job scale`
//! changes a count the same way.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{logs, marked_job, marked_service_job, marker_pids, Client, Server};
use berth_tests::{cli_at, wait_for};
use serde_json::Value;

/// The IDs of the job's allocs that run and should, and its task PIDs,
/// once there are `n` of each.
fn running(server: &Server, job: &str, n: usize) -> Result<(BTreeSet<String>, BTreeSet<i32>)> {
    wait_for(
        &format!("{n} allocs of {job} running"),
        Duration::from_secs(30),
        || {
            let ids: BTreeSet<String> = server
                .allocs(job)?
                .iter()
                .filter(|a| a["desired_status"] == "run" && a["client_status"] == "running")
                .filter_map(|a| a["id"].as_str().map(String::from))
                .collect();
            let pids = marker_pids(job);
            Ok((ids.len() == n && pids.len() == n).then_some((ids, pids)))
        },
    )
}

fn cluster() -> Result<(Server, Client, Client)> {
    let mut server = Server::start("")?;
    let c1 = Client::start(&server, "u1", false, "")?;
    let c2 = Client::start(&server, "u2", false, "")?;
    server
        .wait_nodes_ready(&["u1", "u2"])
        .with_context(|| logs(&server, &[&c1, &c2]))?;
    Ok((server, c1, c2))
}

#[test]
fn count_changes_keep_the_running_allocs_and_stop_exactly_the_difference() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-count";
    server.run_job(job, &marked_service_job(job, 3, None, None))?;
    let (ids3, pids3) = running(&server, job, 3).with_context(|| logs(&server, &[&c1, &c2]))?;

    server.run_job(job, &marked_service_job(job, 5, None, None))?;
    let (ids5, pids5) = running(&server, job, 5).with_context(|| logs(&server, &[&c1, &c2]))?;
    assert!(ids3.is_subset(&ids5), "{ids3:?} not kept in {ids5:?}");
    assert!(pids3.is_subset(&pids5), "{pids3:?} not kept in {pids5:?}");

    server.run_job(job, &marked_service_job(job, 2, None, None))?;
    let (ids2, pids2) = running(&server, job, 2).with_context(|| logs(&server, &[&c1, &c2]))?;
    assert!(ids2.is_subset(&ids5), "{ids2:?} not kept from {ids5:?}");
    assert!(pids2.is_subset(&pids5), "{pids2:?} not kept from {pids5:?}");
    // Exactly three stopped, the highest indexes, for the count.
    let allocs = server.allocs(job)?;
    assert_eq!(allocs.len(), 5, "no alloc placed anew: {allocs:?}");
    let stopped: Vec<&Value> = allocs
        .iter()
        .filter(|a| a["desired_status"] == "stop")
        .collect();
    assert_eq!(stopped.len(), 3, "{allocs:?}");
    assert!(stopped
        .iter()
        .all(|a| a["desired_description"] == "count reduced" && a["index"].as_u64() >= Some(2)));
    // Every alloc left carries the job's last version.
    let version = server.get(&format!("/v1/job/{job}"))?["version"].clone();
    assert!(allocs
        .iter()
        .filter(|a| a["desired_status"] == "run")
        .all(|a| a["job"]["version"] == version));
    // `job scale` is the same count change: back to 3 through it.
    let out = server.cli(&["job", "scale", job, "g", "3"])?;
    assert!(out.contains("scaled to 3"), "{out}");
    let (ids3b, pids3b) = running(&server, job, 3)?;
    assert!(ids2.is_subset(&ids3b) && pids2.is_subset(&pids3b));
    // A group the job does not have, and a stopped job, are refused.
    let bad = cli_at(&server.addr(), &["job", "scale", job, "nope", "1"])?;
    assert_ne!(bad.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("has no group \"nope\" (its groups: g)"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    server.stop_marked_job(job)?;
    let stopped = cli_at(&server.addr(), &["job", "scale", job, "4"])?;
    assert!(
        String::from_utf8_lossy(&stopped.stderr).contains("is stopped: run it to scale it"),
        "{}",
        String::from_utf8_lossy(&stopped.stderr)
    );
    Ok(())
}

#[test]
fn a_group_meta_change_moves_the_allocs_version_and_restarts_nothing() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-meta";
    let with_meta = |tier: &str| {
        marked_job(
            job,
            "service",
            2,
            &format!("meta {{\n tier = \"{tier}\"\n }}"),
            None,
        )
    };
    server.run_job(job, &with_meta("bronze"))?;
    let (ids, pids) = running(&server, job, 2).with_context(|| logs(&server, &[&c1, &c2]))?;

    // The plan says so before anything changes.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("meta.hcl");
    std::fs::write(&file, with_meta("gold"))?;
    let plan = cli_at(
        &server.addr(),
        &["job", "plan", file.to_str().context("UTF-8")?],
    )?;
    let text = String::from_utf8_lossy(&plan.stdout);
    assert_eq!(plan.status.code(), Some(1), "{text}");
    assert!(text.contains("2 in-place update"), "{text}");
    assert!(!text.contains("destroy"), "{text}");

    server.run_job(job, &with_meta("gold"))?;
    let version = server.get(&format!("/v1/job/{job}"))?["version"].clone();
    assert_eq!(version, 1);
    wait_for(
        "the allocs on the new version",
        Duration::from_secs(30),
        || {
            let allocs = server.allocs(job)?;
            Ok(allocs
                .iter()
                .all(|a| {
                    a["job"]["version"] == version
                        && a["job"]["task_groups"][0]["meta"]["tier"] == "gold"
                })
                .then_some(allocs))
        },
    )?;
    let (after, pids_after) = running(&server, job, 2)?;
    assert_eq!(after, ids, "the allocs were replaced");
    assert_eq!(pids_after, pids, "the tasks restarted");
    assert_eq!(server.allocs(job)?.len(), 2, "an alloc was placed anew");
    server.stop_marked_job(job)?;
    Ok(())
}

#[test]
fn history_lists_the_versions_with_their_diffs_and_revert_runs_an_old_one() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-hist";
    let spec = |count: u32, tier: &str| {
        marked_job(
            job,
            "service",
            count,
            &format!("meta {{\n tier = \"{tier}\"\n }}"),
            None,
        )
    };
    server.run_job(job, &spec(2, "bronze"))?;
    let (ids, pids) = running(&server, job, 2).with_context(|| logs(&server, &[&c1, &c2]))?;
    server.run_job(job, &spec(2, "gold"))?;
    server.run_job(job, &spec(3, "gold"))?;
    running(&server, job, 3)?;

    let history = server.cli(&["job", "history", "-p", job])?;
    let at = |v: &str| history.find(&format!("Version     = {v}\n"));
    let (v2, v1, v0) = (at("2"), at("1"), at("0"));
    assert!(
        v2 < v1 && v1 < v0 && v0.is_some(),
        "newest first:\n{history}"
    );
    assert!(
        history.contains("~ task_groups[g].count: 2 => 3"),
        "{history}"
    );
    assert!(
        history.contains("~ task_groups[g].meta.tier: \"bronze\" => \"gold\""),
        "{history}"
    );
    let old = server.cli(&["job", "inspect", "-version", "0", job])?;
    let old: Value = serde_json::from_str(&old)?;
    assert_eq!(old["task_groups"][0]["meta"]["tier"], "bronze", "{old}");

    // Back to version 0: a new version (3) with its spec, which the
    // allocs take in place; the one the count added stops.
    let out = server.cli(&["job", "revert", job, "0"])?;
    assert!(out.contains("now version 3"), "{out}");
    let (after, pids_after) = running(&server, job, 2)?;
    assert_eq!(after, ids, "the first two allocs were kept");
    assert_eq!(pids_after, pids, "their tasks were kept");
    let stored = server.get(&format!("/v1/job/{job}"))?;
    assert_eq!(stored["version"], 3);
    assert_eq!(stored["task_groups"][0]["meta"]["tier"], "bronze");
    // A version not kept is named as such.
    let none = cli_at(&server.addr(), &["job", "revert", job, "9"])?;
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("has no version 9 kept (kept: 0, 1, 2, 3)"),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
    server.stop_marked_job(job)?;
    Ok(())
}

#[test]
fn a_rolling_update_keeps_all_but_max_parallel_running() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-rolling";
    let update = "update {\n max_parallel = 1\n min_healthy_time = \"2s\"\n }";
    let v1 = marked_job(job, "service", 4, update, None);
    server.run_job(job, &v1)?;
    running(&server, job, 4).with_context(|| logs(&server, &[&c1, &c2]))?;

    // A destructive change (the task's args): one alloc at a time, the
    // next once the new one ran for 2 s; `job run` follows it to the end.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("v2.hcl");
    std::fs::write(&file, v1.replace("sleep 0.2", "sleep 0.3"))?;
    let file = file.to_str().context("UTF-8")?;
    let mut least = usize::MAX;
    let mut samples = 0;
    let (run, rolled) = std::thread::scope(|s| {
        let run = s.spawn(|| cli_at(&server.addr(), &["job", "run", file]));
        let rolled = wait_for(
            "four allocs of version 1 running",
            Duration::from_secs(90),
            || {
                let allocs = server.allocs(job)?;
                let serving =
                    |a: &&Value| a["desired_status"] == "run" && a["client_status"] == "running";
                least = least.min(allocs.iter().filter(serving).count());
                samples += 1;
                let new = allocs
                    .iter()
                    .filter(serving)
                    .filter(|a| a["job"]["version"] == 1)
                    .count();
                std::thread::sleep(Duration::from_millis(100));
                Ok((new == 4).then_some(()))
            },
        );
        (run.join(), rolled)
    });
    rolled.with_context(|| logs(&server, &[&c1, &c2]))?;
    let run = run.map_err(|_| anyhow::anyhow!("job run panicked"))??;
    let text = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(0), "{text}");
    assert!(text.contains("is done: 4 allocs running"), "{text}");
    assert!(least >= 3, "{least} allocs running at one sample");
    assert!(samples > 20, "only {samples} samples");
    // The old ones were replaced one by one: four stopped, four placed.
    let allocs = server.allocs(job)?;
    assert_eq!(allocs.len(), 8, "{allocs:?}");
    // Each version was a deployment; the last one succeeded once its
    // four allocs were healthy, and `job status` shows it.
    let latest = deployment_of(&server, job, 1, "successful")?;
    assert_eq!(latest["groups"]["g"]["healthy_allocs"], 4, "{latest}");
    let status = server.cli(&["job", "status", job])?;
    assert!(
        status.contains("Latest Deployment") && status.contains("successful"),
        "{status}"
    );
    let list = server.cli(&["deployment", "list"])?;
    assert!(
        list.lines()
            .any(|l| l.contains(job) && l.contains("successful")),
        "{list}"
    );
    server.stop_marked_job(job)?;
    Ok(())
}

/// The newest deployment of `job`, once it is of `version` and `status`.
fn deployment_of(server: &Server, job: &str, version: u64, status: &str) -> Result<Value> {
    wait_for(
        &format!("the deployment of {job} version {version} {status}"),
        Duration::from_secs(60),
        || {
            let d = server.get(&format!("/v1/job/{job}/deployment"))?;
            Ok((d["job_version"] == version && d["status"] == status).then_some(d))
        },
    )
}

#[test]
fn a_failing_update_with_auto_revert_goes_back_to_the_stable_version() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-revert";
    let update = "update {\n max_parallel = 1\n min_healthy_time = \"1s\"\n auto_revert = true\n }";
    let v0 = marked_job(job, "service", 2, update, None);
    server.run_job(job, &v0)?;
    deployment_of(&server, job, 0, "successful").with_context(|| logs(&server, &[&c1, &c2]))?;
    let history = server.cli(&["job", "history", job])?;
    assert!(
        history.contains("Version     = 0\nStable      = true"),
        "{history}"
    );

    // Version 1's task exits at once: its first alloc fails, the
    // deployment fails, and the job goes back to version 0's spec as
    // version 2, which deploys.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("v1.hcl");
    std::fs::write(&file, v0.replace("while :; do sleep 0.2; done", "exit 3"))?;
    let run = cli_at(
        &server.addr(),
        &["job", "run", file.to_str().context("UTF-8")?],
    )?;
    assert_eq!(
        run.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );
    deployment_of(&server, job, 2, "successful").with_context(|| {
        let all = server.get(&format!("/v1/job/{job}/deployments"));
        let allocs = server.allocs(job);
        format!("{all:#?}\n{allocs:#?}\n{}", logs(&server, &[&c1, &c2]))
    })?;
    let stored = server.get(&format!("/v1/job/{job}"))?;
    assert_eq!(stored["version"], 2);
    assert_eq!(
        stored["task_groups"][0]["tasks"][0]["config"]["args"][1],
        "while :; do sleep 0.2; done"
    );
    running(&server, job, 2)?;
    let failed = server.get(&format!("/v1/job/{job}/deployments"))?;
    let failed = failed
        .as_array()
        .and_then(|all| all.iter().find(|d| d["job_version"] == 1))
        .cloned()
        .context("the deployment of version 1")?;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["reverted_to"], 0, "{failed}");
    let id = failed["id"].as_str().context("an ID")?;
    let shown = server.cli(&["deployment", "status", &id[..8]])?;
    assert!(
        shown.contains("Failed due to unhealthy allocations; rolling back to job version 0"),
        "{shown}"
    );
    // Only a running deployment can be failed.
    let again = cli_at(&server.addr(), &["deployment", "fail", id])?;
    assert_ne!(again.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("only a running deployment can be failed"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    server.stop_marked_job(job)?;
    Ok(())
}

#[test]
fn deployment_fail_halts_a_rolling_update() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-fail";
    // Each new alloc must run 5 minutes to be healthy: the roll waits
    // after the first one.
    let update = "update {\n max_parallel = 1\n min_healthy_time = \"5m\"\n healthy_deadline = \"10m\"\n progress_deadline = \"15m\"\n }";
    let v0 = marked_job(job, "service", 3, "", None);
    server.run_job(job, &v0)?;
    running(&server, job, 3).with_context(|| logs(&server, &[&c1, &c2]))?;
    let v1 = marked_job(job, "service", 3, update, None).replace("sleep 0.2", "sleep 0.3");
    server.run_job(job, &v1)?;
    let d = deployment_of(&server, job, 1, "running")?;
    let id = d["id"].as_str().context("an ID")?;
    let out = server.cli(&["deployment", "fail", id])?;
    assert!(out.contains("Deployment marked as failed"), "{out}");
    deployment_of(&server, job, 1, "failed")?;
    // The roll stopped where it was: one alloc of version 1, two of
    // version 0, all running, and nothing replaces them.
    let (ids, _) = running(&server, job, 3)?;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(200));
        let allocs = server.allocs(job)?;
        let live = |v: u64| {
            allocs
                .iter()
                .filter(|a| a["desired_status"] == "run" && a["job"]["version"] == v)
                .count()
        };
        assert_eq!((live(0), live(1)), (2, 1), "{allocs:?}");
    }
    assert_eq!(running(&server, job, 3)?.0, ids);
    server.stop_marked_job(job)?;
    Ok(())
}

#[test]
fn a_canary_update_waits_for_deployment_promote() -> Result<()> {
    let (server, c1, c2) = cluster()?;
    let job = "upd-canary";
    let update = "update {\n max_parallel = 1\n canary = 1\n min_healthy_time = \"1s\"\n }";
    let v0 = marked_job(job, "service", 3, update, None);
    server.run_job(job, &v0)?;
    deployment_of(&server, job, 0, "successful").with_context(|| logs(&server, &[&c1, &c2]))?;

    // A destructive change: one canary of version 1 beside the three
    // allocs of version 0; `job run` says it waits for a promotion.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("v1.hcl");
    std::fs::write(&file, v0.replace("sleep 0.2", "sleep 0.3"))?;
    let run = cli_at(
        &server.addr(),
        &["job", "run", file.to_str().context("UTF-8")?],
    )?;
    let text = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(0), "{text}");
    assert!(text.contains("berth deployment promote"), "{text}");
    let (ids, _) = running(&server, job, 4).with_context(|| logs(&server, &[&c1, &c2]))?;
    let d = deployment_of(&server, job, 1, "running")?;
    assert_eq!(
        d["groups"]["g"]["placed_canaries"].as_array().map(Vec::len),
        Some(1)
    );
    let status = server.cli(&["deployment", "status", d["id"].as_str().context("an ID")?])?;
    assert!(
        status.contains("requires manual promotion") && status.contains("Promoted"),
        "{status}"
    );
    // Nothing moves until the promotion.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(running(&server, job, 4)?.0, ids);

    let out = server.cli(&["deployment", "promote", d["id"].as_str().context("an ID")?])?;
    assert!(out.contains("promoted"), "{out}");
    deployment_of(&server, job, 1, "successful").with_context(|| logs(&server, &[&c1, &c2]))?;
    let allocs = server.allocs(job)?;
    let live: Vec<&Value> = allocs
        .iter()
        .filter(|a| a["desired_status"] == "run")
        .collect();
    assert_eq!(live.len(), 3, "{allocs:?}");
    assert!(live.iter().all(|a| a["job"]["version"] == 1), "{live:?}");
    // The canary was kept: three placed for version 1 in all.
    assert_eq!(allocs.len(), 6, "{allocs:?}");
    let canary = d["groups"]["g"]["placed_canaries"][0]
        .as_str()
        .context("the canary")?;
    let shown = server.cli(&["alloc", "status", canary])?;
    assert!(
        shown.contains("Canary") && shown.contains("Deployment Health   = healthy"),
        "{shown}"
    );
    server.stop_marked_job(job)?;
    Ok(())
}
