//! The redb backend: `<data_dir>/server/state.redb`, one table per object
//! kind with JSON values keyed by ID, the indexes and the schema version in
//! `meta`, records that failed to decode in `quarantine`, and the node
//! secrets in `node_secrets_sealed` by node ID, apart from the nodes.
//!
//! Secrets are sealed with the keyring beside the file
//! (`<data_dir>/server/keyring/`, see [`crate::keyring`]) when a record is
//! written and opened when it is loaded: a volume's `secrets` are stored as
//! `sealed_secrets`, a node secret as a [`Sealed`] value. The in-memory
//! tables hold them in the clear. Schema 1 kept both in the clear (node
//! secrets as text in `node_secrets`); such records still load and are
//! sealed in the same transaction. A record that does not open (its key is
//! gone, its ciphertext damaged) is quarantined like one that fails to
//! decode.

use berth_sync::RwLockExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use berth_structs::NodeSecret;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::error::StoreError;
use super::record::{
    decode_checked, decode_volume, encode_volume, open_node_secret, record_aad, seal_node_secret,
    usable_node_secret, Record, MAX_SANE_INDEX, NODE_SECRETS_SEALED_NAME,
};
use super::{Backend, Change, RecordStore, Table, TableVisitor, Tables};
use crate::file_modes;
use crate::keyring::{KeyRotation, Keyring, KEYRING_DIR};

/// The schema version this build writes. Bump it with a migration in
/// [`RedbBackend::migrate`] when a stored shape changes incompatibly.
/// Version 2 seals secrets; version 1's clear ones are sealed on load.
pub const SCHEMA_VERSION: u64 = 2;

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");
/// Schema 1's node secrets, in the clear; emptied into
/// [`NODE_SECRETS_SEALED`] and deleted on load.
const NODE_SECRETS: TableDefinition<&str, &str> = TableDefinition::new("node_secrets");
/// A JSON [`Sealed`] node secret by node ID.
const NODE_SECRETS_SEALED: TableDefinition<&str, &[u8]> =
    TableDefinition::new(NODE_SECRETS_SEALED_NAME);
const META_SCHEMA: &str = "schema_version";
const META_INDEX: &str = "index";

/// A table's redb table: its records' JSON by key, under its name.
fn definition(table: Table) -> TableDefinition<'static, &'static str, &'static [u8]> {
    TableDefinition::new(table.name())
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
    keyring: Keyring,
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

    /// Open (or create) the database at `path`, and the keyring in
    /// `keyring/` beside it (made with a first key when missing). The
    /// directory is kept 0700 and the file 0600; looser modes are narrowed.
    pub fn open(path: &Path) -> Result<RedbBackend, StoreError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        file_modes::ensure_private_dir(dir).map_err(|source| StoreError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let keyring = Keyring::open(&dir.join(KEYRING_DIR))?;
        let db = Self::open_db(path)?;
        Ok(RedbBackend {
            db: std::sync::RwLock::new(Some(std::sync::Arc::new(db))),
            path: path.to_path_buf(),
            keyring,
        })
    }

    /// The keyring that seals the database's secrets.
    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    fn open_db(path: &Path) -> Result<Database, StoreError> {
        file_modes::ensure_private_file(path).map_err(|source| StoreError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Database::create(path).map_err(|e| StoreError::Open {
            path: path.display().to_string(),
            source: e.into(),
        })
    }

    /// The open database, opening it again if an I/O error closed it.
    fn db(&self) -> Result<std::sync::Arc<Database>, StoreError> {
        if let Some(db) = self.db.read_locked().as_ref() {
            return Ok(db.clone());
        }
        let mut slot = self.db.write_locked();
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
        self.db.write_locked().take();
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

    /// Checks the schema version (migrating an older one) and reads the
    /// indexes from `meta` into `tables`.
    fn load_meta(
        &self,
        txn: &redb::WriteTransaction,
        tables: &mut Tables,
    ) -> Result<(), StoreError> {
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
                self.migrate(v, txn)?;
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
        Ok(())
    }
}

/// Decode every record of `table`; bad ones (see [`decode_checked`]) are
/// returned as bad. Each good record comes with whether it held secrets in
/// the clear.
fn decode_table<R: Record>(
    table: &redb::Table<&str, &[u8]>,
    keyring: &Keyring,
    bad: &mut Vec<(Table, String, Vec<u8>)>,
) -> Result<Vec<(String, R, bool)>, StoreError> {
    let mut out = Vec::new();
    for row in table.iter()? {
        let (k, v) = row?;
        let key = k.value().to_string();
        match decode_checked::<R>(&key, v.value(), keyring) {
            Some((r, clear)) => out.push((key, r, clear)),
            None => bad.push((R::TABLE, key, v.value().to_vec())),
        }
    }
    Ok(out)
}

/// Loads every table of the schema in one write transaction, setting bad
/// records aside and sealing clear secrets.
struct Loader<'a> {
    txn: &'a redb::WriteTransaction,
    keyring: &'a Keyring,
    /// Records to quarantine: table, key, stored bytes.
    bad: Vec<(Table, String, Vec<u8>)>,
    /// Records that held secrets in the clear, now sealed.
    sealed: usize,
}

