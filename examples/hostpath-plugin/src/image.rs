//! Image-backed volumes: a sparse file `<state-dir>/images/<id>.img` holding
//! an ext4 filesystem, attached to a loop device on the node that stages it.
//!
//! The loop device of an image is found by its backing file in
//! `/sys/block/loop*/loop/backing_file`, never remembered, so a restarted
//! plugin finds the devices it attached before. Everything here blocks;
//! callers run it off the async runtime. Missing tools or loop support are
//! `FAILED_PRECONDITION`, naming what is missing.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::state::Backing;

/// Directory (inside the state directory) holding the volume images.
pub const IMAGES_DIR: &str = "images";
/// The CreateVolume parameter that picks the backing.
pub const BACKING_PARAMETER: &str = "backing";
/// The filesystem put on images.
pub const FS_TYPE: &str = "ext4";

const LOOP_CONTROL: &str = "/dev/loop-control";
const SYS_BLOCK: &str = "/sys/block";
/// How long a detach waits for the kernel to let go of the image.
const DETACH_WAIT: Duration = Duration::from_secs(5);

/// The image file of volume `volume_id`.
pub fn image_path(state_dir: &Path, volume_id: &str) -> PathBuf {
    state_dir.join(IMAGES_DIR).join(format!("{volume_id}.img"))
}

/// The backing CreateVolume `parameters` ask for.
pub fn backing_of(parameters: &BTreeMap<String, String>) -> Result<Backing, Error> {
    match parameters.get(BACKING_PARAMETER).map(String::as_str) {
        None | Some("directory") => Ok(Backing::Directory),
        Some("image") => Ok(Backing::Image),
        Some(other) => Err(Error::invalid(
            "parameters",
            format!("backing {other:?} is not known: use \"directory\" or \"image\""),
        )),
    }
}

/// Runs a tool, mapping a missing binary to `FAILED_PRECONDITION` and a
/// failure to `INTERNAL` with its output. Returns its stdout.
fn run(program: &str, args: &[&str], needs: &str) -> Result<String, Error> {
    let output = Command::new(program).args(args).output().map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            Error::FailedPrecondition(format!(
                "{program} is not installed on this node ({needs} needs it)"
            ))
        } else {
            Error::Internal(format!("running {program}: {e}"))
        }
    })?;
    if !output.status.success() {
        return Err(Error::Internal(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Makes the sparse image of `bytes` at `path` and formats it ext4. A
/// half-made image is removed.
pub fn create_image(path: &Path, bytes: i64) -> Result<(), Error> {
    let size = u64::try_from(bytes)
        .ok()
        .filter(|b| *b > 0)
        .ok_or_else(|| Error::invalid("capacity_range", "an image needs a positive size"))?;
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(Error::io("creating", dir))?;
    }
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(Error::io("creating", path))?;
    // From here on the file is ours: removed again if it cannot be made.
    let made = (|| {
        file.set_len(size).map_err(Error::io("sizing", path))?;
        drop(file);
        let shown = path.to_string_lossy();
        run("mkfs.ext4", &["-q", "-F", &shown], "an image-backed volume")?;
        Ok(())
    })();
    if made.is_err() {
        let _ = fs::remove_file(path);
    }
    made
}

/// Grows the image at `path` to `bytes` (never shrinks it). The filesystem
/// inside is grown by `NodeExpandVolume` on the node that stages it (or at
/// the next stage).
pub fn grow_image(path: &Path, bytes: i64) -> Result<(), Error> {
    let size = u64::try_from(bytes)
        .map_err(|_| Error::invalid("capacity_range", "size must not be negative"))?;
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(Error::io("opening", path))?;
    let current = file
        .metadata()
        .map_err(Error::io("inspecting", path))?
        .len();
    if size > current {
        file.set_len(size).map_err(Error::io("growing", path))?;
        file.sync_all().map_err(Error::io("syncing", path))?;
    }
    Ok(())
}

/// Removes the image at `path`; a missing image is fine.
pub fn remove_image(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io("removing", path)(e)),
        _ => Ok(()),
    }
}

/// Whether loop devices can be used here; the reason when not.
pub fn check_loop_support() -> Result<(), Error> {
    if !Path::new(LOOP_CONTROL).exists() {
        return Err(Error::FailedPrecondition(format!(
            "loop devices are not available on this node ({LOOP_CONTROL} is missing): \
             image-backed volumes cannot be staged here"
        )));
    }
    Ok(())
}

/// A loop device attached to an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    /// `/dev/loopN`.
    pub path: PathBuf,
    /// Attached read-only (`losetup --read-only`): what a read-only block
    /// publish hands out, since a read-only bind of a device node does not
    /// stop writes to the device.
    pub read_only: bool,
}

