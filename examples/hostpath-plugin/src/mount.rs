//! Bind mounts and the mount table (`/proc/self/mountinfo`).
//!
//! Everything here blocks; callers run it off the async runtime.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::Error;

const MOUNTINFO: &str = "/proc/self/mountinfo";

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// `major:minor` of the mounted filesystem.
    pub dev: String,
    /// The directory of the filesystem that is mounted (not `/` for binds).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`/`ro`, `nosuid`, ...).
    pub options: Vec<String>,
    pub fs_type: String,
    pub source: String,
}

impl MountEntry {
    pub fn is_read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// Parses the text of a mountinfo file; malformed lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    // id parent major:minor root mount_point options [optional...] - fstype source super_options
    let (left, right) = line.split_once(" - ")?;
    let mut left = left.split(' ');
    let _id = left.next()?;
    let _parent = left.next()?;
    let dev = left.next()?.to_owned();
    let root = PathBuf::from(unescape(left.next()?));
    let mount_point = PathBuf::from(unescape(left.next()?));
    let options = left.next()?.split(',').map(str::to_owned).collect();
    let mut right = right.split(' ');
    let fs_type = unescape(right.next()?);
    let source = unescape(right.next().unwrap_or(""));
    Some(MountEntry {
        dev,
        root,
        mount_point,
        options,
        fs_type,
        source,
    })
}

/// Undoes the kernel's octal escapes (`\040` for a space and so on).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads this process's mount table.
pub fn read_mountinfo() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&fs::read_to_string(MOUNTINFO)?))
}

/// `path` made absolute and free of symlinks when possible, as the mount
/// table spells mount points.
fn canonical(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
}

/// The topmost mount whose mount point is `path`, if `path` is a mount point.
pub fn mount_at(path: &Path) -> Result<Option<MountEntry>, Error> {
    let path = canonical(path);
    let table = read_mountinfo().map_err(Error::io("reading", Path::new(MOUNTINFO)))?;
    Ok(table.into_iter().rev().find(|m| m.mount_point == path))
}

/// Mount points whose mounted directory is `dir` or lies inside it: the bind
/// mounts (direct or chained) of a volume directory.
pub fn mounts_of(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let dir = canonical(dir);
    let table = read_mountinfo().map_err(Error::io("reading", Path::new(MOUNTINFO)))?;
    Ok(mounts_of_in(&table, &dir))
}

fn mounts_of_in(table: &[MountEntry], dir: &Path) -> Vec<PathBuf> {
    // The mount that holds `dir`: the one with the longest mount point above
    // it (the topmost of those, when several are stacked).
    let Some(holder) = table
        .iter()
        .filter(|m| dir.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count())
    else {
        return Vec::new();
    };
    let relative = dir
        .strip_prefix(&holder.mount_point)
        .unwrap_or(Path::new(""));
    let fs_path = holder.root.join(relative);
    table
        .iter()
        .filter(|m| m.dev == holder.dev && m.root.starts_with(&fs_path) && m.mount_point != dir)
        .map(|m| m.mount_point.clone())
        .collect()
}

/// Whether `a` and `b` name the same file (device and inode).
pub fn same_file(a: &Path, b: &Path) -> Result<bool, Error> {
    let ma = fs::metadata(a).map_err(Error::io("inspecting", a))?;
    let mb = fs::metadata(b).map_err(Error::io("inspecting", b))?;
    Ok(ma.dev() == mb.dev() && ma.ino() == mb.ino())
}

/// Bind-mounts `source` at `target`.
pub fn bind_mount(source: &Path, target: &Path) -> Result<(), Error> {
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(Error::sys("bind-mounting onto", target))
}

/// Mounts the filesystem on block device `dev` at `target`, with the CSI
/// `mount_flags` (known flags become mount flags, the rest filesystem
/// options).
pub fn mount_device(
    dev: &Path,
    target: &Path,
    fs_type: &str,
    mount_flags: &[String],
) -> Result<(), Error> {
    let (flags, data) = parse_mount_flags(mount_flags);
    let data = (!data.is_empty()).then_some(data);
    mount(Some(dev), target, Some(fs_type), flags, data.as_deref())
        .map_err(Error::sys("mounting a device onto", target))
}

