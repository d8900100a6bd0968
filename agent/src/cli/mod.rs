//! The command line: Nomad-shaped commands and single-dash flags. Every
//! command but `agent` and `config validate` is a client of the HTTP API.

pub mod errors;
pub mod http_client;
mod node;
mod snapshot;
mod volume_stats;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use errors::UsageError;
use http_client::{ApiClient, DEFAULT_ADDR};

const USAGE: &str = "\
Usage: berth <command> [args]

Commands:
  agent -dev [-data-dir DIR] [-http-addr ADDR]   run a dev agent (server and client)
  agent [-config PATH]... [-server] [-client]     run a server and/or client agent (see berth agent -h)
  config validate PATH...                         check agent config files (merged in order, as one agent's)
  job run [-detach] FILE                          submit a job and wait for its allocs
  job stop JOB                                    stop a job
  job status [-json] [-all-allocs] [JOB]          show jobs (the latest version's allocs, newest first)
  alloc status [-json] ALLOC                      show an allocation
  node status [-json] [NODE]                      show nodes
  node drain -enable [-deadline D] [-force] [-detach] NODE
                                                  move a node's allocs elsewhere (see berth node drain -h)
  node drain -disable NODE                        stop draining a node (it stays ineligible)
  node eligibility -enable|-disable NODE          allow or forbid new allocs on a node
  node purge [-json] NODE                         forget a node that is gone; its allocs are lost, its claims freed
  volume create FILE                              create a CSI volume through its plugin (of one that exists: grow it)
  volume register FILE                            register an existing CSI volume
  volume deregister [-force] VOLUME               forget a CSI volume
  volume delete VOLUME                            delete a CSI volume through its plugin
  volume detach VOLUME NODE                       release the volume's claims on a node
  volume status [-json] [-verbose] [VOLUME]       show CSI volumes (-verbose: each claim with its volume stats)
  volume snapshot create [-json] VOLUME [NAME]    snapshot a CSI volume through its plugin
  volume snapshot list [-plugin P] [-json]        list the snapshots of a plugin (of all plugins)
  volume snapshot delete PLUGIN SNAPSHOT          delete a snapshot through its plugin
  plugin status [-json] [PLUGIN]                  show CSI plugins
  system gc                                       garbage collect what is done, now

Every command but agent and config takes -address ADDR (default BERTH_ADDR, then http://127.0.0.1:4747).
";

/// A command line berth cannot make sense of: reported with [`USAGE`].
fn usage_error(message: impl Into<String>) -> anyhow::Error {
    UsageError::new(message, USAGE).into()
}

/// Flags common to API commands, and the positional arguments left over.
struct ApiArgs {
    api: ApiClient,
    json: bool,
    detach: bool,
    force: bool,
    all_allocs: bool,
    verbose: bool,
    positional: Vec<String>,
}

/// Parses `args` with the flags the command `allowed`.
fn api_args(command: &str, args: &[String], allowed: &[&str]) -> Result<ApiArgs> {
    let mut address = std::env::var("BERTH_ADDR").unwrap_or_else(|_| DEFAULT_ADDR.to_string());
    let mut json = false;
    let mut detach = false;
    let mut force = false;
    let mut all_allocs = false;
    let mut verbose = false;
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let flag = a.trim_start_matches('-');
        if !a.starts_with('-') || a == "-" {
            positional.push(a.clone());
            continue;
        }
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        if name != "address" && !allowed.contains(&name) {
            return Err(usage_error(format!(
                "berth {command}: unknown flag -{name}"
            )));
        }
        match name {
            "address" => {
                address = match inline {
                    Some(v) => v,
                    None => it.next().cloned().ok_or_else(|| {
                        usage_error(format!("berth {command}: -address needs a value"))
                    })?,
                }
            }
            "json" => json = true,
            "detach" => detach = true,
            "force" => force = true,
            "all-allocs" => all_allocs = true,
            "verbose" => verbose = true,
            _ => unreachable!("allowed flags are handled above"),
        }
    }
    Ok(ApiArgs {
        api: ApiClient::new(&address)?,
        json,
        detach,
        force,
        all_allocs,
        verbose,
        positional,
    })
}

fn one_positional(command: &str, a: &ApiArgs, what: &str) -> Result<String> {
    match a.positional.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(usage_error(format!("berth {command}: missing {what}"))),
        _ => Err(usage_error(format!(
            "berth {command}: takes one {what}, got {:?}",
            a.positional
        ))),
    }
}

fn optional_positional(command: &str, a: &ApiArgs, what: &str) -> Result<Option<String>> {
    match a.positional.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        _ => Err(usage_error(format!(
            "berth {command}: takes at most one {what}, got {:?}",
            a.positional
        ))),
    }
}

