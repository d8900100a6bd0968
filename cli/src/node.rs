//! `berth node status|drain|eligibility|purge`, and the tables they print.

use std::collections::HashMap;

use anyhow::Result;
use clap::{ArgGroup, Args, Subcommand};
use serde_json::{json, Value};

use super::output::{
    ago_at, format_time, joined, key_values, print_lines, short_id, shown_id, text, titled_table,
    OutputArgs, Table,
};
use super::{allocs_phrase, enc, print_json, print_release_warnings, strs, Ctx};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// Show nodes, or one node: drivers, resources, CSI plugins and volumes,
    /// allocs and events
    Status(StatusArgs),
    /// Move a node's allocs elsewhere, or stop draining it
    Drain(DrainArgs),
    /// Allow or forbid new allocs on a node
    Eligibility(EligibilityArgs),
    /// Forget a node that is gone; its allocs are lost, its claims freed
    #[command(long_about = PURGE_ABOUT)]
    Purge(PurgeArgs),
    /// Introduction tokens new nodes register with
    #[command(subcommand)]
    Intro(IntroCommand),
}

#[derive(clap::Subcommand, Debug)]
pub enum IntroCommand {
    /// Make a token that lets new nodes register (set it as client {
    /// intro_token }); its secret is printed this once
    Create(IntroCreateArgs),
    /// List the introduction tokens (never their secrets)
    List(IntroListArgs),
    /// Revoke an introduction token: it enrolls no node from now on
    Revoke(IntroRevokeArgs),
}

#[derive(Args, Debug)]
pub struct IntroListArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct IntroRevokeArgs {
    /// The token's accessor ID (or a unique prefix of it)
    #[arg(value_name = "ACCESSOR")]
    pub accessor: String,
}

#[derive(Args, Debug)]
pub struct IntroCreateArgs {
    /// How long the token lets nodes register (default 1h)
    #[arg(long, value_name = "DUR")]
    pub ttl: Option<String>,
    /// How many nodes may register with it (default 1)
    #[arg(long, value_name = "N")]
    pub uses: Option<u32>,
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

/// `berth node status [-self] [-verbose] [-json] [-t T] [NODE]`.
#[derive(Args, Debug)]
#[command(long_about = STATUS_ABOUT)]
pub struct StatusArgs {
    /// Show the node of the agent at -address
    #[arg(long = "self", conflicts_with = "node")]
    pub self_node: bool,
    /// Full IDs, attributes and meta, every event with its details
    #[arg(long)]
    pub verbose: bool,
    #[command(flatten)]
    pub output: OutputArgs,
    /// The node's ID, ID prefix or name (none: every node)
    #[arg(value_name = "NODE")]
    pub node: Option<String>,
}

/// The long help of `berth node status`.
const STATUS_ABOUT: &str = "\
Without NODE, lists the nodes: their class, datacenter, drain, eligibility,
status, last heartbeat and running allocs. With NODE (an ID, a unique ID
prefix or a name) or -self (the node of the agent at -address), shows that
node: its drivers and their health, its resources (total, what the node
reserves for itself, what its allocs ask for), its CSI plugins and the CSI
volumes its allocs claim, its allocs and its recent events.";

/// The long help of `berth node purge`.
const PURGE_ABOUT: &str = "\
Forgets a node that is gone: it is removed, its allocs that were not done
are lost and replaced, and the volume claims made on it are freed. Its
write claims are freed only with -force: a node may be gone from the
servers while its tasks still run (a client restarted with a new data dir
comes back as a new node, and the old tasks keep running and writing).
Without -force they are kept and listed; once the node's tasks are
stopped, `berth volume detach VOLUME NODE-ID` frees each. -force asks
first whether the node's tasks are stopped; -y answers yes.";

#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// The node's tasks are gone too: free its write claims
    #[arg(long)]
    pub force: bool,
    /// With -force: do not ask
    #[arg(short = 'y', long = "yes")]
    pub yes: bool,
    /// The node's ID, ID prefix or name
    #[arg(value_name = "NODE")]
    pub node: String,
}

