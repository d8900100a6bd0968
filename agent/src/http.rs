//! The HTTP JSON API: a thin layer over the server role's Rust API. Each
//! handler decodes, calls the server, and maps errors to status codes in one
//! place ([`ApiError`]). Keys are snake_case; secrets are never returned.
//!
//! Every error has one shape, `{"error": "<message>"}` with
//! `content-type: application/json`: handler errors through [`ApiError`],
//! bad request bodies, paths and query strings through the extractors
//! [`ApiJson`], [`ApiPath`] and [`ApiQuery`] (whose rejections are
//! [`ApiError`]s), unknown paths through the fallback, and whatever axum
//! itself answers (a wrong method, say) through the [`one_error_shape`]
//! layer, so that no route can answer another shape.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::response::Response;
use axum::{Json, Router};
use berth_server::{Server, SnapshotRequest};
use berth_structs::acl::{Capability, Level, Need};
use berth_structs::api::{JobPlanRequest, JobRegisterRequest, JobView};
use berth_structs::{CsiPlugin, CsiVolume, Job};
use serde::Deserialize;
use serde_json::{json, Value};

use query::{encode, indexed, BlockingQuery, ListQuery};
use routes::Routes;

pub use berth_api::{describe_size, MAX_REQUEST_BODY};
pub use errors::*;

type ApiResult = Result<Json<Value>, ApiError>;

fn to_json<T: serde::Serialize>(v: &T) -> ApiResult {
    serde_json::to_value(v)
        .map(Json)
        .map_err(|e| ApiError::internal(format!("encoding the answer: {e}")))
}

/// The API view of a volume: the volume, without secrets, with the allocs
/// that hold its claims and the health of its plugin (`null` when no node
/// runs the plugin).
fn volume_view(v: &CsiVolume, plugin: Option<&CsiPlugin>) -> Value {
    let mut clean = v.clone();
    clean.secrets.clear();
    let mut out = serde_json::to_value(&clean).unwrap_or(Value::Null);
    out["read_allocs"] = json!(v.read_claims.keys().collect::<Vec<_>>());
    out["write_allocs"] = json!(v.write_claims.keys().collect::<Vec<_>>());
    out["plugin"] = plugin.map_or(Value::Null, |p| {
        json!({
            "provider": p.provider,
            "version": p.version,
            "controller_required": p.controller_required,
            "controllers_healthy": p.controllers_healthy,
            "controllers_expected": p.controllers_expected,
            "nodes_healthy": p.nodes_healthy,
            "nodes_expected": p.nodes_expected,
        })
    });
    out
}

/// [`volume_view`] of a volume just written, with its plugin's health.
fn written_volume_view(s: &Server, v: &CsiVolume) -> Value {
    volume_view(v, s.plugin(&v.plugin_id).ok().as_ref())
}

