//! A cluster of separate processes on one machine: one `berth agent
//! -server` and client agents, each with its own data dir and ports, some
//! of them behind a [`Relay`] the test partitions.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::relay::Relay;
use crate::{api_get_at, cli_ok_at, example_with, free_port, run_job_at, wait_for, Agent};

/// A server agent on fixed loopback ports (kept across restarts).
pub struct Server {
    pub agent: Agent,
    pub http_port: u16,
    /// `127.0.0.1:PORT` of the agent protocol.
    pub rpc: String,
    _config: tempfile::TempDir,
}

impl Server {
    /// Starts a server whose `server { ... }` block holds `server_block`
    /// (e.g. `min_heartbeat_ttl = "2s"`), and waits for its API.
    pub fn start(server_block: &str) -> Result<Server> {
        Server::start_with(server_block, "")
    }

    /// [`Server::start`] with `more` (blocks such as `etcd { ... }`) at
    /// the top level of its config file.
    pub fn start_with(server_block: &str, more: &str) -> Result<Server> {
        let config = tempfile::tempdir()?;
        let file = config.path().join("server.hcl");
        std::fs::write(
            &file,
            format!("server {{\n  enabled = true\n  {server_block}\n}}\n{more}\n"),
        )?;
        let http_port = free_port();
        let rpc = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{http_port}");
        let agent = Agent::start(&[
            "-config",
            path_str(&file)?,
            "-server",
            "-http-addr",
            &http,
            "-rpc-addr",
            &rpc,
        ])?;
        let mut s = Server {
            agent,
            http_port,
            rpc,
            _config: config,
        };
        s.wait_serving()?;
        Ok(s)
    }

    /// A server that keeps its state in etcd (members at `endpoints`,
    /// keys under `prefix`), with the keyring in `keys` (the same for
    /// every server of one cluster), a lease of 3 s and heartbeat TTLs
    /// short enough that a node wrongly missed is marked down within a
    /// test.
    pub fn start_on_etcd(endpoints: &[String], prefix: &str, keys: &Path) -> Result<Server> {
        Server::start_on_etcd_with(endpoints, prefix, keys, "")
    }

    /// [`Server::start_on_etcd`] with `more` in its `etcd` block.
    pub fn start_on_etcd_with(
        endpoints: &[String],
        prefix: &str,
        keys: &Path,
        more: &str,
    ) -> Result<Server> {
        let list = endpoints
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ");
        Server::start_with(
            "store = \"etcd\"\n  min_heartbeat_ttl = \"2s\"\n  heartbeat_grace = \"2s\"",
            &format!(
                "etcd {{\n  endpoints = [{list}]\n  prefix = \"{prefix}\"\n  lease_ttl = \"3s\"\n  \
                 request_timeout = \"2s\"\n  keyring_dir = \"{}\"\n{more}\n}}",
                path_str(keys)?
            ),
        )
    }

