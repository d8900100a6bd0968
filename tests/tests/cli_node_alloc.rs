//! `berth node status` and `berth alloc status` against a server and a
//! client agent (with reservations) that runs the example hostpath plugin
//! and a task with a CSI volume mounted: the node list, one node by ID,
//! prefix or `-self` with its drivers, resources, CSI plugins and volumes,
//! allocs and timed events; an alloc with its tasks, their timed events,
//! resources and the volume mount; `-verbose`, `-json`; unknown and
//! ambiguous IDs; help.

use std::process::Output;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cli_text::{assert_error, header_value, section, stderr, stdout};
use berth_tests::cluster::{shared_plugin_job, writer_volume, Client, Server};
use berth_tests::snapshot::settings;
use berth_tests::{cli_at, csi_volume_service_job, quick_batch_job, wait_for, DevAgent};
use serde_json::Value;

/// What the client keeps for itself.
const RESERVED: &str = "reserved {\n    cpu    = 500\n    memory = 256\n    disk   = 10\n  }";

/// A server, a client named `worker` with [`RESERVED`], the hostpath
/// plugin on it, and the job `web` whose task `app` has the volume `data`
/// mounted at `data`.
struct Setup {
    server: Server,
    client: Client,
    node_id: String,
    web: Value,
    _state: tempfile::TempDir,
}

fn setup() -> Result<Setup> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "worker", false, RESERVED)?;
    let node_id = server.wait_nodes_ready(&["worker"])?.remove(0);
    let state = tempfile::tempdir()?;
    server.run_job("plugin", &shared_plugin_job(state.path())?)?;
    server.wait_plugin_nodes(1)?;
    server.create_volume("data", &writer_volume("data"))?;
    server.run_job(
        "web",
        &csi_volume_service_job("web", "app", &["-c", "exec sleep 300"]),
    )?;
    let web = wait_for("the web alloc to run", Duration::from_secs(60), || {
        let allocs = server.allocs("web")?;
        Ok(allocs.into_iter().find(|a| a["client_status"] == "running"))
    })
    .with_context(|| client.agent.log())?;
    Ok(Setup {
        server,
        client,
        node_id,
        web,
        _state: state,
    })
}

impl Setup {
    /// Runs the CLI against the server; the whole output, failing unless
    /// it exits 0.
    fn cli(&self, args: &[&str]) -> Result<String> {
        self.server.cli(args)
    }

    /// Runs the CLI against the client agent.
    fn cli_client(&self, args: &[&str]) -> Result<Output> {
        cli_at(&format!("http://127.0.0.1:{}", self.client.http_port), args)
    }

    fn web_id(&self) -> &str {
        self.web["id"].as_str().unwrap_or_default()
    }
}

/// A `key = value` line's key and value.
fn columns_of_pair(line: &str) -> Option<(&str, &str)> {
    let (k, v) = line.split_once(" = ")?;
    Some((k.trim(), v.trim()))
}

/// The row of `section` whose first column is `first`, split in columns
/// (runs of two or more spaces apart).
fn row<'a>(section: &[&'a str], first: &str) -> Option<Vec<&'a str>> {
    section
        .iter()
        .map(|l| columns(l))
        .find(|cols| cols.first() == Some(&first))
}

fn columns(line: &str) -> Vec<&str> {
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect()
}

/// The start of each column of a table header line.
fn column_starts(header: &str) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut prev = ' ';
    let mut gap = 2;
    for (i, c) in header.char_indices() {
        if c != ' ' && (i == 0 || (prev == ' ' && gap >= 2)) {
            starts.push(i);
        }
        gap = if c == ' ' { gap + 1 } else { 0 };
        prev = c;
    }
    starts
}

/// A `2026-12-01T12:40:03Z`-shaped time.
fn is_time(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() >= 20 && b[4] == b'-' && b[7] == b'-' && b[10] == b'T' && s.ends_with('Z')
}

