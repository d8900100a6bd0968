//! Growing a volume: `volume create` of a volume that exists, asking for
//! more capacity. The controller step (`ControllerExpandVolume`) runs
//! through a client that runs the plugin's controller, when that controller
//! can expand; the node step (`NodeExpandVolume`) runs on every node where
//! the volume is published, when the controller says it is needed or there
//! was no controller step. Anything but the capacity differing from the
//! volume is the "already exists" conflict; asking for less is an error:
//! volumes cannot shrink.

use std::collections::BTreeMap;

use berth_proto::berth::v1 as pb;
use berth_structs::{ClaimState, CsiVolume};
use futures_util::future::join_all;

use super::capability_pb;
use crate::error::ServerError;
use crate::server::Server;
use crate::state::Change;

/// What a create of an existing volume asks of its capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapacityChange {
    /// The same requests: nothing to do.
    Unchanged,
    /// Other requests the volume already satisfies: they are stored, no
    /// plugin is called.
    Requests,
    /// More than the volume has: expand it.
    Grow,
}

/// The fields of a volume spec other than its capacity in which `new`
/// differs from the volume `old` (by name; secrets by name only).
pub fn spec_differences(old: &CsiVolume, new: &CsiVolume) -> Vec<&'static str> {
    let mut out = Vec::new();
    let sorted = |v: &CsiVolume| {
        let mut caps: Vec<_> = v
            .capabilities
            .iter()
            .map(|c| (c.access_mode, c.attachment_mode))
            .collect();
        caps.sort();
        caps.dedup();
        caps
    };
    let name = |v: &CsiVolume| {
        if v.name.is_empty() {
            v.id.clone()
        } else {
            v.name.clone()
        }
    };
    if old.plugin_id != new.plugin_id {
        out.push("plugin_id");
    }
    if name(old) != name(new) {
        out.push("name");
    }
    if !new.external_id.is_empty() && new.external_id != old.external_id {
        out.push("external_id");
    }
    if sorted(old) != sorted(new) {
        out.push("capability");
    }
    if old.mount_options != new.mount_options {
        out.push("mount_options");
    }
    if old.parameters != new.parameters {
        out.push("parameters");
    }
    if old.secrets != new.secrets {
        out.push("secrets");
    }
    if old.requested_topologies != new.requested_topologies {
        out.push("topology_request");
    }
    if old.snapshot_id != new.snapshot_id {
        out.push("snapshot_id");
    }
    if old.clone_id != new.clone_id {
        out.push("clone_id");
    }
    out
}

/// How `new`'s capacity requests relate to the volume `old`. Asking for
/// less than the volume has (a lower `capacity_min` than before, or a
/// `capacity_max` below its capacity) is an error: volumes cannot shrink.
/// The requests are stored only once an expansion has fully succeeded, so
/// creating the same spec again after a failed step retries it.
pub fn capacity_change(old: &CsiVolume, new: &CsiVolume) -> Result<CapacityChange, ServerError> {
    if (old.capacity_min, old.capacity_max) == (new.capacity_min, new.capacity_max) {
        return Ok(CapacityChange::Unchanged);
    }
    let id = &old.id;
    let (old_min, new_min) = (old.capacity_min.unwrap_or(0), new.capacity_min.unwrap_or(0));
    if new_min < old_min {
        let asks = match new.capacity_min {
            Some(m) => format!("capacity_min {m} asks for less"),
            None => "the spec sets no capacity_min (keep it to leave the size as it is)".into(),
        };
        return Err(ServerError::BadRequest(format!(
            "volumes cannot shrink: volume {id:?} was created with capacity_min {old_min} bytes; {asks}"
        )));
    }
    // What the volume has: the plugin's answer, else what was asked.
    let current = if old.capacity > 0 {
        old.capacity
    } else {
        old_min.max(old.capacity_max.unwrap_or(0))
    };
    if let Some(max) = new.capacity_max.filter(|&m| m < current) {
        return Err(ServerError::BadRequest(format!(
            "volumes cannot shrink: volume {id:?} has {current} bytes; capacity_max {max} asks for less"
        )));
    }
    // A request that rose expands, also when the volume already has that
    // much: the plugin answers an expand it has done as done, and the node
    // step that a failure left undone is made again.
    let wanted = new.capacity_min.or(new.capacity_max).unwrap_or(0);
    let asked = old.capacity_min.or(old.capacity_max).unwrap_or(0);
    Ok(if wanted > current || (asked > 0 && wanted > asked) {
        CapacityChange::Grow
    } else {
        CapacityChange::Requests
    })
}

