//! `claims-release`: N allocs, each holding a write claim on its own CSI
//! volume, stopped together with one `job stop`, until every claim is
//! free on the servers.
//!
//! One real server agent (`berth agent -server`, default settings) and
//! N/5 simulated nodes (`bench/src/sim.rs`), each with a healthy node
//! plugin `sim` (no controller publish), 5 allocs per node. N volumes
//! `cr-N[i]` are registered through the API and one service job of N
//! allocs claims them (`per_alloc`); the nodes claim each alloc's volume
//! (`CSIVolume.Claim`) and report it running. Then, from the moment the
//! bench sends `DELETE /v1/job/<id>` (what `berth job stop -detach` does):
//! - with Unpublish (a client's CSI hook postrun): each node, seeing its
//!   allocs stopped, calls `CSIVolume.Unpublish` for each one's volume
//!   (the server drives the claim `taken → node-detached →
//!   controller-detached → ready-to-free → freed` before it answers), then
//!   reports the allocs complete. Measured to the last Unpublish answered,
//!   confirmed by reading every volume free through the API.
//! - without Unpublish (nodes that went away before their postrun; they
//!   still answer the server's node detach): the nodes only report the
//!   allocs complete and the server's volume watcher must free the claims,
//!   after its reap grace (5 s by default, `claim_reap_grace`). Measured
//!   by polling the volumes through the API every 200 ms.
//!
//! Baseline, in the same run: from the stop to every alloc reported
//! complete by its node (the stop reaching the nodes, without the claims'
//! release).
//!
//! Target: all N = 1,000 claims free ≤ 10 s after the stop, with Unpublish.
//! Printed too: the rate (claims/s), each Unpublish's round trip, growth
//! over `--sizes`, and the watcher's time at the largest size.
//!
//! With `--on-etcd`, each size runs again against a server that keeps
//! its state in etcd (one member on loopback, its own fsync; every step
//! of a claim's release one fenced transaction): the first run, on the
//! embedded store, is the baseline.
//!
//! ```text
//! scripts/bench claims-release                  # --sizes 10,100,1000
//! scripts/bench claims-release --sizes 1000 --no-watcher
//! scripts/bench claims-release --sizes 1000 --on-etcd --no-watcher
//! ```

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::report::{self, Ms, Samples};
use crate::sim::{self, Fleet, FleetConfig, FleetStats, How, ServerAgent, Servers, TASK_CPU};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Claims (allocs, volumes) per run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![10, 100, 1000])]
    pub sizes: Vec<usize>,
    /// Skip the run at the largest size where the nodes do not call
    /// Unpublish and the volume watcher frees the claims.
    #[arg(long)]
    pub no_watcher: bool,
    /// Run each size again with the server on etcd, and print what that
    /// costs.
    #[arg(long)]
    pub on_etcd: bool,
}

const ALLOCS_PER_NODE: usize = 5;

/// The server's default `claim_reap_grace`: how long the watcher leaves a
/// terminal alloc's claim to its client.
const REAP_GRACE: Duration = Duration::from_secs(5);

struct Point {
    claims: usize,
    /// Stop to every claim free.
    free: Duration,
    /// Stop to every alloc reported complete (the baseline).
    stopped: Duration,
    unpublishes: Samples,
}

pub fn run(args: &Args) -> Result<()> {
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        bail!("--sizes: give one or more claim counts above 0");
    }
    report::heading(
        "claims-release",
        "N allocs, each with a write claim on its own volume, stopped by one job stop: stop to every claim free on the servers",
    );
    let mut points = Vec::new();
    for &n in &args.sizes {
        let p = measure(n, true, How::Plain)?;
        print_point(&p, true);
        if args.on_etcd {
            let e = measure(n, true, How::OnEtcd)?;
            println!("  -- the same, the server on etcd");
            print_point(&e, true);
            report::ratio_line(
                "etcd / embedded: Unpublish round trip (claim to free)",
                &e.unpublishes,
                &p.unpublishes,
            );
            report::value(
                "etcd / embedded: stop to every claim free",
                format!("{} / {}", Ms(e.free), Ms(p.free)),
            );
        }
        points.push(p);
    }
    let last = points.last().context("no size ran")?;
    report::target(
        &format!(
            "all {} claims free <= 10 s after the stop ({:.2} s)",
            last.claims,
            last.free.as_secs_f64()
        ),
        last.free <= Duration::from_secs(10),
    );
    if points.len() >= 2 {
        let pts: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.claims as f64, p.free.as_secs_f64()))
            .collect();
        report::growth_table("stop to all claims free", "s", &pts);
    }
    if !args.no_watcher {
        let n = *args.sizes.iter().max().unwrap_or(&1000);
        let p = measure(n, false, How::Plain)?;
        print_point(&p, false);
    }
    Ok(())
}

