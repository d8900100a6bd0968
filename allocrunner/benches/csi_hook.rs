//! What berth's CSI volume path costs over the bare CSI calls it makes,
//! against one real `hostpath-plugin` process on a unix socket, in one run.
//!
//! Each round, for a fresh alloc with one volume, in turn:
//! - hook: the CSI hook's prerun (claim from an in-process claimer, then
//!   `CsiManager::mount_volume`) and its postrun (unmount, release);
//! - manager: `CsiManager::mount_volume`, then `unmount_volume`;
//! - bare: `NodeStageVolume` + `NodePublishVolume`, then
//!   `NodeUnpublishVolume` + `NodeUnstageVolume`, from a CSI client.
//!
//! The volume usage records go where the agent keeps them: a redb database
//! file, every write a durable transaction (`--store redb`, the default);
//! `--store file` writes a file per record (`fsync`, rename, `fsync` of the
//! directory); `--store mem` keeps them in memory, which shows what the
//! durable writes cost.
//! Prints the median and p99 of each and the ratios to the bare calls; the
//! target is at most 1.2x the bare calls, or 2 ms more, whichever is larger.
//!
//!     cargo build -p hostpath-plugin
//!     cargo bench -p berth-allocrunner --bench csi_hook [-- --rounds 300] [--store redb|file|mem]

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use berth_sync::Shutdown;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_allocrunner::alloc_hooks::{AllocHook, AllocHookContext, CsiHook};
use berth_allocrunner::{
    AllocRunnerConfig, AllocStateUpdater, ClaimError, ClaimGrant, ClaimRequest, VolumeClaimer,
};
use berth_csimanager::volume_manager::volume_capability;
use berth_csimanager::StoreError;
use berth_csimanager::{
    CsiClient, CsiManager, FingerprintSink, ManagerConfig, MountRequest, NodeEventSink,
    PluginRegistration, PluginRegistry, UnmountRequest, VolumeStateStore, VolumeStub,
};
use berth_proto::csi::v1 as csi;
use berth_structs::{
    AccessMode, AllocClientStatus, Allocation, AttachmentMode, CsiInfo, CsiMountOptions,
    CsiPluginType, Job, NodeEvent, TaskGroup, TaskState, VolumeRequest,
};

const PLUGIN_ID: &str = "hostpath";
const VOLUME: &str = "data";
const ACCESS: AccessMode = AccessMode::SingleNodeWriter;
const ATTACH: AttachmentMode = AttachmentMode::FileSystem;

// ------------------------------------------------------------ what berth needs

/// Every write durable before it returns: temp file, fsync, rename, fsync
/// of the directory.
struct SyncedStore {
    dir: PathBuf,
}

impl SyncedStore {
    fn write(&self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let path = self.dir.join(name);
        let tmp = self.dir.join(format!("{name}.tmp"));
        let mut f = std::fs::File::create(&tmp).map_err(StoreError::new)?;
        f.write_all(bytes).map_err(StoreError::new)?;
        f.sync_all().map_err(StoreError::new)?;
        std::fs::rename(&tmp, &path).map_err(StoreError::new)?;
        self.sync_dir()
    }

    fn sync_dir(&self) -> Result<(), StoreError> {
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(StoreError::new)
    }

    fn file_name(key: &str) -> String {
        key.replace('/', "%")
    }
}

impl VolumeStateStore for SyncedStore {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, StoreError> {
        Ok(Vec::new())
    }
    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(plugins).map_err(StoreError::new)?;
        self.write("plugins", &bytes)
    }
    fn load_volumes(&self) -> Result<Vec<VolumeStub>, StoreError> {
        Ok(Vec::new())
    }
    fn put_volume(&self, stub: &VolumeStub) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(stub).map_err(StoreError::new)?;
        self.write(&Self::file_name(&stub.key()), &bytes)
    }
    fn delete_volume(&self, key: &str) -> Result<(), StoreError> {
        match std::fs::remove_file(self.dir.join(Self::file_name(key))) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::new(e)),
        }
    }
}

/// The agent's kind of store: a redb table, each write a durable commit.
struct RedbStore {
    db: redb::Database,
}

const VOLUMES: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("csi_volumes");
const PLUGINS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("csi_plugins");

