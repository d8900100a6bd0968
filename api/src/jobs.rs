//! Typed calls of the job and alloc endpoints: what `berth job run`,
//! `job status`, `job stop` and `alloc stop` send and read, for any Rust
//! program.
//!
//! ```no_run
//! # fn main() -> berth_api::Result<()> {
//! use berth_api::ApiClient;
//! use berth_api::structs::Job;
//!
//! let api = ApiClient::new("http://127.0.0.1:4747")?;
//! let job = Job { id: "web".into(), name: "web".into(), ..Default::default() };
//! let registered = api.register_job(&job, None)?;
//! println!("version {}, {} unplaced", registered.version, registered.unplaced_allocs);
//! for alloc in api.job_allocations("web")? {
//!     println!("{} {:?}", alloc.id, alloc.client_status);
//! }
//! # Ok(()) }
//! ```

use berth_structs::api::{
    AllocStopResponse, JobPlanRequest, JobRegisterRequest, JobRegisterResponse, JobView,
};
use berth_structs::{Allocation, Job};
use serde_json::Value;

use crate::client::ApiClient;
use crate::Result;

/// Percent-encodes an ID for a URL path segment or query value.
pub fn path_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl ApiClient {
    /// `PUT /v1/jobs`: registers `job`; with `enforce_index`, only while
    /// the stored job's job modify index is that (0: only a new job).
    pub fn register_job(
        &self,
        job: &Job,
        enforce_index: Option<u64>,
    ) -> Result<JobRegisterResponse> {
        let body = JobRegisterRequest {
            job: job.clone(),
            enforce_index: enforce_index.is_some(),
            job_modify_index: enforce_index.unwrap_or(0),
        };
        self.put_as("/v1/jobs", &body)
    }

    /// `PUT /v1/job/{id}/plan`: what registering `job` would change, as
    /// the API answers it.
    pub fn plan_job(&self, job: &Job) -> Result<Value> {
        let path = format!("/v1/job/{}/plan", path_segment(&job.id));
        self.put_as(&path, &JobPlanRequest { job: job.clone() })
    }

    /// `GET /v1/job/{id}`: a job by ID or unique ID prefix.
    pub fn job(&self, id: &str) -> Result<JobView> {
        self.get_as(&format!("/v1/job/{}", path_segment(id)))
    }

    /// `GET /v1/jobs`: the first page of jobs.
    pub fn jobs(&self) -> Result<Vec<JobView>> {
        self.get_as("/v1/jobs")
    }

    /// `GET /v1/job/{id}/allocations`: the first page of a job's allocs.
    pub fn job_allocations(&self, id: &str) -> Result<Vec<Allocation>> {
        self.get_as(&format!("/v1/job/{}/allocations", path_segment(id)))
    }

    /// `DELETE /v1/job/{id}`: stops a job (and with `purge`, removes it
    /// once its allocs are done). Answers the state index of the stop.
    pub fn stop_job(&self, id: &str, purge: bool) -> Result<u64> {
        let mut path = format!("/v1/job/{}", path_segment(id));
        if purge {
            path.push_str("?purge=true");
        }
        let index = self.delete(&path)?;
        crate::client::decode(&path, index)
    }

    /// `GET /v1/allocation/{id}`: an alloc by ID or unique ID prefix.
    pub fn allocation(&self, id: &str) -> Result<Allocation> {
        self.get_as(&format!("/v1/allocation/{}", path_segment(id)))
    }

    /// `POST /v1/allocation/{id}/stop`: stops an alloc; its job places a
    /// replacement.
    pub fn stop_allocation(&self, id: &str) -> Result<AllocStopResponse> {
        let path = format!("/v1/allocation/{}/stop", path_segment(id));
        self.post_as(&path, &serde_json::json!({}))
    }
}

#[cfg(test)]
mod tests {
    use super::path_segment;

    #[test]
    fn a_path_segment_keeps_unreserved_bytes_and_encodes_the_rest() {
        assert_eq!(path_segment("web-1.a_b~"), "web-1.a_b~");
        assert_eq!(path_segment("data[0]"), "data%5B0%5D");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }
}
