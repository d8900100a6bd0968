//! `berth-api`: the typed client of a berth agent's HTTP API, what the
//! `berth` CLI and any Rust program use to talk to a cluster.
//!
//! [`ApiClient`] speaks to one agent (`http://` or `https://` with mutual
//! TLS, an ACL token in `X-Berth-Token`); its answers are JSON values or,
//! through the `_as` methods, any type that deserializes from them, such
//! as the data model of [`berth_structs`], re-exported as [`structs`].
//! The job and alloc endpoints have typed calls ([`jobs`]:
//! `register_job`, `job`, `job_allocations`, `stop_job`,
//! `stop_allocation`, ...) whose request and answer bodies are
//! [`types`], the definitions the agent answers with.
//! Every failure is an [`Error`]: what the API answered ([`ApiError`]),
//! or why no answer came.

pub mod client;
pub mod jobs;
pub mod tls;

pub use berth_structs as structs;
pub use berth_structs::api as types;
pub use client::{ApiClient, ApiError, RawAnswer, TlsFiles, DEFAULT_ADDR};
pub use jobs::path_segment;

/// The largest request body the API reads. Job and volume specs are far
/// smaller; the CLI refuses a spec file above it before reading it.
pub const MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// A size for people: `2 MiB` for whole MiB, else `50.0 MiB`, `3.5 KiB`.
pub fn describe_size(bytes: u64) -> String {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;
    const GIB: u64 = 1024 * 1024 * 1024;
    let (unit, name) = if bytes >= GIB {
        (GIB, "GiB")
    } else if bytes >= MIB {
        (MIB, "MiB")
    } else if bytes >= KIB {
        (KIB, "KiB")
    } else {
        return format!("{bytes} bytes");
    };
    if bytes.checked_rem(unit) == Some(0) {
        format!("{} {name}", bytes / unit)
    } else {
        // Precision is irrelevant here: the number is only shown.
        format!("{:.1} {name}", bytes as f64 / unit as f64)
    }
}

/// Why a request got no answer it could use.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API answered, with a status other than 2xx.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// Nothing answers at the address.
    #[error("no berth agent answers at {base} ({why})")]
    Unreachable { base: String, why: String },
    /// The address is not one of an API.
    #[error("address {0:?} is not of the form http://HOST:PORT or https://HOST:PORT")]
    Address(String),
    /// The TLS files could not be used.
    #[error("{0}")]
    Tls(String),
    /// The request or its answer failed on the way (TLS, timeout, I/O).
    #[error("{0}")]
    Transport(String),
    /// The request body could not be encoded.
    #[error("encoding the request: {0}")]
    Encode(#[source] serde_json::Error),
    /// The answer is not of the type asked for.
    #[error("the answer to {path} is not what was expected: {source}")]
    Decode {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

impl Error {
    /// The API's answer, when this is one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            Error::Api(e) => Some(e),
            _ => None,
        }
    }
}

/// What the client's calls return.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_described_for_people() {
        assert_eq!(describe_size(MAX_REQUEST_BODY as u64), "2 MiB");
        assert_eq!(describe_size(1536), "1.5 KiB");
        assert_eq!(describe_size(12), "12 bytes");
    }
}
