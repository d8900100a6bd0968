//! The CSI Controller service: volumes are directories under
//! `<state-dir>/volumes` (or image files, see [`crate::image`]), placed in
//! the creating instance's topology and optionally filled from a snapshot
//! or another volume; controller publication and capacity are bookkeeping,
//! except that an image file grows with its volume. Snapshots are in
//! [`crate::snapshot`].

mod create;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::ops::Bound;

use berth_proto::csi::v1::controller_server::Controller;
use berth_proto::csi::v1::controller_service_capability::{self, rpc};
use berth_proto::csi::v1::list_volumes_response::{Entry, VolumeStatus};
use berth_proto::csi::v1::validate_volume_capabilities_response::Confirmed;
use berth_proto::csi::v1::*;
use nix::sys::statvfs::statvfs;
use tonic::{Request, Response, Status};

use crate::capability::{self, Rejection};
use crate::error::{require, Error};
use crate::image;
use crate::mount;
use crate::plugin::Plugin;
use crate::state::{self, Backing, ContentSource, Publication, VolumeRecord};

/// The publish_context key naming the node a volume was published to.
pub const PUBLISHED_BY: &str = "published_by";

fn volume_of(record: &VolumeRecord) -> Volume {
    Volume {
        capacity_bytes: record.capacity_bytes,
        volume_id: record.volume_id.clone(),
        accessible_topology: topology_of(&record.topology).into_iter().collect(),
        content_source: record.content_source.as_ref().map(content_source_proto),
        ..Default::default()
    }
}

fn content_source_proto(source: &ContentSource) -> VolumeContentSource {
    use volume_content_source::{SnapshotSource, Type, VolumeSource};
    VolumeContentSource {
        r#type: Some(match source {
            ContentSource::Snapshot(id) => Type::Snapshot(SnapshotSource {
                snapshot_id: id.clone(),
            }),
            ContentSource::Volume(id) => Type::Volume(VolumeSource {
                volume_id: id.clone(),
            }),
        }),
    }
}

/// The condition of a volume as the controller sees it: abnormal when its
/// data (directory or image file) is gone from the state directory.
/// Blocking (a stat).
fn condition_of(state_dir: &std::path::Path, volume: &VolumeRecord) -> VolumeCondition {
    let path = state::volume_data_path(state_dir, volume);
    let present = match volume.backing {
        Backing::Directory => path.is_dir(),
        Backing::Image => path.is_file(),
    };
    if present {
        VolumeCondition {
            abnormal: false,
            message: "volume data is present".to_owned(),
        }
    } else {
        VolumeCondition {
            abnormal: true,
            message: format!(
                "the data of volume {} is missing: {} does not exist",
                volume.volume_id,
                path.display()
            ),
        }
    }
}

/// Widens a statvfs count, whatever its platform type.
fn wide<T: Into<u64>>(n: T) -> u64 {
    n.into()
}

/// from everywhere.
fn topology_of(segments: &BTreeMap<String, String>) -> Option<Topology> {
    (!segments.is_empty()).then(|| Topology {
        segments: segments.clone().into_iter().collect(),
    })
}

impl Plugin {
    pub(crate) async fn delete(
        &self,
        req: DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let _guard = self.begin("DeleteVolume", &volume_id).await?;
        if !state::is_volume_id(&volume_id) {
            // Never one of ours, so there is nothing to delete.
            tracing::info!(%volume_id, "volume does not exist; nothing to delete");
            return Ok(DeleteVolumeResponse {});
        }
        let dir = self.volume_dir(&volume_id);
        let state_dir = self.state_dir().to_owned();
        let id = volume_id.clone();
        // Checked and removed under the state lock, so that no instance
        // publishes the volume in between.
        let record = self
            .store()
            .update(move |s| {
                if let Some(record) = s.volumes.get(&id) {
                    if !record.publications.is_empty() {
                        let nodes: Vec<_> = record.publications.keys().cloned().collect();
                        return Err(Error::FailedPrecondition(format!(
                            "volume {id} is still published to node(s) {}",
                            nodes.join(", ")
                        )));
                    }
                }
                let image = image::image_path(&state_dir, &id);
                if image.exists() {
                    // Attached on this machine: still staged here.
                    if let Some(dev) = image::find_loop(&image)? {
                        return Err(Error::FailedPrecondition(format!(
                            "volume {id} is still attached to {} (staged on this node)",
                            dev.display()
                        )));
                    }
                    image::remove_image(&image)?;
                }
                if dir.exists() {
                    // Mounts on this machine; see the crate docs for mounts
                    // on other nodes sharing the state directory.
                    let mounts = mount::mounts_of(&dir)?;
                    if !mounts.is_empty() {
                        let paths: Vec<_> =
                            mounts.iter().map(|p| p.display().to_string()).collect();
                        return Err(Error::FailedPrecondition(format!(
                            "volume {id} is still mounted at {}",
                            paths.join(", ")
                        )));
                    }
                    match fs::remove_dir_all(&dir) {
                        Err(e) if e.kind() != io::ErrorKind::NotFound => {
                            return Err(Error::io("removing", &dir)(e))
                        }
                        _ => {}
                    }
                }
                Ok(s.volumes.remove(&id))
            })
            .await?;
        match record {
            Some(r) => tracing::info!(%volume_id, name = %r.name, "deleted volume"),
            None => tracing::info!(%volume_id, "volume does not exist; nothing to delete"),
        }
        Ok(DeleteVolumeResponse {})
    }

