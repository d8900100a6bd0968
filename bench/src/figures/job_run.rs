//! `job-run`: how long `berth job run` of a one-task batch job takes, no
//! volume.
//!
//! Measured: the wall time of one `berth job run FILE` process (the real
//! release CLI against a release `berth agent -dev`), from its spawn to its
//! exit with status 0, which it reaches once the servers record the alloc
//! `complete`. The job is a batch job whose one raw_exec task runs
//! `sh -c 'echo hi > file'`. Every round submits a new job ID: re-running
//! one ID with an unchanged spec places nothing (`job run` answers
//! "unchanged" at once), and a changed spec would also stop the previous
//! version's alloc, which is work a first run does not do.
//!
//! Baseline, measured in the same run and interleaved round by round: one
//! CLI read round trip (`berth node status -json`, process spawn to exit)
//! plus a fork/exec of the task's command (`sh -c 'echo hi > file'`, spawn
//! to exit). That is the floor: a CLI that talks to the agent, and the
//! task's own process.
//!
//! Target: median ≤ 25 ms, or ≤ 5x the baseline's median.
//!
//! With `--exec` the rounds are timed again on the same agent, a raw_exec
//! job and an exec job in turn (the exec task writes `local/file`: its
//! task dir is its root, its user `nobody`), and the figure prints what
//! the cgroup, the namespaces and the root of an exec task cost. Target:
//! exec's median at most raw_exec's + 10 ms.
//!
//! ```text
//! scripts/bench job-run [--rounds 50] [--warmup 5] [--tls] [--exec]
//! ```
//!
//! With `--tls` the rounds are timed again on two clusters of one server
//! agent and one client agent each (`-dev` takes no config file), one
//! plain and one with mutual TLS on both ports of both agents, a round of
//! each in turn: the CLI over HTTPS with a client certificate (a new
//! handshake per process), the client to its server over TLS.
//!
//! The job spec and the timing loop are `pub`: the CSI variant
//! (`job_run_csi`) runs the same rounds with a volume in the group.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use berth_tests::{binary, DevAgent};

use crate::report::{self, Samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured rounds (each one job run and one baseline)
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Unmeasured rounds first (warms the agent, the page cache, the CLI)
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Also time the rounds on a plain server + client pair and on one
    /// with mutual TLS on every port, interleaved, and print what TLS
    /// costs.
    #[arg(long)]
    pub tls: bool,
    /// Also time raw_exec and exec jobs in turn and print what an exec
    /// task's isolation costs.
    #[arg(long)]
    pub exec: bool,
}

/// The task's command: what the figure runs as a task and as the
/// baseline's fork/exec.
pub const TASK_SCRIPT: &str = "echo hi > file";

/// What goes into one round's job beyond the plain batch job: extra
/// stanzas for the group (a `volume` block) and for the task (a
/// `volume_mount`), and the path the task writes, relative to the task
/// directory.
#[derive(Debug, Clone)]
pub struct JobShape {
    pub group_extra: String,
    pub task_extra: String,
    pub write_to: String,
    pub driver: &'static str,
}

impl Default for JobShape {
    fn default() -> JobShape {
        JobShape {
            group_extra: String::new(),
            task_extra: String::new(),
            write_to: "file".to_string(),
            driver: "raw_exec",
        }
    }
}

