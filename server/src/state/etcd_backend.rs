//! The etcd backend (`server { store = "etcd" }`): every record as one key
//! under the configured prefix, its JSON the value, as the redb backend
//! stores it (secrets sealed with the keyring beside the server's data).
//!
//! ```text
//! <prefix>/<table>/<key>                      a record (jobs, allocs, nodes, volumes, acl)
//! <prefix>/node_secrets/<node ID>             a sealed node secret
//! <prefix>/meta/index                         the index of the last write
//! <prefix>/meta/table/<table>                 the index of the last write to a table
//! <prefix>/meta/schema                        the schema version
//! <prefix>/meta/cluster-id                    the cluster ID
//! <prefix>/quarantine/<table>/<key>/<index>   a record that did not load
//! ```
//!
//! A write is one transaction: its puts and deletes and the new indexes,
//! on the condition that `meta/index` was last written at the revision this
//! server last wrote or read it at. So a write is only ever made on top of
//! the state it was planned on: if anything else wrote meanwhile, the
//! transaction changes nothing and the write fails.

use std::collections::BTreeMap;
use std::path::Path;

use berth_proto::etcd::mvccpb::KeyValue;
use berth_sync::MutexExt;

use super::error::StoreError;
use super::record::{decode_checked, seal_node_secret, usable_node_secret, Record};
use super::{Backend, Change, Table, TableVisitor, Tables, SCHEMA_VERSION};
use crate::etcd::{self, EtcdClient};
use crate::keyring::Keyring;
use crate::leader::{Fence, LEADER_KEY};

pub(super) const META_INDEX: &str = "meta/index";
const META_SCHEMA: &str = "meta/schema";
const META_CLUSTER_ID: &str = "meta/cluster-id";
/// The IDs of the keys the cluster's secrets are sealed with, the active
/// one last: every server must hold them all.
const META_KEYRING: &str = "meta/keyring";
const NODE_SECRETS: &str = "node_secrets";
const QUARANTINE: &str = "quarantine";

fn table_index_key(table: Table) -> String {
    format!("meta/table/{}", table.name())
}

fn record_key(table: Table, key: &str) -> String {
    format!("{}/{key}", table.name())
}

pub struct EtcdBackend {
    client: EtcdClient,
    keyring: std::sync::Arc<Keyring>,
    /// The etcd revision of the last load: where following the writes of
    /// the leader starts (see `super::etcd_follow`).
    loaded_revision: std::sync::Arc<std::sync::atomic::AtomicI64>,
    /// The revision `meta/index` was last written or read at (0: not
    /// there): the condition of the next write.
    meta_revision: std::sync::Mutex<i64>,
    /// The leader's term every write is fenced with, when servers elect
    /// a leader (see `crate::leader`).
    fence: Option<std::sync::Arc<Fence>>,
}

