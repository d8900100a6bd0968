//! Validation at the door: the servers refuse jobs, volumes and nodes whose
//! names would become unsafe paths on a node, or whose numbers are beyond
//! their limits, with a message naming the field; nothing of them is
//! stored and no call reaches a client.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_proto::berth::v1 as pb;
use berth_server::ServerError;
use berth_structs::{AccessMode, JobType};
use support::*;

fn validation_message(e: ServerError) -> String {
    assert_eq!(e.http_status(), 400, "{e}");
    assert_eq!(e.grpc_code(), tonic::Code::InvalidArgument, "{e}");
    match e {
        ServerError::Validation(v) => v.to_string(),
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[tokio::test]
async fn register_job_refuses_names_that_escape_a_path() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;

    let mut bad_task = job("web", JobType::Service, 1);
    bad_task.task_groups[0].tasks[0].name = "../x".into();
    let msg = validation_message(s.register_job(bad_task).await.unwrap_err());
    assert!(
        msg.starts_with("group \"g\" task \"../x\": task name \"../x\" is not allowed"),
        "{msg}"
    );

    let mut bad_plugin = job("web", JobType::Service, 1);
    bad_plugin.task_groups[0].tasks[0].csi_plugin = Some(berth_structs::TaskCsiPluginConfig {
        id: "../../plugins".into(),
        plugin_type: berth_structs::CsiPluginType::Monolith,
        mount_dir: "/csi".into(),
        stage_publish_base_dir: None,
        health_timeout: berth_structs::TaskCsiPluginConfig::DEFAULT_HEALTH_TIMEOUT,
    });
    let msg = validation_message(s.register_job(bad_plugin).await.unwrap_err());
    assert!(
        msg.contains("csi_plugin.id \"../../plugins\" is not allowed"),
        "{msg}"
    );

    let msg = validation_message(
        s.register_job(volume_job(
            "writer",
            "../../../../../escape_target",
            AccessMode::SingleNodeWriter,
        ))
        .await
        .unwrap_err(),
    );
    assert!(
        msg.contains("source \"../../../../../escape_target\" is not allowed"),
        "{msg}"
    );

    let msg = validation_message(
        s.register_job(job("../etc", JobType::Batch, 1))
            .await
            .unwrap_err(),
    );
    assert!(msg.contains("job ID \"../etc\" is not allowed"), "{msg}");

    // Nothing of them was stored or placed.
    assert!(s.jobs().is_empty(), "{:?}", s.jobs());
    assert!(s.allocations().is_empty());

    // The same job with plain names is accepted.
    s.register_job(job("web", JobType::Service, 1))
        .await
        .unwrap();
    assert_eq!(s.jobs().len(), 1);
}

#[tokio::test]
async fn register_job_refuses_numbers_beyond_their_limits() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    let mut j = job("web", JobType::Service, 2);
    j.task_groups[0].tasks[0].resources.cpu = u64::MAX;
    let msg = validation_message(s.register_job(j).await.unwrap_err());
    assert_eq!(
        msg,
        "group \"g\" task \"t\": resources.cpu 18446744073709551615 is too large (at most \
         10000000 MHz)"
    );
    let msg = validation_message(
        s.register_job(job("web", JobType::Service, u32::MAX))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        msg,
        "group \"g\": count 4294967295 is too large (at most 10000)"
    );
    assert!(s.jobs().is_empty());
}

