//! An operator's actions on the tasks of an alloc this agent's client runs:
//! `POST /v1/client/allocation/{id}/restart` (`{"task": optional}`) and
//! `POST /v1/client/allocation/{id}/signal` (`{"signal": "SIGHUP", "task":
//! optional}`). Node-local routes: any agent reaches them through
//! [`super::client_forward`].

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use berth_allocrunner::{AllocRunner, TaskOpError};
use serde::Deserialize;
use serde_json::{json, Value};

use super::agent_api::AgentInfo;
use super::{ApiError, ApiJson, ApiPath};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RestartBody {
    #[serde(default)]
    task: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    signal: String,
    #[serde(default)]
    task: Option<String>,
}

impl From<TaskOpError> for ApiError {
    fn from(e: TaskOpError) -> Self {
        let status =
            StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        ApiError::new(status, e.to_string())
    }
}

/// The runner of alloc `id` (or unique prefix) on this agent's client.
pub(super) async fn runner_of(info: &AgentInfo, id: &str) -> Result<AllocRunner, ApiError> {
    let client = info.client_role.get().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "this agent does not run the client role",
        )
    })?;
    client.alloc_runner(id).await.map_err(|matches| {
        if matches.is_empty() {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("alloc {id:?} does not run on this client"),
            )
        } else {
            ApiError::bad_request(format!(
                "alloc ID prefix {id:?} matches more than one alloc: {}",
                matches.join(", ")
            ))
        }
    })
}

/// A task named in a body: an empty name is no name.
fn task_of(task: &Option<String>) -> Option<&str> {
    task.as_deref().filter(|t| !t.is_empty())
}

/// Restarts the task (or every running task) in place; answers the tasks
/// restarted.
pub async fn restart_alloc(
    State(info): State<Arc<AgentInfo>>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    // The body is optional: none restarts every running task.
    let body: RestartBody = if body.is_empty() {
        RestartBody::default()
    } else {
        super::check_json_content_type(&headers)?;
        super::decode_json(&body)?
    };
    let runner = runner_of(&info, &id).await?;
    let tasks = runner.restart_tasks(task_of(&body.task)).await?;
    Ok(Json(
        json!({ "alloc_id": runner.alloc_id(), "tasks": tasks }),
    ))
}

/// Sends a signal to the task (or every running task); answers the tasks
/// signaled.
pub async fn signal_alloc(
    State(info): State<Arc<AgentInfo>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<SignalBody>,
) -> Result<Json<Value>, ApiError> {
    let signal = berth_allocrunner::parse_signal(&body.signal)?;
    let runner = runner_of(&info, &id).await?;
    let tasks = runner.signal_tasks(task_of(&body.task), signal).await?;
    Ok(Json(json!({
        "alloc_id": runner.alloc_id(),
        "signal": signal.as_str(),
        "tasks": tasks,
    })))
}
