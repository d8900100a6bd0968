//! The CSI hook: claims the group's CSI volumes on the servers and mounts
//! them on this node before the tasks start; unmounts and releases them
//! after the tasks are done. Before the tasks of a stopping alloc that runs
//! a CSI node plugin are killed, it waits until no other alloc needs the
//! plugin; when the alloc is destroyed, it unmounts what csimanager still
//! records as mounted for it.

use berth_sync::MutexExt;
use std::time::Duration;

use backon::ExponentialBuilder;
use berth_csimanager::{retry_notify, CsiError, MountRequest, UnmountRequest};
use berth_structs::{
    AccessMode, AttachmentMode, ClaimMode, CsiPluginType, TaskEvent, TaskGroup, VolumeRequest,
};
use tracing::{error, info, warn, Instrument};

use super::{AllocHook, AllocHookContext};
use crate::alloc_runner::EVENT_WAITING_FOR_VOLUMES;
use crate::claims::{ClaimError, ClaimGrant, ClaimRequest};
use crate::error::{AllocRunnerError, HookError};

/// One volume of the group, as far as prerun got with it.
#[derive(Debug, Clone)]
struct VolumeUse {
    name: String,
    volume_id: String,
    access_mode: AccessMode,
    attachment_mode: AttachmentMode,
    read_only: bool,
    /// Set once the servers granted the claim.
    plugin_id: String,
    /// Set once a mount was asked for: it may have (partly) happened even
    /// if it failed, so postrun unmounts with it.
    unmount: Option<UnmountRequest>,
}

/// Claims and mounts the group's CSI volumes; see the module docs. Every
/// volume whose claim was sent is released at postrun, every volume whose
/// mount was asked for is unmounted first, and a volume that cannot be
/// unmounted is not released: the servers' volume watcher reaps its claim
/// once the alloc is terminal.
#[derive(Default)]
pub struct CsiHook {
    volumes: Vec<VolumeUse>,
    /// Whether this run's prerun ran (a restored alloc may be stopped
    /// before it does).
    prerun_ran: bool,
}

pub(crate) fn backoff(total: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .with_jitter_seed(berth_structs::now_ms() as u64)
        .without_max_times()
        .with_total_delay(Some(total))
}

/// The CSI node (or monolith) plugins the group's tasks run, as (task,
/// plugin ID): volumes on this node may need them to be unmounted.
pub(crate) fn node_plugins(group: &TaskGroup) -> Vec<(String, String)> {
    group
        .tasks
        .iter()
        .filter_map(|t| {
            let plugin = t.csi_plugin.as_ref()?;
            (plugin.plugin_type != CsiPluginType::Controller)
                .then(|| (t.name.clone(), plugin.id.clone()))
        })
        .collect()
}

/// How long a mount waits for its node plugin to register on this node.
pub const PLUGIN_REGISTER_WAIT: Duration = Duration::from_secs(120);

/// The task event of an alloc whose mount waits for its node plugin.
pub const EVENT_WAITING_FOR_PLUGIN: &str = "Waiting for plugin";

/// Waits (at most [`PLUGIN_REGISTER_WAIT`]) until node plugin
/// `plugin_id` is registered on this node. The servers granted a claim
/// through it, so an instance is on its way: a plugin alloc placed with
/// this one (a node back from a partition gets both at once), or a plugin
/// restarting. Each task of the alloc gets an event when the wait starts.
/// Past the wait the mount goes ahead and fails as it would have.
async fn wait_for_plugin(ctx: &AllocHookContext, plugin_id: &str) -> Result<(), HookError> {
    let registry = ctx.config.csi.registry();
    if registry.get(plugin_id).is_some() {
        return Ok(());
    }
    let mut changes = registry.subscribe();
    info!(
        plugin_id,
        "waiting for the node plugin to register on this node"
    );
    if let Some(group) = ctx.alloc.group() {
        let message = format!(
            "Waiting up to {} for plugin {plugin_id:?} to register on this node",
            berth_structs::limits::duration_text(PLUGIN_REGISTER_WAIT)
        );
        for task in &group.tasks {
            ctx.task_event(
                &task.name,
                TaskEvent::new(EVENT_WAITING_FOR_PLUGIN, message.clone()),
            );
        }
    }
    let mut stop = ctx.stop.clone();
    let deadline = tokio::time::Instant::now() + PLUGIN_REGISTER_WAIT;
    while registry.get(plugin_id).is_none() {
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = stop.wait() => return Err(HookError::Stopped),
            _ = tokio::time::sleep_until(deadline) => {
                warn!(plugin_id, "the node plugin did not register in time");
                break;
            }
        }
    }
    Ok(())
}

