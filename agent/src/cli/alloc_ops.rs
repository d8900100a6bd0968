//! `berth alloc stop|restart|signal`: operations the servers forward to
//! the alloc's client.

use anyhow::{bail, Result};
use clap::Args;

use super::Ctx;

#[derive(Args, Debug)]
pub struct StopArgs {
    /// Return once the stop is accepted
    #[arg(long)]
    pub detach: bool,
    /// The alloc's ID
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
}

#[derive(Args, Debug)]
pub struct RestartArgs {
    /// The alloc's ID
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
    /// The task to restart (default: every task)
    #[arg(value_name = "TASK")]
    pub task: Option<String>,
}

#[derive(Args, Debug)]
pub struct SignalArgs {
    /// The signal to send (default SIGKILL)
    #[arg(short = 's', value_name = "SIG")]
    pub signal: Option<String>,
    /// The alloc's ID
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
    /// The task to signal (default: every task)
    #[arg(value_name = "TASK")]
    pub task: Option<String>,
}

pub fn stop(_args: StopArgs, _ctx: &Ctx) -> Result<i32> {
    bail!("berth alloc stop is not built yet")
}

pub fn restart(_args: RestartArgs, _ctx: &Ctx) -> Result<i32> {
    bail!("berth alloc restart is not built yet")
}

pub fn signal(_args: SignalArgs, _ctx: &Ctx) -> Result<i32> {
    bail!("berth alloc signal is not built yet")
}
