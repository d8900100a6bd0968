//! berth's metrics: one process-wide Prometheus registry with a typed
//! family for every number berth measures, and [`encode`], the text format
//! that `GET /v1/metrics` serves.
//!
//! Recording is cheap (atomics; at most the label struct is built), so the
//! crates below `agent` record where things happen: the CSI client, the
//! volume manager, the alloc and task runners, the heartbeat loop, the state
//! stores. Gauges that describe the state as a whole (allocs by status,
//! nodes by status) are set by whoever owns that state right before
//! encoding, never on the hot path. This crate knows nothing of berth's
//! data model or of HTTP: label values are plain strings.

use std::fmt::Write;
use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets_range, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// The content type of [`encode`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How an operation ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }

    /// `Ok` for `Ok(_)`, `Error` for `Err(_)`.
    pub fn of<T, E>(r: &Result<T, E>) -> Outcome {
        if r.is_ok() {
            Outcome::Ok
        } else {
            Outcome::Error
        }
    }
}

/// Which state database committed.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Db {
    Server,
    Client,
    /// The servers' state in etcd (one transaction).
    Etcd,
}

impl Db {
    pub fn as_str(self) -> &'static str {
        match self {
            Db::Server => "server",
            Db::Client => "client",
            Db::Etcd => "etcd",
        }
    }
}

/// A label value from outside berth's code (a plugin ID, a subsystem),
/// escaped as the text format wants: the encoder writes values as they
/// are.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct LabelText(pub String);

impl From<&str> for LabelText {
    fn from(s: &str) -> LabelText {
        LabelText(s.to_string())
    }
}