    /// The leader's agent protocol address as this server tells it (`""`
    /// while none is elected).
    pub fn leader(&self) -> Result<String> {
        Ok(self
            .get("/v1/status/leader")?
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    /// The ID of an alloc of `job` its client reports running, if any.
    pub fn running_alloc(&self, job: &str) -> Result<Option<String>> {
        Ok(self
            .allocs(job)?
            .into_iter()
            .find(|a| a["client_status"] == "running")
            .and_then(|a| a["id"].as_str().map(String::from)))
    }

    /// `http://127.0.0.1:PORT`, for the CLI.
    pub fn addr(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// Waits until the HTTP API answers.
    pub fn wait_serving(&mut self) -> Result<()> {
        wait_for("the server's HTTP API", Duration::from_secs(30), || {
            self.agent.check_running()?;
            // Health, which a server that does not lead answers too.
            Ok(api_get_at(self.http_port, "/v1/agent/health")
                .ok()
                .map(|_| ()))
        })
    }

    pub fn get(&self, path: &str) -> Result<Value> {
        api_get_at(self.http_port, path)
    }

    /// Runs the CLI against this server; fails unless it exits 0.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        cli_ok_at(&self.addr(), args)
    }

    /// Writes `spec` to a file for `berth job run`; its path.
    pub fn job_file(&self, name: &str, spec: &str) -> Result<String> {
        crate::cli::job_file_at(self._config.path(), name, spec)
    }

    /// Writes `spec` to a file and runs `berth job run -detach` on it.
    pub fn run_job(&self, name: &str, spec: &str) -> Result<()> {
        run_job_at(&self.addr(), self._config.path(), name, spec)
    }

    /// `berth job stop` of a [`marked_job`], then waits until its task
    /// processes are gone.
    pub fn stop_marked_job(&self, job: &str) -> Result<()> {
        self.cli(&["job", "stop", job])?;
        wait_for("the tasks to end", Duration::from_secs(30), || {
            Ok(marker_pids(job).is_empty().then_some(()))
        })
    }

    /// Writes `spec` to a file and runs `berth volume create` on it.
    pub fn create_volume(&self, name: &str, spec: &str) -> Result<()> {
        let file = self._config.path().join(format!("volume-{name}.hcl"));
        std::fs::write(&file, spec)?;
        self.cli(&["volume", "create", path_str(&file)?])?;
        Ok(())
    }

    /// The node named `name`, as the server shows it.
    pub fn node(&self, name: &str) -> Result<Value> {
        let nodes = self.get("/v1/nodes")?;
        nodes
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["name"] == name)
            .cloned()
            .with_context(|| format!("no node named {name}"))
    }

    /// The full allocs of `job`.
    pub fn allocs(&self, job: &str) -> Result<Vec<Value>> {
        let allocs = self.get(&format!("/v1/job/{job}/allocations"))?;
        Ok(allocs.as_array().cloned().unwrap_or_default())
    }

    /// The volume `id` as the server shows it.
    /// The first of `job`'s allocs to be terminal (complete or failed),
    /// waited for (a minute at most).
    pub fn finished_alloc(&self, job: &str) -> Result<Value> {
        wait_for(
            &format!("the alloc of {job} to finish"),
            Duration::from_secs(60),
            || {
                let allocs = self.allocs(job)?;
                Ok(allocs
                    .into_iter()
                    .find(|a| matches!(a["client_status"].as_str(), Some("complete" | "failed"))))
            },
        )
    }

    pub fn volume(&self, id: &str) -> Result<Value> {
        self.get(&format!("/v1/volume/csi/{id}"))
    }

    /// Waits until the nodes named in `names` are all `ready`; returns
    /// their IDs by name order.
    pub fn wait_nodes_ready(&mut self, names: &[&str]) -> Result<Vec<String>> {
        wait_for("the nodes ready", Duration::from_secs(60), || {
            self.agent.check_running()?;
            let mut ids = Vec::new();
            for name in names {
                match self.node(name) {
                    Ok(n) if n["status"] == "ready" => {
                        ids.push(n["id"].as_str().unwrap_or_default().to_string())
                    }
                    _ => return Ok(None),
                }
            }
            Ok(Some(ids))
        })
    }

    /// Waits until the `hostpath` plugin is healthy on `nodes` nodes.
    pub fn wait_plugin_nodes(&self, nodes: u64) -> Result<()> {
        wait_for(
            "the plugin healthy on the nodes",
            Duration::from_secs(60),
            || {
                let p = self.get("/v1/plugin/csi/hostpath")?;
                Ok((p["nodes_healthy"].as_u64() == Some(nodes)).then_some(()))
            },
        )
    }
}

/// Waits until `server` lists `n` servers, and checks that it marks
/// `leader` (an agent protocol address) alone as leading; the list.
pub fn members_agree(server: &Server, n: usize, leader: &str) -> Result<Vec<Value>> {
    let members = wait_for(
        &format!("{n} servers listed"),
        Duration::from_secs(10),
        || {
            let v = server.get("/v1/operator/servers")?;
            let list = v.as_array().cloned().unwrap_or_default();
            Ok((list.len() == n).then_some(list))
        },
    )?;
    let leaders: Vec<&str> = members
        .iter()
        .filter(|m| m["leader"] == true)
        .filter_map(|m| m["rpc_addr"].as_str())
        .collect();
    anyhow::ensure!(
        leaders == [leader],
        "leaders {leaders:?}, not {leader}: {members:?}"
    );
    Ok(members)
}

/// The index (in `servers`) of the server that leads, once every one of
/// the `live` servers names the same leader.
pub fn wait_leader(servers: &[Server], live: &[usize], within: Duration) -> Result<usize> {
    wait_for("one leader the servers agree on", within, || {
        let mut seen = Vec::new();
        for &i in live {
            seen.push(servers[i].leader().unwrap_or_default());
        }
        if seen.iter().any(String::is_empty) || seen.windows(2).any(|w| w[0] != w[1]) {
            return Ok(None);
        }
        Ok(live.iter().copied().find(|&i| servers[i].rpc == seen[0]))
    })
}

/// A client agent, dialling the server directly or through a relay.
pub struct Client {
    pub agent: Agent,
    pub name: String,
    pub http_port: u16,
    pub relay: Option<Relay>,
    _config: tempfile::TempDir,
}

impl Client {
    /// Starts client `name` of `server`, through a relay when `relayed`,
    /// with `client_block` added to its `client { ... }` block.
    pub fn start(server: &Server, name: &str, relayed: bool, client_block: &str) -> Result<Client> {
        Client::start_with_disk(server, name, relayed, client_block, None)
    }