#[derive(Deserialize)]
struct PurgeQuery {
    #[serde(default)]
    purge: bool,
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

/// What a route of the default namespace needs.
const fn ns(c: Capability) -> Need {
    Need::Namespace(c)
}

/// The server API's routes: answered by an agent's server role, forwarded
/// to a server by a client-only agent.
pub fn server_routes() -> Routes<Arc<Server>> {
    Routes::new()
        .get("/v1/agent/health", Need::Public, || async {
            Json(json!({"ok": true}))
        })
        .get(
            "/v1/status/leader",
            Need::Public,
            leader_gate::status_leader,
        )
        .get(
            "/v1/status/peers",
            Need::Operator(Level::Read),
            leader_gate::status_peers,
        )
        .get(
            "/v1/operator/servers",
            Need::Operator(Level::Read),
            leader_gate::servers,
        )
        .get(
            "/v1/operator/store",
            Need::Operator(Level::Read),
            leader_gate::store_health,
        )
        .get("/v1/jobs", ns(Capability::ListJobs), list_jobs)
        .put("/v1/jobs", ns(Capability::SubmitJob), register_job)
        .get("/v1/job/{id}", ns(Capability::ReadJob), get_job)
        .delete("/v1/job/{id}", ns(Capability::SubmitJob), stop_job)
        .get(
            "/v1/job/{id}/allocations",
            ns(Capability::ReadJob),
            job_allocations,
        )
        .put("/v1/job/{id}/plan", ns(Capability::SubmitJob), plan_job)
        .post("/v1/job/{id}/scale", ns(Capability::SubmitJob), scale_job)
        .get(
            "/v1/job/{id}/versions",
            ns(Capability::ReadJob),
            job_versions,
        )
        .post("/v1/job/{id}/revert", ns(Capability::SubmitJob), revert_job)
        .get("/v1/job/{id}/summary", ns(Capability::ReadJob), job_summary)
        .with(deployments::deployment_routes)
        .get("/v1/allocations", ns(Capability::ReadJob), list_allocations)
        .get(
            "/v1/allocation/{id}",
            ns(Capability::ReadJob),
            get_allocation,
        )
        .post(
            "/v1/allocation/{id}/stop",
            ns(Capability::AllocLifecycle),
            stop_allocation,
        )
        .get("/v1/nodes", Need::Node(Level::Read), list_nodes)
        .get("/v1/node/{id}", Need::Node(Level::Read), get_node)
        .get(
            "/v1/node/{id}/allocations",
            Need::Node(Level::Read),
            node_allocations,
        )
        .post("/v1/node/{id}/drain", Need::Node(Level::Write), drain_node)
        .post(
            "/v1/node/{id}/eligibility",
            Need::Node(Level::Write),
            node_eligibility,
        )
        .put("/v1/node/{id}/purge", Need::Node(Level::Write), purge_node)
        .get("/v1/volumes", ns(Capability::CsiReadVolume), list_volumes)
        .get(
            "/v1/volume/csi/{id}",
            ns(Capability::CsiReadVolume),
            get_volume,
        )
        .put(
            "/v1/volume/csi/{id}",
            ns(Capability::CsiWriteVolume),
            register_volume,
        )
        .delete(
            "/v1/volume/csi/{id}",
            ns(Capability::CsiWriteVolume),
            deregister_volume,
        )
        .put(
            "/v1/volume/csi/{id}/create",
            ns(Capability::CsiWriteVolume),
            create_volume,
        )
        .delete(
            "/v1/volume/csi/{id}/delete",
            ns(Capability::CsiWriteVolume),
            delete_volume,
        )
        .delete(
            "/v1/volume/csi/{id}/detach",
            ns(Capability::CsiWriteVolume),
            detach_volume,
        )
        .get(
            "/v1/volumes/snapshot",
            ns(Capability::CsiReadVolume),
            list_snapshots,
        )
        .put(
            "/v1/volumes/snapshot",
            ns(Capability::CsiWriteVolume),
            create_snapshot,
        )
        .delete(
            "/v1/volumes/snapshot",
            ns(Capability::CsiWriteVolume),
            delete_snapshot,
        )
        .get("/v1/plugins", Need::Plugin(Level::Read), list_plugins)
        .get("/v1/plugin/csi/{id}", Need::Plugin(Level::Read), get_plugin)
        .put("/v1/system/gc", Need::Management, system_gc)
        .put(
            "/v1/operator/keyring/rotate",
            Need::Operator(Level::Write),
            rotate_keyring,
        )
        .put(
            "/v1/node/intro",
            Need::Node(Level::Write),
            acl_api::create_intro,
        )
        .get(
            "/v1/node/intros",
            Need::Node(Level::Write),
            acl_api::list_intros,
        )
        .delete(
            "/v1/node/intro/{accessor}",
            Need::Node(Level::Write),
            acl_api::revoke_intro,
        )
        .post("/v1/acl/bootstrap", Need::Public, acl_api::bootstrap)
        .get("/v1/acl/policies", Need::Management, acl_api::list_policies)
        .get(
            "/v1/acl/policy/{name}",
            Need::Management,
            acl_api::get_policy,
        )
        .put(
            "/v1/acl/policy/{name}",
            Need::Management,
            acl_api::put_policy,
        )
        .delete(
            "/v1/acl/policy/{name}",
            Need::Management,
            acl_api::delete_policy,
        )
        .get("/v1/acl/tokens", Need::Management, acl_api::list_tokens)
        .put("/v1/acl/token", Need::Management, acl_api::create_token)
        .get("/v1/acl/token/self", Need::AnyToken, acl_api::token_self)
        .get(
            "/v1/acl/token/{accessor}",
            Need::Management,
            acl_api::get_token,
        )
        .delete(
            "/v1/acl/token/{accessor}",
            Need::Management,
            acl_api::delete_token,
        )
}

pub fn router(server: Arc<Server>) -> Router {
    router_with(server, None)
}

/// [`router`], with how the agent dials other servers over TLS (for the
/// writes a server that does not lead sends on to the leader).
pub fn router_with(
    server: Arc<Server>,
    tls: Option<Arc<dyn berth_client::servers::ServerTls>>,
) -> Router {
    let api = server_routes()
        .into_router()
        .fallback(unknown_api_path)
        .with_state(server.clone());
    // The layers wrap the whole API from outside, so that they see every
    // answer as it leaves, with the `Allow` header of a 405 already set.
    // The node-local routes of an alloc go to the alloc's node.
    let acl_enabled = server.acl_enabled();
    let leader_gate = leader_gate::LeaderGate::new(server.clone(), tls);
    let gate = acl::AclGate::new(
        &routes::all_routes(),
        acl::UnknownPaths::Deny,
        server.clone(),
        acl::Enforce::Always,
    );
    let router = Router::new()
        .fallback_service(api)
        .layer(axum::middleware::from_fn_with_state(
            server,
            client_forward::send_to_node,
        ));
    // The ACL check comes before anything is sent on to a node.
    let router = if acl_enabled {
        router.layer(axum::middleware::from_fn_with_state(gate, acl::check))
    } else {
        router
    };
    // A server that does not lead answers nothing but its health and who
    // leads, before any token is looked at.
    router
        .layer(axum::middleware::from_fn_with_state(
            leader_gate,
            leader_gate::only_the_leader,
        ))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY))
        .layer(axum::middleware::from_fn(one_error_shape))
}

