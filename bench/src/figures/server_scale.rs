//! `server-scale`: one real server agent (`berth agent -server`, its own
//! process, default settings: min TTL 10 s, 50 heartbeats/s) with N
//! simulated nodes (`bench/src/sim.rs`: each registers with its own ID
//! and secret, heartbeats at the TTL the server returns with the client's
//! jitter, watches its allocs, reports them running and keeps a call
//! stream open), 5 allocs per node (service jobs of up to 1,000 allocs
//! registered through the HTTP API one after another, each node sized to
//! hold exactly 5),
//! and N CSI volumes registered through the API (unclaimed: claims are
//! the `claims-release` figure's).
//!
//! Measured, per size:
//! - the heartbeat round trip (`Node.Heartbeat`, from the simulated node
//!   sending it to the answer) while the set-up writes run, and in the
//!   steady state after it, for `--duration` seconds;
//! - the baseline, in the same steady window: the cheapest round trip to
//!   the same server (a heartbeat of a node it does not know, refused at
//!   once) over a connection of its own, probed every 50 ms;
//! - the same probe all through the set-up, on a thread and a runtime of
//!   its own: how the server answers a node with its own connection (as
//!   every real node has) while the fleet registers at once, its allocs
//!   are placed and its volumes registered. The fleet's own heartbeats
//!   share 100 nodes to a connection and one process's two cores with
//!   the simulation's work, which they also measure;
//! - the server's RSS once everything is in place;
//! - the server's CPU over the steady window (near zero: no per-volume
//!   or per-alloc work while idle, only the heartbeats);
//! - the server's alive tokio tasks (`berth_runtime_alive_tasks`) before
//!   and after the N volumes are registered: equal when no task is held
//!   per volume;
//! - the set-up costs: registering the nodes (all at once), placing and
//!   running the allocs (from the first job registered to every alloc
//!   reported running), registering the volumes (4 API clients).
//!
//! Target: steady heartbeat p99 ≤ 20 ms at 10,000 nodes (the largest
//! size); no node marked down; no RPC failed; no connection lost (an RPC
//! that fails because its connection broke is retried, as a client
//! does, and counted).
//! The nodes dial with a client's HTTP/2 keepalive (a connection whose
//! pings go unanswered for 5 s is dropped) and reopen a broken alloc
//! watch or call stream after a client's backoff; how many were reopened,
//! and the first reasons, are printed (a server that stalls shows there).
//!
//! ```text
//! scripts/bench server-scale                       # --sizes 100,1000,10000
//! scripts/bench server-scale --sizes 10000 --duration 60
//! scripts/bench server-scale --sizes 10000 --tls   # and again with mutual TLS
//! scripts/bench server-scale --sizes 10000 --through-follower
//! ```
//!
//! With `--through-follower`, each size runs again against two servers
//! on one etcd member (loopback, its own fsync), the fleet dialing the
//! one that does not lead: its heartbeats, registrations and call
//! streams go on to the leader, its alloc watches are served by the
//! follower; the first run (one server on the embedded store) is the
//! baseline.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::node_client::NodeClient;

use crate::report::{self, Mib, Ms, Samples};
use crate::sim::{self, Fleet, FleetConfig, How, ServerAgent, Servers, TASK_CPU};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Simulated nodes per run; allocs (5 per node) and volumes (one per
    /// node) scale with them.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 1000, 10000])]
    pub sizes: Vec<usize>,
    /// Seconds of steady heartbeats measured after the set-up.
    #[arg(long, default_value_t = 30)]
    pub duration: u64,
    /// Allocs placed per node.
    #[arg(long, default_value_t = 5)]
    pub allocs_per_node: usize,
    /// Run each size twice, the second time with mutual TLS on the agent
    /// protocol (the nodes present client certificates), and print what
    /// TLS costs.
    #[arg(long)]
    pub tls: bool,
    /// Run each size again with two servers on etcd, the nodes dialing
    /// the follower, and print what that costs.
    #[arg(long)]
    pub through_follower: bool,
}

