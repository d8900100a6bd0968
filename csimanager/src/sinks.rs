//! What csimanager needs from the agent that embeds it.

use std::collections::BTreeMap;

use berth_structs::{CsiInfo, NodeEvent};

use crate::error::StoreError;
use crate::registry::PluginRegistration;
use crate::volume::VolumeStub;

/// Receives node events (subsystems `CSI` and `Storage`).
pub trait NodeEventSink: Send + Sync + 'static {
    fn emit(&self, event: NodeEvent);
}

/// Receives the node's plugin fingerprints: the full set each time.
#[async_trait::async_trait]
pub trait FingerprintSink: Send + Sync + 'static {
    /// `node_plugins` and `controller_plugins` are keyed by plugin ID.
    async fn update_plugins(
        &self,
        node_plugins: BTreeMap<String, CsiInfo>,
        controller_plugins: BTreeMap<String, CsiInfo>,
    );
}

/// Durable storage for what must survive an agent restart. Every write is
/// durable when the call returns; csimanager writes before the CSI call that
/// depends on it.
pub trait VolumeStateStore: Send + Sync + 'static {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, StoreError>;
    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), StoreError>;
    fn load_volumes(&self) -> Result<Vec<VolumeStub>, StoreError>;
    /// Insert or replace the stub under `stub.key()`.
    fn put_volume(&self, stub: &VolumeStub) -> Result<(), StoreError>;
    fn delete_volume(&self, key: &str) -> Result<(), StoreError>;
}