/// The API view of a job: the job, with why any of its allocs could not be
/// placed.
fn job_view(s: &Server, job: &Job) -> Value {
    let view = JobView {
        job,
        placement_failures: s.job_placement_failures(&job.id),
    };
    serde_json::to_value(view).unwrap_or(Value::Null)
}

async fn list_jobs(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    // The summaries count allocs: an alloc's change wakes the list.
    let index = q.block(&s, query::JOB_ALLOCS).await?;
    let (page, next) = s.jobs_page(q.table_page());
    let counts = s.jobs_group_counts(&page);
    let body = Value::Array(
        page.iter()
            .zip(counts)
            .map(|(j, groups)| {
                let mut v = job_view(&s, j);
                if let Some(o) = v.as_object_mut() {
                    o.insert(
                        "summary".into(),
                        serde_json::to_value(groups).unwrap_or_default(),
                    );
                }
                v
            })
            .collect(),
    );
    Ok(indexed(index, body, next))
}

/// What a job asks beyond `submit-job`: running a CSI plugin needs
/// `csi-register-plugin`, mounting CSI volumes `csi-mount-volume`.
fn check_job_capabilities(
    acl: Option<&berth_structs::acl::Acl>,
    job: &Job,
) -> Result<(), ApiError> {
    let tasks = || job.task_groups.iter().flat_map(|g| g.tasks.iter());
    if let Some(t) = tasks().find(|t| t.csi_plugin.is_some()) {
        acl::require(
            acl,
            ns(Capability::CsiRegisterPlugin),
            &format!("task {:?} runs a CSI plugin", t.name),
        )?;
    }
    if job.task_groups.iter().any(|g| !g.volumes.is_empty()) {
        acl::require(
            acl,
            ns(Capability::CsiMountVolume),
            "the job mounts CSI volumes",
        )?;
    }
    Ok(())
}

