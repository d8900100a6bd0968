//! Volume claims: a claim taken for an alloc, and its release through node
//! unpublish, controller unpublish and the claim's removal.

use crate::csi::capability_pb;
use crate::csi::claims::*;
use crate::error::ServerError;
use crate::plugins::requires_controller_publish;
use crate::state::{Change, Tables};
use berth_proto::berth::v1 as pb;
use berth_structs::{
    Allocation, ClaimMode, ClaimState, CsiInfo, CsiMountOptions, CsiVolume, CsiVolumeClaim,
    NodeEvent, NodeStatus, VolumeRequest,
};
use std::collections::BTreeMap;

use super::Server;

impl Server {
    /// Claim a volume for an alloc. The claim is persisted before the
    /// answer; a repeated claim by the same alloc is answered again (and
    /// ControllerPublish, idempotent, is repeated when the plugin needs it).
    pub async fn claim_volume(&self, req: VolumeClaimRequest) -> Result<ClaimGrant, ServerError> {
        let _lock = self.volume_locks.lock(&req.volume_id).await;
        let vid = req.volume_id.as_str();
        let alloc_id = req.alloc_id.as_str();
        // Check and reserve in one write.
        let ((vol, external_node_id, reserved_now, needs_publish), _) = self
            .store
            .write_async(|t, changes| {
                let (vol, node_plugin) = Self::check_claim(t, &req)?;
                let external_node_id = node_plugin.external_node_id.clone();
                let needs_publish = requires_controller_publish(t, &vol.plugin_id);
                let reserved_now =
                    Self::reserve_claim(vol, &req, &external_node_id, needs_publish, changes)?;
                Ok::<_, ServerError>((vol.clone(), external_node_id, reserved_now, needs_publish))
            })
            .await?;
        if reserved_now {
            tracing::info!(volume_id = vid, alloc_id, node_id = %req.node_id, mode = req.mode.as_str(), "volume claimed");
        }
        let mount_options = req.mount_options.merged_over(&vol.mount_options);
        let mut publish_context = vol
            .claim_for(alloc_id)
            .map(|c| c.publish_context.clone())
            .unwrap_or_default();
        if needs_publish {
            publish_context = self
                .publish_claim(&vol, &req, &external_node_id, &mount_options, reserved_now)
                .await?;
        }
        Ok(ClaimGrant {
            volume_id: vol.id.clone(),
            external_id: vol.external_id.clone(),
            plugin_id: vol.plugin_id.clone(),
            publish_context,
            volume_context: vol.context.clone(),
            secrets: vol.secrets.clone(),
            mount_options,
        })
    }

