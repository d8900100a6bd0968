//! `berth job run|plan|inspect|stop|status`.
//!
//! Exit codes: `job run` 0 when every alloc of the submitted version runs
//! (a batch job: completed), 1 when one failed (or on any error), 2 when
//! placements could not be made (Nomad's); `job plan` 0 when registering
//! would create or stop no alloc, 1 when it would, 255 on error (Nomad's).
//! Job IDs may be given as a unique prefix (the servers resolve it).

use std::collections::{BTreeMap, HashMap};

use crate::deployment::Halt;
use anyhow::{anyhow, Result};
use berth_structs::text::count as plural;
use berth_structs::JobType;
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::errors::{one_line, UsageError};
use super::output::{self, joined, short_id, OutputArgs};
use super::{enc, print_json, read_spec, strs, usage_error, Ctx};
use berth_api::types::JobRegisterResponse;
use berth_api::ApiClient;

mod history;
mod plan;
mod scale;
mod status;
mod stop_waits;
mod validate;

use plan::job_plan;
pub use plan::plan_text;
use status::{alloc_table, job_status};

#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Submit a job and follow its allocs until they run (batch: finish)
    Run(RunArgs),
    /// Show what submitting a job would change, place and stop, without
    /// submitting it
    Plan(PlanArgs),
    /// Print a job as the servers store it (JSON)
    Inspect(InspectArgs),
    /// Stop a job and wait until its allocs have stopped
    Stop(StopArgs),
    /// Show jobs, or one job: its summary and its allocs
    Status(StatusArgs),
    /// Set a group's count; the running allocs stay as they are
    Scale(scale::ScaleArgs),
    /// List a job's kept versions (`-p`: what each changed)
    History(history::HistoryArgs),
    /// Run a kept version of a job again, as a new version
    Revert(history::RevertArgs),
    /// Check a job file as `job run` would, without a server
    Validate(validate::ValidateArgs),
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Return once the job is submitted; do not follow its allocs
    #[arg(long)]
    pub detach: bool,
    /// Set a variable the job file declares (repeatable)
    #[arg(long = "var", value_name = "NAME=VALUE")]
    pub vars: Vec<String>,
    /// Submit only if the job's modify index is still this one (as `job
    /// plan` printed it; 0: only if the job does not exist yet)
    #[arg(long, value_name = "INDEX")]
    pub check_index: Option<u64>,
    /// Print the job as JSON, as it would be submitted, and submit nothing
    #[arg(long)]
    pub output: bool,
    /// The job file (HCL)
    #[arg(value_name = "FILE")]
    pub file: String,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Set a variable the job file declares (repeatable)
    #[arg(long = "var", value_name = "NAME=VALUE")]
    pub vars: Vec<String>,
    /// Print the API's answer as JSON
    #[arg(long)]
    pub json: bool,
    /// Show full IDs and every field of the diff
    #[arg(long)]
    pub verbose: bool,
    /// The job file (HCL)
    #[arg(value_name = "FILE")]
    pub file: String,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    // Inspect prints the job's JSON: -json is the same as no flag, -t
    // formats it with a template.
    #[command(flatten)]
    pub output: OutputArgs,
    /// The job as a kept version stored it (`job history` lists them)
    #[arg(long, value_name = "N")]
    pub version: Option<u64>,
    /// The job's ID, or a unique prefix of it
    #[arg(value_name = "JOB")]
    pub job: String,
}

#[derive(Args, Debug)]
pub struct StopArgs {
    /// Also remove the job from the servers' state once its allocs are done
    #[arg(long)]
    pub purge: bool,
    /// Return at once; do not wait for the allocs to stop
    #[arg(long)]
    pub detach: bool,
    /// The job's ID, or a unique prefix of it
    #[arg(value_name = "JOB")]
    pub job: String,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// Show the allocs of every version of the job, not only the latest
    #[arg(long)]
    pub all_allocs: bool,
    /// Show full IDs and more details
    #[arg(long)]
    pub verbose: bool,
    /// The job's ID, or a unique prefix of it (none: every job)
    #[arg(value_name = "JOB")]
    pub job: Option<String>,
}

pub fn run(cmd: JobCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        JobCommand::Run(a) => job_run(a, ctx.api()),
        JobCommand::Plan(a) => job_plan(a, ctx.api()),
        JobCommand::Inspect(a) => job_inspect(a, ctx.api()),
        JobCommand::Stop(a) => job_stop(a, ctx.api()),
        JobCommand::Status(a) => job_status(a, ctx.api()),
        JobCommand::Scale(a) => scale::job_scale(a, ctx.api()),
        JobCommand::History(a) => history::job_history(a, ctx.api()),
        JobCommand::Revert(a) => history::job_revert(a, ctx.api()),
        JobCommand::Validate(a) => validate::job_validate(a),
    }
}

