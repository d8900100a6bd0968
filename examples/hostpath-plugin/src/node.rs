//! The CSI Node service: staging bind-mounts the volume directory, publishing
//! bind-mounts the staging path (read-only when asked).

use std::fs;
use std::path::{Path, PathBuf};

use berth_proto::csi::v1::node_server::Node;
use berth_proto::csi::v1::node_service_capability::{self, rpc};
use berth_proto::csi::v1::volume_usage::Unit;
use berth_proto::csi::v1::*;
use nix::sys::statvfs::statvfs;
use tonic::{Request, Response, Status};

use crate::capability;
use crate::controller::PUBLISHED_BY;
use crate::error::{require, Error};
use crate::mount;
use crate::plugin::{blocking, Plugin};

impl Plugin {
    /// With `--enable-attach`, a volume must be controller-published to this
    /// node before it is staged here.
    async fn check_published(
        &self,
        volume_id: &str,
        publish_context: &std::collections::HashMap<String, String>,
    ) -> Result<(), Error> {
        if let Some(by) = publish_context.get(PUBLISHED_BY) {
            if by != self.node_id() {
                return Err(Error::FailedPrecondition(format!(
                    "volume {volume_id} was published to node {by}, not to this node {}",
                    self.node_id()
                )));
            }
        }
        let (id, node) = (volume_id.to_owned(), self.node_id().to_owned());
        let published_here = self
            .store()
            .read(move |s| {
                s.volumes
                    .get(&id)
                    .is_some_and(|v| v.publications.contains_key(&node))
            })
            .await?;
        if published_here {
            return Ok(());
        }
        Err(Error::FailedPrecondition(format!(
            "volume {volume_id} is not controller-published to node {}: \
             call ControllerPublishVolume first",
            self.node_id()
        )))
    }

    async fn stage(&self, req: NodeStageVolumeRequest) -> Result<NodeStageVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let staging = PathBuf::from(require(&req.staging_target_path, "staging_target_path")?);
        check_absolute(&staging, "staging_target_path")?;
        let cap = capability::check(req.volume_capability.as_ref(), "volume_capability")?;
        let _guard = self.begin("NodeStageVolume", &volume_id).await?;

