//! Faults of a cluster of separate processes: one `berth agent -server`,
//! two `berth agent -client`, the first client behind a relay the test
//! partitions silently (bytes dropped, no connection closed); a client
//! restarted during a partition; a server paused and restarted.
//!
//! The promises under test (DESIGN.md, "Heartbeats and partitions"): a
//! partitioned node stops its `stop_after_client_disconnect` allocs by
//! itself, promptly, together, and unmounts their volumes; allocs without
//! a window keep running; the server marks the node down after TTL +
//! grace and replaces the window alloc no earlier than last heartbeat +
//! window + grace; a write claim of a lost alloc without a window is kept
//! while the partition lasts; at no moment do two writers run; on heal the
//! node is ready again and stops what was replaced, and only the
//! replacement holds the write claim.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use berth_tests::cluster::{
    ids, logs, marked_service_job, marker_pids, node_of, pid_alive, shared_plugin_job, with_status,
    write_claims, writer_volume, Client, Server,
};
use berth_tests::sampler::Sampler;
use berth_tests::wait_for;
use serde_json::Value;

/// Server timings short enough for a test, long enough for a busy
/// 2-core machine: a node is down 4–5 s after its last heartbeat.
const SERVER_BLOCK: &str = r#"min_heartbeat_ttl = "2s"
  heartbeat_grace = "2s""#;
const GRACE_MS: i64 = 2_000;
const MIN_TTL_MS: i64 = 2_000;
const WINDOW_MS: i64 = 5_000;