    /// [`Client::start`] with the data dir on a filesystem of its own of
    /// `disk_mib` MiB, when given (see [`Agent::start_on_disk`]).
    pub fn start_with_disk(
        server: &Server,
        name: &str,
        relayed: bool,
        client_block: &str,
        disk_mib: Option<u64>,
    ) -> Result<Client> {
        let relay = if relayed {
            let upstream = server
                .rpc
                .parse()
                .with_context(|| format!("server address {:?}", server.rpc))?;
            Some(Relay::start(upstream).context("starting the relay")?)
        } else {
            None
        };
        let servers = relay
            .as_ref()
            .map_or(server.rpc.clone(), |r| r.addr().to_string());
        let mut client = Client::start_agent(&servers, name, client_block, "", disk_mib)?;
        client.relay = relay;
        Ok(client)
    }

    /// Starts client `name` whose `-servers` are `servers` (`HOST:PORT`,
    /// comma separated), with `client_block` added to its `client { ... }`
    /// block.
    pub fn start_with_servers(servers: &str, name: &str, client_block: &str) -> Result<Client> {
        Client::start_with_config(servers, name, client_block, "")
    }

    /// [`Client::start_with_servers`] with `top_level` (HCL) at the top
    /// of the client's config file (`datacenter = "east"`, say).
    pub fn start_with_config(
        servers: &str,
        name: &str,
        client_block: &str,
        top_level: &str,
    ) -> Result<Client> {
        Client::start_agent(servers, name, client_block, top_level, None)
    }

    fn start_agent(
        servers: &str,
        name: &str,
        client_block: &str,
        top_level: &str,
        disk_mib: Option<u64>,
    ) -> Result<Client> {
        let config = tempfile::tempdir()?;
        let file = config.path().join("client.hcl");
        std::fs::write(
            &file,
            format!("{top_level}\nclient {{\n  enabled = true\n  {client_block}\n}}\n"),
        )?;
        let http_port = free_port();
        let http = format!("127.0.0.1:{http_port}");
        let args = [
            "-config",
            path_str(&file)?,
            "-client",
            "-servers",
            servers,
            "-node",
            name,
            "-http-addr",
            &http,
        ];
        let agent = match disk_mib {
            Some(mib) => Agent::start_on_disk(&args, mib)?,
            None => Agent::start(&args)?,
        };
        Ok(Client {
            agent,
            name: name.to_string(),
            http_port,
            relay: None,
            _config: config,
        })
    }

    pub fn relay(&self) -> Result<&Relay> {
        self.relay.as_ref().context("this client has no relay")
    }

    /// GETs a node-local route of the client's own HTTP API.
    pub fn get(&self, path: &str) -> Result<Value> {
        api_get_at(self.http_port, path)
    }

