//! The agent's configuration files: HCL in Nomad's shape.
//!
//! ```hcl
//! data_dir  = "/var/lib/berth"
//! name      = "worker-1"
//! log_level = "info"
//! log_json  = false
//! bind_addr = "0.0.0.0"
//! ports { http = 4746, rpc = 4747 }
//! server { enabled = true, heartbeat_grace = "10s", min_heartbeat_ttl = "10s",
//!          max_heartbeats_per_second = 50, default_lost_after = "1h" }
//! client { enabled = true, servers = ["10.0.0.1:4747"], node_class = "storage",
//!          meta { rack = "r1" }, reserved { cpu = 500, memory = 512, disk = 1024 },
//!          disconnect_startup_grace = "30s", csi_volume_stats_interval = "60s",
//!          csi_call_timeout = "30s", cgroup_parent = "berth" }
//! ```
//!
//! [`load`] reads a list of paths (a directory gives its `*.hcl` files in
//! name order); later files override earlier ones attribute by attribute,
//! and `meta` key by key. A key berth does not know, a value of the wrong
//! type or out of range is an error naming the file, the line and the key.
//! The merged configuration must name a data dir, enable the server, the
//! client or both, and give a client its servers.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_structs::limits::{self, MAX_CPU_MHZ, MAX_DURATION, MAX_MEMORY_MB};
use berth_structs::spec::hcl::{BodyReader, Source};
use berth_structs::spec::SpecError;

pub mod client_settings;
pub mod plugins;
pub mod security;
pub mod store;

pub use client_settings::ClientDurations;
pub use security::{ConfigSecret, SecuritySections};

/// The largest configuration file berth reads.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// The most heartbeats per second a server may be asked to take.
pub const MAX_HEARTBEATS_PER_SECOND: u32 = 1_000_000;

/// The largest disk reservation, in MB: 1 EiB.
pub const MAX_RESERVED_DISK_MB: u64 = limits::MAX_VOLUME_CAPACITY_BYTES >> 20;

/// The log levels berth knows, as the file writes them.
pub const LOG_LEVELS: [&str; 5] = ["trace", "debug", "info", "warn", "error"];

/// A configuration that could not be read or does not hold together.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: the file is larger than {MAX_CONFIG_FILE_BYTES} bytes", path.display())]
    TooLarge { path: PathBuf },
    #[error("{}: not UTF-8 text (invalid byte at offset {offset})", path.display())]
    NotText { path: PathBuf, offset: usize },
    /// A file that is not a valid configuration: the line and what is
    /// wrong there.
    #[error("{}:{}: {}", path.display(), error.line, error.message)]
    Invalid { path: PathBuf, error: SpecError },
    /// The merged configuration misses something; `paths` are the files
    /// it was read from.
    #[error("{}: {problem}", shown_paths(paths))]
    Incomplete {
        paths: Vec<PathBuf>,
        problem: String,
    },
}

fn shown_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "no configuration files".to_string();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `ports { ... }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ports {
    /// The HTTP API.
    pub http: Option<u16>,
    /// The server's agent protocol (gRPC).
    pub rpc: Option<u16>,
}

/// `server { ... }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerSection {
    pub enabled: Option<bool>,
    pub heartbeat_grace: Option<Duration>,
    pub min_heartbeat_ttl: Option<Duration>,
    pub max_heartbeats_per_second: Option<u32>,
    /// How long a system job's allocs on a down node are held `unknown`
    /// (zero: lost at once).
    pub default_lost_after: Option<Duration>,
    /// One of [`store::STORES`].
    pub store: Option<String>,
}

/// `client { reserved { ... } }`: what the node keeps for itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reserved {
    /// MHz.
    pub cpu: Option<u64>,
    /// MB.
    pub memory: Option<u64>,
    /// MB.
    pub disk: Option<u64>,
}

/// `client { ... }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientSection {
    pub enabled: Option<bool>,
    /// The servers' agent protocol addresses, `HOST:PORT`.
    pub servers: Option<Vec<String>>,
    pub node_class: Option<String>,
    pub meta: BTreeMap<String, String>,
    pub reserved: Reserved,
    /// The duration settings (`disconnect_startup_grace`,
    /// `csi_volume_stats_interval`, ...: [`client_settings`]).
    pub durations: ClientDurations,
    /// The introduction token a new node registers with (minted by
    /// `berth node intro create`).
    pub intro_token: Option<ConfigSecret>,
    /// The cgroup `exec` tasks' cgroups are made under.
    pub cgroup_parent: Option<String>,
}

