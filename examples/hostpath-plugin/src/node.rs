//! The CSI Node service.
//!
//! Directory-backed volumes: staging bind-mounts the volume directory,
//! publishing bind-mounts the staging path (read-only when asked).
//! Image-backed volumes ([`crate::image`]): staging attaches the image to a
//! loop device and mounts its ext4 filesystem at the staging path (mount
//! access), or binds the device node onto `<staging>/device` (block access);
//! publishing binds the staging mount at the target, or the device node
//! onto a file at the target. Unstaging detaches the loop device once
//! nothing on the node mounts it any more. The node's mount table is the
//! only record of what is staged or published here.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use berth_proto::csi::v1::node_server::Node;
use berth_proto::csi::v1::node_service_capability::{self, rpc};
use berth_proto::csi::v1::volume_usage::Unit;
use berth_proto::csi::v1::*;
use nix::sys::statvfs::statvfs;
use tonic::{Request, Response, Status};

use crate::capability::{self, Checked};
use crate::controller::PUBLISHED_BY;
use crate::error::{require, Error};
use crate::image;
use crate::mount;
use crate::plugin::{blocking, Plugin};
use crate::state::{Backing, VolumeRecord};

/// The file inside a block volume's staging directory onto which the loop
/// device node is bound.
pub const STAGED_DEVICE: &str = "device";

/// Where a volume's data is on this machine.
#[derive(Debug, Clone)]
enum Backend {
    /// The volume directory.
    Directory(PathBuf),
    /// The image file.
    Image(PathBuf),
}

impl Plugin {
    fn backend(&self, record: &VolumeRecord) -> Backend {
        match record.backing {
            Backing::Directory => Backend::Directory(self.volume_dir(&record.volume_id)),
            Backing::Image => {
                Backend::Image(image::image_path(self.state_dir(), &record.volume_id))
            }
        }
    }

    /// The backend of `volume_id` (a well-formed ID) as far as it is known:
    /// a volume no longer in the state is taken to be a directory.
    async fn backend_of(&self, volume_id: &str) -> Result<Backend, Error> {
        let id = volume_id.to_owned();
        let record = self
            .store()
            .read(move |s| s.volumes.get(&id).cloned())
            .await?;
        Ok(match record {
            Some(record) => self.backend(&record),
            None => Backend::Directory(self.volume_dir(volume_id)),
        })
    }

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
        cap.suits(record.backing)
            .map_err(|reason| Error::invalid("volume_capability", reason))?;
        if self.enable_attach() {
            self.check_published(&volume_id, &req.publish_context)
                .await?;
        }
        let backend = self.backend(&record);
        if self.stage_noop() && matches!(backend, Backend::Directory(_)) && !cap.block {
            tracing::info!(%volume_id, staging = %staging.display(), "staged volume (nothing mounted: --stage-noop)");
            return Ok(NodeStageVolumeResponse {});
        }
        let (id, target) = (volume_id.clone(), staging.clone());
        let fresh = blocking(move || match backend {
            Backend::Directory(source) => {
                mount_volume(&id, &source, &target, cap.ro_flag, "staged")
            }
            Backend::Image(image) => stage_image(&id, &image, &target, &cap),
        })
        .await?;
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
        self.unmount_volume(&volume_id, staging, "staging_target_path", true)
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

