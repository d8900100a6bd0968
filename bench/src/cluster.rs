//! The cluster the client figures run: one `berth agent -server` and
//! client-only agents (`-client -servers ... -node ...`), each a process of
//! its own with its own data dir and ports, as README's "Run a cluster"
//! runs them, so that what a client uses is the client's alone. Every
//! agent runs at the default log level (`BERTH_LOG` and `RUST_LOG` are
//! removed), as an operator's would. Dropping an agent kills it and every
//! process it started, and unmounts what it mounted (see
//! [`berth_tests::Agent`]).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_tests::{api_get_at, cli_ok_at, free_port, http_at, run_job_at, wait_for, Agent};
use serde_json::Value;

/// The environment of every agent here: the default log level.
const DEFAULT_LOGGING: [(&str, Option<&str>); 2] = [("BERTH_LOG", None), ("RUST_LOG", None)];

/// A server agent on loopback ports of its own.
pub struct BenchServer {
    /// Held for its drop, which stops the server.
    _agent: Agent,
    pub http_port: u16,
    /// `127.0.0.1:PORT` of the agent protocol.
    pub rpc: String,
    /// Where job and volume specs are written for the CLI.
    specs: tempfile::TempDir,
}

impl BenchServer {
    /// Starts a server and waits until its HTTP API answers.
    pub fn start() -> Result<BenchServer> {
        let http_port = free_port();
        let rpc = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{http_port}");
        let mut agent = Agent::start_with_env(
            &["-server", "-http-addr", &http, "-rpc-addr", &rpc],
            &DEFAULT_LOGGING,
        )?;
        wait_for("the server's HTTP API", Duration::from_secs(30), || {
            agent.check_running()?;
            Ok(api_get_at(http_port, "/v1/nodes").ok().map(|_| ()))
        })?;
        Ok(BenchServer {
            _agent: agent,
            http_port,
            rpc,
            specs: tempfile::tempdir()?,
        })
    }

    /// `http://127.0.0.1:PORT`, for the CLI.
    pub fn addr(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    pub fn get(&self, path: &str) -> Result<Value> {
        api_get_at(self.http_port, path)
    }

    /// Writes `spec` to a file and runs `berth job run -detach` on it.
    pub fn run_job(&self, name: &str, spec: &str) -> Result<()> {
        run_job_at(&self.addr(), self.specs.path(), name, spec)
    }

    /// Runs `berth job run -detach` on the example file `path`.
    pub fn run_example_job(&self, path: &str) -> Result<()> {
        let file = berth_tests::example(path);
        cli_ok_at(&self.addr(), &["job", "run", "-detach", &file])?;
        Ok(())
    }

    /// Writes `spec` to a file and runs `berth volume create` on it.
    pub fn create_volume(&self, name: &str, spec: &str) -> Result<()> {
        let file = self.specs.path().join(format!("volume-{name}.hcl"));
        std::fs::write(&file, spec)?;
        cli_ok_at(&self.addr(), &["volume", "create", path_str(&file)?])?;
        Ok(())
    }

    /// Waits until plugin `plugin` has `nodes` healthy node instances.
    pub fn wait_plugin_nodes(&self, plugin: &str, nodes: u64) -> Result<()> {
        wait_for(
            &format!("plugin {plugin} healthy on {nodes} node(s)"),
            Duration::from_secs(60),
            || {
                let p = self.get(&format!("/v1/plugin/csi/{plugin}"))?;
                Ok((p["nodes_healthy"].as_u64() == Some(nodes)).then_some(()))
            },
        )
    }

    /// Waits (blocking queries) until `count` allocs of `job` run and
    /// every task of each is running; their full allocs, as the servers
    /// have them.
    pub fn wait_job_running(
        &self,
        job: &str,
        count: usize,
        within: Duration,
    ) -> Result<Vec<Value>> {
        let path = format!("/v1/job/{job}/allocations");
        let mut found = Vec::new();
        let deadline = Instant::now() + within;
        wait_until(self.http_port, &path, deadline, |v| {
            let allocs = v.as_array().map(Vec::as_slice).unwrap_or_default();
            // A changed job (a new count too) replaces its allocs: the
            // servers' stopped ones are not counted, and must be gone
            // before the job counts as running.
            let wanted = |a: &&Value| a["desired_status"] == "run";
            let running: Vec<Value> = allocs
                .iter()
                .filter(wanted)
                .filter(|a| a["client_status"] == "running" && all_tasks_running(a))
                .cloned()
                .collect();
            let stopping = allocs.iter().any(|a| {
                a["desired_status"] != "run"
                    && matches!(a["client_status"].as_str(), Some("pending" | "running"))
            });
            let done = running.len() >= count && !stopping;
            found = running;
            Ok(done)
        })
        .with_context(|| format!("{} of {count} allocs of {job} running", found.len()))?;
        Ok(found)
    }
}

/// A client-only agent of a [`BenchServer`].
pub struct BenchClient {
    pub agent: Agent,
    pub name: String,
    pub http_port: u16,
}

impl BenchClient {
    /// Starts client `name` of `server` and waits until it has registered.
    pub fn start(server: &BenchServer, name: &str) -> Result<BenchClient> {
        let http_port = free_port();
        let http = format!("127.0.0.1:{http_port}");
        let agent = Agent::start_with_env(
            &[
                "-client",
                "-servers",
                &server.rpc,
                "-node",
                name,
                "-http-addr",
                &http,
            ],
            &DEFAULT_LOGGING,
        )?;
        let mut client = BenchClient {
            agent,
            name: name.to_string(),
            http_port,
        };
        client.wait_registered(Instant::now() + Duration::from_secs(60))?;
        Ok(client)
    }

