//! The redb backend: `<data_dir>/server/state.redb`, one table per object
//! kind with JSON values keyed by ID, the indexes and the schema version in
//! `meta`, records that failed to decode in `quarantine`, and the node
//! secrets in `node_secrets` (text by node ID), apart from the nodes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use berth_structs::NodeSecret;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;

use super::{Backend, Change, Table, Tables};
use crate::error::StoreError;

/// The schema version this build writes. Bump it with a migration in
/// [`RedbBackend::migrate`] when a stored shape changes incompatibly.
pub const SCHEMA_VERSION: u64 = 1;

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");
const NODE_SECRETS: TableDefinition<&str, &str> = TableDefinition::new("node_secrets");
const META_SCHEMA: &str = "schema_version";
const META_INDEX: &str = "index";

fn definition(table: Table) -> TableDefinition<'static, &'static str, &'static [u8]> {
    match table {
        Table::Jobs => TableDefinition::new("jobs"),
        Table::Allocs => TableDefinition::new("allocs"),
        Table::Nodes => TableDefinition::new("nodes"),
        Table::Volumes => TableDefinition::new("volumes"),
        Table::Acl => TableDefinition::new("acl"),
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

/// No real store reaches this index: 2^53 writes take centuries at a
/// million writes a second. A record or meta entry beyond it is corrupt,
/// and trusting it would leave no room for the index of the next write.
pub(crate) const MAX_SANE_INDEX: u64 = 1 << 53;

/// What loading checks of a decoded record besides its shape.
trait StoredRecord: DeserializeOwned {
    fn id(&self) -> &str;
    /// The create and modify index.
    fn indexes(&self) -> [u64; 2];
}

macro_rules! stored_record {
    ($($t:ty),*) => {$(
        impl StoredRecord for $t {
            fn id(&self) -> &str {
                &self.id
            }
            fn indexes(&self) -> [u64; 2] {
                [self.create_index, self.modify_index]
            }
        }
    )*};
}
stored_record!(
    berth_structs::Job,
    berth_structs::Allocation,
    berth_structs::Node,
    berth_structs::CsiVolume
);

/// Decode every record of `table`; undecodable ones, ones whose ID does not
/// match their key and ones with an index beyond [`MAX_SANE_INDEX`] are
/// returned as bad keys.
fn decode_table<T: StoredRecord>(
    table: &redb::Table<&str, &[u8]>,
    kind: Table,
    bad: &mut Vec<(Table, String, Vec<u8>)>,
) -> Result<BTreeMap<String, T>, StoreError> {
    let name = kind.name();
    let mut out = BTreeMap::new();
    for row in table.iter()? {
        let (k, v) = row?;
        let key = k.value().to_string();
        match serde_json::from_slice::<T>(v.value()) {
            Ok(obj) if obj.id() != key => {
                tracing::error!(table = name, key = %key, id = %obj.id(),
                    "state record's ID does not match its key; quarantining it");
                bad.push((kind, key, v.value().to_vec()));
            }
            Ok(obj) if obj.indexes().iter().any(|&i| i > MAX_SANE_INDEX) => {
                let [create_index, modify_index] = obj.indexes();
                tracing::error!(table = name, key = %key, create_index, modify_index,
                    "state record's index is beyond any real store's; quarantining it");
                bad.push((kind, key, v.value().to_vec()));
            }
            Ok(obj) => {
                out.insert(key, obj);
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

/// An index read from `meta`, or 0 (lost) when it is beyond
/// [`MAX_SANE_INDEX`].
fn sane_index(key: &str, value: Option<u64>) -> u64 {
    match value {
        Some(i) if i > MAX_SANE_INDEX => {
            tracing::error!(
                key,
                index = i,
                "state index is beyond any real store's; rebuilding it from the records"
            );
            0
        }
        v => v.unwrap_or(0),
    }
}

/// The node secrets. One that is not a valid secret is left out (and
/// reported by node ID only): its node is then treated as one without a
/// secret, which takes the secret of its next registration.
fn decode_node_secrets(
    t: &redb::Table<&str, &str>,
) -> Result<BTreeMap<String, NodeSecret>, StoreError> {
    let mut out = BTreeMap::new();
    for row in t.iter()? {
        let (k, v) = row?;
        match NodeSecret::parse(v.value()) {
            Ok(secret) => {
                out.insert(k.value().to_string(), secret);
            }
            Err(e) => {
                tracing::error!(node_id = k.value(), error = %e, "stored node secret is unusable; the node's next registration sets a new one");
            }
        }
    }
    Ok(out)
}

/// The ACL records; like [`decode_table`], a record that fails to decode,
/// sits under another key than its own or has an impossible index is
/// returned as bad.
fn decode_acl(
    table: &redb::Table<&str, &[u8]>,
    bad: &mut Vec<(Table, String, Vec<u8>)>,
) -> Result<Vec<super::AclRecord>, StoreError> {
    let mut out = Vec::new();
    for row in table.iter()? {
        let (k, v) = row?;
        let key = k.value().to_string();
        match serde_json::from_slice::<super::AclRecord>(v.value()) {
            Ok(r) if r.key() == key && r.indexes().iter().all(|&i| i <= MAX_SANE_INDEX) => {
                out.push(r)
            }
            Ok(_) => {
                tracing::error!(table = "acl", key = %key,
                    "ACL record does not match its key or has an impossible index; quarantining it");
                bad.push((Table::Acl, key, v.value().to_vec()));
            }
            Err(e) => {
                tracing::error!(table = "acl", key = %key, error = %e,
                    "ACL record failed to decode; quarantining it");
                bad.push((Table::Acl, key, v.value().to_vec()));
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
            tables.index = sane_index(META_INDEX, meta.get(META_INDEX)?.map(|v| v.value()));
            for t in Table::ALL {
                let key = table_index_key(t);
                let i = sane_index(&key, meta.get(key.as_str())?.map(|v| v.value()));
                tables.table_index.insert(t, i);
            }
        }
        let mut bad = Vec::new();
        {
            let t = txn.open_table(definition(Table::Jobs))?;
            tables.jobs = decode_table(&t, Table::Jobs, &mut bad)?;
            let t = txn.open_table(definition(Table::Allocs))?;
            tables.allocs = decode_table(&t, Table::Allocs, &mut bad)?;
            let t = txn.open_table(definition(Table::Nodes))?;
            tables.nodes = decode_table(&t, Table::Nodes, &mut bad)?;
            let t = txn.open_table(definition(Table::Volumes))?;
            tables.volumes = decode_table(&t, Table::Volumes, &mut bad)?;
            let t = txn.open_table(NODE_SECRETS)?;
            tables.node_secrets = decode_node_secrets(&t)?;
            let t = txn.open_table(definition(Table::Acl))?;
            tables.acl = super::AclTables::from_records(decode_acl(&t, &mut bad)?);
        }
        // The index never goes backwards, even if meta was lost.
        let max_seen = tables
            .jobs
            .values()
            .map(|j| j.modify_index)
            .chain(tables.allocs.values().map(|a| a.modify_index))
            .chain(tables.nodes.values().map(|n| n.modify_index))
            .chain(tables.volumes.values().map(|v| v.modify_index))
            .chain(tables.table_index.values().copied())
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
        let started = std::time::Instant::now();
        let committed = match self.commit_once(index, changes) {
            Err(e) if is_previous_io(&e) => {
                self.close_poisoned();
                self.commit_once(index, changes)
            }
            other => other,
        };
        berth_metrics::record_state_commit(berth_metrics::Db::Server, started.elapsed());
        committed
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
                match change {
                    Change::PutNodeSecret { node_id, secret } => {
                        let mut s = txn.open_table(NODE_SECRETS)?;
                        s.insert(node_id.as_str(), secret.expose())?;
                        continue;
                    }
                    _ => {}
                }
                let mut t = txn.open_table(definition(kind))?;
                let encoded = match change {
                    Change::PutJob(j) => Some(serde_json::to_vec(j)),
                    Change::PutAlloc(a) => Some(serde_json::to_vec(a)),
                    Change::PutNode(n) => Some(serde_json::to_vec(n)),
                    Change::PutVolume(v) => Some(serde_json::to_vec(v)),
                    Change::PutAcl { record, .. } => Some(serde_json::to_vec(record)),
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

#[cfg(test)]
mod tests {
    //! Garbage and damaged records written into a real redb file behind
    //! the backend's back: opening never panics, bad records are
    //! quarantined and reported, good ones load, and the store still takes
    //! writes afterwards.

    use std::collections::BTreeSet;

    use berth_structs::{Allocation, CsiVolume, Job, Node};
    use berth_testutil::json::{self, Nodes};
    use proptest::prelude::*;
    use proptest::sample::Index;
    use serde_json::Value;

    use super::*;
    use crate::state::StateStore;

    fn valid(kind: Table, id: &str) -> Value {
        let v = match kind {
            Table::Jobs => serde_json::to_value(Job {
                id: id.into(),
                name: id.into(),
                create_index: 3,
                modify_index: 5,
                ..Default::default()
            }),
            Table::Allocs => serde_json::to_value(Allocation {
                id: id.into(),
                job_id: "j".into(),
                node_id: "n".into(),
                create_index: 4,
                modify_index: 4,
                ..Default::default()
            }),
            Table::Nodes => serde_json::to_value(Node {
                id: id.into(),
                name: "n".into(),
                create_index: 1,
                modify_index: 7,
                ..Default::default()
            }),
            Table::Volumes => serde_json::to_value(CsiVolume {
                id: id.into(),
                plugin_id: "p".into(),
                secrets: [("token".to_string(), "s".to_string())].into(),
                create_index: 2,
                modify_index: 6,
                ..Default::default()
            }),
            Table::Acl => unreachable!("the generated records are of the first four tables"),
        };
        v.expect("encode a valid record")
    }

    /// What is written under a key.
    #[derive(Debug, Clone)]
    enum Content {
        Valid,
        /// A valid record of another ID.
        OtherId(String),
        Garbage(Vec<u8>),
        /// A valid record with one number set to an extreme value.
        ExtremeNumber(Index, u64),
        /// A valid record with some values replaced, removed or added.
        Mutated(Vec<json::Edit>),
        /// Valid JSON text with bytes cut out and others spliced in.
        Damaged(json::Damage),
    }

    fn content() -> impl Strategy<Value = Content> {
        prop_oneof![
            3 => Just(Content::Valid),
            1 => "[a-z0-9]{0,4}".prop_map(Content::OtherId),
            1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Content::Garbage),
            2 => (any::<Index>(), prop_oneof![
                Just(0u64), Just(u64::MAX), Just(u64::MAX - 1), Just(MAX_SANE_INDEX),
                Just(MAX_SANE_INDEX + 1), any::<u64>(),
            ])
                .prop_map(|(i, n)| Content::ExtremeNumber(i, n)),
            // Up to six edits: as many replacements (4 in 7 edits) as
            // when every edit was one, and removals and additions besides.
            2 => prop::collection::vec(json::edit(), 1..7).prop_map(Content::Mutated),
            2 => json::damage().prop_map(Content::Damaged),
        ]
    }

    fn bytes_of(kind: Table, key: &str, content: &Content) -> Vec<u8> {
        let mut v = valid(kind, key);
        match content {
            Content::Valid => {}
            Content::OtherId(id) => v = valid(kind, &format!("other-{id}")),
            Content::Garbage(b) => return b.clone(),
            Content::ExtremeNumber(at, n) => {
                json::replace_at(&mut v, at, Nodes::Numbers, Value::from(*n));
            }
            Content::Mutated(edits) => v = json::edited(v, edits),
            Content::Damaged(damage) => return damage.apply(v.to_string().as_bytes()),
        }
        v.to_string().into_bytes()
    }

    /// Whether `bytes` under `key` is a record the store should load.
    fn is_good(kind: Table, key: &str, bytes: &[u8]) -> bool {
        fn good<T: StoredRecord>(key: &str, bytes: &[u8]) -> bool {
            serde_json::from_slice::<T>(bytes)
                .is_ok_and(|r| r.id() == key && r.indexes().iter().all(|&i| i <= MAX_SANE_INDEX))
        }
        match kind {
            Table::Jobs => good::<Job>(key, bytes),
            Table::Allocs => good::<Allocation>(key, bytes),
            Table::Nodes => good::<Node>(key, bytes),
            Table::Volumes => good::<CsiVolume>(key, bytes),
            Table::Acl => unreachable!("the generated records are of the first four tables"),
        }
    }

    fn loaded_keys(t: &Tables) -> BTreeSet<(Table, String)> {
        let keys = |kind: Table, ks: Vec<&String>| {
            ks.into_iter()
                .map(move |k| (kind, k.clone()))
                .collect::<Vec<_>>()
        };
        keys(Table::Jobs, t.jobs.keys().collect())
            .into_iter()
            .chain(keys(Table::Allocs, t.allocs.keys().collect()))
            .chain(keys(Table::Nodes, t.nodes.keys().collect()))
            .chain(keys(Table::Volumes, t.volumes.keys().collect()))
            .collect()
    }

    /// Writes `records` and meta indexes straight into a redb file.
    fn write_raw(
        path: &Path,
        records: &BTreeMap<(Table, String), Vec<u8>>,
        meta: &[(String, u64)],
    ) {
        let db = Database::create(path).expect("create db");
        let txn = db.begin_write().expect("begin");
        {
            for ((kind, key), bytes) in records {
                let mut t = txn.open_table(definition(*kind)).expect("open table");
                t.insert(key.as_str(), bytes.as_slice()).expect("insert");
            }
            let mut m = txn.open_table(META).expect("open meta");
            for (k, v) in meta {
                m.insert(k.as_str(), *v).expect("insert meta");
            }
        }
        txn.commit().expect("commit");
    }

    fn meta_entries() -> impl Strategy<Value = Vec<(String, u64)>> {
        let key = prop_oneof![
            Just(META_INDEX.to_string()),
            Just("index/jobs".to_string()),
            Just("index/allocs".to_string()),
            Just("index/volumes".to_string()),
        ];
        let value = prop_oneof![Just(u64::MAX), Just(MAX_SANE_INDEX + 1), 0u64..100];
        prop::collection::vec((key, value), 0..3)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 128,
            max_shrink_iters: 500,
            ..ProptestConfig::default()
        })]

        /// 128 cases, each a fresh database file with up to 10 records.
        #[test]
        fn damaged_records_are_quarantined_and_good_ones_load(
            entries in prop::collection::vec(
                (0usize..4, prop_oneof![3 => "k[0-3]", 1 => "\\PC{0,8}"], content()),
                0..10,
            ),
            meta in meta_entries(),
        ) {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = RedbBackend::path_in(dir.path());
            let backend = RedbBackend::open(&path).expect("open");
            backend.load().expect("first load");
            drop(backend);

            let mut records = BTreeMap::new();
            for (kind, key, content) in &entries {
                let kind = Table::ALL[*kind];
                records.insert((kind, key.clone()), bytes_of(kind, key, content));
            }
            write_raw(&path, &records, &meta);

            let backend = RedbBackend::open(&path).expect("reopen");
            let tables = backend.load().expect("load never fails on bad records");
            let good: BTreeSet<(Table, String)> = records
                .iter()
                .filter(|((kind, key), bytes)| is_good(*kind, key, bytes))
                .map(|(k, _)| k.clone())
                .collect();
            prop_assert_eq!(&loaded_keys(&tables), &good);
            prop_assert!(tables.index <= MAX_SANE_INDEX);
            prop_assert!(tables.table_index.values().all(|&i| i <= tables.index));

            // Every bad record is reported in quarantine with its bytes.
            let quarantined = backend.quarantined().expect("quarantine");
            for ((kind, key), bytes) in &records {
                if good.contains(&(*kind, key.clone())) {
                    continue;
                }
                let prefix = format!("{}/{}/", kind.name(), key);
                prop_assert!(
                    quarantined.iter().any(|q| q.key.starts_with(&prefix) && &q.value == bytes),
                    "{} not quarantined: {:?}", prefix, quarantined.iter().map(|q| &q.key).collect::<Vec<_>>()
                );
            }

            // The bad records left their tables: a second load is clean and
            // the same.
            let again = backend.load().expect("second load");
            prop_assert_eq!(loaded_keys(&again), good);
            prop_assert_eq!(backend.quarantined().expect("quarantine").len(), quarantined.len());

            // The store still takes a write, at an index above all it holds.
            let store = StateStore::open(Box::new(backend)).expect("store");
            let before = store.index();
            let ((), index) = store
                .write(|_, changes| {
                    changes.push(crate::state::Change::PutJob(Job {
                        id: "after".into(),
                        ..Default::default()
                    }));
                    Ok::<_, StoreError>(())
                })
                .expect("write after load");
            prop_assert!(index > before);
        }
    }

    #[test]
    fn a_record_with_an_index_no_store_reaches_is_quarantined_and_writes_go_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        RedbBackend::open(&path)
            .expect("open")
            .load()
            .expect("load");
        let mut huge = valid(Table::Jobs, "huge");
        huge["modify_index"] = Value::from(u64::MAX);
        let records = BTreeMap::from([
            (
                (Table::Jobs, "huge".to_string()),
                huge.to_string().into_bytes(),
            ),
            (
                (Table::Jobs, "fine".to_string()),
                valid(Table::Jobs, "fine").to_string().into_bytes(),
            ),
        ]);
        write_raw(&path, &records, &[(META_INDEX.to_string(), u64::MAX)]);

        let backend = RedbBackend::open(&path).expect("reopen");
        let store = StateStore::open(Box::new(backend)).expect("store");
        assert_eq!(
            store.read(|t| t.jobs.keys().cloned().collect::<Vec<_>>()),
            ["fine"]
        );
        assert_eq!(store.index(), 5, "rebuilt from the records that loaded");
        let quarantined = store.quarantined().expect("quarantine");
        assert_eq!(quarantined.len(), 1);
        assert!(quarantined[0].key.starts_with("jobs/huge/"));
        let ((), index) = store
            .write(|_, changes| {
                changes.push(crate::state::Change::PutJob(Job {
                    id: "next".into(),
                    ..Default::default()
                }));
                Ok::<_, StoreError>(())
            })
            .expect("a write after the load");
        assert_eq!(index, 6);
    }
}
