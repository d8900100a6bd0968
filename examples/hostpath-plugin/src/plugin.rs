//! The plugin object shared by the Identity, Controller and Node services.

use std::collections::BTreeMap;
use std::fs;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use berth_proto::csi::v1::Topology;
use tokio::sync::Notify;
use tonic::{Code, Response, Status};

use crate::config::Config;
use crate::error::Error;
use crate::faults::Faults;
use crate::locks::{VolumeGuard, VolumeLocks};
use crate::state::{self, Store, VolumeRecord, VOLUMES_DIR};

/// The name reported by GetPluginInfo.
pub const PLUGIN_NAME: &str = "hostpath.csi.berth.dev";
/// The version reported by GetPluginInfo.
pub const PLUGIN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The plugin: cheap to clone, one per server.
#[derive(Debug, Clone)]
pub struct Plugin {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Canonical state directory.
    state_dir: PathBuf,
    node_id: String,
    enable_attach: bool,
    /// `--stage-noop`.
    stage_noop: bool,
    /// The topology segments this instance serves; empty for none.
    topology: BTreeMap<String, String>,
    store: Store,
    locks: VolumeLocks,
    faults: Faults,
    in_flight: InFlight,
}

/// Counts the calls being worked on, so shutdown can wait for them.
#[derive(Debug, Default)]
struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

/// One call being worked on; counted out on drop.
struct InFlightGuard(Arc<Inner>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.in_flight.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.in_flight.idle.notify_waiters();
        }
    }
}

impl Plugin {
    /// Prepares the state directory and loads the saved state.
    pub fn new(config: &Config) -> Result<Self, Error> {
        let volumes = config.state_dir.join(VOLUMES_DIR);
        fs::create_dir_all(&volumes).map_err(Error::io("creating", &volumes))?;
        let state_dir = fs::canonicalize(&config.state_dir)
            .map_err(Error::io("resolving", &config.state_dir))?;
        let store = Store::open(&state_dir)?;
        // Make this node known to every instance sharing the state
        // directory, so that a controller can publish volumes to it.
        // Its topology goes with it, so that a controller can tell where
        // the node is.
        let (node_id, topology) = (config.node_id.clone(), config.topology.clone());
        store.update_blocking(|s| {
            if topology.is_empty() {
                s.node_topology.remove(&node_id);
            } else {
                s.node_topology.insert(node_id.clone(), topology);
            }
            s.nodes.insert(node_id);
            Ok(())
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                state_dir,
                node_id: config.node_id.clone(),
                enable_attach: config.enable_attach,
                stage_noop: config.stage_noop,
                topology: config.topology.clone(),
                store,
                locks: VolumeLocks::default(),
                faults: Faults::new(&config.faults),
                in_flight: InFlight::default(),
            }),
        })
    }

    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    pub fn enable_attach(&self) -> bool {
        self.inner.enable_attach
    }

    /// Whether NodeStageVolume of a directory volume mounts nothing
    /// (`--stage-noop`).
    pub fn stage_noop(&self) -> bool {
        self.inner.stage_noop
    }

    /// The topology segments this instance serves (`--topology`); empty
    /// when it reports none.
    pub fn topology(&self) -> &BTreeMap<String, String> {
        &self.inner.topology
    }

    /// The topology NodeGetInfo reports: none without `--topology`.
    pub fn accessible_topology(&self) -> Option<Topology> {
        (!self.inner.topology.is_empty()).then(|| Topology {
            segments: self.inner.topology.clone().into_iter().collect(),
        })
    }

    /// Checks that this instance may use `volume`: its segments satisfy
    /// the volume's recorded topology (`FAILED_PRECONDITION` otherwise).
    pub fn check_accessible(&self, volume: &VolumeRecord) -> Result<(), Error> {
        state::check_accessible(volume, self.node_id(), self.topology())
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    pub fn state_dir(&self) -> &Path {
        &self.inner.state_dir
    }

    /// The directory backing a volume. `volume_id` must satisfy
    /// [`state::is_volume_id`].
    pub fn volume_dir(&self, volume_id: &str) -> PathBuf {
        debug_assert!(state::is_volume_id(volume_id));
        state::volume_dir(&self.inner.state_dir, volume_id)
    }

    /// Starts an operation on a volume: claims the volume (or answers
    /// `ABORTED`), then applies any injected delay or failure while holding it.
    pub async fn begin(&self, rpc: &'static str, volume_id: &str) -> Result<VolumeGuard, Error> {
        let guard = self.inner.locks.try_lock(volume_id)?;
        tracing::info!(rpc = %rpc, volume_id, "call");
        self.inject(rpc).await?;
        Ok(guard)
    }

    /// Applies any injected delay or failure of `rpc`.
    pub async fn inject(&self, rpc: &'static str) -> Result<(), Error> {
        self.inner.faults.inject(rpc).await
    }

    /// The record of a volume, as the shared state has it now (whichever
    /// instance created it).
    pub async fn lookup(&self, volume_id: &str) -> Result<VolumeRecord, Error> {
        let not_found = || Error::NotFound(format!("volume {volume_id} does not exist"));
        if !state::is_volume_id(volume_id) {
            return Err(not_found());
        }
        let id = volume_id.to_owned();
        self.store()
            .read(move |s| s.volumes.get(&id).cloned())
            .await?
            .ok_or_else(not_found)
    }

    /// Runs `op` to completion on its own task, so that a client giving up
    /// on the call neither cuts a mount or state change in half nor frees
    /// the volume before the work is done; then answers the call.
    pub async fn call<T, F, Fut>(&self, rpc: &'static str, op: F) -> Result<Response<T>, Status>
    where
        F: FnOnce(Plugin) -> Fut,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
        T: Send + 'static,
    {
        self.inner.in_flight.count.fetch_add(1, Ordering::AcqRel);
        let counted = InFlightGuard(self.inner.clone());
        let work = op(self.clone());
        let task = async move {
            let _counted = counted;
            work.await
        };
        let result = match tokio::spawn(task).await {
            Ok(result) => result,
            Err(e) => Err(Error::Internal(format!("{rpc} task failed: {e}"))),
        };
        self.inner.faults.hold_after(rpc).await;
        respond(rpc, result)
    }
}

impl Plugin {
    /// Resolves once no call is being worked on.
    pub async fn idle(&self) {
        let in_flight = &self.inner.in_flight;
        loop {
            let notified = in_flight.idle.notified();
            if in_flight.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Turns an operation's result into the gRPC answer, logging failures.
pub fn respond<T>(rpc: &'static str, result: Result<T, Error>) -> Result<Response<T>, Status> {
    match result {
        Ok(value) => Ok(Response::new(value)),
        Err(err) => {
            match err.code() {
                Code::Internal | Code::Unknown | Code::DataLoss => {
                    tracing::error!(rpc, error = %err, "call failed")
                }
                code => tracing::warn!(rpc, ?code, error = %err, "call failed"),
            }
            Err(err.into())
        }
    }
}

/// Runs blocking file-system work off the async runtime.
pub async fn blocking<T, F>(work: F) -> Result<T, Error>
where
    F: FnOnce() -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}
