//! `berth agent`: configuration and the wiring of the server role, the HTTP
//! API and the client into one process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use berth_server::{Server, ServerConfig};
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;

use crate::client::{Client, ClientConfig};
use crate::data_dir::DataDirLock;

/// What `berth agent` was asked to run.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub dev: bool,
    pub data_dir: Option<PathBuf>,
    pub http_addr: SocketAddr,
    /// Where the server role serves the agent protocol; port 0 picks one.
    pub rpc_addr: SocketAddr,
    pub node_name: Option<String>,
    /// Shortest heartbeat TTL the servers hand out.
    pub min_heartbeat_ttl: Duration,
    /// The client's garbage collection knobs (see `ClientConfig`).
    pub gc_max_allocs: usize,
    pub gc_interval: Duration,
    pub gc_alloc_threshold: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            dev: false,
            data_dir: None,
            http_addr: "127.0.0.1:4747".parse().expect("valid literal"),
            rpc_addr: "127.0.0.1:0".parse().expect("valid literal"),
            node_name: None,
            min_heartbeat_ttl: Duration::from_secs(10),
            gc_max_allocs: ClientConfig::DEFAULT_GC_MAX_ALLOCS,
            gc_interval: ClientConfig::DEFAULT_GC_INTERVAL,
            gc_alloc_threshold: ClientConfig::DEFAULT_GC_ALLOC_THRESHOLD,
        }
    }
}

const AGENT_USAGE: &str = "\
Usage: berth agent -dev [options]

  -dev                  run a server and a client in one process
  -data-dir DIR         keep state here (default: a new temp dir)
  -http-addr ADDR       HTTP API address (default 127.0.0.1:4747)
  -rpc-addr ADDR        agent protocol address (default 127.0.0.1:0, any free port)
  -node-name NAME       the node's name (default: the host name)
  -heartbeat-ttl DUR    shortest heartbeat TTL the servers hand out (default 10s)
  -gc-max-allocs N      terminal allocs the node keeps before destroying the oldest (default 50)
  -gc-alloc-threshold DUR  the node destroys allocs terminal for this long (default 1h)
  -gc-interval DUR      how often the node collects its terminal allocs (default 1m)
";

/// A command line `berth agent` cannot make sense of.
fn usage_error(message: impl Into<String>) -> anyhow::Error {
    crate::cli::errors::UsageError::new(message, AGENT_USAGE).into()
}

/// A duration flag's value: humantime ("30s", "5m"), at most
/// [`berth_structs::limits::MAX_DURATION`].
fn duration_flag(name: &str, v: &str) -> Result<Duration> {
    let d =
        berth_structs::spec::parse_duration(v).map_err(|e| anyhow!("berth agent: -{name}: {e}"))?;
    let max = berth_structs::limits::MAX_DURATION;
    if d > max {
        bail!(
            "berth agent: -{name} {}",
            berth_structs::limits::too_large(
                format!("{v:?}"),
                berth_structs::limits::duration_text(max)
            )
        );
    }
    Ok(d)
}

/// What `berth agent`'s command line asks for.
#[derive(Debug, Clone)]
pub enum AgentCommand {
    Run(AgentConfig),
    /// `-h`, `-help`: print the usage.
    Help,
}

impl AgentConfig {
    pub fn from_args(args: &[String]) -> Result<AgentCommand> {
        let mut c = AgentConfig::default();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let flag = a.trim_start_matches('-');
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (flag, None),
            };
            let mut value = |what: &str| -> Result<String> {
                match &inline {
                    Some(v) => Ok(v.clone()),
                    None => it
                        .next()
                        .cloned()
                        .ok_or_else(|| usage_error(format!("berth agent: -{what} needs a value"))),
                }
            };
            match name {
                "dev" => c.dev = true,
                "data-dir" => c.data_dir = Some(PathBuf::from(value(name)?)),
                "http-addr" => {
                    let v = value(name)?;
                    c.http_addr = v.parse().with_context(|| {
                        format!("berth agent: -http-addr {v:?} is not HOST:PORT")
                    })?;
                }
                "rpc-addr" => {
                    let v = value(name)?;
                    c.rpc_addr = v.parse().with_context(|| {
                        format!("berth agent: -rpc-addr {v:?} is not HOST:PORT")
                    })?;
                }
                "node-name" => {
                    let v = value(name)?;
                    berth_structs::check_name("node name", &v)
                        .with_context(|| format!("berth agent: -node-name {v:?}"))?;
                    c.node_name = Some(v);
                }
                "heartbeat-ttl" => c.min_heartbeat_ttl = duration_flag(name, &value(name)?)?,
                // The client's garbage collection knobs; they move to the
                // config file's `client` block once there is one.
                "gc-max-allocs" => {
                    let v = value(name)?;
                    c.gc_max_allocs = v.parse().with_context(|| {
                        format!("berth agent: -gc-max-allocs {v:?} is not a whole number")
                    })?;
                }
                "gc-interval" => {
                    let d = duration_flag(name, &value(name)?)?;
                    if d.is_zero() {
                        bail!("berth agent: -gc-interval must be longer than 0s");
                    }
                    c.gc_interval = d;
                }
                "gc-alloc-threshold" => {
                    c.gc_alloc_threshold = duration_flag(name, &value(name)?)?;
                }
                "config" => bail!(
                    "berth agent: -config is not supported yet; run `berth agent -dev` with flags"
                ),
                "h" | "help" => return Ok(AgentCommand::Help),
                _ => return Err(usage_error(format!("berth agent: unknown flag {a:?}"))),
            }
        }
        if !c.dev {
            return Err(usage_error(
                "berth agent: only -dev mode is available in this version",
            ));
        }
        Ok(AgentCommand::Run(c))
    }
}

