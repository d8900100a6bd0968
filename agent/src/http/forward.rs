//! Both ends of HTTP forwarding. A client-only agent answers what it does
//! not serve itself by sending the request over its gRPC connection to the
//! servers (`Agent.ForwardHttp`), so forwarding follows the client's
//! failover and sees the same partitions; a server runs the request
//! through its own HTTP API in-process and returns the answer as is.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use berth_proto::berth::v1 as pb;
use pb::agent_client::AgentClient;
use pb::agent_server::AgentServer;
use tonic::Code;
use tower::ServiceExt;

use super::agent_api::AgentInfo;
use super::query::MAX_BLOCKING_WAIT;
use super::{body_too_large_message, ApiError, MAX_REQUEST_BODY};

/// How long a forwarded request may take to reach the servers and be
/// answered (a blocking query: on top of its wait).
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer a forwarded request brings back.
pub const MAX_FORWARDED_ANSWER: usize = 64 * 1024 * 1024;
/// Room for the message's other fields around a body at its limit.
const ENVELOPE: usize = 64 * 1024;

/// Request headers that reach the servers; the rest concern only the hop
/// to this agent.
/// The ACL token travels too: the servers check it.
/// So does the mark of a write a server that does not lead sent on to the
/// leader, which is never sent on again.
const REQUEST_HEADERS: [HeaderName; 5] = [
    header::CONTENT_TYPE,
    header::ACCEPT,
    HeaderName::from_static(super::acl::TOKEN_HEADER),
    header::AUTHORIZATION,
    HeaderName::from_static(super::leader_gate::FORWARDED_HEADER),
];

/// Whether a response header travels back: hop-by-hop headers and the
/// length (recomputed here) do not.
pub(crate) fn answer_header(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "content-length" | "transfer-encoding" | "connection" | "keep-alive" | "date"
    )
}

/// A client-only agent's API beyond its node-local routes: every request
/// under `/v1/` goes to the servers.
pub fn forwarding_router(info: Arc<AgentInfo>) -> Router {
    Router::new().fallback(forward).with_state(info)
}

/// How long the servers may take for `path_and_query`: a request that
/// waits first gets its wait on top (see [`requested_wait`]); one the
/// servers send on to an alloc's node gets the node's time on top, so that
/// a slow node is not taken for a server that does not answer.
fn deadline_of(path_and_query: &str) -> Duration {
    let path = path_and_query.split('?').next().unwrap_or_default();
    if super::client_forward::alloc_of_path(path).is_some() {
        return FORWARD_TIMEOUT.saturating_add(super::client_forward::deadline_of(path_and_query));
    }
    FORWARD_TIMEOUT.saturating_add(requested_wait(path_and_query).unwrap_or_default())
}

/// How long a request may wait before it answers: a blocking query
/// (`?index=`) up to its `wait` (at most 5 minutes, the default), a long
/// poll (`?wait=` alone, logs that follow) its `wait`; `None` for a
/// request that does not wait.
pub(crate) fn requested_wait(path_and_query: &str) -> Option<Duration> {
    let (_, query) = path_and_query.split_once('?')?;
    let mut blocking = false;
    let mut wait = None;
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("index", _)) => blocking = true,
            Some(("wait", w)) => {
                wait = Some(
                    humantime::parse_duration(w)
                        .map_or(MAX_BLOCKING_WAIT, |d| d.min(MAX_BLOCKING_WAIT)),
                );
            }
            _ => {}
        }
    }
    match (blocking, wait) {
        (_, Some(w)) => Some(w),
        (true, None) => Some(MAX_BLOCKING_WAIT),
        (false, None) => None,
    }
}

/// A 503 in the one error shape.
fn unreachable(detail: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("servers unreachable: {detail}"),
    )
}

