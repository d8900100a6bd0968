//! The job spec: `job "ID" { group "NAME" { volume ... task "NAME" { ... } } }`.

use std::collections::BTreeMap;

use hcl_edit::structure::{Block, Body};

use super::hcl::{BodyReader, Source};
use super::SpecError;
use crate::constraint::{Affinity, Constraint, Spread, SpreadTarget};
use crate::disconnect::{DisconnectPolicy, ReconcileStrategy};
use crate::job::{
    CsiMountOptions, CsiPluginType, Job, JobType, LogConfig, Resources, RestartPolicy, Task,
    TaskConfig, TaskCsiPluginConfig, TaskGroup, VolumeMount, VolumeRequest, MAX_PIDS_LIMIT,
};
use crate::limits::{
    MAX_COUNT, MAX_CPU_MHZ, MAX_DURATION, MAX_LOG_FILES, MAX_LOG_FILE_SIZE_MB, MAX_MEMORY_MB,
    MAX_PRIORITY, MAX_RESTART_ATTEMPTS,
};
use crate::reschedule::ReschedulePolicy;
use crate::update::UpdateStrategy;

/// Nomad's default job priority.
const DEFAULT_PRIORITY: u32 = 50;

pub(super) fn decode_job(src: &Source<'_>, body: &Body) -> Result<Job, SpecError> {
    // `variable` blocks were read before (see `variables`).
    let file = BodyReader::new(
        src,
        body,
        "the job file".into(),
        1,
        &[],
        &["job", "variable"],
    )?;
    let block = match file.blocks("job").as_slice() {
        [] => return Err(SpecError::at(1, "no job block found")),
        [b] => *b,
        [_, second, ..] => {
            return Err(SpecError::at(
                src.line_of(*second),
                "a job file holds exactly one job block",
            ))
        }
    };
    let (id, r) = BodyReader::labeled(
        src,
        block,
        "the job file",
        "the job ID",
        &["name", "type", "region", "datacenters", "priority", "meta"],
        &[
            "group",
            "meta",
            "constraint",
            "affinity",
            "spread",
            "reschedule",
            "update",
        ],
    )?;

    let job_type = match r.string("type")?.as_deref() {
        None | Some("service") => JobType::Service,
        Some("batch") => JobType::Batch,
        Some("system") => JobType::System,
        Some(other) => {
            return Err(r.invalid(
                "type",
                format!("job type {other:?} is not supported (want service, batch or system)"),
            ))
        }
    };
    let priority = r.u32("priority", MAX_PRIORITY)?.unwrap_or(DEFAULT_PRIORITY);
    if !(1..=100).contains(&priority) {
        return Err(r.invalid("priority", "must be between 1 and 100"));
    }

    let reschedule = r
        .optional_block("reschedule")?
        .map(|b| decode_reschedule(src, b, r.ctx(), &ReschedulePolicy::default_for(job_type)))
        .transpose()?;
    let group_base = reschedule
        .clone()
        .unwrap_or_else(|| ReschedulePolicy::default_for(job_type));
    let update = r
        .optional_block("update")?
        .map(|b| decode_update(src, b, r.ctx(), &UpdateStrategy::default()))
        .transpose()?;
    let update_base = update.clone().unwrap_or_default();

    let mut task_groups: Vec<TaskGroup> = Vec::new();
    for g in r.blocks("group") {
        let line = src.line_of(g);
        let group = decode_group(src, g, r.ctx(), &group_base, &update_base)?;
        if task_groups.iter().any(|other| other.name == group.name) {
            return Err(SpecError::at(
                line,
                format!("group {:?} is defined twice in {}", group.name, r.ctx()),
            ));
        }
        task_groups.push(group);
    }

    Ok(Job {
        name: r.string("name")?.unwrap_or_else(|| id.clone()),
        id,
        job_type,
        datacenters: r.strings("datacenters")?.unwrap_or_default(),
        region: r.string("region")?.unwrap_or_default(),
        priority,
        task_groups,
        meta: r.map("meta")?,
        constraints: decode_constraints(&r)?,
        affinities: decode_affinities(&r)?,
        spreads: decode_spreads(&r)?,
        reschedule,
        update,
        ..Job::default()
    })
}

