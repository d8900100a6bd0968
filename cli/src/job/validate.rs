//! `berth job validate [-var K=V] FILE`: the job file parsed and checked
//! as `job run` would, on this machine, without a server.

use anyhow::Result;
use clap::Args;

use super::load_job;

#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// Set a variable the job file declares (repeatable)
    #[arg(long = "var", value_name = "NAME=VALUE")]
    pub vars: Vec<String>,
    /// The job file (HCL)
    #[arg(value_name = "FILE")]
    pub file: String,
}

pub(super) fn job_validate(a: ValidateArgs) -> Result<i32> {
    let job = load_job("validate", &a.file, &a.vars)?;
    let groups = job.task_groups.len();
    let tasks: usize = job.task_groups.iter().map(|g| g.tasks.len()).sum();
    println!(
        "Job validation successful: job {:?}, {groups} group{}, {tasks} task{}",
        job.id,
        if groups == 1 { "" } else { "s" },
        if tasks == 1 { "" } else { "s" }
    );
    Ok(0)
}
