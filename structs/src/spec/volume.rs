//! The volume spec for `volume create` and `volume register`: top-level
//! attributes and blocks, in Nomad's shape.

use hcl_edit::structure::Body;

use super::hcl::{BodyReader, Source};
use super::job::decode_mount_options;
use super::SpecError;
use crate::csi::{
    AccessMode, AttachmentMode, CsiTopology, CsiTopologyRequest, CsiVolume, VolumeCapability,
};
use crate::limits::{capacity_limit_text, MAX_VOLUME_CAPACITY_BYTES};

pub(super) fn decode_volume(src: &Source<'_>, body: &Body) -> Result<CsiVolume, SpecError> {
    let r = BodyReader::new(
        src,
        body,
        "the volume spec".into(),
        1,
        &[
            "id",
            "name",
            "type",
            "plugin_id",
            "external_id",
            "capacity_min",
            "capacity_max",
            "secrets",
            "parameters",
            "context",
            "snapshot_id",
            "clone_id",
        ],
        &[
            "capability",
            "mount_options",
            "secrets",
            "parameters",
            "context",
            "topology_request",
        ],
    )?;

    match r.string("type")?.as_deref() {
        None => return Err(r.missing("type")),
        Some("csi") => {}
        Some(other) => {
            return Err(r.invalid(
                "type",
                format!("volume type {other:?} is not supported (berth supports \"csi\")"),
            ))
        }
    }

    let mut capabilities = Vec::new();
    for b in r.blocks("capability") {
        let c = BodyReader::unlabeled(
            r.src(),
            b,
            r.ctx(),
            &["access_mode", "attachment_mode"],
            &[],
        )?;
        let capability = VolumeCapability {
            access_mode: c
                .parsed::<AccessMode>("access_mode")?
                .ok_or_else(|| c.missing("access_mode"))?,
            attachment_mode: c
                .parsed::<AttachmentMode>("attachment_mode")?
                .ok_or_else(|| c.missing("attachment_mode"))?,
        };
        if !capabilities.contains(&capability) {
            capabilities.push(capability);
        }
    }

    let mount_options = r
        .optional_block("mount_options")?
        .map(|b| decode_mount_options(src, b, r.ctx()))
        .transpose()?
        .unwrap_or_default();

    let requested_topologies = r
        .optional_block("topology_request")?
        .map(|b| decode_topology_request(src, b, r.ctx()))
        .transpose()?
        .unwrap_or_default();

    let snapshot_id = r.string("snapshot_id")?.unwrap_or_default();
    let clone_id = r.string("clone_id")?.unwrap_or_default();
    if !snapshot_id.is_empty() && !clone_id.is_empty() {
        return Err(r.invalid(
            "clone_id",
            "snapshot_id and clone_id are exclusive: a volume is created from a snapshot or as a clone, not both",
        ));
    }

    let id = r.required_string("id")?;
    Ok(CsiVolume {
        name: r.string("name")?.unwrap_or_else(|| id.clone()),
        id,
        external_id: r.string("external_id")?.unwrap_or_default(),
        plugin_id: r.required_string("plugin_id")?,
        capabilities,
        capacity_min: r.size(
            "capacity_min",
            MAX_VOLUME_CAPACITY_BYTES,
            &capacity_limit_text(),
        )?,
        capacity_max: r.size(
            "capacity_max",
            MAX_VOLUME_CAPACITY_BYTES,
            &capacity_limit_text(),
        )?,
        mount_options,
        secrets: r.map("secrets")?,
        parameters: r.map("parameters")?,
        context: r.map("context")?,
        requested_topologies,
        snapshot_id,
        clone_id,
        ..CsiVolume::default()
    })
}

/// `topology_request { required { topology { segments = {...} } ... }
/// preferred { ... } }`.
fn decode_topology_request(
    src: &Source<'_>,
    block: &hcl_edit::structure::Block,
    parent: &str,
) -> Result<CsiTopologyRequest, SpecError> {
    let r = BodyReader::unlabeled(src, block, parent, &[], &["required", "preferred"])?;
    let list = |name: &str| -> Result<Vec<CsiTopology>, SpecError> {
        let Some(b) = r.optional_block(name)? else {
            return Ok(Vec::new());
        };
        let l = BodyReader::unlabeled(src, b, r.ctx(), &[], &["topology"])?;
        let mut out = Vec::new();
        for t in l.blocks("topology") {
            let line = src.line_of(t);
            let t = BodyReader::unlabeled(src, t, l.ctx(), &["segments"], &["segments"])?;
            let segments = t.map("segments")?;
            if segments.is_empty() {
                return Err(SpecError::at(
                    line,
                    format!("{} needs at least one segment", t.ctx()),
                ));
            }
            let topology = CsiTopology::new(segments);
            if !out.contains(&topology) {
                out.push(topology);
            }
        }
        if out.is_empty() {
            return Err(SpecError::at(
                src.line_of(b),
                format!("{} needs at least one topology block", l.ctx()),
            ));
        }
        Ok(out)
    };
    Ok(CsiTopologyRequest {
        required: list("required")?,
        preferred: list("preferred")?,
    })
}
