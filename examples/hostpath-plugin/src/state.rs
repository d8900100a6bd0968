//! The plugin's own state: volumes, their capacity, where they are
//! controller-published, and the nodes that serve the state directory. Kept
//! in `<state-dir>/state.json`.
//!
//! Several plugin instances (one per node) may share one state directory, the
//! way nodes share an NFS export. So the file on disk is the only copy:
//! every read loads it under a shared `flock` on `<state-dir>/state.lock`,
//! and every change takes the exclusive lock, re-reads the file, applies the
//! change and writes the file atomically (temporary file, fsync, rename)
//! before giving the lock back. No change made through one instance is lost
//! to a change made through another, and each instance sees the others'
//! changes at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::Error;

/// File name of the state file inside the state directory.
pub const STATE_FILE: &str = "state.json";
/// File name of the lock file inside the state directory.
pub const LOCK_FILE: &str = "state.lock";
/// Directory (inside the state directory) holding one directory per volume.
pub const VOLUMES_DIR: &str = "volumes";
/// Directory (inside the state directory) holding one copy per snapshot.
pub const SNAPSHOTS_DIR: &str = "snapshots";

/// How long a reader or writer waits for the state lock before giving up
/// with `UNAVAILABLE`: an instance that holds it longer is stuck (stopped,
/// or its disk is), and the CO retries the call.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(20);
/// The longest pause between two attempts to take the lock.
const LOCK_POLL_MAX: Duration = Duration::from_millis(20);

/// Version of the state file format written by this build.
const FORMAT_VERSION: u32 = 1;

/// Namespace of the name-based (v5) UUIDs used as volume IDs.
const VOLUME_ID_NAMESPACE: Uuid = Uuid::from_u128(0x5b0d_1c52_8f3e_4a57_9d1e_6c0b_2f4a_7e31);
/// Namespace of the name-based (v5) UUIDs used as snapshot IDs.
const SNAPSHOT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x0c7a_52e1_93d4_4b8f_a6e0_1f3d_77b2_c945);

/// The snapshot ID for a CreateSnapshot `name`: a v5 UUID of the name (in a
/// namespace of its own, so it never equals a volume ID), so a retried
/// CreateSnapshot finds the snapshot it made before. Snapshot IDs have the
/// form [`is_volume_id`] checks.
pub fn snapshot_id_for(name: &str) -> String {
    Uuid::new_v5(&SNAPSHOT_ID_NAMESPACE, name.as_bytes())
        .hyphenated()
        .to_string()
}

/// Where the copy of snapshot `snapshot_id` lives: a directory, or an image
/// file for a snapshot of an image-backed volume. `snapshot_id` must
/// satisfy [`is_volume_id`].
pub fn snapshot_path(state_dir: &Path, snapshot_id: &str) -> PathBuf {
    state_dir.join(SNAPSHOTS_DIR).join(snapshot_id)
}

/// Where the data of `volume` lives: its directory, or its image file.
pub fn volume_data_path(state_dir: &Path, volume: &VolumeRecord) -> PathBuf {
    match volume.backing {
        Backing::Directory => volume_dir(state_dir, &volume.volume_id),
        Backing::Image => crate::image::image_path(state_dir, &volume.volume_id),
    }
}

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
    /// The node IDs of the plugin instances that serve this state directory:
    /// the nodes a volume can be controller-published to.
    #[serde(default)]
    pub nodes: BTreeSet<String>,
    /// Snapshots by ID.
    #[serde(default)]
    pub snapshots: BTreeMap<String, SnapshotRecord>,
    /// The topology segments of the nodes in `nodes` that were started
    /// with `--topology`.
    #[serde(default)]
    pub node_topology: BTreeMap<String, BTreeMap<String, String>>,
}

impl State {
    /// The topology segments node `node_id` serves (empty for none).
    pub fn topology_of_node(&self, node_id: &str) -> BTreeMap<String, String> {
        self.node_topology.get(node_id).cloned().unwrap_or_default()
    }
}

/// One snapshot: a copy of a volume's data taken at `created`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub snapshot_id: String,
    /// The CreateSnapshot name.
    pub name: String,
    pub source_volume_id: String,
    /// The capacity of the source volume when the snapshot was taken: a
    /// volume made from the snapshot is at least this big.
    pub size_bytes: i64,
    /// Creation time, seconds and nanoseconds since the Unix epoch.
    pub created_secs: i64,
    #[serde(default)]
    pub created_nanos: i32,
    /// The backing of the source volume, which the copy has too.
    #[serde(default)]
    pub backing: Backing,
    /// CreateSnapshot parameters.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

