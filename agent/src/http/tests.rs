//! The API's errors, through the real router and a real server on a temp
//! dir: every status has the one shape `{"error": "<message>"}` with
//! `content-type: application/json`, and the message names the problem.

use axum::body::Bytes;
use berth_sync::Shutdown;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::Router;
use berth_server::{Server, ServerConfig};
use serde_json::{json, Value};
use tower::ServiceExt;

use super::*;

/// A router over a real server whose state lives in a temp dir.
pub(super) struct TestApi {
    pub router: Router,
    pub server: Arc<Server>,
    _dir: tempfile::TempDir,
}

impl TestApi {
    pub fn new() -> TestApi {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = Server::open(ServerConfig::new(dir.path())).expect("open server");
        TestApi {
            router: router(server.clone()),
            server,
            _dir: dir,
        }
    }
}

/// An answer: status, headers, body.
pub(super) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    /// The message of an error answer, after checking its shape: JSON
    /// content type, an object with exactly one key `error`, a non-empty
    /// string. Panics when the shape is wrong.
    pub fn error_message(&self) -> String {
        self.checked_error_message()
            .unwrap_or_else(|problem| panic!("{problem}"))
    }

    /// [`Self::error_message`], or what is wrong with the shape.
    pub fn checked_error_message(&self) -> Result<String, String> {
        let body = String::from_utf8_lossy(&self.body);
        let ct = self
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !ct.starts_with("application/json") {
            return Err(format!(
                "{} answered content-type {ct:?}, body {body:?}",
                self.status
            ));
        }
        let v: Value = serde_json::from_slice(&self.body).map_err(|e| {
            format!(
                "{} answered a body that is not JSON ({e}): {body:?}",
                self.status
            )
        })?;
        match v.as_object().map(|o| (o.len(), o.get("error"))) {
            Some((1, Some(Value::String(m)))) if !m.is_empty() => Ok(m.clone()),
            _ => Err(format!(
                "{} answered {v} instead of {{\"error\": \"<message>\"}}",
                self.status
            )),
        }
    }
}

pub(super) async fn call(
    router: &Router,
    method: Method,
    uri: &str,
    content_type: Option<&str>,
    body: Body,
) -> Answer {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(ct) = content_type {
        req = req.header(header::CONTENT_TYPE, ct);
    }
    let resp = router
        .clone()
        .oneshot(req.body(body).expect("request"))
        .await
        .expect("the router is infallible");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("read body")
        .to_vec();
    Answer {
        status,
        headers,
        body,
    }
}

async fn get(router: &Router, uri: &str) -> Answer {
    call(router, Method::GET, uri, None, Body::empty()).await
}

/// `method` on `uri` is a JSON 405 that names the methods `allowed` there
/// and keeps the Allow header.
async fn assert_not_allowed(router: &Router, method: Method, uri: &str, allowed: &str) {
    let a = call(router, method.clone(), uri, None, Body::empty()).await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
    assert_eq!(
        a.error_message(),
        format!("method {method} is not allowed on {uri} (allowed: {allowed})")
    );
    assert!(a.headers.contains_key(header::ALLOW), "Allow is kept");
}

async fn put_json(router: &Router, uri: &str, body: impl Into<Body>) -> Answer {
    call(
        router,
        Method::PUT,
        uri,
        Some("application/json"),
        body.into(),
    )
    .await
}

#[tokio::test]
async fn an_unknown_path_is_a_json_404_naming_it() {
    let api = TestApi::new();
    let a = get(&api.router, "/v1/foo").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.error_message(), "unknown API path /v1/foo");
    let a = call(&api.router, Method::DELETE, "/", None, Body::empty()).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.error_message(), "unknown API path /");
}

#[tokio::test]
async fn a_wrong_method_is_a_json_405_naming_the_allowed_ones() {
    let api = TestApi::new();
    assert_not_allowed(&api.router, Method::POST, "/v1/jobs", "GET, HEAD, PUT").await;
    assert_not_allowed(
        &api.router,
        Method::GET,
        "/v1/volume/csi/v/detach",
        "DELETE",
    )
    .await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_a_json_413_naming_the_limit() {
    let api = TestApi::new();
    let big = vec![b' '; MAX_REQUEST_BODY + 1];
    let a = put_json(&api.router, "/v1/jobs", big.clone()).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        a.error_message(),
        "request body is larger than the 2 MiB limit"
    );
    // A body announced too large is refused before it is read.
    let req = Request::builder()
        .method(Method::PUT)
        .uri("/v1/jobs")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, (50u64 * 1024 * 1024).to_string())
        .body(Body::empty())
        .unwrap();
    let resp = api.router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // A body of unknown length (chunked) is cut off at the limit too.
    let stream = futures_free_stream(big);
    let a = put_json(&api.router, "/v1/volume/csi/v/create", stream).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        a.error_message(),
        "request body is larger than the 2 MiB limit"
    );
}

