//! The scheduler placing an N-alloc service job on N ready nodes, in
//! process, against a real state store on a redb file in a temp dir.
//!
//! Each round starts from a copy of one seeded state file (N nodes with
//! room for the job: ready, eligible, `raw_exec`, 4000 MHz and 8 GiB
//! each) opened by a real `berth_server::Server`, and measures, in turn:
//!
//! - **write alone** (the baseline): one store write of N allocs made
//!   beforehand, as the placement's write will hold them: what any
//!   registration that places N allocs pays to make them durable;
//! - **place**: `Server::plan_job`, from the call to its answer: the
//!   scheduler's placement computation (`scheduler::place`, the function a
//!   registration's evaluation runs) with nothing written;
//! - **register**: `Server::register_job` (what the HTTP API's
//!   `PUT /v1/jobs` calls), from the call to its answer: the job's write,
//!   the evaluation that places the N allocs and commits them in one
//!   write, and the answer's reads.
//!
//! - **with placement rules** (unless `--no-rules`): place and register
//!   again on another copy, of the same job with constraints
//!   (`${attr.kernel.name} = linux`, a `regexp` and a `version` over node
//!   values, `distinct_hosts`), an affinity and a `spread` over the
//!   nodes' ten racks, against the plain job's (the baseline). Target:
//!   at most twice the plain job's register.
//!
//! Printed per size: the samples of each, register's ratio to the write
//! alone, and the per-alloc cost; then how the register time grows over
//! the sizes. Target: it grows no worse than n log n (fitted exponent
//! below 1.3 over 100..10,000, see `report::growth`).
//!
//! With `--http N` (1,000 by default; 0 leaves it out), the whole
//! registration through a real server: a `berth agent -server` process
//! whose state was seeded with N ready nodes, `PUT /v1/jobs` of a new
//! N-alloc job from the request's first byte to the answer's last,
//! against the in-process register of the same size (its baseline, from
//! the rounds above when the size is among `--sizes`).
//!
//! A second section shows what the tables' indexes buy: one lookup of a
//! node's allocs (`Tables::allocs_on_node`, ten allocs a node) in a store
//! of 1,000 and of 50,000 allocs, against the scan of the allocs table it
//! replaced (the baseline). Target: the indexed lookup grows sublinearly
//! with the table (two B-tree descents, log n, slowed by cache misses as the
//! table outgrows the caches), while the scan grows with the table.
//!
//! ```text
//! scripts/bench scheduler [--sizes 100,1000,10000] [--rounds 5] [--http 1000] [--lookup-allocs 1000,50000] [--no-rules]
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use berth_server::state::{Change, RedbBackend, StateStore};
use berth_server::{Server, ServerConfig, StoreError};
use berth_structs::{
    AllocDesiredStatus, Allocation, Job, JobType, Node, NodeResources, NodeStatus, Resources, Task,
    TaskConfig, TaskGroup,
};