#[test]
fn node_status_shows_drivers_resources_plugins_volumes_allocs_and_timed_events() -> Result<()> {
    let s = setup()?;
    let node_id = s.node_id.as_str();
    let web_id = s.web_id().to_string();

    // The list: one sized table, the node with its allocs running.
    let list = s.cli(&["node", "status"])?;
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 2, "{list}");
    let header = columns(lines[0]);
    assert_eq!(
        header,
        [
            "ID",
            "Name",
            "Class",
            "DC",
            "Drain",
            "Eligibility",
            "Status",
            "Last Heartbeat",
            "Allocs Running"
        ],
        "{list}"
    );
    let cols = columns(lines[1]);
    assert_eq!(cols[0], &node_id[..8], "{list}");
    assert_eq!(
        &cols[1..7],
        ["worker", "<none>", "dc1", "false", "eligible", "ready"]
    );
    assert!(cols[7].ends_with("ago"), "{list}");
    assert_eq!(cols[8], "2", "the plugin and web run: {list}");
    assert_eq!(
        column_starts(lines[0]),
        column_starts(lines[1]),
        "columns line up: {list}"
    );

    // One node, by ID prefix: every section.
    let detail = s.cli(&["node", "status", &node_id[..6]])?;
    assert_eq!(header_value(&detail, "ID").as_deref(), Some(&node_id[..8]));
    assert_eq!(header_value(&detail, "Name").as_deref(), Some("worker"));
    assert_eq!(header_value(&detail, "Status").as_deref(), Some("ready"));
    assert_eq!(
        header_value(&detail, "Eligibility").as_deref(),
        Some("eligible")
    );
    assert_eq!(header_value(&detail, "Drain").as_deref(), Some("false"));
    assert!(header_value(&detail, "Last Heartbeat").is_some_and(|h| h.ends_with("ago")));

    let drivers = section(&detail, "Drivers");
    let raw_exec = row(&drivers, "raw_exec").with_context(|| detail.clone())?;
    assert_eq!(
        &raw_exec[1..3],
        ["true", "true"],
        "detected, healthy: {detail}"
    );
    assert_eq!(raw_exec.last(), Some(&"Healthy"), "{detail}");

    let json = s.server.get(&format!("/v1/node/{node_id}"))?;
    let resources = section(&detail, "Resources");
    assert_eq!(
        columns(resources[0]),
        ["CPU (MHz)", "Memory (MiB)", "Disk (MiB)"],
        "{detail}"
    );
    let total = row(&resources, "Total").with_context(|| detail.clone())?;
    assert_eq!(
        total[1..],
        [
            json["total_resources"]["cpu"].to_string(),
            json["total_resources"]["memory_mb"].to_string(),
            json["total_resources"]["disk_mb"].to_string()
        ]
    );
    assert_eq!(
        row(&resources, "Reserved").with_context(|| detail.clone())?[1..],
        ["500", "256", "10"],
        "{detail}"
    );
    // The plugin (100 MHz, 64 MiB) and web (50 MHz, 32 MiB).
    assert_eq!(
        row(&resources, "Allocated").with_context(|| detail.clone())?[1..],
        ["150", "96", "0"],
        "{detail}"
    );

    let plugins = section(&detail, "CSI Plugins");
    assert_eq!(
        columns(plugins[0]),
        ["ID", "Type", "Healthy", "Topology", "Description"]
    );
    for kind in ["controller", "node"] {
        let p = plugins
            .iter()
            .map(|l| columns(l))
            .find(|c| c.get(1) == Some(&kind))
            .with_context(|| detail.clone())?;
        assert_eq!([p[0], p[2]], ["hostpath", "true"], "{detail}");
    }

    let volumes = section(&detail, "CSI Volumes");
    assert_eq!(
        columns(volumes[0]),
        ["Volume", "Plugin", "Alloc ID", "Mode", "State"]
    );
    assert_eq!(
        row(&volumes, "data").with_context(|| detail.clone())?,
        ["data", "hostpath", &web_id[..8], "write", "taken"],
        "{detail}"
    );

    let allocs = section(&detail, "Allocations");
    assert_eq!(
        columns(allocs[0]),
        ["ID", "Job", "Group", "Status", "Created"]
    );
    let web = row(&allocs, &web_id[..8]).with_context(|| detail.clone())?;
    assert_eq!(&web[1..4], ["web", "web", "running"], "{detail}");
    assert!(web[4].ends_with("ago"), "{detail}");

    // Events: time, subsystem, then the message; the volume's mount among
    // them.
    let events = section(&detail, "Recent Events");
    assert_eq!(columns(events[0]), ["Time", "Subsystem", "Message"]);
    assert!(events.len() > 1, "{detail}");
    for e in &events[1..] {
        let cols = columns(e);
        assert!(is_time(cols[0]), "a time first: {e}");
    }
    assert!(
        events
            .iter()
            .any(|e| columns(e)[1..] == ["Storage", "Mount volume"]),
        "{detail}"
    );
    assert!(events.len() <= 11, "the newest 10: {detail}");

    // -self at the client agent: the same node.
    let own = s.cli_client(&["node", "status", "-self"])?;
    assert!(own.status.success(), "{}", stderr(&own));
    let own = stdout(&own);
    assert_eq!(header_value(&own, "ID").as_deref(), Some(&node_id[..8]));
    assert_eq!(section(&own, "CSI Volumes"), volumes);

    // A server-only agent has no node of its own.
    let out = cli_at(&s.server.addr(), &["node", "status", "-self"])?;
    assert_error(&out, "runs no client");

    // -t: a template over the API's JSON.
    let name = s.cli(&[
        "node",
        "status",
        "-t",
        "{{ name }}/{{ reserved.cpu }}",
        node_id,
    ])?;
    assert_eq!(name.trim_end(), "worker/500");

    // -verbose: full IDs, attributes and meta, event details.
    let verbose = s.cli(&["node", "status", "-verbose", "worker"])?;
    assert_eq!(header_value(&verbose, "ID").as_deref(), Some(node_id));
    let attributes = section(&verbose, "Attributes");
    assert!(
        attributes
            .iter()
            .any(|l| columns_of_pair(l) == Some(("kernel.name", "linux"))),
        "{verbose}"
    );
    assert!(
        row(&section(&verbose, "CSI Volumes"), "data").is_some_and(|r| r[2] == web_id),
        "{verbose}"
    );
    let mount = section(&verbose, "Recent Events")
        .into_iter()
        .find(|e| e.contains("Mount volume"))
        .with_context(|| verbose.clone())?;
    assert!(mount.contains("volume_id=data"), "details shown: {mount}");

    // -json: the API's node view.
    let out = s.cli(&["node", "status", "-json", node_id])?;
    let v: Value = serde_json::from_str(&out)?;
    assert_eq!(v["driver_info"]["raw_exec"]["healthy"], true, "{v}");
    assert_eq!(v["driver_info"]["raw_exec"]["detected"], true, "{v}");
    assert!(v["driver_info"]["raw_exec"]["update_time_ms"].as_i64() > Some(0));
    assert_eq!(v["reserved"]["cpu"], 500);
    assert_eq!(v["reserved"]["memory_mb"], 256);
    assert_eq!(
        v["total_resources"]["cpu"].as_u64(),
        Some(v["resources"]["cpu"].as_u64().unwrap_or(0) + 500)
    );
    assert_eq!(v["allocated_resources"]["cpu"], 150);
    assert_eq!(v["allocated_resources"]["memory_mb"], 96);
    assert_eq!(v["csi_node_plugins"]["hostpath"]["healthy"], true);
    assert_eq!(v["csi_volumes"][0]["volume_id"], "data");
    assert_eq!(v["csi_volumes"][0]["alloc_id"], web_id);
    assert_eq!(v["csi_volumes"][0]["state"], "taken");
    assert!(v["events"][0]["timestamp"].as_i64() > Some(0));
    let list: Value = serde_json::from_str(&s.cli(&["node", "status", "-json"])?)?;
    assert_eq!(list[0]["id"], node_id);

    let shown = redact(&detail, &["Recent Events"], usize::MAX);
    settings().bind(|| insta::assert_snapshot!("node_status_detail", shown));
    Ok(())
}

