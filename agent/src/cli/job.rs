//! `berth job run|stop|status`.

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::http_client::ApiClient;
use super::{enc, print_json, read_spec, strs, Ctx};

#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Submit a job and wait for its allocs to run (batch: to finish)
    Run(RunArgs),
    /// Stop a job
    Stop(StopArgs),
    /// Show jobs, or one job and its allocs (the latest version's, newest first)
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Return once the job is submitted; do not wait for its allocs
    #[arg(long)]
    pub detach: bool,
    /// The job file (HCL)
    #[arg(value_name = "FILE")]
    pub file: String,
}

#[derive(Args, Debug)]
pub struct StopArgs {
    /// The job's ID
    #[arg(value_name = "JOB")]
    pub job: String,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// Show the allocs of every version of the job, not only the latest
    #[arg(long)]
    pub all_allocs: bool,
    /// The job's ID (none: every job)
    #[arg(value_name = "JOB")]
    pub job: Option<String>,
}

pub fn run(cmd: JobCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        JobCommand::Run(a) => job_run(a, ctx.api()),
        JobCommand::Stop(a) => job_stop(a, ctx.api()),
        JobCommand::Status(a) => job_status(a, ctx.api()),
    }
}

fn job_run(a: RunArgs, api: &ApiClient) -> Result<i32> {
    let path = a.file;
    let src = read_spec("job file", &path)?;
    let job = berth_structs::spec::parse_job(&src).map_err(|e| anyhow!("{path}: {e}"))?;
    job.validate().map_err(|e| anyhow!("{path}: {e}"))?;
    let resp = api.put("/v1/jobs", &json!({ "job": job }))?;
    let index = resp.get("index").and_then(Value::as_u64).unwrap_or(0);
    println!("Job {:?} submitted (index {index})", job.id);
    let failures = strs(&resp["placement_failures"]);
    if !failures.is_empty() {
        println!("Placement failures (the job waits until they clear):");
        for f in &failures {
            println!("  {f}");
        }
    }
    let outcome = placement_outcome(&resp);
    if a.detach {
        if let Some(o) = &outcome {
            println!("{o}");
        }
        return Ok(0);
    }
    if resp.get("changed").and_then(Value::as_bool) == Some(false) && failures.is_empty() {
        println!("Job {:?} is unchanged: nothing new to place", job.id);
        return Ok(0);
    }
    let placed = monitor_job(api, &job.id, job.job_type, index, !failures.is_empty())?;
    if let Some(o) = &outcome {
        println!("{o}");
    }
    Ok(if failures.is_empty() { placed } else { 2 })
}

/// How many of the job's allocs were placed, when some were not.
fn placement_outcome(resp: &Value) -> Option<String> {
    let num = |k: &str| resp.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (desired, unplaced) = (num("desired_allocs"), num("unplaced_allocs"));
    if unplaced == 0 {
        return None;
    }
    let placed = desired.saturating_sub(unplaced);
    Some(if placed > 0 {
        format!(
            "{placed} of {desired} allocs placed; the job runs with them and waits for capacity for the rest"
        )
    } else {
        format!("0 of {desired} allocs placed; the job waits until they can be placed")
    })
}

/// Waits until the allocs placed for this submission run (service, system)
/// or finish (batch). Exit code 2 when any fails. With `blocked`, some
/// allocs could not be placed: it returns once the placed ones are done, or
/// at once when none were placed.
fn monitor_job(
    api: &ApiClient,
    job_id: &str,
    job_type: berth_structs::JobType,
    index: u64,
    blocked: bool,
) -> Result<i32> {
    let mut last_line = String::new();
    let mut seen_index = 0;
    loop {
        // A blocking query: answers as soon as anything changes.
        let (allocs, state_index) = api.get_indexed(&format!(
            "/v1/job/{}/allocations?index={seen_index}&wait=10s",
            enc(job_id)
        ))?;
        seen_index = state_index;
        let allocs: Vec<&Value> = allocs
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|x| x.get("create_index").and_then(Value::as_u64).unwrap_or(0) >= index)
                    .collect()
            })
            .unwrap_or_default();
        let status_of = |x: &Value| {
            x.get("client_status")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let count = |s: &str| allocs.iter().filter(|x| status_of(x) == s).count();
        let (pending, running, complete, failed, lost) = (
            count("pending"),
            count("running"),
            count("complete"),
            count("failed"),
            count("lost"),
        );
        let line = format!(
            "allocs: {} placed, {pending} pending, {running} running, {complete} complete, {failed} failed, {lost} lost",
            allocs.len()
        );
        if line != last_line {
            println!("{line}");
            last_line = line;
        }
        if allocs.is_empty() && blocked {
            return Ok(2);
        }
        if !allocs.is_empty() {
            if failed + lost > 0 && pending + running == 0 {
                println!("Job {job_id:?}: {failed} alloc(s) failed");
                return Ok(2);
            }
            let done = match job_type {
                berth_structs::JobType::Batch => pending + running == 0,
                _ => pending == 0,
            };
            if done {
                if failed + lost > 0 {
                    println!("Job {job_id:?}: {failed} alloc(s) failed");
                    return Ok(2);
                }
                if blocked {
                    let state = match job_type {
                        berth_structs::JobType::Batch => "done",
                        _ => "running",
                    };
                    println!("Job {job_id:?}: the allocs placed are {state}");
                    return Ok(2);
                }
                println!("Job {job_id:?}: done");
                return Ok(0);
            }
        }
    }
}

