//! The mount table of this mount namespace (`/proc/self/mountinfo`), read
//! one way for everyone that must know what is mounted: orphaned mount
//! removal, live repair, and (through `berth-allocrunner`) the task volume
//! binds and alloc dir removal.

use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{umount2, MntFlags};

/// Every mount point, in mountinfo order (a path mounted over twice is
/// listed twice). Empty, with a warning, when mountinfo cannot be read.
pub fn mount_points() -> Vec<PathBuf> {
    match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(text) => parse_mount_points(&text),
        Err(e) => {
            tracing::warn!(error = %e, "reading /proc/self/mountinfo failed");
            Vec::new()
        }
    }
}

/// The mount points (the fifth field) of mountinfo text, unescaped.
pub fn parse_mount_points(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .collect()
}

/// Mount points at or below `dir` (as mountinfo shows it: canonical),
/// deepest first, each once.
pub fn mounts_at_or_below(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mount_points()
        .into_iter()
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by(|a, b| {
        b.components()
            .count()
            .cmp(&a.components().count())
            .then_with(|| a.cmp(b))
    });
    found.dedup();
    found
}

/// Whether `path` (canonical) is a mount point.
pub fn is_mount_point(path: &Path) -> bool {
    mount_points().iter().any(|p| p == path)
}

/// Whether the topmost mount at `path` (canonical) is in a shared peer
/// group (its optional fields hold `shared:N`). False when nothing is
/// mounted there or mountinfo cannot be read.
pub fn is_shared(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|text| topmost_is_shared(&text, path))
}

fn topmost_is_shared(text: &str, path: &Path) -> bool {
    text.lines()
        .rev()
        .filter_map(|l| {
            let (left, _) = l.split_once(" - ")?;
            let fields: Vec<&str> = left.split(' ').collect();
            let mount_point = PathBuf::from(unescape(fields.get(4)?));
            Some((mount_point, fields.get(6..).unwrap_or_default().to_vec()))
        })
        .find(|(m, _)| m == path)
        .is_some_and(|(_, optional)| optional.iter().any(|f| f.starts_with("shared:")))
}

/// Undoes mountinfo's `\ooo` escapes (space, tab, newline, backslash).
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..=i + 3].iter().all(|c| (b'0'..=b'7').contains(c));
        let value = octal
            .then(|| {
                b[i + 1..=i + 3]
                    .iter()
                    .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'))
            })
            .and_then(|v| u8::try_from(v).ok());
        match value {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Detaches everything mounted at `path` (`umount2(MNT_DETACH)` until
/// nothing is left: mounts may be stacked). Users of a detached mount keep
/// it until they let go. Nothing mounted there is fine. A symlink at
/// `path` is not followed (a task could have put one where its mount was):
/// nothing is detached through it.
pub fn detach_all(path: &Path) -> Result<(), Errno> {
    loop {
        match umount2(path, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) => continue,
            Err(Errno::EINVAL | Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_topmost_mount_at_a_path_tells_whether_it_is_shared() {
        let text = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:40 / /mnt/a\\040b rw,relatime shared:7 master:2 - tmpfs tmpfs rw
31 30 0:41 / /mnt/a\\040b rw,relatime - tmpfs tmpfs rw
32 22 0:42 / /mnt/c rw,relatime master:3 - tmpfs tmpfs rw
";
        assert!(topmost_is_shared(text, Path::new("/")));
        // Mounted over by a private mount: the topmost one counts.
        assert!(!topmost_is_shared(text, Path::new("/mnt/a b")));
        assert!(!topmost_is_shared(text, Path::new("/mnt/c")));
        assert!(!topmost_is_shared(text, Path::new("/mnt/none")));
        let shared_on_top =
            format!("{text}33 31 0:43 / /mnt/a\\040b rw shared:9 - tmpfs tmpfs rw\n");
        assert!(topmost_is_shared(&shared_on_top, Path::new("/mnt/a b")));
    }

    #[test]
    fn mount_points_are_unescaped() {
        let text = "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw\n\
                    37 35 98:0 / /plain rw - ext4 /dev/sda1 rw\n";
        assert_eq!(
            parse_mount_points(text),
            vec![PathBuf::from("/mnt/with space"), PathBuf::from("/plain")]
        );
        assert_eq!(unescape("a\\134b"), "a\\b");
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape("trailing\\04"), "trailing\\04");
        // Not a byte: kept as written.
        assert_eq!(unescape(r"/x\777"), r"/x\777");
    }

    /// Detaches everything below a temp dir when dropped.
    struct Cleanup(PathBuf);

    impl Drop for Cleanup {
        fn drop(&mut self) {
            for m in mounts_at_or_below(&self.0) {
                let _ = detach_all(&m);
            }
        }
    }

    /// A temp dir `root` with a tmpfs mounted at `root/m`, all detached
    /// when dropped.
    struct TmpfsDir {
        root: PathBuf,
        m: PathBuf,
        _cleanup: Cleanup,
        _dir: tempfile::TempDir,
    }

    impl TmpfsDir {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().canonicalize().unwrap();
            let m = root.join("m");
            std::fs::create_dir(&m).unwrap();
            let cleanup = Cleanup(root.clone());
            tmpfs(&m);
            TmpfsDir {
                root,
                m,
                _cleanup: cleanup,
                _dir: dir,
            }
        }
    }

    fn tmpfs(at: &Path) {
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
    }

    #[test]
    fn stacked_mounts_are_listed_once_and_all_detached() {
        let t = TmpfsDir::new();
        let (root, m) = (t.root.clone(), t.m.clone());
        std::fs::create_dir(m.join("deep")).unwrap();
        tmpfs(&m.join("deep"));
        tmpfs(&m);
        assert_eq!(
            mounts_at_or_below(&root),
            vec![m.join("deep"), m.clone()],
            "deepest first, the stacked path once"
        );
        assert!(is_mount_point(&m));
        detach_all(&m).unwrap();
        assert!(!is_mount_point(&m), "every mount stacked at the path went");
        detach_all(&m).unwrap();
    }

    #[test]
    fn a_symlink_is_not_followed() {
        let t = TmpfsDir::new();
        let (root, m) = (t.root.clone(), t.m.clone());
        let link = root.join("link");
        std::os::unix::fs::symlink(&m, &link).unwrap();
        detach_all(&link).unwrap();
        assert!(is_mount_point(&m), "the mount the link points at stays");
    }
}
