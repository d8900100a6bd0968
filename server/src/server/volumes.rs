//! Volumes: registration and creation, updates, deregistration and deletion,
//! the reads of them, and detaching one from a node.

use crate::csi::*;
use crate::error::ServerError;
use crate::plugins::*;
use crate::prefix::resolve_node;
use crate::state::Change;
use berth_proto::berth::v1 as pb;
use berth_structs::text::count_of;
use berth_structs::{topologies_text, CsiPlugin, CsiTopology, CsiVolume};

use super::Server;

impl Server {
    /// A ready, connected node running a healthy controller of `plugin_id`.
    pub(crate) fn controller_client(&self, plugin_id: &str) -> Result<String, ServerError> {
        self.controller_client_in(plugin_id, &[])
    }

    /// [`Server::controller_client`], preferring a node whose node plugin
    /// is in one of `required` (a controller there can create a volume
    /// reachable from it); any other one when none is.
    pub(crate) fn controller_client_in(
        &self,
        plugin_id: &str,
        required: &[CsiTopology],
    ) -> Result<String, ServerError> {
        let (candidates, in_topology) = self.store.read(|t| {
            let candidates = controller_nodes(t, plugin_id);
            let in_topology: Vec<String> = candidates
                .iter()
                .filter(|id| {
                    let here = t
                        .nodes
                        .get(id.as_str())
                        .and_then(|n| n.csi_node_plugins.get(plugin_id))
                        .and_then(|p| p.accessible_topology.as_ref());
                    here.is_some_and(|here| required.iter().any(|r| r.contains(here)))
                })
                .cloned()
                .collect();
            (candidates, in_topology)
        });
        in_topology
            .into_iter()
            .chain(candidates)
            .find(|n| self.calls.is_connected(n))
            .ok_or_else(|| {
                ServerError::Unavailable(format!(
                    "no connected client runs a healthy controller of CSI plugin {plugin_id:?}"
                ))
            })
    }

    /// How many volumes have a lock entry now (held or waited for); zero
    /// whenever no volume operation is running.
    pub fn volume_locks_in_use(&self) -> usize {
        self.volume_locks.len()
    }

    pub fn volumes(&self) -> Vec<CsiVolume> {
        self.store.read(|t| {
            let places = node_plugin_places(t, None);
            t.volumes
                .values()
                .map(|v| public_view_in(v, &places))
                .collect()
        })
    }

    /// A page of the volumes, as [`Self::volumes`] shows them.
    pub fn volumes_page(&self, page: crate::Page<'_>) -> crate::Paged<CsiVolume> {
        self.store.read(|t| {
            let places = node_plugin_places(t, None);
            page.of(&t.volumes, |v| public_view_in(v, &places))
        })
    }

