//! The client's state database: one crash-safe redb file under
//! `<data_dir>/client/`, mode 0600, with a schema version. It holds the node
//! identity (node ID and node secret),
//! the time of the last heartbeat, the CSI plugin registry, the volume
//! stubs, and the allocs this node runs with their states and task handles
//! (what a restarted client reattaches to). A record that fails to decode is reported and moved to a
//! quarantine table; it never stops the agent from starting.

use berth_sync::RwLockExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use berth_allocrunner::{
    AllocStateStore, Persist, PersistedAllocState, RestoredAlloc, StateError as StoreError,
    TaskHandleRecord,
};
use berth_csimanager::{
    PluginRegistration, StoreError as CsiStoreError, VolumeStateStore, VolumeStub,
};
use berth_structs::{Allocation, NodeSecret};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
const PLUGINS: TableDefinition<&str, &[u8]> = TableDefinition::new("csi_plugins");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("csi_volumes");
const ALLOCS: TableDefinition<&str, &[u8]> = TableDefinition::new("allocs");
const ALLOC_STATES: TableDefinition<&str, &[u8]> = TableDefinition::new("alloc_states");
/// Keyed `<alloc_id>/<task>`.
const TASK_HANDLES: TableDefinition<&str, &[u8]> = TableDefinition::new("task_handles");
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");

/// redb's page cache (reads and buffered writes). Its default, 1 GiB,
/// would keep the whole file in the agent's memory as it grows with the
/// allocs; the client reads the database in full only when it starts, and
/// the pages a write walks stay within this.
const CACHE_BYTES: usize = 1 << 20;

/// The schema this build writes. Opening a database with a newer schema is
/// refused rather than misread.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("client state database {path}")]
    Open {
        path: String,
        #[source]
        source: redb::DatabaseError,
    },
    #[error("client state database: {0}")]
    Db(String),
    #[error(
        "client state database has schema version {found}, newer than this berth ({SCHEMA_VERSION}); \
         refusing to read it"
    )]
    TooNew { found: u32 },
    #[error("client state database: an earlier write failed on I/O (is the disk full?)")]
    PreviousIo,
    #[error("client state {path}: setting its mode to 0600 (0700 for the directory): {source}")]
    Mode {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The node's identity, created at the client's first start and kept in
/// its state database.
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    pub node_id: String,
    /// Sent with every node RPC; `Debug` redacts it.
    pub secret: NodeSecret,
}

const META_NODE_ID: &str = "node_id";
const META_NODE_SECRET: &str = "node_secret";
/// The cluster the node registered with (see
/// `servers::ServerChannels::pin_cluster`).
const META_CLUSTER_ID: &str = "cluster_id";

/// The database file holds the node secret: readable by its owner only.
/// Created with mode 0600 when missing; a looser mode on an existing file
/// is narrowed.
fn restrict_mode(path: &Path) -> Result<(), StateError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mode_err = |source| StateError::Mode {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(mode_err)?;
    let mode = file.metadata().map_err(mode_err)?.permissions().mode();
    if mode & 0o077 != 0 {
        tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), narrowed_to = "600", "client state database was readable by others; setting mode 0600");
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(mode_err)?;
    }
    Ok(())
}

