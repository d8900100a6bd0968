//! `berth volume`: create, register, deregister, delete, detach and
//! status of CSI volumes; `volume snapshot` is in snapshot.rs.

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::output::{ago_cell, id_cell, key_values, print_lines, text, OutputArgs, Table};
use super::{
    allocs_phrase, enc, node, print_release_warnings, read_spec, snapshot, strs, volume_stats, Ctx,
};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create a CSI volume through its plugin (of one that exists: grow it)
    Create(FileArgs),
    /// Register an existing CSI volume
    Register(FileArgs),
    /// Forget a CSI volume
    Deregister(DeregisterArgs),
    /// Delete a CSI volume through its plugin
    Delete(VolumeArg),
    /// Release a volume's claims on a node
    Detach(DetachArgs),
    /// Show CSI volumes, or one volume with its claims (-verbose: its
    /// parameters, context, requested topology and each claim's volume stats)
    Status(StatusArgs),
    /// Create, list and delete snapshots of CSI volumes
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
}

#[derive(Args, Debug)]
pub struct FileArgs {
    /// The volume file (HCL)
    #[arg(value_name = "FILE")]
    pub file: String,
}

#[derive(Args, Debug)]
pub struct VolumeArg {
    /// The volume's ID
    #[arg(value_name = "VOLUME")]
    pub volume: String,
}

#[derive(Args, Debug)]
pub struct DeregisterArgs {
    /// Release the volume's claims first
    #[arg(long)]
    pub force: bool,
    /// The volume's ID
    #[arg(value_name = "VOLUME")]
    pub volume: String,
}

#[derive(Args, Debug)]
pub struct DetachArgs {
    /// The volume's ID
    #[arg(value_name = "VOLUME")]
    pub volume: String,
    /// The node's ID, ID prefix or name
    #[arg(value_name = "NODE")]
    pub node: String,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// Also show parameters, context, requested topology, the snapshot or
    /// clone source and each claim's volume stats
    #[arg(long)]
    pub verbose: bool,
    /// The volume's ID or a unique prefix of it (none: every volume)
    #[arg(value_name = "VOLUME")]
    pub volume: Option<String>,
}

pub fn run(cmd: VolumeCommand, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    match cmd {
        VolumeCommand::Create(a) => volume_submit(&a.file, true, api),
        VolumeCommand::Register(a) => volume_submit(&a.file, false, api),
        VolumeCommand::Deregister(a) => volume_deregister(a, api),
        VolumeCommand::Delete(a) => volume_delete(a, api),
        VolumeCommand::Detach(a) => volume_detach(a, api),
        VolumeCommand::Status(a) => volume_status(a, api),
        VolumeCommand::Snapshot(cmd) => snapshot::run(cmd, ctx),
    }
}

fn volume_submit(path: &str, create: bool, api: &ApiClient) -> Result<i32> {
    let src = read_spec("volume file", path)?;
    let vol = berth_structs::spec::parse_volume(&src).map_err(|e| anyhow!("{path}: {e}"))?;
    vol.validate(!create).map_err(|e| anyhow!("{path}: {e}"))?;
    let url = if create {
        format!("/v1/volume/csi/{}/create", enc(&vol.id))
    } else {
        format!("/v1/volume/csi/{}", enc(&vol.id))
    };
    // A create of a volume that exists grows it (or changes nothing).
    let before = if create {
        snapshot::existing_volume(api, &vol.id)?
    } else {
        None
    };
    let resp = api.put(&url, &json!({ "volume": vol }))?;
    if create {
        println!(
            "{}",
            snapshot::create_outcome(&vol.id, before.as_ref(), &resp)
        );
    } else {
        println!("Registered volume {:?}", vol.id);
    }
    Ok(0)
}

fn volume_deregister(a: DeregisterArgs, api: &ApiClient) -> Result<i32> {
    let id = a.volume;
    let resp = api.delete(&format!("/v1/volume/csi/{}?force={}", enc(&id), a.force))?;
    print_release_warnings(&resp);
    let released = strs(&resp["released"]);
    if released.is_empty() {
        println!("Deregistered volume {id:?}");
    } else {
        println!(
            "Deregistered volume {id:?} after releasing the claims of {} ({})",
            allocs_phrase(released.len()),
            released.join(", ")
        );
    }
    Ok(0)
}

fn volume_delete(a: VolumeArg, api: &ApiClient) -> Result<i32> {
    let id = a.volume;
    api.delete(&format!("/v1/volume/csi/{}/delete", enc(&id)))?;
    println!("Deleted volume {id:?}");
    Ok(0)
}

