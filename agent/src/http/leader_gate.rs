//! The server API of a server that does not lead (see
//! `berth_server::leader`), before any token is looked at. It answers
//! reads from its tables, which the etcd watch keeps current with the
//! leader's writes (blocking queries included), and refuses writes with
//! `503` naming the leader.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Json;
use berth_server::leader::Role;
use berth_server::Server;

use super::errors::error_response;

pub(crate) async fn only_the_leader(
    State(server): State<Arc<Server>>,
    req: Request,
    next: Next,
) -> Response {
    if let Role::Standby { leader } = server.role() {
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            let message = berth_server::cluster_id::not_the_leader(leader.as_ref());
            return error_response(StatusCode::SERVICE_UNAVAILABLE, &message);
        }
    }
    next.run(req).await
}

/// `GET /v1/status/leader`: the leader's agent protocol address
/// (`HOST:PORT`, as Nomad answers it), `""` while none is elected.
pub(crate) async fn status_leader(State(server): State<Arc<Server>>) -> Json<String> {
    let leader = match server.role() {
        Role::Leader { .. } => Some(server.config().identity.clone()),
        Role::Standby { leader } => leader,
    };
    Json(leader.map(|l| l.rpc_addr).unwrap_or_default())
}
