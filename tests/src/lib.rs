//! Shared harness for the end-to-end tests: a real `berth agent -dev`
//! process on a temp data dir, the real CLI, and a guard that, whatever the
//! test's outcome, kills every process the test started (tasks outlive the
//! agent by design), unmounts every mount under the data dir and detaches
//! the loop devices of images there.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

pub mod cli_text;
pub mod cluster;
pub mod pki;
pub mod snapshot;
pub use berth_testutil::relay;

pub use berth_testutil::loops::{loop_devices_unusable, loops_backed_under};
pub use berth_testutil::mounts_under;
use berth_testutil::pids_mentioning;

pub use berth_testutil::{bin_dir, binary};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repo root")
        .to_path_buf()
}

/// Path of an example file, e.g. `jobs/writer.hcl`.
pub fn example(path: &str) -> String {
    repo_root()
        .join("examples")
        .join(path)
        .display()
        .to_string()
}

/// The text of an example file with the first `from` replaced by `to`; an
/// error when the example has no `from` (it changed under the test).
pub fn example_with(path: &str, from: &str, to: &str) -> Result<String> {
    let src = std::fs::read_to_string(example(path))
        .with_context(|| format!("reading example {path}"))?;
    if !src.contains(from) {
        bail!("example {path} has no {from:?} to replace");
    }
    Ok(src.replacen(from, to, 1))
}

