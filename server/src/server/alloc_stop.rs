//! `alloc stop`: an operator stops one alloc. The alloc is marked
//! desired-stop (its client stops it through the normal path, unmounting
//! its volumes and releasing their claims in order) and its job is
//! evaluated, which, as Nomad does, places a replacement for a service or
//! batch alloc (and a system alloc on its node) once the job still wants
//! it.

use crate::error::ServerError;
use crate::server::Server;
use crate::state::Change;

/// The desired description of an alloc an operator stopped.
pub const ALLOC_STOP_DESCRIPTION: &str = "alloc was stopped by an operator";

pub use berth_structs::api::AllocStopResponse;

impl Server {
    /// Stops alloc `id` (ID or unique prefix) and evaluates its job. An
    /// alloc the servers already want stopped, or whose client says it is
    /// done, is left as it is: nothing runs there to stop, and a finished
    /// batch alloc marked stopped would have its work run again.
    pub async fn stop_alloc(&self, id: &str) -> Result<AllocStopResponse, ServerError> {
        let alloc = self.allocation(id)?;
        let (stopped, _) = self
            .store
            .write_async(|t, changes| {
                let a = t.allocs.get(&alloc.id).ok_or_else(|| {
                    ServerError::not_found(format!("alloc {:?} not found", alloc.id))
                })?;
                if a.is_terminal() {
                    return Ok::<_, ServerError>(false);
                }
                let mut a = a.clone();
                a.desired_status = berth_structs::AllocDesiredStatus::Stop;
                a.desired_description = ALLOC_STOP_DESCRIPTION.to_string();
                changes.push(Change::PutAlloc(a));
                Ok(true)
            })
            .await?;
        if !stopped {
            tracing::info!(alloc_id = %alloc.id, "alloc stop: the alloc is already stopped or done");
            return Ok(AllocStopResponse {
                index: self.store.index(),
                alloc_id: alloc.id,
                replacement: None,
                already_stopped: true,
            });
        }
        let stop_index = self.store.index();
        tracing::info!(alloc_id = %alloc.id, job_id = %alloc.job_id, "alloc stopped by an operator");
        self.evaluate_job(&alloc.job_id).await;
        let replacement = self.store.read(|t| {
            t.allocs_of_job(&alloc.job_id)
                .filter(|a| {
                    a.create_index > stop_index
                        && a.task_group == alloc.task_group
                        && a.index == alloc.index
                        && !a.is_terminal()
                })
                .map(|a| a.id.clone())
                .next()
        });
        Ok(AllocStopResponse {
            index: self.store.index(),
            alloc_id: alloc.id,
            replacement,
            already_stopped: false,
        })
    }
}