use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sizes: N nodes and a job of N allocs for each.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 1_000, 10_000])]
    pub sizes: Vec<usize>,
    /// Measured rounds per size.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// N of the registration through a real server's HTTP API (0: none).
    #[arg(long, default_value_t = 1_000)]
    pub http: usize,
    /// Table sizes (allocs, ten a node) of the lookup section.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1_000, 50_000])]
    pub lookup_allocs: Vec<usize>,
    /// Lookups per sample in the lookup section.
    #[arg(long, default_value_t = 1_000)]
    pub lookups: usize,
    /// Leave out the job with placement rules.
    #[arg(long)]
    pub no_rules: bool,
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(!args.sizes.is_empty(), "--sizes names no size");
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(
        args.sizes.iter().all(|n| (1..=10_000).contains(n)),
        "every size must be 1..=10000 (a group's count is at most 10000)"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    report::heading(
        "scheduler",
        &format!(
            "an N-alloc service job placed on N ready nodes, in process on a redb store, {} rounds per size",
            args.rounds
        ),
    );
    let mut growth = Vec::new();
    let mut place_growth = Vec::new();
    let mut in_process = std::collections::BTreeMap::new();
    for &n in &args.sizes {
        let m = measure_size(&rt, n, args.rounds, !args.no_rules)?;
        in_process.insert(n, m.register.clone());
        println!("  N = {n}");
        report::samples("write alone (baseline)", &m.write_alone);
        report::samples("place (plan_job, no write)", &m.place);
        report::samples("register (place + its write)", &m.register);
        report::ratio_line("register / write alone", &m.register, &m.write_alone);
        report::value(
            "register per alloc",
            format!(
                "{:.1} us",
                m.register.median().as_secs_f64() * 1e6 / n as f64
            ),
        );
        report::value(
            "place per alloc",
            format!("{:.1} us", m.place.median().as_secs_f64() * 1e6 / n as f64),
        );
        if let Some((place, register)) = &m.rules {
            report::samples("place with rules", place);
            report::samples("register with rules", register);
            report::ratio_line("with rules / without (register)", register, &m.register);
            report::target(
                "with rules at most twice without",
                register.median() <= m.register.median() * 2,
            );
        }
        growth.push((n as f64, m.register.median().as_secs_f64() * 1000.0));
        place_growth.push((n as f64, m.place.median().as_secs_f64() * 1000.0));
    }
    if growth.len() >= 2 {
        report::growth_table("place", "ms", &place_growth);
        let g = report::growth_table("register", "ms", &growth);
        report::target("register grows no worse than n log n", g.exponent < 1.3);
    }
    if args.http > 0 {
        ensure!(
            args.http <= 10_000,
            "--http must be at most 10000 (a group's count)"
        );
        let baseline = match in_process.get(&args.http) {
            Some(s) => s.clone(),
            None => measure_size(&rt, args.http, args.rounds, false)?.register,
        };
        let http = register_over_http(args.http, args.rounds)?;
        println!("  N = {} through a server's HTTP API", args.http);
        report::samples("register in process (baseline)", &baseline);
        report::samples("PUT /v1/jobs", &http);
        report::ratio_line("HTTP / in process", &http, &baseline);
    }
    lookups(&args.lookup_allocs, args.lookups, args.rounds.max(5))?;
    Ok(())
}

pub fn smoke() -> Result<()> {
    run(&Args {
        sizes: vec![10, 40],
        rounds: 1,
        http: 20,
        lookup_allocs: vec![100, 400],
        lookups: 10,
        no_rules: false,
    })
}

struct SizeSamples {
    write_alone: Samples,
    place: Samples,
    register: Samples,
    /// Place and register of the job with placement rules.
    rules: Option<(Samples, Samples)>,
}

/// The rounds of one size, each on its own copy of the seeded state.
fn measure_size(
    rt: &tokio::runtime::Runtime,
    n: usize,
    rounds: usize,
    rules: bool,
) -> Result<SizeSamples> {
    let dir = tempfile::tempdir()?;
    let seed = dir.path().join("seed");
    seed_nodes(&seed, n)?;
    let job = job(&format!("bench-{n}"), n);
    let mut out = SizeSamples {
        write_alone: Samples::new(),
        place: Samples::new(),
        register: Samples::new(),
        rules: rules.then(|| (Samples::new(), Samples::new())),
    };
    for round in 0..rounds {
        // The baseline: the same allocs, written in one write.
        let base = copy_state(&seed, &dir.path().join(format!("base-{round}")))?;
        let store = open_store(&base)?;
        let shared = std::sync::Arc::new(job.clone());
        let allocs: Vec<Change> = (0..n)
            .map(|i| Change::PutAlloc(alloc(&shared, i, &node_id(i))))
            .collect();
        let start = Instant::now();
        store.write(|_, c| {
            c.extend(allocs);
            Ok::<_, StoreError>(())
        })?;
        out.write_alone.push(start.elapsed());
        drop(store);

        // The scheduler, on a server over another copy.
        let data = copy_state(&seed, &dir.path().join(format!("server-{round}")))?;
        let server = Server::open(ServerConfig::new(&data))?;
        let start = Instant::now();
        let plan = server.plan_job(job.clone())?;
        out.place.push(start.elapsed());
        let placed: u64 = plan.groups.iter().map(|g| g.place).sum();
        ensure!(
            placed == n as u64 && plan.unplaced_allocs == 0,
            "the plan placed {placed} of {n} allocs: {:?}",
            plan.placement_failures
        );
        let start = Instant::now();
        let resp = rt.block_on(server.register_job(job.clone()))?;
        out.register.push(start.elapsed());
        ensure!(
            resp.unplaced_allocs == 0 && resp.desired_allocs == n as u64,
            "the registration left {} of {} allocs unplaced: {:?}",
            resp.unplaced_allocs,
            resp.desired_allocs,
            resp.placement_failures
        );
        let allocs = server.job_allocations(&job.id)?;
        ensure!(
            allocs.len() == n,
            "{} allocs stored, {n} placed",
            allocs.len()
        );
        // Spread: one alloc a node.
        let nodes: std::collections::BTreeSet<&str> =
            allocs.iter().map(|a| a.node_id.as_str()).collect();
        ensure!(
            nodes.len() == n,
            "the job's {n} allocs went to {} nodes, not one a node",
            nodes.len()
        );
        drop(server);
        std::fs::remove_dir_all(&base).ok();
        std::fs::remove_dir_all(&data).ok();
        if let Some((place, register)) = &mut out.rules {
            let data = copy_state(&seed, &dir.path().join(format!("rules-{round}")))?;
            let (p, r) = place_with_rules(rt, &data, n)?;
            place.push(p);
            register.push(r);
            std::fs::remove_dir_all(&data).ok();
        }
    }
    Ok(out)
}