/// `berth node drain -enable [-deadline D] [-force] [-detach] NODE`,
/// `berth node drain -disable NODE`.
#[derive(Args, Debug)]
#[command(
    long_about = DRAIN_ABOUT,
    group(ArgGroup::new("mode").required(true).args(["enable", "disable"]))
)]
pub struct DrainArgs {
    /// Start draining the node (or change the deadline of its drain)
    #[arg(long)]
    pub enable: bool,
    /// Stop draining; stopped allocs stay stopped and the node stays ineligible
    #[arg(long)]
    pub disable: bool,
    /// How long the drain waits for the service and batch allocs to stop
    /// (default 1h). At the deadline it stops waiting and stops the system
    /// allocs too; plugins still wait until their volumes are unmounted: no
    /// volume is left behind a stopped plugin.
    #[arg(long, value_name = "D", conflicts_with = "disable")]
    pub deadline: Option<String>,
    /// A deadline of now: do not wait for the allocs to migrate
    #[arg(long, conflicts_with_all = ["disable", "deadline"])]
    pub force: bool,
    /// Return once the drain has started
    #[arg(long, conflicts_with = "disable")]
    pub detach: bool,
    /// Print the node as the API answers it, and return
    #[arg(long)]
    pub json: bool,
    /// The node's ID, ID prefix or name
    #[arg(value_name = "NODE")]
    pub node: String,
}

/// `berth node eligibility -enable|-disable NODE`.
#[derive(Args, Debug)]
#[command(
    long_about = ELIGIBILITY_ABOUT,
    group(ArgGroup::new("mode").required(true).args(["enable", "disable"]))
)]
pub struct EligibilityArgs {
    /// Allow new allocs on the node
    #[arg(long)]
    pub enable: bool,
    /// Forbid new allocs on the node; allocs already there keep running
    #[arg(long)]
    pub disable: bool,
    /// Print the node as the API answers it
    #[arg(long)]
    pub json: bool,
    /// The node's ID, ID prefix or name
    #[arg(value_name = "NODE")]
    pub node: String,
}

/// The long help of `berth node drain`.
const DRAIN_ABOUT: &str = "\
Drains a node (an ID, a unique ID prefix or a name). The node becomes
ineligible for new allocs. Its service and batch allocs are stopped at once
and placed again on other nodes. Its system allocs are stopped last: once the
service and batch allocs there have stopped, and a CSI plugin only once every
alloc on the node that uses a volume of that plugin has unmounted it and its
claim is released. The drain is complete when every alloc on the node has
stopped; the node then stays ineligible until `berth node eligibility -enable
NODE`.

Without -detach the command follows the drain, printing the allocs as they
stop, until it completes; Ctrl-C leaves the drain running.";

/// The long help of `berth node eligibility`.
const ELIGIBILITY_ABOUT: &str = "\
Allows (-enable) or forbids (-disable) new allocs on a node (an ID, a unique
ID prefix or a name). Allocs already there keep running. A draining node
cannot be made eligible: disable the drain first.";

pub fn run(cmd: NodeCommand, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    match cmd {
        NodeCommand::Status(a) => node_status(a, api),
        NodeCommand::Drain(a) => node_drain(a, api),
        NodeCommand::Eligibility(a) => node_eligibility(a, api),
        NodeCommand::Purge(a) => node_purge(a, api),
        NodeCommand::Intro(IntroCommand::Create(a)) => node_intro_create(a, api),
        NodeCommand::Intro(IntroCommand::List(a)) => node_intro_list(&a, api),
        NodeCommand::Intro(IntroCommand::Revoke(a)) => {
            let v = api.delete(&format!("/v1/node/intro/{}", enc(&a.accessor)))?;
            println!(
                "Introduction token {} revoked ({} uses were left)",
                text(&v["accessor_id"]),
                text(&v["uses_left"])
            );
            Ok(0)
        }
    }
}

/// `berth node intro list [-json]`.
fn node_intro_list(a: &IntroListArgs, api: &ApiClient) -> Result<i32> {
    let v = api.get("/v1/node/intros")?;
    if a.json {
        return print_json(&v);
    }
    let mut t = Table::new(["Accessor ID", "Uses Left", "Created", "Expires"]);
    for tok in v.as_array().into_iter().flatten() {
        t.push([
            text(&tok["accessor_id"]),
            text(&tok["uses_left"]),
            format_time(tok["create_time_ms"].as_i64().unwrap_or(0)),
            format_time(tok["expiration_time_ms"].as_i64().unwrap_or(0)),
        ]);
    }
    print_lines(t.lines());
    Ok(0)
}

