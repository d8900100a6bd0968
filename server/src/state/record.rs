//! What the store needs to know of one kind of object: [`Record`], its
//! table, its key, its create and modify index and how a write stamps
//! them, the secondary indexes it is in, and how it is encoded for the
//! backend. The store's writes, its stamping, its indexes and the redb
//! backend are generic over it; the list of tables is in `schema`.
//!
//! [`RecordStore`] is how a table holds its records in memory: a map by
//! key for most, [`super::AclTables`] (with lookups by secret hash) for
//! the ACL records.

use std::borrow::Cow;
use std::collections::BTreeMap;

use berth_structs::{Allocation, CsiVolume, Job, Node, NodeSecret};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::error::StoreError;
use super::{Indexes, Table};
use crate::keyring::{Keyring, KeyringError, Sealed};

/// Why a stored record did not load (or did not open to be sealed again).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("failed to decode: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("its secrets do not open: {0}")]
    Unseal(#[from] KeyringError),
    #[error("is not a node secret: {0}")]
    InvalidNodeSecret(#[from] berth_structs::NodeSecretError),
}

/// What a write moved besides its tables, for the store's watches.
#[derive(Debug, Default)]
pub struct WriteEffects {
    /// Nodes that had an alloc put or deleted (but for its volume stats
    /// alone).
    pub alloc_nodes: Vec<String>,
    /// Nodes written or deleted.
    pub nodes: Vec<String>,
    /// An alloc was put or deleted (but for its volume stats alone).
    pub allocs_moved: bool,
}

/// One kind of object the store keeps, in its own table.
pub trait Record: Clone + std::fmt::Debug + Serialize + DeserializeOwned + Sized {
    /// The table it is kept in.
    const TABLE: Table;
    /// How the table holds its records in memory.
    type Store: RecordStore<Self>;

    /// Its key in the table.
    fn key(&self) -> Cow<'_, str>;

    /// The create and modify index (zero where the record has none).
    fn indexes(&self) -> [u64; 2];

    /// Sets the create and modify index (and times) of a record about to
    /// be written at `index`, replacing `old` when there was one.
    fn stamp(&mut self, old: Option<&Self>, index: u64, now_ms: i64);

    /// Adds the record to the secondary indexes.
    fn index(&self, _idx: &mut Indexes) {}

    /// Removes the record from the secondary indexes.
    fn unindex(&self, _idx: &mut Indexes) {}

    /// Whether a put of `self` over `old` changes nothing that watchers or
    /// indexes look at (an alloc's volume stats alone).
    fn quiet_over(&self, _old: &Self) -> bool {
        false
    }

    /// Notes what a put (`new` is `Some`) or a delete (`new` is `None`)
    /// under `key` moved for the watches; `old` is what was there.
    fn note_write(_key: &str, _old: Option<&Self>, _new: Option<&Self>, _fx: &mut WriteEffects) {}

    /// The stored bytes.
    fn encode(&self, _keyring: &Keyring) -> Result<Vec<u8>, StoreError> {
        serde_json::to_vec(self).map_err(|source| StoreError::Encode {
            table: Self::TABLE.name(),
            key: self.key().into_owned(),
            source,
        })
    }

    /// Decodes the stored bytes under `key`, opening sealed parts. The flag
    /// is true for a record that held secrets in the clear (schema 1),
    /// which is to be written again sealed.
    fn decode(_key: &str, bytes: &[u8], _keyring: &Keyring) -> Result<(Self, bool), RecordError> {
        Ok((serde_json::from_slice(bytes)?, false))
    }

    /// Reports a stored record that is quarantined on load: `decoded` is
    /// the record when it decoded but is unusable.
    fn report_bad(key: &str, decoded: Option<&Self>, error: Option<&RecordError>) {
        let name = Self::TABLE.name();
        match (decoded, error) {
            (_, Some(e)) => tracing::error!(table = name, key = %key, error = %e,
                "state record did not load; quarantining it"),
            (Some(r), None) if r.key() != key => {
                tracing::error!(table = name, key = %key, id = %r.key(),
                    "state record's ID does not match its key; quarantining it")
            }
            (Some(r), None) => {
                let [create_index, modify_index] = r.indexes();
                tracing::error!(table = name, key = %key, create_index, modify_index,
                    "state record's index is beyond any real store's; quarantining it")
            }
            (None, None) => {}
        }
    }
}

/// How a table holds its records in memory. Everything the store does to
/// a table goes through here.
pub trait RecordStore<R: Record>: std::fmt::Debug + Default + Clone {
    /// Stamps `record` for a write at `index` (see [`Record::stamp`]).
    fn stamp(&self, record: &mut R, index: u64, now_ms: i64);
    /// Puts `record`, keeping `idx` and noting what moved in `fx`.
    fn put(&mut self, record: R, idx: &mut Indexes, fx: &mut WriteEffects);
    /// Deletes the record under `key`, keeping `idx` and noting what moved.
    fn delete(&mut self, key: &str, idx: &mut Indexes, fx: &mut WriteEffects);
    /// Puts a record as loaded from the backend.
    fn insert_loaded(&mut self, record: R);
    /// Adds every record to `idx`.
    fn index_all(&self, idx: &mut Indexes);
    /// The highest modify index of the records that the store's index is
    /// kept above on load.
    fn max_modify_index(&self) -> u64;
}

impl<R: Record> RecordStore<R> for BTreeMap<String, R> {
    fn stamp(&self, record: &mut R, index: u64, now_ms: i64) {
        let old = self.get(record.key().as_ref());
        record.stamp(old, index, now_ms);
    }

    fn put(&mut self, record: R, idx: &mut Indexes, fx: &mut WriteEffects) {
        let key = record.key().into_owned();
        let old = self.get(&key);
        if !old.is_some_and(|o| record.quiet_over(o)) {
            if let Some(o) = old {
                o.unindex(idx);
            }
            record.index(idx);
            R::note_write(&key, old, Some(&record), fx);
        }
        self.insert(key, record);
    }

    fn delete(&mut self, key: &str, idx: &mut Indexes, fx: &mut WriteEffects) {
        let old = self.remove(key);
        if let Some(o) = &old {
            o.unindex(idx);
        }
        R::note_write(key, old.as_ref(), None, fx);
    }

    fn insert_loaded(&mut self, record: R) {
        self.insert(record.key().into_owned(), record);
    }

    fn index_all(&self, idx: &mut Indexes) {
        for r in self.values() {
            r.index(idx);
        }
    }

    fn max_modify_index(&self) -> u64 {
        self.values().map(|r| r.indexes()[1]).max().unwrap_or(0)
    }
}

/// The create and modify index and time of a record that keeps both
/// times (an alloc, a deployment).
struct Stamps<'a> {
    create_index: &'a mut u64,
    create_time_ms: &'a mut i64,
    modify_index: &'a mut u64,
    modify_time_ms: &'a mut i64,
}

