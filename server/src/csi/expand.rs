//! Growing a volume: `volume create` of a volume that exists, asking for
//! more capacity. The controller step (`ControllerExpandVolume`) runs
//! through a client that runs the plugin's controller, when that controller
//! can expand; the node step (`NodeExpandVolume`) runs on every node where
//! the volume is published, when the controller says it is needed or there
//! was no controller step. Anything but the capacity differing from the
//! volume is the "already exists" conflict; asking for less is an error:
//! volumes cannot shrink.

use berth_structs::CsiVolume;

use crate::error::ServerError;

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

pub(crate) fn to_i64(v: Option<u64>) -> i64 {
    i64::try_from(v.unwrap_or(0)).unwrap_or(i64::MAX)
}

/// `e` with what was being done in front of its message.
pub(crate) fn during(what: &str, e: ServerError) -> ServerError {
    match e {
        ServerError::Remote { code, message } => ServerError::Remote {
            code,
            message: format!("{what}: {message}"),
        },
        ServerError::Unavailable(m) => ServerError::Unavailable(format!("{what}: {m}")),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_structs::{AccessMode, AttachmentMode, VolumeCapability};
    use futures_util::future::join_all;

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