/// `berth node intro create [-ttl D] [-uses N]`.
fn node_intro_create(a: IntroCreateArgs, api: &ApiClient) -> Result<i32> {
    let v = api.put("/v1/node/intro", &json!({ "ttl": a.ttl, "uses": a.uses }))?;
    if a.json {
        return print_json(&v);
    }
    print_lines(key_values(&[
        ("Accessor ID", super::output::text(&v["accessor_id"])),
        ("Secret ID", super::output::text(&v["secret_id"])),
        ("Uses", super::output::text(&v["uses_left"])),
        (
            "Expires",
            format_time(v["expiration_time_ms"].as_i64().unwrap_or(0)),
        ),
    ]));
    Ok(0)
}

fn node_label(n: &Value) -> String {
    format!(
        "{:?} ({})",
        n["name"].as_str().unwrap_or_default(),
        n["id"].as_str().unwrap_or_default()
    )
}

/// `berth node drain`.
fn node_drain(a: DrainArgs, api: &ApiClient) -> Result<i32> {
    let node = &a.node;
    let mut body = json!({ "enable": a.enable, "force": a.force });
    if let Some(d) = &a.deadline {
        body["deadline"] = json!(d);
    }
    let n = api.post(&format!("/v1/node/{}/drain", enc(node)), &body)?;
    if a.json {
        return print_json(&n);
    }
    let label = node_label(&n);
    if a.disable {
        println!(
            "Node {label}: drain disabled; it stays ineligible (berth node eligibility -enable {} makes it eligible)",
            n["name"].as_str().unwrap_or_default()
        );
        return Ok(0);
    }
    println!(
        "Node {label} is draining (deadline {}); no new allocs go there",
        n["drain_strategy"]["deadline"].as_str().unwrap_or("?")
    );
    if a.detach {
        return Ok(0);
    }
    let id = n["id"].as_str().unwrap_or_default().to_string();
    follow_drain(api, &id)
}

/// What was printed of an alloc while following a drain.
#[derive(Default)]
struct Shown {
    stopped: bool,
    terminal: bool,
}

/// Prints the node's allocs as the drain stops them, until the drain
/// ends. 0 when it completed, 2 when it ended otherwise (disabled).
fn follow_drain(api: &ApiClient, node_id: &str) -> Result<i32> {
    let mut shown: HashMap<String, Shown> = HashMap::new();
    let mut index = 0;
    loop {
        // A blocking query: answers as soon as anything changes.
        let (allocs, state_index) = api.get_indexed(&format!(
            "/v1/node/{}/allocations?index={index}&wait=10s",
            enc(node_id)
        ))?;
        index = state_index;
        for a in allocs.as_array().into_iter().flatten() {
            let id = a["id"].as_str().unwrap_or_default();
            let s = shown.entry(id.to_string()).or_default();
            let drained = a["desired_status"] == "stop"
                && a["desired_description"] == berth_structs::node::DRAIN_STOP_DESCRIPTION;
            let label = format!(
                "Alloc {} ({})",
                short_id(id),
                a["name"].as_str().unwrap_or_default()
            );
            if drained && !s.stopped {
                s.stopped = true;
                println!(
                    "{label}: stopping ({})",
                    berth_structs::node::DRAIN_STOP_DESCRIPTION
                );
            }
            let status = a["client_status"].as_str().unwrap_or_default();
            let terminal = matches!(status, "complete" | "failed" | "lost");
            if s.stopped && terminal && !s.terminal {
                s.terminal = true;
                println!("{label}: {status}");
            }
        }
        let n = api.get(&format!("/v1/node/{}", enc(node_id)))?;
        if n["drain_strategy"].is_null() {
            let last = n["events"]
                .as_array()
                .into_iter()
                .flatten()
                .rfind(|e| e["subsystem"] == "Drain")
                .and_then(|e| e["message"].as_str())
                .unwrap_or_default()
                .to_string();
            if last == berth_structs::node::DRAIN_COMPLETE_EVENT {
                println!("Node {}: drain complete", node_label(&n));
                return Ok(0);
            }
            println!(
                "Node {}: the drain ended without completing ({})",
                node_label(&n),
                if last.is_empty() {
                    "no drain event"
                } else {
                    &last
                }
            );
            return Ok(2);
        }
    }
}

