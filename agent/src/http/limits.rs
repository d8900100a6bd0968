//! How many waiting requests an agent holds at once (`limits {
//! max_blocking_queries, max_log_follows }`): a blocking query
//! (`GET ...?index=N`, N > 0) or a log follow (`GET
//! /v1/client/fs/logs/{id}?wait=D`) past its limit is answered 429 at once
//! instead of joining the others that wait.
//!
//! Each admitted request holds an [`InFlight`] slot until its handler
//! ends, also when the client goes away and its request is dropped, so a
//! slot can never leak.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::ApiError;
use crate::config::security::Limits;

/// What a refused client is told to wait before it tries again.
const RETRY_AFTER_SECS: u32 = 1;

/// The kinds of request that wait, each with its own limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// A blocking query: `?index=N` with N above 0.
    BlockingQuery,
    /// A read of task logs that waits for new bytes (`?wait=D`, D above
    /// 0): what `berth alloc logs -f` sends.
    LogFollow,
}

impl Waiting {
    /// The kind of waiting request `method` on `path_and_query` is, if any.
    /// `HEAD` runs the `GET` handler, so it waits as long and counts the
    /// same.
    pub fn of(method: &Method, path: &str, query: Option<&str>) -> Option<Waiting> {
        if method != Method::GET && method != Method::HEAD {
            return None;
        }
        let query = query?;
        let param = |name: &str| {
            query
                .split('&')
                .filter_map(|pair| pair.split_once('='))
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v)
        };
        if path.starts_with("/v1/client/fs/logs/") {
            // A wait that does not parse is refused by the route itself.
            let waits = param("wait")
                .is_some_and(|w| humantime::parse_duration(w).map_or(true, |d| d > Duration::ZERO));
            return waits.then_some(Waiting::LogFollow);
        }
        let blocks = param("index").is_some_and(|i| i.parse::<u64>().map_or(true, |i| i > 0));
        blocks.then_some(Waiting::BlockingQuery)
    }
}

/// The slots of waiting requests of one agent. Cloning shares them.
#[derive(Clone, Debug)]
pub struct ApiLimits {
    blocking_queries: Slots,
    log_follows: Slots,
}

#[derive(Clone, Debug)]
struct Slots {
    free: Arc<Semaphore>,
    max: u32,
    /// The config key that sets `max`, for the refusal.
    key: &'static str,
    what: &'static str,
}

impl Slots {
    fn new(max: u32, key: &'static str, what: &'static str) -> Slots {
        Slots {
            free: Arc::new(Semaphore::new(max as usize)),
            max,
            key,
            what,
        }
    }
}

/// One admitted waiting request; its slot is given back when this is
/// dropped.
#[derive(Debug)]
pub struct InFlight {
    _permit: OwnedSemaphorePermit,
}

impl ApiLimits {
    pub fn new(limits: &Limits) -> ApiLimits {
        ApiLimits {
            blocking_queries: Slots::new(
                limits.max_blocking_queries,
                "limits.max_blocking_queries",
                "blocking queries",
            ),
            log_follows: Slots::new(
                limits.max_log_follows,
                "limits.max_log_follows",
                "log follows",
            ),
        }
    }

    fn slots(&self, kind: Waiting) -> &Slots {
        match kind {
            Waiting::BlockingQuery => &self.blocking_queries,
            Waiting::LogFollow => &self.log_follows,
        }
    }

    /// A slot for a request of `kind`, or the 429 that says the limit is
    /// reached.
    pub fn admit(&self, kind: Waiting) -> Result<InFlight, ApiError> {
        let slots = self.slots(kind);
        match slots.free.clone().try_acquire_owned() {
            Ok(permit) => Ok(InFlight { _permit: permit }),
            Err(_) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "this agent already serves {} {} ({} = {}); try again later",
                    slots.max, slots.what, slots.key, slots.max
                ),
            )),
        }
    }

    /// How many requests of `kind` are in flight now.
    pub fn in_flight(&self, kind: Waiting) -> u32 {
        let slots = self.slots(kind);
        let free = u32::try_from(slots.free.available_permits()).unwrap_or(slots.max);
        slots.max.saturating_sub(free)
    }
}

