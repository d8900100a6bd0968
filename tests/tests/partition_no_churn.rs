//! A short partition restarts nothing: one `berth agent -server`, two
//! clients, the first behind a relay the test partitions silently (bytes
//! dropped, no connection closed) for 20 s, well past TTL + grace.
//!
//! - A system job and a service job with `disconnect { lost_after = "1m",
//!   replace = false }` on the partitioned node: the servers show their
//!   allocs `unknown` while it is down; after the heal the same tasks run
//!   (same PIDs), and no alloc was stopped or created.
//! - With `replace = true`: the replacement runs on the other node during
//!   the partition; after the heal `reconcile = "keep_original"` stops the
//!   replacement and `keep_replacement` the original.
//! - After a heal, a reader submitted during the partition and the
//!   replacement of a lost writer run on the healed node, whether its
//!   plugin alloc was held (the default) or replaced with them
//!   (`default_lost_after = "0s"`): none fails for a plugin gap.
//! - Writers of single-node-writer volumes with `replace = true`: without
//!   `stop_on_client_after` the unknown writer keeps its claim and no
//!   replacement runs; with `stop_on_client_after = "5s"` the replacement
//!   runs only after the window (+ grace), and a sampler never sees two
//!   writers of one volume.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use berth_tests::cluster::{
    ids, logs, marked_job, marked_reader_job, marker_pids, node_of, pid_alive, shared_plugin_job,
    with_status, write_claims, writer_volume, Client, Server,
};
use berth_tests::sampler::Sampler;
use berth_tests::wait_for;
use serde_json::Value;

/// A node is down 4–5 s after its last heartbeat.
const SERVER_BLOCK: &str = r#"min_heartbeat_ttl = "2s"
  heartbeat_grace = "2s""#;
const PARTITION: Duration = Duration::from_secs(20);

fn disconnect(replace: bool, reconcile: &str) -> String {
    format!(
        r#"disconnect {{
      lost_after = "1m"
      replace    = {replace}
      reconcile  = "{reconcile}"
    }}"#
    )
}