pub fn run_from_args(args: &[String]) -> Result<i32> {
    let config = match AgentConfig::from_args(args)? {
        AgentCommand::Run(c) => c,
        AgentCommand::Help => {
            print!("{AGENT_USAGE}");
            return Ok(0);
        }
    };
    // The data dir is claimed before anything else (databases, logs), so
    // that a second agent on it fails at once with one line.
    let data_dir = prepare_data_dir(&config)?;
    let lock = DataDirLock::acquire(&data_dir)?;
    crate::logging::init();
    tracing::debug!(lock = %lock.path().display(), "data dir claimed");
    if config.data_dir.is_none() {
        tracing::info!(data_dir = %data_dir.display(), "dev agent uses a fresh temp data dir");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("berth-agent")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run(config, data_dir))?;
    drop(lock);
    Ok(0)
}

/// The data dir, created if needed, as an absolute path.
fn prepare_data_dir(config: &AgentConfig) -> Result<PathBuf> {
    match &config.data_dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .with_context(|| format!("creating data dir {}", d.display()))?;
            d.canonicalize()
                .with_context(|| format!("resolving data dir {}", d.display()))
        }
        // Kept after exit: a dev agent's tasks and mounts outlive it.
        None => Ok(tempfile::Builder::new()
            .prefix("berth-dev-")
            .tempdir()
            .context("creating a temp data dir")?
            .keep()),
    }
}

