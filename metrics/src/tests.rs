use super::*;

#[test]
fn encode_has_every_family_with_help_type_and_unit() {
    record_csi_rpc(
        "hostpath",
        "NodeStageVolume",
        Duration::from_millis(3),
        None,
    );
    record_csi_rpc(
        "hostpath",
        "NodePublishVolume",
        Duration::from_millis(2),
        Some("Unavailable"),
    );
    let m = metrics();
    m.task_starts.inc();
    m.task_restarts.inc();
    m.task_exits
        .get_or_create(&OutcomeLabels { outcome: "success" })
        .inc();
    m.heartbeat_duration.observe(0.002);
    m.heartbeat_failures.inc();
    m.server_heartbeats.inc();
    for family in [
        &m.csi_claim_duration,
        &m.csi_unpublish_duration,
        &m.csi_mount_duration,
        &m.csi_unmount_duration,
    ] {
        observe_plugin_op(family, "hostpath", Outcome::Ok, Duration::from_millis(5));
    }
    m.server_claim_duration
        .get_or_create(&ModeOutcomeLabels {
            mode: "write",
            outcome: Outcome::Error,
        })
        .observe(0.01);
    record_node_event("Storage");
    set_nodes(&[("ready", 1), ("down", 0)]);
    set_client_allocs(&[("running", 1)]);
    record_state_commit(Db::Client, Duration::from_micros(700));
    record_store_write_conflict("moved");
    set_leader(true);
    set_allocs(&[("running", 2), ("complete", 0)]);
    let text = encode();
    for family in [
        "# TYPE berth_csi_rpc_duration_seconds histogram",
        "# TYPE berth_csi_rpc_errors_total counter",
        "# TYPE berth_csi_claim_duration_seconds histogram",
        "# TYPE berth_csi_unpublish_duration_seconds histogram",
        "# TYPE berth_csi_mount_duration_seconds histogram",
        "# TYPE berth_csi_unmount_duration_seconds histogram",
        "# TYPE berth_server_claim_duration_seconds histogram",
        "# TYPE berth_heartbeat_duration_seconds histogram",
        "# TYPE berth_heartbeat_failures_total counter",
        "# TYPE berth_server_heartbeats_total counter",
        "# TYPE berth_nodes gauge",
        "# TYPE berth_allocs gauge",
        "# TYPE berth_client_allocs gauge",
        "# TYPE berth_task_starts_total counter",
        "# TYPE berth_task_restarts_total counter",
        "# TYPE berth_task_exits_total counter",
        "# TYPE berth_state_commit_duration_seconds histogram",
        "# TYPE berth_node_events_total counter",
        "# TYPE berth_server_leader gauge",
        "# TYPE berth_leadership_changes_total counter",
        "# TYPE berth_store_write_conflicts_total counter",
        "# TYPE berth_etcd_watch_lag_revisions gauge",
        "# TYPE berth_build_info gauge",
        "# TYPE process_resident_memory_bytes gauge",
        "# TYPE process_cpu_seconds_total counter",
        "# TYPE process_open_fds gauge",
        "# HELP berth_csi_rpc_duration_seconds Time of one CSI call to a plugin.",
    ] {
        assert!(text.contains(family), "{family} missing from:\n{text}");
    }
    // The 0.0.4 text format: no OpenMetrics-only lines.
    assert!(
        !text.contains("# UNIT") && !text.contains("# EOF"),
        "{text}"
    );
    for sample in [
        r#"berth_csi_rpc_duration_seconds_count{plugin="hostpath",method="NodeStageVolume"} 1"#,
        r#"berth_csi_rpc_errors_total{plugin="hostpath",method="NodePublishVolume",code="Unavailable"} 1"#,
        r#"berth_state_commit_duration_seconds_count{db="client"} 1"#,
        r#"berth_allocs{client_status="running"} 2"#,
        r#"berth_allocs{client_status="complete"} 0"#,
        r#"berth_task_starts_total "#,
        r#"berth_csi_mount_duration_seconds_count{plugin="hostpath",outcome="ok"} 1"#,
        r#"berth_server_claim_duration_seconds_count{mode="write",outcome="error"} 1"#,
        r#"berth_node_events_total{subsystem="Storage"} 1"#,
        r#"berth_store_write_conflicts_total{reason="moved"} 1"#,
        "berth_server_leader 1",
        r#"berth_nodes{status="ready"} 1"#,
        r#"berth_task_exits_total{outcome="success"} 1"#,
        "berth_build_info{version=\"",
    ] {
        assert!(text.contains(sample), "{sample} missing from:\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("process_resident_memory_bytes ") && !l.ends_with(" 0")),
        "{text}"
    );
}

#[test]
fn latency_buckets_run_from_half_a_millisecond_to_thirty_seconds() {
    record_csi_rpc("buckets", "Probe", Duration::from_secs(100), None);
    let text = encode();
    let bounds: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.starts_with("berth_csi_rpc_duration_seconds_bucket{")
                && l.contains("plugin=\"buckets\"")
        })
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            le.parse().ok()
        })
        .collect();
    assert!((bounds[0] - 0.0005).abs() < 1e-9, "{bounds:?}");
    let finite: Vec<f64> = bounds.iter().copied().filter(|b| b.is_finite()).collect();
    assert!((finite[finite.len() - 1] - 30.0).abs() < 1e-6, "{bounds:?}");
    assert!(finite.windows(2).all(|w| w[1] > w[0]), "{bounds:?}");
    assert_eq!(bounds.last(), Some(&f64::INFINITY), "{bounds:?}");
}

