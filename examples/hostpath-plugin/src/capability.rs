//! Which volume capabilities a volume can offer: mount access for every
//! volume, block access for image-backed ones.

use berth_proto::csi::v1::volume_capability::access_mode::Mode;
use berth_proto::csi::v1::volume_capability::AccessType;
use berth_proto::csi::v1::{CapacityRange, VolumeCapability};

use crate::error::Error;
use crate::state::Backing;

/// Capacity given to a volume when CreateVolume does not ask for one.
pub const DEFAULT_CAPACITY_BYTES: i64 = 1 << 30;

/// Why a capability cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The capability is not well formed (a REQUIRED part is missing).
    Malformed(String),
    /// Well formed, but this plugin cannot offer it.
    Unsupported(String),
}

/// A capability this plugin can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub mode: Mode,
    /// The `ro` mount flag was given.
    pub ro_flag: bool,
    /// Block access: the volume is handed over as a device, not mounted.
    pub block: bool,
    /// The filesystem type asked for (mount access; empty when not given).
    pub fs_type: String,
    /// The mount flags asked for (mount access).
    pub mount_flags: Vec<String>,
}

impl Checked {
    /// Whether the access mode only ever reads.
    pub fn is_reader_only(&self) -> bool {
        matches!(
            self.mode,
            Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly
        )
    }

    /// Whether a volume with this backing can serve the capability; the
    /// reason when it cannot.
    pub fn suits(&self, backing: Backing) -> Result<(), String> {
        match backing {
            Backing::Directory if self.block => Err(
                "block access needs an image-backed volume (CreateVolume parameter \
                 backing = \"image\"): this volume is a directory"
                    .to_owned(),
            ),
            Backing::Directory => Ok(()),
            Backing::Image if !self.block && !matches!(self.fs_type.as_str(), "" | "ext4") => {
                Err(format!(
                    "fs_type {:?} is not offered: image-backed volumes hold ext4",
                    self.fs_type
                ))
            }
            // ext4 is not a cluster filesystem: mounted writable by two
            // nodes at once it is corrupted. (A raw block device may be
            // shared: what is on it is the workload's business.)
            Backing::Image
                if !self.block
                    && matches!(
                        self.mode,
                        Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter
                    ) =>
            {
                Err(format!(
                    "access mode {} is not offered for mount access to an image-backed volume: \
                     its ext4 cannot be mounted writable on several nodes at once (use block \
                     access, or a reader-only or single-node mode)",
                    self.mode.as_str_name()
                ))
            }
            Backing::Image => Ok(()),
        }
    }
}

/// Checks one capability.
pub fn classify(cap: &VolumeCapability) -> Result<Checked, Rejection> {
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| Mode::try_from(m.mode).unwrap_or(Mode::Unknown))
        .unwrap_or(Mode::Unknown);
    if mode == Mode::Unknown {
        return Err(Rejection::Malformed(
            "access_mode is required and must be a known mode".to_owned(),
        ));
    }
    match &cap.access_type {
        None => Err(Rejection::Malformed(
            "access_type (mount or block) is required".to_owned(),
        )),
        // Whether the volume's backing can serve it is checked against the
        // volume ([`Checked::suits`]).
        Some(AccessType::Block(_)) => Ok(Checked {
            mode,
            ro_flag: false,
            block: true,
            fs_type: String::new(),
            mount_flags: Vec::new(),
        }),
        // fs_type and volume_mount_group mean nothing to a bind mount of a
        // directory; the `ro` flag is honoured there, other flags are
        // ignored. Image-backed volumes are mounted with the flags.
        Some(AccessType::Mount(mount)) => Ok(Checked {
            mode,
            ro_flag: mount.mount_flags.iter().any(|f| f == "ro"),
            block: false,
            fs_type: mount.fs_type.clone(),
            mount_flags: mount.mount_flags.clone(),
        }),
    }
}

/// [`check`], then whether a volume with `backing` can serve the capability.
pub fn check_for(
    cap: Option<&VolumeCapability>,
    field: &'static str,
    backing: Backing,
) -> Result<Checked, Error> {
    let checked = check(cap, field)?;
    checked
        .suits(backing)
        .map_err(|reason| Error::invalid(field, reason))?;
    Ok(checked)
}

