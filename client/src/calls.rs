//! The calls the servers make on this client, over the stream the client
//! opens (`Node.OpenCallStream`): node detach, the controller RPCs of
//! plugins that run here, and requests to the node-local HTTP routes
//! (`ClientHttp`, answered by the node-local router). The stream is
//! reopened whenever it drops.

use berth_sync::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use berth_csimanager::fingerprint::{controller_has_rpc, node_has_rpc};
use berth_csimanager::{CsiClient, CsiError, CsiManager, ExpandRequest, UnmountRequest};
use berth_proto::berth::v1 as pb;
use berth_proto::csi::v1 as csi;
use berth_structs::{AccessMode, AttachmentMode, CsiMountOptions};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use pb::server_call::Call;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::rpc::ServerConn;

/// What answers the HTTP requests the servers forward to this node over
/// the call stream (`Call::ClientHttp`): the agent's node-local API.
#[async_trait::async_trait]
pub trait LocalApi: Send + Sync + 'static {
    /// The answer to one forwarded request; an error is the gRPC code and
    /// message the call fails with.
    async fn answer(
        &self,
        request: pb::ClientHttp,
    ) -> Result<pb::ClientHttpReply, (tonic::Code, String)>;
}

/// Makes the [`LocalApi`] of a running client. A factory rather than the
/// API itself: the API holds the client, which holds its configuration.
#[derive(Clone)]
pub struct LocalApiFactory(pub Arc<dyn Fn(Arc<crate::Client>) -> Arc<dyn LocalApi> + Send + Sync>);

impl std::fmt::Debug for LocalApiFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalApiFactory")
    }
}

impl LocalApiFactory {
    /// The local API of `client`: the factory's, else one that refuses.
    pub(crate) fn make(
        factory: Option<&LocalApiFactory>,
        client: &Arc<crate::Client>,
    ) -> Arc<dyn LocalApi> {
        match factory {
            Some(f) => (f.0)(client.clone()),
            None => Arc::new(NoLocalApi),
        }
    }
}

/// A client without a node-local API refuses forwarded requests.
struct NoLocalApi;

#[async_trait::async_trait]
impl LocalApi for NoLocalApi {
    async fn answer(
        &self,
        _request: pb::ClientHttp,
    ) -> Result<pb::ClientHttpReply, (tonic::Code, String)> {
        Err((
            tonic::Code::Unimplemented,
            "this node serves no local HTTP API".into(),
        ))
    }
}

/// Keeps the call stream open until `shutdown`.
pub async fn run_call_stream(
    conn: ServerConn,
    csi: Arc<CsiManager>,
    local_api: Arc<dyn LocalApi>,
    mut shutdown: Shutdown,
) {
    let mut failures: u32 = 0;
    loop {
        // The server this attempt goes to, moved on from if it fails.
        let server = conn.servers().current();
        let result = tokio::select! {
            r = serve_once(&conn, &csi, &local_api) => r,
            _ = shutdown.wait() => return,
        };
        match result {
            Ok(()) => failures = 0,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "call stream to the servers dropped");
                // The server may be gone: reopen it on the next one.
                conn.servers().failover_from(server);
            }
        }
        let wait = super::servers::retry_delay(failures);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait() => return,
        }
    }
}

