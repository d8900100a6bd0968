//! A node RPC with a wrong node secret, sent over the real agent protocol
//! to a real `berth agent -dev`, is refused and changes nothing: the dev
//! node stays ready under its name and its running alloc stays running.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_tests::{free_port, only_alloc, sleeping_service_job, wait_for, DevAgent};
use serde_json::Value;
use tonic::transport::Channel;

const FORGED: &str = "forged-node-secret-0123456789abcdef";

fn forged<T>(message: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut()
        .insert(pb::NODE_SECRET_METADATA, FORGED.parse().expect("ascii"));
    req.set_timeout(Duration::from_secs(10));
    req
}

fn assert_refused<T: std::fmt::Debug>(what: &str, r: Result<T, tonic::Status>, node_id: &str) {
    let err = r.expect_err(what);
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "{what}: {}",
        err.message()
    );
    assert!(err.message().contains(node_id), "{what}: {}", err.message());
    assert!(!err.message().contains(FORGED), "{what}: {}", err.message());
}

#[test]
fn a_node_rpc_with_a_wrong_secret_is_refused_and_changes_nothing() -> Result<()> {
    let rpc_port = free_port();
    let rpc_addr = format!("127.0.0.1:{rpc_port}");
    let agent = DevAgent::start_with_args(&["-rpc-addr", &rpc_addr])?;

    // The client's state database holds the node secret: owner-only.
    let state = agent.data_dir.path().join("client").join("state.redb");
    let mode = std::fs::metadata(&state)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", state.display());

    let spec = agent.write_file("sleeper.hcl", &sleeping_service_job("sleeper", 1, 0))?;
    agent.cli_ok(&["job", "run", "-detach", &spec])?;
    let alloc = wait_for("the alloc to run", Duration::from_secs(60), || {
        let a = only_alloc(&agent, "sleeper")?;
        Ok((a["client_status"] == "running").then_some(a))
    })
    .with_context(|| agent.log())?;
    let alloc_id = alloc["id"].as_str().context("alloc id")?.to_string();
    let node_id = agent
        .cli_json(&["node", "status", "-json"])?
        .as_array()
        .and_then(|a| a.first())
        .and_then(|n| n["id"].as_str())
        .context("the dev node's ID")?
        .to_string();
    let node: Value = agent.api_get(&format!("/v1/node/{node_id}"))?;

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let channel = Channel::from_shared(format!("http://{rpc_addr}"))?
            .connect()
            .await?;
        let mut nc = NodeClient::new(channel);
        let mut impostor = node.clone();
        impostor["name"] = "impostor".into();
        assert_refused(
            "register",
            nc.register(forged(pb::RegisterRequest {
                node_json: serde_json::to_vec(&impostor)?,
                ..Default::default()
            }))
            .await,
            &node_id,
        );
        assert_refused(
            "heartbeat",
            nc.heartbeat(forged(pb::HeartbeatRequest {
                node_id: node_id.clone(),
            }))
            .await,
            &node_id,
        );
        assert_refused(
            "update allocs",
            nc.update_allocations(forged(pb::UpdateAllocationsRequest {
                node_id: node_id.clone(),
                updates: vec![pb::AllocStatusUpdate {
                    alloc_id: alloc_id.clone(),
                    client_status: "failed".into(),
                    client_description: "forged".into(),
                    task_states_json: vec![],
                    ..Default::default()
                }],
            }))
            .await,
            &node_id,
        );
        assert_refused(
            "events",
            nc.emit_events(forged(pb::EmitEventsRequest {
                node_id: node_id.clone(),
                events: vec![pb::NodeEvent {
                    subsystem: "Cluster".into(),
                    message: "forged event".into(),
                    details: Default::default(),
                    timestamp_ms: 1,
                }],
            }))
            .await,
            &node_id,
        );
        anyhow::Ok(())
    })?;

    // Nothing changed: the alloc runs, the node is ready under its name
    // and carries no forged event, and the agent still serves its client.
    let a = only_alloc(&agent, "sleeper")?;
    assert_eq!(a["client_status"], "running", "{a}");
    let after = agent.api_get(&format!("/v1/node/{node_id}"))?;
    assert_eq!(after["status"], "ready", "{after}");
    assert_eq!(after["name"], node["name"], "{after}");
    assert!(!after.to_string().contains("forged"), "{after}");
    assert!(
        agent.log().contains("node RPC refused"),
        "the refusals are logged"
    );
    assert!(!agent.log().contains(FORGED), "no secret in the log");
    Ok(())
}