fn print_point(p: &Point, unpublish: bool) {
    let how = if unpublish {
        "nodes call Unpublish"
    } else {
        "no Unpublish: the volume watcher frees them"
    };
    println!("  -- {} claims, {how}", p.claims);
    let one = |d: Duration| -> Samples { std::iter::once(d).collect() };
    report::samples("stop to every claim free", &one(p.free));
    report::samples("baseline: stop to allocs complete", &one(p.stopped));
    report::ratio_line(
        "claims free / allocs complete",
        &one(p.free),
        &one(p.stopped),
    );
    report::value(
        "rate",
        format!(
            "{:.0} claims/s",
            p.claims as f64 / p.free.as_secs_f64().max(1e-9)
        ),
    );
    if unpublish {
        report::samples("Unpublish round trip", &p.unpublishes);
    } else {
        report::value(
            "of which the reap grace",
            format!(
                "{} (after it: {})",
                Ms(REAP_GRACE),
                Ms(p.free.saturating_sub(REAP_GRACE))
            ),
        );
    }
}

fn measure(claims: usize, unpublish: bool, how: How) -> Result<Point> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("the bench's tokio runtime")?;
    let servers = Servers::start(how)?;
    let server = &servers.dialed;
    let nodes = claims.div_ceil(ALLOCS_PER_NODE);
    let cfg = FleetConfig {
        nodes,
        node_cpu: ALLOCS_PER_NODE as u64 * TASK_CPU,
        plugin_nodes: nodes,
        unpublish,
        channels: super::server_scale::channels_for(nodes),
    };
    let fleet = rt.block_on(Fleet::start(server, &cfg))?;
    let source = format!("cr-{claims}");
    server.parallel(claims, 4, |s, i| {
        s.register_volume(&format!("{source}[{i}]"))
    })?;
    let job_id = format!("claims-{claims}");
    let job = sim::job(&job_id, claims as u32, Some(&source));
    server.put("/v1/jobs", &serde_json::json!({ "job": job }))?;
    let stats = fleet.stats.clone();
    rt.block_on(sim::wait_until(
        "every alloc running with its claim",
        Duration::from_secs(600),
        || {
            stats.running.load(Ordering::Relaxed) >= claims
                && stats.claimed.load(Ordering::Relaxed) >= claims
        },
        || {
            format!(
                "{} running, {} claimed of {claims}",
                stats.running.load(Ordering::Relaxed),
                stats.claimed.load(Ordering::Relaxed)
            )
        },
    ))?;
    fleet.stats.check()?;
    if claimed_volumes(server, &source)? != claims {
        bail!("the servers do not show {claims} claimed volumes after the claims");
    }

    let stopped_at = Instant::now();
    let complete = rt.spawn(all_complete(fleet.stats.clone(), claims));
    server.delete(&format!("/v1/job/{job_id}"))?;
    let freed_at = if unpublish {
        rt.block_on(sim::wait_until(
            "every Unpublish answered",
            Duration::from_secs(600),
            || stats.unpublished.load(Ordering::Relaxed) >= claims,
            || {
                format!(
                    "{} of {claims} unpublished",
                    stats.unpublished.load(Ordering::Relaxed)
                )
            },
        ))?;
        stats
            .last_unpublish()
            .context("no Unpublish was answered")?
    } else {
        wait_free(server, &source, Duration::from_secs(600))?
    };
    let left = claimed_volumes(server, &source)?;
    if left != 0 {
        bail!("{left} volumes still claimed after every Unpublish was answered");
    }
    let stopped = rt
        .block_on(complete)
        .context("the completion watch panicked")??;
    fleet.stats.check()?;
    Ok(Point {
        claims,
        free: freed_at.duration_since(stopped_at),
        stopped: stopped.duration_since(stopped_at),
        unpublishes: fleet.stats.unpublishes(),
    })
}

/// When every alloc was reported complete.
async fn all_complete(stats: Arc<FleetStats>, claims: usize) -> Result<Instant> {
    let deadline = Instant::now() + Duration::from_secs(600);
    while stats.complete.load(Ordering::Relaxed) < claims {
        if Instant::now() > deadline {
            bail!(
                "only {} of {claims} allocs reported complete",
                stats.complete.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Instant::now())
}

/// How many volumes with IDs starting `source` hold a claim, read from the
/// API.
fn claimed_volumes(server: &ServerAgent, source: &str) -> Result<usize> {
    let (list, _) = server.get_indexed(&format!("/v1/volumes?prefix={source}"))?;
    Ok(count_claimed(&list))
}

fn count_claimed(list: &serde_json::Value) -> usize {
    list.as_array()
        .map(|vs| {
            vs.iter()
                .filter(|v| {
                    ["read_allocs", "write_allocs"]
                        .iter()
                        .any(|k| v[*k].as_array().is_some_and(|a| !a.is_empty()))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Poll the volumes every 200 ms until none is claimed; when that was
/// first seen.
fn wait_free(server: &ServerAgent, source: &str, timeout: Duration) -> Result<Instant> {
    let started = Instant::now();
    loop {
        let left = claimed_volumes(server, source)?;
        if left == 0 {
            return Ok(Instant::now());
        }
        if started.elapsed() > timeout {
            bail!("{left} volumes still claimed {timeout:?} after the stop");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// 10 claims released by Unpublish (on each store), then 5 by the volume
/// watcher.
pub fn smoke() -> Result<()> {
    let p = measure(10, true, How::Plain)?;
    print_point(&p, true);
    let e = measure(10, true, How::OnEtcd)?;
    print_point(&e, true);
    let p = measure(5, false, How::Plain)?;
    print_point(&p, false);
    if p.free < REAP_GRACE {
        bail!(
            "the watcher freed the claims {} after the stop, before its reap grace",
            Ms(p.free)
        );
    }
    Ok(())
}
