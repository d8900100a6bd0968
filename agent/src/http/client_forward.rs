//! The node-local client routes of one alloc (`/v1/client/allocation/{id}`
//! and below, `/v1/client/fs/{what}/{id}`), reachable through any agent:
//!
//! - an agent whose client role holds the alloc (ID or unique prefix)
//!   answers itself;
//! - else an agent with the server role finds the alloc's node and sends
//!   the request there over the node's call stream (`ClientHttp`); the
//!   client runs it through its node-local router ([`node_local_router`]);
//! - else (a client-only agent without the alloc) the request is forwarded
//!   to a server as any other (see [`super::forward`]), which does the step
//!   above.
//!
//! Bodies travel as bytes, and answers keep their headers (the logs'
//! `X-Berth-Log-*`), so raw answers come back as the node gave them.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use berth_proto::berth::v1 as pb;
use berth_server::{Server, MAX_CLIENT_HTTP_ANSWER};
use tower::ServiceExt;

use super::agent_api::AgentInfo;
use super::{body_too_large_message, ApiError, MAX_REQUEST_BODY};
use berth_client::Client;

/// How long a node may take to answer a request that does not wait (a
/// restart waits for the task's kill timeout).
pub const CLIENT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The alloc ID (or prefix) a node-local route is about, when `path` is
/// one of them: `/v1/client/allocation/{id}[/...]` or
/// `/v1/client/fs/{what}/{id}[/...]`.
pub fn alloc_of_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/client/")?;
    let id = if let Some(r) = rest.strip_prefix("allocation/") {
        r.split('/').next()
    } else if let Some(r) = rest.strip_prefix("fs/") {
        let mut parts = r.split('/');
        parts.next().filter(|what| !what.is_empty())?;
        parts.next()
    } else {
        None
    }?;
    (!id.is_empty()).then_some(id)
}

/// `path_and_query` with the alloc ID of its path (at `prefix`'s place)
/// replaced by `full`.
fn with_full_id(path_and_query: &str, prefix: &str, full: &str) -> String {
    let (path, query) = match path_and_query.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path_and_query, None),
    };
    let mut segments: Vec<&str> = path.split('/').collect();
    // "", "v1", "client", then "allocation" ID or "fs" WHAT ID.
    let at = if segments.get(3) == Some(&"allocation") {
        4
    } else {
        5
    };
    if segments.get(at) == Some(&prefix) {
        segments[at] = full;
    }
    let path = segments.join("/");
    match query {
        Some(q) => format!("{path}?{q}"),
        None => path,
    }
}

/// How long the node may take for `path_and_query`: a request that waits
/// (`wait=`, logs that follow; `index=`, a blocking query) gets its wait on
/// top.
pub fn deadline_of(path_and_query: &str) -> Duration {
    let wait = super::forward::requested_wait(path_and_query);
    CLIENT_CALL_TIMEOUT.saturating_add(wait.unwrap_or_default())
}

/// How long a request to `alloc`'s node may take on top of
/// [`deadline_of`] because it stops the alloc's tasks (a restart): the
/// longest kill timeout its tasks set.
fn kill_time(alloc: &berth_structs::Allocation, path_and_query: &str) -> Duration {
    let path = path_and_query.split('?').next().unwrap_or_default();
    if !path.ends_with("/restart") {
        return Duration::ZERO;
    }
    alloc
        .group()
        .and_then(|g| g.tasks.iter().filter_map(|t| t.kill_timeout).max())
        .unwrap_or_default()
}

/// Whether this agent's client role runs the alloc `id` (or allocs whose
/// IDs start with it: the local routes then answer, naming the matches).
async fn held_here(client: &Client, id: &str) -> bool {
    match client.alloc_runner(id).await {
        Ok(_) => true,
        Err(matches) => !matches.is_empty(),
    }
}

/// What routes a node-local request: the agent, and the API it falls back
/// on (the server's, or forwarding).
#[derive(Clone)]
pub struct ClientRouting {
    pub info: Arc<AgentInfo>,
    pub rest: Router,
}

