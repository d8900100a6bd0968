//! CreateVolume: the request checked, then, under the state lock, an
//! existing volume of the same name confirmed (and its data recreated
//! should it be gone) or a new one placed in this instance's topology and
//! filled from its content source.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use berth_proto::csi::v1::*;

use super::volume_of;
use crate::capability;
use crate::copy;
use crate::error::{require, Error};
use crate::image;
use crate::plugin::Plugin;
use crate::state::{self, Backing, ContentSource, State, VolumeRecord};

impl Plugin {
    pub(crate) async fn create(
        &self,
        req: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, Error> {
        let wanted = WantedVolume::checked(req)?;
        let name = wanted.name.clone();
        let volume_id = state::volume_id_for(&name);
        let _guard = self.begin("CreateVolume", &volume_id).await?;
        tracing::debug!(%name, %volume_id, "creating volume");

        // A new volume is placed in this instance's topology; without
        // --topology it is accessible from everywhere.
        let place = Placement {
            dir: self.volume_dir(&volume_id),
            image: image::image_path(self.state_dir(), &volume_id),
            offered: self.topology().clone(),
            node_id: self.node_id().to_owned(),
            state_dir: self.state_dir().to_owned(),
        };
        let id = volume_id.clone();
        // Checked and made under the state lock, so that two instances
        // creating the same name at once agree on one volume.
        let (record, existed) = self
            .store()
            .update(move |s| {
                if let Some(existing) = s.volumes.get(&id) {
                    let record = confirm_existing(existing, &id, &wanted, &place)?;
                    return Ok((record, true));
                }
                Ok((make_volume(s, id, wanted, place)?, false))
            })
            .await?;
        if existed {
            tracing::info!(%name, %volume_id, "volume already exists");
        } else {
            tracing::info!(%name, %volume_id, capacity_bytes = record.capacity_bytes, "created volume");
        }
        Ok(CreateVolumeResponse {
            volume: Some(volume_of(&record)),
        })
    }
}

/// What a CreateVolume asks for, checked.
struct WantedVolume {
    name: String,
    backing: Backing,
    source: Option<ContentSource>,
    range: (i64, i64),
    requisite: Vec<BTreeMap<String, String>>,
    parameters: BTreeMap<String, String>,
}

impl WantedVolume {
    /// Checks `req`: a name without control characters, capabilities that
    /// suit the backing its parameters ask for, a content source, a
    /// capacity range and the requisite topologies.
    fn checked(req: CreateVolumeRequest) -> Result<WantedVolume, Error> {
        let name = require(&req.name, "name")?.to_owned();
        if name
            .chars()
            .any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
        {
            return Err(Error::invalid(
                "name",
                "must not contain control characters",
            ));
        }
        let caps = capability::check_all(&req.volume_capabilities, "volume_capabilities")?;
        let backing = image::backing_of(&req.parameters.clone().into_iter().collect())?;
        for cap in &caps {
            cap.suits(backing)
                .map_err(|reason| Error::invalid("volume_capabilities", reason))?;
        }
        let source = content_source_of(req.volume_content_source.as_ref())?;
        let range = capability::range_bounds(req.capacity_range.as_ref())?;
        let requisite = requisite_of(req.accessibility_requirements.as_ref());
        Ok(WantedVolume {
            name,
            backing,
            source,
            range,
            requisite,
            parameters: req.parameters.into_iter().collect(),
        })
    }
}

/// Where a new volume goes: its data paths and this instance's topology.
struct Placement {
    dir: PathBuf,
    image: PathBuf,
    offered: BTreeMap<String, String>,
    node_id: String,
    state_dir: PathBuf,
}

/// The existing volume `existing` (of ID `id`) when it is the one `wanted`
/// asks for, its data recreated should it have gone missing;
/// `ALREADY_EXISTS` when it differs.
fn confirm_existing(
    existing: &VolumeRecord,
    id: &str,
    wanted: &WantedVolume,
    place: &Placement,
) -> Result<VolumeRecord, Error> {
    let WantedVolume {
        name: wanted_name,
        range,
        parameters,
        source,
        requisite,
        ..
    } = wanted;
    let (dir, image) = (&place.dir, &place.image);
    if existing.name != *wanted_name {
        return Err(Error::AlreadyExists(format!(
            "volume ID {id} of name {wanted_name:?} is taken by volume {:?}",
            existing.name
        )));
    }
    if !capability::fits(existing.capacity_bytes, *range) {
        return Err(Error::AlreadyExists(format!(
            "volume {wanted_name:?} exists with capacity {} bytes, outside the \
             requested range",
            existing.capacity_bytes
        )));
    }
    if existing.parameters != *parameters {
        return Err(Error::AlreadyExists(format!(
            "volume {wanted_name:?} exists with different parameters"
        )));
    }
    if existing.content_source != *source {
        return Err(Error::AlreadyExists(format!(
            "volume {wanted_name:?} exists with another content source ({:?})",
            existing.content_source
        )));
    }
    if !meets_requisite(&existing.topology, requisite) {
        return Err(Error::AlreadyExists(format!(
            "volume {wanted_name:?} exists in topology {}, which meets none of \
             the requested topologies {}",
            state::describe_topology(&existing.topology),
            describe_requisite(requisite)
        )));
    }
    // Recreate the directory should it have gone missing.
    match existing.backing {
        state::Backing::Directory => fs::create_dir_all(dir).map_err(Error::io("creating", dir))?,
        state::Backing::Image if !image.exists() => {
            image::create_image(image, existing.capacity_bytes)?
        }
        state::Backing::Image => {}
    }
    Ok(existing.clone())
}

/// A new volume as `wanted` asks, of ID `id`, placed in this instance's
/// topology, its data made (from its content source, if any) and its
/// record added to `s`.
fn make_volume(
    s: &mut State,
    id: String,
    wanted: WantedVolume,
    place: Placement,
) -> Result<VolumeRecord, Error> {
    let WantedVolume {
        name: wanted_name,
        backing,
        source,
        range,
        requisite,
        parameters,
    } = wanted;
    let Placement {
        dir,
        image,
        offered,
        node_id,
        state_dir,
    } = place;
    if !offered.is_empty() && !meets_requisite(&offered, &requisite) {
        return Err(Error::ResourceExhausted(format!(
            "none of the requested topologies {} is served by node {node_id}, \
             which offers topology {}",
            describe_requisite(&requisite),
            state::describe_topology(&offered)
        )));
    }
    let from = match &source {
        Some(source) => Some(source_data(s, &state_dir, source)?),
        None => None,
    };
    let capacity = match &from {
        Some(from) => capacity_with_source(range, from.size_bytes)?,
        None => capability::capacity_for(range),
    };
    let capacity = capability::at_least_minimum(capacity, backing, range)?;
    fill_data(from, backing, capacity, &dir, &image)?;
    let record = VolumeRecord {
        volume_id: id.clone(),
        name: wanted_name,
        capacity_bytes: capacity,
        parameters,
        publications: Default::default(),
        topology: offered,
        content_source: source,
        backing,
    };
    s.volumes.insert(id, record.clone());
    Ok(record)
}

/// Makes a new volume's data at `dir` or `image` (by its `backing`):
/// copied from `from`, the data of its content source, or empty; an image
/// of `capacity` bytes.
fn fill_data(
    from: Option<SourceData>,
    backing: Backing,
    capacity: i64,
    dir: &Path,
    image: &Path,
) -> Result<(), Error> {
    match (from, backing) {
        (Some(from), _) if from.backing != backing => {
            return Err(Error::invalid(
                "volume_content_source",
                format!(
                    "the source holds the data of a {} volume, and this volume \
                     would be a {} one",
                    backing_name(from.backing),
                    backing_name(backing)
                ),
            ))
        }
        (Some(from), state::Backing::Directory) => {
            // Whatever is there has no record: a leftover.
            copy::remove_data(dir)?;
            copy::copy_data(&from.path, dir)?;
        }
        (Some(from), state::Backing::Image) => {
            // A mounted source image's filesystem may still
            // hold data in the page cache.
            nix::unistd::sync();
            copy::remove_data(image)?;
            copy::copy_data(&from.path, image)?;
            image::grow_image(image, capacity)?;
        }
        (None, state::Backing::Directory) => {
            fs::create_dir_all(dir).map_err(Error::io("creating", dir))?
        }
        (None, state::Backing::Image) => image::create_image(image, capacity)?,
    }
    Ok(())
}

/// The snapshot or volume a CreateVolume asks to pre-populate the volume
/// from.
fn content_source_of(source: Option<&VolumeContentSource>) -> Result<Option<ContentSource>, Error> {
    use volume_content_source::Type;
    let Some(source) = source else {
        return Ok(None);
    };
    match &source.r#type {
        None => Err(Error::invalid(
            "volume_content_source",
            "names neither a snapshot nor a volume",
        )),
        Some(Type::Snapshot(s)) => Ok(Some(ContentSource::Snapshot(
            require(&s.snapshot_id, "volume_content_source.snapshot.snapshot_id")?.to_owned(),
        ))),
        Some(Type::Volume(v)) => Ok(Some(ContentSource::Volume(
            require(&v.volume_id, "volume_content_source.volume.volume_id")?.to_owned(),
        ))),
    }
}