impl EtcdBackend {
    /// A backend on `client`'s etcd, sealing secrets with the keyring in
    /// `keyring_dir` (made with a first key when missing).
    pub fn open(client: EtcdClient, keyring_dir: &Path) -> Result<EtcdBackend, StoreError> {
        if let Some(dir) = keyring_dir.parent() {
            crate::file_modes::ensure_private_dir(dir).map_err(|source| StoreError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let keyring = std::sync::Arc::new(Keyring::open(keyring_dir)?);
        Ok(EtcdBackend {
            client,
            keyring,
            loaded_revision: Default::default(),
            meta_revision: std::sync::Mutex::new(0),
            fence: None,
        })
    }

    /// Every write is made only while the leader key is the one `fence`
    /// holds the term of, and refused while it holds none.
    pub fn fenced(mut self, fence: std::sync::Arc<Fence>) -> EtcdBackend {
        self.fence = Some(fence);
        self
    }

    pub fn client(&self) -> &EtcdClient {
        &self.client
    }

    /// What follows the leader's writes into a store on this backend.
    pub fn follower(&self) -> super::etcd_follow::Follower {
        super::etcd_follow::Follower::new(
            self.client.clone(),
            self.keyring.clone(),
            self.loaded_revision.clone(),
        )
    }

    /// Checks that this server's keyring is the cluster's: the first
    /// server records the IDs of its keys in etcd; every other must hold
    /// them all, and seal with the same active key, or it could neither
    /// open the secrets the others sealed nor seal any they could open.
    pub fn check_keyring(&self) -> Result<(), StoreError> {
        let ours = self.keyring.key_ids();
        let active = self.keyring.active_id();
        let recorded = serde_json::to_vec(&ours).unwrap_or_default();
        let theirs = self.patiently("check the keyring", || {
            let client = self.client.clone();
            let key = client.key(META_KEYRING);
            let recorded = recorded.clone();
            async move {
                let made = client
                    .txn(etcd::TxnRequest {
                        compare: vec![etcd::absent(key.clone())],
                        success: vec![etcd::put(key.clone(), recorded.clone())],
                        failure: vec![etcd::get(key)],
                    })
                    .await?;
                Ok(if made.succeeded {
                    recorded
                } else {
                    etcd::got(&made)
                        .map(|kv| kv.value.clone())
                        .unwrap_or_default()
                })
            }
        })?;
        let theirs: Vec<String> = serde_json::from_slice(&theirs).map_err(|e| {
            StoreError::Corrupt(format!("the keyring IDs in etcd do not read: {e}"))
        })?;
        let missing: Vec<&String> = theirs.iter().filter(|id| !ours.contains(id)).collect();
        if missing.is_empty() && theirs.last() == Some(&active) {
            return Ok(());
        }
        Err(StoreError::Corrupt(format!(
            "this server's keyring ({}) is not the cluster's: the servers on etcd seal secrets \
             with key {} (keys {}), this one holds {}; copy the keyring directory of a server of \
             the cluster to every server (or point server {{ keyring_dir }} at a copy) before \
             starting it",
            self.keyring.dir().display(),
            theirs.last().map_or("?", String::as_str),
            theirs.join(", "),
            ours.join(", "),
        )))
    }

    /// The cluster ID kept in etcd, made (a UUID) by the first server that
    /// asks: servers that start together all read the one that won.
    pub fn cluster_id(&self) -> Result<String, StoreError> {
        let fresh = uuid::Uuid::new_v4().to_string();
        let answer = self.patiently("read the cluster ID", || {
            let client = self.client.clone();
            let key = client.key(META_CLUSTER_ID);
            let fresh = fresh.clone();
            async move {
                let made = client
                    .txn(etcd::TxnRequest {
                        compare: vec![etcd::absent(key.clone())],
                        success: vec![etcd::put(key.clone(), fresh.clone().into_bytes())],
                        failure: vec![],
                    })
                    .await?;
                if made.succeeded {
                    return Ok(fresh);
                }
                let kv = client.get(key).await?;
                Ok(kv
                    .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
                    .unwrap_or_default())
            }
        })?;
        uuid::Uuid::parse_str(&answer).map_err(|e| {
            StoreError::Corrupt(format!(
                "the cluster ID in etcd under {} is not a cluster ID ({e}): restore it from a \
                 backup (a new ID would make these servers a new cluster, which no client of \
                 the old one would follow)",
                String::from_utf8_lossy(&self.client.key(META_CLUSTER_ID)),
            ))
        })?;
        if answer == fresh {
            tracing::info!(cluster_id = %answer, "made the cluster ID");
        }
        Ok(answer)
    }

    /// Runs `call` until etcd answers, as long as it takes (a server
    /// without its state can do nothing), saying now and then that it
    /// waits to `what`.
    fn patiently<T, F>(&self, what: &str, call: impl Fn() -> F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T, crate::etcd::EtcdError>> + Send + 'static,
    {
        use std::time::{Duration, Instant};
        let started = Instant::now();
        let mut said: Option<Instant> = None;
        loop {
            match self.client.block_on(call()) {
                Ok(answer) => return Ok(answer),
                Err(e) if e.is_unavailable() => {
                    if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
                        tracing::warn!(error = %e, waited = ?started.elapsed(),
                            "waiting for etcd to {what}");
                        said = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Every key under the prefix, at one revision.
    fn read_all(&self) -> Result<(Vec<KeyValue>, i64), StoreError> {
        self.patiently("load the server state", || {
            let client = self.client.clone();
            async move {
                let prefix = client.prefix();
                client.range_prefix(&prefix).await
            }
        })
    }
}

fn not_leader() -> StoreError {
    StoreError::NotLeader("this server does not lead: only the leader writes".into())
}

/// What a key under the prefix is (see the module's layout).
pub(super) enum StoredKey {
    /// `meta/...`: its path under the prefix.
    Meta(String),
    /// A sealed node secret, by node ID.
    NodeSecret(String),
    /// A record of a table, by its key.
    Record(Table, String),
    /// The leader key, the members, the quarantine, another prefix's.
    Other,
}

impl StoredKey {
    pub(super) fn of(prefix: &[u8], key: &[u8]) -> StoredKey {
        let Some(rest) = key.strip_prefix(prefix) else {
            return StoredKey::Other;
        };
        let rest = String::from_utf8_lossy(rest);
        let Some((kind, key)) = rest.split_once('/') else {
            return StoredKey::Other;
        };
        if kind == "meta" {
            return StoredKey::Meta(rest.into_owned());
        }
        if kind == NODE_SECRETS {
            return StoredKey::NodeSecret(key.to_string());
        }
        match Table::ALL.into_iter().find(|t| t.name() == kind) {
            Some(table) => StoredKey::Record(table, key.to_string()),
            None => StoredKey::Other,
        }
    }
}

/// The stored keys of one load, by what they are.
#[derive(Default)]
struct Stored {
    meta: BTreeMap<String, (String, i64)>,
    tables: BTreeMap<&'static str, Vec<(String, Vec<u8>)>>,
    node_secrets: Vec<(String, Vec<u8>)>,
}

impl Stored {
    fn sort(client: &EtcdClient, kvs: Vec<KeyValue>) -> Stored {
        let prefix = client.prefix();
        let mut stored = Stored::default();
        for kv in kvs {
            match StoredKey::of(&prefix, &kv.key) {
                StoredKey::Meta(path) => {
                    let value = String::from_utf8_lossy(&kv.value).into_owned();
                    stored.meta.insert(path, (value, kv.mod_revision));
                }
                StoredKey::NodeSecret(node_id) => stored.node_secrets.push((node_id, kv.value)),
                StoredKey::Record(table, key) => stored
                    .tables
                    .entry(table.name())
                    .or_default()
                    .push((key, kv.value)),
                StoredKey::Other => {}
            }
        }
        stored
    }

    /// An index kept in meta, 0 when missing or unreadable.
    fn index(&self, key: &str) -> u64 {
        let Some((value, _)) = self.meta.get(key) else {
            return 0;
        };
        match value.parse::<u64>() {
            Ok(i) if i <= super::record::MAX_SANE_INDEX => i,
            _ => {
                tracing::error!(key, value = %value,
                    "state index in etcd is unreadable; rebuilding it from the records");
                0
            }
        }
    }
}

/// Loads every table from the sorted keys, noting the bad ones.
struct Loader<'a> {
    stored: &'a mut Stored,
    keyring: &'a Keyring,
    /// Records to quarantine: table, key, stored bytes.
    bad: Vec<(Table, String, Vec<u8>)>,
    /// Records that held secrets in the clear, sealed now: table, key,
    /// stored bytes.
    resealed: Vec<(Table, String, Vec<u8>)>,
}

impl TableVisitor for Loader<'_> {
    type Error = StoreError;

    fn visit<R: Record>(&mut self, store: &mut R::Store) -> Result<(), StoreError> {
        use super::RecordStore;
        let rows = self
            .stored
            .tables
            .remove(R::TABLE.name())
            .unwrap_or_default();
        for (key, bytes) in rows {
            match decode_checked::<R>(&key, &bytes, self.keyring) {
                Some((record, clear)) => {
                    if clear {
                        let bytes = record.encode(self.keyring)?;
                        self.resealed.push((R::TABLE, key, bytes));
                    }
                    store.insert_loaded(record);
                }
                None => self.bad.push((R::TABLE, key, bytes)),
            }
        }
        Ok(())
    }
}

impl Backend for EtcdBackend {
    fn load(&self) -> Result<Tables, StoreError> {
        let (kvs, revision) = self.read_all()?;
        let mut stored = Stored::sort(&self.client, kvs);
        if let Some((found, _)) = stored.meta.get(META_SCHEMA) {
            let found = found.parse::<u64>().unwrap_or(u64::MAX);
            if found > SCHEMA_VERSION {
                return Err(StoreError::SchemaTooNew {
                    path: String::from_utf8_lossy(&self.client.prefix()).into_owned(),
                    found,
                    supported: SCHEMA_VERSION,
                });
            }
        }
        let mut tables = Tables {
            index: stored.index(META_INDEX),
            ..Tables::default()
        };
        for t in Table::ALL {
            tables
                .table_index
                .insert(t, stored.index(&table_index_key(t)));
        }
        *self.meta_revision.locked() = stored.meta.get(META_INDEX).map_or(0, |(_, rev)| *rev);
        let secrets = std::mem::take(&mut stored.node_secrets);
        let mut loader = Loader {
            stored: &mut stored,
            keyring: &self.keyring,
            bad: Vec::new(),
            resealed: Vec::new(),
        };
        tables.visit_mut(&mut loader)?;
        let Loader { bad, resealed, .. } = loader;
        for (node_id, bytes) in secrets {
            if let Some(secret) = usable_node_secret(&node_id, &bytes, &self.keyring) {
                tables.node_secrets.insert(node_id, secret);
            }
        }
        tables.raise_index_to_records();
        self.fix_up(tables.index, &bad, &resealed)?;
        self.loaded_revision
            .store(revision, std::sync::atomic::Ordering::SeqCst);
        tracing::info!(
            prefix = %String::from_utf8_lossy(&self.client.prefix()),
            index = tables.index,
            jobs = tables.jobs.len(),
            allocs = tables.allocs.len(),
            nodes = tables.nodes.len(),
            volumes = tables.volumes.len(),
            quarantined = bad.len(),
            "loaded server state from etcd"
        );
        Ok(tables)
    }

    fn rotate_keyring(&self) -> Result<crate::keyring::KeyRotation, StoreError> {
        Err(StoreError::Unsupported(
            "rotating the keyring of servers on etcd is not supported yet: every server holds \
             the keys, and a new one would have to reach them all before it seals"
                .into(),
        ))
    }

    fn commit(&self, index: u64, changes: &[Change]) -> Result<(), StoreError> {
        let started = std::time::Instant::now();
        let committed = self.commit_once(index, changes);
        berth_metrics::record_state_commit(berth_metrics::Db::Etcd, started.elapsed());
        committed
    }
}

impl EtcdBackend {
    /// Sets the records that did not load aside, stores clear secrets
    /// sealed and records the schema version, in one transaction.
    fn fix_up(
        &self,
        index: u64,
        bad: &[(Table, String, Vec<u8>)],
        resealed: &[(Table, String, Vec<u8>)],
    ) -> Result<(), StoreError> {
        let c = &self.client;
        let mut ops = vec![etcd::put(
            c.key(META_SCHEMA),
            SCHEMA_VERSION.to_string().into_bytes(),
        )];
        for (table, key, bytes) in bad {
            let aside = format!("{QUARANTINE}/{}/{key}/{index}", table.name());
            ops.push(etcd::put(c.key(&aside), bytes.clone()));
            ops.push(etcd::delete(c.key(&record_key(*table, key))));
        }
        for (table, key, bytes) in resealed {
            ops.push(etcd::put(c.key(&record_key(*table, key)), bytes.clone()));
        }
        let client = c.clone();
        c.block_on(async move {
            client
                .txn(etcd::TxnRequest {
                    compare: vec![],
                    success: ops,
                    failure: vec![],
                })
                .await
        })?;
        Ok(())
    }

    /// The puts and deletes of a write at `index`.
    fn ops(&self, index: u64, changes: &[Change]) -> Result<Vec<etcd::RequestOp>, StoreError> {
        let c = &self.client;
        let mut ops = Vec::with_capacity(changes.len() + 4);
        let mut touched = std::collections::BTreeSet::new();
        for change in changes {
            touched.insert(change.table());
            // A deleted node's secret stays: its ID stays bound to it.
            if let Change::PutNodeSecret { node_id, secret } = change {
                let bytes = seal_node_secret(node_id, secret, &self.keyring)?;
                ops.push(etcd::put(
                    c.key(&format!("{NODE_SECRETS}/{node_id}")),
                    bytes,
                ));
                continue;
            }
            let key = c.key(&record_key(change.table(), &change.key()));
            match change.encode(&self.keyring) {
                Some(bytes) => ops.push(etcd::put(key, bytes?)),
                None => ops.push(etcd::delete(key)),
            }
        }
        let at = index.to_string().into_bytes();
        ops.push(etcd::put(c.key(META_INDEX), at.clone()));
        for table in touched {
            ops.push(etcd::put(c.key(&table_index_key(table)), at.clone()));
        }
        Ok(ops)
    }

    fn commit_once(&self, index: u64, changes: &[Change]) -> Result<(), StoreError> {
        let term = match &self.fence {
            None => None,
            Some(fence) => Some((fence, fence.term().ok_or_else(not_leader)?)),
        };
        let ops = self.ops(index, changes)?;
        let mut meta_revision = self.meta_revision.locked();
        let client = self.client.clone();
        let meta_key = client.key(META_INDEX);
        let leader_key = client.key(LEADER_KEY);
        let mut compare = vec![etcd::mod_revision_is(meta_key.clone(), *meta_revision)];
        if let Some((_, term)) = term {
            compare.push(etcd::created_at(leader_key.clone(), term));
        }
        let txn = etcd::TxnRequest {
            compare,
            success: ops,
            failure: vec![etcd::get(leader_key)],
        };
        let answer = self.client.block_on(async move { client.txn(txn).await });
        match answer {
            Ok(done) if done.succeeded => {
                *meta_revision = done.header.map_or(*meta_revision, |h| h.revision);
                Ok(())
            }
            Ok(refused) => {
                if let Some((fence, term)) = term {
                    if etcd::got(&refused).map(|kv| kv.create_revision) != Some(term) {
                        berth_metrics::record_store_write_conflict("not_leader");
                        fence.lost(term);
                        return Err(not_leader());
                    }
                }
                berth_metrics::record_store_write_conflict("moved");
                Err(StoreError::Conflict(format!(
                    "the state in etcd was written by someone else since index {}; this \
                     server's write at index {index} is refused",
                    index - 1
                )))
            }
            Err(e) if e.is_unavailable() => {
                // The transaction may have been applied without its answer
                // arriving: it was if `meta/index` holds this index now.
                match self.landed(meta_key, index) {
                    Some(revision) => {
                        tracing::info!(index, "etcd applied a write whose answer was lost");
                        *meta_revision = revision;
                        Ok(())
                    }
                    None => Err(e.into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The revision `meta/index` holds `index` at, if etcd answers that it
    /// does.
    fn landed(&self, meta_key: Vec<u8>, index: u64) -> Option<i64> {
        let client = self.client.clone();
        let kv = self
            .client
            .block_on(async move { client.get(meta_key).await })
            .ok()??;
        (kv.value == index.to_string().into_bytes()).then_some(kv.mod_revision)
    }
}

#[cfg(test)]
mod tests {
    //! Against a real etcd member (`berth_testutil::etcd`).

    use std::time::Duration;

    use berth_structs::{CsiVolume, Job, Node, NodeSecret};
    use berth_testutil::etcd::Etcd;

    use super::*;
    use crate::etcd::EtcdConfig;
    use crate::state::StateStore;

    const VOLUME_SECRET: &str = "s3cr3t-volume-password";

    struct Opened {
        store: StateStore,
        _keyring: tempfile::TempDir,
    }

    fn config(etcd: &Etcd, prefix: &str) -> EtcdConfig {
        EtcdConfig {
            prefix: prefix.into(),
            request_timeout: Duration::from_secs(2),
            dial_timeout: Duration::from_secs(1),
            ..EtcdConfig::new(vec![etcd.endpoint()])
        }
    }

    fn backend(etcd: &Etcd, prefix: &str, keyring: &Path) -> EtcdBackend {
        let client = EtcdClient::new(config(etcd, prefix)).expect("client");
        EtcdBackend::open(client, &keyring.join("keyring")).expect("backend")
    }

    /// A store on `prefix`, with a keyring of its own unless `keyring` is
    /// given.
    fn open(etcd: &Etcd, prefix: &str, keyring: Option<&Path>) -> Opened {
        let dir = tempfile::tempdir().expect("keyring dir");
        let at = keyring.unwrap_or(dir.path());
        let store = StateStore::open(Box::new(backend(etcd, prefix, at))).expect("store");
        Opened {
            store,
            _keyring: dir,
        }
    }

    fn job(id: &str) -> Change {
        Change::PutJob(Job {
            id: id.into(),
            ..Job::default()
        })
    }

    fn put(store: &StateStore, changes: Vec<Change>) -> Result<u64, StoreError> {
        store
            .write(|_, c| {
                c.extend(changes);
                Ok::<_, StoreError>(())
            })
            .map(|(_, index)| index)
    }

    fn raw(etcd: &Etcd, prefix: &str) -> Vec<KeyValue> {
        let client = EtcdClient::new(config(etcd, prefix)).expect("client");
        let c = client.clone();
        client
            .block_on(async move { c.range_prefix(&c.prefix()).await })
            .expect("read etcd")
            .0
    }

    #[test]
    fn writes_load_back_with_their_indexes_and_secrets_sealed() {
        let etcd = Etcd::start();
        let keyring = tempfile::tempdir().unwrap();
        let first = open(&etcd, "/t1", Some(keyring.path()));
        let volume = CsiVolume {
            id: "vol".into(),
            plugin_id: "p".into(),
            secrets: [("password".to_string(), VOLUME_SECRET.to_string())].into(),
            ..Default::default()
        };
        let secret = NodeSecret::parse("node-secret-abcdefghijklmnop").unwrap();
        let one = put(
            &first.store,
            vec![
                job("web"),
                Change::PutVolume(volume),
                Change::PutNode(Node {
                    id: "n1".into(),
                    ..Node::default()
                }),
                Change::PutNodeSecret {
                    node_id: "n1".into(),
                    secret: secret.clone(),
                },
            ],
        )
        .expect("first write");
        let two = put(
            &first.store,
            vec![job("db"), Change::DeleteJob("web".into())],
        )
        .expect("second write");
        assert_eq!(two, one + 1);

        // Nothing secret is in etcd in the clear.
        for kv in raw(&etcd, "/t1") {
            let text = String::from_utf8_lossy(&kv.value);
            assert!(!text.contains(VOLUME_SECRET), "clear secret in {kv:?}");
            assert!(
                !text.contains(secret.expose()),
                "clear node secret in {kv:?}"
            );
        }

        // Another store on the same prefix and keyring loads the same.
        let second = open(&etcd, "/t1", Some(keyring.path()));
        second.store.read(|t| {
            assert_eq!(t.index, two);
            assert_eq!(t.jobs.keys().collect::<Vec<_>>(), ["db"]);
            assert_eq!(t.jobs["db"].create_index, two);
            assert_eq!(t.table_index[&Table::Jobs], two);
            assert_eq!(t.table_index[&Table::Volumes], one);
            assert_eq!(t.volumes["vol"].secrets["password"], VOLUME_SECRET);
            assert_eq!(t.node_secrets["n1"].expose(), secret.expose());
        });
        // And another prefix holds nothing of it.
        let other = open(&etcd, "/t2", None);
        other
            .store
            .read(|t| assert!(t.jobs.is_empty() && t.index == 0));
    }

    #[test]
    fn a_write_on_top_of_a_state_that_moved_is_refused_and_changes_nothing() {
        let etcd = Etcd::start();
        let a = open(&etcd, "/c", None);
        let b = open(&etcd, "/c", None);
        put(&a.store, vec![job("from-a")]).expect("a writes first");
        let refused = put(&b.store, vec![job("from-b")]).expect_err("b planned on old state");
        assert!(matches!(refused, StoreError::Conflict(_)), "{refused}");
        // Neither etcd nor b's tables took it.
        b.store.read(|t| assert!(t.jobs.is_empty() && t.index == 0));
        let reloaded = open(&etcd, "/c", None);
        reloaded
            .store
            .read(|t| assert_eq!(t.jobs.keys().collect::<Vec<_>>(), ["from-a"]));
        // a goes on writing on its own state.
        put(&a.store, vec![job("again")]).expect("a writes on");
    }

    #[test]
    fn with_etcd_down_a_write_is_unavailable_and_applies_nowhere() {
        let mut etcd = Etcd::start();
        let opened = open(&etcd, "/d", None);
        let store = &opened.store;
        let one = put(store, vec![job("before")]).expect("write while up");
        etcd.kill();
        let down = put(store, vec![job("during")]).expect_err("etcd is down");
        assert!(down.is_unavailable(), "{down}");
        assert!(down.to_string().contains(&etcd.endpoint()), "{down}");
        assert_eq!(store.index(), one);
        store.read(|t| assert!(!t.jobs.contains_key("during")));
        etcd.restart();
        // Writes go on where they stopped, once etcd is back.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let after = loop {
            match put(store, vec![job("after")]) {
                Ok(i) => break i,
                Err(e) if e.is_unavailable() && std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => panic!("write after etcd came back: {e}"),
            }
        };
        assert_eq!(after, one + 1);
        let reloaded = open(&etcd, "/d", None);
        reloaded.store.read(|t| {
            assert_eq!(t.jobs.keys().collect::<Vec<_>>(), ["after", "before"]);
        });
    }

    #[test]
    fn a_record_that_does_not_decode_is_quarantined_and_writes_go_on() {
        let etcd = Etcd::start();
        let client = EtcdClient::new(config(&etcd, "/q")).unwrap();
        let c = client.clone();
        let stored = |id: &str| {
            serde_json::to_vec(&Job {
                id: id.into(),
                ..Job::default()
            })
            .unwrap()
        };
        let (good, other) = (stored("good"), stored("other"));
        client
            .block_on(async move {
                c.txn(etcd::TxnRequest {
                    compare: vec![],
                    success: vec![
                        etcd::put(c.key("jobs/bad"), b"{not json".to_vec()),
                        etcd::put(c.key("jobs/good"), good),
                        etcd::put(c.key("jobs/wrong-key"), other),
                    ],
                    failure: vec![],
                })
                .await
            })
            .unwrap();
        let opened = open(&etcd, "/q", None);
        opened
            .store
            .read(|t| assert_eq!(t.jobs.keys().collect::<Vec<_>>(), ["good"]));
        let keys: Vec<String> = raw(&etcd, "/q")
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect();
        assert!(
            keys.contains(&"/q/quarantine/jobs/bad/0".to_string()),
            "{keys:?}"
        );
        assert!(
            keys.contains(&"/q/quarantine/jobs/wrong-key/0".to_string()),
            "{keys:?}"
        );
        assert!(!keys.contains(&"/q/jobs/bad".to_string()), "{keys:?}");
        put(&opened.store, vec![job("next")]).expect("writes go on");
    }

    #[test]
    fn a_server_whose_keyring_is_not_the_clusters_is_refused_naming_both() {
        let etcd = Etcd::start();
        let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        backend(&etcd, "/k", first.path())
            .check_keyring()
            .expect("the first server's keyring becomes the cluster's");
        backend(&etcd, "/k", first.path())
            .check_keyring()
            .expect("the same keys again");
        let other = backend(&etcd, "/k", second.path());
        let refused = other.check_keyring().unwrap_err().to_string();
        assert!(refused.contains("is not the cluster's"), "{refused}");
        assert!(refused.contains(&other.keyring.active_id()), "{refused}");
        // A copy of the first keyring is the cluster's.
        let copy = tempfile::tempdir().unwrap();
        std::fs::create_dir(copy.path().join("keyring")).unwrap();
        for entry in std::fs::read_dir(first.path().join("keyring")).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(
                &path,
                copy.path().join("keyring").join(path.file_name().unwrap()),
            )
            .unwrap();
        }
        backend(&etcd, "/k", copy.path())
            .check_keyring()
            .expect("a copy of the cluster's keyring");
    }

    #[test]
    fn rotating_the_keyring_on_etcd_is_refused_saying_why() {
        let etcd = Etcd::start();
        let opened = open(&etcd, "/r", None);
        let refused = opened.store.rotate_keyring().unwrap_err();
        assert!(matches!(refused, StoreError::Unsupported(_)), "{refused}");
        assert!(
            refused.to_string().contains("not supported yet"),
            "{refused}"
        );
    }

    #[test]
    fn the_cluster_id_is_made_once_per_prefix() {
        let etcd = Etcd::start();
        let dir = tempfile::tempdir().unwrap();
        let first = backend(&etcd, "/id1", dir.path()).cluster_id().unwrap();
        assert_eq!(
            backend(&etcd, "/id1", dir.path()).cluster_id().unwrap(),
            first
        );
        assert_ne!(
            backend(&etcd, "/id2", dir.path()).cluster_id().unwrap(),
            first
        );
    }
}
