//! Property tests of every HTTP request body, path and query string,
//! through the real router over a real server on a temp dir: whatever
//! arrives, the API never panics, never answers a 5xx, and answers every
//! 4xx in the one shape `{"error": "<message>"}`.
//!
//! The one 5xx allowed is a 503 from `PUT /v1/volume/csi/{id}/create` for a
//! volume that passes validation: creating it needs a client that runs the
//! plugin's controller, and none is connected here.
//!
//! Time is paused (and advances on its own when everything waits), so a
//! blocking query with an arbitrary `index` and `wait` answers at once.

use berth_sync::MutexExt;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use axum::body::Body;
use axum::http::{Method, StatusCode};
use berth_testutil::json;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};

use super::tests::{call, Answer, TestApi};

/// Cases per property; all of them together run in a few seconds.
const BODY_BYTES_CASES: u32 = 500;
const MUTATED_JOB_CASES: u32 = 500;
const MUTATED_VOLUME_CASES: u32 = 500;
const PATH_CASES: u32 = 1000;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}

/// Runs `cases` cases of `strategy` through `test` (which answers the
/// status it saw) and says how many ran and what they were answered.
fn check<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<StatusCode, TestCaseError>,
) {
    let ran = AtomicU32::new(0);
    let statuses = Mutex::new(BTreeMap::<u16, u32>::new());
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&strategy, |v| {
        ran.fetch_add(1, Ordering::Relaxed);
        let status = test(v)?;
        let mut tally = statuses.locked();
        let n = tally.entry(status.as_u16()).or_default();
        *n = n.saturating_add(1);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!(
        "{name}: {} cases run, no failure; answers by status: {:?}",
        ran.load(Ordering::Relaxed),
        statuses.locked()
    );
}

/// The invariant every answer keeps.
fn check_answer(
    what: &str,
    a: &Answer,
    may_be_unavailable: bool,
) -> Result<StatusCode, TestCaseError> {
    let allowed_503 = may_be_unavailable && a.status == StatusCode::SERVICE_UNAVAILABLE;
    prop_assert!(
        !a.status.is_server_error() || allowed_503,
        "{what}: answered {} {:?}",
        a.status,
        String::from_utf8_lossy(&a.body)
    );
    if a.status.is_client_error() || a.status.is_server_error() {
        if let Err(problem) = a.checked_error_message() {
            return Err(TestCaseError::fail(format!("{what}: {problem}")));
        }
    } else if !a.body.is_empty() {
        prop_assert!(
            serde_json::from_slice::<Value>(&a.body).is_ok(),
            "{what}: a {} answer that is not JSON: {:?}",
            a.status,
            String::from_utf8_lossy(&a.body)
        );
    }
    Ok(a.status)
}

/// IDs for the path, some of them hostile.
fn path_id() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9_.-]{1,16}",
        Just("data".to_string()),
        Just("..".to_string()),
        Just("%2E%2E%2Fescape".to_string()),
        Just("%FF".to_string()),
        Just("data%5B0%5D".to_string()),
        "(%[0-9A-F]{2}){1,6}",
    ]
}

/// The routes that take a body; the bool says whether a 503 is allowed.
fn body_route() -> impl Strategy<Value = (String, bool)> {
    prop_oneof![
        Just(("/v1/jobs".to_string(), false)),
        path_id().prop_map(|id| (format!("/v1/volume/csi/{id}"), false)),
        path_id().prop_map(|id| (format!("/v1/volume/csi/{id}/create"), true)),
    ]
}

fn content_type() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        6 => Just(Some("application/json".to_string())),
        1 => Just(None),
        1 => Just(Some("application/json; charset=utf-8".to_string())),
        1 => Just(Some("text/plain".to_string())),
        1 => "[ -~]{0,30}".prop_map(Some),
    ]
}

/// A JSON value of any shape, with the numbers and strings that break
/// things, and strings longer than any field or body may be.
fn json_value() -> BoxedStrategy<Value> {
    json::value_of(
        prop_oneof![
            8 => json::leaf(),
            1 => (1usize..200_000).prop_map(|n| Value::String("x".repeat(n))),
        ]
        .boxed(),
    )
}

