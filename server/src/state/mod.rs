//! The state store: in-memory tables of jobs, allocations, nodes and CSI
//! volumes, a raft-style global index, watches for blocking queries, and a
//! [`Backend`] that makes every write durable before it becomes visible.
//!
//! Writes go through [`StateStore::write`]: the closure reads the current
//! tables and returns the changes it wants; the store stamps them with the
//! next index, commits them to the backend, and only then applies them in
//! memory and wakes the watchers. Writes are serialized; reads never wait
//! for a backend commit.
//!
//! CSI plugins are not stored: they are derived from node fingerprints and
//! plugin allocs (see `crate::plugins`).
//!
//! Node secrets are kept apart from the nodes, in their own map and their
//! own database table, so that no answer built from a [`Node`] can carry
//! one; they count as writes to the nodes table.
//!
//! The tables are declared once, in `schema`: each holds one [`Record`]
//! type, and the store's stamping, applying and indexing and the redb
//! backend's loading and committing are generic over it.

mod acl_tables;
mod error;
mod etcd_backend;
mod etcd_follow;
mod indexes;
mod job_copies;
pub mod job_versions;
mod record;
mod redb_backend;
mod schema;

use berth_sync::{MutexExt, RwLockExt};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::time::Duration;

use berth_structs::{Allocation, CsiVolume, Node};
use indexes::ids;
use tokio::sync::watch;

pub use error::StoreError;

pub use acl_tables::{
    intro_key as acl_intro_key, policy_key as acl_policy_key, token_key as acl_token_key,
    AclBootstrap, AclRecord, AclTables,
};
pub use etcd_backend::EtcdBackend;
pub use etcd_follow::{Follower, Freshness, FRESH_FOR};
pub use indexes::{Indexes, NodeUse};
pub(crate) use job_copies::shared_copy;
pub use record::{Record, RecordError, RecordStore, TableVisitor, WriteEffects};
pub use redb_backend::{QuarantinedRecord, RedbBackend, SCHEMA_VERSION};
pub use schema::{Change, Table, Tables};

/// The indexes of the last writes of the nodes, the volumes and the allocs
/// (leaving out writes of an alloc's volume stats alone). A pass that reads
/// only those and the clock (the volume watcher, the drainer) need not run
/// again for a write that moves none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterIndexes {
    pub nodes: u64,
    pub volumes: u64,
    pub allocs: u64,
}

impl Tables {
    pub fn cluster_indexes(&self) -> ClusterIndexes {
        let at = |table| self.table_index.get(&table).copied().unwrap_or(0);
        ClusterIndexes {
            nodes: at(Table::Nodes),
            volumes: at(Table::Volumes),
            allocs: self.allocs_state_index,
        }
    }

    /// The index of the last write to any of `tables` (0 when none was
    /// ever written). A read of only those tables that saw this is still
    /// valid while it has not moved: what a plan computed outside the
    /// writer checks before it commits.
    pub fn last_write_to(&self, tables: &[Table]) -> u64 {
        tables
            .iter()
            .filter_map(|table| self.table_index.get(table).copied())
            .max()
            .unwrap_or(0)
    }

    /// Raises the index of tables just loaded to the highest index a
    /// record or a table holds: the index never goes backwards, even if
    /// the backend lost what it kept of it.
    pub(crate) fn raise_index_to_records(&mut self) {
        let max_seen = std::iter::once(self.max_modify_index())
            .chain(self.table_index.values().copied())
            .max()
            .unwrap_or(0);
        self.index = self.index.max(max_seen);
    }

    /// These tables with their indexes built from them (for tables put
    /// together by hand; the store keeps its own).
    pub fn with_indexes(mut self) -> Tables {
        self.indexes = Indexes::build(&self);
        self
    }

    /// Build the indexes again from the tables (after changing tables put
    /// together by hand).
    pub fn reindex(&mut self) {
        self.indexes = Indexes::build(self);
    }

    /// The indexes, as the store keeps them.
    pub fn indexes(&self) -> &Indexes {
        &self.indexes
    }

