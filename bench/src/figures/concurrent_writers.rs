//! `concurrent-writers`: job submissions while N CSI volume claims are
//! released at once, in process, against a real `berth_server::Server` on
//! a redb store in a temp dir.
//!
//! The state is seeded with `--nodes` ready nodes and N volumes, each
//! with a write claim of its own alloc (taken, no controller publish).
//! Then all N releases start together (`Server::unpublish_claim` as a
//! node's `CSIVolume.Unpublish` asks it: each a few store writes to the
//! volumes table, then a pass over the blocked jobs), and while they run
//! new service jobs of `--count` allocs are registered one after another
//! (`Server::register_job`, what `PUT /v1/jobs` calls) by `--submitters`
//! tasks at once, each timed from the call to its answer. Only
//! submissions that started while releases were still under way count.
//!
//! Each run is made twice: with the scheduler planning on a snapshot of
//! the tables, outside the store's writer (berth's behaviour), and with
//! `ServerConfig::scheduler_plans_in_writer` (planning inside the writer,
//! as before), the baseline. Printed per mode: the submissions with
//! nothing else running, the submissions during the releases, and the
//! time until every claim is free; then the ratios between the modes.
//!
//! ```text
//! scripts/bench concurrent-writers [--claims 1000] [--nodes 500] [--count 50] [--submits 200] [--submitters 4] [--rounds 5]
//! ```

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use berth_server::state::Change;
use berth_server::{ReleaseOrigin, Server, ServerConfig, StoreError};
use berth_structs::{AccessMode, AttachmentMode, ClaimMode, ClaimState, CsiVolume, CsiVolumeClaim};

use super::scheduler::{job, node, node_id, open_store};
use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Claims released at once (one volume and one alloc each).
    #[arg(long, default_value_t = 1_000)]
    pub claims: usize,
    /// Ready nodes in the state.
    #[arg(long, default_value_t = 500)]
    pub nodes: usize,
    /// Allocs of each submitted job.
    #[arg(long, default_value_t = 50)]
    pub count: usize,
    /// Submissions at most, per mode, round and phase.
    #[arg(long, default_value_t = 200)]
    pub submits: usize,
    /// Submitters running at once during the releases.
    #[arg(long, default_value_t = 4)]
    pub submitters: usize,
    /// Rounds per mode (the modes alternate), each on a fresh state.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.claims > 0 && args.nodes > 0 && args.count > 0 && args.submits > 0);
    ensure!(args.submitters > 0 && args.rounds > 0);
    // Room for both phases' submissions: 40 allocs a node.
    ensure!(
        args.count * args.submits * 2 <= args.nodes * 40,
        "--nodes {} hold {} allocs, fewer than the submissions need",
        args.nodes,
        args.nodes * 40
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    report::heading(
        "concurrent-writers",
        &format!(
            "{}-alloc job submissions ({} submitters) while {} claims are released, {} nodes, \
             in process on a redb store, {} rounds",
            args.count, args.submitters, args.claims, args.nodes, args.rounds
        ),
    );
    let mut snapshot = ModeSamples::default();
    let mut writer = ModeSamples::default();
    for _ in 0..args.rounds {
        rt.block_on(measure(args, false, &mut snapshot))?;
        rt.block_on(measure(args, true, &mut writer))?;
    }
    for (label, m) in [
        ("plan on a snapshot", &snapshot),
        ("plan in the writer (baseline)", &writer),
    ] {
        println!("  {label}");
        report::samples("submit, nothing else running", &m.quiet);
        report::samples("submit during the releases", &m.loaded);
        report::samples("every claim free after", &m.released);
        report::value(
            "releases",
            format!(
                "{:.0} claims/s (median round)",
                args.claims as f64 / m.released.median().as_secs_f64()
            ),
        );
    }
    report::ratio_line(
        "submit during the releases: snapshot / writer",
        &snapshot.loaded,
        &writer.loaded,
    );
    report::ratio_line(
        "every claim free: snapshot / writer",
        &snapshot.released,
        &writer.released,
    );
    Ok(())
}

pub fn smoke() -> Result<()> {
    run(&Args {
        claims: 100,
        nodes: 10,
        count: 2,
        submits: 5,
        submitters: 2,
        rounds: 1,
    })
}

#[derive(Default)]
struct ModeSamples {
    quiet: Samples,
    loaded: Samples,
    /// Per round, from the releases' start to every claim free.
    released: Samples,
}