async fn serve_once(
    conn: &ServerConn,
    csi: &Arc<CsiManager>,
    local_api: &Arc<dyn LocalApi>,
) -> Result<(), tonic::Status> {
    let (tx, rx) = mpsc::channel::<pb::ClientMessage>(64);
    tx.send(pb::ClientMessage {
        msg: Some(pb::client_message::Msg::Hello(pb::ClientHello {
            node_id: conn.node_id(),
        })),
    })
    .await
    .map_err(|_| tonic::Status::internal("call stream closed before hello"))?;
    let mut inbound = conn
        .node_client()
        .open_call_stream(ReceiverStream::new(rx))
        .await?
        .into_inner();
    tracing::debug!("call stream to the servers open");
    while let Some(call) = inbound.next().await {
        let call = call?;
        let tx = tx.clone();
        let csi = csi.clone();
        let local_api = local_api.clone();
        tokio::spawn(async move {
            let call_id = call.call_id;
            let deadline = Duration::from_millis(call.deadline_ms.max(1000));
            let result =
                match tokio::time::timeout(deadline, handle_call(&csi, &local_api, call)).await {
                    Ok(r) => r,
                    Err(_) => Err(pb::CallError {
                        code: tonic::Code::DeadlineExceeded as i32,
                        message: "the client did not finish the call before its deadline".into(),
                    }),
                };
            let result = match result {
                Ok(r) => r,
                Err(e) => pb::call_reply::Result::Error(e),
            };
            let reply = pb::ClientMessage {
                msg: Some(pb::client_message::Msg::Reply(pb::CallReply {
                    call_id,
                    result: Some(result),
                })),
            };
            let _ = tx.send(reply).await;
        });
    }
    Ok(())
}

fn call_error(e: CsiError) -> pb::CallError {
    pb::CallError {
        code: e.code() as i32,
        message: e.to_string(),
    }
}

fn bad_call(msg: impl Into<String>) -> pb::CallError {
    pb::CallError {
        code: tonic::Code::InvalidArgument as i32,
        message: msg.into(),
    }
}

/// The berth spelling of a capability, in CSI's terms.
fn csi_capability(
    cap: Option<&pb::VolumeCapability>,
) -> Result<csi::VolumeCapability, pb::CallError> {
    let cap = cap.ok_or_else(|| bad_call("capability is required"))?;
    let access: AccessMode = cap.access_mode.parse().map_err(bad_call)?;
    let attach: AttachmentMode = cap.attachment_mode.parse().map_err(bad_call)?;
    Ok(berth_csimanager::volume_manager::volume_capability(
        access,
        attach,
        &CsiMountOptions {
            fs_type: cap.fs_type.clone(),
            mount_flags: cap.mount_flags.clone(),
        },
    ))
}

/// CSI `accessibility_requirements` from the call's topologies; none when
/// both lists are empty.
fn topology_requirement(
    requisite: Vec<pb::Topology>,
    preferred: Vec<pb::Topology>,
) -> Option<csi::TopologyRequirement> {
    let csi_topology = |t: pb::Topology| csi::Topology {
        segments: t.segments.into_iter().collect(),
    };
    (!requisite.is_empty() || !preferred.is_empty()).then(|| csi::TopologyRequirement {
        requisite: requisite.into_iter().map(csi_topology).collect(),
        preferred: preferred.into_iter().map(csi_topology).collect(),
    })
}

async fn handle_call(
    csi: &Arc<CsiManager>,
    local_api: &Arc<dyn LocalApi>,
    call: pb::ServerCall,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let empty = || pb::call_reply::Result::Empty(pb::Empty {});
    match call.call {
        None => Err(bad_call("empty call")),
        Some(Call::NodeDetach(d)) => node_detach(csi, d).await,
        Some(Call::ControllerPublish(p)) => {
            let client = csi.client(&p.plugin_id).await.map_err(call_error)?;
            let resp = client
                .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                    volume_id: p.external_id,
                    node_id: p.external_node_id,
                    volume_capability: Some(csi_capability(p.capability.as_ref())?),
                    readonly: p.read_only,
                    secrets: p.secrets,
                    volume_context: p.volume_context,
                })
                .await
                .map_err(call_error)?;
            Ok(pb::call_reply::Result::ControllerPublish(
                pb::ControllerPublishReply {
                    publish_context: resp.publish_context,
                },
            ))
        }
        Some(Call::ControllerUnpublish(u)) => {
            let client = csi.client(&u.plugin_id).await.map_err(call_error)?;
            client
                .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                    volume_id: u.external_id,
                    node_id: u.external_node_id,
                    secrets: u.secrets,
                })
                .await
                .map_err(call_error)?;
            Ok(empty())
        }
        Some(Call::CreateVolume(c)) => create_volume(csi, c).await,
        Some(Call::DeleteVolume(d)) => {
            let client = csi.client(&d.plugin_id).await.map_err(call_error)?;
            client
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: d.external_id,
                    secrets: d.secrets,
                })
                .await
                .map_err(call_error)?;
            Ok(empty())
        }
        Some(Call::ValidateVolume(v)) => validate_volume(csi, v).await,
        Some(Call::ExpandVolume(e)) => expand_volume(csi, e).await,
        Some(Call::ExpandVolumeOnNode(e)) => expand_volume_on_node(csi, e).await,
        Some(Call::CreateSnapshot(c)) => create_snapshot(csi, c).await,
        Some(Call::DeleteSnapshot(d)) => {
            let client =
                snapshot_controller(csi, &d.plugin_id, ControllerRpc::CreateDeleteSnapshot).await?;
            client
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: d.snapshot_id,
                    secrets: d.secrets,
                })
                .await
                .map_err(call_error)?;
            Ok(empty())
        }
        Some(Call::ListSnapshots(l)) => list_snapshots(csi, l).await,
        Some(Call::ClientHttp(h)) => local_api
            .answer(h)
            .await
            .map(pb::call_reply::Result::ClientHttp)
            .map_err(|(code, message)| pb::CallError {
                code: code as i32,
                message,
            }),
    }
}