/// `-var NAME=VALUE` flags as pairs; one without `=` is a usage error.
fn parse_vars(command: &str, vars: &[String]) -> Result<Vec<(String, String)>> {
    vars.iter()
        .map(|v| match v.split_once('=') {
            Some((name, value)) if !name.is_empty() => Ok((name.to_string(), value.to_string())),
            _ => Err(usage_error(
                &["job", command],
                format!("-var {v:?}: want -var NAME=VALUE"),
            )),
        })
        .collect()
}

/// Reads, parses (with the variables) and checks a job file.
fn load_job(command: &str, path: &str, vars: &[String]) -> Result<berth_structs::Job> {
    let vars = parse_vars(command, vars)?;
    let src = read_spec("job file", path)?;
    let job = berth_structs::spec::parse_job_with_variables(&src, &vars)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    job.validate().map_err(|e| anyhow!("{path}: {e}"))?;
    Ok(job)
}

fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

fn n(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or_default()
}

fn now_ms() -> i64 {
    berth_structs::now_ms()
}

/// Node names by ID (a node without a name shows its short ID).
fn node_names(api: &ApiClient) -> Result<HashMap<String, String>> {
    let nodes = api.get("/v1/nodes")?;
    Ok(nodes
        .as_array()
        .into_iter()
        .flatten()
        .map(|node| {
            let id = s(node, "id").to_string();
            let name = match s(node, "name") {
                "" => short_id(&id).to_string(),
                name => name.to_string(),
            };
            (id, name)
        })
        .collect())
}

fn node_name<'a>(names: &'a HashMap<String, String>, id: &'a str) -> &'a str {
    names.get(id).map_or_else(|| short_id(id), String::as_str)
}

/// Rows (the first the header) in columns, one line each.
fn table(rows: &[Vec<String>]) -> String {
    joined(output::table(rows))
}

// ---- job run ----------------------------------------------------------

fn job_run(a: RunArgs, api: &ApiClient) -> Result<i32> {
    let path = a.file.clone();
    let job = load_job("run", &path, &a.vars)?;
    if a.output {
        return print_json(&json!({ "job": job }));
    }
    let resp = api.register_job(&job, a.check_index)?;
    let (version, changed) = (resp.version, resp.changed);
    if changed {
        println!(
            "==> Job {:?} submitted: version {version}, job modify index {}",
            job.id, resp.job_modify_index
        );
    }
    let failures = resp.placement_failures.clone();
    if !changed && failures.is_empty() {
        println!("==> Job {:?} is unchanged: nothing new to place", job.id);
        return Ok(0);
    }
    let names = node_names(api)?;
    let (allocs, index) = api.get_indexed(&format!("/v1/job/{}/allocations", enc(&job.id)))?;
    let mine = allocs_of_version(&allocs, version);
    // Allocs made before this submission took it in place.
    let (mine, kept): (Vec<Value>, Vec<Value>) = mine
        .into_iter()
        .partition(|al| n(al, "create_index") >= resp.job_modify_index);
    if changed && !kept.is_empty() {
        println!(
            "==> Updated in place: {}, running on",
            plural(kept.len() as u64, "alloc", "allocs")
        );
    }
    if !mine.is_empty() {
        /// At most this many placements are named.
        const SHOWN: usize = 8;
        let mut placed: Vec<String> = mine
            .iter()
            .take(SHOWN)
            .map(|al| {
                format!(
                    "{} on {}",
                    s(al, "name"),
                    node_name(&names, s(al, "node_id"))
                )
            })
            .collect();
        if mine.len() > SHOWN {
            placed.push(format!("and {} more", mine.len() - SHOWN));
        }
        println!(
            "==> Placed {}: {}",
            plural(mine.len() as u64, "alloc", "allocs"),
            placed.join(", ")
        );
        for line in crate::reschedule::waiting_lines(&mine) {
            println!("==> {line}");
        }
    }
    if !failures.is_empty() {
        println!("==> Placement failures (the job waits until they clear):");
        for f in &failures {
            println!("    {f}");
        }
    }
    let outcome = placement_outcome(&resp);
    if let Some(o) = &outcome {
        println!("==> {o}");
    }
    if a.detach {
        return Ok(0);
    }
    let code = follow_run(
        api,
        &job.id,
        job.job_type,
        version,
        &names,
        !failures.is_empty(),
        (allocs, index),
    )?;
    Ok(code)
}