/// Done-when 2, 3 and 4: a silent partition of one client, its window
/// allocs stopped by the client itself, the node marked down, the window
/// alloc replaced on the other node no earlier than the rule, the write
/// claim of a lost alloc without a window kept, and the heal.
#[test]
fn a_silent_partition_stops_window_allocs_on_time_and_never_runs_two_writers() -> Result<()> {
    let shared_state = tempfile::tempdir()?;
    let mut server = Server::start(SERVER_BLOCK)?;
    // A short startup grace: the partition comes soon after the start.
    let c1 = Client::start(&server, "p1", true, r#"disconnect_startup_grace = "1s""#)?;
    server.wait_nodes_ready(&["p1"])?;
    server.run_job("plugin", &shared_plugin_job(shared_state.path())?)?;
    server
        .wait_plugin_nodes(1)
        .with_context(|| logs(&server, &[&c1]))?;
    server.create_volume("vol-a", &writer_volume("vol-a"))?;
    server.create_volume("vol-b", &writer_volume("vol-b"))?;

    // Everything is placed on p1, the only node so far.
    let jobs = [
        ("guarded", 1, Some("5s"), Some("vol-a")),
        ("holder", 1, None, Some("vol-b")),
        ("steady", 1, None, None),
        ("fifty", 50, Some("5s"), None),
    ];
    for (job, count, window, volume) in jobs {
        server.run_job(job, &marked_service_job(job, count, window, volume))?;
    }
    wait_for("every task running on p1", Duration::from_secs(90), || {
        for (job, count, _, _) in jobs {
            let running = with_status(&server.allocs(job)?, "running").len();
            if running != count as usize || marker_pids(job).len() != count as usize {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .with_context(|| logs(&server, &[&c1]))?;
    let guarded_old = ids(&with_status(&server.allocs("guarded")?, "running"));
    let holder_old = ids(&with_status(&server.allocs("holder")?, "running"));
    let steady_pid = *marker_pids("steady").first().context("steady runs")?;
    let fifty_pids = marker_pids("fifty");
    let guarded_pid = *marker_pids("guarded").first().context("guarded runs")?;
    let guarded_alloc = guarded_old.first().cloned().context("a guarded alloc")?;
    ensure!(
        !c1.mounts_with(&guarded_alloc).is_empty(),
        "vol-a is mounted for the guarded alloc on p1"
    );

    // The second node joins; the plugin runs there too.
    let c2 = Client::start(&server, "p2", false, "")?;
    let c2_id = server.wait_nodes_ready(&["p2"])?.remove(0);
    server
        .wait_plugin_nodes(2)
        .with_context(|| logs(&server, &[&c1, &c2]))?;

    let sampler = Sampler::start(&["guarded", "holder", "fifty", "steady"]);
    let t0 = Instant::now();
    c1.relay()?.partition();

    // p1 stops its window alloc and unmounts its volume by itself.
    wait_for(
        "the guarded task stopped and vol-a unmounted on p1",
        Duration::from_secs(20),
        || Ok((!pid_alive(guarded_pid) && c1.mounts_with(&guarded_alloc).is_empty()).then_some(())),
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    let stopped_after = t0.elapsed();
    ensure!(
        stopped_after <= Duration::from_millis(6_500),
        "the window alloc stopped and unmounted {stopped_after:?} after the partition (limit 6.5 s)\n{}",
        logs(&server, &[&c1, &c2])
    );

    // The fifty window allocs stop within one second of each other.
    wait_for("all fifty stopped", Duration::from_secs(20), || {
        Ok(fifty_pids.iter().all(|p| !pid_alive(*p)).then_some(()))
    })?;
    std::thread::sleep(Duration::from_millis(100));
    let spread = sampler.with(|s| {
        let times: Vec<Instant> = fifty_pids
            .iter()
            .filter_map(|p| s.gone_at.get(p).copied())
            .collect();
        (
            times.len(),
            times.iter().max().copied(),
            times.iter().min().copied(),
        )
    });
    match spread {
        (50, Some(last), Some(first)) => ensure!(
            last.duration_since(first) <= Duration::from_secs(1),
            "the fifty window allocs stopped {:?} apart (limit 1 s)",
            last.duration_since(first)
        ),
        (n, _, _) => bail!("saw {n} of the fifty stop"),
    }

    // The server marks p1 down; the guarded alloc is replaced on p2, not
    // before the node's last heartbeat + window + grace.
    let down = wait_for("p1 marked down", Duration::from_secs(30), || {
        let n = server.node("p1")?;
        Ok((n["status"] == "down").then_some(n))
    })
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    let last_heartbeat_ms = down["last_heartbeat_ms"].as_i64().unwrap_or_default();
    ensure!(
        last_heartbeat_ms > 0,
        "the server shows p1's last heartbeat: {down}"
    );
    // Not before TTL (at least min_heartbeat_ttl) + grace.
    let full = server.get(&format!(
        "/v1/node/{}",
        down["id"].as_str().unwrap_or_default()
    ))?;
    let marked_down_ms = full["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["details"]["status"] == "down")
        .filter_map(|e| e["timestamp"].as_i64())
        .max()
        .context("a node event says p1 went down")?;
    ensure!(
        marked_down_ms >= last_heartbeat_ms + MIN_TTL_MS + GRACE_MS,
        "p1 was marked down {} ms after its last heartbeat, before TTL + grace",
        marked_down_ms - last_heartbeat_ms
    );
    let replacement = wait_for(
        "the guarded alloc replaced on p2 with vol-a mounted",
        Duration::from_secs(30),
        || {
            let allocs = server.allocs("guarded")?;
            let r = allocs
                .iter()
                .find(|a| node_of(a) == c2_id && a["client_status"] == "running")
                .cloned();
            Ok(r.filter(|r| {
                let id = r["id"].as_str().unwrap_or_default();
                !c2.mounts_with(id).is_empty() && marker_pids("guarded").len() == 1
            }))
        },
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    let replaced_at = replacement["create_time_ms"].as_i64().unwrap_or_default();
    let earliest = last_heartbeat_ms + WINDOW_MS + GRACE_MS;
    ensure!(
        replaced_at >= earliest,
        "the replacement was placed at {replaced_at}, {} ms before last heartbeat + window + grace",
        earliest - replaced_at
    );
    let replacement_id = replacement["id"].as_str().unwrap_or_default().to_string();
    ensure!(
        write_claims(&server.volume("vol-a")?) == BTreeSet::from([replacement_id.clone()]),
        "only the replacement holds vol-a"
    );

    // Until the partition ends: the write claim of the lost alloc without
    // a window stays, so its replacement cannot run; the alloc without a
    // window keeps running on p1 with the same pid.
    let heal_at = t0 + Duration::from_secs(30);
    while Instant::now() < heal_at {
        let vol_b = server.volume("vol-b")?;
        ensure!(
            write_claims(&vol_b) == holder_old,
            "the lost holder alloc's write claim was released during the partition: {vol_b}"
        );
        ensure!(
            with_status(&server.allocs("holder")?, "running").is_empty(),
            "no holder alloc runs anywhere while its lost alloc holds vol-b"
        );
        ensure!(
            pid_alive(steady_pid),
            "the steady task still runs on p1 (same pid)"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    ensure!(
        marker_pids("holder").len() == 1,
        "the holder task still runs on partitioned p1"
    );

    // Heal: p1 is ready again, stops what was replaced or lost, releases
    // vol-b, and the holder's replacement takes it.
    c1.relay()?.heal();
    server
        .wait_nodes_ready(&["p1"])
        .with_context(|| logs(&server, &[&c1, &c2]))?;
    wait_for(
        "the steady and holder tasks stopped on p1",
        Duration::from_secs(30),
        || {
            Ok(
                (!pid_alive(steady_pid) && holder_old.iter().all(|a| c1.mounts_with(a).is_empty()))
                    .then_some(()),
            )
        },
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    let holder_new = wait_for(
        "the holder replaced and holding vol-b",
        Duration::from_secs(60),
        || {
            let running = ids(&with_status(&server.allocs("holder")?, "running"));
            let claims = write_claims(&server.volume("vol-b")?);
            Ok(
                (running.len() == 1 && claims == running && running != holder_old)
                    .then_some(running),
            )
        },
    )
    .with_context(|| logs(&server, &[&c1, &c2]))?;
    ensure!(holder_new.len() == 1);
    ensure!(
        write_claims(&server.volume("vol-a")?) == BTreeSet::from([replacement_id]),
        "after the heal still only the replacement holds vol-a"
    );
    for old in guarded_old.iter().chain(&holder_old) {
        let left = c1.mounts_with(old);
        ensure!(
            left.is_empty(),
            "mounts left on p1 for stopped alloc {old}: {left:?}"
        );
    }

    // At no sampled moment did two writers of one volume run.
    let most = sampler.with(|s| s.most_alive.clone());
    ensure!(
        most.get("guarded").copied().unwrap_or_default() <= 1,
        "two guarded writers ran at once: {most:?}"
    );
    ensure!(
        most.get("holder").copied().unwrap_or_default() <= 1,
        "two holder writers ran at once: {most:?}\n{}",
        logs(&server, &[&c1, &c2])
    );
    Ok(())
}

/// Unix milliseconds now.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Unix milliseconds of a moment the sampler saw.
fn unix_ms_of(at: Instant) -> i64 {
    let now = Instant::now();
    now_ms() - now.saturating_duration_since(at).as_millis() as i64
}

/// Done-when 5: a client restarted during a partition stops each window
/// alloc at its last heartbeat before the restart + window, not before and
/// promptly after: the task's executor holds it to the heartbeat lease, and
/// the agent's `disconnect_startup_grace` (longer than the short window
/// here) holds nothing past the window the servers replace it after.
#[test]
fn a_client_restarted_during_a_partition_stops_window_allocs_at_the_stated_time() -> Result<()> {
    let mut server = Server::start(SERVER_BLOCK)?;
    let mut c1 = Client::start(&server, "r1", true, r#"disconnect_startup_grace = "4s""#)?;
    server.wait_nodes_ready(&["r1"])?;
    // The short window ends inside the agent's startup grace; the long one
    // after.
    server.run_job("short", &marked_service_job("short", 1, Some("3s"), None))?;
    server.run_job("long", &marked_service_job("long", 1, Some("12s"), None))?;
    wait_for("both window tasks running", Duration::from_secs(60), || {
        Ok((marker_pids("short").len() == 1 && marker_pids("long").len() == 1).then_some(()))
    })
    .with_context(|| logs(&server, &[&c1]))?;
    let short_pid = *marker_pids("short").first().context("short runs")?;
    let long_pid = *marker_pids("long").first().context("long runs")?;
    // Let a heartbeat or two go through after the placements.
    std::thread::sleep(Duration::from_secs(2));
    let sampler = Sampler::start(&["short", "long"]);

    c1.relay()?.partition();
    // No heartbeat can succeed from now on: the last one is on record.
    std::thread::sleep(Duration::from_millis(100));
    let last_heartbeat_ms = c1.get("/v1/agent/self")?["client"]["last_heartbeat_ms"]
        .as_i64()
        .context("the client shows its last successful heartbeat")?;
    c1.agent.kill()?;
    std::thread::sleep(Duration::from_millis(1_000));
    ensure!(
        pid_alive(short_pid) && pid_alive(long_pid),
        "the tasks outlive their agent"
    );
    c1.agent.start_again()?;

    wait_for("both window tasks stopped", Duration::from_secs(30), || {
        Ok((!pid_alive(short_pid) && !pid_alive(long_pid)).then_some(()))
    })
    .with_context(|| logs(&server, &[&c1]))?;
    std::thread::sleep(Duration::from_millis(100));
    let gone = |pid: i32| sampler.with(|s| s.gone_at.get(&pid).copied().map(unix_ms_of));
    let short_gone = gone(short_pid).context("the short task was seen stopping")?;
    let long_gone = gone(long_pid).context("the long task was seen stopping")?;
    for (what, gone, window_ms) in [("short", short_gone, 3_000), ("long", long_gone, 12_000)] {
        let due = last_heartbeat_ms + window_ms;
        ensure!(
            gone >= due,
            "the {what} alloc stopped {} ms before its last heartbeat + window",
            due - gone
        );
        ensure!(
            gone <= due + 2_000,
            "the {what} alloc stopped {} ms after it was due (limit 2 s)",
            gone - due
        );
    }
    ensure!(
        short_gone < long_gone,
        "the short window alloc stopped first"
    );
    Ok(())
}

/// No node event or status says a node went down.
fn never_down(server: &Server, names: &[&str]) -> Result<()> {
    for name in names {
        let n = server.node(name)?;
        ensure!(n["status"] == "ready", "{name} is {}", n["status"]);
        let full = server.get(&format!(
            "/v1/node/{}",
            n["id"].as_str().unwrap_or_default()
        ))?;
        let downs: Vec<&Value> = full["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["details"]["status"] == "down")
            .collect();
        ensure!(downs.is_empty(), "{name} was marked down: {downs:?}");
    }
    Ok(())
}

/// Done-when 6: a server paused for 30 s (SIGSTOP) and resumed, then a
/// server restarted: no node is marked down for the time the server was
/// away, and no alloc is lost.
#[test]
fn a_server_paused_or_restarted_marks_no_node_down() -> Result<()> {
    // TTL + grace of 6 s or more: far below the 30 s pause, and room for
    // clients that backed off while the server was away to reconnect.
    let mut server = Server::start(
        r#"min_heartbeat_ttl = "3s"
  heartbeat_grace = "3s""#,
    )?;
    let a = Client::start(&server, "s1", false, "")?;
    let b = Client::start(&server, "s2", false, "")?;
    server.wait_nodes_ready(&["s1", "s2"])?;
    server.run_job("calm", &marked_service_job("calm", 2, None, None))?;
    let pids = wait_for("both calm tasks running", Duration::from_secs(60), || {
        let pids = marker_pids("calm");
        let running = with_status(&server.allocs("calm")?, "running").len();
        Ok((pids.len() == 2 && running == 2).then_some(pids))
    })
    .with_context(|| logs(&server, &[&a, &b]))?;
    let settled = Duration::from_secs(12);

    server.agent.signal(nix::sys::signal::Signal::SIGSTOP)?;
    std::thread::sleep(Duration::from_secs(30));
    server.agent.signal(nix::sys::signal::Signal::SIGCONT)?;
    // Longer than TTL + grace after the resume.
    std::thread::sleep(settled);
    never_down(&server, &["s1", "s2"]).with_context(|| logs(&server, &[&a, &b]))?;

    server.agent.stop()?;
    std::thread::sleep(Duration::from_secs(3));
    server.agent.start_again()?;
    server.wait_serving()?;
    std::thread::sleep(settled);
    never_down(&server, &["s1", "s2"]).with_context(|| logs(&server, &[&a, &b]))?;

    let allocs = server.allocs("calm")?;
    ensure!(
        with_status(&allocs, "running").len() == 2 && allocs.len() == 2,
        "no calm alloc was lost or replaced: {allocs:?}"
    );
    ensure!(
        marker_pids("calm") == pids,
        "the calm tasks kept their pids"
    );
    Ok(())
}

/// Done-when 8: draining the node that runs a volume-using alloc and the
/// plugin moves the alloc to the other node; the plugin on the drained
/// node stops only after the volume is unmounted there; no unmount error
/// is recorded.
#[test]
fn a_drain_moves_the_volume_alloc_and_stops_the_plugin_after_the_unmount() -> Result<()> {
    let shared_state = tempfile::tempdir()?;
    let mut server = Server::start(SERVER_BLOCK)?;
    let d1 = Client::start(&server, "d1", false, "")?;
    server.wait_nodes_ready(&["d1"])?;
    server.run_job("plugin", &shared_plugin_job(shared_state.path())?)?;
    server
        .wait_plugin_nodes(1)
        .with_context(|| logs(&server, &[&d1]))?;
    server.create_volume("vol-d", &writer_volume("vol-d"))?;
    server.run_job(
        "mover",
        &marked_service_job("mover", 1, None, Some("vol-d")),
    )?;
    let old = wait_for("the mover running on d1", Duration::from_secs(60), || {
        let running = with_status(&server.allocs("mover")?, "running")
            .into_iter()
            .cloned()
            .collect::<Vec<_>>();
        Ok(match running.as_slice() {
            [a] if marker_pids("mover").len() == 1 => {
                Some(a["id"].as_str().unwrap_or_default().to_string())
            }
            _ => None,
        })
    })
    .with_context(|| logs(&server, &[&d1]))?;
    ensure!(!d1.mounts_with(&old).is_empty(), "vol-d mounted on d1");
    let d2 = Client::start(&server, "d2", false, "")?;
    let d2_id = server.wait_nodes_ready(&["d2"])?.remove(0);
    server
        .wait_plugin_nodes(2)
        .with_context(|| logs(&server, &[&d1, &d2]))?;

    // The plugin process of d1: its command line names d1's data dir.
    let d1_dir = d1.agent.data_path().display().to_string();
    let plugin_on_d1 = || -> Vec<i32> {
        berth_tests::processes_with_cmdline("hostpath-plugin")
            .into_iter()
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&d1_dir))
                    .unwrap_or(false)
            })
            .collect()
    };
    ensure!(plugin_on_d1().len() == 1, "one plugin process on d1");

    server.cli(&["node", "drain", "-enable", "-detach", "d1"])?;
    // Watch the order: vol-d unmounted on d1, then the plugin gone.
    let mut unmounted_at = None;
    let mut plugin_gone_at = None;
    let deadline = Instant::now() + Duration::from_secs(90);
    while unmounted_at.is_none() || plugin_gone_at.is_none() {
        ensure!(
            Instant::now() < deadline,
            "drain did not finish: unmounted {unmounted_at:?}, plugin gone {plugin_gone_at:?}\n{}",
            logs(&server, &[&d1, &d2])
        );
        let now = Instant::now();
        if unmounted_at.is_none() && d1.mounts_with(&old).is_empty() {
            unmounted_at = Some(now);
        }
        if plugin_gone_at.is_none() && plugin_on_d1().is_empty() {
            plugin_gone_at = Some(now);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ensure!(
        unmounted_at <= plugin_gone_at,
        "the plugin on d1 stopped before vol-d was unmounted there"
    );
    let new = wait_for(
        "the mover running on d2 with vol-d",
        Duration::from_secs(60),
        || {
            let allocs = server.allocs("mover")?;
            Ok(allocs
                .iter()
                .find(|a| node_of(a) == d2_id && a["client_status"] == "running")
                .map(|a| a["id"].as_str().unwrap_or_default().to_string())
                .filter(|id| !d2.mounts_with(id).is_empty()))
        },
    )
    .with_context(|| logs(&server, &[&d1, &d2]))?;
    ensure!(
        write_claims(&server.volume("vol-d")?) == BTreeSet::from([new]),
        "only the moved alloc holds vol-d"
    );
    let node = server.node("d1")?;
    ensure!(
        node["scheduling_eligibility"] == "ineligible",
        "a drained node stays ineligible: {node}"
    );
    let full = server.get(&format!(
        "/v1/node/{}",
        node["id"].as_str().unwrap_or_default()
    ))?;
    let storage_errors: Vec<&Value> = full["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["subsystem"] == "Storage" && e["details"]["success"] != "true")
        .collect();
    ensure!(
        storage_errors.is_empty(),
        "no unmount error on d1: {storage_errors:?}"
    );
    Ok(())
}
