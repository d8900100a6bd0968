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
    /// The plugin job rolled to a version whose instances fail or delay a
    /// CSI call (`--fail RPC=unavailable:COUNT` or `--delay RPC=MS`ms), a
    /// writer job stopped and run again under it, then the plugin rolled
    /// back.
    PluginRpc {
        rpc: &'static str,
        fail_count: Option<u64>,
        delay_ms: u64,
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
    pub const KINDS: [&'static str; 7] = [
        "kill_client",
        "kill_server",
        "pause_server",
        "partition",
        "kill_plugin",
        "kill_executor",
        "plugin_rpc",
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
        }
    }

    /// The next fault of a run.
    pub fn pick(rng: &mut Rng, nodes: usize) -> Fault {
        let node = rng.below(nodes as u64) as usize;
        match rng.below(7) {
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
            _ => Fault::PluginRpc {
                rpc: RPCS[rng.below(RPCS.len() as u64) as usize],
                fail_count: (rng.below(2) == 0).then(|| rng.between(1, 3)),
                delay_ms: rng.between(0, 2_000),
            },
        }
    }

    /// Does the fault; returns once it is over (the agent started again,
    /// the partition healed).
    pub fn apply(&self, world: &mut World, rng: &mut Rng) -> Result<String> {
        let sleep = |ms: u64| std::thread::sleep(Duration::from_millis(ms));
        Ok(match *self {
            Fault::KillClient { node, down_ms } => {
                let client = &mut world.clients[node];
                client.agent.kill()?;
                sleep(down_ms);
                client.agent.start_again()?;
                format!("client {} killed, down {down_ms} ms", client.name)
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
            } => {
                let mut args = vec![format!("--delay={rpc}={delay_ms}ms")];
                if let Some(n) = fail_count {
                    args.push(format!("--fail={rpc}=unavailable:{n}"));
                }
                world.roll_plugin(&args)?;
                let writers: Vec<String> = world.writers.keys().cloned().collect();
                let job = rng.pick(&writers).clone();
                world.server.cli(&["job", "stop", &job])?;
                world.accepted.remove(&job);
                world.run(&job, 0)?;
                sleep(rng.between(500, 3_000));
                world.roll_plugin(&[])?;
                format!(
                    "plugin rolled with {}, {job} stopped and run, rolled back",
                    args.join(" ")
                )
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
