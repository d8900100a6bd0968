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
}

impl Fault {
    /// Every kind, for the report's counts.
    pub const KINDS: [&'static str; 6] = [
        "kill_client",
        "kill_server",
        "pause_server",
        "partition",
        "kill_plugin",
        "kill_executor",
    ];

    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillClient { .. } => "kill_client",
            Fault::KillServer { .. } => "kill_server",
            Fault::PauseServer { .. } => "pause_server",
            Fault::Partition { .. } => "partition",
            Fault::KillPlugin { .. } => "kill_plugin",
            Fault::KillExecutor { .. } => "kill_executor",
        }
    }

    /// The next fault of a run.
    pub fn pick(rng: &mut Rng, nodes: usize) -> Fault {
        let node = rng.below(nodes as u64) as usize;
        match rng.below(6) {
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
            _ => Fault::KillExecutor { node },
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
