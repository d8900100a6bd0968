//! `berth plugin status`: the CSI plugins of the cluster, or one plugin
//! with its capabilities, its controller and node instances and the allocs
//! that run it.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use super::output::{ago_cell, id_cell, key_values, print_lines, table, text, OutputArgs, Table};
use super::{enc, node, Ctx};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum PluginCommand {
    /// Show CSI plugins, or one plugin with its capabilities, instances
    /// and allocs
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// Also show each instance's alloc and capabilities, and each node
    /// instance's external node ID, volume limit and topology
    #[arg(long)]
    pub verbose: bool,
    /// The plugin's ID or a unique prefix of it (none: every plugin)
    #[arg(value_name = "PLUGIN")]
    pub plugin: Option<String>,
}

pub fn run(cmd: PluginCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        PluginCommand::Status(a) => plugin_status(a, ctx.api()),
    }
}

fn plugin_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    match &a.plugin {
        Some(id) => {
            let p = api.get(&format!("/v1/plugin/csi/{}", enc(id)))?;
            a.output.emit(&p, |p| {
                print_lines(plugin_detail(p, a.verbose));
                Ok(())
            })
        }
        None => {
            let list = api.get("/v1/plugins")?;
            a.output.emit(&list, |l| {
                if l.as_array().is_some_and(Vec::is_empty) {
                    println!("No CSI plugins");
                    return Ok(());
                }
                print_lines(plugin_list(l));
                Ok(())
            })
        }
    }
}

/// The rows of `plugin status` without a plugin: header first.
pub fn plugin_list(plugins: &Value) -> Vec<String> {
    let mut rows = Table::new([
        "ID",
        "Provider",
        "Controllers Healthy/Expected",
        "Nodes Healthy/Expected",
    ]);
    for p in plugins.as_array().into_iter().flatten() {
        rows.push(vec![
            text(&p["id"]),
            text(&p["provider"]),
            format!("{}/{}", p["controllers_healthy"], p["controllers_expected"]),
            format!("{}/{}", p["nodes_healthy"], p["nodes_expected"]),
        ]);
    }
    rows.lines()
}

/// What `plugin status PLUGIN` prints; `verbose` adds each instance's
/// alloc, capabilities, and (nodes) the provider's node ID, volume limit
/// and topology.
pub fn plugin_detail(p: &Value, verbose: bool) -> Vec<String> {
    let mut out = key_values(&[
        ("ID", text(&p["id"])),
        ("Provider", text(&p["provider"])),
        ("Version", text(&p["version"])),
        ("Controllers Healthy", text(&p["controllers_healthy"])),
        ("Controllers Expected", text(&p["controllers_expected"])),
        ("Nodes Healthy", text(&p["nodes_healthy"])),
        ("Nodes Expected", text(&p["nodes_expected"])),
        ("Volumes", text(&p["volume_count"])),
    ]);
    out.push(String::new());
    out.push("Capabilities".to_string());
    out.extend(table(&[
        vec![
            "Controller".to_string(),
            names(&p["controller_capabilities"]),
        ],
        vec!["Node".to_string(), names(&p["node_capabilities"])],
    ]));
    for (title, field, is_node) in [
        ("Controllers", "controllers", false),
        ("Nodes", "nodes", true),
    ] {
        out.push(String::new());
        out.push(title.to_string());
        let rows = instance_rows(p, field, is_node, verbose);
        if rows.is_empty() {
            out.push("None".to_string());
        } else {
            out.extend(rows);
        }
    }
    out.push(String::new());
    out.push("Allocations".to_string());
    let allocs = p["allocations"].as_array().cloned().unwrap_or_default();
    if allocs.is_empty() {
        out.push("No allocations placed".to_string());
        return out;
    }
    let mut rows = Table::new([
        "ID",
        "Node ID",
        "Node Name",
        "Job",
        "Task",
        "Status",
        "Created",
    ]);
    for a in &allocs {
        rows.push(vec![
            id_cell(&a["id"]),
            id_cell(&a["node_id"]),
            text(&a["node_name"]),
            text(&a["job_id"]),
            text(&a["task"]),
            text(&a["client_status"]),
            ago_cell(&a["create_time_ms"]),
        ]);
    }
    out.extend(rows.lines());
    out
}

/// `A, B, C`; `-` for none.
fn names(list: &Value) -> String {
    let names: Vec<&str> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if names.is_empty() {
        "-".to_string()
    } else {
        names.join(", ")
    }
}

