//! `berth alloc`: the command group, and `alloc status`.

use std::collections::BTreeMap;

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use super::output::{
    ago_at, format_time, joined, key_values, shown_id, table, text_or, titled_table, OutputArgs,
};
use super::{alloc_logs, alloc_ops, enc, volume_stats, Ctx};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum AllocCommand {
    /// Show an allocation: its tasks, their events, its CSI volumes
    Status(StatusArgs),
    /// Print a task's logs
    Logs(alloc_logs::LogsArgs),
    /// Stop an allocation and wait until it has stopped (a replacement is
    /// placed where the job still wants one)
    Stop(alloc_ops::StopArgs),
    /// Restart an allocation's tasks, or one task
    Restart(alloc_ops::RestartArgs),
    /// Send a signal to an allocation's tasks, or to one task
    Signal(alloc_ops::SignalArgs),
}

/// `berth alloc status [-verbose] [-json] [-t T] ALLOC`.
#[derive(Args, Debug)]
#[command(long_about = STATUS_ABOUT)]
pub struct StatusArgs {
    /// Full IDs and every task event
    #[arg(long)]
    pub verbose: bool,
    #[command(flatten)]
    pub output: OutputArgs,
    /// The alloc's ID or a unique ID prefix
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
}

/// The long help of `berth alloc status`.
const STATUS_ABOUT: &str = "\
Shows an allocation (an ID or a unique ID prefix): its node, job and
statuses; each task with its state, restarts, the resources it asks for and
its recent events, newest first; and the CSI volumes of its group, where
each task mounts them, read-only or not, with the stats its node last
reported.";

pub fn run(cmd: AllocCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        AllocCommand::Status(a) => alloc_status(a, ctx.api()),
        AllocCommand::Logs(a) => alloc_logs::run(a, ctx),
        AllocCommand::Stop(a) => alloc_ops::stop(a, ctx),
        AllocCommand::Restart(a) => alloc_ops::restart(a, ctx),
        AllocCommand::Signal(a) => alloc_ops::signal(a, ctx),
    }
}

fn alloc_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    let v = api.get(&format!("/v1/allocation/{}", enc(&a.alloc)))?;
    a.output.emit(&v, |v| {
        // The node may be gone (purged): its name is then unknown.
        let node_name = v["node_id"]
            .as_str()
            .filter(|id| !id.is_empty())
            .and_then(|id| api.get(&format!("/v1/node/{}", enc(id))).ok())
            .and_then(|n| n["name"].as_str().map(str::to_string));
        let plugins = volume_plugins(v, api);
        print!(
            "{}",
            alloc_detail(
                v,
                node_name.as_deref(),
                &plugins,
                a.verbose,
                berth_structs::now_ms()
            )
        );
        Ok(())
    })
}

/// The plugin of each CSI volume of the alloc's group, by volume ID: as
/// the node reported it with the volume's stats, else as the servers
/// know the volume.
fn volume_plugins(alloc: &Value, api: &ApiClient) -> BTreeMap<String, String> {
    csi_volumes(alloc)
        .into_iter()
        .filter_map(|(name, volume_id, _)| {
            let reported = alloc["csi_volume_stats"][&name]["plugin_id"]
                .as_str()
                .filter(|p| !p.is_empty())
                .map(str::to_string);
            let plugin = reported.or_else(|| {
                api.get(&format!("/v1/volume/csi/{}", enc(&volume_id)))
                    .ok()
                    .and_then(|v| v["plugin_id"].as_str().map(str::to_string))
            })?;
            Some((volume_id, plugin))
        })
        .collect()
}

/// The alloc's group in the job it was placed with.
fn group(alloc: &Value) -> Option<&Value> {
    alloc["job"]["task_groups"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|g| g["name"] == alloc["task_group"])
}

