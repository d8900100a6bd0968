//! The versions of each job the store keeps: each change of a job's spec
//! records the new version beside the job, and the oldest beyond
//! [`KEPT_VERSIONS`] go in the same write; a job's versions leave with
//! the job, and so do its deployments (of which as many are kept).

use berth_structs::{Job, JobStatus, JobVersion};

use super::{Change, Tables};

/// How many versions of a job are kept (Nomad keeps six).
pub const KEPT_VERSIONS: usize = 6;

/// The versions of job `job_id` kept in `t`, oldest first.
pub fn versions_of<'a>(t: &'a Tables, job_id: &'a str) -> impl Iterator<Item = &'a JobVersion> {
    let from = JobVersion::key_of(job_id, 0);
    t.job_versions
        .range(from..)
        .map(|(_, v)| v)
        .take_while(move |v| v.job_id == job_id)
}

/// Whether two submissions of a job are the same, ignoring fields the
/// servers manage.
pub fn same_spec(a: &Job, b: &Job) -> bool {
    let norm = |j: &Job| Job {
        stop: false,
        status: JobStatus::Pending,
        version: 0,
        create_index: 0,
        modify_index: 0,
        modify_time_ms: 0,
        job_modify_index: 0,
        purge: false,
        ..j.clone()
    };
    norm(a) == norm(b)
}

/// Records `job`, a new version of it, and drops the versions that fall
/// beyond [`KEPT_VERSIONS`] with it.
pub fn record_version(t: &Tables, job: &Job, changes: &mut Vec<Change>) {
    let older: Vec<String> = versions_of(t, &job.id)
        .filter(|v| v.version < job.version)
        .map(|v| JobVersion::key_of(&v.job_id, v.version))
        .collect();
    let drop = (older.len() + 1).saturating_sub(KEPT_VERSIONS);
    changes.extend(older.into_iter().take(drop).map(Change::DeleteJobVersion));
    changes.push(Change::PutJobVersion(JobVersion {
        job_id: job.id.clone(),
        version: job.version,
        job: job.clone(),
        ..JobVersion::default()
    }));
}

/// Deletes every kept version of job `job_id`, and its deployments (the
/// job leaves the state).
pub fn forget_versions(t: &Tables, job_id: &str, changes: &mut Vec<Change>) {
    changes.extend(
        versions_of(t, job_id)
            .map(|v| Change::DeleteJobVersion(JobVersion::key_of(&v.job_id, v.version))),
    );
    changes.extend(
        t.deployments_of_job(job_id)
            .map(|d| Change::DeleteDeployment(d.id.clone())),
    );
}

/// The oldest deployments of job `job_id` to delete when a new one is
/// opened, so that [`KEPT_VERSIONS`] are left with it.
pub fn old_deployments(t: &Tables, job_id: &str) -> Vec<String> {
    let all: Vec<&berth_structs::Deployment> = t.deployments_of_job(job_id).collect();
    let drop = (all.len() + 1).saturating_sub(KEPT_VERSIONS);
    all.into_iter().take(drop).map(|d| d.id.clone()).collect()
}