/// Place and register of an `n`-alloc job with placement rules on a
/// server over `data`: the time of each.
fn place_with_rules(
    rt: &tokio::runtime::Runtime,
    data: &Path,
    n: usize,
) -> Result<(std::time::Duration, std::time::Duration)> {
    use berth_structs::{Affinity, Constraint, Operator, Spread};
    let mut job = job(&format!("rules-{n}"), n);
    let rule = |attribute: &str, operator: Operator, value: &str| Constraint {
        attribute: attribute.into(),
        operator,
        value: value.into(),
    };
    job.constraints
        .push(rule("${attr.kernel.name}", Operator::Equal, "linux"));
    let group = &mut job.task_groups[0];
    group.constraints.extend([
        rule("${meta.rack}", Operator::Regexp, "^r[0-9]+$"),
        rule("${attr.kernel.version}", Operator::Version, ">= 5.0, < 99"),
        rule("", Operator::DistinctHosts, ""),
    ]);
    group.affinities.push(Affinity {
        attribute: "${meta.rack}".into(),
        value: "r1".into(),
        weight: 20,
        ..Affinity::default()
    });
    group.spreads.push(Spread {
        attribute: "${meta.rack}".into(),
        weight: 50,
        targets: Vec::new(),
    });
    job.validate()?;
    let server = Server::open(ServerConfig::new(data))?;
    let start = Instant::now();
    let plan = server.plan_job(job.clone())?;
    let place = start.elapsed();
    ensure!(
        plan.unplaced_allocs == 0,
        "with rules: {:?}",
        plan.placement_failures
    );
    let start = Instant::now();
    let resp = rt.block_on(server.register_job(job.clone()))?;
    let register = start.elapsed();
    ensure!(
        resp.unplaced_allocs == 0,
        "with rules: {:?}",
        resp.placement_failures
    );
    let allocs = server.job_allocations(&job.id)?;
    let mut per_rack = std::collections::BTreeMap::new();
    for a in &allocs {
        let i: usize = a.node_id.trim_start_matches("node-").parse()?;
        *per_rack.entry(i % RACKS).or_insert(0usize) += 1;
    }
    let (least, most) = (
        per_rack.values().min().copied().unwrap_or(0),
        per_rack.values().max().copied().unwrap_or(0),
    );
    ensure!(
        allocs.len() == n && most - least <= 1,
        "with rules: {} allocs, per rack {per_rack:?}",
        allocs.len()
    );
    Ok((place, register))
}