/// How many of the job's allocs were placed, when some were not.
fn placement_outcome(resp: &JobRegisterResponse) -> Option<String> {
    let (desired, unplaced) = (resp.desired_allocs, resp.unplaced_allocs);
    if unplaced == 0 {
        return None;
    }
    let placed = desired.saturating_sub(unplaced);
    Some(if placed > 0 {
        format!(
            "{placed} of {} placed; the job runs with them and waits for capacity for the rest",
            plural(desired, "alloc", "allocs")
        )
    } else {
        format!(
            "0 of {} placed; the job waits until they can be placed",
            plural(desired, "alloc", "allocs")
        )
    })
}

/// The allocs of `version` the servers want running, by create index.
fn allocs_of_version(allocs: &Value, version: u64) -> Vec<Value> {
    let mut out: Vec<Value> = allocs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|al| al["job"]["version"].as_u64() == Some(version))
        .filter(|al| s(al, "desired_status") == "run")
        .cloned()
        .collect();
    out.sort_by_key(|al| (n(al, "create_index"), s(al, "name").to_string()));
    out
}

/// Why an alloc failed: its failed tasks' last events, or what its client
/// said.
fn failure_reason(al: &Value) -> String {
    let mut reasons = Vec::new();
    if let Some(states) = al["task_states"].as_object() {
        for (task, st) in states {
            if st["failed"].as_bool() != Some(true) {
                continue;
            }
            let events = st["events"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            let why: Vec<String> = events
                .iter()
                .rev()
                .filter(|e| !s(e, "message").is_empty())
                .take(2)
                .map(|e| format!("{}: {}", s(e, "type"), s(e, "message")))
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            if why.is_empty() {
                reasons.push(format!("task {task:?} failed"));
            } else {
                reasons.push(format!("task {task:?}: {}", why.join("; ")));
            }
        }
    }
    if reasons.is_empty() {
        match s(al, "client_description") {
            "" => "no reason given".to_string(),
            d => d.to_string(),
        }
    } else {
        reasons.join("; ")
    }
}

/// One line per alloc whose client status moved since `seen`.
fn print_transitions(
    allocs: &[Value],
    seen: &mut BTreeMap<String, String>,
    names: &HashMap<String, String>,
) {
    let mut allocs: Vec<&Value> = allocs.iter().collect();
    allocs.sort_by_key(|al| (s(al, "name"), n(al, "create_index")));
    for al in allocs {
        let id = s(al, "id").to_string();
        let status = s(al, "client_status").to_string();
        let before = seen.insert(id.clone(), status.clone());
        let from = match before {
            Some(b) if b == status => continue,
            Some(b) => b,
            None if status == "pending" => continue,
            None => "pending".to_string(),
        };
        let mut line = format!(
            "    Alloc {} {} on {}: {from} -> {status}",
            short_id(&id),
            s(al, "name"),
            node_name(names, s(al, "node_id"))
        );
        if status == "failed" || status == "lost" {
            line.push_str(&format!(": {}", failure_reason(al)));
        }
        println!("{line}");
    }
}

/// Follows the allocs of `version` through blocking queries, printing
/// each transition, until they all run (a batch job: finish). `first` is
/// the job's allocs as already read, with the index they reflect: they are
/// looked at first, and the blocking queries wait for changes after them.
/// 0 when they did, 1 when one failed, 2 when some could not be placed.
fn follow_run(
    api: &ApiClient,
    job_id: &str,
    job_type: JobType,
    version: u64,
    names: &HashMap<String, String>,
    blocked: bool,
    first: (Value, u64),
) -> Result<i32> {
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut names = names.clone();
    let mut next = Some(first);
    let mut index = 0;
    loop {
        let (allocs, at) = match next.take() {
            Some(read) => read,
            None => api.get_indexed(&format!(
                "/v1/job/{}/allocations?index={index}&wait=10s",
                enc(job_id)
            ))?,
        };
        index = at;
        let mine = allocs_of_version(&allocs, version);
        if mine.iter().any(|al| !names.contains_key(s(al, "node_id"))) {
            names = node_names(api)?;
        }
        print_transitions(&mine, &mut seen, &names);
        // Only a service job's versions roll out in deployments.
        let halt = match job_type {
            JobType::Service => crate::deployment::halt_of_version(api, job_id, version)?,
            JobType::Batch | JobType::System => None,
        };
        match halt {
            Some(Halt::Failed(why)) => {
                println!("==> Job {job_id:?}: {why}");
                return Ok(1);
            }
            Some(Halt::NeedsPromotion(what)) => {
                println!("==> Job {job_id:?}: {what}");
                return Ok(0);
            }
            None => {}
        }
        if mine.is_empty() {
            if blocked {
                return Ok(2);
            }
            println!("==> Job {job_id:?}: no allocs to wait for");
            return Ok(0);
        }
        let count = |st: &str| {
            mine.iter()
                .filter(|al| s(al, "client_status") == st)
                .count() as u64
        };
        let (pending, running, complete) = (count("pending"), count("running"), count("complete"));
        let (failed, lost) = (count("failed"), count("lost"));
        let done = match job_type {
            JobType::Batch => pending + running == 0,
            JobType::Service | JobType::System => pending == 0,
        };
        // A rolling update is done once no alloc of an older version is
        // left to replace (a failure ends it sooner).
        let to_replace = older_serving(&allocs, version);
        if !done || (to_replace > 0 && count("failed") + count("lost") == 0) {
            continue;
        }
        let total = mine.len() as u64;
        if failed + lost > 0 {
            println!(
                "==> Job {job_id:?} failed: {} of {total} failed{}",
                plural(failed, "alloc", "allocs"),
                if lost > 0 {
                    format!(", {lost} lost")
                } else {
                    String::new()
                }
            );
            return Ok(1);
        }
        let state = match job_type {
            JobType::Batch => format!("{} complete", plural(complete, "alloc", "allocs")),
            _ => format!("{} running", plural(running, "alloc", "allocs")),
        };
        if blocked {
            println!("==> Job {job_id:?}: the allocs placed are done ({state}); the rest wait for placement");
            return Ok(2);
        }
        println!("==> Job {job_id:?} is done: {state}");
        return Ok(0);
    }
}

/// The allocs of versions before `version` that still serve (the
/// servers want them running): those a rolling update has yet to
/// replace.
fn older_serving(allocs: &Value, version: u64) -> usize {
    allocs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|al| {
            al["job"]["version"].as_u64().unwrap_or(0) < version
                && s(al, "desired_status") == "run"
                && matches!(s(al, "client_status"), "pending" | "running")
        })
        .count()
}