        let record = self.lookup(&volume_id).await?;
        self.check_accessible(&record)?;
        if self.enable_attach() {
            self.check_published(&volume_id, &req.publish_context)
                .await?;
        }
        let source = self.volume_dir(&volume_id);
        let read_only = cap.ro_flag;
        let (id, target) = (volume_id.clone(), staging.clone());
        let fresh =
            blocking(move || mount_volume(&id, &source, &target, read_only, "staged")).await?;
        if fresh {
            tracing::info!(%volume_id, staging = %staging.display(), "staged volume");
        } else {
            tracing::info!(%volume_id, staging = %staging.display(), "volume already staged");
        }
        Ok(NodeStageVolumeResponse {})
    }

    async fn unstage(
        &self,
        req: NodeUnstageVolumeRequest,
    ) -> Result<NodeUnstageVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let staging = PathBuf::from(require(&req.staging_target_path, "staging_target_path")?);
        check_absolute(&staging, "staging_target_path")?;
        let _guard = self.begin("NodeUnstageVolume", &volume_id).await?;
        self.unmount_volume(&volume_id, staging, "staging_target_path")
            .await?;
        Ok(NodeUnstageVolumeResponse {})
    }

    async fn publish(
        &self,
        req: NodePublishVolumeRequest,
    ) -> Result<NodePublishVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let target = PathBuf::from(require(&req.target_path, "target_path")?);
        check_absolute(&target, "target_path")?;
        let cap = capability::check(req.volume_capability.as_ref(), "volume_capability")?;
        if req.staging_target_path.is_empty() {
            return Err(Error::FailedPrecondition(
                "staging_target_path is not set, but the plugin has STAGE_UNSTAGE_VOLUME: \
                 stage the volume first"
                    .to_owned(),
            ));
        }
        let staging = PathBuf::from(&req.staging_target_path);
        check_absolute(&staging, "staging_target_path")?;
        let _guard = self.begin("NodePublishVolume", &volume_id).await?;

        self.lookup(&volume_id).await?;
        let volume_dir = self.volume_dir(&volume_id);
        let read_only = req.readonly || cap.is_reader_only() || cap.ro_flag;
        let (id, tgt) = (volume_id.clone(), target.clone());
        let fresh = blocking(move || {
            let staged =
                mount::mount_at(&staging)?.is_some() && mount::same_file(&staging, &volume_dir)?;
            if !staged {
                return Err(Error::FailedPrecondition(format!(
                    "volume {id} is not staged at {}: call NodeStageVolume first",
                    staging.display()
                )));
            }
            mount_volume(&id, &staging, &tgt, read_only, "published")
        })
        .await?;
        if fresh {
            tracing::info!(%volume_id, target = %target.display(), read_only, "published volume");
        } else {
            tracing::info!(%volume_id, target = %target.display(), "volume already published");
        }
        Ok(NodePublishVolumeResponse {})
    }

    async fn unpublish(
        &self,
        req: NodeUnpublishVolumeRequest,
    ) -> Result<NodeUnpublishVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let target = PathBuf::from(require(&req.target_path, "target_path")?);
        check_absolute(&target, "target_path")?;
        let _guard = self.begin("NodeUnpublishVolume", &volume_id).await?;
        self.unmount_volume(&volume_id, target, "target_path")
            .await?;
        Ok(NodeUnpublishVolumeResponse {})
    }

    /// Unmounts a volume from `path` and removes the mount point. A path
    /// that is not mounted (or gone) is fine; a path with another
    /// volume's mount is refused.
    async fn unmount_volume(
        &self,
        volume_id: &str,
        path: PathBuf,
        field: &'static str,
    ) -> Result<(), Error> {
        if !crate::state::is_volume_id(volume_id) {
            // Never one of ours: nothing of it can be mounted, and the path is
            // left alone.
            return Err(Error::NotFound(format!(
                "volume {volume_id} does not exist"
            )));
        }
        let volume_dir = self.volume_dir(volume_id);
        let id = volume_id.to_owned();
        let shown = path.display().to_string();
        let was_mounted = blocking(move || {
            let mounted = mount::mount_at(&path)?.is_some();
            if mounted {
                // Refuse to unmount something that is not this volume; when the
                // volume directory is already gone there is nothing to compare.
                if volume_dir.exists() && !mount::same_file(&path, &volume_dir)? {
                    return Err(Error::invalid(
                        field,
                        format!("{} is not a mount of volume {id}", path.display()),
                    ));
                }
                mount::unmount_all(&path)?;
            }
            if let Err(e) = mount::remove_mount_point(&path) {
                // Never delete data: a non-empty directory or a file stays.
                tracing::warn!(path = %path.display(), error = %e, "could not remove mount point");
            }
            Ok(mounted)
        })
        .await?;
        if was_mounted {
            tracing::info!(volume_id, path = %shown, "unmounted volume");
        } else {
            tracing::info!(volume_id, path = %shown, "volume was not mounted; nothing to unmount");
        }
        Ok(())
    }

    async fn volume_stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> Result<NodeGetVolumeStatsResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let path = PathBuf::from(require(&req.volume_path, "volume_path")?);
        check_absolute(&path, "volume_path")?;
        self.inject("NodeGetVolumeStats").await?;
        self.lookup(&volume_id).await?;
        let volume_dir = self.volume_dir(&volume_id);
        blocking(move || {
            let not_found = || {
                Error::NotFound(format!(
                    "volume {volume_id} is not mounted at {}",
                    path.display()
                ))
            };
            if !path.exists() || mount::mount_at(&path)?.is_none() {
                return Err(not_found());
            }
            if !mount::same_file(&path, &volume_dir)? {
                return Err(not_found());
            }
            let st = statvfs(&path).map_err(Error::sys("statvfs", &path))?;
            let frsize = wide(st.fragment_size());
            let bytes = |blocks: u64| to_i64(blocks.saturating_mul(frsize));
            let (blocks, bfree, bavail) = (
                wide(st.blocks()),
                wide(st.blocks_free()),
                wide(st.blocks_available()),
            );
            let (files, ffree) = (wide(st.files()), wide(st.files_free()));
            Ok(NodeGetVolumeStatsResponse {
                usage: vec![
                    VolumeUsage {
                        available: bytes(bavail),
                        total: bytes(blocks),
                        used: bytes(blocks.saturating_sub(bfree)),
                        unit: Unit::Bytes as i32,
                    },
                    VolumeUsage {
                        available: to_i64(ffree),
                        total: to_i64(files),
                        used: to_i64(files.saturating_sub(ffree)),
                        unit: Unit::Inodes as i32,
                    },
                ],
                volume_condition: None,
            })
        })
        .await
    }
}

