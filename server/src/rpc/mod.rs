//! The gRPC services of `berth.v1`: thin adapters that decode requests,
//! call the [`Server`](crate::Server) and map errors in one place
//! (`From<ServerError> for tonic::Status`).

mod csi_volume;
pub mod limits;
mod node;

use std::sync::Arc;

use berth_proto::berth::v1::csi_volume_server::CsiVolumeServer;
use berth_proto::berth::v1::node_server::NodeServer;

use crate::peer::PeerIdentity;
use crate::register_rate::RegisterLimiter;
use crate::server::Server;

pub use limits::{Limited, MethodLimit};

pub use csi_volume::CsiVolumeService;
pub use node::NodeService;

/// Whether the peer of `req` presented an agent certificate of `region`
/// at the TLS handshake.
pub(crate) fn peer_has_agent_certificate<T>(region: &str, req: &tonic::Request<T>) -> bool {
    req.extensions()
        .get::<PeerIdentity>()
        .is_some_and(|p| p.is_agent_of(region))
}

/// Refuses a `Node.Register` of a peer that registered more often than
/// `limiter` (the server's `register_rate`) allows. A request whose peer
/// address is unknown (not over TCP) is not limited, nor is any when there
/// is no limiter.
pub(crate) fn check_register_rate(
    limiter: Option<&RegisterLimiter>,
    peer: Option<std::net::SocketAddr>,
) -> Result<(), ServerError> {
    let Some(limiter) = limiter else {
        return Ok(());
    };
    let Some(peer) = peer else {
        return Ok(());
    };
    limiter
        .take(peer.ip(), std::time::Instant::now())
        .map_err(|wait| {
            let limit = limiter.limit();
            tracing::debug!(peer = %peer.ip(), "register refused: over the rate limit");
            ServerError::TooManyRequests(format!(
                "register: too many registrations from {} (a burst of {}, then {} a \
                 second: limits.node_register_burst_per_client, \
                 limits.node_register_rate_per_client); retry in {} ms",
                peer.ip(),
                limit.burst,
                limit.rate,
                wait.as_millis().max(1)
            ))
        })
}

/// The gRPC `Node` service of `server`, for a `tonic::transport::Server`
/// router, behind the per-method limits of [`limits::NODE_METHODS`].
pub fn node_service(server: &Arc<Server>) -> Limited<NodeServer<NodeService>> {
    // A client's answer to a `ClientHttp` call (logs, say) may be as large
    // as a forwarded answer, plus its envelope; the limits let only the
    // call stream's replies be that large.
    let svc = NodeServer::new(NodeService::new(server.clone()))
        .max_decoding_message_size(crate::partial_budget::CALL_REPLY);
    Limited::new(svc, limits::NODE_METHODS, server)
}

/// The gRPC `CSIVolume` service of `server`, for a
/// `tonic::transport::Server` router, behind the limits of
/// [`limits::CSI_VOLUME_METHODS`].
pub fn csi_volume_service(server: &Arc<Server>) -> Limited<CsiVolumeServer<CsiVolumeService>> {
    let svc = CsiVolumeServer::new(CsiVolumeService::new(server.clone()));
    Limited::new(svc, limits::CSI_VOLUME_METHODS, server)
}

use berth_proto::berth::v1::NODE_SECRET_METADATA;
use berth_structs::{NodeSecret, ValidationError};

use crate::error::ServerError;
use crate::server::node_secrets::Presented;

/// The node secret a request carries in its metadata, or why there is none
/// (the reason never holds the secret).
pub(crate) fn presented_secret<T>(req: &tonic::Request<T>) -> Presented {
    secret_of(
        req.metadata()
            .get(NODE_SECRET_METADATA)
            .map(|v| v.to_str().map_err(drop)),
    )
}

/// [`presented_secret`] from the metadata's text: none, or text that is
/// printable ASCII or not.
pub(crate) fn secret_of(value: Option<Result<&str, ()>>) -> Presented {
    let value = value.ok_or_else(|| {
        format!("the request carries no node secret (metadata {NODE_SECRET_METADATA})")
    })?;
    let text =
        value.map_err(|()| format!("metadata {NODE_SECRET_METADATA} is not printable ASCII"))?;
    NodeSecret::parse(text).map_err(|e| format!("metadata {NODE_SECRET_METADATA}: {e}"))
}

pub(crate) fn decode_json<T: serde::de::DeserializeOwned>(
    what: &str,
    bytes: &[u8],
) -> Result<T, ServerError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ServerError::BadRequest(format!("decoding {what} JSON: {e}")))
}

pub(crate) fn parse<T: std::str::FromStr<Err = String>>(
    field: &str,
    value: &str,
) -> Result<T, ServerError> {
    value.parse().map_err(|e: String| {
        ServerError::Validation(ValidationError(vec![format!("{field}: {e}")]))
    })
}
