//! The CSI Identity service.

use berth_proto::csi::v1::identity_server::Identity;
use berth_proto::csi::v1::plugin_capability::{self, service};
use berth_proto::csi::v1::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};
use tonic::{Request, Response, Status};

use crate::plugin::{Plugin, PLUGIN_NAME, PLUGIN_VERSION};

#[tonic::async_trait]
impl Identity for Plugin {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        self.call("GetPluginInfo", |p| async move {
            p.inject("GetPluginInfo").await?;
            Ok(GetPluginInfoResponse {
                name: PLUGIN_NAME.to_owned(),
                vendor_version: PLUGIN_VERSION.to_owned(),
                manifest: Default::default(),
            })
        })
        .await
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        self.call("GetPluginCapabilities", |p| async move {
            p.inject("GetPluginCapabilities").await?;
            Ok(GetPluginCapabilitiesResponse {
                capabilities: vec![PluginCapability {
                    r#type: Some(plugin_capability::Type::Service(
                        plugin_capability::Service {
                            r#type: service::Type::ControllerService as i32,
                        },
                    )),
                }],
            })
        })
        .await
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        self.call("Probe", |p| async move {
            p.inject("Probe").await?;
            Ok(ProbeResponse { ready: Some(true) })
        })
        .await
    }
}