/// The directory of the database (`<data_dir>/client`): its owner's only.
/// Created with mode 0700 when missing; a looser mode is narrowed.
fn restrict_dir(dir: &Path) -> Result<(), StateError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let mode_err = |source| StateError::Mode {
        path: dir.display().to_string(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(mode_err)?;
    let mode = std::fs::metadata(dir)
        .map_err(mode_err)?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o077 != 0 {
        tracing::warn!(path = %dir.display(), mode = format!("{mode:o}"), narrowed_to = "700", "client state directory was open to others; setting mode 0700");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(mode_err)?;
    }
    Ok(())
}

fn db_err(e: impl std::fmt::Display) -> StateError {
    StateError::Db(e.to_string())
}

/// A redb error, keeping apart the one that asks for the database to be
/// opened again.
fn rdb(e: impl Into<redb::Error>) -> StateError {
    match e.into() {
        redb::Error::PreviousIo => StateError::PreviousIo,
        other => StateError::Db(other.to_string()),
    }
}

/// The client's state database. Cheap to clone; clones share it.
#[derive(Clone)]
pub struct ClientState {
    /// `None` once an I/O error poisoned it: redb refuses every transaction
    /// after a failed write until the file is opened again.
    db: Arc<RwLock<Option<Arc<Database>>>>,
    path: Arc<PathBuf>,
}

impl ClientState {
    pub fn open(dir: &Path) -> Result<ClientState, StateError> {
        restrict_dir(dir)?;
        let path = dir.join("state.redb");
        let db = Self::open_db(&path)?;
        let state = ClientState {
            db: Arc::new(RwLock::new(Some(Arc::new(db)))),
            path: Arc::new(path),
        };
        state.migrate()?;
        Ok(state)
    }

    fn open_db(path: &Path) -> Result<Database, StateError> {
        restrict_mode(path)?;
        Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(path)
            .map_err(|source| StateError::Open {
                path: path.display().to_string(),
                source,
            })
    }

    /// The open database, opened again if an I/O error closed it.
    fn db(&self) -> Result<Arc<Database>, StateError> {
        if let Some(db) = self.db.read_locked().as_ref() {
            return Ok(db.clone());
        }
        let mut slot = self.db.write_locked();
        if let Some(db) = slot.as_ref() {
            return Ok(db.clone());
        }
        let db = Arc::new(Self::open_db(&self.path)?);
        tracing::info!(path = %self.path.display(), "client state database opened again after an I/O error");
        *slot = Some(db.clone());
        Ok(db)
    }

    /// Runs `f` in a write transaction and commits it, synced. After an
    /// I/O error (a full disk) poisoned the database, it is opened again
    /// and `f` is tried once more, so the agent recovers once space is
    /// freed.
    fn write<T>(
        &self,
        f: impl Fn(&redb::WriteTransaction) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        self.write_with(Persist::Synced, f)
    }

    /// [`Self::write`], committed without a sync when `persist` is
    /// [`Persist::Unsynced`]: readers see it at once, and the next synced
    /// commit puts it on disk with its own (redb's `Durability::None`); a
    /// crash before that loses it.
    fn write_with<T>(
        &self,
        persist: Persist,
        f: impl Fn(&redb::WriteTransaction) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        let attempt = || {
            let started = std::time::Instant::now();
            let mut tx = self.db()?.begin_write().map_err(rdb)?;
            if persist == Persist::Unsynced {
                tx.set_durability(Durability::None).map_err(db_err)?;
            }
            let out = f(&tx)?;
            tx.commit().map_err(rdb)?;
            berth_metrics::record_state_commit(berth_metrics::Db::Client, started.elapsed());
            Ok(out)
        };
        match attempt() {
            Err(StateError::PreviousIo) => {
                tracing::warn!(path = %self.path.display(), "client state database hit an I/O error; reopening it");
                self.db.write_locked().take();
                attempt()
            }
            other => other,
        }
    }

    fn migrate(&self) -> Result<(), StateError> {
        let found = self.meta("schema_version")?;
        match found.as_deref().map(str::parse::<u32>) {
            None => self.set_meta("schema_version", &SCHEMA_VERSION.to_string()),
            Some(Ok(v)) if v > SCHEMA_VERSION => Err(StateError::TooNew { found: v }),
            Some(Ok(_)) => Ok(()),
            Some(Err(_)) => Err(StateError::Db(format!(
                "schema_version record is not a number: {found:?}"
            ))),
        }
    }

    pub fn meta(&self, key: &str) -> Result<Option<String>, StateError> {
        let tx = self.db()?.begin_read().map_err(rdb)?;
        let table = match tx.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(db_err(e)),
        };
        let v = table.get(key).map_err(rdb)?;
        Ok(v.map(|v| v.value().to_string()))
    }

    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), StateError> {
        self.write(|tx| {
            let mut t = tx.open_table(META).map_err(rdb)?;
            t.insert(key, value).map_err(rdb)?;
            Ok(())
        })
    }

    /// The cluster the node registered with, once it has.
    pub fn cluster_id(&self) -> Result<Option<String>, StateError> {
        self.meta(META_CLUSTER_ID)
    }

    /// Records the cluster the node registered with.
    pub fn set_cluster_id(&self, id: &str) -> Result<(), StateError> {
        self.set_meta(META_CLUSTER_ID, id)
    }

    /// Whether the servers enforced ACL tokens when they last said (see
    /// [`crate::rpc::ServerConn::cluster_acl`]); `None` before they ever
    /// did, or for a record that is not a boolean.
    pub fn cluster_acl(&self) -> Result<Option<bool>, StateError> {
        Ok(self
            .meta(META_CLUSTER_ACL)?
            .and_then(|v| v.parse::<bool>().ok()))
    }

    /// Records what the servers said of enforcing ACL tokens.
    pub fn set_cluster_acl(&self, enabled: bool) -> Result<(), StateError> {
        self.set_meta(META_CLUSTER_ACL, if enabled { "true" } else { "false" })
    }

    /// The node ID and secret, created (and stored) at the first start. A
    /// database from before node secrets keeps its node ID and gets a
    /// secret; a stored secret that is not one is replaced, and the
    /// servers then refuse the node until an operator purges it.
    pub fn node_identity(&self) -> Result<NodeIdentity, StateError> {
        let node_id = match self.meta(META_NODE_ID)? {
            Some(id) => id,
            None => {
                let id = berth_structs::generate_id();
                self.set_meta(META_NODE_ID, &id)?;
                id
            }
        };
        let stored = self.meta(META_NODE_SECRET)?;
        let secret = match stored.as_deref().map(NodeSecret::parse) {
            Some(Ok(secret)) => secret,
            found => {
                if let Some(Err(e)) = found {
                    tracing::error!(node_id, error = %e, "stored node secret is unusable; creating a new one");
                }
                let secret = NodeSecret::generate();
                self.set_meta(META_NODE_SECRET, secret.expose())?;
                secret
            }
        };
        Ok(NodeIdentity { node_id, secret })
    }

    /// Every record of `table`, decoded. Records that fail to decode, or
    /// that belong under another key than theirs (`key_of`), are moved to
    /// the quarantine table and reported: a record under the wrong key
    /// could never be deleted by its owner and would be restored forever.
    fn load_all<T: DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key_of: impl Fn(&T) -> String,
    ) -> Result<Vec<T>, StateError> {
        let mut good = Vec::new();
        let mut bad: Vec<(String, Vec<u8>, String)> = Vec::new();
        {
            let tx = self.db()?.begin_read().map_err(rdb)?;
            let t = match tx.open_table(table) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(good),
                Err(e) => return Err(db_err(e)),
            };
            for row in t.iter().map_err(rdb)? {
                let (k, v) = row.map_err(rdb)?;
                match serde_json::from_slice::<T>(v.value()) {
                    Ok(rec) if key_of(&rec) == k.value() => good.push(rec),
                    Ok(rec) => bad.push((
                        k.value().to_string(),
                        v.value().to_vec(),
                        format!("the record belongs under key {:?}", key_of(&rec)),
                    )),
                    Err(e) => bad.push((k.value().to_string(), v.value().to_vec(), e.to_string())),
                }
            }
        }
        if !bad.is_empty() {
            self.write(|tx| {
                let mut src = tx.open_table(table).map_err(rdb)?;
                let mut q = tx.open_table(QUARANTINE).map_err(rdb)?;
                for (key, bytes, err) in &bad {
                    tracing::error!(
                        table = %redb::TableHandle::name(&table),
                        key = %key,
                        error = %err,
                        "client state record does not decode; moved to quarantine"
                    );
                    let qkey = format!("{}/{}", redb::TableHandle::name(&table), key);
                    q.insert(qkey.as_str(), bytes.as_slice()).map_err(rdb)?;
                    src.remove(key.as_str()).map_err(rdb)?;
                }
                Ok(())
            })?;
        }
        Ok(good)
    }

    fn put<T: Serialize>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
        value: &T,
    ) -> Result<(), StateError> {
        self.put_with(Persist::Synced, table, key, value)
    }

    fn put_with<T: Serialize>(
        &self,
        persist: Persist,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
        value: &T,
    ) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(value).map_err(db_err)?;
        self.write_with(persist, |tx| {
            let mut t = tx.open_table(table).map_err(rdb)?;
            t.insert(key, bytes.as_slice()).map_err(rdb)?;
            Ok(())
        })
    }

    fn delete(&self, table: TableDefinition<&str, &[u8]>, key: &str) -> Result<(), StateError> {
        self.write(|tx| {
            let mut t = tx.open_table(table).map_err(rdb)?;
            t.remove(key).map_err(rdb)?;
            Ok(())
        })
    }

    /// Keys of quarantined records, `<table>/<key>`.
    pub fn quarantined(&self) -> Result<Vec<String>, StateError> {
        let tx = self.db()?.begin_read().map_err(rdb)?;
        let t = match tx.open_table(QUARANTINE) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(db_err(e)),
        };
        let mut out = Vec::new();
        for row in t.iter().map_err(rdb)? {
            let (k, _) = row.map_err(rdb)?;
            out.push(k.value().to_string());
        }
        Ok(out)
    }

    #[cfg(test)]
    fn put_raw(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
        bytes: &[u8],
    ) -> Result<(), StateError> {
        self.write(|tx| {
            let mut t = tx.open_table(table).map_err(rdb)?;
            t.insert(key, bytes).map_err(rdb)?;
            Ok(())
        })
    }
}

