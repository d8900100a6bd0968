//! Copying a volume's data: for snapshots, and for volumes made from a
//! snapshot or another volume.
//!
//! A directory is copied file by file (contents, permissions, ownership and
//! symlinks; sockets, FIFOs and device nodes are skipped); an image file is
//! copied sparsely, only its data ranges, so a mostly empty image stays
//! small. Each copy is made under a temporary name next to its destination
//! and renamed into place, so a copy cut short never shows under the final
//! name. Everything here blocks; callers run it off the async runtime.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{lchown, symlink, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::unistd::{lseek, Whence};

use crate::error::Error;

/// The unit in which file data is read, written and checked for zeros.
const CHUNK: usize = 1 << 20;

/// Copies the volume data at `source` (a directory or an image file) to
/// `dest`, which must not exist yet. A copy cut short leaves nothing at
/// `dest`. Returns the number of bytes copied.
pub fn copy_data(source: &Path, dest: &Path) -> Result<u64, Error> {
    let meta = fs::symlink_metadata(source).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            Error::FailedPrecondition(format!(
                "the data at {} is missing; nothing to copy",
                source.display()
            ))
        } else {
            Error::io("inspecting", source)(e)
        }
    })?;
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent).map_err(Error::io("creating", parent))?;
    }
    let tmp = temporary_name(dest);
    // A temporary copy left by a crashed attempt is of no use.
    remove_data(&tmp)?;
    let copied = if meta.is_dir() {
        fs::create_dir(&tmp).map_err(Error::io("creating", &tmp))?;
        copy_tree(source, &tmp)
    } else if meta.is_file() {
        copy_sparse(source, &tmp)
    } else {
        return Err(Error::Internal(format!(
            "{} is neither a directory nor a file",
            source.display()
        )));
    };
    let copied = copied.and_then(|bytes| {
        fs::rename(&tmp, dest).map_err(Error::io("renaming into place", dest))?;
        Ok(bytes)
    });
    if copied.is_err() {
        let _ = remove_data(&tmp);
    }
    copied
}

/// Removes volume data (a directory tree or a file); a missing path is fine.
pub fn remove_data(path: &Path) -> Result<(), Error> {
    let result = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    };
    match result {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io("removing", path)(e)),
        _ => Ok(()),
    }
}

/// `<dir>/.<name>.copying`: where the copy to `dest` is made.
fn temporary_name(dest: &Path) -> PathBuf {
    let mut name = std::ffi::OsString::from(".");
    name.push(dest.file_name().unwrap_or_default());
    name.push(".copying");
    dest.with_file_name(name)
}

/// Copies the contents of directory `source` into the existing directory
/// `dest`, then gives `dest` the permissions and owner of `source`.
fn copy_tree(source: &Path, dest: &Path) -> Result<u64, Error> {
    let mut bytes = 0;
    for entry in fs::read_dir(source).map_err(Error::io("reading", source))? {
        let entry = entry.map_err(Error::io("reading", source))?;
        let from = entry.path();
        let to = dest.join(entry.file_name());
        let meta = fs::symlink_metadata(&from).map_err(Error::io("inspecting", &from))?;
        let kind = meta.file_type();
        if kind.is_dir() {
            fs::create_dir(&to).map_err(Error::io("creating", &to))?;
            bytes += copy_tree(&from, &to)?;
        } else if kind.is_file() {
            bytes += copy_sparse(&from, &to)?;
        } else if kind.is_symlink() {
            let target = fs::read_link(&from).map_err(Error::io("reading link", &from))?;
            symlink(&target, &to).map_err(Error::io("creating link", &to))?;
            lchown(&to, Some(meta.uid()), Some(meta.gid()))
                .map_err(Error::io("changing owner of", &to))?;
        } else {
            tracing::warn!(path = %from.display(), "not copying a special file");
        }
    }
    copy_attributes(source, dest)?;
    Ok(bytes)
}

/// Gives `dest` the permissions and owner of `source`.
fn copy_attributes(source: &Path, dest: &Path) -> Result<(), Error> {
    let meta = fs::metadata(source).map_err(Error::io("inspecting", source))?;
    lchown(dest, Some(meta.uid()), Some(meta.gid()))
        .map_err(Error::io("changing owner of", dest))?;
    fs::set_permissions(dest, fs::Permissions::from_mode(meta.mode() & 0o7777))
        .map_err(Error::io("changing permissions of", dest))
}