/// Unmounts with `req`, retrying every error until the release retry
/// timeout; `notify` hears of each retry.
async fn unmount(
    ctx: &AllocHookContext,
    req: &UnmountRequest,
    notify: impl FnMut(&CsiError, Duration),
) -> Result<(), CsiError> {
    let csi = ctx.config.csi.clone();
    retry_notify(
        backoff(ctx.config.release_retry_timeout),
        || {
            let csi = csi.clone();
            let req = req.clone();
            async move { csi.unmount_volume(req).await }
        },
        |_| true,
        notify,
    )
    .await
}

impl CsiHook {
    async fn claim(
        &self,
        ctx: &AllocHookContext,
        req: ClaimRequest,
    ) -> Result<ClaimGrant, HookError> {
        let volume_id = req.volume_id.clone();
        let claimer = ctx.config.claimer.clone();
        let attempt = || {
            let claimer = claimer.clone();
            let req = req.clone();
            async move { claimer.claim(req).await }
        };
        let retried = retry_notify(
            backoff(ctx.config.claim_retry_timeout),
            attempt,
            |e: &ClaimError| e.retryable,
            |e: &ClaimError, wait: Duration| {
                warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim not granted yet; retrying");
            },
        );
        let mut stop = ctx.stop.clone();
        let started = std::time::Instant::now();
        let granted = tokio::select! {
            r = retried => r.map_err(|error| {
                if error.alloc_terminal {
                    // The servers hold the alloc terminal (lost while its
                    // node was away, say): it is stopped, not failed, and
                    // its client hears so next.
                    info!(volume_id = %volume_id, "the servers hold the alloc terminal; not starting it");
                    HookError::Stopped
                } else {
                    HookError::Claim { volume_id, error }
                }
            }),
            _ = stop.wait() => Err(HookError::Stopped),
        };
        // The plugin is known from the grant only.
        let plugin = granted.as_ref().map(|g| g.plugin_id.as_str()).unwrap_or("");
        berth_metrics::observe_plugin_op(
            &berth_metrics::metrics().csi_claim_duration,
            plugin,
            berth_metrics::Outcome::of(&granted),
            started.elapsed(),
        );
        granted
    }

    /// What to unmount for `v` before its claim may be released: the mount
    /// this run asked for, or else one that csimanager still records for the
    /// alloc (made before an agent restart, when this run's claim or mount
    /// did not get that far).
    fn unmount_request(ctx: &AllocHookContext, v: &VolumeUse) -> Option<UnmountRequest> {
        if let Some(req) = &v.unmount {
            return Some(req.clone());
        }
        ctx.config
            .csi
            .volume_stubs_of(&ctx.alloc.id)
            .into_iter()
            .find(|s| s.volume_id == v.volume_id)
            .map(|s| UnmountRequest::for_stub(&s, &ctx.alloc.id))
    }

    /// What the alloc uses of the group's volume request `name`.
    fn volume_use(
        ctx: &AllocHookContext,
        name: &str,
        req: &VolumeRequest,
    ) -> Result<VolumeUse, HookError> {
        if req.volume_type != "csi" {
            return Err(HookError::Invalid(format!(
                "volume {name:?}: type {:?} is not supported",
                req.volume_type
            )));
        }
        let (Some(access_mode), Some(attachment_mode)) = (req.access_mode, req.attachment_mode)
        else {
            return Err(HookError::Invalid(format!(
                "volume {name:?}: access_mode and attachment_mode are required"
            )));
        };
        Ok(VolumeUse {
            name: name.to_string(),
            volume_id: req.source_for(ctx.alloc.index),
            access_mode,
            attachment_mode,
            read_only: req.read_only || access_mode.is_reader_only(),
            plugin_id: String::new(),
            unmount: None,
        })
    }

    /// csimanager's record of `volume_id` for this alloc, when its publish
    /// target is still a mount point.
    fn still_published(
        ctx: &AllocHookContext,
        volume_id: &str,
    ) -> Option<(berth_csimanager::VolumeStub, std::path::PathBuf)> {
        ctx.config
            .csi
            .volume_stubs_of(&ctx.alloc.id)
            .into_iter()
            .find_map(|stub| {
                if stub.volume_id != volume_id {
                    return None;
                }
                let target = stub.allocs.get(&ctx.alloc.id)?.clone();
                crate::alloc_dir::mounts_below(&target)
                    .contains(&target)
                    .then_some((stub, target))
            })
    }

