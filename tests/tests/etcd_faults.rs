//! Servers on a three-member etcd under faults, with real processes: the
//! leader killed during a stream of job submits, a leader cut off from
//! etcd but not from its clients, and etcd members lost. What must hold:
//! one leader at a time, a new one within `lease_ttl` + 2 s, every submit
//! the CLI reported accepted kept and placed once, no node marked down
//! and no alloc replaced because of the servers' trouble.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::cluster::{wait_leader, Client, Server};
use berth_tests::{cli_at, http_at, sleeping_service_job, wait_for};
use berth_testutil::etcd::EtcdCluster;

/// The lease `Server::start_on_etcd` gives its servers.
const LEASE_TTL: Duration = Duration::from_secs(3);

fn submit(server: &Server, dir: &std::path::Path, job: &str) -> Result<bool> {
    let spec = dir.join(format!("{job}.hcl"));
    std::fs::write(&spec, sleeping_service_job(job, 1, 1))?;
    let path = spec.to_str().context("path")?;
    Ok(cli_at(&server.addr(), &["job", "run", "-detach", path])?
        .status
        .success())
}

fn assert_node_ready(server: &Server) -> Result<()> {
    let node = server.node("n1")?;
    anyhow::ensure!(node["status"] == "ready", "node not ready: {node}");
    Ok(())
}

#[test]
fn the_leader_killed_during_a_stream_of_submits_loses_none_and_places_none_twice() -> Result<()> {
    let etcd = EtcdCluster::start(3);
    let endpoints = etcd.endpoints();
    let keys = tempfile::tempdir()?;
    let mut servers = vec![
        Server::start_on_etcd(&endpoints, "/faults", keys.path())?,
        Server::start_on_etcd(&endpoints, "/faults", keys.path())?,
        Server::start_on_etcd(&endpoints, "/faults", keys.path())?,
    ];
    let all: Vec<String> = servers.iter().map(|s| s.rpc.clone()).collect();
    let client = Client::start_with_servers(&all.join(","), "n1", "")?;
    let leader = wait_leader(&servers, &[0, 1, 2], Duration::from_secs(15))?;
    servers[leader]
        .wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    let dir = tempfile::tempdir()?;
    // Submits go to the servers in turn (a follower sends them on).
    // Thirty submits, five a second, round the servers; the leader dies
    // after the sixth, and the stream goes on through the others while
    // they elect a new one.
    let mut accepted = Vec::new();
    let mut killed_at = None;
    for n in 0..30 {
        let job = format!("stream-{n}");
        let target = n % 3;
        if n == 6 {
            servers[leader].agent.kill()?;
            killed_at = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(200));
        if killed_at.is_some() && target == leader {
            continue;
        }
        if submit(&servers[target], dir.path(), &job)? {
            accepted.push(job);
        }
    }
    killed_at.context("the leader was not killed")?;
    let live: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    let next = wait_leader(&servers, &live, Duration::from_secs(10))?;
    // Before the kill all six, and after the election the rest.
    assert!(accepted.len() >= 12, "accepted only {accepted:?}");
    // Every accepted submit is there, placed once, and runs.
    for job in &accepted {
        wait_for(&format!("{job} running"), Duration::from_secs(30), || {
            servers[next].running_alloc(job)
        })
        .with_context(|| servers[next].agent.log())?;
        let allocs = servers[next].allocs(job)?;
        assert_eq!(allocs.len(), 1, "{job} placed more than once: {allocs:?}");
    }
    assert_node_ready(&servers[next])?;
    Ok(())
}