    /// The checks of a claim before anything is reserved: the volume exists
    /// with the capability (and allows the claim's mode), the alloc exists,
    /// is live, is on the claiming node and its group asks for the volume
    /// in the claim's modes, the node runs the volume's node
    /// plugin and, for a new claim, the volume is reachable from it. The
    /// volume and the node's plugin.
    fn check_claim<'t>(
        t: &'t Tables,
        req: &VolumeClaimRequest,
    ) -> Result<(&'t CsiVolume, &'t CsiInfo), ServerError> {
        let vid = req.volume_id.as_str();
        let alloc_id = req.alloc_id.as_str();
        let vol = t
            .volumes
            .get(vid)
            .ok_or_else(|| ServerError::not_found(format!("volume {vid:?} not found")))?;
        if !vol.has_capability(req.access_mode, req.attachment_mode) {
            return Err(ServerError::Conflict(format!(
                "volume {vid:?} does not have capability {}/{}",
                req.access_mode, req.attachment_mode
            )));
        }
        if req.mode == ClaimMode::Write && req.access_mode.is_reader_only() {
            return Err(ServerError::Conflict(format!(
                "access mode {} of volume {vid:?} does not allow a write claim",
                req.access_mode
            )));
        }
        let alloc = t
            .allocs
            .get(alloc_id)
            .ok_or_else(|| ServerError::not_found(format!("alloc {alloc_id:?} not found")))?;
        if alloc.node_id != req.node_id {
            return Err(ServerError::Conflict(format!(
                "alloc {alloc_id} is placed on node {}, not {}",
                alloc.node_id, req.node_id
            )));
        }
        if alloc.is_terminal() {
            return Err(ServerError::Conflict(format!(
                "alloc {alloc_id} {} {vid:?}",
                berth_structs::CLAIM_REFUSED_ALLOC_TERMINAL
            )));
        }
        check_declared(alloc, req)?;
        let node = t
            .nodes
            .get(&req.node_id)
            .ok_or_else(|| ServerError::not_found(format!("node {:?} not found", req.node_id)))?;
        let node_plugin = node.csi_node_plugins.get(&vol.plugin_id).ok_or_else(|| {
            ServerError::Unavailable(format!(
                "node {} does not run CSI node plugin {:?}",
                req.node_id, vol.plugin_id
            ))
        })?;
        // A new claim only from where the volume is reachable (the
        // scheduler places nothing elsewhere); a claim already
        // taken is left to the plugin.
        if vol.claim_for(alloc_id).is_none()
            && !vol.reachable_from(node_plugin.accessible_topology.as_ref())
        {
            return Err(ServerError::Conflict(format!(
                "volume {vid:?} is reachable only from topology {}; node {} is not in it",
                berth_structs::topologies_text(&vol.accessible_topology),
                req.node_id
            )));
        }
        Ok((vol, node_plugin))
    }

    /// Reserves the claim of `req` on `vol` in `changes` (or, for a claim the
    /// alloc already holds, records that ControllerPublish is to be sent):
    /// true when the claim is taken now. A claim being released, or held in
    /// another mode, is a conflict; claims of the kind all taken, in use.
    fn reserve_claim(
        vol: &CsiVolume,
        req: &VolumeClaimRequest,
        external_node_id: &str,
        needs_publish: bool,
        changes: &mut Vec<Change>,
    ) -> Result<bool, ServerError> {
        let vid = req.volume_id.as_str();
        let alloc_id = req.alloc_id.as_str();
        let mut reserved_now = false;
        match vol.claim_for(alloc_id) {
            Some(c) if c.releasing => {
                return Err(ServerError::Conflict(format!(
                    "the claim of alloc {alloc_id} on volume {vid:?} is being released"
                )));
            }
            Some(c)
                if c.mode == req.mode
                    && c.access_mode == req.access_mode
                    && c.attachment_mode == req.attachment_mode =>
            {
                if needs_publish && !c.controller_published {
                    // Recorded before the ControllerPublish below.
                    let mut v = vol.clone();
                    if let Some(c) = v
                        .write_claims
                        .get_mut(alloc_id)
                        .or(v.read_claims.get_mut(alloc_id))
                    {
                        c.controller_published = true;
                    }
                    changes.push(Change::PutVolume(v));
                }
            }
            Some(c) => {
                return Err(ServerError::Conflict(format!(
                    "alloc {alloc_id} already claims volume {vid:?} as {} {}/{}",
                    c.mode.as_str(),
                    c.access_mode,
                    c.attachment_mode
                )));
            }
            None => {
                if let Some(why) =
                    vol.claim_conflict(alloc_id, &req.node_id, req.access_mode, req.mode)
                {
                    return Err(ServerError::InUse(why));
                }
                let claim = CsiVolumeClaim {
                    alloc_id: alloc_id.to_string(),
                    node_id: req.node_id.clone(),
                    external_node_id: external_node_id.to_owned(),
                    mode: req.mode,
                    access_mode: req.access_mode,
                    attachment_mode: req.attachment_mode,
                    state: ClaimState::Taken,
                    publish_context: BTreeMap::new(),
                    releasing: false,
                    // Persisted with the reservation, so before the
                    // ControllerPublish below whose outcome may be
                    // uncertain.
                    controller_published: needs_publish,
                    kept_after_purge: false,
                };
                let mut v = vol.clone();
                match req.mode {
                    ClaimMode::Read => v.read_claims.insert(alloc_id.to_string(), claim),
                    ClaimMode::Write => v.write_claims.insert(alloc_id.to_string(), claim),
                };
                changes.push(Change::PutVolume(v));
                reserved_now = true;
            }
        }
        Ok(reserved_now)
    }

    /// Sends ControllerPublish for the claim of `req` and records the
    /// publish context it answers in the claim. When it fails, a claim
    /// reserved by this request is given back if the controller certainly
    /// did not publish.
    async fn publish_claim(
        &self,
        vol: &CsiVolume,
        req: &VolumeClaimRequest,
        external_node_id: &str,
        mount_options: &CsiMountOptions,
        reserved_now: bool,
    ) -> Result<BTreeMap<String, String>, ServerError> {
        let vid = req.volume_id.as_str();
        let alloc_id = req.alloc_id.as_str();
        match self
            .controller_publish(vol, req, external_node_id, mount_options)
            .await
        {
            Ok(ctx) => {
                let answered = ctx.clone();
                self.store
                    .write_async(|t, changes| {
                        if let Some(mut v) = t.volumes.get(vid).cloned() {
                            let claim = v
                                .write_claims
                                .get_mut(alloc_id)
                                .or(v.read_claims.get_mut(alloc_id));
                            if let Some(c) = claim {
                                if c.publish_context != ctx {
                                    c.publish_context = ctx;
                                    changes.push(Change::PutVolume(v));
                                }
                            }
                        }
                        Ok::<_, ServerError>(())
                    })
                    .await?;
                Ok(answered)
            }
            Err(e) => {
                tracing::warn!(volume_id = vid, alloc_id, plugin_id = %vol.plugin_id, error = %e,
                    "ControllerPublish failed");
                if reserved_now && is_final(&e) {
                    // The controller certainly did not publish: give the
                    // reservation back.
                    self.drop_claim(vid, alloc_id).await?;
                }
                Err(e)
            }
        }
    }

    async fn controller_publish(
        &self,
        vol: &berth_structs::CsiVolume,
        req: &VolumeClaimRequest,
        external_node_id: &str,
        mount: &CsiMountOptions,
    ) -> Result<BTreeMap<String, String>, ServerError> {
        let controller = self.controller_client(&vol.plugin_id)?;
        let call = pb::server_call::Call::ControllerPublish(pb::ControllerPublish {
            plugin_id: vol.plugin_id.clone(),
            external_id: vol.external_id.clone(),
            external_node_id: external_node_id.to_string(),
            capability: Some(capability_pb(req.access_mode, req.attachment_mode, mount)),
            read_only: req.mode == ClaimMode::Read,
            secrets: vol.secrets.clone().into_iter().collect(),
            volume_context: vol.context.clone().into_iter().collect(),
        });
        match self
            .calls
            .call(&controller, call, self.config.client_call_timeout)
            .await?
        {
            pb::call_reply::Result::ControllerPublish(r) => {
                Ok(r.publish_context.into_iter().collect())
            }
            pb::call_reply::Result::Empty(_) => Ok(BTreeMap::new()),
            _ => Err(ServerError::Internal(format!(
                "node {controller} answered ControllerPublish with another kind of reply"
            ))),
        }
    }

    /// Remove a claim without any detach (only when nothing was attached).
    async fn drop_claim(&self, volume_id: &str, alloc_id: &str) -> Result<(), ServerError> {
        self.store
            .write_async(|t, changes| {
                if let Some(mut v) = t.volumes.get(volume_id).cloned() {
                    if v.read_claims.remove(alloc_id).is_some()
                        | v.write_claims.remove(alloc_id).is_some()
                    {
                        changes.push(Change::PutVolume(v));
                    }
                }
                Ok::<_, ServerError>(())
            })
            .await?;
        Ok(())
    }

    /// Release the claim of `alloc_id` on `volume_id`: node detach,
    /// controller detach, free. An unknown volume or claim is already
    /// released. Blocked jobs are evaluated after a free.
    pub async fn unpublish_claim(
        &self,
        volume_id: &str,
        alloc_id: &str,
        origin: ReleaseOrigin,
    ) -> Result<(), ServerError> {
        let freed = {
            let _lock = self.volume_locks.lock(volume_id).await;
            // No warnings to collect: this release stops at a failed
            // detach, whoever asked for it.
            self.release_claim_locked(volume_id, alloc_id, &origin, None)
                .await?
        };
        if freed {
            self.evaluate_blocked().await;
        }
        Ok(())
    }

    /// Set the claim's state (and mark it releasing); returns false when
    /// the claim is gone.
    async fn checkpoint_claim(
        &self,
        volume_id: &str,
        alloc_id: &str,
        state: ClaimState,
    ) -> Result<bool, ServerError> {
        let (found, _) = self
            .store
            .write_async(|t, changes| {
                let Some(mut v) = t.volumes.get(volume_id).cloned() else {
                    return Ok::<_, ServerError>(false);
                };
                let claim = match v.write_claims.get_mut(alloc_id) {
                    Some(c) => Some(c),
                    None => v.read_claims.get_mut(alloc_id),
                };
                let Some(c) = claim else { return Ok(false) };
                if c.state != state || !c.releasing {
                    c.state = state;
                    c.releasing = true;
                    changes.push(Change::PutVolume(v));
                }
                Ok(true)
            })
            .await?;
        if found {
            tracing::debug!(
                volume_id,
                alloc_id,
                state = state.as_str(),
                "claim checkpointed"
            );
        }
        Ok(found)
    }

    /// Drive a claim to freed; the caller holds the volume lock. Returns
    /// whether a claim was freed. With `warnings`, an operator's release
    /// (`volume detach`, a forced deregister: both have checked that the
    /// alloc stopped) goes on past a node or controller detach that fails,
    /// so it always ends the claim: what failed is pushed to `warnings` and
    /// recorded as a `Storage` event of the claim's node. Without, the
    /// release stops at the error, to be retried.
    pub(crate) async fn release_claim_locked(
        &self,
        volume_id: &str,
        alloc_id: &str,
        origin: &ReleaseOrigin,
        mut warnings: Option<&mut Vec<String>>,
    ) -> Result<bool, ServerError> {
        loop {
            let Some((vol, claim)) = self.store.read(|t| {
                t.volumes
                    .get(volume_id)
                    .and_then(|v| v.claim_for(alloc_id).map(|c| (v.clone(), c.clone())))
            }) else {
                return Ok(false);
            };
            // A controller detach follows what was sent for this claim,
            // never the plugin's current fingerprint: an unhealthy
            // controller reports no capabilities. A publish context is
            // proof of a publish too (claims stored before the flag
            // existed).
            let controller_detach = claim.controller_published || !claim.publish_context.is_empty();
            match claim.state {
                ClaimState::Taken => {
                    // The client of the claim's node unpublished and
                    // unstaged before asking: no node detach call is made.
                    let node_call = !matches!(origin,
                        ReleaseOrigin::Client { node_id } if *node_id == claim.node_id);
                    if !claim.releasing {
                        tracing::info!(volume_id, alloc_id, node_id = %claim.node_id, origin = ?origin, "releasing claim");
                        // Checkpointed before the node detach call; with no
                        // call to make, the next write is the checkpoint.
                        if node_call {
                            self.checkpoint_claim(volume_id, alloc_id, ClaimState::Taken)
                                .await?;
                        }
                    }
                    if let Some(warnings) = warnings.as_deref_mut() {
                        if !self.node_up(&claim.node_id) {
                            let node = self.node_label(&claim.node_id);
                            warnings.push(format!(
                                "node {node} is down or gone and was not told to unmount volume {volume_id:?} for alloc {alloc_id}"
                            ));
                        }
                    }
                    if let Err(e) = self.node_detach(&vol, &claim, origin).await {
                        let node = self.node_label(&claim.node_id);
                        let what = format!(
                            "node {node} could not unmount volume {volume_id:?} for alloc {alloc_id}: {e}"
                        );
                        self.go_on_past(e, &claim, volume_id, what, warnings.as_deref_mut())?;
                    }
                    if !controller_detach {
                        // Nothing is left to detach: the claim is freed in
                        // this one write.
                        return self.free_claim(volume_id, alloc_id).await;
                    }
                    self.checkpoint_claim(volume_id, alloc_id, ClaimState::NodeDetached)
                        .await?;
                }
                ClaimState::NodeDetached => {
                    if controller_detach {
                        if let Err(e) = self.controller_detach(&vol, &claim).await {
                            let node = self.node_label(&claim.node_id);
                            let what = format!(
                                "the controller could not detach volume {volume_id:?} from node {node} for alloc {alloc_id}: {e}; it may still be attached there"
                            );
                            self.go_on_past(e, &claim, volume_id, what, warnings.as_deref_mut())?;
                        }
                    }
                    // No call follows the controller detach: the
                    // controller-detached and ready-to-free steps are the
                    // free itself, in one write.
                    return self.free_claim(volume_id, alloc_id).await;
                }
                // Claims checkpointed past the controller detach (stored by
                // an earlier release that stopped there): only the free is
                // left.
                ClaimState::ControllerDetached | ClaimState::ReadyToFree => {
                    return self.free_claim(volume_id, alloc_id).await;
                }
            }
        }
    }

    /// Removes a claim whose detach steps are done; answers that a claim
    /// was freed.
    async fn free_claim(&self, volume_id: &str, alloc_id: &str) -> Result<bool, ServerError> {
        self.drop_claim(volume_id, alloc_id).await?;
        tracing::info!(volume_id, alloc_id, "claim freed");
        Ok(true)
    }

    /// Whether the node exists and is not down (it can be told to detach).
    fn node_up(&self, node_id: &str) -> bool {
        self.store.read(|t| {
            t.nodes
                .get(node_id)
                .is_some_and(|n| n.status != NodeStatus::Down)
        })
    }

    /// A node's name, or its ID when it has none (or is gone).
    fn node_label(&self, node_id: &str) -> String {
        self.store
            .read(|t| t.nodes.get(node_id).map(|n| n.name.clone()))
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| node_id.to_string())
    }

    /// A detach step of a release failed with `error`: a release that
    /// collects `warnings` goes on (the failure, said by `what`, becomes a
    /// warning and a `Storage` event of the claim's node); any other stops
    /// with it.
    fn go_on_past(
        &self,
        error: ServerError,
        claim: &CsiVolumeClaim,
        volume_id: &str,
        what: String,
        warnings: Option<&mut Vec<String>>,
    ) -> Result<(), ServerError> {
        let Some(warnings) = warnings else {
            return Err(error);
        };
        tracing::warn!(volume_id, alloc_id = %claim.alloc_id, node_id = %claim.node_id, error = %error,
            "detach step failed; the operator's release frees the claim anyway");
        let event = NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, FORCED_RELEASE_EVENT)
            .with_detail("volume_id", volume_id)
            .with_detail("alloc_id", claim.alloc_id.as_str())
            .with_detail("success", "false")
            .with_detail("error", what.as_str());
        if let Err(e) = self.emit_node_events(&claim.node_id, vec![event]) {
            tracing::debug!(node_id = %claim.node_id, error = %e, "no node to record the failed detach on");
        }
        warnings.push(what);
        Ok(())
    }

    /// ControllerUnpublishVolume for a claim, through a client that runs a
    /// healthy controller of the plugin. With none reachable the error is
    /// `Unavailable` and the claim stays node-detached, to be retried.
    async fn controller_detach(
        &self,
        vol: &berth_structs::CsiVolume,
        claim: &CsiVolumeClaim,
    ) -> Result<(), ServerError> {
        let (volume_id, alloc_id) = (vol.id.as_str(), claim.alloc_id.as_str());
        let controller = self.controller_client(&vol.plugin_id).inspect_err(|e| {
            tracing::warn!(volume_id, alloc_id, plugin_id = %vol.plugin_id, error = %e,
                "no controller to detach the volume; the claim stays node-detached")
        })?;
        let call = pb::server_call::Call::ControllerUnpublish(pb::ControllerUnpublish {
            plugin_id: vol.plugin_id.clone(),
            external_id: vol.external_id.clone(),
            external_node_id: claim.external_node_id.clone(),
            secrets: vol.secrets.clone().into_iter().collect(),
        });
        match self
            .calls
            .call(&controller, call, self.config.client_call_timeout)
            .await
        {
            Ok(_) => Ok(()),
            // CSI: NotFound for the volume or the node means the volume is
            // not published there, which is what the call is for.
            Err(ServerError::Remote {
                code: tonic::Code::NotFound,
                message,
            }) => {
                tracing::info!(volume_id, alloc_id, plugin_id = %vol.plugin_id, reason = %message,
                    "ControllerUnpublish found the volume or node gone; treating it as detached");
                Ok(())
            }
            Err(e) => {
                tracing::warn!(volume_id, alloc_id, plugin_id = %vol.plugin_id, error = %e,
                    "ControllerUnpublish failed; the claim stays node-detached");
                Err(e)
            }
        }
    }

    async fn node_detach(
        &self,
        vol: &berth_structs::CsiVolume,
        claim: &CsiVolumeClaim,
        origin: &ReleaseOrigin,
    ) -> Result<(), ServerError> {
        if let ReleaseOrigin::Client { node_id } = origin {
            if *node_id == claim.node_id {
                return Ok(());
            }
        }
        if !self.node_up(&claim.node_id) {
            tracing::info!(volume_id = %vol.id, alloc_id = %claim.alloc_id, node_id = %claim.node_id,
                "node is down or gone; skipping node detach");
            return Ok(());
        }
        let call = pb::server_call::Call::NodeDetach(pb::NodeDetach {
            plugin_id: vol.plugin_id.clone(),
            volume_id: vol.id.clone(),
            external_id: vol.external_id.clone(),
            alloc_id: claim.alloc_id.clone(),
            capability: Some(capability_pb(
                claim.access_mode,
                claim.attachment_mode,
                &vol.mount_options,
            )),
            read_only: claim.mode == ClaimMode::Read,
        });
        self.calls
            .call(&claim.node_id, call, self.config.client_call_timeout)
            .await
            .inspect_err(|e| {
                tracing::warn!(volume_id = %vol.id, alloc_id = %claim.alloc_id, node_id = %claim.node_id,
                    error = %e, "node detach failed; the claim stays taken")
            })?;
        Ok(())
    }
}

