//! `berth alloc`: the command group, and `alloc status`.

use anyhow::Result;
use clap::{Args, Subcommand};

use super::http_client::ApiClient;
use super::{alloc_logs, alloc_ops, enc, print_json, volume_stats, Ctx};

#[derive(Subcommand, Debug)]
pub enum AllocCommand {
    /// Show an allocation: its tasks, their events, its CSI volumes
    Status(StatusArgs),
    /// Print a task's logs
    Logs(alloc_logs::LogsArgs),
    /// Stop an allocation (it is placed again elsewhere)
    Stop(alloc_ops::StopArgs),
    /// Restart an allocation's tasks, or one task
    Restart(alloc_ops::RestartArgs),
    /// Send a signal to an allocation's tasks, or to one task
    Signal(alloc_ops::SignalArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// The alloc's ID
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
}

pub fn run(cmd: AllocCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        AllocCommand::Status(a) => alloc_status(a, ctx.api()),
        AllocCommand::Logs(a) => alloc_logs::run(a, ctx),
        AllocCommand::Stop(a) => alloc_ops::stop(a, ctx),
        AllocCommand::Restart(a) => alloc_ops::restart(a, ctx),
        AllocCommand::Signal(a) => alloc_ops::signal(a, ctx),
    }
}

fn alloc_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    let id = a.alloc;
    let v = api.get(&format!("/v1/allocation/{}", enc(&id)))?;
    if a.json {
        return print_json(&v);
    }
    println!("ID            = {}", v["id"].as_str().unwrap_or_default());
    println!("Name          = {}", v["name"].as_str().unwrap_or_default());
    println!(
        "Node ID       = {}",
        v["node_id"].as_str().unwrap_or_default()
    );
    println!(
        "Client Status = {}",
        v["client_status"].as_str().unwrap_or_default()
    );
    println!(
        "Desired       = {}",
        v["desired_status"].as_str().unwrap_or_default()
    );
    if let Some(states) = v["task_states"].as_object() {
        for (task, st) in states {
            println!(
                "\nTask {task:?} is {:?}{}",
                st["state"].as_str().unwrap_or_default(),
                if st["failed"].as_bool() == Some(true) {
                    " (failed)"
                } else {
                    ""
                }
            );
            for ev in st["events"].as_array().into_iter().flatten() {
                println!(
                    "  {:<24} {}",
                    ev["type"].as_str().unwrap_or_default(),
                    ev["message"].as_str().unwrap_or_default()
                );
            }
        }
    }
    let volumes = volume_stats::alloc_volume_lines(&v);
    if !volumes.is_empty() {
        println!("\nCSI Volumes");
        for line in volumes {
            println!("  {line}");
        }
    }
    Ok(0)
}
