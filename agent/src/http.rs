//! The HTTP JSON API: a thin layer over the server role's Rust API. Each
//! handler decodes, calls the server, and maps errors to status codes in one
//! place ([`ApiError`]). Keys are snake_case; secrets are never returned.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, put};
use axum::{Json, Router};
use berth_server::{Server, ServerError};
use berth_structs::{CsiVolume, Job};
use serde::Deserialize;
use serde_json::{json, Value};

pub struct ApiError(ServerError);

impl From<ServerError> for ApiError {
    fn from(e: ServerError) -> Self {
        ApiError(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::warn!(error = %self.0, "API request failed");
        }
        (status, Json(json!({ "error": self.0.to_string() }))).into_response()
    }
}

type ApiResult = Result<Json<Value>, ApiError>;

fn to_json<T: serde::Serialize>(v: &T) -> ApiResult {
    serde_json::to_value(v)
        .map(Json)
        .map_err(|e| ApiError(ServerError::Internal(format!("encoding the answer: {e}"))))
}

/// The API view of a volume: the volume, without secrets, with the allocs
/// that hold its claims.
fn volume_view(v: &CsiVolume) -> Value {
    let mut clean = v.clone();
    clean.secrets.clear();
    let mut out = serde_json::to_value(&clean).unwrap_or(Value::Null);
    out["read_allocs"] = json!(v.read_claims.keys().collect::<Vec<_>>());
    out["write_allocs"] = json!(v.write_claims.keys().collect::<Vec<_>>());
    out
}

#[derive(Deserialize)]
struct JobRegister {
    job: Job,
}

#[derive(Deserialize)]
struct VolumeSubmit {
    volume: CsiVolume,
}

#[derive(Deserialize)]
struct ForceQuery {
    #[serde(default)]
    force: bool,
}

pub fn router(server: Arc<Server>) -> Router {
    Router::new()
        .route(
            "/v1/agent/health",
            get(|| async { Json(json!({"ok": true})) }),
        )
        .route("/v1/jobs", get(list_jobs).put(register_job))
        .route("/v1/job/{id}", get(get_job).delete(stop_job))
        .route("/v1/job/{id}/allocations", get(job_allocations))
        .route("/v1/allocations", get(list_allocations))
        .route("/v1/allocation/{id}", get(get_allocation))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/node/{id}", get(get_node))
        .route("/v1/volumes", get(list_volumes))
        .route(
            "/v1/volume/csi/{id}",
            get(get_volume)
                .put(register_volume)
                .delete(deregister_volume),
        )
        .route("/v1/volume/csi/{id}/create", put(create_volume))
        .route("/v1/volume/csi/{id}/delete", delete(delete_volume))
        .route("/v1/volume/csi/{id}/detach", delete(detach_volume))
        .route("/v1/plugins", get(list_plugins))
        .route("/v1/plugin/csi/{id}", get(get_plugin))
        .with_state(server)
}

/// The API view of a job: the job, with why any of its allocs could not be
/// placed.
fn job_view(s: &Server, job: &Job) -> Value {
    let mut out = serde_json::to_value(job).unwrap_or(Value::Null);
    out["placement_failures"] = json!(s.job_placement_failures(&job.id));
    out
}

async fn list_jobs(State(s): State<Arc<Server>>) -> ApiResult {
    Ok(Json(Value::Array(
        s.jobs().iter().map(|j| job_view(&s, j)).collect(),
    )))
}

async fn register_job(State(s): State<Arc<Server>>, Json(body): Json<JobRegister>) -> ApiResult {
    let resp = s.register_job(body.job).await?;
    to_json(&resp)
}

async fn get_job(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(job_view(&s, &s.job(&id)?)))
}

async fn stop_job(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    let resp = s.stop_job(&id).await?;
    to_json(&resp)
}

/// A blocking query: `?index=N` answers once the state's index passes N
/// (or after `wait`, default 5 minutes at most), like Nomad's.
#[derive(Deserialize)]
struct BlockingQuery {
    index: Option<u64>,
    wait: Option<String>,
}

/// The longest a blocking query waits.
const MAX_BLOCKING_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