/// Splits CSI mount flags into kernel mount flags and the option string
/// handed to the filesystem.
pub fn parse_mount_flags(mount_flags: &[String]) -> (MsFlags, String) {
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for f in mount_flags {
        match f.as_str() {
            "ro" => flags |= MsFlags::MS_RDONLY,
            "rw" | "defaults" | "" => {}
            "noatime" => flags |= MsFlags::MS_NOATIME,
            "nodiratime" => flags |= MsFlags::MS_NODIRATIME,
            "relatime" => flags |= MsFlags::MS_RELATIME,
            "strictatime" => flags |= MsFlags::MS_STRICTATIME,
            "lazytime" => flags |= MsFlags::MS_LAZYTIME,
            "nosuid" => flags |= MsFlags::MS_NOSUID,
            "nodev" => flags |= MsFlags::MS_NODEV,
            "noexec" => flags |= MsFlags::MS_NOEXEC,
            "sync" => flags |= MsFlags::MS_SYNCHRONOUS,
            "dirsync" => flags |= MsFlags::MS_DIRSYNC,
            other => data.push(other),
        }
    }
    (flags, data.join(","))
}

/// The mounts whose filesystem is on the device numbered `rdev`, and the
/// bind mounts of that device's node (a block volume handed out as a file).
pub fn mounts_of_device(rdev: u64) -> Result<Vec<MountEntry>, Error> {
    let table = read_mountinfo().map_err(Error::io("reading", Path::new(MOUNTINFO)))?;
    let dev = format!(
        "{}:{}",
        nix::sys::stat::major(rdev),
        nix::sys::stat::minor(rdev)
    );
    let node = device_name(rdev);
    Ok(table
        .into_iter()
        .filter(|m| {
            // A bind of the device's node (`/dev/loopN`) shows the
            // filesystem holding the node, which is devtmpfs on a host but
            // a tmpfs or an overlay in a container: match by the node's
            // name, then by the device the mounted file is.
            m.dev == dev
                || (node
                    .as_deref()
                    .is_some_and(|n| m.root.file_name().is_some_and(|f| f == n))
                    && fs::metadata(&m.mount_point).is_ok_and(|meta| {
                        meta.file_type().is_block_device() && meta.rdev() == rdev
                    }))
        })
        .collect())
}

/// The kernel's name of block device `rdev` (`loop0`), from sysfs.
fn device_name(rdev: u64) -> Option<String> {
    let link = format!(
        "/sys/dev/block/{}:{}",
        nix::sys::stat::major(rdev),
        nix::sys::stat::minor(rdev)
    );
    fs::read_link(link)
        .ok()?
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
}

/// Makes an empty file at `path` (a mount point for a device), keeping one
/// that is there.
pub fn make_mount_file(path: &Path) -> Result<(), Error> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_file() || meta.file_type().is_block_device() => Ok(()),
        Ok(meta) if meta.is_dir() => {
            // An empty directory left where a file should go (a CO that
            // made the target as a directory): replace it.
            fs::remove_dir(path).map_err(|_| {
                Error::AlreadyExists(format!(
                    "{} is a directory, not a file for a block device",
                    path.display()
                ))
            })?;
            make_mount_file(path)
        }
        Ok(_) => Err(Error::AlreadyExists(format!(
            "{} is neither a file nor a directory",
            path.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
            }
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map(drop)
                .map_err(Error::io("creating", path))
        }
        Err(e) => Err(Error::io("inspecting", path)(e)),
    }
}

/// Makes the filesystem mounted at `target` and that mount writable, with
/// the CSI `mount_flags` (an `ro` among them is left out); other mounts of
/// the filesystem keep their own read-only flag.
pub fn remount_writable(target: &Path, mount_flags: &[String]) -> Result<(), Error> {
    let (flags, data) = parse_mount_flags(mount_flags);
    let data = (!data.is_empty()).then_some(data);
    mount(
        None::<&str>,
        target,
        None::<&str>,
        (flags - MsFlags::MS_RDONLY) | MsFlags::MS_REMOUNT,
        data.as_deref(),
    )
    .map_err(Error::sys("remounting writable", target))
}

/// Makes the bind mount at `target` read-only.
pub fn remount_read_only(target: &Path) -> Result<(), Error> {
    mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .map_err(Error::sys("remounting read-only", target))
}

/// Unmounts everything mounted at `path` (stacked mounts included). Not
/// being a mount point is fine.
pub fn unmount_all(path: &Path) -> Result<(), Error> {
    // Bounded, in case the table never stops showing the mount.
    for _ in 0..32 {
        if mount_at(path)?.is_none() {
            return Ok(());
        }
        match umount2(path, MntFlags::empty()) {
            Ok(()) => {}
            // Not a mount point (any more): someone else unmounted it.
            Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => return Ok(()),
            Err(e) => return Err(Error::sys("unmounting", path)(e)),
        }
    }
    Err(Error::Internal(format!(
        "{} is still mounted after repeated unmounts",
        path.display()
    )))
}