impl RedbStore {
    fn write(
        &self,
        table: redb::TableDefinition<&str, &[u8]>,
        key: &str,
        value: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(StoreError::new)?;
        {
            let mut t = txn.open_table(table).map_err(StoreError::new)?;
            match value {
                Some(v) => {
                    t.insert(key, v).map_err(StoreError::new)?;
                }
                None => {
                    t.remove(key).map_err(StoreError::new)?;
                }
            }
        }
        txn.commit().map_err(StoreError::new)
    }
}

impl VolumeStateStore for RedbStore {
    fn load_plugins(&self) -> Result<Vec<PluginRegistration>, StoreError> {
        Ok(Vec::new())
    }
    fn save_plugins(&self, plugins: &[PluginRegistration]) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(plugins).map_err(StoreError::new)?;
        self.write(PLUGINS, "all", Some(&bytes))
    }
    fn load_volumes(&self) -> Result<Vec<VolumeStub>, StoreError> {
        Ok(Vec::new())
    }
    fn put_volume(&self, stub: &VolumeStub) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(stub).map_err(StoreError::new)?;
        self.write(VOLUMES, &stub.key(), Some(&bytes))
    }
    fn delete_volume(&self, key: &str) -> Result<(), StoreError> {
        self.write(VOLUMES, key, None)
    }
}

use berth_csimanager::testing::MemStore;

struct Discard;

impl NodeEventSink for Discard {
    fn emit(&self, _: NodeEvent) {}
}

#[async_trait::async_trait]
impl FingerprintSink for Discard {
    async fn update_plugins(&self, _: BTreeMap<String, CsiInfo>, _: BTreeMap<String, CsiInfo>) {}
}

impl AllocStateUpdater for Discard {
    fn alloc_updated(
        &self,
        _: &str,
        _: AllocClientStatus,
        _: &str,
        _: &BTreeMap<String, TaskState>,
        _: bool,
    ) {
    }
}

/// Grants every claim at once: the servers' share is not measured.
struct Granting {
    external_id: String,
}

#[async_trait::async_trait]
impl VolumeClaimer for Granting {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimGrant, ClaimError> {
        Ok(ClaimGrant {
            volume_id: req.volume_id,
            external_id: self.external_id.clone(),
            plugin_id: PLUGIN_ID.into(),
            secrets: BTreeMap::from([("token".to_string(), "s3cr3t".to_string())]),
            ..ClaimGrant::default()
        })
    }
    async fn unpublish(&self, _: &str, _: &str) -> Result<(), ClaimError> {
        Ok(())
    }
}