/// The capabilities of one instance, in the server's terms.
fn instance_capabilities(info: &Value, is_node: bool) -> String {
    let flags: &[(&str, &str)] = if is_node {
        &[
            ("supports_stage_unstage", "StageUnstage"),
            ("supports_expand", "Expand"),
            ("supports_volume_stats", "VolumeStats"),
            ("supports_volume_condition", "VolumeCondition"),
        ]
    } else {
        &[
            ("requires_controller_publish", "ControllerPublish"),
            ("supports_create_delete", "CreateDelete"),
            ("supports_expand", "Expand"),
            ("supports_snapshots", "Snapshots"),
        ]
    };
    let names: Vec<&str> = flags
        .iter()
        .filter(|(k, _)| info[*k].as_bool() == Some(true))
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "-".to_string()
    } else {
        names.join(",")
    }
}

/// The instances of `field` (`controllers` or `nodes`): node, health,
/// description, when the health last changed.
fn instance_rows(p: &Value, field: &str, is_node: bool, verbose: bool) -> Vec<String> {
    let Some(instances) = p[field].as_object().filter(|m| !m.is_empty()) else {
        return Vec::new();
    };
    let mut header = vec!["Node ID", "Node Name", "Healthy", "Description", "Updated"];
    if verbose {
        header.extend(["Alloc ID", "Capabilities"]);
        if is_node {
            header.extend(["External Node ID", "Max Volumes", "Topology"]);
        }
    }
    let mut rows = Table::new(header);
    for (node_id, info) in instances {
        let node = &p["instance_nodes"][node_id];
        let mut row = vec![
            id_cell(&Value::from(node_id.as_str())),
            text(&node["name"]),
            text(&info["healthy"]),
            text(&info["health_description"]),
            ago_cell(&node["health_changed_ms"]),
        ];
        if verbose {
            row.push(id_cell(&info["alloc_id"]));
            row.push(instance_capabilities(info, is_node));
            if is_node {
                row.push(text(&info["external_node_id"]));
                row.push(match info["max_volumes"].as_u64() {
                    Some(0) | None => "unlimited".to_string(),
                    Some(n) => n.to_string(),
                });
                row.push(node::topology_text(&info["accessible_topology"]));
            }
        }
        rows.push(row);
    }
    rows.lines()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plugin() -> Value {
        json!({
            "id": "hostpath", "provider": "hp.example", "version": "1.0",
            "controllers_healthy": 0, "controllers_expected": 0,
            "nodes_healthy": 1, "nodes_expected": 2, "volume_count": 3,
            "controller_capabilities": [], "node_capabilities": ["StageUnstage", "VolumeStats"],
            "controllers": {},
            "nodes": {"node-1-long-id": {"alloc_id": "alloc-1-long-id", "healthy": true,
                "health_description": "healthy", "supports_stage_unstage": true,
                "external_node_id": "ext-n1", "max_volumes": 0,
                "accessible_topology": {"segments": {"zone": "a"}}}},
            "instance_nodes": {"node-1-long-id": {"name": "n1", "status": "ready",
                "health_changed_ms": 1}},
            "allocations": [{"id": "alloc-1-long-id", "node_id": "node-1-long-id",
                "node_name": "n1", "job_id": "hostpath-plugin", "task": "plugin",
                "client_status": "running", "create_time_ms": 1}],
        })
    }

    #[test]
    fn the_list_shows_healthy_of_expected() {
        let rows = plugin_list(&json!([plugin()]));
        assert_eq!(rows.len(), 2, "{rows:#?}");
        assert!(
            rows[1].contains("0/0") && rows[1].contains("1/2"),
            "{rows:#?}"
        );
    }

    #[test]
    fn the_detail_shows_capabilities_instances_and_allocs() {
        let lines = plugin_detail(&plugin(), false);
        let text = lines.join("\n");
        assert!(text.contains("Volumes              = 3"), "{text}");
        let caps: Vec<&String> = lines
            .iter()
            .skip_while(|l| *l != "Capabilities")
            .take(3)
            .collect();
        assert_eq!(caps[1], "Controller  -", "{text}");
        assert_eq!(caps[2], "Node        StageUnstage, VolumeStats", "{text}");
        assert!(text.contains("Controllers\nNone"), "{text}");
        let node = lines.iter().find(|l| l.starts_with("node-1-l")).unwrap();
        for want in ["n1", "true", "healthy", " ago"] {
            assert!(node.contains(want), "{want:?} in {node:?}");
        }
        assert!(!node.contains("ext-n1"), "{node:?}");
        let alloc = lines.iter().find(|l| l.starts_with("alloc-1-")).unwrap();
        assert!(alloc.contains("hostpath-plugin") && alloc.contains("running"));
    }

    #[test]
    fn verbose_shows_each_instance_in_full() {
        let lines = plugin_detail(&plugin(), true);
        let node = lines.iter().find(|l| l.starts_with("node-1-l")).unwrap();
        for want in [
            "alloc-1-",
            "StageUnstage",
            "ext-n1",
            "unlimited",
            "{zone=a}",
        ] {
            assert!(node.contains(want), "{want:?} in {node:?}");
        }
    }
}
