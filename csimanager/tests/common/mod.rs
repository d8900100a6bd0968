//! Shared test fixtures: an in-memory state store, event and fingerprint
//! recorders, the real `hostpath-plugin` process, and a guard that removes
//! every mount a test made below its temp dir, also when the test fails.

#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses its own share
pub use berth_testutil::{
    hostpath_plugin_binary, mount_count_at, mounts_under, wait_for, MountCleanup,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_csimanager::{
    CsiClient, CsiManager, FingerprintSink, ManagerConfig, MountRequest, PluginRegistration,
    PluginRegistry, RetryPolicy, UnmountRequest,
};
use berth_proto::csi::v1 as csi;
use berth_structs::{AccessMode, AttachmentMode, CsiInfo, CsiMountOptions, CsiPluginType};

// ---------------------------------------------------------------- store

pub use berth_csimanager::testing::{EventLog, MemStore};

pub type PluginMaps = (BTreeMap<String, CsiInfo>, BTreeMap<String, CsiInfo>);

#[derive(Default)]
pub struct FingerprintLog(Mutex<Vec<PluginMaps>>);

impl FingerprintLog {
    pub fn updates(&self) -> Vec<PluginMaps> {
        self.0.lock().unwrap().clone()
    }
    pub fn last(&self) -> Option<PluginMaps> {
        self.0.lock().unwrap().last().cloned()
    }
}

#[async_trait::async_trait]
impl FingerprintSink for FingerprintLog {
    async fn update_plugins(
        &self,
        node_plugins: BTreeMap<String, CsiInfo>,
        controller_plugins: BTreeMap<String, CsiInfo>,
    ) {
        self.0
            .lock()
            .unwrap()
            .push((node_plugins, controller_plugins));
    }
}

// ---------------------------------------------------------------- polling

// ---------------------------------------------------------------- mounts

// ---------------------------------------------------------------- plugin

/// A running `hostpath-plugin`; killed on drop.
pub struct PluginProcess {
    child: Child,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
}

impl PluginProcess {
    /// Starts the plugin in `dir` and waits for its socket.
    pub async fn start(dir: &Path, extra_args: &[&str]) -> PluginProcess {
        let socket = dir.join("csi.sock");
        let state_dir = dir.join("plugin-state");
        let child = Command::new(hostpath_plugin_binary())
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--node-id", "node-1", "--state-dir"])
            .arg(&state_dir)
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start hostpath-plugin");
        let mut p = PluginProcess {
            child,
            socket,
            state_dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        // Listening, not just bound: the socket file appears at bind(),
        // and a dial before listen() is refused.
        while std::os::unix::net::UnixStream::connect(&p.socket).is_err() {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("hostpath-plugin exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "hostpath-plugin never listened on its socket"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        p
    }

    /// The plugin's process ID, to pause (SIGSTOP) and resume it.
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A process paused with SIGSTOP until this is dropped (SIGCONT), also
/// when the test fails.
pub struct Paused(nix::unistd::Pid);

impl Paused {
    pub fn new(pid: nix::unistd::Pid) -> Paused {
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}

// ---------------------------------------------------------------- harness

pub const PLUGIN_ID: &str = "hostpath";
pub const PLUGIN_ALLOC: &str = "plugin-alloc-1";

pub fn registration(socket: &Path, plugin_type: CsiPluginType) -> PluginRegistration {
    PluginRegistration {
        plugin_id: PLUGIN_ID.into(),
        plugin_type,
        socket_path: socket.to_path_buf(),
        alloc_id: PLUGIN_ALLOC.into(),
        task: "plugin".into(),
        mount_root: PathBuf::new(),
        provider: String::new(),
        version: String::new(),
    }
}

/// Quick retries, so tests that exhaust them stay short.
pub fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        min_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(100),
        max_retries: 4,
        max_total_delay: Duration::from_secs(2),
    }
}

/// A plugin, a manager for it, and everything recorded. Fields drop in
/// order: the plugin stops, mounts are cleaned, then the temp dir goes.
pub struct Harness {
    pub plugin: PluginProcess,
    pub manager: Arc<CsiManager>,
    pub registry: PluginRegistry,
    pub store: Arc<MemStore>,
    pub events: Arc<EventLog>,
    pub fingerprints: Arc<FingerprintLog>,
    pub root: PathBuf,
    pub call_timeout: Duration,
    _mounts: MountCleanup,
    pub dir: tempfile::TempDir,
}

impl Harness {
    pub async fn start(plugin_args: &[&str]) -> Harness {
        Self::start_with(plugin_args, Duration::from_secs(5)).await
    }

    pub async fn start_with(plugin_args: &[&str], call_timeout: Duration) -> Harness {
        let dir = tempfile::tempdir().expect("temp dir");
        let mounts = MountCleanup(dir.path().to_path_buf());
        let plugin = PluginProcess::start(dir.path(), plugin_args).await;
        let root = dir.path().join("csi");
        let store = Arc::new(MemStore::default());
        let events = Arc::new(EventLog::default());
        let fingerprints = Arc::new(FingerprintLog::default());
        let registry = PluginRegistry::new();
        registry.register(registration(&plugin.socket, CsiPluginType::Monolith));
        let manager = new_manager(
            &root,
            call_timeout,
            registry.clone(),
            &store,
            &events,
            &fingerprints,
        );
        Harness {
            plugin,
            manager,
            registry,
            store,
            events,
            fingerprints,
            root,
            call_timeout,
            _mounts: mounts,
            dir,
        }
    }

    /// A new manager over the same store, as after an agent restart: the
    /// registry starts empty and is restored from the store.
    pub fn restart(&mut self) {
        self.registry = PluginRegistry::new();
        self.events = Arc::new(EventLog::default());
        self.manager = new_manager(
            &self.root,
            self.call_timeout,
            self.registry.clone(),
            &self.store,
            &self.events,
            &self.fingerprints,
        );
    }

    /// Stops the plugin and starts it again, same socket and state dir.
    pub async fn restart_plugin(&mut self, plugin_args: &[&str]) {
        self.plugin.kill();
        let _ = std::fs::remove_file(&self.plugin.socket);
        self.plugin = PluginProcess::start(self.dir.path(), plugin_args).await;
    }

    pub fn client(&self) -> CsiClient {
        CsiClient::connect(PLUGIN_ID, &self.plugin.socket, Duration::from_secs(5)).unwrap()
    }

    /// Creates a volume through the plugin's controller; its external ID.
    pub async fn create_volume(&self, name: &str) -> String {
        let resp = self
            .client()
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                volume_capabilities: vec![berth_csimanager::volume_manager::volume_capability(
                    AccessMode::MultiNodeMultiWriter,
                    AttachmentMode::FileSystem,
                    &CsiMountOptions::default(),
                )],
                ..Default::default()
            })
            .await
            .expect("CreateVolume");
        resp.volume.expect("volume").volume_id
    }

    pub fn backing_dir(&self, external_id: &str) -> PathBuf {
        self.plugin.state_dir.join("volumes").join(external_id)
    }
}

pub fn new_manager(
    root: &Path,
    call_timeout: Duration,
    registry: PluginRegistry,
    store: &Arc<MemStore>,
    events: &Arc<EventLog>,
    fingerprints: &Arc<FingerprintLog>,
) -> Arc<CsiManager> {
    let manager = CsiManager::new(
        ManagerConfig {
            root_dir: root.to_path_buf(),
            node_id: "node-1".into(),
            call_timeout,
            fingerprint_interval: Duration::from_millis(200),
        },
        registry,
        store.clone(),
        events.clone(),
        fingerprints.clone(),
    )
    .expect("CsiManager::new");
    manager.set_retry_policy(fast_retry());
    manager
}

pub fn mount_req(volume_id: &str, external_id: &str, alloc_id: &str) -> MountRequest {
    MountRequest {
        plugin_id: PLUGIN_ID.into(),
        volume_id: volume_id.into(),
        external_id: external_id.into(),
        alloc_id: alloc_id.into(),
        access_mode: AccessMode::MultiNodeMultiWriter,
        attachment_mode: AttachmentMode::FileSystem,
        read_only: false,
        mount_options: CsiMountOptions::default(),
        publish_context: BTreeMap::new(),
        volume_context: BTreeMap::new(),
        secrets: BTreeMap::from([("token".to_string(), "s3cr3t".to_string())]),
    }
}

pub fn unmount_req(m: &MountRequest) -> UnmountRequest {
    UnmountRequest::from(m)
}
