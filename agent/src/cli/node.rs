//! `berth node status|drain|eligibility|purge`, and the tables they print.

use std::collections::HashMap;

use anyhow::Result;
use clap::{ArgGroup, Args, Subcommand};
use serde_json::{json, Value};

use super::http_client::ApiClient;
use super::{allocs_phrase, enc, print_json, print_release_warnings, strs, volume_stats, Ctx};

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// Show nodes, or one node with its CSI plugins and events
    Status(StatusArgs),
    /// Move a node's allocs elsewhere, or stop draining it
    Drain(DrainArgs),
    /// Allow or forbid new allocs on a node
    Eligibility(EligibilityArgs),
    /// Forget a node that is gone; its allocs are lost, its claims freed
    Purge(PurgeArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// The node's ID, ID prefix or name (none: every node)
    #[arg(value_name = "NODE")]
    pub node: Option<String>,
}

#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
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
    }
}

/// The first eight characters of an ID, as tables show it.
pub fn short_id(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
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
                && a["desired_description"] == berth_server::DRAIN_STOP_DESCRIPTION;
            let label = format!(
                "Alloc {} ({})",
                short_id(id),
                a["name"].as_str().unwrap_or_default()
            );
            if drained && !s.stopped {
                s.stopped = true;
                println!(
                    "{label}: stopping ({})",
                    berth_server::DRAIN_STOP_DESCRIPTION
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
            if last == berth_server::DRAIN_COMPLETE_EVENT {
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
    let v = match &a.node {
        Some(id) => api.get(&format!("/v1/node/{}", enc(&id)))?,
        None => api.get("/v1/nodes")?,
    };
    if a.json {
        return print_json(&v);
    }
    let nodes = match &v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    let allocs = api.get("/v1/allocations")?;
    for row in node_table(&nodes, &allocs, berth_structs::now_ms()) {
        println!("{row}");
    }
    if let [n] = nodes.as_slice() {
        println!("\nID = {}", n["id"].as_str().unwrap_or_default());
        if let Some(d) = n["drain_strategy"].as_object() {
            let at = d.get("force_deadline_ms").and_then(Value::as_i64);
            println!(
                "Drain deadline = {} ({})",
                d.get("deadline")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
                deadline_left(at.unwrap_or(0), berth_structs::now_ms())
            );
        }
        let plugins = plugin_table(n);
        if !plugins.is_empty() {
            println!("\nCSI Plugins");
            for row in plugins {
                println!("  {row}");
            }
        }
        println!("\nEvents");
        for e in n["events"].as_array().into_iter().flatten() {
            println!(
                "  {:<10} {:<20} {}",
                e["subsystem"].as_str().unwrap_or_default(),
                e["message"].as_str().unwrap_or_default(),
                e["details"]
            );
        }
    }
    Ok(0)
}

fn node_purge(a: PurgeArgs, api: &ApiClient) -> Result<i32> {
    let node = &a.node;
    let resp = api.put(&format!("/v1/node/{}/purge", enc(node)), &json!({}))?;
    if a.json {
        return print_json(&resp);
    }
    print_release_warnings(&resp);
    let name = resp["node_name"].as_str().unwrap_or_default();
    let id = resp["node_id"].as_str().unwrap_or_default();
    let lost = strs(&resp["lost_allocs"]);
    let released = resp["released"].as_array().map_or(0, Vec::len);
    println!(
        "Purged node {name:?} ({id}): {} lost, {released} volume claim(s) freed",
        allocs_phrase(lost.len())
    );
    Ok(0)
}

/// How long ago `ms` (unix milliseconds) was, for people: `3s ago`.
pub fn ago(ms: i64, now_ms: i64) -> String {
    if ms <= 0 {
        return "never".into();
    }
    let secs = u64::try_from(now_ms.saturating_sub(ms)).unwrap_or(0) / 1000;
    format!(
        "{} ago",
        humantime::format_duration(std::time::Duration::from_secs(secs))
    )
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

/// The rows of the `node status` table: ID (short), name, class, status,
/// eligibility, drain, last heartbeat, running allocs.
pub fn node_table(nodes: &[Value], allocs: &Value, now_ms: i64) -> Vec<String> {
    let mut running: HashMap<&str, usize> = HashMap::new();
    for a in allocs.as_array().into_iter().flatten() {
        if a["client_status"] == "running" {
            let n = running
                .entry(a["node_id"].as_str().unwrap_or_default())
                .or_default();
            *n = n.saturating_add(1);
        }
    }
    let row = |cols: [&str; 8]| {
        format!(
            "{:<8}  {:<20}  {:<10}  {:<12}  {:<11}  {:<5}  {:<16}  {}",
            cols[0], cols[1], cols[2], cols[3], cols[4], cols[5], cols[6], cols[7]
        )
        .trim_end()
        .to_string()
    };
    let mut out = vec![row([
        "ID",
        "Name",
        "Class",
        "Status",
        "Eligibility",
        "Drain",
        "Last heartbeat",
        "Allocs running",
    ])];
    for n in nodes {
        let id = n["id"].as_str().unwrap_or_default();
        let class = match n["node_class"].as_str().unwrap_or_default() {
            "" => "<none>",
            c => c,
        };
        let drain = if n["drain"].as_bool().unwrap_or(false) {
            "true"
        } else {
            "false"
        };
        let heartbeat = ago(n["last_heartbeat_ms"].as_i64().unwrap_or(0), now_ms);
        let count = running.get(id).copied().unwrap_or(0).to_string();
        out.push(row([
            short_id(id),
            n["name"].as_str().unwrap_or_default(),
            class,
            n["status"].as_str().unwrap_or_default(),
            n["scheduling_eligibility"].as_str().unwrap_or("eligible"),
            drain,
            &heartbeat,
            &count,
        ]));
    }
    out
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
/// health and the node plugin's topology; nothing when it runs none.
pub fn plugin_table(node: &Value) -> Vec<String> {
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
            rows.push(vec![
                id.clone(),
                kind.to_string(),
                p["healthy"].as_bool().unwrap_or(false).to_string(),
                topology,
            ]);
        }
    }
    if rows.is_empty() {
        return Vec::new();
    }
    rows.sort();
    rows.insert(
        0,
        ["ID", "Type", "Healthy", "Topology"]
            .map(String::from)
            .to_vec(),
    );
    volume_stats::table(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_table_shows_each_plugin_and_its_node_topology() {
        let n = json!({
            "csi_node_plugins": {
                "hostpath": {"healthy": true,
                             "accessible_topology": {"segments": {"zone": "a", "rack": "r1"}}},
                "nfs": {"healthy": false}
            },
            "csi_controller_plugins": {"hostpath": {"healthy": true}}
        });
        assert_eq!(
            plugin_table(&n),
            vec![
                "ID        Type        Healthy  Topology",
                "hostpath  controller  true     -",
                "hostpath  node        true     {rack=r1,zone=a}",
                "nfs       node        false    -",
            ]
        );
        assert!(plugin_table(&json!({})).is_empty());
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
                   "status": "ready", "scheduling_eligibility": "ineligible", "drain": true,
                   "last_heartbeat_ms": 97_000}),
            json!({"id": "fedcba9876543210", "name": "worker-2", "status": "down",
                   "scheduling_eligibility": "eligible", "drain": false,
                   "last_heartbeat_ms": 0}),
        ];
        let allocs = json!([
            {"node_id": "0123456789abcdef", "client_status": "running"},
            {"node_id": "0123456789abcdef", "client_status": "running"},
            {"node_id": "0123456789abcdef", "client_status": "complete"},
        ]);
        let rows = node_table(&nodes, &allocs, 100_000);
        assert_eq!(
            rows,
            vec![
                "ID        Name                  Class       Status        Eligibility  Drain  Last heartbeat    Allocs running",
                "01234567  worker-1              gpu         ready         ineligible   true   3s ago            2",
                "fedcba98  worker-2              <none>      down          eligible     false  never             0",
            ]
        );
        assert_eq!(ago(40_000, 100_000), "1m ago");
        assert_eq!(
            deadline_left(3_700_000, 100_000),
            "the drain stops waiting for migrations in 1h"
        );
        assert_eq!(
            deadline_left(i64::MIN, i64::MAX),
            "past: the drain no longer waits for migrations"
        );
    }
}
