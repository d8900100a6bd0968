//! Logging set-up and the systemd readiness notification.

/// Logs go to stderr; `BERTH_LOG` (or `RUST_LOG`) sets the filter.
pub fn init() {
    let filter = std::env::var("BERTH_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| "info".to_string());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
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