/// The data a new volume is pre-populated from.
struct SourceData {
    path: std::path::PathBuf,
    backing: Backing,
    size_bytes: i64,
}

/// Finds the data of a content source in the state (`NOT_FOUND` when the
/// snapshot or volume does not exist).
fn source_data(
    s: &State,
    state_dir: &std::path::Path,
    source: &ContentSource,
) -> Result<SourceData, Error> {
    let data = match source {
        ContentSource::Snapshot(id) => {
            let snapshot = s
                .snapshots
                .get(id)
                .ok_or_else(|| Error::NotFound(format!("source snapshot {id} does not exist")))?;
            SourceData {
                path: state::snapshot_path(state_dir, id),
                backing: snapshot.backing,
                size_bytes: snapshot.size_bytes,
            }
        }
        ContentSource::Volume(id) => {
            let volume = s
                .volumes
                .get(id)
                .ok_or_else(|| Error::NotFound(format!("source volume {id} does not exist")))?;
            SourceData {
                path: state::volume_data_path(state_dir, volume),
                backing: volume.backing,
                size_bytes: volume.capacity_bytes,
            }
        }
    };
    Ok(data)
}

fn backing_name(backing: Backing) -> &'static str {
    match backing {
        Backing::Directory => "directory-backed",
        Backing::Image => "image-backed",
    }
}