async fn register_job(
    State(s): State<Arc<Server>>,
    acl: Option<axum::Extension<berth_structs::acl::Acl>>,
    ApiJson(body): ApiJson<JobRegisterRequest>,
) -> ApiResult {
    check_job_capabilities(acl.as_deref(), &body.job)?;
    let enforce = body.enforce_index.then_some(body.job_modify_index);
    let resp = s.register_job_checked(body.job, enforce).await?;
    to_json(&resp)
}

/// `job plan`: what registering the job would change, place and stop,
/// without writing anything.
async fn plan_job(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<JobPlanRequest>,
) -> ApiResult {
    if body.job.id != id {
        return Err(ApiError::bad_request(format!(
            "job ID in the path ({id:?}) differs from the one in the body ({:?})",
            body.job.id
        )));
    }
    to_json(&s.plan_job(body.job)?)
}

/// `job scale`: a group's new count, taken in place by the running
/// allocs. The job's own capabilities are checked as its registration's.
async fn scale_job(
    State(s): State<Arc<Server>>,
    acl: Option<axum::Extension<berth_structs::acl::Acl>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<berth_structs::api::JobScaleRequest>,
) -> ApiResult {
    check_job_capabilities(acl.as_deref(), &s.job(&id)?)?;
    to_json(&s.scale_job(&id, body.group.as_deref(), body.count).await?)
}

/// `job history`: the job's kept versions, newest first, each with what
/// it changed.
async fn job_versions(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::JOBS).await?;
    Ok(indexed(index, encode(&s.job_versions(&id)?)?, None))
}

/// `job revert`: a kept version submitted again. The version's own
/// capabilities are checked as its registration's.
async fn revert_job(
    State(s): State<Arc<Server>>,
    acl: Option<axum::Extension<berth_structs::acl::Acl>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<berth_structs::api::JobRevertRequest>,
) -> ApiResult {
    check_job_capabilities(acl.as_deref(), &s.job_version(&id, body.version)?)?;
    to_json(
        &s.revert_job(&id, body.version, body.enforce_prior_version)
            .await?,
    )
}

/// A job's allocs per group by state (by job ID or unique prefix).
async fn job_summary(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::JOB_ALLOCS).await?;
    let id = s.resolve_job_id(&id)?;
    Ok(indexed(index, encode(&s.job_summary(&id)?)?, None))
}

/// A job by ID or unique ID prefix.
async fn get_job(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::JOBS).await?;
    let id = s.resolve_job_id(&id)?;
    Ok(indexed(index, job_view(&s, &s.job(&id)?), None))
}

/// `job stop` (by ID or unique prefix); `?purge=true` also removes the job
/// once its allocs are done. Answers the index.
async fn stop_job(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PurgeQuery>,
) -> ApiResult {
    let id = s.resolve_job_id(&id)?;
    let resp = s.stop_job_with(&id, q.purge).await?;
    to_json(&resp)
}

async fn job_allocations(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::JOB_ALLOCS).await?;
    let id = s.resolve_job_id(&id)?;
    let (page, next) = q.page(s.job_allocations(&id)?, |a| &a.id);
    Ok(indexed(index, encode(&page)?, next))
}

async fn list_allocations(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::ALLOCS).await?;
    let (page, next) = s.allocations_page(q.table_page());
    Ok(indexed(index, encode(&page)?, next))
}

async fn get_allocation(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::ALLOCS).await?;
    Ok(indexed(index, encode(&s.allocation(&id)?)?, None))
}

