//! Reading what the agent reports and records: string lists, task and
//! node events, a task's recorded pid, a plugin's stderr.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

/// The strings of a JSON array (empty for anything else).
pub fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// The pid of `task` of `alloc_id` as its executor recorded it under the
/// agent data dir `data_dir`.
pub fn recorded_task_pid(data_dir: &Path, alloc_id: &str, task: &str) -> Result<i32> {
    let path = data_dir
        .join("alloc")
        .join(alloc_id)
        .join(".executor")
        .join(task)
        .join("state.json");
    let v: Value = serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    let pid = v["task_pid"]
        .as_i64()
        .with_context(|| format!("no task_pid in {v}"))?;
    Ok(i32::try_from(pid)?)
}

/// The events of `task` in a full alloc status, oldest first, as
/// `(type, message, time_ms)`.
pub fn task_events(alloc: &Value, task: &str) -> Vec<(String, String, i64)> {
    alloc["task_states"][task]["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["type"].as_str().unwrap_or_default().to_string(),
                e["message"].as_str().unwrap_or_default().to_string(),
                e["time_ms"].as_i64().unwrap_or_default(),
            )
        })
        .collect()
}

/// The events of `subsystem` (such as "Storage") in a full node status.
pub fn node_events<'a>(node: &'a Value, subsystem: &str) -> Vec<&'a Value> {
    node["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["subsystem"] == subsystem)
        .collect()
}

/// What the plugin task of alloc `alloc_id` (task `plugin`, as in the
/// example plugin job) wrote to stderr so far, below agent data dir
/// `data_dir`; the plugin logs every mount and unmount there.
pub fn plugin_stderr(data_dir: &Path, alloc_id: &str) -> String {
    std::fs::read_to_string(
        data_dir
            .join("alloc")
            .join(alloc_id)
            .join("alloc/logs/plugin.stderr.0"),
    )
    .unwrap_or_default()
}
