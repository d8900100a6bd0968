//! Two servers on one etcd (`store = "etcd"`) and a client that lists
//! both: one server leads, the other follows its writes through etcd's
//! watch, answers reads and sends writes on to the leader;
//! when the leader is killed the other takes over within the lease TTL,
//! with the state the leader left, and the node's alloc runs on without a
//! node marked down or an alloc replaced. A client that reaches only the
//! follower is served through it: the follower sends its requests on to
//! the leader.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::cluster::{members_agree, wait_leader, Client, Server};
use berth_tests::{http_at, sleeping_service_job, wait_for};
use berth_testutil::etcd::Etcd;

/// The lease `Server::start_on_etcd` gives its servers.
const LEASE_TTL: Duration = Duration::from_secs(3);

#[test]
fn the_standby_takes_over_a_killed_leader_with_its_state() -> Result<()> {
    let etcd = Etcd::start();
    let keys = tempfile::tempdir()?;
    let mut servers = [
        Server::start_on_etcd(&[etcd.endpoint()], "/ha", keys.path())?,
        Server::start_on_etcd(&[etcd.endpoint()], "/ha", keys.path())?,
    ];
    let l = wait_leader(&servers, &[0, 1], Duration::from_secs(15))?;
    let s = 1 - l;
    let leader = servers[l].rpc.clone();

    // Both list both servers, the leader marked as the election says.
    for server in &servers {
        members_agree(server, 2, &leader)?;
        let peers = server.get("/v1/status/peers")?;
        assert_eq!(peers.as_array().map(Vec::len), Some(2), "{peers}");
    }
    let table = servers[s].cli(&["server", "members"])?;
    assert!(
        table.contains("Leader") && table.contains(&leader),
        "{table}"
    );

    // The standby sends writes on to the leader and gives its answer.
    let unknown = http_at(
        servers[s].http_port,
        "DELETE /v1/job/nonesuch HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    let at_leader = http_at(
        servers[l].http_port,
        "DELETE /v1/job/nonesuch HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    assert_eq!(unknown.status, at_leader.status, "{}", unknown.text());
    assert_eq!(unknown.json()?, at_leader.json()?);

    // A client that lists the standby first still registers, with the
    // leader.
    let both = format!("{},{}", servers[s].rpc, servers[l].rpc);
    let client = Client::start_with_servers(&both, "n1", "")?;
    servers[l]
        .wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    // Submitted through the standby.
    servers[s].run_job("ha-sleepy", &sleeping_service_job("ha-sleepy", 1, 1))?;
    let running = |server: &Server| -> Result<Option<String>> {
        Ok(server
            .allocs("ha-sleepy")?
            .into_iter()
            .find(|a| a["client_status"] == "running")
            .and_then(|a| a["id"].as_str().map(String::from)))
    };
    let alloc = wait_for("the alloc running", Duration::from_secs(30), || {
        running(&servers[l])
    })?;
    // The standby follows the leader's writes through etcd's watch and
    // answers reads with them.
    wait_for(
        "the standby to see the alloc running",
        Duration::from_secs(10),
        || Ok((running(&servers[s])? == Some(alloc.clone())).then_some(())),
    )?;
    assert_eq!(
        servers[s].get("/v1/job/ha-sleepy")?["modify_index"],
        servers[l].get("/v1/job/ha-sleepy")?["modify_index"]
    );

    let killed = Instant::now();
    servers[l].agent.kill()?;
    let standby_rpc = servers[s].rpc.clone();
    wait_for("the standby to lead", Duration::from_secs(10), || {
        Ok((servers[s].leader()? == standby_rpc).then_some(()))
    })
    .with_context(|| servers[s].agent.log())?;
    let took = killed.elapsed();
    assert!(
        took < LEASE_TTL + Duration::from_secs(2),
        "a new leader after {took:?}"
    );

    // The new leader has the state: the node stays ready (it reaches the
    // new leader before its fresh TTL runs out) and the alloc runs on.
    let node = servers[s].node("n1")?;
    assert_eq!(node["status"], "ready", "{node}");
    let after = wait_for(
        "the alloc reported running",
        Duration::from_secs(30),
        || running(&servers[s]),
    )?;
    assert_eq!(after, alloc, "the alloc was replaced");
    let watch_until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < watch_until {
        let node = servers[s].node("n1")?;
        assert_eq!(node["status"], "ready", "marked down: {node}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(servers[s].allocs("ha-sleepy")?.len(), 1);

    // The old leader comes back as the standby.
    servers[l].agent.start_again()?;
    servers[l].wait_serving()?;
    wait_for(
        "the old leader to stand by",
        Duration::from_secs(10),
        || Ok((servers[l].leader()? == standby_rpc).then_some(())),
    )?;
    // It caught up through the watch: a write of the new leader's shows
    // on it, and both answer alike.
    servers[s].run_job(
        "after-restart",
        &sleeping_service_job("after-restart", 0, 1),
    )?;
    let index = servers[s].get("/v1/job/after-restart")?["modify_index"].clone();
    wait_for(
        "the restarted server to catch up",
        Duration::from_secs(10),
        || {
            Ok(servers[l]
                .get("/v1/job/after-restart")
                .ok()
                .filter(|j| j["modify_index"] == index)
                .map(|_| ()))
        },
    )?;
    for path in ["/v1/jobs", "/v1/job/ha-sleepy/allocations"] {
        assert_eq!(servers[l].get(path)?, servers[s].get(path)?, "{path}");
    }
    // A node's last heartbeat is the leader's to know (heartbeats are not
    // written); the rest is the same.
    let node_of = |server: &Server| -> Result<(serde_json::Value, serde_json::Value)> {
        let n = server.node("n1")?;
        Ok((n["status"].clone(), n["modify_index"].clone()))
    };
    assert_eq!(node_of(&servers[l])?, node_of(&servers[s])?);
    Ok(())
}

#[test]
fn a_client_that_reaches_only_the_follower_runs_its_allocs_through_it() -> Result<()> {
    let etcd = Etcd::start();
    let keys = tempfile::tempdir()?;
    let mut servers = [
        Server::start_on_etcd(&[etcd.endpoint()], "/fw", keys.path())?,
        Server::start_on_etcd(&[etcd.endpoint()], "/fw", keys.path())?,
    ];
    let l = wait_leader(&servers, &[0, 1], Duration::from_secs(15))?;
    let f = 1 - l;
    // The client knows the follower alone: it registers, watches its
    // allocs, reports them and heartbeats through it.
    let client = Client::start_with_servers(&servers[f].rpc, "n-fw", "")?;
    servers[l]
        .wait_nodes_ready(&["n-fw"])
        .with_context(|| format!("{}\n{}", client.agent.log(), servers[f].agent.log()))?;
    servers[f].run_job("fw-sleepy", &sleeping_service_job("fw-sleepy", 1, 1))?;
    let alloc = wait_for("the alloc running", Duration::from_secs(30), || {
        servers[l].running_alloc("fw-sleepy")
    })
    .with_context(|| client.agent.log())?;
    // Its heartbeats reach the leader's TTL timers: the node stays ready
    // well past its TTL and grace (2 s each).
    let watch_until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < watch_until {
        let node = servers[l].node("n-fw")?;
        assert_eq!(node["status"], "ready", "marked down: {node}");
        std::thread::sleep(Duration::from_millis(250));
    }
    // A stop reaches the task through the follower, and the client's
    // report of it reaches the leader.
    servers[f].cli(&["job", "stop", "fw-sleepy"])?;
    wait_for("the alloc to stop", Duration::from_secs(30), || {
        let allocs = servers[l].allocs("fw-sleepy")?;
        Ok(allocs
            .iter()
            .any(|a| a["id"] == alloc.as_str() && a["client_status"] == "complete")
            .then_some(()))
    })
    .with_context(|| client.agent.log())?;
    assert!(
        !client.agent.log().contains("does not lead"),
        "the follower refused the client: {}",
        client.agent.log()
    );
    Ok(())
}

#[test]
fn a_volume_job_run_and_stopped_in_a_loop_through_a_leader_kill_leaves_no_claim_behind(
) -> Result<()> {
    use berth_tests::cluster::{
        marked_service_job, marker_pids, shared_plugin_job_with_args, write_claims, writer_volume,
    };
    let etcd = Etcd::start();
    let keys = tempfile::tempdir()?;
    let mut servers = [
        Server::start_on_etcd(&[etcd.endpoint()], "/ha", keys.path())?,
        Server::start_on_etcd(&[etcd.endpoint()], "/ha", keys.path())?,
    ];
    let mut l = wait_leader(&servers, &[0, 1], Duration::from_secs(15))?;
    let mut s = 1 - l;
    let both = format!("{},{}", servers[0].rpc, servers[1].rpc);
    let client = Client::start_with_servers(&both, "n1", "")?;
    servers[l]
        .wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    let shared = tempfile::tempdir()?;
    // With controller attach: every claim is published to the node and
    // unpublished from it by the leader.
    servers[s].run_job(
        "plugin",
        &shared_plugin_job_with_args(shared.path(), &["--enable-attach"])?,
    )?;
    servers[l]
        .wait_plugin_nodes(1)
        .with_context(|| client.agent.log())?;
    servers[s].create_volume("vol-ha", &writer_volume("vol-ha"))?;

    // A sampler of the writers: never two tasks of the job at once.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(marker_pids("claimer").len());
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };
    for round in 0..5 {
        let via = &servers[s];
        via.run_job(
            "claimer",
            &marked_service_job("claimer", 1, None, Some("vol-ha")),
        )?;
        let alloc = wait_for("the claimer running", Duration::from_secs(60), || {
            via.running_alloc("claimer")
        })
        .with_context(|| client.agent.log())?;
        if round == 2 {
            // The leader dies while the claim is held; the other leads.
            servers[l].agent.kill()?;
            std::mem::swap(&mut l, &mut s);
            let rpc = servers[l].rpc.clone();
            wait_for("the other server to lead", Duration::from_secs(10), || {
                Ok((servers[l].leader()? == rpc).then_some(()))
            })?;
        }
        let via = if round == 2 { &servers[l] } else { &servers[s] };
        via.cli(&["job", "stop", "claimer"])?;
        wait_for("the claim freed", Duration::from_secs(60), || {
            let volume = via.get("/v1/volume/csi/vol-ha")?;
            Ok(write_claims(&volume).is_empty().then_some(()))
        })
        .with_context(|| client.agent.log())?;
        anyhow::ensure!(
            client.mounts_with(&alloc).is_empty(),
            "the stopped alloc's volume is still mounted"
        );
        if round == 2 {
            // From here on the survivor takes it all, as leader.
            s = l;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = sampler.join().expect("sampler");
    assert!(most <= 1, "{most} writers of the volume at once");
    let volume = servers[l].get("/v1/volume/csi/vol-ha")?;
    assert!(write_claims(&volume).is_empty(), "{volume}");
    // Each of the five claims was unpublished from the node by the
    // controller; the one held at the kill at most once more (the new
    // leader resumes it from its checkpoint).
    let plugin = servers[l].allocs("hostpath-plugin")?;
    let plugin_alloc = plugin
        .first()
        .and_then(|a| a["id"].as_str())
        .context("no plugin alloc")?;
    let log = berth_tests::plugin_stderr(&client.agent.data_path(), plugin_alloc);
    let unpublished = log.matches("unpublished volume").count();
    assert!(
        (5..=6).contains(&unpublished),
        "ControllerUnpublish ran {unpublished} times for 5 claims:\n{log}"
    );
    Ok(())
}