/// Runs the command line; returns the process exit code. A
/// [`UsageError`] says the command line itself is wrong.
pub fn run(args: Vec<String>) -> Result<i32> {
    let (cmd, rest) = match args.as_slice() {
        [] => return Err(usage_error("berth: no command given")),
        [c, rest @ ..] => (c.as_str(), rest),
    };
    let sub = rest.first().map(String::as_str);
    let tail = rest.get(1..).unwrap_or_default();
    match (cmd, sub) {
        ("agent", _) => crate::agent::run_from_args(rest),
        // Hidden: the per-task executor the raw_exec driver starts.
        ("executor", _) => Ok(berth_allocrunner::executor::run_executor(rest)),
        ("config", Some("validate")) => config_validate(tail),
        ("job", Some("run")) => job_run(tail),
        ("job", Some("stop")) => job_stop(tail),
        ("job", Some("status")) => job_status(tail),
        ("alloc", Some("status")) => alloc_status(tail),
        ("node", Some("status")) => node_status(tail),
        ("node", Some("drain")) => node::node_drain(tail),
        ("node", Some("eligibility")) => node::node_eligibility(tail),
        ("node", Some("purge")) => node_purge(tail),
        ("volume", Some("create")) => volume_submit(tail, true),
        ("volume", Some("register")) => volume_submit(tail, false),
        ("volume", Some("deregister")) => volume_deregister(tail),
        ("volume", Some("delete")) => volume_delete(tail),
        ("volume", Some("detach")) => volume_detach(tail),
        ("volume", Some("status")) => volume_status(tail),
        ("volume", Some("snapshot")) => match tail.split_first() {
            Some((c, rest)) if c == "create" => snapshot::snapshot_create(rest),
            Some((c, rest)) if c == "list" => snapshot::snapshot_list(rest),
            Some((c, rest)) if c == "delete" => snapshot::snapshot_delete(rest),
            _ => Err(usage_error(
                "berth volume snapshot: want create, list or delete",
            )),
        },
        ("plugin", Some("status")) => plugin_status(tail),
        ("system", Some("gc")) => system_gc(tail),
        ("help" | "-h" | "-help" | "--help", _) => {
            print!("{USAGE}");
            Ok(0)
        }
        _ => Err(usage_error(format!(
            "berth: unknown command {:?}",
            args.join(" ")
        ))),
    }
}

/// Percent-encodes an ID for a URL path segment or query value.
fn enc(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn print_json(v: &Value) -> Result<i32> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(0)
}

