//! A job's kept versions (`job history`) and a revert to one of them
//! (`job revert`): a revert submits the old version's spec, a new
//! version that the allocs take as any change (in place, or replaced).

use berth_structs::api::JobRegisterResponse;
use berth_structs::Job;
use serde::Serialize;

use crate::error::ServerError;
use crate::server::Server;
use crate::state::job_versions::versions_of;
use crate::state::Tables;

use super::jobs::spec_index;
use super::plan::{diff_values, spec_value, FieldDiff};

/// One kept version of a job, and what it changed of the kept version
/// before it (nothing for the oldest kept).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobVersionView {
    pub version: u64,
    /// Unix milliseconds of its submission.
    pub submit_time_ms: i64,
    /// A deployment of the version succeeded.
    pub stable: bool,
    pub job: Job,
    pub diff: Vec<FieldDiff>,
}

impl Server {
    /// The kept versions of the job `id` (an ID or a unique ID prefix)
    /// names, newest first.
    pub fn job_versions(&self, id: &str) -> Result<Vec<JobVersionView>, ServerError> {
        self.store.read(|t| {
            let job = crate::server::job_in(t, id)?;
            let kept: Vec<_> = versions_of(t, &job.id).collect();
            let mut out: Vec<JobVersionView> = kept
                .iter()
                .enumerate()
                .map(|(i, v)| JobVersionView {
                    version: v.version,
                    submit_time_ms: v.submit_time_ms,
                    stable: v.stable,
                    job: v.job.clone(),
                    diff: match i.checked_sub(1).and_then(|p| kept.get(p)) {
                        Some(before) => diff_values(&spec_value(&before.job), &spec_value(&v.job)),
                        None => Vec::new(),
                    },
                })
                .collect();
            out.reverse();
            Ok(out)
        })
    }

    /// The spec version `version` of the job `id` names stored (a
    /// version not kept is an error naming those that are).
    pub fn job_version(&self, id: &str, version: u64) -> Result<Job, ServerError> {
        self.store
            .read(|t| kept_version(t, crate::server::job_in(t, id)?, version))
    }

    /// Submit version `version` of job `id` again, as a new version; with
    /// `enforce_prior`, only while the job's version is that one.
    pub async fn revert_job(
        &self,
        id: &str,
        version: u64,
        enforce_prior: Option<u64>,
    ) -> Result<JobRegisterResponse, ServerError> {
        let (spec, index) = self.store.read(|t| {
            let job = crate::server::job_in(t, id)?;
            if let Some(want) = enforce_prior {
                if job.version != want {
                    return Err(ServerError::Conflict(format!(
                        "job {:?} is at version {}, not {want}: it changed since",
                        job.id, job.version
                    )));
                }
            }
            Ok((kept_version(t, job, version)?, spec_index(Some(job))))
        })?;
        self.register_job_checked(spec, Some(index)).await
    }
}

/// The spec of `job` as its version `version` stored it, or an error
/// naming the versions kept.
fn kept_version(t: &Tables, job: &Job, version: u64) -> Result<Job, ServerError> {
    if let Some(v) = versions_of(t, &job.id).find(|v| v.version == version) {
        return Ok(v.job.clone());
    }
    let kept: Vec<String> = versions_of(t, &job.id)
        .map(|v| v.version.to_string())
        .collect();
    Err(ServerError::not_found(format!(
        "job {:?} has no version {version} kept (kept: {})",
        job.id,
        if kept.is_empty() {
            "none".to_string()
        } else {
            kept.join(", ")
        }
    )))
}
