//! The harness shared by the plugin's integration tests: the real
//! `hostpath-plugin` binary on a temporary unix socket, a gRPC channel to it,
//! and requests and mount-table helpers. Dropping a `PluginProcess` kills the
//! plugin, unmounts what is left under its directory and detaches the loop
//! devices of the images there.

// Each test binary uses part of the harness.
#![allow(dead_code)]

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_proto::csi::v1::controller_client::ControllerClient;
use berth_proto::csi::v1::identity_client::IdentityClient;
use berth_proto::csi::v1::node_client::NodeClient;
use berth_proto::csi::v1::volume_capability::access_mode::Mode;
use berth_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use berth_proto::csi::v1::*;
use hyper_util::rt::TokioIo;
use nix::mount::{umount2, MntFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Code;
use tower::service_fn;

pub const BIN: &str = env!("CARGO_BIN_EXE_hostpath-plugin");
pub const DEADLINE: Duration = Duration::from_secs(20);
pub const MIB: i64 = 1 << 20;

/// A running plugin and its temporary directory. Dropping it kills the
/// plugin and unmounts whatever is still mounted under the directory, so a
/// failing test leaves nothing behind.
pub struct PluginProcess {
    pub child: Option<Child>,
    pub root: PathBuf,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    // Dropped last, after the cleanup in `Drop::drop`; shared with the
    // instances started by `start_sibling`.
    _dir: Arc<tempfile::TempDir>,
}

impl PluginProcess {
    pub fn start(args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = fs::canonicalize(dir.path()).expect("canonical temp dir");
        let mut plugin = Self {
            child: None,
            socket: root.join("run/csi.sock"),
            state_dir: root.join("state"),
            log: root.join("plugin.log"),
            root,
            _dir: Arc::new(dir),
        };
        plugin.spawn(args);
        plugin
    }

    /// Starts another instance on the same state directory (storage shared
    /// by several nodes), with its own socket `<root>/<name>/csi.sock` and
    /// log `<root>/<name>.log`.
    pub fn start_sibling(&self, name: &str, args: &[&str]) -> Self {
        let mut plugin = Self {
            child: None,
            root: self.root.clone(),
            socket: self.root.join(name).join("csi.sock"),
            state_dir: self.state_dir.clone(),
            log: self.root.join(format!("{name}.log")),
            _dir: self._dir.clone(),
        };
        plugin.spawn(args);
        plugin
    }

    pub fn spawn(&mut self, args: &[&str]) {
        assert!(self.child.is_none(), "plugin already running");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let child = Command::new(BIN)
            .arg("--endpoint")
            .arg(format!("unix://{}", self.socket.display()))
            .arg(format!("--state-dir={}", self.state_dir.display()))
            .args(args)
            .env("RUST_LOG", "debug")
            .env_remove("CSI_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start hostpath-plugin");
        self.child = Some(child);
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// Waits for the socket to accept connections, then opens a channel.
    pub async fn connect(&mut self) -> Channel {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("plugin exited early with {status}:\n{}", self.logs());
            }
            if UnixStream::connect(&self.socket).await.is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "socket {} never came up:\n{}",
                self.socket.display(),
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let socket = self.socket.clone();
        Endpoint::try_from("http://[::1]:50051")
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .timeout(DEADLINE)
            .connect_with_connector(service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
            }))
            .await
            .expect("connect to the plugin")
    }

    /// Connects, and opens a controller and a node client on the channel.
    pub async fn clients(&mut self) -> (ControllerClient<Channel>, NodeClient<Channel>) {
        let channel = self.connect().await;
        (
            ControllerClient::new(channel.clone()),
            NodeClient::new(channel),
        )
    }

    /// Sends SIGTERM and waits for the plugin to exit.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("plugin running");
        kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).expect("SIGTERM");
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("plugin ignored SIGTERM:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Deepest first; lazily, so a busy mount cannot wedge the cleanup.
        for _ in 0..8 {
            let mut mounts = mounts_under(&self.root);
            if mounts.is_empty() {
                break;
            }
            mounts.sort_by_key(|m| std::cmp::Reverse(m.0.components().count()));
            for (mount_point, _) in mounts {
                let _ = umount2(&mount_point, MntFlags::MNT_DETACH);
            }
        }
        // The last instance on the directory detaches the loop devices of
        // its images (one still held by a lazily unmounted filesystem is
        // cleared by the kernel on its last close).
        if Arc::strong_count(&self._dir) == 1 {
            for dev in loops_backed_under(&self.root) {
                let _ = Command::new("losetup").arg("-d").arg(dev).status();
            }
        }
        if std::thread::panicking() {
            let _ = writeln!(io::stderr(), "--- plugin log ---\n{}", self.logs());
        }
    }
}

