//! berth-server: the control plane. It owns the cluster state (the state
//! store and its redb persistence, with the keyring that seals the
//! secrets it stores), the scheduler, node identity (the
//! node secrets every node RPC is checked against), node liveness and
//! drain, CSI volumes, claims and the volume watcher, garbage collection,
//! and the gRPC services clients call (`berth.v1.Node`, `berth.v1.CSIVolume`).
//!
//! It knows nothing of the client side (alloc runners, csimanager, the
//! heartbeat loop), the HTTP API or the CLI: clients reach it only through
//! `berth-proto`, and the agent crate calls the public API of [`Server`].
//! Calls the server makes on clients (node detach, controller RPCs) travel
//! over the client-opened call stream (`calls`).

mod calls;
pub mod cluster_id;
mod coalesced;
mod config;
mod csi;
mod drainer;
mod error;
pub mod etcd;
pub mod etcd_tls;
pub mod file_modes;
mod gc;
pub mod keyring;
pub mod leader;
pub mod leader_link;
mod liveness;
mod partial_budget;
mod peer;
mod plugins;
mod prefix;
mod register_rate;
mod rpc;
mod scheduler;
mod server;
pub mod state;

pub use cluster_id::ClusterIdLayer;
pub use config::{ServerConfig, StoreConfig};
pub use csi::{
    ClaimGrant, ReleaseOrigin, SnapshotRequest, VolumeClaimRequest, VolumeRelease,
    FORCED_RELEASE_EVENT,
};
pub use drainer::{DRAIN_COMPLETE_EVENT, DRAIN_STOP_DESCRIPTION};
pub use error::{ServerError, StoreError};
pub use gc::GcReport;
pub use peer::PeerIdentity;
pub use plugins::{InstanceNode, PluginAlloc, PluginStatus};
pub use register_rate::RegisterRate;
pub use rpc::{
    csi_volume_service, limits, node_service, CsiVolumeService, Limited, MethodLimit, NodeService,
};
pub use server::acl::{NewIntroToken, NewToken, TokenRequest, TokenWithPolicies};
pub use server::alloc_stop::{AllocStopResponse, ALLOC_STOP_DESCRIPTION};
pub use server::client_routes::MAX_CLIENT_HTTP_ANSWER;
pub use server::jobs::JobRegisterResponse;
pub use server::node_secrets::Enrollment;
pub use server::nodes::{AllocUpdate, NodePurge, NodeRegistration, NodeUsage, ReleasedClaim};
pub use server::page::{Page, Paged};
pub use server::plan::{
    DiffKind, DiffOp, FieldDiff, GroupPlan, GroupSummary, JobDiff, JobPlan, JobSummary,
    PlannedAlloc, StoppedAlloc,
};
pub use server::versions::JobVersionView;
pub use server::{Server, StoreHealth};
pub use state::Table;
