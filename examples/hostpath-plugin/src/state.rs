//! The plugin's own state: volumes, their capacity and where they are
//! controller-published. Kept in `<state-dir>/state.json`, written
//! atomically on every change and reloaded at start.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::error::Error;

/// File name of the state file inside the state directory.
pub const STATE_FILE: &str = "state.json";
/// Directory (inside the state directory) holding one directory per volume.
pub const VOLUMES_DIR: &str = "volumes";

/// Version of the state file format written by this build.
const FORMAT_VERSION: u32 = 1;

/// Namespace of the name-based (v5) UUIDs used as volume IDs.
const VOLUME_ID_NAMESPACE: Uuid = Uuid::from_u128(0x5b0d_1c52_8f3e_4a57_9d1e_6c0b_2f4a_7e31);

/// The volume ID for a CreateVolume `name`: a v5 UUID of the name, so a
/// retried CreateVolume finds the volume it made before.
pub fn volume_id_for(name: &str) -> String {
    Uuid::new_v5(&VOLUME_ID_NAMESPACE, name.as_bytes())
        .hyphenated()
        .to_string()
}

/// Whether `id` has the form of an ID this plugin hands out. Only such IDs
/// are ever turned into paths, so a request cannot point outside the
/// volumes directory.
pub fn is_volume_id(id: &str) -> bool {
    Uuid::try_parse(id).is_ok_and(|u| u.hyphenated().to_string() == id)
}

/// The directory backing volume `volume_id`.
pub fn volume_dir(state_dir: &Path, volume_id: &str) -> PathBuf {
    state_dir.join(VOLUMES_DIR).join(volume_id)
}

/// Everything the plugin remembers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// Volumes by ID.
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeRecord>,
}

/// One provisioned volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub volume_id: String,
    /// The CreateVolume name.
    pub name: String,
    pub capacity_bytes: i64,
    /// CreateVolume parameters, checked when a CreateVolume is repeated.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Controller publications by node ID.
    #[serde(default)]
    pub publications: BTreeMap<String, Publication>,
}

/// A ControllerPublishVolume that succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    pub readonly: bool,
    /// The CSI access mode name, e.g. `SINGLE_NODE_WRITER`.
    pub access_mode: String,
}

/// The on-disk form.
#[derive(Serialize, Deserialize)]
struct StateFile {
    version: u32,
    #[serde(flatten)]
    state: State,
}

/// The state, in memory and on disk. Changes are made on a copy, saved, and
/// only then become visible, so memory never gets ahead of the disk.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    state: Mutex<State>,
}

impl Store {
    /// Loads the state file of `state_dir`, or starts empty if there is none.
    pub fn open(state_dir: &Path) -> Result<Self, Error> {
        let path = state_dir.join(STATE_FILE);
        let state = load(&path)?;
        Ok(Self {
            path,
            state: Mutex::new(state),
        })
    }

    /// Runs `f` on the current state.
    pub async fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&*self.state.lock().await)
    }

    /// Applies `f` to a copy of the state; if it succeeds and changed
    /// something, saves the copy and makes it current.
    pub async fn update<R>(
        &self,
        f: impl FnOnce(&mut State) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let mut current = self.state.lock().await;
        let mut next = current.clone();
        let result = f(&mut next)?;
        if next != *current {
            let bytes = encode(&next)?;
            let path = self.path.clone();
            tokio::task::spawn_blocking(move || write_atomic(&path, &bytes))
                .await
                .map_err(|e| Error::Internal(format!("state writer failed: {e}")))?
                .map_err(Error::Persist)?;
            *current = next;
        }
        Ok(result)
    }

    /// Re-reads the state file, picking up changes made by another plugin
    /// process (a controller) that shares the state directory.
    pub async fn reload(&self) -> Result<(), Error> {
        let mut current = self.state.lock().await;
        let path = self.path.clone();
        *current = tokio::task::spawn_blocking(move || load(&path))
            .await
            .map_err(|e| Error::Internal(format!("state reader failed: {e}")))??;
        Ok(())
    }
}

fn encode(state: &State) -> Result<Vec<u8>, Error> {
    let file = StateFile {
        version: FORMAT_VERSION,
        state: state.clone(),
    };
    let mut bytes = serde_json::to_vec_pretty(&file)
        .map_err(|e| Error::Internal(format!("encoding state: {e}")))?;
    bytes.push(b'\n');
    Ok(bytes)
}

