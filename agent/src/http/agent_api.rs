//! What every agent serves over HTTP, whatever its roles: the node-local
//! routes it answers itself (`/v1/agent/self`, `/v1/client/...`), and the
//! rest of the API, answered by the server role of this agent, or
//! forwarded to a server by a client-only agent (see [`super::forward`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use berth_server::Server;
use berth_structs::acl::{Capability, Level, Need};
use serde_json::json;

use super::query::{encode, indexed, BlockingQuery};
use super::routes::Routes;
use super::{ApiError, ApiPath, ApiQuery, MAX_REQUEST_BODY};
use berth_client::Client;

/// What `/v1/agent/self` tells about this agent. The parts known only
/// once a role has started are set then.
pub struct AgentInfo {
    pub server: bool,
    pub client: bool,
    pub data_dir: PathBuf,
    /// The servers the client dials, as configured (`HOST:PORT`).
    pub servers: Vec<String>,
    pub http_addr: OnceLock<SocketAddr>,
    /// Where this agent's server role serves the agent protocol.
    pub rpc_addr: OnceLock<SocketAddr>,
    pub client_role: OnceLock<Arc<Client>>,
    /// This agent's server role, when it runs one (for its metrics).
    pub server_role: OnceLock<Arc<Server>>,
    /// How this agent dials servers over TLS (`tls.rpc`): a server that
    /// does not lead sends writes on to the leader with it.
    pub server_tls: OnceLock<Arc<dyn berth_client::servers::ServerTls>>,
    /// Whether this agent's own config turns ACLs on.
    pub acl_enabled: bool,
    /// How long a client-only agent keeps a token the servers resolved
    /// (`acl { token_ttl }`).
    pub acl_token_ttl: std::time::Duration,
    /// `acl { public_metrics = true }`: `/v1/metrics` answers without a
    /// token.
    pub public_metrics: bool,
    /// The `Host` values its HTTP API answers (see [`super::host_check`]).
    pub allowed_hosts: super::host_check::AllowedHosts,
    /// How many waiting requests it holds at once (see [`super::limits`]).
    pub limits: super::limits::ApiLimits,
}

impl AgentInfo {
    pub fn new(server: bool, client: bool, data_dir: PathBuf, servers: Vec<String>) -> AgentInfo {
        AgentInfo {
            server,
            client,
            data_dir,
            servers,
            http_addr: OnceLock::new(),
            rpc_addr: OnceLock::new(),
            client_role: OnceLock::new(),
            server_role: OnceLock::new(),
            server_tls: OnceLock::new(),
            acl_enabled: false,
            acl_token_ttl: crate::config::security::AclSection::DEFAULT_TOKEN_TTL,
            public_metrics: false,
            allowed_hosts: super::host_check::AllowedHosts::default(),
            limits: super::limits::ApiLimits::default(),
        }
    }

    /// This agent as its security config has it: the `Host` names it
    /// answers, its `limits` and its `acl` block.
    pub fn with_security(self, security: &crate::config::SecuritySections) -> AgentInfo {
        AgentInfo {
            allowed_hosts: super::host_check::AllowedHosts::new(
                security.http_allowed_hosts.clone(),
            ),
            limits: super::limits::ApiLimits::new(&security.limits.effective()),
            acl_enabled: security.acl.enabled(),
            acl_token_ttl: security.acl.effective_token_ttl(),
            public_metrics: security.acl.public_metrics(),
            ..self
        }
    }

    /// The client role, or a 404 that says this agent does not run one
    /// (yet).
    fn client_or_404(&self) -> Result<&Arc<Client>, ApiError> {
        self.client_role.get().ok_or_else(|| {
            let why = if self.client {
                "the client role of this agent has not started yet"
            } else {
                "this agent does not run the client role"
            };
            ApiError::new(StatusCode::NOT_FOUND, why)
        })
    }
}

/// The routes every agent answers itself, whatever its roles.
pub fn agent_routes() -> Routes<Arc<AgentInfo>> {
    Routes::new()
        .get("/v1/agent/self", Need::Agent(Level::Read), agent_self)
        .get(
            "/v1/openapi.json",
            Need::Public,
            super::openapi::openapi_json,
        )
        .get(METRICS_PATH, Need::Agent(Level::Read), metrics)
        .get(
            "/v1/client/allocations",
            Need::Node(Level::Read),
            client_allocations,
        )
        .get(
            "/v1/client/allocation/{id}",
            Need::Namespace(Capability::ReadJob),
            client_allocation,
        )
        .get(
            "/v1/client/allocation/{id}/stats",
            Need::Namespace(Capability::ReadJob),
            client_allocation_stats,
        )
        .get(
            "/v1/client/fs/logs/{id}",
            Need::Namespace(Capability::ReadLogs),
            client_fs_logs,
        )
        .post(
            "/v1/client/allocation/{id}/restart",
            Need::Namespace(Capability::AllocLifecycle),
            super::alloc_ops::restart_alloc,
        )
        .post(
            "/v1/client/allocation/{id}/signal",
            Need::Namespace(Capability::AllocLifecycle),
            super::alloc_ops::signal_alloc,
        )
}

