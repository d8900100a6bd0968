//! The typed calls of `berth-api` against a real dev agent: a Rust
//! program registers a job, reads it and its allocs back as the data
//! model's types, stops an alloc and the job, with the answers the CLI
//! reads as JSON decoded into `berth_api::types`.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_api::structs::{spec::parse_job, AllocDesiredStatus, JobStatus};
use berth_api::ApiClient;
use berth_tests::{sleeping_service_job, wait_for, DevAgent};

#[test]
fn a_rust_program_runs_reads_and_stops_a_job_through_the_typed_api() -> Result<()> {
    let agent = DevAgent::start()?;
    let api = ApiClient::new(&agent.http_addr)?;
    let job = parse_job(&sleeping_service_job("typed", 2, 1))?;

    let registered = api.register_job(&job, Some(0))?;
    assert!(registered.changed);
    assert_eq!(
        (registered.desired_allocs, registered.unplaced_allocs),
        (2, 0)
    );
    assert!(registered.placement_failures.is_empty());
    // enforce_index 0 registers only a new job: the second is refused,
    // with the API's error.
    let refused = api
        .register_job(&job, Some(0))
        .expect_err("enforce_index 0 of an existing job");
    let answer = refused.api().context("an API error")?;
    assert_eq!(answer.status, 409, "{refused}");
    let again = api.register_job(&job, Some(registered.job_modify_index))?;
    assert!(!again.changed, "the same spec again changes nothing");

    let running = wait_for("both allocs running", Duration::from_secs(30), || {
        let allocs = api.job_allocations("typed")?;
        Ok((allocs.len() == 2
            && allocs
                .iter()
                .all(|a| a.client_status == berth_api::structs::AllocClientStatus::Running))
        .then_some(allocs))
    })
    .with_context(|| agent.log())?;
    let view = api.job("typ")?;
    assert_eq!(view.job.id, "typed", "a unique prefix names the job");
    assert_eq!(view.job.status, JobStatus::Running);
    assert!(view.placement_failures.is_empty());
    assert!(api.jobs()?.iter().any(|j| j.job.id == "typed"));

    let first = &running[0];
    assert_eq!(api.allocation(&first.id[..8])?.id, first.id);
    let stopped = api.stop_allocation(&first.id)?;
    assert_eq!(stopped.alloc_id, first.id);
    assert!(!stopped.already_stopped);
    assert!(stopped.replacement.is_some(), "{stopped:?}");

    let index = api.stop_job("typed", false)?;
    assert!(index > stopped.index);
    let allocs = api.job_allocations("typed")?;
    assert!(
        allocs
            .iter()
            .all(|a| a.desired_status == AllocDesiredStatus::Stop),
        "{allocs:?}"
    );
    Ok(())
}