impl Stamps<'_> {
    /// Stamped for a write at `index`, `now_ms`, over a record created at
    /// `old` (index, time) when there was one.
    fn set(self, old: Option<(u64, i64)>, index: u64, now_ms: i64) {
        let (created_index, created_ms) = old.unwrap_or((index, now_ms));
        *self.create_index = created_index;
        *self.create_time_ms = created_ms;
        *self.modify_index = index;
        *self.modify_time_ms = now_ms;
    }
}

impl Record for Job {
    const TABLE: Table = Table::Jobs;
    type Store = BTreeMap<String, Job>;

    fn key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }

    fn indexes(&self) -> [u64; 2] {
        [self.create_index, self.modify_index]
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, now_ms: i64) {
        self.create_index = old.map_or(index, |o| o.create_index);
        self.modify_index = index;
        self.modify_time_ms = now_ms;
    }
}

impl Record for berth_structs::JobVersion {
    const TABLE: Table = Table::JobVersions;
    type Store = BTreeMap<String, berth_structs::JobVersion>;

    fn key(&self) -> Cow<'_, str> {
        Cow::Owned(berth_structs::JobVersion::key_of(
            &self.job_id,
            self.version,
        ))
    }

    fn indexes(&self) -> [u64; 2] {
        [self.create_index, self.modify_index]
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, now_ms: i64) {
        self.create_index = old.map_or(index, |o| o.create_index);
        self.modify_index = index;
        if self.submit_time_ms == 0 {
            self.submit_time_ms = now_ms;
        }
    }
}

impl Record for berth_structs::Deployment {
    const TABLE: Table = Table::Deployments;
    type Store = BTreeMap<String, berth_structs::Deployment>;

