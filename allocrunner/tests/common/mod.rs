//! Shared fixtures of the alloc runner tests: a recording state updater, a
//! scripted volume claimer, a real CsiManager over in-memory stores, alloc
//! builders, and guards that clean up mounts and processes on failure.

#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses its own share
pub use berth_testutil::{hostpath_plugin_binary, mounts_under, wait_for, MountCleanup};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_allocrunner::{
    AllocRunner, AllocRunnerConfig, AllocStateStore, AllocStateUpdater, ClaimError, ClaimGrant,
    ClaimRequest, ExecutorCommand, PersistedAllocState, RestoredAlloc, StateError,
    TaskHandleRecord, VolumeClaimer,
};
use berth_csimanager::volume_manager::volume_capability;
use berth_csimanager::{CsiManager, FingerprintSink, ManagerConfig, PluginRegistry};
use berth_proto::csi::v1 as csi;
use berth_structs::{
    AccessMode, AllocClientStatus, Allocation, AttachmentMode, CsiInfo, CsiMountOptions,
    CsiPluginType, Job, JobType, RestartPolicy, Task, TaskConfig, TaskCsiPluginConfig, TaskGroup,
    TaskState, TaskStateKind, VolumeMount, VolumeRequest,
};

// ---------------------------------------------------------------- updater

#[derive(Debug, Clone)]
pub struct Update {
    pub status: AllocClientStatus,
    pub description: String,
    pub tasks: BTreeMap<String, TaskState>,
}

#[derive(Default)]
pub struct RecordingUpdater(Mutex<Vec<Update>>);

impl RecordingUpdater {
    pub fn updates(&self) -> Vec<Update> {
        self.0.lock().unwrap().clone()
    }
    pub fn last(&self) -> Option<Update> {
        self.0.lock().unwrap().last().cloned()
    }
    /// The distinct client statuses reported, in order.
    pub fn statuses(&self) -> Vec<AllocClientStatus> {
        let mut out: Vec<AllocClientStatus> = Vec::new();
        for u in self.updates() {
            if out.last() != Some(&u.status) {
                out.push(u.status);
            }
        }
        out
    }
    pub fn events(&self, task: &str) -> Vec<String> {
        self.last()
            .and_then(|u| u.tasks.get(task).cloned())
            .map(|s| s.events.into_iter().map(|e| e.event_type).collect())
            .unwrap_or_default()
    }
}

impl AllocStateUpdater for RecordingUpdater {
    fn alloc_updated(
        &self,
        _alloc_id: &str,
        status: AllocClientStatus,
        description: &str,
        tasks: &BTreeMap<String, TaskState>,
        _status_moved: bool,
    ) {
        self.0.lock().unwrap().push(Update {
            status,
            description: description.to_string(),
            tasks: tasks.clone(),
        });
    }
}

// ---------------------------------------------------------------- claimer

/// Called with `(volume_id, alloc_id)` when an unpublish arrives, before it
/// is answered: tests look at the node's state at that moment.
pub type UnpublishObserver = Box<dyn Fn(&str, &str) + Send + Sync>;

/// Answers claims from a script per volume (then with `default`), and
/// records every claim and unpublish.
#[derive(Default)]
pub struct ScriptedClaimer {
    pub scripts: Mutex<BTreeMap<String, VecDeque<Result<ClaimGrant, ClaimError>>>>,
    pub defaults: Mutex<BTreeMap<String, ClaimGrant>>,
    pub claims: Mutex<Vec<ClaimRequest>>,
    pub unpublishes: Mutex<Vec<(String, String)>>,
    pub on_unpublish: Mutex<Option<UnpublishObserver>>,
}

impl ScriptedClaimer {
    pub fn grant(&self, result: ClaimGrant) {
        self.defaults
            .lock()
            .unwrap()
            .insert(result.volume_id.clone(), result);
    }
    pub fn script(&self, volume_id: &str, answers: Vec<Result<ClaimGrant, ClaimError>>) {
        self.scripts
            .lock()
            .unwrap()
            .insert(volume_id.to_string(), answers.into());
    }
    pub fn claims(&self) -> Vec<ClaimRequest> {
        self.claims.lock().unwrap().clone()
    }
    pub fn unpublishes(&self) -> Vec<(String, String)> {
        self.unpublishes.lock().unwrap().clone()
    }
    /// Runs `f` on every later unpublish, before it is recorded and answered.
    pub fn observe_unpublish(&self, f: impl Fn(&str, &str) + Send + Sync + 'static) {
        *self.on_unpublish.lock().unwrap() = Some(Box::new(f));
    }
}

