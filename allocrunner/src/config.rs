//! What every alloc runner on a node shares.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use berth_csimanager::CsiManager;

use crate::cgroups::Cgroups;
use crate::claims::VolumeClaimer;
use crate::driver::{Driver, ExecDriver, ExecutorCommand, RawExecDriver};
use crate::state::{AllocStateStore, AllocStateUpdater, NoopStateStore};
use crate::users::DeniedIds;

/// How a client's drivers are set up (see
/// [`AllocRunnerConfig::drivers_for`]).
#[derive(Debug, Clone)]
pub struct DriverSettings {
    /// Whether `raw_exec` starts tasks.
    pub raw_exec_enabled: bool,
    /// The host's cgroups `exec` tasks run in, or why there are none.
    pub cgroups: Result<Cgroups, String>,
    /// The uids and gids `exec` tasks may not run as.
    pub exec_denied: DeniedIds,
    /// The uids and gids `raw_exec` tasks may not run as.
    pub raw_exec_denied: DeniedIds,
}

/// Shared by all alloc runners of a client. Build it with
/// [`AllocRunnerConfig::new`] and adjust the public fields.
pub struct AllocRunnerConfig {
    /// `<data_dir>/alloc`: each alloc's directory is `<alloc_root>/<alloc_id>`.
    pub alloc_root: PathBuf,
    /// `<data_dir>/client/csi/plugins`: a plugin task's socket is
    /// `<plugin_root>/<plugin_id>/<alloc_id>/csi.sock`.
    pub plugin_root: PathBuf,
    pub node_id: String,
    pub csi: Arc<CsiManager>,
    pub claimer: Arc<dyn VolumeClaimer>,
    pub updater: Arc<dyn AllocStateUpdater>,
    /// Where allocs, their states and task handles are persisted for a
    /// restart; keeps nothing by default.
    pub store: Arc<dyn AllocStateStore>,
    /// Task drivers by name; `raw_exec` by default.
    pub drivers: BTreeMap<String, Arc<dyn Driver>>,
    /// Put before the agent's `PATH` in every task's `PATH`.
    pub extra_path: Option<String>,
    /// Time between SIGTERM and SIGKILL for tasks without `kill_timeout`.
    pub default_kill_timeout: Duration,
    /// How often a healthy plugin task is probed.
    pub plugin_probe_interval: Duration,
    /// Deadline of each probe and `GetPluginInfo` call to a plugin task.
    pub plugin_call_timeout: Duration,
    /// How long the CSI hook keeps retrying a claim the servers call
    /// retryable (e.g. while a previous claim of the volume is freed).
    pub claim_retry_timeout: Duration,
    /// How long the CSI hook keeps retrying an unmount or an unpublish when
    /// the alloc stops.
    pub release_retry_timeout: Duration,
    /// How often a running task's usage is sampled (`exec` tasks).
    pub stats_interval: Duration,
    /// The client's heartbeat lease (see [`crate::lease`]), which the
    /// executors of tasks whose group sets a disconnect window watch;
    /// None: no task is held to it by its executor.
    pub heartbeat_lease: Option<PathBuf>,
}

impl AllocRunnerConfig {
    pub const DEFAULT_KILL_TIMEOUT: Duration = Duration::from_secs(5);

    pub fn new(
        alloc_root: PathBuf,
        plugin_root: PathBuf,
        node_id: String,
        csi: Arc<CsiManager>,
        claimer: Arc<dyn VolumeClaimer>,
        updater: Arc<dyn AllocStateUpdater>,
    ) -> AllocRunnerConfig {
        let drivers = Self::default_drivers();
        AllocRunnerConfig {
            alloc_root,
            plugin_root,
            node_id,
            csi,
            claimer,
            updater,
            store: Arc::new(NoopStateStore),
            drivers,
            extra_path: None,
            default_kill_timeout: Self::DEFAULT_KILL_TIMEOUT,
            plugin_probe_interval: Duration::from_secs(30),
            plugin_call_timeout: Duration::from_secs(10),
            claim_retry_timeout: Duration::from_secs(5 * 60),
            release_retry_timeout: Duration::from_secs(2 * 60),
            stats_interval: Duration::from_secs(1),
            heartbeat_lease: None,
        }
    }

    /// The drivers a client has unless told otherwise: `raw_exec` and
    /// `exec` under this binary's executor.
    pub fn default_drivers() -> BTreeMap<String, Arc<dyn Driver>> {
        let mut drivers: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
        drivers.insert("raw_exec".into(), Arc::new(RawExecDriver::new()));
        drivers.insert(
            "exec".into(),
            Arc::new(ExecDriver::new(RawExecDriver::new())),
        );
        drivers
    }

    /// The drivers of a client set up as `settings` say: `exec` tasks in
    /// its cgroups (or refused, saying why there are none), `raw_exec`
    /// refusing new tasks unless enabled (it still finds and stops the
    /// tasks it started before), each refusing the users it denies.
    pub fn drivers_for(settings: &DriverSettings) -> BTreeMap<String, Arc<dyn Driver>> {
        let mut drivers: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
        let exec = ExecDriver::with_cgroups(RawExecDriver::new(), settings.cgroups.clone())
            .denying(settings.exec_denied.clone());
        drivers.insert("exec".into(), Arc::new(exec));
        let mut raw_exec = RawExecDriver::new().denying(settings.raw_exec_denied.clone());
        if !settings.raw_exec_enabled {
            raw_exec = raw_exec.disabled();
        }
        drivers.insert("raw_exec".into(), Arc::new(raw_exec));
        drivers
    }

    /// Runs `raw_exec` and `exec` tasks under `executor` instead of
    /// `<this binary> executor` (tests point it at a built binary).
    pub fn set_executor(&mut self, executor: ExecutorCommand) {
        self.drivers.insert(
            "raw_exec".into(),
            Arc::new(RawExecDriver::with_executor(executor.clone())),
        );
        self.drivers.insert(
            "exec".into(),
            Arc::new(ExecDriver::new(RawExecDriver::with_executor(executor))),
        );
    }
}