/// The largest job registered: `count` is at most 10,000, and smaller
/// jobs are how a fleet's allocs arrive.
const JOB_ALLOCS: usize = 1000;

struct Point {
    nodes: usize,
    setup_heartbeats: Samples,
    /// The refused round trip on a connection, thread and runtime of its
    /// own, all through the set-up.
    setup_aside: Samples,
    steady_heartbeats: Samples,
    baseline: Samples,
    rss_kib: u64,
    cpu_share: f64,
    tasks_before_volumes: f64,
    tasks_after_volumes: f64,
    tasks_idle: f64,
    register: Duration,
    place: Duration,
    volumes: Duration,
    down: f64,
    /// Alloc watches and call streams reopened, the first reasons.
    reopened: (usize, Vec<String>),
    /// RPCs retried after a broken connection, the first reasons.
    retried: (usize, Vec<String>),
}

pub fn run(args: &Args) -> Result<()> {
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        bail!("--sizes: give one or more node counts above 0");
    }
    if args.allocs_per_node == 0 {
        bail!("--allocs-per-node: at least 1");
    }
    report::heading(
        "server-scale",
        &format!(
            "a server agent with N simulated nodes heartbeating, {} allocs per node, N unclaimed CSI volumes; steady window {} s",
            args.allocs_per_node, args.duration
        ),
    );
    let mut points = Vec::new();
    for &n in &args.sizes {
        let p = measure(n, args, How::Plain)?;
        print_point(&p, "");
        if args.through_follower {
            compare_follower(&measure(n, args, How::ThroughFollower)?, &p)?;
        }
        if args.tls {
            let t = measure(n, args, How::Tls)?;
            print_point(&t, ", mutual TLS on the agent protocol");
            report::ratio_line(
                "TLS / plain: steady heartbeat",
                &t.steady_heartbeats,
                &p.steady_heartbeats,
            );
            report::value(
                "TLS / plain: steady heartbeat p99",
                format!(
                    "{} / {}",
                    Ms(t.steady_heartbeats.p99()),
                    Ms(p.steady_heartbeats.p99())
                ),
            );
            report::value(
                "TLS / plain: server RSS",
                format!("{} / {}", Mib(t.rss_kib), Mib(p.rss_kib)),
            );
            if t.down > 0.0 {
                bail!("with TLS, {} of {n} nodes were marked down", t.down);
            }
        }
        points.push(p);
    }
    let last = points.last().context("no size ran")?;
    let down: Vec<String> = points
        .iter()
        .filter(|p| p.down > 0.0)
        .map(|p| format!("{} of {}", p.down, p.nodes))
        .collect();
    report::target(
        &format!(
            "steady heartbeat p99 <= 20 ms at {} nodes (p99 {})",
            last.nodes,
            Ms(last.steady_heartbeats.p99())
        ),
        last.steady_heartbeats.p99() <= Duration::from_millis(20),
    );
    if points.len() >= 2 {
        let g = |f: &dyn Fn(&Point) -> f64| -> Vec<(f64, f64)> {
            points.iter().map(|p| (p.nodes as f64, f(p))).collect()
        };
        report::growth_table(
            "steady heartbeat p99",
            "ms",
            &g(&|p| p.steady_heartbeats.p99().as_secs_f64() * 1000.0),
        );
        report::growth_table("server RSS", "MiB", &g(&|p| p.rss_kib as f64 / 1024.0));
        report::growth_table(
            "registering the nodes",
            "s",
            &g(&|p| p.register.as_secs_f64()),
        );
        report::growth_table(
            "placing and running the allocs",
            "s",
            &g(&|p| p.place.as_secs_f64()),
        );
        report::growth_table(
            "registering the volumes",
            "s",
            &g(&|p| p.volumes.as_secs_f64()),
        );
    }
    report::target(
        &format!(
            "set-up at {} nodes: a node's own connection answered, p99 <= 100 ms (p99 {})",
            last.nodes,
            Ms(last.setup_aside.p99())
        ),
        last.setup_aside.p99() <= Duration::from_millis(100),
    );
    let lost: usize = points.iter().map(|p| p.retried.0 + p.reopened.0).sum();
    report::target(
        &format!("no connection lost ({lost} RPCs retried or streams reopened)"),
        lost == 0,
    );
    if !down.is_empty() {
        bail!(
            "nodes were marked down (heartbeats not answered within TTL + grace): {}",
            down.join(", ")
        );
    }
    Ok(())
}

