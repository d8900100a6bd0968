//! The plugin supervisor: runs a `csi_plugin` task as a CSI plugin.
//!
//! Before the task starts it gets `CSI_ENDPOINT=unix://<socket>`. After it
//! starts, the supervisor waits for the socket, probes until the plugin is
//! healthy (or kills the task for a restart once `health_timeout` has
//! passed), asks for `GetPluginInfo` and registers the plugin in
//! csimanager's registry. It probes every `plugin_probe_interval` after
//! that, with a task event on each health change. When the task exits the
//! plugin is marked unhealthy at once (it stays registered, with what it
//! last was, until it is healthy again); it is deregistered when the task
//! stops for good. An instance never takes the registration from a healthy
//! newer alloc's instance of the same plugin (a plugin upgrade: the old
//! alloc may run on while it waits to stop).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth_csimanager::{CsiClient, CsiManager, PluginRegistration};
use berth_proto::csi::v1 as csi;
use berth_structs::TaskCsiPluginConfig;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument};

use super::{KillRequest, TaskControl, TaskHook, TaskHookContext};
use crate::error::HookError;
use crate::state::TaskEvents;

/// The longest path a unix socket can have (`sun_path` is 108 bytes with
/// its terminating NUL).
pub const MAX_SOCKET_PATH_LEN: usize = 107;

/// How often the socket and health are checked while the plugin starts.
const STARTUP_POLL: Duration = Duration::from_millis(250);

pub const EVENT_PLUGIN_HEALTHY: &str = "Plugin became healthy";
pub const EVENT_PLUGIN_UNHEALTHY: &str = "Plugin became unhealthy";
/// Why a plugin whose task exited is unhealthy.
const PLUGIN_TASK_EXITED: &str = "the plugin task exited";

/// `<plugin_root>/<plugin_id>/<alloc_id>/csi.sock`.
pub fn plugin_socket_path(plugin_root: &Path, plugin_id: &str, alloc_id: &str) -> PathBuf {
    plugin_root.join(plugin_id).join(alloc_id).join("csi.sock")
}

pub struct PluginSupervisorHook {
    plugin: TaskCsiPluginConfig,
    socket: Option<PathBuf>,
    supervisor: Option<JoinHandle<()>>,
}

impl PluginSupervisorHook {
    pub fn new(plugin: TaskCsiPluginConfig) -> PluginSupervisorHook {
        PluginSupervisorHook {
            plugin,
            socket: None,
            supervisor: None,
        }
    }

    fn plugin_error(&self, message: impl Into<String>) -> HookError {
        HookError::Plugin {
            plugin_id: self.plugin.id.clone(),
            message: message.into(),
        }
    }

    /// Stops supervising and deregisters this alloc's instance.
    fn halt(&mut self, ctx: &TaskHookContext) {
        if let Some(s) = self.supervisor.take() {
            s.abort();
        }
        if ctx
            .config
            .csi
            .registry()
            .deregister(&self.plugin.id, &ctx.alloc.id)
        {
            info!(plugin_id = %self.plugin.id, "deregistered plugin");
        }
    }
}

