//! In-memory stand-ins for what the agent gives csimanager, for the tests
//! of csimanager and of the crates above it (feature `testing`): a volume
//! state store that survives a "restart" because the test keeps it, and a
//! node event log.

use berth_sync::MutexExt;
use std::collections::BTreeMap;
use std::sync::Mutex;

use berth_structs::NodeEvent;

use crate::{NodeEventSink, PluginRegistration, StoreError, VolumeStateStore, VolumeStub};

/// A [`VolumeStateStore`] in memory, shared by "restarts".
#[derive(Default)]
pub struct MemStore {
    plugins: Mutex<Vec<PluginRegistration>>,
    volumes: Mutex<BTreeMap<String, VolumeStub>>,
}

impl MemStore {
    pub fn plugins(&self) -> Vec<PluginRegistration> {
        self.plugins.locked().clone()
    }

    pub fn volumes(&self) -> BTreeMap<String, VolumeStub> {
        self.volumes.locked().clone()
    }
}

impl VolumeStateStore for MemStore {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, StoreError> {
        Ok(self.plugins())
    }
    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), StoreError> {
        *self.plugins.locked() = plugins.to_vec();
        Ok(())
    }
    fn load_volumes(&self) -> Result<Vec<VolumeStub>, StoreError> {
        Ok(self.volumes().into_values().collect())
    }
    fn put_volume(&self, stub: &VolumeStub) -> Result<(), StoreError> {
        self.volumes.locked().insert(stub.key(), stub.clone());
        Ok(())
    }
    fn delete_volume(&self, key: &str) -> Result<(), StoreError> {
        self.volumes.locked().remove(key);
        Ok(())
    }
}

/// A [`NodeEventSink`] that keeps every event.
#[derive(Default)]
pub struct EventLog(Mutex<Vec<NodeEvent>>);

impl EventLog {
    pub fn all(&self) -> Vec<NodeEvent> {
        self.0.locked().clone()
    }

    /// The events of `subsystem` with `message`.
    pub fn with_message(&self, subsystem: &str, message: &str) -> Vec<NodeEvent> {
        self.all()
            .into_iter()
            .filter(|e| e.subsystem == subsystem && e.message == message)
            .collect()
    }
}

impl NodeEventSink for EventLog {
    fn emit(&self, event: NodeEvent) {
        self.0.locked().push(event);
    }
}