/// What a volume was pre-populated from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

/// One provisioned volume.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// What holds the volume's data.
    #[serde(default)]
    pub backing: Backing,
    /// The topology segments the volume is accessible from: those of the
    /// instance that created it. Empty: accessible from every instance.
    #[serde(default)]
    pub topology: BTreeMap<String, String>,
    /// The snapshot or volume the volume was pre-populated from.
    #[serde(default)]
    pub content_source: Option<ContentSource>,
}

/// Whether an instance serving `offered` satisfies the topology `wanted`:
/// every key of `wanted` has the same value in `offered`. An empty `wanted`
/// is satisfied everywhere.
pub fn topology_satisfied(
    offered: &BTreeMap<String, String>,
    wanted: &BTreeMap<String, String>,
) -> bool {
    wanted.iter().all(|(k, v)| offered.get(k) == Some(v))
}

/// A topology as `{k1=v1, k2=v2}`, for messages.
pub fn describe_topology(segments: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = segments.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", pairs.join(", "))
}

/// Checks that `volume` can be used by the instance of `node_id` serving the
/// topology `offered`: answers `FAILED_PRECONDITION`, naming both
/// topologies, when the volume was placed elsewhere.
pub fn check_accessible(
    volume: &VolumeRecord,
    node_id: &str,
    offered: &BTreeMap<String, String>,
) -> Result<(), Error> {
    if topology_satisfied(offered, &volume.topology) {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "volume {} is accessible from topology {}, which node {node_id} (topology {}) is not in",
        volume.volume_id,
        describe_topology(&volume.topology),
        describe_topology(offered)
    )))
}

/// What holds a volume's data: chosen by the CreateVolume parameter
/// `backing` (`directory`, the default, or `image`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backing {
    /// A directory `<state-dir>/volumes/<id>`, bind-mounted.
    #[default]
    Directory,
    /// A sparse file `<state-dir>/images/<id>.img` holding an ext4
    /// filesystem, attached to a loop device on the node that stages it.
    Image,
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

/// The state file and its lock; cheap to clone. Holds no copy of the state:
/// every call reads the file, so changes made by another instance sharing
/// the directory are seen at once.
#[derive(Debug, Clone)]
pub struct Store {
    paths: Arc<Paths>,
}

#[derive(Debug)]
struct Paths {
    state: PathBuf,
    lock: PathBuf,
    lock_timeout: Duration,
}

impl Store {
    /// Opens the state of `state_dir` (creating its lock file), checking that
    /// the state file, if there is one, is readable by this build.
    pub fn open(state_dir: &Path) -> Result<Self, Error> {
        let store = Self {
            paths: Arc::new(Paths {
                state: state_dir.join(STATE_FILE),
                lock: state_dir.join(LOCK_FILE),
                lock_timeout: LOCK_TIMEOUT,
            }),
        };
        store.read_blocking(|_| ())?;
        Ok(store)
    }

    /// The same store, waiting at most `timeout` for the state lock.
    pub fn with_lock_timeout(self, timeout: Duration) -> Self {
        Self {
            paths: Arc::new(Paths {
                state: self.paths.state.clone(),
                lock: self.paths.lock.clone(),
                lock_timeout: timeout,
            }),
        }
    }

    /// Runs `f` on the current state, read under the shared lock.
    pub async fn read<R, F>(&self, f: F) -> Result<R, Error>
    where
        F: FnOnce(&State) -> R + Send + 'static,
        R: Send + 'static,
    {
        let store = self.clone();
        offload("state reader", move || store.read_blocking(f)).await
    }

    /// Under the exclusive lock, applies `f` to the current state re-read
    /// from disk and, if it succeeds and changed something, saves the result
    /// before the lock is given back. `f` may also do file-system work that
    /// must not interleave with another instance's change (creating or
    /// removing a volume directory); an error from `f` saves nothing.
    pub async fn update<R, F>(&self, f: F) -> Result<R, Error>
    where
        F: FnOnce(&mut State) -> Result<R, Error> + Send + 'static,
        R: Send + 'static,
    {
        let store = self.clone();
        offload("state writer", move || store.update_blocking(f)).await
    }