/// The batch job `id`: group `g`, one raw_exec task `t` running
/// `sh -c 'echo hi > <write_to>'`, with `shape`'s extra stanzas.
pub fn job_spec(id: &str, shape: &JobShape) -> String {
    format!(
        r#"
job "{id}" {{
  type = "batch"
  group "g" {{
{group_extra}
    task "t" {{
      driver = "{driver}"
      config {{
        command = "/bin/sh"
        args    = ["-c", "echo hi > {write_to}"]
      }}
{task_extra}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#,
        group_extra = shape.group_extra,
        task_extra = shape.task_extra,
        write_to = shape.write_to,
        driver = shape.driver,
    )
}

/// Writes round `round`'s job (ID `<prefix>-<round>`) into the agent's data
/// dir and times `berth job run` on it: spawn to exit. An error unless it
/// exits 0 (every alloc complete). Returns the job ID too.
pub fn timed_job_run(
    agent: &DevAgent,
    prefix: &str,
    round: usize,
    shape: &JobShape,
) -> Result<(String, Duration)> {
    let id = format!("{prefix}-{round}");
    let file = agent.write_file(&format!("{id}.hcl"), &job_spec(&id, shape))?;
    let start = Instant::now();
    let out = agent.cli(&["job", "run", &file])?;
    let took = start.elapsed();
    if !out.status.success() {
        bail!(
            "berth job run {file} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((id, took))
}

/// The baseline's two parts, timed: `berth node status -json` (spawn to
/// exit, status 0) and a fork/exec of `sh -c 'echo hi > file'` in `dir`.
pub fn timed_baseline(agent: &DevAgent, dir: &Path) -> Result<(Duration, Duration)> {
    let start = Instant::now();
    let out = agent.cli(&["node", "status", "-json"])?;
    let read = start.elapsed();
    ensure!(
        out.status.success(),
        "berth node status -json failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = Instant::now();
    let status = Command::new("/bin/sh")
        .args(["-c", TASK_SCRIPT])
        .current_dir(dir)
        .stdin(Stdio::null())
        .status()
        .context("running sh")?;
    let exec = start.elapsed();
    ensure!(status.success(), "sh -c {TASK_SCRIPT:?} failed: {status}");
    Ok((read, exec))
}

/// What [`measure`] collected.
pub struct Rounds {
    /// `job run` to completion, per round.
    pub job_run: Samples,
    /// The baseline (read round trip + fork/exec), per round.
    pub baseline: Samples,
    pub read: Samples,
    pub exec: Samples,
    /// The job IDs run, warm-up rounds included, in order.
    pub jobs: Vec<String>,
}

/// Runs `warmup` unmeasured and then `rounds` measured rounds against
/// `agent`: each round one timed `job run` of a new job of `shape` (IDs
/// `<prefix>-<n>`), then one timed baseline, so that the machine's noise
/// falls on both alike.
pub fn measure(
    agent: &DevAgent,
    prefix: &str,
    shape: &JobShape,
    rounds: usize,
    warmup: usize,
) -> Result<Rounds> {
    let scratch = tempfile::Builder::new()
        .prefix("berth-bench-baseline-")
        .tempdir()?;
    let mut out = Rounds {
        job_run: Samples::new(),
        baseline: Samples::new(),
        read: Samples::new(),
        exec: Samples::new(),
        jobs: Vec::new(),
    };
    for round in 0..warmup + rounds {
        let (id, took) = timed_job_run(agent, prefix, round, shape)
            .with_context(|| format!("round {round}; agent log:\n{}", agent.log()))?;
        out.jobs.push(id);
        let (read, exec) = timed_baseline(agent, scratch.path())?;
        if round >= warmup {
            out.job_run.push(took);
            out.read.push(read);
            out.exec.push(exec);
            out.baseline.push(read + exec);
        }
    }
    Ok(out)
}

/// Checks that job `id`'s one alloc is complete and that its task wrote
/// `hi` to `write_to` (relative to the task directory).
pub fn check_task_wrote(agent: &DevAgent, id: &str, write_to: &str) -> Result<()> {
    let allocs = agent.job_allocs(id)?;
    ensure!(
        allocs.len() == 1,
        "job {id} has {} allocs, not 1",
        allocs.len()
    );
    let alloc = &allocs[0];
    ensure!(
        alloc["client_status"] == "complete",
        "job {id}'s alloc is {}, not complete",
        alloc["client_status"]
    );
    let alloc_id = alloc["id"].as_str().context("an alloc ID")?;
    let path = agent
        .data_dir
        .path()
        .join("alloc")
        .join(alloc_id)
        .join("t")
        .join(write_to);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    ensure!(
        text == "hi\n",
        "{} holds {text:?}, not \"hi\\n\"",
        path.display()
    );
    Ok(())
}

/// Prints the rounds: job run, the baseline and its parts, the ratio and
/// the target (median ≤ 25 ms or ≤ 5x the baseline). Returns whether the
/// target was met.
pub fn print(r: &Rounds) -> bool {
    report::samples("job run (to complete)", &r.job_run);
    report::samples("baseline (read + fork/exec)", &r.baseline);
    report::samples("  of which CLI read round trip", &r.read);
    report::samples("  of which fork/exec sh", &r.exec);
    report::ratio_line("job run / baseline", &r.job_run, &r.baseline);
    let met = r.job_run.median() <= Duration::from_millis(25)
        || report::ratio(&r.job_run, &r.baseline) <= 5.0;
    report::target("median <= 25 ms or <= 5x baseline", met)
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    // The CLI the rounds spawn; fail early and clearly when it is missing.
    let berth = binary("berth");
    report::heading(
        "job-run",
        &format!(
            "`berth job run` of a raw_exec batch job (sh -c {TASK_SCRIPT:?}) to complete; {} rounds after {} warm-up ({})",
            args.rounds,
            args.warmup,
            berth.display()
        ),
    );
    let agent = DevAgent::start()?;
    let rounds = measure(
        &agent,
        "bench",
        &JobShape::default(),
        args.rounds,
        args.warmup,
    )?;
    if let Some(last) = rounds.jobs.last() {
        check_task_wrote(&agent, last, "file")?;
    }
    print(&rounds);
    if args.tls {
        let (plain, tls) = tls_pair(args.rounds, args.warmup)?;
        print_tls(&plain, &tls);
    }
    if args.exec {
        exec_against_raw_exec(&agent, args.rounds, args.warmup)?;
    }
    Ok(())
}

/// Times a raw_exec job and an exec job in turn on `agent`, `rounds`
/// times after `warmup`, and prints both and the difference of their
/// medians against the target (exec ≤ raw_exec + 10 ms).
fn exec_against_raw_exec(agent: &DevAgent, rounds: usize, warmup: usize) -> Result<()> {
    let raw = JobShape::default();
    let exec = JobShape {
        driver: "exec",
        write_to: "local/file".to_string(),
        ..JobShape::default()
    };
    let (mut raw_times, mut exec_times) = (Samples::new(), Samples::new());
    let mut last_exec = String::new();
    for round in 0..warmup + rounds {
        let context = || format!("round {round}; agent log:\n{}", agent.log());
        let (_, r) = timed_job_run(agent, "raw", round, &raw).with_context(context)?;
        let (id, e) = timed_job_run(agent, "exec", round, &exec).with_context(context)?;
        last_exec = id;
        if round >= warmup {
            raw_times.push(r);
            exec_times.push(e);
        }
    }
    check_task_wrote(agent, &last_exec, "local/file")?;
    report::heading(
        "job-run --exec",
        &format!("raw_exec and exec jobs in turn, {rounds} rounds after {warmup} warm-up"),
    );
    report::samples("job run, raw_exec", &raw_times);
    report::samples("job run, exec", &exec_times);
    let extra = exec_times.median().saturating_sub(raw_times.median());
    report::value("exec over raw_exec (medians)", format!("{extra:.1?}"));
    report::target(
        "exec median <= raw_exec median + 10 ms",
        exec_times.median() <= raw_times.median() + Duration::from_millis(10),
    );
    Ok(())
}

/// One server agent and one client agent, each its own process, with
/// mutual TLS on both ports of both or on none; the CLI is pointed at the
/// server (over HTTPS with the CLI's certificate when TLS is on).
struct TwoAgents {
    _server: berth_tests::Agent,
    client: berth_tests::Agent,
    cli_flags: Vec<String>,
    dir: tempfile::TempDir,
}

impl TwoAgents {
    fn start(pki: Option<&berth_tests::pki::Pki>) -> Result<TwoAgents> {
        use berth_tests::pki::{CLIENT_CERT, SERVER_CERT};
        let dir = tempfile::Builder::new()
            .prefix("berth-bench-tls-")
            .tempdir()?;
        let block = |cert: &str| pki.map_or(String::new(), |p| p.tls_block(cert, true));
        let server_file = dir.path().join("server.hcl");
        std::fs::write(&server_file, block(SERVER_CERT))?;
        let client_file = dir.path().join("client.hcl");
        std::fs::write(&client_file, block(CLIENT_CERT))?;
        let path = |p: &Path| {
            p.to_str()
                .map(str::to_string)
                .context("temp paths are UTF-8")
        };
        let http_port = berth_tests::free_port();
        let rpc = format!("127.0.0.1:{}", berth_tests::free_port());
        let server = berth_tests::Agent::start(&[
            "-server",
            "-config",
            &path(&server_file)?,
            "-http-addr",
            &format!("127.0.0.1:{http_port}"),
            "-rpc-addr",
            &rpc,
        ])?;
        let client = berth_tests::Agent::start_client(
            &["-config", &path(&client_file)?],
            &rpc,
            "bench",
            &format!("127.0.0.1:{}", berth_tests::free_port()),
        )?;
        let cli_flags = match pki {
            Some(p) => p.cli_flags(http_port),
            None => vec!["-address".into(), format!("http://127.0.0.1:{http_port}")],
        };
        let mut two = TwoAgents {
            _server: server,
            client,
            cli_flags,
            dir,
        };
        berth_tests::wait_for("the client's node ready", Duration::from_secs(60), || {
            two.client.check_running()?;
            let Ok(out) = two.cli(&["node", "status", "-json"]) else {
                return Ok(None);
            };
            let nodes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            Ok(nodes
                .as_array()
                .is_some_and(|n| n.iter().any(|n| n["status"] == "ready"))
                .then_some(()))
        })?;
        Ok(two)
    }

    fn cli(&self, args: &[&str]) -> Result<std::process::Output> {
        let out = Command::new(binary("berth"))
            .args(&self.cli_flags)
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .context("running berth")?;
        berth_tests::exit_ok(out, args)
    }

    /// Times `berth job run` of a new job `<prefix>-<round>`: spawn to
    /// exit, once its alloc is complete.
    fn timed_job_run(&self, prefix: &str, round: usize) -> Result<Duration> {
        let id = format!("{prefix}-{round}");
        let file = self.dir.path().join(format!("{id}.hcl"));
        std::fs::write(&file, job_spec(&id, &JobShape::default()))?;
        let file = file.to_str().context("temp paths are UTF-8")?;
        let start = Instant::now();
        self.cli(&["job", "run", file])?;
        Ok(start.elapsed())
    }
}

/// `job run` timed on a plain server and client pair and on one with
/// mutual TLS on every port, one round of each in turn, so that the
/// machine's noise falls on both alike.
fn tls_pair(rounds: usize, warmup: usize) -> Result<(Samples, Samples)> {
    let pki = berth_tests::pki::Pki::new()?;
    let plain = TwoAgents::start(None)?;
    let tls = TwoAgents::start(Some(&pki))?;
    let (mut p, mut t) = (Samples::new(), Samples::new());
    for round in 0..warmup + rounds {
        let took_plain = plain.timed_job_run("plain", round)?;
        let took_tls = tls.timed_job_run("tls", round)?;
        if round >= warmup {
            p.push(took_plain);
            t.push(took_tls);
        }
    }
    Ok((p, t))
}

fn print_tls(plain: &Samples, tls: &Samples) {
    report::samples("job run, server + client, plain", plain);
    report::samples("job run, server + client, mutual TLS", tls);
    report::ratio_line("TLS / plain", tls, plain);
}

/// Two rounds after one warm-up; every job's task must have written its
/// file.
pub fn smoke() -> Result<()> {
    let agent = DevAgent::start()?;
    let shape = JobShape::default();
    let rounds = measure(&agent, "smoke", &shape, 2, 1)?;
    for id in &rounds.jobs {
        check_task_wrote(&agent, id, &shape.write_to)?;
    }
    print(&rounds);
    let (plain, tls) = tls_pair(2, 1)?;
    print_tls(&plain, &tls);
    exec_against_raw_exec(&agent, 2, 1)
}
