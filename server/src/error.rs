//! Errors of the server role, and their one mapping to gRPC status codes.
//!
//! The HTTP layer maps [`ServerError`] by variant (or through
//! [`ServerError::http_status`]); the gRPC layer goes through
//! `From<ServerError> for tonic::Status`. Clients classify gRPC codes: the
//! codes a claim can fail with are chosen so that "try again later" is
//! retryable (`ResourceExhausted`, `Unavailable`) and a request that can never
//! succeed is final (`NotFound`, `FailedPrecondition`, `InvalidArgument`).

use berth_structs::ValidationError;

pub use crate::state::StoreError;

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::Db(e.into())
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

/// Errors of the server's public API and RPC services.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The named object does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// The object fails its checks.
    #[error("{0}")]
    Validation(#[from] ValidationError),
    /// The request contradicts the current state and will not succeed by
    /// retrying it unchanged (e.g. deregistering a claimed volume without
    /// force, a claim of an access mode the volume does not have).
    #[error("{0}")]
    Conflict(String),
    /// The volume's claims of the wanted kind are all taken right now; retry
    /// once a claim is freed.
    #[error("{0}")]
    InUse(String),
    /// A needed party (a client running a plugin, the call stream of a node)
    /// cannot be reached now; retry.
    #[error("{0}")]
    Unavailable(String),
    /// A node RPC whose node secret is missing or is not the node's, or
    /// that acts for an alloc of another node. The message names the node,
    /// never a secret.
    #[error("{0}")]
    Forbidden(String),
    /// The caller made more requests of this kind than its limit allows
    /// (`Node.Register` per peer address); retry after the wait the
    /// message names.
    #[error("{0}")]
    TooManyRequests(String),
    /// A client answered a server call with an error (typically a CSI plugin
    /// error); `code` is the gRPC code it reported.
    #[error("{message}")]
    Remote { code: tonic::Code, message: String },
    #[error("state store: {0}")]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServerError {
    pub fn not_found(what: impl Into<String>) -> ServerError {
        ServerError::NotFound(what.into())
    }

    /// The HTTP status the API should answer with.
    pub fn http_status(&self) -> u16 {
        match self {
            ServerError::NotFound(_) => 404,
            ServerError::BadRequest(_) | ServerError::Validation(_) => 400,
            ServerError::Conflict(_) | ServerError::InUse(_) => 409,
            ServerError::Unavailable(_) => 503,
            ServerError::Store(e) if e.is_unavailable() => 503,
            ServerError::Store(StoreError::Unsupported(_)) => 400,
            ServerError::Forbidden(_) => 403,
            ServerError::TooManyRequests(_) => 429,
            ServerError::Remote { code, .. } => match code {
                tonic::Code::InvalidArgument | tonic::Code::OutOfRange => 400,
                tonic::Code::NotFound => 404,
                tonic::Code::AlreadyExists
                | tonic::Code::FailedPrecondition
                | tonic::Code::Aborted => 409,
                tonic::Code::Unavailable | tonic::Code::ResourceExhausted => 503,
                tonic::Code::DeadlineExceeded => 504,
                _ => 502,
            },
            ServerError::Store(_) | ServerError::Internal(_) => 500,
        }
    }

    /// The gRPC code this error travels as.
    pub fn grpc_code(&self) -> tonic::Code {
        match self {
            ServerError::NotFound(_) => tonic::Code::NotFound,
            ServerError::BadRequest(_) | ServerError::Validation(_) => tonic::Code::InvalidArgument,
            ServerError::Conflict(_) => tonic::Code::FailedPrecondition,
            ServerError::InUse(_) => tonic::Code::ResourceExhausted,
            ServerError::Unavailable(_) => tonic::Code::Unavailable,
            ServerError::Store(e) if e.is_unavailable() => tonic::Code::Unavailable,
            ServerError::Store(StoreError::Unsupported(_)) => tonic::Code::FailedPrecondition,
            ServerError::Forbidden(_) => tonic::Code::PermissionDenied,
            ServerError::TooManyRequests(_) => tonic::Code::ResourceExhausted,
            ServerError::Remote { code, .. } => *code,
            ServerError::Store(_) | ServerError::Internal(_) => tonic::Code::Internal,
        }
    }
}

impl From<ServerError> for tonic::Status {
    fn from(e: ServerError) -> tonic::Status {
        tonic::Status::new(e.grpc_code(), e.to_string())
    }
}
