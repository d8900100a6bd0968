//! The ACL check of every API request: the caller's token (the
//! `X-Berth-Token` header, or `Authorization: Bearer`), resolved to what it
//! may do, against the [`Need`] its route names in the route table. Deny
//! by default: no token is the anonymous token, which reaches the public
//! routes only. Every write that passes is logged as an audit line with
//! the token's accessor (`acl_accessor`).
//!
//! The server role resolves tokens from its state; a client-only agent
//! asks the servers (`GET /v1/acl/token/self`, forwarded as any request)
//! and keeps the answer for `acl { token_ttl }`.

use berth_sync::MutexExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use berth_structs::acl::{check_secret_text, secret_hash, Acl, Need};

use super::routes::Route;
use super::ApiError;

/// The header that carries a token (Nomad's is `X-Nomad-Token`).
pub const TOKEN_HEADER: &str = "x-berth-token";

/// Who resolves a token's secret to an [`Acl`].
#[async_trait::async_trait]
pub trait TokenResolver: Send + Sync {
    /// What `secret` may do (`None`: no token was given).
    async fn resolve(&self, secret: Option<&str>) -> Result<Acl, ApiError>;
}

#[async_trait::async_trait]
impl TokenResolver for berth_server::Server {
    async fn resolve(&self, secret: Option<&str>) -> Result<Acl, ApiError> {
        self.resolve_token(secret).map_err(ApiError::from)
    }
}

/// The routes' needs, found by method and path.
pub struct NeedTable {
    by_method: HashMap<Method, matchit::Router<Need>>,
    /// Every path some route serves, whatever its method.
    paths: matchit::Router<()>,
}

/// What the table says of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// A route serves this method on this path and needs this.
    Route(Need),
    /// A route serves the path, but not with this method (`OPTIONS`, say).
    UnlistedMethod,
    /// No route of this table serves the path.
    UnknownPath,
}

impl NeedTable {
    pub fn new(routes: &[Route]) -> NeedTable {
        let mut by_method: HashMap<Method, matchit::Router<Need>> = HashMap::new();
        let mut paths = matchit::Router::new();
        for r in routes {
            let table = by_method.entry(r.method.clone()).or_default();
            if let Err(e) = table.insert(r.path, r.need) {
                // The route table's test refuses duplicates; a clash here
                // is a programming error seen at start.
                tracing::error!(path = r.path, error = %e, "route cannot be entered in the ACL table");
            }
            // Several methods share a path: the second insert of it is
            // expected to clash.
            let _ = paths.insert(r.path, ());
        }
        NeedTable { by_method, paths }
    }

    /// What `method` on `path` needs. `HEAD` runs the `GET` handler (axum
    /// serves it so), so it needs what `GET` needs.
    pub fn lookup(&self, method: &Method, path: &str) -> Lookup {
        let method = if method == Method::HEAD {
            &Method::GET
        } else {
            method
        };
        if let Some(m) = self.by_method.get(method).and_then(|t| t.at(path).ok()) {
            return Lookup::Route(*m.value);
        }
        if self.paths.at(path).is_ok() {
            Lookup::UnlistedMethod
        } else {
            Lookup::UnknownPath
        }
    }
}

/// What a gate does with a path its table does not list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownPaths {
    /// Another router behind this one answers them and checks them there
    /// (the agent's own routes, in front of the server API or the
    /// forwarding to it).
    PassOn,
    /// Nothing behind checks them: only a management token gets past
    /// (to the 404), anyone else is refused.
    Deny,
}

/// When a gate checks tokens.
#[derive(Clone)]
pub enum Enforce {
    /// Always (the agent's own config turns ACLs on).
    Always,
    /// While this says so (a client agent whose servers enforce ACLs).
    When(Arc<dyn Fn() -> bool + Send + Sync>),
}

/// The ACL check of one router.
pub struct AclGate {
    needs: NeedTable,
    unknown_paths: UnknownPaths,
    resolver: Arc<dyn TokenResolver>,
    enforce: Enforce,
}

impl AclGate {
    pub fn new(
        routes: &[Route],
        unknown_paths: UnknownPaths,
        resolver: Arc<dyn TokenResolver>,
        enforce: Enforce,
    ) -> Arc<AclGate> {
        Arc::new(AclGate {
            needs: NeedTable::new(routes),
            unknown_paths,
            resolver,
            enforce,
        })
    }

    fn enforced(&self) -> bool {
        match &self.enforce {
            Enforce::Always => true,
            Enforce::When(now) => now(),
        }
    }

