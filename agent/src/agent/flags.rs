//! What `berth agent` was asked to run: its flags over its configuration
//! files, checked, as one [`AgentConfig`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use berth_client::ClientConfig;

/// What `berth agent` was asked to run.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub dev: bool,
    /// Run the server role (its agent protocol listener and the HTTP API).
    pub server: bool,
    /// Run the client role.
    pub client: bool,
    /// The servers a client-only agent dials, `HOST:PORT`: the first, and
    /// the next when one fails. Empty when
    /// the agent runs the server role itself: its client dials that.
    pub servers: Vec<String>,
    pub data_dir: Option<PathBuf>,
    pub http_addr: SocketAddr,
    /// Where the server role serves the agent protocol; port 0 picks one.
    pub rpc_addr: SocketAddr,
    pub node_name: Option<String>,
    /// Shortest heartbeat TTL the servers hand out.
    pub min_heartbeat_ttl: Duration,
    /// The server block's other heartbeat knobs; `None` keeps the
    /// server's defaults.
    pub heartbeat_grace: Option<Duration>,
    pub max_heartbeats_per_second: Option<u32>,
    /// `server { default_lost_after }`; `None` keeps the server's default.
    pub default_lost_after: Option<Duration>,
    /// Terminal allocs the client keeps (`-gc-max-allocs`).
    pub gc_max_allocs: usize,
    /// The client's duration settings, the flags over the files; what is
    /// absent keeps the client's default
    /// ([`crate::config::client_settings`]).
    pub client_durations: crate::config::ClientDurations,
    /// The client's node class and meta, registered with the node.
    pub node_class: Option<String>,
    /// The node's datacenter (the config's `datacenter`).
    pub datacenter: Option<String>,
    pub meta: BTreeMap<String, String>,
    /// `client { reserved }`: CPU (MHz) and memory (MiB) the node keeps
    /// for itself.
    pub reserved_cpu: u64,
    pub reserved_memory_mb: u64,
    pub reserved_disk_mb: u64,
    /// The log filter when `BERTH_LOG` (and `RUST_LOG`) is not set.
    pub log_level: Option<String>,
    /// `-log-level`: set on the command line, it wins over the files, also
    /// when SIGHUP reloads them.
    pub log_level_flag: Option<String>,
    /// Logs as JSON lines (`log_json`, `-log-json`).
    pub log_json: bool,
    /// The `-config` paths, read again on SIGHUP for the log level.
    pub config_paths: Vec<PathBuf>,
    /// What those files said at start, to tell on SIGHUP whether keys
    /// other than `log_level` changed.
    pub files_at_start: Option<crate::config::AgentFileConfig>,
    /// Config keys that were set but that this version does not apply
    /// yet; logged at start.
    pub not_applied: Vec<&'static str>,
    /// What in the files is likely a mistake, though the agent can start
    /// with it; logged at start.
    pub config_warnings: Vec<String>,
    /// `region`, `insecure_bind`, `acl`, `tls` and `limits` (`-dev`: ACLs
    /// only with `-acl-enabled`, no TLS).
    pub security: crate::config::SecuritySections,
    /// `client { intro_token }`: what a new node registers with.
    pub intro_token: Option<crate::config::ConfigSecret>,
    /// Where the server keeps its state (`server { store }`, `etcd`).
    pub store: berth_server::StoreConfig,
    /// The client runs raw_exec tasks: `plugin "raw_exec" { config {
    /// enabled = true } }`, or `-dev`.
    pub raw_exec_enabled: bool,
    /// `-cgroup-parent`, else `client { cgroup_parent }`; None: the
    /// client's default.
    pub cgroup_parent: Option<String>,
    /// `plugin "exec" { config { denied_host_uids, denied_host_gids } }`;
    /// None: the client's default.
    pub exec_denied: Option<berth_allocrunner::users::DeniedIds>,
    /// The same of `raw_exec`.
    pub raw_exec_denied: Option<berth_allocrunner::users::DeniedIds>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            dev: false,
            server: false,
            client: false,
            servers: Vec::new(),
            data_dir: None,
            http_addr: "127.0.0.1:4747".parse().expect("valid literal"),
            rpc_addr: "127.0.0.1:0".parse().expect("valid literal"),
            node_name: None,
            min_heartbeat_ttl: Duration::from_secs(10),
            heartbeat_grace: None,
            max_heartbeats_per_second: None,
            default_lost_after: None,
            gc_max_allocs: ClientConfig::DEFAULT_GC_MAX_ALLOCS,
            client_durations: crate::config::ClientDurations::default(),
            node_class: None,
            datacenter: None,
            meta: BTreeMap::new(),
            reserved_cpu: 0,
            reserved_memory_mb: 0,
            reserved_disk_mb: 0,
            log_level: None,
            log_level_flag: None,
            log_json: false,
            config_paths: Vec::new(),
            files_at_start: None,
            not_applied: Vec::new(),
            config_warnings: Vec::new(),
            security: crate::config::SecuritySections::default(),
            intro_token: None,
            store: berth_server::StoreConfig::Embedded,
            raw_exec_enabled: false,
            cgroup_parent: None,
            exec_denied: None,
            raw_exec_denied: None,
        }
    }
}