async fn forward(State(info): State<Arc<AgentInfo>>, req: Request) -> Response {
    match forward_request(&info, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// What the servers say `secret` may do (`GET /v1/acl/token/self`,
/// forwarded as any request): how a client-only agent checks a token on
/// its node-local routes.
pub(crate) async fn resolve_remotely(
    info: &AgentInfo,
    secret: String,
) -> Result<super::acl::Resolved, ApiError> {
    let req = Request::builder()
        .method(Method::GET)
        .uri("/v1/acl/token/self")
        .header(super::acl::TOKEN_HEADER, secret)
        .body(Body::empty())
        .map_err(|e| ApiError::internal(format!("building the token request: {e}")))?;
    let resp = forward_request(info, req).await?;
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1024 * 1024)
        .await
        .map_err(|e| unreachable(format!("reading the servers' answer: {e}")))?;
    let value: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| unreachable(format!("the servers' answer to a token is not JSON: {e}")))?;
    if !status.is_success() {
        let message = value["error"].as_str().unwrap_or("the token was refused");
        return Err(ApiError::new(status, message.to_string()));
    }
    let acl = serde_json::from_value(value["acl"].clone())
        .map_err(|e| unreachable(format!("the servers' answer to a token has no ACL: {e}")))?;
    Ok(super::acl::Resolved {
        acl,
        expires_ms: value["expiration_time_ms"].as_i64(),
    })
}

/// `req` as the message that carries it over the agent protocol, and how
/// long the servers may take for it.
pub(crate) async fn to_message(req: Request) -> Result<(pb::HttpRequest, Duration), ApiError> {
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    if !path_and_query.starts_with("/v1/") {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("unknown API path {}", req.uri().path()),
        ));
    }
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, MAX_REQUEST_BODY)
        .await
        .map_err(|_| ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, body_too_large_message()))?;
    let headers = REQUEST_HEADERS
        .iter()
        .filter_map(|name| {
            parts.headers.get(name).map(|v| pb::HttpHeader {
                name: name.as_str().to_string(),
                value: v.as_bytes().to_vec(),
            })
        })
        .collect();
    let deadline = deadline_of(&path_and_query);
    let message = pb::HttpRequest {
        method: parts.method.as_str().to_string(),
        path_and_query,
        headers,
        body: body.to_vec(),
    };
    Ok((message, deadline))
}

/// The largest forwarded answer a client of the `Agent` service decodes,
/// and the largest request it encodes.
pub(crate) const AGENT_CLIENT_LIMITS: (usize, usize) = (
    MAX_FORWARDED_ANSWER.saturating_add(ENVELOPE),
    MAX_REQUEST_BODY.saturating_add(ENVELOPE),
);

async fn forward_request(info: &AgentInfo, req: Request) -> Result<Response, ApiError> {
    let Some(client) = info.client_role.get() else {
        if !req.uri().path().starts_with("/v1/") {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("unknown API path {}", req.uri().path()),
            ));
        }
        return Err(unreachable("the client role has not started yet"));
    };
    let path = req.uri().path().to_string();
    let (message, deadline) = to_message(req).await?;
    let started = tokio::time::Instant::now();
    let mut grpc = AgentClient::new(client.node_channel())
        .max_decoding_message_size(AGENT_CLIENT_LIMITS.0)
        .max_encoding_message_size(AGENT_CLIENT_LIMITS.1);
    // Each server is tried once at most, within the one deadline: a
    // failed attempt has already moved the client on to the next.
    let mut last_error = String::from("no server answered");
    for _ in 0..client.servers().count() {
        let left = deadline.saturating_sub(started.elapsed());
        if left.is_zero() {
            break;
        }
        let server = client.servers().current();
        let server_addr = client.servers().current_addr().to_string();
        let mut r = tonic::Request::new(message.clone());
        r.set_timeout(left);
        match tokio::time::timeout(left, grpc.forward_http(r)).await {
            Ok(Ok(answer)) => return answer_of(answer.into_inner()),
            Ok(Err(status)) if !transport_failure(status.code()) => {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!(
                        "the server refused the forwarded request: {}",
                        status.message()
                    ),
                ));
            }
            Ok(Err(status)) => {
                last_error = format!("{server_addr}: {}", status.message());
            }
            Err(_) => {
                client.servers().failover_from(server);
                last_error = format!("{server_addr}: no answer within {deadline:?}");
            }
        }
    }
    tracing::warn!(path = %path, error = %last_error, "forwarding an API request failed");
    Err(unreachable(last_error))
}