/// A row of [`ALLOC_STATES`]: says which alloc it belongs to, so that it
/// can be read without its key.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct AllocStateRow {
    alloc_id: String,
    state: PersistedAllocState,
}

/// A row of [`TASK_HANDLES`].
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TaskHandleRow {
    alloc_id: String,
    task: String,
    handle: TaskHandleRecord,
}

impl TaskHandleRow {
    /// Its key: `<alloc_id>/<task>`, the prefix `delete_alloc` removes.
    fn key(&self) -> String {
        task_handle_key(&self.alloc_id, &self.task)
    }
}

fn task_handle_key(alloc_id: &str, task: &str) -> String {
    format!("{alloc_id}/{task}")
}

impl AllocStateStore for ClientState {
    fn put_alloc(&self, alloc: &Allocation) -> Result<(), StoreError> {
        self.put(ALLOCS, &alloc.id, alloc)
            .map_err(StoreError::backend)
    }

    fn put_alloc_state(
        &self,
        alloc_id: &str,
        state: &PersistedAllocState,
    ) -> Result<(), StoreError> {
        self.put_alloc_state_with(alloc_id, state, Persist::Synced)
    }

    fn put_alloc_with(&self, alloc: &Allocation, persist: Persist) -> Result<(), StoreError> {
        self.put_with(persist, ALLOCS, &alloc.id, alloc)
            .map_err(StoreError::backend)
    }