// ---- job inspect ------------------------------------------------------

/// The stored job, without what the API adds to it.
fn stored_job(api: &ApiClient, id: &str) -> Result<Value> {
    let mut job = api.get(&format!("/v1/job/{}", enc(id)))?;
    if let Value::Object(m) = &mut job {
        m.remove("placement_failures");
    }
    Ok(job)
}

fn job_inspect(a: InspectArgs, api: &ApiClient) -> Result<i32> {
    let job = match a.version {
        None => stored_job(api, &a.job)?,
        Some(n) => history::versions(api, &a.job)?
            .into_iter()
            .find(|v| v["version"].as_u64() == Some(n))
            .map(|v| v["job"].clone())
            .ok_or_else(|| anyhow::anyhow!("job {:?} has no version {n} kept", a.job))?,
    };
    let output = OutputArgs {
        json: a.output.template.is_none(),
        template: a.output.template,
    };
    output.emit(&job, |_| Ok(()))
}

// ---- job stop ---------------------------------------------------------

/// Whether an alloc has stopped for good: terminal on its client, or
/// stopped by the servers before its client started it and the job is
/// dead (nothing of it runs).
fn stopped(al: &Value, job_dead: bool) -> bool {
    matches!(s(al, "client_status"), "complete" | "failed" | "lost")
        || (job_dead && s(al, "desired_status") != "run" && s(al, "client_status") == "pending")
}

fn is_not_found(e: &berth_api::Error) -> bool {
    e.api().is_some_and(|a| a.status == 404)
}