impl BlockingQuery {
    async fn block(&self, s: &Server) -> Result<(), ApiError> {
        let Some(index) = self.index else {
            return Ok(());
        };
        let wait = match &self.wait {
            None => MAX_BLOCKING_WAIT,
            Some(w) => humantime::parse_duration(w)
                .map_err(|e| ApiError(ServerError::BadRequest(format!("wait={w:?}: {e}"))))?,
        };
        s.wait_for_index(index, wait.min(MAX_BLOCKING_WAIT)).await;
        Ok(())
    }
}

/// The answer with the state index it reflects, in `X-Berth-Index`.
fn indexed(s: &Server, body: Value) -> Response {
    let index = s.index();
    ([("x-berth-index", index.to_string())], Json(body)).into_response()
}

async fn job_allocations(
    State(s): State<Arc<Server>>,
    Path(id): Path<String>,
    Query(q): Query<BlockingQuery>,
) -> Result<Response, ApiError> {
    q.block(&s).await?;
    let allocs = s.job_allocations(&id)?;
    let body = serde_json::to_value(&allocs)
        .map_err(|e| ApiError(ServerError::Internal(format!("encoding the answer: {e}"))))?;
    Ok(indexed(&s, body))
}

async fn list_allocations(State(s): State<Arc<Server>>) -> ApiResult {
    to_json(&s.allocations())
}

async fn get_allocation(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    to_json(&s.allocation(&id)?)
}

async fn list_nodes(State(s): State<Arc<Server>>) -> ApiResult {
    to_json(&s.nodes())
}

async fn get_node(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    to_json(&s.node(&id)?)
}

async fn list_volumes(State(s): State<Arc<Server>>) -> ApiResult {
    Ok(Json(Value::Array(
        s.volumes().iter().map(volume_view).collect(),
    )))
}

async fn get_volume(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(volume_view(&s.volume(&id)?)))
}

fn check_volume_id(path_id: &str, vol: &CsiVolume) -> Result<(), ApiError> {
    if vol.id != path_id {
        return Err(ApiError(ServerError::BadRequest(format!(
            "volume ID in the path ({path_id:?}) differs from the one in the body ({:?})",
            vol.id
        ))));
    }
    Ok(())
}

async fn register_volume(
    State(s): State<Arc<Server>>,
    Path(id): Path<String>,
    Json(body): Json<VolumeSubmit>,
) -> ApiResult {
    check_volume_id(&id, &body.volume)?;
    let v = s.register_volume(body.volume).await?;
    Ok(Json(volume_view(&v)))
}

async fn create_volume(
    State(s): State<Arc<Server>>,
    Path(id): Path<String>,
    Json(body): Json<VolumeSubmit>,
) -> ApiResult {
    check_volume_id(&id, &body.volume)?;
    let v = s.create_volume(body.volume).await?;
    Ok(Json(volume_view(&v)))
}

async fn deregister_volume(
    State(s): State<Arc<Server>>,
    Path(id): Path<String>,
    Query(q): Query<ForceQuery>,
) -> ApiResult {
    s.deregister_volume(&id, q.force).await?;
    Ok(Json(json!({})))
}

async fn delete_volume(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    s.delete_volume(&id).await?;
    Ok(Json(json!({})))
}

#[derive(Deserialize)]
struct DetachQuery {
    node: String,
}

async fn detach_volume(
    State(s): State<Arc<Server>>,
    Path(id): Path<String>,
    Query(q): Query<DetachQuery>,
) -> ApiResult {
    s.detach_volume(&id, &q.node).await?;
    Ok(Json(json!({})))
}

async fn list_plugins(State(s): State<Arc<Server>>) -> ApiResult {
    to_json(&s.plugins())
}

async fn get_plugin(State(s): State<Arc<Server>>, Path(id): Path<String>) -> ApiResult {
    to_json(&s.plugin(&id)?)
}

/// Serves the API on `listener` until `shutdown` flips.
pub async fn serve(
    listener: tokio::net::TcpListener,
    server: Arc<Server>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(addr = ?addr, "HTTP API listening");
    axum::serve(listener, router(server))
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|v| *v).await;
        })
        .await
}
