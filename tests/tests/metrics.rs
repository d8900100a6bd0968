//! What a dev agent tells about itself while a volume lives through it:
//! `GET /v1/metrics` (parsed as Prometheus parses it) and its JSON log
//! lines. The real `berth` binary, the example hostpath plugin, real
//! mounts.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{
    cli_json_at, example, free_port, http_at, only_alloc, wait_for, Agent, DevAgent,
};
use prometheus_parse::{Sample, Scrape, Value};

/// A volume secret that must never show.
const SECRET: &str = "m3tr1cs-s3cr3t-0b5e";

/// The life of a volume on `agent`: the plugin job, `volume create` of a
/// volume with a secret, and the writer job, which mounts it, runs to
/// completion, and has it unmounted and its claim freed. Returns the
/// writer's alloc ID.
fn volume_life(agent: &DevAgent) -> Result<String> {
    agent.run_example_plugin()?;
    let volume = agent.write_file(
        "hostpath-volume.hcl",
        &format!(
            "{}\nsecrets {{\n  token = \"{SECRET}\"\n}}\n",
            std::fs::read_to_string(example("volumes/hostpath.hcl"))?
        ),
    )?;
    agent.cli_ok(&["volume", "create", &volume])?;
    agent.cli_ok(&["job", "run", &example("jobs/writer.hcl")])?;
    let writer = only_alloc(agent, "writer")?;
    if writer["client_status"] != "complete" {
        bail!("the writer did not complete: {writer}");
    }
    agent.wait_volume_unclaimed("data")?;
    Ok(writer["id"].as_str().unwrap_or_default().to_string())
}

/// `GET /v1/metrics` of `agent`: its content type and body.
fn scrape(agent: &DevAgent) -> Result<(String, String)> {
    let port = agent
        .http_addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .context("the agent's port")?;
    scrape_at(port)
}

/// `GET /v1/metrics` of the agent whose HTTP API listens on `port`.
fn scrape_at(port: u16) -> Result<(String, String)> {
    let answer = http_at(
        port,
        "GET /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    if answer.status != 200 {
        bail!(
            "GET /v1/metrics answered {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    let content_type = answer
        .header("content-type")
        .unwrap_or_default()
        .to_string();
    Ok((content_type, String::from_utf8(answer.body)?))
}

fn parse(text: &str) -> Result<Scrape> {
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).context("parsing /v1/metrics")
}

/// The samples of `metric` whose labels include every `(name, value)` of
/// `labels`.
fn samples<'a>(scrape: &'a Scrape, metric: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .collect()
}

/// How many observations the histogram `metric` holds across the series
/// that match `labels` (its `+Inf` buckets).
fn histogram_count(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    samples(scrape, metric, labels)
        .iter()
        .filter_map(|s| match &s.value {
            Value::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than.is_infinite())
                .map(|b| b.count),
            _ => None,
        })
        .sum()
}

/// The value of the counter or gauge `metric` summed across the series
/// that match `labels`; `None` when there is no such series.
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let found = samples(scrape, metric, labels);
    if found.is_empty() {
        return None;
    }
    Some(
        found
            .iter()
            .map(|s| match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum(),
    )
}

