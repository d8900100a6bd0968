//! Datacenters: a client's `datacenter` is registered with its node, and
//! a job runs only on the nodes of the datacenters it lists, by name or
//! glob; one that lists none of them is a placement failure naming the
//! node's datacenter.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{logs, marked_service_job, node_of, Client, Server};
use berth_tests::wait_for;

fn in_datacenters(job: &str, datacenters: &[&str], count: u32) -> String {
    let list = datacenters
        .iter()
        .map(|d| format!("{d:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    marked_service_job(job, count, None, None).replacen(
        "  type = \"service\"",
        &format!("  type = \"service\"\n  datacenters = [{list}]"),
        1,
    )
}

#[test]
fn a_job_runs_only_in_the_datacenters_it_lists() -> Result<()> {
    let mut server = Server::start("")?;
    let east = Client::start_with_config(&server.rpc, "dc-east", "", "datacenter = \"us-east-1\"")?;
    let west = Client::start_with_config(&server.rpc, "dc-west", "", "")?;
    let ids = server
        .wait_nodes_ready(&["dc-east", "dc-west"])
        .with_context(|| logs(&server, &[&east, &west]))?;
    assert_eq!(server.node("dc-east")?["datacenter"], "us-east-1");
    assert_eq!(server.node("dc-west")?["datacenter"], "dc1");

    // Two allocs, by a glob: both on the east node.
    let job = "dc-glob";
    server.run_job(job, &in_datacenters(job, &["us-*"], 2))?;
    let allocs = wait_for("both allocs running", Duration::from_secs(30), || {
        let allocs = server.allocs(job)?;
        let running = allocs
            .iter()
            .filter(|a| a["client_status"] == "running")
            .count();
        Ok((running == 2).then_some(allocs))
    })
    .with_context(|| logs(&server, &[&east, &west]))?;
    assert!(allocs.iter().all(|a| node_of(a) == ids[0]), "{allocs:?}");

    // A datacenter no node is in: nothing placed, and the failure names
    // what the nodes are in.
    let lost = "dc-none";
    server.run_job(lost, &in_datacenters(lost, &["eu-west-1"], 1))?;
    let failures = wait_for("the placement failure", Duration::from_secs(10), || {
        let job = server.get(&format!("/v1/job/{lost}"))?;
        let lines = job["placement_failures"].to_string();
        Ok(lines
            .contains("not in the job's datacenters")
            .then_some(lines))
    })?;
    assert!(
        failures.contains("\\\"us-east-1\\\"") && failures.contains("\\\"dc1\\\""),
        "{failures}"
    );
    assert!(server.allocs(lost)?.is_empty());
    server.stop_marked_job(job)?;
    Ok(())
}
