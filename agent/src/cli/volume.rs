//! `berth volume`: create, register, deregister, delete, detach and
//! status of CSI volumes; `volume snapshot` is in snapshot.rs.

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::http_client::ApiClient;
use super::{
    allocs_phrase, enc, node, print_json, print_release_warnings, read_spec, snapshot, strs,
    volume_stats, Ctx,
};

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
    /// Show CSI volumes (-verbose: each claim with its volume stats)
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
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// Show each claim with its volume stats
    #[arg(long)]
    pub verbose: bool,
    /// The volume's ID (none: every volume)
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
    let src = read_spec("volume file", &path)?;
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
    let mut v = match &a.volume {
        Some(id) => api.get(&format!("/v1/volume/csi/{}", enc(&id)))?,
        None => api.get("/v1/volumes")?,
    };
    // Each volume's own answer carries its claims joined with their allocs;
    // one without claims has none to join (no request for it).
    if let (true, Value::Array(list)) = (a.verbose, &mut v) {
        for vol in list.iter_mut() {
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
    }
    if a.json {
        return print_json(&v);
    }
    let vols = match &v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    println!(
        "{:<20} {:<14} {:<12} {:<8} {:<8}",
        "ID", "Plugin", "Schedulable", "Readers", "Writers"
    );
    for vol in &vols {
        println!(
            "{:<20} {:<14} {:<12} {:<8} {:<8}",
            vol["id"].as_str().unwrap_or_default(),
            vol["plugin_id"].as_str().unwrap_or_default(),
            vol["schedulable"].as_bool().unwrap_or_default(),
            vol["read_allocs"].as_array().map_or(0, Vec::len),
            vol["write_allocs"].as_array().map_or(0, Vec::len)
        );
    }
    if let [vol] = vols.as_slice() {
        let req = &vol["requested_topologies"];
        println!("\nTopology");
        for (what, list) in [
            ("Required", &req["required"]),
            ("Preferred", &req["preferred"]),
            ("Accessible", &vol["accessible_topology"]),
        ] {
            println!("  {what:<10} = {}", node::topologies_text(list));
        }
    }
    if a.verbose {
        for vol in &vols {
            let lines = volume_stats::volume_claim_lines(vol);
            println!(
                "\nClaims of {}{}",
                vol["id"].as_str().unwrap_or_default(),
                if lines.is_empty() { ": none" } else { "" }
            );
            for line in lines {
                println!("  {line}");
            }
        }
    }
    Ok(0)
}