/// The agent's layer: an alloc-scoped client request for an alloc this
/// agent does not run goes to `rest` instead of the local routes.
pub async fn route_client_request(
    State(routing): State<ClientRouting>,
    req: Request,
    next: Next,
) -> Response {
    let Some(id) = alloc_of_path(req.uri().path()) else {
        return next.run(req).await;
    };
    if let Some(client) = routing.info.client_role.get() {
        if held_here(client, id).await {
            return next.run(req).await;
        }
    }
    match routing.rest.oneshot(req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

/// The server API's layer: alloc-scoped client requests go to the node
/// that holds the alloc.
pub async fn send_to_node(State(server): State<Arc<Server>>, req: Request, next: Next) -> Response {
    if alloc_of_path(req.uri().path()).is_none() {
        return next.run(req).await;
    }
    match to_node(&server, req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn to_node(server: &Server, req: Request) -> Result<Response, ApiError> {
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    let id = alloc_of_path(req.uri().path())
        .unwrap_or_default()
        .to_string();
    let alloc = server.allocation(&id)?;
    if alloc.node_id.is_empty() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("alloc {} is not placed on a node", alloc.id),
        ));
    }
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, MAX_REQUEST_BODY)
        .await
        .map_err(|_| ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, body_too_large_message()))?;
    let path_and_query = with_full_id(&path_and_query, &id, &alloc.id);
    let deadline = deadline_of(&path_and_query).saturating_add(kill_time(&alloc, &path_and_query));
    let request = pb::ClientHttp {
        method: parts.method.as_str().to_string(),
        path_and_query,
        content_type: parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string(),
        body: body.to_vec(),
    };
    tracing::debug!(alloc_id = %alloc.id, node_id = %alloc.node_id, path = %parts.uri.path(), "sending a client request to the alloc's node");
    let reply = server
        .client_http(&alloc.node_id, request, deadline)
        .await?;
    answer_of(reply)
}

/// The node's answer as this agent's.
fn answer_of(a: pb::ClientHttpReply) -> Result<Response, ApiError> {
    super::forward::relayed_answer("the node", a.status, a.headers, a.body)
}

/// The routes a client answers for the servers: the agent's own routes,
/// over `client`, and nothing else (no forwarding: the request came from
/// the servers).
pub fn node_local_router(client: Arc<Client>) -> Router {
    let info = AgentInfo::new(false, true, std::path::PathBuf::new(), Vec::new());
    let _ = info.client_role.set(client);
    super::agent_api::agent_routes()
        .into_router()
        .with_state(Arc::new(info))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("unknown client API path {}", uri.path()),
            )
        })
        .layer(axum::middleware::from_fn(super::one_error_shape))
}

/// The node-local API as the client answers the servers' forwarded
/// requests with it.
pub struct NodeLocalApi(Router);

#[async_trait::async_trait]
impl berth_client::calls::LocalApi for NodeLocalApi {
    async fn answer(
        &self,
        request: pb::ClientHttp,
    ) -> Result<pb::ClientHttpReply, (tonic::Code, String)> {
        answer_client_http(&self.0, request).await
    }
}

/// What a client is given to make its node-local API.
pub fn local_api_factory() -> berth_client::calls::LocalApiFactory {
    berth_client::calls::LocalApiFactory(std::sync::Arc::new(|client| {
        std::sync::Arc::new(NodeLocalApi(node_local_router(client)))
    }))
}

/// Whether the servers may send `path_and_query` to a node: one alloc's
/// node-local route, with no empty, `.` or `..` segment that a router
/// could read as another route.
fn servable_for_servers(path_and_query: &str) -> bool {
    let path = path_and_query
        .split_once('?')
        .map_or(path_and_query, |(p, _)| p);
    let clean = path
        .split('/')
        .skip(1)
        .all(|seg| !seg.is_empty() && seg != "." && seg != "..");
    path.starts_with('/') && clean && alloc_of_path(path).is_some()
}

