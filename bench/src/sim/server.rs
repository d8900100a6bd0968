//! The server agent the simulated fleet talks to: a real `berth agent
//! -server` process and the HTTP requests the figures make of it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};

use super::PLUGIN;

/// How long a set-up request (a job registered, a volume) may take: at
/// ten thousand nodes placing a job is slow.
const SETUP_TIMEOUT: Duration = Duration::from_secs(600);

/// The servers a figure is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// One server on the embedded store.
    Plain,
    /// The same, with mutual TLS on the agent protocol.
    Tls,
    /// One server on etcd (one member on loopback, its own fsync).
    OnEtcd,
    /// Two servers on etcd; the nodes dial the follower.
    ThroughFollower,
}

/// The server the fleet dials, and what stays up beside it (dropped
/// after it).
pub struct Servers {
    pub dialed: ServerAgent,
    _leader: Option<ServerAgent>,
    _etcd: Option<(berth_testutil::etcd::Etcd, tempfile::TempDir)>,
}

impl Servers {
    pub fn start(how: How) -> Result<Servers> {
        if matches!(how, How::Plain | How::Tls) {
            return Ok(Servers {
                dialed: ServerAgent::start_with_tls(how == How::Tls)?,
                _leader: None,
                _etcd: None,
            });
        }
        let etcd = berth_testutil::etcd::Etcd::start();
        let keys = tempfile::tempdir()?;
        let knows = |s: &ServerAgent, leader: &str| -> Result<()> {
            berth_tests::wait_for(
                "the server to know the leader",
                Duration::from_secs(60),
                || Ok((s.leader()? == leader).then_some(())),
            )
        };
        let leader = ServerAgent::start_on_etcd(&etcd.endpoint(), "/bench", keys.path())?;
        knows(&leader, &leader.rpc.clone())?;
        if how == How::OnEtcd {
            return Ok(Servers {
                dialed: leader,
                _leader: None,
                _etcd: Some((etcd, keys)),
            });
        }
        let follower = ServerAgent::start_on_etcd(&etcd.endpoint(), "/bench", keys.path())?;
        knows(&follower, &leader.rpc)?;
        Ok(Servers {
            dialed: follower,
            _leader: Some(leader),
            _etcd: Some((etcd, keys)),
        })
    }
}

/// A real server agent (`berth agent -server`, its own process, the
/// default log level) on free loopback ports; killed on drop. The whole
/// simulated fleet registers from one loopback address, so its limit of
/// registrations and connections per address are raised.
pub struct ServerAgent {
    pub agent: berth_tests::Agent,
    pub http_port: u16,
    pub rpc: String,
    /// With mutual TLS on the agent protocol: the certificates.
    pub tls: Option<berth_tests::pki::Pki>,
    _config: tempfile::TempDir,
}

/// The `limits` block of a server a simulated fleet registers with.
const FLEET_LIMITS: &str = "limits {\n  node_register_rate_per_client = 1000000\n  \
                            node_register_burst_per_client = 1000000\n  \
                            rpc_max_conns_per_client = 10000\n}\n";

impl ServerAgent {
    /// With `tls`, mutual TLS on the agent protocol (certificates made by
    /// `berth tls` in a temp dir); the HTTP API stays plain.
    pub fn start_with_tls(tls: bool) -> Result<ServerAgent> {
        Self::start_with(tls, "")
    }

    /// A server that keeps its state in the etcd at `endpoint`, under
    /// `prefix`, sealing with the keyring in `keys` (the same for every
    /// server of the prefix).
    pub fn start_on_etcd(
        endpoint: &str,
        prefix: &str,
        keys: &std::path::Path,
    ) -> Result<ServerAgent> {
        let keys = keys.to_str().context("the keyring dir is not UTF-8")?;
        Self::start_with(
            false,
            &format!(
                "server {{\n  store = \"etcd\"\n}}\netcd {{\n  endpoints = [\"{endpoint}\"]\n  \
                 prefix = \"{prefix}\"\n  keyring_dir = \"{keys}\"\n}}\n"
            ),
        )
    }

    /// The agent protocol address of the leader this server knows, `""`
    /// while it knows none.
    pub fn leader(&self) -> Result<String> {
        let (leader, _) = self.get_indexed("/v1/status/leader")?;
        Ok(leader.as_str().unwrap_or_default().to_string())
    }

