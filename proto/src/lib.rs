//! Wire protocols of berth.
//!
//! `csi::v1` is the Container Storage Interface, spec v1.12, wire-identical to
//! the upstream definition. `berth::v1` is the protocol between a client agent
//! and the servers. This crate holds generated code only; it knows nothing of
//! the data model, the client or the servers.

pub mod csi {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("csi.v1");
    }
}

pub mod berth {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("berth.v1");
    }
}