/// `alloc stop`: the alloc is stopped through its client and, where the
/// job still wants it, replaced; answers `{index, alloc_id, replacement,
/// already_stopped}`.
async fn stop_allocation(State(s): State<Arc<Server>>, ApiPath(id): ApiPath<String>) -> ApiResult {
    to_json(&s.stop_alloc(&id).await?)
}

/// The nodes, each with how many allocs its client reports running
/// (`allocs_running`, counted as the list answers), so that a list needs
/// no read of every alloc. The list blocks on the nodes table alone.
async fn list_nodes(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::NODES).await?;
    let (page, next) = s.nodes_page(q.table_page());
    let ids: Vec<&str> = page.iter().map(|n| n.id.as_str()).collect();
    let running = s.running_allocs_on_nodes(&ids);
    let mut body = encode(&page)?;
    if let Some(nodes) = body.as_array_mut() {
        for (n, count) in nodes.iter_mut().zip(running) {
            n["allocs_running"] = json!(count);
        }
    }
    Ok(indexed(index, body, next))
}

/// A node (by ID, unique ID prefix or name) with what its allocs use
/// (`allocated_resources`), its total (`total_resources`: the schedulable
/// `resources` plus `reserved`) and the CSI volumes its allocs claim
/// (`csi_volumes`). A node carries no secrets.
async fn get_node(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::NODE).await?;
    let node = s.node(&id)?;
    let usage = s.node_usage(&node.id);
    let mut out = serde_json::to_value(&node)
        .map_err(|e| ApiError::internal(format!("encoding the answer: {e}")))?;
    out["total_resources"] = json!(node.resources.plus(&node.reserved));
    out["allocated_resources"] = json!(usage.allocated);
    out["csi_volumes"] = json!(usage.csi_volumes);
    Ok(indexed(index, out, None))
}

/// The allocs placed on a node (by ID, unique ID prefix or name).
async fn node_allocations(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::NODE_ALLOCS).await?;
    let node = s.node(&id)?;
    let (page, next) = q.page(s.allocations_on_node(&node.id), |a| &a.id);
    Ok(indexed(index, encode(&page)?, next))
}

/// The body of `POST /v1/node/{id}/drain`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    enable: bool,
    /// How long the drain waits for migrations (`"1h"`, the default).
    #[serde(default)]
    deadline: Option<String>,
    /// A drain that does not wait at all (deadline now).
    #[serde(default)]
    force: bool,
}

/// A drain's deadline when none is given (Nomad's).
const DEFAULT_DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(3600);

impl DrainBody {
    /// The deadline to drain with, or None to disable the drain.
    fn deadline(&self) -> Result<Option<std::time::Duration>, ApiError> {
        if !self.enable {
            if self.deadline.is_some() || self.force {
                return Err(ApiError::bad_request(
                    "deadline and force apply only when enabling a drain (enable: true)",
                ));
            }
            return Ok(None);
        }
        match (&self.deadline, self.force) {
            (Some(_), true) => Err(ApiError::bad_request(
                "give either deadline or force, not both (force is a deadline of now)",
            )),
            (None, true) => Ok(Some(std::time::Duration::ZERO)),
            (None, false) => Ok(Some(DEFAULT_DRAIN_DEADLINE)),
            (Some(d), false) => humantime::parse_duration(d)
                .map(Some)
                .map_err(|e| ApiError::bad_request(format!("deadline {d:?}: {e}"))),
        }
    }
}

/// `node drain`: start, update or disable a node's drain; answers the node.
async fn drain_node(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<DrainBody>,
) -> ApiResult {
    let deadline = body.deadline()?;
    to_json(&s.update_node_drain(&id, deadline).await?)
}

/// The body of `POST /v1/node/{id}/eligibility`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EligibilityBody {
    eligible: bool,
}