    fn start_with(tls: bool, more: &str) -> Result<ServerAgent> {
        let config = tempfile::tempdir()?;
        let file = config.path().join("server.hcl");
        let pki = tls.then(berth_tests::pki::Pki::new).transpose()?;
        let tls_block = pki.as_ref().map_or(String::new(), |p| {
            p.tls_block(berth_tests::pki::SERVER_CERT, false)
        });
        std::fs::write(&file, format!("{FLEET_LIMITS}{tls_block}{more}"))?;
        let file = file.to_str().context("the temp dir is not UTF-8")?;
        let http_port = berth_tests::free_port();
        let rpc = format!("127.0.0.1:{}", berth_tests::free_port());
        let http = format!("127.0.0.1:{http_port}");
        let mut agent = berth_tests::Agent::start_with_env(
            &[
                "-server",
                "-config",
                file,
                "-http-addr",
                &http,
                "-rpc-addr",
                &rpc,
            ],
            &[("BERTH_LOG", None)],
        )?;
        berth_tests::wait_for(
            "the server agent's HTTP API",
            Duration::from_secs(60),
            || {
                agent.check_running()?;
                Ok(berth_tests::api_get_at(http_port, "/v1/agent/self").ok())
            },
        )?;
        Ok(ServerAgent {
            agent,
            http_port,
            rpc,
            tls: pki,
            _config: config,
        })
    }

    pub fn pid(&self) -> Result<u32> {
        self.agent.pid().context("the server agent is not running")
    }

    /// The server process's resident set, in KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        berth_tests::rss_kib(self.pid()?).context("reading the server's RSS")
    }

    /// User plus system CPU time the server process has used.
    pub fn cpu_time(&self) -> Result<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?))?;
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        // Fields 14 and 15 of the whole line; 12 and 13 after the name.
        let ticks = |i: usize| -> Result<u64> {
            fields
                .get(i)
                .and_then(|f| f.parse().ok())
                .context("a /proc stat without CPU times")
        };
        // SAFETY: sysconf reads a system constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        Ok(Duration::from_secs_f64(
            (ticks(11)? + ticks(12)?) as f64 / hz,
        ))
    }

    /// One gauge or counter of the server's `/v1/metrics`, by its exact
    /// series (`berth_runtime_alive_tasks`, `berth_nodes{status="down"}`).
    pub fn metric(&self, series: &str) -> Result<f64> {
        let a = berth_tests::http_at(
            self.http_port,
            "GET /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        )?;
        let text = String::from_utf8_lossy(&a.body);
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {series} in the server's metrics"))
    }

    /// `PUT path` with a JSON body; the answer's JSON, an error unless 200.
    pub fn put(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        self.send("PUT", path, &body.to_string())
    }

    pub fn delete(&self, path: &str) -> Result<serde_json::Value> {
        self.send("DELETE", path, "")
    }

    fn send(&self, method: &str, path: &str, body: &str) -> Result<serde_json::Value> {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let a = berth_tests::http_at_within(self.http_port, &request, SETUP_TIMEOUT)
            .with_context(|| format!("{method} {path}"))?;
        if a.status != 200 {
            return Err(anyhow!(
                "{method} {path}: {} {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            ));
        }
        serde_json::from_slice(&a.body).with_context(|| format!("{method} {path}: the answer"))
    }

    /// `GET path`, its JSON and `X-Berth-Index`.
    pub fn get_indexed(&self, path: &str) -> Result<(serde_json::Value, u64)> {
        crate::cluster::get_indexed(self.http_port, path, 0, Duration::ZERO)
    }

    /// Run `each(i)` for `0..count` on `workers` threads (HTTP requests
    /// of the set-up, a few at a time as several operators would).
    pub fn parallel(
        &self,
        count: usize,
        workers: usize,
        each: impl Fn(&ServerAgent, usize) -> Result<()> + Sync,
    ) -> Result<()> {
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..workers.max(1))
                .map(|_| {
                    s.spawn(|| loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= count {
                            return Ok::<(), anyhow::Error>(());
                        }
                        each(self, i)?;
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow!("a set-up thread panicked"))??;
            }
            Ok(())
        })
    }

    /// Register a CSI volume of [`PLUGIN`] through the API.
    pub fn register_volume(&self, id: &str) -> Result<()> {
        let vol = berth_structs::CsiVolume {
            id: id.into(),
            name: id.into(),
            external_id: format!("ext-{id}"),
            plugin_id: PLUGIN.into(),
            capabilities: vec![berth_structs::VolumeCapability {
                access_mode: berth_structs::AccessMode::SingleNodeWriter,
                attachment_mode: berth_structs::AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        self.put(
            &format!(
                "/v1/volume/csi/{}",
                id.replace('[', "%5B").replace(']', "%5D")
            ),
            &serde_json::json!({ "volume": vol }),
        )?;
        Ok(())
    }
}