    async fn controller_publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, Error> {
        if !self.enable_attach() {
            return Err(Error::Unimplemented("ControllerPublishVolume"));
        }
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let node_id = require(&req.node_id, "node_id")?.to_owned();
        let cap = capability::check(req.volume_capability.as_ref(), "volume_capability")?;
        let _guard = self.begin("ControllerPublishVolume", &volume_id).await?;

        let wanted = Publication {
            readonly: req.readonly,
            access_mode: cap.mode.as_str_name().to_owned(),
        };
        let context = HashMap::from([(PUBLISHED_BY.to_owned(), node_id.clone())]);
        let multi_node = cap.mode.as_str_name().starts_with("MULTI_NODE");
        let (id, node) = (volume_id.clone(), node_id.clone());
        // Checked and recorded under the state lock, so that two instances
        // cannot each publish a single-node volume to a different node.
        let fresh = self
            .store()
            .update(move |s| {
                if !s.nodes.contains(&node) {
                    return Err(Error::NotFound(format!(
                        "node {node} does not exist: no instance of this plugin with that node ID \
                         serves this state directory (known nodes: {})",
                        s.nodes.iter().cloned().collect::<Vec<_>>().join(", ")
                    )));
                }
                let node_topology = s.topology_of_node(&node);
                let record = s
                    .volumes
                    .get_mut(&id)
                    .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
                cap.suits(record.backing)
                    .map_err(|reason| Error::invalid("volume_capability", reason))?;
                state::check_accessible(record, &node, &node_topology)?;
                if let Some(current) = record.publications.get(&node) {
                    if *current == wanted {
                        return Ok(false);
                    }
                    return Err(Error::AlreadyExists(format!(
                        "volume {id} is published to node {node} with access mode {} and \
                         readonly={}, incompatible with the request",
                        current.access_mode, current.readonly
                    )));
                }
                if let Some(other) = record.publications.keys().find(|n| **n != node) {
                    if !multi_node {
                        return Err(Error::FailedPrecondition(format!(
                            "volume {id} is published to node {other} and the access mode is \
                             not multi-node"
                        )));
                    }
                }
                record.publications.insert(node, wanted);
                Ok(true)
            })
            .await?;
        if !fresh {
            tracing::info!(%volume_id, %node_id, "volume already published to node");
            return Ok(ControllerPublishVolumeResponse {
                publish_context: context,
            });
        }
        tracing::info!(%volume_id, %node_id, readonly = req.readonly, "published volume to node");
        Ok(ControllerPublishVolumeResponse {
            publish_context: context,
        })
    }

    async fn controller_unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, Error> {
        if !self.enable_attach() {
            return Err(Error::Unimplemented("ControllerUnpublishVolume"));
        }
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let node_id = req.node_id;
        let _guard = self.begin("ControllerUnpublishVolume", &volume_id).await?;
        // An unknown volume or node is regarded as unpublished.
        let (id, node) = (volume_id.clone(), node_id.clone());
        let removed = self
            .store()
            .update(move |s| {
                let Some(record) = s.volumes.get_mut(&id) else {
                    return Ok(0);
                };
                let before = record.publications.len();
                if node.is_empty() {
                    record.publications.clear();
                } else {
                    record.publications.remove(&node);
                }
                Ok(before - record.publications.len())
            })
            .await?;
        let node = if node_id.is_empty() { "*" } else { &node_id };
        if removed > 0 {
            tracing::info!(%volume_id, node, "unpublished volume");
        } else {
            tracing::info!(%volume_id, node, "volume was not published; nothing to do");
        }
        Ok(ControllerUnpublishVolumeResponse {})
    }