impl EncodeLabelValue for LabelText {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

impl EncodeLabelValue for Db {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CsiRpcLabels {
    pub plugin: LabelText,
    pub method: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CsiRpcErrorLabels {
    pub plugin: LabelText,
    pub method: &'static str,
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginOutcomeLabels {
    pub plugin: LabelText,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeOutcomeLabels {
    pub mode: &'static str,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClientStatusLabels {
    pub client_status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DbLabels {
    pub db: Db,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubsystemLabels {
    pub subsystem: LabelText,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every family berth records, registered once in [`metrics`].
pub struct Metrics {
    registry: Registry,
    /// Time of one CSI call to a plugin, by plugin and CSI method.
    pub csi_rpc_duration: Histograms<CsiRpcLabels>,
    /// CSI calls that failed, by plugin, method and gRPC code name.
    pub csi_rpc_errors: Family<CsiRpcErrorLabels, Counter>,
    /// Time for the client to have a volume claimed by the servers
    /// (retries included).
    pub csi_claim_duration: Histograms<PluginOutcomeLabels>,
    /// Time for the client to have a claim released by the servers
    /// (retries included).
    pub csi_unpublish_duration: Histograms<PluginOutcomeLabels>,
    /// Time to mount a volume for an alloc (stage and publish).
    pub csi_mount_duration: Histograms<PluginOutcomeLabels>,
    /// Time to unmount a volume for an alloc (unpublish and unstage).
    pub csi_unmount_duration: Histograms<PluginOutcomeLabels>,
    /// Time for a server to handle one claim request.
    pub server_claim_duration: Histograms<ModeOutcomeLabels>,
    /// Time of one heartbeat round trip, as the client sees it.
    pub heartbeat_duration: Histogram,
    /// Heartbeats that failed, as the client sees it.
    pub heartbeat_failures: Counter,
    /// Heartbeats a server handled.
    pub server_heartbeats: Counter,
    /// Nodes the server knows, by status (set at scrape time).
    pub nodes: Family<StatusLabels, Gauge>,
    /// Allocs the server knows, by client status (set at scrape time).
    pub allocs: Family<ClientStatusLabels, Gauge>,
    /// Allocs this client runs, by client status (set at scrape time).
    pub client_allocs: Family<ClientStatusLabels, Gauge>,
    /// What each running task of this client uses (set at scrape time).
    pub client_tasks: tasks::TaskFamilies,
    /// Task processes started (restarts included).
    pub task_starts: Counter,
    /// Task restarts after an exit.
    pub task_restarts: Counter,
    /// Task process exits, by outcome.
    pub task_exits: Family<OutcomeLabels, Counter>,
    /// Time of one state database commit.
    pub state_commit_duration: Histograms<DbLabels>,
    /// Node events recorded, by subsystem.
    pub node_events: Family<SubsystemLabels, Counter>,
    /// 1 while this server leads, 0 while it does not.
    pub server_leader: Gauge,
    /// Times this server became the leader or stopped being it.
    pub leadership_changes: Counter,
    /// Writes etcd refused on their condition, by reason (`moved`: the
    /// state moved under the write; `not_leader`: the term was over).
    pub store_write_conflicts: Family<ReasonLabels, Counter>,
    /// etcd revisions this server's watch has not applied yet.
    pub etcd_watch_lag: Gauge,
    build_info: Family<VersionLabels, Gauge>,
}

/// Latency buckets: 0.5 ms to 30 s, exponential. CSI calls can be slow.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets_range(0.0005, 30.0, 16))
}

fn histograms<L: Clone + std::hash::Hash + Eq>() -> Histograms<L> {
    Family::new_with_constructor(latency_histogram)
}

impl Metrics {
    fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            csi_rpc_duration: histograms(),
            csi_rpc_errors: Family::default(),
            csi_claim_duration: histograms(),
            csi_unpublish_duration: histograms(),
            csi_mount_duration: histograms(),
            csi_unmount_duration: histograms(),
            server_claim_duration: histograms(),
            heartbeat_duration: latency_histogram(),
            heartbeat_failures: Counter::default(),
            server_heartbeats: Counter::default(),
            nodes: Family::default(),
            allocs: Family::default(),
            client_allocs: Family::default(),
            client_tasks: tasks::TaskFamilies::default(),
            task_starts: Counter::default(),
            task_restarts: Counter::default(),
            task_exits: Family::default(),
            state_commit_duration: histograms(),
            node_events: Family::default(),
            server_leader: Gauge::default(),
            leadership_changes: Counter::default(),
            store_write_conflicts: Family::default(),
            etcd_watch_lag: Gauge::default(),
            build_info: Family::default(),
        };
        let r = m.registry.sub_registry_with_prefix("berth");
        r.register_collector(Box::new(runtime::RuntimeCollector));
        let s = Unit::Seconds;
        r.register_with_unit(
            "csi_rpc_duration",
            "Time of one CSI call to a plugin",
            s.clone(),
            m.csi_rpc_duration.clone(),
        );
        r.register(
            "csi_rpc_errors",
            "CSI calls to a plugin that failed, by gRPC code",
            m.csi_rpc_errors.clone(),
        );
        r.register_with_unit(
            "csi_claim_duration",
            "Time for the client to have a volume claimed by the servers, retries included",
            s.clone(),
            m.csi_claim_duration.clone(),
        );
        r.register_with_unit(
            "csi_unpublish_duration",
            "Time for the client to have a volume claim released by the servers, retries included",
            s.clone(),
            m.csi_unpublish_duration.clone(),
        );
        r.register_with_unit(
            "csi_mount_duration",
            "Time to mount a volume for an alloc (stage and publish)",
            s.clone(),
            m.csi_mount_duration.clone(),
        );
        r.register_with_unit(
            "csi_unmount_duration",
            "Time to unmount a volume for an alloc (unpublish and unstage)",
            s.clone(),
            m.csi_unmount_duration.clone(),
        );
        r.register_with_unit(
            "server_claim_duration",
            "Time for a server to handle one volume claim",
            s.clone(),
            m.server_claim_duration.clone(),
        );
        r.register_with_unit(
            "heartbeat_duration",
            "Time of one heartbeat round trip to the servers",
            s.clone(),
            m.heartbeat_duration.clone(),
        );
        r.register(
            "heartbeat_failures",
            "Heartbeats to the servers that failed",
            m.heartbeat_failures.clone(),
        );
        r.register(
            "server_heartbeats",
            "Node heartbeats this server handled",
            m.server_heartbeats.clone(),
        );
        r.register("nodes", "Nodes by status", m.nodes.clone());
        r.register(
            "allocs",
            "Allocs the servers know, by client status",
            m.allocs.clone(),
        );
        r.register(
            "client_allocs",
            "Allocs this client runs, by client status",
            m.client_allocs.clone(),
        );
        r.register(
            "task_starts",
            "Task processes started, restarts included",
            m.task_starts.clone(),
        );
        r.register(
            "task_restarts",
            "Tasks restarted, by the restart policy or an operator",
            m.task_restarts.clone(),
        );
        r.register(
            "task_exits",
            "Task process exits, by outcome",
            m.task_exits.clone(),
        );
        r.register_with_unit(
            "state_commit_duration",
            "Time of one state database commit",
            s,
            m.state_commit_duration.clone(),
        );
        r.register(
            "node_events",
            "Node events recorded, by subsystem",
            m.node_events.clone(),
        );
        r.register(
            "server_leader",
            "1 while this server leads, 0 while it does not",
            m.server_leader.clone(),
        );
        r.register(
            "leadership_changes",
            "Times this server became the leader or stopped being it",
            m.leadership_changes.clone(),
        );
        r.register(
            "store_write_conflicts",
            "Writes etcd refused on their condition, by reason",
            m.store_write_conflicts.clone(),
        );
        r.register(
            "etcd_watch_lag_revisions",
            "etcd revisions this server's watch has not applied yet",
            m.etcd_watch_lag.clone(),
        );
        r.register("build_info", "berth's version", m.build_info.clone());
        m.client_tasks.register(r);
        // The process metrics keep their standard names, without the prefix.
        m.registry
            .register_collector(Box::new(process::ProcessCollector));
        m.build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        m
    }
}

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// Every metric in the Prometheus text format, version 0.0.4
/// ([`CONTENT_TYPE`]).
pub fn encode() -> String {
    let m = metrics();
    let mut open_metrics = String::new();
    // Writing to a String cannot fail, and every family is well formed.
    let _ = prometheus_client::encoding::text::encode(&mut open_metrics, &m.registry);
    to_text_format(&open_metrics)
}

/// The registry writes OpenMetrics; the 0.0.4 text format that
/// `text/plain` scrapers read differs in three ways: a counter's family is
/// named with its `_total` suffix, and there are no `# UNIT` and `# EOF`
/// lines.
fn to_text_format(open_metrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let doc = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match doc {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                let _ = writeln!(out, "{prefix}{name}{total} {tail}");
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

// ---- Recording helpers: one line at each place that records. ----

/// Records one CSI call: its time, and its gRPC code name when it failed.
pub fn record_csi_rpc(
    plugin: &str,
    method: &'static str,
    elapsed: Duration,
    error: Option<&'static str>,
) {
    let m = metrics();
    m.csi_rpc_duration
        .get_or_create(&CsiRpcLabels {
            plugin: plugin.into(),
            method,
        })
        .observe(elapsed.as_secs_f64());
    if let Some(code) = error {
        m.csi_rpc_errors
            .get_or_create(&CsiRpcErrorLabels {
                plugin: plugin.into(),
                method,
                code,
            })
            .inc();
    }
}

/// Observes `elapsed` in a `{plugin, outcome}` histogram family.
pub fn observe_plugin_op(
    family: &Histograms<PluginOutcomeLabels>,
    plugin: &str,
    outcome: Outcome,
    elapsed: Duration,
) {
    family
        .get_or_create(&PluginOutcomeLabels {
            plugin: plugin.into(),
            outcome,
        })
        .observe(elapsed.as_secs_f64());
}

/// Counts one write etcd refused on its condition (`moved` or
/// `not_leader`).
pub fn record_store_write_conflict(reason: &'static str) {
    metrics()
        .store_write_conflicts
        .get_or_create(&ReasonLabels { reason })
        .inc();
}

/// Records whether this server leads now, counting a change.
pub fn set_leader(leads: bool) {
    let m = metrics();
    let now = i64::from(leads);
    if m.server_leader.set(now) != now {
        m.leadership_changes.inc();
    }
}

/// Records one state database commit.
pub fn record_state_commit(db: Db, elapsed: Duration) {
    metrics()
        .state_commit_duration
        .get_or_create(&DbLabels { db })
        .observe(elapsed.as_secs_f64());
}

/// The node event subsystems counted by name; any other a client reports
/// is counted as `other`, so that the label's values stay few whatever the
/// clients send.
pub const NODE_EVENT_SUBSYSTEMS: &[&str] = &["CSI", "Cluster", "Drain", "Driver", "Storage"];

/// Counts one node event of `subsystem`.
pub fn record_node_event(subsystem: &str) {
    let subsystem = NODE_EVENT_SUBSYSTEMS
        .iter()
        .find(|s| **s == subsystem)
        .copied()
        .unwrap_or("other");
    metrics()
        .node_events
        .get_or_create(&SubsystemLabels {
            subsystem: subsystem.into(),
        })
        .inc();
}

/// Sets `berth_nodes{status}`. `counts` names every status, zeros too,
/// so that a status that emptied reads 0 rather than its last value.
pub fn set_nodes(counts: &[(&'static str, i64)]) {
    for &(status, n) in counts {
        metrics()
            .nodes
            .get_or_create(&StatusLabels { status })
            .set(n);
    }
}

/// Sets `berth_allocs{client_status}` (the servers' view). `counts` names
/// every status, zeros too.
pub fn set_allocs(counts: &[(&'static str, i64)]) {
    for &(client_status, n) in counts {
        metrics()
            .allocs
            .get_or_create(&ClientStatusLabels { client_status })
            .set(n);
    }
}

/// Sets `berth_client_allocs{client_status}` (this client's runners).
/// `counts` names every status, zeros too.
pub fn set_client_allocs(counts: &[(&'static str, i64)]) {
    for &(client_status, n) in counts {
        metrics()
            .client_allocs
            .get_or_create(&ClientStatusLabels { client_status })
            .set(n);
    }
}

mod process;
mod runtime;
pub mod tasks;
#[cfg(test)]
mod tests;