/// A group; its `reschedule` block's unset fields take `reschedule_base`
/// (the job's block, or the job type's defaults).
fn decode_group(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
    reschedule_base: &ReschedulePolicy,
    update_base: &UpdateStrategy,
) -> Result<TaskGroup, SpecError> {
    let (name, r) = BodyReader::labeled(
        src,
        block,
        parent,
        "the group name",
        &[
            "count",
            "stop_after_client_disconnect",
            "max_client_disconnect",
            "meta",
        ],
        &[
            "restart",
            "volume",
            "task",
            "meta",
            "disconnect",
            "constraint",
            "affinity",
            "spread",
            "reschedule",
            "update",
        ],
    )?;
    let update = r
        .optional_block("update")?
        .map(|b| decode_update(src, b, r.ctx(), update_base))
        .transpose()?;
    let reschedule = r
        .optional_block("reschedule")?
        .map(|b| decode_reschedule(src, b, r.ctx(), reschedule_base))
        .transpose()?;
    let disconnect = match r.optional_block("disconnect")? {
        None => None,
        Some(b) => Some(decode_disconnect(src, b, r.ctx())?),
    };
    for (alias, in_block) in [
        ("stop_after_client_disconnect", "stop_on_client_after"),
        ("max_client_disconnect", "lost_after"),
    ] {
        if disconnect.is_some() && r.duration(alias, MAX_DURATION)?.is_some() {
            return Err(r.invalid(
                alias,
                format!(
                    "{alias} is the old name of disconnect {{ {in_block} }}; set it in the disconnect block, not beside it"
                ),
            ));
        }
    }

    let restart = match r.optional_block("restart")? {
        None => RestartPolicy::default(),
        Some(b) => decode_restart(src, b, r.ctx())?,
    };

    let mut volumes = BTreeMap::new();
    for v in r.blocks("volume") {
        let line = src.line_of(v);
        let request = decode_volume_request(src, v, r.ctx())?;
        let name = request.name.clone();
        if volumes.insert(name.clone(), request).is_some() {
            return Err(SpecError::at(
                line,
                format!("volume {name:?} is defined twice in {}", r.ctx()),
            ));
        }
    }

    let mut tasks: Vec<Task> = Vec::new();
    for t in r.blocks("task") {
        let line = src.line_of(t);
        let task = decode_task(src, t, r.ctx())?;
        if tasks.iter().any(|other| other.name == task.name) {
            return Err(SpecError::at(
                line,
                format!("task {:?} is defined twice in {}", task.name, r.ctx()),
            ));
        }
        tasks.push(task);
    }

    Ok(TaskGroup {
        name,
        count: r.u32("count", MAX_COUNT)?.unwrap_or(1),
        volumes,
        tasks,
        restart,
        stop_after_client_disconnect: r.duration("stop_after_client_disconnect", MAX_DURATION)?,
        max_client_disconnect: r.duration("max_client_disconnect", MAX_DURATION)?,
        disconnect,
        meta: r.map("meta")?,
        constraints: decode_constraints(&r)?,
        affinities: decode_affinities(&r)?,
        spreads: decode_spreads(&r)?,
        reschedule,
        update,
    })
}

/// An `update` block; what it leaves unset is `base`'s.
fn decode_update(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
    base: &UpdateStrategy,
) -> Result<UpdateStrategy, SpecError> {
    let r = BodyReader::unlabeled(
        src,
        block,
        parent,
        &[
            "max_parallel",
            "min_healthy_time",
            "healthy_deadline",
            "progress_deadline",
            "auto_revert",
            "auto_promote",
            "canary",
            "stagger",
            "health_check",
        ],
        &[],
    )?;
    let duration = |name: &str, base: std::time::Duration| {
        r.duration(name, MAX_DURATION).map(|d| d.unwrap_or(base))
    };
    Ok(UpdateStrategy {
        max_parallel: r
            .u32("max_parallel", MAX_COUNT)?
            .unwrap_or(base.max_parallel),
        min_healthy_time: duration("min_healthy_time", base.min_healthy_time)?,
        healthy_deadline: duration("healthy_deadline", base.healthy_deadline)?,
        progress_deadline: duration("progress_deadline", base.progress_deadline)?,
        auto_revert: r.bool("auto_revert")?.unwrap_or(base.auto_revert),
        auto_promote: r.bool("auto_promote")?.unwrap_or(base.auto_promote),
        canary: r.u32("canary", MAX_COUNT)?.unwrap_or(base.canary),
        stagger: duration("stagger", base.stagger)?,
        health_check: r
            .string("health_check")?
            .unwrap_or_else(|| base.health_check.clone()),
    })
}