/// A body without a known length, in 64 KiB frames.
fn futures_free_stream(bytes: Vec<u8>) -> Body {
    let chunks: Vec<Result<Bytes, std::io::Error>> = bytes
        .chunks(64 * 1024)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    Body::from_stream(tokio_stream::iter(chunks))
}

#[tokio::test]
async fn a_body_that_is_not_json_is_a_json_415() {
    let api = TestApi::new();
    let a = call(&api.router, Method::PUT, "/v1/jobs", None, Body::from("{}")).await;
    assert_eq!(a.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(
        a.error_message(),
        "request body must be JSON: set content-type: application/json"
    );
    let a = call(
        &api.router,
        Method::PUT,
        "/v1/jobs",
        Some("application/x-www-form-urlencoded"),
        Body::from("job=x"),
    )
    .await;
    assert_eq!(a.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(
        a.error_message()
            .contains("content-type is \"application/x-www-form-urlencoded\""),
        "{}",
        a.error_message()
    );
}

#[tokio::test]
async fn malformed_json_is_a_json_400_with_its_line_and_column() {
    let api = TestApi::new();
    let a = put_json(&api.router, "/v1/jobs", r#"{"job": }"#).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        a.error_message(),
        "invalid JSON at line 1 column 9: expected value"
    );
    let a = put_json(&api.router, "/v1/jobs", "").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        a.error_message()
            .starts_with("invalid JSON at line 1 column 0: EOF"),
        "{}",
        a.error_message()
    );
    let e = decode_json::<Value>(b"{} trailing").unwrap_err();
    assert_eq!(e.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        e.message,
        "invalid JSON at line 1 column 4: trailing characters"
    );
}

#[tokio::test]
async fn json_of_the_wrong_shape_is_a_json_422_naming_the_field() {
    let api = TestApi::new();
    let a = put_json(&api.router, "/v1/jobs", "{}").await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.error_message(), "missing field \"job\"");
    let a = put_json(&api.router, "/v1/jobs", r#"{"job": {"id": 5}}"#).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        a.error_message(),
        "job.id: invalid type: integer \"5\", expected a string"
    );
    let a = put_json(&api.router, "/v1/volume/csi/v", r#""text""#).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        a.error_message(),
        "invalid type: string \"text\", expected struct VolumeSubmit"
    );
}

#[tokio::test]
async fn a_secret_that_does_not_fit_is_not_echoed() {
    let api = TestApi::new();
    for secrets in [
        json!("hunter2-secret"),
        json!({"token": ["hunter2-secret"]}),
    ] {
        let body = json!({"volume": {"id": "v", "plugin_id": "p", "secrets": secrets}});
        let a = put_json(&api.router, "/v1/volume/csi/v", body.to_string()).await;
        assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
        let m = a.error_message();
        assert!(m.starts_with("volume.secrets"), "{m}");
        assert!(
            m.ends_with(": invalid value (secrets are not shown)"),
            "{m}"
        );
        assert!(!m.contains("hunter2"), "{m}");
    }
}

#[tokio::test]
async fn a_bad_query_string_is_a_json_400_naming_the_parameter() {
    let api = TestApi::new();
    let a = call(
        &api.router,
        Method::DELETE,
        "/v1/volume/csi/v?force=maybe",
        None,
        Body::empty(),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let m = a.error_message();
    assert!(
        m.starts_with("invalid query string \"force=maybe\": force"),
        "{m}"
    );
    let a = get(&api.router, "/v1/job/x/allocations?index=soon").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let m = a.error_message();
    assert!(m.contains("index: invalid digit"), "{m}");
}

#[tokio::test]
async fn an_undecodable_path_parameter_is_a_json_400() {
    let api = TestApi::new();
    let a = get(&api.router, "/v1/job/%FF").await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let m = a.error_message();
    assert!(m.starts_with("invalid URL path /v1/job/%FF: "), "{m}");
}

#[tokio::test]
async fn handler_errors_keep_the_same_shape() {
    let api = TestApi::new();
    let a = get(&api.router, "/v1/job/nope").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.error_message().contains("nope"), "{}", a.error_message());
    let a = put_json(
        &api.router,
        "/v1/volume/csi/other",
        json!({"volume": {"id": "v", "plugin_id": "p"}}).to_string(),
    )
    .await;
    assert!(a.status.is_client_error(), "{}", a.status);
    a.error_message();
}

