//! Three etcd members, three servers on them and two clients: jobs,
//! volumes and claims work through any server's API, a client that
//! reaches only a follower runs its allocs through it, and every server
//! agrees on who leads.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{
    logs, marked_service_job, marker_pids, members_agree, shared_plugin_job, wait_leader,
    write_claims, writer_volume, Client, Server,
};
use berth_tests::wait_for;
use berth_testutil::etcd::EtcdCluster;

/// Waits until `server` shows the write claims of `volume` as `want`.
fn wait_claims(server: &Server, volume: &str, want: &[&str]) -> Result<()> {
    let want: std::collections::BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    wait_for(
        &format!("the claims of {volume} to be {want:?}"),
        Duration::from_secs(30),
        || Ok((write_claims(&server.volume(volume)?) == want).then_some(())),
    )
}

#[test]
fn three_servers_serve_jobs_volumes_and_claims_through_any_of_them() -> Result<()> {
    let etcd = EtcdCluster::start(3);
    let keys = tempfile::tempdir()?;
    let endpoints = etcd.endpoints();
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(Server::start_on_etcd(&endpoints, "/three", keys.path())?);
    }
    let l = wait_leader(&servers, &[0, 1, 2], Duration::from_secs(15))?;
    let (f1, f2) = match l {
        0 => (1, 2),
        1 => (0, 2),
        _ => (0, 1),
    };
    let leader = servers[l].rpc.clone();

    // Every server says the same of the election.
    for server in &servers {
        wait_for("the leader known", Duration::from_secs(10), || {
            Ok((server.leader()? == leader).then_some(()))
        })?;
        members_agree(server, 3, &leader)?;
    }

    // One client reaches a follower alone; the other lists the second
    // follower first.
    let a = Client::start_with_servers(&servers[f1].rpc, "n-a", "")?;
    let b = Client::start_with_servers(
        &format!("{},{}", servers[f2].rpc, servers[l].rpc),
        "n-b",
        "",
    )?;
    let all_logs = |servers: &[Server]| {
        servers
            .iter()
            .map(|s| logs(s, &[&a, &b]))
            .collect::<Vec<_>>()
            .join("\n")
    };
    servers[f2]
        .wait_nodes_ready(&["n-a", "n-b"])
        .with_context(|| all_logs(&servers))?;

    // The plugin through one follower, the volume through the other.
    let shared = tempfile::tempdir()?;
    servers[f1].run_job("plugin", &shared_plugin_job(shared.path())?)?;
    servers[f2]
        .wait_plugin_nodes(2)
        .with_context(|| all_logs(&servers))?;
    servers[f2].create_volume("vol-3", &writer_volume("vol-3"))?;

    // A volume job run through one server and stopped through another,
    // every pair in turn: each server shows the claim, then its end.
    for (run_via, stop_via) in [(f1, f2), (f2, l), (l, f1)] {
        servers[run_via].run_job(
            "writer3",
            &marked_service_job("writer3", 1, None, Some("vol-3")),
        )?;
        let alloc = wait_for("the writer running", Duration::from_secs(60), || {
            servers[stop_via].running_alloc("writer3")
        })
        .with_context(|| all_logs(&servers))?;
        for server in &servers {
            wait_claims(server, "vol-3", &[alloc.as_str()])?;
        }
        // The alloc's node-local routes answer through every server,
        // whichever holds the node's call stream.
        for server in &servers {
            let local = server.get(&format!("/v1/client/allocation/{alloc}"))?;
            assert!(local.to_string().contains(alloc.as_str()), "{local}");
        }
        servers[stop_via].cli(&["job", "stop", "writer3"])?;
        for server in &servers {
            wait_claims(server, "vol-3", &[]).with_context(|| all_logs(&servers))?;
        }
        for client in [&a, &b] {
            anyhow::ensure!(
                client.mounts_with(&alloc).is_empty(),
                "the stopped alloc's volume is still mounted on {}",
                client.name
            );
        }
    }
    wait_for("no writer left", Duration::from_secs(30), || {
        Ok(marker_pids("writer3").is_empty().then_some(()))
    })?;
    for client in [&a, &b] {
        assert!(
            !client.agent.log().contains("does not lead"),
            "a follower refused {}: {}",
            client.name,
            client.agent.log()
        );
    }
    Ok(())
}
