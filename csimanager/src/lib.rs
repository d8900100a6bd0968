//! berth-csimanager: the client side of CSI.
//!
//! It owns the CSI clients that talk to plugins over unix sockets, the
//! dynamic plugin registry that plugin tasks register into, fingerprinting of
//! registered plugins, the volume manager that stages and publishes volumes
//! for allocs, and the storage node events those operations emit.
//!
//! Where things are: `client` (one cached connection per plugin, deadlines,
//! error classification), `registry`, `fingerprint`, `volume` (the types the
//! CSI hook passes in), `volume_manager` (stage/publish, usage counting,
//! per-volume serialization, retries, undo, storage events), `manager` (the
//! entry point that ties them together), `orphans` (mounts no restored
//! alloc owns, removed at agent start), `repair` (lost mounts of running
//! allocs made again once their plugin is healthy), `retry` (the retry
//! loop with backoff all CSI calls share), `stats` (the loop that
//! collects volume stats and conditions), `mountinfo` (the mount table,
//! read one way for all of them).
//!
//! It knows nothing of the servers, the HTTP API or how allocs run: what it
//! needs from above (persistence, somewhere to send node events and
//! fingerprints) it asks for through the small traits in [`sinks`].

pub mod client;
pub mod error;
pub mod fingerprint;
pub mod manager;
pub mod mountinfo;
pub mod orphans;
pub mod registry;
pub mod repair;
pub mod retry;
pub mod sinks;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
pub mod volume;
pub mod volume_manager;

pub use client::CsiClient;
pub use error::{CsiError, StoreError};
pub use fingerprint::PluginFingerprint;
pub use manager::{CsiManager, ManagerConfig};
pub use orphans::{OrphanRemoval, RemovedHow, EVENT_ORPHANED_MOUNT_REMOVED};
pub use registry::{PluginRegistration, PluginRegistry, RegistryEntry};
pub use repair::{LostMount, RepairWatch, VolumeRepair};
pub use retry::retry_notify;
pub use sinks::{FingerprintSink, NodeEventSink, VolumeStateStore};
pub use stats::VolumeStatsSink;
pub use volume::{
    ExpandRequest, MountContext, MountInfo, MountRequest, UnmountRequest, VolumeStub,
};
pub use volume_manager::RetryPolicy;
