//! `berth node purge` on a dev agent with the real binary: the node is
//! forgotten and its alloc lost; the client, still alive, finds itself
//! unknown at its next heartbeat, registers again, stops the lost alloc
//! through the normal path and runs its replacement.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use berth_tests::{sleeping_service_job, wait_for, DevAgent};
use serde_json::Value;

#[test]
fn purging_a_live_node_loses_its_alloc_and_the_client_registers_again_and_replaces_it() -> Result<()>
{
    // A short TTL: the client heartbeats about every second.
    let agent = DevAgent::start_with_args(&["-heartbeat-ttl", "2s"])?;
    let job = sleeping_service_job("purged", 1, 0).replace(r#"["300"]"#, r#"["3071"]"#);
    let file = agent.write_file("purged.hcl", &job)?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let first = wait_for("the alloc to run", Duration::from_secs(60), || {
        let allocs = agent.api_get("/v1/job/purged/allocations")?;
        Ok(allocs
            .as_array()
            .and_then(|a| a.iter().find(|a| a["client_status"] == "running"))
            .map(|a| a["id"].as_str().unwrap_or_default().to_string()))
    })?;
    let first_pids = wait_for("its task process", Duration::from_secs(30), || {
        let pids = agent.processes_with_cmdline("sleep 3071");
        Ok((!pids.is_empty()).then_some(pids))
    })?;
    let nodes = agent.api_get("/v1/nodes")?;
    let node = &nodes[0];
    let (node_id, name) = (
        node["id"].as_str().unwrap_or_default().to_string(),
        node["name"].as_str().unwrap_or_default().to_string(),
    );

    let out = agent.cli_ok(&["node", "purge", &name])?;
    ensure!(
        out.contains(&format!("Purged node {name:?} ({node_id}): 1 alloc lost")),
        "purge output: {out}"
    );
    let a = agent.api_get(&format!("/v1/allocation/{first}"))?;
    ensure!(
        a["client_status"] == "lost" && a["desired_status"] == "stop",
        "the purged node's alloc is lost and desired stop: {a}"
    );

    // The client registers again under its own ID, stops the lost alloc's
    // task and runs the replacement.
    wait_for("the node ready again", Duration::from_secs(30), || {
        let nodes = agent.api_get("/v1/nodes")?;
        Ok(nodes
            .as_array()
            .is_some_and(|n| {
                n.iter()
                    .any(|n| n["id"] == node_id.as_str() && n["status"] == "ready")
            })
            .then_some(()))
    })
    .map_err(|e| e.context(agent.log()))?;
    let next = wait_for(
        "the lost task stopped and a replacement running",
        Duration::from_secs(60),
        || {
            let allocs = agent.api_get("/v1/job/purged/allocations")?;
            let running: Vec<&Value> = allocs
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["client_status"] == "running")
                .collect();
            let pids = agent.processes_with_cmdline("sleep 3071");
            let old_gone = first_pids.iter().all(|p| !pids.contains(p));
            Ok(match running.as_slice() {
                [one] if one["id"] != first.as_str() && old_gone && pids.len() == 1 => {
                    Some(one["id"].as_str().unwrap_or_default().to_string())
                }
                _ => None,
            })
        },
    )
    .map_err(|e| e.context(agent.log()))?;
    ensure!(next != first);
    let old = agent.api_get(&format!("/v1/allocation/{first}"))?;
    ensure!(
        old["desired_status"] == "stop"
            && ["lost", "complete"].contains(&old["client_status"].as_str().unwrap_or_default()),
        "the purged alloc stays stopped: {old}"
    );
    Ok(())
}