/// The client's end of a `ClientHttp` call: runs it through `local`, the
/// node-local router. Only an alloc's node-local routes
/// (`/v1/client/allocation/{id}...`, `/v1/client/fs/{what}/{id}...`) are
/// served this way.
pub async fn answer_client_http(
    local: &Router,
    r: pb::ClientHttp,
) -> Result<pb::ClientHttpReply, (tonic::Code, String)> {
    if !servable_for_servers(&r.path_and_query) {
        return Err((
            tonic::Code::InvalidArgument,
            format!(
                "path {:?} is not a node-local route of an alloc",
                r.path_and_query
            ),
        ));
    }
    let method = Method::from_bytes(r.method.as_bytes()).map_err(|_| {
        (
            tonic::Code::InvalidArgument,
            format!("method {:?} is invalid", r.method),
        )
    })?;
    let mut builder = axum::http::Request::builder()
        .method(method)
        .uri(&r.path_and_query);
    if !r.content_type.is_empty() {
        builder = builder.header(header::CONTENT_TYPE, r.content_type.as_str());
    }
    let req = builder.body(Body::from(r.body)).map_err(|e| {
        (
            tonic::Code::InvalidArgument,
            format!("invalid request: {e}"),
        )
    })?;
    let resp = match local.clone().oneshot(req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    };
    let (parts, body) = resp.into_parts();
    let body = axum::body::to_bytes(body, MAX_CLIENT_HTTP_ANSWER)
        .await
        .map_err(|e| {
            (
                tonic::Code::ResourceExhausted,
                format!(
                    "the answer is larger than the {} limit or unreadable: {e}",
                    super::describe_size(MAX_CLIENT_HTTP_ANSWER as u64)
                ),
            )
        })?;
    let headers = parts
        .headers
        .iter()
        .filter(|(name, _)| super::forward::answer_header(name))
        .map(|(name, value)| pb::HttpHeader {
            name: name.as_str().to_string(),
            value: value.as_bytes().to_vec(),
        })
        .collect();
    Ok(pb::ClientHttpReply {
        status: u32::from(parts.status.as_u16()),
        headers,
        body: body.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent without the alloc (here: without a client role at all)
    /// sends an alloc's requests to `rest` and answers the others itself.
    #[tokio::test]
    async fn an_agent_without_the_alloc_sends_its_requests_on() {
        let info = Arc::new(AgentInfo::new(
            true,
            false,
            std::path::PathBuf::new(),
            Vec::new(),
        ));
        let rest =
            Router::new().fallback(|uri: axum::http::Uri| async move { format!("rest: {}", uri) });
        let routing = ClientRouting {
            info: info.clone(),
            rest: rest.clone(),
        };
        let api = Router::new()
            .route(
                "/v1/client/allocation/{id}",
                axum::routing::get(|| async { "local" }),
            )
            .route(
                "/v1/client/allocations",
                axum::routing::get(|| async { "local" }),
            )
            .fallback_service(rest)
            .layer(axum::middleware::from_fn_with_state(
                routing,
                route_client_request,
            ));
        for (path, want) in [
            (
                "/v1/client/allocation/ab12",
                "rest: /v1/client/allocation/ab12",
            ),
            (
                "/v1/client/allocation/ab12/signal?x=1",
                "rest: /v1/client/allocation/ab12/signal?x=1",
            ),
            ("/v1/client/fs/logs/ab12", "rest: /v1/client/fs/logs/ab12"),
            ("/v1/client/allocations", "local"),
        ] {
            let req = axum::http::Request::builder()
                .uri(path)
                .body(Body::empty())
                .unwrap();
            let resp = api.clone().oneshot(req).await.unwrap();
            let body = axum::body::to_bytes(resp.into_body(), 1024).await.unwrap();
            assert_eq!(body, want.as_bytes(), "{path}");
        }
    }

    /// The servers reach an alloc's node-local routes on a node, and
    /// nothing else of its API, however the path is spelled.
    #[tokio::test]
    async fn a_node_answers_the_servers_only_on_an_alloc_route() {
        let local = Router::new()
            .fallback(|uri: axum::http::Uri| async move { format!("served {}", uri.path()) });
        let call = |path: &str| pb::ClientHttp {
            method: "GET".into(),
            path_and_query: path.into(),
            content_type: String::new(),
            body: Vec::new(),
        };
        for path in [
            "/v1/client/allocation/ab12",
            "/v1/client/allocation/ab12/signal",
            "/v1/client/fs/logs/ab12?task=web&offset=0",
        ] {
            let reply = answer_client_http(&local, call(path)).await.unwrap();
            assert_eq!(reply.status, 200, "{path}");
        }
        for path in [
            "/v1/agent/self",
            "/v1/metrics",
            "/v1/client/allocations",
            "/v1/client/../agent/self",
            "/v1/client/allocation/../../agent/self",
            "/v1/client/allocation/ab12/../../../metrics",
            "/v1/client/allocation/./ab12",
            "/v1/client//allocation/ab12",
            "/v1/client/fs/logs/ab12/..",
            "v1/client/allocation/ab12",
            "",
        ] {
            let (code, message) = answer_client_http(&local, call(path)).await.unwrap_err();
            assert_eq!(code, tonic::Code::InvalidArgument, "{path}");
            assert!(
                message.contains("not a node-local route of an alloc"),
                "{message}"
            );
        }
    }

    #[test]
    fn the_alloc_of_a_node_local_route_is_found_in_its_path() {
        assert_eq!(alloc_of_path("/v1/client/allocation/ab12"), Some("ab12"));
        assert_eq!(
            alloc_of_path("/v1/client/allocation/ab12/restart"),
            Some("ab12")
        );
        assert_eq!(alloc_of_path("/v1/client/fs/logs/ab12"), Some("ab12"));
        assert_eq!(alloc_of_path("/v1/client/fs/logs/ab12/x"), Some("ab12"));
        // Not about one alloc: served (or refused) where they arrive.
        for path in [
            "/v1/client/allocations",
            "/v1/client/allocation/",
            "/v1/client/fs/logs",
            "/v1/client/fs/logs/",
            "/v1/client/fs//ab12",
            "/v1/allocation/ab12",
            "/v1/agent/self",
        ] {
            assert_eq!(alloc_of_path(path), None, "{path}");
        }
    }

    #[test]
    fn the_node_gets_the_full_alloc_id_and_the_query_as_is() {
        assert_eq!(
            with_full_id("/v1/client/allocation/ab/signal", "ab", "ab12-cd"),
            "/v1/client/allocation/ab12-cd/signal"
        );
        assert_eq!(
            with_full_id("/v1/client/fs/logs/ab?task=t&type=stdout", "ab", "ab12"),
            "/v1/client/fs/logs/ab12?task=t&type=stdout"
        );
        assert_eq!(
            with_full_id("/v1/client/allocation/ab12", "ab12", "ab12"),
            "/v1/client/allocation/ab12"
        );
    }

    #[test]
    fn a_restart_gets_the_longest_kill_timeout_of_the_tasks_on_top() {
        let task = |name: &str, kill: Option<u64>| berth_structs::Task {
            name: name.into(),
            kill_timeout: kill.map(Duration::from_secs),
            ..Default::default()
        };
        let alloc = berth_structs::Allocation {
            task_group: "g".into(),
            job: berth_structs::Job {
                task_groups: vec![berth_structs::TaskGroup {
                    name: "g".into(),
                    tasks: vec![task("a", Some(45)), task("b", None), task("c", Some(3))],
                    ..Default::default()
                }],
                ..Default::default()
            }
            .into(),
            ..Default::default()
        };
        assert_eq!(
            kill_time(&alloc, "/v1/client/allocation/x/restart"),
            Duration::from_secs(45)
        );
        assert_eq!(
            kill_time(&alloc, "/v1/client/allocation/x/restart?task=c"),
            Duration::from_secs(45)
        );
        for path in [
            "/v1/client/allocation/x/signal",
            "/v1/client/fs/logs/x?wait=3s",
        ] {
            assert_eq!(kill_time(&alloc, path), Duration::ZERO, "{path}");
        }
        let none = berth_structs::Allocation::default();
        assert_eq!(
            kill_time(&none, "/v1/client/allocation/x/restart"),
            Duration::ZERO
        );
    }

    #[test]
    fn a_request_that_waits_gets_its_wait_on_top_of_the_call_timeout() {
        assert_eq!(
            deadline_of("/v1/client/allocation/a/restart"),
            CLIENT_CALL_TIMEOUT
        );
        assert_eq!(
            deadline_of("/v1/client/fs/logs/a?wait=20s&offset=3"),
            CLIENT_CALL_TIMEOUT + Duration::from_secs(20)
        );
        assert_eq!(
            deadline_of("/v1/client/fs/logs/a?wait=9999h"),
            CLIENT_CALL_TIMEOUT + Duration::from_secs(300)
        );
    }
}
