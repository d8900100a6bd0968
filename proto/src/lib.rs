//! Wire protocols of berth.
//!
//! `csi::v1` is the Container Storage Interface, spec v1.12, wire-identical to
//! the upstream definition; `etcd` the part of etcd's v3 API the servers
//! use. `berth::v1` is the protocol between a client agent
//! and the servers. This crate holds generated code and the protocol's
//! constants only; it knows nothing of the data model, the client or the
//! servers.

pub mod csi {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("csi.v1");
    }
}

/// The part of etcd's v3 API the servers speak when they keep their state
/// in etcd (a client only; see `etcd/rpc.proto`).
pub mod etcd {
    pub mod etcdserverpb {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("etcdserverpb");
    }
    pub mod mvccpb {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("mvccpb");
    }
}

pub mod berth {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("berth.v1");

        /// The gRPC metadata key that carries the calling node's secret on
        /// every `Node` and `CSIVolume` RPC. The servers refuse a call whose
        /// secret is not the one the node registered with.
        pub const NODE_SECRET_METADATA: &str = "x-berth-node-secret";

        /// The header that names the cluster on every answer of the agent
        /// protocol, and on a client's requests the cluster it registered
        /// with: a server refuses a request that names another cluster,
        /// and a client takes no answer from a server of another one.
        pub const CLUSTER_ID_HEADER: &str = "x-berth-cluster-id";

        /// The gRPC metadata key that carries an introduction token on
        /// `Node.Register`: what a node the servers do not know registers
        /// with when it has no client certificate.
        pub const INTRO_TOKEN_METADATA: &str = "x-berth-intro-token";

        /// The largest answer a client sends back on the call stream for
        /// one node-local HTTP request (as large as a forwarded answer).
        pub const MAX_CLIENT_HTTP_ANSWER: usize = 64 * 1024 * 1024;

        /// The largest node JSON a `Node.Register` may carry.
        pub const MAX_REGISTER_NODE_JSON: usize = 1024 * 1024;
    }
}
