//! [`DevAgent`]: a `berth agent -dev` on a temp data dir, with the CLI and
//! API run against it, cleaned up on drop.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::process::{kill_and_unmount, path_with_bins, spawn_agent};
use crate::{
    api_get_at, binary, example, free_port, http_at, processes_with_cmdline, strs, wait_for,
    HttpAnswer,
};

/// Waits up to 60 s for the only alloc of `job` to run, and answers its
/// full status.
pub fn wait_alloc_running(agent: &DevAgent, job: &str) -> Result<Value> {
    wait_for(
        &format!("the {job} alloc to run"),
        Duration::from_secs(60),
        || {
            let a = only_alloc(agent, job)?;
            Ok((a["client_status"] == "running").then_some(a))
        },
    )
    .with_context(|| agent.log())
}

/// The full status of the only alloc of `job`.
pub fn only_alloc(agent: &DevAgent, job: &str) -> Result<Value> {
    let status = agent.cli_json(&["job", "status", job])?;
    match status["allocations"].as_array().map(Vec::as_slice) {
        Some([a]) => agent.cli_json(&["alloc", "status", a["id"].as_str().unwrap_or_default()]),
        other => bail!("job {job} should have one alloc, has {other:?}"),
    }
}

/// A running dev agent and everything it started.
pub struct DevAgent {
    pub data_dir: tempfile::TempDir,
    pub http_addr: String,
    port: u16,
    child: Option<Child>,
    /// Binaries tasks find on PATH (the example plugin).
    path_env: String,
    log_path: PathBuf,
    /// Flags given to `berth agent -dev` besides the data dir and address.
    extra_args: Vec<String>,
    /// The `berth` binary it runs.
    program: PathBuf,
    /// With `-acl-enabled`: the management token its ACL bootstrap made,
    /// which [`Self::cli`] presents.
    pub token: Option<String>,
}

/// How many ports a dev agent is started on before its start fails.
const PORT_ATTEMPTS: usize = 3;

impl DevAgent {
    /// Starts `berth agent -dev` on a fresh data dir and waits until its
    /// node is ready.
    pub fn start() -> Result<DevAgent> {
        Self::start_with_args(&[])
    }

    /// [`Self::start`] with more flags for `berth agent -dev` (kept on
    /// restarts).
    pub fn start_with_args(extra_args: &[&str]) -> Result<DevAgent> {
        Self::start_program(&binary("berth"), extra_args)
    }

