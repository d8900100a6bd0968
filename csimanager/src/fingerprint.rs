//! Fingerprinting of registered plugins: what each plugin is, whether it is
//! healthy, and what it can do, as the node reports it to the servers.

use berth_proto::csi::v1 as csi;
use berth_structs::{CsiInfo, CsiTopology};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use csi::plugin_capability::service::Type as PluginService;

use crate::client::CsiClient;
use crate::error::CsiError;
use crate::registry::PluginRegistration;

/// The fingerprint of one plugin instance: its node entry when its type has
/// a node service, its controller entry when its type has a controller
/// service (a monolith has both).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PluginFingerprint {
    pub node: Option<CsiInfo>,
    pub controller: Option<CsiInfo>,
}

impl PluginFingerprint {
    /// Healthy when every service the plugin is registered for is healthy.
    pub fn healthy(&self) -> bool {
        let entries = [self.node.as_ref(), self.controller.as_ref()];
        let mut present = entries.into_iter().flatten().peekable();
        present.peek().is_some() && present.all(|i| i.healthy)
    }

    /// The first unhealthy entry's description, or empty.
    pub fn health_error(&self) -> String {
        [self.node.as_ref(), self.controller.as_ref()]
            .into_iter()
            .flatten()
            .find(|i| !i.healthy)
            .map(|i| i.health_description.clone())
            .unwrap_or_default()
    }

    /// Makes every entry unhealthy for `why`, keeping all else.
    pub fn set_unhealthy(&mut self, why: &str) {
        for info in [self.node.as_mut(), self.controller.as_mut()]
            .into_iter()
            .flatten()
        {
            info.healthy = false;
            info.health_description = why.to_string();
        }
    }

    /// Gives each unhealthy entry the capability flags of the same service's
    /// entry in `last_good` (the last healthy one): a plugin that is down or
    /// restarting still needs, say, controller publishing. Only health and
    /// its description say that it is unhealthy. A provider the plugin
    /// could not be asked for is the last good one too.
    pub fn keep_capabilities_of(&mut self, last_good: &PluginFingerprint) {
        for (now, good) in [
            (self.node.as_mut(), last_good.node.as_ref()),
            (self.controller.as_mut(), last_good.controller.as_ref()),
        ] {
            if let (Some(now), Some(good)) = (now, good) {
                if !now.healthy {
                    if now.provider.is_empty() {
                        now.provider = good.provider.clone();
                        now.version = good.version.clone();
                    }
                    now.requires_controller_publish = good.requires_controller_publish;
                    now.supports_stage_unstage = good.supports_stage_unstage;
                    now.supports_create_delete = good.supports_create_delete;
                    now.external_node_id = good.external_node_id.clone();
                    now.max_volumes = good.max_volumes;
                    now.supports_volume_stats = good.supports_volume_stats;
                    now.supports_volume_condition = good.supports_volume_condition;
                    now.accessible_topology = good.accessible_topology.clone();
                    now.supports_expand = good.supports_expand;
                    now.supports_snapshots = good.supports_snapshots;
                }
            }
        }
    }

    /// Records the healthy entries of `fp` as the last good ones.
    pub fn remember_healthy(&mut self, fp: &PluginFingerprint) {
        if let Some(n) = fp.node.as_ref().filter(|n| n.healthy) {
            self.node = Some(n.clone());
        }
        if let Some(c) = fp.controller.as_ref().filter(|c| c.healthy) {
            self.controller = Some(c.clone());
        }
    }
}

const HEALTHY: &str = "healthy";

/// The fingerprint of a plugin whose supervisor says it is unhealthy (its
/// task died, a probe failed), made without asking the plugin: unhealthy
/// for `why`, with the provider it registered with.
pub fn unhealthy_fingerprint(reg: &PluginRegistration, why: &str) -> PluginFingerprint {
    let mut fp = registered(reg);
    fp.set_unhealthy(why);
    fp
}