#[async_trait::async_trait]
impl VolumeClaimer for ScriptedClaimer {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimGrant, ClaimError> {
        self.claims.lock().unwrap().push(req.clone());
        if let Some(next) = self
            .scripts
            .lock()
            .unwrap()
            .get_mut(&req.volume_id)
            .and_then(|q| q.pop_front())
        {
            return next;
        }
        self.defaults
            .lock()
            .unwrap()
            .get(&req.volume_id)
            .cloned()
            .ok_or_else(|| ClaimError::fatal(format!("volume {} not found", req.volume_id)))
    }

    async fn unpublish(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError> {
        if let Some(observe) = self.on_unpublish.lock().unwrap().as_ref() {
            observe(volume_id, alloc_id);
        }
        self.unpublishes
            .lock()
            .unwrap()
            .push((volume_id.to_string(), alloc_id.to_string()));
        Ok(())
    }
}

// ---------------------------------------------------------------- csimanager

pub use berth_csimanager::testing::{EventLog, MemStore};

#[derive(Default)]
pub struct NoFingerprints;

#[async_trait::async_trait]
impl FingerprintSink for NoFingerprints {
    async fn update_plugins(
        &self,
        _node: BTreeMap<String, CsiInfo>,
        _controller: BTreeMap<String, CsiInfo>,
    ) {
    }
}

// ---------------------------------------------------------------- alloc store

/// An in-memory [`AllocStateStore`]; a "restarted agent" reads it back.
#[derive(Default)]
pub struct MemAllocStore {
    allocs: Mutex<BTreeMap<String, RestoredAlloc>>,
    alloc_writes: std::sync::atomic::AtomicUsize,
}

impl MemAllocStore {
    pub fn handle(&self, alloc_id: &str, task: &str) -> Option<TaskHandleRecord> {
        let allocs = self.allocs.lock().unwrap();
        allocs.get(alloc_id)?.handles.get(task).cloned()
    }

    /// Drops the persisted handles of an alloc, as if the agent died
    /// between starting its tasks and persisting their handles.
    pub fn forget_handles(&self, alloc_id: &str) {
        if let Some(r) = self.allocs.lock().unwrap().get_mut(alloc_id) {
            r.handles.clear();
        }
    }

    pub fn contains(&self, alloc_id: &str) -> bool {
        self.allocs.lock().unwrap().contains_key(alloc_id)
    }

