//! Constraints on a cluster of one server and two clients: a job pinned to
//! a node by name runs only there; `distinct_hosts` spreads two allocs
//! over both nodes; a constraint no node meets is a placement failure
//! naming it and the nodes it filtered; the node's fingerprinted
//! attributes and meta are what the constraints read. A spread over
//! racks splits allocs by rack, not by node (three clients, two racks).

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{logs, marked_job, node_of, Client, Server};
use berth_tests::wait_for;

fn constrained(job: &str, count: u32, constraint: &str) -> String {
    marked_job(
        job,
        "service",
        count,
        &format!("constraint {{\n{constraint}\n}}"),
        None,
    )
}

/// The IDs of the nodes the running allocs of `job` are on, once `count`
/// run.
fn running_on(server: &Server, job: &str, count: usize) -> Result<Vec<String>> {
    wait_for(
        &format!("{count} allocs of {job} running"),
        Duration::from_secs(30),
        || {
            let allocs = server.allocs(job)?;
            let running: Vec<String> = allocs
                .iter()
                .filter(|a| a["client_status"] == "running")
                .map(|a| node_of(a).to_string())
                .collect();
            Ok((running.len() == count).then_some(running))
        },
    )
}

#[test]
fn constraints_pin_spread_and_explain_placements() -> Result<()> {
    let mut server = Server::start("")?;
    let a = Client::start_with_config(&server.rpc, "cons-a", "meta { rack = \"r1\" }", "")?;
    let b = Client::start_with_config(&server.rpc, "cons-b", "meta { rack = \"r2\" }", "")?;
    let ids = server
        .wait_nodes_ready(&["cons-a", "cons-b"])
        .with_context(|| logs(&server, &[&a, &b]))?;
    let node = server.node("cons-b")?;
    assert_eq!(node["attributes"]["kernel.name"], "linux", "{node}");
    assert_eq!(node["attributes"]["driver.raw_exec"], "1", "{node}");
    assert!(
        node["attributes"]["cpu.numcores"]
            .as_str()
            .is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n > 0)),
        "{node}"
    );

    // Pinned by name: both allocs on cons-b.
    let pinned = "cons-pinned";
    let by_name = "attribute = \"${node.unique.name}\"\nvalue = \"cons-b\"";
    server.run_job(pinned, &constrained(pinned, 2, by_name))?;
    let on = running_on(&server, pinned, 2).with_context(|| logs(&server, &[&a, &b]))?;
    assert!(on.iter().all(|n| *n == ids[1]), "{on:?}");

    // distinct_hosts: one alloc on each node, though both fit on one.
    let spread = "cons-distinct";
    server.run_job(
        spread,
        &constrained(spread, 2, "operator = \"distinct_hosts\"\nvalue = \"true\""),
    )?;
    let mut on = running_on(&server, spread, 2)?;
    on.sort();
    let mut both = ids.clone();
    both.sort();
    assert_eq!(on, both);

    // A rack no node is in, by meta: a failure naming the constraint and
    // the two nodes it filtered; `job plan` says the same.
    let nowhere = "cons-nowhere";
    let by_rack = "attribute = \"${meta.rack}\"\nvalue = \"r9\"";
    server.run_job(nowhere, &constrained(nowhere, 1, by_rack))?;
    let failures = wait_for("the placement failure", Duration::from_secs(10), || {
        let job = server.get(&format!("/v1/job/{nowhere}"))?;
        let lines = job["placement_failures"].to_string();
        Ok(lines.contains("not met").then_some(lines))
    })?;
    assert!(
        failures.contains(r#"2 nodes (cons-a, cons-b): constraint \"${meta.rack} = r9\" not met"#),
        "{failures}"
    );
    assert!(server.allocs(nowhere)?.is_empty());

    for job in [pinned, spread] {
        server.stop_marked_job(job)?;
    }
    Ok(())
}

#[test]
fn a_spread_splits_allocs_by_rack_not_by_node() -> Result<()> {
    let mut server = Server::start("")?;
    let a = Client::start_with_config(&server.rpc, "spread-a", "meta { rack = \"r1\" }", "")?;
    let b = Client::start_with_config(&server.rpc, "spread-b", "meta { rack = \"r1\" }", "")?;
    let c = Client::start_with_config(&server.rpc, "spread-c", "meta { rack = \"r2\" }", "")?;
    let ids = server
        .wait_nodes_ready(&["spread-a", "spread-b", "spread-c"])
        .with_context(|| logs(&server, &[&a, &b, &c]))?;
    let job = "spread-racks";
    let spec = marked_job(
        job,
        "service",
        4,
        "spread {\nattribute = \"${meta.rack}\"\n}",
        None,
    );
    server.run_job(job, &spec)?;
    let on = running_on(&server, job, 4).with_context(|| logs(&server, &[&a, &b, &c]))?;
    // By node it would be 2/1/1, three in r1; by rack it is 2/2.
    let in_r2 = on.iter().filter(|n| **n == ids[2]).count();
    assert_eq!(in_r2, 2, "{on:?} (nodes {ids:?})");
    server.stop_marked_job(job)
}
