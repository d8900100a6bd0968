//! The workload's churn between faults: job updates, stops and runs,
//! `alloc restart` and `alloc stop`, node drains, a batch job that writes
//! to its own volume and is done, and a scratch volume's life (create,
//! grow, snapshot, delete).

use anyhow::{Context, Result};
use berth_tests::cluster::{marked_job, writer_volume_with};

use crate::rng::Rng;
use crate::world::{World, BATCH_JOB, NODES};

impl World {
    /// One operation of the workload, chosen by `rng`; what it did.
    pub fn churn(&mut self, rng: &mut Rng) -> Result<String> {
        let jobs: Vec<String> = self.wanted.keys().cloned().collect();
        let job = rng.pick(&jobs).clone();
        match rng.below(7) {
            0 => {
                let version = rng.between(1, 3);
                self.run(&job, version)?;
                Ok(format!("update {job} to version {version}"))
            }
            1 => {
                self.server.cli(&["job", "stop", "-detach", &job])?;
                self.accepted.remove(&job);
                self.run(&job, 0)?;
                Ok(format!("stop and run {job}"))
            }
            2 => self.alloc_op(rng, &job, "restart"),
            3 => self.alloc_op(rng, &job, "stop"),
            4 => self.drain(rng),
            5 => self.run_batch(),
            _ => self.scratch_volume(),
        }
    }

    /// `berth system gc`: what is done is collected.
    pub fn collect_garbage(&mut self) -> Result<String> {
        let server = &self.server;
        again("collecting garbage", || server.cli(&["system", "gc"]))?;
        // A batch job whose allocs all finished is dead, and goes: the
        // checks then have no batch allocs to look at until the next run.
        match server.get(&format!("/v1/job/{BATCH_JOB}")) {
            Err(e) if self.batch_runs > 0 && format!("{e:#}").contains(" 404 Not Found") => {
                self.batch_runs = 0;
                Ok("system gc (the batch job collected)".into())
            }
            _ => Ok("system gc".into()),
        }
    }

    /// `alloc restart` or `alloc stop` of one of `job`'s running allocs.
    fn alloc_op(&mut self, rng: &mut Rng, job: &str, op: &str) -> Result<String> {
        let running: Vec<String> = self
            .allocs(job)?
            .iter()
            .filter(|a| a["client_status"] == "running")
            .filter_map(|a| a["id"].as_str().map(String::from))
            .collect();
        if running.is_empty() {
            return Ok(format!("{op} an alloc of {job}: none runs"));
        }
        let id = rng.pick(&running).clone();
        // A node that is cut off answers no restart: not a fault of
        // berth's. A stop goes through the servers.
        let done = self.server.cli(&["alloc", op, &id]);
        if op == "stop" {
            done?;
        }
        Ok(format!("{op} alloc {id} of {job}"))
    }

    /// A node drained for 1-4 s (a 3 s deadline, past which its plugin
    /// is stopped too), then made eligible again.
    fn drain(&mut self, rng: &mut Rng) -> Result<String> {
        let node = *rng.pick(&NODES);
        self.server.cli(&[
            "node",
            "drain",
            "-enable",
            "-detach",
            "-deadline",
            "3s",
            node,
        ])?;
        let ms = rng.between(1_000, 4_000);
        std::thread::sleep(std::time::Duration::from_millis(ms));
        self.server.cli(&["node", "drain", "-disable", node])?;
        self.server.cli(&["node", "eligibility", "-enable", node])?;
        Ok(format!("{node} drained for {ms} ms"))
    }

    /// A new version of the batch job: one alloc writes to its volume for
    /// a second, and is done. Settling waits for it to be.
    fn run_batch(&mut self) -> Result<String> {
        self.batch_runs += 1;
        let volume = self.volume_of(BATCH_JOB).context("the batch volume")?;
        let spec = marked_job(BATCH_JOB, "batch", 1, "", Some(volume)).replace(
            "while :; do sleep 0.2; done",
            &format!("sleep 1; : {}", self.batch_runs),
        );
        self.server.run_job(BATCH_JOB, &spec)?;
        Ok(format!("batch version {} run", self.batch_runs))
    }

    /// A scratch volume created, grown, snapshotted, the snapshot and
    /// then the volume deleted: the plugin's controller calls, among the
    /// faults.
    fn scratch_volume(&mut self) -> Result<String> {
        self.scratch += 1;
        let id = format!("scratch-{}", self.scratch);
        let server = &self.server;
        again("creating the volume", || {
            server.create_volume(&id, &writer_volume_with(&id, "1MiB", ""))
        })?;
        again("growing the volume", || {
            server.create_volume(&format!("{id}-grown"), &writer_volume_with(&id, "2MiB", ""))
        })?;
        let snap = again("snapshotting the volume", || {
            server.cli(&[
                "volume",
                "snapshot",
                "create",
                "-json",
                &id,
                &format!("{id}-snap"),
            ])
        })?;
        let snap: serde_json::Value =
            serde_json::from_str(&snap).context("the snapshot as JSON")?;
        let snap_id = snap["id"].as_str().context("the snapshot's ID")?;
        again("deleting the snapshot", || {
            server.cli(&["volume", "snapshot", "delete", "hostpath", snap_id])
        })?;
        again("deleting the volume", || {
            server.cli(&["volume", "delete", &id])
        })?;
        Ok(format!(
            "volume {id} created, grown, snapshotted and deleted"
        ))
    }
}

/// Runs `op` again, for up to 30 s, while it fails for a passing reason,
/// as an operator would: a server that has just restarted answers 503
/// for a plugin's controller until the clients running it have reported
/// back, and an agent that is starting answers nothing yet.
fn again<T>(what: &str, mut op: impl FnMut() -> Result<T>) -> Result<T> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match op() {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() < deadline && passing(&e) => {
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            Err(e) => return Err(e).context(what.to_string()),
        }
    }
}

/// Whether an error is one a moment later may not give.
fn passing(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    ["(HTTP 503)", "(HTTP 429)", "no berth agent answers"]
        .iter()
        .any(|p| text.contains(p))
}