impl ApiLimits {
    /// `router` with its waiting requests counted against these limits
    /// (the server API that forwarded requests run through).
    pub fn apply(&self, router: axum::Router) -> axum::Router {
        router.layer(axum::middleware::from_fn_with_state(
            self.clone(),
            limit_waiting_requests,
        ))
    }

    /// The limits and what is in flight, for `/v1/agent/self`.
    pub fn view(&self) -> serde_json::Value {
        serde_json::json!({
            "max_blocking_queries": self.blocking_queries.max,
            "blocking_queries": self.in_flight(Waiting::BlockingQuery),
            "max_log_follows": self.log_follows.max,
            "log_follows": self.in_flight(Waiting::LogFollow),
        })
    }
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits::new(&Limits::default())
    }
}

/// The middleware: a waiting request runs holding a slot, or is answered
/// 429 (with `Retry-After`) when none is free.
pub async fn limit_waiting_requests(
    State(limits): State<ApiLimits>,
    req: Request,
    next: Next,
) -> Response {
    let Some(kind) = Waiting::of(req.method(), req.uri().path(), req.uri().query()) else {
        return next.run(req).await;
    };
    let slot = match limits.admit(kind) {
        Ok(slot) => slot,
        Err(refused) => {
            tracing::debug!(path = %req.uri().path(), kind = ?kind, "waiting request refused: limit reached");
            let mut resp = refused.into_response();
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            return resp;
        }
    };
    // The handler builds the whole answer before it returns (long polls,
    // not streams), so the slot is held for as long as the request waits;
    // a client that goes away drops this future, and the slot with it.
    let resp = next.run(req).await;
    drop(slot);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(blocking: u32, follows: u32) -> ApiLimits {
        ApiLimits::new(&Limits {
            max_blocking_queries: blocking,
            max_log_follows: follows,
            ..Limits::default()
        })
    }

    #[test]
    fn waiting_requests_are_told_apart() {
        let get = Method::GET;
        let of = |path, query| Waiting::of(&get, path, query);
        assert_eq!(
            of("/v1/jobs", Some("index=5&wait=10s")),
            Some(Waiting::BlockingQuery)
        );
        assert_eq!(
            of("/v1/client/allocations", Some("index=1")),
            Some(Waiting::BlockingQuery)
        );
        // Index 0 and no index answer at once.
        assert_eq!(of("/v1/jobs", Some("index=0")), None);
        assert_eq!(of("/v1/jobs", Some("prefix=web")), None);
        assert_eq!(of("/v1/jobs", None), None);
        // A malformed index is counted: the route refuses it, but only
        // once it is admitted.
        assert_eq!(
            of("/v1/jobs", Some("index=x")),
            Some(Waiting::BlockingQuery)
        );
        assert_eq!(
            of("/v1/client/fs/logs/abc", Some("type=stdout&wait=30s")),
            Some(Waiting::LogFollow)
        );
        assert_eq!(of("/v1/client/fs/logs/abc", Some("wait=0s")), None);
        assert_eq!(of("/v1/client/fs/logs/abc", Some("limit=10")), None);
        // A log read is never a blocking query.
        assert_eq!(of("/v1/client/fs/logs/abc", Some("index=3")), None);
        // HEAD runs the GET handler and waits as long.
        let head = |path, query| Waiting::of(&Method::HEAD, path, query);
        assert_eq!(
            head("/v1/jobs", Some("index=5&wait=3s")),
            Some(Waiting::BlockingQuery)
        );
        assert_eq!(
            head("/v1/client/fs/logs/abc", Some("wait=30s")),
            Some(Waiting::LogFollow)
        );
        // Writes do not wait.
        assert_eq!(Waiting::of(&Method::PUT, "/v1/jobs", Some("index=5")), None);
    }

    #[test]
    fn the_request_past_the_limit_is_refused_with_429() {
        let l = limits(2, 1);
        let a = l.admit(Waiting::BlockingQuery).expect("first");
        let b = l.admit(Waiting::BlockingQuery).expect("second");
        let refused = l.admit(Waiting::BlockingQuery).expect_err("third");
        let shown = format!("{refused:?}");
        assert!(shown.contains("429"), "{shown}");
        assert!(shown.contains("limits.max_blocking_queries = 2"), "{shown}");
        assert_eq!(l.in_flight(Waiting::BlockingQuery), 2);
        // The other kind has its own slots.
        let f = l.admit(Waiting::LogFollow).expect("a log follow");
        let refused = l.admit(Waiting::LogFollow).expect_err("a second follow");
        assert!(format!("{refused:?}").contains("limits.max_log_follows = 1"));
        drop((a, b, f));
    }

    #[test]
    fn a_finished_request_frees_its_slot() {
        let l = limits(1, 1);
        let first = l.admit(Waiting::BlockingQuery).expect("first");
        assert!(l.admit(Waiting::BlockingQuery).is_err());
        drop(first);
        assert_eq!(l.in_flight(Waiting::BlockingQuery), 0);
        let again = l.admit(Waiting::BlockingQuery).expect("the freed slot");
        // Clones share the slots.
        assert!(l.clone().admit(Waiting::BlockingQuery).is_err());
        drop(again);
    }

    /// Through a router: the request past the limit answers 429 in the
    /// error shape while the first waits, and the slot is free again once
    /// the first is answered, or once its client goes away (its request
    /// future dropped).
    #[tokio::test]
    async fn the_middleware_refuses_past_the_limit_and_frees_on_drop() {
        use axum::body::Body;
        use axum::routing::get;
        use tower::ServiceExt;

        let (release_tx, release_rx) = tokio::sync::watch::channel(false);
        let l = limits(1, 1);
        let router = axum::Router::new()
            .route(
                "/v1/jobs",
                get(move || {
                    let mut rx = release_rx.clone();
                    async move {
                        let _ = rx.wait_for(|v| *v).await;
                        "done"
                    }
                }),
            )
            .layer(axum::middleware::from_fn_with_state(
                l.clone(),
                limit_waiting_requests,
            ));
        let req = || {
            Request::builder()
                .uri("/v1/jobs?index=7")
                .body(Body::empty())
                .expect("a request")
        };
        let first = tokio::spawn(router.clone().oneshot(req()));
        tokio::time::timeout(Duration::from_secs(10), async {
            while l.in_flight(Waiting::BlockingQuery) == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the first request is admitted");
        let refused = router.clone().oneshot(req()).await.expect("an answer");
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            refused.headers().get(header::RETRY_AFTER),
            Some(&HeaderValue::from(1u32))
        );
        let body = axum::body::to_bytes(refused.into_body(), 4096)
            .await
            .expect("the body");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("max_blocking_queries")),
            "{v}"
        );
        // A request that does not wait is not counted.
        let plain = Request::builder()
            .uri("/v1/jobs")
            .body(Body::empty())
            .expect("a request");
        let plain = tokio::spawn(router.clone().oneshot(plain));
        release_tx.send_replace(true);
        assert_eq!(
            first.await.expect("joined").expect("answered").status(),
            StatusCode::OK
        );
        assert_eq!(
            plain.await.expect("joined").expect("answered").status(),
            StatusCode::OK
        );
        assert_eq!(l.in_flight(Waiting::BlockingQuery), 0);

        // A client that goes away: its request future is dropped.
        release_tx.send_replace(false);
        let gone = tokio::spawn(router.clone().oneshot(req()));
        tokio::time::timeout(Duration::from_secs(10), async {
            while l.in_flight(Waiting::BlockingQuery) == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("admitted");
        gone.abort();
        let _ = gone.await;
        assert_eq!(l.in_flight(Waiting::BlockingQuery), 0);
        release_tx.send_replace(true);
        let after = router.oneshot(req()).await.expect("an answer");
        assert_eq!(after.status(), StatusCode::OK);
    }
}
