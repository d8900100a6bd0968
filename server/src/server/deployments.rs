//! The deployment endpoints: the list, one deployment, a job's, an
//! operator's `deployment fail` (the job's evaluation then reverts it
//! when a group asks for `auto_revert`) and `deployment promote` (the
//! canaries, once healthy, let the rest of the roll go on).

use berth_structs::deployment::DESC_FAILED_BY_USER;
use berth_structs::{Deployment, DeploymentStatus};

use crate::error::ServerError;
use crate::prefix::{resolve, Kind};
use crate::server::page::{Page, Paged};
use crate::server::Server;
use crate::state::{Change, Tables};

const DEPLOYMENT: Kind = Kind {
    singular: "deployment",
    plural: "deployments",
};

/// The deployment `id` (an ID or a unique ID prefix) names.
fn deployment_in<'a>(t: &'a Tables, id: &str) -> Result<&'a Deployment, ServerError> {
    resolve(&t.deployments, id, DEPLOYMENT, |k, d: &Deployment| {
        format!("{k:?} (job {:?} version {})", d.job_id, d.job_version)
    })?
    .map(|(_, d)| d)
    .ok_or_else(|| ServerError::not_found(format!("deployment {id:?} not found")))
}

impl Server {
    /// A page of the deployments, by ID.
    pub fn deployments_page(&self, page: Page<'_>) -> Paged<Deployment> {
        self.store
            .read(|t| page.of(&t.deployments, Deployment::clone))
    }

    /// The deployment `id` (an ID or a unique ID prefix) names.
    pub fn deployment(&self, id: &str) -> Result<Deployment, ServerError> {
        self.store.read(|t| deployment_in(t, id).cloned())
    }

    /// The deployments of the job `id` names, newest first.
    pub fn job_deployments(&self, id: &str) -> Result<Vec<Deployment>, ServerError> {
        self.store.read(|t| {
            let job = crate::server::job_in(t, id)?;
            let mut all: Vec<Deployment> = t.deployments_of_job(&job.id).cloned().collect();
            all.reverse();
            Ok(all)
        })
    }

    /// `deployment fail`: a running deployment fails now; the job's
    /// evaluation that follows reverts the job when a group asks for
    /// `auto_revert`. Returns the deployment as it is then.
    pub async fn fail_deployment(&self, id: &str) -> Result<Deployment, ServerError> {
        let (job_id, _) = self
            .store
            .write_async(|t, changes| {
                let d = deployment_in(t, id)?;
                if !d.status.is_active() {
                    return Err(ServerError::Conflict(format!(
                        "deployment {:?} is {} ({}): only a running deployment can be failed",
                        d.id,
                        d.status.as_str(),
                        d.status_description
                    )));
                }
                let mut d = d.clone();
                d.status = DeploymentStatus::Failed;
                d.status_description = DESC_FAILED_BY_USER.into();
                let job_id = d.job_id.clone();
                changes.push(Change::PutDeployment(d));
                Ok::<_, ServerError>(job_id)
            })
            .await?;
        tracing::info!(job_id = %job_id, deployment = id, "deployment failed by an operator");
        self.evaluate_job(&job_id).await;
        self.deployment(id)
    }

    /// `deployment promote`: the groups that wait with healthy canaries
    /// go on with the roll (refused while a canary is not healthy yet).
    /// Returns the deployment as it is after the job's evaluation.
    pub async fn promote_deployment(&self, id: &str) -> Result<Deployment, ServerError> {
        let (job_id, _) = self
            .store
            .write_async(|t, changes| {
                let d = deployment_in(t, id)?;
                if !d.needs_promotion() {
                    return Err(ServerError::Conflict(format!(
                        "deployment {:?} ({}: {}) has no canaries waiting for promotion",
                        d.id,
                        d.status.as_str(),
                        d.status_description
                    )));
                }
                let waiting = crate::scheduler::canaries_healthy(d, &t.allocs);
                if let Some((group, _)) = waiting.iter().find(|(_, ok)| !ok) {
                    let g = &d.groups[group];
                    return Err(ServerError::Conflict(format!(
                    "deployment {:?}: group {group:?} has {} of {} canaries placed and not all \
                     healthy yet; promote once they are",
                    d.id,
                    g.placed_canaries.len(),
                    g.desired_canaries
                )));
                }
                let mut d = d.clone();
                for g in d.groups.values_mut() {
                    g.promoted = true;
                }
                d.status_description = "Deployment is running".into();
                let job_id = d.job_id.clone();
                changes.push(Change::PutDeployment(d));
                Ok::<_, ServerError>(job_id)
            })
            .await?;
        tracing::info!(job_id = %job_id, deployment = id, "deployment promoted");
        self.evaluate_job(&job_id).await;
        self.deployment(id)
    }
}