#[tokio::test]
async fn a_non_json_error_from_anywhere_is_rewritten_into_the_one_shape() {
    // A route that answers plain text, as axum's own extractors do: the
    // layer still turns it into the one shape, keeping its text.
    let app = Router::new()
        .route(
            "/plain",
            axum::routing::get(|| async { (StatusCode::CONFLICT, "plain text refusal") }),
        )
        .route(
            "/empty",
            axum::routing::get(|| async { StatusCode::IM_A_TEAPOT }),
        )
        .layer(axum::middleware::from_fn(one_error_shape));
    let a = call(&app, Method::GET, "/plain", None, Body::empty()).await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    assert_eq!(a.error_message(), "plain text refusal");
    let a = call(&app, Method::GET, "/empty", None, Body::empty()).await;
    assert_eq!(a.status, StatusCode::IM_A_TEAPOT);
    assert_eq!(a.error_message(), "i'm a teapot");
}

#[test]
fn sizes_are_described_for_people() {
    assert_eq!(describe_size(MAX_REQUEST_BODY as u64), "2 MiB");
    assert_eq!(describe_size(50 * 1024 * 1024), "50 MiB");
    assert_eq!(describe_size(50 * 1024 * 1024 + 100 * 1024), "50.1 MiB");
    assert_eq!(describe_size(1536), "1.5 KiB");
    assert_eq!(describe_size(12), "12 bytes");
    assert!(describe_size(u64::MAX).ends_with(" GiB"));
}

/// The API served on a real socket: a body over the limit from the CLI's
/// own client gets the server's 413 message, not a broken pipe.
#[test]
fn the_cli_client_reports_the_servers_413_for_a_body_over_the_limit() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = rt.block_on(async { TestApi::new() });
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop_tx, stop_rx) = Shutdown::channel();
    let served = rt.spawn(serve_router(listener, router(api.server.clone()), stop_rx));
    let client = berth_api::ApiClient::new(&format!("http://{addr}")).unwrap();
    let big = json!({ "job": "x".repeat(16 * 1024 * 1024) });
    let err = client.put("/v1/jobs", &big).unwrap_err();
    stop_tx.shutdown();
    let _ = rt.block_on(served);
    let api_err = err
        .api()
        .unwrap_or_else(|| panic!("expected the API's answer, got: {err:#}"));
    assert_eq!(api_err.status, 413);
    assert_eq!(
        api_err.message,
        "request body is larger than the 2 MiB limit"
    );
}

async fn post_json(router: &Router, uri: &str, body: Value) -> Answer {
    call(
        router,
        Method::POST,
        uri,
        Some("application/json"),
        Body::from(body.to_string()),
    )
    .await
}

fn body_json(a: &Answer) -> Value {
    assert_eq!(
        a.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&a.body)
    );
    serde_json::from_slice(&a.body).expect("JSON answer")
}

async fn api_with_node(id: &str, name: &str) -> TestApi {
    let api = TestApi::new();
    api.server
        .register_node(berth_structs::Node {
            id: id.into(),
            name: name.into(),
            ..Default::default()
        })
        .await
        .expect("register node");
    api
}