/// The IDs and desired statuses of `job`'s allocs.
fn allocs_of(server: &Server, job: &str) -> Result<BTreeSet<(String, String)>> {
    Ok(server
        .allocs(job)?
        .iter()
        .map(|a| {
            (
                a["id"].as_str().unwrap_or_default().to_string(),
                a["desired_status"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect())
}

/// One server and p1 (behind the relay), `jobs` (name, type, group HCL)
/// running there, then p2; the cluster and p1's node ID.
fn cluster_with(jobs: &[(&str, &str, String)]) -> Result<(Server, Client, Client, String)> {
    let mut server = Server::start(SERVER_BLOCK)?;
    let c1 = Client::start(&server, "p1", true, r#"disconnect_startup_grace = "1s""#)?;
    let p1 = server.wait_nodes_ready(&["p1"])?.remove(0);
    for (job, job_type, extra) in jobs {
        server.run_job(job, &marked_job(job, job_type, 1, extra, None))?;
    }
    wait_for("every task running on p1", Duration::from_secs(60), || {
        for (job, _, _) in jobs {
            let running = server
                .allocs(job)?
                .iter()
                .filter(|a| a["client_status"] == "running")
                .count();
            if running != 1 || marker_pids(job).len() != 1 {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .with_context(|| server.agent.log())?;
    let c2 = Client::start(&server, "p2", false, "")?;
    server.wait_nodes_ready(&["p2"])?;
    Ok((server, c1, c2, p1))
}

/// Partitions p1 until `PARTITION` has passed, calling `during` each
/// half second once p1 is down, then heals and waits for p1 to be ready.
fn partition_p1(
    server: &mut Server,
    c1: &Client,
    c2: &Client,
    mut during: impl FnMut(&Server) -> Result<()>,
) -> Result<()> {
    let t0 = Instant::now();
    c1.relay()?.partition();
    wait_for("p1 marked down", Duration::from_secs(30), || {
        Ok((server.node("p1")?["status"] == "down").then_some(()))
    })
    .with_context(|| logs(server, &[c1, c2]))?;
    while t0.elapsed() < PARTITION {
        during(server).with_context(|| logs(server, &[c1, c2]))?;
        std::thread::sleep(Duration::from_millis(500));
    }
    c1.relay()?.heal();
    server
        .wait_nodes_ready(&["p1"])
        .with_context(|| logs(server, &[c1, c2]))?;
    Ok(())
}

#[test]
fn a_partition_shorter_than_lost_after_restarts_nothing() -> Result<()> {
    let jobs = [
        ("sys", "system", String::new()),
        ("kept", "service", disconnect(false, "best_score")),
    ];
    let (mut server, c1, c2, p1) = cluster_with(&jobs)?;
    // The system job runs on p2 too now; p1's task is the one from before.
    wait_for("sys on both nodes", Duration::from_secs(30), || {
        Ok((marker_pids("sys").len() == 2).then_some(()))
    })?;
    let sys_on_p1: Vec<Value> = server
        .allocs("sys")?
        .into_iter()
        .filter(|a| node_of(a) == p1)
        .collect();
    ensure!(sys_on_p1.len() == 1, "{sys_on_p1:?}");
    let pids_before: BTreeSet<i32> = marker_pids("sys")
        .into_iter()
        .chain(marker_pids("kept"))
        .collect();
    let allocs_before = (allocs_of(&server, "sys")?, allocs_of(&server, "kept")?);

    let mut seen_unknown = BTreeSet::new();
    partition_p1(&mut server, &c1, &c2, |server| {
        for job in ["sys", "kept"] {
            for a in server.allocs(job)? {
                if node_of(&a) == p1 && a["client_status"] == "unknown" {
                    seen_unknown.insert(job);
                }
            }
            ensure!(
                marker_pids(job).len() == if job == "sys" { 2 } else { 1 },
                "{job}: no task stopped or started during the partition"
            );
        }
        Ok(())
    })?;
    ensure!(
        seen_unknown == BTreeSet::from(["sys", "kept"]),
        "the servers showed p1's allocs unknown during the partition: {seen_unknown:?}"
    );

    wait_for(
        "p1's allocs running again on the servers",
        Duration::from_secs(20),
        || {
            let all: Vec<Value> = ["sys", "kept"]
                .iter()
                .map(|j| server.allocs(j))
                .collect::<Result<Vec<_>>>()?
                .concat();
            Ok(all
                .iter()
                .all(|a| a["client_status"] == "running")
                .then_some(()))
        },
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    // A few seconds for anything that would restart a task to do so.
    let settle = Instant::now() + Duration::from_secs(5);
    while Instant::now() < settle {
        for pid in &pids_before {
            ensure!(pid_alive(*pid), "task {pid} was stopped after the heal");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let pids_after: BTreeSet<i32> = marker_pids("sys")
        .into_iter()
        .chain(marker_pids("kept"))
        .collect();
    ensure!(
        pids_after == pids_before,
        "the same tasks run: {pids_before:?} then {pids_after:?}"
    );
    let allocs_after = (allocs_of(&server, "sys")?, allocs_of(&server, "kept")?);
    ensure!(
        allocs_after == allocs_before,
        "no alloc stopped or created: {allocs_before:?} then {allocs_after:?}"
    );
    Ok(())
}

#[test]
fn reconcile_keeps_the_original_or_the_replacement_after_the_heal() -> Result<()> {
    let jobs = [
        ("orig", "service", disconnect(true, "keep_original")),
        ("repl", "service", disconnect(true, "keep_replacement")),
    ];
    let (mut server, c1, c2, _p1) = cluster_with(&jobs)?;
    let original = |job: &str| -> Result<i32> {
        marker_pids(job)
            .into_iter()
            .next()
            .with_context(|| format!("{job} runs"))
    };
    let (orig_old, repl_old) = (original("orig")?, original("repl")?);

    // Both replacements run on p2 during the partition.
    let new_pid =
        |job: &str, old: i32| -> Option<i32> { marker_pids(job).into_iter().find(|p| *p != old) };
    let (mut orig_new, mut repl_new) = (None, None);
    partition_p1(&mut server, &c1, &c2, |_| {
        orig_new = orig_new.or(new_pid("orig", orig_old));
        repl_new = repl_new.or(new_pid("repl", repl_old));
        Ok(())
    })?;
    let (orig_new, repl_new) = orig_new.zip(repl_new).with_context(|| {
        format!(
            "both replacements ran during the partition\n{}",
            logs(&server, &[&c1, &c2])
        )
    })?;

    wait_for(
        "keep_original stops the replacement, keep_replacement the original",
        Duration::from_secs(30),
        || Ok((!pid_alive(orig_new) && !pid_alive(repl_old)).then_some(())),
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    ensure!(pid_alive(orig_old), "keep_original: the original runs on");
    ensure!(
        pid_alive(repl_new),
        "keep_replacement: the replacement runs on"
    );
    for job in ["orig", "repl"] {
        let live = server
            .allocs(job)?
            .into_iter()
            .filter(|a| a["desired_status"] == "run")
            .count();
        ensure!(live == 1, "{job}: one alloc left desired run, not {live}");
    }
    Ok(())
}

#[test]
fn an_unknown_writer_and_its_replacement_never_run_at_once() -> Result<()> {
    let shared_state = tempfile::tempdir()?;
    let mut server = Server::start(SERVER_BLOCK)?;
    let c1 = Client::start(&server, "p1", true, r#"disconnect_startup_grace = "1s""#)?;
    server.wait_nodes_ready(&["p1"])?;
    server.run_job("plugin", &shared_plugin_job(shared_state.path())?)?;
    server
        .wait_plugin_nodes(1)
        .with_context(|| server.agent.log())?;
    server.create_volume("vol-w", &writer_volume("vol-w"))?;
    server.create_volume("vol-n", &writer_volume("vol-n"))?;
    let windowed = r#"disconnect {
      lost_after           = "1m"
      replace              = true
      stop_on_client_after = "5s"
    }"#;
    server.run_job(
        "win",
        &marked_job("win", "service", 1, windowed, Some("vol-w")),
    )?;
    let plain = disconnect(true, "best_score");
    server.run_job(
        "nowin",
        &marked_job("nowin", "service", 1, &plain, Some("vol-n")),
    )?;
    wait_for(
        "both writers running on p1",
        Duration::from_secs(60),
        || {
            for job in ["win", "nowin"] {
                let running = with_status(&server.allocs(job)?, "running").len();
                if running != 1 || marker_pids(job).len() != 1 {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .with_context(|| server.agent.log())?;
    let c2 = Client::start(&server, "p2", false, "")?;
    let p2 = server.wait_nodes_ready(&["p2"])?.remove(0);
    server
        .wait_plugin_nodes(2)
        .with_context(|| logs(&server, &[&c1, &c2]))?;
    let nowin_alloc = ids(&with_status(&server.allocs("nowin")?, "running"));
    let nowin_pid = *marker_pids("nowin").first().context("nowin runs")?;
    let win_pid = *marker_pids("win").first().context("win runs")?;
    let win_alloc = ids(&with_status(&server.allocs("win")?, "running"));

    let sampler = Sampler::start(&["win", "nowin"]);
    let mut last_heartbeat_ms = 0;
    let mut replacement: Option<Value> = None;
    partition_p1(&mut server, &c1, &c2, |server| {
        if last_heartbeat_ms == 0 {
            last_heartbeat_ms = server.node("p1")?["last_heartbeat_ms"]
                .as_i64()
                .unwrap_or_default();
        }
        // Without a window: the unknown writer keeps its claim and runs
        // on; no replacement runs.
        ensure!(
            write_claims(&server.volume("vol-n")?) == nowin_alloc,
            "vol-n's write claim stays with the unknown writer"
        );
        ensure!(
            marker_pids("nowin") == BTreeSet::from([nowin_pid]),
            "only the unknown nowin writer runs"
        );
        if replacement.is_none() {
            replacement = server
                .allocs("win")?
                .into_iter()
                .find(|a| node_of(a) == p2 && a["client_status"] == "running");
        }
        Ok(())
    })?;
    let replacement = replacement.with_context(|| {
        format!(
            "win's replacement ran on p2 during the partition\n{}",
            logs(&server, &[&c1, &c2])
        )
    })?;
    let placed_at = replacement["create_time_ms"].as_i64().unwrap_or_default();
    ensure!(
        placed_at >= last_heartbeat_ms + 5_000 + 2_000,
        "win's replacement was placed {} ms after p1's last heartbeat, before window + grace",
        placed_at - last_heartbeat_ms
    );
    ensure!(!pid_alive(win_pid), "p1 stopped win's writer by itself");

    // After the heal: the nowin writer runs on, the stopped win alloc is
    // stopped on the servers too, its replacement runs on.
    let replacement_id = replacement["id"].as_str().unwrap_or_default().to_string();
    wait_for(
        "win's original stopped on the servers, and its client says so",
        Duration::from_secs(30),
        || {
            let allocs = server.allocs("win")?;
            let original_done = allocs
                .iter()
                .filter(|a| win_alloc.contains(a["id"].as_str().unwrap_or_default()))
                .all(|a| {
                    a["desired_status"] == "stop"
                        && matches!(a["client_status"].as_str(), Some("complete" | "failed"))
                });
            Ok(original_done.then_some(()))
        },
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    let settle = Instant::now() + Duration::from_secs(5);
    while Instant::now() < settle {
        ensure!(
            pid_alive(nowin_pid),
            "the nowin writer was stopped after the heal"
        );
        let running = ids(&with_status(&server.allocs("win")?, "running"));
        ensure!(
            running == BTreeSet::from([replacement_id.clone()]) && marker_pids("win").len() == 1,
            "only win's replacement runs after the heal: {running:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    ensure!(
        write_claims(&server.volume("vol-w")?) == BTreeSet::from([replacement_id]),
        "only win's replacement holds vol-w"
    );
    let most = sampler.with(|s| s.most_alive.clone());
    for job in ["win", "nowin"] {
        ensure!(
            most.get(job).copied().unwrap_or_default() <= 1,
            "two {job} writers ran at once: {most:?}"
        );
    }
    Ok(())
}

/// The plugin-gap case: p1 runs the shipped plugin job and a volume's
/// writer; it is partitioned past TTL + grace, a reader of the volume is
/// submitted meanwhile, and it heals. The reader and the writer's
/// replacement run on p1 and nothing fails with the plugin "not
/// registered" — whether the plugin alloc is held unknown and resumes
/// (the default) or, with `default_lost_after = "0s"`, is lost and
/// replaced together with the volume's users.
fn heal_with_volume_users(server_extra: &str) -> Result<()> {
    let block = format!("{SERVER_BLOCK}\n  {server_extra}");
    let mut server = Server::start(&block)?;
    let c1 = Client::start(&server, "p1", true, r#"disconnect_startup_grace = "1s""#)?;
    server.wait_nodes_ready(&["p1"])?;
    let shipped = std::fs::read_to_string(berth_tests::example("jobs/hostpath-plugin.hcl"))?;
    server.run_job("plugin", &shipped)?;
    server
        .wait_plugin_nodes(1)
        .with_context(|| server.agent.log())?;
    server.create_volume("v1", &writer_volume("v1"))?;
    server.run_job(
        "writer",
        &marked_job("writer", "service", 1, "", Some("v1")),
    )?;
    wait_for("the writer running", Duration::from_secs(60), || {
        Ok((with_status(&server.allocs("writer")?, "running").len() == 1).then_some(()))
    })
    .with_context(|| logs(&server, &[&c1]))?;

    c1.relay()?.partition();
    wait_for("p1 marked down", Duration::from_secs(30), || {
        Ok((server.node("p1")?["status"] == "down").then_some(()))
    })
    .with_context(|| logs(&server, &[&c1]))?;
    server.run_job("reader", &marked_reader_job("reader", "v1"))?;
    wait_for("the reader waiting for p1", Duration::from_secs(10), || {
        let job = server.get("/v1/job/reader")?;
        Ok(job["placement_failures"]
            .as_array()
            .is_some_and(|f| !f.is_empty())
            .then_some(()))
    })?;
    c1.relay()?.heal();
    server
        .wait_nodes_ready(&["p1"])
        .with_context(|| logs(&server, &[&c1]))?;

    wait_for(
        "the reader and the writer running on p1",
        Duration::from_secs(90),
        || {
            for job in ["reader", "writer"] {
                let allocs = server.allocs(job)?;
                if let Some(f) = allocs.iter().find(|a| a["client_status"] == "failed") {
                    anyhow::bail!("{job} failed: {f}");
                }
                if with_status(&allocs, "running").is_empty() {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .with_context(|| logs(&server, &[&c1]))?;
    let client_log = c1.agent.log();
    ensure!(
        !client_log.contains("is not registered on this node"),
        "a mount found no plugin:\n{client_log}"
    );
    Ok(())
}

#[test]
fn after_a_heal_the_volume_users_run_with_the_plugin_held() -> Result<()> {
    heal_with_volume_users("")
}

#[test]
fn after_a_heal_the_volume_users_wait_for_a_replaced_plugin() -> Result<()> {
    heal_with_volume_users(r#"default_lost_after = "0s""#)
}