fn volume_detach(a: DetachArgs, api: &ApiClient) -> Result<i32> {
    let (volume, node) = (&a.volume, &a.node);
    let resp = api.delete(&format!(
        "/v1/volume/csi/{}/detach?node={}",
        enc(volume),
        enc(node)
    ))?;
    let released = strs(&resp["released"]);
    if released.is_empty() {
        println!("volume {volume:?} has no claims on node {node:?}; nothing to detach");
        return Ok(0);
    }
    print_release_warnings(&resp);
    println!(
        "Detached volume {volume:?} from node {node:?}: released the claims of {} ({})",
        allocs_phrase(released.len()),
        released.join(", ")
    );
    Ok(0)
}

fn volume_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    let Some(id) = &a.volume else {
        let mut list = api.get("/v1/volumes")?;
        if a.verbose {
            with_claims(&mut list, api)?;
        }
        return a.output.emit(&list, |v| {
            if v.as_array().is_some_and(Vec::is_empty) {
                println!("No CSI volumes");
                return Ok(());
            }
            print_lines(volume_list(v));
            if a.verbose {
                for vol in v.as_array().into_iter().flatten() {
                    println!("\nVolume Stats of {}", text(&vol["id"]));
                    print_lines(stats_lines(vol));
                }
            }
            Ok(())
        });
    };
    let vol = api.get(&format!("/v1/volume/csi/{}", enc(id)))?;
    a.output.emit(&vol, |v| {
        print_lines(volume_detail(v, a.verbose));
        Ok(())
    })
}

/// Gives each volume of the list its claims joined with their allocs (the
/// answer for the one volume has them); a volume without claims has none
/// to join, and costs no request.
fn with_claims(list: &mut Value, api: &ApiClient) -> Result<()> {
    for vol in list.as_array_mut().into_iter().flatten() {
        match vol["id"].as_str() {
            Some(id) if volume_stats::has_claims(vol) => {
                *vol = api.get(&format!("/v1/volume/csi/{}", enc(id)))?;
            }
            _ => {
                if let Some(o) = vol.as_object_mut() {
                    o.insert("claim_allocs".into(), json!([]));
                }
            }
        }
    }
    Ok(())
}

// ---- rendering of `volume status` ----

fn count(v: &Value) -> usize {
    v.as_array().map_or(0, Vec::len)
}

/// A size in bytes for people; `-` for none.
fn size(v: &Value) -> String {
    match v.as_u64() {
        Some(0) | None => "-".to_string(),
        Some(n) => berth_api::describe_size(n),
    }
}

/// The distinct values of `key` over the volume's claims (Nomad shows the
/// access and attachment mode in use); `<none>` while it has no claims.
fn claims_use(vol: &Value, key: &str) -> String {
    let mut seen: Vec<String> = Vec::new();
    for k in ["read_claims", "write_claims"] {
        for c in vol[k].as_object().into_iter().flat_map(|m| m.values()) {
            let m = text(&c[key]);
            if !seen.contains(&m) {
                seen.push(m);
            }
        }
    }
    if seen.is_empty() {
        "<none>".to_string()
    } else {
        seen.join(", ")
    }
}

/// `single-node-writer/file-system, ...`: what the volume allows.
fn capabilities_text(vol: &Value) -> String {
    let caps: Vec<String> = vol["capabilities"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            format!(
                "{}/{}",
                text(&c["access_mode"]),
                text(&c["attachment_mode"])
            )
        })
        .collect();
    if caps.is_empty() {
        "-".to_string()
    } else {
        caps.join(", ")
    }
}

/// `fs_type: ext4, flags: noatime,nodev`; `<none>` when neither is set.
fn mount_options_text(opts: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(fs) = opts["fs_type"].as_str().filter(|s| !s.is_empty()) {
        parts.push(format!("fs_type: {fs}"));
    }
    let flags: Vec<&str> = opts["mount_flags"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if !flags.is_empty() {
        parts.push(format!("flags: {}", flags.join(",")));
    }
    if parts.is_empty() {
        "<none>".to_string()
    } else {
        parts.join(", ")
    }
}

/// A map of strings as `key = value` lines; `<none>` for an empty one.
fn map_lines(map: &Value) -> Vec<String> {
    let rows: Vec<(&str, String)> = map
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.as_str(), text(v)))
        .collect();
    if rows.is_empty() {
        return vec!["<none>".to_string()];
    }
    key_values(&rows)
}

/// The rows of `volume status` without a volume: header first.
pub fn volume_list(volumes: &Value) -> Vec<String> {
    let mut rows = Table::new([
        "ID",
        "Name",
        "Plugin ID",
        "Schedulable",
        "Access Mode",
        "Claims (R/W)",
        "Capacity",
    ]);
    for v in volumes.as_array().into_iter().flatten() {
        rows.push(vec![
            text(&v["id"]),
            text(&v["name"]),
            text(&v["plugin_id"]),
            text(&v["schedulable"]),
            claims_use(v, "access_mode"),
            format!("{}/{}", count(&v["read_allocs"]), count(&v["write_allocs"])),
            size(&v["capacity"]),
        ]);
    }
    rows.lines()
}