    fn put_alloc_state_with(
        &self,
        alloc_id: &str,
        state: &PersistedAllocState,
        persist: Persist,
    ) -> Result<(), StoreError> {
        let row = AllocStateRow {
            alloc_id: alloc_id.to_string(),
            state: state.clone(),
        };
        self.put_with(persist, ALLOC_STATES, alloc_id, &row)
            .map_err(StoreError::backend)
    }

    /// The handle and the state in one synced transaction.
    fn put_task_started(
        &self,
        alloc_id: &str,
        task: &str,
        handle: Option<&TaskHandleRecord>,
        state: &PersistedAllocState,
    ) -> Result<(), StoreError> {
        let handle_key = task_handle_key(alloc_id, task);
        let state_row = serde_json::to_vec(&AllocStateRow {
            alloc_id: alloc_id.to_string(),
            state: state.clone(),
        })
        .map_err(|e| StoreError::codec(alloc_id, e))?;
        let handle_row = handle
            .map(|h| {
                serde_json::to_vec(&TaskHandleRow {
                    alloc_id: alloc_id.to_string(),
                    task: task.to_string(),
                    handle: h.clone(),
                })
            })
            .transpose()
            .map_err(|e| StoreError::codec(handle_key.as_str(), e))?;
        self.write(|tx| {
            if let Some(row) = &handle_row {
                let mut t = tx.open_table(TASK_HANDLES).map_err(rdb)?;
                t.insert(handle_key.as_str(), row.as_slice()).map_err(rdb)?;
            }
            let mut t = tx.open_table(ALLOC_STATES).map_err(rdb)?;
            t.insert(alloc_id, state_row.as_slice()).map_err(rdb)?;
            Ok(())
        })
        .map_err(StoreError::backend)
    }

    fn put_task_handle(
        &self,
        alloc_id: &str,
        task: &str,
        handle: &TaskHandleRecord,
    ) -> Result<(), StoreError> {
        let row = TaskHandleRow {
            alloc_id: alloc_id.to_string(),
            task: task.to_string(),
            handle: handle.clone(),
        };
        self.put(TASK_HANDLES, &task_handle_key(alloc_id, task), &row)
            .map_err(StoreError::backend)
    }

    fn delete_alloc(&self, alloc_id: &str) -> Result<(), StoreError> {
        let prefix = format!("{alloc_id}/");
        self.write(|tx| {
            for table in [ALLOCS, ALLOC_STATES] {
                let mut t = tx.open_table(table).map_err(rdb)?;
                t.remove(alloc_id).map_err(rdb)?;
            }
            let mut t = tx.open_table(TASK_HANDLES).map_err(rdb)?;
            t.retain(|k, _| !k.starts_with(&prefix)).map_err(rdb)?;
            Ok(())
        })
        .map_err(StoreError::backend)
    }

    /// Allocs with their states and handles. A state or handle whose alloc
    /// is missing (or was quarantined) is ignored: without the alloc there
    /// is nothing to restore.
    fn load_allocs(&self) -> Result<Vec<RestoredAlloc>, StoreError> {
        let allocs: Vec<Allocation> = self
            .load_all(ALLOCS, |a: &Allocation| a.id.clone())
            .map_err(StoreError::backend)?;
        let states: Vec<AllocStateRow> = self
            .load_all(ALLOC_STATES, |r: &AllocStateRow| r.alloc_id.clone())
            .map_err(StoreError::backend)?;
        let handles: Vec<TaskHandleRow> = self
            .load_all(TASK_HANDLES, TaskHandleRow::key)
            .map_err(StoreError::backend)?;
        let mut out: std::collections::BTreeMap<String, RestoredAlloc> = allocs
            .into_iter()
            .map(|alloc| {
                (
                    alloc.id.clone(),
                    RestoredAlloc {
                        alloc,
                        state: None,
                        handles: Default::default(),
                    },
                )
            })
            .collect();
        for row in states {
            if let Some(r) = out.get_mut(&row.alloc_id) {
                r.state = Some(row.state);
            }
        }
        for row in handles {
            if let Some(r) = out.get_mut(&row.alloc_id) {
                r.handles.insert(row.task, row.handle);
            }
        }
        Ok(out.into_values().collect())
    }
}

const LAST_HEARTBEAT: &str = "last_heartbeat_ms";
/// Whether the servers enforce ACL tokens, as they last said.
const META_CLUSTER_ACL: &str = "cluster_acl";

impl berth_heartbeat::LastHeartbeatStore for ClientState {
    fn save(&self, unix_ms: i64) {
        // The lease first: the executors of tasks with a disconnect
        // window hold them to it (see `berth_allocrunner::lease`).
        if let Some(dir) = self.path.parent() {
            if let Err(e) = berth_allocrunner::lease::renew(dir) {
                tracing::warn!(error = %e, "renewing the heartbeat lease failed");
            }
        }
        if let Err(e) = self.set_meta(LAST_HEARTBEAT, &unix_ms.to_string()) {
            tracing::warn!(error = %e, "recording the last heartbeat failed");
        }
    }

