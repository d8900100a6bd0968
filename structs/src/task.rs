//! Tasks: what runs, with which driver and config, held to which
//! resources, with which volume mounts and logs; and the checks a task
//! passes at submit time (called from its group's).

use std::collections::BTreeMap;
use std::path::{Component, Path};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::csi::AttachmentMode;
use crate::durations::{humantime_serde_compat, opt_duration};
use crate::job::{check_duration, TaskGroup};
use crate::limits::{too_large, MAX_CPU_MHZ, MAX_LOG_FILES, MAX_LOG_FILE_SIZE_MB, MAX_MEMORY_MB};
use crate::names::{check_name, quoted};

/// Drivers this build of berth runs.
pub const SUPPORTED_DRIVERS: &[&str] = &["exec", "raw_exec"];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Task {
    pub name: String,
    pub driver: String,
    #[serde(default)]
    pub config: TaskConfig,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub volume_mounts: Vec<VolumeMount>,
    #[serde(default)]
    pub csi_plugin: Option<TaskCsiPluginConfig>,
    #[serde(default, with = "opt_duration")]
    pub kill_timeout: Option<Duration>,
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// How the task's stdout and stderr files rotate.
    #[serde(default)]
    pub logs: LogConfig,
    /// Placement rules (`constraint` blocks): the nodes this may run on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<crate::constraint::Constraint>,
    /// Placement preferences (`affinity` blocks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub affinities: Vec<crate::constraint::Affinity>,
    /// The user the task runs as (empty: the driver's default, `nobody`
    /// for `exec`, the agent's user for `raw_exec`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub user: String,
}

/// The `logs` block: the task's stdout and stderr each go to numbered
/// files (`<task>.stdout.0`, `.1`, ...) of at most `max_file_size` MiB, of
/// which the newest `max_files` are kept. Nomad's names and defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogConfig {
    pub max_files: u32,
    /// MiB.
    pub max_file_size: u64,
}

impl LogConfig {
    pub const DEFAULT_MAX_FILES: u32 = 10;
    pub const DEFAULT_MAX_FILE_SIZE_MB: u64 = 10;

    /// The size at which a file is closed and the next one opened.
    pub fn max_file_size_bytes(&self) -> u64 {
        self.max_file_size.saturating_mul(1 << 20)
    }

    fn validate(&self, at: &str, errs: &mut Vec<String>) {
        if self.max_files == 0 {
            errs.push(format!("{at}: logs.max_files must be at least 1"));
        } else if self.max_files > MAX_LOG_FILES {
            errs.push(format!(
                "{at}: logs.max_files {}",
                too_large(self.max_files, MAX_LOG_FILES)
            ));
        }
        if self.max_file_size == 0 {
            errs.push(format!("{at}: logs.max_file_size must be at least 1 (MiB)"));
        } else if self.max_file_size > MAX_LOG_FILE_SIZE_MB {
            errs.push(format!(
                "{at}: logs.max_file_size {}",
                too_large(self.max_file_size, format!("{MAX_LOG_FILE_SIZE_MB} MiB"))
            ));
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            max_files: Self::DEFAULT_MAX_FILES,
            max_file_size: Self::DEFAULT_MAX_FILE_SIZE_MB,
        }
    }
}

/// Driver configuration. `raw_exec` reads `command` and `args`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TaskConfig {
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// The most processes an `exec` task may have at once (None: the
    /// client's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_limit: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// MHz.
    pub cpu: u64,
    /// MiB: what placement counts, and the task's limit.
    pub memory_mb: u64,
    /// MiB above `memory_mb` an `exec` task may use while the node has
    /// it (Nomad's oversubscription): its hard limit, `memory_mb` the
    /// soft one. 0: none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_max_mb: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Default for Resources {
    fn default() -> Self {
        Resources {
            cpu: 100,
            memory_mb: 300,
            memory_max_mb: 0,
        }
    }
}

/// The most a task's `pids_limit` may be (the kernel's own ceiling).
pub const MAX_PIDS_LIMIT: u64 = 4_194_304;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct VolumeMount {
    /// The name of a `volume` block of the group.
    pub volume: String,
    /// Relative to the task directory.
    pub destination: String,
    #[serde(default)]
    pub read_only: bool,
    /// How mounts made later on either side of the bind reach the other.
    #[serde(default)]
    pub propagation_mode: PropagationMode,
}

/// `volume_mount { propagation_mode }`: whether mounts made later under the
/// volume's host path show in the task directory, and the other way round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum PropagationMode {
    /// Neither way (`MS_PRIVATE`).
    #[default]
    Private,
    /// Mounts made under the host path show in the task dir (`MS_SLAVE`).
    HostToTask,
    /// Both ways (`MS_SHARED`).
    Bidirectional,
}