    /// Mounts below this client's data dir whose path mentions `needle`.
    pub fn mounts_with(&self, needle: &str) -> Vec<PathBuf> {
        crate::mounts_under(&self.agent.data_path())
            .into_iter()
            .filter(|m| m.display().to_string().contains(needle))
            .collect()
    }
}

/// The plugin system job with its volume data kept in `state_dir`, which
/// every instance shares: the hostpath plugin as network storage, which
/// every node reaches (so without the shipped job's per-node topology).
pub fn shared_plugin_job(state_dir: &Path) -> Result<String> {
    let job = example_with(
        "jobs/hostpath-plugin.hcl",
        "--state-dir=${BERTH_NODE_DATA_DIR}",
        &format!("--state-dir={}", path_str(state_dir)?),
    )?;
    let per_node = "\"--topology=topology.hostpath.csi/node=${BERTH_NODE_ID}\",";
    anyhow::ensure!(
        job.contains(per_node),
        "the plugin job has no {per_node:?} to take out"
    );
    Ok(job.replacen(per_node, "", 1))
}

/// [`shared_plugin_job`] with `extra_args` added to the plugin's command
/// line (e.g. `--topology=topology.hostpath.csi/node=${BERTH_NODE_ID}`).
pub fn shared_plugin_job_with_args(state_dir: &Path, extra_args: &[&str]) -> Result<String> {
    let from = format!("\"--state-dir={}\",", path_str(state_dir)?);
    let job = shared_plugin_job(state_dir)?;
    if !job.contains(&from) {
        anyhow::bail!("the plugin job has no {from:?} to add arguments after");
    }
    let extra: String = extra_args
        .iter()
        .map(|a| format!("\n          {a:?},"))
        .collect();
    Ok(job.replacen(&from, &format!("{from}{extra}"), 1))
}

/// A single-node-writer hostpath volume named `id`.
pub fn writer_volume(id: &str) -> String {
    writer_volume_with(id, "1MiB", "")
}

/// A single-node-writer hostpath volume named `id` of at least
/// `capacity_min`, with the `extra` lines in its spec.
pub fn writer_volume_with(id: &str, capacity_min: &str, extra: &str) -> String {
    format!(
        r#"
id        = "{id}"
name      = "{id}"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "{capacity_min}"
{extra}

capability {{
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}}
"#
    )
}

/// A service job of `count` allocs whose task is a shell loop whose
/// command line holds `marker-<job>-<test pid>` (see [`marker_pids`]); with a
/// `stop_after_client_disconnect` window when `window` is set, and the
/// volume `volume` mounted at `data` when set.
pub fn marked_service_job(
    job: &str,
    count: u32,
    window: Option<&str>,
    volume: Option<&str>,
) -> String {
    let window = window.map_or(String::new(), |w| {
        format!("stop_after_client_disconnect = \"{w}\"")
    });
    marked_job(job, "service", count, &window, volume)
}

/// A job of `job_type` like [`marked_service_job`], with `group_extra`
/// (HCL: a `disconnect` block, say) in its group.
pub fn marked_job(
    job: &str,
    job_type: &str,
    count: u32,
    group_extra: &str,
    volume: Option<&str>,
) -> String {
    marked(
        job,
        job_type,
        count,
        group_extra,
        volume.map(|v| (v, false)),
    )
}

/// A service job of one alloc like [`marked_service_job`] that mounts
/// `volume` read-only (beside its writer on a node).
pub fn marked_reader_job(job: &str, volume: &str) -> String {
    marked(job, "service", 1, "", Some((volume, true)))
}

/// [`marked_job`] with the volume (its ID, and whether read-only).
fn marked(
    job: &str,
    job_type: &str,
    count: u32,
    group_extra: &str,
    volume: Option<(&str, bool)>,
) -> String {
    let (volume_block, mount) = match volume {
        Some((v, read_only)) => (
            format!(
                r#"volume "data" {{
      type            = "csi"
      source          = "{v}"
      read_only       = {read_only}
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}"#
            ),
            format!(
                r#"volume_mount {{
        volume      = "data"
        destination = "data"
        read_only   = {read_only}
      }}"#
            ),
        ),
        None => (String::new(), String::new()),
    };
    let marker = marker(job);
    format!(
        r#"
job "{job}" {{
  type = "{job_type}"
  group "g" {{
    count = {count}
    {group_extra}
    {volume_block}
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "while :; do sleep 0.2; done", "${{BERTH_ALLOC_DIR}}/{marker}"]
      }}
      {mount}
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

/// What the tasks of a [`marked_service_job`] carry on their command line:
/// the job's name and this test process's PID, so that test binaries
/// running side by side never count each other's tasks.
pub fn marker(job: &str) -> String {
    format!("marker-{job}-{}", std::process::id())
}

/// PIDs of the live task processes of a [`marked_service_job`] started by
/// this test process. The task's shell forks a child for each `sleep`,
/// and until that child execs it shows the shell's command line: a process
/// whose parent carries the same marker is such a child, not a task.
pub fn marker_pids(job: &str) -> BTreeSet<i32> {
    let pids: BTreeSet<i32> = crate::processes_with_cmdline(&format!("/{} ", marker(job)))
        .into_iter()
        .collect();
    pids.iter()
        .copied()
        // A process gone before its parent is read is no task.
        .filter(|pid| parent_pid(*pid).is_some_and(|parent| !pids.contains(&parent)))
        .collect()
}

/// The parent of `pid`, from `/proc/<pid>/stat`.
fn parent_pid(pid: i32) -> Option<i32> {
    crate::stat_fields(u32::try_from(pid).ok()?)?
        .get(1)?
        .parse()
        .ok()
}

/// The logs of a server and its clients, for an error's context.
pub fn logs(server: &Server, clients: &[&Client]) -> String {
    let mut s = format!("server log:\n{}\n", server.agent.log());
    for c in clients {
        s.push_str(&format!("{} log:\n{}\n", c.name, c.agent.log()));
    }
    s
}

/// The node an alloc (as the API shows it) is placed on.
pub fn node_of(alloc: &Value) -> &str {
    alloc["node_id"].as_str().unwrap_or_default()
}

/// The allocs among `allocs` whose client status is `status`.
pub fn with_status<'a>(allocs: &'a [Value], status: &str) -> Vec<&'a Value> {
    allocs
        .iter()
        .filter(|a| a["client_status"] == status)
        .collect()
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("a UTF-8 temp path")
}

/// The IDs of `allocs` (as the API shows them).
pub fn ids(allocs: &[&Value]) -> BTreeSet<String> {
    allocs
        .iter()
        .map(|a| a["id"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// The alloc IDs that hold write claims of `volume` (as the API shows it).
pub fn write_claims(volume: &Value) -> BTreeSet<String> {
    volume["write_claims"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Whether `pid` runs (and is not a zombie).
pub fn pid_alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z'))
}