    fn load(&self) -> Option<i64> {
        self.meta(LAST_HEARTBEAT).ok().flatten()?.parse().ok()
    }
}

impl VolumeStateStore for ClientState {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, CsiStoreError> {
        self.load_all(PLUGINS, |p: &PluginRegistration| p.plugin_id.clone())
            .map_err(CsiStoreError::new)
    }

    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), CsiStoreError> {
        self.write(|tx| {
            let mut t = tx.open_table(PLUGINS).map_err(rdb)?;
            t.retain(|_, _| false).map_err(rdb)?;
            for p in plugins {
                let bytes = serde_json::to_vec(p).map_err(db_err)?;
                t.insert(p.plugin_id.as_str(), bytes.as_slice())
                    .map_err(rdb)?;
            }
            Ok(())
        })
        .map_err(CsiStoreError::new)
    }

    fn load_volumes(&self) -> Result<Vec<VolumeStub>, CsiStoreError> {
        self.load_all(VOLUMES, VolumeStub::key)
            .map_err(CsiStoreError::new)
    }

    fn put_volume(&self, stub: &VolumeStub) -> Result<(), CsiStoreError> {
        self.put(VOLUMES, &stub.key(), stub)
            .map_err(CsiStoreError::new)
    }

    fn delete_volume(&self, key: &str) -> Result<(), CsiStoreError> {
        self.delete(VOLUMES, key).map_err(CsiStoreError::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_structs::{AccessMode, AttachmentMode};

    fn stub(vol: &str) -> VolumeStub {
        VolumeStub {
            plugin_id: "hostpath".into(),
            volume_id: vol.into(),
            external_id: format!("ext-{vol}"),
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
            read_only: false,
            staging_path: "/tmp/staging".into(),
            staged: true,
            staging_mounted: None,
            unstaging: false,
            allocs: [("a1".to_string(), "/tmp/target".into())].into(),
            mounted_with: Default::default(),
        }
    }

    fn mode_of(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_state_file_is_created_0600_and_a_looser_mode_is_narrowed_on_open() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let s = ClientState::open(dir.path()).unwrap();
        s.node_identity().unwrap();
        assert_eq!(mode_of(&path), 0o600);
        drop(s);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let s = ClientState::open(dir.path()).unwrap();
        assert_eq!(mode_of(&path), 0o600);
        assert!(s.meta("node_secret").unwrap().is_some());
    }

    #[test]
    fn the_node_identity_is_created_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = ClientState::open(dir.path())
            .unwrap()
            .node_identity()
            .unwrap();
        assert_eq!(first.secret.expose().len(), 64);
        let again = ClientState::open(dir.path())
            .unwrap()
            .node_identity()
            .unwrap();
        assert_eq!(again.node_id, first.node_id);
        assert_eq!(again.secret, first.secret);
        assert!(!format!("{again:?}").contains(first.secret.expose()));

        // A database from before node secrets keeps its node ID.
        let old = tempfile::tempdir().unwrap();
        let s = ClientState::open(old.path()).unwrap();
        s.set_meta("node_id", "node-from-before").unwrap();
        let id = s.node_identity().unwrap();
        assert_eq!(id.node_id, "node-from-before");
        assert_ne!(id.secret, first.secret);
        assert_eq!(s.node_identity().unwrap().secret, id.secret);
    }

    #[test]
    fn volume_stubs_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = ClientState::open(dir.path()).unwrap();
            s.put_volume(&stub("data")).unwrap();
            s.put_volume(&stub("other")).unwrap();
            s.delete_volume(&stub("other").key()).unwrap();
        }
        let s = ClientState::open(dir.path()).unwrap();
        assert_eq!(s.load_volumes().unwrap(), vec![stub("data")]);
        assert_eq!(
            s.meta("schema_version").unwrap().as_deref(),
            Some(SCHEMA_VERSION.to_string().as_str())
        );
    }

    #[test]
    fn corrupt_record_is_quarantined_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let s = ClientState::open(dir.path()).unwrap();
        s.put_volume(&stub("data")).unwrap();
        s.put_raw(VOLUMES, "hostpath/broken/x", b"{not json")
            .unwrap();
        let loaded = s.load_volumes().unwrap();
        assert_eq!(loaded, vec![stub("data")]);
        assert_eq!(
            s.quarantined().unwrap(),
            vec!["csi_volumes/hostpath/broken/x"]
        );
        // The bad record is gone from its table: the next load is clean.
        assert_eq!(s.load_volumes().unwrap().len(), 1);
    }

    fn handle(pid: u32) -> TaskHandleRecord {
        TaskHandleRecord {
            driver: "raw_exec".into(),
            executor_dir: "/tmp/x".into(),
            executor_pid: pid,
            executor_start_ticks: 1,
            task_pid: pid + 1,
            pgid: (pid + 1) as i32,
            task_start_ticks: 2,
            started_at_ms: 3,
            cgroup: Vec::new(),
        }
    }

    fn alloc(id: &str) -> Allocation {
        Allocation {
            id: id.into(),
            ..Allocation::default()
        }
    }

    /// An unsynced state is read back at once and reaches the disk with
    /// the next synced write; a task's start writes its handle and the
    /// state together.
    #[test]
    fn unsynced_states_are_seen_at_once_and_kept_by_the_next_synced_write() {
        let dir = tempfile::tempdir().unwrap();
        let state = |description: &str| PersistedAllocState {
            description: description.into(),
            ..Default::default()
        };
        {
            let s = ClientState::open(dir.path()).unwrap();
            s.put_alloc_with(&alloc("a1"), Persist::Synced).unwrap();
            s.put_alloc_state_with("a1", &state("pending"), Persist::Unsynced)
                .unwrap();
            let loaded = s.load_allocs().unwrap();
            assert_eq!(loaded[0].state, Some(state("pending")));
            s.put_alloc_with(
                &Allocation {
                    name: "renamed".into(),
                    ..alloc("a1")
                },
                Persist::Unsynced,
            )
            .unwrap();
            s.put_task_started("a1", "web", Some(&handle(10)), &state("running"))
                .unwrap();
        }
        let s = ClientState::open(dir.path()).unwrap();
        let loaded = s.load_allocs().unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].alloc.name, "renamed");
        assert_eq!(loaded[0].state, Some(state("running")));
        assert_eq!(loaded[0].handles.get("web"), Some(&handle(10)));
    }

    #[test]
    fn allocs_states_and_handles_survive_reopen_and_are_deleted_together() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = ClientState::open(dir.path()).unwrap();
            s.put_alloc(&alloc("a1")).unwrap();
            s.put_alloc(&alloc("a2")).unwrap();
            let state = PersistedAllocState {
                description: "Tasks are running".into(),
                ..Default::default()
            };
            s.put_alloc_state("a1", &state).unwrap();
            s.put_task_handle("a1", "web", &handle(10)).unwrap();
            s.put_task_handle("a1", "web", &handle(20)).unwrap();
            s.put_task_handle("a2", "db", &handle(30)).unwrap();
            s.delete_alloc("a2").unwrap();
            // A handle of an alloc that was never recorded is ignored.
            s.put_task_handle("ghost", "x", &handle(40)).unwrap();
        }
        let s = ClientState::open(dir.path()).unwrap();
        let loaded = s.load_allocs().unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].alloc.id, "a1");
        assert_eq!(
            loaded[0].state.as_ref().map(|s| s.description.as_str()),
            Some("Tasks are running")
        );
        assert_eq!(loaded[0].handles.len(), 1);
        assert_eq!(loaded[0].handles["web"], handle(20), "the last run wins");
        s.delete_alloc("a1").unwrap();
        assert!(s.load_allocs().unwrap().is_empty());
    }

    #[test]
    fn a_corrupt_task_handle_is_quarantined() {
        let dir = tempfile::tempdir().unwrap();
        let s = ClientState::open(dir.path()).unwrap();
        s.put_alloc(&alloc("a1")).unwrap();
        s.put_raw(TASK_HANDLES, "a1/web", b"{\"alloc_id\": 3")
            .unwrap();
        let loaded = s.load_allocs().unwrap();
        assert_eq!(loaded.len(), 1);
        assert!(loaded[0].handles.is_empty());
        assert_eq!(s.quarantined().unwrap(), vec!["task_handles/a1/web"]);
    }

    #[test]
    fn newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = ClientState::open(dir.path()).unwrap();
            s.set_meta("schema_version", "99").unwrap();
        }
        match ClientState::open(dir.path()) {
            Err(StateError::TooNew { found: 99 }) => {}
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("a newer schema must be refused"),
        }
    }

    #[test]
    fn a_full_disk_fails_writes_clearly_and_they_work_again_once_space_is_freed() {
        let disk = berth_testutil::SmallDisk::new("4m");
        let state = ClientState::open(&disk.path().join("client")).unwrap();
        state.put_volume(&stub("before")).unwrap();
        let fill = disk.fill();

        let mut big = stub("big");
        // Larger than what is left, whatever redb's page slack.
        big.external_id = "x".repeat(512 * 1024);
        let err = state.put_volume(&big).expect_err("the disk is full");
        assert!(!err.to_string().is_empty());
        assert!(
            err.cause().downcast_ref::<StateError>().is_some(),
            "the store's own error is kept as the cause: {err:?}"
        );
        // A later write fails too, but never panics.
        assert!(state.put_volume(&stub("during")).is_err());

        std::fs::remove_file(fill).unwrap();
        state.put_volume(&stub("after")).unwrap();
        let mut keys: Vec<String> = state
            .load_volumes()
            .unwrap()
            .into_iter()
            .map(|s| s.volume_id)
            .collect();
        keys.sort();
        assert_eq!(keys, vec!["after", "before"]);
    }
}