    /// The allocs placed on `node_id`, in ID order.
    pub fn allocs_on_node<'a>(&'a self, node_id: &str) -> impl Iterator<Item = &'a Allocation> {
        self.by_ids(&self.allocs, &self.indexes.allocs_by_node, node_id)
    }

    /// The deployments of `job_id`, oldest first.
    pub fn deployments_of_job<'a>(
        &'a self,
        job_id: &str,
    ) -> impl Iterator<Item = &'a berth_structs::Deployment> {
        let mut all: Vec<&berth_structs::Deployment> = self
            .by_ids(&self.deployments, &self.indexes.deployments_by_job, job_id)
            .collect();
        all.sort_by_key(|d| (d.create_index, d.job_version));
        all.into_iter()
    }

    /// The allocs of `job_id`, in ID order.
    pub fn allocs_of_job<'a>(&'a self, job_id: &str) -> impl Iterator<Item = &'a Allocation> {
        self.by_ids(&self.allocs, &self.indexes.allocs_by_job, job_id)
    }

    /// The allocs (terminal or not) with a task that runs CSI plugin
    /// `plugin_id`, in ID order.
    pub fn allocs_running_plugin<'a>(
        &'a self,
        plugin_id: &str,
    ) -> impl Iterator<Item = &'a Allocation> {
        self.by_ids(&self.allocs, &self.indexes.plugin_allocs, plugin_id)
    }

    /// The volumes with a claim made on `node_id`, in ID order.
    pub fn volumes_claimed_on_node<'a>(
        &'a self,
        node_id: &str,
    ) -> impl Iterator<Item = &'a CsiVolume> {
        self.by_ids(&self.volumes, &self.indexes.claims_by_node, node_id)
    }

    /// The volumes `alloc_id` holds a claim of, in ID order.
    pub fn volumes_claimed_by_alloc<'a>(
        &'a self,
        alloc_id: &str,
    ) -> impl Iterator<Item = &'a CsiVolume> {
        self.by_ids(&self.volumes, &self.indexes.claims_by_alloc, alloc_id)
    }

    /// Whether any volume holds a claim of `alloc_id`.
    pub fn alloc_has_claims(&self, alloc_id: &str) -> bool {
        self.indexes.claims_by_alloc.contains_key(alloc_id)
    }

    /// The IDs of the allocs that hold a volume claim, in ID order.
    pub fn claimed_alloc_ids(&self) -> impl Iterator<Item = &str> {
        self.indexes.claims_by_alloc.keys().map(String::as_str)
    }

    /// The volumes of CSI plugin `plugin_id`, in ID order.
    pub fn volumes_of_plugin<'a>(&'a self, plugin_id: &str) -> impl Iterator<Item = &'a CsiVolume> {
        self.by_ids(&self.volumes, &self.indexes.volumes_by_plugin, plugin_id)
    }

    /// The nodes named `name`, in ID order.
    pub fn nodes_named<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a Node> {
        self.by_ids(&self.nodes, &self.indexes.nodes_by_name, name)
    }

    /// Whether node `node_id` may count as a controller (or node)
    /// instance of `plugin_id`: always, unless the servers demand that an
    /// alloc of that plugin, not terminal, runs there
    /// ([`Tables::plugin_instances_need_allocs`]).
    pub fn plugin_instance_allowed(
        &self,
        node_id: &str,
        plugin_id: &str,
        controller: bool,
    ) -> bool {
        if !self.plugin_instances_need_allocs {
            return true;
        }
        self.allocs_running_plugin(plugin_id)
            .filter(|a| a.node_id == node_id && !a.is_terminal())
            .filter_map(|a| a.group())
            .flat_map(|g| g.tasks.iter())
            .filter_map(|task| task.csi_plugin.as_ref())
            .any(|c| {
                c.id == plugin_id
                    && if controller {
                        c.plugin_type.has_controller()
                    } else {
                        c.plugin_type.has_node()
                    }
            })
    }

    /// The nodes that report a node or a controller instance of CSI
    /// plugin `plugin_id`, in ID order.
    pub fn nodes_with_plugin<'a>(&'a self, plugin_id: &str) -> impl Iterator<Item = &'a Node> {
        self.by_ids(&self.nodes, &self.indexes.nodes_by_plugin, plugin_id)
    }

    /// The IDs of the CSI plugins that a node reports or an alloc that is
    /// not terminal runs, in ID order.
    pub fn plugin_ids(&self) -> BTreeSet<&str> {
        let run = self
            .indexes
            .plugin_allocs
            .keys()
            .filter(|id| self.allocs_running_plugin(id).any(|a| !a.is_terminal()));
        self.indexes
            .nodes_by_plugin
            .keys()
            .chain(run)
            .map(String::as_str)
            .collect()
    }

    /// What the allocs that are not terminal on `node_id` ask for (zero
    /// when none is there).
    pub fn node_use(&self, node_id: &str) -> NodeUse {
        self.indexes
            .node_usage
            .get(node_id)
            .copied()
            .unwrap_or_default()
    }

    /// The nodes with a drain strategy, in ID order.
    pub fn draining_nodes(&self) -> impl Iterator<Item = &Node> {
        self.indexes
            .draining_nodes
            .iter()
            .filter_map(|id| self.nodes.get(id))
    }

    /// The objects of `table` whose IDs `index` has under `key`.
    fn by_ids<'a, V>(
        &'a self,
        table: &'a BTreeMap<String, V>,
        index: &'a BTreeMap<String, BTreeSet<String>>,
        key: &str,
    ) -> impl Iterator<Item = &'a V> + 'a {
        ids(index, key).filter_map(move |id| table.get(id))
    }
}

/// Where the tables are made durable. A second implementation (a replicated
/// log) slots in here.
pub trait Backend: Send + Sync {
    /// Read everything back. Records that fail to decode are reported and
    /// set aside, never fatal.
    fn load(&self) -> Result<Tables, StoreError>;
    /// Make `changes`, stamped with `index`, durable. When this returns Ok
    /// the write survives a crash.
    fn commit(&self, index: u64, changes: &[Change]) -> Result<(), StoreError>;
    /// Records set aside because they failed to decode.
    fn quarantined(&self) -> Result<Vec<QuarantinedRecord>, StoreError> {
        Ok(Vec::new())
    }
    /// Seal every stored secret again with a new key and retire the old
    /// keys (see `crate::keyring`).
    fn rotate_keyring(&self) -> Result<crate::keyring::KeyRotation, StoreError> {
        Err(StoreError::NoKeyring)
    }
}

/// The state store. Cheap reads through [`StateStore::read`], serialized
/// durable writes through [`StateStore::write`].
pub struct StateStore {
    backend: Box<dyn Backend>,
    tables: RwLock<Tables>,
    writer: Mutex<()>,
    /// The async callers' turns at the writer, first come first served
    /// (see [`StateStore::write_async`]).
    turns: tokio::sync::Mutex<()>,
    index_tx: watch::Sender<u64>,
    /// The index of the last write that changed a node or an alloc (but
    /// for its volume stats alone): what alloc watches wait on.
    allocs_or_nodes_tx: watch::Sender<u64>,
    /// Per node that someone watches: the index of the last write that
    /// put or deleted one of its allocs (but for their volume stats alone)
    /// or wrote the node. A node's alloc watch waits on its own, so a
    /// write wakes the watches of the nodes it touched, not every node's.
    node_tx: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// The index of the last write to each table: what blocking queries
    /// wait on, so that a write to one table wakes no reader of another.
    table_tx: BTreeMap<Table, watch::Sender<u64>>,
}

