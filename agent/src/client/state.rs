//! The client's state database: one crash-safe redb file under
//! `<data_dir>/client/`, with a schema version. It holds the node identity,
//! the time of the last heartbeat, the CSI plugin registry and the volume
//! stubs. A record that fails to decode is reported and moved to a
//! quarantine table; it never stops the agent from starting.

use std::path::Path;
use std::sync::Arc;

use berth_csimanager::{PluginRegistration, VolumeStateStore, VolumeStub};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::Serialize;

const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
const PLUGINS: TableDefinition<&str, &[u8]> = TableDefinition::new("csi_plugins");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("csi_volumes");
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");

/// The schema this build writes. Opening a database with a newer schema is
/// refused rather than misread.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("client state database {path}: {source}")]
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
}

fn db_err(e: impl std::fmt::Display) -> StateError {
    StateError::Db(e.to_string())
}

/// The client's state database. Cheap to clone.
#[derive(Clone)]
pub struct ClientState {
    db: Arc<Database>,
}

impl ClientState {
    pub fn open(dir: &Path) -> Result<ClientState, StateError> {
        std::fs::create_dir_all(dir).map_err(db_err)?;
        let path = dir.join("state.redb");
        let db = Database::create(&path).map_err(|source| StateError::Open {
            path: path.display().to_string(),
            source,
        })?;
        let state = ClientState { db: Arc::new(db) };
        state.migrate()?;
        Ok(state)
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
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = match tx.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(db_err(e)),
        };
        let v = table.get(key).map_err(db_err)?;
        Ok(v.map(|v| v.value().to_string()))
    }

    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(META).map_err(db_err)?;
            t.insert(key, value).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)
    }

    /// Every record of `table`, decoded. Records that fail to decode are
    /// moved to the quarantine table and reported.
    fn load_all<T: DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
    ) -> Result<Vec<T>, StateError> {
        let mut good = Vec::new();
        let mut bad: Vec<(String, Vec<u8>, String)> = Vec::new();
        {
            let tx = self.db.begin_read().map_err(db_err)?;
            let t = match tx.open_table(table) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(good),
                Err(e) => return Err(db_err(e)),
            };
            for row in t.iter().map_err(db_err)? {
                let (k, v) = row.map_err(db_err)?;
                match serde_json::from_slice::<T>(v.value()) {
                    Ok(rec) => good.push(rec),
                    Err(e) => bad.push((k.value().to_string(), v.value().to_vec(), e.to_string())),
                }
            }
        }
        if !bad.is_empty() {
            let tx = self.db.begin_write().map_err(db_err)?;
            {
                let mut src = tx.open_table(table).map_err(db_err)?;
                let mut q = tx.open_table(QUARANTINE).map_err(db_err)?;
                for (key, bytes, err) in &bad {
                    tracing::error!(
                        table = %redb::TableHandle::name(&table),
                        key = %key,
                        error = %err,
                        "client state record does not decode; moved to quarantine"
                    );
                    let qkey = format!("{}/{}", redb::TableHandle::name(&table), key);
                    q.insert(qkey.as_str(), bytes.as_slice()).map_err(db_err)?;
                    src.remove(key.as_str()).map_err(db_err)?;
                }
            }
            tx.commit().map_err(db_err)?;
        }
        Ok(good)
    }

    fn put<T: Serialize>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
        value: &T,
    ) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(value).map_err(db_err)?;
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(table).map_err(db_err)?;
            t.insert(key, bytes.as_slice()).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)
    }

    fn delete(&self, table: TableDefinition<&str, &[u8]>, key: &str) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(table).map_err(db_err)?;
            t.remove(key).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)
    }

    /// Keys of quarantined records, `<table>/<key>`.
    pub fn quarantined(&self) -> Result<Vec<String>, StateError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let t = match tx.open_table(QUARANTINE) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(db_err(e)),
        };
        let mut out = Vec::new();
        for row in t.iter().map_err(db_err)? {
            let (k, _) = row.map_err(db_err)?;
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
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(table).map_err(db_err)?;
            t.insert(key, bytes).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)
    }
}

const LAST_HEARTBEAT: &str = "last_heartbeat_ms";

impl berth_heartbeat::LastHeartbeatStore for ClientState {
    fn save(&self, unix_ms: i64) {
        if let Err(e) = self.set_meta(LAST_HEARTBEAT, &unix_ms.to_string()) {
            tracing::warn!(error = %e, "recording the last heartbeat failed");
        }
    }

    fn load(&self) -> Option<i64> {
        self.meta(LAST_HEARTBEAT).ok().flatten()?.parse().ok()
    }
}

impl VolumeStateStore for ClientState {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, String> {
        self.load_all(PLUGINS).map_err(|e| e.to_string())
    }

    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), String> {
        let tx = self.db.begin_write().map_err(|e| e.to_string())?;
        {
            let mut t = tx.open_table(PLUGINS).map_err(|e| e.to_string())?;
            t.retain(|_, _| false).map_err(|e| e.to_string())?;
            for p in plugins {
                let bytes = serde_json::to_vec(p).map_err(|e| e.to_string())?;
                t.insert(p.plugin_id.as_str(), bytes.as_slice())
                    .map_err(|e| e.to_string())?;
            }
        }
        tx.commit().map_err(|e| e.to_string())
    }

    fn load_volumes(&self) -> Result<Vec<VolumeStub>, String> {
        self.load_all(VOLUMES).map_err(|e| e.to_string())
    }

    fn put_volume(&self, stub: &VolumeStub) -> Result<(), String> {
        self.put(VOLUMES, &stub.key(), stub)
            .map_err(|e| e.to_string())
    }

    fn delete_volume(&self, key: &str) -> Result<(), String> {
        self.delete(VOLUMES, key).map_err(|e| e.to_string())
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
            allocs: [("a1".to_string(), "/tmp/target".into())].into(),
        }
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
}