#[cfg(test)]
mod properties {
    //! Garbage and damaged records written into a real client state file:
    //! loading never panics, bad records (undecodable, or under another
    //! key than theirs) are quarantined and reported, good ones load, and
    //! the database still takes writes.

    use std::collections::{BTreeMap, BTreeSet};

    use berth_structs::{AccessMode, AttachmentMode, CsiPluginType};
    use berth_testutil::json;
    use proptest::prelude::*;
    use serde_json::Value;

    use super::*;

    const TABLES: [TableDefinition<'static, &'static str, &'static [u8]>; 5] =
        [ALLOCS, ALLOC_STATES, TASK_HANDLES, PLUGINS, VOLUMES];

    fn table_name(t: usize) -> &'static str {
        redb::TableHandle::name(&TABLES[t])
    }

    /// The key and a valid record of identity `n` in table `t`.
    fn valid(t: usize, n: usize) -> (String, Value) {
        let alloc = format!("a{n}");
        let encoded = match t {
            0 => serde_json::to_value(Allocation {
                id: alloc.clone(),
                ..Default::default()
            }),
            1 => serde_json::to_value(AllocStateRow {
                alloc_id: alloc.clone(),
                state: PersistedAllocState::default(),
            }),
            2 => {
                return (
                    format!("{alloc}/web"),
                    serde_json::to_value(TaskHandleRow {
                        alloc_id: alloc,
                        task: "web".into(),
                        handle: TaskHandleRecord {
                            driver: "raw_exec".into(),
                            executor_dir: "/tmp/x".into(),
                            executor_pid: 10,
                            executor_start_ticks: 1,
                            task_pid: 11,
                            pgid: 11,
                            task_start_ticks: 2,
                            started_at_ms: 3,
                            cgroup: Vec::new(),
                        },
                    })
                    .expect("encode"),
                )
            }
            3 => {
                return (
                    format!("p{n}"),
                    serde_json::to_value(PluginRegistration {
                        plugin_id: format!("p{n}"),
                        plugin_type: CsiPluginType::Monolith,
                        socket_path: "/tmp/csi.sock".into(),
                        alloc_id: "a0".into(),
                        task: "plugin".into(),
                        mount_root: "/tmp/mounts".into(),
                        provider: "test".into(),
                        version: "1".into(),
                    })
                    .expect("encode"),
                )
            }
            _ => {
                let stub = VolumeStub {
                    plugin_id: "p".into(),
                    volume_id: format!("v{n}"),
                    external_id: "ext".into(),
                    access_mode: AccessMode::SingleNodeWriter,
                    attachment_mode: AttachmentMode::FileSystem,
                    read_only: false,
                    staging_path: "/tmp/staging".into(),
                    staged: true,
                    staging_mounted: None,
                    unstaging: false,
                    allocs: [("a1".to_string(), "/tmp/target".into())].into(),
                    mounted_with: Default::default(),
                };
                return (stub.key(), serde_json::to_value(&stub).expect("encode"));
            }
        };
        (alloc, encoded.expect("encode"))
    }