/// The loop devices attached to `image`, read-write ones first.
pub fn loops_of(image: &Path) -> Result<Vec<LoopDevice>, Error> {
    let image = fs::canonicalize(image).unwrap_or_else(|_| image.to_owned());
    let entries = match fs::read_dir(SYS_BLOCK) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("reading", Path::new(SYS_BLOCK))(e)),
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with("loop")) else {
            continue;
        };
        let Ok(backing) = fs::read_to_string(entry.path().join("loop/backing_file")) else {
            continue;
        };
        if Path::new(backing.trim_end_matches('\n')) != image {
            continue;
        }
        let read_only =
            fs::read_to_string(entry.path().join("ro")).is_ok_and(|ro| ro.trim() == "1");
        found.push(LoopDevice {
            path: PathBuf::from("/dev").join(name),
            read_only,
        });
    }
    found.sort_by_key(|d| (d.read_only, d.path.clone()));
    Ok(found)
}

/// The read-write loop device attached to `image` (the one staging
/// attaches), if any.
pub fn find_loop(image: &Path) -> Result<Option<PathBuf>, Error> {
    Ok(loops_of(image)?
        .into_iter()
        .find(|d| !d.read_only)
        .map(|d| d.path))
}

/// Attaches `image` to a read-write loop device, or finds the one it is
/// attached to.
pub fn attach(image: &Path) -> Result<PathBuf, Error> {
    if let Some(dev) = find_loop(image)? {
        return Ok(dev);
    }
    attach_new(image, false)
}

/// Attaches `image` to a read-only loop device, or finds the one it is
/// attached to.
pub fn attach_read_only(image: &Path) -> Result<PathBuf, Error> {
    if let Some(dev) = loops_of(image)?.into_iter().find(|d| d.read_only) {
        return Ok(dev.path);
    }
    attach_new(image, true)
}

fn attach_new(image: &Path, read_only: bool) -> Result<PathBuf, Error> {
    check_loop_support()?;
    if !image.is_file() {
        return Err(Error::NotFound(format!(
            "image {} does not exist",
            image.display()
        )));
    }
    let shown = image.to_string_lossy();
    let mut args = vec!["--find", "--show"];
    if read_only {
        args.push("--read-only");
    }
    args.push(&shown);
    let dev = run("losetup", &args, "attaching an image")?;
    if dev.is_empty() {
        return Err(Error::Internal(format!(
            "losetup attached {} but named no device",
            image.display()
        )));
    }
    Ok(PathBuf::from(dev))
}

/// Detaches every loop device of `image`. Returns whether there was one.
pub fn detach(image: &Path) -> Result<bool, Error> {
    let loops = loops_of(image)?;
    for dev in &loops {
        detach_device(image, &dev.path)?;
    }
    Ok(!loops.is_empty())
}

