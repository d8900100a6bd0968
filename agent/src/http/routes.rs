//! The one table of the API's routes. Every `/v1/` route goes through a
//! [`Routes`] builder, which builds the axum router and records each
//! (method, path) it serves, so that the API can be listed (and described,
//! see [`super::openapi`]) without a running agent.
//!
//! Two tables make the whole API: [`super::server_routes`], answered by the
//! server role (or forwarded to it by a client-only agent), and
//! [`super::agent_api::agent_routes`], which every agent answers itself.
//! A new route goes into one of them.
//!
//! Every route names what it needs of the caller's ACL token ([`Need`]):
//! a route cannot be added without one, and [`super::acl`] checks it on
//! every request.

use axum::handler::Handler;
use axum::http::Method;
use axum::routing::{self, MethodRouter};
use axum::Router;
use berth_structs::acl::Need;

/// One route: its method, its path (axum's syntax) and what it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub method: Method,
    pub path: &'static str,
    pub need: Need,
}

/// A router under construction, with the list of routes it serves.
pub struct Routes<S> {
    router: Router<S>,
    table: Vec<Route>,
}

impl<S: Clone + Send + Sync + 'static> Default for Routes<S> {
    fn default() -> Self {
        Routes::new()
    }
}

impl<S: Clone + Send + Sync + 'static> Routes<S> {
    pub fn new() -> Routes<S> {
        Routes {
            router: Router::new(),
            table: Vec::new(),
        }
    }

    pub fn get<H, T>(self, path: &'static str, need: Need, handler: H) -> Routes<S>
    where
        H: Handler<T, S>,
        T: 'static,
    {
        self.add(Method::GET, path, need, routing::get(handler))
    }

    pub fn put<H, T>(self, path: &'static str, need: Need, handler: H) -> Routes<S>
    where
        H: Handler<T, S>,
        T: 'static,
    {
        self.add(Method::PUT, path, need, routing::put(handler))
    }

    pub fn post<H, T>(self, path: &'static str, need: Need, handler: H) -> Routes<S>
    where
        H: Handler<T, S>,
        T: 'static,
    {
        self.add(Method::POST, path, need, routing::post(handler))
    }

    pub fn delete<H, T>(self, path: &'static str, need: Need, handler: H) -> Routes<S>
    where
        H: Handler<T, S>,
        T: 'static,
    {
        self.add(Method::DELETE, path, need, routing::delete(handler))
    }

    /// Adds the routes `add` adds (a part of the API kept in its own
    /// module).
    pub fn with(self, add: impl FnOnce(Routes<S>) -> Routes<S>) -> Routes<S> {
        add(self)
    }

    /// Adds one (method, path); several methods of one path merge into one
    /// axum route.
    fn add(
        mut self,
        method: Method,
        path: &'static str,
        need: Need,
        route: MethodRouter<S>,
    ) -> Routes<S> {
        debug_assert!(
            path.starts_with("/v1/"),
            "API route {path} is not under /v1/"
        );
        self.table.push(Route { method, path, need });
        self.router = self.router.route(path, route);
        self
    }

    /// Every route, in the order they were added.
    pub fn table(&self) -> &[Route] {
        &self.table
    }

    /// The axum router that serves the routes (its state still to be
    /// given).
    pub fn into_router(self) -> Router<S> {
        self.router
    }
}

/// Every route any agent serves: its own routes, then the server API's
/// (answered there or forwarded). The OpenAPI document's test holds the
/// document to it; the ACL check finds each request's [`Need`] in it.
pub fn all_routes() -> Vec<Route> {
    let mut all = super::agent_api::agent_routes().table().to_vec();
    all.extend_from_slice(super::server_routes().table());
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_route_once() {
        let all = all_routes();
        let mut seen = std::collections::HashSet::new();
        for r in &all {
            assert!(
                seen.insert((r.method.clone(), r.path)),
                "{} {} is registered twice",
                r.method,
                r.path
            );
        }
        let has = |m: Method, p: &str| all.iter().any(|r| r.method == m && r.path == p);
        assert!(has(Method::GET, "/v1/jobs"));
        assert!(has(Method::PUT, "/v1/jobs"));
        assert!(has(Method::GET, "/v1/agent/self"));
    }
}