/// `node eligibility`: whether new allocs may go to the node; answers the
/// node.
async fn node_eligibility(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<EligibilityBody>,
) -> ApiResult {
    to_json(&s.set_node_eligibility(&id, body.eligible).await?)
}

async fn list_volumes(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::VOLUMES).await?;
    let plugins: std::collections::BTreeMap<String, CsiPlugin> =
        s.plugins().into_iter().map(|p| (p.id.clone(), p)).collect();
    let (page, next) = s.volumes_page(q.table_page());
    let body = Value::Array(
        page.iter()
            .map(|v| volume_view(v, plugins.get(&v.plugin_id)))
            .collect(),
    );
    Ok(indexed(index, body, next))
}

async fn get_volume(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::VOLUMES).await?;
    let vol = s.volume(&id)?;
    let mut out = written_volume_view(&s, &vol);
    out["claim_allocs"] = claim_allocs(&s, &vol);
    Ok(indexed(index, out, None))
}

/// Each claim of `vol` joined with its alloc and node: the alloc's name,
/// job, status and creation time, the node's name, and the stats its node
/// last reported for this volume (`null` when none, or when the alloc is
/// gone). Newest alloc first.
fn claim_allocs(s: &Server, vol: &CsiVolume) -> Value {
    let mut claims: Vec<(i64, Value)> = vol
        .claims()
        .map(|c| {
            let alloc = s.allocation(&c.alloc_id).ok();
            let stats = alloc.as_ref().and_then(|a| {
                a.csi_volume_stats
                    .values()
                    .find(|st| st.volume_id == vol.id)
                    .cloned()
            });
            let created = alloc.as_ref().map_or(0, |a| a.create_time_ms);
            let claim = json!({
                "alloc_id": c.alloc_id,
                "alloc_name": alloc.as_ref().map(|a| a.name.clone()),
                "job_id": alloc.as_ref().map(|a| a.job_id.clone()),
                "node_id": c.node_id,
                "node_name": s.node(&c.node_id).ok().map(|n| n.name),
                "mode": c.mode,
                "access_mode": c.access_mode,
                "attachment_mode": c.attachment_mode,
                "state": c.state.as_str(),
                "client_status": alloc.as_ref().map(|a| a.client_status.as_str()),
                "create_time_ms": alloc.as_ref().map(|a| a.create_time_ms),
                "volume_stats": stats,
            });
            (created, claim)
        })
        .collect();
    claims.sort_by(|a, b| {
        b.0.cmp(&a.0)
            .then_with(|| a.1["alloc_id"].as_str().cmp(&b.1["alloc_id"].as_str()))
    });
    Value::Array(claims.into_iter().map(|(_, c)| c).collect())
}

fn check_volume_id(path_id: &str, vol: &CsiVolume) -> Result<(), ApiError> {
    if vol.id != path_id {
        return Err(ApiError::bad_request(format!(
            "volume ID in the path ({path_id:?}) differs from the one in the body ({:?})",
            vol.id
        )));
    }
    Ok(())
}

async fn register_volume(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<VolumeSubmit>,
) -> ApiResult {
    check_volume_id(&id, &body.volume)?;
    let v = s.register_volume(body.volume).await?;
    Ok(Json(written_volume_view(&s, &v)))
}

async fn create_volume(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<VolumeSubmit>,
) -> ApiResult {
    check_volume_id(&id, &body.volume)?;
    let v = s.create_volume(body.volume).await?;
    Ok(Json(written_volume_view(&s, &v)))
}

async fn deregister_volume(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ForceQuery>,
) -> ApiResult {
    let report = s.deregister_volume(&id, q.force).await?;
    to_json(&report)
}

async fn delete_volume(State(s): State<Arc<Server>>, ApiPath(id): ApiPath<String>) -> ApiResult {
    s.delete_volume(&id).await?;
    Ok(Json(json!({})))
}