    async fn validate_capabilities(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> Result<ValidateVolumeCapabilitiesResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        if req.volume_capabilities.is_empty() {
            return Err(Error::MissingField("volume_capabilities"));
        }
        self.inject("ValidateVolumeCapabilities").await?;
        let record = self.lookup(&volume_id).await?;

        let not_confirmed = |message: String| ValidateVolumeCapabilitiesResponse {
            confirmed: None,
            message,
        };
        for cap in &req.volume_capabilities {
            match capability::classify(cap) {
                Ok(checked) => {
                    if let Err(reason) = checked.suits(record.backing) {
                        return Ok(not_confirmed(reason));
                    }
                }
                Err(Rejection::Malformed(reason)) => {
                    return Err(Error::invalid("volume_capabilities", reason))
                }
                Err(Rejection::Unsupported(reason)) => return Ok(not_confirmed(reason)),
            }
        }
        let parameters: BTreeMap<String, String> = req.parameters.clone().into_iter().collect();
        if !parameters.is_empty() && parameters != record.parameters {
            return Ok(not_confirmed(
                "parameters differ from those the volume was created with".to_owned(),
            ));
        }
        Ok(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        })
    }

    async fn list(&self, req: ListVolumesRequest) -> Result<ListVolumesResponse, Error> {
        self.inject("ListVolumes").await?;
        let max = match req.max_entries {
            n if n < 0 => {
                return Err(Error::invalid("max_entries", "must not be negative"));
            }
            0 => usize::MAX,
            n => n as usize,
        };
        let start = req.starting_token;
        // Tokens are the ID of the first volume of the next page.
        if !start.is_empty() && !state::is_volume_id(&start) {
            return Err(Error::BadToken(start));
        }
        let state_dir = self.state_dir().to_owned();
        let (entries, next_token) = self
            .store()
            .read(move |s| {
                let mut page = s
                    .volumes
                    .range::<str, _>((Bound::Included(start.as_str()), Bound::Unbounded))
                    .map(|(_, v)| v);
                let entries: Vec<Entry> = page
                    .by_ref()
                    .take(max)
                    .map(|v| Entry {
                        volume: Some(volume_of(v)),
                        status: Some(VolumeStatus {
                            published_node_ids: v.publications.keys().cloned().collect(),
                            volume_condition: Some(condition_of(&state_dir, v)),
                        }),
                    })
                    .collect();
                let next = page.next().map(|v| v.volume_id.clone()).unwrap_or_default();
                (entries, next)
            })
            .await?;
        Ok(ListVolumesResponse {
            entries,
            next_token,
        })
    }

    async fn controller_expand(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        let range = req
            .capacity_range
            .as_ref()
            .ok_or(Error::MissingField("capacity_range"))?;
        let (required, limit) = capability::range_bounds(Some(range))?;
        let cap = match req.volume_capability.as_ref() {
            Some(cap) => Some(capability::check(Some(cap), "volume_capability")?),
            None => None,
        };
        let _guard = self.begin("ControllerExpandVolume", &volume_id).await?;
        if !state::is_volume_id(&volume_id) {
            return Err(Error::NotFound(format!(
                "volume {volume_id} does not exist"
            )));
        }
        let state_dir = self.state_dir().to_owned();
        let id = volume_id.clone();
        // Checked and grown under the state lock, so that two expansions
        // through two instances cannot undo each other.
        let (before, after, backing) = self
            .store()
            .update(move |s| {
                let record = s
                    .volumes
                    .get_mut(&id)
                    .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
                if let Some(cap) = &cap {
                    cap.suits(record.backing)
                        .map_err(|reason| Error::invalid("volume_capability", reason))?;
                }
                let before = record.capacity_bytes;
                if limit > 0 && limit < before {
                    return Err(Error::OutOfRange(format!(
                        "volume {id} holds {before} bytes, more than limit_bytes {limit}: \
                         volumes never shrink"
                    )));
                }
                // A smaller request is met by the capacity the volume has.
                let after = before.max(required);
                if after > before {
                    if record.backing == Backing::Image {
                        image::grow_image(&state::volume_data_path(&state_dir, record), after)?;
                    }
                    record.capacity_bytes = after;
                }
                Ok((before, after, record.backing))
            })
            .await?;
        if after > before {
            tracing::info!(%volume_id, before, after, "expanded volume");
        } else {
            tracing::info!(%volume_id, capacity_bytes = after, "volume already has the capacity");
        }
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: after,
            // The filesystem inside an image is grown on the node that
            // stages it. Asked even when this call changed nothing: an
            // earlier call may have grown the image without the node
            // having grown the filesystem yet.
            node_expansion_required: backing == Backing::Image,
        })
    }

    async fn capacity(&self, req: GetCapacityRequest) -> Result<GetCapacityResponse, Error> {
        self.inject("GetCapacity").await?;
        let parameters: BTreeMap<String, String> = req.parameters.into_iter().collect();
        let backing = image::backing_of(&parameters)?;
        let none = GetCapacityResponse {
            available_capacity: 0,
            maximum_volume_size: Some(0),
            minimum_volume_size: None,
        };
        let mut servable = true;
        for cap in &req.volume_capabilities {
            match capability::classify(cap) {
                Ok(checked) => servable &= checked.suits(backing).is_ok(),
                Err(Rejection::Malformed(reason)) => {
                    return Err(Error::invalid("volume_capabilities", reason))
                }
                Err(Rejection::Unsupported(_)) => servable = false,
            }
        }
        if let Some(topology) = &req.accessible_topology {
            let wanted: BTreeMap<String, String> = topology.segments.clone().into_iter().collect();
            // Without --topology every volume is accessible from anywhere.
            if !self.topology().is_empty() && !state::topology_satisfied(self.topology(), &wanted) {
                servable = false;
            }
        }
        if !servable {
            return Ok(none);
        }
        let state_dir = self.state_dir().to_owned();
        let available = crate::plugin::blocking(move || {
            let st = statvfs(&state_dir).map_err(Error::sys("statvfs", &state_dir))?;
            let bytes = wide(st.blocks_available()).saturating_mul(wide(st.fragment_size()));
            Ok(i64::try_from(bytes).unwrap_or(i64::MAX))
        })
        .await?;
        Ok(GetCapacityResponse {
            available_capacity: available,
            // No volume can hold more than the filesystem has free.
            maximum_volume_size: Some(available),
            minimum_volume_size: match capability::minimum_capacity(backing) {
                0 => None,
                minimum => Some(minimum),
            },
        })
    }

    async fn get_volume(
        &self,
        req: ControllerGetVolumeRequest,
    ) -> Result<ControllerGetVolumeResponse, Error> {
        let volume_id = require(&req.volume_id, "volume_id")?.to_owned();
        self.inject("ControllerGetVolume").await?;
        let record = self.lookup(&volume_id).await?;
        let (state_dir, volume) = (self.state_dir().to_owned(), record.clone());
        let condition =
            crate::plugin::blocking(move || Ok(condition_of(&state_dir, &volume))).await?;
        Ok(ControllerGetVolumeResponse {
            volume: Some(volume_of(&record)),
            status: Some(controller_get_volume_response::VolumeStatus {
                published_node_ids: record.publications.keys().cloned().collect(),
                volume_condition: Some(condition),
            }),
        })
    }

    fn controller_capabilities(&self) -> ControllerGetCapabilitiesResponse {
        let mut types = vec![
            rpc::Type::CreateDeleteVolume,
            rpc::Type::ListVolumes,
            rpc::Type::GetCapacity,
            rpc::Type::CreateDeleteSnapshot,
            rpc::Type::ListSnapshots,
            rpc::Type::GetSnapshot,
            rpc::Type::CloneVolume,
            rpc::Type::ExpandVolume,
            rpc::Type::GetVolume,
            rpc::Type::VolumeCondition,
        ];
        if self.enable_attach() {
            types.push(rpc::Type::PublishUnpublishVolume);
            types.push(rpc::Type::ListVolumesPublishedNodes);
        }
        ControllerGetCapabilitiesResponse {
            capabilities: types
                .into_iter()
                .map(|t| ControllerServiceCapability {
                    r#type: Some(controller_service_capability::Type::Rpc(
                        controller_service_capability::Rpc { r#type: t as i32 },
                    )),
                })
                .collect(),
        }
    }
}