/// `PUT /v1/jobs` of an N-alloc job, `rounds` times (a new job each
/// time), to a `berth agent -server` whose state holds N ready nodes.
fn register_over_http(n: usize, rounds: usize) -> Result<Samples> {
    let port = berth_tests::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut agent = berth_tests::Agent::start(&["-server", "-http-addr", &addr])?;
    berth_tests::wait_for(
        "the server's HTTP API",
        std::time::Duration::from_secs(30),
        || {
            agent.check_running()?;
            Ok(berth_tests::api_get_at(port, "/v1/nodes").ok())
        },
    )?;
    // Seed the nodes while the agent is stopped; it gives every node a
    // fresh heartbeat TTL when it starts again.
    agent.stop()?;
    {
        let store = open_store(&agent.data_path())?;
        let nodes: Vec<Change> = (0..n).map(|i| Change::PutNode(node(i))).collect();
        store.write(|_, c| {
            c.extend(nodes);
            Ok::<_, StoreError>(())
        })?;
    }
    agent.start_again()?;
    berth_tests::wait_for(
        "the seeded nodes",
        std::time::Duration::from_secs(30),
        || {
            agent.check_running()?;
            let nodes = berth_tests::api_get_at(port, "/v1/nodes").ok();
            Ok(nodes.filter(|v| v.as_array().is_some_and(|a| a.len() == n)))
        },
    )?;
    let mut samples = Samples::new();
    for round in 0..rounds {
        let job = job(&format!("http-{n}-{round}"), n);
        let body = serde_json::to_string(&serde_json::json!({ "job": job }))?;
        let request = format!(
            "PUT /v1/jobs HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let start = Instant::now();
        let answer = berth_tests::http_at(port, &request)?;
        samples.push(start.elapsed());
        let resp: serde_json::Value = serde_json::from_slice(&answer.body)
            .with_context(|| format!("PUT /v1/jobs: {}", String::from_utf8_lossy(&answer.body)))?;
        ensure!(
            answer.status == 200 && resp["unplaced_allocs"] == 0 && resp["desired_allocs"] == n,
            "PUT /v1/jobs answered {}: {resp}",
            answer.status
        );
    }
    agent.stop()?;
    Ok(samples)
}

/// The lookup section: a node's allocs by the index against a scan.
fn lookups(sizes: &[usize], per_sample: usize, samples: usize) -> Result<()> {
    if sizes.is_empty() {
        return Ok(());
    }
    ensure!(per_sample > 0, "--lookups must be at least 1");
    println!(
        "  lookup of one node's allocs (ten a node), {per_sample} lookups a sample, {samples} samples"
    );
    let mut indexed_points = Vec::new();
    let mut scan_points = Vec::new();
    for &allocs in sizes {
        ensure!(allocs >= 10, "--lookup-allocs sizes must be at least 10");
        let dir = tempfile::tempdir()?;
        let store = open_store(dir.path())?;
        let nodes = allocs / 10;
        let job = std::sync::Arc::new(job("lookup", 1));
        let changes: Vec<Change> = (0..allocs)
            .map(|i| Change::PutAlloc(alloc(&job, i, &node_id(i % nodes))))
            .collect();
        store.write(|_, c| {
            c.extend(changes);
            Ok::<_, StoreError>(())
        })?;
        let mut indexed = Samples::new();
        let mut scan = Samples::new();
        for s in 0..samples {
            // Interleaved, on nodes spread over the table.
            let ids: Vec<String> = (0..per_sample)
                .map(|i| node_id((i * 7919 + s) % nodes))
                .collect();
            let (found_indexed, took) = store.read(|t| {
                let start = Instant::now();
                let found: usize = ids.iter().map(|id| t.allocs_on_node(id).count()).sum();
                (found, start.elapsed())
            });
            indexed.push(took);
            let (found_scan, took) = store.read(|t| {
                let start = Instant::now();
                let found: usize = ids
                    .iter()
                    .map(|id| t.allocs.values().filter(|a| &a.node_id == id).count())
                    .sum();
                (found, start.elapsed())
            });
            scan.push(took);
            ensure!(
                found_indexed == found_scan && found_indexed == per_sample * 10,
                "the index found {found_indexed} allocs, the scan {found_scan}, of {} expected",
                per_sample * 10
            );
        }
        report::samples(&format!("indexed, {allocs} allocs"), &indexed);
        report::samples(&format!("scan (baseline), {allocs} allocs"), &scan);
        report::ratio_line(&format!("scan / indexed, {allocs} allocs"), &scan, &indexed);
        indexed_points.push((allocs as f64, indexed.median().as_secs_f64() * 1000.0));
        scan_points.push((allocs as f64, scan.median().as_secs_f64() * 1000.0));
    }
    if indexed_points.len() >= 2 {
        let indexed = report::growth_table("the indexed lookup", "ms", &indexed_points);
        report::growth_table("the scan", "ms", &scan_points);
        // A lookup descends two B-trees (log n) whose nodes stop fitting in
        // the caches as the table grows, so it is not quite flat; what it
        // must not do is grow with the table as the scan does.
        report::target(
            "the indexed lookup grows sublinearly with the table (cost ~ n^k, k < 0.8)",
            indexed.exponent < 0.8,
        );
    }
    Ok(())
}

pub(super) fn node_id(i: usize) -> String {
    format!("node-{i:05}")
}

/// The racks the nodes are in (`meta.rack`, node i in rack i % RACKS).
const RACKS: usize = 10;

pub(super) fn node(i: usize) -> Node {
    Node {
        id: node_id(i),
        name: format!("bench-{i:05}"),
        datacenter: "dc1".into(),
        meta: [("rack".to_string(), format!("r{}", i % RACKS))].into(),
        attributes: [
            ("kernel.name".to_string(), "linux".to_string()),
            ("kernel.version".to_string(), "6.1.0".to_string()),
        ]
        .into(),
        status: NodeStatus::Ready,
        drivers: vec!["raw_exec".into()],
        resources: NodeResources {
            cpu: 4_000,
            memory_mb: 8_192,
            disk_mb: 0,
        },
        ..Node::default()
    }
}

pub(super) fn job(id: &str, count: usize) -> Job {
    Job {
        id: id.into(),
        name: id.into(),
        job_type: JobType::Service,
        datacenters: vec!["dc1".into()],
        task_groups: vec![TaskGroup {
            name: "web".into(),
            count: u32::try_from(count).unwrap_or(u32::MAX),
            tasks: vec![Task {
                name: "server".into(),
                driver: "raw_exec".into(),
                config: TaskConfig {
                    command: "/bin/sleep".into(),
                    args: vec!["3600".into()],
                    ..berth_structs::TaskConfig::default()
                },
                resources: Resources {
                    cpu: 100,
                    memory_mb: 64,
                    ..berth_structs::Resources::default()
                },
                ..Task::default()
            }],
            ..TaskGroup::default()
        }],
        ..Job::default()
    }
}

/// An alloc of `job` as a placement makes it (its allocs share the job).
fn alloc(job: &std::sync::Arc<Job>, index: usize, node_id: &str) -> Allocation {
    let group = &job.task_groups[0];
    Allocation {
        id: berth_structs::generate_id(),
        name: format!("{}.{}[{index}]", job.id, group.name),
        job_id: job.id.clone(),
        job: std::sync::Arc::clone(job),
        task_group: group.name.clone(),
        index: u32::try_from(index).unwrap_or(u32::MAX),
        node_id: node_id.to_string(),
        desired_status: AllocDesiredStatus::Run,
        ..Allocation::default()
    }
}

/// A server data dir at `data_dir` with `n` ready nodes, written in one
/// write.
fn seed_nodes(data_dir: &Path, n: usize) -> Result<()> {
    std::fs::create_dir_all(data_dir)?;
    seed_into(&open_store(data_dir)?, n)
}

/// `n` ready nodes written into `store` in one write.
pub(super) fn seed_into(store: &StateStore, n: usize) -> Result<()> {
    let nodes: Vec<Change> = (0..n).map(|i| Change::PutNode(node(i))).collect();
    store.write(|_, c| {
        c.extend(nodes);
        Ok::<_, StoreError>(())
    })?;
    Ok(())
}

pub(super) fn open_store(data_dir: &Path) -> Result<StateStore> {
    let path = RedbBackend::path_in(data_dir);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let backend =
        RedbBackend::open(&path).with_context(|| format!("opening {}", path.display()))?;
    Ok(StateStore::open(Box::new(backend))?)
}

/// A copy of the server state under `from` in a new data dir `to`.
fn copy_state(from: &Path, to: &Path) -> Result<PathBuf> {
    let src = RedbBackend::path_in(from);
    let dst = RedbBackend::path_in(to);
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::copy(&src, &dst)
        .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
    if !dst.exists() {
        bail!("{} was not made", dst.display());
    }
    // The keyring beside it opens the secrets the copy holds sealed.
    let keyring = |p: &Path| {
        p.parent()
            .unwrap_or(p)
            .join(berth_server::keyring::KEYRING_DIR)
    };
    let (src_keys, dst_keys) = (keyring(&src), keyring(&dst));
    std::fs::create_dir_all(&dst_keys)?;
    for entry in
        std::fs::read_dir(&src_keys).with_context(|| format!("reading {}", src_keys.display()))?
    {
        let entry = entry?;
        std::fs::copy(entry.path(), dst_keys.join(entry.file_name()))
            .with_context(|| format!("copying {}", entry.path().display()))?;
    }
    Ok(to.to_path_buf())
}