fn job_stop(a: StopArgs, api: &ApiClient) -> Result<i32> {
    let announce = |id: &str, index: &Value| {
        println!(
            "==> Job {id:?} {} (index {})",
            if a.purge {
                "stopped; it is purged once its allocs are done"
            } else {
                "stopped"
            },
            index.as_u64().unwrap_or_default()
        )
    };
    let stop_path = |id: &str| {
        if a.purge {
            format!("/v1/job/{}?purge=true", enc(id))
        } else {
            format!("/v1/job/{}", enc(id))
        }
    };
    if a.detach {
        // Nothing to follow: the stop goes out at once (the servers
        // resolve a prefix themselves), without reads before it.
        let index = api.delete(&stop_path(&a.job))?;
        announce(&a.job, &index);
        return Ok(0);
    }
    // Resolve a prefix once: the follow-up queries name the job exactly.
    let id = s(&api.get(&format!("/v1/job/{}", enc(&a.job)))?, "id").to_string();
    // What runs before the stop: each is followed until it has stopped.
    let before = api.get(&format!("/v1/job/{}/allocations", enc(&id)))?;
    let before = before.as_array().map(Vec::as_slice).unwrap_or(&[]);
    let live_at_stop = before.iter().filter(|al| !stopped(al, false)).count() as u64;
    let index = api.delete(&stop_path(&id))?;
    announce(&id, &index);
    let names = node_names(api)?;
    let mut seen: BTreeMap<String, String> = before
        .iter()
        .map(|al| (s(al, "id").to_string(), s(al, "client_status").to_string()))
        .collect();
    let mut at = 0;
    let mut waits = BTreeMap::new();
    let mut last: Vec<Value> = Vec::new();
    // Whether `last` shows every alloc stopped (a purge may take the job
    // away before an answer says so).
    let mut settled = false;
    loop {
        let (allocs, next) = match api.get_indexed(&format!(
            "/v1/job/{}/allocations?index={at}&wait=10s",
            enc(&id)
        )) {
            Ok(r) => r,
            // Purged (or collected): it and its allocs are gone, so done.
            Err(e) if is_not_found(&e) => break,
            Err(e) => return Err(e.into()),
        };
        at = next;
        // The allocs it had when it was stopped; a later run's are not
        // waited for.
        let allocs: Vec<Value> = allocs
            .as_array()
            .into_iter()
            .flatten()
            .filter(|al| seen.contains_key(s(al, "id")))
            .cloned()
            .collect();
        print_transitions(&allocs, &mut seen, &names);
        stop_waits::print_volume_waits(api, &allocs, &names, &mut waits)?;
        let dead = match api.get(&format!("/v1/job/{}", enc(&id))) {
            Ok(job) if job["stop"].as_bool() == Some(false) => {
                println!("==> Job {id:?} was submitted again: not waiting for its old allocs");
                return Ok(0);
            }
            Ok(job) => s(&job, "status") == "dead",
            Err(e) if is_not_found(&e) => true,
            Err(e) => return Err(e.into()),
        };
        last = allocs;
        if last.iter().all(|al| stopped(al, dead)) {
            settled = true;
            break;
        }
    }
    if a.purge {
        // The servers remove it once no volume claim holds its allocs.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match api.get(&format!("/v1/job/{}", enc(&id))) {
                Err(e) if is_not_found(&e) => break,
                Err(e) => return Err(e.into()),
                Ok(_) if std::time::Instant::now() >= deadline => {
                    println!(
                        "==> Job {id:?} is not purged yet: a volume claim still holds one of its allocs"
                    );
                    return Ok(1);
                }
                Ok(_) => {
                    let _ = api.get_indexed(&format!(
                        "/v1/job/{}/allocations?index={at}&wait=5s",
                        enc(&id)
                    ));
                }
            }
        }
    }
    let stopped_count = live_at_stop;
    println!(
        "==> Job {id:?}: {} stopped{}",
        plural(stopped_count, "alloc", "allocs"),
        if a.purge { "; the job is purged" } else { "" }
    );
    if settled && !last.is_empty() {
        last.sort_by_key(|al| std::cmp::Reverse(n(al, "create_index")));
        print!("\n{}", alloc_table(&last, &names, false, now_ms()));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent that answers one request with `body` and then no more;
    /// joining it gives the request head.
    fn one_request_agent(body: &str) -> (ApiClient, std::thread::JoinHandle<Vec<u8>>) {
        let (addr, server) = berth_testutil::one_answer_server(format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        ));
        (ApiClient::new(&addr).unwrap(), server)
    }

    #[test]
    fn the_job_list_is_one_request() {
        let (api, server) = one_request_agent(
            r#"[{"id":"web","type":"service","priority":50,"status":"running","modify_time_ms":1}]"#,
        );
        let args = StatusArgs {
            output: OutputArgs::default(),
            all_allocs: false,
            verbose: false,
            job: None,
        };
        assert_eq!(job_status(args, &api).unwrap(), 0);
        let head = server.join().unwrap();
        assert!(head.starts_with(b"GET /v1/jobs "), "{head:?}");
    }

    #[test]
    fn vars_need_a_name_and_an_equals_sign() {
        assert_eq!(
            parse_vars("run", &["a=b=c".into(), "e=".into()]).unwrap(),
            vec![("a".into(), "b=c".into()), ("e".into(), String::new())]
        );
        for bad in ["novalue", "=x"] {
            let e = parse_vars("run", &[bad.into()]).unwrap_err();
            assert!(e.downcast_ref::<UsageError>().is_some(), "{bad}: {e}");
        }
    }
}