    async fn release(ctx: &AllocHookContext, v: &VolumeUse) -> Result<(), HookError> {
        let total = ctx.config.release_retry_timeout;
        if let Some(req) = Self::unmount_request(ctx, v) {
            let unmounted = unmount(ctx, &req, |e, wait: Duration| {
                warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "unmount failed; retrying");
            })
            .await;
            if let Err(error) = unmounted {
                error!(error = %error, "unmount failed for good; leaving the claim for the servers to reap");
                return Err(HookError::Unmount {
                    volume_id: v.volume_id.clone(),
                    error,
                });
            }
            info!("unmounted volume");
        }
        let claimer = ctx.config.claimer.clone();
        let alloc_id = ctx.alloc.id.clone();
        let started = std::time::Instant::now();
        let released = retry_notify(
            backoff(total),
            || {
                let claimer = claimer.clone();
                let volume_id = v.volume_id.clone();
                let alloc_id = alloc_id.clone();
                async move { claimer.unpublish(&volume_id, &alloc_id).await }
            },
            |e: &ClaimError| e.retryable,
            |e: &ClaimError, wait: Duration| {
                warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "unpublish failed; retrying");
            },
        )
        .await;
        berth_metrics::observe_plugin_op(
            &berth_metrics::metrics().csi_unpublish_duration,
            &v.plugin_id,
            berth_metrics::Outcome::of(&released),
            started.elapsed(),
        );
        match released {
            Ok(()) => {
                info!("released claim");
                Ok(())
            }
            Err(error) => {
                error!(error = %error, "releasing the claim failed");
                Err(HookError::Unpublish {
                    volume_id: v.volume_id.clone(),
                    error,
                })
            }
        }
    }
}