impl TableVisitor for Loader<'_> {
    type Error = StoreError;

    fn visit<R: Record>(&mut self, store: &mut R::Store) -> Result<(), StoreError> {
        let mut t = self.txn.open_table(definition(R::TABLE))?;
        for (key, record, clear) in decode_table::<R>(&t, self.keyring, &mut self.bad)? {
            // Schema 1's clear secrets are sealed now.
            if clear {
                t.insert(key.as_str(), record.encode(self.keyring)?.as_slice())?;
                self.sealed += 1;
            }
            store.insert_loaded(record);
        }
        Ok(())
    }
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

/// The node secrets: schema 1's clear ones are moved into the sealed
/// table (and their table deleted), then every sealed one is opened. One
/// that is unusable (not a secret, not opening) is left out and reported by
/// node ID only: its node is then treated as one without a secret, which
/// takes the secret of its next registration.
fn load_node_secrets(
    txn: &redb::WriteTransaction,
    keyring: &Keyring,
) -> Result<(BTreeMap<String, NodeSecret>, usize), StoreError> {
    let mut clear = Vec::new();
    {
        let old = txn.open_table(NODE_SECRETS)?;
        for row in old.iter()? {
            let (k, v) = row?;
            clear.push((k.value().to_string(), v.value().to_string()));
        }
    }
    txn.delete_table(NODE_SECRETS)?;
    let mut sealed_table = txn.open_table(NODE_SECRETS_SEALED)?;
    let mut moved = 0;
    for (node_id, text) in clear {
        match NodeSecret::parse(&text) {
            Ok(secret) => {
                let bytes = seal_node_secret(&node_id, &secret, keyring)?;
                sealed_table.insert(node_id.as_str(), bytes.as_slice())?;
                moved += 1;
            }
            Err(e) => {
                tracing::error!(node_id, error = %e, "stored node secret is unusable; the node's next registration sets a new one");
            }
        }
    }
    let mut out = BTreeMap::new();
    for row in sealed_table.iter()? {
        let (k, v) = row?;
        if let Some(secret) = usable_node_secret(k.value(), v.value(), keyring) {
            out.insert(k.value().to_string(), secret);
        }
    }
    Ok((out, moved))
}

