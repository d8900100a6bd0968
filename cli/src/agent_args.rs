//! `berth agent`'s command line: its flags, as clap parses them. The
//! binary that runs agents turns them into a configuration (see
//! [`crate::Host::agent`]); this crate only knows their names.

use std::path::PathBuf;

/// The long help of `berth agent`.
const AGENT_ABOUT: &str = "\
Runs a berth agent: the server role (the agent protocol and the HTTP API),
the client role, or both. `-dev` runs a server and a client in one process
on a temp data dir.

Flags override the config files. Without -dev the files and flags together
need a data dir, a role, and servers for a client-only agent.

SIGHUP reads the config files again and applies their log_level (unless
-log-level is given); other changes need a restart.";

/// `berth agent`'s flags. Values are checked when they are turned into an
/// agent configuration, with the same messages as the config files get.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(long_about = AGENT_ABOUT, args_override_self = true)]
pub struct AgentArgs {
    /// Run a server and a client in one process, on a temp data dir
    #[arg(long)]
    pub dev: bool,
    /// Read an agent config file, or a directory's *.hcl in name order
    /// (repeatable; later files override earlier ones)
    #[arg(long, value_name = "PATH", action = clap::ArgAction::Append)]
    pub config: Vec<PathBuf>,
    /// Run the server role (agent protocol and HTTP API)
    #[arg(long)]
    pub server: bool,
    /// Run the client role
    #[arg(long)]
    pub client: bool,
    /// The servers' agent protocol addresses a client dials (the first,
    /// and the next when one fails)
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub servers: Option<String>,
    /// Keep state here (-dev: default a new temp dir)
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// HTTP API address (default bind_addr:ports.http, 127.0.0.1:4747)
    #[arg(long, value_name = "HOST:PORT")]
    pub http_addr: Option<String>,
    /// Agent protocol address (-dev: default 127.0.0.1:0, any free port;
    /// else bind_addr:ports.rpc, 127.0.0.1:4647)
    #[arg(long, value_name = "HOST:PORT")]
    pub rpc_addr: Option<String>,
    /// The node's name (default: the host name)
    #[arg(long, value_name = "NAME", visible_alias = "node-name")]
    pub node: Option<String>,
    /// Shortest heartbeat TTL the servers hand out (default 10s)
    #[arg(long, value_name = "DUR")]
    pub heartbeat_ttl: Option<String>,
    /// Terminal allocs the node keeps before destroying the oldest (default 50)
    #[arg(long, value_name = "N")]
    pub gc_max_allocs: Option<String>,
    /// The node destroys allocs terminal for this long (default 1h)
    #[arg(long, value_name = "DUR")]
    pub gc_alloc_threshold: Option<String>,
    /// How often the node collects its terminal allocs (default 1m)
    #[arg(long, value_name = "DUR")]
    pub gc_interval: Option<String>,
    /// How often the node fingerprints CSI plugins and repairs lost volume
    /// mounts of running allocs (default 30s)
    #[arg(long, value_name = "DUR")]
    pub csi_fingerprint_interval: Option<String>,
    /// The cgroup exec tasks' cgroups are made under (default: berth; two
    /// agents on one host need two)
    #[arg(long, value_name = "PATH")]
    pub cgroup_parent: Option<String>,
    /// How often the node collects the stats (usage, condition) of the CSI
    /// volumes its allocs use (default 1m)
    #[arg(long, value_name = "DUR")]
    pub csi_volume_stats_interval: Option<String>,
    /// trace, debug, info, warn or error (default: log_level, else info);
    /// BERTH_LOG or RUST_LOG, when set, win over both
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// Log JSON lines instead of text
    #[arg(long)]
    pub log_json: bool,
    /// Require ACL tokens on the API (-dev runs with ACLs off without it)
    #[arg(long)]
    pub acl_enabled: bool,
}