    fn key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }

    fn indexes(&self) -> [u64; 2] {
        [self.create_index, self.modify_index]
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, now_ms: i64) {
        let old = old.map(|o| (o.create_index, o.create_time_ms));
        let stamps = Stamps {
            create_index: &mut self.create_index,
            create_time_ms: &mut self.create_time_ms,
            modify_index: &mut self.modify_index,
            modify_time_ms: &mut self.modify_time_ms,
        };
        stamps.set(old, index, now_ms);
    }

    fn index(&self, idx: &mut Indexes) {
        super::indexes::link(&mut idx.deployments_by_job, &self.job_id, &self.id);
    }

    fn unindex(&self, idx: &mut Indexes) {
        super::indexes::unlink(&mut idx.deployments_by_job, &self.job_id, &self.id);
    }
}

impl Record for Allocation {
    const TABLE: Table = Table::Allocs;
    type Store = BTreeMap<String, Allocation>;

    fn key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }

    fn indexes(&self) -> [u64; 2] {
        [self.create_index, self.modify_index]
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, now_ms: i64) {
        let old = old.map(|o| (o.create_index, o.create_time_ms));
        let stamps = Stamps {
            create_index: &mut self.create_index,
            create_time_ms: &mut self.create_time_ms,
            modify_index: &mut self.modify_index,
            modify_time_ms: &mut self.modify_time_ms,
        };
        stamps.set(old, index, now_ms);
    }

    fn index(&self, idx: &mut Indexes) {
        idx.put_alloc(self);
    }

    fn unindex(&self, idx: &mut Indexes) {
        idx.remove_alloc(self);
    }

    /// A write of the volume stats alone sends nothing new to the node:
    /// its alloc watch is not made to scan every alloc again for it.
    fn quiet_over(&self, old: &Self) -> bool {
        old.same_but_volume_stats(self)
    }

    fn note_write(_key: &str, old: Option<&Self>, new: Option<&Self>, fx: &mut WriteEffects) {
        for a in new.into_iter().chain(old) {
            fx.alloc_nodes.push(a.node_id.clone());
            fx.allocs_moved = true;
        }
    }
}

impl Record for Node {
    const TABLE: Table = Table::Nodes;
    type Store = BTreeMap<String, Node>;

    fn key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }

    fn indexes(&self) -> [u64; 2] {
        [self.create_index, self.modify_index]
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, _now_ms: i64) {
        self.create_index = old.map_or(index, |o| o.create_index);
        self.modify_index = index;
    }

    fn index(&self, idx: &mut Indexes) {
        idx.put_node(self);
    }

    fn unindex(&self, idx: &mut Indexes) {
        idx.remove_node(self);
    }

    /// A node's watch is woken by any write of the node, a delete of one
    /// that is not there too.
    fn note_write(key: &str, _old: Option<&Self>, _new: Option<&Self>, fx: &mut WriteEffects) {
        fx.nodes.push(key.to_string());
    }
}

impl Record for CsiVolume {
    const TABLE: Table = Table::Volumes;
    type Store = BTreeMap<String, CsiVolume>;

    fn key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }

    fn indexes(&self) -> [u64; 2] {
        [self.create_index, self.modify_index]
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, _now_ms: i64) {
        self.create_index = old.map_or(index, |o| o.create_index);
        self.modify_index = index;
    }

    fn index(&self, idx: &mut Indexes) {
        idx.put_volume(self);
    }

    fn unindex(&self, idx: &mut Indexes) {
        idx.remove_volume(self);
    }

    fn encode(&self, keyring: &Keyring) -> Result<Vec<u8>, StoreError> {
        encode_volume(self, keyring)
    }

    fn decode(key: &str, bytes: &[u8], keyring: &Keyring) -> Result<(Self, bool), RecordError> {
        decode_volume(key, bytes, keyring)
    }
}

/// A volume as stored: its secrets sealed, apart from the rest.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredVolume<V> {
    #[serde(flatten)]
    volume: V,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sealed_secrets: Option<Sealed>,
}

/// The associated data a record's sealed value is bound to.
pub(crate) fn record_aad(table: &str, key: &str) -> String {
    format!("{table}/{key}")
}

/// A volume's stored bytes: its secrets sealed with the active key.
pub(crate) fn encode_volume(v: &CsiVolume, keyring: &Keyring) -> Result<Vec<u8>, StoreError> {
    let encode_err = |source| StoreError::Encode {
        table: Table::Volumes.name(),
        key: v.id.clone(),
        source,
    };
    if v.secrets.is_empty() {
        return serde_json::to_vec(v).map_err(encode_err);
    }
    let secrets = serde_json::to_vec(&v.secrets).map_err(encode_err)?;
    let sealed = keyring
        .seal(&secrets, &record_aad(Table::Volumes.name(), &v.id))
        .map_err(|source| StoreError::Seal {
            record: record_aad(Table::Volumes.name(), &v.id),
            source,
        })?;
    let mut bare = v.clone();
    bare.secrets.clear();
    serde_json::to_vec(&StoredVolume {
        volume: bare,
        sealed_secrets: Some(sealed),
    })
    .map_err(encode_err)
}