        let record = self.lookup(&volume_id).await?;
        cap.suits(record.backing)
            .map_err(|reason| Error::invalid("volume_capability", reason))?;
        let backend = self.backend(&record);
        let read_only = req.readonly || cap.is_reader_only() || cap.ro_flag;
        let (id, tgt) = (volume_id.clone(), target.clone());
        let noop = self.stage_noop();
        let fresh = blocking(move || {
            let not_staged = || {
                Error::FailedPrecondition(format!(
                    "volume {id} is not staged at {}: call NodeStageVolume first",
                    staging.display()
                ))
            };
            match &backend {
                Backend::Image(image) if cap.block => {
                    let staged_device = staging.join(STAGED_DEVICE);
                    let dev = image::find_loop(image)?.ok_or_else(not_staged)?;
                    if mount::mount_at(&staged_device)?.is_none()
                        || !holds_volume(&staged_device, &backend)?
                    {
                        return Err(not_staged());
                    }
                    if !read_only {
                        return bind_device(&id, &dev, &tgt, false, "published");
                    }
                    // A read-only bind of a device node still lets writes
                    // through to the device: hand out a read-only loop
                    // device of the image instead.
                    let ro_dev = image::attach_read_only(image)?;
                    let bound = bind_device(&id, &ro_dev, &tgt, true, "published");
                    if bound.is_err() {
                        if let Err(e) = detach_unused(&id, image, false) {
                            tracing::error!(volume_id = %id, error = %e, "could not detach a read-only loop device after a failed publish");
                        }
                    }
                    bound
                }
                Backend::Directory(source) if noop => {
                    mount_volume(&id, source, &tgt, read_only, "published")
                }
                _ => {
                    let staged =
                        mount::mount_at(&staging)?.is_some() && holds_volume(&staging, &backend)?;
                    if !staged {
                        return Err(not_staged());
                    }
                    mount_volume(&id, &staging, &tgt, read_only, "published")
                }
            }
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
        self.unmount_volume(&volume_id, target, "target_path", false)
            .await?;
        Ok(NodeUnpublishVolumeResponse {})
    }

    /// Unmounts a volume from `path` and removes the mount point (for a
    /// block staging, the device bound at `<path>/device` as well). A path
    /// that is not mounted (or gone) is fine; a path with another volume's
    /// mount is refused. `unstage`: the image's loop device is detached too
    /// once nothing on the node mounts it.
    async fn unmount_volume(
        &self,
        volume_id: &str,
        path: PathBuf,
        field: &'static str,
        unstage: bool,
    ) -> Result<(), Error> {
        if !crate::state::is_volume_id(volume_id) {
            // Never one of ours: nothing of it can be mounted, and the path is
            // left alone.
            return Err(Error::NotFound(format!(
                "volume {volume_id} does not exist"
            )));
        }
        let backend = self.backend_of(volume_id).await?;
        let id = volume_id.to_owned();
        let shown = path.display().to_string();
        let was_mounted = blocking(move || {
            let mut mounted = unmount_checked(&id, &path, &backend, field)?;
            if !mounted && matches!(backend, Backend::Image(_)) {
                // A block staging binds the device inside the directory. (A
                // filesystem staging is a mount at `path` itself, so its
                // files are never mistaken for the device.)
                let device = path.join(STAGED_DEVICE);
                if unmount_checked(&id, &device, &backend, field)? {
                    mounted = true;
                    if let Err(e) = mount::remove_mount_point(&device) {
                        tracing::warn!(path = %device.display(), error = %e, "could not remove mount point");
                    }
                }
            }
            if let Err(e) = mount::remove_mount_point(&path) {
                // Never delete data: a non-empty directory or a file stays.
                tracing::warn!(path = %path.display(), error = %e, "could not remove mount point");
            }
            if let Backend::Image(image) = &backend {
                detach_unused(&id, image, unstage)?;
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
        self.inject("NodeGetVolumeStats").await?;
        if !path.is_absolute() {
            // No volume can be at a relative path.
            return Err(Error::NotFound(format!(
                "volume_path {} is not an absolute path: no volume is there",
                path.display()
            )));
        }
        let record = self.lookup(&volume_id).await?;
        let backend = self.backend(&record);
        blocking(move || {
            match fs::symlink_metadata(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(Error::NotFound(format!(
                        "volume_path {} does not exist",
                        path.display()
                    )))
                }
                Err(e) if !is_dead_mount(&e) => return Err(Error::io("inspecting", &path)(e)),
                _ => {}
            }
            if let Some(message) = abnormal_condition(&volume_id, &path, &backend)? {
                return Ok(NodeGetVolumeStatsResponse {
                    usage: Vec::new(),
                    volume_condition: Some(VolumeCondition {
                        abnormal: true,
                        message,
                    }),
                });
            }
            Ok(NodeGetVolumeStatsResponse {
                usage: usage_of(&path, &backend)?,
                volume_condition: Some(VolumeCondition {
                    abnormal: false,
                    message: format!("volume {volume_id} is mounted at {}", path.display()),
                }),
            })
        })
        .await
    }

    async fn expand(
        &self,
        req: NodeExpandVolumeRequest,
    ) -> Result<NodeExpandVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let path = PathBuf::from(require(&req.volume_path, "volume_path")?);
        let (required, _) = capability::range_bounds(req.capacity_range.as_ref())?;
        let block = match req.volume_capability.as_ref() {
            Some(cap) => capability::check(Some(cap), "volume_capability")?.block,
            None => false,
        };
        let _guard = self.begin("NodeExpandVolume", &volume_id).await?;
        if !path.is_absolute() {
            return Err(Error::NotFound(format!(
                "volume_path {} is not an absolute path: no volume is there",
                path.display()
            )));
        }
        let record = self.lookup(&volume_id).await?;
        let backend = self.backend(&record);
        let id = volume_id.clone();
        let capacity = blocking(move || {
            if !path.exists() {
                return Err(Error::NotFound(format!(
                    "volume_path {} does not exist",
                    path.display()
                )));
            }
            let Backend::Image(image) = backend else {
                // A directory has no size of its own to grow on the node.
                return Ok(record.capacity_bytes);
            };
            let dev = image::find_loop(&image)?.ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "volume {id} is not staged on this node: there is no loop device to expand"
                ))
            })?;
            image::refresh_loop(&dev)?;
            let rdev = image::device_number(&dev)?;
            // A read-only mount (readers only) cannot be grown; the
            // filesystem grows at the next writable stage.
            let mounted = mount::mounts_of_device(rdev)?
                .iter()
                .any(|m| m.fs_type == image::FS_TYPE && !m.is_read_only());
            // A block volume's content belongs to the workload; only a
            // mounted ext4 is grown here (online).
            if mounted && !block {
                image::resize_fs(&dev)?;
            }
            let size = image::device_size(&dev)?;
            let size = i64::try_from(size).unwrap_or(i64::MAX);
            if required > size {
                return Err(Error::OutOfRange(format!(
                    "volume {id} has {size} bytes, less than the {required} bytes asked for: \
                     expand it through the controller first"
                )));
            }
            Ok(size)
        })
        .await?;
        tracing::info!(%volume_id, capacity_bytes = capacity, "expanded volume on the node");
        Ok(NodeExpandVolumeResponse {
            capacity_bytes: capacity,
        })
    }
}