#[test]
fn alloc_status_shows_tasks_their_timed_events_resources_and_the_volume_mount() -> Result<()> {
    let s = setup()?;
    let web_id = s.web_id().to_string();

    let out = s.cli(&["alloc", "status", &web_id[..8]])?;
    assert_eq!(header_value(&out, "ID").as_deref(), Some(&web_id[..8]));
    assert_eq!(header_value(&out, "Name").as_deref(), Some("web.web[0]"));
    assert_eq!(
        header_value(&out, "Node ID").as_deref(),
        Some(&s.node_id[..8])
    );
    assert_eq!(header_value(&out, "Node Name").as_deref(), Some("worker"));
    assert_eq!(header_value(&out, "Job ID").as_deref(), Some("web"));
    assert_eq!(header_value(&out, "Job Version").as_deref(), Some("0"));
    assert_eq!(
        header_value(&out, "Client Status").as_deref(),
        Some("running")
    );
    assert_eq!(header_value(&out, "Desired Status").as_deref(), Some("run"));
    assert!(header_value(&out, "Created").is_some_and(|c| c.ends_with("ago")));
    assert!(header_value(&out, "Modified").is_some_and(|c| c.ends_with("ago")));

    assert!(out.contains("Task \"app\" is \"running\""), "{out}");
    assert_eq!(header_value(&out, "Restarts").as_deref(), Some("0"));
    assert_eq!(header_value(&out, "Last Restart").as_deref(), Some("N/A"));
    let resources = section(&out, "Task Resources");
    assert_eq!(columns(resources[0]), ["CPU", "Memory"], "{out}");
    assert_eq!(columns(resources[1]), ["50 MHz", "32 MiB"], "{out}");

    let events = section(&out, "Recent Events");
    assert_eq!(columns(events[0]), ["Time", "Type", "Description"]);
    let types: Vec<&str> = events[1..].iter().map(|e| columns(e)[1]).collect();
    assert_eq!(types.first(), Some(&"Started"), "newest first: {out}");
    assert_eq!(types.last(), Some(&"Received"), "{out}");
    for e in &events[1..] {
        assert!(is_time(columns(e)[0]), "a time first: {e}");
    }

    let volumes = section(&out, "CSI Volumes");
    let header = columns(volumes[0]);
    assert_eq!(
        header[..6],
        [
            "Name",
            "Volume",
            "Plugin",
            "Task",
            "Destination",
            "Read Only"
        ],
        "{out}"
    );
    let data = row(&volumes, "data").with_context(|| out.clone())?;
    assert_eq!(
        data[..6],
        ["data", "data", "hostpath", "app", "data", "false"],
        "{out}"
    );

    // -verbose: full IDs.
    let verbose = s.cli(&["alloc", "status", "-verbose", &web_id])?;
    assert_eq!(
        header_value(&verbose, "ID").as_deref(),
        Some(web_id.as_str())
    );
    assert_eq!(
        header_value(&verbose, "Node ID").as_deref(),
        Some(s.node_id.as_str())
    );

    let job = s.cli(&["alloc", "status", "-t", "{{ job_id }}", &web_id])?;
    assert_eq!(job.trim_end(), "web");

    // -json: the API's alloc.
    let v: Value = serde_json::from_str(&s.cli(&["alloc", "status", "-json", &web_id])?)?;
    assert_eq!(v["id"], web_id);
    let events = &v["task_states"]["app"]["events"];
    assert!(events[0]["time_ms"].as_i64() > Some(0), "{v}");

    let shown = redact(&out, &[], 6);
    settings().bind(|| insta::assert_snapshot!("alloc_status_detail", shown));
    Ok(())
}

