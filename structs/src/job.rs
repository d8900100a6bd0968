//! Jobs, task groups and tasks, and the checks a job passes at submit time.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::csi::{AccessMode, AttachmentMode};
use crate::limits::{
    duration_text, too_large, MAX_COUNT, MAX_DURATION, MAX_PRIORITY, MAX_RESTART_ATTEMPTS,
};
use crate::names::{check_name, quoted};
use crate::ValidationError;

pub use crate::task::*;

/// How the scheduler treats a job.
pub use crate::durations::{humantime_serde_compat, opt_duration};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum JobType {
    /// Long-running; failed allocs are replaced.
    #[default]
    Service,
    /// Runs to completion; allocs that complete are not replaced.
    Batch,
    /// One alloc per eligible node.
    System,
}

impl JobType {
    pub fn as_str(&self) -> &'static str {
        match self {
            JobType::Service => "service",
            JobType::Batch => "batch",
            JobType::System => "system",
        }
    }
}

/// The state of a job as the servers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Accepted, nothing running yet.
    #[default]
    Pending,
    /// At least one alloc is placed and not terminal.
    Running,
    /// Nothing runs, and allocs of the current version failed or were
    /// lost without a replacement yet: the servers replace them after
    /// their reschedule delay, or the reschedule policy allows no more.
    /// What `job run` calls a failed job, the job status calls the same.
    Failed,
    /// Stopped, or done: every alloc finished (a batch job) or was
    /// replaced.
    Dead,
}

/// One version of a job as it was submitted: the servers keep the last
/// few of each job (`job history`, `job revert`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct JobVersion {
    pub job_id: String,
    pub version: u64,
    /// The job as that version stored it.
    pub job: Job,
    /// Unix milliseconds of the submission.
    #[serde(default)]
    pub submit_time_ms: i64,
    /// A deployment of this version succeeded: `auto_revert` goes back to
    /// the newest stable version.
    #[serde(default)]
    pub stable: bool,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

