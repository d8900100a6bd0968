//! Logging set-up and the systemd readiness notification.

/// Logs go to stderr; `BERTH_LOG` (or `RUST_LOG`) sets the filter, else
/// `default_level` (the config's `log_level`), else `info`.
pub fn init(default_level: Option<&str>) {
    let filter = filter(
        std::env::var("BERTH_LOG")
            .or_else(|_| std::env::var("RUST_LOG"))
            .ok(),
        default_level,
    );
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// The log filter: the environment's, else the config's level, else
/// `info`.
fn filter(from_env: Option<String>, default_level: Option<&str>) -> String {
    from_env
        .or_else(|| default_level.map(str::to_string))
        .unwrap_or_else(|| "info".to_string())
}

/// Tells systemd (`Type=notify`) that the agent is ready, when it runs
/// under systemd.
pub fn notify_systemd_ready() {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot notify systemd");
            return;
        }
    };
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    let result = if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)
            .and_then(|addr| sock.send_to_addr(b"READY=1", &addr))
    } else {
        sock.send_to(b"READY=1", &path)
    };
    if let Err(e) = result {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}

#[cfg(test)]
mod tests {
    use super::filter;

    #[test]
    fn log_level_sets_the_filter_unless_the_environment_does() {
        assert_eq!(filter(None, None), "info");
        assert_eq!(filter(None, Some("debug")), "debug");
        assert_eq!(filter(Some("warn".into()), Some("debug")), "warn");
    }
}
