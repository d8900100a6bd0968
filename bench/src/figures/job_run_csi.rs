//! `job-run-csi`: `berth job run` of the `job-run` batch job with one CSI
//! volume mounted, against the same job without a volume.
//!
//! Measured: the wall time of one `berth job run FILE` process (the real
//! release CLI against a release `berth agent -dev`), from its spawn to its
//! exit with status 0, which it reaches once the servers record the alloc
//! `complete`. The job is `job-run`'s batch job (one raw_exec task running
//! `sh -c 'echo hi > <path>'`) whose group asks for the CSI volume `data`
//! of the example hostpath plugin (a supervised task of the same agent,
//! as shipped: no controller attach), single-node-writer, mounted at
//! `data` in the task directory, and the task writes into the volume. So
//! each round walks the whole volume path: claim on the servers,
//! `NodeStageVolume`, `NodePublishVolume`, the bind into the task
//! directory, the task, the unbind, `NodeUnpublishVolume`,
//! `NodeUnstageVolume`, and the claim's release (`CSIVolume.Unpublish`)
//! before the alloc is reported complete. Every round submits new job IDs
//! (see `job-run`).
//!
//! Baseline, measured in the same run and interleaved round by round: the
//! same job without the volume (`job-run`'s figure), one `job run` right
//! before each volume round.
//!
//! Target: median ≤ 1.2x the baseline's median, or ≤ the baseline's
//! median + 5 ms.
//!
//! ```text
//! scripts/bench job-run-csi [--rounds 50] [--warmup 5]
//! ```

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use berth_tests::{binary, DevAgent};

use super::job_run::{check_task_wrote, timed_job_run, JobShape, TASK_SCRIPT};
use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured rounds (each one job run with the volume and one without)
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Unmeasured rounds first (warms the agent, the plugin connection,
    /// the page cache)
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
}

/// The group's `volume` block and the task's `volume_mount`: volume `data`
/// (single-node-writer, file system) at `data` in the task directory.
const VOLUME_BLOCK: &str = r#"    volume "data" {
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }"#;

const VOLUME_MOUNT: &str = r#"      volume_mount {
        volume      = "data"
        destination = "data"
      }"#;

/// The job of round `round` with the volume: its task writes `data/r<round>`,
/// a file inside the volume.
fn volume_shape(round: usize) -> JobShape {
    JobShape {
        group_extra: VOLUME_BLOCK.to_string(),
        task_extra: VOLUME_MOUNT.to_string(),
        write_to: format!("data/r{round}"),
        ..JobShape::default()
    }
}

/// Checks that the task of round `round` wrote `hi` into the volume: the
/// file is in the plugin's directory of volume `data` (the task's bind
/// mount is gone with its alloc).
fn check_wrote_into_volume(agent: &DevAgent, round: usize) -> Result<()> {
    let name = format!("r{round}");
    let root = agent.data_dir.path().join("node_data");
    let found = find_file(&root, &name, 6)
        .with_context(|| format!("no file {name} under {}", root.display()))?;
    let text = std::fs::read_to_string(&found)?;
    ensure!(
        text == "hi\n",
        "{} holds {text:?}, not \"hi\\n\"",
        found.display()
    );
    Ok(())
}

/// The first file called `name` below `dir`, at most `depth` levels down.
fn find_file(dir: &Path, name: &str, depth: usize) -> Option<std::path::PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut dirs = Vec::new();
    for e in entries.flatten() {
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_file() && e.file_name() == name {
            return Some(e.path());
        }
        if kind.is_dir() {
            dirs.push(e.path());
        }
    }
    if depth == 0 {
        return None;
    }
    dirs.iter().find_map(|d| find_file(d, name, depth - 1))
}

/// A dev agent running the example plugin with volume `data` created.
fn agent_with_volume() -> Result<DevAgent> {
    let agent = DevAgent::start()?;
    agent.run_plugin_and_create_volume()?;
    Ok(agent)
}

