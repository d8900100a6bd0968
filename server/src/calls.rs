//! Calls the server makes on clients, over the streams the clients opened
//! with `Node.OpenCallStream`.
//!
//! Each connected node has one [`Connection`]: the sender of its outbound
//! stream and the calls waiting for a reply. A newer stream of the same node
//! replaces the older one; when a stream drops, its pending calls fail with
//! `Unavailable` (their reply senders are dropped).

use berth_sync::MutexExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use berth_proto::berth::v1::{call_reply, server_call, CallReply, ServerCall};
use tokio::sync::{mpsc, oneshot};

use crate::error::ServerError;

/// The outbound half of a call stream.
pub type CallSender = mpsc::Sender<Result<ServerCall, tonic::Status>>;

struct Connection {
    conn_id: u64,
    tx: CallSender,
    pending: HashMap<u64, oneshot::Sender<CallReply>>,
}

#[derive(Default)]
pub struct CallRegistry {
    next_id: AtomicU64,
    conns: Mutex<HashMap<String, Connection>>,
}

impl CallRegistry {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<String, Connection>> {
        self.conns.locked()
    }

    /// Register the stream of `node_id`; returns the connection's ID. An
    /// older stream of the node is dropped, failing its pending calls.
    pub fn attach(&self, node_id: &str, tx: CallSender) -> u64 {
        let conn_id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let old = self.conns().insert(
            node_id.to_string(),
            Connection {
                conn_id,
                tx,
                pending: HashMap::new(),
            },
        );
        if let Some(old) = old {
            tracing::info!(
                node_id,
                old_conn = old.conn_id,
                conn_id,
                pending = old.pending.len(),
                "call stream replaced by a newer one"
            );
        } else {
            tracing::info!(node_id, conn_id, "call stream opened");
        }
        conn_id
    }

    /// Forget the stream `conn_id` of `node_id` (if it is still the current
    /// one). Its pending calls fail with `Unavailable`.
    pub fn detach(&self, node_id: &str, conn_id: u64) {
        let mut conns = self.conns();
        if conns.get(node_id).is_some_and(|c| c.conn_id == conn_id) {
            if let Some(c) = conns.remove(node_id) {
                tracing::info!(
                    node_id,
                    conn_id,
                    pending = c.pending.len(),
                    "call stream closed"
                );
            }
        }
    }

    /// Hand a reply to the call waiting for it.
    pub fn deliver(&self, node_id: &str, conn_id: u64, reply: CallReply) {
        let waiter = {
            let mut conns = self.conns();
            conns
                .get_mut(node_id)
                .filter(|c| c.conn_id == conn_id)
                .and_then(|c| c.pending.remove(&reply.call_id))
        };
        match waiter {
            Some(w) => {
                let _ = w.send(reply);
            }
            None => {
                tracing::debug!(
                    node_id,
                    call_id = reply.call_id,
                    "reply to a call nobody waits for"
                )
            }
        }
    }

    /// Whether `node_id` has a call stream open.
    pub fn is_connected(&self, node_id: &str) -> bool {
        self.conns().contains_key(node_id)
    }

    /// Call `node_id` and wait for its reply, at most `deadline`.
    pub async fn call(
        &self,
        node_id: &str,
        call: server_call::Call,
        deadline: Duration,
    ) -> Result<call_reply::Result, ServerError> {
        let call_id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let kind = call_kind(&call);
        let (reply_tx, reply_rx) = oneshot::channel();
        let (tx, conn_id) = {
            let mut conns = self.conns();
            let conn = conns.get_mut(node_id).ok_or_else(|| {
                ServerError::Unavailable(format!("node {node_id} has no call stream open"))
            })?;
            conn.pending.insert(call_id, reply_tx);
            (conn.tx.clone(), conn.conn_id)
        };
        let msg = ServerCall {
            call_id,
            deadline_ms: deadline.as_millis() as u64,
            call: Some(call),
        };
        tracing::debug!(node_id, call_id, call = kind, "calling client");
        let sent = tokio::time::timeout(deadline, tx.send(Ok(msg))).await;
        if !matches!(sent, Ok(Ok(()))) {
            self.forget(node_id, conn_id, call_id);
            return Err(ServerError::Unavailable(format!(
                "call stream of node {node_id} closed before the {kind} call was sent"
            )));
        }
        let reply = match tokio::time::timeout(deadline, reply_rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => {
                return Err(ServerError::Unavailable(format!(
                    "call stream of node {node_id} closed before it answered the {kind} call"
                )))
            }
            Err(_) => {
                self.forget(node_id, conn_id, call_id);
                return Err(ServerError::Remote {
                    code: tonic::Code::DeadlineExceeded,
                    message: format!(
                        "node {node_id} did not answer the {kind} call within {deadline:?}"
                    ),
                });
            }
        };
        match reply.result {
            Some(call_reply::Result::Error(e)) => Err(ServerError::Remote {
                code: tonic::Code::from_i32(e.code),
                message: format!("{kind} on node {node_id}: {}", e.message),
            }),
            Some(r) => Ok(r),
            None => Err(ServerError::Internal(format!(
                "node {node_id} answered the {kind} call without a result"
            ))),
        }
    }

    fn forget(&self, node_id: &str, conn_id: u64, call_id: u64) {
        if let Some(c) = self
            .conns()
            .get_mut(node_id)
            .filter(|c| c.conn_id == conn_id)
        {
            c.pending.remove(&call_id);
        }
    }
}

fn call_kind(call: &server_call::Call) -> &'static str {
    match call {
        server_call::Call::NodeDetach(_) => "NodeDetach",
        server_call::Call::ControllerPublish(_) => "ControllerPublish",
        server_call::Call::ControllerUnpublish(_) => "ControllerUnpublish",
        server_call::Call::CreateVolume(_) => "CreateVolume",
        server_call::Call::DeleteVolume(_) => "DeleteVolume",
        server_call::Call::ValidateVolume(_) => "ValidateVolume",
        server_call::Call::ExpandVolume(_) => "ExpandVolume",
        server_call::Call::ExpandVolumeOnNode(_) => "ExpandVolumeOnNode",
        server_call::Call::CreateSnapshot(_) => "CreateSnapshot",
        server_call::Call::DeleteSnapshot(_) => "DeleteSnapshot",
        server_call::Call::ListSnapshots(_) => "ListSnapshots",
        server_call::Call::ClientHttp(_) => "ClientHttp",
    }
}