/// Whether an I/O error says the path is a mount whose filesystem is gone.
fn is_dead_mount(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOTCONN) | Some(libc::ESTALE) | Some(libc::EIO)
    )
}

/// Why the volume at `path` is not healthy, or `None` when it is a live
/// mount of the volume.
fn abnormal_condition(
    volume_id: &str,
    path: &Path,
    backend: &Backend,
) -> Result<Option<String>, Error> {
    match backend {
        Backend::Directory(dir) if !dir.is_dir() => {
            return Ok(Some(format!(
                "the data directory {} of volume {volume_id} is missing",
                dir.display()
            )))
        }
        Backend::Image(image) if !image.is_file() => {
            return Ok(Some(format!(
                "the image {} of volume {volume_id} is missing",
                image.display()
            )))
        }
        Backend::Image(image) if image::find_loop(image)?.is_none() => {
            return Ok(Some(format!(
                "volume {volume_id} is not attached to a loop device on this node"
            )))
        }
        _ => {}
    }
    if let Err(e) = fs::metadata(path) {
        if is_dead_mount(&e) {
            return Ok(Some(format!("{} is not a live mount: {e}", path.display())));
        }
        return Err(Error::io("inspecting", path)(e));
    }
    let mut mounted_at = path.to_owned();
    if mount::mount_at(path)?.is_none() {
        // A block staging: the device is bound inside.
        let device = path.join(STAGED_DEVICE);
        if matches!(backend, Backend::Image(_)) && mount::mount_at(&device)?.is_some() {
            mounted_at = device;
        } else {
            return Ok(Some(format!("{} is no longer mounted", path.display())));
        }
    }
    if !holds_volume(&mounted_at, backend)? {
        return Ok(Some(format!(
            "{} holds another mount, not volume {volume_id}",
            mounted_at.display()
        )));
    }
    Ok(None)
}

/// Bytes and inodes of the filesystem at `path`; bytes only for a device.
fn usage_of(path: &Path, backend: &Backend) -> Result<Vec<VolumeUsage>, Error> {
    let device = if matches!(backend, Backend::Image(_)) && mount::mount_at(path)?.is_none() {
        path.join(STAGED_DEVICE)
    } else {
        path.to_owned()
    };
    let meta = fs::metadata(&device).map_err(Error::io("inspecting", &device))?;
    if meta.file_type().is_block_device() {
        return Ok(vec![VolumeUsage {
            available: 0,
            used: 0,
            total: to_i64(image::device_size(&device)?),
            unit: Unit::Bytes as i32,
        }]);
    }
    let st = statvfs(path).map_err(Error::sys("statvfs", path))?;
    let frsize = wide(st.fragment_size());
    let bytes = |blocks: u64| to_i64(blocks.saturating_mul(frsize));
    let (blocks, bfree, bavail) = (
        wide(st.blocks()),
        wide(st.blocks_free()),
        wide(st.blocks_available()),
    );
    let (files, ffree) = (wide(st.files()), wide(st.files_free()));
    Ok(vec![
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
    ])
}

/// Whether the mount at `path` is of the volume: the volume directory (or
/// its bind), the image's filesystem, or the image's loop device node.
fn holds_volume(path: &Path, backend: &Backend) -> Result<bool, Error> {
    match backend {
        Backend::Directory(dir) => mount::same_file(path, dir),
        Backend::Image(image) => {
            let meta = fs::metadata(path).map_err(Error::io("inspecting", path))?;
            let here = if meta.file_type().is_block_device() {
                meta.rdev()
            } else {
                meta.dev()
            };
            for dev in image::loops_of(image)? {
                if image::device_number(&dev.path)? == here {
                    return Ok(true);
                }
            }
            Ok(false)
        }
    }
}

/// Unmounts the volume's mount at `path`, if there is one; refuses a mount
/// of something else. Returns whether something was unmounted.
fn unmount_checked(
    volume_id: &str,
    path: &Path,
    backend: &Backend,
    field: &'static str,
) -> Result<bool, Error> {
    if mount::mount_at(path)?.is_none() {
        return Ok(false);
    }
    let ours = match backend {
        // When the volume directory is already gone there is nothing to
        // compare.
        Backend::Directory(dir) if !dir.exists() => true,
        _ => match fs::metadata(path) {
            // A dead mount at the CO's path holds nothing any more.
            Err(e) if is_dead_mount(&e) => true,
            _ => holds_volume(path, backend)?,
        },
    };
    if !ours {
        return Err(Error::invalid(
            field,
            format!("{} is not a mount of volume {volume_id}", path.display()),
        ));
    }
    mount::unmount_all(path)?;
    Ok(true)
}