/// The entries the registration's type has, unhealthy until fingerprinted.
fn registered(reg: &PluginRegistration) -> PluginFingerprint {
    let base = CsiInfo {
        plugin_id: reg.plugin_id.clone(),
        alloc_id: reg.alloc_id.clone(),
        provider: reg.provider.clone(),
        version: reg.version.clone(),
        healthy: false,
        health_description: String::new(),
        ..CsiInfo::default()
    };
    PluginFingerprint {
        node: reg.plugin_type.has_node().then(|| base.clone()),
        controller: reg.plugin_type.has_controller().then(|| base.clone()),
    }
}

/// Fingerprints the plugin registered as `reg` through `client`. Never
/// fails: a plugin that cannot be fingerprinted is reported unhealthy, with
/// the reason in `health_description`.
pub async fn fingerprint(client: &CsiClient, reg: &PluginRegistration) -> PluginFingerprint {
    let mut fp = registered(reg);

    let identity = match identity(client).await {
        Ok(i) => i,
        Err(e) => {
            fp.set_unhealthy(&e.to_string());
            return fp;
        }
    };
    for info in [fp.node.as_mut(), fp.controller.as_mut()]
        .into_iter()
        .flatten()
    {
        info.provider = identity.provider.clone();
        info.version = identity.version.clone();
    }
    if !identity.ready {
        fp.set_unhealthy("plugin is not ready (Probe)");
        return fp;
    }

    if let Some(info) = fp.node.as_mut() {
        match node_fingerprint(client, info).await {
            Ok(()) => {
                info.healthy = true;
                info.health_description = HEALTHY.to_string();
            }
            Err(e) => {
                info.healthy = false;
                info.health_description = e.to_string();
            }
        }
    }
    if let Some(info) = fp.controller.as_mut() {
        if !identity.controller_service {
            info.healthy = false;
            info.health_description =
                "plugin does not advertise CONTROLLER_SERVICE (GetPluginCapabilities)".to_string();
        } else {
            match controller_fingerprint(client, info).await {
                Ok(()) => {
                    info.healthy = true;
                    info.health_description = HEALTHY.to_string();
                }
                Err(e) => {
                    info.healthy = false;
                    info.health_description = e.to_string();
                }
            }
        }
    }
    fp
}

struct Identity {
    provider: String,
    version: String,
    ready: bool,
    controller_service: bool,
}

async fn identity(client: &CsiClient) -> Result<Identity, CsiError> {
    let info = client.get_plugin_info(csi::GetPluginInfoRequest {}).await?;
    let caps = client
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await?;
    let probe = client.probe(csi::ProbeRequest {}).await?;
    let controller_service = caps.capabilities.iter().any(|c| {
        matches!(
            c.r#type,
            Some(csi::plugin_capability::Type::Service(s))
                if s.r#type == PluginService::ControllerService as i32
        )
    });
    Ok(Identity {
        provider: info.name,
        version: info.vendor_version,
        // An unset `ready` means ready (CSI spec).
        ready: probe.ready.unwrap_or(true),
        controller_service,
    })
}

async fn node_fingerprint(client: &CsiClient, info: &mut CsiInfo) -> Result<(), CsiError> {
    let node = client.node_get_info(csi::NodeGetInfoRequest {}).await?;
    let caps = client
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
        .await?;
    info.external_node_id = node.node_id;
    info.max_volumes = u64::try_from(node.max_volumes_per_node).unwrap_or(0);
    info.accessible_topology = node_topology(node.accessible_topology);
    info.supports_stage_unstage = node_supports_stage_unstage(&caps);
    info.supports_volume_stats = node_has_rpc(&caps, NodeRpc::GetVolumeStats);
    info.supports_volume_condition = node_has_rpc(&caps, NodeRpc::VolumeCondition);
    info.supports_expand = node_has_rpc(&caps, NodeRpc::ExpandVolume);
    Ok(())
}