/// Whether `server` says it leads (`berth_server_leader 1`).
fn says_it_leads(server: &Server) -> bool {
    http_at(
        server.http_port,
        "GET /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )
    .map(|a| a.text().lines().any(|l| l == "berth_server_leader 1"))
    .unwrap_or(false)
}

#[test]
fn a_leader_cut_off_from_etcd_stops_before_another_leads() -> Result<()> {
    let etcd = EtcdCluster::start(3);
    let endpoints = etcd.endpoints();
    // The first server reaches etcd through the first member alone.
    let keys = tempfile::tempdir()?;
    let first = Server::start_on_etcd(&endpoints[..1], "/faults", keys.path())?;
    wait_for("the first server to lead", Duration::from_secs(15), || {
        Ok((first.leader()? == first.rpc).then_some(()))
    })?;
    let second = Server::start_on_etcd(&endpoints[1..], "/faults", keys.path())?;
    let mut servers = [first, second];
    let client =
        Client::start_with_servers(&format!("{},{}", servers[0].rpc, servers[1].rpc), "n1", "")?;
    servers[0]
        .wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    servers[0].run_job("cut-off", &sleeping_service_job("cut-off", 1, 1))?;
    let alloc = wait_for("the alloc running", Duration::from_secs(30), || {
        servers[0].running_alloc("cut-off")
    })?;

    // A sampler of who leads: never both at once.
    let both = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (a, b) = (servers[0].http_port, servers[1].http_port);
    let sampler = {
        let (both, stop) = (both.clone(), stop.clone());
        std::thread::spawn(move || {
            let leads = |port: u16| {
                http_at(
                    port,
                    "GET /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                )
                .map(|r| r.text().lines().any(|l| l == "berth_server_leader 1"))
                .unwrap_or(false)
            };
            let mut samples = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let (x, y) = (leads(a), leads(b));
                samples += 1;
                if x && y {
                    both.lock().unwrap().push(samples);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            samples
        })
    };
    let cut = Instant::now();
    etcd.members[0].pause();
    let second_rpc = servers[1].rpc.clone();
    wait_for("the second server to lead", Duration::from_secs(10), || {
        Ok((servers[1].leader()? == second_rpc).then_some(()))
    })
    .with_context(|| servers[1].agent.log())?;
    // The lease runs out `lease_ttl` after the last keep-alive; when the
    // stopped member was etcd's own leader, etcd first elects another and
    // then gives every lease its whole TTL again, which adds up to one TTL
    // more.
    let took = cut.elapsed();
    assert!(
        took < LEASE_TTL * 2 + Duration::from_secs(2),
        "a new leader after {took:?}"
    );
    assert!(
        !says_it_leads(&servers[0]),
        "the cut-off server still leads"
    );
    // The node reaches the new leader, stays ready, and its alloc runs on.
    let after = wait_for(
        "the alloc reported running",
        Duration::from_secs(30),
        || servers[1].running_alloc("cut-off"),
    )?;
    assert_eq!(after, alloc);
    assert_node_ready(&servers[1])?;
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().expect("sampler");
    assert!(samples > 20, "only {samples} samples");
    assert!(
        both.lock().unwrap().is_empty(),
        "both servers led at once in samples {:?}",
        both.lock().unwrap()
    );

    // Back in touch, the first server follows the second.
    etcd.members[0].resume();
    wait_for(
        "the first server to follow",
        Duration::from_secs(15),
        || Ok((servers[0].leader()? == second_rpc).then_some(())),
    )?;
    Ok(())
}

#[test]
fn one_etcd_member_lost_changes_nothing_and_two_stop_writes_but_mark_no_node_down() -> Result<()> {
    let mut etcd = EtcdCluster::start(3);
    let endpoints = etcd.endpoints();
    let keys = tempfile::tempdir()?;
    let servers = [
        Server::start_on_etcd(&endpoints, "/faults", keys.path())?,
        Server::start_on_etcd(&endpoints, "/faults", keys.path())?,
    ];
    let client =
        Client::start_with_servers(&format!("{},{}", servers[0].rpc, servers[1].rpc), "n1", "")?;
    let leader = wait_leader(&servers, &[0, 1], Duration::from_secs(15))?;
    let mut lead = &servers[leader];
    let mut follower = &servers[1 - leader];
    wait_for("the node ready", Duration::from_secs(30), || {
        Ok(assert_node_ready(lead).ok())
    })
    .with_context(|| client.agent.log())?;
    let dir = tempfile::tempdir()?;
    assert!(submit(follower, dir.path(), "before")?);
    let alloc = wait_for("the alloc running", Duration::from_secs(30), || {
        lead.running_alloc("before")
    })?;

    // One member lost: writes go on, and the operator sees which.
    etcd.members[0].kill();
    let store = follower.get("/v1/operator/store")?;
    assert_eq!(store["store"], "etcd", "{store}");
    let healthy: Vec<bool> = store["members"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| m["healthy"] == true)
        .collect();
    assert_eq!(healthy, [false, true, true], "{store}");
    wait_for(
        "a write with one member lost",
        Duration::from_secs(10),
        || Ok(submit(follower, dir.path(), "one-lost")?.then_some(())),
    )?;

    // Two lost: no quorum. The leader gives up, writes are refused with
    // why, reads answer, and no node is marked down.
    etcd.members[1].kill();
    wait_for("no server to lead", Duration::from_secs(10), || {
        Ok((servers[0].leader()?.is_empty() && servers[1].leader()?.is_empty()).then_some(()))
    })?;
    let refused = http_at(
        servers[0].http_port,
        "DELETE /v1/job/before HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.text().contains("no quorum"), "{}", refused.text());
    // Longer than the node's TTL and grace: nobody marks it down.
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        for s in &servers {
            assert_node_ready(s)?;
            assert_eq!(s.running_alloc("before")?, Some(alloc.clone()));
        }
        std::thread::sleep(Duration::from_millis(250));
    }

    // The members return: a leader again, writes go on, the node and its
    // alloc as they were.
    etcd.members[0].restart_in_background();
    etcd.members[1].restart_in_background();
    let leader = wait_leader(&servers, &[0, 1], Duration::from_secs(30))?;
    lead = &servers[leader];
    follower = &servers[1 - leader];
    wait_for(
        "a write after the members return",
        Duration::from_secs(15),
        || Ok(submit(follower, dir.path(), "after")?.then_some(())),
    )?;
    assert_node_ready(lead)?;
    assert_eq!(lead.running_alloc("before")?, Some(alloc));
    Ok(())
}
