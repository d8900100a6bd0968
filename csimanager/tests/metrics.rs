//! What the CSI side records in berth's metrics, against the real
//! `hostpath-plugin`: every call timed under its plugin and method, a
//! failed call counted under its gRPC code, a volume's mount and unmount
//! timed with their outcome.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use berth_csimanager::CsiClient;
use berth_proto::csi::v1 as csi;
use common::*;

/// The value of the sample line that starts with `series` (names and
/// labels exactly as encoded), if there is one.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn csi_calls_are_timed_and_failures_counted_by_grpc_code() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = PluginProcess::start(dir.path(), &[]).await;
    let client =
        CsiClient::connect("metrics-calls", &plugin.socket, Duration::from_secs(5)).unwrap();
    client.probe(csi::ProbeRequest {}).await.expect("Probe");
    // A stage without a volume ID is refused: InvalidArgument.
    client
        .node_stage_volume(csi::NodeStageVolumeRequest::default())
        .await
        .expect_err("a stage without a volume ID");
    // A plugin that is not there: Unavailable.
    let gone = CsiClient::connect(
        "metrics-gone",
        &dir.path().join("no.sock"),
        Duration::from_secs(1),
    )
    .unwrap();
    gone.probe(csi::ProbeRequest {})
        .await
        .expect_err("no plugin");

    let text = berth_metrics::encode();
    for (series, at_least) in [
        (
            r#"berth_csi_rpc_duration_seconds_count{plugin="metrics-calls",method="Probe"}"#,
            1.0,
        ),
        (
            r#"berth_csi_rpc_duration_seconds_count{plugin="metrics-calls",method="NodeStageVolume"}"#,
            1.0,
        ),
        (
            r#"berth_csi_rpc_errors_total{plugin="metrics-calls",method="NodeStageVolume",code="InvalidArgument"}"#,
            1.0,
        ),
        (
            r#"berth_csi_rpc_errors_total{plugin="metrics-gone",method="Probe",code="Unavailable"}"#,
            1.0,
        ),
    ] {
        let n = sample(&text, series).unwrap_or(0.0);
        assert!(n >= at_least, "{series} is {n}:\n{text}");
    }
    // A call that succeeded is no error.
    assert_eq!(
        sample(
            &text,
            r#"berth_csi_rpc_errors_total{plugin="metrics-calls",method="Probe",code="InvalidArgument"}"#
        ),
        None,
        "{text}"
    );
}

#[tokio::test]
async fn a_volumes_mount_and_unmount_are_timed_with_their_outcome() {
    let h = Harness::start(&[]).await;
    let ext = h.create_volume("timed").await;
    let m = mount_req("timed", &ext, "alloc-timed");
    h.manager.mount_volume(m.clone()).await.expect("mount");
    h.manager
        .unmount_volume(unmount_req(&m))
        .await
        .expect("unmount");
    // A mount the plugin refuses (no such volume) is timed as an error.
    let bad = mount_req("missing", "no-such-volume", "alloc-timed");
    h.manager
        .mount_volume(bad)
        .await
        .expect_err("no such volume");

    let text = berth_metrics::encode();
    for series in [
        r#"berth_csi_mount_duration_seconds_count{plugin="hostpath",outcome="ok"}"#,
        r#"berth_csi_unmount_duration_seconds_count{plugin="hostpath",outcome="ok"}"#,
        r#"berth_csi_mount_duration_seconds_count{plugin="hostpath",outcome="error"}"#,
        r#"berth_csi_rpc_duration_seconds_count{plugin="hostpath",method="NodeStageVolume"}"#,
        r#"berth_csi_rpc_duration_seconds_count{plugin="hostpath",method="NodePublishVolume"}"#,
        r#"berth_csi_rpc_duration_seconds_count{plugin="hostpath",method="NodeUnpublishVolume"}"#,
        r#"berth_csi_rpc_duration_seconds_count{plugin="hostpath",method="NodeUnstageVolume"}"#,
    ] {
        let n = sample(&text, series).unwrap_or(0.0);
        assert!(n >= 1.0, "{series} is {n}:\n{text}");
    }
}