/// A `reschedule` block; what it leaves unset is `base`'s.
fn decode_reschedule(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
    base: &ReschedulePolicy,
) -> Result<ReschedulePolicy, SpecError> {
    let r = BodyReader::unlabeled(
        src,
        block,
        parent,
        &[
            "attempts",
            "interval",
            "delay",
            "delay_function",
            "max_delay",
            "unlimited",
        ],
        &[],
    )?;
    let attempts = r.u32("attempts", MAX_RESTART_ATTEMPTS)?;
    Ok(ReschedulePolicy {
        // Attempts without `unlimited` mean a limit (Nomad's rule).
        unlimited: r
            .bool("unlimited")?
            .unwrap_or(base.unlimited && attempts.is_none()),
        attempts: attempts.unwrap_or(base.attempts),
        interval: r
            .duration("interval", MAX_DURATION)?
            .unwrap_or(base.interval),
        delay: r.duration("delay", MAX_DURATION)?.unwrap_or(base.delay),
        delay_function: r.parsed("delay_function")?.unwrap_or(base.delay_function),
        max_delay: r
            .duration("max_delay", MAX_DURATION)?
            .unwrap_or(base.max_delay),
    })
}

/// The `constraint { attribute operator value }` blocks of a job, a group
/// or a task.
fn decode_constraints(parent: &BodyReader<'_, '_>) -> Result<Vec<Constraint>, SpecError> {
    parent
        .blocks("constraint")
        .into_iter()
        .map(|b| {
            let r = BodyReader::unlabeled(
                parent.src(),
                b,
                parent.ctx(),
                &["attribute", "operator", "value"],
                &[],
            )?;
            Ok(Constraint {
                attribute: r.string("attribute")?.unwrap_or_default(),
                operator: r.parsed("operator")?.unwrap_or_default(),
                value: r.string("value")?.unwrap_or_default(),
            })
        })
        .collect()
}

/// The `affinity { attribute operator value weight }` blocks of a job, a
/// group or a task.
fn decode_affinities(parent: &BodyReader<'_, '_>) -> Result<Vec<Affinity>, SpecError> {
    parent
        .blocks("affinity")
        .into_iter()
        .map(|b| {
            let r = BodyReader::unlabeled(
                parent.src(),
                b,
                parent.ctx(),
                &["attribute", "operator", "value", "weight"],
                &[],
            )?;
            let weight = match r.i64("weight")? {
                None => Affinity::DEFAULT_WEIGHT,
                Some(w) => i8::try_from(w)
                    .ok()
                    .filter(|w| *w != 0 && (-100..=100).contains(w))
                    .ok_or_else(|| {
                        r.invalid(
                            "weight",
                            format!("{w} is not between -100 and 100 (and not 0)"),
                        )
                    })?,
            };
            Ok(Affinity {
                attribute: r.string("attribute")?.unwrap_or_default(),
                operator: r.parsed("operator")?.unwrap_or_default(),
                value: r.string("value")?.unwrap_or_default(),
                weight,
            })
        })
        .collect()
}

/// The `spread { attribute weight target "VALUE" { percent } }` blocks of
/// a job or a group.
fn decode_spreads(parent: &BodyReader<'_, '_>) -> Result<Vec<Spread>, SpecError> {
    parent
        .blocks("spread")
        .into_iter()
        .map(|b| {
            let r = BodyReader::unlabeled(
                parent.src(),
                b,
                parent.ctx(),
                &["attribute", "weight"],
                &["target"],
            )?;
            let targets = r
                .blocks("target")
                .into_iter()
                .map(|t| {
                    let (value, t) = BodyReader::labeled(
                        parent.src(),
                        t,
                        r.ctx(),
                        "the attribute's value",
                        &["percent"],
                        &[],
                    )?;
                    Ok(SpreadTarget {
                        value,
                        percent: t
                            .u32("percent", 100)?
                            .and_then(|p| u8::try_from(p).ok())
                            .ok_or_else(|| t.missing("percent"))?,
                    })
                })
                .collect::<Result<Vec<_>, SpecError>>()?;
            Ok(Spread {
                attribute: r.required_string("attribute")?,
                weight: r
                    .u32("weight", 100)?
                    .and_then(|w| u8::try_from(w).ok())
                    .unwrap_or(Spread::DEFAULT_WEIGHT),
                targets,
            })
        })
        .collect()
}

