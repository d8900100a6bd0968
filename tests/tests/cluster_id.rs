//! Two unrelated servers listed in one client's `servers`: each is a
//! cluster of its own (its cluster ID, made at its first start), and the
//! client stays with the one it registered with. When that server dies
//! the client does not move to the other, which would tell it its allocs
//! are gone; the other never learns of the node; and when its own server
//! comes back the node and its alloc are as they were.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{Client, Server};
use berth_tests::{sleeping_service_job, wait_for};

#[test]
fn a_client_stays_with_its_cluster_when_an_unrelated_server_is_listed() -> Result<()> {
    let mut own = Server::start("")?;
    let other = Server::start("")?;
    let client = Client::start_with_servers(&format!("{},{}", own.rpc, other.rpc), "n1", "")?;
    own.wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    own.run_job("sleepy", &sleeping_service_job("sleepy", 1, 1))?;
    let running = wait_for("the alloc running", Duration::from_secs(30), || {
        Ok(own
            .allocs("sleepy")?
            .into_iter()
            .find(|a| a["client_status"] == "running"))
    })
    .with_context(|| client.agent.log())?;
    let nodes_of_other =
        || -> Result<usize> { Ok(other.get("/v1/nodes")?.as_array().map_or(0, Vec::len)) };
    assert_eq!(nodes_of_other()?, 0, "the other cluster never saw the node");

    // Its own server dies: the client's failover reaches the other
    // server, which names another cluster, and is refused.
    own.agent.kill()?;
    wait_for(
        "the client to refuse the other cluster's server",
        Duration::from_secs(30),
        || {
            Ok(client
                .agent
                .log()
                .contains("that this node registered with")
                .then_some(()))
        },
    )
    .with_context(|| client.agent.log())?;
    assert_eq!(
        nodes_of_other()?,
        0,
        "the other cluster refused the node's requests"
    );

    // Its own server comes back: the node and its alloc are as they were.
    own.agent.start_again()?;
    own.wait_serving()?;
    own.wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    let after = wait_for(
        "the alloc reported running again",
        Duration::from_secs(30),
        || {
            let allocs = own.allocs("sleepy")?;
            Ok((allocs.len() == 1 && allocs[0]["client_status"] == "running").then_some(allocs))
        },
    )
    .with_context(|| client.agent.log())?;
    assert_eq!(
        after[0]["id"], running["id"],
        "the same alloc, not a replacement"
    );
    let restarts = after[0]["task_states"]["sleep"]["restarts"].as_u64();
    assert_eq!(
        restarts,
        Some(0),
        "the task was never stopped: {}",
        after[0]
    );
    assert_eq!(nodes_of_other()?, 0);
    Ok(())
}
