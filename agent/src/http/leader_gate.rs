//! The server API of a server that does not lead (see
//! `berth_server::leader`), before any token is looked at. It answers
//! reads from its tables, which the etcd watch keeps current with the
//! leader's writes (blocking queries included). It sends on to the leader
//! over the agent protocol (`Agent.ForwardHttp`, as client agents
//! forward) the writes, and the reads of an alloc's node-local routes (its
//! logs, files, stats) whose node keeps its call stream at the leader;
//! the leader's answer is its own. A request that a server already sent
//! on is not sent on again: while no server leads, or the leader does not
//! answer, it is answered `503` naming why.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use berth_client::servers::ServerTls;
use berth_proto::berth::v1 as pb;
use berth_server::leader::{Role, ServerIdentity};
use berth_server::leader_link::{LeaderLink, SentOn, SENT_ON_BY_HEADER};
use berth_server::Server;

use super::errors::error_response;
use super::forward::{answer_of, to_message, AGENT_CLIENT_LIMITS};
use super::leader_conns::LeaderConns;
use super::ApiError;

/// The header that marks a write a server sent on to the leader.
pub const FORWARDED_HEADER: &str = "x-berth-sent-to-leader";

/// The gate's state: the server, and the connections to the leader it
/// knows.
pub struct LeaderGate {
    server: Arc<Server>,
    conns: LeaderConns,
}

impl LeaderGate {
    pub fn new(server: Arc<Server>, tls: Option<Arc<dyn ServerTls>>) -> Arc<LeaderGate> {
        let conns = LeaderConns::new(tls, server.cluster_id());
        Arc::new(LeaderGate { server, conns })
    }

    /// Sends the write `req` on to `leader`; its answer.
    async fn send_on(&self, leader: &ServerIdentity, req: Request) -> Result<Response, ApiError> {
        let (mut message, deadline) = to_message(req).await?;
        message.headers.push(pb::HttpHeader {
            name: FORWARDED_HEADER.into(),
            value: b"1".to_vec(),
        });
        let (channel, _slot) = self.conns.slot(&leader.rpc_addr, false).map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the leader's address {}: {e}", leader.rpc_addr),
            )
        })?;
        let mut grpc = pb::agent_client::AgentClient::new(channel)
            .max_decoding_message_size(AGENT_CLIENT_LIMITS.0)
            .max_encoding_message_size(AGENT_CLIENT_LIMITS.1);
        let mut request = tonic::Request::new(message);
        request.set_timeout(deadline);
        // Sent on once: the leader, should it no longer lead, refuses it.
        if let Ok(name) = self.server.config().identity.name.parse() {
            request.metadata_mut().insert(SENT_ON_BY_HEADER, name);
        }
        let failed = |why: String| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "this server does not lead, and sending the write on to the leader {} ({}) \
                     failed: {why}",
                    leader.name, leader.rpc_addr
                ),
            )
        };
        match tokio::time::timeout(deadline, grpc.forward_http(request)).await {
            Ok(Ok(answer)) => answer_of(answer.into_inner()),
            Ok(Err(status)) => Err(failed(status.message().to_string())),
            Err(_) => Err(failed(format!("no answer within {deadline:?}"))),
        }
    }
}

/// The agent protocol of a server that does not lead sends the nodes'
/// requests on to the leader over this agent's channel to it (see
/// `berth_server::leader_link`).
impl LeaderLink for LeaderGate {
    fn send(&self, rpc_addr: &str, req: axum::http::Request<tonic::body::Body>) -> SentOn {
        Box::pin(self.conns.send(rpc_addr, req))
    }
}

pub(crate) async fn only_the_leader(
    State(gate): State<Arc<LeaderGate>>,
    req: Request,
    next: Next,
) -> Response {
    let Role::Standby { leader } = gate.server.role() else {
        return next.run(req).await;
    };
    if matches!(*req.method(), Method::GET | Method::HEAD) && !node_elsewhere(&gate.server, &req) {
        return next.run(req).await;
    }
    match leader {
        Some(l) if !req.headers().contains_key(FORWARDED_HEADER) => gate
            .send_on(&l, req)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        leader => {
            let message = berth_server::cluster_id::not_the_leader(leader.as_ref());
            error_response(StatusCode::SERVICE_UNAVAILABLE, &message)
        }
    }
}

/// Whether `req` is a node-local route of an alloc whose node has no call
/// stream open to this server: a node that reached this server sends its
/// call stream on to the leader, which reaches the node for it.
fn node_elsewhere(server: &Server, req: &Request) -> bool {
    super::client_forward::alloc_of_path(req.uri().path())
        .and_then(|id| server.allocation(id).ok())
        .is_some_and(|a| !a.node_id.is_empty() && !server.node_connected(&a.node_id))
}

/// `GET /v1/status/leader`: the leader's agent protocol address
/// (`HOST:PORT`, as Nomad answers it), `""` while none is elected.
pub(crate) async fn status_leader(State(server): State<Arc<Server>>) -> axum::Json<String> {
    let leader = match server.role() {
        Role::Leader { .. } => Some(server.config().identity.clone()),
        Role::Standby { leader } => leader,
    };
    axum::Json(leader.map(|l| l.rpc_addr).unwrap_or_default())
}

/// `GET /v1/status/peers`: the agent protocol address of every server
/// that is there (`HOST:PORT`, as Nomad answers it).
pub(crate) async fn status_peers(
    State(server): State<Arc<Server>>,
) -> Result<axum::Json<Vec<String>>, ApiError> {
    let members = server.members().await?;
    Ok(axum::Json(
        members.into_iter().map(|m| m.identity.rpc_addr).collect(),
    ))
}

/// `GET /v1/operator/servers`: the servers, the leader marked, with when
/// each last said it was there (`berth server members`).
pub(crate) async fn servers(
    State(server): State<Arc<Server>>,
) -> Result<axum::Json<Vec<berth_server::leader::Member>>, ApiError> {
    Ok(axum::Json(server.members().await?))
}

/// `GET /v1/operator/store`: where the state is kept and, on etcd, each
/// member's health (`berth operator store`).
pub(crate) async fn store_health(
    State(server): State<Arc<Server>>,
) -> axum::Json<berth_server::StoreHealth> {
    axum::Json(server.store_health().await)
}
