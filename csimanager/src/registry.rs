//! The dynamic plugin registry: plugin tasks register here once healthy and
//! deregister when they stop; csimanager watches it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use berth_structs::CsiPluginType;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// One plugin instance on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginRegistration {
    pub plugin_id: String,
    pub plugin_type: CsiPluginType,
    /// Host path of the plugin's unix socket.
    pub socket_path: PathBuf,
    /// The alloc that runs the plugin task.
    pub alloc_id: String,
    pub task: String,
    /// Host directory under which staging and publish paths are made for
    /// this plugin.
    pub mount_root: PathBuf,
    pub provider: String,
    pub version: String,
}

#[derive(Default)]
struct Inner {
    plugins: BTreeMap<String, PluginRegistration>,
}

/// Registered plugins by plugin ID. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct PluginRegistry {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<watch::Sender<u64>>,
}

impl Default for PluginRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl PluginRegistry {
    pub fn new() -> PluginRegistry {
        let (tx, _) = watch::channel(0);
        PluginRegistry {
            inner: Arc::default(),
            changed: Arc::new(tx),
        }
    }

    /// Adds or replaces the plugin's registration.
    pub fn register(&self, reg: PluginRegistration) {
        {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            if inner.plugins.get(&reg.plugin_id) == Some(&reg) {
                return;
            }
            inner.plugins.insert(reg.plugin_id.clone(), reg);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Removes the plugin, if `alloc_id` is the instance registered for it
    /// (a newer instance of the plugin is left alone).
    pub fn deregister(&self, plugin_id: &str, alloc_id: &str) -> bool {
        let removed = {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            match inner.plugins.get(plugin_id) {
                Some(r) if r.alloc_id == alloc_id => inner.plugins.remove(plugin_id).is_some(),
                _ => false,
            }
        };
        if removed {
            self.changed.send_modify(|v| *v += 1);
        }
        removed
    }

    pub fn get(&self, plugin_id: &str) -> Option<PluginRegistration> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.plugins.get(plugin_id).cloned()
    }

    pub fn list(&self) -> Vec<PluginRegistration> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.plugins.values().cloned().collect()
    }

    /// A receiver whose value changes on every registry change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(id: &str, alloc: &str) -> PluginRegistration {
        PluginRegistration {
            plugin_id: id.into(),
            plugin_type: CsiPluginType::Monolith,
            socket_path: "/tmp/x.sock".into(),
            alloc_id: alloc.into(),
            task: "plugin".into(),
            mount_root: "/tmp/x".into(),
            provider: "p".into(),
            version: "1".into(),
        }
    }

    #[test]
    fn deregister_leaves_a_newer_instance() {
        let r = PluginRegistry::new();
        let mut rx = r.subscribe();
        r.register(reg("hostpath", "a1"));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        r.register(reg("hostpath", "a2"));
        assert!(!r.deregister("hostpath", "a1"));
        assert_eq!(r.get("hostpath").unwrap().alloc_id, "a2");
        assert!(r.deregister("hostpath", "a2"));
        assert!(r.list().is_empty());
    }
}
