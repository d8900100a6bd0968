//! File modes of what the server keeps on disk: its state directory and
//! keyring are 0700, the database and key files 0600. A looser mode found
//! at start is narrowed, with a warning naming the path and both modes.

use std::fs::{File, OpenOptions, Permissions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Narrow the mode of `path` to `mode` if it grants more; a warning names
/// the path and both modes. Missing is fine (nothing to narrow).
pub fn narrow(path: &Path, mode: u32) -> std::io::Result<()> {
    let found = match std::fs::metadata(path) {
        Ok(m) => m.permissions().mode() & 0o777,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if found & !mode != 0 {
        tracing::warn!(
            path = %path.display(),
            mode = format!("{found:o}"),
            narrowed_to = format!("{mode:o}"),
            "mode was looser than berth keeps it; narrowing it"
        );
        std::fs::set_permissions(path, Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Narrow a file to `mode` (see [`narrow`]).
pub fn narrow_file(path: &Path, mode: u32) -> std::io::Result<()> {
    narrow(path, mode)
}

/// Make `dir` (and its missing parents) and narrow it to 0700.
pub fn ensure_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    narrow(dir, 0o700)
}

/// Create (or truncate) `path` with mode 0600, also when it existed with
/// another mode.
pub fn create_private_file(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(Permissions::from_mode(0o600))?;
    Ok(file)
}

/// Make sure the database file at `path` exists with mode 0600 before redb
/// opens it (redb would create it 0644), narrowing a looser existing one.
pub fn ensure_private_file(path: &Path) -> std::io::Result<()> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    narrow(path, 0o600)
}
