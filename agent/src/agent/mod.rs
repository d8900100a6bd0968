//! `berth agent`: configuration and the wiring of the server role, the HTTP
//! API and the client into one process.

mod flags;
mod roles;
mod signals;

use berth_sync::{Shutdown, ShutdownSender};
pub use flags::*;
use roles::{start_client_http, start_server};
use signals::{reload_log_level, reload_tls, Signal, Signals};

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use tokio::sync::watch;

use crate::data_dir::DataDirLock;
use berth_client::Client;

pub fn run_from_args(args: AgentArgs) -> Result<i32> {
    let config = AgentConfig::from_flags(args)?;
    // The data dir is claimed before anything else (databases, logs), so
    // that a second agent on it fails at once with one line.
    let data_dir = prepare_data_dir(&config)?;
    let lock = DataDirLock::acquire(&data_dir)?;
    let log = crate::logging::init(config.log_level.as_deref(), config.log_json);
    tracing::debug!(lock = %lock.path().display(), "data dir claimed");
    restrict_data_dir(&data_dir)?;
    if config.data_dir.is_none() {
        tracing::info!(data_dir = %data_dir.display(), "dev agent uses a fresh temp data dir");
    }
    limit_malloc_arenas();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("berth-agent")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run(config, data_dir, log))?;
    drop(lock);
    Ok(0)
}

