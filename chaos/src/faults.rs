//! The faults a run injects, each chosen by the seeded generator: what it
//! is (a kind and its parameters, printed in the schedule) and how it is
//! done to the world.

use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::rng::Rng;
use crate::world::World;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL of client `node`'s agent, started again after `down_ms`.
    KillClient { node: usize, down_ms: u64 },
    /// SIGKILL of the server agent, started again after `down_ms`.
    KillServer { down_ms: u64 },
    /// SIGSTOP of the server agent, SIGCONT after `paused_ms`.
    PauseServer { paused_ms: u64 },
    /// Client `node`'s connection to the servers drops every byte, no
    /// connection closed, for `cut_ms`.
    Partition { node: usize, cut_ms: u64 },
    /// SIGKILL of the CSI plugin task on client `node`.
    KillPlugin { node: usize },
    /// SIGKILL of one task executor on client `node`.
    KillExecutor { node: usize },
    /// The plugin job rolled to a version whose instances fail, delay or
    /// hang a CSI call (`--fail RPC=unavailable:COUNT`, `--delay
    /// RPC=MS`ms, past the clients' 2 s call deadline at times, or
    /// `--hold-after RPC=FILE`: the call's work done, its answer held
    /// `hold_ms`), a writer job stopped and run again under it, then the
    /// plugin rolled back.
    PluginRpc {
        rpc: &'static str,
        fail_count: Option<u64>,
        delay_ms: u64,
        hold_ms: Option<u64>,
    },
    /// SIGKILL of client `node`'s agent; one record of its state
    /// database overwritten with bytes that do not decode; started again.
    CorruptRecord { node: usize },
    /// Client `node`'s data dir filled up for `full_ms`, while the
    /// workload changes once, and its agent killed and started again on
    /// the full disk when `restart`; then the space freed.
    FullDisk {
        node: usize,
        full_ms: u64,
        restart: bool,
    },
}

/// The CSI calls a volume's claim and release go through.
const RPCS: [&str; 4] = [
    "NodeStageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
];

