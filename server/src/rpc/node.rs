//! `berth.v1.Node`: what clients tell the servers, the alloc watch, and
//! the call stream.

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::node_server::Node;
use berth_structs::{CsiInfo, NodeEvent};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{decode_json, parse, presented_secret};
use crate::error::ServerError;
use crate::server::alloc_watch::{NodeAllocs, SentAllocs, WatchUpdate};
use crate::server::nodes::AllocUpdate;
use crate::server::Server;

pub struct NodeService {
    server: Arc<Server>,
}

impl NodeService {
    pub(crate) fn new(server: Arc<Server>) -> NodeService {
        NodeService { server }
    }
}

fn plugin_info(f: &pb::PluginFingerprint) -> CsiInfo {
    CsiInfo {
        plugin_id: f.plugin_id.clone(),
        alloc_id: f.alloc_id.clone(),
        provider: f.provider.clone(),
        version: f.version.clone(),
        healthy: f.healthy,
        health_description: f.health_description.clone(),
        requires_controller_publish: f.requires_controller_publish,
        supports_stage_unstage: f.supports_stage_unstage,
        supports_create_delete: f.supports_create_delete,
        external_node_id: f.external_node_id.clone(),
        max_volumes: f.max_volumes,
        accessible_topology: (!f.accessible_topology.is_empty()).then(|| {
            berth_structs::CsiTopology::new(
                f.accessible_topology
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            )
        }),
        supports_volume_stats: f.supports_volume_stats,
        supports_volume_condition: f.supports_volume_condition,
        supports_expand: f.supports_expand,
        supports_snapshots: f.supports_snapshots,
    }
}

/// Send the node's allocs now and after each change of them (with
/// `deltas`, only what changed), until the client goes away or the server
/// shuts down.
async fn stream_allocations(
    server: Arc<Server>,
    node_id: String,
    deltas: bool,
    tx: mpsc::Sender<Result<pb::AllocationsUpdate, Status>>,
) {
    let mut index_rx = server.subscribe_node(&node_id);
    let mut shutdown = server.shutdown_rx();
    // What was sent: each alloc's ID, modify index and job. A write of an
    // alloc's volume stats alone moves neither the node's alloc index nor
    // `index_rx` (see the store), so it is never sent back to the client.
    let mut sent = SentAllocs::default();
    // The node's allocs are scanned again only when a write touched one of
    // them: a scan is of all allocs.
    let mut scanned_at: Option<u64> = None;
    // The node the watch was opened for: once it is purged (or purged and
    // registered anew, by whichever client), this watch ends.
    let registered_at = server.node_registered_at(&node_id);
    loop {
        index_rx.borrow_and_update();
        let still_registered = server.node_registered_at(&node_id) == registered_at;
        if !still_registered || registered_at.is_none() {
            tracing::info!(
                node_id,
                "node purged or registered anew; ending its alloc watch"
            );
            let _ = tx
                .send(Err(Status::not_found(format!(
                    "node {node_id:?} is no longer registered as it was when this watch opened"
                ))))
                .await;
            return;
        }
        let scan = server.node_allocs_since(&node_id, scanned_at, &sent, deltas);
        if let Some(NodeAllocs { at, index, update }) = scan {
            scanned_at = Some(at);
            if let Some(update) = update {
                let message = match encode_update(index, &update) {
                    Ok(m) => m,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                tracing::debug!(
                    node_id,
                    index,
                    allocs = update.allocs.len(),
                    removed = update.removed.len(),
                    delta = update.delta,
                    "sending allocs"
                );
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
                sent.sent(&update);
            }
        }
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = tx.closed() => return,
            r = index_rx.changed() => if r.is_err() { return },
            _ = server.tables_stale() => {
                // The node opens it again: on a server that is current,
                // or through this one to the leader.
                tracing::info!(node_id, "this server's state is no longer current; ending the alloc watch it served");
                let _ = tx
                    .send(Err(Status::unavailable(
                        "this server does not lead and its copy of the state is no longer \
                         current (it cannot confirm it with etcd)",
                    )))
                    .await;
                return;
            }
        }
    }
}