/// Detaches the image's read-only loop devices (and, on `unstage`, its
/// read-write one) that nothing on the node mounts any more; a device
/// still mounted elsewhere (another staging or publish) is kept.
fn detach_unused(volume_id: &str, image: &Path, unstage: bool) -> Result<(), Error> {
    for dev in image::loops_of(image)? {
        if !(unstage || dev.read_only) {
            continue;
        }
        let rdev = image::device_number(&dev.path)?;
        let users = mount::mounts_of_device(rdev)?;
        if users.is_empty() {
            image::detach_device(image, &dev.path)?;
            tracing::info!(volume_id, device = %dev.path.display(), "detached loop device");
        } else {
            tracing::info!(volume_id, device = %dev.path.display(), mounts = users.len(), "loop device still mounted elsewhere; kept");
        }
    }
    Ok(())
}

/// Attaches the image (or finds its loop device) and mounts its filesystem
/// at `staging`, or binds the device at `<staging>/device` for block
/// access. A loop device attached here is detached again on failure.
/// Returns false when already staged.
fn stage_image(
    volume_id: &str,
    image: &Path,
    staging: &Path,
    cap: &Checked,
) -> Result<bool, Error> {
    let attached_before = image::find_loop(image)?.is_some();
    // The image may have grown while it was not staged: grow its
    // filesystem now, offline. Only for a writable staging, which the CO
    // gives one node at a time: a reader-only volume may be mounted on
    // other nodes sharing the state directory.
    let writable_fs = !cap.block && !cap.is_reader_only() && !cap.ro_flag;
    if !attached_before && writable_fs && image::grow_filesystem_offline(image)? {
        tracing::info!(volume_id, image = %image.display(), "grew the filesystem to the image's size");
    }
    let dev = image::attach(image)?;
    let staged = (|| {
        fs::create_dir_all(staging).map_err(Error::io("creating", staging))?;
        if cap.block {
            return bind_device(
                volume_id,
                &dev,
                &staging.join(STAGED_DEVICE),
                false,
                "staged",
            );
        }
        let rdev = image::device_number(&dev)?;
        // The filesystem's mounts on this node share one superblock, which
        // is read-only or writable for all of them.
        let mounted: Vec<_> = mount::mounts_of_device(rdev)?
            .into_iter()
            .filter(|m| m.fs_type == image::FS_TYPE)
            .collect();
        let sb_read_only = !mounted.is_empty() && mounted.iter().all(|m| m.is_read_only());
        // A reader-only staging mounts a filesystem no one mounts here
        // read-only: other nodes sharing the state directory may mount the
        // image too, and ext4 must not be mounted writable twice. Where a
        // writer has it mounted here, the reader shares that mount's
        // superblock (its publish binds are read-only).
        let read_only =
            cap.ro_flag || (cap.is_reader_only() && (mounted.is_empty() || sb_read_only));
        if let Some(existing) = mount::mount_at(staging)? {
            let here = fs::metadata(staging)
                .map_err(Error::io("inspecting", staging))?
                .dev();
            if here == rdev && (existing.is_read_only() == read_only || cap.is_reader_only()) {
                return Ok(false);
            }
            return Err(Error::AlreadyExists(format!(
                "{} already has a different mount (volume {volume_id} staged there with \
                 other options, or another volume)",
                staging.display()
            )));
        }
        let mut flags = cap.mount_flags.clone();
        if (read_only || sb_read_only) && !flags.iter().any(|f| f == "ro") {
            flags.push("ro".to_owned());
        }
        mount::mount_device(&dev, staging, image::FS_TYPE, &flags)?;
        if !read_only && sb_read_only {
            // Readers mounted it here first: the writer's own mount makes
            // the filesystem writable; the readers' mounts stay read-only.
            if let Err(e) = mount::remount_writable(staging, &cap.mount_flags) {
                let _ = mount::unmount_all(staging);
                return Err(e);
            }
            tracing::info!(volume_id, device = %dev.display(), "made the read-only filesystem writable for a writer");
        }
        Ok(true)
    })();
    if staged.is_err() && !attached_before {
        if let Err(e) = image::detach(image) {
            tracing::error!(volume_id, device = %dev.display(), error = %e, "could not detach loop device after a failed stage");
        }
    }
    staged
}

/// Binds device node `dev` onto the file `target` (made when missing),
/// read-only when asked. Returns false when the same device is already
/// bound there.
fn bind_device(
    volume_id: &str,
    dev: &Path,
    target: &Path,
    read_only: bool,
    what: &str,
) -> Result<bool, Error> {
    let rdev = image::device_number(dev)?;
    if let Some(existing) = mount::mount_at(target)? {
        let meta = fs::metadata(target).map_err(Error::io("inspecting", target))?;
        if meta.file_type().is_block_device()
            && meta.rdev() == rdev
            && existing.is_read_only() == read_only
        {
            return Ok(false);
        }
        return Err(Error::AlreadyExists(format!(
            "{} already has a different mount (volume {volume_id} {what} there with other \
             options, or another volume)",
            target.display()
        )));
    }
    mount::make_mount_file(target)?;
    bind(dev, target, read_only)?;
    Ok(true)
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
    bind(source, target, read_only)?;
    Ok(true)
}