fn decode_disconnect(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
) -> Result<DisconnectPolicy, SpecError> {
    let r = BodyReader::unlabeled(
        src,
        block,
        parent,
        &["lost_after", "replace", "reconcile", "stop_on_client_after"],
        &[],
    )?;
    let default = DisconnectPolicy::default();
    let reconcile = match r.string("reconcile")? {
        None => default.reconcile,
        Some(s) => s
            .parse::<ReconcileStrategy>()
            .map_err(|e| r.invalid("reconcile", e))?,
    };
    Ok(DisconnectPolicy {
        lost_after: r.duration("lost_after", MAX_DURATION)?,
        replace: r.bool("replace")?.unwrap_or(default.replace),
        reconcile,
        stop_on_client_after: r.duration("stop_on_client_after", MAX_DURATION)?,
    })
}

fn decode_restart(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
) -> Result<RestartPolicy, SpecError> {
    let r = BodyReader::unlabeled(
        src,
        block,
        parent,
        &["attempts", "interval", "delay", "mode"],
        &[],
    )?;
    let default = RestartPolicy::default();
    let mode = r.string("mode")?.unwrap_or(default.mode);
    if mode != "fail" && mode != "delay" {
        return Err(r.invalid(
            "mode",
            format!("restart mode {mode:?} is not supported (want fail or delay)"),
        ));
    }
    Ok(RestartPolicy {
        attempts: r
            .u32("attempts", MAX_RESTART_ATTEMPTS)?
            .unwrap_or(default.attempts),
        interval: r
            .duration("interval", MAX_DURATION)?
            .unwrap_or(default.interval),
        delay: r.duration("delay", MAX_DURATION)?.unwrap_or(default.delay),
        mode,
    })
}

fn decode_volume_request(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
) -> Result<VolumeRequest, SpecError> {
    let (name, r) = BodyReader::labeled(
        src,
        block,
        parent,
        "the volume name",
        &[
            "type",
            "source",
            "read_only",
            "access_mode",
            "attachment_mode",
            "per_alloc",
        ],
        &["mount_options"],
    )?;
    let mount_options = r
        .optional_block("mount_options")?
        .map(|b| decode_mount_options(src, b, r.ctx()))
        .transpose()?;
    Ok(VolumeRequest {
        name,
        volume_type: r.required_string("type")?,
        source: r.required_string("source")?,
        read_only: r.bool("read_only")?.unwrap_or(false),
        access_mode: r.parsed("access_mode")?,
        attachment_mode: r.parsed("attachment_mode")?,
        per_alloc: r.bool("per_alloc")?.unwrap_or(false),
        mount_options,
    })
}

/// `mount_options { fs_type mount_flags }`, in a group's volume or a volume spec.
pub(super) fn decode_mount_options(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
) -> Result<CsiMountOptions, SpecError> {
    let r = BodyReader::unlabeled(src, block, parent, &["fs_type", "mount_flags"], &[])?;
    Ok(CsiMountOptions {
        fs_type: r.string("fs_type")?.unwrap_or_default(),
        mount_flags: r.strings("mount_flags")?.unwrap_or_default(),
    })
}

