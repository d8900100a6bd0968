//! The store's schema: the one list of its tables. Each line names a
//! table, its field in [`Tables`], the [`Record`] type it holds and its
//! put and delete [`Change`]s; everything the store and its backend do
//! per table (stamping, applying, indexing, loading, committing) is
//! generated from it. Adding a table is a type that implements
//! [`Record`] and a line here.

use std::borrow::Cow;
use std::collections::BTreeMap;

use berth_structs::{Allocation, CsiVolume, Deployment, Job, JobVersion, Node, NodeSecret};

use super::error::StoreError;
use super::record::{Record, RecordStore, TableVisitor, WriteEffects};
use super::{AclRecord, Indexes};
use crate::keyring::Keyring;

macro_rules! schema {
    ($(
        $(#[$doc:meta])*
        $table:ident($name:literal) $field:ident: $ty:ty => $put:ident, $del:ident;
    )*) => {
        /// The tables of the store.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Table {
            $($(#[$doc])* $table,)*
        }

        impl Table {
            pub const ALL: [Table; [$(Table::$table),*].len()] = [$(Table::$table),*];

            /// The table's name (on disk too).
            pub fn name(&self) -> &'static str {
                match self {
                    $(Table::$table => $name,)*
                }
            }
        }

        /// One change of a write. The records are held inline: a change
        /// lives only as long as its write, and an alloc, the largest,
        /// is the most common one.
        #[derive(Debug, Clone)]
        #[allow(clippy::large_enum_variant)]
        pub enum Change {
            $(
                #[doc = concat!("Put a record of the `", $name, "` table.")]
                $put($ty),
                #[doc = concat!("Delete the record of the `", $name, "` table under a key.")]
                $del(String),
            )*
            /// Set the secret of a node (its registration's). Deleting a
            /// node keeps its secret: the ID stays bound to it, so that
            /// only the node that had it (or a new introduction token)
            /// takes the ID again.
            PutNodeSecret {
                node_id: String,
                secret: NodeSecret,
            },
        }

        impl Change {
            pub fn table(&self) -> Table {
                match self {
                    $(Change::$put(_) | Change::$del(_) => Table::$table,)*
                    Change::PutNodeSecret { .. } => Table::Nodes,
                }
            }

            /// The key of the record the change puts or deletes.
            pub fn key(&self) -> Cow<'_, str> {
                match self {
                    $(
                        Change::$put(r) => Record::key(r),
                        Change::$del(k) => Cow::Borrowed(k),
                    )*
                    Change::PutNodeSecret { node_id, .. } => Cow::Borrowed(node_id),
                }
            }

            /// The put of the record stored as `bytes` under `key` in
            /// `table`, decoded as a load decodes it (`None`, reported,
            /// when it does not).
            pub(crate) fn decoded(
                table: Table,
                key: &str,
                bytes: &[u8],
                keyring: &Keyring,
            ) -> Option<Change> {
                match table {
                    $(Table::$table => super::record::decode_checked::<$ty>(key, bytes, keyring)
                        .map(|(r, _)| Change::$put(r)),)*
                }
            }

            /// The delete of the record under `key` in `table`.
            pub(crate) fn deletion(table: Table, key: String) -> Change {
                match table {
                    $(Table::$table => Change::$del(key),)*
                }
            }

            /// The bytes a put stores in its table (`None` for a delete,
            /// and for a node secret, which is kept apart).
            pub(crate) fn encode(
                &self,
                keyring: &Keyring,
            ) -> Option<Result<Vec<u8>, StoreError>> {
                match self {
                    $(Change::$put(r) => Some(Record::encode(r, keyring)),)*
                    _ => None,
                }
            }

            /// Sets the create and modify index (and times) of a put.
            fn stamp(&mut self, tables: &Tables, index: u64, now_ms: i64) {
                match self {
                    $(Change::$put(r) => RecordStore::stamp(&tables.$field, r, index, now_ms),)*
                    _ => {}
                }
            }

            /// Applies the change to `tables`, keeping their indexes.
            pub(super) fn apply(self, tables: &mut Tables, fx: &mut WriteEffects) {
                match self {
                    $(
                        Change::$put(r) => {
                            RecordStore::put(&mut tables.$field, r, &mut tables.indexes, fx)
                        }
                        Change::$del(k) => {
                            RecordStore::delete(&mut tables.$field, &k, &mut tables.indexes, fx)
                        }
                    )*
                    Change::PutNodeSecret { node_id, secret } => {
                        tables.node_secrets.insert(node_id, secret);
                    }
                }
            }
        }

        /// The in-memory tables and their indexes.
        #[derive(Debug, Default, Clone)]
        pub struct Tables {
            $($(#[$doc])* pub $field: <$ty as Record>::Store,)*
            /// The secret each node registered with, by node ID.
            pub node_secrets: BTreeMap<String, NodeSecret>,
            /// The index of the last write.
            pub index: u64,
            /// The index of the last write to each table.
            pub table_index: BTreeMap<Table, u64>,
            /// The index of the last write that put or deleted an alloc of each
            /// node, since the store was opened (memory only): an alloc watch
            /// looks at the allocs again only when its node's moved, not on every
            /// write of any node. A write of an alloc's volume stats alone does
            /// not move it (the client is not sent those).
            pub node_allocs_index: BTreeMap<String, u64>,
            /// The index of the last write that put or deleted an alloc, leaving
            /// out writes of an alloc's volume stats alone (memory only).
            pub allocs_state_index: u64,
            /// Lookups by something other than an object's ID (memory only: built
            /// when the store opens, kept by its writes).
            pub(crate) indexes: Indexes,
            /// A node counts as an instance of a CSI plugin only while an alloc of
            /// a job with that plugin's `csi_plugin` block runs on it (memory
            /// only: the servers' policy, set when they open the store).
            pub plugin_instances_need_allocs: bool,
        }

        impl Tables {
            /// Adds every record of every table to `idx`.
            pub(super) fn index_all(&self, idx: &mut Indexes) {
                $(RecordStore::index_all(&self.$field, idx);)*
            }

            /// The highest modify index of the records (see
            /// [`RecordStore::max_modify_index`]).
            pub(super) fn max_modify_index(&self) -> u64 {
                [$(RecordStore::max_modify_index(&self.$field)),*].into_iter().max().unwrap_or(0)
            }

            /// Runs `visitor` over every table, in the order of the schema.
            pub(crate) fn visit_mut<V: TableVisitor>(&mut self, visitor: &mut V) -> Result<(), V::Error> {
                $(visitor.visit::<$ty>(&mut self.$field)?;)*
                Ok(())
            }
        }
    };
}

schema! {
    Jobs("jobs") jobs: Job => PutJob, DeleteJob;
    Allocs("allocs") allocs: Allocation => PutAlloc, DeleteAlloc;
    Nodes("nodes") nodes: Node => PutNode, DeleteNode;
    Volumes("volumes") volumes: CsiVolume => PutVolume, DeleteVolume;
    /// The last versions of each job, as submitted.
    JobVersions("job_versions") job_versions: JobVersion => PutJobVersion, DeleteJobVersion;
    /// ACL policies, tokens and introduction tokens.
    Acl("acl") acl: AclRecord => PutAcl, DeleteAcl;
    /// The deployments of the jobs' versions.
    Deployments("deployments") deployments: Deployment => PutDeployment, DeleteDeployment;
}

impl Change {
    /// Put an ACL record.
    pub fn put_acl(record: AclRecord) -> Change {
        Change::PutAcl(record)
    }
}

/// Set create/modify indexes (and alloc times) on the changes of a write.
pub(super) fn stamp(tables: &Tables, index: u64, changes: &mut [Change]) {
    let now = berth_structs::now_ms();
    for change in changes.iter_mut() {
        change.stamp(tables, index, now);
    }
}
