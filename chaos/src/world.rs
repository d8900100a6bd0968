//! The cluster a run works on: one server agent, three client agents each
//! behind a relay the run can partition and each with its data dir on a
//! small filesystem of its own, the example CSI plugin as a
//! system job over storage every node reaches, a single-writer volume per
//! writer job, and a fleet job without volumes. Every job's task carries
//! a marker on its command line, so the run counts the task processes of
//! each job on the host (see `berth_tests::cluster::marker_pids`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{
    marked_service_job, shared_plugin_job, shared_plugin_job_with_args, writer_volume, Client,
    Server,
};
use serde_json::Value;

use crate::sampler::WriterSampler;

/// Server timings short enough for faults to play out in seconds: a node
/// is down 4-5 s after its last heartbeat.
const SERVER_BLOCK: &str = r#"min_heartbeat_ttl = "2s"
  heartbeat_grace = "2s""#;

/// A writer job's alloc stops itself this long into a lost connection,
/// and the servers replace it no sooner.
pub const WINDOW: &str = "5s";

pub const NODES: [&str; 3] = ["chaos-0", "chaos-1", "chaos-2"];

/// A client's CSI calls give up after 2 s, so that a plugin that hangs
/// past the deadline plays out in seconds.
const CLIENT_BLOCK: &str = r#"disconnect_startup_grace = "1s"
  csi_call_timeout = "2s""#;

/// A batch job (see `workload`) that writes to its own volume for a
/// second, then is done.
pub const BATCH_JOB: &str = "batch";
const BATCH_VOLUME: &str = "vol-b";

/// The size of each client's data dir, a filesystem of its own that the
/// full-disk fault fills.
const DISK_MIB: u64 = 256;

pub struct World {
    pub server: Server,
    pub clients: Vec<Client>,
    plugin_state: tempfile::TempDir,
    /// Writer job name → its volume.
    pub writers: BTreeMap<String, String>,
    /// Job name → the allocs it wants running now.
    pub wanted: BTreeMap<String, usize>,
    /// Every job the CLI accepted and that was not stopped since.
    pub accepted: BTreeSet<String>,
    /// Samples the writers' task processes every 20 ms.
    pub sampler: WriterSampler,
    /// Per client, while its agent started again has not said it is
    /// ready: where its log stood at the start.
    pub restarted: Vec<Option<u64>>,
    /// How many hold files were handed out.
    holds: u64,
    /// How many versions of the batch job were run; 0: none yet.
    pub batch_runs: u64,
    /// How many scratch volumes were made (see `workload`).
    pub scratch: u64,
}

impl World {
    pub fn start() -> Result<World> {
        let mut server = Server::start(SERVER_BLOCK).context("starting the server")?;
        let mut clients = Vec::new();
        for name in NODES {
            let client = Client::start_with_disk(&server, name, true, CLIENT_BLOCK, Some(DISK_MIB))
                .with_context(|| format!("starting client {name}"))?;
            clients.push(client);
        }
        server.wait_nodes_ready(&NODES)?;
        let plugin_state = tempfile::Builder::new().prefix("berth-chaos-").tempdir()?;
        server.run_job(
            "plugin",
            &quick_restarts(shared_plugin_job(plugin_state.path())?),
        )?;
        server.wait_plugin_nodes(NODES.len() as u64)?;
        let mut writers = BTreeMap::new();
        let mut wanted = BTreeMap::new();
        for i in 0..3 {
            let (job, volume) = (format!("writer-{i}"), format!("vol-{i}"));
            server.create_volume(&volume, &writer_volume(&volume))?;
            writers.insert(job.clone(), volume);
            wanted.insert(job, 1);
        }
        wanted.insert("fleet".to_string(), 3);
        server.create_volume(BATCH_VOLUME, &writer_volume(BATCH_VOLUME))?;
        let sampler = WriterSampler::start(writers.keys().cloned().collect());
        let mut world = World {
            server,
            clients,
            plugin_state,
            writers,
            wanted,
            accepted: BTreeSet::new(),
            sampler,
            restarted: vec![None; NODES.len()],
            holds: 0,
            batch_runs: 0,
            scratch: 0,
        };
        for job in world.wanted.clone().keys() {
            world.run(job, 0)?;
        }
        Ok(world)
    }

