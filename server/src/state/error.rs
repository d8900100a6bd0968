//! The store's own error: what failed between the tables and the disk.

/// Errors of the state store and its persistence.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("opening the state database {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: redb::Error,
    },
    #[error("state database: {0}")]
    Db(#[from] redb::Error),
    #[error("state database {path} has schema version {found}, newer than this berth supports ({supported})")]
    SchemaTooNew {
        path: String,
        found: u64,
        supported: u64,
    },
    #[error("encoding {table} record {key:?}: {source}")]
    Encode {
        table: &'static str,
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("sealing the secrets of {record}: {source}")]
    Seal {
        record: String,
        #[source]
        source: crate::keyring::KeyringError,
    },
    #[error("{0}")]
    Keyring(#[from] crate::keyring::KeyringError),
    #[error("sealing the secrets of {record} again: {source}; the keyring is unchanged")]
    Reseal {
        record: String,
        #[source]
        source: super::RecordError,
    },
    #[error("this state store keeps no keyring")]
    NoKeyring,
    /// etcd (the store of `server { store = "etcd" }`) failed or did not
    /// answer.
    #[error("{0}")]
    Etcd(#[from] crate::etcd::EtcdError),
    /// A write on a server that does not lead (see `crate::leader`).
    #[error("{0}")]
    NotLeader(String),
    /// A conditional write found the store moved under it.
    #[error("{0}")]
    Conflict(String),
    /// What this store cannot do.
    #[error("{0}")]
    Unsupported(String),
    /// What the store holds cannot be right.
    #[error("{0}")]
    Corrupt(String),
    #[error("creating the state directory {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// Whether the store could not be reached (etcd down or without
    /// quorum), or this server does not lead: a write may succeed when
    /// tried again later, or at another server.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Etcd(e) => e.is_unavailable(),
            StoreError::NotLeader(_) => true,
            _ => false,
        }
    }
}