#[tokio::test]
async fn create_and_register_volume_refuse_an_id_that_escapes() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();
    register(&s, node("n1")).await;
    give_plugin(&s, "n1", "hostpath", true, true, false).await;
    let client = TestClient::connect(&ts, "n1", ok_handler()).await;

    let escape = volume(
        "../../../../../escape_target",
        "hostpath",
        &[AccessMode::SingleNodeWriter],
    );
    let msg = validation_message(s.create_volume(escape.clone()).await.unwrap_err());
    assert!(
        msg.starts_with("volume: volume ID \"../../../../../escape_target\" is not allowed"),
        "{msg}"
    );
    let msg = validation_message(s.register_volume(escape).await.unwrap_err());
    assert!(
        msg.starts_with("volume: volume ID \"../../../../../escape_target\" is not allowed"),
        "{msg}"
    );

    let bad_plugin = volume("data", "../hostpath", &[AccessMode::SingleNodeWriter]);
    let msg = validation_message(s.register_volume(bad_plugin.clone()).await.unwrap_err());
    assert!(
        msg.contains("plugin_id \"../hostpath\" is not allowed"),
        "{msg}"
    );
    let msg = validation_message(s.create_volume(bad_plugin).await.unwrap_err());
    assert!(
        msg.contains("plugin_id \"../hostpath\" is not allowed"),
        "{msg}"
    );

    // Refused at the door: no plugin was asked, nothing was stored.
    assert!(client.call_kinds().is_empty(), "{:?}", client.call_kinds());
    assert!(s.volumes().is_empty());

    // A plain ID gets through to the plugin.
    s.create_volume(volume("data", "hostpath", &[AccessMode::SingleNodeWriter]))
        .await
        .unwrap();
    assert_eq!(client.call_kinds(), ["CreateVolume"]);
}

#[tokio::test]
async fn node_registration_refuses_ids_and_names_that_escape() {
    let ts = TestServer::start(|_| {}).await;
    let s = ts.server.clone();

    let msg = validation_message(s.register_node(node("../n1")).await.unwrap_err());
    assert!(
        msg.starts_with("node: node ID \"../n1\" is not allowed"),
        "{msg}"
    );
    let mut bad_name = node("n1");
    bad_name.name = "a/b".into();
    let msg = validation_message(s.register_node(bad_name).await.unwrap_err());
    assert!(
        msg.starts_with("node: node name \"a/b\" is not allowed"),
        "{msg}"
    );
    let msg = validation_message(s.register_node(node("")).await.unwrap_err());
    assert!(
        msg.contains("node ID \"\" is not allowed (it is empty)"),
        "{msg}"
    );

    // Over gRPC, as a client registers: InvalidArgument with the message.
    let mut nc = ts.node_client().await;
    let err = nc
        .register(pb::RegisterRequest {
            node_json: serde_json::to_vec(&node("..")).unwrap(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("node ID \"..\" is not allowed"),
        "{}",
        err.message()
    );
    assert!(s.nodes().is_empty(), "{:?}", s.nodes());

    register(&s, node("n1")).await;
    assert_eq!(s.nodes().len(), 1);
}

#[tokio::test]
async fn a_job_or_a_node_of_another_region_is_refused_with_both_regions() {
    let ts = TestServer::start(|c| c.region = "eu-west".into()).await;
    let s = ts.server.clone();
    let mut n1 = node("n1");
    n1.region = "eu-west".into();
    register(&s, n1).await;

    let mut other = node("n2");
    other.region = "us-east".into();
    let msg = validation_message(s.register_node(other).await.unwrap_err());
    assert!(
        msg.contains("node \"n2\" is in region \"us-east\", these servers in \"eu-west\""),
        "{msg}"
    );
    // A node that names no region is in `global`.
    let msg = validation_message(s.register_node(node("n3")).await.unwrap_err());
    assert!(msg.contains("region \"global\""), "{msg}");

    let mut far = job("far", JobType::Service, 1);
    far.region = "us-east".into();
    let msg = validation_message(s.plan_job(far.clone()).unwrap_err());
    assert!(
        msg.contains("region \"us-east\" is not this cluster's region \"eu-west\""),
        "{msg}"
    );
    let msg = validation_message(s.register_job(far).await.unwrap_err());
    assert!(msg.contains("is not this cluster's region"), "{msg}");
    assert!(s.job("far").is_err());

    // This region's name, or none, is taken.
    let mut here = job("here", JobType::Service, 1);
    here.region = "eu-west".into();
    s.register_job(here).await.unwrap();
    s.register_job(job("unnamed", JobType::Service, 1))
        .await
        .unwrap();
}
