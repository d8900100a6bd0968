//! `berth alloc logs`: a task's stdout or stderr.

use anyhow::{bail, Result};
use clap::Args;

use super::Ctx;

#[derive(Args, Debug)]
pub struct LogsArgs {
    /// Keep printing the log as the task writes it
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Print the task's stderr instead of its stdout
    #[arg(long)]
    pub stderr: bool,
    /// Print the end of the log (with -n: its last N lines)
    #[arg(long)]
    pub tail: bool,
    /// How many lines -tail prints
    #[arg(short = 'n', value_name = "N")]
    pub lines: Option<u64>,
    /// The alloc's ID
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
    /// The task (default: the alloc's only task)
    #[arg(value_name = "TASK")]
    pub task: Option<String>,
}

pub fn run(_args: LogsArgs, _ctx: &Ctx) -> Result<i32> {
    bail!("berth alloc logs is not built yet")
}