fn to_i64(v: Option<u64>) -> i64 {
    i64::try_from(v.unwrap_or(0)).unwrap_or(i64::MAX)
}

/// `e` with what was being done in front of its message.
fn during(what: &str, e: ServerError) -> ServerError {
    match e {
        ServerError::Remote { code, message } => ServerError::Remote {
            code,
            message: format!("{what}: {message}"),
        },
        ServerError::Unavailable(m) => ServerError::Unavailable(format!("{what}: {m}")),
        other => other,
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use berth_structs::{AccessMode, AttachmentMode, VolumeCapability};

    fn vol(min: Option<u64>, max: Option<u64>, capacity: u64) -> CsiVolume {
        CsiVolume {
            id: "data".into(),
            name: "data".into(),
            plugin_id: "hostpath".into(),
            external_id: "ext-data".into(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            capacity_min: min,
            capacity_max: max,
            capacity,
            ..Default::default()
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn capacity_changes_grow_keep_or_refuse_to_shrink() {
        let old = vol(Some(20 * MIB), None, 20 * MIB);
        let same = vol(Some(20 * MIB), None, 0);
        assert_eq!(
            capacity_change(&old, &same).unwrap(),
            CapacityChange::Unchanged
        );
        let more = vol(Some(40 * MIB), None, 0);
        assert_eq!(capacity_change(&old, &more).unwrap(), CapacityChange::Grow);
        let less = vol(Some(10 * MIB), None, 0);
        let err = capacity_change(&old, &less).unwrap_err();
        assert!(err.to_string().contains("volumes cannot shrink"), "{err}");
        assert_eq!(err.http_status(), 400);
        // A spec without the capacity_min the volume was created with says
        // so, rather than asking for 0 bytes.
        let unset = vol(None, None, 0);
        let err = capacity_change(&old, &unset).unwrap_err().to_string();
        assert!(err.contains("the spec sets no capacity_min"), "{err}");
        // A capacity_max below what the volume has is a shrink too.
        let capped = vol(Some(20 * MIB), Some(10 * MIB), 0);
        assert!(capacity_change(&old, &capped).is_err());
        // A max the volume is within is a request change only.
        let with_max = vol(Some(20 * MIB), Some(100 * MIB), 0);
        assert_eq!(
            capacity_change(&old, &with_max).unwrap(),
            CapacityChange::Requests
        );
        // A request that rose expands even when the volume already has
        // that much (a plugin that rounded up, a node step that failed).
        let rounded = vol(Some(20 * MIB), None, 32 * MIB);
        let within = vol(Some(30 * MIB), None, 0);
        assert_eq!(
            capacity_change(&rounded, &within).unwrap(),
            CapacityChange::Grow
        );
        // Without a request before, only more than it has expands.
        let unasked = vol(None, None, 32 * MIB);
        assert_eq!(
            capacity_change(&unasked, &within).unwrap(),
            CapacityChange::Requests
        );
        // capacity_max alone asks for more.
        let max_only = vol(None, None, 20 * MIB);
        let grow_max = vol(None, Some(40 * MIB), 0);
        assert_eq!(
            capacity_change(&max_only, &grow_max).unwrap(),
            CapacityChange::Grow
        );
    }

    #[tokio::test(start_paused = true)]
    async fn node_steps_run_at_once_and_answer_in_order() {
        let started = tokio::time::Instant::now();
        let steps: Vec<_> = [3u64, 1, 2]
            .into_iter()
            .map(|secs| async move {
                tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
                secs
            })
            .collect();
        assert_eq!(join_all(steps).await, vec![3, 1, 2]);
        assert_eq!(started.elapsed().as_secs(), 3, "not 6: at once");
        assert!(join_all(Vec::<std::future::Ready<u8>>::new())
            .await
            .is_empty());
    }

    #[test]
    fn differences_other_than_capacity_are_named() {
        let old = vol(Some(MIB), None, MIB);
        let mut new = vol(Some(2 * MIB), None, 0);
        new.external_id.clear();
        assert!(spec_differences(&old, &new).is_empty());
        new.parameters.insert("backing".into(), "image".into());
        new.secrets.insert("token".into(), "s3cret".into());
        new.capabilities[0].access_mode = AccessMode::MultiNodeReader;
        assert_eq!(
            spec_differences(&old, &new),
            vec!["capability", "parameters", "secrets"]
        );
    }
}