/// One malloc arena for the agent's threads, instead of glibc's eight per
/// core: every runtime worker and blocking thread would otherwise get an
/// arena of its own, whose pages stay resident once a burst of work (many
/// allocs starting) has touched them. (Threads keep their own small
/// caches, so they seldom wait on the arena's lock.)
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn limit_malloc_arenas() {
    // SAFETY: mallopt only sets malloc's tunables; called before the
    // runtime starts its threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn limit_malloc_arenas() {}

/// Logs a warning naming the executors on this host that belong to another
/// data dir: tasks of a node this one may have replaced (a lost data dir),
/// still running and maybe writing to their volumes.
fn warn_of_foreign_executors(data_dir: &Path) {
    let foreign = berth_allocrunner::driver::executors_outside(data_dir);
    if foreign.is_empty() {
        return;
    }
    let shown: Vec<String> = foreign
        .iter()
        .take(10)
        .map(|e| format!("pid {} ({})", e.pid, e.dir.display()))
        .collect();
    tracing::warn!(
        executors = foreign.len(),
        shown = %shown.join(", "),
        data_dir = %data_dir.display(),
        "task executors of another data dir run on this host: if they are a lost data dir's, \
         their tasks still run; stop them before `berth node purge -force` of the old node"
    );
}

/// The data dir and its `server/` and `client/` dirs hold the state
/// databases and the keyring: they are their owner's only (0700). A looser
/// mode is narrowed, with a warning naming the path and both modes.
fn restrict_data_dir(data_dir: &Path) -> Result<()> {
    for dir in [
        data_dir.to_path_buf(),
        data_dir.join("server"),
        data_dir.join("client"),
    ] {
        berth_server::file_modes::narrow(&dir, 0o700)
            .with_context(|| format!("setting mode 0700 on {}", dir.display()))?;
    }
    Ok(())
}

/// The data dir, created (mode 0700) if needed, as an absolute path.
fn prepare_data_dir(config: &AgentConfig) -> Result<PathBuf> {
    match &config.data_dir {
        Some(d) => {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .with_context(|| format!("creating data dir {}", d.display()))?;
            d.canonicalize()
                .with_context(|| format!("resolving data dir {}", d.display()))
        }
        // Kept after exit: a dev agent's tasks and mounts outlive it.
        None => Ok(tempfile::Builder::new()
            .prefix("berth-dev-")
            .tempdir()
            .context("creating a temp data dir")?
            .keep()),
    }
}

/// Runs the agent on `data_dir`, which the caller holds the
/// [`DataDirLock`] of, until SIGINT or SIGTERM; SIGHUP reloads the log
/// level through `log`. Tells systemd how it goes (see `crate::systemd`).
pub async fn run(
    config: AgentConfig,
    data_dir: PathBuf,
    log: crate::logging::LogControl,
) -> Result<()> {
    // Installed first: a SIGHUP while the agent starts must not end it,
    // and a SIGTERM then is handled below once the agent is up.
    let mut signals = Signals::install().context("installing the signal handlers")?;
    let (shutdown_tx, shutdown_rx) = Shutdown::channel();
    for key in &config.not_applied {
        tracing::warn!(key, "this config key is not applied by this version yet");
    }
    for warning in &config.config_warnings {
        tracing::warn!("{warning}");
    }

    let tls = agent_tls(&config)?;

    if config.server && config.client {
        tracing::warn!(
            server_state = %data_dir.join("server").display(),
            "this agent runs the server and the client role on one host: tasks run with \
             raw_exec as root and can read the server's keyring and state; in production run \
             servers on hosts of their own (submit-job is root on the nodes until tasks run \
             isolated)"
        );
    }

    let mut components = crate::systemd::Components::default();
    let mut tasks = tokio::task::JoinSet::new();
    let agent_info = agent_info(&config, &data_dir);
    let local_rpc_addr = if config.server {
        crate::systemd::status("loading the server state");
        let (addr, server) = start_server(
            &config,
            tls.as_ref(),
            &data_dir,
            &shutdown_rx,
            &mut tasks,
            &agent_info,
        )
        .await?;
        components.server = Some(server);
        Some(addr)
    } else {
        // A client-only agent serves the HTTP API too: its node-local
        // routes, and the rest forwarded to its servers.
        start_client_http(&config, tls.as_ref(), &shutdown_rx, &mut tasks, &agent_info).await?;
        None
    };
    let servers = servers_to_dial(&config, local_rpc_addr)?;

    // The client stops before the server role, so that its last updates
    // still reach the servers.
    let (client_stop_tx, client_stop_rx) = Shutdown::channel();
    let client_task = if config.client {
        start_client_role(
            &config,
            &data_dir,
            servers,
            tls.as_ref(),
            &mut components,
            &agent_info,
            client_stop_rx,
        )
        .await?
    } else {
        // No client role: a task that ends only when told to stop.
        let mut rx = client_stop_rx;
        tokio::spawn(async move {
            let _ = rx.wait().await;
        })
    };
    let mut running = Running {
        client_task,
        client_done: false,
        tasks,
    };

    // READY=1 once every role serves: the server's listeners are up
    // already; the client says when it is.
    let (ready_tx, ready_rx) = watch::channel(false);
    let announcer = tokio::spawn(announce_ready(components.clone(), ready_tx));
    let (watchdog_stop_tx, watchdog_stop_rx) = Shutdown::channel();
    let watchdog = tokio::spawn(crate::systemd::run_watchdog(
        components.clone(),
        ready_rx.clone(),
        watchdog_stop_rx,
    ));

    let failure = loop {
        tokio::select! {
            signal = signals.next() => match signal {
                Signal::Stop(name) => {
                    tracing::info!(signal = name, "shutting down; tasks keep running");
                    break None;
                }
                Signal::Reload => {
                    if let Some(t) = &tls {
                        reload_tls(t);
                    }
                    reload_log_level(&config, &log, &components, *ready_rx.borrow()).await;
                }
            },
            stopped = running.next_stop() => break stopped,
        }
    };
    announcer.abort();
    watchdog_stop_tx.shutdown();
    let _ = watchdog.await;
    crate::systemd::stopping();
    running.stop(client_stop_tx, shutdown_tx).await;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The agent's TLS as `config` sets it up, `None` when it is off.
fn agent_tls(config: &AgentConfig) -> Result<Option<std::sync::Arc<crate::tls::AgentTls>>> {
    let tls = config
        .security
        .tls_settings()
        .and_then(|s| s.map(crate::tls::AgentTls::new).transpose())
        .context("berth agent")?;
    if let Some(t) = &tls {
        tracing::info!(rpc = t.rpc, http = t.http, "TLS on");
    }
    Ok(tls)
}

/// What the HTTP API says of this agent (`/v1/agent/self`, its roles and
/// security), shared by the routes.
fn agent_info(
    config: &AgentConfig,
    data_dir: &Path,
) -> std::sync::Arc<crate::http::agent_api::AgentInfo> {
    std::sync::Arc::new(
        crate::http::agent_api::AgentInfo::new(
            config.server,
            config.client,
            data_dir.to_path_buf(),
            config.servers.clone(),
        )
        .with_security(&config.security),
    )
}

/// The servers the client dials: a client next to the server role dials
/// it; a client-only agent dials its servers, the first, and the next
/// when one fails.
fn servers_to_dial(
    config: &AgentConfig,
    local_rpc_addr: Option<std::net::SocketAddr>,
) -> Result<Vec<String>> {
    let servers: Vec<String> = match local_rpc_addr {
        Some(addr) => vec![format!("http://{addr}")],
        None => config
            .servers
            .iter()
            .map(|s| format!("http://{s}"))
            .collect(),
    };
    if servers.is_empty() {
        bail!("berth agent: the client has no servers to dial");
    }
    Ok(servers)
}

/// Starts the client role (restoring its allocs first) and runs it until
/// `stop`; the task it runs in.
async fn start_client_role(
    config: &AgentConfig,
    data_dir: &Path,
    servers: Vec<String>,
    tls: Option<&std::sync::Arc<crate::tls::AgentTls>>,
    components: &mut crate::systemd::Components,
    agent_info: &crate::http::agent_api::AgentInfo,
    stop: Shutdown,
) -> Result<tokio::task::JoinHandle<()>> {
    // The dial addresses carry http:// for tonic; TLS is the connector's.
    let shown: Vec<&str> = servers
        .iter()
        .map(|s| s.strip_prefix("http://").unwrap_or(s))
        .collect();
    let rpc_tls = tls.is_some_and(|t| t.rpc);
    tracing::info!(servers = ?shown, tls = rpc_tls, "client starting");
    warn_of_foreign_executors(data_dir);
    let mut client_config = config.client_config(data_dir.to_path_buf(), servers);
    client_config.tls = tls
        .cloned()
        .filter(|t| t.rpc)
        .map(|t| t as std::sync::Arc<dyn berth_client::servers::ServerTls>);
    // The client beside the server role is let in by it: a token of
    // one use, for the case that the servers do not know the node yet.
    if let (Some(server), None) = (&components.server, &client_config.intro_token) {
        if server.config().node_enrollment {
            let token = server
                .create_intro_token(Some("10m"), Some(1))
                .await
                .context("making the local client's introduction token")?;
            client_config.intro_token = Some(crate::config::ConfigSecret::new(token.secret_id));
        }
    }
    let client = Client::start(client_config, stop.clone())
        .await
        .context("starting the client")?;
    let acl_off_in_files = config.security.acl.enabled == Some(false) && !config.server;
    if acl_off_in_files && client.cluster_acl() == Some(true) {
        bail!(
            "berth agent: acl {{ enabled = false }} is set, but this client's servers enforce ACL \
             tokens (as they said before this start); a client of an ACL cluster checks tokens \
             on its own routes: remove the acl block or set enabled = true"
        );
    }
    if acl_off_in_files {
        tokio::spawn(warn_acl_overridden(client.cluster_acl_changes()));
    }
    crate::systemd::status("restoring allocs, then registering with the servers");
    components.client = Some(client.clone());
    let _ = agent_info.client_role.set(client.clone());
    Ok(tokio::spawn(client.run(stop)))
}

/// Says, each time the servers say they enforce ACL tokens, that this
/// client's `acl { enabled = false }` is overridden: it checks tokens
/// anyway.
async fn warn_acl_overridden(mut changes: watch::Receiver<Option<bool>>) {
    loop {
        if *changes.borrow_and_update() == Some(true) {
            tracing::error!(
                "acl {{ enabled = false }} is set, but the servers enforce ACL tokens: this client \
                 checks tokens on its routes anyway, and refuses to start with this config; \
                 remove the acl block or set enabled = true"
            );
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// Says READY=1 once every role serves: the server's listeners are up
/// already; the client says when it is.
async fn announce_ready(components: crate::systemd::Components, ready: watch::Sender<bool>) {
    if let Some(mut r) = components.client.as_ref().map(|c| c.ready()) {
        let _ = r.wait_for(|v| *v).await;
    }
    let status = components.status().await;
    tracing::info!(%status, "agent ready");
    crate::systemd::ready(&status);
    ready.send_replace(true);
}

/// The running roles: the client's task and the other components'.
struct Running {
    client_task: tokio::task::JoinHandle<()>,
    client_done: bool,
    tasks: tokio::task::JoinSet<Result<()>>,
}

impl Running {
    /// Waits until the client or a component stops by itself; the failure
    /// that stopped it, if it failed.
    async fn next_stop(&mut self) -> Option<anyhow::Error> {
        tokio::select! {
            r = &mut self.client_task => {
                self.client_done = true;
                match r {
                    Err(e) => Some(anyhow!("the client panicked: {e}")),
                    Ok(()) => {
                        tracing::warn!("the client stopped; shutting down");
                        None
                    }
                }
            }
            Some(r) = self.tasks.join_next() => match r {
                Ok(Ok(())) => {
                    tracing::warn!("an agent component stopped; shutting down");
                    None
                }
                Ok(Err(e)) => Some(e),
                Err(e) => Some(anyhow!("agent component panicked: {e}")),
            },
        }
    }

    /// Stops the client first (its last updates still reach the servers),
    /// then every other component, each within a bound.
    async fn stop(mut self, client_stop: ShutdownSender, shutdown: ShutdownSender) {
        client_stop.shutdown();
        if !self.client_done
            && tokio::time::timeout(Duration::from_secs(5), &mut self.client_task)
                .await
                .is_err()
        {
            tracing::warn!("the client did not stop within 5s; going on");
        }
        shutdown.shutdown();
        let drain = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_secs(10), drain)
            .await
            .is_err()
        {
            tracing::warn!("components did not stop within 10s; exiting anyway");
        }
    }
}
