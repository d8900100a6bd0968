//! The redb backend: `<data_dir>/server/state.redb`, one table per object
//! kind with JSON values keyed by ID, the indexes and the schema version in
//! `meta`, and records that failed to decode in `quarantine`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;

use super::{Backend, Change, Table, Tables};
use crate::error::StoreError;

/// The schema version this build writes. Bump it with a migration in
/// [`RedbBackend::migrate`] when a stored shape changes incompatibly.
pub const SCHEMA_VERSION: u64 = 1;

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");
const META_SCHEMA: &str = "schema_version";
const META_INDEX: &str = "index";

fn definition(table: Table) -> TableDefinition<'static, &'static str, &'static [u8]> {
    match table {
        Table::Jobs => TableDefinition::new("jobs"),
        Table::Allocs => TableDefinition::new("allocs"),
        Table::Nodes => TableDefinition::new("nodes"),
        Table::Volumes => TableDefinition::new("volumes"),
    }
}

fn table_index_key(table: Table) -> String {
    format!("index/{}", table.name())
}

/// A record set aside because it failed to decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedRecord {
    /// `<table>/<key>/<index at quarantine time>`.
    pub key: String,
    pub value: Vec<u8>,
}

pub struct RedbBackend {
    /// `None` after an I/O error closed it; the next use opens it again.
    db: std::sync::RwLock<Option<std::sync::Arc<Database>>>,
    path: PathBuf,
}

/// redb refuses every transaction after one failed on I/O (a full disk,
/// say) until the database is opened again.
fn is_previous_io(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(redb::Error::PreviousIo))
}

impl RedbBackend {
    /// The database file under a data dir.
    pub fn path_in(data_dir: &Path) -> PathBuf {
        data_dir.join("server").join("state.redb")
    }