/// Unmounts a volume of an alloc on this node for the servers (a node
/// detach of a claim whose alloc is gone).
async fn node_detach(
    csi: &Arc<CsiManager>,
    d: pb::NodeDetach,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let empty = || pb::call_reply::Result::Empty(pb::Empty {});
    let cap = d
        .capability
        .ok_or_else(|| bad_call("node detach needs the claim's capability"))?;
    let access: AccessMode = cap.access_mode.parse().map_err(bad_call)?;
    let attach: AttachmentMode = cap.attachment_mode.parse().map_err(bad_call)?;
    csi.unmount_volume(UnmountRequest {
        plugin_id: d.plugin_id,
        volume_id: d.volume_id,
        external_id: d.external_id,
        alloc_id: d.alloc_id,
        access_mode: access,
        attachment_mode: attach,
        read_only: d.read_only,
    })
    .await
    .map_err(call_error)?;
    Ok(empty())
}

/// `CreateVolume` through the controller plugin.
async fn create_volume(
    csi: &Arc<CsiManager>,
    c: pb::CreateVolume,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let client = csi.client(&c.plugin_id).await.map_err(call_error)?;
    let caps = c
        .capabilities
        .iter()
        .map(|cap| csi_capability(Some(cap)))
        .collect::<Result<Vec<_>, _>>()?;
    let capacity_range = (c.capacity_min > 0 || c.capacity_max > 0).then_some(csi::CapacityRange {
        required_bytes: c.capacity_min,
        limit_bytes: c.capacity_max,
    });
    let resp = client
        .create_volume(csi::CreateVolumeRequest {
            name: c.name,
            capacity_range,
            volume_capabilities: caps,
            parameters: c.parameters,
            secrets: c.secrets,
            accessibility_requirements: topology_requirement(c.requisite, c.preferred),
            volume_content_source: content_source(&c.snapshot_id, &c.clone_id),
            ..Default::default()
        })
        .await
        .map_err(call_error)?;
    let vol = resp.volume.ok_or_else(|| pb::CallError {
        code: tonic::Code::Internal as i32,
        message: "plugin answered CreateVolume without a volume".into(),
    })?;
    if vol.volume_id.is_empty() {
        return Err(pb::CallError {
            code: tonic::Code::Internal as i32,
            message: "plugin answered CreateVolume with an empty volume_id".into(),
        });
    }
    Ok(pb::call_reply::Result::CreateVolume(
        pb::CreateVolumeReply {
            external_id: vol.volume_id,
            capacity_bytes: vol.capacity_bytes,
            volume_context: vol.volume_context,
            accessible_topology: vol
                .accessible_topology
                .into_iter()
                .map(|t| pb::Topology {
                    segments: t.segments.into_iter().collect(),
                })
                .collect(),
        },
    ))
}

