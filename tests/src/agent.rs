//! [`Agent`]: one `berth agent` process (a server, a client) on its own
//! temp data dir, killed with everything it started on drop.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::process::{kill_and_unmount, path_with_bins, spawn_agent_with_env};
use crate::wait_for;

/// One `berth agent` process started with the given flags (a server, a
/// client) on its own temp data dir, its log kept there; on drop it is
/// killed with everything it started, and its mounts are unmounted.
pub struct Agent {
    pub data_dir: tempfile::TempDir,
    child: Option<Child>,
    log_path: PathBuf,
    argv: Vec<OsString>,
    /// Environment changes, kept on restarts (see `spawn_agent_with_env`).
    env: Vec<(String, Option<String>)>,
}

/// The agent config that turns raw_exec on.
pub const RAW_EXEC_ON: &str = "plugin \"raw_exec\" {\n  config {\n    enabled = true\n  }\n}\n";

impl Agent {
    /// Starts `berth agent -data-dir <temp dir> ARGS...`; does not wait
    /// for anything.
    pub fn start(args: &[&str]) -> Result<Agent> {
        Self::start_with_env(args, &[])
    }

    /// [`Agent::start`] with environment changes: `(NAME, Some(value))`
    /// sets NAME, `(NAME, None)` removes it; kept on restarts.
    pub fn start_with_env(args: &[&str], env: &[(&str, Option<&str>)]) -> Result<Agent> {
        Self::start_as(args, env, true, None)
    }

    /// [`Agent::start`] with its data dir on a filesystem of its own of
    /// `mib` MiB (an ext4 image, loop-mounted), which a test can fill.
    pub fn start_on_disk(args: &[&str], mib: u64) -> Result<Agent> {
        Self::start_as(args, &[], true, Some(mib))
    }

    /// [`Agent::start`] of a client that keeps raw_exec off, as a client
    /// agent has it unless its config turns it on.
    pub fn start_without_raw_exec(args: &[&str]) -> Result<Agent> {
        Self::start_as(args, &[], false, None)
    }

    /// Starts the agent; its client role, if it has one, runs raw_exec
    /// tasks, as the tests' jobs are, when `raw_exec` (one more config
    /// file turns it on; `-dev`, which takes no file, has it on).
    fn start_as(
        args: &[&str],
        env: &[(&str, Option<&str>)],
        raw_exec: bool,
        disk_mib: Option<u64>,
    ) -> Result<Agent> {
        let data_dir = tempfile::Builder::new().prefix("berth-e2e-").tempdir()?;
        if let Some(mib) = disk_mib {
            mount_disk(data_dir.path(), mib)?;
        }
        let log_path = data_dir.path().join("agent.log");
        let mut argv: Vec<OsString> = vec!["-data-dir".into(), data_dir.path().join("data").into()];
        if raw_exec && !args.contains(&"-dev") {
            let file = data_dir.path().join("raw_exec.hcl");
            std::fs::write(&file, RAW_EXEC_ON)?;
            argv.extend(["-config".into(), file.into_os_string()]);
        }
        argv.extend(args.iter().map(OsString::from));
        if args.contains(&"-client") || args.contains(&"-dev") {
            argv.extend([
                "-cgroup-parent".into(),
                crate::process::cgroup_parent_of(data_dir.path()).into(),
            ]);
        }
        let env: Vec<(String, Option<String>)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
            .collect();
        let child = spawn_agent_with_env(&argv, &path_with_bins(), &log_path, &env)?;
        Ok(Agent {
            data_dir,
            child: Some(child),
            log_path,
            argv,
            env,
        })
    }

    /// The cgroup the agent's `exec` tasks' cgroups are under (one of its
    /// own when it has a client role).
    pub fn cgroup_parent(&self) -> String {
        crate::process::cgroup_parent_of(self.data_dir.path())
    }

    /// The agent's data dir (below the temp dir that also holds its log).
    pub fn data_path(&self) -> PathBuf {
        self.data_dir.path().join("data")
    }

    /// The agent process's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` to the agent process (not to its tasks).
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> Result<()> {
        let pid = self.pid().context("the agent is not running")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
            .with_context(|| format!("sending {signal} to the agent"))
    }

