//! `stores`: the servers' two stores side by side, in one run, in process:
//! the embedded redb store (the baseline: what one server pays) and etcd
//! (`store = "etcd"`, one member on loopback that the figure starts, the
//! server elected leader of its prefix, every write one fenced
//! transaction). Each store's server starts with N ready nodes; then, a
//! store after the other, round by round:
//!
//! - **job submit**: `Server::register_job` (what `PUT /v1/jobs` calls) of
//!   a new one-alloc service job, from the call to its answer: the job's
//!   write, the evaluation and the alloc's write;
//! - **placement**: `Server::register_job` of an N-alloc job on the N
//!   nodes, as allocs placed per second.
//!
//! No target is held: the figure shows what etcd's round trips and fenced
//! transactions cost against a local fsync.
//!
//! ```text
//! scripts/bench stores [--nodes 1000] [--rounds 50]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use berth_server::etcd::EtcdConfig;
use berth_server::state::{EtcdBackend, StateStore};
use berth_server::{Server, ServerConfig, StoreConfig};
use berth_sync::Shutdown;
use berth_testutil::etcd::Etcd;

use super::scheduler::{job, open_store, seed_into};
use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Ready nodes each server starts with (and the size of the placed job).
    #[arg(long, default_value_t = 1_000)]
    pub nodes: usize,
    /// Measured job submits per store.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Measured N-alloc placements per store.
    #[arg(long, default_value_t = 3)]
    pub placements: usize,
}

pub fn smoke() -> Result<()> {
    run(&Args {
        nodes: 20,
        rounds: 3,
        placements: 1,
    })
}

struct StoreSamples {
    submit: Samples,
    placed_per_second: Vec<f64>,
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(
        args.rounds > 0 && args.placements > 0,
        "rounds must be at least 1"
    );
    ensure!(
        (1..=10_000).contains(&args.nodes),
        "--nodes must be 1..=10000 (a group's count is at most 10000)"
    );
    report::heading(
        "stores",
        &format!(
            "job submit and placement on {} ready nodes, in process: redb against one local etcd member",
            args.nodes
        ),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let etcd = Etcd::start();
    let dir = tempfile::tempdir()?;
    let redb = {
        let data = dir.path().join("redb");
        let store = open_store(&data)?;
        seed_into(&store, args.nodes)?;
        drop(store);
        measure(&rt, ServerConfig::new(&data), args)?
    };
    let on_etcd = {
        let data = dir.path().join("etcd");
        let mut etcd_config = EtcdConfig::new(vec![etcd.endpoint()]);
        etcd_config.prefix = "/bench".into();
        {
            let client = berth_server::etcd::EtcdClient::new(etcd_config.clone())?;
            let backend = EtcdBackend::open(client, &data.join("server").join("keyring"))?;
            let store = StateStore::open(Box::new(backend))?;
            seed_into(&store, args.nodes)?;
        }
        let mut config = ServerConfig::new(&data);
        config.store = StoreConfig::Etcd(etcd_config);
        measure(&rt, config, args)?
    };
    println!("  job submit (one alloc)");
    report::samples("redb (baseline)", &redb.submit);
    report::samples("etcd", &on_etcd.submit);
    report::ratio_line("etcd / redb", &on_etcd.submit, &redb.submit);
    println!("  placement of a {}-alloc job", args.nodes);
    for (label, s) in [("redb", &redb), ("etcd", &on_etcd)] {
        let mut rates = s.placed_per_second.clone();
        rates.sort_by(f64::total_cmp);
        report::value(
            &format!("{label}: allocs placed per second (median)"),
            format!("{:.0}", rates[rates.len() / 2]),
        );
    }
    Ok(())
}

/// The rounds on a server of `config`, once it leads.
fn measure(
    rt: &tokio::runtime::Runtime,
    config: ServerConfig,
    args: &Args,
) -> Result<StoreSamples> {
    let server = Server::open(config)?;
    let (stop, shutdown) = Shutdown::channel();
    let running = rt.spawn(Arc::clone(&server).run(shutdown));
    let deadline = Instant::now() + Duration::from_secs(30);
    // Leading, and past taking up the state (the first write is fenced).
    while !server.role().is_leader() || rt.block_on(server.register_job(job("warmup", 1))).is_err()
    {
        ensure!(
            Instant::now() < deadline,
            "the server did not lead within 30s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut out = StoreSamples {
        submit: Samples::new(),
        placed_per_second: Vec::new(),
    };
    for round in 0..args.rounds {
        let start = Instant::now();
        let resp = rt.block_on(server.register_job(job(&format!("submit-{round}"), 1)))?;
        out.submit.push(start.elapsed());
        ensure!(
            resp.unplaced_allocs == 0,
            "a submit left its alloc unplaced"
        );
    }
    for round in 0..args.placements {
        let start = Instant::now();
        let resp = rt
            .block_on(server.register_job(job(&format!("place-{round}"), args.nodes)))
            .context("placing the large job")?;
        let took = start.elapsed();
        ensure!(
            resp.unplaced_allocs == 0,
            "the placement left {} allocs unplaced",
            resp.unplaced_allocs
        );
        // Each node has room for many such allocs: the rounds fit.
        out.placed_per_second
            .push(args.nodes as f64 / took.as_secs_f64());
    }
    stop.shutdown();
    let _ = rt.block_on(running);
    Ok(out)
}