/// The loop devices whose backing file lies under `dir`, from sysfs.
pub fn loops_backed_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(devices) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    devices
        .flatten()
        .filter_map(|device| {
            let backing = fs::read_to_string(device.path().join("loop/backing_file")).ok()?;
            Path::new(backing.trim_end())
                .starts_with(dir)
                .then(|| Path::new("/dev").join(device.file_name()))
        })
        .collect()
}

/// Mount points (with their options) at or below `dir`, read straight from
/// the kernel's mount table.
pub fn mounts_under(dir: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let table = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    table
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let mount_point = unescape(fields.nth(4)?);
            let options = fields.next()?.split(',').map(str::to_owned).collect();
            Some((PathBuf::from(mount_point), options))
        })
        .filter(|(mount_point, _)| mount_point.starts_with(dir))
        .collect()
}

pub fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

pub fn mount_options(dir: &Path, mount_point: &Path) -> Option<Vec<String>> {
    mounts_under(dir)
        .into_iter()
        .rev()
        .find(|(m, _)| m == mount_point)
        .map(|(_, options)| options)
}

/// One plugin instance and its clients.
pub struct Instance {
    pub process: PluginProcess,
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

impl Instance {
    pub async fn connect(mut process: PluginProcess) -> Self {
        let channel = process.connect().await;
        Self {
            process,
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel),
        }
    }
}

/// Whether each tool runs and succeeds with its argument; prints why not.
pub fn tools_usable(tools: &[(&str, &str)]) -> bool {
    for (tool, arg) in tools {
        match Command::new(tool).arg(arg).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                eprintln!(
                    "skipping: {tool} {arg} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                return false;
            }
            Err(e) => {
                eprintln!("skipping: {tool} cannot run: {e}");
                return false;
            }
        }
    }
    true
}

/// Unpublishes the volume from the target, then unstages it.
pub async fn unpublish_and_unstage(
    node: &mut NodeClient<Channel>,
    volume_id: &str,
    staging: &Path,
    target: &Path,
) {
    node.node_unpublish_volume(unpublish_request(volume_id, target))
        .await
        .expect("unpublish");
    node.node_unstage_volume(unstage_request(volume_id, staging))
        .await
        .expect("unstage");
}

/// The controller RPCs the plugin advertises.
pub async fn controller_rpcs(
    controller: &mut ControllerClient<Channel>,
) -> Vec<controller_service_capability::rpc::Type> {
    controller
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(controller_service_capability::Type::Rpc(r)) => r.r#type.try_into().ok(),
            None => None,
        })
        .collect()
}

pub fn capability(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

pub fn create_request(name: &str, required: i64, limit: i64) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.to_owned(),
        capacity_range: Some(CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
        volume_capabilities: vec![capability(Mode::SingleNodeWriter)],
        secrets: [("password".to_owned(), "hunter2".to_owned())].into(),
        ..Default::default()
    }
}

pub fn stage_request(volume_id: &str, staging: &Path) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: volume_id.to_owned(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(capability(Mode::SingleNodeWriter)),
        ..Default::default()
    }
}

pub fn publish_request(
    volume_id: &str,
    staging: &Path,
    target: &Path,
    readonly: bool,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.to_owned(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(capability(Mode::SingleNodeWriter)),
        readonly,
        ..Default::default()
    }
}

pub fn unpublish_request(volume_id: &str, target: &Path) -> NodeUnpublishVolumeRequest {
    NodeUnpublishVolumeRequest {
        volume_id: volume_id.to_owned(),
        target_path: target.display().to_string(),
    }
}

pub fn unstage_request(volume_id: &str, staging: &Path) -> NodeUnstageVolumeRequest {
    NodeUnstageVolumeRequest {
        volume_id: volume_id.to_owned(),
        staging_target_path: staging.display().to_string(),
    }
}

pub fn code<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> Code {
    result.expect_err("the call should fail").code()
}