fn job_stop(a: StopArgs, api: &ApiClient) -> Result<i32> {
    let id = a.job;
    api.delete(&format!("/v1/job/{}", enc(&id)))?;
    println!("Job {id:?} stopped");
    Ok(0)
}

/// A job with stubs of its allocs: by default those of its latest version,
/// newest first; with `all_allocs`, every alloc the servers still keep.
fn job_view(api: &ApiClient, job: &Value, all_allocs: bool) -> Result<Value> {
    let id = job.get("id").and_then(Value::as_str).unwrap_or_default();
    let version = job.get("version").and_then(Value::as_u64).unwrap_or(0);
    let allocs = api.get(&format!("/v1/job/{}/allocations", enc(id)))?;
    let mut allocs: Vec<&Value> = allocs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| all_allocs || a["job"]["version"].as_u64().unwrap_or(0) == version)
        .collect();
    allocs.sort_by_key(|a| std::cmp::Reverse(a["create_index"].as_u64().unwrap_or(0)));
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
            })
        })
        .collect();
    let mut v = job.clone();
    v["allocations"] = Value::Array(stubs);
    Ok(v)
}

fn job_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    match a.job {
        Some(id) => {
            let job = api.get(&format!("/v1/job/{}", enc(&id)))?;
            let v = job_view(api, &job, a.all_allocs)?;
            if a.json {
                return print_json(&v);
            }
            println!("ID      = {}", v["id"].as_str().unwrap_or_default());
            println!("Type    = {}", v["type"].as_str().unwrap_or_default());
            println!("Status  = {}", v["status"].as_str().unwrap_or_default());
            println!("Version = {}", v["version"].as_u64().unwrap_or_default());
            let failures = strs(&v["placement_failures"]);
            if !failures.is_empty() {
                println!("\nPlacement failures (the job waits until they clear)");
                for f in &failures {
                    println!("  {f}");
                }
            }
            println!(
                "\nAllocations{}",
                if a.all_allocs {
                    " (all versions)"
                } else {
                    " (latest version, newest first)"
                }
            );
            println!(
                "{:<38} {:<38} {:<10} {:<10}",
                "ID", "Node ID", "Desired", "Status"
            );
            for al in v["allocations"].as_array().into_iter().flatten() {
                println!(
                    "{:<38} {:<38} {:<10} {:<10}",
                    al["id"].as_str().unwrap_or_default(),
                    al["node_id"].as_str().unwrap_or_default(),
                    al["desired_status"].as_str().unwrap_or_default(),
                    al["client_status"].as_str().unwrap_or_default()
                );
            }
            Ok(0)
        }
        None => {
            let jobs = api.get("/v1/jobs")?;
            let views = jobs
                .as_array()
                .into_iter()
                .flatten()
                .map(|j| job_view(api, j, a.all_allocs))
                .collect::<Result<Vec<_>>>()?;
            if a.json {
                return print_json(&Value::Array(views));
            }
            println!("{:<30} {:<8} {:<8}", "ID", "Type", "Status");
            for j in &views {
                println!(
                    "{:<30} {:<8} {:<8}",
                    j["id"].as_str().unwrap_or_default(),
                    j["type"].as_str().unwrap_or_default(),
                    j["status"].as_str().unwrap_or_default()
                );
            }
            Ok(0)
        }
    }
}