/// Bind-mounts `source` at `target`, read-only when asked; never leaves a
/// writable mount behind a read-only request.
fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), Error> {
    mount::bind_mount(source, target)?;
    if read_only {
        if let Err(e) = mount::remount_read_only(target) {
            if let Err(undo) = mount::unmount_all(target) {
                tracing::error!(target = %target.display(), error = %undo, "could not undo bind mount");
            }
            return Err(e);
        }
    }
    Ok(())
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
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("NodeExpandVolume", |p| async move { p.expand(req).await })
            .await
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        self.call("NodeGetCapabilities", |p| async move {
            p.inject("NodeGetCapabilities").await?;
            let capabilities = [
                rpc::Type::StageUnstageVolume,
                rpc::Type::GetVolumeStats,
                rpc::Type::VolumeCondition,
                rpc::Type::ExpandVolume,
            ]
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::ffi::OsString;

    use berth_proto::csi::v1::volume_capability::access_mode::Mode;
    use berth_proto::csi::v1::volume_capability::{
        AccessMode, AccessType, BlockVolume, MountVolume,
    };
    use nix::mount::{umount2, MntFlags};
    use tonic::Code;

    use super::*;
    use berth_proto::csi::v1::controller_server::Controller;

    use crate::config::{parse_args, Command};

    /// A plugin on a temporary state directory; unmounts (and detaches)
    /// whatever its test left below the directory when dropped.
    struct Fixture {
        plugin: Plugin,
        root: PathBuf,
        _dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let root = fs::canonicalize(dir.path()).unwrap();
            let args = [
                "--endpoint".to_owned(),
                format!("unix://{}/csi.sock", root.display()),
                format!("--state-dir={}/state", root.display()),
                "--node-id=node-1".to_owned(),
            ];
            let Command::Run(config) =
                parse_args(args.map(OsString::from), None, || Ok("host".into())).unwrap()
            else {
                panic!("not a run command");
            };
            Fixture {
                plugin: Plugin::new(&config).unwrap(),
                root,
                _dir: dir,
            }
        }

        async fn create(&self, name: &str, params: &[(&str, &str)]) -> String {
            self.plugin
                .create_volume(Request::new(CreateVolumeRequest {
                    name: name.into(),
                    capacity_range: Some(CapacityRange {
                        required_bytes: 16 << 20,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
                    parameters: params
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    ..Default::default()
                }))
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap()
                .volume_id
        }

        /// A fixture where loop devices can be used; `None`, and why not
        /// printed, where they cannot.
        fn with_loop_devices() -> Option<Self> {
            match image::check_loop_support() {
                Ok(()) => Some(Self::new()),
                Err(e) => {
                    eprintln!("skipping: {e}");
                    None
                }
            }
        }

        /// Creates an image-backed volume: its ID and the path of its image.
        async fn create_image(&self, name: &str) -> (String, PathBuf) {
            let id = self.create(name, &[("backing", "image")]).await;
            let img = image::image_path(self.plugin.state_dir(), &id);
            (id, img)
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.root.join(rel)
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let table = mount::read_mountinfo().unwrap_or_default();
            let mut mine: Vec<_> = table
                .iter()
                .filter(|m| m.mount_point.starts_with(&self.root))
                .map(|m| m.mount_point.clone())
                .collect();
            mine.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for m in mine {
                let _ = umount2(&m, MntFlags::MNT_DETACH);
            }
            if let Ok(images) = fs::read_dir(self.root.join("state").join(image::IMAGES_DIR)) {
                for img in images.flatten() {
                    let _ = image::detach(&img.path());
                }
            }
        }
    }

    fn mount_cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    fn block_cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(AccessType::Block(BlockVolume {})),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    fn stage_req(id: &str, staging: &Path, cap: VolumeCapability) -> NodeStageVolumeRequest {
        NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap),
            publish_context: HashMap::new(),
            ..Default::default()
        }
    }

    fn publish_req(
        id: &str,
        target: &Path,
        staging: &Path,
        cap: VolumeCapability,
    ) -> NodePublishVolumeRequest {
        NodePublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.display().to_string(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap),
            ..Default::default()
        }
    }

    fn unpublish_req(id: &str, target: &Path) -> NodeUnpublishVolumeRequest {
        NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.display().to_string(),
        }
    }

    fn unstage_req(id: &str, staging: &Path) -> NodeUnstageVolumeRequest {
        NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
        }
    }

    fn expand_req(id: &str, path: &Path, required_bytes: i64) -> NodeExpandVolumeRequest {
        NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes,
                limit_bytes: 0,
            }),
            ..Default::default()
        }
    }

    fn stats_req(id: &str, path: &str) -> NodeGetVolumeStatsRequest {
        NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            staging_target_path: String::new(),
        }
    }

    fn code<T>(r: Result<T, Error>) -> Code {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.code(),
        }
    }

    #[tokio::test]
    async fn stats_answer_not_found_and_invalid_argument_as_the_spec_says() {
        let f = Fixture::new();
        let p = &f.plugin;
        let id = f.create("v", &[]).await;
        assert_eq!(
            code(p.volume_stats(stats_req("", "/x")).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(p.volume_stats(stats_req(&id, "")).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(p.volume_stats(stats_req(&id, "some/path")).await),
            Code::NotFound,
            "a relative path holds no volume"
        );
        let missing = f.path("nowhere");
        assert_eq!(
            code(
                p.volume_stats(stats_req(&id, &missing.display().to_string()))
                    .await
            ),
            Code::NotFound
        );
        let unknown = crate::state::volume_id_for("unknown");
        assert_eq!(
            code(p.volume_stats(stats_req(&unknown, "/")).await),
            Code::NotFound
        );
        assert_eq!(
            code(p.volume_stats(stats_req("../etc", "/")).await),
            Code::NotFound
        );
    }

    #[tokio::test]
    async fn stats_report_usage_and_condition_of_a_directory_volume() {
        let f = Fixture::new();
        let p = &f.plugin;
        let id = f.create("v", &[]).await;
        let staging = f.path("staging");
        p.stage(stage_req(&id, &staging, mount_cap(Mode::SingleNodeWriter)))
            .await
            .unwrap();
        let shown = staging.display().to_string();
        let live = p.volume_stats(stats_req(&id, &shown)).await.unwrap();
        let condition = live.volume_condition.unwrap();
        assert!(!condition.abnormal, "{}", condition.message);
        let bytes = live
            .usage
            .iter()
            .find(|u| u.unit == Unit::Bytes as i32)
            .unwrap();
        assert!(bytes.total > 0 && bytes.available <= bytes.total);
        assert!(live.usage.iter().any(|u| u.unit == Unit::Inodes as i32));

        // The mount vanishes under the CO: abnormal, not an error.
        mount::unmount_all(&staging).unwrap();
        let gone = p.volume_stats(stats_req(&id, &shown)).await.unwrap();
        let condition = gone.volume_condition.unwrap();
        assert!(condition.abnormal);
        assert!(
            condition.message.contains("no longer mounted"),
            "{}",
            condition.message
        );

        // Mounted again, but the data directory is removed behind it.
        p.stage(stage_req(&id, &staging, mount_cap(Mode::SingleNodeWriter)))
            .await
            .unwrap();
        let dir = p.volume_dir(&id);
        fs::rename(&dir, f.path("moved")).unwrap();
        let condition = p
            .volume_stats(stats_req(&id, &shown))
            .await
            .unwrap()
            .volume_condition
            .unwrap();
        assert!(condition.abnormal);
        assert!(
            condition.message.contains("data directory"),
            "{}",
            condition.message
        );
    }

    #[tokio::test]
    async fn directory_volumes_refuse_block_access() {
        let f = Fixture::new();
        let id = f.create("v", &[]).await;
        let err = f
            .plugin
            .stage(stage_req(
                &id,
                &f.path("s"),
                block_cap(Mode::SingleNodeWriter),
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.to_string().contains("image-backed"), "{err}");
        assert!(mount::mount_at(&f.path("s")).unwrap().is_none());
    }

    #[tokio::test]
    async fn expand_checks_its_arguments() {
        let f = Fixture::new();
        let p = &f.plugin;
        let id = f.create("v", &[]).await;
        let expand = |id: &str, path: &str| NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        };
        assert_eq!(
            code(p.expand(expand("", "/x")).await),
            Code::InvalidArgument
        );
        assert_eq!(code(p.expand(expand(&id, "")).await), Code::InvalidArgument);
        assert_eq!(
            code(
                p.expand(expand(&crate::state::volume_id_for("no"), "/"))
                    .await
            ),
            Code::NotFound
        );
        assert_eq!(
            code(
                p.expand(expand(&id, &f.path("nowhere").display().to_string()))
                    .await
            ),
            Code::NotFound
        );
        assert_eq!(code(p.expand(expand(&id, "rel")).await), Code::NotFound);
        // A directory volume has nothing to grow on the node.
        let dir = f.path("d");
        fs::create_dir(&dir).unwrap();
        let grown = p
            .expand(expand(&id, &dir.display().to_string()))
            .await
            .unwrap();
        assert_eq!(grown.capacity_bytes, 16 << 20);
    }

    #[tokio::test]
    async fn node_rpcs_check_required_fields() {
        let f = Fixture::new();
        let p = &f.plugin;
        let id = f.create("v", &[]).await;
        let s = f.path("s").display().to_string();
        let mut no_cap = stage_req(&id, Path::new(&s), mount_cap(Mode::SingleNodeWriter));
        no_cap.volume_capability = None;
        assert_eq!(code(p.stage(no_cap).await), Code::InvalidArgument);
        let unknown = crate::state::volume_id_for("unknown");
        assert_eq!(
            code(
                p.stage(stage_req(
                    &unknown,
                    Path::new(&s),
                    mount_cap(Mode::SingleNodeWriter)
                ))
                .await
            ),
            Code::NotFound
        );
        assert_eq!(
            code(p.unstage(unstage_req(&id, Path::new(""))).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(p.unpublish(unpublish_req("", Path::new(&s))).await),
            Code::InvalidArgument
        );
        let publish = publish_req(
            &id,
            &f.path("t"),
            Path::new(&s),
            mount_cap(Mode::SingleNodeWriter),
        );
        assert_eq!(
            code(p.publish(publish.clone()).await),
            Code::FailedPrecondition,
            "not staged"
        );
        let mut no_staging = publish.clone();
        no_staging.staging_target_path.clear();
        assert_eq!(code(p.publish(no_staging).await), Code::FailedPrecondition);
        let mut unknown_pub = publish;
        unknown_pub.volume_id = unknown;
        assert_eq!(code(p.publish(unknown_pub).await), Code::NotFound);
    }

    #[tokio::test]
    async fn image_volume_stages_publishes_and_reports_its_own_filesystem() {
        let Some(f) = Fixture::with_loop_devices() else {
            return;
        };
        let p = &f.plugin;
        let (id, img) = f.create_image("img").await;
        assert_eq!(fs::metadata(&img).unwrap().len(), 16 << 20);
        let staging = f.path("staging");
        let cap = VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec!["noatime".into()],
                volume_mount_group: String::new(),
            })),
            ..mount_cap(Mode::SingleNodeWriter)
        };
        for _ in 0..2 {
            p.stage(stage_req(&id, &staging, cap.clone()))
                .await
                .unwrap();
        }
        let entry = mount::mount_at(&staging).unwrap().unwrap();
        assert_eq!(entry.fs_type, "ext4");
        assert!(entry.options.iter().any(|o| o == "noatime"), "{entry:?}");
        let dev = image::find_loop(&img).unwrap().expect("attached");

        let target = f.path("target");
        let publish = NodePublishVolumeRequest {
            readonly: true,
            ..publish_req(&id, &target, &staging, cap.clone())
        };
        p.publish(publish.clone()).await.unwrap();
        fs::write(staging.join("a"), b"data").unwrap();
        assert_eq!(fs::read(target.join("a")).unwrap(), b"data");
        assert!(
            fs::write(target.join("b"), b"x").is_err(),
            "read-only publish"
        );

        let stats = p
            .volume_stats(stats_req(&id, &target.display().to_string()))
            .await
            .unwrap();
        assert!(!stats.volume_condition.unwrap().abnormal);
        let bytes = stats
            .usage
            .iter()
            .find(|u| u.unit == Unit::Bytes as i32)
            .unwrap();
        assert!(
            bytes.total > 8 << 20 && bytes.total <= 16 << 20,
            "the image's own filesystem: {bytes:?}"
        );

        // A mount of something else at the target is not this volume.
        p.unpublish(unpublish_req(&id, &target)).await.unwrap();
        assert!(!target.exists());
        fs::create_dir(&target).unwrap();
        mount::bind_mount(&f.root, &target).unwrap();
        let condition = p
            .volume_stats(stats_req(&id, &target.display().to_string()))
            .await
            .unwrap()
            .volume_condition
            .unwrap();
        assert!(condition.abnormal && condition.message.contains("another mount"));
        mount::unmount_all(&target).unwrap();

        for _ in 0..2 {
            p.unstage(unstage_req(&id, &staging)).await.unwrap();
        }
        assert!(!staging.exists());
        assert_eq!(
            image::find_loop(&img).unwrap(),
            None,
            "{} detached",
            dev.display()
        );
        p.delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        }))
        .await
        .unwrap();
        assert!(!img.exists());
    }

    #[tokio::test]
    async fn block_volume_is_a_device_file_at_the_target() {
        let Some(f) = Fixture::with_loop_devices() else {
            return;
        };
        let p = &f.plugin;
        let (id, img) = f.create_image("blk").await;
        let staging = f.path("staging");
        p.stage(stage_req(&id, &staging, block_cap(Mode::SingleNodeWriter)))
            .await
            .unwrap();
        assert!(
            mount::mount_at(&staging).unwrap().is_none(),
            "no filesystem mount"
        );
        let target = f.path("pods/p1/dev");
        let publish = publish_req(&id, &target, &staging, block_cap(Mode::SingleNodeWriter));
        for _ in 0..2 {
            p.publish(publish.clone()).await.unwrap();
        }
        let meta = fs::metadata(&target).unwrap();
        assert!(meta.file_type().is_block_device());
        assert_eq!(image::device_size(&target).unwrap(), 16 << 20);
        // The same target read-only clashes.
        let mut ro = publish.clone();
        ro.readonly = true;
        assert_eq!(code(p.publish(ro.clone()).await), Code::AlreadyExists);
        // Read-only elsewhere: a read-only loop device, which refuses writes.
        let ro_target = f.path("pods/p2/dev");
        ro.target_path = ro_target.display().to_string();
        for _ in 0..2 {
            p.publish(ro.clone()).await.unwrap();
        }
        let written = fs::OpenOptions::new()
            .write(true)
            .open(&ro_target)
            .and_then(|mut dev| std::io::Write::write_all(&mut dev, b"x"));
        let err = written.expect_err("a read-only block publish refuses writes");
        assert!(
            matches!(
                err.raw_os_error(),
                Some(libc::EPERM | libc::EROFS | libc::EACCES)
            ),
            "{err}"
        );
        assert_eq!(image::loops_of(&img).unwrap().len(), 2);
        p.unpublish(unpublish_req(&id, &ro_target)).await.unwrap();
        assert_eq!(
            image::loops_of(&img).unwrap().len(),
            1,
            "the read-only device goes with its last publish"
        );

        let stats = p
            .volume_stats(stats_req(&id, &target.display().to_string()))
            .await
            .unwrap();
        assert!(!stats.volume_condition.unwrap().abnormal);
        assert_eq!(stats.usage[0].total, 16 << 20);

        // Unstaging while published keeps the device: it is still in use.
        p.unpublish(unpublish_req(&id, &target)).await.unwrap();
        assert!(!target.exists(), "the device file is removed");
        p.unstage(unstage_req(&id, &staging)).await.unwrap();
        assert!(!staging.exists());
        assert_eq!(image::find_loop(&img).unwrap(), None);
    }

    #[tokio::test]
    async fn a_reader_stages_an_image_read_only_and_a_writer_after_it_makes_it_writable() {
        let Some(f) = Fixture::with_loop_devices() else {
            return;
        };
        let p = &f.plugin;
        let (id, img) = f.create_image("shared").await;
        let unstage = |staging: &Path| unstage_req(&id, staging);

        // A reader alone: ext4 is mounted read-only (other nodes sharing
        // the state directory may mount it as well).
        let reader = f.path("staging-reader");
        let reader_cap = mount_cap(Mode::MultiNodeReaderOnly);
        for _ in 0..2 {
            p.stage(stage_req(&id, &reader, reader_cap.clone()))
                .await
                .unwrap();
        }
        assert!(mount::mount_at(&reader).unwrap().unwrap().is_read_only());
        assert!(fs::write(reader.join("x"), b"x").is_err(), "read-only");
        let target = f.path("target-reader");
        p.publish(NodePublishVolumeRequest {
            readonly: true,
            ..publish_req(&id, &target, &reader, reader_cap.clone())
        })
        .await
        .unwrap();

        // A writer on the same node then: the filesystem becomes writable
        // for it; the reader's mounts stay read-only.
        let writer = f.path("staging-writer");
        p.stage(stage_req(&id, &writer, mount_cap(Mode::SingleNodeWriter)))
            .await
            .unwrap();
        assert!(!mount::mount_at(&writer).unwrap().unwrap().is_read_only());
        fs::write(writer.join("written"), b"by the writer").unwrap();
        assert_eq!(fs::read(reader.join("written")).unwrap(), b"by the writer");
        assert_eq!(fs::read(target.join("written")).unwrap(), b"by the writer");
        for ro in [&reader, &target] {
            assert!(mount::mount_at(ro).unwrap().unwrap().is_read_only());
            assert!(fs::write(ro.join("x"), b"x").is_err(), "{}", ro.display());
        }
        p.unpublish(unpublish_req(&id, &target)).await.unwrap();
        // A reader staged while the writer has it shares its filesystem.
        let reader2 = f.path("staging-reader-2");
        p.stage(stage_req(&id, &reader2, reader_cap.clone()))
            .await
            .unwrap();
        assert_eq!(fs::read(reader2.join("written")).unwrap(), b"by the writer");

        for staging in [&reader, &writer, &reader2] {
            p.unstage(unstage(staging)).await.unwrap();
        }
        assert_eq!(image::find_loop(&img).unwrap(), None, "detached");
    }

    #[tokio::test]
    async fn image_volume_expands_online() {
        let Some(f) = Fixture::with_loop_devices() else {
            return;
        };
        let p = &f.plugin;
        let (id, img) = f.create_image("grow").await;
        let staging = f.path("staging");
        p.stage(stage_req(&id, &staging, mount_cap(Mode::SingleNodeWriter)))
            .await
            .unwrap();
        let fs_bytes = |path: &Path| {
            let st = statvfs(path).unwrap();
            wide(st.blocks()) * wide(st.fragment_size())
        };
        let before = fs_bytes(&staging);
        image::grow_image(&img, 32 << 20).unwrap();
        match p.expand(expand_req(&id, &staging, 32 << 20)).await {
            Ok(grown) => assert_eq!(grown.capacity_bytes, 32 << 20),
            Err(Error::FailedPrecondition(why)) => {
                // No CAP_SYS_RESOURCE here: the filesystem grows offline at
                // the next stage instead.
                assert!(why.contains("CAP_SYS_RESOURCE"), "{why}");
                assert_eq!(
                    image::device_size(&image::find_loop(&img).unwrap().unwrap()).unwrap(),
                    32 << 20
                );
                p.unstage(unstage_req(&id, &staging)).await.unwrap();
                p.stage(stage_req(&id, &staging, mount_cap(Mode::SingleNodeWriter)))
                    .await
                    .unwrap();
            }
            Err(e) => panic!("{e}"),
        }
        let after = fs_bytes(&staging);
        assert!(after > before + (12 << 20), "{before} -> {after}");
        // More than the image holds is out of range.
        assert_eq!(
            code(p.expand(expand_req(&id, &staging, 64 << 20)).await),
            Code::OutOfRange
        );
        p.unstage(unstage_req(&id, &staging)).await.unwrap();
        assert_eq!(image::find_loop(&img).unwrap(), None);
    }

    #[tokio::test]
    async fn capabilities_include_stats_condition_and_expansion() {
        let f = Fixture::new();
        let caps = f
            .plugin
            .node_get_capabilities(Request::new(NodeGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        let types: Vec<_> = caps
            .iter()
            .filter_map(|c| match c.r#type {
                Some(node_service_capability::Type::Rpc(r)) => Some(r.r#type),
                _ => None,
            })
            .collect();
        for t in [
            rpc::Type::StageUnstageVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::VolumeCondition,
            rpc::Type::ExpandVolume,
        ] {
            assert!(types.contains(&(t as i32)), "{t:?} in {types:?}");
        }
    }
}