/// Prints the run through a follower `f` against the one server's `p`;
/// an error if a node was marked down.
fn compare_follower(f: &Point, p: &Point) -> Result<()> {
    let n = f.nodes;
    print_point(f, ", through a follower on etcd");
    report::ratio_line(
        "follower on etcd / one server: steady heartbeat",
        &f.steady_heartbeats,
        &p.steady_heartbeats,
    );
    report::value(
        "follower on etcd / one server: steady heartbeat p99",
        format!(
            "{} / {}",
            Ms(f.steady_heartbeats.p99()),
            Ms(p.steady_heartbeats.p99())
        ),
    );
    report::target(
        &format!(
            "through a follower: steady heartbeat p99 <= 20 ms at {n} nodes (p99 {})",
            Ms(f.steady_heartbeats.p99())
        ),
        f.steady_heartbeats.p99() <= Duration::from_millis(20),
    );
    if f.down > 0.0 {
        bail!(
            "through a follower, {} of {n} nodes were marked down",
            f.down
        );
    }
    Ok(())
}

fn print_point(p: &Point, label: &str) {
    println!("  -- {} nodes{label}", p.nodes);
    report::samples("heartbeat during set-up", &p.setup_heartbeats);
    report::samples("set-up: a node's own connection", &p.setup_aside);
    report::samples("heartbeat steady", &p.steady_heartbeats);
    report::samples("baseline: refused round trip", &p.baseline);
    report::ratio_line(
        "steady heartbeat / baseline",
        &p.steady_heartbeats,
        &p.baseline,
    );
    report::value("server RSS", Mib(p.rss_kib));
    report::value(
        "server CPU, steady window",
        format!("{:.1} % of one core", p.cpu_share * 100.0),
    );
    report::value(
        "alive tasks: before/after volumes",
        format!(
            "{} / {} (idle at the end: {})",
            p.tasks_before_volumes, p.tasks_after_volumes, p.tasks_idle
        ),
    );
    report::value(
        "set-up: nodes / allocs / volumes",
        format!(
            "{:.1} s / {:.1} s / {:.1} s",
            p.register.as_secs_f64(),
            p.place.as_secs_f64(),
            p.volumes.as_secs_f64()
        ),
    );
    report::value(
        "registration throughput",
        format!(
            "{:.0} nodes/s",
            p.nodes as f64 / p.register.as_secs_f64().max(1e-9)
        ),
    );
    report::value("nodes marked down", p.down);
    let (n, why) = &p.reopened;
    report::value("streams reopened by the nodes", n);
    for w in why {
        println!("      {w}");
    }
    let (n, why) = &p.retried;
    report::value("RPCs retried (connection lost)", n);
    for w in why {
        println!("      {w}");
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("the bench's tokio runtime")
}

/// One channel per 100 nodes, at least 4.
pub(crate) fn channels_for(nodes: usize) -> usize {
    nodes.div_ceil(100).max(4)
}

fn measure(nodes: usize, args: &Args, how: How) -> Result<Point> {
    let rt = runtime()?;
    let servers = Servers::start(how)?;
    let server = &servers.dialed;
    let total_allocs = nodes * args.allocs_per_node;
    let cfg = FleetConfig {
        nodes,
        node_cpu: args.allocs_per_node as u64 * TASK_CPU,
        plugin_nodes: 1,
        unpublish: true,
        channels: channels_for(nodes),
    };
    let setup_done = std::sync::atomic::AtomicBool::new(false);
    let (setup, aside) = std::thread::scope(|scope| {
        let aside = probe_aside(scope, server, &setup_done);
        let setup = set_up(&rt, server, &cfg, nodes, total_allocs);
        setup_done.store(true, std::sync::atomic::Ordering::SeqCst);
        (setup, aside.join())
    });
    let setup_aside = aside.map_err(|_| anyhow::anyhow!("the probe panicked"))??;
    let Setup {
        fleet,
        started: setup_started,
        ended: setup_ended,
        register,
        place,
        volumes,
        tasks_before_volumes,
        tasks_after_volumes,
    } = setup?;

    // Steady: heartbeats go on; probe the baseline meanwhile.
    let cpu_before = server.cpu_time()?;
    let steady_started = Instant::now();
    let window = Duration::from_secs(args.duration);
    let baseline = rt.block_on(probe(server, window))?;
    let steady_ended = Instant::now();
    let cpu = server.cpu_time()?.saturating_sub(cpu_before);
    let cpu_share = cpu.as_secs_f64() / steady_ended.duration_since(steady_started).as_secs_f64();
    let tasks_idle = server.metric("berth_runtime_alive_tasks")?;
    let rss_kib = server.rss_kib()?;
    let down = server.metric("berth_nodes{status=\"down\"}").unwrap_or(0.0);

    let setup_heartbeats = fleet.stats.heartbeats_between(setup_started, setup_ended);
    let steady_heartbeats = fleet.stats.heartbeats_between(steady_started, steady_ended);
    let reopened = fleet.stats.reopened.read();
    let retried = fleet.stats.retried.read();
    fleet.stats.check()?;
    drop(fleet);
    drop(servers);
    Ok(Point {
        nodes,
        setup_heartbeats,
        setup_aside,
        steady_heartbeats,
        baseline,
        rss_kib,
        cpu_share,
        tasks_before_volumes,
        tasks_after_volumes,
        tasks_idle,
        register,
        place,
        volumes,
        down,
        reopened,
        retried,
    })
}

/// What the set-up made and how long each part took.
struct Setup {
    fleet: Fleet,
    started: Instant,
    ended: Instant,
    register: Duration,
    place: Duration,
    volumes: Duration,
    tasks_before_volumes: f64,
    tasks_after_volumes: f64,
}

/// Registers the fleet (all at once), places and runs its allocs, and
/// registers its volumes.
fn set_up(
    rt: &tokio::runtime::Runtime,
    server: &ServerAgent,
    cfg: &FleetConfig,
    nodes: usize,
    total_allocs: usize,
) -> Result<Setup> {
    let started = Instant::now();
    let fleet = rt.block_on(Fleet::start(server, cfg))?;
    let register = fleet.registration;

    // The allocs, through the API, one job after another.
    let placing = Instant::now();
    let jobs = total_allocs.div_ceil(JOB_ALLOCS);
    server.parallel(jobs, 1, |s, j| {
        let count = JOB_ALLOCS.min(total_allocs - j * JOB_ALLOCS);
        let job = sim::job(&format!("scale-{j}"), count as u32, None);
        s.put("/v1/jobs", &serde_json::json!({ "job": job }))?;
        Ok(())
    })?;
    let stats = fleet.stats.clone();
    rt.block_on(sim::wait_until(
        "every alloc reported running",
        Duration::from_secs(1800),
        // A failed RPC leaves its allocs pending: it fails the run at once.
        || {
            stats.running.load(std::sync::atomic::Ordering::Relaxed) >= total_allocs
                || stats.failures(0).1 > 0
        },
        || {
            format!(
                "{} of {total_allocs} running",
                stats.running.load(std::sync::atomic::Ordering::Relaxed)
            )
        },
    ))?;
    let place = placing.elapsed();
    fleet.stats.check()?;

    let tasks_before_volumes = server.metric("berth_runtime_alive_tasks")?;
    let registering = Instant::now();
    server.parallel(nodes, 4, |s, i| s.register_volume(&format!("vol-{i}")))?;
    let volumes = registering.elapsed();
    // Let the writes' watchers settle before counting.
    std::thread::sleep(Duration::from_secs(1));
    let tasks_after_volumes = server.metric("berth_runtime_alive_tasks")?;
    let ended = Instant::now();
    Ok(Setup {
        fleet,
        started,
        ended,
        register,
        place,
        volumes,
        tasks_before_volumes,
        tasks_after_volumes,
    })
}

/// Round trips of a heartbeat the server refuses at once (a node it does
/// not know), every 50 ms for `window`.
async fn probe(server: &ServerAgent, window: Duration) -> Result<Samples> {
    let end = Instant::now() + window;
    probe_until(server, &|| Instant::now() >= end).await
}

/// [`probe`] on a thread and a runtime of its own, over a connection of
/// its own, until `done`: how the server answers a node while the fleet's
/// set-up storms on, free of the simulation's own load and of the
/// fleet's shared connections.
fn probe_aside<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    server: &'s ServerAgent,
    done: &'s std::sync::atomic::AtomicBool,
) -> std::thread::ScopedJoinHandle<'s, Result<Samples>> {
    scope.spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("the probe's runtime")?
            .block_on(probe_until(server, &|| {
                done.load(std::sync::atomic::Ordering::SeqCst)
            }))
    })
}

