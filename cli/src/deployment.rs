//! `berth deployment list|status|fail|promote`: the rollouts of job
//! versions, and the "Latest Deployment" section of `job status`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::{enc, print_json, Ctx};
use crate::output::{format_time, joined, key_values, short_id, table, text};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum DeploymentCommand {
    /// List the deployments
    List(ListArgs),
    /// Show a deployment and its groups
    Status(StatusArgs),
    /// Fail a running deployment (a group with auto_revert reverts the job)
    Fail(FailArgs),
    /// Promote a deployment whose canaries are healthy: the roll goes on
    Promote(FailArgs),
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// Show full IDs
    #[arg(long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// Show full IDs
    #[arg(long)]
    pub verbose: bool,
    /// The deployment's ID, or a unique prefix of it
    #[arg(value_name = "DEPLOYMENT")]
    pub id: String,
}

#[derive(Args, Debug)]
pub struct FailArgs {
    /// The deployment's ID, or a unique prefix of it
    #[arg(value_name = "DEPLOYMENT")]
    pub id: String,
}

pub fn run(cmd: DeploymentCommand, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    match cmd {
        DeploymentCommand::List(a) => list(a, api),
        DeploymentCommand::Status(a) => status(a, api),
        DeploymentCommand::Fail(a) => fail(a, api),
        DeploymentCommand::Promote(a) => promote(a, api),
    }
}

fn list(a: ListArgs, api: &ApiClient) -> Result<i32> {
    let v = api.get("/v1/deployments")?;
    if a.json {
        return print_json(&v);
    }
    let mut all: Vec<&Value> = v.as_array().into_iter().flatten().collect();
    if all.is_empty() {
        println!("No deployments");
        return Ok(0);
    }
    all.sort_by_key(|d| std::cmp::Reverse(d["create_index"].as_u64().unwrap_or(0)));
    let mut rows = vec![["ID", "Job ID", "Job Version", "Status", "Description"]
        .map(String::from)
        .to_vec()];
    for d in all {
        let id = d["id"].as_str().unwrap_or("");
        rows.push(vec![
            if a.verbose { id } else { short_id(id) }.to_string(),
            text(&d["job_id"]),
            text(&d["job_version"]),
            text(&d["status"]),
            text(&d["status_description"]),
        ]);
    }
    print!("{}", joined(table(&rows)));
    Ok(0)
}

fn status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    let d = api.get(&format!("/v1/deployment/{}", enc(&a.id)))?;
    if a.json {
        return print_json(&d);
    }
    print!("{}", deployment_text(&d, a.verbose));
    Ok(0)
}

fn fail(a: FailArgs, api: &ApiClient) -> Result<i32> {
    let d = api.post(&format!("/v1/deployment/fail/{}", enc(&a.id)), &json!({}))?;
    println!(
        "==> Deployment {} of job {:?} version {} failed: {}",
        short_id(d["id"].as_str().unwrap_or("")),
        d["job_id"].as_str().unwrap_or(""),
        text(&d["job_version"]),
        text(&d["status_description"])
    );
    Ok(0)
}

fn promote(a: FailArgs, api: &ApiClient) -> Result<i32> {
    let d = api.post(
        &format!("/v1/deployment/promote/{}", enc(&a.id)),
        &json!({}),
    )?;
    println!(
        "==> Deployment {} of job {:?} version {} promoted: {}",
        short_id(d["id"].as_str().unwrap_or("")),
        d["job_id"].as_str().unwrap_or(""),
        text(&d["job_version"]),
        text(&d["status_description"])
    );
    Ok(0)
}

/// A deployment: its header and its groups.
pub fn deployment_text(d: &Value, verbose: bool) -> String {
    let id = d["id"].as_str().unwrap_or("");
    let mut out = joined(key_values(&[
        ("ID", if verbose { id } else { short_id(id) }.to_string()),
        ("Job ID", text(&d["job_id"])),
        ("Job Version", text(&d["job_version"])),
        ("Status", text(&d["status"])),
        ("Description", text(&d["status_description"])),
    ]));
    out.push_str("\nDeployed\n");
    out.push_str(&groups_table(d));
    out
}

/// The groups of a deployment: counts and deadlines.
fn groups_table(d: &Value) -> String {
    let groups = d["groups"].as_object();
    let canaries = groups
        .into_iter()
        .flatten()
        .any(|(_, g)| g["desired_canaries"].as_u64().unwrap_or(0) > 0);
    let mut header = vec!["Task Group", "Auto Revert"];
    if canaries {
        header.extend(["Promoted", "Desired Canaries"]);
    }
    header.extend([
        "Desired",
        "Placed",
        "Healthy",
        "Unhealthy",
        "Progress Deadline",
    ]);
    let mut rows = vec![header.into_iter().map(String::from).collect::<Vec<_>>()];
    for (name, g) in groups.into_iter().flatten() {
        let mut row = vec![name.clone(), text(&g["auto_revert"])];
        if canaries {
            row.push(text(&g["promoted"]));
            row.push(text(&g["desired_canaries"]));
        }
        let by = g["require_progress_by_ms"].as_i64().unwrap_or(0);
        row.extend([
            text(&g["desired_total"]),
            text(&g["placed_allocs"]),
            text(&g["healthy_allocs"]),
            text(&g["unhealthy_allocs"]),
            if by > 0 && d["status"] == "running" {
                format_time(by)
            } else {
                "-".into()
            },
        ]);
        rows.push(row);
    }
    joined(table(&rows))
}

/// `job status`'s section of the job's newest deployment (nothing when
/// it has none).
pub fn latest_section(d: &Value) -> String {
    if !d.is_object() {
        return String::new();
    }
    let mut out = String::from("\nLatest Deployment\n");
    out.push_str(&joined(key_values(&[
        ("ID", short_id(d["id"].as_str().unwrap_or("")).to_string()),
        ("Status", text(&d["status"])),
        ("Description", text(&d["status_description"])),
    ])));
    out.push_str("\nDeployed\n");
    out.push_str(&groups_table(d));
    out
}

/// Where the deployment of `job`'s version `version` stopped short of
/// its end, for `job run`, which follows it.
pub enum Halt {
    /// It failed: what to say of it.
    Failed(String),
    /// Its canaries are healthy and wait for `deployment promote`.
    NeedsPromotion(String),
}

/// Whether the deployment of `job`'s version `version` failed or waits
/// for a promotion.
pub fn halt_of_version(api: &ApiClient, job: &str, version: u64) -> Result<Option<Halt>> {
    let all = api.get(&format!("/v1/job/{}/deployments", enc(job)))?;
    let Some(d) = all
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["job_version"] == version)
    else {
        return Ok(None);
    };
    let id = short_id(d["id"].as_str().unwrap_or(""));
    let why = text(&d["status_description"]);
    Ok(match d["status"].as_str() {
        Some("failed") => Some(Halt::Failed(format!(
            "deployment {id} of version {version} failed: {why}"
        ))),
        Some("running") if why == berth_structs::deployment::DESC_NEEDS_PROMOTION => {
            Some(Halt::NeedsPromotion(format!(
                "the canaries of deployment {id} are healthy; `berth deployment promote {id}` \
                 rolls the rest"
            )))
        }
        _ => None,
    })
}
