//! `berth job status`: the jobs table, and one job with its summary,
//! placement failures, the allocs waiting for a reschedule or for the
//! claims of those they replace, and its allocs.

use std::collections::HashMap;

use anyhow::Result;
use berth_api::ApiClient;
use serde_json::{json, Value};

use super::{enc, n, node_name, node_names, now_ms, s, strs, table, StatusArgs};
use crate::output::{ago_at, short_id};

/// The allocs table: ID, node, group, version, desired, status, created,
/// modified.
pub(super) fn alloc_table(
    allocs: &[Value],
    names: &HashMap<String, String>,
    verbose: bool,
    now: i64,
) -> String {
    let mut rows = vec![[
        "ID",
        "Node",
        "Task Group",
        "Version",
        "Desired",
        "Status",
        "Created",
        "Modified",
    ]
    .map(String::from)
    .to_vec()];
    for al in allocs {
        let id = s(al, "id");
        let node = s(al, "node_id");
        let version = al
            .get("job_version")
            .or_else(|| al["job"].get("version"))
            .and_then(Value::as_u64)
            .unwrap_or_default();
        rows.push(vec![
            if verbose { id } else { short_id(id) }.to_string(),
            if verbose {
                node.to_string()
            } else {
                node_name(names, node).to_string()
            },
            s(al, "task_group").to_string(),
            version.to_string(),
            s(al, "desired_status").to_string(),
            s(al, "client_status").to_string(),
            ago_at(
                al.get("create_time_ms")
                    .and_then(Value::as_i64)
                    .unwrap_or_default(),
                now,
            ),
            ago_at(
                al.get("modify_time_ms")
                    .and_then(Value::as_i64)
                    .unwrap_or_default(),
                now,
            ),
        ]);
    }
    table(&rows)
}

/// A job with stubs of its allocs (by default those of its latest
/// version, newest first; with `all_allocs` every alloc the servers keep)
/// and its summary.
/// An alloc the servers stopped whose client has not finished it yet.
fn stopping(a: &Value) -> bool {
    a["desired_status"] != "run"
        && matches!(a["client_status"].as_str(), Some("pending" | "running"))
}

fn job_view(api: &ApiClient, job: &Value, all_allocs: bool) -> Result<Value> {
    let id = s(job, "id");
    let version = n(job, "version");
    let allocs = api.get(&format!("/v1/job/{}/allocations", enc(id)))?;
    let mut allocs: Vec<&Value> = allocs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| {
            all_allocs || a["job"]["version"].as_u64().unwrap_or(0) == version || stopping(a)
        })
        .collect();
    allocs.sort_by_key(|a| std::cmp::Reverse(n(a, "create_index")));
    let stubs: Vec<Value> = allocs
        .into_iter()
        .map(|a| {
            json!({
                "id": a["id"],
                "name": a["name"],
                "node_id": a["node_id"],
                "task_group": a["task_group"],
                "job_version": a["job"]["version"],
                "client_status": a["client_status"],
                "desired_status": a["desired_status"],
                "create_index": a["create_index"],
                "create_time_ms": a["create_time_ms"],
                "modify_time_ms": a["modify_time_ms"],
                "reschedule_attempts": a["reschedule_events"].as_array().map_or(0, Vec::len),
                "waiting_for_claims_of": a["waiting_for_claims_of"],
                "next_reschedule_ms": match crate::reschedule::next_reschedule(a) {
                    Some(crate::reschedule::Next::At(at)) => json!(at),
                    Some(crate::reschedule::Next::NoMore) => json!("none"),
                    None => Value::Null,
                },
            })
        })
        .collect();
    let mut v = job.clone();
    v["allocations"] = Value::Array(stubs);
    v["summary"] = api.get(&format!("/v1/job/{}/summary", enc(id)))?["groups"].clone();
    v["latest_deployment"] = api.get(&format!("/v1/job/{}/deployment", enc(id)))?;
    Ok(v)
}