    /// What a request needs to pass; `None`: it is another router's to
    /// check. A method or path with no entry is denied, never allowed.
    fn need_of(&self, method: &Method, path: &str) -> Option<Need> {
        match (self.needs.lookup(method, path), self.unknown_paths) {
            (Lookup::Route(need), _) => Some(need),
            (Lookup::UnlistedMethod, _) | (Lookup::UnknownPath, UnknownPaths::Deny) => {
                Some(Need::Management)
            }
            (Lookup::UnknownPath, UnknownPaths::PassOn) => None,
        }
    }
}

/// The secret a request carries, or why it is unusable. The error never
/// holds the secret.
pub fn token_of(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let forbidden = |m: String| ApiError::new(StatusCode::FORBIDDEN, m);
    if let Some(v) = headers.get(TOKEN_HEADER) {
        let text = v
            .to_str()
            .map_err(|_| forbidden(format!("header {TOKEN_HEADER} is not printable ASCII")))?;
        return check_secret_text(text)
            .map(|t| Some(t.to_string()))
            .map_err(forbidden);
    }
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let text = v
            .to_str()
            .map_err(|_| forbidden("header Authorization is not printable ASCII".into()))?;
        let Some(bearer) = text
            .strip_prefix("Bearer ")
            .or_else(|| text.strip_prefix("bearer "))
        else {
            return Err(forbidden(
                "header Authorization must be \"Bearer <token>\"".into(),
            ));
        };
        return check_secret_text(bearer)
            .map(|t| Some(t.to_string()))
            .map_err(forbidden);
    }
    Ok(None)
}

/// The middleware: resolves the token, checks the route's need, puts the
/// [`Acl`] into the request's extensions (handlers that check more, such
/// as job registration, read it there), and logs writes.
pub async fn check(State(gate): State<Arc<AclGate>>, mut req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    if !gate.enforced() {
        return next.run(req).await;
    }
    let Some(need) = gate.need_of(&method, &path) else {
        // Not this gate's route: the router behind checks it.
        return next.run(req).await;
    };
    let (acl, anonymous) = match token_of(req.headers()) {
        Ok(secret) => match gate.resolver.resolve(secret.as_deref()).await {
            Ok(acl) => (acl, secret.is_none()),
            Err(e) => return e.into_response(),
        },
        Err(e) => return e.into_response(),
    };
    if let Err(why) = acl.check(need) {
        tracing::info!(acl_accessor = acl.accessor_id.as_deref().unwrap_or("anonymous"),
            method = %method, path = %path, "API request refused by ACL");
        let why = if anonymous {
            format!("{why}; no token was given: pass one with -token or BERTH_TOKEN (header {TOKEN_HEADER})")
        } else {
            why
        };
        return ApiError::new(StatusCode::FORBIDDEN, why).into_response();
    }
    let accessor = acl.accessor_id.clone();
    req.extensions_mut().insert(acl);
    let resp = next.run(req).await;
    if method != Method::GET && method != Method::HEAD {
        tracing::info!(
            target: "berth::audit",
            acl_accessor = accessor.as_deref().unwrap_or("anonymous"),
            method = %method,
            path = %path,
            status = resp.status().as_u16(),
            "API write"
        );
    }
    resp
}

/// Whether the request's ACL (none: ACLs are off) allows `need`; for the
/// checks a handler makes beyond its route's.
pub fn require(acl: Option<&Acl>, need: Need, why: &str) -> Result<(), ApiError> {
    match acl {
        None => Ok(()),
        Some(acl) => acl
            .check(need)
            .map_err(|e| ApiError::new(StatusCode::FORBIDDEN, format!("{e} ({why})"))),
    }
}

/// What the servers answered for a token: what it may do, and when it
/// expires (unix ms), if it does.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub acl: Acl,
    pub expires_ms: Option<i64>,
}

/// A client-only agent's resolver: asks the servers through `ask` and
/// keeps each answer, by the hash of the secret, for `ttl` at most: never
/// past the token's own expiry, and never once `generation` (the servers'
/// index of their last change to tokens and policies, which the client
/// hears with every heartbeat) has moved, so a deleted token is refused
/// within a heartbeat.
pub struct RemoteResolver<F> {
    ask: F,
    ttl: Duration,
    generation: Box<dyn Fn() -> u64 + Send + Sync>,
    cache: Mutex<HashMap<String, Cached>>,
}

struct Cached {
    until: Instant,
    generation: u64,
    acl: Acl,
}

/// The most resolved tokens a client-only agent keeps.
const MAX_CACHED_TOKENS: usize = 4096;

