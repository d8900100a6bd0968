//! What `job stop` says while a stopping CSI plugin alloc waits for the
//! volumes mounted through it to be unmounted (a plugin is never stopped
//! under a mounted volume): which allocs on its node still hold volumes of
//! the plugin, kept current as they go.

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use berth_api::ApiClient;
use serde_json::Value;

use super::{enc, node_name, s, short_id};

/// The task event a plugin alloc records while it waits.
const WAITING_FOR_VOLUMES: &str = "Waiting for volumes";

/// The plugin IDs an alloc's group runs (its `csi_plugin` tasks).
fn plugin_ids(al: &Value) -> Vec<String> {
    let group = s(al, "task_group");
    al["job"]["task_groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|g| s(g, "name") == group)
        .flat_map(|g| g["tasks"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["csi_plugin"]["id"].as_str().map(str::to_string))
        .collect()
}

/// Whether the newest event of one of the alloc's tasks says it waits for
/// volumes.
fn waits_for_volumes(al: &Value) -> bool {
    al["task_states"]
        .as_object()
        .into_iter()
        .flatten()
        .any(|(_, st)| {
            st["events"]
                .as_array()
                .and_then(|e| e.last())
                .is_some_and(|e| s(e, "type") == WAITING_FOR_VOLUMES)
        })
}

/// The allocs on `al`'s node (but itself) holding claims of volumes of
/// its plugins, as `alloc 3f2a1b0c (readers.g[0])`.
fn volume_users(api: &ApiClient, al: &Value) -> Result<Vec<String>> {
    let plugins = plugin_ids(al);
    let node = api.get(&format!("/v1/node/{}", enc(s(al, "node_id"))))?;
    let mut users: Vec<String> = node["csi_volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| plugins.iter().any(|p| p == s(v, "plugin_id")))
        .map(|v| s(v, "alloc_id").to_string())
        .filter(|id| id != s(al, "id"))
        .collect();
    users.sort();
    users.dedup();
    Ok(users
        .iter()
        .map(|id| {
            let name = api
                .get(&format!("/v1/allocation/{}", enc(id)))
                .ok()
                .map(|a| s(&a, "name").to_string())
                .unwrap_or_default();
            format!("alloc {} ({name})", short_id(id))
        })
        .collect())
}

/// Prints, for each alloc of `allocs` that waits for volumes, what it
/// waits for, when that differs from what `shown` says was printed last.
pub(super) fn print_volume_waits(
    api: &ApiClient,
    allocs: &[Value],
    names: &HashMap<String, String>,
    shown: &mut BTreeMap<String, Vec<String>>,
) -> Result<()> {
    for al in allocs.iter().filter(|al| waits_for_volumes(al)) {
        if matches!(s(al, "client_status"), "complete" | "failed" | "lost") {
            continue;
        }
        let users = volume_users(api, al)?;
        if shown.get(s(al, "id")) == Some(&users) {
            continue;
        }
        let on = node_name(names, s(al, "node_id"));
        if users.is_empty() {
            println!(
                "    Alloc {} {} on {on}: its volumes are released; stopping",
                short_id(s(al, "id")),
                s(al, "name")
            );
        } else {
            println!(
                "    Alloc {} {} on {on} waits for {} volume user(s) to unmount: {}",
                short_id(s(al, "id")),
                s(al, "name"),
                users.len(),
                users.join(", ")
            );
        }
        shown.insert(s(al, "id").to_string(), users);
    }
    Ok(())
}
