//! Volume expansion: the controller's ControllerExpandVolume and the
//! node's NodeExpandVolume, and what a volume update's spec may change.

use crate::csi::capability_pb;
use crate::csi::expand::*;
use crate::error::ServerError;
use crate::state::Change;
use berth_proto::berth::v1 as pb;
use berth_structs::{ClaimState, CsiVolume};
use futures_util::future::join_all;
use std::collections::BTreeMap;

use super::Server;

impl Server {
    /// `volume create` of `new` when the volume `old` exists: a no-op when
    /// nothing changed, an expansion when only the capacity grew, else the
    /// "already exists" conflict. The caller holds the volume's lock.
    pub(super) async fn recreate_volume_locked(
        &self,
        old: &CsiVolume,
        new: &CsiVolume,
    ) -> Result<(), ServerError> {
        let differs = spec_differences(old, new);
        if !differs.is_empty() {
            return Err(ServerError::Conflict(format!(
                "volume {:?} already exists and its {} differ; only capacity_min and capacity_max can change (to grow it)",
                old.id,
                differs.join(", ")
            )));
        }
        match capacity_change(old, new)? {
            CapacityChange::Unchanged => Ok(()),
            CapacityChange::Requests => {
                self.store_capacity(&old.id, new.capacity_min, new.capacity_max, None)
            }
            CapacityChange::Grow => self.expand_volume_locked(old, new).await,
        }
    }

    /// Records the capacity requests (and, when known, the capacity) of the
    /// volume `id`.
    fn store_capacity(
        &self,
        id: &str,
        min: Option<u64>,
        max: Option<u64>,
        capacity: Option<u64>,
    ) -> Result<(), ServerError> {
        self.store
            .write(|t, changes| {
                let Some(mut v) = t.volumes.get(id).cloned() else {
                    return Err(ServerError::not_found(format!("volume {id:?} not found")));
                };
                v.capacity_min = min;
                v.capacity_max = max;
                if let Some(c) = capacity {
                    v.capacity = c;
                }
                changes.push(Change::PutVolume(v));
                Ok(())
            })
            .map(|_| ())
    }

    async fn expand_volume_locked(
        &self,
        old: &CsiVolume,
        new: &CsiVolume,
    ) -> Result<(), ServerError> {
        let id = &old.id;
        let plugin_id = &old.plugin_id;
        let (min, max) = (to_i64(new.capacity_min), to_i64(new.capacity_max));
        let Some(first) = old.capabilities.first() else {
            return Err(ServerError::Internal(format!(
                "volume {id:?} has no capability"
            )));
        };
        let capability =
            capability_pb(first.access_mode, first.attachment_mode, &old.mount_options);
        let secrets: std::collections::HashMap<String, String> =
            old.secrets.clone().into_iter().collect();

        // The controller step, when the plugin has a controller.
        let (controller_expanded, node_step) = self
            .expand_by_controller(old, (min, max), &capability, &secrets)
            .await?;
        if !node_step {
            return self.store_capacity(id, new.capacity_min, new.capacity_max, None);
        }

        // The node step, on every node where the volume is published.
        let by_node = Self::published_on_nodes(old);
        if by_node.is_empty() {
            return match controller_expanded {
                // Not mounted anywhere: a node stages it at its new size.
                Some(_) => self.store_capacity(id, new.capacity_min, new.capacity_max, None),
                None => Err(ServerError::BadRequest(format!(
                    "cannot expand volume {id:?}: CSI plugin {plugin_id:?} has no controller that supports EXPAND_VOLUME, \
                     and the volume is not in use on any node whose node plugin could expand it"
                ))),
            };
        }
        let (failures, node_capacity) = self
            .expand_on_nodes(
                old,
                by_node,
                (min, max),
                &secrets,
                controller_expanded.is_some(),
            )
            .await;
        if failures.is_empty() {
            let capacity = (controller_expanded.is_none() && node_capacity > 0)
                .then(|| node_capacity.max(u64::try_from(min).unwrap_or(0)));
            return self.store_capacity(id, new.capacity_min, new.capacity_max, capacity);
        }
        Err(Self::node_step_failed(id, failures, controller_expanded))
    }

    /// The controller step of an expansion (ControllerExpandVolume through
    /// a client running the controller), when the plugin has a controller:
    /// the node of that controller and the capacity it expanded the volume
    /// to (stored at once), and whether the node step is still needed.
    async fn expand_by_controller(
        &self,
        old: &CsiVolume,
        (min, max): (i64, i64),
        capability: &pb::VolumeCapability,
        secrets: &std::collections::HashMap<String, String>,
    ) -> Result<(Option<(String, u64)>, bool), ServerError> {
        let id = &old.id;
        let plugin_id = &old.plugin_id;
        let has_controller = self.store.read(|t| {
            t.nodes
                .values()
                .any(|n| n.csi_controller_plugins.contains_key(plugin_id))
        });
        let mut controller_expanded: Option<(String, u64)> = None;
        let mut node_step = true;
        if has_controller {
            let controller = self.controller_client(plugin_id)?;
            let call = pb::server_call::Call::ExpandVolume(pb::ExpandVolume {
                plugin_id: plugin_id.clone(),
                external_id: old.external_id.clone(),
                capacity_min: min,
                capacity_max: max,
                capability: Some(capability.clone()),
                secrets: secrets.clone(),
            });
            let reply = self
                .calls
                .call(&controller, call, self.config.client_call_timeout)
                .await
                .map_err(|e| during(&format!("expanding volume {id:?} (controller)"), e))?;
            let pb::call_reply::Result::ExpandVolume(r) = reply else {
                return Err(ServerError::Internal(format!(
                    "node {controller} answered ExpandVolume with another kind of reply"
                )));
            };
            if r.controller_supported {
                let capacity = u64::try_from(r.capacity_bytes)
                    .ok()
                    .filter(|&c| c > 0)
                    .unwrap_or(u64::try_from(min).unwrap_or(0));
                // The requests wait for the node step; the capacity is real.
                self.store_capacity(id, old.capacity_min, old.capacity_max, Some(capacity))?;
                tracing::info!(volume_id = %id, plugin_id = %plugin_id, capacity, node_expansion_required = r.node_expansion_required, "volume expanded by its controller");
                controller_expanded = Some((controller, capacity));
                node_step = r.node_expansion_required;
            }
        }
        Ok((controller_expanded, node_step))
    }