/// Runs the agent on `data_dir`, which the caller holds the
/// [`DataDirLock`] of, until SIGINT or SIGTERM.
pub async fn run(config: AgentConfig, data_dir: PathBuf) -> Result<()> {
    let (shutdown_tx, shutdown_rx) = watch::channel(false);

    let server = Server::open(ServerConfig {
        data_dir: data_dir.clone(),
        min_heartbeat_ttl: config.min_heartbeat_ttl,
        ..ServerConfig::default()
    })
    .context("opening the server state")?;

    let rpc_listener = tokio::net::TcpListener::bind(config.rpc_addr)
        .await
        .with_context(|| format!("binding the agent protocol to {}", config.rpc_addr))?;
    let rpc_addr = rpc_listener.local_addr()?;
    let http_listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("binding the HTTP API to {}", config.http_addr))?;
    tracing::info!(rpc_addr = %rpc_addr, http_addr = %http_listener.local_addr()?, "agent starting");

    let mut tasks = tokio::task::JoinSet::new();
    {
        let server = server.clone();
        let rx = shutdown_rx.clone();
        tasks.spawn(async move {
            server.run(rx).await;
            Ok::<(), anyhow::Error>(())
        });
    }
    {
        let router = tonic::transport::Server::builder()
            .add_service(server.node_service())
            .add_service(server.csi_volume_service());
        let mut rx = shutdown_rx.clone();
        tasks.spawn(async move {
            router
                .serve_with_incoming_shutdown(TcpListenerStream::new(rpc_listener), async move {
                    let _ = rx.wait_for(|v| *v).await;
                })
                .await
                .context("agent protocol server")
        });
    }
    {
        let server = server.clone();
        let rx = shutdown_rx.clone();
        tasks.spawn(async move {
            crate::http::serve(http_listener, server, rx)
                .await
                .context("HTTP API")
        });
    }

    // The client stops before the server role, so that its last updates
    // still reach the servers.
    let (client_stop_tx, client_stop_rx) = watch::channel(false);
    let client = Client::start(
        ClientConfig {
            node_name: config.node_name.clone(),
            gc_max_allocs: config.gc_max_allocs,
            gc_interval: config.gc_interval,
            gc_alloc_threshold: config.gc_alloc_threshold,
            ..ClientConfig::new(data_dir.clone(), format!("http://{rpc_addr}"))
        },
        client_stop_rx.clone(),
    )
    .await
    .context("starting the client")?;
    let mut client_task = tokio::spawn(client.run(client_stop_rx));
    let mut client_done = false;

    crate::logging::notify_systemd_ready();
    let term = async {
        let mut sigterm =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = sigterm.recv() => {}
        }
        Ok::<(), std::io::Error>(())
    };
    let mut failure = None;
    tokio::select! {
        r = term => {
            r.context("waiting for signals")?;
            tracing::info!("shutting down; tasks keep running");
        }
        r = &mut client_task => {
            client_done = true;
            if let Err(e) = r {
                failure = Some(anyhow!("the client panicked: {e}"));
            } else {
                tracing::warn!("the client stopped; shutting down");
            }
        }
        Some(r) = tasks.join_next() => {
            match r {
                Ok(Ok(())) => tracing::warn!("an agent component stopped; shutting down"),
                Ok(Err(e)) => failure = Some(e),
                Err(e) => failure = Some(anyhow!("agent component panicked: {e}")),
            }
        }
    }
    let _ = client_stop_tx.send(true);
    if !client_done
        && tokio::time::timeout(Duration::from_secs(5), &mut client_task)
            .await
            .is_err()
    {
        tracing::warn!("the client did not stop within 5s; going on");
    }
    let _ = shutdown_tx.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .is_err()
    {
        tracing::warn!("components did not stop within 10s; exiting anyway");
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_node_name_that_breaks_the_name_rule_is_refused_before_anything_starts() {
        for bad in ["../n1", "a b", ""] {
            let e = AgentConfig::from_args(&args(&["-dev", "-node-name", bad]))
                .expect_err(bad)
                .to_string();
            assert!(e.contains("-node-name"), "{e}");
        }
        let Ok(AgentCommand::Run(c)) =
            AgentConfig::from_args(&args(&["-dev", "-node-name", "worker-1"]))
        else {
            panic!("a good node name is taken");
        };
        assert_eq!(c.node_name.as_deref(), Some("worker-1"));
    }

    #[test]
    fn durations_beyond_the_limit_are_too_large() {
        for flag in ["-heartbeat-ttl", "-gc-interval", "-gc-alloc-threshold"] {
            let e = AgentConfig::from_args(&args(&["-dev", flag, "20000h"]))
                .expect_err(flag)
                .to_string();
            assert!(e.contains("too large"), "{flag}: {e}");
            let e = AgentConfig::from_args(&args(&["-dev", flag, "99999999999999999999999h"]))
                .expect_err(flag)
                .to_string();
            assert!(e.contains("too large"), "{flag}: {e}");
        }
    }

    /// Flags the agent knows, a few it does not, and values of every kind.
    fn arg() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let flag = prop::sample::select(vec![
            "dev",
            "data-dir",
            "http-addr",
            "rpc-addr",
            "node-name",
            "heartbeat-ttl",
            "gc-max-allocs",
            "gc-interval",
            "gc-alloc-threshold",
            "config",
            "help",
            "h",
            "nope",
            "",
        ]);
        let value = prop_oneof![
            "\\PC{0,12}",
            Just("0s".to_string()),
            Just("1y".to_string()),
            Just("99999999999999999999999h".to_string()),
            Just("18446744073709551616".to_string()),
            Just("127.0.0.1:0".to_string()),
            Just("../x".to_string()),
            Just("-dev".to_string()),
        ];
        prop_oneof![
            (prop::sample::select(vec!["-", "--"]), flag.clone())
                .prop_map(|(dash, f)| format!("{dash}{f}")),
            (flag, value.clone()).prop_map(|(f, v)| format!("-{f}={v}")),
            value,
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 2048,
            failure_persistence: None,
            ..proptest::test_runner::Config::default()
        })]

        /// Any command line is a config, a help request or an error: never
        /// a panic, and a config holds only what the rules allow.
        #[test]
        fn any_command_line_is_a_config_or_a_clear_error(
            mut argv in proptest::collection::vec(arg(), 0..8),
            dev in proptest::bool::ANY,
        ) {
            if dev {
                argv.insert(0, "-dev".to_string());
            }
            match AgentConfig::from_args(&argv) {
                Ok(AgentCommand::Run(c)) => {
                    proptest::prop_assert!(c.dev);
                    if let Some(n) = &c.node_name {
                        proptest::prop_assert!(berth_structs::is_valid_name(n), "{n:?}");
                    }
                    let max = berth_structs::limits::MAX_DURATION;
                    proptest::prop_assert!(c.min_heartbeat_ttl <= max);
                    proptest::prop_assert!(c.gc_alloc_threshold <= max);
                    proptest::prop_assert!(!c.gc_interval.is_zero() && c.gc_interval <= max);
                }
                Ok(AgentCommand::Help) => {}
                Err(e) => proptest::prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