/// Checks a REQUIRED single capability field.
pub fn check(cap: Option<&VolumeCapability>, field: &'static str) -> Result<Checked, Error> {
    let cap = cap.ok_or(Error::MissingField(field))?;
    classify(cap).map_err(|r| match r {
        Rejection::Malformed(reason) | Rejection::Unsupported(reason) => {
            Error::invalid(field, reason)
        }
    })
}

/// Checks a REQUIRED list of capabilities.
pub fn check_all(caps: &[VolumeCapability], field: &'static str) -> Result<Vec<Checked>, Error> {
    if caps.is_empty() {
        return Err(Error::MissingField(field));
    }
    caps.iter().map(|c| check(Some(c), field)).collect()
}

/// The capacity range as (required, limit), 0 meaning unset.
pub fn range_bounds(range: Option<&CapacityRange>) -> Result<(i64, i64), Error> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(Error::invalid(
            "capacity_range",
            "bytes must not be negative",
        ));
    }
    if limit > 0 && required > limit {
        return Err(Error::invalid(
            "capacity_range",
            format!("required_bytes {required} exceeds limit_bytes {limit}"),
        ));
    }
    Ok((required, limit))
}

/// The smallest image-backed volume: a smaller image cannot hold an ext4
/// filesystem (mkfs.ext4 refuses 64 KiB), so an image is never made
/// smaller than this, whatever less is asked for.
pub const MIN_IMAGE_CAPACITY_BYTES: i64 = 1 << 20;

/// The smallest volume of a backing.
pub fn minimum_capacity(backing: Backing) -> i64 {
    match backing {
        Backing::Directory => 0,
        Backing::Image => MIN_IMAGE_CAPACITY_BYTES,
    }
}

/// Raises `capacity` to the backing's minimum; `OUT_OF_RANGE` when the
/// range's limit is below that minimum.
pub fn at_least_minimum(
    capacity: i64,
    backing: Backing,
    (_, limit): (i64, i64),
) -> Result<i64, Error> {
    let minimum = minimum_capacity(backing);
    if limit > 0 && limit < minimum {
        return Err(Error::OutOfRange(format!(
            "limit_bytes {limit} is below {minimum} bytes, the smallest volume of this backing"
        )));
    }
    Ok(capacity.max(minimum))
}

/// The capacity to provision for a range: what is required, else the
/// default bounded by the limit.
pub fn capacity_for((required, limit): (i64, i64)) -> i64 {
    if required > 0 {
        required
    } else if limit > 0 {
        limit.min(DEFAULT_CAPACITY_BYTES)
    } else {
        DEFAULT_CAPACITY_BYTES
    }
}

/// Whether an existing capacity satisfies a range.
pub fn fits(capacity: i64, (required, limit): (i64, i64)) -> bool {
    capacity >= required && (limit == 0 || capacity <= limit)
}

#[cfg(test)]
mod tests {
    use berth_proto::csi::v1::volume_capability::{AccessMode, BlockVolume, MountVolume};

    use super::*;