    /// [`Store::read`], on the calling thread.
    pub fn read_blocking<R>(&self, f: impl FnOnce(&State) -> R) -> Result<R, Error> {
        let _lock = self.lock(FlockArg::LockSharedNonblock)?;
        Ok(f(&load(&self.paths.state)?))
    }

    /// [`Store::update`], on the calling thread.
    pub fn update_blocking<R>(
        &self,
        f: impl FnOnce(&mut State) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let _lock = self.lock(FlockArg::LockExclusiveNonblock)?;
        let current = load(&self.paths.state)?;
        let mut next = current.clone();
        let result = f(&mut next)?;
        if next != current {
            write_atomic(&self.paths.state, &encode(&next)?).map_err(Error::Persist)?;
        }
        Ok(result)
    }

    /// Takes the lock (`arg` is a non-blocking shared or exclusive lock),
    /// retrying until the lock timeout ([`LOCK_TIMEOUT`] by default). The lock is given back when the
    /// returned file is dropped. Each call opens the lock file anew, so
    /// calls within one process exclude each other as well.
    fn lock(&self, arg: FlockArg) -> Result<Flock<File>, Error> {
        let path = &self.paths.lock;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(path)
            .map_err(Error::io("opening", path))?;
        let started = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            match Flock::lock(file, arg) {
                Ok(locked) => return Ok(locked),
                Err((unlocked, Errno::EWOULDBLOCK | Errno::EINTR)) => {
                    let waited = started.elapsed();
                    if waited >= self.paths.lock_timeout {
                        return Err(Error::StateLocked {
                            path: path.clone(),
                            waited,
                        });
                    }
                    std::thread::sleep(pause);
                    pause = pause.saturating_mul(2).min(LOCK_POLL_MAX);
                    file = unlocked;
                }
                Err((_, e)) => return Err(Error::sys("locking", path)(e)),
            }
        }
    }
}

