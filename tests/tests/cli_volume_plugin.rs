//! `berth volume status` and `berth plugin status` against a dev agent that
//! runs the example hostpath plugin: the list, the detail of one volume or
//! plugin (by ID or ID prefix), `-verbose`, `-json`, errors and help. A
//! volume created with a secret never shows it, in any output.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cli_text::{assert_error, header_value, section, stderr, stdout};
use berth_tests::snapshot::settings;
use berth_tests::{csi_volume_service_job, example, wait_alloc_running, wait_for, DevAgent};
use serde_json::Value;

/// A volume secret that must never show.
const SECRET: &str = "tok-9c41e07d";

/// The example volume `id`, with a secret.
fn volume_spec(id: &str) -> Result<String> {
    let src = std::fs::read_to_string(example("volumes/hostpath.hcl"))?;
    Ok(format!(
        "{}\nsecrets {{\n  token = \"{SECRET}\"\n}}\n",
        src.replace("\"data\"", &format!("{id:?}"))
    ))
}

/// The dev agent's node name, fixed so that snapshots of tables keep
/// their column widths on every host.
const NODE: &str = "dev-node";

/// `text` up to the line `title` (that section and what follows left out).
fn before_section<'a>(text: &'a str, title: &str) -> &'a str {
    match text.find(&format!("\n{title}\n")) {
        Some(at) => &text[..at],
        None => text,
    }
}

/// The text never names the secret nor a `secrets` key.
fn assert_no_secret(what: &str, text: &str) {
    assert!(!text.contains(SECRET), "{what} shows the secret:\n{text}");
    assert!(
        !text.contains("\"secrets\""),
        "{what} has a secrets key:\n{text}"
    );
}

