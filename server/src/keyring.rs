//! The server's keyring: the keys that seal the secrets the state database
//! keeps (CSI volume secrets, node secrets), so that the database file alone
//! (a copy, a backup) gives none of them away.
//!
//! Keys live in `<data_dir>/server/keyring/` (mode 0700), one file
//! `<key_id>.json` each (mode 0600), made at the first start. The newest key
//! seals; every key on disk opens what it sealed. Rotation
//! ([`Keyring::add_key`] then [`Keyring::retire_all_but_active`], driven by
//! the store) adds a key, and the old ones are removed once the store has
//! sealed everything again with the new one.
//!
//! Sealing is XChaCha20-Poly1305 with a random 192-bit nonce per seal, and
//! the record it belongs to (`<table>/<key>`) as associated data: a sealed
//! value moved onto another record does not open.
//!
//! Neither key material nor what it seals ever reaches a log line or an
//! error message: errors name key IDs and paths only.

use berth_sync::RwLockExt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use serde::{Deserialize, Serialize};

use crate::file_modes;

/// The keyring directory beside a state database file.
pub const KEYRING_DIR: &str = "keyring";

/// Errors of the keyring. None carries key material or plaintext.
#[derive(Debug, thiserror::Error)]
pub enum KeyringError {
    #[error("keyring {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("keyring key file {path} is not a key: {why}")]
    BadKeyFile { path: String, why: String },
    #[error("sealed with key {key_id}, which is not in the keyring {dir}")]
    MissingKey { key_id: String, dir: String },
    #[error("does not open with key {key_id}: the ciphertext is damaged or was sealed for another record")]
    Corrupt { key_id: String },
    #[error("sealed value is malformed: {0}")]
    Malformed(String),
    #[error("sealing failed")]
    Seal,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> KeyringError + '_ {
    move |source| KeyringError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One key as its file holds it.
#[derive(Serialize, Deserialize)]
struct KeyFile {
    id: String,
    /// Milliseconds since the epoch; the newest key seals.
    created_ms: u64,
    /// The 256-bit key, base64.
    key: String,
}

struct Key {
    id: String,
    created_ms: u64,
    /// Kept to write the key's file.
    material: chacha20poly1305::Key,
    cipher: XChaCha20Poly1305,
}

impl Key {
    fn generate(created_ms: u64) -> Key {
        let material = XChaCha20Poly1305::generate_key(&mut OsRng);
        Key {
            id: uuid::Uuid::new_v4().simple().to_string(),
            created_ms,
            cipher: XChaCha20Poly1305::new(&material),
            material,
        }
    }
}

/// The format of [`Sealed`] this build writes.
pub const SEALED_VERSION: u32 = 1;

/// What a keyring rotation did. Carries key IDs, never key material.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyRotation {
    /// The new key, which seals from now on.
    pub key_id: String,
    /// The keys removed: nothing is sealed with them any more.
    pub retired: Vec<String>,
    /// Volumes whose secrets were sealed again with the new key.
    pub volumes: usize,
    /// Node secrets sealed again with the new key.
    pub node_secrets: usize,
}

/// A value sealed with one key of the keyring, as the database stores it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    /// The format of the sealed value; this build writes and reads 1.
    #[serde(rename = "v")]
    pub version: u32,
    pub key_id: String,
    /// Base64.
    pub nonce: String,
    /// Base64: the ciphertext with its tag.
    pub ciphertext: String,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealed")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// The keys, the newest of which seals.