/// The Prometheus scrape path.
const METRICS_PATH: &str = "/v1/metrics";

/// The whole API of an agent: the node-local routes, then `server`'s API
/// when this agent runs the server role, else forwarding to the servers
/// the client dials.
pub fn agent_router(server: Option<Arc<Server>>, info: Arc<AgentInfo>) -> Router {
    if let Some(s) = &server {
        let _ = info.server_role.set(s.clone());
    }
    let rest = match server {
        Some(s) => super::router_with(s, info.server_tls.get().cloned()),
        None => super::forward::forwarding_router(info.clone()),
    };
    // An alloc-scoped client request for an alloc this agent does not run
    // goes to `rest`: the server sends it to the alloc's node.
    let routing = super::client_forward::ClientRouting {
        info: info.clone(),
        rest: rest.clone(),
    };
    // A client-only agent checks tokens when its own config says so, and
    // also whenever its servers enforce them (see
    // `Client::checks_tokens`; until the client role has started, it
    // checks): an `acl` block missing from a client's files never opens
    // its routes.
    let follows_servers = !info.acl_enabled && info.client && info.server_role.get().is_none();
    let enforce = if follows_servers {
        let info = info.clone();
        super::acl::Enforce::When(Arc::new(move || {
            info.client_role.get().is_none_or(|c| c.checks_tokens())
        }))
    } else {
        super::acl::Enforce::Always
    };
    let gate = (info.acl_enabled || follows_servers).then(|| {
        let ttl = info.acl_token_ttl;
        let resolver: Arc<dyn super::acl::TokenResolver> = match info.server_role.get() {
            Some(s) => s.clone(),
            None => {
                let ask_info = info.clone();
                let index_info = info.clone();
                Arc::new(super::acl::RemoteResolver::new(
                    move |secret: String| {
                        let info = ask_info.clone();
                        async move { super::forward::resolve_remotely(&info, secret).await }
                    },
                    ttl,
                    Box::new(move || index_info.client_role.get().map_or(0, |c| c.acl_index())),
                ))
            }
        };
        // The agent's own routes; the rest is checked where it is answered.
        // With `public_metrics`, the metrics route is public on purpose.
        let mut routes = agent_routes().table().to_vec();
        if info.public_metrics {
            for r in routes.iter_mut().filter(|r| r.path == METRICS_PATH) {
                r.need = Need::Public;
            }
        }
        super::acl::AclGate::new(&routes, super::acl::UnknownPaths::PassOn, resolver, enforce)
    });
    // The web UI's files are public (the page asks for a token itself).
    let router = agent_routes()
        .into_router()
        .merge(super::ui::routes())
        .with_state(info.clone())
        .fallback_service(rest)
        .layer(axum::middleware::from_fn_with_state(
            routing,
            super::client_forward::route_client_request,
        ));
    let router = match gate {
        Some(gate) => router.layer(axum::middleware::from_fn_with_state(
            gate,
            super::acl::check,
        )),
        None => router,
    };
    router
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY))
        .layer(axum::middleware::from_fn(super::one_error_shape))
        .layer(axum::middleware::from_fn_with_state(
            info.limits.clone(),
            super::limits::limit_waiting_requests,
        ))
        .layer(axum::middleware::from_fn_with_state(
            info,
            super::host_check::refuse_foreign_host,
        ))
}

/// This agent's own metrics in the Prometheus text format, never
/// forwarded. The gauges of the state as a whole (allocs and nodes by
/// status) are counted now, from the server role's state and the client
/// role's runners.
async fn metrics(State(info): State<Arc<AgentInfo>>) -> Response {
    if let Some(server) = info.server_role.get() {
        berth_metrics::set_allocs(&server.alloc_status_counts());
        berth_metrics::set_nodes(&server.node_status_counts());
    }
    if let Some(client) = info.client_role.get() {
        berth_metrics::set_client_allocs(&client.alloc_status_counts().await);
        let rows: Vec<berth_metrics::tasks::TaskUsageRow> = client
            .task_samples()
            .await
            .into_iter()
            .map(
                |(alloc_id, job, task, u)| berth_metrics::tasks::TaskUsageRow {
                    labels: berth_metrics::tasks::TaskLabels {
                        alloc_id,
                        job,
                        task,
                    },
                    memory_bytes: u.memory_bytes,
                    memory_limit_bytes: u.memory_limit_bytes,
                    cpu_millicores: u.cpu_millicores,
                    cpu_seconds: u.cpu_total_ns as f64 / 1e9,
                    throttled_periods: u.throttled_periods,
                },
            )
            .collect();
        berth_metrics::metrics().client_tasks.set(&rows);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            berth_metrics::CONTENT_TYPE,
        )],
        berth_metrics::encode(),
    )
        .into_response()
}