/// `ValidateVolumeCapabilities` through the controller plugin: an
/// unconfirmed answer is a failed precondition.
async fn validate_volume(
    csi: &Arc<CsiManager>,
    v: pb::ValidateVolume,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let empty = || pb::call_reply::Result::Empty(pb::Empty {});
    let client = csi.client(&v.plugin_id).await.map_err(call_error)?;
    let caps = v
        .capabilities
        .iter()
        .map(|cap| csi_capability(Some(cap)))
        .collect::<Result<Vec<_>, _>>()?;
    let resp = client
        .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
            volume_id: v.external_id,
            volume_context: v.volume_context,
            volume_capabilities: caps,
            parameters: v.parameters,
            secrets: v.secrets,
            ..Default::default()
        })
        .await
        .map_err(call_error)?;
    if resp.confirmed.is_none() {
        return Err(pb::CallError {
            code: tonic::Code::FailedPrecondition as i32,
            message: format!(
                "plugin did not confirm the volume's capabilities: {}",
                resp.message
            ),
        });
    }
    Ok(empty())
}

/// CSI `volume_content_source` of a create: a snapshot or a volume to
/// clone (the servers send at most one).
fn content_source(snapshot_id: &str, clone_id: &str) -> Option<csi::VolumeContentSource> {
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let source = if !snapshot_id.is_empty() {
        Type::Snapshot(SnapshotSource {
            snapshot_id: snapshot_id.to_string(),
        })
    } else if !clone_id.is_empty() {
        Type::Volume(VolumeSource {
            volume_id: clone_id.to_string(),
        })
    } else {
        return None;
    };
    Some(csi::VolumeContentSource {
        r#type: Some(source),
    })
}

fn capacity_range(min: i64, max: i64) -> Option<csi::CapacityRange> {
    (min > 0 || max > 0).then_some(csi::CapacityRange {
        required_bytes: min,
        limit_bytes: max,
    })
}

/// `ControllerExpandVolume` when the controller has `EXPAND_VOLUME`; the
/// answer says when it has not (the servers then expand on the nodes only).
async fn expand_volume(
    csi: &Arc<CsiManager>,
    e: pb::ExpandVolume,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let client = csi.client(&e.plugin_id).await.map_err(call_error)?;
    let caps = client
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .map_err(call_error)?;
    if !controller_has_rpc(&caps, ControllerRpc::ExpandVolume) {
        return Ok(pb::call_reply::Result::ExpandVolume(
            pb::ExpandVolumeReply {
                controller_supported: false,
                ..Default::default()
            },
        ));
    }
    let resp = client
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: e.external_id,
            capacity_range: capacity_range(e.capacity_min, e.capacity_max),
            secrets: e.secrets,
            volume_capability: e
                .capability
                .as_ref()
                .map(|c| csi_capability(Some(c)))
                .transpose()?,
        })
        .await
        .map_err(call_error)?;
    Ok(pb::call_reply::Result::ExpandVolume(
        pb::ExpandVolumeReply {
            controller_supported: true,
            capacity_bytes: resp.capacity_bytes,
            node_expansion_required: resp.node_expansion_required,
        },
    ))
}

/// `NodeExpandVolume` when the node plugin has `EXPAND_VOLUME`; the answer
/// says when it has not.
async fn expand_volume_on_node(
    csi: &Arc<CsiManager>,
    e: pb::ExpandVolumeOnNode,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let client = csi.client(&e.plugin_id).await.map_err(call_error)?;
    let caps = client
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
        .await
        .map_err(call_error)?;
    if !node_has_rpc(&caps, NodeRpc::ExpandVolume) {
        return Ok(pb::call_reply::Result::ExpandVolumeOnNode(
            pb::ExpandVolumeOnNodeReply {
                node_supported: false,
                capacity_bytes: 0,
            },
        ));
    }
    let cap = e
        .capability
        .ok_or_else(|| bad_call("node expand needs the volume's capability"))?;
    let capacity_bytes = csi
        .expand_volume(ExpandRequest {
            plugin_id: e.plugin_id,
            volume_id: e.volume_id,
            external_id: e.external_id,
            alloc_ids: e.alloc_ids,
            capacity_min: e.capacity_min,
            capacity_max: e.capacity_max,
            access_mode: cap.access_mode.parse().map_err(bad_call)?,
            attachment_mode: cap.attachment_mode.parse().map_err(bad_call)?,
            mount_options: CsiMountOptions {
                fs_type: cap.fs_type,
                mount_flags: cap.mount_flags,
            },
            secrets: e.secrets.into_iter().collect(),
        })
        .await
        .map_err(call_error)?;
    Ok(pb::call_reply::Result::ExpandVolumeOnNode(
        pb::ExpandVolumeOnNodeReply {
            node_supported: true,
            capacity_bytes,
        },
    ))
}