/// Reads a spec file (`kind` says which: "job file"). A file larger than
/// the API accepts is refused before it is read, so a huge file costs
/// neither memory nor a request.
fn read_spec(kind: &str, path: &str) -> Result<String> {
    use std::io::Read;
    let limit = crate::http::MAX_REQUEST_BODY as u64;
    let too_large = |size: String| {
        anyhow!(
            "{kind} {path} is {size}; the limit is {}",
            crate::http::describe_size(limit)
        )
    };
    let file = std::fs::File::open(path).with_context(|| format!("reading {path}"))?;
    let meta = file.metadata().with_context(|| format!("reading {path}"))?;
    if meta.is_dir() {
        bail!("{kind} {path} is a directory");
    }
    if meta.len() > limit {
        return Err(too_large(crate::http::describe_size(meta.len())));
    }
    // A pipe or a file that grows has no size up front: read one byte past
    // the limit at most.
    let mut raw = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut raw)
        .with_context(|| format!("reading {path}"))?;
    if raw.len() as u64 > limit {
        return Err(too_large(format!(
            "more than {}",
            crate::http::describe_size(limit)
        )));
    }
    String::from_utf8(raw).map_err(|e| {
        anyhow!(
            "{kind} {path} is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// `berth config validate PATH...`: reads the paths as `berth agent
/// -config` would (one agent's configuration, later files over earlier
/// ones) and says whether they make a valid one. Starts nothing.
fn config_validate(args: &[String]) -> Result<i32> {
    if let Some(flag) = args
        .iter()
        .find(|a| a.starts_with('-') && a.as_str() != "-")
    {
        return Err(usage_error(format!(
            "berth config validate: unknown flag {flag}"
        )));
    }
    if args.is_empty() {
        return Err(usage_error(
            "berth config validate: missing a config file or directory",
        ));
    }
    let paths: Vec<std::path::PathBuf> = args.iter().map(std::path::PathBuf::from).collect();
    let config = crate::config::load(&paths)?;
    let roles = match (config.server_enabled(), config.client_enabled()) {
        (true, true) => "server and client",
        (true, false) => "server",
        _ => "client",
    };
    println!("Configuration is valid ({roles})");
    Ok(0)
}

fn job_run(args: &[String]) -> Result<i32> {
    let a = api_args("job run", args, &["detach"])?;
    let path = one_positional("job run", &a, "job file")?;
    let src = read_spec("job file", &path)?;
    let job = berth_structs::spec::parse_job(&src).map_err(|e| anyhow!("{path}: {e}"))?;
    job.validate().map_err(|e| anyhow!("{path}: {e}"))?;
    let resp = a.api.put("/v1/jobs", &json!({ "job": job }))?;
    let index = resp.get("index").and_then(Value::as_u64).unwrap_or(0);
    println!("Job {:?} submitted (index {index})", job.id);
    let failures = strs(&resp["placement_failures"]);
    if !failures.is_empty() {
        println!("Placement failures (the job waits until they clear):");
        for f in &failures {
            println!("  {f}");
        }
    }
    let outcome = placement_outcome(&resp);
    if a.detach {
        if let Some(o) = &outcome {
            println!("{o}");
        }
        return Ok(0);
    }
    if resp.get("changed").and_then(Value::as_bool) == Some(false) && failures.is_empty() {
        println!("Job {:?} is unchanged: nothing new to place", job.id);
        return Ok(0);
    }
    let placed = monitor_job(&a.api, &job.id, job.job_type, index, !failures.is_empty())?;
    if let Some(o) = &outcome {
        println!("{o}");
    }
    Ok(if failures.is_empty() { placed } else { 2 })
}

/// How many of the job's allocs were placed, when some were not.
fn placement_outcome(resp: &Value) -> Option<String> {
    let num = |k: &str| resp.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (desired, unplaced) = (num("desired_allocs"), num("unplaced_allocs"));
    if unplaced == 0 {
        return None;
    }
    let placed = desired.saturating_sub(unplaced);
    Some(if placed > 0 {
        format!(
            "{placed} of {desired} allocs placed; the job runs with them and waits for capacity for the rest"
        )
    } else {
        format!("0 of {desired} allocs placed; the job waits until they can be placed")
    })
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// Waits until the allocs placed for this submission run (service, system)
/// or finish (batch). Exit code 2 when any fails. With `blocked`, some
/// allocs could not be placed: it returns once the placed ones are done, or
/// at once when none were placed.
fn monitor_job(
    api: &ApiClient,
    job_id: &str,
    job_type: berth_structs::JobType,
    index: u64,
    blocked: bool,
) -> Result<i32> {
    let mut last_line = String::new();
    let mut seen_index = 0;
    loop {
        // A blocking query: answers as soon as anything changes.
        let (allocs, state_index) = api.get_indexed(&format!(
            "/v1/job/{}/allocations?index={seen_index}&wait=10s",
            enc(job_id)
        ))?;
        seen_index = state_index;
        let allocs: Vec<&Value> = allocs
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|x| x.get("create_index").and_then(Value::as_u64).unwrap_or(0) >= index)
                    .collect()
            })
            .unwrap_or_default();
        let status_of = |x: &Value| {
            x.get("client_status")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let count = |s: &str| allocs.iter().filter(|x| status_of(x) == s).count();
        let (pending, running, complete, failed, lost) = (
            count("pending"),
            count("running"),
            count("complete"),
            count("failed"),
            count("lost"),
        );
        let line = format!(
            "allocs: {} placed, {pending} pending, {running} running, {complete} complete, {failed} failed, {lost} lost",
            allocs.len()
        );
        if line != last_line {
            println!("{line}");
            last_line = line;
        }
        if allocs.is_empty() && blocked {
            return Ok(2);
        }
        if !allocs.is_empty() {
            if failed + lost > 0 && pending + running == 0 {
                println!("Job {job_id:?}: {failed} alloc(s) failed");
                return Ok(2);
            }
            let done = match job_type {
                berth_structs::JobType::Batch => pending + running == 0,
                _ => pending == 0,
            };
            if done {
                if failed + lost > 0 {
                    println!("Job {job_id:?}: {failed} alloc(s) failed");
                    return Ok(2);
                }
                if blocked {
                    let state = match job_type {
                        berth_structs::JobType::Batch => "done",
                        _ => "running",
                    };
                    println!("Job {job_id:?}: the allocs placed are {state}");
                    return Ok(2);
                }
                println!("Job {job_id:?}: done");
                return Ok(0);
            }
        }
    }
}

fn job_stop(args: &[String]) -> Result<i32> {
    let a = api_args("job stop", args, &[])?;
    let id = one_positional("job stop", &a, "job ID")?;
    a.api.delete(&format!("/v1/job/{}", enc(&id)))?;
    println!("Job {id:?} stopped");
    Ok(0)
}

/// A job with stubs of its allocs: by default those of its latest version,
/// newest first; with `all_allocs`, every alloc the servers still keep.
fn job_view(api: &ApiClient, job: &Value, all_allocs: bool) -> Result<Value> {
    let id = job.get("id").and_then(Value::as_str).unwrap_or_default();
    let version = job.get("version").and_then(Value::as_u64).unwrap_or(0);
    let allocs = api.get(&format!("/v1/job/{}/allocations", enc(id)))?;
    let mut allocs: Vec<&Value> = allocs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| all_allocs || a["job"]["version"].as_u64().unwrap_or(0) == version)
        .collect();
    allocs.sort_by_key(|a| std::cmp::Reverse(a["create_index"].as_u64().unwrap_or(0)));
    let stubs: Vec<Value> = allocs
        .into_iter()
        .map(|a| {
            json!({
                "id": a["id"],
                "name": a["name"],
                "node_id": a["node_id"],
                "task_group": a["task_group"],
                "job_version": a["job"]["version"],
                "client_status": a["client_status"],
                "desired_status": a["desired_status"],
                "create_index": a["create_index"],
            })
        })
        .collect();
    let mut v = job.clone();
    v["allocations"] = Value::Array(stubs);
    Ok(v)
}

fn job_status(args: &[String]) -> Result<i32> {
    let a = api_args("job status", args, &["json", "all-allocs"])?;
    match optional_positional("job status", &a, "job ID")? {
        Some(id) => {
            let job = a.api.get(&format!("/v1/job/{}", enc(&id)))?;
            let v = job_view(&a.api, &job, a.all_allocs)?;
            if a.json {
                return print_json(&v);
            }
            println!("ID      = {}", v["id"].as_str().unwrap_or_default());
            println!("Type    = {}", v["type"].as_str().unwrap_or_default());
            println!("Status  = {}", v["status"].as_str().unwrap_or_default());
            println!("Version = {}", v["version"].as_u64().unwrap_or_default());
            let failures = strs(&v["placement_failures"]);
            if !failures.is_empty() {
                println!("\nPlacement failures (the job waits until they clear)");
                for f in &failures {
                    println!("  {f}");
                }
            }
            println!(
                "\nAllocations{}",
                if a.all_allocs {
                    " (all versions)"
                } else {
                    " (latest version, newest first)"
                }
            );
            println!(
                "{:<38} {:<38} {:<10} {:<10}",
                "ID", "Node ID", "Desired", "Status"
            );
            for al in v["allocations"].as_array().into_iter().flatten() {
                println!(
                    "{:<38} {:<38} {:<10} {:<10}",
                    al["id"].as_str().unwrap_or_default(),
                    al["node_id"].as_str().unwrap_or_default(),
                    al["desired_status"].as_str().unwrap_or_default(),
                    al["client_status"].as_str().unwrap_or_default()
                );
            }
            Ok(0)
        }
        None => {
            let jobs = a.api.get("/v1/jobs")?;
            let views = jobs
                .as_array()
                .into_iter()
                .flatten()
                .map(|j| job_view(&a.api, j, a.all_allocs))
                .collect::<Result<Vec<_>>>()?;
            if a.json {
                return print_json(&Value::Array(views));
            }
            println!("{:<30} {:<8} {:<8}", "ID", "Type", "Status");
            for j in &views {
                println!(
                    "{:<30} {:<8} {:<8}",
                    j["id"].as_str().unwrap_or_default(),
                    j["type"].as_str().unwrap_or_default(),
                    j["status"].as_str().unwrap_or_default()
                );
            }
            Ok(0)
        }
    }
}

fn alloc_status(args: &[String]) -> Result<i32> {
    let a = api_args("alloc status", args, &["json"])?;
    let id = one_positional("alloc status", &a, "alloc ID")?;
    let v = a.api.get(&format!("/v1/allocation/{}", enc(&id)))?;
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

fn node_status(args: &[String]) -> Result<i32> {
    let a = api_args("node status", args, &["json"])?;
    let v = match optional_positional("node status", &a, "node ID")? {
        Some(id) => a.api.get(&format!("/v1/node/{}", enc(&id)))?,
        None => a.api.get("/v1/nodes")?,
    };
    if a.json {
        return print_json(&v);
    }
    let nodes = match &v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    let allocs = a.api.get("/v1/allocations")?;
    for row in node::node_table(&nodes, &allocs, berth_structs::now_ms()) {
        println!("{row}");
    }
    if let [n] = nodes.as_slice() {
        println!("\nID = {}", n["id"].as_str().unwrap_or_default());
        if let Some(d) = n["drain_strategy"].as_object() {
            let at = d.get("force_deadline_ms").and_then(Value::as_i64);
            println!(
                "Drain deadline = {} ({})",
                d.get("deadline")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
                node::deadline_left(at.unwrap_or(0), berth_structs::now_ms())
            );
        }
        let plugins = node::plugin_table(n);
        if !plugins.is_empty() {
            println!("\nCSI Plugins");
            for row in plugins {
                println!("  {row}");
            }
        }
        println!("\nEvents");
        for e in n["events"].as_array().into_iter().flatten() {
            println!(
                "  {:<10} {:<20} {}",
                e["subsystem"].as_str().unwrap_or_default(),
                e["message"].as_str().unwrap_or_default(),
                e["details"]
            );
        }
    }
    Ok(0)
}

fn volume_submit(args: &[String], create: bool) -> Result<i32> {
    let command = if create {
        "volume create"
    } else {
        "volume register"
    };
    let a = api_args(command, args, &[])?;
    let path = one_positional(command, &a, "volume file")?;
    let src = read_spec("volume file", &path)?;
    let vol = berth_structs::spec::parse_volume(&src).map_err(|e| anyhow!("{path}: {e}"))?;
    vol.validate(!create).map_err(|e| anyhow!("{path}: {e}"))?;
    let url = if create {
        format!("/v1/volume/csi/{}/create", enc(&vol.id))
    } else {
        format!("/v1/volume/csi/{}", enc(&vol.id))
    };
    // A create of a volume that exists grows it (or changes nothing).
    let before = if create {
        snapshot::existing_volume(&a.api, &vol.id)?
    } else {
        None
    };
    let resp = a.api.put(&url, &json!({ "volume": vol }))?;
    if create {
        println!(
            "{}",
            snapshot::create_outcome(&vol.id, before.as_ref(), &resp)
        );
    } else {
        println!("Registered volume {:?}", vol.id);
    }
    Ok(0)
}

fn volume_deregister(args: &[String]) -> Result<i32> {
    let a = api_args("volume deregister", args, &["force"])?;
    let id = one_positional("volume deregister", &a, "volume ID")?;
    let resp = a
        .api
        .delete(&format!("/v1/volume/csi/{}?force={}", enc(&id), a.force))?;
    print_release_warnings(&resp);
    let released = strs(&resp["released"]);
    if released.is_empty() {
        println!("Deregistered volume {id:?}");
    } else {
        println!(
            "Deregistered volume {id:?} after releasing the claims of {} ({})",
            allocs_phrase(released.len()),
            released.join(", ")
        );
    }
    Ok(0)
}

/// What an operator's release could not do (the claims were freed anyway).
fn print_release_warnings(resp: &Value) {
    for w in strs(&resp["warnings"]) {
        println!("Warning: {w}");
    }
}

fn allocs_phrase(n: usize) -> String {
    if n == 1 {
        "1 alloc".into()
    } else {
        format!("{n} allocs")
    }
}

fn volume_delete(args: &[String]) -> Result<i32> {
    let a = api_args("volume delete", args, &[])?;
    let id = one_positional("volume delete", &a, "volume ID")?;
    a.api
        .delete(&format!("/v1/volume/csi/{}/delete", enc(&id)))?;
    println!("Deleted volume {id:?}");
    Ok(0)
}

fn node_purge(args: &[String]) -> Result<i32> {
    let a = api_args("node purge", args, &["json"])?;
    let [node] = a.positional.as_slice() else {
        return Err(usage_error(
            "berth node purge: takes one node ID, ID prefix or name",
        ));
    };
    let resp = a
        .api
        .put(&format!("/v1/node/{}/purge", enc(node)), &json!({}))?;
    if a.json {
        return print_json(&resp);
    }
    print_release_warnings(&resp);
    let name = resp["node_name"].as_str().unwrap_or_default();
    let id = resp["node_id"].as_str().unwrap_or_default();
    let lost = strs(&resp["lost_allocs"]);
    let released = resp["released"].as_array().map_or(0, Vec::len);
    println!(
        "Purged node {name:?} ({id}): {} lost, {released} volume claim(s) freed",
        allocs_phrase(lost.len())
    );
    Ok(0)
}

fn volume_detach(args: &[String]) -> Result<i32> {
    let a = api_args("volume detach", args, &[])?;
    let [volume, node] = a.positional.as_slice() else {
        return Err(usage_error(
            "berth volume detach: takes a volume ID and a node ID",
        ));
    };
    let resp = a.api.delete(&format!(
        "/v1/volume/csi/{}/detach?node={}",
        enc(volume),
        enc(node)
    ))?;
    let released = strs(&resp["released"]);
    if released.is_empty() {
        println!("volume {volume:?} has no claims on node {node:?}; nothing to detach");
        return Ok(0);
    }
    print_release_warnings(&resp);
    println!(
        "Detached volume {volume:?} from node {node:?}: released the claims of {} ({})",
        allocs_phrase(released.len()),
        released.join(", ")
    );
    Ok(0)
}

fn volume_status(args: &[String]) -> Result<i32> {
    let a = api_args("volume status", args, &["json", "verbose"])?;
    let mut v = match optional_positional("volume status", &a, "volume ID")? {
        Some(id) => a.api.get(&format!("/v1/volume/csi/{}", enc(&id)))?,
        None => a.api.get("/v1/volumes")?,
    };
    // Each volume's own answer carries its claims joined with their allocs;
    // one without claims has none to join (no request for it).
    if let (true, Value::Array(list)) = (a.verbose, &mut v) {
        for vol in list.iter_mut() {
            match vol["id"].as_str() {
                Some(id) if volume_stats::has_claims(vol) => {
                    *vol = a.api.get(&format!("/v1/volume/csi/{}", enc(id)))?;
                }
                _ => {
                    if let Some(o) = vol.as_object_mut() {
                        o.insert("claim_allocs".into(), json!([]));
                    }
                }
            }
        }
    }
    if a.json {
        return print_json(&v);
    }
    let vols = match &v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    println!(
        "{:<20} {:<14} {:<12} {:<8} {:<8}",
        "ID", "Plugin", "Schedulable", "Readers", "Writers"
    );
    for vol in &vols {
        println!(
            "{:<20} {:<14} {:<12} {:<8} {:<8}",
            vol["id"].as_str().unwrap_or_default(),
            vol["plugin_id"].as_str().unwrap_or_default(),
            vol["schedulable"].as_bool().unwrap_or_default(),
            vol["read_allocs"].as_array().map_or(0, Vec::len),
            vol["write_allocs"].as_array().map_or(0, Vec::len)
        );
    }
    if let [vol] = vols.as_slice() {
        let req = &vol["requested_topologies"];
        println!("\nTopology");
        for (what, list) in [
            ("Required", &req["required"]),
            ("Preferred", &req["preferred"]),
            ("Accessible", &vol["accessible_topology"]),
        ] {
            println!("  {what:<10} = {}", node::topologies_text(list));
        }
    }
    if a.verbose {
        for vol in &vols {
            let lines = volume_stats::volume_claim_lines(vol);
            println!(
                "\nClaims of {}{}",
                vol["id"].as_str().unwrap_or_default(),
                if lines.is_empty() { ": none" } else { "" }
            );
            for line in lines {
                println!("  {line}");
            }
        }
    }
    Ok(0)
}

fn plugin_status(args: &[String]) -> Result<i32> {
    let a = api_args("plugin status", args, &["json"])?;
    let v = match optional_positional("plugin status", &a, "plugin ID")? {
        Some(id) => a.api.get(&format!("/v1/plugin/csi/{}", enc(&id)))?,
        None => a.api.get("/v1/plugins")?,
    };
    if a.json {
        return print_json(&v);
    }
    let plugins = match &v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    println!(
        "{:<20} {:<28} {:<20} {:<20}",
        "ID", "Provider", "Controllers", "Nodes"
    );
    for p in &plugins {
        println!(
            "{:<20} {:<28} {:<20} {:<20}",
            p["id"].as_str().unwrap_or_default(),
            p["provider"].as_str().unwrap_or_default(),
            format!(
                "{}/{} healthy",
                p["controllers_healthy"], p["controllers_expected"]
            ),
            format!("{}/{} healthy", p["nodes_healthy"], p["nodes_expected"])
        );
    }
    Ok(0)
}

fn system_gc(args: &[String]) -> Result<i32> {
    let a = api_args("system gc", args, &["json"])?;
    if !a.positional.is_empty() {
        return Err(usage_error(format!(
            "berth system gc: takes no arguments, got {:?}",
            a.positional
        )));
    }
    let v = a.api.put("/v1/system/gc", &json!({}))?;
    if a.json {
        return print_json(&v);
    }
    let n = |k: &str| v[k].as_array().map_or(0, Vec::len);
    println!(
        "Garbage collected {} allocs, {} jobs, {} nodes",
        n("allocs"),
        n("jobs"),
        n("nodes")
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn ids_are_percent_encoded() {
        assert_eq!(enc("data[0]"), "data%5B0%5D");
        assert_eq!(enc("a/b c"), "a%2Fb%20c");
        assert_eq!(enc("plain-id_1.x~"), "plain-id_1.x~");
    }

    #[test]
    fn flags_and_positionals() {
        let a = api_args("job run", &s(&["-detach", "x.hcl"]), &["detach"]).unwrap();
        assert!(a.detach);
        assert_eq!(a.positional, vec!["x.hcl"]);
        let a = api_args(
            "job status",
            &s(&["-address=http://h:1", "-json"]),
            &["json"],
        )
        .unwrap();
        assert!(a.json);
        assert!(api_args("job stop", &s(&["-json", "x"]), &[]).is_err());
        assert!(api_args("job stop", &s(&["-address"]), &[]).is_err());
    }
}