    /// The agent's PID; an error when it does not run.
    pub fn pid(&self) -> Result<u32> {
        self.agent.pid().context("the client agent is not running")
    }

    /// Polls the client's own `/v1/agent/self` (every 5 ms) until it says
    /// the node registered with the servers; when it did.
    pub fn wait_registered(&mut self, deadline: Instant) -> Result<Instant> {
        loop {
            self.agent.check_running()?;
            if let Ok(me) = api_get_at(self.http_port, "/v1/agent/self") {
                if me["client"]["registered"] == true {
                    return Ok(Instant::now());
                }
            }
            if Instant::now() >= deadline {
                bail!("client {} did not register in time", self.name);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Whether every task of `alloc` (the API's JSON, from the servers or the
/// client) is running.
pub fn all_tasks_running(alloc: &Value) -> bool {
    let tasks = alloc["task_states"].as_object();
    tasks.is_some_and(|t| !t.is_empty() && t.values().all(|s| s["state"] == "running"))
}

/// GETs `path` from the HTTP API on loopback `port` as a blocking query:
/// with `index` above 0 the answer waits (at most `wait`) until the data
/// changes past it. The JSON and the index it reflects (`X-Berth-Index`).
pub fn get_indexed(port: u16, path: &str, index: u64, wait: Duration) -> Result<(Value, u64)> {
    let sep = if path.contains('?') { '&' } else { '?' };
    let full = if index > 0 {
        format!(
            "{path}{sep}index={index}&wait={}ms",
            wait.as_millis().max(1)
        )
    } else {
        path.to_string()
    };
    let answer = http_at(
        port,
        &format!("GET {full} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )?;
    if answer.status != 200 {
        bail!(
            "GET {full}: {}\n{}",
            answer.head,
            String::from_utf8_lossy(&answer.body)
        );
    }
    let index = answer
        .header("x-berth-index")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let v = serde_json::from_slice(&answer.body).with_context(|| format!("GET {full}"))?;
    Ok((v, index))
}

/// Follows `path` on loopback `port` with blocking queries until `done`
/// says yes to an answer; the moment it did. Until the API answers (an
/// agent starting) it asks again every 5 ms. An error at `deadline`.
pub fn wait_until(
    port: u16,
    path: &str,
    deadline: Instant,
    mut done: impl FnMut(&Value) -> Result<bool>,
) -> Result<Instant> {
    let mut index = 0;
    let mut last_err = None;
    loop {
        let now = Instant::now();
        if now >= deadline {
            let e = anyhow::anyhow!("timed out following {path}");
            return Err(match last_err {
                Some(last) => e.context(last),
                None => e,
            });
        }
        let wait = (deadline - now).min(Duration::from_secs(5));
        match get_indexed(port, path, index, wait) {
            Ok((v, next)) => {
                last_err = None;
                if done(&v)? {
                    return Ok(Instant::now());
                }
                if next == 0 || next == index {
                    // Nothing to block on: ask again shortly.
                    std::thread::sleep(Duration::from_millis(5));
                }
                index = next;
            }
            Err(e) => {
                last_err = Some(e.to_string());
                index = 0;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// A service job `job` of `count` allocs whose one task `t` (raw_exec)
/// sleeps an hour, with 5 MHz and 8 MB each; with `volume`, the group
/// claims `<volume>[<alloc index>]` (per alloc, multi-node-multi-writer)
/// and mounts it at `data`.
pub fn sleep_job(job: &str, count: u32, volume: Option<&str>) -> String {
    let (volume_block, mount) = match volume {
        Some(v) => (
            format!(
                r#"volume "data" {{
      type            = "csi"
      source          = "{v}"
      per_alloc       = true
      access_mode     = "multi-node-multi-writer"
      attachment_mode = "file-system"
    }}"#
            ),
            r#"volume_mount {
        volume      = "data"
        destination = "data"
      }"#,
        ),
        None => (String::new(), ""),
    };
    format!(
        r#"
job "{job}" {{
  type = "service"
  group "g" {{
    count = {count}
    {volume_block}
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sleep"
        args    = ["3600"]
      }}
      {mount}
      resources {{
        cpu    = 5
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// A hostpath volume `id` that many allocs on many nodes may write.
pub fn shared_volume(id: &str) -> String {
    format!(
        r#"
id        = "{id}"
name      = "{id}"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "1MiB"

capability {{
  access_mode     = "multi-node-multi-writer"
  attachment_mode = "file-system"
}}
"#
    )
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("a UTF-8 temp path")
}