pub(crate) fn decode_volume(
    key: &str,
    bytes: &[u8],
    keyring: &Keyring,
) -> Result<(CsiVolume, bool), RecordError> {
    let stored: StoredVolume<CsiVolume> = serde_json::from_slice(bytes)?;
    let mut volume = stored.volume;
    match stored.sealed_secrets {
        Some(sealed) => {
            let plain = keyring.open_sealed(&sealed, &record_aad(Table::Volumes.name(), key))?;
            volume.secrets = serde_json::from_slice(&plain)?;
            Ok((volume, false))
        }
        None => {
            let clear = !volume.secrets.is_empty();
            Ok((volume, clear))
        }
    }
}

/// The name node secrets are sealed under (and the redb table they are
/// kept in).
pub(crate) const NODE_SECRETS_SEALED_NAME: &str = "node_secrets_sealed";

/// No real store reaches this index: 2^53 writes take centuries at a
/// million writes a second. A record or meta entry beyond it is corrupt,
/// and trusting it would leave no room for the index of the next write.
pub(crate) const MAX_SANE_INDEX: u64 = 1 << 53;

/// A node secret's stored bytes.
pub(crate) fn seal_node_secret(
    node_id: &str,
    secret: &NodeSecret,
    keyring: &Keyring,
) -> Result<Vec<u8>, StoreError> {
    let record = record_aad(NODE_SECRETS_SEALED_NAME, node_id);
    let sealed = keyring
        .seal(secret.expose().as_bytes(), &record)
        .map_err(|source| StoreError::Seal {
            record: record.clone(),
            source,
        })?;
    serde_json::to_vec(&sealed).map_err(|source| StoreError::Encode {
        table: NODE_SECRETS_SEALED_NAME,
        key: node_id.to_string(),
        source,
    })
}

pub(crate) fn open_node_secret(
    node_id: &str,
    bytes: &[u8],
    keyring: &Keyring,
) -> Result<NodeSecret, RecordError> {
    let sealed: Sealed = serde_json::from_slice(bytes)?;
    let plain = keyring.open_sealed(&sealed, &record_aad(NODE_SECRETS_SEALED_NAME, node_id))?;
    let text =
        String::from_utf8(plain).map_err(|_| berth_structs::NodeSecretError::NotPrintable)?;
    Ok(NodeSecret::parse(&text)?)
}

/// The sealed node secret of `node_id`, opened; one that is unusable (not
/// a secret, not opening) is reported by node ID only and `None`: its node
/// is then treated as one without a secret, which takes the secret of its
/// next registration.
pub(crate) fn usable_node_secret(
    node_id: &str,
    bytes: &[u8],
    keyring: &Keyring,
) -> Option<NodeSecret> {
    open_node_secret(node_id, bytes, keyring)
        .map_err(|e| {
            tracing::error!(node_id, error = %e, "stored node secret is unusable; the node's next registration sets a new one");
        })
        .ok()
}

/// Decodes a stored record of `R`'s table under `key`, opening its sealed
/// parts; with whether it held secrets in the clear (schema 1). A record
/// that does not decode, whose ID is not its key or whose index is beyond
/// [`MAX_SANE_INDEX`] is reported and `None`: the backend quarantines it.
pub(crate) fn decode_checked<R: Record>(
    key: &str,
    bytes: &[u8],
    keyring: &Keyring,
) -> Option<(R, bool)> {
    match R::decode(key, bytes, keyring) {
        Ok((r, clear)) if r.key() == key && r.indexes().iter().all(|&i| i <= MAX_SANE_INDEX) => {
            Some((r, clear))
        }
        Ok((r, _)) => {
            R::report_bad(key, Some(&r), None);
            None
        }
        Err(e) => {
            R::report_bad(key, None, Some(&e));
            None
        }
    }
}

/// A visitor of every table of [`super::Tables`], one record type at a time (see
/// `Tables::visit_mut`): how the backend loads them.
pub trait TableVisitor {
    type Error;
    fn visit<R: Record>(&mut self, store: &mut R::Store) -> Result<(), Self::Error>;
}