/// A service job `id` of `count` allocs whose one task sleeps for five
/// minutes; `version` goes into the task's env, so that each value is a
/// changed spec.
pub fn sleeping_service_job(id: &str, count: u32, version: usize) -> String {
    format!(
        r#"
job "{id}" {{
  type = "service"
  group "web" {{
    count = {count}
    task "sleep" {{
      driver = "raw_exec"
      env {{
        VERSION = "{version}"
      }}
      config {{
        command = "/bin/sleep"
        args    = ["300"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// A batch job `id` of `count` allocs whose one task exits 0 at once,
/// asking for 10 MHz and 8 MB.
pub fn quick_batch_job(id: &str, count: u32) -> String {
    format!(
        r#"
job "{id}" {{
  type = "batch"
  group "g" {{
    count = {count}
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "exit 0"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// The strings of a JSON array (empty for anything else).
pub fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// The pid of `task` of `alloc_id` as its executor recorded it under the
/// agent data dir `data_dir`.
pub fn recorded_task_pid(data_dir: &Path, alloc_id: &str, task: &str) -> Result<i32> {
    let path = data_dir
        .join("alloc")
        .join(alloc_id)
        .join(".executor")
        .join(task)
        .join("state.json");
    let v: Value = serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    let pid = v["task_pid"]
        .as_i64()
        .with_context(|| format!("no task_pid in {v}"))?;
    Ok(i32::try_from(pid)?)
}

/// The events of `task` in a full alloc status, oldest first, as
/// `(type, message, time_ms)`.
pub fn task_events(alloc: &Value, task: &str) -> Vec<(String, String, i64)> {
    alloc["task_states"][task]["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["type"].as_str().unwrap_or_default().to_string(),
                e["message"].as_str().unwrap_or_default().to_string(),
                e["time_ms"].as_i64().unwrap_or_default(),
            )
        })
        .collect()
}

/// The events of `subsystem` (such as "Storage") in a full node status.
pub fn node_events<'a>(node: &'a Value, subsystem: &str) -> Vec<&'a Value> {
    node["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["subsystem"] == subsystem)
        .collect()
}

/// A service job `job` of one group `job` whose task `task` runs
/// `/bin/sh` with `args`, with the CSI volume "data" (single node writer)
/// mounted at `data` in its task dir.
pub fn csi_volume_service_job(job: &str, task: &str, args: &[&str]) -> String {
    let args = args
        .iter()
        .map(|a| Value::from(*a).to_string())
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"
job "{job}" {{
  type        = "service"
  datacenters = ["dc1"]

  group "{job}" {{
    volume "data" {{
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}

    task "{task}" {{
      driver = "raw_exec"

      config {{
        command = "/bin/sh"
        args    = [{args}]
      }}

      volume_mount {{
        volume      = "data"
        destination = "data"
      }}

      resources {{
        cpu    = 50
        memory = 32
      }}
    }}
  }}
}}
"#
    )
}

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

/// What the plugin task of alloc `alloc_id` (task `plugin`, as in the
/// example plugin job) wrote to stderr so far, below agent data dir
/// `data_dir`; the plugin logs every mount and unmount there.
pub fn plugin_stderr(data_dir: &Path, alloc_id: &str) -> String {
    std::fs::read_to_string(
        data_dir
            .join("alloc")
            .join(alloc_id)
            .join("alloc/logs/plugin.stderr.0"),
    )
    .unwrap_or_default()
}

/// Polls `f` until it returns `Ok(Some(v))`, or fails after `timeout` with
/// the last error or `what`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() >= deadline {
            return Err(match last_err {
                Some(e) => e.context(format!("timed out after {timeout:?} waiting for {what}")),
                None => anyhow!("timed out after {timeout:?} waiting for {what}"),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().expect("local addr").port()
}

/// Resident memory of a process in KiB (`VmRSS`), if it runs.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// PIDs of live (non-zombie) processes whose command line contains
/// `needle`.
pub fn processes_with_cmdline(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat
                .rfind(')')
                .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
            // Arguments are NUL-separated; match them as a command line.
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            !zombie && cmdline.contains(needle)
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// An answer of the HTTP API, as read off the wire.
pub struct HttpAnswer {
    pub status: u16,
    /// The status line and the headers.
    pub head: String,
    pub body: Vec<u8>,
}

impl HttpAnswer {
    /// The value of the header `name` (in any case), when there is one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body decoded as JSON; an error with the body when it is not.
    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| self.text())
    }
}

/// An ACL policy that reads jobs, nodes and plugins and writes nothing.
pub const READONLY_POLICY: &str = r#"
namespace "default" {
  policy = "read"
}
node   { policy = "read" }
plugin { policy = "read" }
"#;

/// Writes a token of [`READONLY_POLICY`] must be refused, as (method,
/// path, body): a job submit of `job_body`, a node purge and drain,
/// `system gc`, a volume create.
pub fn writes_refused_to_readers(job_body: &str) -> Vec<(&'static str, &'static str, String)> {
    vec![
        ("PUT", "/v1/jobs", job_body.to_string()),
        ("PUT", "/v1/node/x/purge", "{}".into()),
        ("POST", "/v1/node/x/drain", r#"{"enable": true}"#.into()),
        ("PUT", "/v1/system/gc", "{}".into()),
        (
            "PUT",
            "/v1/volume/csi/v1/create",
            r#"{"volume": {"id": "v1"}}"#.into(),
        ),
    ]
}

/// `Agent.ForwardHttp` of `method path` (with `token` as `X-Berth-Token`
/// when given, and a JSON `body`) on `channel` to an agent protocol port;
/// the status of the HTTP answer.
pub async fn forward_http(
    channel: tonic::transport::Channel,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<u32> {
    use berth_proto::berth::v1 as pb;
    let mut headers = vec![pb::HttpHeader {
        name: "content-type".into(),
        value: b"application/json".to_vec(),
    }];
    if let Some(t) = token {
        headers.push(pb::HttpHeader {
            name: "x-berth-token".into(),
            value: t.as_bytes().to_vec(),
        });
    }
    let answer = pb::agent_client::AgentClient::new(channel)
        .forward_http(pb::HttpRequest {
            method: method.into(),
            path_and_query: path.into(),
            headers,
            body: body.as_bytes().to_vec(),
        })
        .await
        .with_context(|| format!("Agent.ForwardHttp of {method} {path}"))?
        .into_inner();
    Ok(answer.status)
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
        agent.spawn(port)?;
        agent.wait_ready()?;
        Ok(agent)
    }

    fn spawn(&mut self, port: u16) -> Result<()> {
        let mut args: Vec<OsString> = vec!["-dev".into(), "-data-dir".into()];
        args.push(self.data_dir.path().into());
        args.push("-http-addr".into());
        args.push(format!("127.0.0.1:{port}").into());
        args.extend(self.extra_args.iter().map(OsString::from));
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

/// Kills `child`, then every process that mentions `dir` (tasks outlive
/// their agent), and unmounts everything below `dir`.
fn kill_and_unmount(child: &mut Option<Child>, dir: &Path) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
    let shown = dir.display().to_string();
    for _ in 0..3 {
        for pid in pids_mentioning(&shown) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        for m in mounts_under(dir) {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        if mounts_under(dir).is_empty() && pids_mentioning(&shown).is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Image-backed volumes: their loop devices would outlive the test. A
    // device still held by a lazily unmounted filesystem is only marked to
    // be cleared, which the kernel does on its last close.
    for dev in loops_backed_under(dir) {
        let _ = Command::new("losetup").arg("-d").arg(&dev).status();
    }
}

/// PATH for agents and the CLI: the workspace's binaries (the example
/// plugin) first.
fn path_with_bins() -> String {
    format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    )
}

/// Sends `request`, a whole raw HTTP/1.1 request (asking for
/// `Connection: close`), to the HTTP API on loopback `port` and reads the
/// answer to its end.
pub fn http_at(port: u16, request: &str) -> Result<HttpAnswer> {
    http_at_within(port, request, Duration::from_secs(30))
}

/// [`http_at`], waiting up to `timeout` for the answer (a request that
/// places thousands of allocs takes longer than a test's 30 s).
pub fn http_at_within(port: u16, request: &str, timeout: Duration) -> Result<HttpAnswer> {
    http_send_at(port, request, timeout)?.answer()
}

/// A request on its own connection whose answer is read later.
pub struct HttpSent {
    conn: std::net::TcpStream,
}

/// Sends `request` as [`http_at`] does and returns once it is on the wire,
/// before its answer: a blocking query sent before the change it waits
/// for. [`HttpSent::answer`] waits up to `timeout` for the answer.
pub fn http_send_at(port: u16, request: &str, timeout: Duration) -> Result<HttpSent> {
    use std::io::Write;
    let mut conn =
        std::net::TcpStream::connect(("127.0.0.1", port)).context("connecting to the HTTP API")?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.write_all(request.as_bytes())?;
    Ok(HttpSent { conn })
}

impl HttpSent {
    /// Reads the answer to its end.
    pub fn answer(mut self) -> Result<HttpAnswer> {
        use std::io::Read;
        let mut raw = Vec::new();
        self.conn.read_to_end(&mut raw)?;
        parse_http_answer(raw)
    }
}

/// Splits a whole raw HTTP/1.1 answer into its status, head and body.
pub(crate) fn parse_http_answer(raw: Vec<u8>) -> Result<HttpAnswer> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP answer: {:?}", String::from_utf8_lossy(&raw)))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no status in {head:?}"))?;
    Ok(HttpAnswer {
        status,
        head,
        body: raw[split + 4..].to_vec(),
    })
}

/// GETs `path` from the HTTP API on loopback `port` and decodes the JSON
/// answer; an error for any status but 200.
pub fn api_get_at(port: u16, path: &str) -> Result<Value> {
    let answer = http_at(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )
    .with_context(|| format!("GET {path}"))?;
    let body = String::from_utf8_lossy(&answer.body);
    if answer.status != 200 {
        bail!("GET {path}: {}\n{body}", answer.head);
    }
    if answer
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        bail!("GET {path}: a chunked answer is not expected");
    }
    serde_json::from_slice(&answer.body).with_context(|| format!("GET {path}: decoding {body:?}"))
}

/// Runs the CLI against the HTTP API at `addr` (`http://HOST:PORT`).
pub fn cli_at(addr: &str, args: &[&str]) -> Result<Output> {
    Command::new(binary("berth"))
        .args(args)
        .env("BERTH_ADDR", addr)
        .env("PATH", path_with_bins())
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running berth {}", args.join(" ")))
}

/// Runs the CLI against `addr` and decodes its JSON output; an error with
/// its stderr unless it exits 0.
pub fn cli_json_at(addr: &str, args: &[&str]) -> Result<Value> {
    let out = cli_at(addr, args)?;
    if !out.status.success() {
        bail!(
            "berth {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("berth {}", args.join(" ")))
}

/// Runs the CLI against `addr`; its stdout, or an error with its output
/// unless it exits 0.
pub fn cli_ok_at(addr: &str, args: &[&str]) -> Result<String> {
    let out = exit_ok(cli_at(addr, args)?, args)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `out` of `berth ARGS...`, or an error with its stdout and stderr
/// unless it exited 0.
pub fn exit_ok(out: Output, args: &[&str]) -> Result<Output> {
    if !out.status.success() {
        bail!(
            "berth {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// Writes `spec` to `dir`/`name`.hcl and runs `berth job run -detach` on
/// it against `addr`; an error with its output unless it exits 0.
pub fn run_job_at(addr: &str, dir: &Path, name: &str, spec: &str) -> Result<()> {
    let file = dir.join(format!("{name}.hcl"));
    std::fs::write(&file, spec).with_context(|| format!("writing {}", file.display()))?;
    let file = file.to_str().context("a UTF-8 job file path")?;
    cli_ok_at(addr, &["job", "run", "-detach", file])?;
    Ok(())
}

/// Starts `PROGRAM agent ARGS...` (PROGRAM a `berth` binary) with the
/// workspace's binaries on `PATH`, its output appended to `log_path` (a
/// restarted agent's log follows the first one's).
fn spawn_agent(
    program: &Path,
    args: &[OsString],
    path_env: &str,
    log_path: &Path,
) -> Result<Child> {
    spawn_program(program, args, path_env, log_path, &[])
}

/// [`spawn_agent`] with environment changes last: `(NAME, Some(value))`
/// sets NAME, `(NAME, None)` removes it (e.g. `BERTH_LOG`).
fn spawn_agent_with_env(
    args: &[OsString],
    path_env: &str,
    log_path: &Path,
    env: &[(String, Option<String>)],
) -> Result<Child> {
    spawn_program(&binary("berth"), args, path_env, log_path, env)
}

fn spawn_program(
    program: &Path,
    args: &[OsString],
    path_env: &str,
    log_path: &Path,
    env: &[(String, Option<String>)],
) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)?;
    let mut command = Command::new(program);
    command
        .arg("agent")
        .args(args)
        .env("PATH", path_env)
        .env("BERTH_LOG", "info,berth=debug");
    for (name, value) in env {
        match value {
            Some(v) => command.env(name, v),
            None => command.env_remove(name),
        };
    }
    command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting berth agent")
}

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

impl Agent {
    /// Starts `berth agent -data-dir <temp dir> ARGS...`; does not wait
    /// for anything.
    pub fn start(args: &[&str]) -> Result<Agent> {
        Self::start_with_env(args, &[])
    }

    /// [`Agent::start`] with environment changes: `(NAME, Some(value))`
    /// sets NAME, `(NAME, None)` removes it; kept on restarts.
    pub fn start_with_env(args: &[&str], env: &[(&str, Option<&str>)]) -> Result<Agent> {
        let data_dir = tempfile::Builder::new().prefix("berth-e2e-").tempdir()?;
        let log_path = data_dir.path().join("agent.log");
        let mut argv: Vec<OsString> = vec!["-data-dir".into(), data_dir.path().join("data").into()];
        argv.extend(args.iter().map(OsString::from));
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

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
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

impl Drop for Agent {
    fn drop(&mut self) {
        kill_and_unmount(&mut self.child, self.data_dir.path());
    }
}

impl Drop for DevAgent {
    fn drop(&mut self) {
        self.cleanup();
    }
}
