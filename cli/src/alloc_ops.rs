//! `berth alloc stop | restart | signal`. A stop goes to the servers (the
//! alloc is stopped through its client and replaced where the job still
//! wants it); a restart or a signal is a node-local route of the alloc's
//! client, which any agent forwards there.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};

use super::output::OutputArgs;
use super::{enc, Ctx};
use berth_api::ApiClient;

/// How long `alloc stop` waits for the client to stop the alloc.
const STOP_WAIT: Duration = Duration::from_secs(5 * 60);
/// One blocking query's wait while `alloc stop` waits (below the CLI's
/// read timeout).
const POLL_WAIT: &str = "20s";
/// How long a stopped alloc's replacement is waited for: one that needs
/// the stopped alloc's volume claim is placed only once the claim is free.
const REPLACEMENT_WAIT: Duration = Duration::from_secs(15);

#[derive(Args, Debug)]
pub struct StopArgs {
    /// Return once the stop is accepted, without waiting for the client
    #[arg(long)]
    pub detach: bool,
    #[command(flatten)]
    pub output: OutputArgs,
    /// The alloc's ID (or a unique prefix)
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
}

#[derive(Args, Debug)]
pub struct RestartArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// The alloc's ID (or a unique prefix)
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
    /// The task to restart (default: every running task)
    #[arg(value_name = "TASK")]
    pub task: Option<String>,
}

#[derive(Args, Debug)]
pub struct SignalArgs {
    /// The signal to send: a name (SIGHUP, HUP) or a number
    #[arg(short = 's', value_name = "SIG", default_value = "SIGKILL")]
    pub signal: String,
    #[command(flatten)]
    pub output: OutputArgs,
    /// The alloc's ID (or a unique prefix)
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
    /// The task to signal (default: every running task)
    #[arg(value_name = "TASK")]
    pub task: Option<String>,
}

/// Whether the client is done with the alloc.
fn stopped(alloc: &Value) -> bool {
    matches!(
        alloc["client_status"].as_str(),
        Some("complete" | "failed" | "lost")
    )
}

/// Waits, with blocking queries, until the client reports alloc `id`
/// stopped; the alloc then.
fn wait_stopped(api: &ApiClient, id: &str) -> Result<Value> {
    let started = Instant::now();
    let mut index = 0u64;
    loop {
        let path = format!("/v1/allocation/{}?index={index}&wait={POLL_WAIT}", enc(id));
        let (alloc, at) = api.get_indexed(&path)?;
        if stopped(&alloc) {
            return Ok(alloc);
        }
        if started.elapsed() >= STOP_WAIT {
            bail!(
                "alloc {id} did not stop within {}: its client status is {} (alloc stop -detach does not wait)",
                humantime::format_duration(STOP_WAIT),
                alloc["client_status"].as_str().unwrap_or("unknown")
            );
        }
        if at <= index {
            // No newer index to block on: do not spin.
            std::thread::sleep(Duration::from_millis(250));
        }
        index = at.max(index);
    }
}

/// The alloc placed in place of the stopped `alloc` (same name, placed
/// later), waited for up to [`REPLACEMENT_WAIT`] while its job runs.
fn wait_replacement(api: &ApiClient, alloc: &Value) -> Result<Option<String>> {
    let job = alloc["job_id"].as_str().unwrap_or_default();
    if api.get(&format!("/v1/job/{}", enc(job)))?["stop"] == true {
        return Ok(None);
    }
    let created = alloc["create_index"].as_u64().unwrap_or(0);
    let started = Instant::now();
    let mut index = 0u64;
    loop {
        let (allocs, at) = api.get_indexed(&format!(
            "/v1/job/{}/allocations?index={index}&wait=5s",
            enc(job)
        ))?;
        let replacement = allocs.as_array().into_iter().flatten().find(|a| {
            a["name"] == alloc["name"]
                && a["id"] != alloc["id"]
                && a["desired_status"] == "run"
                && a["create_index"].as_u64().unwrap_or(0) > created
        });
        if let Some(r) = replacement {
            return Ok(r["id"].as_str().map(str::to_string));
        }
        if started.elapsed() >= REPLACEMENT_WAIT {
            return Ok(None);
        }
        if at <= index {
            std::thread::sleep(Duration::from_millis(250));
        }
        index = at.max(index);
    }
}

fn replacement_line(answer: &Value) -> String {
    match answer["replacement"].as_str() {
        Some(r) => format!("Replacement: {r}"),
        None => "Replacement: none placed (yet)".to_string(),
    }
}

pub fn stop(args: StopArgs, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    let mut answer = api.post(
        &format!("/v1/allocation/{}/stop", enc(&args.alloc)),
        &json!({}),
    )?;
    let id = answer["alloc_id"]
        .as_str()
        .unwrap_or(&args.alloc)
        .to_string();
    if answer["already_stopped"] == true {
        // Nothing was stopped, so no replacement comes of it: no wait.
        return args.output.emit(&answer, |_| {
            println!("Alloc {id} is already stopped");
            Ok(())
        });
    }
    if args.detach {
        return args.output.emit(&answer, |a| {
            println!("Alloc {id} is stopping");
            println!("{}", replacement_line(a));
            Ok(())
        });
    }
    let alloc = wait_stopped(api, &id)?;
    if answer["replacement"].is_null() {
        if let Some(r) = wait_replacement(api, &alloc)? {
            answer["replacement"] = Value::String(r);
        }
    }
    answer["alloc"] = alloc;
    args.output.emit(&answer, |a| {
        let alloc = &a["alloc"];
        let status = alloc["client_status"].as_str().unwrap_or("unknown");
        println!("Alloc {id} stopped: client status {status}");
        if let Some(d) = alloc["client_description"]
            .as_str()
            .filter(|d| !d.is_empty())
        {
            println!("Description: {d}");
        }
        println!("{}", replacement_line(a));
        Ok(())
    })
}

/// The tasks an answer names, for people.
fn tasks_of(answer: &Value) -> String {
    let tasks: Vec<&str> = answer["tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let noun = if tasks.len() == 1 { "task" } else { "tasks" };
    format!("{noun} {}", tasks.join(", "))
}

pub fn restart(args: RestartArgs, ctx: &Ctx) -> Result<i32> {
    let answer = ctx.api().post(
        &format!("/v1/client/allocation/{}/restart", enc(&args.alloc)),
        &json!({ "task": args.task }),
    )?;
    args.output.emit(&answer, |a| {
        println!(
            "Restarted {} of alloc {}",
            tasks_of(a),
            a["alloc_id"].as_str().unwrap_or(&args.alloc)
        );
        Ok(())
    })
}

pub fn signal(args: SignalArgs, ctx: &Ctx) -> Result<i32> {
    let answer = ctx.api().post(
        &format!("/v1/client/allocation/{}/signal", enc(&args.alloc)),
        &json!({ "signal": args.signal, "task": args.task }),
    )?;
    args.output.emit(&answer, |a| {
        println!(
            "Sent {} to {} of alloc {}",
            a["signal"].as_str().unwrap_or(&args.signal),
            tasks_of(a),
            a["alloc_id"].as_str().unwrap_or(&args.alloc)
        );
        Ok(())
    })
}