/// The capacity of a volume made from a source of `source_bytes`: what is
/// required, but never less than the source; `OUT_OF_RANGE` when the
/// source does not fit under the limit.
fn capacity_with_source((required, limit): (i64, i64), source_bytes: i64) -> Result<i64, Error> {
    let capacity = if required == 0 && source_bytes == 0 {
        capability::capacity_for((required, limit))
    } else {
        required.max(source_bytes)
    };
    if limit > 0 && capacity > limit {
        return Err(Error::OutOfRange(format!(
            "the content source holds {source_bytes} bytes, more than limit_bytes {limit}"
        )));
    }
    Ok(capacity)
}

/// The `requisite` topologies of a CreateVolume, as segment maps.
fn requisite_of(requirements: Option<&TopologyRequirement>) -> Vec<BTreeMap<String, String>> {
    requirements
        .map(|r| {
            r.requisite
                .iter()
                .map(|t| t.segments.clone().into_iter().collect())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `segments` satisfy one of `requisite` (an empty `requisite`
/// asks for nothing).
fn meets_requisite(
    segments: &BTreeMap<String, String>,
    requisite: &[BTreeMap<String, String>],
) -> bool {
    requisite.is_empty()
        || requisite
            .iter()
            .any(|wanted| state::topology_satisfied(segments, wanted))
}

fn describe_requisite(requisite: &[BTreeMap<String, String>]) -> String {
    let each: Vec<String> = requisite.iter().map(state::describe_topology).collect();
    format!("[{}]", each.join(", "))
}
