//! The node-local HTTP routes of clients (an alloc's status, restart,
//! signal, logs) reached through a server: the request travels to the node
//! that holds the alloc over the node's call stream (`ClientHttp`), and the
//! client answers it with its own node-local router.

use std::time::Duration;

use berth_proto::berth::v1 as pb;
use pb::{call_reply, server_call};

use crate::error::ServerError;
use crate::server::Server;

pub use berth_proto::berth::v1::MAX_CLIENT_HTTP_ANSWER;

impl Server {
    /// Runs `request` through the node-local routes of `node_id`, at most
    /// `deadline`. A node without an open call stream is `Unavailable`
    /// ("node X is not connected").
    pub async fn client_http(
        &self,
        node_id: &str,
        request: pb::ClientHttp,
        deadline: Duration,
    ) -> Result<pb::ClientHttpReply, ServerError> {
        if !self.calls.is_connected(node_id) {
            return Err(ServerError::Unavailable(format!(
                "node {node_id} is not connected"
            )));
        }
        match self
            .calls
            .call(node_id, server_call::Call::ClientHttp(request), deadline)
            .await?
        {
            call_reply::Result::ClientHttp(reply) => Ok(reply),
            _ => Err(ServerError::Internal(format!(
                "node {node_id} answered a client HTTP request with another kind of reply"
            ))),
        }
    }
}