/// The lost-data-dir case: a client comes back under a fresh data dir as a
/// new node while the old node's writer task keeps running on the host.
/// `node purge` of the old node without `-force` keeps the writer's write
/// claim (the replacement is not placed, nothing mounts the volume for it)
/// and lists it; `-force` without a terminal asks for `-y` and purges
/// nothing; once the old tasks are killed, `volume detach` by the old
/// node's ID frees the claim and the replacement runs with the volume.
#[test]
fn a_purge_of_a_node_whose_tasks_may_run_keeps_their_write_claim() -> Result<()> {
    use berth_tests::cluster::{
        marked_job, marker_pids, pid_alive, shared_plugin_job, with_status, writer_volume, Client,
        Server,
    };
    let shared_state = tempfile::tempdir()?;
    let mut server = Server::start("")?;
    let old = Client::start(&server, "w1", false, "")?;
    let old_id = server.wait_nodes_ready(&["w1"])?.remove(0);
    server.run_job("plugin", &shared_plugin_job(shared_state.path())?)?;
    server.wait_plugin_nodes(1)?;
    server.create_volume("vol", &writer_volume("vol"))?;
    server.run_job(
        "writer",
        &marked_job("writer", "service", 1, "", Some("vol")),
    )?;
    let old_pid = wait_for("the writer running", Duration::from_secs(60), || {
        let running = with_status(&server.allocs("writer")?, "running").len();
        Ok((running == 1)
            .then(|| marker_pids("writer").into_iter().next())
            .flatten())
    })?;

    // The client's data dir is lost: its agent dies, its tasks run on, and
    // a client under a fresh data dir joins as a new node.
    let mut old = old;
    old.agent.kill()?;
    let new = Client::start(&server, "w1", false, "")?;
    wait_for("the new node ready", Duration::from_secs(60), || {
        let nodes = server.get("/v1/nodes")?;
        Ok(nodes
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["status"] == "ready" && n["id"] != old_id.as_str())
            .then_some(()))
    })?;
    ensure!(
        new.agent
            .log()
            .contains("task executors of another data dir run on this host"),
        "the new client warns of the old node's executors:\n{}",
        new.agent.log()
    );

    // -force without a terminal asks for -y and purges nothing.
    let forced = std::process::Command::new(berth_tests::binary("berth"))
        .args(["node", "purge", "-force", &old_id])
        .env("BERTH_ADDR", server.addr())
        .stdin(std::process::Stdio::null())
        .output()?;
    let said = String::from_utf8_lossy(&forced.stderr).into_owned();
    ensure!(
        !forced.status.success() && said.contains("pass -y"),
        "{forced:?}"
    );
    ensure!(
        server.get(&format!("/v1/node/{old_id}")).is_ok(),
        "nothing purged without -y"
    );

    let out = server.cli(&["node", "purge", &old_id])?;
    ensure!(
        out.contains("0 volume claim(s) freed") && out.contains("Kept 1 write claim(s)"),
        "purge output: {out}"
    );
    ensure!(
        out.contains(&format!("berth volume detach vol {old_id}")),
        "the purge says how to free it: {out}"
    );
    // The old writer runs on; no replacement writes beside it.
    let blocked = wait_for(
        "the replacement blocked by the kept claim",
        Duration::from_secs(30),
        || {
            let job = server.get("/v1/job/writer")?;
            Ok(job["placement_failures"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|f| {
                    f.as_str()
                        .unwrap_or_default()
                        .contains("already has a writer")
                })
                .then_some(()))
        },
    );
    blocked.with_context(|| server.agent.log())?;
    ensure!(pid_alive(old_pid), "the old writer still runs");
    ensure!(
        marker_pids("writer") == std::collections::BTreeSet::from([old_pid]),
        "only the old writer runs"
    );

    // The old tasks are stopped (as a reboot would); the operator frees
    // the claim by the old node's ID; the replacement takes the volume.
    let old_dir = old.agent.data_path().display().to_string();
    for pid in berth_tests::processes_with_cmdline(&old_dir) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    wait_for("the old writer gone", Duration::from_secs(10), || {
        Ok((!pid_alive(old_pid)).then_some(()))
    })?;
    server.cli(&["volume", "detach", "vol", &old_id])?;
    let next = wait_for(
        "the replacement running with the volume",
        Duration::from_secs(60),
        || {
            let running = with_status(&server.allocs("writer")?, "running")
                .into_iter()
                .filter_map(|a| a["id"].as_str().map(str::to_string))
                .next();
            Ok(running.filter(|id| !new.mounts_with(id).is_empty()))
        },
    )
    .with_context(|| format!("{}\n{}", server.agent.log(), new.agent.log()))?;
    ensure!(!next.is_empty());
    Ok(())
}
