//! Loop devices of image-backed volumes: whether they can be used here,
//! and the ones a test's files back, to detach when it ends.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The loop devices whose backing file lies under `dir` (an image volume
/// of an agent there; the file may already be deleted).
pub fn loops_backed_under(dir: &Path) -> Vec<PathBuf> {
    if dir.as_os_str().is_empty() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            Path::new(backing.trim_end())
                .starts_with(dir)
                .then(|| Path::new("/dev").join(e.file_name()))
        })
        .collect()
}

/// Why image-backed volumes (ext4 images on loop devices) cannot work
/// here, if they cannot: no loop support, a missing tool, no free device.
pub fn loop_devices_unusable() -> Option<String> {
    if !Path::new("/dev/loop-control").exists() {
        return Some("/dev/loop-control is missing (no loop device support)".into());
    }
    for tool in ["losetup", "mkfs.ext4", "resize2fs", "e2fsck", "dumpe2fs"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("{tool} is not installed"));
        }
    }
    match Command::new("losetup").arg("--find").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "losetup --find finds no free loop device: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("losetup cannot run: {e}")),
    }
}