    /// [`Self::start_with_args`] running the agent binary `program`
    /// instead of the workspace's `berth` (e.g. a copy of it elsewhere).
    pub fn start_program(program: &Path, extra_args: &[&str]) -> Result<DevAgent> {
        let data_dir = tempfile::Builder::new().prefix("berth-e2e-").tempdir()?;
        let port = free_port();
        let http_addr = format!("http://127.0.0.1:{port}");
        let path_env = path_with_bins();
        let log_path = data_dir.path().join("agent.log");
        let mut agent = DevAgent {
            data_dir,
            http_addr,
            port,
            child: None,
            path_env,
            log_path,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            program: program.to_path_buf(),
            token: None,
        };
        // Another test may take the free port before the agent binds it:
        // then the agent exits saying so, and starts again on another.
        let mut attempts = 0;
        loop {
            agent.spawn(agent.port)?;
            match agent.wait_ready() {
                Ok(()) => return Ok(agent),
                Err(e) if attempts + 1 < PORT_ATTEMPTS && agent.lost_its_port() => {
                    attempts += 1;
                    agent.child = None;
                    agent.port = free_port();
                    agent.http_addr = format!("http://127.0.0.1:{}", agent.port);
                    eprintln!("the dev agent's port was taken ({e:#}); starting it on another");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the agent has exited because its HTTP port was taken.
    fn lost_its_port(&mut self) -> bool {
        let exited = self
            .child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_some());
        exited && self.log().contains("Address already in use")
    }

    fn spawn(&mut self, port: u16) -> Result<()> {
        let mut args: Vec<OsString> = vec!["-dev".into(), "-data-dir".into()];
        args.push(self.data_dir.path().into());
        args.push("-http-addr".into());
        args.push(format!("127.0.0.1:{port}").into());
        args.extend(self.extra_args.iter().map(OsString::from));
        args.push("-cgroup-parent".into());
        args.push(crate::process::cgroup_parent_of(self.data_dir.path()).into());
        self.child = Some(spawn_agent(
            &self.program,
            &args,
            &self.path_env,
            &self.log_path,
        )?);
        Ok(())
    }

    fn wait_ready(&mut self) -> Result<()> {
        if self.token.is_none() && self.extra_args.iter().any(|a| a == "-acl-enabled") {
            let token = wait_for("the ACL bootstrap", Duration::from_secs(30), || {
                if let Some(c) = self.child.as_mut() {
                    if let Some(status) = c.try_wait()? {
                        bail!("berth agent exited early ({status}); log:\n{}", self.log());
                    }
                }
                let out = self.cli(&["acl", "bootstrap", "-json"])?;
                if !out.status.success() {
                    return Ok(None);
                }
                let v: Value = serde_json::from_slice(&out.stdout)?;
                Ok(v["secret_id"].as_str().map(str::to_string))
            })?;
            self.token = Some(token);
        }
        wait_for("the dev node to be ready", Duration::from_secs(30), || {
            if let Some(c) = self.child.as_mut() {
                if let Some(status) = c.try_wait()? {
                    bail!("berth agent exited early ({status}); log:\n{}", self.log());
                }
            }
            let out = self.cli(&["node", "status", "-json"])?;
            if !out.status.success() {
                return Ok(None);
            }
            let v: Value = serde_json::from_slice(&out.stdout)?;
            let ready = v
                .as_array()
                .is_some_and(|a| a.iter().any(|n| n["status"] == "ready"));
            Ok(ready.then_some(()))
        })
    }

    /// Waits until `plugin` has a healthy node and a healthy controller.
    pub fn wait_plugin_healthy(&self, plugin: &str) -> Result<()> {
        wait_for(
            &format!("plugin {plugin} to be healthy"),
            Duration::from_secs(60),
            || {
                let out = self.cli(&["plugin", "status", "-json", plugin])?;
                if !out.status.success() {
                    return Ok(None);
                }
                let p: Value = serde_json::from_slice(&out.stdout)?;
                Ok((p["nodes_healthy"] == 1 && p["controllers_healthy"] == 1).then_some(()))
            },
        )
        .with_context(|| self.log())
    }

    /// Runs the example plugin job, waits until the plugin is healthy, and
    /// creates the example volume `data` through it.
    pub fn run_plugin_and_create_volume(&self) -> Result<()> {
        self.run_example_plugin()?;
        self.cli_ok(&["volume", "create", &example("volumes/hostpath.hcl")])?;
        Ok(())
    }

    /// Runs the example plugin job and waits until the plugin is healthy.
    pub fn run_example_plugin(&self) -> Result<()> {
        self.cli_ok(&[
            "job",
            "run",
            "-detach",
            &example("jobs/hostpath-plugin.hcl"),
        ])?;
        self.wait_plugin_healthy("hostpath")
    }

    /// Writes `spec` to job file `name`.hcl and runs it detached; an error
    /// with the CLI's output unless it exits 0.
    pub fn run_job(&self, name: &str, spec: &str) -> Result<()> {
        let file = self.write_file(&format!("{name}.hcl"), spec)?;
        self.cli_ok(&["job", "run", "-detach", &file])?;
        Ok(())
    }

    /// The agent process's PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Writes `src` (a job or volume spec) into the agent's data dir as
    /// `name`; its path, for the CLI.
    pub fn write_file(&self, name: &str, src: &str) -> Result<String> {
        let path = self.data_dir.path().join(name);
        std::fs::write(&path, src).with_context(|| format!("writing {}", path.display()))?;
        Ok(path.display().to_string())
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Runs the CLI against this agent.
    pub fn cli(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = Command::new(binary("berth"));
        if let Some(t) = &self.token {
            cmd.env("BERTH_TOKEN", t);
        }
        cmd.args(args)
            .env("BERTH_ADDR", &self.http_addr)
            .env("PATH", &self.path_env)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running berth {}", args.join(" ")))
    }

    /// Sends `request`, a whole raw HTTP/1.1 request (asking for
    /// `Connection: close`), to the agent's HTTP API and reads the answer
    /// to its end.
    pub fn http(&self, request: &str) -> Result<HttpAnswer> {
        http_at(self.port, request)
    }

    /// GETs `path` (e.g. `/v1/job/web/allocations`) from the HTTP API and
    /// decodes the JSON answer; an error for any status but 200.
    pub fn api_get(&self, path: &str) -> Result<Value> {
        api_get_at(self.port, path)
    }

    /// The allocs of `job` as the API has them.
    pub fn job_allocs(&self, job: &str) -> Result<Vec<Value>> {
        Ok(self
            .api_get(&format!("/v1/job/{job}/allocations"))?
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Runs the CLI and fails with its output unless it exits 0.
    pub fn cli_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.cli(args)?;
        if !out.status.success() {
            bail!(
                "berth {} failed ({}):\nstdout: {}\nstderr: {}\nagent log:\n{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.log()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs a read command with `-json` and decodes its output.
    pub fn cli_json(&self, args: &[&str]) -> Result<Value> {
        let mut a = args.to_vec();
        a.push("-json");
        // The ID, when given, goes last.
        if args.len() == 3 {
            a = vec![args[0], args[1], "-json", args[2]];
        }
        let out = self.cli_ok(&a)?;
        serde_json::from_str(&out).with_context(|| format!("decoding {out:?}"))
    }

    /// Stops the agent with SIGTERM and waits for it to exit.
    pub fn stop_agent(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let exited = wait_for("the agent to exit", Duration::from_secs(15), || {
                Ok(c.try_wait()?.map(|_| ()))
            });
            if exited.is_err() {
                let _ = c.kill();
                let _ = c.wait();
                bail!("agent did not exit on SIGTERM within 15s");
            }
        }
        Ok(())
    }

    /// Kills the agent with SIGKILL (no shutdown at all; tasks and their
    /// executors live on) and waits for it to be gone.
    pub fn kill_agent(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().context("killing the agent")?;
            c.wait().context("waiting for the killed agent")?;
        }
        Ok(())
    }

    /// Restarts the agent as an operator would: SIGTERM, then a new agent
    /// on the same data dir and HTTP port, ready once its node is.
    pub fn restart(&mut self) -> Result<()> {
        self.stop_agent()?;
        self.start_again()
    }

    /// Starts a new agent on the same data dir and HTTP port after
    /// [`Self::stop_agent`], ready once its node is.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("the agent still runs");
        }
        self.spawn(self.port)?;
        self.wait_ready()
    }

    /// PIDs of live processes whose command line contains `needle`.
    pub fn processes_with_cmdline(&self, needle: &str) -> Vec<i32> {
        processes_with_cmdline(needle)
    }

    /// The node's CSI events, `(message, count)`, oldest first. Equal
    /// events fold into the newest one, which moves to the end with its
    /// count.
    pub fn csi_node_events(&self) -> Result<Vec<(String, u64)>> {
        let nodes = self.api_get("/v1/nodes")?;
        let id = nodes[0]["id"].as_str().unwrap_or_default().to_string();
        let node = self.api_get(&format!("/v1/node/{id}"))?;
        Ok(node["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["subsystem"] == "CSI")
            .map(|e| {
                (
                    e["message"].as_str().unwrap_or_default().to_string(),
                    e["count"].as_u64().unwrap_or(1),
                )
            })
            .collect())
    }

    /// Waits until volume `id` has no read or write claims left.
    pub fn wait_volume_unclaimed(&self, id: &str) -> Result<()> {
        wait_for(
            &format!("the claims of volume {id} to be freed"),
            Duration::from_secs(60),
            || {
                let v = self.cli_json(&["volume", "status", id])?;
                Ok(
                    (strs(&v["read_allocs"]).is_empty() && strs(&v["write_allocs"]).is_empty())
                        .then_some(()),
                )
            },
        )
        .with_context(|| self.log())
    }

    /// Kills every process that mentions the data dir and unmounts
    /// everything below it.
    fn cleanup(&mut self) {
        kill_and_unmount(&mut self.child, self.data_dir.path());
    }
}

impl Drop for DevAgent {
    fn drop(&mut self) {
        self.cleanup();
    }
}