#[async_trait::async_trait]
impl AllocHook for CsiHook {
    fn name(&self) -> &'static str {
        "csi"
    }

    async fn prerun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError> {
        let Some(group) = ctx.alloc.group() else {
            return Err(HookError::Invalid(format!(
                "group {:?} is not in the job",
                ctx.alloc.task_group
            )));
        };
        self.prerun_ran = true;
        for (name, req) in &group.volumes {
            let volume = Self::volume_use(ctx, name, req)?;
            let (volume_id, access_mode, attachment_mode, read_only) = (
                volume.volume_id.clone(),
                volume.access_mode,
                volume.attachment_mode,
                volume.read_only,
            );
            let span = tracing::info_span!(
                "csi_volume",
                volume = %name,
                volume_id = %volume_id,
                plugin_id = tracing::field::Empty,
            );
            // Recorded before the claim is sent: a claim cut short by a stop
            // may still have been granted, and postrun releases it.
            self.volumes.push(volume);
            // After an agent restart a volume still published for this
            // alloc is kept as it is: its claim is held on the servers, and
            // the task goes on using it even while they are unreachable.
            if ctx.restoring {
                if let Some((stub, target)) = Self::still_published(ctx, &volume_id) {
                    span.record("plugin_id", stub.plugin_id.as_str());
                    span.in_scope(|| info!(target = %target.display(), "kept the volume mounted from before the restart"));
                    if let Some(v) = self.volumes.last_mut() {
                        v.plugin_id = stub.plugin_id.clone();
                        v.unmount = Some(UnmountRequest::for_stub(&stub, &ctx.alloc.id));
                    }
                    ctx.mounts.locked().insert(
                        name.clone(),
                        berth_csimanager::MountInfo {
                            source: target,
                            read_only: stub.read_only,
                        },
                    );
                    continue;
                }
            }
            let claim = self
                .claim(
                    ctx,
                    ClaimRequest {
                        volume_id: volume_id.clone(),
                        alloc_id: ctx.alloc.id.clone(),
                        mode: if read_only {
                            ClaimMode::Read
                        } else {
                            ClaimMode::Write
                        },
                        access_mode,
                        attachment_mode,
                        read_only,
                        mount_options: req.mount_options.clone().unwrap_or_default(),
                    },
                )
                .instrument(span.clone())
                .await?;
            let mount_options = req
                .mount_options
                .clone()
                .unwrap_or_default()
                .merged_over(&claim.mount_options);
            span.record("plugin_id", claim.plugin_id.as_str());
            let mount = MountRequest {
                plugin_id: claim.plugin_id,
                volume_id: volume_id.clone(),
                external_id: claim.external_id,
                alloc_id: ctx.alloc.id.clone(),
                access_mode,
                attachment_mode,
                read_only,
                mount_options,
                publish_context: claim.publish_context,
                volume_context: claim.volume_context,
                secrets: claim.secrets,
            };
            if let Some(v) = self.volumes.last_mut() {
                v.plugin_id = mount.plugin_id.clone();
                v.unmount = Some(UnmountRequest::from(&mount));
            }
            wait_for_plugin(ctx, &mount.plugin_id)
                .instrument(span.clone())
                .await?;
            let info = ctx
                .config
                .csi
                .mount_volume(mount)
                .instrument(span.clone())
                .await
                .map_err(|error| HookError::Mount {
                    volume_id: volume_id.clone(),
                    error,
                })?;
            span.in_scope(|| info!(source = %info.source.display(), "mounted volume"));
            ctx.mounts.locked().insert(name.clone(), info);
        }
        Ok(())
    }

    async fn postrun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError> {
        let mut errs = Vec::new();
        let mut volumes = std::mem::take(&mut self.volumes);
        if ctx.restoring || !self.prerun_ran {
            // A restored alloc stopped before (or during) this run's prerun:
            // what the previous agent mounted and claimed is released all
            // the same, also for the volumes this run's prerun never reached
            // (unmounted through csimanager's records, then unpublished).
            let reached: std::collections::BTreeSet<String> =
                volumes.iter().map(|v| v.name.clone()).collect();
            let rest: Vec<VolumeUse> = ctx
                .alloc
                .group()
                .map(|g| {
                    g.volumes
                        .iter()
                        .filter(|(name, _)| !reached.contains(*name))
                        .filter_map(|(name, req)| Self::volume_use(ctx, name, req).ok())
                        .collect()
                })
                .unwrap_or_default();
            volumes.extend(rest);
        }
        for v in volumes.iter().rev() {
            let span = tracing::info_span!("csi_volume", volume = %v.name, volume_id = %v.volume_id, plugin_id = %v.plugin_id);
            if let Err(e) = Self::release(ctx, v).instrument(span).await {
                errs.push(e);
            }
            ctx.mounts.locked().remove(&v.name);
        }
        HookError::from_many(errs)
    }
    /// Before the tasks of a stopping alloc are killed: waits, for each CSI
    /// node plugin the alloc runs, until no other alloc on this node has a
    /// volume of the plugin mounted (their unpublish and unstage need it),
    /// unless another healthy instance of the plugin serves them. No
    /// deadline: a mount is never left behind a stopped plugin. The plugin
    /// task gets an event, and the log a line, when the wait starts and
    /// whenever the number of volumes changes; the tasks keep running (and
    /// the alloc its status) meanwhile.
    async fn pre_kill(&mut self, ctx: &AllocHookContext) {
        let Some(group) = ctx.alloc.group() else {
            return;
        };
        for (task, plugin_id) in node_plugins(group) {
            let mut waited = false;
            ctx.config
                .csi
                .wait_until_plugin_instance_unneeded(&plugin_id, &ctx.alloc.id, |volumes| {
                    waited = true;
                    let message = format!(
                        "Waiting for {volumes} volume(s) of plugin {plugin_id:?} to be unmounted before stopping"
                    );
                    info!(task = %task, plugin_id = %plugin_id, volumes, "waiting for the plugin's volumes to be unmounted before stopping it");
                    ctx.task_event(&task, TaskEvent::new(EVENT_WAITING_FOR_VOLUMES, message));
                })
                .await;
            if waited {
                info!(task = %task, plugin_id = %plugin_id, "no volume needs the plugin any more; stopping it");
            }
        }
    }

    /// Unmounts (with retries) every CSI volume csimanager still records
    /// as mounted for the alloc; an error when one remains.
    async fn destroy(&mut self, ctx: &AllocHookContext) -> Result<(), AllocRunnerError> {
        let alloc_id = &ctx.alloc.id;
        let csi = &ctx.config.csi;
        for stub in csi.volume_stubs_of(alloc_id) {
            warn!(alloc_id = %alloc_id, volume_id = %stub.volume_id, plugin_id = %stub.plugin_id, "a volume is still mounted for the destroyed alloc; unmounting it");
            let req = UnmountRequest::for_stub(&stub, alloc_id);
            let unmounted = unmount(ctx, &req, |e, wait: Duration| {
                warn!(alloc_id = %alloc_id, volume_id = %stub.volume_id, error = %e, retry_in_ms = wait.as_millis() as u64, "unmount failed; retrying");
            })
            .await;
            if let Err(error) = unmounted {
                error!(alloc_id = %alloc_id, volume_id = %stub.volume_id, plugin_id = %stub.plugin_id, error = %error, "cannot unmount a volume of the destroyed alloc; keeping its records");
                return Err(AllocRunnerError::VolumeStillMounted {
                    volume_id: stub.volume_id,
                    error,
                });
            }
        }
        if let Some(stub) = csi.volume_stubs_of(alloc_id).into_iter().next() {
            return Err(AllocRunnerError::VolumeStillRecorded {
                volume_id: stub.volume_id,
            });
        }
        Ok(())
    }
}
