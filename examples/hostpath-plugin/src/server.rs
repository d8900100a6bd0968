//! Serving the plugin on its unix socket until SIGTERM or SIGINT.

use berth_sync::MutexExt;
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use berth_proto::csi::v1::controller_server::ControllerServer;
use berth_proto::csi::v1::identity_server::IdentityServer;
use berth_proto::csi::v1::node_server::NodeServer;
use tokio::net::UnixListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;
use tokio_stream::wrappers::UnixListenerStream;

use crate::config::Config;
use crate::plugin::{Plugin, PLUGIN_NAME, PLUGIN_VERSION};

/// How long in-flight calls get to finish after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long connections get to flush the last answers once no call is in
/// flight any more. Idle connections a CO keeps open do not hold shutdown up
/// any longer than this.
const FLUSH_GRACE: Duration = Duration::from_millis(500);

/// Runs the plugin until SIGTERM or SIGINT, then removes its socket.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    // Listen for signals before the socket appears, so none is missed.
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;

    let plugin = Plugin::new(&config).context("preparing the state directory")?;
    let socket = Socket::bind(&config.socket_path)?;
    tracing::info!(
        name = PLUGIN_NAME,
        version = PLUGIN_VERSION,
        endpoint = %config.socket_path.display(),
        state_dir = %plugin.state_dir().display(),
        node_id = plugin.node_id(),
        enable_attach = plugin.enable_attach(),
        "serving CSI"
    );

    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let mut server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(plugin.clone()))
            .add_service(ControllerServer::new(plugin.clone()))
            .add_service(NodeServer::new(plugin.clone()))
            .serve_with_incoming_shutdown(socket.incoming()?, async {
                let _ = stop_rx.await;
            }),
    );

    let signal_name = tokio::select! {
        result = &mut server => {
            // The server stopped by itself: that is a failure.
            socket.remove();
            result.context("server task failed")?.context("serving CSI")?;
            bail!("server stopped unexpectedly");
        }
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    };
    tracing::info!(signal = signal_name, "shutting down");
    // Stop accepting connections and calls, let the calls in flight finish,
    // give their answers a moment to go out, then stop.
    let _ = stop_tx.send(());
    let drained = async {
        if tokio::time::timeout(SHUTDOWN_GRACE, plugin.idle())
            .await
            .is_err()
        {
            tracing::warn!(grace = ?SHUTDOWN_GRACE, "calls still in flight; stopping anyway");
            return None;
        }
        tokio::time::timeout(FLUSH_GRACE, &mut server).await.ok()
    };
    let result = match drained.await {
        Some(joined) => joined
            .context("server task failed")
            .and_then(|r| r.context("serving CSI")),
        None => {
            server.abort();
            Ok(())
        }
    };
    socket.remove();
    tracing::info!("stopped");
    result
}

/// The listening socket, remembered by inode so that shutdown removes only
/// the socket this process created.
struct Socket {
    path: PathBuf,
    listener: std::sync::Mutex<Option<UnixListener>>,
    identity: (u64, u64),
}

impl Socket {
    fn bind(path: &Path) -> anyhow::Result<Self> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)
                .with_context(|| format!("creating socket directory {}", parent.display()))?;
        }
        match fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                tracing::info!(path = %path.display(), "removing stale socket");
                fs::remove_file(path)
                    .with_context(|| format!("removing stale socket {}", path.display()))?;
            }
            Ok(_) => bail!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("inspecting {}", path.display()));
            }
        }
        let listener = UnixListener::bind(path)
            .with_context(|| format!("binding unix socket {}", path.display()))?;
        let meta = fs::metadata(path).with_context(|| format!("inspecting {}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            listener: std::sync::Mutex::new(Some(listener)),
            identity: (meta.dev(), meta.ino()),
        })
    }

    fn incoming(&self) -> anyhow::Result<UnixListenerStream> {
        let listener = self
            .listener
            .locked()
            .take()
            .context("socket already in use")?;
        Ok(UnixListenerStream::new(listener))
    }

    /// Removes the socket file if it is still ours.
    fn remove(&self) {
        match fs::symlink_metadata(&self.path) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.identity => {
                if let Err(e) = fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "could not remove socket");
                }
            }
            Ok(_) => tracing::info!(path = %self.path.display(), "socket was replaced; leaving it"),
            Err(_) => {}
        }
    }
}