/// One round of one mode: a fresh seeded server, the quiet submissions,
/// then the releases with submissions beside them.
async fn measure(args: &Args, plans_in_writer: bool, out: &mut ModeSamples) -> Result<()> {
    let dir = tempfile::tempdir()?;
    seed(dir.path(), args.nodes, args.claims)?;
    let mut config = ServerConfig::new(dir.path());
    config.scheduler_plans_in_writer = plans_in_writer;
    let server = Server::open(config)?;
    let submitted = Arc::new(AtomicUsize::new(0));
    for _ in 0..args.submits / 4 {
        out.quiet
            .push(submit(&server, &submitted, args.count).await?);
    }

    let done = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut releases = tokio::task::JoinSet::new();
    let nodes = args.nodes;
    for i in 0..args.claims {
        let (server, done) = (server.clone(), done.clone());
        releases.spawn(async move {
            let origin = ReleaseOrigin::Client {
                node_id: node_id(i % nodes),
            };
            let r = server
                .unpublish_claim(&volume_id(i), &claim_alloc_id(i), origin)
                .await;
            done.fetch_add(1, Ordering::Relaxed);
            r
        });
    }
    let mut submitters = tokio::task::JoinSet::new();
    let per_submitter = args.submits.div_ceil(args.submitters);
    let (claims, count) = (args.claims, args.count);
    for _ in 0..args.submitters {
        let (server, done, submitted) = (server.clone(), done.clone(), submitted.clone());
        submitters.spawn(async move {
            let mut took = Vec::new();
            while took.len() < per_submitter && done.load(Ordering::Relaxed) < claims {
                took.push(submit(&server, &submitted, count).await?);
            }
            Ok::<_, anyhow::Error>(took)
        });
    }
    let mut loaded = 0usize;
    while let Some(took) = submitters.join_next().await {
        for d in took?? {
            out.loaded.push(d);
            loaded += 1;
        }
    }
    while let Some(r) = releases.join_next().await {
        r??;
    }
    out.released.push(start.elapsed());
    let held = server
        .volumes()
        .iter()
        .filter(|v| !v.write_claims.is_empty() || !v.read_claims.is_empty())
        .count();
    ensure!(held == 0, "{held} of {} volumes still claimed", args.claims);
    if loaded == 0 {
        // Not an error: at a small size the releases may all end before
        // the first submission starts (the samples show n=0 then).
        println!("  (a round ended its releases before a submission started)");
    }
    Ok(())
}

/// Register a new job of `count` allocs; returns how long it took.
async fn submit(server: &Server, submitted: &AtomicUsize, count: usize) -> Result<Duration> {
    let n = submitted.fetch_add(1, Ordering::Relaxed);
    let job = job(&format!("submit-{n}"), count);
    let start = Instant::now();
    let resp = server.register_job(job).await?;
    let took = start.elapsed();
    ensure!(
        resp.unplaced_allocs == 0,
        "a submission left {} allocs unplaced: {:?}",
        resp.unplaced_allocs,
        resp.placement_failures
    );
    Ok(took)
}

fn volume_id(i: usize) -> String {
    format!("cw-{i:05}")
}

fn claim_alloc_id(i: usize) -> String {
    format!("cw-alloc-{i:05}")
}

/// A data dir at `data_dir` with `nodes` ready nodes and `claims` volumes,
/// each claimed for writing by its own alloc on one of the nodes.
fn seed(data_dir: &std::path::Path, nodes: usize, claims: usize) -> Result<()> {
    let store = open_store(data_dir)?;
    let mut changes: Vec<Change> = (0..nodes).map(|i| Change::PutNode(node(i))).collect();
    changes.extend((0..claims).map(|i| {
        let claim = CsiVolumeClaim {
            alloc_id: claim_alloc_id(i),
            node_id: node_id(i % nodes),
            external_node_id: String::new(),
            mode: ClaimMode::Write,
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
            state: ClaimState::Taken,
            publish_context: BTreeMap::new(),
            releasing: false,
            controller_published: false,
            kept_after_purge: false,
        };
        Change::PutVolume(CsiVolume {
            id: volume_id(i),
            name: volume_id(i),
            plugin_id: "sim".into(),
            write_claims: BTreeMap::from([(claim.alloc_id.clone(), claim)]),
            ..CsiVolume::default()
        })
    }));
    store.write(|_, c| {
        c.extend(changes);
        Ok::<_, StoreError>(())
    })?;
    Ok(())
}