/// Whether the group of `alloc` (as it was placed) asks for the volume
/// `req` claims, in the claim's modes: a `csi` volume block whose `source`
/// (with `per_alloc`, the alloc's own index) is the volume, with the
/// claim's access and attachment modes, and that is not read-only for a
/// write claim. A node acts only on what the servers placed on it: any
/// other claim is refused, whatever the alloc or its node.
fn check_declared(alloc: &Allocation, req: &VolumeClaimRequest) -> Result<(), ServerError> {
    let vid = req.volume_id.as_str();
    let refused = |why: String| {
        ServerError::Forbidden(format!(
            "alloc {} (group {:?} of job {:?}) {why}; a node claims only the volumes its allocs' groups ask for, as they ask",
            alloc.id, alloc.task_group, alloc.job_id
        ))
    };
    let asked: Vec<&VolumeRequest> = alloc
        .group()
        .map(|g| {
            g.volumes
                .values()
                .filter(|r| r.volume_type == "csi" && r.source_for(alloc.index) == vid)
                .collect()
        })
        .unwrap_or_default();
    if asked.is_empty() {
        return Err(refused(format!("asks for no CSI volume {vid:?}")));
    }
    let fits = |r: &&VolumeRequest| {
        let read_only = r.read_only || r.access_mode.is_some_and(|m| m.is_reader_only());
        r.access_mode == Some(req.access_mode)
            && r.attachment_mode == Some(req.attachment_mode)
            && (req.mode == ClaimMode::Read || !read_only)
    };
    if asked.iter().any(fits) {
        return Ok(());
    }
    let shown: Vec<String> = asked
        .iter()
        .map(|r| {
            let mode = |m: Option<String>| m.unwrap_or_else(|| "-".into());
            format!(
                "{:?}: {}{}/{}",
                r.name,
                if r.read_only { "read-only " } else { "" },
                mode(r.access_mode.map(|m| m.to_string())),
                mode(r.attachment_mode.map(|m| m.to_string())),
            )
        })
        .collect();
    Err(refused(format!(
        "asks for volume {vid:?} as {}, not a {} claim {}/{}",
        shown.join(", "),
        req.mode.as_str(),
        req.access_mode,
        req.attachment_mode
    )))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use berth_structs::{AccessMode, AttachmentMode};

    use super::*;

    #[test]
    fn many_claims_released_at_once_wait_parked_not_on_a_thread_each() {
        const NAME: &str = "claim-storm";
        const CLAIMS: usize = 300;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(NAME)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let server = Arc::new(Server::open(crate::ServerConfig::new(dir.path())).unwrap());
        // A write claim on each volume, taken on node n0 (no controller).
        server
            .store
            .write(|_, changes| {
                for i in 0..CLAIMS {
                    let claim = CsiVolumeClaim {
                        alloc_id: format!("a{i}"),
                        node_id: "n0".into(),
                        external_node_id: "n0".into(),
                        mode: ClaimMode::Write,
                        access_mode: AccessMode::SingleNodeWriter,
                        attachment_mode: AttachmentMode::FileSystem,
                        state: ClaimState::Taken,
                        publish_context: BTreeMap::new(),
                        releasing: false,
                        controller_published: false,
                        kept_after_purge: false,
                    };
                    changes.push(Change::PutVolume(CsiVolume {
                        id: format!("v{i}"),
                        plugin_id: "p".into(),
                        write_claims: BTreeMap::from([(claim.alloc_id.clone(), claim)]),
                        ..CsiVolume::default()
                    }));
                }
                Ok::<_, ServerError>(())
            })
            .unwrap();
        // The runtime's threads, sampled all through the release.
        let peak = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (peak, done) = (peak.clone(), done.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    peak.fetch_max(berth_testutil::threads_named(NAME), Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        rt.block_on(async {
            let mut releases = tokio::task::JoinSet::new();
            for i in 0..CLAIMS {
                let server = server.clone();
                releases.spawn(async move {
                    let origin = ReleaseOrigin::Client {
                        node_id: "n0".into(),
                    };
                    server
                        .unpublish_claim(&format!("v{i}"), &format!("a{i}"), origin)
                        .await
                });
            }
            while let Some(released) = releases.join_next().await {
                released.unwrap().unwrap();
            }
        });
        done.store(true, Ordering::SeqCst);
        sampler.join().unwrap();
        let claimed = server.store.read(|t| {
            t.volumes
                .values()
                .filter(|v| !v.write_claims.is_empty())
                .count()
        });
        assert_eq!(claimed, 0, "every claim freed");
        // The two workers, the thread the writer whose turn it is blocks
        // and a few of the blocking pool's; a release that blocked a
        // thread of its own for its write took one per claim.
        let peak = peak.load(Ordering::SeqCst);
        assert!(peak <= 8, "{peak} threads for {CLAIMS} releases at once");
    }
}