    /// How many times an alloc was written.
    pub fn alloc_writes(&self) -> usize {
        self.alloc_writes.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl AllocStateStore for MemAllocStore {
    fn put_alloc(&self, alloc: &Allocation) -> Result<(), StateError> {
        self.alloc_writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut allocs = self.allocs.lock().unwrap();
        allocs
            .entry(alloc.id.clone())
            .and_modify(|r| r.alloc = alloc.clone())
            .or_insert_with(|| RestoredAlloc {
                alloc: alloc.clone(),
                state: None,
                handles: BTreeMap::new(),
            });
        Ok(())
    }

    fn put_alloc_state(
        &self,
        alloc_id: &str,
        state: &PersistedAllocState,
    ) -> Result<(), StateError> {
        if let Some(r) = self.allocs.lock().unwrap().get_mut(alloc_id) {
            r.state = Some(state.clone());
        }
        Ok(())
    }

    fn put_task_handle(
        &self,
        alloc_id: &str,
        task: &str,
        handle: &TaskHandleRecord,
    ) -> Result<(), StateError> {
        if let Some(r) = self.allocs.lock().unwrap().get_mut(alloc_id) {
            r.handles.insert(task.to_string(), handle.clone());
        }
        Ok(())
    }

    fn delete_alloc(&self, alloc_id: &str) -> Result<(), StateError> {
        self.allocs.lock().unwrap().remove(alloc_id);
        Ok(())
    }

    fn load_allocs(&self) -> Result<Vec<RestoredAlloc>, StateError> {
        Ok(self.allocs.lock().unwrap().values().cloned().collect())
    }
}

// ---------------------------------------------------------------- harness

/// A temp data dir, a CsiManager, a claimer and an updater. Drops in field
/// order: mounts are cleaned, processes of the test killed, then the temp
/// dir goes.
pub struct Harness {
    pub config: Arc<AllocRunnerConfig>,
    pub csi: Arc<CsiManager>,
    pub claimer: Arc<ScriptedClaimer>,
    pub updater: Arc<RecordingUpdater>,
    pub store: Arc<MemStore>,
    pub node_events: Arc<EventLog>,
    // Dropped in this order: processes, then mounts, then the dir.
    _processes: berth_testutil::ProcessCleanup,
    _mounts: MountCleanup,
    pub dir: tempfile::TempDir,
}

impl Harness {
    pub fn new() -> Harness {
        Self::with(|_| {})
    }

    pub fn with(adjust: impl FnOnce(&mut AllocRunnerConfig)) -> Harness {
        let dir = tempfile::Builder::new()
            .prefix("ar")
            .tempdir()
            .expect("temp dir");
        let data = dir.path().canonicalize().unwrap();
        let store = Arc::new(MemStore::default());
        let node_events = Arc::new(EventLog::default());
        let csi = CsiManager::new(
            ManagerConfig {
                root_dir: data.join("client/csi"),
                node_id: "node-1".into(),
                call_timeout: Duration::from_secs(5),
                fingerprint_interval: Duration::from_secs(30),
            },
            PluginRegistry::new(),
            store.clone(),
            node_events.clone(),
            Arc::new(NoFingerprints),
        )
        .expect("CsiManager::new");
        let claimer = Arc::new(ScriptedClaimer::default());
        let updater = Arc::new(RecordingUpdater::default());
        let mut config = AllocRunnerConfig::new(
            data.join("alloc"),
            data.join("client/csi/plugins"),
            "node-1".into(),
            csi.clone(),
            claimer.clone(),
            updater.clone(),
        );
        config.set_executor(test_executor());
        config.default_kill_timeout = Duration::from_secs(2);
        config.release_retry_timeout = Duration::from_secs(2);
        adjust(&mut config);
        Harness {
            config: Arc::new(config),
            csi,
            claimer,
            updater,
            store,
            node_events,
            _processes: berth_testutil::ProcessCleanup(data.clone()),
            _mounts: MountCleanup(data),
            dir,
        }
    }

    /// The same config with another store (what a restarted agent has).
    pub fn config_with_store(&self, store: Arc<dyn AllocStateStore>) -> Arc<AllocRunnerConfig> {
        self.config_with(store, self.csi.clone())
    }

    /// A new CsiManager over the same volume store with a fresh registry:
    /// what a restarted agent builds (plugins and volume usage come back
    /// from the store).
    pub fn restarted_csi(&self) -> Arc<CsiManager> {
        CsiManager::new(
            self.csi.config().clone(),
            PluginRegistry::new(),
            self.store.clone(),
            self.node_events.clone(),
            Arc::new(NoFingerprints),
        )
        .expect("CsiManager::new on restart")
    }

    /// The same config with another alloc store and CsiManager.
    pub fn config_with(
        &self,
        store: Arc<dyn AllocStateStore>,
        csi: Arc<CsiManager>,
    ) -> Arc<AllocRunnerConfig> {
        let mut config = AllocRunnerConfig::new(
            self.config.alloc_root.clone(),
            self.config.plugin_root.clone(),
            self.config.node_id.clone(),
            csi,
            self.claimer.clone(),
            self.updater.clone(),
        );
        config.set_executor(test_executor());
        config.default_kill_timeout = self.config.default_kill_timeout;
        config.release_retry_timeout = self.config.release_retry_timeout;
        config.store = store;
        Arc::new(config)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap()
    }

    pub fn runner(&self, alloc: Allocation) -> AllocRunner {
        AllocRunner::new(self.config.clone(), alloc)
    }
}

/// The executor binary this crate builds for its tests.
pub fn test_executor() -> ExecutorCommand {
    ExecutorCommand {
        program: PathBuf::from(env!("CARGO_BIN_EXE_berth-allocrunner-executor")),
        args: Vec::new(),
    }
}

/// What the driver gets to run `script` under `/bin/sh -c` as task "t" of
/// alloc "a", in `dir`: its output in `dir/t.stdout.N` and
/// `dir/t.stderr.N`, its executor's records in `dir/executor`.
pub fn sh_task_spec(dir: &std::path::Path, script: &str) -> berth_allocrunner::TaskSpec {
    berth_allocrunner::TaskSpec {
        alloc_id: "a".into(),
        task: "t".into(),
        command: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        env: [("PATH".to_string(), "/usr/bin:/bin".to_string())].into(),
        task_dir: dir.to_path_buf(),
        stdout_path: dir.join("t.stdout"),
        stderr_path: dir.join("t.stderr"),
        logs: Default::default(),
        executor_dir: dir.join("executor"),
        limits: Default::default(),
        cgroup_procs: Vec::new(),
        isolation: None,
        user: None,
        disconnect: None,
    }
}

/// A runtime of its own, for tests that play an agent that stops (its
/// runtime shut down) and one that starts again.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Waits until `task` of the runner is running.
pub async fn wait_running(runner: &AllocRunner, task: &str, within: Duration) {
    wait_for(&format!("task {task} to run"), within, || {
        runner
            .task_states()
            .get(task)
            .is_some_and(|st| st.state == TaskStateKind::Running)
    })
    .await;
}

/// Waits until a restored runner has reattached to `task` (its persisted
/// state says running from the start, so that alone proves nothing).
pub async fn wait_reattached(runner: &AllocRunner, task: &str, within: Duration) {
    wait_for(&format!("task {task} to be reattached"), within, || {
        runner.task_states().get(task).is_some_and(|st| {
            st.state == TaskStateKind::Running
                && st.events.iter().any(|e| e.event_type == "Reattached")
        })
    })
    .await;
}

/// Waits for the runner to finish, within `within`.
/// Asks the runner's alloc to stop, as the servers do (desired `stop`).
pub fn ask_to_stop(runner: &AllocRunner) {
    let mut a = (*runner.alloc()).clone();
    a.desired_status = berth_structs::AllocDesiredStatus::Stop;
    runner.update(a);
}

pub async fn wait_done(runner: &AllocRunner, within: Duration) {
    tokio::time::timeout(within, runner.wait())
        .await
        .expect("the alloc runner finishes in time");
}

// ---------------------------------------------------------------- allocs

pub fn sh_task(name: &str, script: &str) -> Task {
    Task {
        name: name.into(),
        driver: "raw_exec".into(),
        config: TaskConfig {
            command: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            ..berth_structs::TaskConfig::default()
        },
        ..Task::default()
    }
}

pub fn no_restarts() -> RestartPolicy {
    RestartPolicy {
        attempts: 0,
        interval: Duration::from_secs(60),
        delay: Duration::ZERO,
        mode: "fail".into(),
    }
}

pub fn alloc(job_type: JobType, tasks: Vec<Task>) -> Allocation {
    let group = TaskGroup {
        name: "g".into(),
        count: 1,
        tasks,
        restart: no_restarts(),
        ..TaskGroup::default()
    };
    let id = berth_structs::generate_id();
    Allocation {
        name: "j.g[0]".into(),
        job_id: "j".into(),
        job: Job {
            id: "j".into(),
            name: "j".into(),
            job_type,
            task_groups: vec![group],
            ..Job::default()
        }
        .into(),
        task_group: "g".into(),
        node_id: "node-1".into(),
        id,
        ..Allocation::default()
    }
}

pub fn group_mut(alloc: &mut Allocation) -> &mut TaskGroup {
    &mut std::sync::Arc::make_mut(&mut alloc.job).task_groups[0]
}

/// A service alloc whose one task, `task`, has the CSI volume `volume`
/// (asked for with `mode`, as a file system) bound read-write at `data`
/// in its task dir.
pub fn csi_volume_user(mut task: Task, volume: &str, mode: AccessMode) -> Allocation {
    task.volume_mounts = vec![VolumeMount {
        volume: volume.into(),
        destination: "data".into(),
        read_only: false,
        ..Default::default()
    }];
    let mut a = alloc(JobType::Service, vec![task]);
    group_mut(&mut a).volumes = [(
        volume.to_string(),
        VolumeRequest {
            name: volume.into(),
            volume_type: "csi".into(),
            source: volume.into(),
            access_mode: Some(mode),
            attachment_mode: Some(AttachmentMode::FileSystem),
            ..VolumeRequest::default()
        },
    )]
    .into();
    a
}

// ---------------------------------------------------------------- plugin

/// The id the hostpath plugin registers under in these tests.
pub const PLUGIN_ID: &str = "hostpath";

/// A monolith plugin `PLUGIN_ID` with its socket dir at /csi.
pub fn plugin_config(health_timeout: Duration) -> TaskCsiPluginConfig {
    TaskCsiPluginConfig {
        id: PLUGIN_ID.into(),
        plugin_type: CsiPluginType::Monolith,
        mount_dir: "/csi".into(),
        stage_publish_base_dir: None,
        health_timeout,
    }
}

/// A task "plugin" that runs the hostpath plugin as `PLUGIN_ID` with its
/// volumes in `state_dir` (expanded by the task's shell) and writes its
/// pid to `local/pid` in its task dir (for a `PidFileKiller`).
pub fn hostpath_plugin_task(state_dir: &str) -> Task {
    let script = format!(
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; exec {} --state-dir "{state_dir}" --node-id node-1"#,
        hostpath_plugin_binary().display()
    );
    let mut task = sh_task("plugin", &script);
    task.csi_plugin = Some(plugin_config(Duration::from_secs(20)));
    task
}

/// Runs [`hostpath_plugin_task`] (its volumes in its task dir) in a service
/// alloc until it registers, within `within`; its runner, its state dir
/// and the killer of its process.
pub async fn run_hostpath_plugin(
    h: &Harness,
    within: Duration,
) -> (AllocRunner, PathBuf, PidFileKiller) {
    let task = hostpath_plugin_task("$BERTH_TASK_DIR/local/state");
    let a = alloc(JobType::Service, vec![task]);
    let task_dir = h.data_dir().join("alloc").join(&a.id).join("plugin");
    let killer = PidFileKiller(task_dir.join("local/pid"));
    let runner = h.runner(a);
    runner.run();
    wait_for("the plugin to register", within, || {
        h.csi.registry().get(PLUGIN_ID).is_some()
    })
    .await;
    (runner, task_dir.join("local/state"), killer)
}

/// Creates the volume `name` through the registered plugin for `mode`;
/// its external ID.
pub async fn create_volume(h: &Harness, name: &str, mode: AccessMode) -> String {
    let client = h.csi.client(PLUGIN_ID).await.expect("client");
    client
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            volume_capabilities: vec![volume_capability(
                mode,
                AttachmentMode::FileSystem,
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

/// Creates the volume `name` as [`create_volume`] does and has the
/// claimer grant its claims; its external ID.
pub async fn create_granted_volume(h: &Harness, name: &str, mode: AccessMode) -> String {
    let ext = create_volume(h, name, mode).await;
    h.claimer.grant(ClaimGrant {
        volume_id: name.into(),
        external_id: ext.clone(),
        plugin_id: PLUGIN_ID.into(),
        ..ClaimGrant::default()
    });
    ext
}

// ---------------------------------------------------------------- cleanup

/// Live (non-zombie) processes whose process group is `pgid`.
pub fn live_group_members(pgid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command (which is in parentheses): state ppid pgrp.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let fields: Vec<&str> = rest.split(' ').collect();
        if fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string() {
            out.push(pid);
        }
    }
    out
}

/// Kills a process group on drop, so a failed test leaves no `sleep 1000`.
pub struct GroupKiller(pub Option<i32>);

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Kills, on drop, the process group whose leader wrote its pid to a file
/// (tasks started as `sh -c 'echo $$ > FILE; exec ...'`).
pub struct PidFileKiller(pub PathBuf);

impl Drop for PidFileKiller {
    fn drop(&mut self) {
        let pgid = std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        if let Some(pgid) = pgid {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}