    /// Whether `bytes` under `key` of table `t` should load.
    fn is_good(t: usize, key: &str, bytes: &[u8]) -> bool {
        fn good<T: DeserializeOwned>(
            bytes: &[u8],
            key: &str,
            key_of: impl Fn(&T) -> String,
        ) -> bool {
            serde_json::from_slice::<T>(bytes).is_ok_and(|r| key_of(&r) == key)
        }
        match t {
            0 => good(bytes, key, |a: &Allocation| a.id.clone()),
            1 => good(bytes, key, |r: &AllocStateRow| r.alloc_id.clone()),
            2 => good(bytes, key, TaskHandleRow::key),
            3 => good(bytes, key, |p: &PluginRegistration| p.plugin_id.clone()),
            _ => good(bytes, key, VolumeStub::key),
        }
    }

    #[derive(Debug, Clone)]
    enum Content {
        Valid,
        /// The valid record of another identity.
        Other(usize),
        Garbage(Vec<u8>),
        /// A valid record with some values replaced, removed or added.
        Mutated(Vec<json::Edit>),
        /// Valid JSON text with bytes cut out and others spliced in.
        Damaged(json::Damage),
    }

    fn content() -> impl Strategy<Value = Content> {
        prop_oneof![
            3 => Just(Content::Valid),
            1 => (0usize..3).prop_map(Content::Other),
            1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Content::Garbage),
            // Up to six edits: as many replacements (4 in 7 edits) as
            // when every edit was one, and removals and additions besides.
            2 => prop::collection::vec(json::edit(), 1..7).prop_map(Content::Mutated),
            2 => json::damage().prop_map(Content::Damaged),
        ]
    }

    fn bytes_of(t: usize, n: usize, content: &Content) -> Vec<u8> {
        let (_, mut v) = valid(t, n);
        match content {
            Content::Valid => {}
            Content::Other(m) => v = valid(t, n.wrapping_add(1).wrapping_add(*m)).1,
            Content::Garbage(b) => return b.clone(),
            Content::Mutated(edits) => v = json::edited(v, edits),
            Content::Damaged(damage) => return damage.apply(v.to_string().as_bytes()),
        }
        v.to_string().into_bytes()
    }

    /// The keys each load answered with, by table.
    fn loaded(s: &ClientState) -> BTreeSet<(usize, String)> {
        let restored = s.load_allocs().expect("load allocs");
        let mut out = BTreeSet::new();
        for r in &restored {
            out.insert((0, r.alloc.id.clone()));
            if r.state.is_some() {
                out.insert((1, r.alloc.id.clone()));
            }
            for task in r.handles.keys() {
                out.insert((2, format!("{}/{task}", r.alloc.id)));
            }
        }
        for p in s.load_plugins().expect("load plugins") {
            out.insert((3, p.plugin_id));
        }
        for v in s.load_volumes().expect("load volumes") {
            out.insert((4, v.key()));
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 128,
            max_shrink_iters: 500,
            ..ProptestConfig::default()
        })]

        /// 128 cases, each a fresh database file with up to 12 records.
        #[test]
        fn damaged_records_are_quarantined_and_good_ones_load(
            entries in prop::collection::vec(
                (0usize..5, 0usize..3, prop::option::weighted(0.2, "\\PC{0,8}"), content()),
                0..12,
            ),
        ) {
            let dir = tempfile::tempdir().expect("tempdir");
            let s = ClientState::open(dir.path()).expect("open");
            let mut written: BTreeMap<(usize, String), Vec<u8>> = BTreeMap::new();
            for (t, n, odd_key, content) in &entries {
                let key = odd_key.clone().unwrap_or_else(|| valid(*t, *n).0);
                let bytes = bytes_of(*t, *n, content);
                s.put_raw(TABLES[*t], &key, &bytes).expect("write raw");
                written.insert((*t, key), bytes);
            }
            let good: BTreeSet<(usize, String)> = written
                .iter()
                .filter(|((t, key), bytes)| is_good(*t, key, bytes))
                .map(|(k, _)| k.clone())
                .collect();
            // States and handles are answered only with their alloc.
            let allocs: BTreeSet<String> = good
                .iter()
                .filter(|(t, _)| *t == 0)
                .map(|(_, k)| k.clone())
                .collect();
            let expected: BTreeSet<(usize, String)> = good
                .iter()
                .filter(|(t, k)| match t {
                    1 => allocs.contains(k),
                    2 => allocs.contains(k.split('/').next().unwrap_or_default()),
                    _ => true,
                })
                .cloned()
                .collect();
            prop_assert_eq!(&loaded(&s), &expected);

            let quarantined: BTreeSet<String> = s.quarantined().expect("quarantine").into_iter().collect();
            let bad: BTreeSet<String> = written
                .keys()
                .filter(|k| !good.contains(*k))
                .map(|(t, key)| format!("{}/{key}", table_name(*t)))
                .collect();
            prop_assert_eq!(&quarantined, &bad);

            // The bad records left their tables; a reopen loads the same.
            drop(s);
            let s = ClientState::open(dir.path()).expect("reopen");
            prop_assert_eq!(&loaded(&s), &expected);
            prop_assert_eq!(s.quarantined().expect("quarantine").len(), bad.len());
            s.put_alloc(&Allocation { id: "after".into(), ..Default::default() })
                .expect("a write after the load");
        }

        /// 128 cases: any text in the meta records the client reads.
        #[test]
        fn meta_records_of_any_text_open_or_fail_clearly(
            key in prop::sample::select(vec!["schema_version", "last_heartbeat_ms", "node_id"]),
            value in prop_oneof!["\\PC{0,24}", any::<i64>().prop_map(|n| n.to_string()), any::<u64>().prop_map(|n| n.to_string())],
        ) {
            let dir = tempfile::tempdir().expect("tempdir");
            ClientState::open(dir.path()).expect("open").set_meta(key, &value).expect("set meta");
            match ClientState::open(dir.path()) {
                Ok(s) => {
                    let hb = berth_heartbeat::LastHeartbeatStore::load(&s);
                    if key == "last_heartbeat_ms" {
                        prop_assert_eq!(hb, value.parse::<i64>().ok());
                    }
                    prop_assert!(loaded(&s).is_empty());
                }
                Err(e) => {
                    prop_assert_eq!(key, "schema_version");
                    prop_assert!(e.to_string().contains("schema"), "{}", e);
                }
            }
        }
    }

    #[test]
    fn a_record_under_another_key_is_quarantined() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = ClientState::open(dir.path()).expect("open");
        // Alloc a1's record under a2's key: deleting a1 would never remove
        // it, and it would be restored as a1 on every start.
        let (_, a1) = valid(0, 1);
        s.put_raw(ALLOCS, "a2", a1.to_string().as_bytes())
            .expect("write");
        let (key, v0) = valid(4, 0);
        let (_, v1) = valid(4, 1);
        s.put_raw(VOLUMES, &key, v1.to_string().as_bytes())
            .expect("write");
        assert!(s.load_allocs().expect("load").is_empty());
        assert!(s.load_volumes().expect("load").is_empty());
        assert_eq!(
            s.quarantined().expect("quarantine"),
            ["allocs/a2".to_string(), format!("csi_volumes/{key}")]
        );
        s.put_raw(VOLUMES, &key, v0.to_string().as_bytes())
            .expect("write");
        assert_eq!(s.load_volumes().expect("load").len(), 1);
    }
}
