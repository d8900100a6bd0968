//! The bodies of the HTTP API's job and alloc endpoints that are not a
//! stored object as it is: what a request sends and what an answer
//! holds. The agent's handlers and the servers produce them, and
//! `berth-api` decodes them, so the two sides share one definition.

use serde::{Deserialize, Serialize};

use crate::Job;

/// `PUT /v1/jobs`: register a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRegisterRequest {
    pub job: Job,
    /// Register only while the stored job's job modify index is
    /// `job_modify_index` (0: only a new job), Nomad's names.
    #[serde(default)]
    pub enforce_index: bool,
    #[serde(default)]
    pub job_modify_index: u64,
}

/// The body of `PUT /v1/job/{id}/plan`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobPlanRequest {
    pub job: Job,
}

/// The body of `POST /v1/job/{id}/scale`: the group's new count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobScaleRequest {
    pub count: u32,
    /// The group to scale; none: the job's only group.
    #[serde(default)]
    pub group: Option<String>,
}

/// The body of `POST /v1/job/{id}/revert`: the kept version to submit
/// again, and with `enforce_prior_version`, only while the job is at
/// that version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRevertRequest {
    pub version: u64,
    #[serde(default)]
    pub enforce_prior_version: Option<u64>,
}

/// The answer to a job registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRegisterResponse {
    /// The state index after the registration and its evaluation.
    pub index: u64,
    /// The job's modify index.
    pub job_modify_index: u64,
    /// The job's version (bumped on each change).
    pub version: u64,
    /// False when the job was already registered unchanged.
    pub changed: bool,
    /// Placements that could not be made (the job waits for them): one
    /// line per group and distinct reason, with how many allocs it holds
    /// back.
    pub placement_failures: Vec<String>,
    /// The allocs the job wants: the groups' counts (for a system job, one
    /// per ready node).
    pub desired_allocs: u64,
    /// How many of them could not be placed now.
    pub unplaced_allocs: u64,
}

/// A job as `GET /v1/job/{id}` and `GET /v1/jobs` answer it: the job,
/// with why any of its allocs could not be placed. The servers encode a
/// `JobView<&Job>`, without copying the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView<J = Job> {
    #[serde(flatten)]
    pub job: J,
    #[serde(default)]
    pub placement_failures: Vec<String>,
}

/// The answer to an alloc stop.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AllocStopResponse {
    /// The state index after the stop (and its evaluation).
    pub index: u64,
    /// The full ID of the stopped alloc.
    pub alloc_id: String,
    /// The alloc placed to replace it, when one was placed at once.
    pub replacement: Option<String>,
    /// The alloc was already stopped or done: nothing was written, and no
    /// replacement comes of this stop.
    pub already_stopped: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_view_is_the_job_with_its_failures_beside_its_fields() {
        let view = JobView {
            job: Job {
                id: "web".into(),
                ..Default::default()
            },
            placement_failures: vec!["g: no node fits".into()],
        };
        let json = serde_json::to_value(&view).expect("encodes");
        assert_eq!(json["id"], "web");
        assert_eq!(json["placement_failures"][0], "g: no node fits");
        let back: JobView = serde_json::from_value(json).expect("decodes");
        assert_eq!(back, view);
    }

    #[test]
    fn a_register_request_without_enforce_index_does_not_enforce() {
        let job = Job {
            id: "web".into(),
            ..Default::default()
        };
        let body = serde_json::json!({ "job": job });
        let r: JobRegisterRequest = serde_json::from_value(body).expect("decodes");
        assert!(!r.enforce_index);
        assert_eq!(r.job.id, "web");
    }
}