#[derive(Deserialize, Default)]
struct PurgeBody {
    /// The node's tasks are gone too: its write claims are freed.
    #[serde(default)]
    force: bool,
}

/// `node purge`: the operator says the node is gone (with `force`: its
/// tasks too).
async fn purge_node(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    body: axum::body::Bytes,
) -> ApiResult {
    // An empty body is a purge without force, as before the body existed.
    let body: PurgeBody = if body.iter().all(u8::is_ascii_whitespace) {
        PurgeBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            berth_server::ServerError::BadRequest(format!(
                "node purge: the body is not valid JSON: {e}"
            ))
        })?
    };
    to_json(&s.purge_node(&id, body.force).await?)
}

#[derive(Deserialize)]
struct DetachQuery {
    node: String,
}

async fn detach_volume(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<DetachQuery>,
) -> ApiResult {
    let report = s.detach_volume(&id, &q.node).await?;
    to_json(&report)
}

/// `PUT /v1/volumes/snapshot`: `{volume_id, name, parameters, secrets}`;
/// answers the snapshot (never the secrets).
async fn create_snapshot(
    State(s): State<Arc<Server>>,
    ApiJson(body): ApiJson<SnapshotRequest>,
) -> ApiResult {
    to_json(&s.create_snapshot(body).await?)
}

#[derive(Deserialize)]
struct SnapshotListQuery {
    #[serde(default)]
    plugin_id: Option<String>,
}

async fn list_snapshots(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<SnapshotListQuery>,
) -> ApiResult {
    let plugin = q.plugin_id.filter(|p| !p.is_empty());
    to_json(&s.list_snapshots(plugin.as_deref()).await?)
}

#[derive(Deserialize)]
struct SnapshotDeleteQuery {
    plugin_id: String,
    snapshot_id: String,
}

async fn delete_snapshot(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<SnapshotDeleteQuery>,
) -> ApiResult {
    s.delete_snapshot(&q.plugin_id, &q.snapshot_id).await?;
    Ok(Json(json!({})))
}

async fn list_plugins(
    State(s): State<Arc<Server>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::PLUGINS).await?;
    let (page, next) = q.page(s.plugins(), |p| &p.id);
    Ok(indexed(index, encode(&page)?, next))
}

/// A plugin (by ID or unique ID prefix) with its instances' nodes, its
/// capabilities, the allocs that run it and how many volumes use it.
async fn get_plugin(
    State(s): State<Arc<Server>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let index = q.block(&s, query::PLUGINS).await?;
    Ok(indexed(index, encode(&s.plugin_status(&id)?)?, None))
}

/// A forced garbage collection (`berth system gc`): everything that is done
/// goes now, whatever the thresholds. Answers what was removed.
async fn system_gc(State(s): State<Arc<Server>>) -> ApiResult {
    let report = s.garbage_collect(true).await?;
    to_json(&report)
}

/// A new root keyring key seals every stored secret; answers its ID and
/// the retired keys' IDs, never key material.
async fn rotate_keyring(State(s): State<Arc<Server>>) -> ApiResult {
    let rotation = s.rotate_keyring()?;
    to_json(&rotation)
}

#[cfg(test)]
/// Serves `router` on `listener` over plain HTTP with the default limits
/// until `shutdown` flips (the agent's listeners: [`listener::serve`]).
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: berth_sync::Shutdown,
) -> std::io::Result<()> {
    listener::serve(listener, router, shutdown, listener::HttpServing::plain()).await
}

pub mod acl;
mod acl_api;
pub mod agent_api;
pub mod alloc_ops;
pub mod client_forward;
mod deployments;
pub mod errors;
pub mod forward;
pub mod host_check;
pub mod leader_conns;
pub mod leader_gate;
pub mod limits;
pub mod listener;
pub mod openapi;
mod openapi_jobs;
pub mod query;
pub mod routes;
pub mod ui;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod query_tests;

#[cfg(test)]
mod proptests;