/// One agent's configuration: a file's, or several merged. What a file
/// does not set is `None` (or empty), so that merging can tell it from a
/// value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentFileConfig {
    pub data_dir: Option<PathBuf>,
    /// The node's name.
    pub name: Option<String>,
    /// The datacenter the node is in (`dc1` when none is set).
    pub datacenter: Option<String>,
    /// One of [`LOG_LEVELS`].
    pub log_level: Option<String>,
    pub log_json: Option<bool>,
    pub bind_addr: Option<IpAddr>,
    pub ports: Ports,
    pub server: ServerSection,
    pub client: ClientSection,
    /// `region`, `insecure_bind`, `acl`, `tls`, `limits`.
    pub security: SecuritySections,
    /// `etcd { ... }`: the etcd members of `server { store = "etcd" }`.
    pub etcd: store::EtcdSection,
    /// `plugin "raw_exec" { config { enabled = true } }`.
    pub plugins: plugins::PluginSettings,
}

impl AgentFileConfig {
    /// `later` over `self`: every value `later` sets wins, `meta` merges
    /// key by key.
    pub fn merge(self, later: AgentFileConfig) -> AgentFileConfig {
        let mut meta = self.client.meta;
        meta.extend(later.client.meta);
        AgentFileConfig {
            data_dir: later.data_dir.or(self.data_dir),
            name: later.name.or(self.name),
            datacenter: later.datacenter.or(self.datacenter),
            log_level: later.log_level.or(self.log_level),
            log_json: later.log_json.or(self.log_json),
            bind_addr: later.bind_addr.or(self.bind_addr),
            ports: Ports {
                http: later.ports.http.or(self.ports.http),
                rpc: later.ports.rpc.or(self.ports.rpc),
            },
            server: ServerSection {
                enabled: later.server.enabled.or(self.server.enabled),
                heartbeat_grace: later.server.heartbeat_grace.or(self.server.heartbeat_grace),
                min_heartbeat_ttl: later
                    .server
                    .min_heartbeat_ttl
                    .or(self.server.min_heartbeat_ttl),
                max_heartbeats_per_second: later
                    .server
                    .max_heartbeats_per_second
                    .or(self.server.max_heartbeats_per_second),
                default_lost_after: later
                    .server
                    .default_lost_after
                    .or(self.server.default_lost_after),
                store: later.server.store.or(self.server.store),
            },
            client: ClientSection {
                enabled: later.client.enabled.or(self.client.enabled),
                servers: later.client.servers.or(self.client.servers),
                node_class: later.client.node_class.or(self.client.node_class),
                meta,
                reserved: Reserved {
                    cpu: later.client.reserved.cpu.or(self.client.reserved.cpu),
                    memory: later.client.reserved.memory.or(self.client.reserved.memory),
                    disk: later.client.reserved.disk.or(self.client.reserved.disk),
                },
                durations: self.client.durations.merge(later.client.durations),
                intro_token: later.client.intro_token.or(self.client.intro_token),
                cgroup_parent: later.client.cgroup_parent.or(self.client.cgroup_parent),
            },
            security: self.security.merge(later.security),
            etcd: self.etcd.merge(later.etcd),
            plugins: self.plugins.merge(later.plugins),
        }
    }

    pub fn server_enabled(&self) -> bool {
        self.server.enabled == Some(true)
    }

    pub fn client_enabled(&self) -> bool {
        self.client.enabled == Some(true)
    }

    /// What a whole agent's configuration needs: a data dir, a role, and
    /// servers for a client. `None` when it has them.
    fn incomplete(&self) -> Option<String> {
        if self.data_dir.is_none() {
            return Some("data_dir is not set: every agent keeps its state in a data dir".into());
        }
        if !self.server_enabled() && !self.client_enabled() {
            return Some(
                "neither the server nor the client is enabled: set server { enabled = true } \
                 or client { enabled = true }"
                    .into(),
            );
        }
        let no_servers = self.client.servers.as_ref().is_none_or(Vec::is_empty);
        if self.client_enabled() && no_servers {
            return Some(
                "the client has no servers: set client { servers = [\"HOST:PORT\"] }".into(),
            );
        }
        if let Some(problem) = self.security.tls.incomplete() {
            return Some(problem);
        }
        if self.server_enabled() {
            if let Err(problem) = store::store_config(self.server.store.as_deref(), &self.etcd) {
                return Some(problem);
            }
        }
        let bind = self.bind_addr.into_iter().collect::<Vec<_>>();
        self.security
            .insecure_bind_problem(self.server_enabled(), &bind)
    }
}