/// One alloc watch message, each alloc as JSON.
fn encode_update(index: u64, update: &WatchUpdate) -> Result<pb::AllocationsUpdate, Status> {
    let mut allocs_json = Vec::with_capacity(update.allocs.len());
    for a in &update.allocs {
        match serde_json::to_vec(a) {
            Ok(b) => allocs_json.push(b),
            Err(e) => {
                tracing::error!(alloc_id = %a.id, error = %e, "encoding alloc failed");
                return Err(Status::internal(format!("encoding alloc {}: {e}", a.id)));
            }
        }
    }
    Ok(pb::AllocationsUpdate {
        index,
        allocs_json,
        delta: update.delta,
        removed_ids: update.removed.clone(),
        same_job_ids: update.same_job.clone(),
    })
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let size = req.get_ref().node_json.len();
        if size > pb::MAX_REGISTER_NODE_JSON {
            return Err(ServerError::BadRequest(format!(
                "register: the node is {size} bytes of JSON; the limit is {} bytes",
                pb::MAX_REGISTER_NODE_JSON
            ))
            .into());
        }
        // A caller that does not say its node ID (an older client) has its
        // node decoded first, within the size limit.
        let mut decoded: Option<berth_structs::Node> = None;
        let mut claimed_id = req.get_ref().node_id.clone();
        if claimed_id.is_empty() {
            let node: berth_structs::Node = decode_json("node", &req.get_ref().node_json)?;
            claimed_id = node.id.clone();
            decoded = Some(node);
        }
        let what = format!("register of node {claimed_id}");
        let secret = presented_secret(&req)
            .map_err(|why| ServerError::Forbidden(format!("{what}: {why}")))?;
        let intro_token = match req.metadata().get(pb::INTRO_TOKEN_METADATA) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| {
                        ServerError::Forbidden(format!(
                            "{what}: metadata {} is not printable ASCII",
                            pb::INTRO_TOKEN_METADATA
                        ))
                    })?
                    .to_string(),
            ),
        };
        let certificate = super::peer_has_agent_certificate(&self.server.config().region, &req);
        let enrollment = self.server.enrollment(certificate, intro_token);
        // The caller's right to the ID is checked before its node is
        // decoded: a stranger's megabyte of JSON is never parsed.
        self.server
            .precheck_registration(&claimed_id, &secret, &enrollment)?;
        let node: berth_structs::Node = match decoded {
            Some(n) => n,
            None => decode_json("node", &req.get_ref().node_json)?,
        };
        if node.id != claimed_id {
            return Err(ServerError::BadRequest(format!(
                "register: node_id {claimed_id:?} is not the ID of the node ({:?})",
                node.id
            ))
            .into());
        }
        let reg = self
            .server
            .register_node_enrolled(node, &secret, enrollment)
            .await?;
        Ok(Response::new(pb::RegisterResponse {
            heartbeat_ttl_ms: reg.heartbeat_ttl.as_millis() as u64,
            acl_enabled: self.server.acl_enabled(),
            acl_index: self.server.acl_index(),
            index: reg.index,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let node_id = &req.get_ref().node_id;
        self.server
            .authenticate_node("Heartbeat", node_id, &presented_secret(&req))?;
        let ttl = self.server.node_heartbeat(node_id).await?;
        berth_metrics::metrics().server_heartbeats.inc();
        Ok(Response::new(pb::HeartbeatResponse {
            heartbeat_ttl_ms: ttl.as_millis() as u64,
            acl_enabled: self.server.acl_enabled(),
            acl_index: self.server.acl_index(),
        }))
    }

    type WatchAllocationsStream = ReceiverStream<Result<pb::AllocationsUpdate, Status>>;

    async fn watch_allocations(
        &self,
        req: Request<pb::WatchAllocationsRequest>,
    ) -> Result<Response<Self::WatchAllocationsStream>, Status> {
        let presented = presented_secret(&req);
        let pb::WatchAllocationsRequest { node_id, deltas } = req.into_inner();
        // A server that does not lead serves the watch from its tables
        // once they hold what the node's register (sent on to the
        // leader) wrote.
        self.server.read_barrier("WatchAllocations").await?;
        // Unknown node: NotFound, so the client registers first.
        self.server
            .authenticate_node("WatchAllocations", &node_id, &presented)?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(stream_allocations(self.server.clone(), node_id, deltas, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn update_allocations(
        &self,
        req: Request<pb::UpdateAllocationsRequest>,
    ) -> Result<Response<pb::UpdateAllocationsResponse>, Status> {
        let presented = presented_secret(&req);
        let r = req.into_inner();
        self.server
            .authenticate_node("UpdateAllocations", &r.node_id, &presented)?;
        let mut updates = Vec::with_capacity(r.updates.len());
        for u in r.updates {
            let task_states = if u.task_states_json.is_empty() {
                None
            } else {
                Some(decode_json("task_states", &u.task_states_json)?)
            };
            let csi_volume_stats = if u.csi_volume_stats_json.is_empty() {
                None
            } else {
                Some(decode_json("csi_volume_stats", &u.csi_volume_stats_json)?)
            };
            if u.volume_stats_only {
                updates.push(AllocUpdate {
                    alloc_id: u.alloc_id,
                    csi_volume_stats,
                    volume_stats_only: true,
                    ..AllocUpdate::default()
                });
                continue;
            }
            updates.push(AllocUpdate {
                client_status: parse("client_status", &u.client_status)?,
                alloc_id: u.alloc_id,
                client_description: u.client_description,
                task_states,
                csi_volume_stats,
                volume_stats_only: false,
            });
        }
        let index = self.server.update_allocations(&r.node_id, updates).await?;
        Ok(Response::new(pb::UpdateAllocationsResponse { index }))
    }

    async fn emit_events(
        &self,
        req: Request<pb::EmitEventsRequest>,
    ) -> Result<Response<pb::EmitEventsResponse>, Status> {
        let presented = presented_secret(&req);
        let r = req.into_inner();
        self.server
            .authenticate_node("EmitEvents", &r.node_id, &presented)?;
        let events = r
            .events
            .into_iter()
            .map(|e| NodeEvent {
                subsystem: e.subsystem,
                message: e.message,
                details: e.details.into_iter().collect(),
                timestamp: if e.timestamp_ms > 0 {
                    e.timestamp_ms
                } else {
                    berth_structs::now_ms()
                },
                count: 1,
            })
            .collect::<Vec<NodeEvent>>();
        let subsystems: Vec<String> = events.iter().map(|e| e.subsystem.clone()).collect();
        self.server.emit_node_events(&r.node_id, events)?;
        for subsystem in &subsystems {
            berth_metrics::record_node_event(subsystem);
        }
        Ok(Response::new(pb::EmitEventsResponse {}))
    }

    async fn update_plugins(
        &self,
        req: Request<pb::UpdatePluginsRequest>,
    ) -> Result<Response<pb::UpdatePluginsResponse>, Status> {
        let presented = presented_secret(&req);
        let r = req.into_inner();
        self.server
            .authenticate_node("UpdatePlugins", &r.node_id, &presented)?;
        let mut nodes = BTreeMap::new();
        let mut controllers = BTreeMap::new();
        for f in &r.plugins {
            if f.plugin_id.is_empty() {
                return Err(
                    ServerError::BadRequest("plugin fingerprint without plugin_id".into()).into(),
                );
            }
            match f.kind.as_str() {
                "node" => nodes.insert(f.plugin_id.clone(), plugin_info(f)),
                "controller" => controllers.insert(f.plugin_id.clone(), plugin_info(f)),
                other => {
                    return Err(ServerError::BadRequest(format!(
                        "plugin {:?}: kind {other:?} is neither node nor controller",
                        f.plugin_id
                    ))
                    .into())
                }
            };
        }
        self.server
            .update_node_plugins(&r.node_id, nodes, controllers)
            .await?;
        Ok(Response::new(pb::UpdatePluginsResponse {}))
    }

    type OpenCallStreamStream = ReceiverStream<Result<pb::ServerCall, Status>>;

    async fn open_call_stream(
        &self,
        req: Request<Streaming<pb::ClientMessage>>,
    ) -> Result<Response<Self::OpenCallStreamStream>, Status> {
        let presented = presented_secret(&req);
        let mut inbound = req.into_inner();
        let node_id = match inbound.message().await? {
            Some(pb::ClientMessage {
                msg: Some(pb::client_message::Msg::Hello(h)),
            }) if !h.node_id.is_empty() => h.node_id,
            Some(_) => {
                return Err(Status::invalid_argument(
                    "the first message of a call stream must be a ClientHello with a node_id",
                ))
            }
            None => {
                return Err(Status::invalid_argument(
                    "call stream closed before ClientHello",
                ))
            }
        };
        self.server
            .authenticate_node("OpenCallStream", &node_id, &presented)?;
        let (tx, rx) = mpsc::channel(16);
        let server = self.server.clone();
        let conn_id = server.calls().attach(&node_id, tx);
        tokio::spawn(async move {
            let mut shutdown = server.shutdown_rx();
            loop {
                tokio::select! {
                    _ = shutdown.wait() => break,
                    msg = inbound.message() => match msg {
                        Ok(Some(pb::ClientMessage { msg: Some(pb::client_message::Msg::Reply(reply)) })) => {
                            server.calls().deliver(&node_id, conn_id, reply);
                        }
                        Ok(Some(_)) => {
                            tracing::warn!(node_id, "unexpected message on the call stream; ignored");
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::info!(node_id, error = %e, "call stream broke");
                            break;
                        }
                    }
                }
            }
            server.calls().detach(&node_id, conn_id);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