#[tokio::test]
async fn drain_and_eligibility_routes_answer_the_node_by_id_prefix_or_name() {
    let api = api_with_node("5e1f0a2b-0000-4000-8000-000000000001", "worker-1").await;
    let id = "5e1f0a2b-0000-4000-8000-000000000001";

    let n = body_json(
        &post_json(
            &api.router,
            "/v1/node/worker-1/drain",
            json!({"enable": true, "deadline": "30m"}),
        )
        .await,
    );
    assert_eq!(n["id"], id);
    assert_eq!(n["drain"], true);
    assert_eq!(n["scheduling_eligibility"], "ineligible");
    assert_eq!(n["drain_strategy"]["deadline"], "30m");

    // Without a deadline: an hour; -force: now.
    let n =
        body_json(&post_json(&api.router, "/v1/node/5e1f/drain", json!({"enable": true})).await);
    assert_eq!(n["drain_strategy"]["deadline"], "1h");
    let n = body_json(
        &post_json(
            &api.router,
            &format!("/v1/node/{id}/drain"),
            json!({"enable": true, "force": true}),
        )
        .await,
    );
    assert_eq!(n["drain_strategy"]["deadline"], "0s");

    // A draining node cannot be made eligible.
    let a = post_json(
        &api.router,
        "/v1/node/worker-1/eligibility",
        json!({"eligible": true}),
    )
    .await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    assert!(
        a.error_message()
            .contains("is draining; disable the drain first"),
        "{}",
        a.error_message()
    );

    let n = body_json(
        &post_json(
            &api.router,
            "/v1/node/worker-1/drain",
            json!({"enable": false}),
        )
        .await,
    );
    assert_eq!(n["drain"], false);
    assert_eq!(n["drain_strategy"], Value::Null);
    assert_eq!(n["scheduling_eligibility"], "ineligible");

    let n = body_json(
        &post_json(
            &api.router,
            "/v1/node/worker-1/eligibility",
            json!({"eligible": true}),
        )
        .await,
    );
    assert_eq!(n["scheduling_eligibility"], "eligible");
    let n = body_json(
        &post_json(
            &api.router,
            "/v1/node/worker-1/eligibility",
            json!({"eligible": false}),
        )
        .await,
    );
    assert_eq!(n["scheduling_eligibility"], "ineligible");
    let listed = body_json(&get(&api.router, "/v1/nodes").await);
    assert_eq!(listed[0]["scheduling_eligibility"], "ineligible");
    assert_eq!(listed[0]["drain"], false);

    let allocs = get(&api.router, "/v1/node/worker-1/allocations").await;
    assert!(allocs.headers.contains_key("x-berth-index"));
    assert_eq!(body_json(&allocs), json!([]));
}