impl Fault {
    /// Every kind, for the report's counts.
    pub const KINDS: [&'static str; 9] = [
        "kill_client",
        "kill_server",
        "pause_server",
        "partition",
        "kill_plugin",
        "kill_executor",
        "plugin_rpc",
        "corrupt_record",
        "full_disk",
    ];

    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillClient { .. } => "kill_client",
            Fault::KillServer { .. } => "kill_server",
            Fault::PauseServer { .. } => "pause_server",
            Fault::Partition { .. } => "partition",
            Fault::KillPlugin { .. } => "kill_plugin",
            Fault::KillExecutor { .. } => "kill_executor",
            Fault::PluginRpc { .. } => "plugin_rpc",
            Fault::CorruptRecord { .. } => "corrupt_record",
            Fault::FullDisk { .. } => "full_disk",
        }
    }

    /// The next fault of a run.
    pub fn pick(rng: &mut Rng, nodes: usize) -> Fault {
        let node = rng.below(nodes as u64) as usize;
        match rng.below(Self::KINDS.len() as u64) {
            0 => Fault::KillClient {
                node,
                down_ms: rng.between(0, 3_000),
            },
            1 => Fault::KillServer {
                down_ms: rng.between(0, 2_000),
            },
            2 => Fault::PauseServer {
                paused_ms: rng.between(500, 4_000),
            },
            // Within the writers' window and past it.
            3 => Fault::Partition {
                node,
                cut_ms: rng.between(1_000, 9_000),
            },
            4 => Fault::KillPlugin { node },
            5 => Fault::KillExecutor { node },
            6 => Fault::PluginRpc {
                rpc: RPCS[rng.below(RPCS.len() as u64) as usize],
                fail_count: (rng.below(2) == 0).then(|| rng.between(1, 3)),
                delay_ms: rng.between(0, 4_000),
                hold_ms: (rng.below(2) == 0).then(|| rng.between(500, 4_000)),
            },
            7 => Fault::CorruptRecord { node },
            _ => Fault::FullDisk {
                node,
                full_ms: rng.between(1_000, 8_000),
                restart: rng.below(2) == 0,
            },
        }
    }

    /// Does the fault; returns once it is over (the agent started again,
    /// the partition healed).
    pub fn apply(&self, world: &mut World, rng: &mut Rng) -> Result<String> {
        let sleep = |ms: u64| std::thread::sleep(Duration::from_millis(ms));
        Ok(match *self {
            Fault::KillClient { node, down_ms } => {
                world.clients[node].agent.kill()?;
                sleep(down_ms);
                world.start_client_again(node)?;
                format!(
                    "client {} killed, down {down_ms} ms",
                    world.clients[node].name
                )
            }
            Fault::KillServer { down_ms } => {
                world.server.agent.kill()?;
                sleep(down_ms);
                world.server.agent.start_again()?;
                world.server.wait_serving()?;
                format!("server killed, down {down_ms} ms")
            }
            Fault::PauseServer { paused_ms } => {
                let pid = world.server.agent.pid().context("the server runs")?;
                let pid = Pid::from_raw(pid as i32);
                kill(pid, Signal::SIGSTOP)?;
                sleep(paused_ms);
                kill(pid, Signal::SIGCONT)?;
                format!("server paused {paused_ms} ms")
            }
            Fault::Partition { node, cut_ms } => {
                let client = &world.clients[node];
                let relay = client.relay()?;
                relay.partition();
                sleep(cut_ms);
                relay.heal();
                format!("client {} cut off {cut_ms} ms", client.name)
            }
            Fault::KillPlugin { node } => {
                let client = &world.clients[node];
                let needle = format!("--node-id={}", node_id(world, node)?);
                let pids = berth_tests::processes_with_cmdline(&needle);
                kill_one(rng, &pids, "plugin", &client.name)
            }
            Fault::PluginRpc {
                rpc,
                fail_count,
                delay_ms,
                hold_ms,
            } => {
                let mut args = vec![format!("--delay={rpc}={delay_ms}ms")];
                if let Some(n) = fail_count {
                    args.push(format!("--fail={rpc}=unavailable:{n}"));
                }
                let release = world.hold_file();
                if hold_ms.is_some() {
                    args.push(format!("--hold-after={rpc}={}", release.display()));
                }
                world.roll_plugin(&args)?;
                let writers: Vec<String> = world.writers.keys().cloned().collect();
                let job = rng.pick(&writers).clone();
                world.server.cli(&["job", "stop", "-detach", &job])?;
                world.accepted.remove(&job);
                world.run(&job, 0)?;
                let held = hold_ms.unwrap_or(0);
                let after = rng.between(500, 3_000);
                sleep(held.min(after));
                std::fs::write(&release, b"")?;
                sleep(after.saturating_sub(held));
                world.roll_plugin(&[])?;
                format!(
                    "plugin rolled with {}, {job} stopped and run, rolled back",
                    args.join(" ")
                )
            }
            Fault::CorruptRecord { node } => {
                let agent = &mut world.clients[node].agent;
                agent.kill()?;
                let db = agent.data_path().join("client/state.redb");
                let what = crate::corrupt::corrupt_one(&db, rng);
                world.start_client_again(node)?;
                format!(
                    "client {} killed, {}, started again",
                    world.clients[node].name, what?
                )
            }
            Fault::FullDisk {
                node,
                full_ms,
                restart,
            } => {
                let fill = world.clients[node].agent.data_path().join("chaos-fill");
                let filled = fill_up(&fill);
                let mut what = vec![format!(
                    "client {} data dir full ({} MiB written)",
                    world.clients[node].name,
                    filled.as_ref().map_or(0, |b| b >> 20)
                )];
                if restart {
                    world.clients[node].agent.kill()?;
                    world.start_client_again(node)?;
                    what.push("its agent killed and started again".into());
                }
                what.push(world.churn(rng)?);
                sleep(full_ms);
                std::fs::remove_file(&fill)?;
                filled?;
                what.push(format!("space freed after {full_ms} ms"));
                what.join(", ")
            }
            Fault::KillExecutor { node } => {
                let client = &world.clients[node];
                let data = client.agent.data_path();
                // `berth-executor <state dir>`, or the agent's own
                // `berth executor <state dir>`.
                let needle = format!("executor {}", data.display());
                let pids = berth_tests::processes_with_cmdline(&needle);
                kill_one(rng, &pids, "executor", &client.name)
            }
        })
    }
}

/// Writes zeros to `path` until its filesystem is full; how many bytes.
fn fill_up(path: &std::path::Path) -> Result<u64> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    let chunk = vec![0u8; 1 << 20];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => break,
            Err(e) => return Err(e.into()),
        }
    }
    // What the page cache held is on the disk, so the space is taken.
    match f.sync_all() {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(written)
}

/// SIGKILL of one of `pids` (a `what` of node `node`); says which.
fn kill_one(rng: &mut Rng, pids: &[i32], what: &str, node: &str) -> String {
    if pids.is_empty() {
        return format!("no {what} runs on {node}");
    }
    let pid = *rng.pick(pids);
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    format!("{what} {pid} on {node} killed")
}

/// The node ID of client `node`, as the servers know it.
fn node_id(world: &World, node: usize) -> Result<String> {
    let n = world.server.node(&world.clients[node].name)?;
    Ok(n["id"].as_str().context("a node ID")?.to_string())
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
