//! The steps of mounting a volume for an alloc
//! ([`VolumeManager::mount_locked`](super::VolumeManager)): the plan, the
//! usage taken durably, the stage and the publish, each undoing what it
//! must when its CSI call fails.

use std::collections::BTreeMap;
use std::path::PathBuf;

use berth_proto::csi::v1 as csi;
use berth_structs::AttachmentMode;

use super::{create_dir_all, path_string, to_map, volume_capability, VolumeManager};
use crate::client::CsiClient;
use crate::error::CsiError;
use crate::repair::{detach_dead_mount, mount_points, staging_is_live};
use crate::volume::{MountContext, MountRequest, VolumeStub};

impl VolumeManager {
    /// Works out what mounting `req` does: its paths and capability, and
    /// whether it stages (the first user, or a staging recorded that is not
    /// really there).
    pub(super) async fn plan_mount(&self, supports_stage: bool, req: &MountRequest) -> MountPlan {
        let (access, attach) = (req.access_mode, req.attachment_mode);
        let key = req.stub_key();
        let staging = self.staging_path(
            &req.plugin_id,
            &req.volume_id,
            access,
            attach,
            req.read_only,
        );
        let target = self.target_path(
            &req.plugin_id,
            &req.alloc_id,
            &req.volume_id,
            access,
            attach,
            req.read_only,
        );
        let read_only = req.read_only || access.is_reader_only();
        let capability = volume_capability(access, attach, &req.mount_options);

        let prior = self.lock_stubs().get(&key).cloned();
        // A mount again for an alloc that already uses the volume: a
        // restore after a restart.
        let remount = prior
            .as_ref()
            .is_some_and(|s| s.allocs.contains_key(&req.alloc_id));
        // The record says staged for some alloc (another, or this one on a
        // restore). A usage being unstaged (marked before
        // NodeUnstageVolume) is not staged for anyone: the unstage may
        // have finished.
        let recorded_staged = prior
            .as_ref()
            .is_some_and(|s| s.staged && !s.unstaging && !s.allocs.is_empty());
        // When the stage left a mount at (or, for a block volume, below)
        // the staging path, the record is trusted only while that mount is
        // there: anyone unmounting the staging path, or a stage cut off by
        // a crash, leaves a record that says staged while nothing is, and
        // publishing from the bare directory would hand the task a
        // directory that is not the volume. Staging again is safe:
        // NodeStageVolume is idempotent. When the stage mounted nothing
        // (as the CSI spec allows), the record alone says staged.
        let stage_missing = supports_stage
            && recorded_staged
            && prior.as_ref().and_then(|s| s.staging_mounted) != Some(false)
            && !staging_is_live(&staging, attach, &mount_points().await).await;
        if stage_missing {
            tracing::info!(staging = %staging.display(), "the volume is recorded as staged but nothing is staged at its staging path; staging it again");
        }
        let need_stage = supports_stage && (!recorded_staged || stage_missing);
        MountPlan {
            key,
            staging,
            target,
            read_only,
            capability,
            attach,
            supports_stage,
            prior,
            remount,
            stage_missing,
            need_stage,
        }
    }

    /// Records the alloc's usage of the volume in its stub, durably.
    pub(super) fn take_usage(&self, req: &MountRequest, plan: &MountPlan) -> Result<(), CsiError> {
        let mut stub = plan.prior.clone().unwrap_or_else(|| VolumeStub {
            plugin_id: req.plugin_id.clone(),
            volume_id: req.volume_id.clone(),
            external_id: req.external_id.clone(),
            access_mode: req.access_mode,
            attachment_mode: req.attachment_mode,
            read_only: req.read_only,
            staging_path: plan.staging.clone(),
            staged: false,
            staging_mounted: None,
            unstaging: false,
            allocs: BTreeMap::new(),
            mounted_with: MountContext::default(),
        });
        stub.external_id = req.external_id.clone();
        // What the staging is made with (a repair stages again with it):
        // another alloc's later publish leaves it as it is.
        if plan.need_stage || plan.prior.is_none() {
            stub.mounted_with = MountContext::of(req);
        }
        stub.allocs
            .insert(req.alloc_id.clone(), plan.target.clone());
        if plan.need_stage {
            // What the stage leaves is recorded once it returns.
            stub.staged = true;
            stub.unstaging = false;
            stub.staging_mounted = None;
        }
        self.put_stub(&stub)
    }

