//! The signals the agent acts on: SIGINT and SIGTERM stop it, SIGHUP
//! reloads the TLS files and the log level.

use super::flags::AgentConfig;

/// The signals the agent acts on.
pub(super) struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

/// What a signal asks of the agent.
pub(super) enum Signal {
    /// SIGTERM or SIGINT: shut down, leaving the tasks running.
    Stop(&'static str),
    /// SIGHUP: reload the log level.
    Reload,
}

impl Signals {
    pub(super) fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// The next signal. A stream that ends (it does not while the runtime
    /// lives) counts as a stop.
    pub(super) async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::Stop("SIGTERM"),
            _ = self.int.recv() => Signal::Stop("SIGINT"),
            r = self.hup.recv() => match r {
                Some(()) => Signal::Reload,
                None => Signal::Stop("SIGHUP"),
            },
        }
    }
}

/// SIGHUP: reads the TLS certificate, key and CA again. New connections
/// use them; open ones keep theirs. Files that do not load are logged and
/// the ones in force kept.
pub(super) fn reload_tls(tls: &crate::tls::AgentTls) {
    match tls.reload() {
        Ok(()) => tracing::info!("SIGHUP: TLS certificates reloaded; new connections use them"),
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: the TLS files do not load; the certificates in force stay")
        }
    }
}

/// SIGHUP: reads the config files again and applies their `log_level`
/// (the `-log-level` flag, when given, stays in force). Files that no
/// longer read are logged and the level in force kept; other keys are not
/// applied, and a change to them is logged as needing a restart. Tells
/// systemd `RELOADING=1`, then `READY=1` when the agent was ready.
pub(super) async fn reload_log_level(
    config: &AgentConfig,
    log: &crate::logging::LogControl,
    components: &crate::systemd::Components,
    ready: bool,
) {
    crate::systemd::reloading();
    let level = if let Some(flag) = &config.log_level_flag {
        tracing::info!(level = %flag, "SIGHUP: the log level is set by -log-level; it stays");
        Some(Some(flag.clone()))
    } else if config.config_paths.is_empty() {
        tracing::info!("SIGHUP: the agent runs from no config file; nothing to reload");
        None
    } else {
        match crate::config::read_merged(&config.config_paths) {
            Ok((_, file)) => {
                let others_changed = config.files_at_start.as_ref().is_some_and(|old| {
                    let mut old = old.clone();
                    old.log_level = file.log_level.clone();
                    old != file
                });
                if others_changed {
                    tracing::warn!("SIGHUP: config keys other than log_level changed; they take effect at the next restart");
                }
                Some(file.log_level)
            }
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: the config files do not read; the log level stays");
                None
            }
        }
    };
    if let Some(level) = level {
        match log.set_level(level.as_deref()) {
            Ok(crate::logging::LevelChange::Changed { from, to }) => {
                tracing::info!(%from, %to, "SIGHUP: log level changed")
            }
            Ok(crate::logging::LevelChange::Unchanged(l)) => {
                tracing::info!(level = %l, "SIGHUP: log level unchanged")
            }
            Ok(crate::logging::LevelChange::SetByEnvironment(f)) => {
                tracing::info!(filter = %f, "SIGHUP: BERTH_LOG or RUST_LOG sets the log filter; it stays")
            }
            Err(e) => tracing::error!(error = %e, "SIGHUP: the log level stays"),
        }
    }
    if ready {
        crate::systemd::ready(&components.status().await);
    } else {
        crate::systemd::status("restoring allocs, then registering with the servers");
    }
}