#[test]
fn volume_status_lists_details_and_never_shows_secrets() -> Result<()> {
    let agent = DevAgent::start_with_args(&["-node", NODE, "-csi-volume-stats-interval", "2s"])?;
    agent.run_example_plugin()?;
    let spec = agent.write_file("data.hcl", &volume_spec("data")?)?;
    let created = agent.cli_ok(&["volume", "create", &spec])?;
    assert!(created.contains("\"data\""), "{created}");
    let spec2 = agent.write_file("data2.hcl", &volume_spec("data2")?)?;
    agent.cli_ok(&["volume", "create", &spec2])?;

    // A job claims "data" for writing.
    let job = agent.write_file(
        "holder.hcl",
        &csi_volume_service_job("holder", "holder", &["-c", "sleep 3600"]),
    )?;
    agent.cli_ok(&["job", "run", "-detach", &job])?;
    let alloc = wait_alloc_running(&agent, "holder")?;
    let alloc_id = alloc["id"].as_str().context("alloc ID")?.to_string();
    let short = &alloc_id[..8];

    // The list: one row per volume, columns sized to their cells.
    let list = agent.cli_ok(&["volume", "status"])?;
    let header = list.lines().next().context("a header")?;
    for column in [
        "ID",
        "Name",
        "Plugin ID",
        "Schedulable",
        "Access Mode",
        "Claims (R/W)",
        "Capacity",
    ] {
        assert!(header.contains(column), "{column:?} in {list}");
    }
    let row = list
        .lines()
        .find(|l| l.starts_with("data "))
        .with_context(|| format!("a row of data in {list}"))?;
    for want in ["hostpath", "true", "single-node-writer", "0/1"] {
        assert!(row.contains(want), "{want:?} in {row:?}");
    }
    let row2 = list
        .lines()
        .find(|l| l.starts_with("data2 "))
        .with_context(|| format!("a row of data2 in {list}"))?;
    assert!(row2.contains("<none>") && row2.contains("0/0"), "{row2:?}");

    // The detail, by ID and by a unique prefix.
    let detail = agent.cli_ok(&["volume", "status", "data"])?;
    let want = [
        ("ID", "data"),
        ("Name", "data"),
        ("Plugin ID", "hostpath"),
        ("Provider", "hostpath.csi.berth.dev"),
        ("Schedulable", "true"),
        ("Controllers Healthy", "1"),
        ("Controllers Expected", "1"),
        ("Nodes Healthy", "1"),
        ("Nodes Expected", "1"),
        ("Access Mode", "single-node-writer"),
        ("Attachment Mode", "file-system"),
        ("Mount Options", "<none>"),
    ];
    for (key, value) in want {
        assert_eq!(
            header_value(&detail, key).as_deref(),
            Some(value),
            "{key} in:\n{detail}"
        );
    }
    // The shipped plugin job keeps volumes on their node, and says so.
    assert!(
        header_value(&detail, "Topology")
            .is_some_and(|v| v.starts_with("{topology.hostpath.csi/node=")),
        "{detail}"
    );
    assert!(
        header_value(&detail, "External ID").is_some_and(|v| !v.is_empty() && v != "-"),
        "{detail}"
    );
    assert!(
        header_value(&detail, "Capacity").is_some_and(|v| v.contains("MiB")),
        "{detail}"
    );
    let allocs = section(&detail, "Allocations");
    assert!(allocs.len() == 2, "a header and one claim: {detail}");
    for want in [short, "write", "taken", "running"] {
        assert!(allocs[1].contains(want), "{want:?} in {detail}");
    }
    let by_prefix = agent.cli_ok(&["volume", "status", "data2"])?;
    assert_eq!(header_value(&by_prefix, "ID").as_deref(), Some("data2"));
    let ambiguous = agent.cli(&["volume", "status", "dat"])?;
    assert_error(&ambiguous, "matches 2 volumes: \"data\", \"data2\"");
    let missing = agent.cli(&["volume", "status", "nope"])?;
    assert_error(&missing, "\"nope\" not found");

    // -verbose: parameters, context, requested topology, and the claim's
    // volume stats once its node reported them (this agent collects them
    // every 2 s).
    let verbose = wait_for("the claim's volume stats", Duration::from_secs(20), || {
        let text = agent.cli_ok(&["volume", "status", "-verbose", "data"])?;
        let stats = section(&text, "Volume Stats");
        let reported = stats
            .iter()
            .any(|l| l.contains(short) && !l.contains("no stats reported yet"));
        Ok(reported.then_some(text))
    })?;
    for title in [
        "Parameters",
        "Context",
        "Requested Topology",
        "Volume Stats",
    ] {
        assert!(
            verbose.lines().any(|l| l.trim() == title),
            "{title} in:\n{verbose}"
        );
    }
    let stats = section(&verbose, "Volume Stats");
    assert!(stats[0].contains("Used / Total"), "{verbose}");
    // The stats' figures are those of the host's filesystem: left out.
    let verbose_head = before_section(&verbose, "Volume Stats");
    settings().bind(|| {
        insta::assert_snapshot!("volume_status_list", list);
        insta::assert_snapshot!("volume_status_detail", detail);
        insta::assert_snapshot!("volume_status_verbose", verbose_head);
    });
    assert!(
        stats
            .iter()
            .any(|l| l.contains(short) && l.contains("normal")),
        "{verbose}"
    );

    // -json: the API's JSON, never a secret, in the list, the detail and
    // -verbose; nor in the API's own answers.
    let json = agent.cli_ok(&["volume", "status", "-json", "data"])?;
    assert_no_secret("volume status -json data", &json);
    let v: Value = serde_json::from_str(&json)?;
    assert_eq!(v["id"], "data");
    assert_eq!(v["plugin"]["nodes_healthy"], 1, "{v}");
    assert_eq!(v["claim_allocs"][0]["alloc_id"], alloc_id.as_str(), "{v}");
    assert_eq!(v["claim_allocs"][0]["state"], "taken", "{v}");
    assert!(v["claim_allocs"][0]["node_name"].is_string(), "{v}");
    for args in [
        &["volume", "status", "-json"][..],
        &["volume", "status", "-verbose", "-json"],
        &["volume", "status", "-verbose", "-json", "data"],
    ] {
        assert_no_secret(&args.join(" "), &agent.cli_ok(args)?);
    }
    for path in ["/v1/volumes", "/v1/volume/csi/data"] {
        assert_no_secret(path, &agent.api_get(path)?.to_string());
    }
    assert!(
        !agent.log().contains(SECRET),
        "the agent log shows the secret"
    );

    agent.cli_ok(&["job", "stop", "holder"])?;
    agent.wait_volume_unclaimed("data")?;
    Ok(())
}