/// `berth node eligibility`.
fn node_eligibility(a: EligibilityArgs, api: &ApiClient) -> Result<i32> {
    let n = api.post(
        &format!("/v1/node/{}/eligibility", enc(&a.node)),
        &json!({ "eligible": a.enable }),
    )?;
    if a.json {
        return print_json(&n);
    }
    println!(
        "Node {} is {} for scheduling",
        node_label(&n),
        n["scheduling_eligibility"].as_str().unwrap_or_default()
    );
    Ok(0)
}

fn node_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    let node = match (&a.node, a.self_node) {
        (_, true) => Some(self_node_id(api)?),
        (node, false) => node.clone(),
    };
    let now = berth_structs::now_ms();
    let Some(node) = node else {
        let nodes = api.get("/v1/nodes")?;
        return a.output.emit(&nodes, |nodes| {
            let list = nodes.as_array().cloned().unwrap_or_default();
            if list.is_empty() {
                println!("No nodes registered");
                return Ok(());
            }
            print_lines(node_table(&list, a.verbose, now));
            Ok(())
        });
    };
    let n = api.get(&format!("/v1/node/{}", enc(&node)))?;
    a.output.emit(&n, |n| {
        let id = n["id"].as_str().unwrap_or_default();
        let allocs = api.get(&format!("/v1/node/{}/allocations", enc(id)))?;
        print!("{}", node_detail(n, &allocs, a.verbose, now));
        Ok(())
    })
}

/// The node of the agent at the API address (`/v1/agent/self`); an error
/// when that agent runs no client.
fn self_node_id(api: &ApiClient) -> Result<String> {
    let me = api.get("/v1/agent/self")?;
    match me["client"]["node_id"].as_str() {
        Some(id) if !id.is_empty() => Ok(id.to_string()),
        _ => anyhow::bail!(
            "the agent at -address runs no client, so it has no node of its own: give a NODE instead of -self"
        ),
    }
}

/// Events `node status` shows without -verbose.
pub const RECENT_EVENTS: usize = 10;

fn or_none(s: &str) -> String {
    if s.is_empty() {
        "<none>".to_string()
    } else {
        s.to_string()
    }
}

/// The detail of one node of the API's node view (`GET /v1/node/{id}`)
/// with its allocs: the header, then the Drivers, Resources, CSI Plugins,
/// CSI Volumes, Allocations and Recent Events sections (and Attributes
/// and Meta with -verbose).
pub fn node_detail(n: &Value, allocs: &Value, verbose: bool, now_ms: i64) -> String {
    let mut out = joined(key_values(&node_header(n, verbose, now_ms)));

    out += &driver_and_resource_tables(n, now_ms);

    out += &titled_table(
        "CSI Plugins",
        &["ID", "Type", "Healthy", "Topology", "Description"],
        plugin_rows(n),
    );

    let volumes: Vec<Vec<String>> = n["csi_volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| {
            vec![
                text(&v["volume_id"]),
                text(&v["plugin_id"]),
                shown_id(v["alloc_id"].as_str().unwrap_or("-"), verbose).to_string(),
                text(&v["mode"]),
                text(&v["state"]),
            ]
        })
        .collect();
    out += &titled_table(
        "CSI Volumes",
        &["Volume", "Plugin", "Alloc ID", "Mode", "State"],
        volumes,
    );

    let mut on_node: Vec<&Value> = allocs.as_array().into_iter().flatten().collect();
    on_node.sort_by_key(|a| std::cmp::Reverse(a["create_index"].as_u64().unwrap_or(0)));
    let allocs: Vec<Vec<String>> = on_node
        .iter()
        .map(|a| {
            vec![
                shown_id(a["id"].as_str().unwrap_or_default(), verbose).to_string(),
                text(&a["job_id"]),
                text(&a["task_group"]),
                text(&a["client_status"]),
                ago_at(a["create_time_ms"].as_i64().unwrap_or(0), now_ms),
            ]
        })
        .collect();
    out += &titled_table(
        "Allocations",
        &["ID", "Job", "Group", "Status", "Created"],
        allocs,
    );

    if verbose {
        for (title, key) in [("Attributes", "attributes"), ("Meta", "meta")] {
            let pairs: Vec<(&str, String)> = n[key]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.as_str(), text(v)))
                .collect();
            if !pairs.is_empty() {
                out += &format!("\n{title}\n{}", joined(key_values(&pairs)));
            }
        }
    }

    out += &titled_table(
        "Recent Events",
        &["Time", "Subsystem", "Message"],
        event_rows(&n["events"], verbose),
    );
    out
}