impl Backend for RedbBackend {
    fn load(&self) -> Result<Tables, StoreError> {
        let txn = self.db()?.begin_write()?;
        let mut tables = Tables::default();
        self.load_meta(&txn, &mut tables)?;
        let mut loader = Loader {
            txn: &txn,
            keyring: &self.keyring,
            bad: Vec::new(),
            sealed: 0,
        };
        tables.visit_mut(&mut loader)?;
        let Loader { bad, sealed, .. } = loader;
        let (secrets, sealed_node_secrets) = load_node_secrets(&txn, &self.keyring)?;
        tables.node_secrets = secrets;
        if sealed > 0 || sealed_node_secrets > 0 {
            tracing::info!(
                volumes = sealed,
                node_secrets = sealed_node_secrets,
                "sealed secrets that an older berth stored in the clear"
            );
        }
        tables.raise_index_to_records();
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

    fn rotate_keyring(&self) -> Result<KeyRotation, StoreError> {
        let key_id = self.keyring.add_key()?;
        let resealed = match self.reseal_all() {
            Err(e) if is_previous_io(&e) => {
                self.close_poisoned();
                self.reseal_all()
            }
            other => other,
        };
        let (volumes, node_secrets) = match resealed {
            Ok(counts) => counts,
            Err(e) => {
                if let Err(undo) = self.keyring.remove_key(&key_id) {
                    tracing::error!(key_id, error = %undo, "removing the unused new keyring key failed");
                }
                return Err(e);
            }
        };
        let retired = self.keyring.retire_all_but_active()?;
        tracing::info!(key_id, retired = ?retired, volumes, node_secrets, "rotated the keyring");
        Ok(KeyRotation {
            key_id,
            retired,
            volumes,
            node_secrets,
        })
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
    /// Seal every stored secret again with the active key, in one
    /// transaction. A secret that does not open fails it: its key must
    /// stay.
    fn reseal_all(&self) -> Result<(usize, usize), StoreError> {
        let k = &self.keyring;
        let txn = self.db()?.begin_write()?;
        let (volumes, node_secrets);
        {
            let mut t = txn.open_table(definition(Table::Volumes))?;
            let mut resealed = Vec::new();
            for row in t.iter()? {
                let (key, bytes) = row?;
                let key = key.value().to_string();
                let (volume, _) =
                    decode_volume(&key, bytes.value(), k).map_err(|source| StoreError::Reseal {
                        record: record_aad(Table::Volumes.name(), &key),
                        source,
                    })?;
                if !volume.secrets.is_empty() {
                    resealed.push((key, encode_volume(&volume, k)?));
                }
            }
            for (key, bytes) in &resealed {
                t.insert(key.as_str(), bytes.as_slice())?;
            }
            volumes = resealed.len();
            let mut s = txn.open_table(NODE_SECRETS_SEALED)?;
            let mut resealed = Vec::new();
            for row in s.iter()? {
                let (node_id, bytes) = row?;
                let node_id = node_id.value().to_string();
                let secret = open_node_secret(&node_id, bytes.value(), k).map_err(|source| {
                    StoreError::Reseal {
                        record: record_aad(NODE_SECRETS_SEALED_NAME, &node_id),
                        source,
                    }
                })?;
                resealed.push((node_id.clone(), seal_node_secret(&node_id, &secret, k)?));
            }
            for (node_id, bytes) in &resealed {
                s.insert(node_id.as_str(), bytes.as_slice())?;
            }
            node_secrets = resealed.len();
        }
        txn.commit()?;
        Ok((volumes, node_secrets))
    }

    fn commit_once(&self, index: u64, changes: &[Change]) -> Result<(), StoreError> {
        let txn = self.db()?.begin_write()?;
        {
            let mut touched = std::collections::BTreeSet::new();
            for change in changes {
                let kind = change.table();
                touched.insert(kind);
                // A deleted node's secret stays: its ID stays bound to it.
                if let Change::PutNodeSecret { node_id, secret } = change {
                    let bytes = seal_node_secret(node_id, secret, &self.keyring)?;
                    let mut s = txn.open_table(NODE_SECRETS_SEALED)?;
                    s.insert(node_id.as_str(), bytes.as_slice())?;
                    continue;
                }
                let mut t = txn.open_table(definition(kind))?;
                match change.encode(&self.keyring) {
                    Some(bytes) => {
                        t.insert(change.key().as_ref(), bytes?.as_slice())?;
                    }
                    None => {
                        t.remove(change.key().as_ref())?;
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

    use base64::engine::general_purpose::STANDARD as B64;
    use base64::Engine;

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
            Table::JobVersions | Table::Acl | Table::Deployments => {
                unreachable!("the generated records are of the first four tables")
            }
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
        fn good<T: Record>(key: &str, bytes: &[u8]) -> bool {
            serde_json::from_slice::<T>(bytes)
                .is_ok_and(|r| r.key() == key && r.indexes().iter().all(|&i| i <= MAX_SANE_INDEX))
        }
        match kind {
            Table::Jobs => good::<Job>(key, bytes),
            Table::Allocs => good::<Allocation>(key, bytes),
            Table::Nodes => good::<Node>(key, bytes),
            Table::Volumes => good::<CsiVolume>(key, bytes),
            Table::JobVersions | Table::Acl | Table::Deployments => {
                unreachable!("the generated records are of the first four tables")
            }
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

    /// The stored form of each table: the record's JSON under its key, in
    /// the table named after it, and the indexes in `meta`.
    #[test]
    fn each_table_stores_its_records_json_under_their_keys() {
        use berth_structs::acl::AclPolicy;

        use crate::state::{AclRecord, Change};

        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        let store =
            StateStore::open(Box::new(RedbBackend::open(&path).expect("open"))).expect("store");
        let ((), index) = store
            .write(|_, changes| {
                changes.push(Change::PutJob(Job {
                    id: "j".into(),
                    ..Default::default()
                }));
                changes.push(Change::PutAlloc(Allocation {
                    id: "a".into(),
                    ..Default::default()
                }));
                changes.push(Change::PutNode(Node {
                    id: "n".into(),
                    ..Default::default()
                }));
                changes.push(Change::PutVolume(CsiVolume {
                    id: "v".into(),
                    ..Default::default()
                }));
                changes.push(Change::put_acl(AclRecord::Policy(AclPolicy {
                    name: "ops".into(),
                    ..Default::default()
                })));
                Ok::<_, StoreError>(())
            })
            .expect("write");
        let want: Vec<(&str, &str, Vec<u8>)> = store.read(|t| {
            vec![
                ("jobs", "j", serde_json::to_vec(&t.jobs["j"]).expect("json")),
                (
                    "allocs",
                    "a",
                    serde_json::to_vec(&t.allocs["a"]).expect("json"),
                ),
                (
                    "nodes",
                    "n",
                    serde_json::to_vec(&t.nodes["n"]).expect("json"),
                ),
                (
                    "volumes",
                    "v",
                    serde_json::to_vec(&t.volumes["v"]).expect("json"),
                ),
                (
                    "acl",
                    "policy/ops",
                    serde_json::to_vec(&AclRecord::Policy(t.acl.policies["ops"].clone()))
                        .expect("json"),
                ),
            ]
        });
        drop(store);
        let db = Database::create(&path).expect("open db");
        let txn = db.begin_read().expect("read");
        for (table, key, bytes) in want {
            let t = txn
                .open_table(TableDefinition::<&str, &[u8]>::new(table))
                .expect("table");
            let stored = t.get(key).expect("get").expect("stored").value().to_vec();
            assert_eq!(stored, bytes, "{table}/{key}");
        }
        let m = txn.open_table(META).expect("meta");
        for key in [
            META_INDEX,
            "index/jobs",
            "index/allocs",
            "index/nodes",
            "index/volumes",
            "index/acl",
        ] {
            assert_eq!(
                m.get(key).expect("get").map(|v| v.value()),
                Some(index),
                "{key}"
            );
        }
    }

    /// What every secret test stores: a volume with secrets and a node
    /// secret.
    const VOLUME_SECRET: &str = "vol-secret-0123456789";

    fn secret_volume() -> CsiVolume {
        CsiVolume {
            id: "vol".into(),
            plugin_id: "p".into(),
            secrets: [("password".to_string(), VOLUME_SECRET.to_string())].into(),
            ..Default::default()
        }
    }

    fn node_secret() -> NodeSecret {
        NodeSecret::parse("node-secret-abcdefghijklmnop").expect("a node secret")
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    fn file_bytes(path: &Path) -> Vec<u8> {
        std::fs::read(path).expect("read the database file")
    }

    fn put_secrets(store: &StateStore) {
        store
            .write(|_, changes| {
                changes.push(crate::state::Change::PutVolume(secret_volume()));
                changes.push(crate::state::Change::PutNode(Node {
                    id: "n1".into(),
                    ..Default::default()
                }));
                changes.push(crate::state::Change::PutNodeSecret {
                    node_id: "n1".into(),
                    secret: node_secret(),
                });
                Ok::<_, StoreError>(())
            })
            .expect("write the secrets");
    }

    fn assert_secrets_loaded(store: &StateStore) {
        store.read(|t| {
            assert_eq!(t.volumes["vol"].secrets["password"], VOLUME_SECRET);
            assert_eq!(t.node_secrets["n1"], node_secret());
        });
    }

    #[test]
    fn secrets_are_sealed_in_the_file_and_open_again_on_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        let store =
            StateStore::open(Box::new(RedbBackend::open(&path).expect("open"))).expect("store");
        put_secrets(&store);
        assert_secrets_loaded(&store);
        let raw = file_bytes(&path);
        assert!(
            !contains(&raw, VOLUME_SECRET.as_bytes()),
            "volume secret in the file"
        );
        assert!(!contains(&raw, b"password"), "secret names are sealed too");
        assert!(
            !contains(&raw, node_secret().expose().as_bytes()),
            "node secret in the file"
        );
        drop(store);

        let store =
            StateStore::open(Box::new(RedbBackend::open(&path).expect("reopen"))).expect("store");
        assert_secrets_loaded(&store);
        assert!(store.quarantined().expect("quarantine").is_empty());
    }

    #[test]
    fn a_schema_1_database_with_clear_secrets_loads_and_is_sealed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        // What schema 1 wrote: the volume's secrets in its JSON, the node
        // secret as text.
        {
            let db = Database::create(&path).expect("create db");
            let txn = db.begin_write().expect("begin");
            {
                let mut t = txn.open_table(definition(Table::Volumes)).expect("volumes");
                let bytes = serde_json::to_vec(&secret_volume()).expect("encode");
                t.insert("vol", bytes.as_slice()).expect("insert");
                let mut n = txn.open_table(definition(Table::Nodes)).expect("nodes");
                let bytes = serde_json::to_vec(&Node {
                    id: "n1".into(),
                    ..Default::default()
                })
                .expect("encode");
                n.insert("n1", bytes.as_slice()).expect("insert");
                let mut s = txn.open_table(NODE_SECRETS).expect("node secrets");
                s.insert("n1", node_secret().expose()).expect("insert");
                let mut m = txn.open_table(META).expect("meta");
                m.insert(META_SCHEMA, 1).expect("schema");
            }
            txn.commit().expect("commit");
        }
        assert!(contains(&file_bytes(&path), VOLUME_SECRET.as_bytes()));

        let backend = RedbBackend::open(&path).expect("open");
        let store = StateStore::open(Box::new(backend)).expect("store");
        assert_secrets_loaded(&store);
        assert!(store.quarantined().expect("quarantine").is_empty());
        drop(store);

        // Stored sealed now: the tables hold no clear secret, and it loads
        // from the sealed form.
        let db = Database::create(&path).expect("open db");
        {
            let txn = db.begin_read().expect("read");
            let t = txn.open_table(definition(Table::Volumes)).expect("volumes");
            let bytes = t
                .get("vol")
                .expect("get")
                .expect("vol stored")
                .value()
                .to_vec();
            assert!(!contains(&bytes, VOLUME_SECRET.as_bytes()));
            assert!(contains(&bytes, b"sealed_secrets"));
            assert!(matches!(
                txn.open_table(NODE_SECRETS),
                Err(redb::TableError::TableDoesNotExist(_))
            ));
            let m = txn.open_table(META).expect("meta");
            assert_eq!(
                m.get(META_SCHEMA).expect("get").map(|v| v.value()),
                Some(SCHEMA_VERSION)
            );
        }
        drop(db);
        let store =
            StateStore::open(Box::new(RedbBackend::open(&path).expect("reopen"))).expect("store");
        assert_secrets_loaded(&store);
    }

    /// Rewrites the stored volume `vol` with `edit` applied to its JSON.
    fn edit_stored_volume(path: &Path, edit: impl FnOnce(&mut Value)) {
        let db = Database::create(path).expect("open db");
        let txn = db.begin_write().expect("begin");
        {
            let mut t = txn.open_table(definition(Table::Volumes)).expect("volumes");
            let bytes = t
                .get("vol")
                .expect("get")
                .expect("vol stored")
                .value()
                .to_vec();
            let mut v: Value = serde_json::from_slice(&bytes).expect("json");
            edit(&mut v);
            t.insert("vol", v.to_string().as_bytes()).expect("insert");
        }
        txn.commit().expect("commit");
    }

    #[test]
    fn a_damaged_ciphertext_is_quarantined_and_reported_and_writes_go_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        let store =
            StateStore::open(Box::new(RedbBackend::open(&path).expect("open"))).expect("store");
        put_secrets(&store);
        drop(store);
        edit_stored_volume(&path, |v| {
            let ct = v["sealed_secrets"]["ciphertext"]
                .as_str()
                .expect("ciphertext")
                .to_string();
            let mut bytes = B64.decode(ct).expect("base64");
            bytes[0] ^= 0xff;
            v["sealed_secrets"]["ciphertext"] = Value::from(B64.encode(bytes));
        });

        let backend = RedbBackend::open(&path).expect("reopen");
        let store =
            StateStore::open(Box::new(backend)).expect("a damaged record never stops the store");
        assert!(store.read(|t| t.volumes.is_empty()));
        assert_eq!(store.read(|t| t.node_secrets.len()), 1, "the rest loads");
        let quarantined = store.quarantined().expect("quarantine");
        assert_eq!(quarantined.len(), 1);
        assert!(
            quarantined[0].key.starts_with("volumes/vol/"),
            "{}",
            quarantined[0].key
        );
        put_secrets(&store);
        assert_secrets_loaded(&store);
    }

    #[test]
    fn a_volume_sealed_with_a_missing_key_is_quarantined_with_the_key_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        let store =
            StateStore::open(Box::new(RedbBackend::open(&path).expect("open"))).expect("store");
        put_secrets(&store);
        drop(store);
        edit_stored_volume(&path, |v| {
            v["sealed_secrets"]["key_id"] = Value::from("0000gone");
        });
        let volume = {
            let db = Database::create(&path).expect("open db");
            let txn = db.begin_read().expect("read");
            let t = txn.open_table(definition(Table::Volumes)).expect("volumes");
            let bytes = t.get("vol").expect("get").expect("stored").value().to_vec();
            bytes
        };
        let backend = RedbBackend::open(&path).expect("reopen");
        let keyring_dir = backend.keyring().dir().display().to_string();
        let e = decode_volume("vol", &volume, backend.keyring()).expect_err("does not open");
        assert_eq!(
            e.to_string(),
            format!("its secrets do not open: sealed with key 0000gone, which is not in the keyring {keyring_dir}")
        );
        let store = StateStore::open(Box::new(backend)).expect("store");
        assert!(store.read(|t| t.volumes.is_empty()));
        assert_eq!(store.quarantined().expect("quarantine").len(), 1);
    }

    #[test]
    fn a_sealed_value_moved_onto_another_record_does_not_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let keyring = Keyring::open(&dir.path().join("keyring")).expect("keyring");
        let bytes = encode_volume(&secret_volume(), &keyring).expect("encode");
        let (back, clear) = decode_volume("vol", &bytes, &keyring).expect("round trip");
        assert_eq!(back, secret_volume());
        assert!(!clear);
        let e = decode_volume("other", &bytes, &keyring).expect_err("bound to its record");
        assert!(
            e.to_string()
                .contains("ciphertext is damaged or was sealed for another record"),
            "{e}"
        );
    }

    #[test]
    fn rotating_the_keyring_reseals_everything_and_removes_the_old_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        let backend = RedbBackend::open(&path).expect("open");
        let old = backend.keyring().active_id();
        let keyring_dir = backend.keyring().dir().to_path_buf();
        let store = StateStore::open(Box::new(backend)).expect("store");
        put_secrets(&store);
        let index = store.index();
        let old_ciphertext = {
            let raw = file_bytes(&path);
            let at = raw
                .windows(b"\"ciphertext\":\"".len())
                .position(|w| w == b"\"ciphertext\":\"")
                .expect("a sealed value in the file")
                + b"\"ciphertext\":\"".len();
            raw[at..at + 24].to_vec()
        };

        let rotation = store.rotate_keyring().expect("rotate");
        assert_ne!(rotation.key_id, old);
        assert_eq!(rotation.retired, std::slice::from_ref(&old));
        assert_eq!((rotation.volumes, rotation.node_secrets), (1, 1));
        assert_eq!(store.index(), index, "a rotation is no write of the tables");
        assert!(!keyring_dir.join(format!("{old}.json")).exists());
        assert!(keyring_dir
            .join(format!("{}.json", rotation.key_id))
            .exists());
        assert_secrets_loaded(&store);
        drop(store);

        let raw = file_bytes(&path);
        assert!(
            !contains(&raw, &old_ciphertext),
            "the old ciphertext is gone from the file"
        );
        assert!(!contains(&raw, old.as_bytes()), "nothing names the old key");
        let backend = RedbBackend::open(&path).expect("reopen");
        assert_eq!(
            backend.keyring().key_ids(),
            std::slice::from_ref(&rotation.key_id)
        );
        let store = StateStore::open(Box::new(backend)).expect("store");
        assert_secrets_loaded(&store);
        assert!(store.quarantined().expect("quarantine").is_empty());
    }

    #[test]
    fn the_state_dir_keyring_and_files_are_private_and_looser_ones_are_narrowed() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = RedbBackend::path_in(dir.path());
        let backend = RedbBackend::open(&path).expect("open");
        let keyring_dir = backend.keyring().dir().to_path_buf();
        let key_file = keyring_dir.join(format!("{}.json", backend.keyring().active_id()));
        drop(backend);
        let server_dir = path.parent().expect("parent").to_path_buf();
        for (p, want) in [
            (&server_dir, 0o700),
            (&path, 0o600),
            (&keyring_dir, 0o700),
            (&key_file, 0o600),
        ] {
            assert_eq!(mode(p), want, "{}", p.display());
        }
        for (p, loose) in [
            (&server_dir, 0o755),
            (&path, 0o644),
            (&keyring_dir, 0o755),
            (&key_file, 0o644),
        ] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(loose)).expect("chmod");
        }
        RedbBackend::open(&path).expect("reopen");
        for (p, want) in [
            (&server_dir, 0o700),
            (&path, 0o600),
            (&keyring_dir, 0o700),
            (&key_file, 0o600),
        ] {
            assert_eq!(mode(p), want, "narrowed: {}", p.display());
        }
    }
}
