//! The client's configuration: what the agent's flags and files make
//! of a client (see `agent/src/agent/flags.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub data_dir: PathBuf,
    /// `http://HOST:PORT` of each server's agent protocol; the client
    /// dials the first and moves on to the next when one fails.
    pub servers: Vec<String>,
    /// The client dials its servers over mutual TLS (`tls.rpc`).
    pub tls: Option<Arc<dyn crate::servers::ServerTls>>,
    pub node_name: Option<String>,
    /// How often terminal allocs are checked for garbage collection
    /// (Nomad's `gc_interval`).
    pub gc_interval: Duration,
    /// Terminal allocs kept on the node: beyond this many, the oldest are
    /// destroyed (Nomad's `gc_max_allocs`).
    pub gc_max_allocs: usize,
    /// Terminal allocs older than this are destroyed at the next
    /// `gc_interval`, however few there are.
    pub gc_alloc_threshold: Duration,
    /// The datacenter the node is in, as registered (`dc1` by default):
    /// a job runs only in the datacenters it lists.
    pub datacenter: String,
    /// The region the node is in (the agent's `region`, `global` by
    /// default): the servers take only nodes of their own.
    pub region: String,
    /// The node's class and key/value pairs, as registered.
    pub node_class: String,
    pub meta: BTreeMap<String, String>,
    /// What the node keeps for itself: taken off the fingerprinted CPU
    /// (MHz) and memory (MiB) the servers schedule against, and off the
    /// free disk (MiB) it reports.
    pub reserved_cpu: u64,
    pub reserved_memory_mb: u64,
    pub reserved_disk_mb: u64,
    /// The agent's own disconnect tracker stops no alloc sooner than this
    /// after the client starts. It is the fallback for a task whose
    /// executor does not watch the heartbeat lease (one started by an
    /// older agent); an executor that does stops its task at the last
    /// heartbeat + window, whether the agent has just started or not.
    pub disconnect_startup_grace: Duration,
    /// How often the stats and condition of the CSI volumes mounted here
    /// are collected (`client { csi_volume_stats_interval }`).
    pub csi_volume_stats_interval: Duration,
    /// How often CSI plugins are fingerprinted and lost volume mounts of
    /// running allocs are repaired (`-csi-fingerprint-interval`).
    pub csi_fingerprint_interval: Duration,
    /// The deadline of each call to a CSI plugin (`client {
    /// csi_call_timeout }`); a call past it is given up and retried as
    /// its caller retries.
    pub csi_call_timeout: Duration,
    /// The introduction token the node registers with while the servers
    /// do not know it (`client { intro_token }`).
    pub intro_token: Option<berth_structs::secret::ConfigSecret>,
    /// What answers the HTTP requests the servers forward to this node
    /// (the agent's node-local API); without one they are refused.
    pub local_api: Option<crate::calls::LocalApiFactory>,
    /// Whether the node runs `raw_exec` tasks (a task as root, held to
    /// nothing): the agent turns it on only when its config says
    /// `plugin "raw_exec" { config { enabled = true } }`, or with `-dev`.
    /// On here, for clients made in code (tests).
    pub raw_exec_enabled: bool,
    /// The cgroup `exec` tasks' cgroups are made under, in each hierarchy
    /// (`client { cgroup_parent }`, `-cgroup-parent`). The client removes
    /// the cgroups there of allocs it does not know, so two agents on one
    /// host need two parents.
    pub cgroup_parent: String,
    /// The uids and gids `exec` tasks may not run as (`plugin "exec" {
    /// config { denied_host_uids, denied_host_gids } }`; uid 0 unless
    /// set).
    pub exec_denied: berth_allocrunner::users::DeniedIds,
    /// The same of `raw_exec` tasks (none unless set).
    pub raw_exec_denied: berth_allocrunner::users::DeniedIds,
}

impl ClientConfig {
    pub const DEFAULT_GC_INTERVAL: Duration = Duration::from_secs(60);
    pub const DEFAULT_GC_MAX_ALLOCS: usize = 50;
    pub const DEFAULT_GC_ALLOC_THRESHOLD: Duration = Duration::from_secs(60 * 60);
    pub const DEFAULT_CSI_FINGERPRINT_INTERVAL: Duration = Duration::from_secs(30);
    pub const DEFAULT_CSI_CALL_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_DATACENTER: &'static str = "dc1";
    pub const DEFAULT_REGION: &'static str = "global";

    /// The defaults for a client of `servers` (`http://HOST:PORT` each).
    pub fn new(data_dir: PathBuf, servers: Vec<String>) -> ClientConfig {
        ClientConfig {
            data_dir,
            servers,
            tls: None,
            node_name: None,
            gc_interval: Self::DEFAULT_GC_INTERVAL,
            gc_max_allocs: Self::DEFAULT_GC_MAX_ALLOCS,
            gc_alloc_threshold: Self::DEFAULT_GC_ALLOC_THRESHOLD,
            datacenter: Self::DEFAULT_DATACENTER.into(),
            region: Self::DEFAULT_REGION.into(),
            node_class: String::new(),
            meta: BTreeMap::new(),
            reserved_cpu: 0,
            reserved_memory_mb: 0,
            reserved_disk_mb: 0,
            disconnect_startup_grace: berth_heartbeat::DisconnectConfig::default().startup_grace,
            csi_volume_stats_interval: berth_csimanager::stats::DEFAULT_VOLUME_STATS_INTERVAL,
            csi_fingerprint_interval: Self::DEFAULT_CSI_FINGERPRINT_INTERVAL,
            csi_call_timeout: Self::DEFAULT_CSI_CALL_TIMEOUT,
            intro_token: None,
            local_api: None,
            raw_exec_enabled: true,
            cgroup_parent: berth_allocrunner::cgroups::DEFAULT_PARENT.into(),
            exec_denied: berth_allocrunner::users::DeniedIds::not_root(),
            raw_exec_denied: berth_allocrunner::users::DeniedIds::default(),
        }
    }

    /// How the client's drivers are set up.
    pub fn driver_settings(&self) -> berth_allocrunner::config::DriverSettings {
        berth_allocrunner::config::DriverSettings {
            raw_exec_enabled: self.raw_exec_enabled,
            cgroups: self.cgroups(),
            exec_denied: self.exec_denied.clone(),
            raw_exec_denied: self.raw_exec_denied.clone(),
        }
    }

    /// The host's cgroups under [`Self::cgroup_parent`], or why `exec`
    /// tasks cannot run.
    pub fn cgroups(&self) -> Result<berth_allocrunner::cgroups::Cgroups, String> {
        berth_allocrunner::cgroups::Cgroups::detect()?.with_parent(&self.cgroup_parent)
    }
}