/// The key/value header of [`node_detail`].
fn node_header(n: &Value, verbose: bool, now_ms: i64) -> Vec<(&'static str, String)> {
    let id = n["id"].as_str().unwrap_or_default();
    let usable: Vec<String> = strs(&n["drivers"]);
    let mut header = vec![
        ("ID", shown_id(id, verbose).to_string()),
        ("Name", text(&n["name"])),
        (
            "Class",
            or_none(n["node_class"].as_str().unwrap_or_default()),
        ),
        ("DC", text(&n["datacenter"])),
        ("Status", text(&n["status"])),
        (
            "Eligibility",
            n["scheduling_eligibility"]
                .as_str()
                .unwrap_or("eligible")
                .to_string(),
        ),
        ("Drain", n["drain"].as_bool().unwrap_or(false).to_string()),
    ];
    if let Some(d) = n["drain_strategy"].as_object() {
        let at = d.get("force_deadline_ms").and_then(Value::as_i64);
        header.push((
            "Drain Deadline",
            format!(
                "{} ({})",
                d.get("deadline")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
                deadline_left(at.unwrap_or(0), now_ms)
            ),
        ));
    }
    header.push((
        "Last Heartbeat",
        ago_at(n["last_heartbeat_ms"].as_i64().unwrap_or(0), now_ms),
    ));
    header.push((
        "Drivers",
        if usable.is_empty() {
            "<none>".to_string()
        } else {
            usable.join(", ")
        },
    ));
    header
}

/// The Drivers and Resources sections of [`node_detail`].
fn driver_and_resource_tables(n: &Value, now_ms: i64) -> String {
    let mut out = String::new();
    let drivers: Vec<Vec<String>> = n["driver_info"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, d)| {
            vec![
                name.clone(),
                d["detected"].as_bool().unwrap_or(false).to_string(),
                d["healthy"].as_bool().unwrap_or(false).to_string(),
                ago_at(d["update_time_ms"].as_i64().unwrap_or(0), now_ms),
                text(&d["health_description"]),
            ]
        })
        .collect();
    out += &titled_table(
        "Drivers",
        &["Driver", "Detected", "Healthy", "Updated", "Description"],
        drivers,
    );

    let figures = |r: &Value| -> Vec<String> {
        ["cpu", "memory_mb", "disk_mb"]
            .iter()
            .map(|k| r[*k].as_u64().unwrap_or(0).to_string())
            .collect()
    };
    let mut resources = Vec::new();
    for (label, key) in [
        ("Total", "total_resources"),
        ("Reserved", "reserved"),
        ("Allocated", "allocated_resources"),
    ] {
        let mut row = vec![label.to_string()];
        row.extend(figures(&n[key]));
        resources.push(row);
    }
    out += &titled_table(
        "Resources",
        &["", "CPU (MHz)", "Memory (MiB)", "Disk (MiB)"],
        resources,
    );
    out
}

/// A node's events, newest first (the newest [`RECENT_EVENTS`], all with
/// `verbose`): time, subsystem, then the message last, so a long one
/// never pushes the others; `verbose` adds the details and the count.
fn event_rows(events: &Value, verbose: bool) -> Vec<Vec<String>> {
    let all: Vec<&Value> = events.as_array().into_iter().flatten().rev().collect();
    let shown = if verbose {
        all.len()
    } else {
        RECENT_EVENTS.min(all.len())
    };
    all[..shown]
        .iter()
        .map(|e| {
            let mut message = text(&e["message"]);
            if verbose {
                let details: Vec<String> = e["details"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(_, v)| v.as_str() != Some(""))
                    .map(|(k, v)| format!("{k}={}", text(v)))
                    .collect();
                if !details.is_empty() {
                    message = format!("{message} ({})", details.join(", "));
                }
            }
            match e["count"].as_u64() {
                Some(count) if count > 1 => message = format!("{message} (x{count})"),
                _ => {}
            }
            vec![
                format_time(e["timestamp"].as_i64().unwrap_or(0)),
                text(&e["subsystem"]),
                message,
            ]
        })
        .collect()
}