impl StateStore {
    /// Load the tables from `backend`.
    pub fn open(backend: Box<dyn Backend>) -> Result<StateStore, StoreError> {
        let mut tables = backend.load()?;
        job_copies::JobCopies::share_loaded(&mut tables);
        tables.indexes = Indexes::build(&tables);
        let (index_tx, _) = watch::channel(tables.index);
        let (allocs_or_nodes_tx, _) = watch::channel(tables.index);
        let table_tx = Table::ALL
            .into_iter()
            .map(|t| {
                let at = tables.table_index.get(&t).copied().unwrap_or(0);
                (t, watch::channel(at).0)
            })
            .collect();
        Ok(StateStore {
            backend,
            tables: RwLock::new(tables),
            writer: Mutex::new(()),
            turns: tokio::sync::Mutex::new(()),
            index_tx,
            allocs_or_nodes_tx,
            node_tx: Mutex::new(HashMap::new()),
            table_tx,
        })
    }

    fn tables(&self) -> RwLockReadGuard<'_, Tables> {
        // A poisoned lock means a panic while applying in-memory changes that
        // were already durable; the tables are still the last good state.
        self.tables.read_locked()
    }

    fn writer(&self) -> MutexGuard<'_, ()> {
        self.writer.locked()
    }

    /// Read the tables.
    pub fn read<R>(&self, f: impl FnOnce(&Tables) -> R) -> R {
        f(&self.tables())
    }

    /// Sets [`Tables::plugin_instances_need_allocs`].
    pub fn set_plugin_instances_need_allocs(&self, on: bool) {
        let mut guard = self.tables.write_locked();
        guard.plugin_instances_need_allocs = on;
    }

    /// Records the backend set aside because they failed to decode.
    pub fn quarantined(&self) -> Result<Vec<QuarantinedRecord>, StoreError> {
        self.backend.quarantined()
    }

    /// The index of the last write.
    pub fn index(&self) -> u64 {
        *self.index_tx.borrow()
    }

    /// The index of the last write to `table`.
    pub fn table_index(&self, table: Table) -> u64 {
        self.tables().table_index.get(&table).copied().unwrap_or(0)
    }

    /// The index of the last write to any of `tables`: what a read of
    /// those tables reflects (0 when none was ever written).
    pub fn tables_index(&self, tables: &[Table]) -> u64 {
        let t = self.tables();
        tables
            .iter()
            .filter_map(|table| t.table_index.get(table).copied())
            .max()
            .unwrap_or(0)
    }

    /// Wait until a write to one of `tables` has an index greater than
    /// `min_index`, or `timeout` passes; writes to other tables do not wake
    /// the waiter. Returns [`Self::tables_index`] then.
    pub async fn wait_for_tables(
        &self,
        tables: &[Table],
        min_index: u64,
        timeout: Duration,
    ) -> u64 {
        let mut watches: Vec<watch::Receiver<u64>> = tables
            .iter()
            .filter_map(|t| self.table_tx.get(t).map(watch::Sender::subscribe))
            .collect();
        let written = async {
            while !watches.is_empty() {
                if watches
                    .iter_mut()
                    .any(|w| *w.borrow_and_update() > min_index)
                {
                    return;
                }
                let changes = watches.iter_mut().map(|w| Box::pin(w.changed()));
                if futures_util::future::select_all(changes).await.0.is_err() {
                    // The store is going away: nothing more to wait for.
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, written).await;
        self.tables_index(tables)
    }

    /// A receiver that sees the index of every write.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.index_tx.subscribe()
    }

    /// A receiver that sees the index of each write that changed a node or
    /// an alloc, leaving out writes of an alloc's volume stats alone (which
    /// nodes send all the time, and which alloc watches do not send).
    pub fn subscribe_allocs_and_nodes(&self) -> watch::Receiver<u64> {
        self.allocs_or_nodes_tx.subscribe()
    }

    /// A receiver that sees the index of each write that put or deleted
    /// an alloc of `node_id` (leaving out writes of an alloc's volume stats
    /// alone) or wrote the node itself (its status, a purge, a new
    /// registration). It starts at the current index.
    pub fn subscribe_node(&self, node_id: &str) -> watch::Receiver<u64> {
        let mut map = self.node_tx.locked();
        match map.get(node_id) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(self.index());
                map.insert(node_id.to_string(), tx);
                rx
            }
        }
    }

    /// Wait until the index is greater than `min_index`, or `timeout`
    /// passes. Returns the index then.
    pub async fn wait_for_index(&self, min_index: u64, timeout: Duration) -> u64 {
        let mut rx = self.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|i| *i > min_index)).await;
        self.index()
    }

    /// Rotate the backend's keyring, between writes (see
    /// [`Backend::rotate_keyring`]). Blocks its thread as [`Self::write`]
    /// does.
    pub fn rotate_keyring(&self) -> Result<crate::keyring::KeyRotation, StoreError> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let rotate = || {
            let _writer = self.writer();
            self.backend.rotate_keyring()
        };
        match Handle::try_current() {
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(rotate)
            }
            _ => rotate(),
        }
    }

    /// Load the tables from the backend again, replacing those in memory,
    /// and wake every watcher: what a server does when it becomes the
    /// leader, to take up the state the previous leader left. The index
    /// never goes back; every table counts as written at the new index.
    /// Blocks its thread as [`Self::write`] does.
    pub fn reload(&self) -> Result<u64, StoreError> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        match Handle::try_current() {
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| self.reload_blocking())
            }
            _ => self.reload_blocking(),
        }
    }

    fn reload_blocking(&self) -> Result<u64, StoreError> {
        let _writer = self.writer();
        let mut loaded = self.backend.load()?;
        job_copies::JobCopies::share_loaded(&mut loaded);
        loaded.indexes = Indexes::build(&loaded);
        let (index, nodes) = {
            let mut guard = self.tables.write_locked();
            let index = loaded.index.max(guard.index);
            loaded.index = index;
            loaded.plugin_instances_need_allocs = guard.plugin_instances_need_allocs;
            for table in Table::ALL {
                loaded.table_index.insert(table, index);
            }
            let nodes: Vec<String> = loaded
                .nodes
                .keys()
                .chain(guard.nodes.keys())
                .chain(loaded.allocs.values().map(|a| &a.node_id))
                .chain(guard.allocs.values().map(|a| &a.node_id))
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            for node_id in &nodes {
                loaded.node_allocs_index.insert(node_id.clone(), index);
            }
            loaded.allocs_state_index = index;
            *guard = loaded;
            (index, nodes)
        };
        self.notify(index, &Table::ALL, true, nodes);
        Ok(index)
    }

    /// Applies a write another server made durable at `index` (the
    /// leader's, as etcd's watch brings it) and wakes its watchers; one at
    /// or below the current index is already here (this server made it,
    /// or loaded it) and is left. Whether it applied.
    pub fn apply_replicated(&self, index: u64, changes: Vec<Change>) -> bool {
        let _writer = self.writer();
        if index <= self.index() || changes.is_empty() {
            return false;
        }
        self.apply_and_notify(index, changes);
        true
    }

    /// Applies the changes of a durable write at `index` in memory and
    /// wakes the watchers of the tables it wrote.
    fn apply_and_notify(&self, index: u64, changes: Vec<Change>) {
        let mut written: Vec<Table> = changes.iter().map(Change::table).collect();
        written.sort();
        written.dedup();
        let (allocs_or_nodes, touched) = self.apply(index, changes);
        self.notify(index, &written, allocs_or_nodes, touched);
    }

    /// Run `f` against the current tables and commit the changes it asks
    /// for. Returns what `f` returned and the index of the write (the
    /// current index when `f` asked for no change).
    ///
    /// A write blocks its thread: waiting for the writer before it, its
    /// closure (a scheduling pass may take a while) and the backend's
    /// commit (an fsync). On a multi-threaded tokio runtime it tells the
    /// runtime so ([`tokio::task::block_in_place`]), which hands the
    /// worker's other tasks to another thread meanwhile: heartbeats and
    /// reads are not left waiting behind writes.
    pub fn write<R, E>(
        &self,
        f: impl FnOnce(&Tables, &mut Vec<Change>) -> Result<R, E>,
    ) -> Result<(R, u64), E>
    where
        E: From<StoreError>,
    {
        use tokio::runtime::{Handle, RuntimeFlavor};
        match Handle::try_current() {
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| self.write_blocking(f))
            }
            _ => self.write_blocking(f),
        }
    }

    /// [`StateStore::write`] for async callers: each waits for its turn
    /// as a parked future, and only the one whose turn it is blocks a
    /// thread. A storm of writers (every node of a fleet registering at
    /// once) then holds neither the runtime's workers nor a thread each
    /// (which exhausts tokio's blocking pool, and leaves the runtime
    /// without a thread for its cores: no heartbeat or HTTP/2 ping is
    /// answered until the storm is written).
    pub async fn write_async<R, E>(
        &self,
        f: impl FnOnce(&Tables, &mut Vec<Change>) -> Result<R, E>,
    ) -> Result<(R, u64), E>
    where
        E: From<StoreError>,
    {
        let _turn = self.turns.lock().await;
        self.write(f)
    }

    /// A turn at the writer for an async caller that writes from sync
    /// code (a scheduling pass); held across no await that writes, or it
    /// waits for itself.
    pub async fn write_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.turns.lock().await
    }

    fn write_blocking<R, E>(
        &self,
        f: impl FnOnce(&Tables, &mut Vec<Change>) -> Result<R, E>,
    ) -> Result<(R, u64), E>
    where
        E: From<StoreError>,
    {
        let _writer = self.writer();
        let mut changes = Vec::new();
        let (result, index) = {
            let tables = self.tables();
            let result = f(&tables, &mut changes)?;
            if changes.is_empty() {
                return Ok((result, tables.index));
            }
            let index = tables.index + 1;
            schema::stamp(&tables, index, &mut changes);
            (result, index)
        };
        self.backend.commit(index, &changes)?;
        self.apply_and_notify(index, changes);
        Ok((result, index))
    }

    /// Applies the changes of a durable write at `index` in memory.
    /// Returns whether the write changed a node or an alloc (but for its
    /// volume stats alone), and the nodes whose alloc watches it concerns.
    fn apply(&self, index: u64, changes: Vec<Change>) -> (bool, Vec<String>) {
        let mut guard = self.tables.write_locked();
        let tables: &mut Tables = &mut guard;
        let mut fx = WriteEffects::default();
        let mut copies = job_copies::JobCopies::default();
        for mut change in changes {
            if let Change::PutAlloc(a) = &mut change {
                copies.share(Some(tables), a);
            }
            tables.table_index.insert(change.table(), index);
            change.apply(tables, &mut fx);
        }
        for node_id in &fx.alloc_nodes {
            tables.node_allocs_index.insert(node_id.clone(), index);
        }
        if fx.allocs_moved {
            tables.allocs_state_index = index;
        }
        tables.index = index;
        let allocs_or_nodes = tables.allocs_state_index == index
            || tables.table_index.get(&Table::Nodes) == Some(&index);
        let mut touched = fx.alloc_nodes;
        touched.extend(fx.nodes);
        (allocs_or_nodes, touched)
    }

    /// Wakes the watchers of a write at `index` to the `written` tables.
    fn notify(
        &self,
        index: u64,
        written: &[Table],
        allocs_or_nodes: bool,
        mut touched: Vec<String>,
    ) {
        self.index_tx.send_replace(index);
        for table in written {
            if let Some(tx) = self.table_tx.get(table) {
                tx.send_replace(index);
            }
        }
        if allocs_or_nodes {
            self.allocs_or_nodes_tx.send_replace(index);
        }
        if !touched.is_empty() {
            touched.sort();
            touched.dedup();
            let mut map = self.node_tx.locked();
            for node_id in touched {
                if let Some(tx) = map.get(&node_id) {
                    if tx.receiver_count() == 0 {
                        // No watch left on the node: forget it.
                        map.remove(&node_id);
                    } else {
                        tx.send_replace(index);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use berth_structs::Job;

    use super::*;

    fn alloc(id: &str, node_id: &str) -> Allocation {
        Allocation {
            id: id.into(),
            node_id: node_id.into(),
            ..Allocation::default()
        }
    }

    fn put(store: &StateStore, changes: Vec<Change>) -> u64 {
        store
            .write(|_, c| {
                c.extend(changes);
                Ok::<_, StoreError>(())
            })
            .unwrap()
            .1
    }

    #[test]
    fn a_storm_of_async_writers_waits_parked_not_on_a_thread_each() {
        const NAME: &str = "store-storm";
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(NAME)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let backend = RedbBackend::open(&RedbBackend::path_in(dir.path())).unwrap();
        let store = std::sync::Arc::new(StateStore::open(Box::new(backend)).unwrap());
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        rt.block_on(async {
            let mut writers = tokio::task::JoinSet::new();
            for i in 0..300 {
                let (store, peak) = (store.clone(), peak.clone());
                writers.spawn(async move {
                    store
                        .write_async(|_, changes| {
                            peak.fetch_max(
                                berth_testutil::threads_named(NAME),
                                std::sync::atomic::Ordering::SeqCst,
                            );
                            std::thread::sleep(Duration::from_micros(500));
                            changes.push(Change::PutJob(Job {
                                id: format!("job-{i}"),
                                ..Job::default()
                            }));
                            Ok::<_, StoreError>(())
                        })
                        .await
                        .unwrap();
                });
            }
            while let Some(done) = writers.join_next().await {
                done.unwrap();
            }
        });
        assert_eq!(store.read(|t| t.jobs.len()), 300);
        // Two workers and the thread the writer whose turn it is blocks;
        // each writer on its own blocked thread would make 300.
        let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
        assert!(peak <= 6, "{peak} threads for 300 writers at once");
    }

    #[tokio::test]
    async fn a_table_wait_ends_with_a_write_to_its_tables_only() {
        let dir = tempfile::tempdir().unwrap();
        let backend = RedbBackend::open(&RedbBackend::path_in(dir.path())).unwrap();
        let store = std::sync::Arc::new(StateStore::open(Box::new(backend)).unwrap());
        let node = |id: &str| {
            Change::PutNode(Node {
                id: id.into(),
                ..Node::default()
            })
        };
        let first = put(&store, vec![Change::PutAlloc(alloc("a1", "n1"))]);
        assert_eq!(store.tables_index(&[Table::Allocs, Table::Jobs]), first);
        assert_eq!(store.tables_index(&[Table::Jobs]), 0);

        // Behind the index: at once.
        let at_once = store.wait_for_tables(&[Table::Allocs], first - 1, Duration::from_secs(60));
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), at_once).await,
            Ok(first)
        );

        // At the index: a node write does not end an allocs wait, an
        // alloc write does.
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .wait_for_tables(&[Table::Allocs], first, Duration::from_secs(60))
                    .await
            })
        };
        put(&store, vec![node("n1")]);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiter.is_finished(), "a node write ended an allocs wait");
        let second = put(&store, vec![Change::PutAlloc(alloc("a2", "n1"))]);
        let woken = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the alloc write")
            .unwrap();
        assert_eq!(woken, second);

        // Nothing written: the wait ends after its timeout.
        let quiet = store
            .wait_for_tables(&[Table::Volumes], 0, Duration::from_millis(50))
            .await;
        assert_eq!(quiet, 0);
    }

    #[test]
    fn a_nodes_alloc_index_moves_only_with_writes_of_its_allocs() {
        let dir = tempfile::tempdir().unwrap();
        let backend = RedbBackend::open(&RedbBackend::path_in(dir.path())).unwrap();
        let store = StateStore::open(Box::new(backend)).unwrap();
        let at = |node: &str| store.read(|t| t.node_allocs_index.get(node).copied());
        let first = put(
            &store,
            vec![
                Change::PutAlloc(alloc("a1", "n1")),
                Change::PutAlloc(alloc("a2", "n2")),
            ],
        );
        assert_eq!((at("n1"), at("n2")), (Some(first), Some(first)));
        // Writes of nodes, jobs and other nodes' allocs leave n1's alone.
        put(
            &store,
            vec![Change::PutNode(Node {
                id: "n1".into(),
                ..Node::default()
            })],
        );
        let mut a2 = alloc("a2", "n2");
        a2.client_status = berth_structs::AllocClientStatus::Running;
        let n2_write = put(&store, vec![Change::PutAlloc(a2)]);
        assert_eq!((at("n1"), at("n2")), (Some(first), Some(n2_write)));
        let delete = put(&store, vec![Change::DeleteAlloc("a1".into())]);
        assert_eq!(at("n1"), Some(delete));
        assert_eq!(at("n3"), None);
    }

    #[test]
    fn a_nodes_watch_is_woken_by_writes_of_its_allocs_and_itself_only() {
        let dir = tempfile::tempdir().unwrap();
        let backend = RedbBackend::open(&RedbBackend::path_in(dir.path())).unwrap();
        let store = StateStore::open(Box::new(backend)).unwrap();
        let mut n1 = store.subscribe_node("n1");
        let mut n2 = store.subscribe_node("n2");
        let first = put(&store, vec![Change::PutAlloc(alloc("a1", "n1"))]);
        assert_eq!(*n1.borrow_and_update(), first);
        assert!(!n2.has_changed().unwrap(), "another node's alloc woke n2");

        // Its volume stats alone: not woken.
        let mut a1 = store.read(|t| t.allocs["a1"].clone());
        a1.csi_volume_stats
            .insert("data".into(), Default::default());
        put(&store, vec![Change::PutAlloc(a1)]);
        assert!(!n1.has_changed().unwrap(), "volume stats woke the watch");

        // A write of the node, and a move of the alloc to n2: both woken.
        let node = put(
            &store,
            vec![Change::PutNode(Node {
                id: "n2".into(),
                ..Node::default()
            })],
        );
        assert_eq!(*n2.borrow_and_update(), node);
        assert!(!n1.has_changed().unwrap());
        let mut a1 = store.read(|t| t.allocs["a1"].clone());
        a1.node_id = "n2".into();
        let moved = put(&store, vec![Change::PutAlloc(a1)]);
        assert_eq!(*n1.borrow_and_update(), moved);
        assert_eq!(*n2.borrow_and_update(), moved);
        let deleted = put(&store, vec![Change::DeleteAlloc("a1".into())]);
        assert_eq!(*n2.borrow_and_update(), deleted);
        assert!(!n1.has_changed().unwrap());

        // A watch dropped: its node's sender goes with the next write.
        drop(n1);
        put(&store, vec![Change::PutAlloc(alloc("a3", "n1"))]);
        assert!(!store.node_tx.lock().unwrap().contains_key("n1"));
        assert!(store.node_tx.lock().unwrap().contains_key("n2"));
    }

    #[test]
    fn a_write_of_volume_stats_alone_leaves_the_nodes_alloc_index() {
        let dir = tempfile::tempdir().unwrap();
        let backend = RedbBackend::open(&RedbBackend::path_in(dir.path())).unwrap();
        let store = StateStore::open(Box::new(backend)).unwrap();
        let at = |node: &str| store.read(|t| t.node_allocs_index.get(node).copied());
        let first = put(&store, vec![Change::PutAlloc(alloc("a1", "n1"))]);

        // Stats only: stored (the alloc's modify index moves), the node's
        // alloc index does not.
        let mut a1 = store.read(|t| t.allocs["a1"].clone());
        a1.csi_volume_stats.insert(
            "data".into(),
            berth_structs::CsiVolumeStats {
                volume_id: "v".into(),
                bytes_used: Some(5 << 20),
                ..Default::default()
            },
        );
        let mut woken = store.subscribe_allocs_and_nodes();
        woken.mark_unchanged();
        let before = store.read(Tables::cluster_indexes);
        let stats_write = put(&store, vec![Change::PutAlloc(a1.clone())]);
        assert_eq!(at("n1"), Some(first));
        assert_eq!(store.read(|t| t.allocs_state_index), first);
        assert!(!woken.has_changed().unwrap(), "alloc watches are not woken");
        assert_eq!(
            store.read(Tables::cluster_indexes),
            before,
            "nor the volume watcher and the drainer"
        );
        store.read(|t| {
            assert_eq!(t.allocs["a1"].modify_index, stats_write);
            assert_eq!(t.allocs["a1"].csi_volume_stats, a1.csi_volume_stats);
        });

        // Anything else the client is sent moves it.
        let mut a1 = store.read(|t| t.allocs["a1"].clone());
        a1.desired_status = berth_structs::AllocDesiredStatus::Stop;
        let stop = put(&store, vec![Change::PutAlloc(a1)]);
        assert_eq!(at("n1"), Some(stop));
        assert_eq!(store.read(|t| t.allocs_state_index), stop);
        assert_eq!(*woken.borrow_and_update(), stop);
        assert_eq!(store.read(Tables::cluster_indexes).allocs, stop);
        // So does a node's write (a purge ends the node's watch).
        put(
            &store,
            vec![Change::PutNode(Node {
                id: "n1".into(),
                ..Node::default()
            })],
        );
        assert!(woken.has_changed().unwrap());

        // Moved to another node: both nodes' move.
        let mut a1 = store.read(|t| t.allocs["a1"].clone());
        a1.node_id = "n2".into();
        let moved = put(&store, vec![Change::PutAlloc(a1)]);
        assert_eq!((at("n1"), at("n2")), (Some(moved), Some(moved)));
    }

    mod indexes {
        use std::collections::BTreeMap;

        use berth_structs::{
            AccessMode, AttachmentMode, ClaimMode, ClaimState, CsiInfo, CsiPluginType,
            CsiVolumeClaim, DrainStrategy, Task, TaskCsiPluginConfig, TaskGroup,
        };
        use proptest::prelude::*;

        use super::*;

        /// One random change, over a handful of IDs so that puts replace,
        /// deletes hit and several objects share a node, job or plugin.
        #[derive(Debug, Clone)]
        enum Op {
            Alloc {
                id: u8,
                node: u8,
                job: u8,
                plugin: Option<u8>,
                stats_only: bool,
                stopped: bool,
            },
            DeleteAlloc(u8),
            Node {
                id: u8,
                name: u8,
                node_plugins: Vec<u8>,
                controller_plugins: Vec<u8>,
                draining: bool,
            },
            DeleteNode(u8),
            Volume {
                id: u8,
                plugin: u8,
                claims: Vec<(u8, u8, bool)>,
            },
            DeleteVolume(u8),
        }

        fn op() -> impl Strategy<Value = Op> {
            let few = || 0u8..4;
            prop_oneof![
                4 => (0u8..8, few(), few(), proptest::option::of(few()), any::<bool>(), any::<bool>()).prop_map(
                    |(id, node, job, plugin, stats_only, stopped)| Op::Alloc { id, node, job, plugin, stats_only, stopped }
                ),
                1 => (0u8..8).prop_map(Op::DeleteAlloc),
                2 => (few(), few(), proptest::collection::vec(few(), 0..3), proptest::collection::vec(few(), 0..2), any::<bool>())
                    .prop_map(|(id, name, node_plugins, controller_plugins, draining)| Op::Node {
                        id, name, node_plugins, controller_plugins, draining
                    }),
                1 => few().prop_map(Op::DeleteNode),
                2 => (few(), few(), proptest::collection::vec((0u8..8, few(), any::<bool>()), 0..4))
                    .prop_map(|(id, plugin, claims)| Op::Volume { id, plugin, claims }),
                1 => few().prop_map(Op::DeleteVolume),
            ]
        }

        fn claim(alloc: u8, node: u8) -> CsiVolumeClaim {
            CsiVolumeClaim {
                alloc_id: format!("a{alloc}"),
                node_id: format!("n{node}"),
                external_node_id: String::new(),
                mode: ClaimMode::Read,
                access_mode: AccessMode::MultiNodeReader,
                attachment_mode: AttachmentMode::FileSystem,
                state: ClaimState::Taken,
                publish_context: BTreeMap::new(),
                releasing: false,
                controller_published: false,
                kept_after_purge: false,
            }
        }

        fn change(store: &StateStore, op: &Op) -> Change {
            match op.clone() {
                Op::Alloc {
                    id,
                    node,
                    job,
                    plugin,
                    stats_only,
                    stopped,
                } => {
                    let id = format!("a{id}");
                    if stats_only {
                        if let Some(mut a) = store.read(|t| t.allocs.get(&id).cloned()) {
                            let stats = berth_structs::CsiVolumeStats {
                                volume_id: "v".into(),
                                bytes_used: Some(u64::from(node)),
                                ..Default::default()
                            };
                            a.csi_volume_stats.insert("data".into(), stats);
                            return Change::PutAlloc(a);
                        }
                    }
                    let tasks = vec![Task {
                        name: "t".into(),
                        csi_plugin: plugin.map(|p| TaskCsiPluginConfig {
                            id: format!("p{p}"),
                            plugin_type: CsiPluginType::Monolith,
                            mount_dir: "/csi".into(),
                            stage_publish_base_dir: None,
                            health_timeout: Duration::from_secs(30),
                        }),
                        ..Task::default()
                    }];
                    Change::PutAlloc(Allocation {
                        id,
                        node_id: format!("n{node}"),
                        job_id: format!("j{job}"),
                        desired_status: if stopped {
                            berth_structs::AllocDesiredStatus::Stop
                        } else {
                            berth_structs::AllocDesiredStatus::Run
                        },
                        task_group: "g".into(),
                        job: Job {
                            id: format!("j{job}"),
                            task_groups: vec![TaskGroup {
                                name: "g".into(),
                                tasks,
                                ..TaskGroup::default()
                            }],
                            ..Job::default()
                        }
                        .into(),
                        ..Allocation::default()
                    })
                }
                Op::DeleteAlloc(id) => Change::DeleteAlloc(format!("a{id}")),
                Op::Node {
                    id,
                    name,
                    node_plugins,
                    controller_plugins,
                    draining,
                } => {
                    let plugins = |ps: Vec<u8>| {
                        ps.into_iter()
                            .map(|p| (format!("p{p}"), CsiInfo::default()))
                            .collect()
                    };
                    Change::PutNode(Node {
                        id: format!("n{id}"),
                        name: format!("name{name}"),
                        csi_node_plugins: plugins(node_plugins),
                        csi_controller_plugins: plugins(controller_plugins),
                        drain_strategy: draining
                            .then(|| DrainStrategy::new(Duration::from_secs(60), 0)),
                        ..Node::default()
                    })
                }
                Op::DeleteNode(id) => Change::DeleteNode(format!("n{id}")),
                Op::Volume { id, plugin, claims } => {
                    let mut v = CsiVolume {
                        id: format!("v{id}"),
                        plugin_id: format!("p{plugin}"),
                        ..CsiVolume::default()
                    };
                    for (alloc, node, write) in claims {
                        let c = claim(alloc, node);
                        if write {
                            v.write_claims.insert(c.alloc_id.clone(), c);
                        } else {
                            v.read_claims.insert(c.alloc_id.clone(), c);
                        }
                    }
                    Change::PutVolume(v)
                }
                Op::DeleteVolume(id) => Change::DeleteVolume(format!("v{id}")),
            }
        }

        /// Every indexed lookup against the scan it replaces.
        fn check_lookups(t: &Tables) {
            let ids = |it: Vec<&String>| it.into_iter().cloned().collect::<Vec<_>>();
            for k in 0..4u8 {
                let node = format!("n{k}");
                let job = format!("j{k}");
                let plugin = format!("p{k}");
                let name = format!("name{k}");
                assert_eq!(
                    ids(t.allocs_on_node(&node).map(|a| &a.id).collect()),
                    ids(t
                        .allocs
                        .values()
                        .filter(|a| a.node_id == node)
                        .map(|a| &a.id)
                        .collect())
                );
                let live: Vec<&Allocation> = t
                    .allocs
                    .values()
                    .filter(|a| a.node_id == node && !a.is_terminal())
                    .collect();
                let tasks = || live.iter().filter_map(|a| a.group()).flat_map(|g| &g.tasks);
                assert_eq!(
                    t.node_use(&node),
                    NodeUse {
                        allocs: live.len() as u64,
                        cpu: tasks().map(|t| u128::from(t.resources.cpu)).sum(),
                        memory_mb: tasks().map(|t| u128::from(t.resources.memory_mb)).sum(),
                    }
                );
                assert_eq!(
                    ids(t.allocs_of_job(&job).map(|a| &a.id).collect()),
                    ids(t
                        .allocs
                        .values()
                        .filter(|a| a.job_id == job)
                        .map(|a| &a.id)
                        .collect())
                );
                let runs = |a: &Allocation| {
                    a.group().is_some_and(|g| {
                        g.tasks
                            .iter()
                            .any(|t| t.csi_plugin.as_ref().is_some_and(|p| p.id == plugin))
                    })
                };
                assert_eq!(
                    ids(t.allocs_running_plugin(&plugin).map(|a| &a.id).collect()),
                    ids(t
                        .allocs
                        .values()
                        .filter(|a| runs(a))
                        .map(|a| &a.id)
                        .collect())
                );
                assert_eq!(
                    ids(t.volumes_claimed_on_node(&node).map(|v| &v.id).collect()),
                    ids(t
                        .volumes
                        .values()
                        .filter(|v| v.claims().any(|c| c.node_id == node))
                        .map(|v| &v.id)
                        .collect())
                );
                assert_eq!(
                    ids(t.volumes_of_plugin(&plugin).map(|v| &v.id).collect()),
                    ids(t
                        .volumes
                        .values()
                        .filter(|v| v.plugin_id == plugin)
                        .map(|v| &v.id)
                        .collect())
                );
                assert_eq!(
                    ids(t.nodes_named(&name).map(|n| &n.id).collect()),
                    ids(t
                        .nodes
                        .values()
                        .filter(|n| n.name == name)
                        .map(|n| &n.id)
                        .collect())
                );
                assert_eq!(
                    ids(t.nodes_with_plugin(&plugin).map(|n| &n.id).collect()),
                    ids(t
                        .nodes
                        .values()
                        .filter(|n| n.csi_node_plugins.contains_key(&plugin)
                            || n.csi_controller_plugins.contains_key(&plugin))
                        .map(|n| &n.id)
                        .collect())
                );
            }
            for k in 0..8u8 {
                let alloc = format!("a{k}");
                assert_eq!(
                    ids(t.volumes_claimed_by_alloc(&alloc).map(|v| &v.id).collect()),
                    ids(t
                        .volumes
                        .values()
                        .filter(|v| v.claim_for(&alloc).is_some())
                        .map(|v| &v.id)
                        .collect())
                );
            }
            let mut plugins: BTreeSet<&str> = BTreeSet::new();
            for n in t.nodes.values() {
                plugins.extend(n.csi_node_plugins.keys().map(String::as_str));
                plugins.extend(n.csi_controller_plugins.keys().map(String::as_str));
            }
            for a in t.allocs.values().filter(|a| !a.is_terminal()) {
                let tasks = a.group().into_iter().flat_map(|g| &g.tasks);
                plugins.extend(tasks.filter_map(|t| t.csi_plugin.as_ref().map(|p| p.id.as_str())));
            }
            assert_eq!(t.plugin_ids(), plugins);
            assert_eq!(
                ids(t.draining_nodes().map(|n| &n.id).collect()),
                ids(t
                    .nodes
                    .values()
                    .filter(|n| n.drain_strategy.is_some())
                    .map(|n| &n.id)
                    .collect())
            );
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]

            /// After any writes and deletes, and after a reload from disk,
            /// the indexes are what a scan of the tables builds, and every
            /// indexed lookup answers what the scan it replaces answers.
            #[test]
            fn indexes_equal_a_scan_after_writes_deletes_and_a_reload(
                writes in proptest::collection::vec(proptest::collection::vec(op(), 1..4), 1..24)
            ) {
                let dir = tempfile::tempdir().unwrap();
                let path = RedbBackend::path_in(dir.path());
                let kept = {
                    let store = StateStore::open(Box::new(RedbBackend::open(&path).unwrap())).unwrap();
                    for ops in &writes {
                        let changes: Vec<Change> = ops.iter().map(|op| change(&store, op)).collect();
                        put(&store, changes);
                        store.read(|t| {
                            prop_assert_eq!(&t.indexes, &Indexes::build(t));
                            check_lookups(t);
                            Ok(())
                        })?;
                    }
                    store.read(|t| t.indexes.clone())
                };
                let store = StateStore::open(Box::new(RedbBackend::open(&path).unwrap())).unwrap();
                store.read(|t| {
                    prop_assert_eq!(&t.indexes, &kept);
                    prop_assert_eq!(&t.indexes, &Indexes::build(t));
                    check_lookups(t);
                    Ok(())
                })?;
            }
        }
    }
}