/// Detaches loop device `dev` of `image`.
pub fn detach_device(image: &Path, dev: &Path) -> Result<(), Error> {
    run(
        "losetup",
        &["-d", &dev.to_string_lossy()],
        "detaching an image",
    )?;
    // While something else holds the device open for a moment (a losetup
    // scanning the devices, a udev probe) the kernel only marks it to be
    // cleared on last close: wait for that, so that a stage right after
    // finds the image free.
    let deadline = Instant::now() + DETACH_WAIT;
    while loops_of(image)?.iter().any(|d| d.path == dev) {
        if Instant::now() >= deadline {
            return Err(Error::Internal(format!(
                "{} still holds {} {DETACH_WAIT:?} after it was detached",
                dev.display(),
                image.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Makes loop device `dev` see its image's current size.
pub fn refresh_loop(dev: &Path) -> Result<(), Error> {
    run(
        "losetup",
        &["-c", &dev.to_string_lossy()],
        "expanding an image",
    )?;
    Ok(())
}

/// Grows the ext4 filesystem on `dev` to fill the device, online (the
/// filesystem is mounted). The kernel allows that only with
/// `CAP_SYS_RESOURCE`; without it the answer is `FAILED_PRECONDITION`, and
/// the filesystem is grown offline when the volume is next staged.
pub fn resize_fs(dev: &Path) -> Result<(), Error> {
    match run("resize2fs", &[&dev.to_string_lossy()], "expanding an image") {
        Err(Error::Internal(why)) if why.contains("Permission denied") => {
            Err(Error::FailedPrecondition(format!(
                "growing the mounted filesystem on {} online is not permitted on this node \
                 (it needs CAP_SYS_RESOURCE): it is grown when the volume is next staged; {why}",
                dev.display()
            )))
        }
        other => other.map(drop),
    }
}

/// The size in bytes of the ext4 filesystem in the (unattached) image.
pub fn filesystem_size(image: &Path) -> Result<u64, Error> {
    let out = run(
        "dumpe2fs",
        &["-h", &image.to_string_lossy()],
        "an image-backed volume",
    )?;
    let field = |name: &str| -> Option<u64> {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    match (field("Block count:"), field("Block size:")) {
        (Some(count), Some(size)) => Ok(count.saturating_mul(size)),
        _ => Err(Error::Internal(format!(
            "dumpe2fs named no block count and size for {}",
            image.display()
        ))),
    }
}

/// Grows the filesystem of the (unattached) image to fill an image that
/// was grown since: checks it (`e2fsck -f -p`), then `resize2fs`. Returns
/// whether it grew.
pub fn grow_filesystem_offline(image: &Path) -> Result<bool, Error> {
    let len = fs::metadata(image)
        .map_err(Error::io("inspecting", image))?
        .len();
    // Less than a 4 KiB block to gain: nothing to do.
    if filesystem_size(image)? + 4096 > len {
        return Ok(false);
    }
    let shown = image.to_string_lossy();
    // e2fsck exits 1 when it fixed something, which is fine here.
    let checked = Command::new("e2fsck")
        .args(["-f", "-p", &shown])
        .output()
        .map_err(|e| Error::FailedPrecondition(format!("running e2fsck: {e}")))?;
    if !matches!(checked.status.code(), Some(0 | 1)) {
        return Err(Error::Internal(format!(
            "e2fsck {shown} failed ({}): {}",
            checked.status,
            String::from_utf8_lossy(&checked.stdout).trim()
        )));
    }
    run("resize2fs", &[&shown], "expanding an image")?;
    Ok(true)
}

/// The size in bytes of the block device `dev` (any node of it: `/dev/loopN`
/// or a file it is bound onto).
pub fn device_size(dev: &Path) -> Result<u64, Error> {
    let rdev = device_number(dev)?;
    let path = PathBuf::from(format!(
        "/sys/dev/block/{}:{}/size",
        nix::sys::stat::major(rdev),
        nix::sys::stat::minor(rdev)
    ));
    let sectors = fs::read_to_string(&path).map_err(Error::io("reading", &path))?;
    let sectors: u64 = sectors
        .trim()
        .parse()
        .map_err(|e| Error::Internal(format!("{}: {e}", path.display())))?;
    Ok(sectors.saturating_mul(512))
}

/// The device number of block device `dev` (its `st_rdev`).
pub fn device_number(dev: &Path) -> Result<u64, Error> {
    let meta = fs::metadata(dev).map_err(Error::io("inspecting", dev))?;
    if !meta.file_type().is_block_device() {
        return Err(Error::FailedPrecondition(format!(
            "{} is not a block device",
            dev.display()
        )));
    }
    Ok(meta.rdev())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backing_comes_from_the_parameters() {
        let params = |v: &str| BTreeMap::from([(BACKING_PARAMETER.to_owned(), v.to_owned())]);
        assert_eq!(backing_of(&BTreeMap::new()).unwrap(), Backing::Directory);
        assert_eq!(
            backing_of(&params("directory")).unwrap(),
            Backing::Directory
        );
        assert_eq!(backing_of(&params("image")).unwrap(), Backing::Image);
        let err = backing_of(&params("nfs")).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.to_string().contains("\"nfs\""), "{err}");
    }

    #[test]
    fn images_are_sparse_and_only_grow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("images/v.img");
        // Formatting needs mkfs.ext4; the sizing does not.
        match create_image(&path, 16 << 20) {
            Ok(()) => {}
            Err(Error::FailedPrecondition(why)) => {
                eprintln!("skipping the format check: {why}");
                fs::create_dir_all(path.parent().unwrap()).unwrap();
                fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
            }
            Err(e) => panic!("{e}"),
        }
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 16 << 20);
        assert!(meta.blocks() * 512 < 16 << 20, "the image is sparse");
        grow_image(&path, 32 << 20).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 32 << 20);
        grow_image(&path, 8 << 20).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().len(),
            32 << 20,
            "never shrinks"
        );
        assert!(create_image(&path, 16 << 20).is_err(), "no overwrite");
        assert_eq!(fs::metadata(&path).unwrap().len(), 32 << 20);
        remove_image(&path).unwrap();
        remove_image(&path).unwrap();
        assert!(create_image(&dir.path().join("zero.img"), 0).is_err());
    }

    #[test]
    fn an_unattached_image_has_no_loop_device() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nothing.img");
        fs::write(&path, b"").unwrap();
        assert_eq!(find_loop(&path).unwrap(), None);
        assert!(!detach(&path).unwrap());
    }
}
