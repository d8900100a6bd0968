//! `berth node drain` and `berth node eligibility`, and the `node status`
//! table.

use std::collections::HashMap;

use anyhow::Result;
use serde_json::{json, Value};

use super::errors::UsageError;
use super::http_client::ApiClient;
use super::{api_args, enc, one_positional, print_json};

/// The help of `berth node drain` (also shown with its usage errors).
pub const DRAIN_HELP: &str = "\
Usage: berth node drain -enable [-deadline D] [-force] [-detach] NODE
       berth node drain -disable NODE

Drains a node (an ID, a unique ID prefix or a name). The node becomes
ineligible for new allocs. Its service and batch allocs are stopped at once
and placed again on other nodes. Its system allocs are stopped last: once the
service and batch allocs there have stopped, and a CSI plugin only once every
alloc on the node that uses a volume of that plugin has unmounted it and its
claim is released. The drain is complete when every alloc on the node has
stopped; the node then stays ineligible until `berth node eligibility -enable
NODE`.

Without -detach the command follows the drain, printing the allocs as they
stop, until it completes; Ctrl-C leaves the drain running.

Options:
  -enable      start draining the node (or change the deadline of its drain)
  -deadline D  how long the drain waits for the service and batch allocs to
               stop (default 1h). At the deadline it stops waiting and stops
               the system allocs too; plugins still wait until their volumes
               are unmounted: no volume is left behind a stopped plugin.
  -force       a deadline of now: do not wait for the allocs to migrate
  -detach      return once the drain has started
  -json        print the node as the API answers it, and return
  -disable     stop draining; stopped allocs stay stopped and the node stays
               ineligible
  -address A   the API address (default BERTH_ADDR, then http://127.0.0.1:4747)
";

/// The help of `berth node eligibility`.
pub const ELIGIBILITY_HELP: &str = "\
Usage: berth node eligibility -enable|-disable NODE

Allows (-enable) or forbids (-disable) new allocs on a node (an ID, a unique
ID prefix or a name). Allocs already there keep running. A draining node
cannot be made eligible: disable the drain first.

Options:
  -json        print the node as the API answers it
  -address A   the API address (default BERTH_ADDR, then http://127.0.0.1:4747)
";

fn usage(message: impl Into<String>, help: &'static str) -> anyhow::Error {
    UsageError::new(message, help).into()
}

/// A usage error of the shared argument parsing, shown with `help`
/// instead of the general usage; other errors as they are.
fn with_help(e: anyhow::Error, help: &'static str) -> anyhow::Error {
    if e.downcast_ref::<UsageError>().is_some() {
        usage(e.to_string(), help)
    } else {
        e
    }
}

/// The flags `-enable`, `-disable` and `-deadline D` (`-deadline=D`) taken
/// out of the command line; the rest is for [`api_args`].
struct Toggle {
    enable: bool,
    disable: bool,
    deadline: Option<String>,
    rest: Vec<String>,
    help: bool,
}

fn toggle_args(
    command: &str,
    args: &[String],
    with_deadline: bool,
    help: &'static str,
) -> Result<Toggle> {
    let mut t = Toggle {
        enable: false,
        disable: false,
        deadline: None,
        rest: Vec::new(),
        help: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let flag = a.strip_prefix("--").or_else(|| a.strip_prefix('-'));
        let (name, inline) = match flag.map(|f| f.split_once('=').unwrap_or((f, ""))) {
            Some((n, v)) if a.contains('=') => (n, Some(v.to_string())),
            Some((n, _)) => (n, None),
            None => ("", None),
        };
        match name {
            "enable" => t.enable = true,
            "disable" => t.disable = true,
            "h" | "help" => t.help = true,
            "deadline" if with_deadline => {
                let value = match inline {
                    Some(v) => v,
                    None => it.next().cloned().ok_or_else(|| {
                        usage(format!("berth {command}: -deadline needs a value"), help)
                    })?,
                };
                t.deadline = Some(value);
            }
            _ => t.rest.push(a.clone()),
        }
    }
    if !t.help && t.enable == t.disable {
        return Err(usage(
            format!("berth {command}: give one of -enable or -disable"),
            help,
        ));
    }
    Ok(t)
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
pub fn node_drain(args: &[String]) -> Result<i32> {
    let t = toggle_args("node drain", args, true, DRAIN_HELP)?;
    if t.help {
        print!("{DRAIN_HELP}");
        return Ok(0);
    }
    let a = api_args("node drain", &t.rest, &["force", "detach", "json"])
        .map_err(|e| with_help(e, DRAIN_HELP))?;
    let node = one_positional("node drain", &a, "node ID, ID prefix or name")
        .map_err(|e| with_help(e, DRAIN_HELP))?;
    if t.disable && (t.deadline.is_some() || a.force || a.detach) {
        return Err(usage(
            "berth node drain: -deadline, -force and -detach go with -enable",
            DRAIN_HELP,
        ));
    }
    if t.deadline.is_some() && a.force {
        return Err(usage(
            "berth node drain: give -deadline or -force, not both (-force is a deadline of now)",
            DRAIN_HELP,
        ));
    }
    let mut body = json!({ "enable": t.enable, "force": a.force });
    if let Some(d) = &t.deadline {
        body["deadline"] = json!(d);
    }
    let n = a
        .api
        .post(&format!("/v1/node/{}/drain", enc(&node)), &body)?;
    if a.json {
        return print_json(&n);
    }
    let label = node_label(&n);
    if t.disable {
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
    follow_drain(&a.api, &id)
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
pub fn node_eligibility(args: &[String]) -> Result<i32> {
    let t = toggle_args("node eligibility", args, false, ELIGIBILITY_HELP)?;
    if t.help {
        print!("{ELIGIBILITY_HELP}");
        return Ok(0);
    }
    let a = api_args("node eligibility", &t.rest, &["json"])
        .map_err(|e| with_help(e, ELIGIBILITY_HELP))?;
    let node = one_positional("node eligibility", &a, "node ID, ID prefix or name")
        .map_err(|e| with_help(e, ELIGIBILITY_HELP))?;
    let n = a.api.post(
        &format!("/v1/node/{}/eligibility", enc(&node)),
        &json!({ "eligible": t.enable }),
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
    super::volume_stats::table(&rows)
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

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn drain_flags_are_taken_out_and_the_rest_left_for_the_api_flags() {
        let t = toggle_args(
            "node drain",
            &strings(&["-enable", "-deadline", "30m", "-force", "n1"]),
            true,
            DRAIN_HELP,
        )
        .unwrap();
        assert!(t.enable && !t.disable);
        assert_eq!(t.deadline.as_deref(), Some("30m"));
        assert_eq!(t.rest, strings(&["-force", "n1"]));
        let t = toggle_args(
            "node drain",
            &strings(&["--deadline=1h", "-enable", "n1"]),
            true,
            DRAIN_HELP,
        )
        .unwrap();
        assert_eq!(t.deadline.as_deref(), Some("1h"));
        assert_eq!(t.rest, strings(&["n1"]));
    }

    #[test]
    fn drain_and_eligibility_need_exactly_one_of_enable_or_disable() {
        for args in [&["n1"][..], &["-enable", "-disable", "n1"][..]] {
            let e = toggle_args("node drain", &strings(args), true, DRAIN_HELP)
                .err()
                .expect("a usage error");
            assert_eq!(
                e.to_string(),
                "berth node drain: give one of -enable or -disable"
            );
            assert!(e.downcast_ref::<UsageError>().is_some());
        }
        let e = toggle_args(
            "node drain",
            &strings(&["-enable", "-deadline"]),
            true,
            DRAIN_HELP,
        )
        .err()
        .expect("a usage error");
        assert_eq!(e.to_string(), "berth node drain: -deadline needs a value");
        // -deadline is no flag of node eligibility: api_args refuses it.
        let t = toggle_args(
            "node eligibility",
            &strings(&["-enable", "-deadline", "1h", "n1"]),
            false,
            ELIGIBILITY_HELP,
        )
        .unwrap();
        assert_eq!(t.rest, strings(&["-deadline", "1h", "n1"]));
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