fn example(path: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn valid_job() -> Value {
    let job = berth_structs::spec::parse_job(&example("jobs/writer.hcl")).expect("example job");
    json!({ "job": job })
}

fn valid_volume() -> Value {
    let vol = berth_structs::spec::parse_volume(&example("volumes/hostpath.hcl"))
        .expect("example volume");
    let mut doc = json!({ "volume": vol });
    // What `volume register` needs besides.
    doc["volume"]["external_id"] = json!("data-on-disk");
    doc
}

#[test]
fn arbitrary_bytes_on_every_body_route_get_an_answer_in_the_one_shape() {
    let rt = runtime();
    let api = rt.block_on(async { TestApi::new() });
    let strategy = (
        body_route(),
        content_type(),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..1024),
            json_value().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
        ],
    );
    check(
        "arbitrary request bodies",
        BODY_BYTES_CASES,
        strategy,
        |((uri, may_503), ct, body)| {
            let a = rt.block_on(call(
                &api.router,
                Method::PUT,
                &uri,
                ct.as_deref(),
                Body::from(body.clone()),
            ));
            check_answer(
                &format!("PUT {uri} ({ct:?}, {} bytes)", body.len()),
                &a,
                may_503,
            )
        },
    );
}

/// Mutations of a valid document sent to `uri`.
fn mutated_documents(name: &str, cases: u32, base: Value, uri: impl Fn(&Value) -> (String, bool)) {
    let rt = runtime();
    let api = rt.block_on(async { TestApi::new() });
    // The unchanged document decodes: the mutations start from a body that
    // gets past decoding to the server.
    let (first_uri, _) = uri(&base);
    let a = rt.block_on(call(
        &api.router,
        Method::PUT,
        &first_uri,
        Some("application/json"),
        Body::from(base.to_string()),
    ));
    assert!(
        a.status != StatusCode::UNPROCESSABLE_ENTITY && a.status != StatusCode::BAD_REQUEST
            || !a.error_message().starts_with("invalid JSON"),
        "{name}: the valid document got {} {:?}",
        a.status,
        String::from_utf8_lossy(&a.body)
    );
    check(
        name,
        cases,
        prop::collection::vec(json::edit_of(json::string(), json_value()), 1..4),
        |mutations| {
            let doc = json::edited(base.clone(), &mutations);
            let (target, may_503) = uri(&doc);
            let body = doc.to_string();
            let a = rt.block_on(call(
                &api.router,
                Method::PUT,
                &target,
                Some("application/json"),
                Body::from(body),
            ));
            check_answer(&format!("PUT {target} after {mutations:?}"), &a, may_503)
        },
    );
}

#[test]
fn mutated_jobs_get_an_answer_in_the_one_shape() {
    mutated_documents("mutated job bodies", MUTATED_JOB_CASES, valid_job(), |_| {
        ("/v1/jobs".to_string(), false)
    });
}

#[test]
fn mutated_volumes_get_an_answer_in_the_one_shape() {
    // The path's ID follows the body's when it is a plain one that fits in
    // a URI (past 64 KiB no client can send the request at all), so that
    // most cases get past the ID check to the server.
    let path_of = |doc: &Value| {
        let id = doc["volume"]["id"]
            .as_str()
            .filter(|id| {
                (1..=4096).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric())
            })
            .unwrap_or("data")
            .to_string();
        id
    };
    mutated_documents(
        "mutated volume register bodies",
        MUTATED_VOLUME_CASES / 2,
        valid_volume(),
        move |doc| (format!("/v1/volume/csi/{}", path_of(doc)), false),
    );
    mutated_documents(
        "mutated volume create bodies",
        MUTATED_VOLUME_CASES / 2,
        valid_volume(),
        move |doc| (format!("/v1/volume/csi/{}/create", path_of(doc)), true),
    );
}