fn node_purge(a: PurgeArgs, api: &ApiClient) -> Result<i32> {
    let node = &a.node;
    if a.force && !a.yes {
        let question = format!(
            "Purging node {node:?} with -force frees the write claims of its allocs. Are its tasks \
             stopped (or its host gone)? A task still running would write beside its replacement."
        );
        if !crate::output::confirm(&question)? {
            eprintln!("Not purged.");
            return Ok(1);
        }
    }
    let resp = api.put(
        &format!("/v1/node/{}/purge", enc(node)),
        &json!({ "force": a.force }),
    )?;
    if a.json {
        return print_json(&resp);
    }
    print_release_warnings(&resp);
    let name = resp["node_name"].as_str().unwrap_or_default();
    let id = resp["node_id"].as_str().unwrap_or_default();
    let lost = strs(&resp["lost_allocs"]);
    let released = resp["released"].as_array().map_or(0, Vec::len);
    let kept = resp["kept"].as_array().cloned().unwrap_or_default();
    println!(
        "Purged node {name:?} ({id}): {} lost, {released} volume claim(s) freed",
        allocs_phrase(lost.len())
    );
    if !kept.is_empty() {
        println!(
            "Kept {} write claim(s): the node's tasks may still write. Once they are stopped, free each:",
            kept.len()
        );
        for k in &kept {
            let volume = k["volume_id"].as_str().unwrap_or_default();
            let alloc = k["alloc_id"].as_str().unwrap_or_default();
            println!(
                "  volume {volume} (alloc {}): berth volume detach {volume} {id}",
                crate::output::short_id(alloc)
            );
        }
    }
    Ok(0)
}

/// When a drain stops waiting for migrations, for people.
pub fn deadline_left(force_deadline_ms: i64, now_ms: i64) -> String {
    match u64::try_from(force_deadline_ms.saturating_sub(now_ms)) {
        Ok(ms) if ms > 0 => format!(
            "the drain stops waiting for migrations in {}",
            humantime::format_duration(std::time::Duration::from_secs(ms / 1000))
        ),
        _ => "past: the drain no longer waits for migrations".into(),
    }
}

/// The rows of the `node status` table, in columns sized to their
/// widest cell: ID (short; whole with `verbose`), name, class, datacenter,
/// drain, eligibility, status, last heartbeat, running allocs (the
/// list's `allocs_running`).
pub fn node_table(nodes: &[Value], verbose: bool, now_ms: i64) -> Vec<String> {
    let mut table = Table::new([
        "ID",
        "Name",
        "Class",
        "DC",
        "Drain",
        "Eligibility",
        "Status",
        "Last Heartbeat",
        "Allocs Running",
    ]);
    for n in nodes {
        let id = n["id"].as_str().unwrap_or_default();
        table.push([
            shown_id(id, verbose).to_string(),
            text(&n["name"]),
            or_none(n["node_class"].as_str().unwrap_or_default()),
            or_none(n["datacenter"].as_str().unwrap_or_default()),
            n["drain"].as_bool().unwrap_or(false).to_string(),
            n["scheduling_eligibility"]
                .as_str()
                .unwrap_or("eligible")
                .to_string(),
            text(&n["status"]),
            ago_at(n["last_heartbeat_ms"].as_i64().unwrap_or(0), now_ms),
            n["allocs_running"].as_u64().unwrap_or(0).to_string(),
        ]);
    }
    table.lines()
}

/// A topology of the API's JSON (`{"segments": {...}}`) as text:
/// `{zone=a}`; `-` for none.
pub fn topology_text(t: &Value) -> String {
    match serde_json::from_value::<berth_structs::CsiTopology>(t.clone()) {
        Ok(t) if !t.segments.is_empty() => t.to_string(),
        _ => "-".to_string(),
    }
}

/// A list of topologies of the API's JSON as text: `{zone=a} or
/// {zone=b}`; `-` for none.
pub fn topologies_text(list: &Value) -> String {
    let list: Vec<berth_structs::CsiTopology> =
        serde_json::from_value(list.clone()).unwrap_or_default();
    berth_structs::topologies_text(&list)
}