/// A client for `plugin_id`'s controller, which must advertise `needed`:
/// else `Unimplemented`, naming the plugin and the capability.
async fn snapshot_controller(
    csi: &Arc<CsiManager>,
    plugin_id: &str,
    needed: ControllerRpc,
) -> Result<CsiClient, pb::CallError> {
    let client = csi.client(plugin_id).await.map_err(call_error)?;
    let caps = client
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .map_err(call_error)?;
    if !controller_has_rpc(&caps, needed) {
        return Err(pb::CallError {
            code: tonic::Code::Unimplemented as i32,
            message: format!(
                "CSI plugin {plugin_id:?} does not support snapshots: its controller lacks the {} capability",
                needed.as_str_name()
            ),
        });
    }
    Ok(client)
}

fn snapshot_pb(s: csi::Snapshot) -> pb::Snapshot {
    pb::Snapshot {
        snapshot_id: s.snapshot_id,
        source_external_id: s.source_volume_id,
        size_bytes: s.size_bytes,
        create_time_ms: s
            .creation_time
            .map(|t| t.seconds.saturating_mul(1000) + i64::from(t.nanos / 1_000_000))
            .unwrap_or(0),
        ready_to_use: s.ready_to_use,
    }
}

async fn create_snapshot(
    csi: &Arc<CsiManager>,
    c: pb::CreateSnapshot,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let client =
        snapshot_controller(csi, &c.plugin_id, ControllerRpc::CreateDeleteSnapshot).await?;
    let resp = client
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: c.source_external_id,
            name: c.name,
            secrets: c.secrets,
            parameters: c.parameters,
        })
        .await
        .map_err(call_error)?;
    let snapshot = resp.snapshot.ok_or_else(|| pb::CallError {
        code: tonic::Code::Internal as i32,
        message: "plugin answered CreateSnapshot without a snapshot".into(),
    })?;
    Ok(pb::call_reply::Result::CreateSnapshot(snapshot_pb(
        snapshot,
    )))
}

/// Every page of `ListSnapshots`. A plugin that hands back the token it was
/// given would never end: that is an error.
async fn list_snapshots(
    csi: &Arc<CsiManager>,
    l: pb::ListSnapshots,
) -> Result<pb::call_reply::Result, pb::CallError> {
    let client = snapshot_controller(csi, &l.plugin_id, ControllerRpc::ListSnapshots).await?;
    let mut snapshots = Vec::new();
    let mut token = String::new();
    loop {
        let resp = client
            .list_snapshots(csi::ListSnapshotsRequest {
                starting_token: token.clone(),
                secrets: l.secrets.clone(),
                ..Default::default()
            })
            .await
            .map_err(call_error)?;
        snapshots.extend(
            resp.entries
                .into_iter()
                .filter_map(|e| e.snapshot)
                .map(snapshot_pb),
        );
        if resp.next_token.is_empty() {
            break;
        }
        if resp.next_token == token {
            return Err(pb::CallError {
                code: tonic::Code::Internal as i32,
                message: format!(
                    "plugin answered ListSnapshots with the same next_token it was given ({token:?})"
                ),
            });
        }
        token = resp.next_token;
    }
    Ok(pb::call_reply::Result::ListSnapshots(
        pb::ListSnapshotsReply { snapshots },
    ))
}