/// What `volume status VOLUME` prints; `verbose` adds parameters, context,
/// the requested topology, the snapshot or clone source, indexes and each
/// claim's volume stats.
pub fn volume_detail(vol: &Value, verbose: bool) -> Vec<String> {
    let plugin = &vol["plugin"];
    let health = |k: &str| {
        if plugin.is_null() {
            "-".to_string()
        } else {
            text(&plugin[k])
        }
    };
    let provider = match vol["provider"].as_str().filter(|p| !p.is_empty()) {
        Some(p) => p.to_string(),
        None => health("provider"),
    };
    let mut capacity = size(&vol["capacity"]);
    let bounds: Vec<String> = [("min", "capacity_min"), ("max", "capacity_max")]
        .iter()
        .filter(|(_, k)| vol[*k].as_u64().is_some())
        .map(|(what, k)| format!("{what} {}", size(&vol[*k])))
        .collect();
    if !bounds.is_empty() {
        capacity = format!("{capacity} (requested {})", bounds.join(", "));
    }
    let mut out = key_values(&[
        ("ID", text(&vol["id"])),
        ("Name", text(&vol["name"])),
        ("External ID", text(&vol["external_id"])),
        ("Plugin ID", text(&vol["plugin_id"])),
        ("Provider", provider),
        ("Schedulable", text(&vol["schedulable"])),
        ("Controllers Healthy", health("controllers_healthy")),
        ("Controllers Expected", health("controllers_expected")),
        ("Nodes Healthy", health("nodes_healthy")),
        ("Nodes Expected", health("nodes_expected")),
        ("Access Mode", claims_use(vol, "access_mode")),
        ("Attachment Mode", claims_use(vol, "attachment_mode")),
        ("Capabilities", capabilities_text(vol)),
        ("Mount Options", mount_options_text(&vol["mount_options"])),
        ("Capacity", capacity),
        (
            "Topology",
            node::topologies_text(&vol["accessible_topology"]),
        ),
    ]);
    out.push(String::new());
    out.push("Allocations".to_string());
    let claims = claim_rows(vol);
    if claims.is_empty() {
        out.push("No allocations placed".to_string());
    } else {
        out.extend(claims);
    }
    if !verbose {
        return out;
    }
    for (title, map) in [
        ("Parameters", &vol["parameters"]),
        ("Context", &vol["context"]),
    ] {
        out.push(String::new());
        out.push(title.to_string());
        out.extend(map_lines(map));
    }
    let req = &vol["requested_topologies"];
    out.push(String::new());
    out.push("Requested Topology".to_string());
    out.extend(key_values(&[
        ("Required", node::topologies_text(&req["required"])),
        ("Preferred", node::topologies_text(&req["preferred"])),
    ]));
    out.push(String::new());
    out.push("Source".to_string());
    out.extend(key_values(&[
        ("Snapshot ID", text(&vol["snapshot_id"])),
        ("Clone ID", text(&vol["clone_id"])),
        ("Create Index", text(&vol["create_index"])),
        ("Modify Index", text(&vol["modify_index"])),
    ]));
    out.push(String::new());
    out.push("Volume Stats".to_string());
    out.extend(stats_lines(vol));
    out
}

/// Each claim of the volume with the stats its node reported.
fn stats_lines(vol: &Value) -> Vec<String> {
    let stats = volume_stats::volume_claim_lines(vol);
    if stats.is_empty() {
        vec!["No claims".to_string()]
    } else {
        stats
    }
}

