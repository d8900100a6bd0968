//! `berth job scale JOB [GROUP] COUNT`: a group's new count. The running
//! allocs take it in place (same IDs, same tasks); the difference is
//! placed, or the allocs of the highest indexes are stopped.

use anyhow::Result;
use clap::Args;
use serde_json::json;

use super::{enc, usage_error};
use berth_api::types::JobRegisterResponse;
use berth_api::ApiClient;

#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// The job's ID, or a unique prefix of it
    #[arg(value_name = "JOB")]
    pub job: String,
    /// `[GROUP] COUNT`: the group (needed when the job has several) and
    /// its new count
    #[arg(value_name = "GROUP_AND_COUNT", num_args = 1..=2, required = true)]
    pub rest: Vec<String>,
}

pub(super) fn job_scale(a: ScaleArgs, api: &ApiClient) -> Result<i32> {
    let (group, count) = match a.rest.as_slice() {
        [count] => (None, count),
        [group, count] => (Some(group.clone()), count),
        _ => {
            return Err(usage_error(
                &["job", "scale"],
                "want JOB [GROUP] COUNT".to_string(),
            ))
        }
    };
    let count: u32 = count.parse().map_err(|_| {
        usage_error(
            &["job", "scale"],
            format!("COUNT {count:?} is not a whole number of allocs"),
        )
    })?;
    let resp: JobRegisterResponse = api.post_as(
        &format!("/v1/job/{}/scale", enc(&a.job)),
        &json!({ "count": count, "group": group }),
    )?;
    let what = group.map_or(String::new(), |g| format!(" group {g:?}"));
    if resp.changed {
        println!(
            "==> Job {:?}{what} scaled to {count}: version {}, job modify index {}",
            a.job, resp.version, resp.job_modify_index
        );
    } else {
        println!(
            "==> Job {:?}{what} has {count} already: nothing changed",
            a.job
        );
    }
    for f in &resp.placement_failures {
        println!("    {f}");
    }
    Ok(0)
}