pub struct Keyring {
    dir: PathBuf,
    keys: RwLock<Vec<Key>>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("dir", &self.dir)
            .field("active", &self.active_id())
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Keyring {
    /// Open the keyring in `dir`, making the directory and a first key when
    /// there is none. A looser mode on the directory or a key file is
    /// narrowed (with a warning).
    pub fn open(dir: &Path) -> Result<Keyring, KeyringError> {
        file_modes::ensure_private_dir(dir).map_err(io_err(dir))?;
        let mut keys = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
            let path = entry.map_err(io_err(dir))?.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("json") => {}
                // A key write that a crash cut short: never made active.
                Some("tmp") => {
                    std::fs::remove_file(&path).map_err(io_err(&path))?;
                    continue;
                }
                _ => continue,
            }
            keys.push(read_key(&path)?);
        }
        let keyring = Keyring {
            dir: dir.to_path_buf(),
            keys: RwLock::new(Vec::new()),
        };
        if keys.is_empty() {
            let key = Key::generate(now_ms());
            keyring.write_key(&key)?;
            tracing::info!(dir = %dir.display(), key_id = %key.id, "made the first keyring key");
            keys.push(key);
        }
        keys.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        *keyring.keys.write_locked() = keys;
        Ok(keyring)
    }

    /// The directory of the key files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The ID of the key that seals.
    pub fn active_id(&self) -> String {
        self.keys
            .read_locked()
            .last()
            .map(|k| k.id.clone())
            .unwrap_or_default()
    }

    /// The IDs of every key, oldest first.
    pub fn key_ids(&self) -> Vec<String> {
        self.keys
            .read_locked()
            .iter()
            .map(|k| k.id.clone())
            .collect()
    }

    /// Seal `plaintext` for the record `aad` with the active key.
    pub fn seal(&self, plaintext: &[u8], aad: &str) -> Result<Sealed, KeyringError> {
        let keys = self.keys.read_locked();
        let key = keys.last().ok_or(KeyringError::Seal)?;
        seal_with(key, plaintext, aad)
    }

    /// Open what [`Keyring::seal`] sealed for the record `aad`.
    pub fn open_sealed(&self, sealed: &Sealed, aad: &str) -> Result<Vec<u8>, KeyringError> {
        if sealed.version != SEALED_VERSION {
            return Err(KeyringError::Malformed(format!(
                "sealed format {} is not one this berth reads ({SEALED_VERSION})",
                sealed.version
            )));
        }
        let keys = self.keys.read_locked();
        let key = keys.iter().find(|k| k.id == sealed.key_id).ok_or_else(|| {
            KeyringError::MissingKey {
                key_id: sealed.key_id.clone(),
                dir: self.dir.display().to_string(),
            }
        })?;
        let nonce = B64
            .decode(&sealed.nonce)
            .map_err(|e| KeyringError::Malformed(format!("nonce: {e}")))?;
        if nonce.len() != 24 {
            return Err(KeyringError::Malformed(format!(
                "nonce is {} bytes, not 24",
                nonce.len()
            )));
        }
        let ciphertext = B64
            .decode(&sealed.ciphertext)
            .map_err(|e| KeyringError::Malformed(format!("ciphertext: {e}")))?;
        key.cipher
            .decrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: &ciphertext,
                    aad: aad.as_bytes(),
                },
            )
            .map_err(|_| KeyringError::Corrupt {
                key_id: sealed.key_id.clone(),
            })
    }

    /// Make a new key, write its file, and make it the one that seals.
    /// The older keys still open what they sealed until
    /// [`Keyring::retire_all_but_active`].
    pub fn add_key(&self) -> Result<String, KeyringError> {
        let mut keys = self.keys.write_locked();
        let newest = keys.last().map(|k| k.created_ms).unwrap_or(0);
        let key = Key::generate(now_ms().max(newest.saturating_add(1)));
        self.write_key(&key)?;
        let id = key.id.clone();
        keys.push(key);
        Ok(id)
    }

    /// Forget the key `key_id` and remove its file (undoing an
    /// [`Keyring::add_key`] whose re-seal failed).
    pub fn remove_key(&self, key_id: &str) -> Result<(), KeyringError> {
        let mut keys = self.keys.write_locked();
        keys.retain(|k| k.id != key_id);
        let path = self.key_path(key_id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    /// Remove every key but the active one, once nothing is sealed with
    /// them any more. Returns the IDs removed.
    pub fn retire_all_but_active(&self) -> Result<Vec<String>, KeyringError> {
        let old: Vec<String> = {
            let keys = self.keys.read_locked();
            let n = keys.len().saturating_sub(1);
            keys[..n].iter().map(|k| k.id.clone()).collect()
        };
        for id in &old {
            self.remove_key(id)?;
        }
        Ok(old)
    }

    fn key_path(&self, key_id: &str) -> PathBuf {
        self.dir.join(format!("{key_id}.json"))
    }

    /// Writes the key's file (mode 0600) through a temp file and a rename,
    /// synced, so a crash leaves the whole key or none.
    fn write_key(&self, key: &Key) -> Result<(), KeyringError> {
        let path = self.key_path(&key.id);
        let tmp = self.dir.join(format!(".{}.json.tmp", key.id));
        let file = KeyFile {
            id: key.id.clone(),
            created_ms: key.created_ms,
            key: B64.encode(key.material),
        };
        let text = serde_json::to_vec(&file).map_err(|e| KeyringError::BadKeyFile {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        let mut f = file_modes::create_private_file(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&text).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&self.dir))?;
        Ok(())
    }
}

fn seal_with(key: &Key, plaintext: &[u8], aad: &str) -> Result<Sealed, KeyringError> {
    let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
    let ciphertext = key
        .cipher
        .encrypt(
            &nonce,
            Payload {
                msg: plaintext,
                aad: aad.as_bytes(),
            },
        )
        .map_err(|_| KeyringError::Seal)?;
    Ok(Sealed {
        version: SEALED_VERSION,
        key_id: key.id.clone(),
        nonce: B64.encode(nonce),
        ciphertext: B64.encode(ciphertext),
    })
}

fn read_key(path: &Path) -> Result<Key, KeyringError> {
    file_modes::narrow_file(path, 0o600).map_err(io_err(path))?;
    let bad = |why: String| KeyringError::BadKeyFile {
        path: path.display().to_string(),
        why,
    };
    let text = std::fs::read(path).map_err(io_err(path))?;
    let file: KeyFile = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    if file.id != stem || !file.id.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(bad(format!(
            "its ID {:?} is not its file name's {stem:?}",
            file.id
        )));
    }
    let material = B64
        .decode(&file.key)
        .map_err(|e| bad(format!("key is not base64: {e}")))?;
    if material.len() != 32 {
        return Err(bad(format!("key is {} bytes, not 32", material.len())));
    }
    let material = *chacha20poly1305::Key::from_slice(&material);
    Ok(Key {
        id: file.id,
        created_ms: file.created_ms,
        cipher: XChaCha20Poly1305::new(&material),
        material,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keyring_opens_what_it_sealed_after_a_restart_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keyring = Keyring::open(&dir.path().join(KEYRING_DIR)).expect("open");
        let sealed = keyring.seal(b"hunter2", "volumes/v").expect("seal");
        assert_eq!(sealed.key_id, keyring.active_id());
        assert!(!format!("{sealed:?}").contains(&sealed.ciphertext));
        let again = Keyring::open(keyring.dir()).expect("reopen");
        assert_eq!(again.key_ids(), keyring.key_ids());
        assert_eq!(
            again.open_sealed(&sealed, "volumes/v").expect("open"),
            b"hunter2"
        );
        let e = again
            .open_sealed(&sealed, "volumes/w")
            .expect_err("another record");
        assert!(matches!(e, KeyringError::Corrupt { .. }), "{e}");
        let mut newer = sealed.clone();
        newer.version = 2;
        let e = again
            .open_sealed(&newer, "volumes/v")
            .expect_err("unknown format");
        assert!(e.to_string().contains("sealed format 2"), "{e}");
    }

    #[test]
    fn an_added_key_seals_and_the_old_one_opens_until_it_is_retired() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keyring = Keyring::open(&dir.path().join(KEYRING_DIR)).expect("open");
        let old = keyring.active_id();
        let sealed_old = keyring.seal(b"a", "r").expect("seal");
        let new = keyring.add_key().expect("add");
        assert_ne!(old, new);
        assert_eq!(keyring.seal(b"b", "r").expect("seal").key_id, new);
        assert_eq!(
            keyring.open_sealed(&sealed_old, "r").expect("old opens"),
            b"a"
        );
        // The newest key seals after a restart too.
        assert_eq!(
            Keyring::open(keyring.dir()).expect("reopen").active_id(),
            new
        );
        assert_eq!(
            keyring.retire_all_but_active().expect("retire"),
            std::slice::from_ref(&old)
        );
        assert!(!keyring.dir().join(format!("{old}.json")).exists());
        let e = keyring.open_sealed(&sealed_old, "r").expect_err("retired");
        assert!(
            e.to_string().contains(&format!(
                "sealed with key {old}, which is not in the keyring"
            )),
            "{e}"
        );
    }

    #[test]
    fn a_bad_key_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ring = dir.path().join(KEYRING_DIR);
        let keyring = Keyring::open(&ring).expect("open");
        let path = ring.join(format!("{}.json", keyring.active_id()));
        for (text, why) in [
            ("not json", "is not a key"),
            (
                r#"{"id":"x","created_ms":1,"key":"AAAA"}"#,
                "is not its file name's",
            ),
        ] {
            std::fs::write(&path, text).expect("write");
            let e = Keyring::open(&ring).expect_err("a bad key file");
            let shown = e.to_string();
            assert!(
                shown.contains(&path.display().to_string()) && shown.contains(why),
                "{shown}"
            );
        }
        let id = keyring.active_id();
        std::fs::write(
            &path,
            format!(r#"{{"id":"{id}","created_ms":1,"key":"AAAA"}}"#),
        )
        .expect("write");
        let e = Keyring::open(&ring).expect_err("a short key");
        assert!(e.to_string().contains("key is 3 bytes, not 32"), "{e}");
    }
}
