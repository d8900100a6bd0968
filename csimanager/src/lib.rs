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
//! entry point that ties them together).
//!
//! It knows nothing of the servers, the HTTP API or how allocs run: what it
//! needs from above (persistence, somewhere to send node events and
//! fingerprints) it asks for through the small traits in [`sinks`].

pub mod client;
pub mod error;
pub mod fingerprint;
pub mod manager;
pub mod registry;
pub mod sinks;
pub mod volume;
pub mod volume_manager;

pub use client::CsiClient;
pub use error::CsiError;
pub use fingerprint::PluginFingerprint;
pub use manager::{CsiManager, ManagerConfig};
pub use registry::{PluginRegistration, PluginRegistry, RegistryEntry};
pub use sinks::{FingerprintSink, NodeEventSink, VolumeStateStore};
pub use volume::{MountInfo, MountRequest, UnmountRequest, VolumeStub};
pub use volume_manager::RetryPolicy;