impl<F> RemoteResolver<F> {
    pub fn new(
        ask: F,
        ttl: Duration,
        generation: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> RemoteResolver<F> {
        RemoteResolver {
            ask,
            ttl,
            generation,
            cache: Mutex::new(HashMap::new()),
        }
    }
}

/// How long an answer got at `now` (`now_ms` on the wall clock) is kept:
/// `ttl`, or less when the token expires sooner; `None` when it has
/// expired already.
fn keep_for(ttl: Duration, expires_ms: Option<i64>, now_ms: i64) -> Option<Duration> {
    match expires_ms {
        None => Some(ttl),
        Some(at) if at <= now_ms => None,
        Some(at) => Some(ttl.min(Duration::from_millis((at - now_ms) as u64))),
    }
}

#[async_trait::async_trait]
impl<F, Fut> TokenResolver for RemoteResolver<F>
where
    F: Fn(String) -> Fut + Send + Sync,
    Fut: std::future::Future<Output = Result<Resolved, ApiError>> + Send,
{
    async fn resolve(&self, secret: Option<&str>) -> Result<Acl, ApiError> {
        let Some(secret) = secret else {
            return Ok(Acl::anonymous());
        };
        let key = secret_hash(secret);
        let generation = (self.generation)();
        let now = Instant::now();
        {
            let cache = self.cache.locked();
            if let Some(c) = cache.get(&key) {
                if now < c.until && c.generation == generation {
                    return Ok(c.acl.clone());
                }
            }
        }
        let resolved = (self.ask)(secret.to_string()).await?;
        let Some(keep) = keep_for(self.ttl, resolved.expires_ms, berth_structs::now_ms()) else {
            return Ok(resolved.acl);
        };
        let mut cache = self.cache.locked();
        if cache.len() >= MAX_CACHED_TOKENS {
            cache.retain(|_, c| now < c.until && c.generation == generation);
            if cache.len() >= MAX_CACHED_TOKENS {
                cache.clear();
            }
        }
        cache.insert(
            key,
            Cached {
                until: now + keep,
                generation,
                acl: resolved.acl.clone(),
            },
        );
        Ok(resolved.acl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_structs::acl::{Capability, Level};

    #[test]
    fn needs_are_found_by_method_and_path() {
        let t = NeedTable::new(&super::super::routes::all_routes());
        assert_eq!(
            t.lookup(&Method::PUT, "/v1/jobs"),
            Lookup::Route(Need::Namespace(Capability::SubmitJob))
        );
        assert_eq!(
            t.lookup(&Method::GET, "/v1/job/web"),
            Lookup::Route(Need::Namespace(Capability::ReadJob))
        );
        assert_eq!(
            t.lookup(&Method::PUT, "/v1/node/n1/purge"),
            Lookup::Route(Need::Node(Level::Write))
        );
        assert_eq!(
            t.lookup(&Method::GET, "/v1/acl/token/self"),
            Lookup::Route(Need::AnyToken)
        );
        // HEAD runs the GET handler: it needs what GET needs.
        assert_eq!(
            t.lookup(&Method::HEAD, "/v1/acl/tokens"),
            Lookup::Route(Need::Management)
        );
        assert_eq!(
            t.lookup(&Method::OPTIONS, "/v1/jobs"),
            Lookup::UnlistedMethod
        );
        assert_eq!(t.lookup(&Method::GET, "/v1/nowhere"), Lookup::UnknownPath);
    }

    #[test]
    fn a_token_comes_from_either_header() {
        let mut h = HeaderMap::new();
        assert_eq!(token_of(&h).unwrap(), None);
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(token_of(&h).unwrap().as_deref(), Some("abc"));
        h.insert(TOKEN_HEADER, "def".parse().unwrap());
        assert_eq!(token_of(&h).unwrap().as_deref(), Some("def"));
        let mut bad = HeaderMap::new();
        bad.insert(header::AUTHORIZATION, "Basic xyz".parse().unwrap());
        assert!(token_of(&bad).is_err());
    }

    /// Only these routes answer without a token; a new public route must
    /// be added here on purpose.
    #[test]
    fn every_route_needs_a_token_but_the_few_public_ones() {
        let public: Vec<String> = super::super::routes::all_routes()
            .into_iter()
            .filter(|r| r.need == Need::Public)
            .map(|r| format!("{} {}", r.method, r.path))
            .collect();
        assert_eq!(
            public,
            [
                "GET /v1/openapi.json",
                "GET /v1/agent/health",
                "GET /v1/status/leader",
                "POST /v1/acl/bootstrap",
            ]
        );
    }

    /// A resolver whose servers answer `expires_ms` and count the asks,
    /// with the generation `generation` holds.
    fn counting_resolver(
        expires_ms: Option<i64>,
        generation: Arc<std::sync::atomic::AtomicU64>,
    ) -> (Arc<std::sync::atomic::AtomicUsize>, impl TokenResolver) {
        use std::sync::atomic::Ordering;
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        let r = RemoteResolver::new(
            move |_secret: String| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok(Resolved {
                        acl: Acl::management(Some("a".into())),
                        expires_ms,
                    })
                }
            },
            Duration::from_secs(60),
            Box::new(move || generation.load(Ordering::SeqCst)),
        );
        (asked, r)
    }

    #[tokio::test]
    async fn a_remote_resolution_is_kept_for_its_ttl_until_the_servers_acls_change() {
        use std::sync::atomic::Ordering;
        let generation = Arc::new(std::sync::atomic::AtomicU64::new(7));
        let (asked, r) = counting_resolver(None, generation.clone());
        assert!(r.resolve(None).await.unwrap().accessor_id.is_none());
        r.resolve(Some("s")).await.unwrap();
        r.resolve(Some("s")).await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // A token deleted (or any change to tokens and policies): asked
        // again.
        generation.store(8, Ordering::SeqCst);
        r.resolve(Some("s")).await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_token_is_kept_no_longer_than_it_lives() {
        use std::sync::atomic::Ordering;
        let generation = Arc::new(std::sync::atomic::AtomicU64::new(0));
        // Expired already: never kept.
        let past = berth_structs::now_ms() - 1;
        let (asked, r) = counting_resolver(Some(past), generation.clone());
        r.resolve(Some("s")).await.unwrap();
        r.resolve(Some("s")).await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        assert_eq!(
            keep_for(Duration::from_secs(30), Some(10_000), 6_000),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            keep_for(Duration::from_secs(3), Some(10_000), 6_000),
            Some(Duration::from_secs(3))
        );
        assert_eq!(keep_for(Duration::from_secs(3), Some(6_000), 6_000), None);
        assert_eq!(
            keep_for(Duration::from_secs(3), None, 6_000),
            Some(Duration::from_secs(3))
        );
    }

    /// Every method a client can send, on every route's path: each one the
    /// router serves has an entry in the need table, and without a token
    /// each one that needs something is refused, HEAD and OPTIONS
    /// included, through the agent's whole router (its own routes, then
    /// the server API behind them).
    #[tokio::test]
    async fn every_method_on_every_route_is_checked() {
        use crate::http::agent_api::{agent_router, AgentInfo};
        use crate::http::tests::call;
        use axum::body::Body;

        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = berth_server::ServerConfig::new(dir.path());
        config.acl_enabled = true;
        let server = berth_server::Server::open(config).expect("open server");
        let boot = server.acl_bootstrap().await.expect("bootstrap").secret_id;
        let mut info = AgentInfo::new(true, false, dir.path().to_path_buf(), Vec::new());
        info.acl_enabled = true;
        let router = agent_router(Some(server.clone()), Arc::new(info));
        let table = NeedTable::new(&super::super::routes::all_routes());

        let methods = [
            Method::GET,
            Method::HEAD,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::PATCH,
            Method::OPTIONS,
        ];
        let mut checked = 0;
        for route in super::super::routes::all_routes() {
            // A made-up value in every path parameter.
            let path: String = route
                .path
                .split('/')
                .map(|seg| if seg.starts_with('{') { "x" } else { seg })
                .collect::<Vec<_>>()
                .join("/");
            for method in &methods {
                let need = table.lookup(method, &path);
                if need == Lookup::Route(Need::Public) {
                    continue;
                }
                let anon = call(&router, method.clone(), &path, None, Body::empty()).await;
                assert_eq!(
                    anon.status,
                    StatusCode::FORBIDDEN,
                    "{method} {path} answered {} without a token",
                    anon.status
                );
                checked += 1;
                // What the router serves (with a token that may do
                // everything: anything but a 405, or the 404 of the
                // made-up ID) has its own need.
                let req = axum::http::Request::builder()
                    .method(method.clone())
                    .uri(&path)
                    .header(TOKEN_HEADER, &boot)
                    .body(Body::empty())
                    .expect("request");
                let served = tower::ServiceExt::oneshot(router.clone(), req)
                    .await
                    .expect("the router is infallible");
                let refused = [StatusCode::METHOD_NOT_ALLOWED, StatusCode::NOT_FOUND];
                if !refused.contains(&served.status()) {
                    assert!(
                        matches!(need, Lookup::Route(_)),
                        "{method} {path} is served ({}) but has no ACL need",
                        served.status()
                    );
                }
            }
        }
        assert!(checked > 100, "only {checked} requests were checked");
        // A path no route serves is refused too, not let through.
        let nowhere = call(&router, Method::GET, "/v1/nowhere", None, Body::empty()).await;
        assert_eq!(nowhere.status, StatusCode::FORBIDDEN);
        let head = call(
            &router,
            Method::HEAD,
            "/v1/acl/tokens?index=1&wait=3s",
            None,
            Body::empty(),
        )
        .await;
        assert_eq!(head.status, StatusCode::FORBIDDEN);
        assert!(head.headers.get("x-berth-index").is_none());
    }
}