async fn controller_fingerprint(client: &CsiClient, info: &mut CsiInfo) -> Result<(), CsiError> {
    let caps = client
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await?;
    let has = |want: ControllerRpc| controller_has_rpc(&caps, want);
    info.requires_controller_publish = has(ControllerRpc::PublishUnpublishVolume);
    info.supports_create_delete = has(ControllerRpc::CreateDeleteVolume);
    info.supports_expand = has(ControllerRpc::ExpandVolume);
    info.supports_snapshots = has(ControllerRpc::CreateDeleteSnapshot);
    Ok(())
}

/// Whether the controller service advertises the RPC capability `want`.
pub fn controller_has_rpc(
    caps: &csi::ControllerGetCapabilitiesResponse,
    want: ControllerRpc,
) -> bool {
    caps.capabilities.iter().any(|c| {
        matches!(
            c.r#type,
            Some(csi::controller_service_capability::Type::Rpc(r)) if r.r#type == want as i32
        )
    })
}

/// The node's topology as NodeGetInfo answers it; `None` when the plugin
/// answers none or one without segments.
pub fn node_topology(topology: Option<csi::Topology>) -> Option<CsiTopology> {
    topology
        .filter(|t| !t.segments.is_empty())
        .map(|t| CsiTopology::new(t.segments.into_iter().collect()))
}

/// Whether the node service advertises `STAGE_UNSTAGE_VOLUME`.
pub fn node_supports_stage_unstage(caps: &csi::NodeGetCapabilitiesResponse) -> bool {
    node_has_rpc(caps, NodeRpc::StageUnstageVolume)
}