fn load(path: &Path) -> Result<State, Error> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(State::default()),
        Err(e) => return Err(Error::io("reading", path)(e)),
    };
    let file: StateFile = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Internal(format!("state file {} is corrupt: {e}", path.display())))?;
    if file.version > FORMAT_VERSION {
        return Err(Error::Internal(format!(
            "state file {} has format version {}, newer than this plugin's {FORMAT_VERSION}",
            path.display(),
            file.version
        )));
    }
    Ok(file.state)
}

/// Replaces `path` with `bytes` atomically: a crash leaves either the old or
/// the new content, never a torn file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_owned();
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = dir.join(tmp_name);

    let write = || -> io::Result<()> {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        File::open(dir)?.sync_all()
    };
    write().inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> State {
        let mut state = State::default();
        let id = volume_id_for("vol-a");
        state.volumes.insert(
            id.clone(),
            VolumeRecord {
                volume_id: id,
                name: "vol-a".into(),
                capacity_bytes: 1 << 30,
                parameters: [("k".to_owned(), "v".to_owned())].into(),
                publications: [(
                    "node-1".to_owned(),
                    Publication {
                        readonly: true,
                        access_mode: "SINGLE_NODE_READER_ONLY".into(),
                    },
                )]
                .into(),
            },
        );
        state
    }

    #[test]
    fn volume_ids_are_deterministic_uuids() {
        let a = volume_id_for("vol-a");
        assert_eq!(a, volume_id_for("vol-a"));
        assert_ne!(a, volume_id_for("vol-b"));
        assert!(is_volume_id(&a));
        assert_eq!(Uuid::parse_str(&a).unwrap().get_version_num(), 5);
    }

    #[test]
    fn only_canonical_uuids_are_volume_ids() {
        assert!(!is_volume_id(""));
        assert!(!is_volume_id("../../etc"));
        assert!(!is_volume_id("vol-a"));
        let id = volume_id_for("x");
        assert!(!is_volume_id(&id.to_uppercase()));
        assert!(!is_volume_id(&id.replace('-', "")));
        assert!(!is_volume_id(&format!("{{{id}}}")));
    }

    #[tokio::test]
    async fn state_round_trips_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.read(|s| s.clone()).await, State::default());
        assert!(!dir.path().join(STATE_FILE).exists(), "nothing written yet");

        let want = sample();
        let w = want.clone();
        store
            .update(|s| {
                *s = w;
                Ok(())
            })
            .await
            .unwrap();

        let reopened = Store::open(dir.path()).unwrap();
        assert_eq!(reopened.read(|s| s.clone()).await, want);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [STATE_FILE], "no temporary file is left behind");
    }

    #[tokio::test]
    async fn failed_update_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let err = store
            .update(|s| {
                s.volumes.clear();
                s.volumes.extend(sample().volumes);
                Err::<(), _>(Error::NotFound("no".into()))
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotFound(_)));
        assert!(store.read(|s| s.volumes.is_empty()).await);
        assert!(!dir.path().join(STATE_FILE).exists());
    }

    #[tokio::test]
    async fn reload_sees_another_writer() {
        let dir = tempfile::tempdir().unwrap();
        let reader = Store::open(dir.path()).unwrap();
        let writer = Store::open(dir.path()).unwrap();
        writer
            .update(|s| {
                *s = sample();
                Ok(())
            })
            .await
            .unwrap();
        assert!(reader.read(|s| s.volumes.is_empty()).await);
        reader.reload().await.unwrap();
        assert_eq!(reader.read(|s| s.clone()).await, sample());
    }

    #[test]
    fn rejects_corrupt_and_future_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STATE_FILE);
        fs::write(&path, b"{not json").unwrap();
        assert!(Store::open(dir.path()).is_err());
        fs::write(&path, br#"{"version": 99, "volumes": {}}"#).unwrap();
        assert!(Store::open(dir.path()).is_err());
        fs::write(&path, br#"{"version": 1}"#).unwrap();
        assert!(Store::open(dir.path()).is_ok());
    }

    #[test]
    fn file_format_is_stable() {
        let text = String::from_utf8(encode(&sample()).unwrap()).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["version"], 1);
        let id = volume_id_for("vol-a");
        let vol = &value["volumes"][&id];
        assert_eq!(vol["name"], "vol-a");
        assert_eq!(vol["capacity_bytes"], 1 << 30);
        assert_eq!(vol["publications"]["node-1"]["readonly"], true);
    }
}