fn path_segment() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop_oneof![
            Just("v1"), Just("job"), Just("jobs"), Just("allocations"), Just("allocation"),
            Just("node"), Just("nodes"), Just("volume"), Just("volumes"), Just("csi"),
            Just("create"), Just("delete"), Just("detach"), Just("plugin"), Just("plugins"),
            Just("agent"), Just("health"), Just("system"), Just("gc"),
        ]
        .prop_map(str::to_string),
        2 => "[a-zA-Z0-9._~-]{0,12}",
        1 => prop_oneof![Just(".."), Just("."), Just("%FF"), Just("%2F"), Just("%00"), Just("%")]
            .prop_map(str::to_string),
        1 => "(%[0-9A-Fa-f]{2}){1,4}",
    ]
}

fn query() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("index".to_string()),
        Just("wait".to_string()),
        Just("force".to_string()),
        Just("node".to_string()),
        "[a-z%0-9]{0,6}",
    ];
    let value = prop_oneof![
        Just("".to_string()),
        Just("true".to_string()),
        Just("1".to_string()),
        Just("-1".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("10s".to_string()),
        Just("99999999999999999h".to_string()),
        Just("%FF".to_string()),
        "[a-zA-Z0-9%+._-]{0,12}",
    ];
    prop::collection::vec((key, value), 0..4).prop_map(|pairs| {
        pairs
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&")
    })
}

/// Paths of the API's routes with arbitrary IDs (most cases), and paths
/// of arbitrary segments.
fn api_path() -> impl Strategy<Value = String> {
    let id = prop_oneof![3 => path_id(), 1 => Just("writer".to_string())];
    let route = prop_oneof![
        Just("/v1/jobs"),
        Just("/v1/job/{id}"),
        Just("/v1/job/{id}/allocations"),
        Just("/v1/allocations"),
        Just("/v1/allocation/{id}"),
        Just("/v1/nodes"),
        Just("/v1/node/{id}"),
        Just("/v1/node/{id}/allocations"),
        Just("/v1/node/{id}/drain"),
        Just("/v1/node/{id}/eligibility"),
        Just("/v1/volumes"),
        Just("/v1/volume/csi/{id}"),
        Just("/v1/volume/csi/{id}/delete"),
        Just("/v1/volume/csi/{id}/detach"),
        Just("/v1/plugins"),
        Just("/v1/plugin/csi/{id}"),
        Just("/v1/agent/health"),
    ];
    let templated = (route, id).prop_map(|(r, id)| r.replace("{id}", &id));
    let free = (any::<bool>(), prop::collection::vec(path_segment(), 0..6)).prop_map(
        |(under_v1, segments)| {
            let root = if under_v1 { "/v1/" } else { "/" };
            format!("{root}{}", segments.join("/"))
        },
    );
    prop_oneof![3 => templated, 1 => free]
}

#[test]
fn arbitrary_paths_and_query_strings_get_an_answer_in_the_one_shape() {
    let rt = runtime();
    let api = rt.block_on(async { TestApi::new() });
    // Something to find: a job, so that job routes also answer 200s.
    let a = rt.block_on(call(
        &api.router,
        Method::PUT,
        "/v1/jobs",
        Some("application/json"),
        Body::from(valid_job().to_string()),
    ));
    assert!(
        a.status.is_success(),
        "{}",
        String::from_utf8_lossy(&a.body)
    );
    let method = prop_oneof![
        4 => Just(Method::GET),
        2 => Just(Method::DELETE),
        1 => Just(Method::PUT),
        1 => Just(Method::POST),
        1 => Just(Method::PATCH),
    ];
    let strategy = (method, api_path(), prop::option::of(query()));
    check(
        "arbitrary paths and query strings",
        PATH_CASES,
        strategy,
        |(method, mut uri, query)| {
            if let Some(q) = &query {
                uri.push('?');
                uri.push_str(q);
            }
            // Only what a client can send: a URI that parses.
            prop_assume!(uri.parse::<axum::http::Uri>().is_ok());
            let a = rt.block_on(call(&api.router, method.clone(), &uri, None, Body::empty()));
            check_answer(&format!("{method} {uri}"), &a, false)
        },
    );
}