/// The claims of the volume, newest alloc first (the API's order): alloc,
/// node, claim mode and state, alloc status, age.
fn claim_rows(vol: &Value) -> Vec<String> {
    let claims = vol["claim_allocs"].as_array().cloned().unwrap_or_default();
    if claims.is_empty() {
        return Vec::new();
    }
    let mut rows = Table::new([
        "ID",
        "Node ID",
        "Node Name",
        "Mode",
        "Claim State",
        "Alloc Status",
        "Created",
    ]);
    for c in &claims {
        rows.push(vec![
            id_cell(&c["alloc_id"]),
            id_cell(&c["node_id"]),
            text(&c["node_name"]),
            text(&c["mode"]),
            text(&c["state"]),
            text(&c["client_status"]),
            ago_cell(&c["create_time_ms"]),
        ]);
    }
    rows.lines()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> Value {
        json!({
            "id": "data", "name": "data", "external_id": "ext-1", "plugin_id": "hostpath",
            "provider": "", "schedulable": true, "capacity": 1u64 << 20,
            "capacity_min": 1u64 << 20, "capacity_max": 100u64 << 20,
            "capabilities": [{"access_mode": "single-node-writer", "attachment_mode": "file-system"}],
            "mount_options": {"fs_type": "ext4", "mount_flags": ["noatime", "nodev"]},
            "parameters": {"a": "b"}, "context": {},
            "requested_topologies": {"required": [{"segments": {"zone": "a"}}], "preferred": []},
            "accessible_topology": [{"segments": {"zone": "a"}}],
            "read_claims": {},
            "write_claims": {"alloc-1": {"access_mode": "single-node-writer", "attachment_mode": "file-system"}},
            "read_allocs": [], "write_allocs": ["alloc-1"],
            "plugin": {"provider": "hp.example", "controllers_healthy": 1, "controllers_expected": 1,
                       "nodes_healthy": 0, "nodes_expected": 1},
            "claim_allocs": [{"alloc_id": "0123456789abcdef", "node_id": "fedcba9876543210",
                              "node_name": "n1", "mode": "write", "state": "taken",
                              "client_status": "running", "create_time_ms": 1, "volume_stats": null}],
        })
    }

    fn value_of(lines: &[String], key: &str) -> Option<String> {
        lines.iter().find_map(|l| {
            let (k, v) = l.split_once(" = ")?;
            (k.trim() == key).then(|| v.to_string())
        })
    }

    #[test]
    fn the_list_sizes_its_columns_and_says_none_for_unclaimed_volumes() {
        let mut other = volume();
        other["id"] = json!("a-much-longer-volume-id");
        other["write_claims"] = json!({});
        other["write_allocs"] = json!([]);
        other["capacity"] = json!(0);
        let rows = volume_list(&json!([volume(), other]));
        assert_eq!(rows.len(), 3, "{rows:#?}");
        let at = rows[0].find("Name").unwrap();
        assert!(
            rows[1..].iter().all(|r| &r[at - 2..at] == "  "),
            "{rows:#?}"
        );
        assert!(rows[1].contains("single-node-writer") && rows[1].contains("0/1"));
        assert!(
            rows[2].contains("<none>") && rows[2].contains("0/0"),
            "{rows:#?}"
        );
        assert!(rows[2].ends_with(" -"), "no capacity: {rows:#?}");
    }

    #[test]
    fn the_detail_shows_the_plugin_modes_options_capacity_and_claims() {
        let lines = volume_detail(&volume(), false);
        assert_eq!(value_of(&lines, "Provider").as_deref(), Some("hp.example"));
        assert_eq!(value_of(&lines, "Nodes Healthy").as_deref(), Some("0"));
        assert_eq!(
            value_of(&lines, "Access Mode").as_deref(),
            Some("single-node-writer")
        );
        assert_eq!(
            value_of(&lines, "Mount Options").as_deref(),
            Some("fs_type: ext4, flags: noatime,nodev")
        );
        assert_eq!(
            value_of(&lines, "Capacity").as_deref(),
            Some("1 MiB (requested min 1 MiB, max 100 MiB)")
        );
        assert_eq!(value_of(&lines, "Topology").as_deref(), Some("{zone=a}"));
        let claim = lines.iter().find(|l| l.starts_with("01234567")).unwrap();
        for want in ["fedcba98", "n1", "write", "taken", "running", " ago"] {
            assert!(claim.contains(want), "{want:?} in {claim:?}");
        }
        assert!(!lines.iter().any(|l| l == "Parameters"), "{lines:#?}");
    }

    #[test]
    fn verbose_adds_parameters_context_requested_topology_and_stats() {
        let mut vol = volume();
        vol["plugin"] = Value::Null;
        vol["mount_options"] = json!({});
        let lines = volume_detail(&vol, true);
        assert_eq!(value_of(&lines, "Nodes Healthy").as_deref(), Some("-"));
        assert_eq!(value_of(&lines, "Mount Options").as_deref(), Some("<none>"));
        assert_eq!(value_of(&lines, "a").as_deref(), Some("b"));
        assert_eq!(value_of(&lines, "Required").as_deref(), Some("{zone=a}"));
        assert_eq!(value_of(&lines, "Preferred").as_deref(), Some("-"));
        for title in [
            "Parameters",
            "Context",
            "Requested Topology",
            "Source",
            "Volume Stats",
        ] {
            assert!(lines.iter().any(|l| l == title), "{title}: {lines:#?}");
        }
        assert!(lines.iter().any(|l| l.contains("no stats reported yet")));
    }
}