    /// Stages the volume (NodeStageVolume); on failure gives back the
    /// usage taken, unless this is a remount.
    pub(super) async fn stage_for_mount(
        &self,
        client: &CsiClient,
        req: &MountRequest,
        plan: &MountPlan,
    ) -> Result<(), CsiError> {
        let (key, staging, capability) = (&plan.key, &plan.staging, &plan.capability);
        let remount = plan.remount;
        let staged = async {
            if plan.stage_missing {
                // A dead mount left at the staging path is taken away
                // first, as a repair does; nothing mounted is fine.
                detach_dead_mount(staging).await?;
            }
            create_dir_all(staging)?;
            let stage_req = csi::NodeStageVolumeRequest {
                volume_id: req.external_id.clone(),
                publish_context: to_map(&req.publish_context),
                staging_target_path: path_string(staging)?,
                volume_capability: Some(capability.clone()),
                secrets: to_map(&req.secrets),
                volume_context: to_map(&req.volume_context),
            };
            self.with_retry("NodeStageVolume", || {
                client.node_stage_volume(stage_req.clone())
            })
            .await
        }
        .await;
        if let Err(e) = staged {
            if remount {
                // The alloc used the volume before (an agent restart
                // re-runs its hooks): its target may still be published
                // and a task may still use it. The stub keeps the alloc
                // (and `staged`), so the stage stays for it and its later
                // unmount unpublishes the target before anything is
                // unstaged.
                tracing::warn!(error = %e, "staging again on restore failed; the alloc keeps its usage");
                return Err(e);
            }
            let prior_staged = plan.prior.as_ref().is_some_and(|s| s.staged);
            self.give_back_failed_stage(
                client,
                key,
                &req.alloc_id,
                e.is_uncertain() || prior_staged,
            )
            .await;
            return Err(e);
        }
        self.record_staging(plan).await
    }

    /// Records what the stage left at the staging path: nothing mounted is
    /// written down (one more durable write, for such plugins only), so
    /// that the next user trusts the record instead of staging again.
    async fn record_staging(&self, plan: &MountPlan) -> Result<(), CsiError> {
        if staging_is_live(&plan.staging, plan.attach, &mount_points().await).await {
            return Ok(());
        }
        let Some(mut stub) = self.lock_stubs().get(&plan.key).cloned() else {
            return Ok(());
        };
        tracing::debug!(staging = %plan.staging.display(), "the plugin's stage mounted nothing; the record says staged");
        stub.staging_mounted = Some(false);
        self.put_stub(&stub)
    }

    /// Publishes the volume at the alloc's target (NodePublishVolume); on
    /// failure undoes the usage (unpublish, and unstage for the last user).
    pub(super) async fn publish_for_mount(
        &self,
        client: &CsiClient,
        req: &MountRequest,
        plan: &MountPlan,
    ) -> Result<(), CsiError> {
        let (staging, target, capability) = (&plan.staging, &plan.target, &plan.capability);
        let published = async {
            match req.attachment_mode {
                AttachmentMode::FileSystem => create_dir_all(target)?,
                AttachmentMode::BlockDevice => {
                    if let Some(parent) = target.parent() {
                        create_dir_all(parent)?;
                    }
                }
            }
            let publish_req = csi::NodePublishVolumeRequest {
                volume_id: req.external_id.clone(),
                publish_context: to_map(&req.publish_context),
                staging_target_path: if plan.supports_stage {
                    path_string(staging)?
                } else {
                    String::new()
                },
                target_path: path_string(target)?,
                volume_capability: Some(capability.clone()),
                readonly: plan.read_only,
                secrets: to_map(&req.secrets),
                volume_context: to_map(&req.volume_context),
            };
            self.with_retry("NodePublishVolume", || {
                client.node_publish_volume(publish_req.clone())
            })
            .await
        }
        .await;
        if let Err(e) = published {
            // Unpublish what may have been published; unstage when this was
            // the last user. A failing undo stays recorded in the stub.
            if let Err(undo) = self
                .release_usage(Some(client), &plan.key, &req.alloc_id)
                .await
            {
                tracing::warn!(error = %undo, "undoing a failed publish failed; the stub keeps what remains to undo");
            }
            return Err(e);
        }
        Ok(())
    }
}

/// What mounting one volume for one alloc does, worked out before any
/// change ([`VolumeManager::mount_locked`](super::VolumeManager)).
pub(super) struct MountPlan {
    pub(super) key: String,
    pub(super) staging: PathBuf,
    pub(super) target: PathBuf,
    pub(super) read_only: bool,
    pub(super) capability: csi::VolumeCapability,
    pub(super) attach: AttachmentMode,
    pub(super) supports_stage: bool,
    /// The volume's stub before this mount.
    pub(super) prior: Option<VolumeStub>,
    /// The alloc already uses the volume (a restore after a restart).
    pub(super) remount: bool,
    /// Recorded as staged, but nothing is staged.
    pub(super) stage_missing: bool,
    pub(super) need_stage: bool,
}