#[test]
fn unknown_and_ambiguous_ids_are_errors_that_say_so() -> Result<()> {
    let agent = DevAgent::start()?;
    // Seventeen allocs: two of them share a first hex digit.
    let job = agent.write_file("many.hcl", &quick_batch_job("many", 17))?;
    agent.cli_ok(&["job", "run", "-detach", &job])?;
    let allocs = wait_for("the 17 allocs", Duration::from_secs(60), || {
        let v = agent.api_get("/v1/job/many/allocations")?;
        let ids: Vec<String> = v
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["id"].as_str().map(str::to_string))
            .collect();
        Ok((ids.len() == 17).then_some(ids))
    })?;
    let shared = (0..16)
        .map(|d| format!("{d:x}"))
        .find(|p| {
            allocs
                .iter()
                .filter(|id| id.starts_with(p.as_str()))
                .count()
                > 1
        })
        .context("two allocs share a first digit")?;
    let matching: Vec<&String> = allocs.iter().filter(|id| id.starts_with(&shared)).collect();

    let out = agent.cli(&["alloc", "status", &shared])?;
    assert_error(&out, &format!("matches {} allocs", matching.len()));
    for id in matching {
        assert!(
            stderr(&out).contains(id.as_str()),
            "{id} listed: {}",
            stderr(&out)
        );
    }

    let out = agent.cli(&["alloc", "status", "ffffffff-0000"])?;
    assert_error(&out, "alloc \"ffffffff-0000\" not found");
    let out = agent.cli(&["node", "status", "no-such-node"])?;
    assert_error(&out, "node \"no-such-node\" not found");
    // A usage error: exit 2.
    let out = agent.cli(&["alloc", "status"])?;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = agent.cli(&["node", "status", "-self", "worker"])?;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    Ok(())
}