    /// A volume by ID, or by a unique ID prefix.
    pub fn volume(&self, id: &str) -> Result<CsiVolume, ServerError> {
        self.store.read(|t| {
            crate::prefix::resolve(&t.volumes, id, crate::prefix::VOLUME, crate::prefix::key)?
                .map(|(_, v)| public_view(v, t))
                .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))
        })
    }

    /// The ID of the volume `id` names: itself, or the one volume whose ID
    /// starts with it.
    pub fn resolve_volume_id(&self, id: &str) -> Result<String, ServerError> {
        self.store.read(|t| {
            crate::prefix::resolve(&t.volumes, id, crate::prefix::VOLUME, crate::prefix::key)?
                .map(|(k, _)| k.clone())
                .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))
        })
    }

    /// Create a volume through a controller plugin (`CreateVolume`) and
    /// register it.
    pub async fn create_volume(&self, mut vol: CsiVolume) -> Result<CsiVolume, ServerError> {
        vol.validate(false)?;
        let _lock = self.volume_locks.lock(&vol.id).await;
        if let Some(old) = self.store.read(|t| t.volumes.get(&vol.id).cloned()) {
            // An existing volume: unchanged, grown, or a conflict.
            self.recreate_volume_locked(&old, &vol).await?;
            drop(_lock);
            return self.volume(&vol.id);
        }
        let controller =
            self.controller_client_in(&vol.plugin_id, &vol.requested_topologies.required)?;
        let supports = self.store.read(|t| {
            t.nodes
                .get(&controller)
                .and_then(|n| n.csi_controller_plugins.get(&vol.plugin_id))
                .is_some_and(|c| c.supports_create_delete)
        });
        if !supports {
            return Err(ServerError::BadRequest(format!(
                "CSI plugin {:?} does not support creating volumes",
                vol.plugin_id
            )));
        }
        let call = pb::server_call::Call::CreateVolume(pb::CreateVolume {
            plugin_id: vol.plugin_id.clone(),
            name: if vol.name.is_empty() {
                vol.id.clone()
            } else {
                vol.name.clone()
            },
            capacity_min: i64::try_from(vol.capacity_min.unwrap_or(0)).unwrap_or(i64::MAX),
            capacity_max: i64::try_from(vol.capacity_max.unwrap_or(0)).unwrap_or(i64::MAX),
            capabilities: vol
                .capabilities
                .iter()
                .map(|c| capability_pb(c.access_mode, c.attachment_mode, &vol.mount_options))
                .collect(),
            parameters: vol.parameters.clone().into_iter().collect(),
            secrets: vol.secrets.clone().into_iter().collect(),
            snapshot_id: vol.snapshot_id.clone(),
            clone_id: vol.clone_id.clone(),
            requisite: topologies_pb(&vol.requested_topologies.required),
            // CSI wants `preferred` within `requisite`: without preferred
            // topologies, the required ones are the preference.
            preferred: if vol.requested_topologies.preferred.is_empty() {
                topologies_pb(&vol.requested_topologies.required)
            } else {
                topologies_pb(&vol.requested_topologies.preferred)
            },
        });
        let reply = self
            .calls
            .call(&controller, call, self.config.client_call_timeout)
            .await
            .map_err(|e| match e {
                ServerError::Remote {
                    code: tonic::Code::ResourceExhausted,
                    message,
                } if !vol.requested_topologies.is_empty() => ServerError::Remote {
                    code: tonic::Code::ResourceExhausted,
                    message: format!(
                        "CSI plugin {:?} cannot create volume {:?} in the requested topology \
                         (required {}, preferred {}): {message}",
                        vol.plugin_id,
                        vol.id,
                        topologies_text(&vol.requested_topologies.required),
                        topologies_text(&vol.requested_topologies.preferred),
                    ),
                },
                e => e,
            })?;
        let pb::call_reply::Result::CreateVolume(created) = reply else {
            return Err(ServerError::Internal(format!(
                "node {controller} answered CreateVolume with another kind of reply"
            )));
        };
        vol.external_id = created.external_id;
        vol.capacity = u64::try_from(created.capacity_bytes).unwrap_or(0);
        vol.context = created.volume_context.into_iter().collect();
        vol.accessible_topology = created
            .accessible_topology
            .into_iter()
            .filter(|t| !t.segments.is_empty())
            .map(|t| CsiTopology::new(t.segments.into_iter().collect()))
            .collect();
        vol.read_claims.clear();
        vol.write_claims.clear();
        if vol.provider.is_empty() {
            vol.provider = self.plugin_provider(&vol.plugin_id);
        }
        let stored = vol.clone();
        self.store
            .write_async(|_, changes| {
                changes.push(Change::PutVolume(stored));
                Ok::<_, ServerError>(())
            })
            .await?;
        tracing::info!(volume_id = %vol.id, plugin_id = %vol.plugin_id, external_id = %vol.external_id, "volume created");
        drop(_lock);
        self.evaluate_blocked().await;
        self.volume(&vol.id)
    }

    fn plugin_provider(&self, plugin_id: &str) -> String {
        self.store.read(|t| {
            t.nodes
                .values()
                .flat_map(|n| {
                    n.csi_controller_plugins
                        .get(plugin_id)
                        .into_iter()
                        .chain(n.csi_node_plugins.get(plugin_id))
                })
                .map(|i| i.provider.clone())
                .find(|p| !p.is_empty())
                .unwrap_or_default()
        })
    }

    /// Register an existing volume. Re-registering may change it, but not
    /// in a way that contradicts its claims.
    pub async fn register_volume(&self, mut vol: CsiVolume) -> Result<CsiVolume, ServerError> {
        vol.validate(true)?;
        if self.plugin(&vol.plugin_id).is_err() {
            return Err(ServerError::BadRequest(format!(
                "no CSI plugin named {:?}: no node has fingerprinted it and no job runs it; \
                 run the plugin's job first (`berth job run`), wait until `berth plugin status {}` \
                 lists it, then register the volume",
                vol.plugin_id, vol.plugin_id
            )));
        }
        let provider = self.plugin_provider(&vol.plugin_id);
        let _lock = self.volume_locks.lock(&vol.id).await;
        self.store.write_async(|t, changes| {
            match t.volumes.get(&vol.id) {
                Some(old) => {
                    let claimed = old.claims().count();
                    if claimed > 0 {
                        if old.plugin_id != vol.plugin_id || old.external_id != vol.external_id {
                            return Err(ServerError::Conflict(format!(
                                "volume {:?} has {}; its plugin_id and external_id cannot change",
                                vol.id,
                                count_of(claimed, "claim", "claims")
                            )));
                        }
                        if let Some(c) = old
                            .claims()
                            .find(|c| !vol.has_capability(c.access_mode, c.attachment_mode))
                        {
                            return Err(ServerError::Conflict(format!(
                                "volume {:?} is claimed as {}/{} by alloc {}; that capability cannot be removed",
                                vol.id, c.access_mode, c.attachment_mode, c.alloc_id
                            )));
                        }
                    }
                    vol.read_claims = old.read_claims.clone();
                    vol.write_claims = old.write_claims.clone();
                }
                None => {
                    vol.read_claims.clear();
                    vol.write_claims.clear();
                }
            }
            if vol.provider.is_empty() {
                vol.provider = provider;
            }
            // No plugin answers a registration: the volume is reachable
            // from where the operator requires it.
            vol.accessible_topology = vol.requested_topologies.required.clone();
            vol.schedulable = false;
            changes.push(Change::PutVolume(vol.clone()));
            Ok(())
        }).await?;
        tracing::info!(volume_id = %vol.id, plugin_id = %vol.plugin_id, "volume registered");
        drop(_lock);
        self.evaluate_blocked().await;
        self.volume(&vol.id)
    }

    /// Deregister a volume (the storage is kept). A claimed volume is
    /// refused unless `force`; with `force` the claims of allocs that are
    /// terminal (or gone) are released first (node and controller detach),
    /// and freed even when a detach fails (reported in the answer's
    /// warnings). Claims of live allocs are refused either way.
    pub async fn deregister_volume(
        &self,
        id: &str,
        force: bool,
    ) -> Result<VolumeRelease, ServerError> {
        let _lock = self.volume_locks.lock(id).await;
        let claims: Vec<(String, bool)> = self
            .store
            .read(|t| {
                t.volumes.get(id).map(|v| {
                    v.claims()
                        .map(|c| (c.alloc_id.clone(), alloc_live(t, &c.alloc_id)))
                        .collect()
                })
            })
            .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))?;
        let mut report = VolumeRelease {
            volume_id: id.to_string(),
            ..Default::default()
        };
        if !claims.is_empty() {
            let ids: Vec<&str> = claims.iter().map(|(a, _)| a.as_str()).collect();
            if !force {
                return Err(ServerError::Conflict(format!(
                    "volume {id:?} has {} (allocs {}); stop them first or deregister with force",
                    count_of(claims.len(), "claim", "claims"),
                    ids.join(", ")
                )));
            }
            let live: Vec<&str> = claims
                .iter()
                .filter(|(_, live)| *live)
                .map(|(a, _)| a.as_str())
                .collect();
            if !live.is_empty() {
                return Err(ServerError::Conflict(format!(
                    "volume {id:?} is in use by allocs that have not stopped on their nodes ({}); stop them first",
                    live.join(", ")
                )));
            }
            for (alloc_id, _) in &claims {
                self.release_claim_locked(
                    id,
                    alloc_id,
                    &ReleaseOrigin::Operator,
                    Some(&mut report.warnings),
                )
                .await?;
                report.released.push(alloc_id.clone());
            }
        }
        self.store
            .write_async(|_, changes| {
                changes.push(Change::DeleteVolume(id.to_string()));
                Ok::<_, ServerError>(())
            })
            .await?;
        tracing::info!(
            volume_id = id,
            force,
            released = report.released.len(),
            warnings = report.warnings.len(),
            "volume deregistered"
        );
        drop(_lock);
        Ok(report)
    }

    /// Delete a volume through its controller plugin (`DeleteVolume`) and
    /// deregister it. A claimed volume is refused.
    pub async fn delete_volume(&self, id: &str) -> Result<(), ServerError> {
        let _lock = self.volume_locks.lock(id).await;
        let vol = self
            .store
            .read(|t| t.volumes.get(id).cloned())
            .ok_or_else(|| ServerError::not_found(format!("volume {id:?} not found")))?;
        let claims = vol.claims().count();
        if claims > 0 {
            return Err(ServerError::Conflict(format!(
                "volume {id:?} has {}; it cannot be deleted while in use",
                count_of(claims, "claim", "claims")
            )));
        }
        let controller = self.controller_client(&vol.plugin_id)?;
        let call = pb::server_call::Call::DeleteVolume(pb::DeleteVolume {
            plugin_id: vol.plugin_id.clone(),
            external_id: vol.external_id.clone(),
            secrets: vol.secrets.clone().into_iter().collect(),
        });
        self.calls
            .call(&controller, call, self.config.client_call_timeout)
            .await?;
        self.store
            .write_async(|_, changes| {
                changes.push(Change::DeleteVolume(id.to_string()));
                Ok::<_, ServerError>(())
            })
            .await?;
        tracing::info!(volume_id = id, plugin_id = %vol.plugin_id, "volume deleted");
        drop(_lock);
        Ok(())
    }

    /// Release the claims of `volume_id` held on `node` (a node ID, name
    /// or unique ID prefix) by allocs that are terminal (or gone) — `volume
    /// detach`. The node is told to unmount; when it cannot (or cannot be
    /// reached), the claims are freed anyway and what failed is in the
    /// answer's warnings and a node event. A claim of a live alloc is
    /// refused. A node holding no claim of the volume is not an error: the
    /// answer releases nothing.
    pub async fn detach_volume(
        &self,
        volume_id: &str,
        node: &str,
    ) -> Result<VolumeRelease, ServerError> {
        let (node_id, node_name, claims) = self.store.read(|t| {
            let v = t
                .volumes
                .get(volume_id)
                .ok_or_else(|| ServerError::not_found(format!("volume {volume_id:?} not found")))?;
            // A claim may name a node that is gone (purged): its exact ID
            // still counts.
            let (node_id, node_name) = if v.claims().any(|c| c.node_id == node) {
                let name = t
                    .nodes
                    .get(node)
                    .map(|n| n.name.clone())
                    .unwrap_or_default();
                (node.to_string(), name)
            } else {
                let n = resolve_node(t, node)?;
                (n.id.clone(), n.name.clone())
            };
            let claims: Vec<(String, bool)> = v
                .claims()
                .filter(|c| c.node_id == node_id)
                .map(|c| (c.alloc_id.clone(), alloc_live(t, &c.alloc_id)))
                .collect();
            Ok::<_, ServerError>((node_id, node_name, claims))
        })?;
        if let Some((alloc, _)) = claims.iter().find(|(_, live)| *live) {
            return Err(ServerError::Conflict(format!(
                "volume {volume_id:?} is in use on node {node_id} by alloc {alloc}, which has not stopped on its node; stop it first"
            )));
        }
        let mut report = VolumeRelease {
            volume_id: volume_id.to_string(),
            node_id,
            node_name,
            ..Default::default()
        };
        let mut freed = false;
        for (alloc_id, _) in claims {
            let _lock = self.volume_locks.lock(volume_id).await;
            freed |= self
                .release_claim_locked(
                    volume_id,
                    &alloc_id,
                    &ReleaseOrigin::Operator,
                    Some(&mut report.warnings),
                )
                .await?;
            report.released.push(alloc_id);
        }
        tracing::info!(volume_id, node_id = %report.node_id, released = report.released.len(), warnings = report.warnings.len(), "volume detached");
        if freed {
            self.evaluate_blocked().await;
        }
        Ok(report)
    }
}

impl Server {
    pub fn plugins(&self) -> Vec<CsiPlugin> {
        self.store
            .read(|t| derive_plugins(t).into_values().collect())
    }

    /// A plugin by ID or unique ID prefix.
    pub fn plugin(&self, id: &str) -> Result<CsiPlugin, ServerError> {
        self.store.read(|t| resolve_plugin_in(t, id))
    }

    /// A plugin by ID or unique ID prefix, with its instances' nodes,
    /// capabilities, allocs and volume count.
    pub fn plugin_status(&self, id: &str) -> Result<PluginStatus, ServerError> {
        self.store.read(|t| {
            let plugin = resolve_plugin_in(t, id)?;
            Ok(plugin_status_in(t, plugin))
        })
    }
}