#[test]
fn plugin_status_lists_details_capabilities_and_allocs() -> Result<()> {
    let agent = DevAgent::start_with_args(&["-node", NODE])?;
    assert_eq!(agent.cli_ok(&["plugin", "status"])?, "No CSI plugins\n");
    assert_eq!(agent.cli_ok(&["volume", "status"])?, "No CSI volumes\n");
    agent.run_example_plugin()?;
    let spec = agent.write_file("data.hcl", &volume_spec("data")?)?;
    agent.cli_ok(&["volume", "create", &spec])?;
    let plugin_alloc = wait_alloc_running(&agent, "hostpath-plugin")?;
    let plugin_alloc_id = plugin_alloc["id"].as_str().context("alloc ID")?.to_string();
    let short = &plugin_alloc_id[..8];

    let list = agent.cli_ok(&["plugin", "status"])?;
    let header = list.lines().next().context("a header")?;
    for column in [
        "ID",
        "Provider",
        "Controllers Healthy/Expected",
        "Nodes Healthy/Expected",
    ] {
        assert!(header.contains(column), "{column:?} in {list}");
    }
    let row = list
        .lines()
        .find(|l| l.starts_with("hostpath "))
        .with_context(|| format!("a row of hostpath in {list}"))?;
    assert!(row.contains("hostpath.csi.berth.dev"), "{row}");
    assert_eq!(row.matches("1/1").count(), 2, "{row}");
    // Nomad's meaning: the example plugin's controller creates volumes
    // but publishes none to nodes, so no controller is required.
    let p = agent.api_get("/v1/plugin/csi/hostpath")?;
    assert_eq!(p["controller_required"], false, "{p}");

    // The detail, by a prefix of the ID.
    let detail = agent.cli_ok(&["plugin", "status", "host"])?;
    for (key, value) in [
        ("ID", "hostpath"),
        ("Provider", "hostpath.csi.berth.dev"),
        ("Controllers Healthy", "1"),
        ("Controllers Expected", "1"),
        ("Nodes Healthy", "1"),
        ("Nodes Expected", "1"),
        ("Volumes", "1"),
    ] {
        assert_eq!(
            header_value(&detail, key).as_deref(),
            Some(value),
            "{key} in:\n{detail}"
        );
    }
    assert!(header_value(&detail, "Version").is_some(), "{detail}");
    let caps = section(&detail, "Capabilities");
    let controller = caps
        .iter()
        .find(|l| l.trim_start().starts_with("Controller"))
        .with_context(|| format!("controller capabilities in {detail}"))?;
    for want in ["CreateDelete", "Expand", "Snapshots"] {
        assert!(controller.contains(want), "{want:?} in {controller:?}");
    }
    let node = caps
        .iter()
        .find(|l| l.trim_start().starts_with("Node"))
        .with_context(|| format!("node capabilities in {detail}"))?;
    for want in ["StageUnstage", "VolumeStats"] {
        assert!(node.contains(want), "{want:?} in {node:?}");
    }
    for title in ["Controllers", "Nodes"] {
        let rows = section(&detail, title);
        assert_eq!(
            rows.len(),
            2,
            "{title}: a header and one node in:\n{detail}"
        );
        assert!(
            rows[1].contains("true") && rows[1].contains("healthy"),
            "{detail}"
        );
        assert!(rows[1].contains(" ago"), "updated ago: {detail}");
    }
    let allocs = section(&detail, "Allocations");
    assert!(
        allocs
            .iter()
            .any(|l| l.contains(short) && l.contains("hostpath-plugin") && l.contains("running")),
        "{detail}"
    );

    // -verbose: each instance's alloc and capabilities, the node's
    // external ID and topology.
    let verbose = agent.cli_ok(&["plugin", "status", "-verbose", "hostpath"])?;
    let nodes = section(&verbose, "Nodes");
    for column in ["External Node ID", "Topology", "Capabilities"] {
        assert!(nodes[0].contains(column), "{column:?} in:\n{verbose}");
    }
    assert!(nodes[1].contains(short), "{verbose}");
    settings().bind(|| {
        insta::assert_snapshot!("plugin_status_list", list);
        insta::assert_snapshot!("plugin_status_detail", detail);
        insta::assert_snapshot!("plugin_status_verbose", verbose);
    });

    // -json: the API's JSON.
    let p = agent.cli_json(&["plugin", "status", "hostpath"])?;
    assert_eq!(p["id"], "hostpath");
    assert_eq!(p["volume_count"], 1, "{p}");
    let caps: Vec<&str> = p["controller_capabilities"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert!(caps.contains(&"CreateDelete"), "{p}");
    assert!(
        p["nodes"]
            .as_object()
            .is_some_and(|n| n.values().all(|i| i["healthy"] == true)),
        "{p}"
    );
    assert_eq!(p["allocations"][0]["id"], plugin_alloc_id.as_str(), "{p}");
    let all = agent.cli_json(&["plugin", "status"])?;
    assert_eq!(all.as_array().map(Vec::len), Some(1), "{all}");

    // -t: a template over the API's JSON.
    let provider = agent.cli_ok(&["plugin", "status", "-t", "{{ provider }}", "hostpath"])?;
    assert_eq!(provider.trim(), "hostpath.csi.berth.dev");
    let ids = agent.cli_ok(&[
        "volume",
        "status",
        "-t",
        "{% for v in value %}{{ v.id }}/{{ v.plugin.nodes_healthy }} {% endfor %}",
    ])?;
    assert_eq!(ids.trim(), "data/1");

    let missing = agent.cli(&["plugin", "status", "nope"])?;
    assert_error(&missing, "\"nope\" not found");
    Ok(())
}

#[test]
fn status_commands_explain_themselves() -> Result<()> {
    // Help needs no agent: the address points nowhere.
    for args in [
        &["volume", "status", "-h"][..],
        &["plugin", "status", "-h"],
        &["volume", "snapshot", "list", "-h"],
    ] {
        let out = std::process::Command::new(berth_tests::binary("berth"))
            .args(args)
            .env("BERTH_ADDR", "http://127.0.0.1:9")
            .output()?;
        let text = stdout(&out);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert!(text.contains("json"), "{args:?}: {text}");
        if args[1] == "status" {
            assert!(text.contains("verbose"), "{args:?}: {text}");
        }
    }
    Ok(())
}

/// A job that asks a volume for a mode it was not created with would wait
/// for a claim forever: `job plan` and `job run` refuse it at once, naming
/// the volume's capabilities, and nothing is stored.
#[test]
fn a_job_asking_a_volume_for_a_mode_it_lacks_is_refused() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_plugin_and_create_volume()?;
    let spec = csi_volume_service_job("wants-mnmw", "w", &["-c", "sleep 60"])
        .replace("single-node-writer", "multi-node-multi-writer");
    let file = agent.write_file("wants-mnmw.hcl", &spec)?;
    for cmd in ["plan", "run"] {
        let out = agent.cli(&["job", cmd, &file])?;
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(!out.status.success(), "job {cmd} was accepted");
        anyhow::ensure!(
            err.contains(
                r#"volume "data" was not created for multi-node-multi-writer file-system"#
            ) && err.contains("its capabilities: single-node-writer file-system"),
            "job {cmd}: {err}"
        );
    }
    let jobs = agent.api_get("/v1/jobs")?;
    anyhow::ensure!(
        !jobs.to_string().contains("wants-mnmw"),
        "the refused job was stored: {jobs}"
    );
    Ok(())
}