#[tokio::test]
async fn bad_drain_and_eligibility_requests_are_refused_naming_the_problem() {
    let api = api_with_node("n1", "n1").await;
    let cases = [
        (
            "/v1/node/n1/drain",
            json!({"enable": true, "deadline": "soon"}),
            StatusCode::BAD_REQUEST,
            "deadline \"soon\": ",
        ),
        (
            "/v1/node/n1/drain",
            json!({"enable": true, "deadline": "100years"}),
            StatusCode::BAD_REQUEST,
            "drain deadline: 100years is too large (at most 1year)",
        ),
        (
            "/v1/node/n1/drain",
            json!({"enable": true, "deadline": "1h", "force": true}),
            StatusCode::BAD_REQUEST,
            "give either deadline or force, not both",
        ),
        (
            "/v1/node/n1/drain",
            json!({"enable": false, "force": true}),
            StatusCode::BAD_REQUEST,
            "deadline and force apply only when enabling a drain",
        ),
        (
            "/v1/node/n1/drain",
            json!({"enable": true, "dedline": "1h"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown field \"dedline\"",
        ),
        (
            "/v1/node/n1/drain",
            json!({"deadline": "1h"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "missing field \"enable\"",
        ),
        (
            "/v1/node/n1/eligibility",
            json!({"eligible": "yes"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "eligible: invalid type",
        ),
        (
            "/v1/node/nope/drain",
            json!({"enable": true}),
            StatusCode::NOT_FOUND,
            "node \"nope\" not found",
        ),
        (
            "/v1/node/nope/eligibility",
            json!({"eligible": false}),
            StatusCode::NOT_FOUND,
            "node \"nope\" not found",
        ),
    ];
    for (uri, body, status, message) in cases {
        let a = post_json(&api.router, uri, body.clone()).await;
        assert_eq!(a.status, status, "{uri} {body}: {}", a.error_message());
        assert!(
            a.error_message().contains(message),
            "{uri} {body}: {:?} lacks {message:?}",
            a.error_message()
        );
    }
    // Nothing changed.
    let n = api.server.node("n1").unwrap();
    assert!(n.drain_strategy.is_none());
    assert!(n.is_eligible());

    assert_not_allowed(&api.router, Method::GET, "/v1/node/n1/drain", "POST").await;
}

#[tokio::test]
async fn node_answers_never_carry_the_node_secret() {
    let api = TestApi::new();
    let secret = berth_structs::NodeSecret::generate();
    let id = "7a3c0a2b-0000-4000-8000-000000000001";
    api.server
        .register_node_with_secret(
            berth_structs::Node {
                id: id.into(),
                name: "worker-1".into(),
                ..Default::default()
            },
            &secret,
        )
        .await
        .expect("register node");
    for uri in [
        "/v1/nodes".to_string(),
        format!("/v1/node/{id}"),
        "/v1/node/worker-1".to_string(),
        format!("/v1/node/{id}/allocations"),
    ] {
        let a = get(&api.router, &uri).await;
        assert_eq!(a.status, StatusCode::OK, "{uri}");
        let body = String::from_utf8_lossy(&a.body);
        assert!(
            !body.contains(secret.expose()),
            "{uri} answered the secret: {body}"
        );
        assert!(!body.to_lowercase().contains("secret"), "{uri}: {body}");
    }
}

#[tokio::test]
async fn purge_route_removes_the_node_by_name_and_an_unknown_node_is_a_404() {
    let id = "7a2c0d4e-0000-4000-8000-000000000003";
    let api = api_with_node(id, "worker-3").await;
    let a = put_json(&api.router, "/v1/node/worker-3/purge", "{}").await;
    let v = body_json(&a);
    assert_eq!(v["node_id"], id);
    assert_eq!(v["node_name"], "worker-3");
    assert_eq!(v["lost_allocs"], json!([]));
    assert_eq!(v["released"], json!([]));
    assert!(api.server.node(id).is_err(), "the node is gone");

    let a = put_json(&api.router, "/v1/node/worker-3/purge", "{}").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(
        a.error_message().contains("node \"worker-3\" not found"),
        "{}",
        a.error_message()
    );
}

#[tokio::test]
async fn snapshot_routes_answer_in_the_one_shape_and_never_echo_secrets() {
    let api = TestApi::new();
    let secret = json!({"token": "hunter2-secret"});
    let a = put_json(
        &api.router,
        "/v1/volumes/snapshot",
        json!({"volume_id": "nope", "name": "n", "secrets": secret}).to_string(),
    )
    .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    let m = a.error_message();
    assert!(m.contains("\"nope\"") && !m.contains("hunter2"), "{m}");
    let a = put_json(
        &api.router,
        "/v1/volumes/snapshot",
        json!({"volume_id": "v", "secrets": "hunter2-secret"}).to_string(),
    )
    .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!a.error_message().contains("hunter2"));

    // Listing with no plugin anywhere is an empty list; a named plugin the
    // servers do not know is a 404 naming it.
    let a = get(&api.router, "/v1/volumes/snapshot").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(body_json(&a), json!([]));
    let a = get(&api.router, "/v1/volumes/snapshot?plugin_id=hp").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(
        a.error_message().contains("\"hp\" not found"),
        "{}",
        a.error_message()
    );

    // A delete needs both IDs.
    let a = call(
        &api.router,
        Method::DELETE,
        "/v1/volumes/snapshot?plugin_id=hp",
        None,
        Body::empty(),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        a.error_message().contains("snapshot_id"),
        "{}",
        a.error_message()
    );
}

#[tokio::test]
async fn the_one_server_of_an_embedded_store_leads_and_is_its_only_member() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = ServerConfig::new(dir.path());
    config.identity = berth_server::leader::ServerIdentity {
        name: "only".into(),
        rpc_addr: "127.0.0.1:4647".into(),
        http_addr: "127.0.0.1:4646".into(),
    };
    let server = Server::open(config).expect("open server");
    let router = router(server);
    let leader = get(&router, "/v1/status/leader").await;
    assert_eq!(leader.status, StatusCode::OK);
    assert_eq!(leader.body, br#""127.0.0.1:4647""#);
    let members = get(&router, "/v1/operator/servers").await;
    let v: Value = serde_json::from_slice(&members.body).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v[0]["name"], "only");
    assert_eq!(v[0]["leader"], true);
    let peers = get(&router, "/v1/status/peers").await;
    assert_eq!(peers.body, br#"["127.0.0.1:4647"]"#);
}