// ------------------------------------------------------------ the plugin

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_plugin(dir: &Path) -> (Plugin, PathBuf) {
    let socket = dir.join("csi.sock");
    let child = Command::new(berth_testutil::hostpath_plugin_binary())
        .arg(format!("--endpoint=unix://{}", socket.display()))
        .arg("--node-id=bench-node")
        .arg("--state-dir")
        .arg(dir.join("plugin-state"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start hostpath-plugin (cargo build -p hostpath-plugin first)");
    let mut plugin = Plugin(child);
    // Generous: CI runs this on a busy machine.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        if let Ok(Some(status)) = plugin.0.try_wait() {
            panic!("hostpath-plugin exited before it listened ({status})");
        }
        assert!(
            Instant::now() < deadline,
            "the plugin socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (plugin, socket)
}

// ------------------------------------------------------------ measuring

#[derive(Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn median(&self) -> Duration {
        self.percentile(0.5)
    }
    fn p99(&self) -> Duration {
        self.percentile(0.99)
    }
    fn percentile(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
        v.get(idx).copied().unwrap_or_default()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn report(name: &str, berth: &Samples, bare: &Samples) -> bool {
    let (m, b) = (berth.median(), bare.median());
    let ratio = m.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let allowed = (b.mul_f64(1.2)).max(b + Duration::from_millis(2));
    let ok = m <= allowed;
    println!(
        "{name:<26} median {:>7.3} ms  p99 {:>7.3} ms  | bare median {:>7.3} ms  p99 {:>7.3} ms  | {ratio:.2}x  (+{:.3} ms)  {}",
        ms(m),
        ms(berth.p99()),
        ms(b),
        ms(bare.p99()),
        ms(m.saturating_sub(b)),
        if ok { "within target" } else { "OVER TARGET" }
    );
    ok
}

fn alloc_with_volume(alloc_id: &str) -> Allocation {
    let group = TaskGroup {
        name: "g".into(),
        count: 1,
        volumes: BTreeMap::from([(
            VOLUME.to_string(),
            VolumeRequest {
                name: VOLUME.into(),
                volume_type: "csi".into(),
                source: VOLUME.into(),
                access_mode: Some(ACCESS),
                attachment_mode: Some(ATTACH),
                ..VolumeRequest::default()
            },
        )]),
        ..TaskGroup::default()
    };
    Allocation {
        id: alloc_id.into(),
        name: "bench.g[0]".into(),
        job_id: "bench".into(),
        job: Job {
            id: "bench".into(),
            name: "bench".into(),
            task_groups: vec![group],
            ..Job::default()
        }
        .into(),
        task_group: "g".into(),
        node_id: "bench-node".into(),
        ..Allocation::default()
    }
}

fn main() {
    let mut rounds = 200usize;
    let mut store = "redb".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n > 0)
                    .expect("--rounds needs a positive number")
            }
            "--store" => {
                store = args.next().unwrap_or_default();
                if !["redb", "file", "mem"].contains(&store.as_str()) {
                    panic!("--store redb|file|mem, not {store:?}");
                }
            }
            // What `cargo bench` passes to every bench target.
            "--bench" => {}
            other => panic!("unknown argument {other:?} (want --rounds N, --store redb|file|mem)"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(run(rounds, &store));
}

async fn run(rounds: usize, store_kind: &str) {
    let dir = tempfile::Builder::new()
        .prefix("csi-hook-bench")
        .tempdir()
        .expect("temp dir");
    let root = dir.path().canonicalize().expect("temp dir path");
    let _mounts = berth_testutil::MountCleanup(root.clone());
    let (_plugin, socket) = start_plugin(&root);
    let csi = manager(&root, &socket, store_kind).await;
    let bare = CsiClient::connect(PLUGIN_ID, &socket, Duration::from_secs(10)).expect("client");
    let external_id = create_volume(&bare).await;
    let config = Arc::new(AllocRunnerConfig::new(
        root.join("alloc"),
        root.join("client/csi/plugins"),
        "bench-node".into(),
        csi.clone(),
        Arc::new(Granting {
            external_id: external_id.clone(),
        }),
        Arc::new(Discard),
    ));

    let (mut hook_mount, mut hook_unmount) = (Samples::default(), Samples::default());
    let (mut mgr_mount, mut mgr_unmount) = (Samples::default(), Samples::default());
    let (mut bare_mount, mut bare_unmount) = (Samples::default(), Samples::default());
    let (_stop_tx, stop_rx) = Shutdown::channel();
    let bare_dir = root.join("bare");

    for round in 0..rounds {
        // The CSI hook, as the alloc runner drives it.
        let ctx = AllocHookContext::new(
            config.clone(),
            Arc::new(alloc_with_volume(&format!("hook-{round}"))),
            stop_rx.clone(),
            false,
        );
        let mut hook = CsiHook::default();
        let t = Instant::now();
        hook.prerun(&ctx).await.expect("hook prerun");
        hook_mount.0.push(t.elapsed());
        let t = Instant::now();
        hook.postrun(&ctx).await.expect("hook postrun");
        hook_unmount.0.push(t.elapsed());

        // CsiManager alone.
        let req = MountRequest {
            plugin_id: PLUGIN_ID.into(),
            volume_id: VOLUME.into(),
            external_id: external_id.clone(),
            alloc_id: format!("mgr-{round}"),
            access_mode: ACCESS,
            attachment_mode: ATTACH,
            read_only: false,
            mount_options: CsiMountOptions::default(),
            publish_context: BTreeMap::new(),
            volume_context: BTreeMap::new(),
            secrets: BTreeMap::from([("token".to_string(), "s3cr3t".to_string())]),
        };
        let unmount = UnmountRequest::from(&req);
        let t = Instant::now();
        csi.mount_volume(req).await.expect("mount_volume");
        mgr_mount.0.push(t.elapsed());
        let t = Instant::now();
        csi.unmount_volume(unmount).await.expect("unmount_volume");
        mgr_unmount.0.push(t.elapsed());

        let (mount, unmount) = bare_round(&bare, &external_id, &bare_dir, round).await;
        bare_mount.0.push(mount);
        bare_unmount.0.push(unmount);
    }

    println!(
        "CSI hook benchmark: {rounds} rounds, one volume per alloc, store {}",
        match store_kind {
            "redb" => "redb (a durable commit per write)",
            "file" => "files (fsync per write)",
            _ => "in memory",
        }
    );
    let mut ok = true;
    ok &= report("hook prerun (mount)", &hook_mount, &bare_mount);
    ok &= report("manager mount_volume", &mgr_mount, &bare_mount);
    ok &= report("hook postrun (unmount)", &hook_unmount, &bare_unmount);
    ok &= report("manager unmount_volume", &mgr_unmount, &bare_unmount);
    println!(
        "target: at most 1.2x the bare calls or +2 ms, whichever is larger: {}",
        if ok { "met" } else { "NOT met" }
    );
}

/// A CsiManager on `store_kind`'s store that knows the plugin at `socket`.
async fn manager(root: &Path, socket: &Path, store_kind: &str) -> Arc<CsiManager> {
    let state = root.join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let store: Arc<dyn VolumeStateStore> = match store_kind {
        "redb" => Arc::new(RedbStore {
            db: redb::Database::create(state.join("client.db")).expect("redb database"),
        }),
        "file" => Arc::new(SyncedStore { dir: state }),
        _ => Arc::new(MemStore::default()),
    };
    let registry = PluginRegistry::new();
    registry.register(PluginRegistration {
        plugin_id: PLUGIN_ID.into(),
        plugin_type: CsiPluginType::Monolith,
        socket_path: socket.to_path_buf(),
        alloc_id: "plugin-alloc".into(),
        task: "plugin".into(),
        mount_root: PathBuf::new(),
        provider: String::new(),
        version: String::new(),
    });
    let csi = CsiManager::new(
        ManagerConfig {
            root_dir: root.join("client/csi"),
            node_id: "bench-node".into(),
            call_timeout: Duration::from_secs(10),
            fingerprint_interval: Duration::from_secs(30),
        },
        registry,
        store,
        Arc::new(Discard),
        Arc::new(Discard),
    )
    .expect("CsiManager::new");
    csi.refresh_fingerprints().await;
    csi
}

/// Creates the bench's volume through the plugin; its external ID.
async fn create_volume(bare: &CsiClient) -> String {
    bare.create_volume(csi::CreateVolumeRequest {
        name: VOLUME.into(),
        volume_capabilities: vec![volume_capability(
            ACCESS,
            ATTACH,
            &CsiMountOptions::default(),
        )],
        ..Default::default()
    })
    .await
    .expect("CreateVolume")
    .volume
    .expect("a volume")
    .volume_id
}

/// The bare CSI calls of one round, to paths made the same way berth makes
/// them: how long the mount (stage, publish) and the unmount took.
async fn bare_round(
    bare: &CsiClient,
    external_id: &str,
    bare_dir: &Path,
    round: usize,
) -> (Duration, Duration) {
    let capability = volume_capability(ACCESS, ATTACH, &CsiMountOptions::default());
    let secrets = std::collections::HashMap::from([("token".to_string(), "s3cr3t".to_string())]);
    let staging = bare_dir.join(format!("staging-{round}"));
    let target = bare_dir.join(format!("target-{round}"));
    let t = Instant::now();
    std::fs::create_dir_all(&staging).expect("staging dir");
    bare.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: external_id.to_string(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(capability.clone()),
        secrets: secrets.clone(),
        ..Default::default()
    })
    .await
    .expect("NodeStageVolume");
    std::fs::create_dir_all(&target).expect("target dir");
    bare.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: external_id.to_string(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(capability),
        secrets,
        ..Default::default()
    })
    .await
    .expect("NodePublishVolume");
    let mount = t.elapsed();
    let t = Instant::now();
    bare.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: external_id.to_string(),
        target_path: target.display().to_string(),
    })
    .await
    .expect("NodeUnpublishVolume");
    bare.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: external_id.to_string(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .expect("NodeUnstageVolume");
    let _ = std::fs::remove_dir(&target);
    let _ = std::fs::remove_dir(&staging);
    (mount, t.elapsed())
}
