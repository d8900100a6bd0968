//! The deployment routes: the list, one deployment, a job's,
//! `deployment fail` and `deployment promote`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use berth_server::Server;
use berth_structs::acl::Capability;
use serde_json::Value;

use super::query::{self, encode, indexed, BlockingQuery, ListQuery};
use super::routes::Routes;
use super::{ns, to_json, ApiError, ApiPath, ApiQuery, ApiResult};

/// The deployment routes, added to the server API's.
pub(super) fn deployment_routes(r: Routes<Arc<Server>>) -> Routes<Arc<Server>> {
    r.get("/v1/deployments", ns(Capability::ReadJob), list_deployments)
        .get(
            "/v1/deployment/{id}",
            ns(Capability::ReadJob),
            get_deployment,
        )
        .post(
            "/v1/deployment/fail/{id}",
            ns(Capability::SubmitJob),
            fail_deployment,
        )
        .post(
            "/v1/deployment/promote/{id}",
            ns(Capability::SubmitJob),
            promote_deployment,
        )
        .get(
            "/v1/job/{id}/deployments",
            ns(Capability::ReadJob),
            job_deployments,
        )
        .get(
            "/v1/job/{id}/deployment",
            ns(Capability::ReadJob),
            latest_deployment,
        )
}

async fn list_deployments(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::DEPLOYMENTS).await?;
    let (page, next) = s.deployments_page(q.table_page());
    Ok(indexed(index, encode(&page)?, next))
}

/// One deployment (by ID or unique ID prefix).
async fn get_deployment(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::DEPLOYMENTS).await?;
    Ok(indexed(index, encode(&s.deployment(&id)?)?, None))
}

/// A job's deployments, newest first.
async fn job_deployments(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::JOB_DEPLOYMENTS).await?;
    Ok(indexed(index, encode(&s.job_deployments(&id)?)?, None))
}

/// A job's newest deployment (`null` when it has none).
async fn latest_deployment(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::JOB_DEPLOYMENTS).await?;
    let latest = s.job_deployments(&id)?.into_iter().next();
    Ok(indexed(
        index,
        latest.map_or(Ok(Value::Null), |d| encode(&d))?,
        None,
    ))
}

/// `deployment fail`: the deployment as it is after the job's evaluation
/// (reverted, when a group asks for `auto_revert`).
async fn fail_deployment(State(s): State<Arc<Server>>, ApiPath(id): ApiPath<String>) -> ApiResult {
    to_json(&s.fail_deployment(&id).await?)
}

/// `deployment promote`: the deployment as it is after the job's
/// evaluation.
async fn promote_deployment(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult {
    to_json(&s.promote_deployment(&id).await?)
}
