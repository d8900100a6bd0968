//! `berth job history JOB` (the job's kept versions, with `-p` what each
//! changed) and `berth job revert JOB VERSION` (a kept version submitted
//! again, as a new version).

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use super::{enc, print_json};
use crate::output::format_time;
use berth_api::types::JobRegisterResponse;
use berth_api::ApiClient;

#[derive(Args, Debug)]
pub struct HistoryArgs {
    /// Show what each version changed of the one before
    #[arg(short = 'p')]
    pub diffs: bool,
    /// Only this version
    #[arg(long, value_name = "N")]
    pub version: Option<u64>,
    /// Print the API's answer as JSON
    #[arg(long)]
    pub json: bool,
    /// The job's ID, or a unique prefix of it
    #[arg(value_name = "JOB")]
    pub job: String,
}

#[derive(Args, Debug)]
pub struct RevertArgs {
    /// Revert only while the job is at this version
    #[arg(long, value_name = "N")]
    pub check_version: Option<u64>,
    /// The job's ID, or a unique prefix of it
    #[arg(value_name = "JOB")]
    pub job: String,
    /// The kept version to run again (`job history` lists them)
    #[arg(value_name = "VERSION")]
    pub version: u64,
}

/// The kept versions of `job`, newest first, as the API answers them.
pub(super) fn versions(api: &ApiClient, job: &str) -> Result<Vec<Value>> {
    let v = api.get(&format!("/v1/job/{}/versions", enc(job)))?;
    Ok(v.as_array().cloned().unwrap_or_default())
}

pub(super) fn job_history(a: HistoryArgs, api: &ApiClient) -> Result<i32> {
    let mut list = versions(api, &a.job)?;
    if let Some(n) = a.version {
        list.retain(|v| v["version"].as_u64() == Some(n));
        if list.is_empty() {
            anyhow::bail!("job {:?} has no version {n} kept", a.job);
        }
    }
    if a.json {
        return print_json(&Value::Array(list));
    }
    let mut out = String::new();
    for v in &list {
        out.push_str(&format!(
            "Version     = {}\nStable      = {}\nSubmit Date = {}\n",
            v["version"].as_u64().unwrap_or_default(),
            v["stable"].as_bool().unwrap_or(false),
            format_time(v["submit_time_ms"].as_i64().unwrap_or_default())
        ));
        let diff = v["diff"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        if a.diffs && !diff.is_empty() {
            out.push_str("Diff        =\n");
            for f in diff {
                out.push_str(&format!("  {}\n", super::plan::diff_line(f)));
            }
        }
        out.push('\n');
    }
    print!("{}", out.trim_end_matches('\n'));
    println!();
    Ok(0)
}

pub(super) fn job_revert(a: RevertArgs, api: &ApiClient) -> Result<i32> {
    let resp: JobRegisterResponse = api.post_as(
        &format!("/v1/job/{}/revert", enc(&a.job)),
        &json!({ "version": a.version, "enforce_prior_version": a.check_version }),
    )?;
    if resp.changed {
        println!(
            "==> Job {:?} reverted to the spec of version {}: now version {}, job modify index {}",
            a.job, a.version, resp.version, resp.job_modify_index
        );
    } else {
        println!(
            "==> Job {:?} already runs the spec of version {}: nothing changed",
            a.job, a.version
        );
    }
    for f in &resp.placement_failures {
        println!("    {f}");
    }
    Ok(0)
}