/// The HTTP API's port when neither a flag nor a file sets one (the
/// CLI's default address).
pub const DEFAULT_HTTP_PORT: u16 = 4747;
/// The server's agent protocol port when neither a flag nor a file sets
/// one.
pub const DEFAULT_RPC_PORT: u16 = 4647;

pub use berth_cli::agent_args::AgentArgs;

/// A command line `berth agent` cannot make sense of.
fn usage_error(message: impl Into<String>) -> anyhow::Error {
    berth_cli::usage_error(&["agent"], message)
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
#[cfg(test)]
#[derive(Debug, Clone)]
pub enum AgentCommand {
    Run(Box<AgentConfig>),
    /// `-h`, `-help`: clap printed the help.
    Help,
}

/// What the command line set, before the files are merged under it.
#[derive(Debug, Default)]
struct Flags {
    dev: bool,
    configs: Vec<PathBuf>,
    server: bool,
    client: bool,
    servers: Option<Vec<String>>,
    data_dir: Option<PathBuf>,
    http_addr: Option<SocketAddr>,
    rpc_addr: Option<SocketAddr>,
    node_name: Option<String>,
    min_heartbeat_ttl: Option<Duration>,
    log_level: Option<String>,
    log_json: bool,
    acl_enabled: bool,
    /// A flag given that only the server role uses, and one that only the
    /// client role uses: refused when that role is off.
    server_flag: Option<&'static str>,
    client_flag: Option<&'static str>,
}

/// `HOST:PORT` of the flag `name`.
fn addr_flag(name: &str, v: &str) -> Result<SocketAddr> {
    v.parse()
        .with_context(|| format!("berth agent: -{name} {v:?} is not HOST:PORT"))
}

impl AgentConfig {
    /// The command line as the tests write it (`["-dev", "-node", "n1"]`),
    /// parsed as `berth agent` parses it.
    #[cfg(test)]
    pub fn from_args(args: &[String]) -> Result<AgentCommand> {
        let argv = std::iter::once("agent".to_string())
            .chain(args.iter().cloned())
            .collect();
        match berth_cli::parse(argv)? {
            berth_cli::Parsed::Run(cli) => match cli.command {
                berth_cli::Command::Agent(a) => {
                    Ok(AgentCommand::Run(Box::new(AgentConfig::from_flags(*a)?)))
                }
                other => bail!("not an agent command: {other:?}"),
            },
            berth_cli::Parsed::Print(..) => Ok(AgentCommand::Help),
        }
    }

    /// The agent's configuration: the flags over the config files they
    /// name (or `-dev`'s, without files).
    pub fn from_flags(a: AgentArgs) -> Result<AgentConfig> {
        let mut c = AgentConfig::default();
        let mut f = Flags {
            dev: a.dev,
            configs: a.config,
            server: a.server,
            client: a.client,
            data_dir: a.data_dir,
            log_json: a.log_json,
            acl_enabled: a.acl_enabled,
            ..Flags::default()
        };
        f.server_flag = [
            (a.rpc_addr.is_some(), "rpc-addr"),
            (a.heartbeat_ttl.is_some(), "heartbeat-ttl"),
        ]
        .into_iter()
        .find_map(|(set, name)| set.then_some(name));
        // The client's duration flags, by the table's flag names.
        let duration_flags = [
            ("gc-interval", &a.gc_interval),
            ("gc-alloc-threshold", &a.gc_alloc_threshold),
            ("csi-fingerprint-interval", &a.csi_fingerprint_interval),
            ("csi-volume-stats-interval", &a.csi_volume_stats_interval),
        ];
        f.client_flag = [
            ("gc-max-allocs", &a.gc_max_allocs),
            ("cgroup-parent", &a.cgroup_parent),
        ]
        .into_iter()
        .chain(duration_flags)
        .find_map(|(name, v)| v.is_some().then_some(name));
        if let Some(v) = &a.servers {
            let mut list = Vec::new();
            for s in v.split(',') {
                crate::config::check_server_addr(s)
                    .map_err(|e| anyhow!("berth agent: -servers: {e}"))?;
                list.push(s.to_string());
            }
            f.servers = Some(list);
        }
        if let Some(v) = &a.http_addr {
            f.http_addr = Some(addr_flag("http-addr", v)?);
        }
        if let Some(v) = &a.rpc_addr {
            f.rpc_addr = Some(addr_flag("rpc-addr", v)?);
        }
        if let Some(v) = a.node {
            berth_structs::check_name("node name", &v)
                .with_context(|| format!("berth agent: -node (-node-name) {v:?}"))?;
            f.node_name = Some(v);
        }
        if let Some(v) = &a.heartbeat_ttl {
            f.min_heartbeat_ttl = Some(duration_flag("heartbeat-ttl", v)?);
        }
        if let Some(v) = &a.log_level {
            let v = v.to_ascii_lowercase();
            if !crate::config::LOG_LEVELS.contains(&v.as_str()) {
                return Err(usage_error(format!(
                    "berth agent: -log-level: unknown level {v:?} (want one of {})",
                    crate::config::LOG_LEVELS.join(", ")
                )));
            }
            f.log_level = Some(v);
        }
        // The client's garbage collection knobs.
        if let Some(v) = &a.gc_max_allocs {
            c.gc_max_allocs = v.parse().with_context(|| {
                format!("berth agent: -gc-max-allocs {v:?} is not a whole number")
            })?;
        }
        if let Some(v) = &a.cgroup_parent {
            berth_allocrunner::cgroups::check_parent(v)
                .map_err(|e| usage_error(format!("berth agent: -cgroup-parent: {e}")))?;
            c.cgroup_parent = Some(v.clone());
        }
        for (flag, v) in duration_flags {
            let Some(v) = v else { continue };
            let setting = crate::config::client_settings::by_flag(flag)
                .ok_or_else(|| anyhow!("berth agent: -{flag} is not a client setting"))?;
            let d = duration_flag(flag, v)?;
            if let Some(problem) = setting.least.problem(d) {
                bail!("berth agent: -{flag} {problem}");
            }
            c.client_durations.set(setting.key, d);
        }
        if f.dev {
            c.apply_dev(f)?;
        } else {
            c.apply_files(f)?;
        }
        Ok(c)
    }

    /// `-dev`: both roles in one process, as the flags say, no files.
    fn apply_dev(&mut self, f: Flags) -> Result<()> {
        let clash = [
            (f.server, "-server"),
            (f.client, "-client"),
            (!f.configs.is_empty(), "-config"),
            (f.servers.is_some(), "-servers"),
        ];
        if let Some((_, flag)) = clash.iter().find(|(set, _)| *set) {
            return Err(usage_error(format!(
                "berth agent: -dev runs a server and a client in one process; \
                 it cannot be combined with {flag}"
            )));
        }
        self.dev = true;
        self.server = true;
        self.client = true;
        // A first try runs the examples as they are.
        self.raw_exec_enabled = true;
        self.data_dir = f.data_dir;
        if let Some(a) = f.http_addr {
            self.http_addr = a;
        }
        if let Some(a) = f.rpc_addr {
            self.rpc_addr = a;
        }
        self.node_name = f.node_name;
        if let Some(d) = f.min_heartbeat_ttl {
            self.min_heartbeat_ttl = d;
        }
        self.log_level = f.log_level.clone();
        self.log_level_flag = f.log_level;
        self.log_json = f.log_json;
        self.security.acl.enabled = Some(f.acl_enabled);
        Ok(())
    }

    /// Not `-dev`: the config files, the flags over them, checked as
    /// `berth config validate` checks files.
    fn apply_files(&mut self, f: Flags) -> Result<()> {
        let (files, mut file) =
            crate::config::read_merged(&f.configs).context("berth agent: -config")?;
        self.files_at_start = Some(file.clone());
        if f.server {
            file.server.enabled = Some(true);
        }
        if f.client {
            file.client.enabled = Some(true);
        }
        if f.servers.is_some() {
            file.client.servers = f.servers;
        }
        if f.data_dir.is_some() {
            file.data_dir = f.data_dir;
        }
        if f.node_name.is_some() {
            file.name = f.node_name;
        }
        if f.min_heartbeat_ttl.is_some() {
            file.server.min_heartbeat_ttl = f.min_heartbeat_ttl;
        }
        if f.log_level.is_some() {
            file.log_level = f.log_level.clone();
        }
        if f.log_json {
            file.log_json = Some(true);
        }
        if f.acl_enabled {
            file.security.acl.enabled = Some(true);
        }
        let file = crate::config::check_whole(files, file)
            .context("berth agent: the configuration (files and flags)")?;
        if let (false, Some(flag)) = (file.server_enabled(), &f.server_flag) {
            return Err(usage_error(format!(
                "berth agent: -{flag} is for the server role, which this agent does not run"
            )));
        }
        if let (false, Some(flag)) = (file.client_enabled(), &f.client_flag) {
            return Err(usage_error(format!(
                "berth agent: -{flag} is for the client role, which this agent does not run"
            )));
        }
        let bind = file
            .bind_addr
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        self.server = file.server_enabled();
        self.client = file.client_enabled();
        self.servers = file.client.servers.clone().unwrap_or_default();
        self.data_dir = file.data_dir.clone();
        self.node_name = file.name.clone();
        self.http_addr = f.http_addr.unwrap_or(SocketAddr::new(
            bind,
            file.ports.http.unwrap_or(DEFAULT_HTTP_PORT),
        ));
        self.rpc_addr = f.rpc_addr.unwrap_or(SocketAddr::new(
            bind,
            file.ports.rpc.unwrap_or(DEFAULT_RPC_PORT),
        ));
        // The addresses the flags set are held to what bind_addr is.
        if let Some(problem) = file
            .security
            .insecure_bind_problem(self.server, &[self.http_addr.ip(), self.rpc_addr.ip()])
        {
            return Err(usage_error(format!("berth agent: {problem}")));
        }
        if let Some(d) = file.server.min_heartbeat_ttl {
            self.min_heartbeat_ttl = d;
        }
        self.heartbeat_grace = file.server.heartbeat_grace;
        self.max_heartbeats_per_second = file.server.max_heartbeats_per_second;
        self.default_lost_after = file.server.default_lost_after;
        if self.server {
            self.store =
                crate::config::store::store_config(file.server.store.as_deref(), &file.etcd)
                    .map_err(|problem| usage_error(format!("berth agent: {problem}")))?;
            self.config_warnings
                .extend(crate::config::store::etcd_block_unused(
                    file.server.store.as_deref(),
                    &file.etcd,
                ));
        }
        self.log_level = file.log_level.clone();
        self.log_level_flag = f.log_level;
        self.log_json = file.log_json.unwrap_or(false);
        self.config_paths = f.configs;
        self.security = file.security.clone();
        self.intro_token = file.client.intro_token.clone();
        self.datacenter = file.datacenter.clone();
        self.raw_exec_enabled = file.plugins.raw_exec_enabled.unwrap_or(false);
        self.exec_denied = file.plugins.exec_denied.clone();
        self.raw_exec_denied = file.plugins.raw_exec_denied.clone();
        if file.client_enabled() {
            let c = &file.client;
            self.node_class = c.node_class.clone();
            self.meta = c.meta.clone();
            self.reserved_cpu = c.reserved.cpu.unwrap_or(0);
            self.reserved_memory_mb = c.reserved.memory.unwrap_or(0);
            self.reserved_disk_mb = c.reserved.disk.unwrap_or(0);
            if self.cgroup_parent.is_none() {
                self.cgroup_parent = c.cgroup_parent.clone();
            }
            // The flags win over the files.
            self.client_durations = c
                .durations
                .clone()
                .merge(std::mem::take(&mut self.client_durations));
        }
        self.not_applied = not_applied_yet(&file);
        Ok(())
    }

    /// The client role's configuration: its data in `data_dir`, its
    /// servers' agent protocol at `servers` (`http://HOST:PORT` each).
    pub fn client_config(&self, data_dir: PathBuf, servers: Vec<String>) -> ClientConfig {
        let defaults = ClientConfig::new(data_dir, servers);
        let mut config = ClientConfig {
            node_name: self.node_name.clone(),
            gc_max_allocs: self.gc_max_allocs,
            datacenter: self
                .datacenter
                .clone()
                .unwrap_or_else(|| defaults.datacenter.clone()),
            region: self.security.effective_region().to_string(),
            node_class: self.node_class.clone().unwrap_or_default(),
            meta: self.meta.clone(),
            reserved_cpu: self.reserved_cpu,
            reserved_memory_mb: self.reserved_memory_mb,
            reserved_disk_mb: self.reserved_disk_mb,
            intro_token: self.intro_token.clone(),
            local_api: Some(crate::http::client_forward::local_api_factory()),
            raw_exec_enabled: self.raw_exec_enabled,
            cgroup_parent: self
                .cgroup_parent
                .clone()
                .unwrap_or_else(|| defaults.cgroup_parent.clone()),
            exec_denied: self
                .exec_denied
                .clone()
                .unwrap_or_else(|| defaults.exec_denied.clone()),
            raw_exec_denied: self
                .raw_exec_denied
                .clone()
                .unwrap_or_else(|| defaults.raw_exec_denied.clone()),
            ..defaults
        };
        self.client_durations.apply(&mut config);
        config
    }
}

/// The keys of `file` this agent reads but does not act on yet, so that
/// it can say so at start rather than drop them silently.
fn not_applied_yet(file: &crate::config::AgentFileConfig) -> Vec<&'static str> {
    let c = &file.client;
    let r = &c.reserved;
    let s = &file.server;
    let no_server = !file.server_enabled();
    let no_client = !file.client_enabled();
    let server_knobs = s.heartbeat_grace.is_some()
        || s.min_heartbeat_ttl.is_some()
        || s.max_heartbeats_per_second.is_some()
        || s.default_lost_after.is_some();
    [
        (
            no_server && file.ports.rpc.is_some(),
            "ports.rpc (for the server role, which is off)",
        ),
        (no_server && server_knobs, "server (the server role is off)"),
        (
            no_client
                && (c.servers.is_some()
                    || c.node_class.is_some()
                    || !c.meta.is_empty()
                    || r.cpu.is_some()
                    || r.memory.is_some()
                    || r.disk.is_some()
                    || !c.durations.is_empty()),
            "client (the client role is off)",
        ),
    ]
    .into_iter()
    .filter_map(|(set, key)| set.then_some(key))
    .collect()
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

    fn run(v: &[&str]) -> AgentConfig {
        match AgentConfig::from_args(&args(v)) {
            Ok(AgentCommand::Run(c)) => *c,
            other => panic!("{v:?}: {other:?}"),
        }
    }

    #[test]
    fn dev_cannot_be_combined_with_a_role_servers_or_config_files() {
        for flags in [
            &["-dev", "-server"][..],
            &["-dev", "-client"],
            &["-dev", "-config", "/etc/berth.d"],
            &["-dev", "-servers", "127.0.0.1:4647"],
            &["-server", "-dev"],
        ] {
            let e = AgentConfig::from_args(&args(flags))
                .expect_err(&format!("{flags:?}"))
                .to_string();
            assert!(e.contains("cannot be combined with"), "{flags:?}: {e}");
        }
        let c = run(&["-dev"]);
        assert!(c.dev && c.server && c.client && c.servers.is_empty());
        assert_eq!(c.http_addr, "127.0.0.1:4747".parse().unwrap());
        assert_eq!(c.rpc_addr, "127.0.0.1:0".parse().unwrap());
    }

    #[test]
    fn flags_alone_make_a_server_agent() {
        let c = run(&[
            "-server",
            "-data-dir",
            "/tmp/s",
            "-http-addr",
            "127.0.0.1:5000",
            "-rpc-addr",
            "127.0.0.1:0",
        ]);
        assert!(!c.dev && c.server && !c.client);
        assert_eq!(c.data_dir, Some(PathBuf::from("/tmp/s")));
        assert_eq!(c.http_addr, "127.0.0.1:5000".parse().unwrap());
        assert_eq!(c.rpc_addr, "127.0.0.1:0".parse().unwrap());
        // Ports default to the CLI's and the agent protocol's.
        let c = run(&["-server", "-data-dir", "/tmp/s"]);
        assert_eq!(c.http_addr, "127.0.0.1:4747".parse().unwrap());
        assert_eq!(c.rpc_addr, "127.0.0.1:4647".parse().unwrap());
    }

    #[test]
    fn a_client_agent_needs_servers_and_takes_a_node_name() {
        let c = run(&[
            "-client",
            "-data-dir=/tmp/c",
            "-servers",
            "127.0.0.1:4647,10.0.0.2:4647",
            "-node",
            "worker-2",
        ]);
        assert!(c.client && !c.server);
        assert_eq!(c.servers, ["127.0.0.1:4647", "10.0.0.2:4647"]);
        assert_eq!(c.node_name.as_deref(), Some("worker-2"));
        let e = AgentConfig::from_args(&args(&["-client", "-data-dir", "/tmp/c"])).unwrap_err();
        assert!(
            format!("{e:#}").contains("the client has no servers"),
            "{e:#}"
        );
        let e = AgentConfig::from_args(&args(&["-client", "-servers", "10.0.0.1"])).unwrap_err();
        assert!(
            format!("{e:#}").contains("\"10.0.0.1\" is not HOST:PORT"),
            "{e:#}"
        );
        for missing in [&["-server"][..], &[]] {
            let e = AgentConfig::from_args(&args(missing)).unwrap_err();
            assert!(format!("{e:#}").contains("data_dir is not set"), "{e:#}");
        }
        for flag in ["-rpc-addr=127.0.0.1:1", "-heartbeat-ttl=1s"] {
            let e =
                AgentConfig::from_args(&args(&["-client", "-data-dir=/c", "-servers=h:1", flag]))
                    .unwrap_err();
            assert!(e.to_string().contains("for the server role"), "{flag}: {e}");
        }
        let e = AgentConfig::from_args(&args(&["-server", "-data-dir=/s", "-gc-interval=1m"]))
            .unwrap_err();
        assert!(e.to_string().contains("for the client role"), "{e}");
        let client_hcl = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/agent/client.hcl");
        let c = run(&["-config", client_hcl, "-data-dir=/c"]);
        assert!(c.client && !c.server);
        // A client-only agent serves the HTTP API on its ports.http.
        assert!(
            !c.not_applied.iter().any(|k| k.starts_with("ports.http")),
            "{:?}",
            c.not_applied
        );
        assert_eq!(c.http_addr, "127.0.0.1:4748".parse().unwrap());
        let c = run(&[
            "-client",
            "-data-dir=/c",
            "-servers=h:1",
            "-http-addr=127.0.0.1:1",
        ]);
        assert_eq!(c.http_addr, "127.0.0.1:1".parse().unwrap());
        let e = AgentConfig::from_args(&args(&["-data-dir", "/d"])).unwrap_err();
        assert!(
            format!("{e:#}").contains("neither the server nor the client"),
            "{e:#}"
        );
    }

    #[test]
    fn flags_override_the_config_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("10-server.hcl"),
            "data_dir = \"/var/lib/berth\"\nname = \"s1\"\nbind_addr = \"0.0.0.0\"\n\
             insecure_bind = true\n\
             ports {\n http = 5646\n rpc = 5647\n}\nserver {\n enabled = true\n \
             heartbeat_grace = \"7s\"\n min_heartbeat_ttl = \"3s\"\n \
             max_heartbeats_per_second = 20\n}\nclient {\n meta {\n rack = \"r1\"\n }\n}\n",
        )
        .unwrap();
        let d = dir.path().to_str().unwrap();
        let c = run(&["-config", d]);
        assert!(c.server && !c.client);
        assert_eq!(c.http_addr, "0.0.0.0:5646".parse().unwrap());
        assert_eq!(c.rpc_addr, "0.0.0.0:5647".parse().unwrap());
        assert_eq!(c.node_name.as_deref(), Some("s1"));
        assert_eq!(c.min_heartbeat_ttl, Duration::from_secs(3));
        assert_eq!(c.heartbeat_grace, Some(Duration::from_secs(7)));
        assert_eq!(c.max_heartbeats_per_second, Some(20));
        assert_eq!(c.not_applied, ["client (the client role is off)"]);
        let c = run(&[
            "-config",
            d,
            "-data-dir",
            "/tmp/other",
            "-rpc-addr",
            "127.0.0.1:0",
            "-node-name",
            "s2",
            "-heartbeat-ttl",
            "9s",
        ]);
        assert_eq!(c.data_dir, Some(PathBuf::from("/tmp/other")));
        assert_eq!(c.rpc_addr, "127.0.0.1:0".parse().unwrap());
        assert_eq!(c.http_addr, "0.0.0.0:5646".parse().unwrap());
        assert_eq!(c.node_name.as_deref(), Some("s2"));
        assert_eq!(c.min_heartbeat_ttl, Duration::from_secs(9));
        let e = AgentConfig::from_args(&args(&["-config", "/nonexistent/berth.hcl"])).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/berth.hcl"), "{e:#}");
    }

    fn client_file(body: &str) -> (tempfile::TempDir, AgentConfig) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("client.hcl");
        std::fs::write(&path, body).unwrap();
        let c = run(&["-config", path.to_str().unwrap()]);
        (dir, c)
    }

    const CLIENT_HCL: &str = r#"
