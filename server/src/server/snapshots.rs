//! Volume snapshots: creation, deletion and the list, through the
//! controller plugin.

use crate::csi::snapshots::*;
use crate::error::ServerError;
use berth_proto::berth::v1 as pb;
use berth_structs::CsiSnapshot;
use std::collections::HashMap;

use super::Server;

impl Server {
    /// `s` as berth shows it; `volumes` are [`volumes_by_external_id`].
    fn snapshot_of(
        plugin_id: &str,
        volumes: &HashMap<String, String>,
        s: pb::Snapshot,
    ) -> CsiSnapshot {
        let source_volume_id = volumes
            .get(&s.source_external_id)
            .cloned()
            .unwrap_or_default();
        CsiSnapshot {
            id: s.snapshot_id,
            name: String::new(),
            plugin_id: plugin_id.to_string(),
            source_volume_id,
            external_source_volume_id: s.source_external_id,
            size_bytes: u64::try_from(s.size_bytes).unwrap_or(0),
            create_time_ms: s.create_time_ms,
            ready_to_use: s.ready_to_use,
        }
    }

    /// Takes a snapshot of a volume through its plugin's controller.
    pub async fn create_snapshot(&self, req: SnapshotRequest) -> Result<CsiSnapshot, ServerError> {
        if req.volume_id.is_empty() {
            return Err(ServerError::BadRequest(
                "a snapshot needs the volume_id of the volume to take it of".into(),
            ));
        }
        let _lock = self.volume_locks.lock(&req.volume_id).await;
        let vol = self
            .store
            .read(|t| t.volumes.get(&req.volume_id).cloned())
            .ok_or_else(|| {
                ServerError::not_found(format!("volume {:?} not found", req.volume_id))
            })?;
        let name = if req.name.is_empty() {
            format!("{}-{}", vol.id, berth_structs::now_ms())
        } else {
            req.name.clone()
        };
        let secrets = if req.secrets.is_empty() {
            vol.secrets.clone()
        } else {
            req.secrets.clone()
        };
        let controller = self.controller_client(&vol.plugin_id)?;
        let call = pb::server_call::Call::CreateSnapshot(pb::CreateSnapshot {
            plugin_id: vol.plugin_id.clone(),
            source_external_id: vol.external_id.clone(),
            name: name.clone(),
            parameters: req.parameters.clone().into_iter().collect(),
            secrets: secrets.into_iter().collect(),
        });
        let reply = self
            .calls
            .call(&controller, call, self.config.client_call_timeout)
            .await
            .map_err(unsupported_is_bad_request)?;
        let pb::call_reply::Result::CreateSnapshot(s) = reply else {
            return Err(ServerError::Internal(format!(
                "node {controller} answered CreateSnapshot with another kind of reply"
            )));
        };
        let volumes = self
            .store
            .read(|t| volumes_by_external_id(t, &vol.plugin_id));
        let mut snapshot = Self::snapshot_of(&vol.plugin_id, &volumes, s);
        snapshot.name = name;
        if snapshot.source_volume_id.is_empty() {
            snapshot.source_volume_id = vol.id.clone();
        }
        tracing::info!(volume_id = %vol.id, plugin_id = %vol.plugin_id, snapshot_id = %snapshot.id, "snapshot created");
        Ok(snapshot)
    }

    /// The snapshots of `plugin_id`, or of every plugin that runs a
    /// controller (skipping those that cannot list snapshots), ordered by
    /// plugin and creation time.
    pub async fn list_snapshots(
        &self,
        plugin_id: Option<&str>,
    ) -> Result<Vec<CsiSnapshot>, ServerError> {
        let plugins: Vec<String> = match plugin_id {
            Some(p) => {
                // A plugin the servers do not know is not found; one they
                // know without a healthy controller is unavailable (below).
                if !self.store.read(|t| t.plugin_ids().contains(p)) {
                    return Err(ServerError::not_found(format!(
                        "CSI plugin {p:?} not found (see `berth plugin status`)"
                    )));
                }
                vec![p.to_string()]
            }
            None => self.store.read(|t| {
                let mut ids: Vec<String> = t
                    .nodes
                    .values()
                    .flat_map(|n| n.csi_controller_plugins.keys().cloned())
                    .collect();
                ids.sort();
                ids.dedup();
                ids
            }),
        };
        let mut out = Vec::new();
        for p in plugins {
            let controller = self.controller_client(&p)?;
            let call = pb::server_call::Call::ListSnapshots(pb::ListSnapshots {
                plugin_id: p.clone(),
                secrets: HashMap::new(),
            });
            let reply = match self
                .calls
                .call(&controller, call, self.config.client_call_timeout)
                .await
                .map_err(unsupported_is_bad_request)
            {
                Ok(r) => r,
                Err(ServerError::BadRequest(_)) if plugin_id.is_none() => continue,
                Err(e) => return Err(e),
            };
            let pb::call_reply::Result::ListSnapshots(list) = reply else {
                return Err(ServerError::Internal(format!(
                    "node {controller} answered ListSnapshots with another kind of reply"
                )));
            };
            // One look-up table per plugin, not a scan of every volume per
            // snapshot.
            let volumes = self.store.read(|t| volumes_by_external_id(t, &p));
            let mut snapshots: Vec<CsiSnapshot> = list
                .snapshots
                .into_iter()
                .map(|s| Self::snapshot_of(&p, &volumes, s))
                .collect();
            snapshots.sort_by(|a, b| (a.create_time_ms, &a.id).cmp(&(b.create_time_ms, &b.id)));
            out.extend(snapshots);
        }
        Ok(out)
    }

    /// Deletes a snapshot through its plugin's controller. A snapshot the
    /// plugin does not know is gone already: not an error (CSI spec).
    pub async fn delete_snapshot(
        &self,
        plugin_id: &str,
        snapshot_id: &str,
    ) -> Result<(), ServerError> {
        if plugin_id.is_empty() || snapshot_id.is_empty() {
            return Err(ServerError::BadRequest(
                "deleting a snapshot needs its plugin_id and snapshot_id".into(),
            ));
        }
        let controller = self.controller_client(plugin_id)?;
        let call = pb::server_call::Call::DeleteSnapshot(pb::DeleteSnapshot {
            plugin_id: plugin_id.to_string(),
            snapshot_id: snapshot_id.to_string(),
            secrets: HashMap::new(),
        });
        self.calls
            .call(&controller, call, self.config.client_call_timeout)
            .await
            .map_err(unsupported_is_bad_request)?;
        tracing::info!(plugin_id, snapshot_id, "snapshot deleted");
        Ok(())
    }
}