/// Whether the node service advertises the RPC capability `want`.
pub fn node_has_rpc(caps: &csi::NodeGetCapabilitiesResponse, want: NodeRpc) -> bool {
    caps.capabilities.iter().any(|c| {
        matches!(
            c.r#type,
            Some(csi::node_service_capability::Type::Rpc(r)) if r.r#type == want as i32
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(healthy: bool, why: &str) -> CsiInfo {
        CsiInfo {
            healthy,
            health_description: why.into(),
            ..CsiInfo::default()
        }
    }

    /// The node entry of a round unhealthy for `why` that follows a
    /// healthy round whose node entry was `good`.
    fn node_after_unhealthy_round(good: CsiInfo, why: &str) -> CsiInfo {
        let mut last_good = PluginFingerprint::default();
        last_good.remember_healthy(&PluginFingerprint {
            node: Some(good),
            controller: None,
        });
        let mut fp = PluginFingerprint {
            node: Some(info(false, why)),
            controller: None,
        };
        fp.keep_capabilities_of(&last_good);
        fp.node.unwrap()
    }

    fn rpc_cap(t: NodeRpc) -> csi::NodeServiceCapability {
        csi::NodeServiceCapability {
            r#type: Some(csi::node_service_capability::Type::Rpc(
                csi::node_service_capability::Rpc { r#type: t as i32 },
            )),
        }
    }

    #[test]
    fn a_monolith_is_healthy_only_when_both_services_are() {
        let mut fp = PluginFingerprint {
            node: Some(info(true, "healthy")),
            controller: Some(info(false, "boom")),
        };
        assert!(!fp.healthy());
        assert_eq!(fp.health_error(), "boom");
        fp.controller = Some(info(true, "healthy"));
        assert!(fp.healthy());
        assert_eq!(fp.health_error(), "");
        assert!(!PluginFingerprint::default().healthy());
    }

    #[test]
    fn an_unhealthy_entry_keeps_the_last_good_capability_flags() {
        let good = CsiInfo {
            healthy: true,
            health_description: "healthy".into(),
            external_node_id: "node-1".into(),
            max_volumes: 7,
            supports_stage_unstage: true,
            requires_controller_publish: true,
            supports_create_delete: true,
            ..CsiInfo::default()
        };
        let mut last_good = PluginFingerprint::default();
        last_good.remember_healthy(&PluginFingerprint {
            node: Some(good.clone()),
            controller: Some(good.clone()),
        });
        // A failed round does not overwrite what was last good.
        last_good.remember_healthy(&PluginFingerprint {
            node: Some(info(false, "down")),
            controller: Some(info(false, "down")),
        });
        let mut fp = PluginFingerprint {
            node: Some(info(false, "down")),
            controller: Some(info(true, "healthy")),
        };
        fp.keep_capabilities_of(&last_good);
        let node = fp.node.as_ref().unwrap();
        assert!(!node.healthy);
        assert_eq!(node.health_description, "down");
        assert_eq!(node.external_node_id, "node-1");
        assert_eq!(node.max_volumes, 7);
        assert!(node.supports_stage_unstage);
        assert!(node.requires_controller_publish && node.supports_create_delete);
        // A healthy entry reports what the plugin says now.
        let ctrl = fp.controller.as_ref().unwrap();
        assert!(!ctrl.requires_controller_publish && !ctrl.supports_create_delete);
    }

    #[test]
    fn an_unhealthy_entry_without_a_provider_keeps_the_last_good_one() {
        let good = CsiInfo {
            healthy: true,
            provider: "hostpath.csi.berth.dev".into(),
            version: "1.0".into(),
            ..CsiInfo::default()
        };
        let node = node_after_unhealthy_round(good, "connection refused");
        assert_eq!(node.provider, "hostpath.csi.berth.dev");
        assert_eq!(node.version, "1.0");
        assert!(!node.healthy);
        assert_eq!(node.health_description, "connection refused");
    }

    #[test]
    fn the_node_topology_is_read_and_an_empty_one_is_none() {
        let t = csi::Topology {
            segments: [("zone".to_string(), "a".to_string())].into(),
        };
        let got = node_topology(Some(t)).expect("a topology");
        assert_eq!(got.to_string(), "{zone=a}");
        assert_eq!(node_topology(Some(csi::Topology::default())), None);
        assert_eq!(node_topology(None), None);

        // An unhealthy round keeps the last good topology.
        let good = CsiInfo {
            healthy: true,
            accessible_topology: Some(got.clone()),
            ..CsiInfo::default()
        };
        let node = node_after_unhealthy_round(good, "down");
        assert_eq!(node.accessible_topology, Some(got));
    }

    #[test]
    fn volume_stats_capabilities_are_read_and_kept_while_unhealthy() {
        let caps = csi::NodeGetCapabilitiesResponse {
            capabilities: vec![
                rpc_cap(NodeRpc::GetVolumeStats),
                rpc_cap(NodeRpc::VolumeCondition),
            ],
        };
        assert!(node_has_rpc(&caps, NodeRpc::GetVolumeStats));
        assert!(node_has_rpc(&caps, NodeRpc::VolumeCondition));
        assert!(!node_has_rpc(&caps, NodeRpc::ExpandVolume));

        let good = CsiInfo {
            healthy: true,
            supports_volume_stats: true,
            supports_volume_condition: true,
            ..CsiInfo::default()
        };
        let node = node_after_unhealthy_round(good, "down");
        assert!(node.supports_volume_stats && node.supports_volume_condition);
    }

    #[test]
    fn stage_unstage_capability_is_read() {
        let yes = csi::NodeGetCapabilitiesResponse {
            capabilities: vec![
                rpc_cap(NodeRpc::GetVolumeStats),
                rpc_cap(NodeRpc::StageUnstageVolume),
            ],
        };
        let no = csi::NodeGetCapabilitiesResponse {
            capabilities: vec![rpc_cap(NodeRpc::GetVolumeStats)],
        };
        assert!(node_supports_stage_unstage(&yes));
        assert!(!node_supports_stage_unstage(&no));
    }
}