    fn mount_cap(mode: Mode, flags: &[&str]) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: String::new(),
                mount_flags: flags.iter().map(|f| f.to_string()).collect(),
                volume_mount_group: String::new(),
            })),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    #[test]
    fn classifies_capabilities() {
        let ok = classify(&mount_cap(Mode::SingleNodeWriter, &[])).unwrap();
        assert_eq!(ok.mode, Mode::SingleNodeWriter);
        assert!(!ok.ro_flag && !ok.is_reader_only());
        let ro = classify(&mount_cap(Mode::MultiNodeReaderOnly, &["ro", "noatime"])).unwrap();
        assert!(ro.ro_flag && ro.is_reader_only());

        let block = VolumeCapability {
            access_type: Some(AccessType::Block(BlockVolume {})),
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
        };
        let checked = classify(&block).unwrap();
        assert!(checked.block);
        let why = checked.suits(Backing::Directory).unwrap_err();
        assert!(why.contains("image-backed"), "{why}");
        checked.suits(Backing::Image).unwrap();
        let xfs = VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "xfs".into(),
                ..Default::default()
            })),
            ..block.clone()
        };
        let xfs = classify(&xfs).unwrap();
        xfs.suits(Backing::Directory).unwrap();
        assert!(xfs.suits(Backing::Image).unwrap_err().contains("xfs"));
        // ext4 on several nodes at once, writable: not offered; shared
        // block access and shared reading are.
        let shared = classify(&mount_cap(Mode::MultiNodeMultiWriter, &[])).unwrap();
        shared.suits(Backing::Directory).unwrap();
        assert!(shared
            .suits(Backing::Image)
            .unwrap_err()
            .contains("MULTI_NODE_MULTI_WRITER"));
        classify(&mount_cap(Mode::MultiNodeReaderOnly, &[]))
            .unwrap()
            .suits(Backing::Image)
            .unwrap();
        let shared_block = VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::MultiNodeMultiWriter as i32,
            }),
            ..block.clone()
        };
        classify(&shared_block)
            .unwrap()
            .suits(Backing::Image)
            .unwrap();
        assert_eq!(
            check_for(Some(&block), "volume_capability", Backing::Directory)
                .unwrap_err()
                .code(),
            tonic::Code::InvalidArgument
        );
        assert!(matches!(
            classify(&mount_cap(Mode::Unknown, &[])),
            Err(Rejection::Malformed(_))
        ));
        let no_type = VolumeCapability {
            access_type: None,
            ..mount_cap(Mode::SingleNodeWriter, &[])
        };
        assert!(matches!(classify(&no_type), Err(Rejection::Malformed(_))));
        let bad_mode = VolumeCapability {
            access_mode: Some(AccessMode { mode: 99 }),
            ..mount_cap(Mode::SingleNodeWriter, &[])
        };
        assert!(matches!(classify(&bad_mode), Err(Rejection::Malformed(_))));
    }

    #[test]
    fn required_capabilities() {
        assert!(matches!(
            check(None, "volume_capability"),
            Err(Error::MissingField("volume_capability"))
        ));
        assert!(matches!(
            check_all(&[], "volume_capabilities"),
            Err(Error::MissingField("volume_capabilities"))
        ));
        assert_eq!(
            check_all(
                &[
                    mount_cap(Mode::SingleNodeWriter, &[]),
                    mount_cap(Mode::MultiNodeMultiWriter, &[])
                ],
                "volume_capabilities"
            )
            .unwrap()
            .len(),
            2
        );
    }

    #[test]
    fn capacity_ranges() {
        let range = |r, l| {
            range_bounds(Some(&CapacityRange {
                required_bytes: r,
                limit_bytes: l,
            }))
        };
        assert_eq!(range_bounds(None).unwrap(), (0, 0));
        assert!(range(-1, 0).is_err());
        assert!(range(0, -1).is_err());
        assert!(range(10, 5).is_err());
        assert_eq!(capacity_for(range(0, 0).unwrap()), DEFAULT_CAPACITY_BYTES);
        assert_eq!(capacity_for(range(100, 0).unwrap()), 100);
        assert_eq!(capacity_for(range(100, 200).unwrap()), 100);
        assert_eq!(capacity_for(range(0, 4096).unwrap()), 4096);
        assert_eq!(
            capacity_for(range(0, 4 << 30).unwrap()),
            DEFAULT_CAPACITY_BYTES
        );
        assert!(fits(100, (100, 0)));
        assert!(fits(100, (0, 100)));
        assert!(fits(100, (0, 0)));
        assert!(!fits(100, (101, 0)));
        assert!(!fits(100, (0, 99)));
    }

    #[test]
    fn images_have_a_minimum_size() {
        let min = MIN_IMAGE_CAPACITY_BYTES;
        assert_eq!(
            at_least_minimum(4096, Backing::Directory, (4096, 0)).unwrap(),
            4096
        );
        assert_eq!(
            at_least_minimum(4096, Backing::Image, (4096, 0)).unwrap(),
            min
        );
        assert_eq!(
            at_least_minimum(4 * min, Backing::Image, (0, 0)).unwrap(),
            4 * min
        );
        assert_eq!(
            at_least_minimum(4096, Backing::Image, (0, min)).unwrap(),
            min
        );
        let err = at_least_minimum(4096, Backing::Image, (0, min - 1)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange);
    }
}
