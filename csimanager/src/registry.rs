//! The dynamic plugin registry: plugin tasks register here once healthy,
//! are marked unhealthy when their supervisor sees them fail (the task
//! died, a probe failed) and register again once healthy, and deregister
//! when they stop for good; csimanager watches it.

use berth_sync::MutexExt;
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
    plugins: BTreeMap<String, RegistryEntry>,
    /// How new the registered instance of each plugin is (see
    /// [`PluginRegistry::register_instance`]); 0 when not known.
    newness: BTreeMap<String, u64>,
}

/// A registered plugin instance and its health as its supervisor knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryEntry {
    pub registration: PluginRegistration,
    /// Set while the supervisor says the instance is unhealthy: why.
    pub unhealthy: Option<String>,
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

    /// Adds or replaces the plugin's registration, healthy.
    pub fn register(&self, reg: PluginRegistration) {
        self.register_instance(reg, 0);
    }

    /// Registers a plugin instance, healthy, unless a healthy instance of
    /// another alloc that is newer (`newness`: the alloc's create index,
    /// which grows with every alloc the servers place) is registered: an
    /// old instance that still runs (a plugin upgrade, its alloc waiting to
    /// stop) never takes the plugin back from its replacement. It does
    /// when the newer one is unhealthy. Returns whether it registered.
    pub fn register_instance(&self, reg: PluginRegistration, newness: u64) -> bool {
        {
            let mut inner = self.inner.locked();
            let id = &reg.plugin_id;
            let newer_serves = inner.plugins.get(id).is_some_and(|e| {
                e.registration.alloc_id != reg.alloc_id
                    && e.unhealthy.is_none()
                    && inner.newness.get(id).copied().unwrap_or(0) > newness
            });
            if newer_serves {
                return false;
            }
            inner.newness.insert(id.clone(), newness);
            let entry = RegistryEntry {
                registration: reg,
                unhealthy: None,
            };
            if inner.plugins.get(&entry.registration.plugin_id) == Some(&entry) {
                return true;
            }
            inner
                .plugins
                .insert(entry.registration.plugin_id.clone(), entry);
        }
        self.changed.send_modify(|v| *v += 1);
        true
    }

    /// Marks the plugin unhealthy (its task died, a probe failed), if
    /// `alloc_id` is the instance registered for it. It stays registered:
    /// the node goes on reporting it, unhealthy, with what it last was.
    /// Returns whether the mark changed anything.
    pub fn mark_unhealthy(&self, plugin_id: &str, alloc_id: &str, reason: &str) -> bool {
        let changed = {
            let mut inner = self.inner.locked();
            match inner.plugins.get_mut(plugin_id) {
                Some(e)
                    if e.registration.alloc_id == alloc_id
                        && e.unhealthy.as_deref() != Some(reason) =>
                {
                    e.unhealthy = Some(reason.to_string());
                    true
                }
                _ => false,
            }
        };
        if changed {
            self.changed.send_modify(|v| *v += 1);
        }
        changed
    }

    /// Removes the plugin, if `alloc_id` is the instance registered for it
    /// (a newer instance of the plugin is left alone).
    pub fn deregister(&self, plugin_id: &str, alloc_id: &str) -> bool {
        let removed = {
            let mut inner = self.inner.locked();
            match inner.plugins.get(plugin_id) {
                Some(e) if e.registration.alloc_id == alloc_id => {
                    inner.newness.remove(plugin_id);
                    inner.plugins.remove(plugin_id).is_some()
                }
                _ => false,
            }
        };
        if removed {
            self.changed.send_modify(|v| *v += 1);
        }
        removed
    }

    /// The plugin's registration and health.
    pub fn entry(&self, plugin_id: &str) -> Option<RegistryEntry> {
        let inner = self.inner.locked();
        inner.plugins.get(plugin_id).cloned()
    }

    /// Every registered plugin with its health.
    pub fn entries(&self) -> Vec<RegistryEntry> {
        let inner = self.inner.locked();
        inner.plugins.values().cloned().collect()
    }

    pub fn get(&self, plugin_id: &str) -> Option<PluginRegistration> {
        let inner = self.inner.locked();
        inner.plugins.get(plugin_id).map(|e| e.registration.clone())
    }

    pub fn list(&self) -> Vec<PluginRegistration> {
        let inner = self.inner.locked();
        inner
            .plugins
            .values()
            .map(|e| e.registration.clone())
            .collect()
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

    #[test]
    fn an_old_instance_never_takes_the_plugin_back_from_a_healthy_newer_one() {
        let r = PluginRegistry::new();
        // Restored from the store (newness unknown): any instance replaces it.
        r.register(reg("hostpath", "new"));
        assert!(r.register_instance(reg("hostpath", "old"), 10));
        assert!(r.register_instance(reg("hostpath", "new"), 20));
        let mut rx = r.subscribe();
        rx.borrow_and_update();
        // The old instance, still running while its alloc waits to stop,
        // probes healthy again: it stays out.
        assert!(!r.register_instance(reg("hostpath", "old"), 10));
        assert_eq!(r.get("hostpath").unwrap().alloc_id, "new");
        assert!(!rx.has_changed().unwrap());
        // Unless the newer one is unhealthy: then the old one serves, until
        // the newer one is healthy again.
        assert!(r.mark_unhealthy("hostpath", "new", "task exited"));
        assert!(r.register_instance(reg("hostpath", "old"), 10));
        assert_eq!(r.get("hostpath").unwrap().alloc_id, "old");
        assert!(r.register_instance(reg("hostpath", "new"), 20));
        assert_eq!(r.get("hostpath").unwrap().alloc_id, "new");
        // The same instance registers again whatever its newness.
        assert!(r.register_instance(reg("hostpath", "new"), 20));
        // Once the newer one deregisters, anything may register.
        assert!(r.deregister("hostpath", "new"));
        assert!(r.register_instance(reg("hostpath", "old"), 10));
    }

    #[test]
    fn an_unhealthy_mark_stays_registered_until_the_instance_registers_again() {
        let r = PluginRegistry::new();
        let mut rx = r.subscribe();
        r.register(reg("hostpath", "a1"));
        rx.borrow_and_update();
        // Another instance's supervisor cannot mark this one.
        assert!(!r.mark_unhealthy("hostpath", "a0", "task exited"));
        assert!(!rx.has_changed().unwrap());

        assert!(r.mark_unhealthy("hostpath", "a1", "task exited"));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        let entry = r.entry("hostpath").expect("still registered");
        assert_eq!(entry.registration, reg("hostpath", "a1"));
        assert_eq!(entry.unhealthy.as_deref(), Some("task exited"));
        assert_eq!(r.entries(), vec![entry]);
        // The same mark again changes nothing.
        assert!(!r.mark_unhealthy("hostpath", "a1", "task exited"));
        assert!(!rx.has_changed().unwrap());

        // Registering the same instance again (healthy) is a change.
        r.register(reg("hostpath", "a1"));
        assert!(rx.has_changed().unwrap());
        assert_eq!(r.entry("hostpath").unwrap().unhealthy, None);

        assert!(r.mark_unhealthy("hostpath", "a1", "probe failed"));
        assert!(r.deregister("hostpath", "a1"));
        r.register(reg("hostpath", "a2"));
        assert_eq!(r.entry("hostpath").unwrap().unhealthy, None);
    }
}