impl PropagationMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            PropagationMode::Private => "private",
            PropagationMode::HostToTask => "host-to-task",
            PropagationMode::Bidirectional => "bidirectional",
        }
    }
}

impl std::fmt::Display for PropagationMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PropagationMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "private" => Ok(PropagationMode::Private),
            "host-to-task" => Ok(PropagationMode::HostToTask),
            "bidirectional" => Ok(PropagationMode::Bidirectional),
            other => Err(format!(
                "unknown propagation mode {other:?} (want private, host-to-task or bidirectional)"
            )),
        }
    }
}

/// What a plugin task is: the `csi_plugin` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCsiPluginConfig {
    pub id: String,
    #[serde(rename = "type")]
    pub plugin_type: CsiPluginType,
    /// Where the plugin expects its socket and mounts inside an isolated
    /// task. `raw_exec` tasks share the host's filesystem and see host paths.
    pub mount_dir: String,
    #[serde(default)]
    pub stage_publish_base_dir: Option<String>,
    #[serde(with = "humantime_serde_compat")]
    pub health_timeout: Duration,
}

impl TaskCsiPluginConfig {
    pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(30);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CsiPluginType {
    Node,
    Controller,
    Monolith,
}

impl CsiPluginType {
    pub fn as_str(&self) -> &'static str {
        match self {
            CsiPluginType::Node => "node",
            CsiPluginType::Controller => "controller",
            CsiPluginType::Monolith => "monolith",
        }
    }
    pub fn has_node(&self) -> bool {
        matches!(self, CsiPluginType::Node | CsiPluginType::Monolith)
    }
    pub fn has_controller(&self) -> bool {
        matches!(self, CsiPluginType::Controller | CsiPluginType::Monolith)
    }
}

impl std::str::FromStr for CsiPluginType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "node" => Ok(CsiPluginType::Node),
            "controller" => Ok(CsiPluginType::Controller),
            "monolith" => Ok(CsiPluginType::Monolith),
            other => Err(format!(
                "unknown CSI plugin type {other:?} (want node, controller or monolith)"
            )),
        }
    }
}

/// Task names the alloc dir keeps for itself: `alloc` is the directory the
/// tasks share.
pub const RESERVED_TASK_NAMES: &[&str] = &["alloc"];

impl Task {
    /// The checks of what holds the task: `memory_max` above `memory`, a
    /// `pids_limit` only where the driver enforces it, a user name.
    fn check_limits(&self, at: &str, errs: &mut Vec<String>) {
        let r = &self.resources;
        if r.memory_max_mb != 0 && r.memory_max_mb < r.memory_mb {
            errs.push(format!(
                "{at}: resources.memory_max ({} MiB) must be at least resources.memory ({} MiB)",
                r.memory_max_mb, r.memory_mb
            ));
        }
        if r.memory_max_mb > MAX_MEMORY_MB {
            errs.push(format!(
                "{at}: resources.memory_max {}",
                too_large(r.memory_max_mb, format!("{MAX_MEMORY_MB} MiB"))
            ));
        }
        match self.config.pids_limit {
            Some(_) if self.driver != "exec" => errs.push(format!(
                "{at}: config.pids_limit applies to the exec driver only, not {}",
                quoted(&self.driver)
            )),
            Some(0) => errs.push(format!("{at}: config.pids_limit must be at least 1")),
            Some(n) if n > MAX_PIDS_LIMIT => errs.push(format!(
                "{at}: config.pids_limit {}",
                too_large(n, MAX_PIDS_LIMIT.to_string())
            )),
            _ => {}
        }
        if !self.user.is_empty() && !is_user_name(&self.user) {
            errs.push(format!(
                "{at}: user {} is not a user name or a numeric uid",
                quoted(&self.user)
            ));
        }
    }