    /// Kills the agent process alone (SIGKILL), as a crash would; its
    /// tasks keep running.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().context("killing the agent")?;
            c.wait()?;
        }
        Ok(())
    }

    /// Stops the agent with SIGTERM and waits for it to exit (at most
    /// 30 s, then SIGKILL); its tasks keep running.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut c) = self.child.take() else {
            return Ok(());
        };
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.try_wait()?.is_none() {
            if Instant::now() >= deadline {
                let _ = c.kill();
                c.wait()?;
                bail!("the agent did not exit within 30s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the agent again with the same flags and data dir (after
    /// [`Agent::stop`] or [`Agent::kill`]).
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("the agent still runs");
        }
        self.child = Some(spawn_agent_with_env(
            &self.argv,
            &path_with_bins(),
            &self.log_path,
            &self.env,
        )?);
        Ok(())
    }

    /// Starts the agent again as [`Agent::start_again`] does, with
    /// `config` (HCL) added as one more `-config` file.
    pub fn start_again_with_config(&mut self, config: &str) -> Result<()> {
        let file = self
            .data_dir
            .path()
            .join(format!("extra-{}.hcl", self.argv.len()));
        std::fs::write(&file, config)?;
        self.argv.extend(["-config".into(), file.into_os_string()]);
        self.start_again()
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// How long the agent's log is now (bytes): a mark for
    /// [`Agent::log_since`].
    pub fn log_len(&self) -> u64 {
        std::fs::metadata(&self.log_path).map_or(0, |m| m.len())
    }

    /// The agent's log from byte `mark` on.
    pub fn log_since(&self, mark: u64) -> String {
        use std::io::{Read, Seek};
        let mut text = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.log_path) {
            if f.seek(std::io::SeekFrom::Start(mark)).is_ok() {
                let _ = f.read_to_end(&mut text);
            }
        }
        String::from_utf8_lossy(&text).into_owned()
    }

    /// An error with the log when the agent has exited.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(c) = self.child.as_mut() {
            if let Some(status) = c.try_wait()? {
                bail!("berth agent exited ({status}); log:\n{}", self.log());
            }
        }
        Ok(())
    }
}

impl Agent {
    /// The agent protocol address a server agent logged it listens on
    /// (`rpc_addr=`), once it has.
    pub fn logged_rpc_addr(&mut self) -> Result<String> {
        wait_for(
            "the server's agent protocol address",
            Duration::from_secs(30),
            || {
                self.check_running()?;
                Ok(self
                    .log()
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("rpc_addr="))
                    .map(str::to_string))
            },
        )
    }

    /// Starts `berth agent -server` with its HTTP API on `http_addr` and
    /// its agent protocol on a free port; the agent and that address.
    pub fn start_server(http_addr: &str) -> Result<(Agent, String)> {
        let mut server = Agent::start(&[
            "-server",
            "-http-addr",
            http_addr,
            "-rpc-addr",
            "127.0.0.1:0",
        ])?;
        let rpc = server.logged_rpc_addr()?;
        Ok((server, rpc))
    }

    /// Starts `berth agent ARGS... -client` as node `node` of the servers at
    /// `rpc`, with its HTTP API on `http_addr`.
    pub fn start_client(args: &[&str], rpc: &str, node: &str, http_addr: &str) -> Result<Agent> {
        let mut all = args.to_vec();
        all.extend([
            "-client",
            "-servers",
            rpc,
            "-node",
            node,
            "-http-addr",
            http_addr,
        ]);
        Agent::start(&all)
    }
}

/// An ext4 filesystem of `mib` MiB (an image in `dir`) mounted at
/// `dir/data`; the agent's drop unmounts it, and the loop device goes with
/// the mount.
fn mount_disk(dir: &std::path::Path, mib: u64) -> Result<()> {
    let image = dir.join("disk.img");
    std::fs::File::create(&image)?.set_len(mib << 20)?;
    let run = |cmd: &mut std::process::Command| -> Result<()> {
        let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
        if !out.status.success() {
            bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    run(std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0"])
        .arg(&image))?;
    let mount_point = dir.join("data");
    std::fs::create_dir_all(&mount_point)?;
    run(std::process::Command::new("mount")
        .args(["-o", "loop,discard"])
        .arg(&image)
        .arg(&mount_point))
}

impl Drop for Agent {
    fn drop(&mut self) {
        kill_and_unmount(&mut self.child, self.data_dir.path());
    }
}