async fn agent_self(State(info): State<Arc<AgentInfo>>) -> Response {
    let roles: Vec<&str> = [(info.server, "server"), (info.client, "client")]
        .into_iter()
        .filter_map(|(on, role)| on.then_some(role))
        .collect();
    let mut out = json!({
        "roles": roles,
        "data_dir": info.data_dir.display().to_string(),
        "http_addr": info.http_addr.get().map(ToString::to_string),
        "rpc_addr": info.rpc_addr.get().map(ToString::to_string),
        "servers": info.servers,
        "limits": info.limits.view(),
    });
    if let Some(c) = info.client_role.get() {
        let node = c.node();
        out["client"] = json!({
            "node_id": node.id,
            "node_name": node.name,
            "registered": c.registered(),
            "last_heartbeat_ms": c.last_heartbeat_ms(),
            "current_server": c.servers().current_addr(),
        });
    }
    Json(out).into_response()
}

/// The allocs this client runs; a blocking query (`?index=N&wait=D`)
/// waits for a change of the client's view of them.
async fn client_allocations(
    State(info): State<Arc<AgentInfo>>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let client = info.client_or_404()?;
    let index = client.wait_alloc_change(q.index(), q.wait()?).await;
    Ok(indexed(index, encode(&client.alloc_views().await)?, None))
}

/// One alloc this client runs; a blocking query as
/// [`client_allocations`].
async fn client_allocation(
    State(info): State<Arc<AgentInfo>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<BlockingQuery>,
) -> Result<Response, ApiError> {
    let client = info.client_or_404()?;
    let wait = q.wait()?;
    // By ID or unique prefix.
    let full = match client.alloc_runner(&id).await {
        Ok(r) => r.alloc_id().to_string(),
        Err(_) => id.clone(),
    };
    let index = client.wait_alloc_change(q.index(), wait).await;
    match client.alloc_view(&full).await {
        Some(view) => Ok(indexed(index, encode(&view)?, None)),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("alloc {id:?} does not run on this client"),
        )),
    }
}

/// What the running tasks of an alloc this client runs use now (their
/// latest samples, every `stats_interval`): Nomad's shape, see
/// [`berth_structs::AllocStats`].
async fn client_allocation_stats(
    State(info): State<Arc<AgentInfo>>,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let runner = super::alloc_ops::runner_of(&info, &id).await?;
    Ok(Json(berth_structs::AllocStats::of(&runner.task_samples())).into_response())
}

/// A task's stdout or stderr as raw bytes, with the cursor after them in
/// `X-Berth-Log-File` and `X-Berth-Log-Offset` (see
/// [`berth_client::logs`]).
async fn client_fs_logs(
    State(info): State<Arc<AgentInfo>>,
    ApiPath(id): ApiPath<String>,
    super::ApiQuery(query): super::ApiQuery<berth_client::logs::LogsQuery>,
) -> Result<Response, ApiError> {
    use berth_client::logs::LogsError;
    // A client role that has not started yet is a moment away: a follower
    // tries again.
    if info.client && info.client_role.get().is_none() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the client role of this agent has not started yet",
        ));
    }
    let client = info.client_or_404()?;
    let request = query
        .request()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let answer = client
        .read_task_logs(&id, &request)
        .await
        .map_err(|e| match e {
            LogsError::NotFound(m) => ApiError::new(StatusCode::NOT_FOUND, m),
            LogsError::BadRequest(m) => ApiError::bad_request(m),
            LogsError::Unavailable(m) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m),
            LogsError::Io(_) => ApiError::internal(e.to_string()),
        })?;
    let state = match answer.task_state {
        berth_structs::TaskStateKind::Pending => "pending",
        berth_structs::TaskStateKind::Running => "running",
        berth_structs::TaskStateKind::Dead => "dead",
    };
    let mut headers = vec![
        (
            axum::http::header::CONTENT_TYPE.as_str(),
            "application/octet-stream".to_string(),
        ),
        ("x-berth-log-alloc", answer.alloc_id),
        ("x-berth-log-task", answer.task),
        ("x-berth-log-file", answer.read.next.file.to_string()),
        ("x-berth-log-offset", answer.read.next.offset.to_string()),
        ("x-berth-log-task-state", state.to_string()),
    ];
    if answer.read.lost {
        headers.push(("x-berth-log-lost", "true".to_string()));
    }
    let mut resp = answer.read.data.into_response();
    for (name, value) in headers {
        if let Ok(v) = axum::http::HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    Ok(resp)
}
