//! The CSI Identity service.

use berth_proto::csi::v1::identity_server::Identity;
use berth_proto::csi::v1::plugin_capability::{self, service, volume_expansion};
use berth_proto::csi::v1::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};
use tonic::{Request, Response, Status};

use crate::plugin::{Plugin, PLUGIN_NAME, PLUGIN_VERSION};

impl Plugin {
    fn plugin_capabilities(&self) -> GetPluginCapabilitiesResponse {
        let mut services = vec![service::Type::ControllerService];
        if !self.topology().is_empty() {
            services.push(service::Type::VolumeAccessibilityConstraints);
        }
        let mut capabilities: Vec<PluginCapability> = services
            .into_iter()
            .map(|t| PluginCapability {
                r#type: Some(plugin_capability::Type::Service(
                    plugin_capability::Service { r#type: t as i32 },
                )),
            })
            .collect();
        // Volumes grow while published: the controller grows the data, the
        // node the filesystem of an image-backed volume.
        capabilities.push(PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: volume_expansion::Type::Online as i32,
                },
            )),
        });
        GetPluginCapabilitiesResponse { capabilities }
    }
}

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
            Ok(p.plugin_capabilities())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn services(p: &Plugin) -> Vec<service::Type> {
        p.plugin_capabilities()
            .capabilities
            .into_iter()
            .filter_map(|c| match c.r#type {
                Some(plugin_capability::Type::Service(s)) => s.r#type.try_into().ok(),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn topology_adds_accessibility_constraints() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            socket_path: dir.path().join("csi.sock"),
            state_dir: dir.path().join("state"),
            node_id: "node-a".into(),
            ..Default::default()
        };
        let plain = Plugin::new(&config).unwrap();
        assert_eq!(services(&plain), [service::Type::ControllerService]);
        let zoned = Plugin::new(&Config {
            topology: [("zone".to_owned(), "z1".to_owned())].into(),
            ..config
        })
        .unwrap();
        assert_eq!(
            services(&zoned),
            [
                service::Type::ControllerService,
                service::Type::VolumeAccessibilityConstraints
            ]
        );
    }

    #[test]
    fn volumes_expand_online() {
        let dir = tempfile::tempdir().unwrap();
        let p = Plugin::new(&Config {
            socket_path: dir.path().join("csi.sock"),
            state_dir: dir.path().join("state"),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .unwrap();
        let expansion: Vec<_> = p
            .plugin_capabilities()
            .capabilities
            .into_iter()
            .filter_map(|c| match c.r#type {
                Some(plugin_capability::Type::VolumeExpansion(e)) => Some(e.r#type),
                _ => None,
            })
            .collect();
        assert_eq!(expansion, [volume_expansion::Type::Online as i32]);
    }
}