fn decode_task(src: &Source<'_>, block: &Block, parent: &str) -> Result<Task, SpecError> {
    let (name, r) = BodyReader::labeled(
        src,
        block,
        parent,
        "the task name",
        &["driver", "kill_timeout", "env", "meta", "user"],
        &[
            "config",
            "env",
            "resources",
            "volume_mount",
            "csi_plugin",
            "meta",
            "logs",
            "constraint",
            "affinity",
        ],
    )?;

    let driver = r.required_string("driver")?;
    // The config block's attributes are the driver's: for a driver berth
    // does not have, what to say is that (validation does), not which
    // attribute of its config is unknown.
    let supported = crate::task::SUPPORTED_DRIVERS.contains(&driver.as_str());
    let config = match r.optional_block("config")? {
        Some(_) if !supported => TaskConfig::default(),
        None => TaskConfig::default(),
        Some(b) => {
            let c =
                BodyReader::unlabeled(src, b, r.ctx(), &["command", "args", "pids_limit"], &[])?;
            TaskConfig {
                command: c.string("command")?.unwrap_or_default(),
                args: c.strings("args")?.unwrap_or_default(),
                pids_limit: c.u64("pids_limit", MAX_PIDS_LIMIT)?,
            }
        }
    };

    let resources = match r.optional_block("resources")? {
        None => Resources::default(),
        Some(b) => {
            let res =
                BodyReader::unlabeled(src, b, r.ctx(), &["cpu", "memory", "memory_max"], &[])?;
            let default = Resources::default();
            Resources {
                cpu: res.u64("cpu", MAX_CPU_MHZ)?.unwrap_or(default.cpu),
                memory_mb: res
                    .u64("memory", MAX_MEMORY_MB)?
                    .unwrap_or(default.memory_mb),
                memory_max_mb: res.u64("memory_max", MAX_MEMORY_MB)?.unwrap_or(0),
            }
        }
    };

    let mut volume_mounts = Vec::new();
    for b in r.blocks("volume_mount") {
        let m = BodyReader::unlabeled(
            src,
            b,
            r.ctx(),
            &["volume", "destination", "read_only", "propagation_mode"],
            &[],
        )?;
        volume_mounts.push(VolumeMount {
            volume: m.required_string("volume")?,
            destination: m.required_string("destination")?,
            read_only: m.bool("read_only")?.unwrap_or(false),
            propagation_mode: m.parsed("propagation_mode")?.unwrap_or_default(),
        });
    }

    let logs = match r.optional_block("logs")? {
        None => LogConfig::default(),
        Some(b) => decode_logs(src, b, r.ctx())?,
    };

    let csi_plugin = r
        .optional_block("csi_plugin")?
        .map(|b| decode_csi_plugin(src, b, r.ctx()))
        .transpose()?;

    Ok(Task {
        name,
        driver,
        config,
        env: r.map("env")?,
        resources,
        volume_mounts,
        csi_plugin,
        kill_timeout: r.duration("kill_timeout", MAX_DURATION)?,
        meta: r.map("meta")?,
        logs,
        constraints: decode_constraints(&r)?,
        affinities: decode_affinities(&r)?,
        user: r.string("user")?.unwrap_or_default(),
    })
}

/// `logs { max_files max_file_size }` (the size in MiB).
fn decode_logs(src: &Source<'_>, block: &Block, parent: &str) -> Result<LogConfig, SpecError> {
    let r = BodyReader::unlabeled(src, block, parent, &["max_files", "max_file_size"], &[])?;
    let default = LogConfig::default();
    let max_files = r
        .u32("max_files", MAX_LOG_FILES)?
        .unwrap_or(default.max_files);
    if max_files == 0 {
        return Err(r.invalid("max_files", "must be at least 1"));
    }
    let max_file_size = r
        .u64("max_file_size", MAX_LOG_FILE_SIZE_MB)?
        .unwrap_or(default.max_file_size);
    if max_file_size == 0 {
        return Err(r.invalid("max_file_size", "must be at least 1 (MiB)"));
    }
    Ok(LogConfig {
        max_files,
        max_file_size,
    })
}

fn decode_csi_plugin(
    src: &Source<'_>,
    block: &Block,
    parent: &str,
) -> Result<TaskCsiPluginConfig, SpecError> {
    let r = BodyReader::unlabeled(
        src,
        block,
        parent,
        &[
            "id",
            "type",
            "mount_dir",
            "stage_publish_base_dir",
            "health_timeout",
        ],
        &[],
    )?;
    Ok(TaskCsiPluginConfig {
        id: r.required_string("id")?,
        plugin_type: r
            .parsed::<CsiPluginType>("type")?
            .ok_or_else(|| r.missing("type"))?,
        mount_dir: r.required_string("mount_dir")?,
        stage_publish_base_dir: r.string("stage_publish_base_dir")?,
        health_timeout: r
            .duration("health_timeout", MAX_DURATION)?
            .unwrap_or(TaskCsiPluginConfig::DEFAULT_HEALTH_TIMEOUT),
    })
}