pub(super) fn job_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    match &a.job {
        Some(id) => {
            let job = api.get(&format!("/v1/job/{}", enc(id)))?;
            let v = job_view(api, &job, a.all_allocs)?;
            let names = if a.output.json || a.output.template.is_some() {
                HashMap::new()
            } else {
                node_names(api)?
            };
            a.output.emit(&v, |v| {
                print!("{}", job_text(v, &names, a.all_allocs, a.verbose, now_ms()));
                Ok(())
            })
        }
        None => {
            let jobs = api.get("/v1/jobs")?;
            // The table shows the jobs' own fields; only -json and -t,
            // which give each job its allocs and summary, ask for those
            // (two requests a job).
            let v = if a.output.json || a.output.template.is_some() {
                let views = jobs
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|j| job_view(api, j, a.all_allocs))
                    .collect::<Result<Vec<_>>>()?;
                Value::Array(views)
            } else {
                jobs
            };
            a.output.emit(&v, |v| {
                print!("{}", jobs_text(v, now_ms()));
                Ok(())
            })
        }
    }
}

/// The jobs table: ID, type, priority, status, modified.
pub fn jobs_text(jobs: &Value, now: i64) -> String {
    let jobs = jobs.as_array().map(Vec::as_slice).unwrap_or(&[]);
    if jobs.is_empty() {
        return "No running jobs\n".into();
    }
    let mut rows = vec![["ID", "Type", "Priority", "Status", "Modified"]
        .map(String::from)
        .to_vec()];
    for j in jobs {
        rows.push(vec![
            s(j, "id").to_string(),
            s(j, "type").to_string(),
            n(j, "priority").to_string(),
            s(j, "status").to_string(),
            ago_at(
                j.get("modify_time_ms")
                    .and_then(Value::as_i64)
                    .unwrap_or_default(),
                now,
            ),
        ]);
    }
    table(&rows)
}

/// One job: its header, summary, placement failures and allocs.
pub fn job_text(
    v: &Value,
    names: &HashMap<String, String>,
    all_allocs: bool,
    verbose: bool,
    now: i64,
) -> String {
    let mut out = String::new();
    let datacenters = strs(&v["datacenters"]);
    let mut header = vec![
        ("ID", s(v, "id").to_string()),
        ("Name", s(v, "name").to_string()),
        ("Type", s(v, "type").to_string()),
        ("Priority", n(v, "priority").to_string()),
        ("Status", s(v, "status").to_string()),
        ("Version", n(v, "version").to_string()),
        (
            "Datacenters",
            if datacenters.is_empty() {
                "*".to_string()
            } else {
                datacenters.join(",")
            },
        ),
    ];
    if v["stop"].as_bool() == Some(true) {
        header.push(("Stopped", "true".into()));
    }
    if verbose {
        header.push(("Job Modify Index", n(v, "job_modify_index").to_string()));
        header.push(("Modify Index", n(v, "modify_index").to_string()));
        header.push(("Create Index", n(v, "create_index").to_string()));
        header.push((
            "Modified",
            ago_at(
                v.get("modify_time_ms")
                    .and_then(Value::as_i64)
                    .unwrap_or_default(),
                now,
            ),
        ));
    }
    let width = header.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, val) in &header {
        out.push_str(&format!("{k:<width$} = {val}\n"));
    }

    out.push_str("\nSummary\n");
    let mut rows = vec![[
        "Task Group",
        "Queued",
        "Starting",
        "Running",
        "Failed",
        "Complete",
        "Lost",
        "Unknown",
    ]
    .map(String::from)
    .to_vec()];
    for (group, c) in v["summary"].as_object().into_iter().flatten() {
        let mut row = vec![group.clone()];
        for k in [
            "queued", "starting", "running", "failed", "complete", "lost", "unknown",
        ] {
            row.push(n(c, k).to_string());
        }
        rows.push(row);
    }
    out.push_str(&table(&rows));

    let failures = strs(&v["placement_failures"]);
    if !failures.is_empty() {
        out.push_str("\nPlacement failures (the job waits until they clear)\n");
        for f in &failures {
            out.push_str(&format!("  {f}\n"));
        }
    }
    out.push_str(&crate::deployment::latest_section(&v["latest_deployment"]));
    out.push_str(&crate::reschedule::job_section(v, now));
    out.push_str(&crate::reschedule::waiting_section(v));
    let older = v["allocations"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|a| a["job_version"] != v["version"]);
    out.push_str(&format!(
        "\nAllocations{}\n",
        match (all_allocs, older) {
            (true, _) => " (all versions)",
            (false, true) => " (latest version and older ones stopping, newest first)",
            (false, false) => " (latest version, newest first)",
        }
    ));
    let allocs = v["allocations"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if allocs.is_empty() {
        out.push_str("No allocations placed\n");
    } else {
        out.push_str(&alloc_table(allocs, names, verbose, now));
    }
    out
}