#[async_trait::async_trait]
impl TaskHook for PluginSupervisorHook {
    fn name(&self) -> &'static str {
        "plugin_supervisor"
    }

    async fn prestart(&mut self, ctx: &mut TaskHookContext) -> Result<(), HookError> {
        let id = &self.plugin.id;
        // The ID becomes a directory name: the servers' rule, checked again.
        if let Err(e) = berth_structs::check_name("csi_plugin.id", id) {
            return Err(self.plugin_error(e.to_string()));
        }
        let socket = plugin_socket_path(&ctx.config.plugin_root, id, &ctx.alloc.id);
        let len = socket.as_os_str().len();
        if len > MAX_SOCKET_PATH_LEN {
            return Err(self.plugin_error(format!(
                "socket path {} is {len} bytes, longer than the {MAX_SOCKET_PATH_LEN} a unix socket allows; use a shorter data_dir",
                socket.display()
            )));
        }
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| HookError::io("creating plugin socket dir", dir, e))?;
        }
        // A reattached plugin still serves on its socket.
        if !ctx.restoring {
            match std::fs::remove_file(&socket) {
                Ok(()) => debug!(socket = %socket.display(), "removed a stale plugin socket"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(HookError::io("removing stale plugin socket", &socket, e)),
            }
        }
        ctx.env.insert(
            "CSI_ENDPOINT".into(),
            format!("unix://{}", socket.display()),
        );
        self.socket = Some(socket);
        Ok(())
    }

    async fn poststart(
        &mut self,
        ctx: &TaskHookContext,
        task: &TaskControl,
    ) -> Result<(), HookError> {
        let Some(socket) = self.socket.clone() else {
            return Err(self.plugin_error("poststart ran before prestart"));
        };
        if let Some(s) = self.supervisor.take() {
            s.abort();
        }
        let health_timeout = if self.plugin.health_timeout.is_zero() {
            TaskCsiPluginConfig::DEFAULT_HEALTH_TIMEOUT
        } else {
            self.plugin.health_timeout
        };
        let sup = Supervision {
            csi: ctx.config.csi.clone(),
            plugin: self.plugin.clone(),
            socket,
            alloc_id: ctx.alloc.id.clone(),
            newness: ctx.alloc.create_index,
            events: ctx.events.clone(),
            task: task.clone(),
            health_timeout,
            probe_interval: ctx.config.plugin_probe_interval,
            call_timeout: ctx.config.plugin_call_timeout,
        };
        let span = tracing::info_span!("plugin_supervisor", alloc_id = %ctx.alloc.id, task = %ctx.task.name, plugin_id = %self.plugin.id);
        self.supervisor = Some(tokio::spawn(sup.run().instrument(span)));
        Ok(())
    }

    /// The task exited (it may restart): a plugin that was registered
    /// healthy becomes unhealthy at once, with a task event and, through
    /// csimanager, a node event, before the task can restart and be healthy
    /// again. It stays registered, so that the node goes on reporting what
    /// it was (its provider, its capabilities) until it is healthy again or
    /// stops for good.
    async fn exited(&mut self, ctx: &TaskHookContext) {
        if let Some(s) = self.supervisor.take() {
            s.abort();
        }
        let csi = &ctx.config.csi;
        let registered_healthy = csi
            .registry()
            .entry(&self.plugin.id)
            .is_some_and(|e| e.registration.alloc_id == ctx.alloc.id && e.unhealthy.is_none());
        if registered_healthy {
            warn!(plugin_id = %self.plugin.id, alloc_id = %ctx.alloc.id, task = %ctx.task.name, "plugin task exited; plugin became unhealthy");
            ctx.events
                .emit(EVENT_PLUGIN_UNHEALTHY, PLUGIN_TASK_EXITED.to_string());
            csi.plugin_unhealthy(&self.plugin.id, &ctx.alloc.id, PLUGIN_TASK_EXITED);
        }
    }

    async fn stop(&mut self, ctx: &TaskHookContext) -> Result<(), HookError> {
        self.halt(ctx);
        if let Some(socket) = self.socket.take() {
            let _ = std::fs::remove_file(&socket);
            if let Some(dir) = socket.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
        Ok(())
    }
}

struct Supervision {
    csi: Arc<CsiManager>,
    plugin: TaskCsiPluginConfig,
    socket: PathBuf,
    alloc_id: String,
    /// The alloc's create index: a newer alloc's instance wins the
    /// registration.
    newness: u64,
    events: TaskEvents,
    task: TaskControl,
    health_timeout: Duration,
    probe_interval: Duration,
    call_timeout: Duration,
}