#[test]
fn metrics_follow_a_volume_through_its_life() -> Result<()> {
    let agent = DevAgent::start()?;
    volume_life(&agent)?;
    // The last steps are recorded in the background after the claim is
    // freed: the client timing its release call, and sending the Storage
    // node events of the mount and unmount (in batches).
    let (content_type, text, m) = wait_for(
        "the volume's release recorded",
        Duration::from_secs(30),
        || {
            let (content_type, text) = scrape(&agent)?;
            let m = parse(&text)?;
            let released = histogram_count(
                &m,
                "berth_csi_unpublish_duration_seconds",
                &[("plugin", "hostpath")],
            ) > 0.0;
            let events =
                value(&m, "berth_node_events_total", &[("subsystem", "Storage")]).unwrap_or(0.0);
            Ok((released && events >= 2.0).then_some((content_type, text, m)))
        },
    )?;
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");

    // Every CSI call of the volume's life, timed, under the plugin's ID.
    for method in [
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "CreateVolume",
        "Probe",
        "NodeGetInfo",
    ] {
        let n = histogram_count(
            &m,
            "berth_csi_rpc_duration_seconds",
            &[("plugin", "hostpath"), ("method", method)],
        );
        assert!(n > 0.0, "no {method} call counted:\n{text}");
    }
    // The whole mount and unmount, the claim and its release, each
    // counted as a success, and the server handling the write claim.
    for metric in [
        "berth_csi_mount_duration_seconds",
        "berth_csi_unmount_duration_seconds",
        "berth_csi_claim_duration_seconds",
        "berth_csi_unpublish_duration_seconds",
    ] {
        let n = histogram_count(&m, metric, &[("plugin", "hostpath"), ("outcome", "ok")]);
        assert!(n > 0.0, "{metric} counted nothing for hostpath:\n{text}");
    }
    assert!(
        histogram_count(
            &m,
            "berth_server_claim_duration_seconds",
            &[("mode", "write"), ("outcome", "ok")]
        ) > 0.0,
        "{text}"
    );

    // The tasks (plugin and writer) started, and the writer exited well.
    assert!(
        value(&m, "berth_task_starts_total", &[]).unwrap_or(0.0) >= 2.0,
        "{text}"
    );
    assert!(
        value(&m, "berth_task_exits_total", &[("outcome", "success")]).unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    // Allocs by status, in the servers' view and the client's: the plugin
    // runs, the writer is complete.
    for metric in ["berth_allocs", "berth_client_allocs"] {
        assert_eq!(
            value(&m, metric, &[("client_status", "running")]),
            Some(1.0),
            "{metric}:\n{text}"
        );
        assert_eq!(
            value(&m, metric, &[("client_status", "complete")]),
            Some(1.0),
            "{metric}:\n{text}"
        );
        assert_eq!(
            value(&m, metric, &[("client_status", "failed")]),
            Some(0.0),
            "{metric}:\n{text}"
        );
    }
    assert_eq!(
        value(&m, "berth_nodes", &[("status", "ready")]),
        Some(1.0),
        "{text}"
    );
    // Both state databases committed.
    for db in ["server", "client"] {
        let n = histogram_count(&m, "berth_state_commit_duration_seconds", &[("db", db)]);
        assert!(n > 0.0, "no {db} state commit counted:\n{text}");
    }
    // The process itself.
    assert_eq!(value(&m, "berth_build_info", &[]), Some(1.0), "{text}");
    assert!(
        value(&m, "process_resident_memory_bytes", &[]).unwrap_or(0.0) > 0.0,
        "{text}"
    );

    // Heartbeats: the client's round trips and the server's count go up
    // while the agent runs.
    let before = value(&m, "berth_server_heartbeats_total", &[]).unwrap_or(0.0);
    wait_for("another heartbeat", Duration::from_secs(30), || {
        let m = parse(&scrape(&agent)?.1)?;
        let now = value(&m, "berth_server_heartbeats_total", &[]).unwrap_or(0.0);
        let round_trips = histogram_count(&m, "berth_heartbeat_duration_seconds", &[]);
        Ok((now > before && round_trips > 0.0).then_some(()))
    })?;
    Ok(())
}

#[test]
fn json_log_lines_carry_alloc_and_task_and_no_secret() -> Result<()> {
    let agent = DevAgent::start_with_args(&["-log-json", "-log-level", "debug"])?;
    let writer_id = volume_life(&agent)?;
    let log = agent.log();

    // Every line the agent wrote is a JSON object.
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("log line is not JSON: {l}")))
        .collect::<Result<_>>()?;

    // A field of a line: its own, or one of the spans it was logged in.
    let field = |line: &serde_json::Value, name: &str| -> Option<String> {
        let spans = line["spans"].as_array().cloned().unwrap_or_default();
        std::iter::once(&line["fields"])
            .chain(std::iter::once(&line["span"]))
            .chain(spans.iter())
            .find_map(|f| f[name].as_str().map(str::to_string))
    };
    // The writer task's lines say which alloc and task they are about.
    let about_the_task: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| field(l, "task").as_deref() == Some("write"))
        .collect();
    assert!(
        !about_the_task.is_empty(),
        "no log line names the task:\n{log}"
    );
    for line in &about_the_task {
        assert_eq!(
            field(line, "alloc_id").as_deref(),
            Some(writer_id.as_str()),
            "{line}"
        );
    }
    // The volume's mount is logged with the volume, the plugin and the
    // alloc.
    assert!(
        lines.iter().any(|l| {
            field(l, "volume_id").as_deref() == Some("data")
                && field(l, "plugin_id").as_deref() == Some("hostpath")
                && field(l, "alloc_id").as_deref() == Some(writer_id.as_str())
        }),
        "no log line names the volume, its plugin and the alloc:\n{log}"
    );

    // The secret shows in neither the log nor the metrics.
    assert!(
        !log.contains(SECRET),
        "the volume's secret is in the agent log"
    );
    let (_, metrics) = scrape(&agent)?;
    assert!(
        !metrics.contains(SECRET),
        "the volume's secret is in /v1/metrics"
    );
    Ok(())
}