/// Removes the (empty) directory or the empty file at `path` (a mount point
/// for a device); a missing path is fine. Files with data and non-empty
/// directories are never removed.
pub fn remove_mount_point(path: &Path) -> Result<(), Error> {
    let result = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir(path),
        Ok(meta) if meta.is_file() && meta.len() == 0 => fs::remove_file(path),
        Ok(_) => {
            return Err(Error::FailedPrecondition(format!(
                "{} is not a directory",
                path.display()
            )))
        }
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("removing", path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 27 8:1 /var/lib/hp/volumes/v1 /mnt/stage\\040dir rw,relatime shared:1 - ext4 /dev/sda1 rw
41 27 8:1 /var/lib/hp/volumes/v1 /mnt/target ro,relatime shared:1 - ext4 /dev/sda1 rw
42 27 8:1 /var/lib/hp/volumes/v10 /mnt/other rw,relatime - ext4 /dev/sda1 rw
43 27 8:1 /var/lib/hp/volumes/v1/sub /mnt/sub rw,relatime - ext4 /dev/sda1 rw
44 27 0:50 /var/lib/hp/volumes/v1 /mnt/otherfs rw - tmpfs tmpfs rw
garbage line
";

    #[test]
    fn parses_lines() {
        let table = parse_mountinfo(SAMPLE);
        assert_eq!(table.len(), 7);
        let stage = &table[2];
        assert_eq!(stage.dev, "8:1");
        assert_eq!(stage.root, PathBuf::from("/var/lib/hp/volumes/v1"));
        assert_eq!(stage.mount_point, PathBuf::from("/mnt/stage dir"));
        assert_eq!(stage.fs_type, "ext4");
        assert_eq!(stage.source, "/dev/sda1");
        assert!(!stage.is_read_only());
        assert!(table[3].is_read_only());
    }

    #[test]
    fn splits_mount_flags() {
        let flags =
            |f: &[&str]| parse_mount_flags(&f.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(flags(&[]), (MsFlags::empty(), String::new()));
        let (f, data) = flags(&["ro", "noatime", "errors=remount-ro", "nodev", "discard"]);
        assert_eq!(
            f,
            MsFlags::MS_RDONLY | MsFlags::MS_NOATIME | MsFlags::MS_NODEV
        );
        assert_eq!(data, "errors=remount-ro,discard");
        assert_eq!(flags(&["rw", "defaults"]).0, MsFlags::empty());
    }

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape("plain"), "plain");
        assert_eq!(unescape("trailing\\04"), "trailing\\04");
        assert_eq!(unescape("\\999"), "\\999");
    }

    #[test]
    fn finds_binds_of_a_directory() {
        let table = parse_mountinfo(SAMPLE);
        let mounts = mounts_of_in(&table, Path::new("/var/lib/hp/volumes/v1"));
        assert_eq!(
            mounts,
            [
                PathBuf::from("/mnt/stage dir"),
                PathBuf::from("/mnt/target"),
                PathBuf::from("/mnt/sub"),
            ],
            "v10 and binds from other filesystems are not v1's"
        );
        assert!(mounts_of_in(&table, Path::new("/var/lib/hp/volumes/v2")).is_empty());
    }

    /// Lazily unmounts its paths, last first, when dropped.
    struct Unmount(Vec<PathBuf>);

    impl Drop for Unmount {
        fn drop(&mut self) {
            for path in self.0.iter().rev() {
                let _ = umount2(path, MntFlags::MNT_DETACH);
            }
        }
    }

    #[test]
    fn finds_a_bind_of_a_device_node_kept_on_a_tmpfs() {
        // As in a container, where /dev is a tmpfs rather than devtmpfs.
        let rdev = match fs::metadata("/dev/loop0") {
            Ok(meta) if meta.file_type().is_block_device() => meta.rdev(),
            _ => return eprintln!("skipping: no /dev/loop0 here"),
        };
        if !nix::unistd::Uid::effective().is_root() {
            return eprintln!("skipping: mounting needs root");
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let dev_dir = root.join("dev");
        fs::create_dir(&dev_dir).unwrap();
        mount(
            Some("tmpfs"),
            &dev_dir,
            Some("tmpfs"),
            MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        let mut mounted = Unmount(vec![dev_dir.clone()]);
        let node = dev_dir.join("loop0");
        let made = std::process::Command::new("mknod")
            .arg(&node)
            .arg("b")
            .arg(nix::sys::stat::major(rdev).to_string())
            .arg(nix::sys::stat::minor(rdev).to_string())
            .status()
            .unwrap();
        assert!(made.success());
        let target = root.join("target");
        make_mount_file(&target).unwrap();
        bind_mount(&node, &target).unwrap();
        mounted.0.push(target.clone());

        let users = mounts_of_device(rdev).unwrap();
        assert!(
            users.iter().any(|m| m.mount_point == target),
            "the bind of the device node is a user of the device: {users:#?}"
        );
        drop(mounted);
        let users = mounts_of_device(rdev).unwrap();
        assert!(!users.iter().any(|m| m.mount_point == target), "{users:#?}");
    }
}