struct Rounds {
    with_volume: Samples,
    without: Samples,
    /// The volume rounds run, warm-up included.
    volume_rounds: Vec<(usize, String)>,
    plain_jobs: Vec<String>,
}

/// `warmup + rounds` rounds, each a `job run` without the volume and then
/// one with it.
fn measure(agent: &DevAgent, rounds: usize, warmup: usize) -> Result<Rounds> {
    let mut out = Rounds {
        with_volume: Samples::new(),
        without: Samples::new(),
        volume_rounds: Vec::new(),
        plain_jobs: Vec::new(),
    };
    let plain = JobShape::default();
    for round in 0..warmup + rounds {
        let (plain_id, plain_took) = timed_job_run(agent, "plain", round, &plain)
            .with_context(|| format!("round {round} without the volume"))?;
        let (vol_id, vol_took) = timed_job_run(agent, "csi", round, &volume_shape(round))
            .with_context(|| {
                format!("round {round} with the volume; agent log:\n{}", agent.log())
            })?;
        out.plain_jobs.push(plain_id);
        out.volume_rounds.push((round, vol_id));
        if round >= warmup {
            out.without.push(plain_took);
            out.with_volume.push(vol_took);
        }
    }
    Ok(out)
}

fn print(r: &Rounds) -> bool {
    report::samples("job run with a CSI volume", &r.with_volume);
    report::samples("baseline: the job without a volume", &r.without);
    report::ratio_line("with volume / without", &r.with_volume, &r.without);
    let extra = r.with_volume.median().saturating_sub(r.without.median());
    report::value("volume's extra (median)", report::Ms(extra));
    let met = report::ratio(&r.with_volume, &r.without) <= 1.2 || extra <= Duration::from_millis(5);
    report::target("median <= 1.2x the job without a volume, or + 5 ms", met)
}

/// Checks the last rounds: both jobs' allocs complete, the plain task's
/// file written, the volume task's file inside the volume, and the volume
/// free again.
fn check(agent: &DevAgent, r: &Rounds) -> Result<()> {
    if let Some(id) = r.plain_jobs.last() {
        check_task_wrote(agent, id, "file")?;
    }
    if let Some((round, id)) = r.volume_rounds.last() {
        let allocs = agent.job_allocs(id)?;
        ensure!(
            allocs.len() == 1 && allocs[0]["client_status"] == "complete",
            "job {id}'s allocs are not one complete alloc: {allocs:?}"
        );
        check_wrote_into_volume(agent, *round)?;
    }
    let vol = agent.api_get("/v1/volume/csi/data")?;
    ensure!(
        vol["read_allocs"].as_array().is_none_or(Vec::is_empty)
            && vol["write_allocs"].as_array().is_none_or(Vec::is_empty),
        "volume data is still claimed after the last job completed: {vol}"
    );
    Ok(())
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let berth = binary("berth");
    report::heading(
        "job-run-csi",
        &format!(
            "`berth job run` of a raw_exec batch job (sh -c {TASK_SCRIPT:?} into a CSI volume of the example hostpath plugin) to complete, against the job without the volume; {} rounds after {} warm-up ({})",
            args.rounds,
            args.warmup,
            berth.display()
        ),
    );
    let agent = agent_with_volume()?;
    let rounds = measure(&agent, args.rounds, args.warmup)?;
    check(&agent, &rounds)?;
    print(&rounds);
    Ok(())
}

/// Two rounds after one warm-up; every task must have written its file
/// into the volume, and the volume must be free at the end.
pub fn smoke() -> Result<()> {
    let agent = agent_with_volume()?;
    let rounds = measure(&agent, 2, 1)?;
    for (round, _) in &rounds.volume_rounds {
        check_wrote_into_volume(&agent, *round)?;
    }
    check(&agent, &rounds)?;
    print(&rounds);
    Ok(())
}