impl Supervision {
    async fn probe(&self, client: &CsiClient) -> Result<(), String> {
        if !self.socket.exists() {
            return Err(format!(
                "socket {} does not exist yet",
                self.socket.display()
            ));
        }
        match client.probe(csi::ProbeRequest {}).await {
            Ok(r) if r.ready == Some(false) => Err("the plugin reports it is not ready".into()),
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Probes, then asks for the plugin's name and version.
    async fn check(&self, client: &CsiClient) -> Result<csi::GetPluginInfoResponse, String> {
        self.probe(client).await?;
        client
            .get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .map_err(|e| e.to_string())
    }

    /// Registers the instance unless a healthy newer one of the plugin is
    /// registered; whether it did.
    fn register(&self, reg: &PluginRegistration) -> bool {
        let registered = self
            .csi
            .registry()
            .register_instance(reg.clone(), self.newness);
        if !registered {
            info!("plugin is healthy; a newer instance of it is registered, so this one is not");
        }
        registered
    }

    fn unhealthy_kill(&self, message: String) {
        warn!(error = %message, "plugin did not become healthy; restarting its task");
        self.events.emit(EVENT_PLUGIN_UNHEALTHY, message.clone());
        // Registered from before (an agent restart): unhealthy now.
        self.csi
            .plugin_unhealthy(&self.plugin.id, &self.alloc_id, &message);
        self.task.kill(KillRequest {
            reason: message,
            restart: true,
        });
    }

    async fn run(self) {
        // A health timeout too long to add to an instant is no deadline.
        let deadline = Instant::now().checked_add(self.health_timeout);
        let client = match CsiClient::connect(&self.plugin.id, &self.socket, self.call_timeout) {
            Ok(c) => c,
            Err(e) => return self.unhealthy_kill(format!("connecting to the plugin: {e}")),
        };
        let info = loop {
            match self.check(&client).await {
                Ok(info) => break info,
                Err(e) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return self.unhealthy_kill(format!(
                        "plugin did not become healthy within {:?}: {e}",
                        self.health_timeout
                    ));
                }
                Err(e) => debug!(error = %e, "plugin not healthy yet"),
            }
            tokio::time::sleep(STARTUP_POLL).await;
        };
        let reg = PluginRegistration {
            plugin_id: self.plugin.id.clone(),
            plugin_type: self.plugin.plugin_type,
            socket_path: self.socket.clone(),
            alloc_id: self.alloc_id.clone(),
            task: self.events.task().to_string(),
            mount_root: PathBuf::from(
                self.plugin
                    .stage_publish_base_dir
                    .as_deref()
                    .unwrap_or(&self.plugin.mount_dir),
            ),
            provider: info.name.clone(),
            version: info.vendor_version.clone(),
        };
        // Already registered healthy by this instance (reattached after an
        // agent restart): no health change, so no event.
        let was_healthy = self.csi.registry().entry(&self.plugin.id).is_some_and(|e| {
            e.unhealthy.is_none()
                && e.registration.alloc_id == self.alloc_id
                && e.registration.socket_path == self.socket
        });
        let healthy_message = if self.register(&reg) {
            format!(
                "plugin {} ({} {}) is healthy and registered",
                self.plugin.id, info.name, info.vendor_version
            )
        } else {
            format!(
                "plugin {} ({} {}) is healthy; a newer instance of it is registered",
                self.plugin.id, info.name, info.vendor_version
            )
        };
        if was_healthy {
            info!(provider = %info.name, version = %info.vendor_version, "plugin is still healthy; registered it again");
        } else {
            info!(provider = %info.name, version = %info.vendor_version, "plugin became healthy; registered it");
            self.events
                .emit(EVENT_PLUGIN_HEALTHY, healthy_message.clone());
        }
        let mut healthy = true;
        loop {
            tokio::time::sleep(self.probe_interval).await;
            match (healthy, self.probe(&client).await) {
                (true, Err(e)) => {
                    warn!(error = %e, "plugin became unhealthy");
                    healthy = false;
                    self.csi
                        .plugin_unhealthy(&self.plugin.id, &self.alloc_id, &e);
                    self.events.emit(EVENT_PLUGIN_UNHEALTHY, e);
                }
                (false, Ok(())) => {
                    info!("plugin became healthy again");
                    healthy = true;
                    self.register(&reg);
                    self.events
                        .emit(EVENT_PLUGIN_HEALTHY, healthy_message.clone());
                }
                _ => {}
            }
        }
    }
}
