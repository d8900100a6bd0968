//! How many durable writes a volume's mount and unmount cost: each is a
//! synced write of the agent's state database, on the path every alloc
//! walks. Against the real `hostpath-plugin`.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use berth_csimanager::{
    CsiManager, ManagerConfig, PluginRegistration, PluginRegistry, StoreError, VolumeStateStore,
    VolumeStub,
};
use berth_structs::CsiPluginType;
use common::*;

/// A [`MemStore`] that counts the volume records it writes and deletes.
#[derive(Default)]
struct CountingStore {
    inner: MemStore,
    writes: AtomicUsize,
}

impl CountingStore {
    fn writes(&self) -> usize {
        self.writes.load(Ordering::SeqCst)
    }
}

impl VolumeStateStore for CountingStore {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, StoreError> {
        self.inner.load_plugins()
    }
    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), StoreError> {
        self.inner.save_plugins(plugins)
    }
    fn load_volumes(&self) -> Result<Vec<VolumeStub>, StoreError> {
        self.inner.load_volumes()
    }
    fn put_volume(&self, stub: &VolumeStub) -> Result<(), StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.put_volume(stub)
    }
    fn delete_volume(&self, key: &str) -> Result<(), StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.delete_volume(key)
    }
}

#[tokio::test]
async fn a_mount_writes_its_record_once_and_the_last_unmount_marks_then_removes_it() {
    let h = Harness::start(&[]).await;
    let store = Arc::new(CountingStore::default());
    let registry = PluginRegistry::new();
    registry.register(registration(&h.plugin.socket, CsiPluginType::Monolith));
    let manager = CsiManager::new(
        ManagerConfig {
            root_dir: h.root.clone(),
            node_id: "node-1".into(),
            call_timeout: Duration::from_secs(5),
            fingerprint_interval: Duration::from_secs(30),
        },
        registry,
        store.clone(),
        h.events.clone(),
        h.fingerprints.clone(),
    )
    .expect("CsiManager::new");
    manager.refresh_fingerprints().await;
    let ext = h.create_volume("data").await;

    let one = mount_req("data", &ext, "alloc-1");
    let two = mount_req("data", &ext, "alloc-2");
    manager.mount_volume(one.clone()).await.expect("mount one");
    assert_eq!(store.writes(), 1, "the usage, before the stage");
    manager.mount_volume(two.clone()).await.expect("mount two");
    assert_eq!(store.writes(), 2);

    // Another alloc still uses the volume: its record says one less.
    manager
        .unmount_volume(unmount_req(&one))
        .await
        .expect("unmount one");
    assert_eq!(store.writes(), 3);
    // The last user: unpublish, the usage marked as being unstaged (one
    // write, so that a crash after the plugin's unstage leaves no record
    // that says staged), unstage, and the record goes.
    manager
        .unmount_volume(unmount_req(&two))
        .await
        .expect("unmount two");
    assert_eq!(store.writes(), 5);
    assert!(store.inner.volumes().is_empty());
    assert_eq!(mount_count_at(&manager.staging_path(&one)), 0);
}