async fn probe_until(server: &ServerAgent, done: &dyn Fn() -> bool) -> Result<Samples> {
    let channel = sim::connect(server, 1).await?.remove(0);
    let mut client = NodeClient::new(channel);
    let mut samples = Samples::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while !done() {
        tick.tick().await;
        let started = Instant::now();
        let r = client
            .heartbeat(pb::HeartbeatRequest {
                node_id: "not-a-node".into(),
            })
            .await;
        let took = started.elapsed();
        if r.is_ok() {
            bail!("the server answered a heartbeat of a node it does not know");
        }
        samples.push(took);
    }
    Ok(samples)
}

/// 20 nodes, 3 s steady: every part of the path runs.
pub fn smoke() -> Result<()> {
    let args = Args {
        sizes: vec![20],
        duration: 3,
        allocs_per_node: 2,
        tls: true,
        through_follower: true,
    };
    let t = measure(20, &args, How::Tls)?;
    print_point(&t, ", mutual TLS on the agent protocol");
    if t.down > 0.0 || t.steady_heartbeats.is_empty() {
        bail!(
            "with TLS: {} nodes down, {} steady heartbeats",
            t.down,
            t.steady_heartbeats.len()
        );
    }
    let p = measure(20, &args, How::Plain)?;
    print_point(&p, "");
    let f = measure(20, &args, How::ThroughFollower)?;
    print_point(&f, ", through a follower on etcd");
    if f.down > 0.0 || f.steady_heartbeats.is_empty() {
        bail!(
            "through a follower: {} nodes down, {} steady heartbeats",
            f.down,
            f.steady_heartbeats.len()
        );
    }
    if p.down > 0.0 {
        bail!("{} simulated nodes were marked down", p.down);
    }
    if p.steady_heartbeats.is_empty() && p.setup_heartbeats.is_empty() {
        bail!("no heartbeat was measured");
    }
    if p.tasks_after_volumes > p.tasks_before_volumes + 2.0 {
        bail!(
            "registering 20 volumes left {} more tasks alive",
            p.tasks_after_volumes - p.tasks_before_volumes
        );
    }
    Ok(())
}
