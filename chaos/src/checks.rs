//! berth's promises, checked after every fault once the cluster settled,
//! and (the writers) sampled all along:
//!
//! 1. a single-writer volume is never written by two running tasks at
//!    once (the sampler: a writer job never has two task processes);
//! 2. no mount under a client's data dir that no live alloc there owns,
//!    and every running writer's volume mounted on its node;
//! 3. no claim whose alloc is terminal or gone;
//! 4. no task process without an alloc that wants it, never more than
//!    the allocs the servers run;
//! 5. every alloc the servers want running runs (or the run names why
//!    not, when it did not settle);
//! 6. every agent runs, and no log has a panic;
//! 7. every job the CLI accepted exists, and no two live allocs of a job
//!    have one name (index).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::Result;
use berth_tests::cluster::{marker_pids, node_of};
use serde_json::Value;

use crate::world::{World, BATCH_JOB};

/// Whether alloc `a` (as the API shows it) has ended on its client.
fn terminal(a: &Value) -> bool {
    matches!(
        a["client_status"].as_str(),
        Some("complete" | "failed" | "lost")
    )
}

/// What a check found wrong.
pub type Violations = Vec<String>;

/// Waits (at most `within`) until every node is ready, the plugin is
/// healthy on each, every job runs the allocs it wants, each with one
/// task process, and the volumes' claims are all of live allocs. How long it took, or what was still
/// not so at the deadline.
pub fn settle(world: &mut World, within: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < within {
        match unsettled(world) {
            Ok(None) => return Ok(start.elapsed()),
            Ok(Some(why)) => last = why,
            Err(e) => last = format!("{e:#}"),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(last)
}

/// What is not settled yet, if anything.
fn unsettled(world: &mut World) -> Result<Option<String>> {
    for (c, mark) in world.clients.iter().zip(world.restarted.iter_mut()) {
        if let Some(at) = *mark {
            if !c.agent.log_since(at).contains("agent ready") {
                return Ok(Some(format!(
                    "client {} is not ready since its start",
                    c.name
                )));
            }
            *mark = None;
        }
    }
    let mut node_ids = Vec::new();
    for c in &world.clients {
        let n = world.server.node(&c.name)?;
        if n["status"] != "ready" {
            return Ok(Some(format!("node {} is {}", c.name, n["status"])));
        }
        node_ids.push(n["id"].as_str().unwrap_or_default().to_string());
    }
    let mut live = BTreeSet::new();
    let mut all = Vec::new();
    for (job, want) in &world.wanted {
        let allocs = world.allocs(job)?;
        live.extend(
            allocs
                .iter()
                .filter(|a| !terminal(a))
                .filter_map(|a| a["id"].as_str().map(String::from)),
        );
        all.extend(allocs.iter().cloned());
        let running = allocs
            .iter()
            .filter(|a| a["desired_status"] == "run" && a["client_status"] == "running")
            .count();
        if running != *want {
            return Ok(Some(format!("{job} runs {running} allocs of {want}")));
        }
        let procs = marker_pids(job).len();
        if procs != *want {
            return Ok(Some(format!(
                "{job} has {procs} task processes for {want} allocs"
            )));
        }
    }
    if world.batch_runs > 0 {
        let allocs = world.allocs(BATCH_JOB)?;
        if let Some(a) = allocs.iter().find(|a| !terminal(a)) {
            return Ok(Some(format!(
                "batch alloc {} is {}",
                a["id"], a["client_status"]
            )));
        }
        if !marker_pids(BATCH_JOB).is_empty() {
            return Ok(Some("a batch task process runs on".into()));
        }
        all.extend(allocs);
    }
    let plugin = world.server.get("/v1/plugin/csi/hostpath")?;
    let healthy = plugin["nodes_healthy"].as_u64().unwrap_or(0);
    if healthy != world.clients.len() as u64 {
        return Ok(Some(format!("the plugin is healthy on {healthy} nodes")));
    }
    let stale = stale_claims(world, &live)?;
    if !stale.is_empty() {
        return Ok(Some(stale.join("; ")));
    }
    all.extend(world.allocs("hostpath-plugin")?);
    let astray = mounts_astray(world, &node_ids, &all);
    if !astray.is_empty() {
        return Ok(Some(format!("(promise 2) {}", astray.join("; "))));
    }
    Ok(None)
}

/// Promise 2, on each client: every mount under its data dir belongs to
/// a live alloc of that node (its alloc dir, its CSI publish target) or
/// stages a volume such an alloc claims; every running writer alloc has
/// its volume staged, published and bound into its alloc dir.
/// `node_ids[i]` is client `i`'s node ID; `allocs`, every alloc of the
/// run's jobs as the servers have them.
fn mounts_astray(world: &World, node_ids: &[String], allocs: &[Value]) -> Vec<String> {
    let mut found = Vec::new();
    for (client, node_id) in world.clients.iter().zip(node_ids) {
        let here: Vec<&Value> = allocs.iter().filter(|a| node_of(a) == node_id).collect();
        let live: BTreeSet<&str> = here
            .iter()
            .filter(|a| !terminal(a))
            .filter_map(|a| a["id"].as_str())
            .collect();
        let volume_of = |a: &Value| world.volume_of(a["job_id"].as_str()?);
        let claimed: BTreeSet<&str> = here
            .iter()
            .filter(|a| !terminal(a))
            .filter_map(|a| volume_of(a))
            .collect();
        let data = client.agent.data_path();
        let mounts: Vec<Vec<String>> = berth_tests::mounts_under(&data)
            .iter()
            .filter_map(|m| m.strip_prefix(&data).ok())
            .map(|r| r.iter().map(|c| c.to_string_lossy().into_owned()).collect())
            // The data dir's own filesystem.
            .filter(|parts: &Vec<String>| !parts.is_empty())
            .collect();
        for parts in &mounts {
            let owned = match parts.iter().map(String::as_str).collect::<Vec<_>>()[..] {
                ["alloc", id, ..] | ["client", "csi", _, "per-alloc", id, ..] => live.contains(id),
                ["client", "csi", _, "staging", volume, ..] => claimed.contains(volume),
                _ => false,
            };
            if !owned {
                found.push(format!(
                    "{}: {} is mounted and no live alloc there owns it",
                    client.name,
                    parts.join("/")
                ));
            }
        }
        for a in here.iter().filter(|a| a["client_status"] == "running") {
            let (Some(id), Some(volume)) = (a["id"].as_str(), volume_of(a)) else {
                continue;
            };
            let has = |want: &[&str]| {
                mounts
                    .iter()
                    .any(|p| p.len() > want.len() && want.iter().zip(p).all(|(w, p)| w == p))
            };
            let staged = mounts.iter().any(|p| {
                p.len() > 4 && p[..2] == ["client", "csi"] && p[3] == "staging" && p[4] == volume
            });
            if !has(&["alloc", id]) || !staged {
                found.push(format!(
                    "{}: alloc {id} runs and its volume {volume} is not {}",
                    client.name,
                    if staged {
                        "bound into its alloc dir"
                    } else {
                        "staged"
                    }
                ));
            }
        }
    }
    found
}

/// The claims whose alloc is not among the `live` ones: terminal or
/// gone (promise 3).
fn stale_claims(world: &World, live: &BTreeSet<String>) -> Result<Vec<String>> {
    let mut stale = Vec::new();
    for volume in world.volumes() {
        let v = world.server.volume(volume)?;
        for kind in ["write_claims", "read_claims"] {
            for alloc in v[kind].as_object().into_iter().flat_map(|m| m.keys()) {
                if !live.contains(alloc) {
                    stale.push(format!(
                        "{volume} has a claim of alloc {alloc}, which is terminal or gone"
                    ));
                }
            }
        }
    }
    Ok(stale)
}

/// The checks after a fault settled (or did not: `settled` says why not).
pub fn after_fault(world: &mut World, settled: &Result<Duration, String>) -> Violations {
    let mut found = Violations::new();
    if let Err(why) = settled {
        found.push(format!("did not settle (promises 2, 3, 4, 5): {why}"));
    }
    found.extend(writers_alone(world));
    found.extend(agents_well(world));
    match jobs_whole(world) {
        Ok(v) => found.extend(v),
        Err(e) => found.push(format!("reading the jobs: {e:#}")),
    }
    found
}

/// Promise 1: a writer job never had two task processes at once.
fn writers_alone(world: &World) -> Violations {
    world
        .sampler
        .overlaps()
        .iter()
        .take(3)
        .map(|o| {
            let volume = world.writers.get(&o.job).map_or("?", String::as_str);
            let procs: Vec<String> = o
                .processes
                .iter()
                .map(|(p, c)| format!("{p}: {c}"))
                .collect();
            format!(
                "{} task processes of {} ran at once at {:.1?}, writers of {volume}: {}",
                o.processes.len(),
                o.job,
                o.at,
                procs.join(" | ")
            )
        })
        .collect()
}

/// Promise 6: every agent runs, and no log has a panic.
fn agents_well(world: &mut World) -> Violations {
    let mut found = Violations::new();
    if let Err(e) = world.server.agent.check_running() {
        found.push(format!("the server exited: {e:#}"));
    }
    for c in &mut world.clients {
        if let Err(e) = c.agent.check_running() {
            found.push(format!("client {} exited: {e:#}", c.name));
        }
    }
    for (name, log) in world.agent_logs() {
        if let Some(line) = log.lines().find(|l| l.contains("panicked")) {
            found.push(format!("{name} panicked: {line}"));
        }
    }
    found
}

/// Promise 7: every accepted job exists; no two live allocs of a job
/// share a name.
fn jobs_whole(world: &World) -> Result<Violations> {
    let mut found = Violations::new();
    for job in &world.accepted {
        if world.server.get(&format!("/v1/job/{job}")).is_err() {
            found.push(format!("job {job}, which the CLI accepted, is gone"));
            continue;
        }
        let allocs: Vec<Value> = world.allocs(job)?;
        let mut names: BTreeMap<String, usize> = BTreeMap::new();
        for a in allocs
            .iter()
            .filter(|a| a["desired_status"] == "run" && !terminal(a))
        {
            *names
                .entry(a["name"].as_str().unwrap_or_default().to_string())
                .or_default() += 1;
        }
        for (name, n) in names.into_iter().filter(|(_, n)| *n > 1) {
            found.push(format!("{n} live allocs of {job} are named {name}"));
        }
    }
    Ok(found)
}