#[test]
fn each_agent_answers_with_its_own_metrics() -> Result<()> {
    let server_port = free_port();
    let (mut server, rpc) = Agent::start_server(&format!("127.0.0.1:{server_port}"))?;
    let client_port = free_port();
    let mut client = Agent::start_client(&[], &rpc, "c1", &format!("127.0.0.1:{client_port}"))?;
    let server_addr = format!("http://127.0.0.1:{server_port}");
    wait_for(
        "the node ready and heartbeating",
        Duration::from_secs(30),
        || {
            server.check_running()?;
            client.check_running()?;
            let Ok(nodes) = cli_json_at(&server_addr, &["node", "status", "-json"]) else {
                return Ok(None);
            };
            let ready = nodes
                .as_array()
                .into_iter()
                .flatten()
                .any(|n| n["status"] == "ready");
            let client_metrics = parse(&scrape_at(client_port)?.1)?;
            let beat =
                histogram_count(&client_metrics, "berth_heartbeat_duration_seconds", &[]) > 0.0;
            Ok((ready && beat).then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "server log:\n{}\nclient log:\n{}",
            server.log(),
            client.log()
        )
    })?;

    // The server counts nodes and heartbeats, runs no alloc and makes no
    // heartbeat of its own.
    let (content_type, text) = scrape_at(server_port)?;
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    let m = parse(&text)?;
    assert_eq!(
        value(&m, "berth_nodes", &[("status", "ready")]),
        Some(1.0),
        "{text}"
    );
    assert!(
        value(&m, "berth_server_heartbeats_total", &[]).unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert_eq!(
        value(&m, "berth_allocs", &[("client_status", "running")]),
        Some(0.0),
        "{text}"
    );
    assert_eq!(value(&m, "berth_client_allocs", &[]), None, "{text}");
    assert_eq!(
        histogram_count(&m, "berth_heartbeat_duration_seconds", &[]),
        0.0,
        "{text}"
    );
    assert!(
        histogram_count(
            &m,
            "berth_state_commit_duration_seconds",
            &[("db", "server")]
        ) > 0.0,
        "{text}"
    );

    // The client-only agent answers with its own numbers, not the
    // server's: heartbeats sent, its allocs, its state database.
    let text = scrape_at(client_port)?.1;
    let m = parse(&text)?;
    assert_eq!(value(&m, "berth_nodes", &[]), None, "{text}");
    assert_eq!(
        value(&m, "berth_server_heartbeats_total", &[]),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(&m, "berth_client_allocs", &[("client_status", "running")]),
        Some(0.0),
        "{text}"
    );
    assert!(
        histogram_count(&m, "berth_heartbeat_duration_seconds", &[]) > 0.0,
        "{text}"
    );
    assert!(
        histogram_count(
            &m,
            "berth_state_commit_duration_seconds",
            &[("db", "client")]
        ) > 0.0,
        "{text}"
    );
    assert_eq!(
        histogram_count(
            &m,
            "berth_state_commit_duration_seconds",
            &[("db", "server")]
        ),
        0.0,
        "{text}"
    );
    Ok(())
}

/// With ACLs on, `/v1/metrics` needs a token with `agent:read` (sent as
/// `Authorization: Bearer`, as Prometheus sends one), unless the operator
/// opts in to a token-less scraper with `acl { public_metrics = true }`;
/// nothing else opens with it.
#[test]
fn metrics_need_a_token_unless_the_operator_makes_them_public() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let get = |port: u16, path: &str, bearer: Option<&str>| -> Result<u16> {
        let auth = bearer.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        let a = http_at(
            port,
            &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n"),
        )?;
        Ok(a.status)
    };
    for public in [false, true] {
        let file = dir.path().join(format!("server-{public}.hcl"));
        std::fs::write(
            &file,
            format!(
                "server {{\n  enabled = true\n}}\nacl {{\n  enabled = true\n  public_metrics = {public}\n}}\n"
            ),
        )?;
        let port = free_port();
        let mut agent = Agent::start(&[
            "-config",
            file.to_str().context("UTF-8")?,
            "-http-addr",
            &format!("127.0.0.1:{port}"),
            "-rpc-addr",
            &format!("127.0.0.1:{}", free_port()),
        ])?;
        let boot = berth_tests::bootstrap_token(&mut agent, port)?;
        let anonymous = get(port, "/v1/metrics", None)?;
        assert_eq!(
            anonymous,
            if public { 200 } else { 403 },
            "public_metrics = {public}"
        );
        assert_eq!(get(port, "/v1/metrics", Some(&boot))?, 200);
        assert_eq!(
            get(port, "/v1/agent/self", None)?,
            403,
            "public_metrics = {public}"
        );
    }
    Ok(())
}