#[test]
fn each_status_command_has_help() -> Result<()> {
    // No agent needed: help never calls the API.
    let addr = "http://127.0.0.1:1";
    for (args, flags) in [
        (
            &["node", "status", "-h"][..],
            &["-self", "-verbose", "-json", "-t"][..],
        ),
        (&["alloc", "status", "-h"], &["-verbose", "-json", "-t"]),
    ] {
        let out = cli_at(addr, args)?;
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let help = stdout(&out);
        assert!(help.contains("Usage:"), "{help}");
        for flag in flags {
            assert!(help.contains(flag), "{flag} in {help}");
        }
    }
    Ok(())
}

/// `text` with what would change its layout from run to run or machine
/// to machine replaced before the shared snapshot filters (IDs, times)
/// apply: ages (their widths differ) and the machine's total resources;
/// tables are aligned again after. The rows of the `drop_rows` sections
/// (events, which differ with timing) are left out but for their header,
/// and table rows keep only their first `keep_columns` cells (stats, which
/// arrive when they arrive).
fn redact(text: &str, drop_rows: &[&str], keep_columns: usize) -> String {
    let cell = |c: &str| -> String {
        if c.ends_with(" ago") || c == "never" {
            "[age] ago".to_string()
        } else {
            c.to_string()
        }
    };
    let mut out: Vec<String> = Vec::new();
    let mut section = String::new();
    let mut rows: Vec<Vec<String>> = Vec::new();
    let flush = |rows: &mut Vec<Vec<String>>, out: &mut Vec<String>| {
        let mut widths = Vec::new();
        for row in rows.iter() {
            widths.resize(widths.len().max(row.len()), 0);
            for (i, c) in row.iter().enumerate() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        for row in rows.drain(..) {
            let line: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
                .collect();
            out.push(line.join("  ").trim_end().to_string());
        }
    };
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(" = ") {
            out.push(format!("{k} = {}", cell(v.trim())));
            continue;
        }
        if line.trim().is_empty() {
            flush(&mut rows, &mut out);
            section.clear();
            out.push(String::new());
            continue;
        }
        let cols = columns(line);
        if cols.len() == 1 {
            flush(&mut rows, &mut out);
            section = line.trim().to_string();
            out.push(line.to_string());
            continue;
        }
        if drop_rows.contains(&section.as_str()) && !rows.is_empty() {
            continue;
        }
        let mut cells: Vec<String> = cols.iter().map(|c| cell(c)).collect();
        if section == "Resources" {
            if rows.is_empty() {
                cells.insert(0, String::new());
            } else if cells[0] == "Total" {
                cells = ["Total", "[cpu]", "[memory]", "[disk]"]
                    .map(String::from)
                    .to_vec();
            }
        }
        cells.truncate(keep_columns);
        rows.push(cells);
    }
    flush(&mut rows, &mut out);
    out.join("\n") + "\n"
}