    /// Open (or create) the database at `path`.
    pub fn open(path: &Path) -> Result<RedbBackend, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let db = Self::open_db(path)?;
        Ok(RedbBackend {
            db: std::sync::RwLock::new(Some(std::sync::Arc::new(db))),
            path: path.to_path_buf(),
        })
    }

    fn open_db(path: &Path) -> Result<Database, StoreError> {
        Database::create(path).map_err(|e| StoreError::Open {
            path: path.display().to_string(),
            source: e.into(),
        })
    }

    /// The open database, opening it again if an I/O error closed it.
    fn db(&self) -> Result<std::sync::Arc<Database>, StoreError> {
        if let Some(db) = self.db.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return Ok(db.clone());
        }
        let mut slot = self.db.write().unwrap_or_else(|e| e.into_inner());
        if let Some(db) = slot.as_ref() {
            return Ok(db.clone());
        }
        let db = std::sync::Arc::new(Self::open_db(&self.path)?);
        tracing::info!(path = %self.path.display(), "state database opened again after an I/O error");
        *slot = Some(db.clone());
        Ok(db)
    }

    /// Closes the database after an I/O error poisoned it, so that the next
    /// use opens it afresh.
    fn close_poisoned(&self) {
        tracing::warn!(path = %self.path.display(), "state database hit an I/O error; reopening it");
        self.db.write().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn quarantined_records(&self) -> Result<Vec<QuarantinedRecord>, StoreError> {
        let txn = self.db()?.begin_read()?;
        let table = match txn.open_table(QUARANTINE) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::new();
        for row in table.iter()? {
            let (k, v) = row?;
            out.push(QuarantinedRecord {
                key: k.value().to_string(),
                value: v.value().to_vec(),
            });
        }
        Ok(out)
    }

    /// Bring an older schema up to [`SCHEMA_VERSION`]. There is no older
    /// schema yet.
    fn migrate(&self, _from: u64, _txn: &redb::WriteTransaction) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Decode every record of `table`; undecodable ones (or ones whose ID does
/// not match their key) are returned as bad keys.
fn decode_table<T: DeserializeOwned>(
    table: &redb::Table<&str, &[u8]>,
    name: &'static str,
    id_of: impl Fn(&T) -> &str,
    bad: &mut Vec<(Table, String, Vec<u8>)>,
    kind: Table,
) -> Result<BTreeMap<String, T>, StoreError> {
    let mut out = BTreeMap::new();
    for row in table.iter()? {
        let (k, v) = row?;
        let key = k.value().to_string();
        match serde_json::from_slice::<T>(v.value()) {
            Ok(obj) if id_of(&obj) == key => {
                out.insert(key, obj);
            }
            Ok(obj) => {
                tracing::error!(table = name, key = %key, id = %id_of(&obj),
                    "state record's ID does not match its key; quarantining it");
                bad.push((kind, key, v.value().to_vec()));
            }
            Err(e) => {
                tracing::error!(table = name, key = %key, error = %e,
                    "state record failed to decode; quarantining it");
                bad.push((kind, key, v.value().to_vec()));
            }
        }
    }
    Ok(out)
}

impl Backend for RedbBackend {
    fn load(&self) -> Result<Tables, StoreError> {
        let txn = self.db()?.begin_write()?;
        let mut tables = Tables::default();
        {
            let mut meta = txn.open_table(META)?;
            let found = meta.get(META_SCHEMA)?.map(|v| v.value());
            match found {
                Some(v) if v > SCHEMA_VERSION => {
                    return Err(StoreError::SchemaTooNew {
                        path: self.path.display().to_string(),
                        found: v,
                        supported: SCHEMA_VERSION,
                    });
                }
                Some(v) if v < SCHEMA_VERSION => {
                    tracing::info!(from = v, to = SCHEMA_VERSION, "migrating server state");
                    self.migrate(v, &txn)?;
                }
                _ => {}
            }
            meta.insert(META_SCHEMA, SCHEMA_VERSION)?;
            tables.index = meta.get(META_INDEX)?.map_or(0, |v| v.value());
            for t in Table::ALL {
                let i = meta
                    .get(table_index_key(t).as_str())?
                    .map_or(0, |v| v.value());
                tables.table_index.insert(t, i);
            }
        }
        let mut bad = Vec::new();
        {
            let t = txn.open_table(definition(Table::Jobs))?;
            tables.jobs = decode_table(
                &t,
                "jobs",
                |j: &berth_structs::Job| &j.id,
                &mut bad,
                Table::Jobs,
            )?;
            let t = txn.open_table(definition(Table::Allocs))?;
            tables.allocs = decode_table(
                &t,
                "allocs",
                |a: &berth_structs::Allocation| &a.id,
                &mut bad,
                Table::Allocs,
            )?;
            let t = txn.open_table(definition(Table::Nodes))?;
            tables.nodes = decode_table(
                &t,
                "nodes",
                |n: &berth_structs::Node| &n.id,
                &mut bad,
                Table::Nodes,
            )?;
            let t = txn.open_table(definition(Table::Volumes))?;
            tables.volumes = decode_table(
                &t,
                "volumes",
                |v: &berth_structs::CsiVolume| &v.id,
                &mut bad,
                Table::Volumes,
            )?;
        }
        // The index never goes backwards, even if meta was lost.
        let max_seen = tables
            .jobs
            .values()
            .map(|j| j.modify_index)
            .chain(tables.allocs.values().map(|a| a.modify_index))
            .chain(tables.nodes.values().map(|n| n.modify_index))
            .chain(tables.volumes.values().map(|v| v.modify_index))
            .max()
            .unwrap_or(0);
        tables.index = tables.index.max(max_seen);
        if !bad.is_empty() {
            let mut q = txn.open_table(QUARANTINE)?;
            for (kind, key, value) in &bad {
                let qkey = format!("{}/{}/{}", kind.name(), key, tables.index);
                q.insert(qkey.as_str(), value.as_slice())?;
                let mut t = txn.open_table(definition(*kind))?;
                t.remove(key.as_str())?;
            }
        }
        txn.commit()?;
        tracing::info!(
            path = %self.path.display(),
            index = tables.index,
            jobs = tables.jobs.len(),
            allocs = tables.allocs.len(),
            nodes = tables.nodes.len(),
            volumes = tables.volumes.len(),
            quarantined = bad.len(),
            "loaded server state"
        );
        Ok(tables)
    }

    fn quarantined(&self) -> Result<Vec<QuarantinedRecord>, StoreError> {
        self.quarantined_records()
    }

    fn commit(&self, index: u64, changes: &[Change]) -> Result<(), StoreError> {
        match self.commit_once(index, changes) {
            Err(e) if is_previous_io(&e) => {
                self.close_poisoned();
                self.commit_once(index, changes)
            }
            other => other,
        }
    }
}

impl RedbBackend {
    fn commit_once(&self, index: u64, changes: &[Change]) -> Result<(), StoreError> {
        let txn = self.db()?.begin_write()?;
        {
            let mut touched = std::collections::BTreeSet::new();
            for change in changes {
                let kind = change.table();
                touched.insert(kind);
                let mut t = txn.open_table(definition(kind))?;
                let encoded = match change {
                    Change::PutJob(j) => Some(serde_json::to_vec(j)),
                    Change::PutAlloc(a) => Some(serde_json::to_vec(a)),
                    Change::PutNode(n) => Some(serde_json::to_vec(n)),
                    Change::PutVolume(v) => Some(serde_json::to_vec(v)),
                    _ => None,
                };
                match encoded {
                    Some(Ok(bytes)) => {
                        t.insert(change.key(), bytes.as_slice())?;
                    }
                    Some(Err(source)) => {
                        return Err(StoreError::Encode {
                            table: kind.name(),
                            key: change.key().to_string(),
                            source,
                        });
                    }
                    None => {
                        t.remove(change.key())?;
                    }
                }
            }
            let mut meta = txn.open_table(META)?;
            meta.insert(META_INDEX, index)?;
            for kind in touched {
                meta.insert(table_index_key(kind).as_str(), index)?;
            }
        }
        txn.commit()?;
        Ok(())
    }
}