    /// The spec of `job` at `version` (a change of version is a change of
    /// the task's command line, so the job rolls to new allocs).
    fn spec(&self, job: &str, version: u64) -> String {
        let count = self.wanted.get(job).copied().unwrap_or(1) as u32;
        let spec = match self.writers.get(job) {
            Some(volume) => marked_service_job(job, count, Some(WINDOW), Some(volume)),
            None => marked_service_job(job, count, None, None),
        };
        // A failed alloc (its executor killed, say) is replaced within a
        // second, not after the default 30 s, so that a run's faults
        // follow each other quickly.
        let reschedule = "    reschedule {\n      delay          = \"1s\"\n      \
                          delay_function = \"constant\"\n      unlimited      = true\n    }\n";
        // `sleep 0.2`, `0.20`, `0.200`...: the same sleep, a new command
        // line (a loop of an invalid sleep would fork as fast as it can).
        spec.replace(
            "sleep 0.2",
            &format!("sleep 0.2{}", "0".repeat(version as usize % 4)),
        )
        .replacen("    restart {", &format!("{reschedule}    restart {{"), 1)
    }

    /// Starts client `node`'s agent again (it was killed); settling waits
    /// until it says it is ready.
    pub fn start_client_again(&mut self, node: usize) -> Result<()> {
        let agent = &mut self.clients[node].agent;
        self.restarted[node] = Some(agent.log_len());
        agent.start_again()
    }

    /// The volume `job`'s allocs write to, if any.
    pub fn volume_of(&self, job: &str) -> Option<&str> {
        if job == BATCH_JOB {
            return Some(BATCH_VOLUME);
        }
        self.writers.get(job).map(String::as_str)
    }

    /// Every volume the run's jobs write to.
    pub fn volumes(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self.writers.values().map(String::as_str).collect();
        all.push(BATCH_VOLUME);
        all
    }

    /// A file no one made yet, for the plugin's `--hold-after`: calls are
    /// held until it exists.
    pub fn hold_file(&mut self) -> std::path::PathBuf {
        self.holds += 1;
        self.plugin_state
            .path()
            .join(format!("release-{}", self.holds))
    }

    /// A new version of the plugin job, its instances started with
    /// `args` more (none: the plain plugin).
    pub fn roll_plugin(&self, args: &[String]) -> Result<()> {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let spec = shared_plugin_job_with_args(self.plugin_state.path(), &args)?;
        self.server.run_job("plugin", &quick_restarts(spec))
    }

    /// `berth job run` of `job` at `version`.
    pub fn run(&mut self, job: &str, version: u64) -> Result<()> {
        let spec = self.spec(job, version);
        self.server.run_job(job, &spec)?;
        self.accepted.insert(job.to_string());
        Ok(())
    }

    pub fn allocs(&self, job: &str) -> Result<Vec<Value>> {
        self.server.allocs(job)
    }

    /// The logs of every agent, for a failed run.
    pub fn logs(&self) -> String {
        let clients: Vec<&Client> = self.clients.iter().collect();
        berth_tests::cluster::logs(&self.server, &clients)
    }

    /// Every agent's log, by name.
    pub fn agent_logs(&self) -> Vec<(String, String)> {
        let mut logs = vec![("server".to_string(), self.server.agent.log())];
        for c in &self.clients {
            logs.push((c.name.clone(), c.agent.log()));
        }
        logs
    }
}

/// The plugin job with its task started again a second after it died
/// (not the default 15 s), so that a run's faults follow each other
/// quickly.
fn quick_restarts(plugin_job: String) -> String {
    plugin_job.replacen(
        "group \"plugin\" {",
        "group \"plugin\" {\n    restart {\n      delay = \"1s\"\n    }",
        1,
    )
}

/// How long to wait for a node to settle before it counts as a violation.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(90);