    /// The nodes where `old` is published (claims taken and not being
    /// released): for each, the allocs using it and its capability there.
    fn published_on_nodes(
        old: &CsiVolume,
    ) -> BTreeMap<String, (Vec<String>, pb::VolumeCapability)> {
        let mut by_node: BTreeMap<String, (Vec<String>, pb::VolumeCapability)> = BTreeMap::new();
        for c in old
            .claims()
            .filter(|c| c.state == ClaimState::Taken && !c.releasing)
        {
            by_node
                .entry(c.node_id.clone())
                .or_insert_with(|| {
                    (
                        Vec::new(),
                        capability_pb(c.access_mode, c.attachment_mode, &old.mount_options),
                    )
                })
                .0
                .push(c.alloc_id.clone());
        }
        by_node
    }

    /// The node step of an expansion (NodeExpandVolume), on every node of
    /// `by_node` at once: what failed, by node, with its code, and the
    /// largest capacity a node reported.
    async fn expand_on_nodes(
        &self,
        old: &CsiVolume,
        by_node: BTreeMap<String, (Vec<String>, pb::VolumeCapability)>,
        (min, max): (i64, i64),
        secrets: &std::collections::HashMap<String, String>,
        controller_expanded: bool,
    ) -> (Vec<(tonic::Code, String)>, u64) {
        let id = &old.id;
        let plugin_id = &old.plugin_id;
        // The nodes are asked at once: a node that does not answer holds
        // neither the others nor the volume's lock for a deadline each.
        let steps: Vec<_> = by_node
            .into_iter()
            .map(|(node_id, (alloc_ids, capability))| {
                let call = pb::server_call::Call::ExpandVolumeOnNode(pb::ExpandVolumeOnNode {
                    plugin_id: plugin_id.clone(),
                    volume_id: id.clone(),
                    external_id: old.external_id.clone(),
                    capacity_min: min,
                    capacity_max: max,
                    capability: Some(capability),
                    secrets: secrets.clone(),
                    alloc_ids,
                });
                async move {
                    let result = self
                        .calls
                        .call(&node_id, call, self.config.client_call_timeout)
                        .await;
                    (node_id, result)
                }
            })
            .collect();
        let mut failures = Vec::new();
        let mut node_capacity = 0u64;
        for (node_id, result) in join_all(steps).await {
            match result {
                Ok(pb::call_reply::Result::ExpandVolumeOnNode(r)) if r.node_supported => {
                    node_capacity = node_capacity.max(u64::try_from(r.capacity_bytes).unwrap_or(0));
                    tracing::info!(volume_id = %id, node_id = %node_id, capacity_bytes = r.capacity_bytes, "volume expanded on a node");
                }
                Ok(pb::call_reply::Result::ExpandVolumeOnNode(_)) => failures.push((
                    tonic::Code::FailedPrecondition,
                    format!(
                        "node {node_id}: NodeExpandVolume: the node plugin of {plugin_id:?} lacks the EXPAND_VOLUME capability{}",
                        if controller_expanded {
                            ", but its controller says the node must expand the volume"
                        } else {
                            " and its controller cannot expand volumes either"
                        }
                    ),
                )),
                Ok(_) => failures.push((
                    tonic::Code::Internal,
                    format!("node {node_id} answered ExpandVolumeOnNode with another kind of reply"),
                )),
                Err(e) => {
                    // The call layer names the call and node; say it once.
                    let text = e.to_string();
                    let prefix = format!("ExpandVolumeOnNode on node {node_id}: ");
                    let text = text.strip_prefix(&prefix).unwrap_or(&text);
                    let text = if text.starts_with("NodeExpandVolume") {
                        text.to_string()
                    } else {
                        format!("NodeExpandVolume: {text}")
                    };
                    failures.push((e.grpc_code(), format!("node {node_id}: {text}")))
                }
            }
        }
        (failures, node_capacity)
    }

    /// The error of a node step that failed on some node: the first
    /// failure's code, every node's message, and what the controller did.
    fn node_step_failed(
        id: &str,
        failures: Vec<(tonic::Code, String)>,
        controller_expanded: Option<(String, u64)>,
    ) -> ServerError {
        let code = failures[0].0;
        let done = match &controller_expanded {
            Some((node, capacity)) => {
                format!(" (the controller on node {node} expanded it to {capacity} bytes)")
            }
            None => String::new(),
        };
        ServerError::Remote {
            code,
            message: format!(
                "expanding volume {id:?} on its nodes failed{done}: {}",
                failures
                    .into_iter()
                    .map(|(_, m)| m)
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        }
    }
}
