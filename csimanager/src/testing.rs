//! In-memory stand-ins for what the agent gives csimanager, for the tests
//! of csimanager and of the crates above it (feature `testing`): a volume
//! state store that survives a "restart" because the test keeps it, and a
//! node event log.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use berth_structs::NodeEvent;

use crate::{NodeEventSink, PluginRegistration, VolumeStateStore, VolumeStub};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A [`VolumeStateStore`] in memory, shared by "restarts".
#[derive(Default)]
pub struct MemStore {
    plugins: Mutex<Vec<PluginRegistration>>,
    volumes: Mutex<BTreeMap<String, VolumeStub>>,
}

impl MemStore {
    pub fn plugins(&self) -> Vec<PluginRegistration> {
        lock(&self.plugins).clone()
    }

    pub fn volumes(&self) -> BTreeMap<String, VolumeStub> {
        lock(&self.volumes).clone()
    }
}

impl VolumeStateStore for MemStore {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, String> {
        Ok(self.plugins())
    }
    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), String> {
        *lock(&self.plugins) = plugins.to_vec();
        Ok(())
    }
    fn load_volumes(&self) -> Result<Vec<VolumeStub>, String> {
        Ok(self.volumes().into_values().collect())
    }
    fn put_volume(&self, stub: &VolumeStub) -> Result<(), String> {
        lock(&self.volumes).insert(stub.key(), stub.clone());
        Ok(())
    }
    fn delete_volume(&self, key: &str) -> Result<(), String> {
        lock(&self.volumes).remove(key);
        Ok(())
    }
}

/// A [`NodeEventSink`] that keeps every event.
#[derive(Default)]
pub struct EventLog(Mutex<Vec<NodeEvent>>);

impl EventLog {
    pub fn all(&self) -> Vec<NodeEvent> {
        lock(&self.0).clone()
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
        lock(&self.0).push(event);
    }
}
