//! A CSI client for one plugin socket: one connection, reused, every call
//! with a deadline, every error classified.
//!
//! Requests are never `Debug`-printed: many carry `secrets`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth_proto::csi::v1 as csi;
use csi::controller_client::ControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

use crate::error::CsiError;

/// A connection to one plugin. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct CsiClient {
    plugin_id: Arc<str>,
    socket_path: Arc<Path>,
    call_timeout: Duration,
    identity: IdentityClient<Channel>,
    controller: ControllerClient<Channel>,
    node: NodeClient<Channel>,
}

impl std::fmt::Debug for CsiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CsiClient")
            .field("plugin_id", &self.plugin_id)
            .field("socket_path", &self.socket_path)
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

impl CsiClient {
    /// A client for the plugin listening on `socket_path`.
    ///
    /// The connection is made lazily on the first call and remade by the
    /// channel if the plugin restarts, so this does not fail when the socket
    /// is not there yet: the first call does (as `Unavailable`). Every call
    /// has the deadline `call_timeout`. Must be called within a tokio
    /// runtime.
    pub fn connect(
        plugin_id: &str,
        socket_path: &Path,
        call_timeout: Duration,
    ) -> Result<CsiClient, CsiError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(CsiError::Io(format!(
                "CSI client for plugin {plugin_id} must be made within a tokio runtime"
            )));
        }
        // The URI is a placeholder: the connector dials the unix socket.
        let endpoint = Endpoint::try_from("http://[::]:50051")
            .map_err(|e| CsiError::Io(format!("CSI endpoint for plugin {plugin_id}: {e}")))?
            .connect_timeout(call_timeout);
        let path: PathBuf = socket_path.to_path_buf();
        let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let stream = UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }));
        Ok(CsiClient {
            plugin_id: Arc::from(plugin_id),
            socket_path: Arc::from(socket_path),
            call_timeout,
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel),
        })
    }

    pub fn plugin_id(&self) -> &str {
        &self.plugin_id
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// Wraps `msg` with the `grpc-timeout` deadline.
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(self.call_timeout);
        req
    }

    /// Runs one unary call under the deadline and classifies its outcome.
    async fn unary<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CsiError> {
        tracing::trace!(plugin_id = %self.plugin_id, op, "CSI call");
        let started = std::time::Instant::now();
        let result = self.classified(op, call).await;
        let code = result.as_ref().err().map(|e| code_name(e.code()));
        berth_metrics::record_csi_rpc(&self.plugin_id, op, started.elapsed(), code);
        result
    }

    async fn classified<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CsiError> {
        let deadline_exceeded = || {
            tracing::debug!(plugin_id = %self.plugin_id, op, timeout = ?self.call_timeout, "CSI call hit its deadline");
            CsiError::Uncertain {
                plugin_id: self.plugin_id.to_string(),
                op,
                code: Code::DeadlineExceeded,
                message: format!("no answer within {:?}", self.call_timeout),
            }
        };
        match tokio::time::timeout(self.call_timeout, call).await {
            Err(_) => Err(deadline_exceeded()),
            // The channel enforces the grpc-timeout too and reports it as
            // Cancelled; either way the deadline passed.
            Ok(Err(status)) if is_client_timeout(&status) => Err(deadline_exceeded()),
            Ok(Err(status)) => {
                let err = CsiError::from_status(&self.plugin_id, op, &status);
                tracing::debug!(plugin_id = %self.plugin_id, op, code = ?status.code(), error = %status.message(), "CSI call failed");
                Err(err)
            }
            Ok(Ok(resp)) => Ok(resp.into_inner()),
        }
    }

    /// The plugin answered, but with something the spec does not allow.
    fn invalid_response(&self, op: &'static str, message: impl Into<String>) -> CsiError {
        CsiError::Final {
            plugin_id: self.plugin_id.to_string(),
            op,
            code: Code::Internal,
            message: format!("plugin returned an invalid response: {}", message.into()),
        }
    }

    // ---- Identity ----

    /// `GetPluginInfo`; a response without a name is an error.
    pub async fn get_plugin_info(
        &self,
        req: csi::GetPluginInfoRequest,
    ) -> Result<csi::GetPluginInfoResponse, CsiError> {
        const OP: &str = "GetPluginInfo";
        let mut c = self.identity.clone();
        let resp = self.unary(OP, c.get_plugin_info(self.request(req))).await?;
        if resp.name.is_empty() {
            return Err(self.invalid_response(OP, "name is empty"));
        }
        Ok(resp)
    }

    pub async fn get_plugin_capabilities(
        &self,
        req: csi::GetPluginCapabilitiesRequest,
    ) -> Result<csi::GetPluginCapabilitiesResponse, CsiError> {
        let mut c = self.identity.clone();
        self.unary(
            "GetPluginCapabilities",
            c.get_plugin_capabilities(self.request(req)),
        )
        .await
    }

    /// `Probe`. A response without `ready` means ready (CSI spec).
    pub async fn probe(&self, req: csi::ProbeRequest) -> Result<csi::ProbeResponse, CsiError> {
        let mut c = self.identity.clone();
        self.unary("Probe", c.probe(self.request(req))).await
    }

    // ---- Controller ----

    pub async fn controller_get_capabilities(
        &self,
        req: csi::ControllerGetCapabilitiesRequest,
    ) -> Result<csi::ControllerGetCapabilitiesResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary(
            "ControllerGetCapabilities",
            c.controller_get_capabilities(self.request(req)),
        )
        .await
    }

    /// `CreateVolume`; a response without a volume ID is an error.
    pub async fn create_volume(
        &self,
        req: csi::CreateVolumeRequest,
    ) -> Result<csi::CreateVolumeResponse, CsiError> {
        const OP: &str = "CreateVolume";
        let mut c = self.controller.clone();
        let resp = self.unary(OP, c.create_volume(self.request(req))).await?;
        match &resp.volume {
            Some(v) if !v.volume_id.is_empty() => Ok(resp),
            Some(_) => Err(self.invalid_response(OP, "volume.volume_id is empty")),
            None => Err(self.invalid_response(OP, "volume is missing")),
        }
    }

    pub async fn delete_volume(
        &self,
        req: csi::DeleteVolumeRequest,
    ) -> Result<csi::DeleteVolumeResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary("DeleteVolume", c.delete_volume(self.request(req)))
            .await
    }

    pub async fn controller_publish_volume(
        &self,
        req: csi::ControllerPublishVolumeRequest,
    ) -> Result<csi::ControllerPublishVolumeResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary(
            "ControllerPublishVolume",
            c.controller_publish_volume(self.request(req)),
        )
        .await
    }

    pub async fn controller_unpublish_volume(
        &self,
        req: csi::ControllerUnpublishVolumeRequest,
    ) -> Result<csi::ControllerUnpublishVolumeResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary(
            "ControllerUnpublishVolume",
            c.controller_unpublish_volume(self.request(req)),
        )
        .await
    }

    pub async fn validate_volume_capabilities(
        &self,
        req: csi::ValidateVolumeCapabilitiesRequest,
    ) -> Result<csi::ValidateVolumeCapabilitiesResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary(
            "ValidateVolumeCapabilities",
            c.validate_volume_capabilities(self.request(req)),
        )
        .await
    }

    pub async fn controller_expand_volume(
        &self,
        req: csi::ControllerExpandVolumeRequest,
    ) -> Result<csi::ControllerExpandVolumeResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary(
            "ControllerExpandVolume",
            c.controller_expand_volume(self.request(req)),
        )
        .await
    }

    /// `CreateSnapshot`; a response without a snapshot ID is an error.
    pub async fn create_snapshot(
        &self,
        req: csi::CreateSnapshotRequest,
    ) -> Result<csi::CreateSnapshotResponse, CsiError> {
        const OP: &str = "CreateSnapshot";
        let mut c = self.controller.clone();
        let resp = self.unary(OP, c.create_snapshot(self.request(req))).await?;
        match &resp.snapshot {
            Some(s) if !s.snapshot_id.is_empty() => Ok(resp),
            Some(_) => Err(self.invalid_response(OP, "snapshot.snapshot_id is empty")),
            None => Err(self.invalid_response(OP, "snapshot is missing")),
        }
    }

    pub async fn delete_snapshot(
        &self,
        req: csi::DeleteSnapshotRequest,
    ) -> Result<csi::DeleteSnapshotResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary("DeleteSnapshot", c.delete_snapshot(self.request(req)))
            .await
    }

    /// `ListSnapshots`, one page.
    pub async fn list_snapshots(
        &self,
        req: csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse, CsiError> {
        let mut c = self.controller.clone();
        self.unary("ListSnapshots", c.list_snapshots(self.request(req)))
            .await
    }

    // ---- Node ----

    /// `NodeGetInfo`; a response without a node ID is an error.
    pub async fn node_get_info(
        &self,
        req: csi::NodeGetInfoRequest,
    ) -> Result<csi::NodeGetInfoResponse, CsiError> {
        const OP: &str = "NodeGetInfo";
        let mut c = self.node.clone();
        let resp = self.unary(OP, c.node_get_info(self.request(req))).await?;
        if resp.node_id.is_empty() {
            return Err(self.invalid_response(OP, "node_id is empty"));
        }
        if resp.max_volumes_per_node < 0 {
            return Err(self.invalid_response(OP, "max_volumes_per_node is negative"));
        }
        Ok(resp)
    }

    pub async fn node_get_capabilities(
        &self,
        req: csi::NodeGetCapabilitiesRequest,
    ) -> Result<csi::NodeGetCapabilitiesResponse, CsiError> {
        let mut c = self.node.clone();
        self.unary(
            "NodeGetCapabilities",
            c.node_get_capabilities(self.request(req)),
        )
        .await
    }

    /// `NodeGetVolumeStats`; usage figures that are negative are an error.
    pub async fn node_get_volume_stats(
        &self,
        req: csi::NodeGetVolumeStatsRequest,
    ) -> Result<csi::NodeGetVolumeStatsResponse, CsiError> {
        const OP: &str = "NodeGetVolumeStats";
        let mut c = self.node.clone();
        let resp = self
            .unary(OP, c.node_get_volume_stats(self.request(req)))
            .await?;
        if let Some(u) = resp
            .usage
            .iter()
            .find(|u| u.total < 0 || u.used < 0 || u.available < 0)
        {
            return Err(self.invalid_response(
                OP,
                format!(
                    "negative usage (total {}, used {}, available {})",
                    u.total, u.used, u.available
                ),
            ));
        }
        Ok(resp)
    }

    pub async fn node_stage_volume(
        &self,
        req: csi::NodeStageVolumeRequest,
    ) -> Result<csi::NodeStageVolumeResponse, CsiError> {
        let mut c = self.node.clone();
        self.unary("NodeStageVolume", c.node_stage_volume(self.request(req)))
            .await
    }

    pub async fn node_unstage_volume(
        &self,
        req: csi::NodeUnstageVolumeRequest,
    ) -> Result<csi::NodeUnstageVolumeResponse, CsiError> {
        let mut c = self.node.clone();
        self.unary(
            "NodeUnstageVolume",
            c.node_unstage_volume(self.request(req)),
        )
        .await
    }

    pub async fn node_publish_volume(
        &self,
        req: csi::NodePublishVolumeRequest,
    ) -> Result<csi::NodePublishVolumeResponse, CsiError> {
        let mut c = self.node.clone();
        self.unary(
            "NodePublishVolume",
            c.node_publish_volume(self.request(req)),
        )
        .await
    }

    pub async fn node_unpublish_volume(
        &self,
        req: csi::NodeUnpublishVolumeRequest,
    ) -> Result<csi::NodeUnpublishVolumeResponse, CsiError> {
        let mut c = self.node.clone();
        self.unary(
            "NodeUnpublishVolume",
            c.node_unpublish_volume(self.request(req)),
        )
        .await
    }

    pub async fn node_expand_volume(
        &self,
        req: csi::NodeExpandVolumeRequest,
    ) -> Result<csi::NodeExpandVolumeResponse, CsiError> {
        let mut c = self.node.clone();
        self.unary("NodeExpandVolume", c.node_expand_volume(self.request(req)))
            .await
    }
}

/// The gRPC name of `code`, as metrics label it.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Cancelled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// Whether `status` is tonic's own client-side deadline expiring.
fn is_client_timeout(status: &tonic::Status) -> bool {
    if status.code() != Code::Cancelled {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = err.source();
    }
    status.message() == tonic::TimeoutExpired(()).to_string()
}