/// Reads and merges the configuration at `paths`, in order (a directory
/// gives its `*.hcl` files in name order), and checks that the result is a
/// whole agent's configuration.
pub fn load(paths: &[PathBuf]) -> Result<AgentFileConfig, ConfigError> {
    let (files, merged) = read_merged(paths)?;
    check_whole(files, merged)
}

/// Reads and merges the configuration at `paths` like [`load`], without
/// checking that the result is whole (flags may complete it); also gives
/// the files read.
pub fn read_merged(paths: &[PathBuf]) -> Result<(Vec<PathBuf>, AgentFileConfig), ConfigError> {
    let files = config_files(paths)?;
    let mut merged = AgentFileConfig::default();
    for path in &files {
        merged = merged.merge(read_file(path)?);
    }
    Ok((files, merged))
}

/// `merged` if it is a whole agent's configuration (a data dir, a role,
/// servers for a client); `files` are named in the error.
pub fn check_whole(
    files: Vec<PathBuf>,
    merged: AgentFileConfig,
) -> Result<AgentFileConfig, ConfigError> {
    match merged.incomplete() {
        Some(problem) => Err(ConfigError::Incomplete {
            paths: files,
            problem,
        }),
        None => Ok(merged),
    }
}

/// The files `paths` name, a directory's `*.hcl` files in name order.
fn config_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, ConfigError> {
    let mut files = Vec::new();
    for path in paths {
        let read_err = |source| ConfigError::Read {
            path: path.clone(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        if !meta.is_dir() {
            files.push(path.clone());
            continue;
        }
        let mut in_dir = Vec::new();
        for entry in std::fs::read_dir(path).map_err(read_err)? {
            let entry = entry.map_err(read_err)?;
            let p = entry.path();
            let is_hcl = p.extension().is_some_and(|e| e == "hcl");
            // Follows symlinks: a linked file counts, a subdirectory not.
            if is_hcl && std::fs::metadata(&p).is_ok_and(|m| m.is_file()) {
                in_dir.push(p);
            }
        }
        in_dir.sort();
        files.extend(in_dir);
    }
    Ok(files)
}

/// Reads one configuration file.
pub fn read_file(path: &Path) -> Result<AgentFileConfig, ConfigError> {
    let read_err = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_err)?;
    let mut raw = Vec::new();
    file.take(MAX_CONFIG_FILE_BYTES.saturating_add(1))
        .read_to_end(&mut raw)
        .map_err(read_err)?;
    if raw.len() as u64 > MAX_CONFIG_FILE_BYTES {
        return Err(ConfigError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    let text = String::from_utf8(raw).map_err(|e| ConfigError::NotText {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    parse(&text).map_err(|error| ConfigError::Invalid {
        path: path.to_path_buf(),
        error,
    })
}

/// The attributes of a file's top level but the security ones.
const TOP_LEVEL_ATTRIBUTES: [&str; 6] = [
    "data_dir",
    "name",
    "datacenter",
    "log_level",
    "log_json",
    "bind_addr",
];

/// Parses the text of one configuration file.
pub fn parse(text: &str) -> Result<AgentFileConfig, SpecError> {
    let src = Source::new(text);
    let body = src.parse_body()?;
    let attributes: Vec<&str> = TOP_LEVEL_ATTRIBUTES
        .into_iter()
        .chain(SecuritySections::ATTRIBUTES)
        .collect();
    let blocks: Vec<&str> = [
        "ports",
        "server",
        "client",
        store::EtcdSection::BLOCK,
        plugins::PluginSettings::BLOCK,
    ]
    .into_iter()
    .chain(SecuritySections::BLOCKS)
    .collect();
    let r = BodyReader::new(
        &src,
        &body,
        "the agent config".into(),
        1,
        &attributes,
        &blocks,
    )?;

    let data_dir = match r.string("data_dir")? {
        None => None,
        Some(d) if !Path::new(&d).is_absolute() => {
            return Err(r.invalid("data_dir", format!("{d:?} must be an absolute path")))
        }
        Some(d) => Some(PathBuf::from(d)),
    };
    let name = r.string("name")?;
    if let Some(n) = &name {
        berth_structs::check_name("node name", n).map_err(|e| r.invalid("name", e))?;
    }
    let datacenter = r.string("datacenter")?;
    if let Some(d) = &datacenter {
        berth_structs::check_name("datacenter", d).map_err(|e| r.invalid("datacenter", e))?;
    }
    let log_level = r.string("log_level")?.map(|l| l.to_ascii_lowercase());
    if let Some(l) = &log_level {
        if !LOG_LEVELS.contains(&l.as_str()) {
            return Err(r.invalid(
                "log_level",
                format!(
                    "unknown level {l:?} (want one of {})",
                    LOG_LEVELS.join(", ")
                ),
            ));
        }
    }
    let bind_addr = r
        .string("bind_addr")?
        .map(|a| {
            a.parse::<IpAddr>()
                .map_err(|_| r.invalid("bind_addr", format!("{a:?} is not an IP address")))
        })
        .transpose()?;

    let ports = match r.optional_block("ports")? {
        None => Ports::default(),
        Some(b) => {
            let p = BodyReader::unlabeled(&src, b, r.ctx(), &["http", "rpc"], &[])?;
            Ports {
                http: port(&p, "http")?,
                rpc: port(&p, "rpc")?,
            }
        }
    };

    let server = server_section(&src, &r)?;
    let client = client_section(&src, &r)?;
    let security = SecuritySections::parse(&src, &r)?;
    let etcd = store::EtcdSection::parse(&src, &r)?;
    let plugins = plugins::PluginSettings::parse(&src, &r)?;

    Ok(AgentFileConfig {
        data_dir,
        name,
        datacenter,
        log_level,
        log_json: r.bool("log_json")?,
        bind_addr,
        ports,
        server,
        client,
        security,
        etcd,
        plugins,
    })
}

/// `server { ... }` of a configuration file.
fn server_section(src: &Source<'_>, r: &BodyReader<'_, '_>) -> Result<ServerSection, SpecError> {
    let section = match r.optional_block("server")? {
        None => ServerSection::default(),
        Some(b) => {
            let s = BodyReader::unlabeled(
                src,
                b,
                r.ctx(),
                &[
                    "enabled",
                    "heartbeat_grace",
                    "min_heartbeat_ttl",
                    "max_heartbeats_per_second",
                    "default_lost_after",
                    "store",
                ],
                &[],
            )?;
            let store = s.string("store")?;
            if let Some(kind) = &store {
                store::check_store(kind).map_err(|problem| s.invalid("store", problem))?;
            }
            let min_heartbeat_ttl = s.duration("min_heartbeat_ttl", MAX_DURATION)?;
            if min_heartbeat_ttl.is_some_and(|d| d.is_zero()) {
                return Err(s.invalid("min_heartbeat_ttl", "must be longer than 0s"));
            }
            let max_heartbeats_per_second =
                s.u32("max_heartbeats_per_second", MAX_HEARTBEATS_PER_SECOND)?;
            if max_heartbeats_per_second == Some(0) {
                return Err(s.invalid("max_heartbeats_per_second", "must be at least 1"));
            }
            ServerSection {
                enabled: s.bool("enabled")?,
                heartbeat_grace: s.duration("heartbeat_grace", MAX_DURATION)?,
                min_heartbeat_ttl,
                max_heartbeats_per_second,
                default_lost_after: s.duration("default_lost_after", MAX_DURATION)?,
                store,
            }
        }
    };
    Ok(section)
}

/// `client { ... }` of a configuration file.
fn client_section(src: &Source<'_>, r: &BodyReader<'_, '_>) -> Result<ClientSection, SpecError> {
    let section = match r.optional_block("client")? {
        None => ClientSection::default(),
        Some(b) => {
            let keys: Vec<&str> = [
                "enabled",
                "servers",
                "node_class",
                "meta",
                "intro_token",
                "cgroup_parent",
            ]
            .into_iter()
            .chain(client_settings::file_keys())
            .collect();
            let c = BodyReader::unlabeled(src, b, r.ctx(), &keys, &["meta", "reserved"])?;
            let servers = c.strings("servers")?;
            for s in servers.iter().flatten() {
                check_server_addr(s).map_err(|problem| c.invalid("servers", problem))?;
            }
            let node_class = c.string("node_class")?;
            if let Some(n) = &node_class {
                berth_structs::check_name("node class", n)
                    .map_err(|e| c.invalid("node_class", e))?;
            }
            let reserved = match c.optional_block("reserved")? {
                None => Reserved::default(),
                Some(b) => {
                    let v =
                        BodyReader::unlabeled(src, b, c.ctx(), &["cpu", "memory", "disk"], &[])?;
                    Reserved {
                        cpu: v.u64("cpu", MAX_CPU_MHZ)?,
                        memory: v.u64("memory", MAX_MEMORY_MB)?,
                        disk: v.u64("disk", MAX_RESERVED_DISK_MB)?,
                    }
                }
            };
            let cgroup_parent = c.string("cgroup_parent")?;
            if let Some(p) = &cgroup_parent {
                berth_allocrunner::cgroups::check_parent(p)
                    .map_err(|e| c.invalid("cgroup_parent", e))?;
            }
            ClientSection {
                enabled: c.bool("enabled")?,
                cgroup_parent,
                servers,
                node_class,
                meta: c.map("meta")?,
                reserved,
                durations: client_durations(&c)?,
                intro_token: c.string("intro_token")?.map(ConfigSecret::new),
            }
        }
    };
    Ok(section)
}

/// The duration settings of `client { ... }`, each held to its least
/// value.
fn client_durations(c: &BodyReader<'_, '_>) -> Result<ClientDurations, SpecError> {
    let mut durations = ClientDurations::default();
    for s in client_settings::CLIENT_DURATIONS
        .iter()
        .filter(|s| s.in_file)
    {
        if let Some(d) = c.duration(s.key, MAX_DURATION)? {
            if let Some(problem) = s.least.problem(d) {
                return Err(c.invalid(s.key, problem));
            }
            durations.set(s.key, d);
        }
    }
    Ok(durations)
}

/// A port: 1 to 65535.
fn port(r: &BodyReader<'_, '_>, name: &str) -> Result<Option<u16>, SpecError> {
    match r.u32(name, u32::from(u16::MAX))? {
        None => Ok(None),
        Some(0) => Err(r.invalid(name, "0 is not a port (want 1 to 65535)")),
        Some(p) => {
            Ok(Some(u16::try_from(p).map_err(|_| {
                r.invalid(name, limits::too_large(p, u16::MAX))
            })?))
        }
    }
}

/// A server address: `HOST:PORT` (or `[IPv6]:PORT`), a port 1 to 65535.
/// The path `key` of `r` names: absolute, or an error naming the key.
pub(crate) fn absolute_path(
    r: &BodyReader<'_, '_>,
    key: &str,
) -> Result<Option<PathBuf>, SpecError> {
    match r.string(key)? {
        None => Ok(None),
        Some(p) if !Path::new(&p).is_absolute() => {
            Err(r.invalid(key, format!("{p:?} must be an absolute path")))
        }
        Some(p) => Ok(Some(PathBuf::from(p))),
    }
}

pub fn check_server_addr(addr: &str) -> Result<(), String> {
    let bad = |why: &str| format!("{addr:?} is not HOST:PORT ({why})");
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(bad("no port"));
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(bad("the port must be 1 to 65535")),
    }
    if let Some(inner) = host.strip_prefix('[') {
        let ip = inner.strip_suffix(']').ok_or_else(|| bad("unclosed '['"))?;
        return ip
            .parse::<std::net::Ipv6Addr>()
            .map(|_| ())
            .map_err(|_| bad("not an IPv6 address in [...]"));
    }
    if host.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    let is_dns_name = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if is_dns_name {
        Ok(())
    } else {
        Err(bad("the host is neither an IP address nor a DNS name"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: &str = r#"
data_dir = "/var/lib/berth/server"
server {
  enabled           = true
  min_heartbeat_ttl = "10s"
}
"#;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("writing a config file");
        p
    }

    fn invalid(text: &str) -> SpecError {
        parse(text).expect_err(text)
    }

    #[test]
    fn every_attribute_and_block_is_read() {
        let c = parse(
            r#"
data_dir  = "/var/lib/berth"
name      = "worker-1"
log_level = "DEBUG"
log_json  = true
bind_addr = "0.0.0.0"
ports {
  http = 4747
  rpc  = 4647
}
server {
  enabled                   = true
  heartbeat_grace           = "15s"
  min_heartbeat_ttl         = "5s"
  max_heartbeats_per_second = 50
  default_lost_after        = "30m"
  store                     = "etcd"
}
etcd {
  endpoints = ["http://10.0.0.1:2379"]
}
client {
  enabled                  = true
  servers                  = ["10.0.0.1:4647", "server-2.example:4647", "[::1]:4647"]
  node_class               = "storage"
  meta { rack = "r1" }
  reserved {
    cpu    = 500
    memory = 512
    disk   = 1024
  }
  disconnect_startup_grace = "30s"
  csi_volume_stats_interval = "15s"
}
"#,
        )
        .expect("a full config");
        assert_eq!(c.data_dir, Some(PathBuf::from("/var/lib/berth")));
        assert_eq!(c.name.as_deref(), Some("worker-1"));
        assert_eq!(c.log_level.as_deref(), Some("debug"));
        assert_eq!(c.log_json, Some(true));
        assert_eq!(c.bind_addr, Some("0.0.0.0".parse().unwrap()));
        assert_eq!(
            c.ports,
            Ports {
                http: Some(4747),
                rpc: Some(4647)
            }
        );
        assert_eq!(
            c.server,
            ServerSection {
                enabled: Some(true),
                heartbeat_grace: Some(Duration::from_secs(15)),
                min_heartbeat_ttl: Some(Duration::from_secs(5)),
                max_heartbeats_per_second: Some(50),
                default_lost_after: Some(Duration::from_secs(30 * 60)),
                store: Some("etcd".into()),
            }
        );
        assert_eq!(c.etcd.endpoints, Some(vec!["http://10.0.0.1:2379".into()]));
        assert_eq!(c.client.servers.as_ref().map(Vec::len), Some(3));
        assert_eq!(c.client.node_class.as_deref(), Some("storage"));
        assert_eq!(c.client.meta.get("rack").map(String::as_str), Some("r1"));
        assert_eq!(
            c.client.reserved,
            Reserved {
                cpu: Some(500),
                memory: Some(512),
                disk: Some(1024)
            }
        );
        assert_eq!(
            c.client.durations.get("disconnect_startup_grace"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            c.client.durations.get("csi_volume_stats_interval"),
            Some(Duration::from_secs(15))
        );
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_line_and_name() {
        let e = invalid("data_dir = \"/x\"\n\nbogus = 1\n");
        assert_eq!(e.line, 3);
        assert!(e.message.contains("unknown attribute \"bogus\""), "{e}");
        let e = invalid("server {\n  enabled = true\n  heartbeat = \"1s\"\n}\n");
        assert_eq!(e.line, 3);
        assert!(e.message.contains("\"heartbeat\" in server"), "{e}");
        let e = invalid("client {\n  tls {}\n}\n");
        assert_eq!(e.line, 2);
        assert!(e.message.contains("unsupported block \"tls\""), "{e}");
        let e = invalid("client {\n  reserved {\n    gpu = 1\n  }\n}\n");
        assert_eq!(e.line, 3);
        assert!(e.message.contains("\"gpu\""), "{e}");
    }

    #[test]
    fn bad_values_name_the_key_and_the_problem() {
        for (text, line, wanted) in [
            ("ports {\n http = 0\n}", 2, "0 is not a port"),
            (
                "ports {\n rpc = 65536\n}",
                2,
                "65536 is too large (at most 65535)",
            ),
            ("ports {\n http = \"80\"\n}", 2, "expected a number"),
            ("name = \"../n\"", 1, "node name \"../n\" is not allowed"),
            ("data_dir = \"var/lib\"", 1, "must be an absolute path"),
            ("log_level = \"loud\"", 1, "unknown level \"loud\""),
            ("bind_addr = \"localhost\"", 1, "is not an IP address"),
            ("log_json = \"yes\"", 1, "expected a bool"),
            (
                "server {\n heartbeat_grace = \"2years\"\n}",
                2,
                "is too large (at most 1year)",
            ),
            (
                "server {\n heartbeat_grace = \"10\"\n}",
                2,
                "invalid duration",
            ),
            (
                "server {\n min_heartbeat_ttl = \"0s\"\n}",
                2,
                "longer than 0s",
            ),
            (
                "server {\n max_heartbeats_per_second = 0\n}",
                2,
                "at least 1",
            ),
            (
                "client {\n servers = [\"10.0.0.1\"]\n}",
                2,
                "\"10.0.0.1\" is not HOST:PORT (no port)",
            ),
            (
                "client {\n servers = [\"a b:1\"]\n}",
                2,
                "neither an IP address nor a DNS name",
            ),
            (
                "client {\n servers = [\"h:0\"]\n}",
                2,
                "the port must be 1 to 65535",
            ),
            (
                "client {\n reserved {\n  cpu = 99999999999\n }\n}",
                3,
                "is too large",
            ),
            (
                "client {\n csi_volume_stats_interval = \"500ms\"\n}",
                2,
                "csi_volume_stats_interval",
            ),
            (
                "client {\n csi_volume_stats_interval = \"500ms\"\n}",
                2,
                "must be at least 1s",
            ),
            (
                "client {\n csi_volume_stats_interval = \"often\"\n}",
                2,
                "csi_volume_stats_interval",
            ),
            ("server {}\nserver {}", 2, "may appear only once"),
            ("data_dir = \"/a\"\ndata_dir = \"/b\"", 2, "defined twice"),
            ("data_dir = var.dir", 1, "expressions are not supported"),
        ] {
            let e = invalid(text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.message.contains(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn a_whole_config_needs_a_data_dir_a_role_and_servers_for_a_client() {
        let dir = tempfile::tempdir().unwrap();
        for (text, wanted) in [
            ("server { enabled = true }", "data_dir is not set"),
            ("data_dir = \"/d\"", "neither the server nor the client"),
            (
                "data_dir = \"/d\"\nserver { enabled = false }\nclient { enabled = false }",
                "neither the server nor the client",
            ),
            (
                "data_dir = \"/d\"\nclient { enabled = true }",
                "the client has no servers",
            ),
            (
                "data_dir = \"/d\"\nclient {\n enabled = true\n servers = []\n}",
                "the client has no servers",
            ),
        ] {
            let p = write(dir.path(), "agent.hcl", text);
            let e = load(std::slice::from_ref(&p)).expect_err(text);
            assert!(matches!(e, ConfigError::Incomplete { .. }), "{text}: {e}");
            let shown = e.to_string();
            assert!(shown.starts_with(&format!("{}: ", p.display())), "{shown}");
            assert!(shown.contains(wanted), "{text}: {shown}");
        }
    }

    #[test]
    fn a_bad_file_is_named_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let good = write(dir.path(), "a.hcl", SERVER);
        let bad = write(
            dir.path(),
            "b.hcl",
            "server {\n  enabled = true\n  nope = 1\n}\n",
        );
        let e = load(&[good, bad.clone()]).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}:3: unknown attribute \"nope\" in server in the agent config",
                bad.display()
            )
        );
        let missing = dir.path().join("missing.hcl");
        let e = load(std::slice::from_ref(&missing)).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }), "{e}");
        assert!(e.to_string().starts_with(&missing.display().to_string()));
        let binary = dir.path().join("bin.hcl");
        std::fs::write(&binary, b"data_dir = \"\xff\"").unwrap();
        assert!(matches!(
            load(&[binary]).unwrap_err(),
            ConfigError::NotText { offset: 12, .. }
        ));
    }

    #[test]
    fn a_file_over_the_limit_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.hcl");
        let comment = "#".repeat(usize::try_from(MAX_CONFIG_FILE_BYTES).unwrap() + 1);
        std::fs::write(&big, comment).unwrap();
        assert!(matches!(
            load(&[big]).unwrap_err(),
            ConfigError::TooLarge { .. }
        ));
    }

    #[test]
    fn later_files_override_earlier_ones_attribute_by_attribute() {
        let dir = tempfile::tempdir().unwrap();
        let base = write(
            dir.path(),
            "base.hcl",
            r#"
data_dir  = "/var/lib/berth"
log_level = "info"
ports { http = 4747 }
client {
  enabled = true
  servers = ["10.0.0.1:4647"]
  meta {
    rack = "r1"
    zone = "a"
  }
  reserved { cpu = 100 }
}
"#,
        );
        let over = write(
            dir.path(),
            "over.hcl",
            r#"
log_level = "debug"
ports { rpc = 4647 }
client {
  servers = ["10.0.0.2:4647"]
  meta { zone = "b" }
  reserved { memory = 256 }
}
"#,
        );
        let c = load(&[base.clone(), over.clone()]).expect("merged");
        assert_eq!(c.data_dir, Some(PathBuf::from("/var/lib/berth")));
        assert_eq!(c.log_level.as_deref(), Some("debug"));
        assert_eq!(c.ports.http, Some(4747));
        assert_eq!(c.ports.rpc, Some(4647));
        assert_eq!(c.client.enabled, Some(true));
        assert_eq!(c.client.servers, Some(vec!["10.0.0.2:4647".to_string()]));
        assert_eq!(c.client.meta.get("rack").map(String::as_str), Some("r1"));
        assert_eq!(c.client.meta.get("zone").map(String::as_str), Some("b"));
        assert_eq!(c.client.reserved.cpu, Some(100));
        assert_eq!(c.client.reserved.memory, Some(256));

        // The other order: the base wins where both set a value.
        let c = load(&[over, base]).expect("merged");
        assert_eq!(c.log_level.as_deref(), Some("info"));
        assert_eq!(c.client.servers, Some(vec!["10.0.0.1:4647".to_string()]));
        assert_eq!(c.client.meta.get("zone").map(String::as_str), Some("a"));
    }

    #[test]
    fn a_directory_gives_its_hcl_files_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("berth.d");
        std::fs::create_dir(&d).unwrap();
        write(&d, "10-base.hcl", SERVER);
        write(&d, "20-name.hcl", "name = \"first\"\n");
        write(&d, "30-name.hcl", "name = \"second\"\n");
        // Not *.hcl, or not a file: left alone.
        write(&d, "99-notes.txt", "not hcl at all {");
        write(&d, "40-off.hcl.bak", "bogus = 1");
        std::fs::create_dir(d.join("50-dir.hcl")).unwrap();
        let c = load(std::slice::from_ref(&d)).expect("the directory");
        assert_eq!(c.name.as_deref(), Some("second"));
        assert!(c.server_enabled());

        // A file after the directory overrides it.
        let last = write(dir.path(), "last.hcl", "name = \"last\"\n");
        let c = load(&[d, last]).expect("the directory and a file");
        assert_eq!(c.name.as_deref(), Some("last"));
    }

    #[test]
    fn the_example_configs_are_valid() {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/agent");
        let server = load(&[examples.join("server.hcl")]).expect("server.hcl");
        assert!(server.server_enabled() && !server.client_enabled());
        assert_eq!(server.data_dir, Some(PathBuf::from("/var/lib/berth")));
        let client = load(&[examples.join("client.hcl")]).expect("client.hcl");
        assert!(client.client_enabled() && !client.server_enabled());
        assert_eq!(
            client.client.servers,
            Some(vec!["127.0.0.1:4647".to_string()])
        );
    }

    /// Lines of a config: valid ones, near misses and garbage.
    fn config_line() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let mut keys = TOP_LEVEL_ATTRIBUTES.to_vec();
        keys.extend([
            "http",
            "rpc",
            "enabled",
            "servers",
            "node_class",
            "heartbeat_grace",
            "min_heartbeat_ttl",
            "max_heartbeats_per_second",
            "disconnect_startup_grace",
            "cpu",
            "memory",
            "disk",
            "rack",
            "bogus",
        ]);
        let key = prop::sample::select(keys);
        let value = prop_oneof![
            Just("\"/var/lib/berth\"".to_string()),
            Just("\"10s\"".to_string()),
            Just("\"99999999999999999999999h\"".to_string()),
            Just("true".to_string()),
            Just("0".to_string()),
            Just("65536".to_string()),
            Just("18446744073709551616".to_string()),
            Just("-1".to_string()),
            Just("1.5".to_string()),
            Just("[\"127.0.0.1:4647\", \"h:0\"]".to_string()),
            Just("{ a = 1 }".to_string()),
            Just("var.x".to_string()),
            Just("\"${x}\"".to_string()),
            "\"[a-z0-9.:/ -]{0,12}\"",
            "[0-9]{1,25}",
        ];
        let block = prop::sample::select(vec![
            "ports {",
            "server {",
            "client {",
            "reserved {",
            "meta {",
            "tls {",
            "}",
            "{",
        ]);
        prop_oneof![
            4 => (key, value).prop_map(|(k, v)| format!("{k} = {v}")),
            2 => block.prop_map(str::to_string),
            1 => "\\PC{0,16}",
            1 => Just(String::new()),
        ]
    }

    fn assert_parse_is_a_config_or_a_located_error(text: &str) -> Result<(), TestCaseError> {
        let lines = text.lines().count().max(1);
        match parse(text) {
            Ok(c) => {
                proptest::prop_assert!(c.ports.http != Some(0) && c.ports.rpc != Some(0));
                if let Some(n) = &c.name {
                    proptest::prop_assert!(berth_structs::is_valid_name(n), "{n:?}");
                }
                if let Some(d) = &c.data_dir {
                    proptest::prop_assert!(d.is_absolute(), "{d:?}");
                }
                proptest::prop_assert!(c.server.min_heartbeat_ttl != Some(Duration::ZERO));
            }
            Err(e) => {
                proptest::prop_assert!(e.line >= 1, "{e}");
                proptest::prop_assert!(e.line <= lines.saturating_add(1), "{e} in {text:?}");
                proptest::prop_assert!(!e.message.is_empty());
            }
        }
        Ok(())
    }

    use proptest::test_runner::TestCaseError;

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 1024,
            failure_persistence: None,
            ..proptest::test_runner::Config::default()
        })]

        /// Any text is a config or an error on a line of the file; never a
        /// panic.
        #[test]
        fn any_text_is_a_config_or_an_error_with_its_line(text in "\\PC{0,200}") {
            assert_parse_is_a_config_or_a_located_error(&text)?;
        }

        /// Configs made of known keys and blocks, near misses and garbage.
        #[test]
        fn near_valid_configs_are_a_config_or_an_error_with_its_line(
            lines in proptest::collection::vec(config_line(), 0..16),
        ) {
            assert_parse_is_a_config_or_a_located_error(&lines.join("\n"))?;
        }
    }
}
