//! Configuration of the server role.

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The agent's data dir; the state lives in `<data_dir>/server/state.redb`.
    pub data_dir: PathBuf,
    /// The shortest heartbeat TTL handed to a node.
    pub min_heartbeat_ttl: Duration,
    /// TTLs are stretched as nodes grow so that the servers see at most
    /// this many heartbeats per second.
    pub max_heartbeats_per_second: f64,
    /// Time past its TTL before a silent node is marked down.
    pub heartbeat_grace: Duration,
    /// Deadline of a call the server makes on a client (ControllerPublish,
    /// NodeDetach, ...).
    pub client_call_timeout: Duration,
    /// How long after an alloc turned terminal the volume watcher leaves its
    /// claims for the client's own `Unpublish` before reaping them. Claims of
    /// allocs that are gone or whose node is down are reaped at once.
    pub claim_reap_grace: Duration,
    /// How often blocked jobs are re-evaluated even when nothing changed
    /// (delayed replacements become due this way).
    pub scheduler_retry_interval: Duration,
    /// A failed service alloc is replaced only this long after it failed.
    pub reschedule_delay: Duration,
    /// Allocs terminal on the client for this long are garbage collected
    /// (once no volume claim names them).
    pub alloc_gc_threshold: Duration,
    /// Jobs stopped or dead, with every alloc terminal, for this long are
    /// garbage collected with their allocs (Nomad's `job_gc_threshold`).
    pub job_gc_threshold: Duration,
    /// Nodes down for this long with no alloc left are garbage collected
    /// (Nomad's `node_gc_threshold`).
    pub node_gc_threshold: Duration,
    /// How often the garbage collector runs.
    pub gc_interval: Duration,
    /// How long the allocs of a system job whose group has no
    /// `disconnect { lost_after }` are held `unknown` while their node is
    /// down, before they are lost (zero: lost at once).
    pub default_lost_after: Duration,
    /// Every API request needs an ACL token (see `crate::acl`).
    pub acl_enabled: bool,
    /// A node the servers do not know registers only with an
    /// introduction token or a client certificate of `region`.
    pub node_enrollment: bool,
    /// The region the agents' certificates name (`global`).
    pub region: String,
    /// How often one peer address may call `Node.Register`; `None` for
    /// no limit.
    pub register_rate: Option<crate::RegisterRate>,
    /// Plan every evaluation inside the state store's writer (on by
    /// default). Off, the scheduler plans on a read of the tables outside
    /// the writer and commits if no table it read has moved, or if every
    /// alloc it places still fits the tables as they are by then; else it
    /// plans again. Claim releases then wait for no plan and end sooner,
    /// but a submit waits twice (for the read and for the writer), and a
    /// plan's read still holds the tables' lock, which each write's apply
    /// waits for (`scripts/bench concurrent-writers` measures both). It
    /// becomes the default once the plan reads a copy-on-write snapshot.
    pub scheduler_plans_in_writer: bool,
    /// Where the state is kept.
    pub store: StoreConfig,
    /// How this server names itself to the others (in the leader key) and
    /// to clients sent to the leader.
    pub identity: crate::leader::ServerIdentity,
}

/// Where the servers keep their state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StoreConfig {
    /// In `<data_dir>/server/state.redb`: one server.
    #[default]
    Embedded,
    /// In etcd, under a key prefix.
    Etcd(crate::etcd::EtcdConfig),
}

/// Production defaults with an empty `data_dir`, which `Server::open`
/// refuses: set it.
impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig::new(PathBuf::new())
    }
}

impl ServerConfig {
    /// Production defaults under `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            data_dir: data_dir.into(),
            min_heartbeat_ttl: Duration::from_secs(10),
            max_heartbeats_per_second: 50.0,
            heartbeat_grace: Duration::from_secs(10),
            client_call_timeout: Duration::from_secs(60),
            claim_reap_grace: Duration::from_secs(5),
            scheduler_retry_interval: Duration::from_secs(5),
            reschedule_delay: Duration::from_secs(5),
            alloc_gc_threshold: Duration::from_secs(60 * 60),
            job_gc_threshold: Duration::from_secs(4 * 60 * 60),
            node_gc_threshold: Duration::from_secs(24 * 60 * 60),
            gc_interval: Duration::from_secs(5 * 60),
            default_lost_after: Duration::from_secs(60 * 60),
            acl_enabled: false,
            node_enrollment: false,
            region: "global".into(),
            register_rate: Some(crate::RegisterRate::default()),
            scheduler_plans_in_writer: true,
            store: StoreConfig::Embedded,
            identity: Default::default(),
        }
    }
}