data_dir  = "/tmp/c"
log_level = "debug"
client {
  enabled                  = true
  servers                  = ["127.0.0.1:4647"]
  node_class               = "storage"
  meta {
    rack = "r1"
    zone = "z2"
  }
  reserved {
    cpu    = 500
    memory = 512
    disk   = 1024
  }
  disconnect_startup_grace = "30s"
}
"#;

    fn client_config(c: &AgentConfig) -> ClientConfig {
        c.client_config(std::env::temp_dir(), vec!["http://127.0.0.1:4647".into()])
    }

    #[test]
    fn node_class_and_meta_of_the_config_are_registered_with_the_node() {
        let (_dir, c) = client_file(CLIENT_HCL);
        let node = berth_client::node_fingerprint(&client_config(&c), "n1".into());
        assert_eq!(node.node_class, "storage");
        assert_eq!(
            node.meta,
            BTreeMap::from([
                ("rack".to_string(), "r1".to_string()),
                ("zone".to_string(), "z2".to_string())
            ])
        );
        assert!(!c
            .not_applied
            .iter()
            .any(|k| k.contains("node_class") || k.contains("meta")));
        // Without them the node has no class and no meta.
        let node = berth_client::node_fingerprint(&client_config(&run(&["-dev"])), "n1".into());
        assert!(node.node_class.is_empty() && node.meta.is_empty());
    }

    #[test]
    fn reserved_cpu_memory_and_disk_come_off_the_fingerprinted_resources() {
        let (_dir, c) = client_file(CLIENT_HCL);
        let bare = berth_client::node_fingerprint(&client_config(&run(&["-dev"])), "n1".into());
        let cc = client_config(&c);
        let node = berth_client::node_fingerprint(&cc, "n1".into());
        assert_eq!(node.resources.cpu, bare.resources.cpu.saturating_sub(500));
        assert_eq!(
            node.resources.memory_mb,
            bare.resources.memory_mb.saturating_sub(512)
        );
        // The free disk of the data dir's filesystem, less the reserve
        // (the free space may move a little between the two reads).
        assert!(bare.resources.disk_mb > 0, "{:?}", bare.resources);
        let expected = bare.resources.disk_mb.saturating_sub(1024);
        assert!(
            node.resources.disk_mb.abs_diff(expected) <= 64,
            "{} vs {expected}",
            node.resources.disk_mb
        );
        assert!(c.not_applied.is_empty(), "{:?}", c.not_applied);
        // More than the machine has leaves nothing, never a wrap.
        let all = ClientConfig {
            reserved_cpu: u64::MAX,
            reserved_memory_mb: u64::MAX,
            reserved_disk_mb: u64::MAX,
            ..cc
        };
        let node = berth_client::node_fingerprint(&all, "n1".into());
        assert_eq!(
            (
                node.resources.cpu,
                node.resources.memory_mb,
                node.resources.disk_mb
            ),
            (0, 0, 0)
        );
    }

    #[test]
    fn log_level_of_the_config_reaches_the_agent() {
        let (_dir, c) = client_file(CLIENT_HCL);
        assert_eq!(c.log_level.as_deref(), Some("debug"));
        assert!(!c.not_applied.iter().any(|k| k.starts_with("log_level")));
        assert!(!c.log_json && c.log_level_flag.is_none());
        let (dir, c) = client_file(&format!("{CLIENT_HCL}\nlog_json = true\n"));
        assert!(c.log_json);
        assert!(!c.not_applied.iter().any(|k| k.contains("log_json")));
        // The files are kept to be read again on SIGHUP.
        assert_eq!(c.config_paths, [dir.path().join("client.hcl")]);
        assert_eq!(
            c.files_at_start
                .as_ref()
                .and_then(|f| f.log_level.as_deref()),
            Some("debug")
        );
    }

    #[test]
    fn log_flags_override_the_config_files() {
        let (dir, _) = client_file(CLIENT_HCL);
        let path = dir.path().join("client.hcl");
        let c = run(&[
            "-config",
            path.to_str().unwrap(),
            "-log-level",
            "WARN",
            "-log-json",
        ]);
        assert_eq!(c.log_level.as_deref(), Some("warn"));
        assert_eq!(c.log_level_flag.as_deref(), Some("warn"));
        assert!(c.log_json);
        let c = run(&["-dev", "-log-level=error", "-log-json"]);
        assert_eq!(c.log_level.as_deref(), Some("error"));
        assert!(c.log_json);
        let e = AgentConfig::from_args(&args(&["-dev", "-log-level", "loud"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("-log-level") && e.contains("\"loud\""), "{e}");
    }

    #[test]
    fn disconnect_startup_grace_of_the_config_reaches_the_client() {
        let (_dir, c) = client_file(CLIENT_HCL);
        assert_eq!(
            client_config(&c).disconnect_startup_grace,
            Duration::from_secs(30)
        );
        // Unset, the heartbeat crate's default stays.
        assert_eq!(
            client_config(&run(&["-dev"])).disconnect_startup_grace,
            berth_heartbeat::DisconnectConfig::default().startup_grace
        );
    }

    #[test]
    fn the_cgroup_parent_of_the_flag_wins_over_the_config_and_must_be_relative() {
        let hcl = CLIENT_HCL.replacen("client {", "client {\n  cgroup_parent = \"ops/berth\"", 1);
        let (dir, c) = client_file(&hcl);
        assert_eq!(client_config(&c).cgroup_parent, "ops/berth");
        let file = dir.path().join("client.hcl");
        let flagged = run(&["-config", file.to_str().unwrap(), "-cgroup-parent", "b2"]);
        assert_eq!(client_config(&flagged).cgroup_parent, "b2");
        assert_eq!(client_config(&run(&["-dev"])).cgroup_parent, "berth");
        let e = AgentConfig::from_args(&args(&["-dev", "-cgroup-parent", "../x"]))
            .expect_err("not relative");
        assert!(
            format!("{e:#}").contains("-cgroup-parent: cgroup parent \"../x\" must be a relative"),
            "{e:#}"
        );
        let bad = CLIENT_HCL.replacen("client {", "client {\n  cgroup_parent = \"/abs\"", 1);
        let path = dir.path().join("bad.hcl");
        std::fs::write(&path, bad).unwrap();
        let e = AgentConfig::from_args(&args(&["-config", path.to_str().unwrap()]))
            .expect_err("absolute");
        assert!(format!("{e:#}").contains("cgroup_parent"), "{e:#}");
    }

    #[test]
    fn csi_call_timeout_of_the_config_reaches_the_client() {
        let hcl = CLIENT_HCL.replacen("client {", "client {\n  csi_call_timeout = \"3s\"", 1);
        let (dir, c) = client_file(&hcl);
        assert_eq!(client_config(&c).csi_call_timeout, Duration::from_secs(3));
        assert_eq!(
            client_config(&run(&["-dev"])).csi_call_timeout,
            Duration::from_secs(30)
        );
        let zero = CLIENT_HCL.replacen("client {", "client {\n  csi_call_timeout = \"0s\"", 1);
        let path = dir.path().join("zero.hcl");
        std::fs::write(&path, zero).unwrap();
        let e =
            AgentConfig::from_args(&args(&["-config", path.to_str().unwrap()])).expect_err("zero");
        assert!(format!("{e:#}").contains("csi_call_timeout"), "{e:#}");
    }

    #[test]
    fn csi_volume_stats_interval_of_the_config_reaches_the_client() {
        let hcl = CLIENT_HCL.replacen(
            "client {",
            "client {\n  csi_volume_stats_interval = \"5s\"",
            1,
        );
        let (_dir, c) = client_file(&hcl);
        assert_eq!(
            client_config(&c).csi_volume_stats_interval,
            Duration::from_secs(5)
        );
        // Unset: a minute.
        assert_eq!(
            client_config(&run(&["-dev"])).csi_volume_stats_interval,
            Duration::from_secs(60)
        );
    }

    #[test]
    fn csi_volume_stats_interval_of_the_flag_wins_over_the_config() {
        let hcl = CLIENT_HCL.replacen(
            "client {",
            "client {\n  csi_volume_stats_interval = \"5s\"",
            1,
        );
        let (dir, _) = client_file(&hcl);
        let file = dir.path().join("client.hcl");
        let flagged = run(&[
            "-config",
            file.to_str().unwrap(),
            "-csi-volume-stats-interval",
            "1s",
        ]);
        assert_eq!(
            client_config(&flagged).csi_volume_stats_interval,
            Duration::from_secs(1),
            "the flag wins over the file"
        );
        assert_eq!(
            client_config(&run(&["-dev", "-csi-volume-stats-interval", "2s"]))
                .csi_volume_stats_interval,
            Duration::from_secs(2)
        );
        let e = AgentConfig::from_args(&args(&["-dev", "-csi-volume-stats-interval", "500ms"]))
            .expect_err("500ms");
        assert!(
            format!("{e:#}").contains("-csi-volume-stats-interval must be at least 1s"),
            "{e:#}"
        );
        let e = AgentConfig::from_args(&args(&["-dev", "-csi-volume-stats-interval", "soon"]))
            .expect_err("not a duration");
        assert!(
            format!("{e:#}").contains("csi-volume-stats-interval"),
            "{e:#}"
        );
    }

    #[test]
    fn csi_fingerprint_interval_of_the_config_or_the_flag_reaches_the_client() {
        let hcl = CLIENT_HCL.replacen(
            "client {",
            "client {\n  csi_fingerprint_interval = \"5s\"",
            1,
        );
        let (dir, c) = client_file(&hcl);
        assert_eq!(
            client_config(&c).csi_fingerprint_interval,
            Duration::from_secs(5)
        );
        let file = dir.path().join("client.hcl");
        let flagged = run(&[
            "-config",
            file.to_str().unwrap(),
            "-csi-fingerprint-interval",
            "1s",
        ]);
        assert_eq!(
            client_config(&flagged).csi_fingerprint_interval,
            Duration::from_secs(1),
            "the flag wins over the file"
        );
        assert_eq!(
            client_config(&run(&["-dev", "-csi-fingerprint-interval", "2s"]))
                .csi_fingerprint_interval,
            Duration::from_secs(2)
        );
        let zero = CLIENT_HCL.replacen(
            "client {",
            "client {\n  csi_fingerprint_interval = \"0s\"",
            1,
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("client.hcl");
        std::fs::write(&path, zero).unwrap();
        let e =
            AgentConfig::from_args(&args(&["-config", path.to_str().unwrap()])).expect_err("0s");
        let e = format!("{e:#}");
        assert!(
            e.contains("csi_fingerprint_interval") && e.contains("longer than 0s"),
            "{e}"
        );
        assert_eq!(
            client_config(&run(&["-dev", "-csi-fingerprint-interval", "2s"]))
                .csi_fingerprint_interval,
            Duration::from_secs(2)
        );
        assert_eq!(
            client_config(&run(&["-dev"])).csi_fingerprint_interval,
            ClientConfig::DEFAULT_CSI_FINGERPRINT_INTERVAL
        );
        let e = AgentConfig::from_args(&args(&["-dev", "-csi-fingerprint-interval", "0s"]))
            .expect_err("0s")
            .to_string();
        assert!(e.contains("longer than 0s"), "{e}");
    }

    #[test]
    fn durations_beyond_the_limit_are_too_large() {
        for flag in [
            "-heartbeat-ttl",
            "-gc-interval",
            "-gc-alloc-threshold",
            "-csi-fingerprint-interval",
        ] {
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
            "server",
            "client",
            "servers",
            "node",
            "data-dir",
            "http-addr",
            "rpc-addr",
            "node-name",
            "heartbeat-ttl",
            "gc-max-allocs",
            "gc-interval",
            "gc-alloc-threshold",
            "csi-fingerprint-interval",
            "log-level",
            "log-json",
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
                    proptest::prop_assert!(c.dev || c.data_dir.is_some());
                    proptest::prop_assert!(c.server || c.client);
                    proptest::prop_assert!(c.server || !c.servers.is_empty());
                    if let Some(n) = &c.node_name {
                        proptest::prop_assert!(berth_structs::is_valid_name(n), "{n:?}");
                    }
                    let max = berth_structs::limits::MAX_DURATION;
                    proptest::prop_assert!(c.min_heartbeat_ttl <= max);
                    let client = c.client_config("/nonexistent".into(), Vec::new());
                    proptest::prop_assert!(client.gc_alloc_threshold <= max);
                    proptest::prop_assert!(
                        !client.gc_interval.is_zero() && client.gc_interval <= max
                    );
                }
                Ok(AgentCommand::Help) => {}
                Err(e) => proptest::prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