/// Copies the regular file `source` to the new file `dest`, writing only
/// the data ranges of `source` that are not all zeros: holes stay holes.
/// Returns the number of bytes written.
fn copy_sparse(source: &Path, dest: &Path) -> Result<u64, Error> {
    let input = File::open(source).map_err(Error::io("opening", source))?;
    let len = input
        .metadata()
        .map_err(Error::io("inspecting", source))?
        .len();
    let output = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(Error::io("creating", dest))?;
    output.set_len(len).map_err(Error::io("sizing", dest))?;

    let mut written = 0;
    let mut buf = vec![0u8; CHUNK];
    for (start, end) in data_ranges(&input, len).map_err(Error::io("reading", source))? {
        let mut offset = start;
        while offset < end {
            let want = usize::try_from(end - offset).map_or(CHUNK, |n| n.min(CHUNK));
            let n = input
                .read_at(&mut buf[..want], offset)
                .map_err(Error::io("reading", source))?;
            if n == 0 {
                // The file shrank under us; what is left reads as zeros.
                break;
            }
            if buf[..n].iter().any(|b| *b != 0) {
                output
                    .write_all_at(&buf[..n], offset)
                    .map_err(Error::io("writing", dest))?;
                written += n as u64;
            }
            offset += n as u64;
        }
    }
    output.sync_all().map_err(Error::io("syncing", dest))?;
    drop(output);
    copy_attributes(source, dest)?;
    Ok(written)
}

/// The `[start, end)` ranges of `file` (of length `len`) that hold data,
/// from `SEEK_DATA`/`SEEK_HOLE`; the whole file where the filesystem
/// cannot tell.
fn data_ranges(file: &File, len: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = file.as_fd();
    let mut ranges = Vec::new();
    let mut pos: u64 = 0;
    while pos < len {
        let offset = i64::try_from(pos).map_err(io::Error::other)?;
        let start = match lseek(fd, offset, Whence::SeekData) {
            Ok(start) => start as u64,
            // No data after `pos`.
            Err(Errno::ENXIO) => break,
            Err(Errno::EINVAL) if ranges.is_empty() && pos == 0 => return Ok(vec![(0, len)]),
            Err(e) => return Err(e.into()),
        };
        let end = match lseek(fd, start as i64, Whence::SeekHole) {
            Ok(end) => (end as u64).min(len),
            Err(e) => return Err(e.into()),
        };
        if end > start {
            ranges.push((start, end));
        }
        pos = end.max(start + 1);
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn copies_a_tree_with_links_and_modes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::create_dir_all(src.join("sub/deeper")).unwrap();
        fs::write(src.join("a.txt"), b"alpha").unwrap();
        fs::write(src.join("sub/deeper/b.bin"), vec![7u8; 3 * CHUNK + 5]).unwrap();
        fs::set_permissions(src.join("a.txt"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::set_permissions(src.join("sub"), fs::Permissions::from_mode(0o711)).unwrap();
        symlink("a.txt", src.join("link")).unwrap();

        let dest = dir.path().join("copies/dest");
        let bytes = copy_data(&src, &dest).unwrap();
        assert_eq!(bytes, 5 + 3 * CHUNK as u64 + 5);
        assert_eq!(fs::read(dest.join("a.txt")).unwrap(), b"alpha");
        assert_eq!(
            fs::read(dest.join("sub/deeper/b.bin")).unwrap(),
            vec![7u8; 3 * CHUNK + 5]
        );
        assert_eq!(
            fs::read_link(dest.join("link")).unwrap(),
            Path::new("a.txt")
        );
        let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&dest.join("a.txt")), 0o640);
        assert_eq!(mode(&dest.join("sub")), 0o711);
        assert!(!temporary_name(&dest).exists());

        // The copy is independent of the source.
        fs::write(src.join("a.txt"), b"changed").unwrap();
        assert_eq!(fs::read(dest.join("a.txt")).unwrap(), b"alpha");

        remove_data(&dest).unwrap();
        assert!(!dest.exists());
        remove_data(&dest).unwrap();
    }

    #[test]
    fn copies_an_image_sparsely() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.img");
        let len = 64 * CHUNK as u64;
        let file = File::create(&src).unwrap();
        file.set_len(len).unwrap();
        file.write_all_at(b"head", 0).unwrap();
        file.write_all_at(b"middle", 10 * CHUNK as u64 + 3).unwrap();
        file.write_all_at(b"tail", len - 4).unwrap();
        file.sync_all().unwrap();

        let dest = dir.path().join("snap/dest.img");
        copy_data(&src, &dest).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), fs::read(&src).unwrap());
        let meta = fs::metadata(&dest).unwrap();
        assert_eq!(meta.len(), len);
        assert!(
            meta.blocks() * 512 <= 8 * CHUNK as u64,
            "the copy stays sparse: {} bytes allocated",
            meta.blocks() * 512
        );
    }

    #[test]
    fn missing_source_is_a_failed_precondition_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("dest");
        let err = copy_data(&dir.path().join("gone"), &dest).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        assert!(!dest.exists());
    }
}