#[test]
fn label_values_are_escaped() {
    record_csi_rpc("we\"ird\\plug\nin", "Probe", Duration::from_millis(1), None);
    let text = encode();
    assert!(
        text.contains(r#"plugin="we\"ird\\plug\nin""#),
        "label not escaped:\n{text}"
    );
    // No sample is cut in two by the newline.
    assert!(!text.lines().any(|l| l.starts_with("in\"")), "{text}");
}

#[test]
fn status_gauges_drop_to_zero_when_a_status_empties() {
    set_client_allocs(&[("running", 3), ("pending", 1)]);
    set_client_allocs(&[("running", 0), ("pending", 1)]);
    let text = encode();
    assert!(
        text.contains(r#"berth_client_allocs{client_status="running"} 0"#),
        "{text}"
    );
}

#[test]
fn outcome_of_a_result() {
    assert_eq!(Outcome::of(&Ok::<(), ()>(())), Outcome::Ok);
    assert_eq!(Outcome::of(&Err::<(), ()>(())), Outcome::Error);
}

#[test]
fn node_events_of_subsystems_berth_does_not_know_are_counted_as_other() {
    // A client may report any subsystem: one series per name sent would
    // grow without bound.
    for i in 0..50 {
        record_node_event(&format!("made-up-{i}"));
    }
    let text = encode();
    assert!(!text.contains("made-up-"), "{text}");
    let other = text
        .lines()
        .find(|l| l.starts_with(r#"berth_node_events_total{subsystem="other"}"#))
        .unwrap_or_else(|| panic!("no other series in {text}"));
    let n: u64 = other.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 50, "{other}");
}

#[tokio::test]
async fn a_scrape_on_a_runtime_counts_its_alive_tasks() {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let held = tokio::spawn(async move {
        let _ = rx.await;
    });
    let text = encode();
    let alive: i64 = text
        .lines()
        .find_map(|l| l.strip_prefix("berth_runtime_alive_tasks "))
        .unwrap_or_else(|| panic!("no berth_runtime_alive_tasks in:\n{text}"))
        .trim()
        .parse()
        .expect("a count");
    assert!(alive >= 1, "the task held open is alive: {alive}");
    let _ = tx.send(());
    held.await.unwrap();
}