/// Widens a statvfs count, whatever its platform type.
fn wide<T: Into<u64>>(n: T) -> u64 {
    n.into()
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn check_absolute(path: &Path, field: &'static str) -> Result<(), Error> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(Error::invalid(field, "must be an absolute path"))
    }
}

/// Bind-mounts `source` (a volume directory, or its staging mount) at
/// `target`, creating `target` and making the mount read-only when asked.
/// Returns false when the same mount is already there. Blocking.
fn mount_volume(
    volume_id: &str,
    source: &Path,
    target: &Path,
    read_only: bool,
    what: &str,
) -> Result<bool, Error> {
    if !source.is_dir() {
        return Err(Error::NotFound(format!(
            "{} of volume {volume_id} does not exist",
            source.display()
        )));
    }
    fs::create_dir_all(target).map_err(Error::io("creating", target))?;
    if let Some(existing) = mount::mount_at(target)? {
        if mount::same_file(target, source)? && existing.is_read_only() == read_only {
            return Ok(false);
        }
        return Err(Error::AlreadyExists(format!(
            "{} already has a different mount (volume {volume_id} {what} there with other \
             options, or another volume)",
            target.display()
        )));
    }
    mount::bind_mount(source, target)?;
    if read_only {
        if let Err(e) = mount::remount_read_only(target) {
            // Never leave a writable mount behind a read-only request.
            if let Err(undo) = mount::unmount_all(target) {
                tracing::error!(target = %target.display(), error = %undo, "could not undo bind mount");
            }
            return Err(e);
        }
    }
    Ok(true)
}

#[tonic::async_trait]
impl Node for Plugin {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("NodeStageVolume", |p| async move { p.stage(req).await })
            .await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("NodeUnstageVolume", |p| async move { p.unstage(req).await })
            .await
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("NodePublishVolume", |p| async move { p.publish(req).await })
            .await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "NodeUnpublishVolume",
            |p| async move { p.unpublish(req).await },
        )
        .await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        self.call("NodeGetVolumeStats", |p| async move {
            p.volume_stats(req).await
        })
        .await
    }

    async fn node_expand_volume(
        &self,
        _request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        self.call("NodeExpandVolume", |p| async move {
            p.inject("NodeExpandVolume").await?;
            Err(Error::Unimplemented("NodeExpandVolume"))
        })
        .await
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        self.call("NodeGetCapabilities", |p| async move {
            p.inject("NodeGetCapabilities").await?;
            let capabilities = [rpc::Type::StageUnstageVolume, rpc::Type::GetVolumeStats]
                .into_iter()
                .map(|t| NodeServiceCapability {
                    r#type: Some(node_service_capability::Type::Rpc(
                        node_service_capability::Rpc { r#type: t as i32 },
                    )),
                })
                .collect();
            Ok(NodeGetCapabilitiesResponse { capabilities })
        })
        .await
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        self.call("NodeGetInfo", |p| async move {
            p.inject("NodeGetInfo").await?;
            Ok(NodeGetInfoResponse {
                node_id: p.node_id().to_owned(),
                max_volumes_per_node: 0,
                accessible_topology: p.accessible_topology(),
            })
        })
        .await
    }
}