/// Whether a gRPC failure means the server was not reached or did not
/// answer in time (try another), rather than an answer.
fn transport_failure(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
    )
}

/// The servers' answer as this agent's.
pub(crate) fn answer_of(a: pb::HttpResponse) -> Result<Response, ApiError> {
    relayed_answer("the server", a.status, a.headers, a.body)
}

/// An answer relayed over gRPC (by `who`: the server, a node) as this
/// agent's: its status, the headers that travel back, its body.
pub(crate) fn relayed_answer(
    who: &str,
    status: u32,
    headers: Vec<pb::HttpHeader>,
    body: Vec<u8>,
) -> Result<Response, ApiError> {
    let status = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("{who} answered an invalid status {status}"),
            )
        })?;
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    for h in headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) else {
            continue;
        };
        if answer_header(&name) {
            resp.headers_mut().append(name, value);
        }
    }
    Ok(resp)
}

/// The server's end: runs forwarded requests through `router`, the
/// server's own HTTP API.
pub struct ForwardService {
    router: Router,
}

/// The `Agent` service's one method: a forwarded request is at most an
/// API request body and its envelope.
const AGENT_METHODS: &[berth_server::MethodLimit] = &[berth_server::MethodLimit::open(
    "/berth.v1.Agent/ForwardHttp",
    MAX_REQUEST_BODY + ENVELOPE,
)];

/// The `Agent` gRPC service of a server, answering forwarded requests
/// with `router`, behind the agent protocol's limits on what a peer sends
/// (see [`berth_server::limits`]).
pub fn forward_service(
    router: Router,
    server: &std::sync::Arc<berth_server::Server>,
) -> berth_server::Limited<AgentServer<ForwardService>> {
    let svc = AgentServer::new(ForwardService { router })
        .max_decoding_message_size(MAX_REQUEST_BODY.saturating_add(ENVELOPE))
        .max_encoding_message_size(MAX_FORWARDED_ANSWER.saturating_add(ENVELOPE));
    berth_server::Limited::new(svc, AGENT_METHODS, server)
}