/// Runs blocking state-file work off the async runtime.
async fn offload<R: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> Result<R, Error> + Send + 'static,
) -> Result<R, Error> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Internal(format!("{what} failed: {e}")))?
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
                backing: Backing::Image,
                topology: [("zone".to_owned(), "z1".to_owned())].into(),
                content_source: Some(ContentSource::Snapshot(snapshot_id_for("snap-a"))),
            },
        );
        let snap = snapshot_id_for("snap-a");
        state.snapshots.insert(
            snap.clone(),
            SnapshotRecord {
                snapshot_id: snap,
                name: "snap-a".into(),
                source_volume_id: volume_id_for("vol-a"),
                size_bytes: 1 << 30,
                created_secs: 1_700_000_000,
                created_nanos: 5,
                backing: Backing::Directory,
                parameters: BTreeMap::new(),
            },
        );
        state
    }

    fn segments(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn topology_is_satisfied_when_every_key_matches() {
        let node_a = segments(&[("node", "a"), ("zone", "z1")]);
        assert!(topology_satisfied(&node_a, &segments(&[])));
        assert!(topology_satisfied(&node_a, &segments(&[("zone", "z1")])));
        assert!(topology_satisfied(&node_a, &node_a));
        assert!(!topology_satisfied(&node_a, &segments(&[("zone", "z2")])));
        assert!(!topology_satisfied(
            &node_a,
            &segments(&[("zone", "z1"), ("rack", "r1")])
        ));
        assert!(!topology_satisfied(
            &segments(&[]),
            &segments(&[("zone", "z1")])
        ));
    }

    #[test]
    fn a_volume_is_accessible_only_within_its_topology() {
        let mut volume = sample().volumes.into_values().next().unwrap();
        check_accessible(&volume, "n1", &segments(&[("zone", "z1"), ("node", "n1")])).unwrap();
        let err = check_accessible(&volume, "n2", &segments(&[("zone", "z2")])).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        let msg = err.to_string();
        assert!(
            msg.contains("{zone=z1}") && msg.contains("{zone=z2}") && msg.contains("n2"),
            "{msg}"
        );
        let err = check_accessible(&volume, "n3", &segments(&[])).unwrap_err();
        assert!(err.to_string().contains("{}"), "{err}");
        volume.topology.clear();
        check_accessible(&volume, "n3", &segments(&[])).unwrap();
    }

    #[test]
    fn records_without_topology_decode() {
        let text = br#"{"version": 1, "volumes": {"x": {"volume_id": "x", "name": "x",
            "capacity_bytes": 1}}}"#;
        let file: StateFile = serde_json::from_slice(text).unwrap();
        assert!(file.state.volumes["x"].topology.is_empty());
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
    fn snapshot_ids_differ_from_volume_ids() {
        let s = snapshot_id_for("a");
        assert_eq!(s, snapshot_id_for("a"));
        assert_ne!(s, volume_id_for("a"));
        assert!(is_volume_id(&s));
        let dir = Path::new("/s");
        assert_eq!(snapshot_path(dir, &s), dir.join("snapshots").join(&s));
        let mut volume = VolumeRecord {
            volume_id: volume_id_for("a"),
            ..Default::default()
        };
        assert_eq!(
            volume_data_path(dir, &volume),
            volume_dir(dir, &volume.volume_id)
        );
        volume.backing = Backing::Image;
        assert_eq!(
            volume_data_path(dir, &volume),
            crate::image::image_path(dir, &volume.volume_id)
        );
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
        assert_eq!(store.read(|s| s.clone()).await.unwrap(), State::default());
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
        assert_eq!(reopened.read(|s| s.clone()).await.unwrap(), want);
        let mut names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [STATE_FILE, LOCK_FILE],
            "no temporary file is left behind"
        );
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
        assert!(store.read(|s| s.volumes.is_empty()).await.unwrap());
        assert!(!dir.path().join(STATE_FILE).exists());
    }

    #[tokio::test]
    async fn reads_see_another_writer_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let reader = Store::open(dir.path()).unwrap();
        let writer = Store::open(dir.path()).unwrap();
        assert!(reader.read(|s| s.volumes.is_empty()).await.unwrap());
        writer
            .update(|s| {
                *s = sample();
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!(reader.read(|s| s.clone()).await.unwrap(), sample());
    }

    #[test]
    fn concurrent_writers_through_separate_stores_lose_no_update() {
        let dir = tempfile::tempdir().unwrap();
        let stores: Vec<_> = (0..4).map(|_| Store::open(dir.path()).unwrap()).collect();
        std::thread::scope(|scope| {
            for (n, store) in stores.iter().enumerate() {
                scope.spawn(move || {
                    for i in 0..10 {
                        let name = format!("vol-{n}-{i}");
                        store
                            .update_blocking(|s| {
                                let id = volume_id_for(&name);
                                s.volumes.insert(
                                    id.clone(),
                                    VolumeRecord {
                                        volume_id: id,
                                        name,
                                        capacity_bytes: 0,
                                        parameters: BTreeMap::new(),
                                        publications: BTreeMap::new(),
                                        backing: Backing::default(),
                                        topology: BTreeMap::new(),
                                        content_source: None,
                                    },
                                );
                                Ok(())
                            })
                            .unwrap();
                    }
                });
            }
        });
        let count = stores[0].read_blocking(|s| s.volumes.len()).unwrap();
        assert_eq!(count, 40, "every writer's volumes are in the state");
    }

    #[tokio::test]
    async fn a_held_lock_makes_changes_wait_then_give_up() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path())
            .unwrap()
            .with_lock_timeout(Duration::from_millis(200));
        let lock_file = File::open(dir.path().join(LOCK_FILE)).unwrap();
        let held = Flock::lock(lock_file, FlockArg::LockExclusive).unwrap();

        let started = Instant::now();
        let err = store
            .update(|s| {
                *s = sample();
                Ok(())
            })
            .await
            .unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(matches!(err, Error::StateLocked { .. }), "{err}");
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(err.to_string().contains(LOCK_FILE), "{err}");
        let err = store.read(|s| s.clone()).await.unwrap_err();
        assert!(matches!(err, Error::StateLocked { .. }), "{err}");

        drop(held);
        store
            .update(|s| {
                *s = sample();
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!(store.read(|s| s.clone()).await.unwrap(), sample());
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
        assert_eq!(vol["topology"]["zone"], "z1");
        let snap = snapshot_id_for("snap-a");
        assert_eq!(vol["content_source"]["snapshot"], snap.as_str());
        let snapshot = &value["snapshots"][&snap];
        assert_eq!(snapshot["source_volume_id"], id.as_str());
        assert_eq!(snapshot["size_bytes"], 1 << 30);
        assert_eq!(snapshot["created_secs"], 1_700_000_000);
    }
}