/// The CSI volumes of the alloc's group: (name in the group, volume ID,
/// read-only in the group), the ID of a `per_alloc` volume with the
/// alloc's index.
fn csi_volumes(alloc: &Value) -> Vec<(String, String, bool)> {
    let index = alloc["index"].as_u64().unwrap_or(0);
    group(alloc)
        .and_then(|g| g["volumes"].as_object())
        .into_iter()
        .flatten()
        .filter(|(_, req)| req["type"] == "csi")
        .map(|(name, req)| {
            let source = req["source"].as_str().unwrap_or_default();
            let id = if req["per_alloc"].as_bool() == Some(true) {
                format!("{source}[{index}]")
            } else {
                source.to_string()
            };
            (name.clone(), id, req["read_only"].as_bool() == Some(true))
        })
        .collect()
}

fn text(v: &Value) -> String {
    text_or(v, "<none>")
}

/// The whole human answer of `alloc status`: the header, each task, the
/// CSI volumes.
pub fn alloc_detail(
    v: &Value,
    node_name: Option<&str>,
    plugins: &BTreeMap<String, String>,
    verbose: bool,
    now_ms: i64,
) -> String {
    let id = |k: &str| shown_id(v[k].as_str().unwrap_or_default(), verbose).to_string();
    let mut header = vec![
        ("ID", id("id")),
        ("Name", text(&v["name"])),
        ("Node ID", id("node_id")),
        ("Node Name", node_name.unwrap_or("<unknown>").to_string()),
        ("Job ID", text(&v["job_id"])),
        (
            "Job Version",
            v["job"]["version"].as_u64().unwrap_or(0).to_string(),
        ),
        ("Client Status", text(&v["client_status"])),
        ("Client Description", text(&v["client_description"])),
        ("Desired Status", text(&v["desired_status"])),
        ("Desired Description", text(&v["desired_description"])),
        (
            "Created",
            ago_at(v["create_time_ms"].as_i64().unwrap_or(0), now_ms),
        ),
        (
            "Modified",
            ago_at(v["modify_time_ms"].as_i64().unwrap_or(0), now_ms),
        ),
    ];
    if let Some(ms) = v["node_last_heartbeat_ms"].as_i64().filter(|ms| *ms > 0) {
        header.push(("Node Last Heartbeat", format_time(ms)));
    }
    let disconnected = &v["disconnected"];
    if let Some(since) = disconnected["since_ms"].as_i64() {
        header.push(("Unknown Since", ago_at(since, now_ms)));
        let lost_at = disconnected["lost_at_ms"].as_i64().unwrap_or(0);
        header.push(("Lost At", format_time(lost_at)));
    }
    header.extend(crate::reschedule::header_lines(v, verbose, now_ms));
    let deployment = &v["deployment"];
    if let Some(d) = deployment["id"].as_str() {
        header.push(("Deployment ID", shown_id(d, verbose).to_string()));
        let health = match deployment["healthy"].as_bool() {
            Some(true) => "healthy",
            Some(false) => "unhealthy",
            None => "unset",
        };
        header.push(("Deployment Health", health.to_string()));
        if deployment["canary"].as_bool() == Some(true) {
            header.push(("Canary", "true".to_string()));
        }
    }
    let mut out = joined(key_values(&header));
    let attempts = crate::reschedule::attempts_rows(v, verbose);
    if !attempts.is_empty() {
        out += &titled_table(
            "Reschedule Attempts",
            &["Time", "From Alloc", "From Node", "Delay"],
            attempts,
        );
    }

    // The group's tasks in their order, then any state of a task the group
    // no longer names.
    let mut tasks: Vec<String> = group(v)
        .and_then(|g| g["tasks"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect();
    for name in v["task_states"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, _)| k)
    {
        if !tasks.contains(name) {
            tasks.push(name.clone());
        }
    }
    for task in &tasks {
        out += &task_section(v, task, verbose);
    }

    let volumes = volume_rows(v, plugins);
    if !volumes.is_empty() {
        out += "\nCSI Volumes\n";
        out += &joined(table(&volumes));
    }
    out
}

/// Task events shown without -verbose.
const RECENT_TASK_EVENTS: usize = 10;

/// One task: its state, the resources it asks for, restarts and times,
/// and its events newest first.
fn task_section(alloc: &Value, task: &str, verbose: bool) -> String {
    let st = &alloc["task_states"][task];
    let state = st["state"].as_str().unwrap_or("pending");
    let failed = if st["failed"].as_bool() == Some(true) {
        " (failed)"
    } else {
        ""
    };
    let mut out = format!("\nTask {task:?} is {state:?}{failed}\n");

    let spec = group(alloc)
        .and_then(|g| g["tasks"].as_array())
        .into_iter()
        .flatten()
        .find(|t| t["name"] == task);
    if let Some(t) = spec {
        let r = &t["resources"];
        let (cpu, memory) = (
            r["cpu"].as_u64().unwrap_or(0),
            r["memory_mb"].as_u64().unwrap_or(0),
        );
        // Used of asked, where the task's cgroup says what it uses.
        let u = &st["usage"];
        let row = match (u["cpu_millicores"].as_u64(), u["memory_bytes"].as_u64()) {
            (Some(millicores), Some(bytes)) => vec![
                format!(
                    "{}.{:02} cores used of {cpu} MHz",
                    millicores / 1000,
                    millicores % 1000 / 10
                ),
                format!(
                    "{} used of {}",
                    crate::output::format_bytes(bytes),
                    crate::output::format_bytes(
                        u["memory_limit_bytes"].as_u64().unwrap_or(memory << 20)
                    )
                ),
            ],
            _ => vec![format!("{cpu} MHz"), format!("{memory} MiB")],
        };
        out += &titled_table("Task Resources", &["CPU", "Memory"], vec![row])[1..];
    }

    let events: Vec<&Value> = st["events"]
        .as_array()
        .into_iter()
        .flatten()
        .rev()
        .collect();
    let last_restart = events
        .iter()
        .find(|e| e["type"] == "Restarting")
        .and_then(|e| e["time_ms"].as_i64())
        .map_or_else(|| "N/A".to_string(), format_time);
    let time = |k: &str| {
        st[k]
            .as_i64()
            .map_or_else(|| "N/A".to_string(), format_time)
    };
    out += "\n";
    out += &joined(key_values(&[
        ("Restarts", st["restarts"].as_u64().unwrap_or(0).to_string()),
        ("Last Restart", last_restart),
        ("Started At", time("started_at_ms")),
        ("Finished At", time("finished_at_ms")),
    ]));

    let shown = if verbose {
        events.len()
    } else {
        RECENT_TASK_EVENTS.min(events.len())
    };
    let rows: Vec<Vec<String>> = events[..shown]
        .iter()
        .map(|e| {
            let mut description = e["message"].as_str().unwrap_or_default().to_string();
            if description.is_empty() {
                description = "-".to_string();
            }
            vec![
                format_time(e["time_ms"].as_i64().unwrap_or(0)),
                e["type"].as_str().unwrap_or_default().to_string(),
                description,
            ]
        })
        .collect();
    out += &titled_table("Recent Events", &["Time", "Type", "Description"], rows);
    out
}

/// The rows of the CSI Volumes section, header first: each CSI volume of
/// the group once per task that mounts it (where, read-only or not), with
/// the stats its node last reported; empty when the group has none.
fn volume_rows(alloc: &Value, plugins: &BTreeMap<String, String>) -> Vec<Vec<String>> {
    let volumes = csi_volumes(alloc);
    if volumes.is_empty() {
        return Vec::new();
    }
    let tasks: Vec<&Value> = group(alloc)
        .and_then(|g| g["tasks"].as_array())
        .into_iter()
        .flatten()
        .collect();
    let mut header: Vec<String> = [
        "Name",
        "Volume",
        "Plugin",
        "Task",
        "Destination",
        "Read Only",
    ]
    .map(String::from)
    .to_vec();
    header.extend(volume_stats::STATS_HEADER.map(String::from));
    let mut rows = vec![header];
    for (name, volume_id, group_read_only) in volumes {
        let plugin = plugins
            .get(&volume_id)
            .cloned()
            .unwrap_or_else(|| "-".to_string());
        let stats = volume_stats::stats_columns(alloc["csi_volume_stats"].get(&name));
        let mut mounts: Vec<(String, String, bool)> = tasks
            .iter()
            .flat_map(|t| {
                t["volume_mounts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|m| m["volume"] == name.as_str())
                    .map(|m| {
                        (
                            t["name"].as_str().unwrap_or_default().to_string(),
                            m["destination"].as_str().unwrap_or_default().to_string(),
                            m["read_only"].as_bool() == Some(true),
                        )
                    })
            })
            .collect();
        if mounts.is_empty() {
            mounts.push(("-".to_string(), "-".to_string(), false));
        }
        for (task, destination, read_only) in mounts {
            let mut row = vec![
                name.clone(),
                volume_id.clone(),
                plugin.clone(),
                task,
                destination,
                (group_read_only || read_only).to_string(),
            ];
            row.extend(stats.iter().cloned());
            rows.push(row);
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn alloc() -> Value {
        json!({
            "id": "aaaabbbbccccdddd", "name": "web.web[0]", "node_id": "0123456789abcdef",
            "job_id": "web", "task_group": "web", "index": 0,
            "job": {"version": 2, "task_groups": [{
                "name": "web",
                "volumes": {
                    "data": {"type": "csi", "source": "data", "read_only": false},
                    "logs": {"type": "csi", "source": "logs", "read_only": true, "per_alloc": true}
                },
                "tasks": [
                    {"name": "app", "resources": {"cpu": 50, "memory_mb": 32},
                     "volume_mounts": [{"volume": "data", "destination": "data", "read_only": false},
                                       {"volume": "logs", "destination": "local/logs"}]},
                    {"name": "side", "resources": {"cpu": 10, "memory_mb": 8},
                     "volume_mounts": [{"volume": "data", "destination": "shared", "read_only": true}]}
                ]
            }]},
            "client_status": "running", "client_description": "Tasks are running",
            "desired_status": "run", "desired_description": "",
            "create_time_ms": 40_000, "modify_time_ms": 90_000,
            "task_states": {
                "app": {"state": "running", "failed": false, "restarts": 1,
                        "started_at_ms": 1_764_592_801_000_i64,
                        "events": (0..12).map(|i| json!({
                            "type": if i == 0 { "Received" } else if i == 5 { "Restarting" } else { "Started" },
                            "message": format!("event {i}"),
                            "time_ms": 1_764_592_800_000_i64 + i * 1000
                        })).collect::<Vec<_>>()},
            },
            "csi_volume_stats": {"data": {"volume_id": "data", "plugin_id": "hostpath",
                "bytes_total": 1_048_576, "bytes_used": 524_288, "bytes_available": 524_288,
                "inodes_total": 100, "inodes_used": 3, "condition": {"abnormal": false}}}
        })
    }

    #[test]
    fn the_detail_shows_the_header_each_task_and_where_each_volume_is_mounted() {
        let plugins = BTreeMap::from([
            ("data".to_string(), "hostpath".to_string()),
            ("logs[0]".to_string(), "hostpath".to_string()),
        ]);
        let text = alloc_detail(&alloc(), Some("worker-1"), &plugins, false, 100_000);
        let want = "\
ID                  = aaaabbbb
Name                = web.web[0]
Node ID             = 01234567
Node Name           = worker-1
Job ID              = web
Job Version         = 2
Client Status       = running
Client Description  = Tasks are running
Desired Status      = run
Desired Description = <none>
Created             = 1m ago
Modified            = 10s ago

Task \"app\" is \"running\"
Task Resources
CPU     Memory
50 MHz  32 MiB

Restarts     = 1
Last Restart = 2025-12-01T12:40:05Z
Started At   = 2025-12-01T12:40:01Z
Finished At  = N/A

Recent Events
Time                  Type        Description
2025-12-01T12:40:11Z  Started     event 11
2025-12-01T12:40:10Z  Started     event 10
2025-12-01T12:40:09Z  Started     event 9
2025-12-01T12:40:08Z  Started     event 8
2025-12-01T12:40:07Z  Started     event 7
2025-12-01T12:40:06Z  Started     event 6
2025-12-01T12:40:05Z  Restarting  event 5
2025-12-01T12:40:04Z  Started     event 4
2025-12-01T12:40:03Z  Started     event 3
2025-12-01T12:40:02Z  Started     event 2

Task \"side\" is \"pending\"
Task Resources
CPU     Memory
10 MHz  8 MiB

Restarts     = 0
Last Restart = N/A
Started At   = N/A
Finished At  = N/A

CSI Volumes
Name  Volume   Plugin    Task  Destination  Read Only  Used / Total         Available  Inodes Used / Total  Condition
data  data     hostpath  app   data         false      512.0 KiB / 1.0 MiB  512.0 KiB  3 / 100              normal
data  data     hostpath  side  shared       true       512.0 KiB / 1.0 MiB  512.0 KiB  3 / 100              normal
logs  logs[0]  hostpath  app   local/logs   true       no stats reported yet
";
        assert_eq!(text, want, "{text}");
    }

    #[test]
    fn verbose_shows_full_ids_and_every_event() {
        let text = alloc_detail(&alloc(), None, &BTreeMap::new(), true, 100_000);
        assert!(
            text.contains("ID                  = aaaabbbbccccdddd\n"),
            "{text}"
        );
        assert!(
            text.contains("Node ID             = 0123456789abcdef\n"),
            "{text}"
        );
        assert!(text.contains("Node Name           = <unknown>\n"), "{text}");
        assert!(text.contains("Received    event 0"), "{text}");
        assert_eq!(text.matches("  event ").count(), 12, "{text}");
        assert!(
            text.contains("data  data     -       app"),
            "no plugin known: {text}"
        );
    }

    /// A group with the per-alloc volume `vol` mounted by no task and
    /// `logs`, with the stats `stats` reported.
    fn with_stats(stats: Value) -> Value {
        json!({
            "task_group": "g",
            "index": 2,
            "job": {"task_groups": [{"name": "g", "volumes": {
                "data": {"type": "csi", "source": "vol", "per_alloc": true},
                "logs": {"type": "csi", "source": "logs"},
            }}]},
            "csi_volume_stats": stats,
        })
    }

    #[test]
    fn the_volume_rows_show_figures_condition_and_errors() {
        let rows = volume_rows(
            &with_stats(json!({
                "data": {
                    "volume_id": "vol[2]", "plugin_id": "hostpath",
                    "bytes_total": 64u64 << 20, "bytes_used": 5u64 << 20,
                    "bytes_available": 59u64 << 20,
                    "inodes_total": 16384, "inodes_used": 12, "inodes_available": 16372,
                    "condition": {"abnormal": true, "message": "data dir is gone"},
                    "error": null, "collected_at_ms": 1,
                },
                "logs": {"volume_id": "logs", "plugin_id": "hostpath", "error": "deadline exceeded"},
            })),
            &BTreeMap::from([("vol[2]".to_string(), "hostpath".to_string())]),
        );
        assert_eq!(rows.len(), 3, "{rows:#?}");
        assert_eq!(rows[0][0], "Name");
        assert_eq!(
            rows[1],
            [
                "data",
                "vol[2]",
                "hostpath",
                "-",
                "-",
                "false",
                "5.0 MiB / 64.0 MiB",
                "59.0 MiB",
                "12 / 16384",
                "abnormal: data dir is gone"
            ]
        );
        assert_eq!(
            rows[2],
            [
                "logs",
                "logs",
                "-",
                "-",
                "-",
                "false",
                "stats unavailable: deadline exceeded"
            ]
        );
    }

    #[test]
    fn a_volume_without_stats_says_so_and_a_group_without_volumes_shows_nothing() {
        let rows = volume_rows(&with_stats(json!({})), &BTreeMap::new());
        assert_eq!(
            rows[1].last().map(String::as_str),
            Some("no stats reported yet")
        );
        assert!(volume_rows(&json!({"job": {"task_groups": []}}), &BTreeMap::new()).is_empty());
    }
}