    pub(crate) fn validate(&self, group: &TaskGroup, errs: &mut Vec<String>) {
        let at = format!("group {} task {}", quoted(&group.name), quoted(&self.name));
        if let Err(e) = check_name("task name", &self.name) {
            errs.push(format!("{at}: {e}"));
        } else if RESERVED_TASK_NAMES.contains(&self.name.as_str()) {
            errs.push(format!(
                "{at}: task name {} is reserved for the alloc's shared directory",
                quoted(&self.name)
            ));
        }
        if !SUPPORTED_DRIVERS.contains(&self.driver.as_str()) {
            errs.push(format!(
                "{at}: driver {} is not supported (supported: {})",
                quoted(&self.driver),
                SUPPORTED_DRIVERS.join(", ")
            ));
        } else if self.config.command.is_empty() {
            errs.push(format!("{at}: config.command is required"));
        }
        for c in &self.constraints {
            if c.operator.is_distinct() {
                errs.push(format!(
                    "{at}: constraint {c}: {} applies to a job or a group, not a task",
                    c.operator.as_str()
                ));
            } else {
                c.validate(&at, errs);
            }
        }
        for a in &self.affinities {
            a.validate(&at, errs);
        }
        if self.resources.cpu > MAX_CPU_MHZ {
            errs.push(format!(
                "{at}: resources.cpu {}",
                too_large(self.resources.cpu, format!("{MAX_CPU_MHZ} MHz"))
            ));
        }
        if self.resources.memory_mb > MAX_MEMORY_MB {
            errs.push(format!(
                "{at}: resources.memory {}",
                too_large(self.resources.memory_mb, format!("{MAX_MEMORY_MB} MiB"))
            ));
        }
        self.check_limits(&at, errs);
        if let Some(d) = self.kill_timeout {
            check_duration(&at, "kill_timeout", d, errs);
        }
        self.logs.validate(&at, errs);
        for m in &self.volume_mounts {
            match group.volumes.get(&m.volume) {
                None => errs.push(format!(
                    "{at}: volume_mount names volume {}, which the group does not define",
                    quoted(&m.volume)
                )),
                Some(v) => {
                    if v.read_only && !m.read_only {
                        errs.push(format!(
                            "{at}: volume_mount of read-only volume {} needs read_only = true",
                            quoted(&m.volume)
                        ));
                    }
                    // A read-only bind of a device file does not stop writes
                    // to the device: only a read-only claim gives a task a
                    // read-only device.
                    if m.read_only
                        && !v.read_only
                        && v.attachment_mode == Some(AttachmentMode::BlockDevice)
                    {
                        errs.push(format!(
                            "{at}: volume_mount read_only = true of block-device volume {} needs \
                             read_only = true on the group's volume (a read-only bind of a \
                             device does not stop writes to it)",
                            quoted(&m.volume)
                        ));
                    }
                }
            }
            if let Err(e) = check_destination(&m.destination) {
                errs.push(format!(
                    "{at}: volume_mount destination {} {e}",
                    quoted(&m.destination)
                ));
            }
        }
        if let Some(p) = &self.csi_plugin {
            if let Err(e) = check_name("csi_plugin.id", &p.id) {
                errs.push(format!("{at}: {e}"));
            }
            if p.mount_dir.is_empty() {
                errs.push(format!("{at}: csi_plugin.mount_dir is required"));
            } else if let Err(e) = check_plugin_dir(&p.mount_dir) {
                errs.push(format!(
                    "{at}: csi_plugin.mount_dir {} {e}",
                    quoted(&p.mount_dir)
                ));
            }
            if let Some(dir) = &p.stage_publish_base_dir {
                if let Err(e) = check_plugin_dir(dir) {
                    errs.push(format!(
                        "{at}: csi_plugin.stage_publish_base_dir {} {e}",
                        quoted(dir)
                    ));
                }
            }
            check_duration(&at, "csi_plugin.health_timeout", p.health_timeout, errs);
        }
    }
}

/// A plugin's mount directory is where staging and publish paths are made:
/// an absolute path that does not climb with `..`.
fn check_plugin_dir(dir: &str) -> Result<(), &'static str> {
    let p = Path::new(dir);
    if !p.is_absolute() {
        return Err("must be an absolute path");
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err("must not contain \"..\"");
    }
    Ok(())
}

/// A mount destination must stay inside the task directory.
pub fn check_destination(dest: &str) -> Result<(), &'static str> {
    if dest.is_empty() {
        return Err("must not be empty");
    }
    let p = Path::new(dest);
    let mut depth: i64 = 0;
    for c in p.components() {
        match c {
            Component::RootDir | Component::Prefix(_) => {
                return Err("must be relative to the task directory")
            }
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return Err("escapes the task directory");
                }
            }
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
        }
    }
    if depth == 0 {
        return Err("must name a directory inside the task directory");
    }
    Ok(())
}

/// Whether `user` can name a user: a numeric uid, or a name of letters,
/// digits, `_`, `-` and `.` (not starting with `-`), at most 32 long.
pub fn is_user_name(user: &str) -> bool {
    !user.is_empty()
        && user.len() <= 32
        && !user.starts_with('-')
        && user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}