/// The rows of a node's CSI plugins: ID, type (node or controller),
/// health, the node plugin's topology and the health description; none
/// when it runs none.
pub fn plugin_rows(node: &Value) -> Vec<Vec<String>> {
    let mut rows: Vec<Vec<String>> = Vec::new();
    for (kind, field) in [
        ("node", "csi_node_plugins"),
        ("controller", "csi_controller_plugins"),
    ] {
        for (id, p) in node[field].as_object().into_iter().flatten() {
            let topology = if kind == "node" {
                topology_text(&p["accessible_topology"])
            } else {
                "-".to_string()
            };
            let description = match p["health_description"].as_str() {
                Some(d) if !d.is_empty() => d.to_string(),
                _ => "-".to_string(),
            };
            rows.push(vec![
                id.clone(),
                kind.to_string(),
                p["healthy"].as_bool().unwrap_or(false).to_string(),
                topology,
                description,
            ]);
        }
    }
    rows.sort();
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_table_shows_each_plugin_its_node_topology_and_health() {
        let n = json!({
            "csi_node_plugins": {
                "hostpath": {"healthy": true, "health_description": "healthy",
                             "accessible_topology": {"segments": {"zone": "a", "rack": "r1"}}},
                "nfs": {"healthy": false, "health_description": "probe failed: connection refused"}
            },
            "csi_controller_plugins": {"hostpath": {"healthy": true}}
        });
        assert_eq!(
            titled_table(
                "CSI Plugins",
                &["ID", "Type", "Healthy", "Topology", "Description"],
                plugin_rows(&n)
            ),
            "\nCSI Plugins\n\
             ID        Type        Healthy  Topology          Description\n\
             hostpath  controller  true     -                 -\n\
             hostpath  node        true     {rack=r1,zone=a}  healthy\n\
             nfs       node        false    -                 probe failed: connection refused\n"
        );
        assert!(plugin_rows(&json!({})).is_empty());
        assert_eq!(titled_table("CSI Plugins", &["ID"], Vec::new()), "");
        assert_eq!(
            topologies_text(&json!([{"segments": {"zone": "a"}}, {"segments": {"zone": "b"}}])),
            "{zone=a} or {zone=b}"
        );
        assert_eq!(topologies_text(&json!([])), "-");
    }

    #[test]
    fn the_status_table_shows_eligibility_drain_heartbeat_and_running_allocs() {
        let nodes = vec![
            json!({"id": "0123456789abcdef", "name": "worker-1", "node_class": "gpu",
                   "datacenter": "dc1",
                   "status": "ready", "scheduling_eligibility": "ineligible", "drain": true,
                   "last_heartbeat_ms": 97_000, "allocs_running": 2}),
            json!({"id": "fedcba9876543210", "name": "worker-2", "status": "down",
                   "scheduling_eligibility": "eligible", "drain": false,
                   "last_heartbeat_ms": 0, "allocs_running": 0}),
        ];
        let rows = node_table(&nodes, false, 100_000);
        assert_eq!(
            rows,
            vec![
                "ID        Name      Class   DC      Drain  Eligibility  Status  Last Heartbeat  Allocs Running",
                "01234567  worker-1  gpu     dc1     true   ineligible   ready   3s ago          2",
                "fedcba98  worker-2  <none>  <none>  false  eligible     down    never           0",
            ]
        );
        let verbose = node_table(&nodes, true, 100_000);
        assert!(
            verbose[1].starts_with("0123456789abcdef  worker-1"),
            "{verbose:#?}"
        );
        assert_eq!(ago_at(40_000, 100_000), "1m ago");
        assert_eq!(
            deadline_left(3_700_000, 100_000),
            "the drain stops waiting for migrations in 1h"
        );
        assert_eq!(
            deadline_left(i64::MIN, i64::MAX),
            "past: the drain no longer waits for migrations"
        );
    }

    /// A node view as the API answers it, with drivers, resources, a
    /// plugin, a claimed volume and events.
    fn node_view() -> Value {
        json!({
            "id": "0123456789abcdef0000", "name": "worker-1", "node_class": "",
            "datacenter": "dc1", "status": "ready", "scheduling_eligibility": "eligible",
            "drain": false, "last_heartbeat_ms": 98_000,
            "drivers": ["raw_exec"],
            "driver_info": {"raw_exec": {"detected": true, "healthy": true,
                            "health_description": "Healthy", "update_time_ms": 40_000}},
            "total_resources": {"cpu": 4000, "memory_mb": 8000, "disk_mb": 100000},
            "reserved": {"cpu": 500, "memory_mb": 256, "disk_mb": 10},
            "allocated_resources": {"cpu": 150, "memory_mb": 96, "disk_mb": 0},
            "csi_node_plugins": {"hostpath": {"healthy": true, "health_description": "healthy"}},
            "csi_volumes": [{"volume_id": "data", "plugin_id": "hostpath",
                             "alloc_id": "aaaabbbbccccdddd", "mode": "write", "state": "taken"}],
            "attributes": {"os.name": "linux"},
            "meta": {},
            "events": (0..12).map(|i| json!({
                "subsystem": "Storage", "message": format!("Mount volume {i}"),
                "details": {"volume_id": "data", "error": ""}, "timestamp": 1_764_592_800_000_i64 + i * 1000,
                "count": if i == 11 { 3 } else { 1 }
            })).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn the_node_detail_shows_each_section_and_the_newest_ten_events() {
        let allocs = json!([
            {"id": "aaaabbbbccccdddd", "job_id": "web", "task_group": "web",
             "client_status": "running", "create_index": 9, "create_time_ms": 40_000},
            {"id": "eeeeffff00001111", "job_id": "hostpath-plugin", "task_group": "plugin",
             "client_status": "running", "create_index": 5, "create_time_ms": 10_000}
        ]);
        let text = node_detail(&node_view(), &allocs, false, 100_000);
        let want = "\
ID             = 01234567
Name           = worker-1
Class          = <none>
DC             = dc1
Status         = ready
Eligibility    = eligible
Drain          = false
Last Heartbeat = 2s ago
Drivers        = raw_exec

Drivers
Driver    Detected  Healthy  Updated  Description
raw_exec  true      true     1m ago   Healthy

Resources
           CPU (MHz)  Memory (MiB)  Disk (MiB)
Total      4000       8000          100000
Reserved   500        256           10
Allocated  150        96            0

CSI Plugins
ID        Type  Healthy  Topology  Description
hostpath  node  true     -         healthy

CSI Volumes
Volume  Plugin    Alloc ID  Mode   State
data    hostpath  aaaabbbb  write  taken

Allocations
ID        Job              Group   Status   Created
aaaabbbb  web              web     running  1m ago
eeeeffff  hostpath-plugin  plugin  running  1m ago

Recent Events
Time                  Subsystem  Message
2025-12-01T12:40:11Z  Storage    Mount volume 11 (x3)
2025-12-01T12:40:10Z  Storage    Mount volume 10
2025-12-01T12:40:09Z  Storage    Mount volume 9
2025-12-01T12:40:08Z  Storage    Mount volume 8
2025-12-01T12:40:07Z  Storage    Mount volume 7
2025-12-01T12:40:06Z  Storage    Mount volume 6
2025-12-01T12:40:05Z  Storage    Mount volume 5
2025-12-01T12:40:04Z  Storage    Mount volume 4
2025-12-01T12:40:03Z  Storage    Mount volume 3
2025-12-01T12:40:02Z  Storage    Mount volume 2
";
        assert_eq!(text, want, "{text}");
    }

    #[test]
    fn the_verbose_node_detail_shows_full_ids_attributes_and_every_event_with_details() {
        let text = node_detail(&node_view(), &json!([]), true, 100_000);
        assert!(
            text.contains("ID             = 0123456789abcdef0000\n"),
            "{text}"
        );
        assert!(
            text.contains("data    hostpath  aaaabbbbccccdddd  write  taken"),
            "{text}"
        );
        assert!(text.contains("\nAttributes\nos.name = linux\n"), "{text}");
        assert!(!text.contains("\nMeta\n"), "no meta, no section: {text}");
        assert!(
            !text.contains("\nAllocations\n"),
            "no allocs, no section: {text}"
        );
        assert!(
            text.contains("Mount volume 11 (volume_id=data) (x3)"),
            "{text}"
        );
        assert!(text.contains("Mount volume 0 (volume_id=data)"), "{text}");
        assert_eq!(text.matches("Mount volume").count(), 12);
    }
}