impl JobVersion {
    /// The key a version is stored under: the job's versions sort
    /// together, oldest first.
    pub fn key_of(job_id: &str, version: u64) -> String {
        format!("{job_id}/{version:020}")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Job {
    pub id: String,
    pub name: String,
    #[serde(rename = "type")]
    pub job_type: JobType,
    #[serde(default)]
    pub datacenters: Vec<String>,
    /// The region the job is for; empty: the region of the servers it is
    /// submitted to. The servers refuse a job for another region.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub region: String,
    /// Placement rules (`constraint` blocks): the nodes this may run on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<crate::constraint::Constraint>,
    /// Placement preferences (`affinity` blocks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub affinities: Vec<crate::constraint::Affinity>,
    /// How the allocs spread over a node value (`spread` blocks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spreads: Vec<crate::constraint::Spread>,
    #[serde(default)]
    pub priority: u32,
    /// The job's `reschedule` block, for the groups without their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reschedule: Option<crate::reschedule::ReschedulePolicy>,
    /// The job's `update` block, for the groups without their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<crate::update::UpdateStrategy>,
    pub task_groups: Vec<TaskGroup>,
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// Set by `job stop`.
    #[serde(default)]
    pub stop: bool,
    #[serde(default)]
    pub status: JobStatus,
    /// Bumped each time the job is submitted with a change.
    #[serde(default)]
    pub version: u64,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
    /// Unix milliseconds of the last change the servers stored (a
    /// submission, a stop, a status change); garbage collection counts its
    /// thresholds from it.
    #[serde(default)]
    pub modify_time_ms: i64,
    /// The index of the last submission that changed the job, or of its
    /// stop; status changes do not move it. A submission with
    /// `enforce_index` must name it (Nomad's `JobModifyIndex`).
    #[serde(default)]
    pub job_modify_index: u64,
    /// Set by a purge: the job leaves the state as soon as its allocs are
    /// done and hold no volume claim.
    #[serde(default)]
    pub purge: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TaskGroup {
    pub name: String,
    pub count: u32,
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeRequest>,
    pub tasks: Vec<Task>,
    #[serde(default)]
    pub restart: RestartPolicy,
    /// The `reschedule` block: None takes the job's, or the job type's
    /// defaults (see [`Job::reschedule_policy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reschedule: Option<crate::reschedule::ReschedulePolicy>,
    /// The `update` block: None takes the job's; neither replaces the
    /// allocs of a destructive change all at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<crate::update::UpdateStrategy>,
    /// Stop the group's allocs once the client has been without a successful
    /// heartbeat for this long: the alias of `disconnect {
    /// stop_on_client_after }` (read both through
    /// [`TaskGroup::stop_on_client_after`]).
    #[serde(default, with = "opt_duration")]
    pub stop_after_client_disconnect: Option<Duration>,
    /// The alias of `disconnect { lost_after }`.
    #[serde(default, with = "opt_duration")]
    pub max_client_disconnect: Option<Duration>,
    /// The `disconnect` block; see [`TaskGroup::on_disconnect`].
    #[serde(default)]
    pub disconnect: Option<crate::disconnect::DisconnectPolicy>,
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// Placement rules (`constraint` blocks): the nodes this may run on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<crate::constraint::Constraint>,
    /// Placement preferences (`affinity` blocks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub affinities: Vec<crate::constraint::Affinity>,
    /// How the allocs spread over a node value (`spread` blocks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spreads: Vec<crate::constraint::Spread>,
}

/// A group's request for a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct VolumeRequest {
    /// The name of the request inside the group (the block label).
    pub name: String,
    /// `csi` or `host`; berth supports `csi`.
    #[serde(rename = "type")]
    pub volume_type: String,
    /// The volume ID.
    pub source: String,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub access_mode: Option<AccessMode>,
    #[serde(default)]
    pub attachment_mode: Option<AttachmentMode>,
    /// With `per_alloc`, alloc N claims `<source>[N]`.
    #[serde(default)]
    pub per_alloc: bool,
    #[serde(default)]
    pub mount_options: Option<CsiMountOptions>,
}

impl VolumeRequest {
    /// The volume ID that the alloc with `alloc_index` claims.
    pub fn source_for(&self, alloc_index: u32) -> String {
        if self.per_alloc {
            format!("{}[{}]", self.source, alloc_index)
        } else {
            self.source.clone()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CsiMountOptions {
    #[serde(default)]
    pub fs_type: String,
    #[serde(default)]
    pub mount_flags: Vec<String>,
}

impl CsiMountOptions {
    /// These options laid over `base`: a field set here wins.
    pub fn merged_over(&self, base: &CsiMountOptions) -> CsiMountOptions {
        CsiMountOptions {
            fs_type: if self.fs_type.is_empty() {
                base.fs_type.clone()
            } else {
                self.fs_type.clone()
            },
            mount_flags: if self.mount_flags.is_empty() {
                base.mount_flags.clone()
            } else {
                self.mount_flags.clone()
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    pub attempts: u32,
    #[serde(with = "humantime_serde_compat")]
    pub interval: Duration,
    #[serde(with = "humantime_serde_compat")]
    pub delay: Duration,
    /// `fail` or `delay`.
    pub mode: String,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            attempts: 2,
            interval: Duration::from_secs(30 * 60),
            delay: Duration::from_secs(15),
            mode: "fail".into(),
        }
    }
}

/// The region of an agent, a node or a job that names none.
pub const DEFAULT_REGION: &str = "global";

impl Job {
    /// The checks a job passes before the servers accept it: every name
    /// that becomes a path or a key on a node passes [`check_name`], every
    /// number is within its limit in [`crate::limits`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        let mut errs = Vec::new();
        if let Err(e) = check_name("job ID", &self.id) {
            errs.push(format!("job: {e}"));
        }
        let job = quoted(&self.id);
        if self.priority > MAX_PRIORITY {
            errs.push(format!(
                "job {job}: priority {}",
                too_large(self.priority, MAX_PRIORITY)
            ));
        }
        if self.task_groups.is_empty() {
            errs.push(format!("job {job}: at least one group is required"));
        }
        if !self.region.is_empty() {
            if let Err(e) = check_name("region", &self.region) {
                errs.push(format!("job {job}: {e}"));
            }
        }
        for c in &self.constraints {
            c.validate(&format!("job {job}"), &mut errs);
        }
        if let Some(r) = &self.reschedule {
            r.validate(&format!("job {job}"), &mut errs);
        }
        if let Some(u) = &self.update {
            u.validate(&format!("job {job}"), &mut errs);
        }
        for a in &self.affinities {
            a.validate(&format!("job {job}"), &mut errs);
        }
        for s in &self.spreads {
            s.validate(&format!("job {job}"), &mut errs);
        }
        let mut group_names = std::collections::BTreeSet::new();
        for tg in &self.task_groups {
            if !group_names.insert(&tg.name) {
                errs.push(format!("group {}: defined twice", quoted(&tg.name)));
            }
            tg.validate(self.job_type, &mut errs);
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ValidationError(errs))
        }
    }

    pub fn lookup_group(&self, name: &str) -> Option<&TaskGroup> {
        self.task_groups.iter().find(|g| g.name == name)
    }

    /// The update strategy of `group`: its own block, else the job's.
    pub fn update_strategy<'a>(
        &'a self,
        group: &'a TaskGroup,
    ) -> Option<&'a crate::update::UpdateStrategy> {
        group.update.as_ref().or(self.update.as_ref())
    }

    /// The reschedule policy of `group`: its own block, else the job's,
    /// else the job type's defaults.
    pub fn reschedule_policy(&self, group: &TaskGroup) -> crate::reschedule::ReschedulePolicy {
        group
            .reschedule
            .clone()
            .or_else(|| self.reschedule.clone())
            .unwrap_or_else(|| crate::reschedule::ReschedulePolicy::default_for(self.job_type))
    }
}

/// `{at}: {what} 5y is too large (at most 1year)` when `d` is over
/// [`MAX_DURATION`].
pub(crate) fn check_duration(at: &str, what: &str, d: Duration, errs: &mut Vec<String>) {
    if d > MAX_DURATION {
        errs.push(format!(
            "{at}: {what} {}",
            too_large(duration_text(d), duration_text(MAX_DURATION))
        ));
    }
}

impl TaskGroup {
    fn validate(&self, job_type: JobType, errs: &mut Vec<String>) {
        let g = quoted(&self.name);
        let at = format!("group {g}");
        if let Err(e) = check_name("group name", &self.name) {
            errs.push(format!("{at}: {e}"));
        }
        if self.count > MAX_COUNT {
            errs.push(format!("{at}: count {}", too_large(self.count, MAX_COUNT)));
        }
        if job_type == JobType::System && self.count > 1 {
            errs.push(format!(
                "{at}: system jobs run one alloc per node; count must be 0 or 1"
            ));
        }
        self.restart.validate(&at, errs);
        if let Some(r) = &self.reschedule {
            r.validate(&at, errs);
        }
        if let Some(u) = &self.update {
            u.validate(&at, errs);
        }
        self.validate_disconnect(&at, errs);
        for c in &self.constraints {
            c.validate(&at, errs);
        }
        for a in &self.affinities {
            a.validate(&at, errs);
        }
        for s in &self.spreads {
            s.validate(&at, errs);
        }
        if self.tasks.is_empty() {
            errs.push(format!("{at}: at least one task is required"));
        }
        for (name, v) in &self.volumes {
            v.validate(&g, name, self.count, errs);
        }
        let mut task_names = std::collections::BTreeSet::new();
        for t in &self.tasks {
            if !task_names.insert(&t.name) {
                errs.push(format!("{at}: task {} defined twice", quoted(&t.name)));
            }
            t.validate(self, errs);
        }
    }
}

impl TaskGroup {
    /// The `disconnect` block and its aliases: durations within bounds,
    /// and an alias never beside the block.
    fn validate_disconnect(&self, at: &str, errs: &mut Vec<String>) {
        let aliases = [
            (
                "stop_after_client_disconnect",
                self.stop_after_client_disconnect,
                "stop_on_client_after",
            ),
            (
                "max_client_disconnect",
                self.max_client_disconnect,
                "lost_after",
            ),
        ];
        for (name, value, in_block) in aliases {
            let Some(d) = value else { continue };
            check_duration(at, name, d, errs);
            if self.disconnect.is_some() {
                errs.push(format!(
                    "{at}: {name} is the old name of disconnect {{ {in_block} }}; set it in the disconnect block, not beside it"
                ));
            }
        }
        if let Some(d) = &self.disconnect {
            for (name, value) in [
                ("disconnect lost_after", d.lost_after),
                ("disconnect stop_on_client_after", d.stop_on_client_after),
            ] {
                if let Some(v) = value {
                    check_duration(at, name, v, errs);
                }
            }
        }
    }
}

impl RestartPolicy {
    fn validate(&self, group_at: &str, errs: &mut Vec<String>) {
        let at = format!("{group_at} restart");
        if self.attempts > MAX_RESTART_ATTEMPTS {
            errs.push(format!(
                "{at}: attempts {}",
                too_large(self.attempts, MAX_RESTART_ATTEMPTS)
            ));
        }
        check_duration(&at, "interval", self.interval, errs);
        check_duration(&at, "delay", self.delay, errs);
        if self.mode != "fail" && self.mode != "delay" {
            errs.push(format!(
                "{at}: mode {} is not supported (want fail or delay)",
                quoted(&self.mode)
            ));
        }
    }
}

impl VolumeRequest {
    fn validate(&self, group: &str, name: &str, count: u32, errs: &mut Vec<String>) {
        let at = format!("group {group} volume {}", quoted(name));
        if let Err(e) = check_name("volume name", name) {
            errs.push(format!("{at}: {e}"));
        }
        if self.name != name {
            errs.push(format!(
                "{at}: the request's name {} differs from its key",
                quoted(&self.name)
            ));
        }
        if self.volume_type != "csi" {
            errs.push(format!(
                "{at}: type {} is not supported (berth supports \"csi\")",
                quoted(&self.volume_type)
            ));
            return;
        }
        match check_name("source", &self.source) {
            Err(e) => errs.push(format!("{at}: {e}")),
            // `[N]` adds only allowed characters, so the longest expansion
            // (the last alloc's) passes exactly when every one does.
            Ok(()) if self.per_alloc && count > 0 => {
                if let Err(e) = check_name("per_alloc volume ID", &self.source_for(count - 1)) {
                    errs.push(format!("{at}: {e}"));
                }
            }
            Ok(()) => {}
        }
        match self.access_mode {
            None => errs.push(format!("{at}: CSI volumes need access_mode")),
            Some(mode) => {
                if mode.is_reader_only() && !self.read_only {
                    errs.push(format!(
                        "{at}: access_mode {:?} needs read_only = true",
                        mode.as_str()
                    ));
                }
                if mode.is_single_node() && count > 1 && !self.per_alloc {
                    errs.push(format!(
                        "{at}: access_mode {:?} with count = {count} needs per_alloc = true",
                        mode.as_str()
                    ));
                }
            }
        }
        if self.attachment_mode.is_none() {
            errs.push(format!("{at}: CSI volumes need attachment_mode"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destination_must_stay_inside_task_dir() {
        assert!(check_destination("data").is_ok());
        assert!(check_destination("a/../b").is_ok());
        assert!(check_destination("../x").is_err());
        assert!(check_destination("a/../../x").is_err());
        assert!(check_destination("/etc").is_err());
        assert!(check_destination(".").is_err());
        assert!(check_destination("").is_err());
    }

    #[test]
    fn job_mount_options_lie_over_the_volume_s() {
        let volume = CsiMountOptions {
            fs_type: "ext4".into(),
            mount_flags: vec!["noatime".into(), "nodev".into()],
        };
        // Nothing set in the job: the volume's options.
        assert_eq!(CsiMountOptions::default().merged_over(&volume), volume);
        // fs_type replaces when set; the volume's flags stay.
        let fs_only = CsiMountOptions {
            fs_type: "xfs".into(),
            mount_flags: vec![],
        };
        assert_eq!(
            fs_only.merged_over(&volume),
            CsiMountOptions {
                fs_type: "xfs".into(),
                mount_flags: volume.mount_flags.clone(),
            }
        );
        // Flags given in the job are taken whole, not added to the volume's.
        let flags_only = CsiMountOptions {
            fs_type: String::new(),
            mount_flags: vec!["ro".into()],
        };
        assert_eq!(
            flags_only.merged_over(&volume),
            CsiMountOptions {
                fs_type: "ext4".into(),
                mount_flags: vec!["ro".into()],
            }
        );
    }

    #[test]
    fn propagation_modes_parse_and_default_to_private() {
        for mode in [
            PropagationMode::Private,
            PropagationMode::HostToTask,
            PropagationMode::Bidirectional,
        ] {
            assert_eq!(mode.as_str().parse::<PropagationMode>().unwrap(), mode);
        }
        let err = "rshared".parse::<PropagationMode>().unwrap_err();
        assert!(err.contains("\"rshared\""), "{err}");
        // Records written before the field decode as private.
        let old: VolumeMount = serde_json::from_str(r#"{"volume":"v","destination":"d"}"#).unwrap();
        assert_eq!(old.propagation_mode, PropagationMode::Private);
        let json = serde_json::to_string(&VolumeMount {
            propagation_mode: PropagationMode::HostToTask,
            ..old
        })
        .unwrap();
        assert!(
            json.contains(r#""propagation_mode":"host-to-task""#),
            "{json}"
        );
    }
}