#[tonic::async_trait]
impl pb::agent_server::Agent for ForwardService {
    async fn forward_http(
        &self,
        request: tonic::Request<pb::HttpRequest>,
    ) -> Result<tonic::Response<pb::HttpResponse>, tonic::Status> {
        let r = request.into_inner();
        if !r.path_and_query.starts_with("/v1/") {
            return Err(tonic::Status::invalid_argument(format!(
                "forwarded path {:?} is not under /v1/",
                r.path_and_query
            )));
        }
        let method = Method::from_bytes(r.method.as_bytes()).map_err(|_| {
            tonic::Status::invalid_argument(format!("forwarded method {:?} is invalid", r.method))
        })?;
        let mut builder = axum::http::Request::builder()
            .method(method)
            .uri(&r.path_and_query);
        for h in &r.headers {
            if REQUEST_HEADERS.iter().any(|n| n.as_str() == h.name) {
                builder = builder.header(h.name.as_str(), h.value.as_slice());
            }
        }
        let req = builder.body(Body::from(r.body)).map_err(|e| {
            tonic::Status::invalid_argument(format!("forwarded request is invalid: {e}"))
        })?;
        let resp = match self.router.clone().oneshot(req).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
        let (parts, body) = resp.into_parts();
        let body = axum::body::to_bytes(body, MAX_FORWARDED_ANSWER)
            .await
            .map_err(|e| {
                tonic::Status::resource_exhausted(format!(
                    "the answer is larger than the {} forwarding limit or unreadable: {e}",
                    super::describe_size(MAX_FORWARDED_ANSWER as u64)
                ))
            })?;
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| answer_header(name))
            .map(|(name, value)| pb::HttpHeader {
                name: name.as_str().to_string(),
                value: value.as_bytes().to_vec(),
            })
            .collect();
        Ok(tonic::Response::new(pb::HttpResponse {
            status: u32::from(parts.status.as_u16()),
            headers,
            body: body.to_vec(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::agent_api::{agent_router, AgentInfo};
    use berth_client::{Client, ClientConfig};
    use berth_sync::{Shutdown, ShutdownSender};
    use berth_testutil::wait_for;

    /// A real server on `dir` serving the agent protocol, the forwarding
    /// service included, on loopback; its address.
    async fn serve_server(
        dir: &std::path::Path,
    ) -> (
        Arc<berth_server::Server>,
        std::net::SocketAddr,
        ShutdownSender,
    ) {
        let server = berth_server::Server::open(berth_server::ServerConfig::new(dir))
            .expect("the server opens");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, mut stop_rx) = Shutdown::channel();
        let router = tonic::transport::Server::builder()
            .add_service(berth_server::node_service(&server))
            .add_service(berth_server::csi_volume_service(&server))
            .add_service(forward_service(
                crate::http::router(server.clone()),
                &server,
            ));
        tokio::spawn(router.serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async move {
                let _ = stop_rx.wait().await;
            },
        ));
        (server, addr, stop_tx)
    }

    /// A client-only agent's API over a running client of `servers`.
    async fn client_agent(
        dir: &std::path::Path,
        servers: Vec<String>,
    ) -> (Router, Arc<Client>, ShutdownSender) {
        let client = Client::start(
            ClientConfig {
                local_api: Some(crate::http::client_forward::local_api_factory()),
                ..ClientConfig::new(dir.to_path_buf(), servers.clone())
            },
            Shutdown::channel().1,
        )
        .await
        .expect("the client starts");
        let (stop_tx, stop_rx) = Shutdown::channel();
        tokio::spawn(client.clone().run(stop_rx));
        let info = Arc::new(AgentInfo::new(false, true, dir.to_path_buf(), servers));
        let _ = info.client_role.set(client.clone());
        (agent_router(None, info), client, stop_tx)
    }

    async fn call(
        api: &Router,
        method: &str,
        uri: &str,
        body: &str,
    ) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = api.clone().oneshot(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (parts.status, parts.headers, value)
    }

    /// A client-only agent answers its node-local routes itself, and the
    /// rest of the API with the server's answer as is: status, body and
    /// X-Berth-Index.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_agent_answers_its_own_routes_and_forwards_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let (server, addr, _stop_server) = serve_server(&dir.path().join("server")).await;
        let (api, client, stop_client) =
            client_agent(&dir.path().join("client"), vec![format!("http://{addr}")]).await;
        wait_for("the node to register", Duration::from_secs(20), || {
            client.registered()
        })
        .await;

        let (status, _, me) = call(&api, "GET", "/v1/agent/self", "").await;
        assert_eq!(status, StatusCode::OK, "{me}");
        assert_eq!(me["roles"], serde_json::json!(["client"]));
        assert_eq!(me["client"]["registered"], true);
        assert_eq!(me["client"]["node_id"], client.node().id.as_str());

        // Forwarded: the node list of the server.
        let (status, _, nodes) = call(&api, "GET", "/v1/nodes", "").await;
        assert_eq!(status, StatusCode::OK, "{nodes}");
        assert!(nodes.to_string().contains(&client.node().id), "{nodes}");
        // The server's errors come back as they are.
        let (status, _, e) = call(&api, "PUT", "/v1/jobs", "{not json").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{e}");
        assert!(e["error"].is_string(), "{e}");
        let (status, _, e) = call(&api, "GET", "/v1/job/nope", "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{e}");

        // A job placed on the server runs here; the client lists it as it
        // sees it.
        let mut job = berth_structs::Job {
            id: "j".into(),
            name: "j".into(),
            job_type: berth_structs::JobType::Batch,
            datacenters: vec!["dc1".into()],
            task_groups: vec![berth_structs::TaskGroup {
                name: "g".into(),
                count: 1,
                tasks: vec![berth_structs::Task {
                    name: "t".into(),
                    driver: "raw_exec".into(),
                    config: berth_structs::TaskConfig {
                        command: "/bin/true".into(),
                        args: Vec::new(),
                        ..berth_structs::TaskConfig::default()
                    },
                    ..berth_structs::Task::default()
                }],
                ..berth_structs::TaskGroup::default()
            }],
            ..berth_structs::Job::default()
        };
        job.task_groups[0].tasks[0].resources.cpu = 10;
        job.task_groups[0].tasks[0].resources.memory_mb = 10;
        server.register_job(job).await.expect("the job registers");
        let (status, headers, allocs) = call(&api, "GET", "/v1/job/j/allocations", "").await;
        assert_eq!(status, StatusCode::OK, "{allocs}");
        assert!(headers.contains_key("x-berth-index"), "{headers:?}");
        let alloc_id = allocs[0]["id"].as_str().expect("an alloc").to_string();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let (status, _, mine) = call(&api, "GET", "/v1/client/allocations", "").await;
            assert_eq!(status, StatusCode::OK, "{mine}");
            // Whether the task starts does not matter here (a unit test
            // binary is no executor): the client runs the alloc.
            if mine[0]["id"] == alloc_id.as_str() && mine[0]["task_states"]["t"].is_object() {
                assert_eq!(mine[0]["job_id"], "j");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{mine}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (status, _, one) = call(
            &api,
            "GET",
            &format!("/v1/client/allocation/{alloc_id}"),
            "",
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{one}");
        assert_eq!(one["id"], alloc_id.as_str());
        let (status, _, e) = call(&api, "GET", "/v1/client/allocation/nope", "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{e}");
        assert!(
            e["error"].as_str().unwrap_or_default().contains("\"nope\""),
            "{e}"
        );
        stop_client.shutdown();
    }

    /// With no server reachable, a forwarded request answers 503 in the one
    /// error shape within the forward timeout, while the node-local routes
    /// keep answering.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_forward_that_reaches_no_server_answers_503_in_bounded_time() {
        let dir = tempfile::tempdir().unwrap();
        let dead: Vec<String> = (0..2)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                format!("http://{}", l.local_addr().unwrap())
            })
            .collect();
        let (api, _client, stop_client) = client_agent(dir.path(), dead).await;
        let started = std::time::Instant::now();
        let (status, headers, e) = call(&api, "GET", "/v1/jobs", "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{e}");
        assert_eq!(headers["content-type"], "application/json");
        assert!(
            e["error"]
                .as_str()
                .unwrap_or_default()
                .starts_with("servers unreachable: "),
            "{e}"
        );
        assert!(
            started.elapsed() < FORWARD_TIMEOUT + Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let (status, _, me) = call(&api, "GET", "/v1/agent/self", "").await;
        assert_eq!(status, StatusCode::OK, "{me}");
        assert_eq!(me["client"]["registered"], false);
        let (status, _, mine) = call(&api, "GET", "/v1/client/allocations", "").await;
        assert_eq!(status, StatusCode::OK, "{mine}");
        assert_eq!(mine, serde_json::json!([]));
        // Not under /v1/: not forwarded.
        let (status, _, e) = call(&api, "GET", "/metrics", "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{e}");
        stop_client.shutdown();
    }

    #[test]
    fn a_blocking_query_gets_its_wait_on_top_of_the_forward_timeout() {
        assert_eq!(deadline_of("/v1/jobs"), FORWARD_TIMEOUT);
        assert_eq!(deadline_of("/v1/jobs?prefix=a"), FORWARD_TIMEOUT);
        assert_eq!(
            deadline_of("/v1/job/x/allocations?index=3&wait=20s"),
            FORWARD_TIMEOUT + Duration::from_secs(20)
        );
        assert_eq!(
            deadline_of("/v1/job/x/allocations?index=3"),
            FORWARD_TIMEOUT + MAX_BLOCKING_WAIT
        );
        assert_eq!(
            deadline_of("/v1/job/x/allocations?index=3&wait=99999h"),
            FORWARD_TIMEOUT + MAX_BLOCKING_WAIT
        );
        // A request for an alloc's node: the node's time on top.
        assert_eq!(
            deadline_of("/v1/client/fs/logs/a?wait=30s"),
            FORWARD_TIMEOUT
                + crate::http::client_forward::CLIENT_CALL_TIMEOUT
                + Duration::from_secs(30)
        );
        assert_eq!(
            deadline_of("/v1/client/allocation/a/restart"),
            FORWARD_TIMEOUT + crate::http::client_forward::CLIENT_CALL_TIMEOUT
        );
    }
}