/// Answers an RPC this plugin does not implement (after any injected fault).
async fn unimplemented<T>(plugin: &Plugin, rpc: &'static str) -> Result<Response<T>, Status>
where
    T: Send + 'static,
{
    plugin
        .call(rpc, move |p| async move {
            p.inject(rpc).await?;
            Err(Error::Unimplemented(rpc))
        })
        .await
}

#[tonic::async_trait]
impl Controller for Plugin {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("CreateVolume", |p| async move { p.create(req).await })
            .await
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("DeleteVolume", |p| async move { p.delete(req).await })
            .await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("ControllerPublishVolume", |p| async move {
            p.controller_publish(req).await
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("ControllerUnpublishVolume", |p| async move {
            p.controller_unpublish(req).await
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        self.call("ValidateVolumeCapabilities", |p| async move {
            p.validate_capabilities(req).await
        })
        .await
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = request.into_inner();
        self.call("ListVolumes", |p| async move { p.list(req).await })
            .await
    }

    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let req = request.into_inner();
        self.call("GetCapacity", |p| async move { p.capacity(req).await })
            .await
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        self.call("ControllerGetCapabilities", |p| async move {
            p.inject("ControllerGetCapabilities").await?;
            Ok(p.controller_capabilities())
        })
        .await
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "CreateSnapshot",
            |p| async move { p.snapshot_volume(req).await },
        )
        .await
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "DeleteSnapshot",
            |p| async move { p.remove_snapshot(req).await },
        )
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        self.call("ListSnapshots", |p| async move {
            p.list_snapshot_page(req).await
        })
        .await
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        self.call("GetSnapshot", |p| async move { p.find_snapshot(req).await })
            .await
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call("ControllerExpandVolume", |p| async move {
            p.controller_expand(req).await
        })
        .await
    }

    async fn controller_get_volume(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "ControllerGetVolume",
            |p| async move { p.get_volume(req).await },
        )
        .await
    }

    async fn controller_modify_volume(
        &self,
        _request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        unimplemented(self, "ControllerModifyVolume").await
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use berth_proto::csi::v1::volume_capability::access_mode::Mode;
    use berth_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
    use tonic::Code;

    use super::*;
    use crate::config::Config;

    fn plugin(dir: &std::path::Path, enable_attach: bool) -> Plugin {
        Plugin::new(&Config {
            socket_path: dir.join("csi.sock"),
            state_dir: dir.join("state"),
            node_id: "node-1".into(),
            enable_attach,
            ..Default::default()
        })
        .unwrap()
    }

    /// A plugin serving `topology`, on `dir`'s state directory.
    fn zoned_plugin(dir: &std::path::Path, node_id: &str, topology: &[(&str, &str)]) -> Plugin {
        Plugin::new(&Config {
            socket_path: dir.join(format!("{node_id}.sock")),
            state_dir: dir.join("state"),
            node_id: node_id.into(),
            topology: segments(topology),
            ..Default::default()
        })
        .unwrap()
    }

    fn segments(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn requiring(name: &str, requisite: &[&[(&str, &str)]]) -> CreateVolumeRequest {
        CreateVolumeRequest {
            accessibility_requirements: Some(TopologyRequirement {
                requisite: requisite
                    .iter()
                    .map(|t| Topology {
                        segments: segments(t).into_iter().collect(),
                    })
                    .collect(),
                preferred: Vec::new(),
            }),
            ..create(name, 0)
        }
    }

    fn topology_segments(volume: &Volume) -> Vec<BTreeMap<String, String>> {
        volume
            .accessible_topology
            .iter()
            .map(|t| t.segments.clone().into_iter().collect())
            .collect()
    }

    #[tokio::test]
    async fn create_places_the_volume_in_this_instance_topology() {
        let dir = tempfile::tempdir().unwrap();
        const NODE: &str = "topology.hostpath.csi/node";
        let a = zoned_plugin(dir.path(), "node-a", &[(NODE, "node-a"), ("zone", "z1")]);
        let b = zoned_plugin(dir.path(), "node-b", &[(NODE, "node-b"), ("zone", "z1")]);
        let placed_a = segments(&[(NODE, "node-a"), ("zone", "z1")]);

        // No requirement: placed here.
        let v = a.create(create("free", 0)).await.unwrap().volume.unwrap();
        assert_eq!(topology_segments(&v), std::slice::from_ref(&placed_a));

        // One requisite entry of several suffices.
        let v = a
            .create(requiring(
                "zoned",
                &[&[(NODE, "node-x")], &[("zone", "z1")]],
            ))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(topology_segments(&v), std::slice::from_ref(&placed_a));

        // Unsatisfiable here: RESOURCE_EXHAUSTED naming both topologies,
        // and nothing is created.
        let err = a
            .create(requiring("elsewhere", &[&[(NODE, "node-b")]]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        let msg = err.to_string();
        assert!(
            msg.contains("node-b") && msg.contains(&state::describe_topology(&placed_a)),
            "{msg}"
        );
        assert!(a.lookup(&state::volume_id_for("elsewhere")).await.is_err());
        let v = b
            .create(requiring("elsewhere", &[&[(NODE, "node-b")]]))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(
            topology_segments(&v),
            [segments(&[(NODE, "node-b"), ("zone", "z1")])]
        );

        // A repeated create, through either instance, answers the recorded
        // topology; one whose requisite the volume does not meet clashes.
        let again = b
            .create(requiring("zoned", &[&[("zone", "z1")]]))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(topology_segments(&again), std::slice::from_ref(&placed_a));
        assert_eq!(
            code(b.create(requiring("zoned", &[&[(NODE, "node-b")]])).await),
            Code::AlreadyExists
        );

        // ListVolumes carries the topology too.
        let listed = b.list(ListVolumesRequest::default()).await.unwrap();
        let zoned_id = state::volume_id_for("zoned");
        let entry = listed
            .entries
            .iter()
            .find(|e| e.volume.as_ref().unwrap().volume_id == zoned_id)
            .unwrap();
        assert_eq!(
            topology_segments(entry.volume.as_ref().unwrap()),
            [placed_a]
        );
    }

    fn from_source(
        name: &str,
        required: i64,
        limit: i64,
        source: ContentSource,
    ) -> CreateVolumeRequest {
        CreateVolumeRequest {
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            volume_content_source: Some(content_source_proto(&source)),
            ..create(name, 0)
        }
    }

    #[tokio::test]
    async fn create_from_a_snapshot_or_a_volume_copies_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let src = p.create(create("src", 4096)).await.unwrap().volume.unwrap();
        fs::create_dir(p.volume_dir(&src.volume_id).join("sub")).unwrap();
        fs::write(p.volume_dir(&src.volume_id).join("sub/f"), b"snap").unwrap();
        let snap = p
            .snapshot_volume(CreateSnapshotRequest {
                name: "snap".into(),
                source_volume_id: src.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .snapshot
            .unwrap();
        fs::write(p.volume_dir(&src.volume_id).join("sub/f"), b"live").unwrap();

        // From the snapshot: its data, its size when none is asked for.
        let by_snap = ContentSource::Snapshot(snap.snapshot_id.clone());
        let restored = p
            .create(from_source("restored", 0, 0, by_snap.clone()))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(restored.capacity_bytes, 4096);
        assert_eq!(
            restored.content_source,
            Some(content_source_proto(&by_snap))
        );
        let data = |v: &Volume| fs::read(p.volume_dir(&v.volume_id).join("sub/f")).unwrap();
        assert_eq!(data(&restored), b"snap");
        // A repeat answers the same volume; another source clashes.
        let again = p
            .create(from_source("restored", 0, 0, by_snap.clone()))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(again, restored);
        let by_volume = ContentSource::Volume(src.volume_id.clone());
        assert_eq!(
            code(
                p.create(from_source("restored", 0, 0, by_volume.clone()))
                    .await
            ),
            Code::AlreadyExists
        );
        assert_eq!(
            code(p.create(create("restored", 0)).await),
            Code::AlreadyExists
        );

        // A clone: the source volume's data now, at the size asked for.
        let clone = p
            .create(from_source("clone", 8192, 0, by_volume.clone()))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(clone.capacity_bytes, 8192);
        assert_eq!(data(&clone), b"live");
        assert_eq!(clone.content_source, Some(content_source_proto(&by_volume)));
        // Independent of its source.
        fs::write(p.volume_dir(&clone.volume_id).join("sub/f"), b"mine").unwrap();
        assert_eq!(data(&src), b"live");

        // Unknown sources are NOT_FOUND; a source above the limit is
        // OUT_OF_RANGE; an empty source ID is INVALID_ARGUMENT; nothing is
        // made for any of them.
        for (name, source, want) in [
            (
                "n1",
                ContentSource::Snapshot(state::snapshot_id_for("nope")),
                Code::NotFound,
            ),
            (
                "n2",
                ContentSource::Snapshot("garbage".into()),
                Code::NotFound,
            ),
            (
                "n3",
                ContentSource::Volume(state::volume_id_for("nope")),
                Code::NotFound,
            ),
            (
                "n4",
                ContentSource::Volume(String::new()),
                Code::InvalidArgument,
            ),
            (
                "n5",
                ContentSource::Snapshot(String::new()),
                Code::InvalidArgument,
            ),
        ] {
            assert_eq!(
                code(p.create(from_source(name, 0, 0, source)).await),
                want,
                "{name}"
            );
            assert!(!p.volume_dir(&state::volume_id_for(name)).exists());
        }
        assert_eq!(
            code(
                p.create(from_source("small", 0, 1024, by_snap.clone()))
                    .await
            ),
            Code::OutOfRange
        );
        assert!(!p.volume_dir(&state::volume_id_for("small")).exists());
        let mut no_type = create("n6", 0);
        no_type.volume_content_source = Some(VolumeContentSource { r#type: None });
        assert_eq!(code(p.create(no_type).await), Code::InvalidArgument);

        // The snapshot's source can go; what was made from it stays.
        p.delete(DeleteVolumeRequest {
            volume_id: src.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        assert_eq!(data(&restored), b"snap");
        let late = p
            .create(from_source("late", 0, 0, by_snap))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(data(&late), b"snap");
    }

    fn expand_to(volume_id: &str, required: i64, limit: i64) -> ControllerExpandVolumeRequest {
        ControllerExpandVolumeRequest {
            volume_id: volume_id.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn expand_grows_and_never_shrinks() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let v = p.create(create("a", 1000)).await.unwrap().volume.unwrap();
        let id = v.volume_id;

        let grown = p.controller_expand(expand_to(&id, 5000, 0)).await.unwrap();
        assert_eq!(grown.capacity_bytes, 5000);
        assert!(
            !grown.node_expansion_required,
            "a directory needs no node step"
        );
        assert_eq!(p.lookup(&id).await.unwrap().capacity_bytes, 5000);
        // Again, and smaller: the capacity the volume has.
        let same = p.controller_expand(expand_to(&id, 5000, 0)).await.unwrap();
        assert_eq!(same.capacity_bytes, 5000);
        let smaller = p.controller_expand(expand_to(&id, 10, 0)).await.unwrap();
        assert_eq!(smaller.capacity_bytes, 5000);
        assert_eq!(p.lookup(&id).await.unwrap().capacity_bytes, 5000);

        // A limit below what the volume has: OUT_OF_RANGE, nothing changes.
        assert_eq!(
            code(p.controller_expand(expand_to(&id, 0, 4000)).await),
            Code::OutOfRange
        );
        assert_eq!(p.lookup(&id).await.unwrap().capacity_bytes, 5000);
        let within = p
            .controller_expand(expand_to(&id, 6000, 6000))
            .await
            .unwrap();
        assert_eq!(within.capacity_bytes, 6000);

        // A repeated create answers the grown volume.
        let again = p.create(create("a", 1000)).await.unwrap().volume.unwrap();
        assert_eq!(again.capacity_bytes, 6000);

        for (req, want) in [
            (
                expand_to(&state::volume_id_for("nope"), 1, 0),
                Code::NotFound,
            ),
            (expand_to("not-a-volume", 1, 0), Code::NotFound),
            (expand_to("", 1, 0), Code::InvalidArgument),
            (expand_to(&id, -1, 0), Code::InvalidArgument),
            (expand_to(&id, 10, 5), Code::InvalidArgument),
            (
                ControllerExpandVolumeRequest {
                    volume_id: id.clone(),
                    ..Default::default()
                },
                Code::InvalidArgument,
            ),
        ] {
            assert_eq!(
                code(p.controller_expand(req.clone()).await),
                want,
                "{req:?}"
            );
        }
        let block = VolumeCapability {
            access_type: Some(AccessType::Block(Default::default())),
            ..cap(Mode::SingleNodeWriter)
        };
        let mut with_block = expand_to(&id, 7000, 0);
        with_block.volume_capability = Some(block);
        assert_eq!(
            code(p.controller_expand(with_block).await),
            Code::InvalidArgument
        );
    }

    #[tokio::test]
    async fn image_volumes_grow_snapshot_and_clone_as_images() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let image_volume = |name: &str, source: Option<ContentSource>| {
            let mut req = create(name, 8 << 20);
            req.parameters
                .insert(image::BACKING_PARAMETER.into(), "image".into());
            req.volume_content_source = source.as_ref().map(content_source_proto);
            req
        };
        let v = match p.create(image_volume("img", None)).await {
            Ok(r) => r.volume.unwrap(),
            Err(e) if e.code() == Code::FailedPrecondition => {
                eprintln!("skipping: image-backed volumes cannot be made here: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let record = p.lookup(&v.volume_id).await.unwrap();
        let path = state::volume_data_path(p.state_dir(), &record);
        let len = |p: &std::path::Path| fs::metadata(p).unwrap().len();
        assert_eq!(len(&path), 8 << 20);

        // Too small for ext4: made at the minimum, or OUT_OF_RANGE when the
        // limit is below it.
        let mut tiny = image_volume("tiny", None);
        tiny.capacity_range = Some(CapacityRange {
            required_bytes: 4096,
            limit_bytes: 0,
        });
        let made = p.create(tiny.clone()).await.unwrap().volume.unwrap();
        assert_eq!(made.capacity_bytes, capability::MIN_IMAGE_CAPACITY_BYTES);
        tiny.name = "tiny-limited".into();
        tiny.capacity_range = Some(CapacityRange {
            required_bytes: 4096,
            limit_bytes: 65536,
        });
        assert_eq!(code(p.create(tiny).await), Code::OutOfRange);
        assert!(!image::image_path(p.state_dir(), &state::volume_id_for("tiny-limited")).exists());

        let grown = p
            .controller_expand(expand_to(&v.volume_id, 16 << 20, 0))
            .await
            .unwrap();
        assert!(grown.node_expansion_required);
        assert_eq!(grown.capacity_bytes, 16 << 20);
        assert_eq!(len(&path), 16 << 20, "the image file grew");
        // A retry still asks the node to grow the filesystem.
        let retry = p
            .controller_expand(expand_to(&v.volume_id, 16 << 20, 0))
            .await
            .unwrap();
        assert!(retry.node_expansion_required);

        let snap = p
            .snapshot_volume(CreateSnapshotRequest {
                name: "img-snap".into(),
                source_volume_id: v.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .snapshot
            .unwrap();
        let copy = state::snapshot_path(p.state_dir(), &snap.snapshot_id);
        assert!(copy.is_file());
        assert_eq!(fs::read(&copy).unwrap(), fs::read(&path).unwrap());
        let allocated = fs::metadata(&copy).unwrap().blocks() * 512;
        assert!(
            allocated < 16 << 20,
            "the copy is sparse: {allocated} bytes"
        );

        let restored = p
            .create(image_volume(
                "img-restored",
                Some(ContentSource::Snapshot(snap.snapshot_id.clone())),
            ))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert_eq!(restored.capacity_bytes, 16 << 20, "at least the snapshot");
        let restored_path =
            state::volume_data_path(p.state_dir(), &p.lookup(&restored.volume_id).await.unwrap());
        assert_eq!(fs::read(&restored_path).unwrap(), fs::read(&copy).unwrap());

        // A directory volume cannot be filled from an image.
        assert_eq!(
            code(
                p.create(from_source(
                    "dir-from-image",
                    0,
                    0,
                    ContentSource::Snapshot(snap.snapshot_id.clone())
                ))
                .await
            ),
            Code::InvalidArgument
        );
    }

    #[tokio::test]
    async fn capacity_is_the_free_space_of_the_state_directory() {
        let dir = tempfile::tempdir().unwrap();
        let p = zoned_plugin(dir.path(), "node-a", &[("zone", "z1")]);
        let all = p.capacity(GetCapacityRequest::default()).await.unwrap();
        assert!(all.available_capacity > 0, "{all:?}");
        assert_eq!(all.maximum_volume_size, Some(all.available_capacity));
        assert_eq!(all.minimum_volume_size, None);
        let images = p
            .capacity(GetCapacityRequest {
                parameters: [(image::BACKING_PARAMETER.to_owned(), "image".to_owned())].into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(
            images.minimum_volume_size,
            Some(capability::MIN_IMAGE_CAPACITY_BYTES)
        );
        let unknown_backing = GetCapacityRequest {
            parameters: [(image::BACKING_PARAMETER.to_owned(), "tape".to_owned())].into(),
            ..Default::default()
        };
        assert_eq!(
            code(p.capacity(unknown_backing).await),
            Code::InvalidArgument
        );

        let at = |pairs: &[(&str, &str)]| GetCapacityRequest {
            accessible_topology: Some(Topology {
                segments: segments(pairs).into_iter().collect(),
            }),
            ..Default::default()
        };
        let here = p.capacity(at(&[("zone", "z1")])).await.unwrap();
        assert!(here.available_capacity > 0);
        let elsewhere = p.capacity(at(&[("zone", "z2")])).await.unwrap();
        assert_eq!(elsewhere.available_capacity, 0);

        // A capability no volume with these parameters can serve: nothing.
        let block = GetCapacityRequest {
            volume_capabilities: vec![VolumeCapability {
                access_type: Some(AccessType::Block(Default::default())),
                ..cap(Mode::SingleNodeWriter)
            }],
            ..Default::default()
        };
        assert_eq!(p.capacity(block).await.unwrap().available_capacity, 0);
        let malformed = GetCapacityRequest {
            volume_capabilities: vec![VolumeCapability::default()],
            ..Default::default()
        };
        assert_eq!(code(p.capacity(malformed).await), Code::InvalidArgument);

        // Without --topology every topology is served.
        let dir = tempfile::tempdir().unwrap();
        let plain = plugin(dir.path(), false);
        assert!(
            plain
                .capacity(at(&[("zone", "z2")]))
                .await
                .unwrap()
                .available_capacity
                > 0
        );
    }

    #[tokio::test]
    async fn get_volume_reports_condition_and_published_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), true);
        let v = p.create(create("a", 0)).await.unwrap().volume.unwrap();
        let get = |id: &str| ControllerGetVolumeRequest {
            volume_id: id.into(),
        };
        let got = p.get_volume(get(&v.volume_id)).await.unwrap();
        assert_eq!(got.volume.as_ref().unwrap(), &v);
        let status = got.status.unwrap();
        assert!(status.published_node_ids.is_empty());
        assert!(!status.volume_condition.unwrap().abnormal);

        p.controller_publish(ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: "node-1".into(),
            volume_capability: Some(cap(Mode::SingleNodeWriter)),
            ..Default::default()
        })
        .await
        .unwrap();
        fs::remove_dir(p.volume_dir(&v.volume_id)).unwrap();
        let status = p
            .get_volume(get(&v.volume_id))
            .await
            .unwrap()
            .status
            .unwrap();
        assert_eq!(status.published_node_ids, ["node-1"]);
        let condition = status.volume_condition.unwrap();
        assert!(condition.abnormal);
        assert!(
            condition.message.contains("missing"),
            "{}",
            condition.message
        );
        let listed = p.list(ListVolumesRequest::default()).await.unwrap();
        let listed = listed.entries[0].status.as_ref().unwrap();
        assert_eq!(listed.published_node_ids, ["node-1"]);
        assert!(listed.volume_condition.as_ref().unwrap().abnormal);

        assert_eq!(
            code(p.get_volume(get(&state::volume_id_for("nope"))).await),
            Code::NotFound
        );
        assert_eq!(code(p.get_volume(get("x")).await), Code::NotFound);
        assert_eq!(code(p.get_volume(get("")).await), Code::InvalidArgument);
    }

    #[tokio::test]
    async fn without_topology_requirements_are_not_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let v = p
            .create(requiring("any", &[&[("zone", "z9")]]))
            .await
            .unwrap()
            .volume
            .unwrap();
        assert!(v.accessible_topology.is_empty(), "{v:?}");
        assert!(p.accessible_topology().is_none());
    }

    fn cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    fn create(name: &str, required: i64) -> CreateVolumeRequest {
        CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap(Mode::SingleNodeWriter)],
            ..Default::default()
        }
    }

    fn code<T>(r: Result<T, Error>) -> Code {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.code(),
        }
    }

    #[tokio::test]
    async fn create_is_idempotent_and_checks_compatibility() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let v1 = p.create(create("a", 100)).await.unwrap().volume.unwrap();
        assert_eq!(v1.capacity_bytes, 100);
        assert!(p.volume_dir(&v1.volume_id).is_dir());
        let v2 = p.create(create("a", 50)).await.unwrap().volume.unwrap();
        assert_eq!(v1, v2, "a smaller request is satisfied by the volume");
        assert_eq!(code(p.create(create("a", 200)).await), Code::AlreadyExists);
        let mut with_params = create("a", 100);
        with_params.parameters.insert("k".into(), "v".into());
        assert_eq!(code(p.create(with_params).await), Code::AlreadyExists);

        // The volume survives a restart.
        drop(p);
        let p = plugin(dir.path(), false);
        let v3 = p.create(create("a", 100)).await.unwrap().volume.unwrap();
        assert_eq!(v1, v3);
    }

    #[tokio::test]
    async fn create_validates_the_request() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        assert_eq!(code(p.create(create("", 0)).await), Code::InvalidArgument);
        assert_eq!(
            code(p.create(create("bad\u{1}name", 0)).await),
            Code::InvalidArgument
        );
        let mut no_caps = create("a", 0);
        no_caps.volume_capabilities.clear();
        let err = p.create(no_caps).await.unwrap_err();
        assert!(err.to_string().contains("volume_capabilities"), "{err}");
        assert_eq!(code(p.create(create("a", -1)).await), Code::InvalidArgument);
    }

    #[tokio::test]
    async fn delete_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let v = p.create(create("a", 0)).await.unwrap().volume.unwrap();
        let del = || DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        };
        p.delete(del()).await.unwrap();
        assert!(!p.volume_dir(&v.volume_id).exists());
        p.delete(del()).await.unwrap();
        p.delete(DeleteVolumeRequest {
            volume_id: "../../etc".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        assert!(p.store().read(|s| s.volumes.is_empty()).await.unwrap());
    }

    #[tokio::test]
    async fn list_pages_through_every_volume() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let mut want = Vec::new();
        for i in 0..5 {
            let v = p.create(create(&format!("v{i}"), 0)).await.unwrap();
            want.push(v.volume.unwrap().volume_id);
        }
        want.sort();
        let mut seen = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let page = p
                .list(ListVolumesRequest {
                    max_entries: 2,
                    starting_token: token,
                })
                .await
                .unwrap();
            pages += 1;
            assert!(page.entries.len() <= 2);
            seen.extend(page.entries.into_iter().map(|e| {
                let status = e.status.as_ref().expect("a status");
                assert!(status.published_node_ids.is_empty(), "nothing is published");
                assert!(!status.volume_condition.as_ref().unwrap().abnormal);
                e.volume.unwrap().volume_id
            }));
            if page.next_token.is_empty() {
                break;
            }
            token = page.next_token;
        }
        assert_eq!(seen, want);
        assert_eq!(pages, 3);
        let all = p.list(ListVolumesRequest::default()).await.unwrap();
        assert_eq!(all.entries.len(), 5);
        assert!(all.next_token.is_empty());
        assert_eq!(
            code(
                p.list(ListVolumesRequest {
                    max_entries: -1,
                    ..Default::default()
                })
                .await
            ),
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                p.list(ListVolumesRequest {
                    max_entries: 0,
                    starting_token: "garbage".into()
                })
                .await
            ),
            Code::Aborted
        );
    }

    #[tokio::test]
    async fn publish_records_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), true);
        let v = p.create(create("a", 0)).await.unwrap().volume.unwrap();
        let publish = |node: &str, mode: Mode, readonly: bool| ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: node.into(),
            volume_capability: Some(cap(mode)),
            readonly,
            ..Default::default()
        };
        let ctx = p
            .controller_publish(publish("node-1", Mode::SingleNodeWriter, false))
            .await
            .unwrap()
            .publish_context;
        assert_eq!(ctx[PUBLISHED_BY], "node-1");
        p.controller_publish(publish("node-1", Mode::SingleNodeWriter, false))
            .await
            .unwrap();
        assert_eq!(
            code(
                p.controller_publish(publish("node-1", Mode::SingleNodeWriter, true))
                    .await
            ),
            Code::AlreadyExists
        );
        assert_eq!(
            code(
                p.controller_publish(publish("node-2", Mode::SingleNodeWriter, false))
                    .await
            ),
            Code::NotFound
        );
        let mut unknown = publish("node-1", Mode::SingleNodeWriter, false);
        unknown.volume_id = state::volume_id_for("nope");
        assert_eq!(code(p.controller_publish(unknown).await), Code::NotFound);

        // Published volumes are listed with their node, and cannot be deleted.
        let listed = p.list(ListVolumesRequest::default()).await.unwrap();
        assert_eq!(
            listed.entries[0]
                .status
                .as_ref()
                .unwrap()
                .published_node_ids,
            ["node-1"]
        );
        let del = DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        };
        assert_eq!(code(p.delete(del.clone()).await), Code::FailedPrecondition);

        let unpublish = ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: "node-1".into(),
            ..Default::default()
        };
        p.controller_unpublish(unpublish.clone()).await.unwrap();
        p.controller_unpublish(unpublish).await.unwrap();
        p.delete(del).await.unwrap();
    }

    #[tokio::test]
    async fn publish_checks_the_capability_and_the_node_topology() {
        let dir = tempfile::tempdir().unwrap();
        let config = |node: &str, zone: &str| Config {
            socket_path: dir.path().join(format!("{node}.sock")),
            state_dir: dir.path().join("state"),
            node_id: node.into(),
            enable_attach: true,
            topology: segments(&[("zone", zone)]),
            ..Default::default()
        };
        let a = Plugin::new(&config("node-a", "z1")).unwrap();
        let _b = Plugin::new(&config("node-b", "z2")).unwrap();
        let _c = Plugin::new(&config("node-c", "z1")).unwrap();
        let v = a.create(create("a", 0)).await.unwrap().volume.unwrap();
        let publish = |node: &str, cap: VolumeCapability| ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: node.into(),
            volume_capability: Some(cap),
            ..Default::default()
        };
        let block = VolumeCapability {
            access_type: Some(AccessType::Block(Default::default())),
            ..cap(Mode::MultiNodeMultiWriter)
        };
        assert_eq!(
            code(a.controller_publish(publish("node-a", block)).await),
            Code::InvalidArgument
        );
        let err = a
            .controller_publish(publish("node-b", cap(Mode::MultiNodeMultiWriter)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(err.to_string().contains("{zone=z2}"), "{err}");
        a.controller_publish(publish("node-c", cap(Mode::MultiNodeMultiWriter)))
            .await
            .unwrap();
        a.controller_publish(publish("node-a", cap(Mode::MultiNodeMultiWriter)))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn publish_is_unimplemented_without_attach() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        assert_eq!(
            code(
                p.controller_publish(ControllerPublishVolumeRequest::default())
                    .await
            ),
            Code::Unimplemented
        );
        let caps = rpc_types(&p);
        assert!(
            !caps.contains(&rpc::Type::PublishUnpublishVolume),
            "{caps:?}"
        );
        assert!(
            !caps.contains(&rpc::Type::ListVolumesPublishedNodes),
            "{caps:?}"
        );
        let with_attach = plugin(dir.path(), true);
        let caps = rpc_types(&with_attach);
        assert!(
            caps.contains(&rpc::Type::PublishUnpublishVolume),
            "{caps:?}"
        );
    }

    fn rpc_types(p: &Plugin) -> Vec<rpc::Type> {
        p.controller_capabilities()
            .capabilities
            .into_iter()
            .filter_map(|c| match c.r#type {
                Some(controller_service_capability::Type::Rpc(r)) => r.r#type.try_into().ok(),
                None => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn controller_capabilities_cover_what_is_served() {
        let dir = tempfile::tempdir().unwrap();
        let caps = rpc_types(&plugin(dir.path(), false));
        for wanted in [
            rpc::Type::CreateDeleteVolume,
            rpc::Type::ListVolumes,
            rpc::Type::CreateDeleteSnapshot,
            rpc::Type::ListSnapshots,
            rpc::Type::GetSnapshot,
            rpc::Type::CloneVolume,
        ] {
            assert!(caps.contains(&wanted), "{wanted:?} missing from {caps:?}");
        }
    }

    #[tokio::test]
    async fn busy_volume_is_aborted() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let _held = p
            .begin("CreateVolume", &state::volume_id_for("a"))
            .await
            .unwrap();
        assert_eq!(code(p.create(create("a", 0)).await), Code::Aborted);
    }

    #[tokio::test]
    async fn validate_confirms_or_explains() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path(), false);
        let v = p.create(create("a", 0)).await.unwrap().volume.unwrap();
        let ok = p
            .validate_capabilities(ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id.clone(),
                volume_capabilities: vec![cap(Mode::MultiNodeReaderOnly)],
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(ok.confirmed.is_some());
        let block = VolumeCapability {
            access_type: Some(AccessType::Block(Default::default())),
            ..cap(Mode::SingleNodeWriter)
        };
        let no = p
            .validate_capabilities(ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id.clone(),
                volume_capabilities: vec![block],
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(no.confirmed.is_none() && !no.message.is_empty());
        assert_eq!(
            code(
                p.validate_capabilities(ValidateVolumeCapabilitiesRequest {
                    volume_id: state::volume_id_for("other"),
                    volume_capabilities: vec![cap(Mode::SingleNodeWriter)],
                    ..Default::default()
                })
                .await
            ),
            Code::NotFound
        );
    }
}
