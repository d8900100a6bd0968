//! The systemd contract, against the real `berth agent` (server and client
//! roles from one config file) and a `NOTIFY_SOCKET` the test listens on:
//! `READY=1` only once the allocs that ran before a restart are picked up
//! again, `WATCHDOG=1` at half `WATCHDOG_USEC`, `STOPPING=1` on SIGTERM
//! with the tasks left running, and after a restart on the same data dir
//! `READY=1` again with the very same task process. SIGHUP applies a
//! changed `log_level`, between `RELOADING=1` and `READY=1`.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_tests::{
    api_get_at, cli_at, free_port, recorded_task_pid, sleeping_service_job, task_events, wait_for,
    Agent,
};
use nix::sys::signal::Signal;
use serde_json::Value;

/// The socket systemd would listen on, and every message the agent sent.
struct NotifySocket {
    sock: UnixDatagram,
    path: PathBuf,
}

impl NotifySocket {
    fn bind(dir: &Path) -> Result<NotifySocket> {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).context("binding the notify socket")?;
        Ok(NotifySocket { sock, path })
    }

    /// The next message, if one comes before `deadline`.
    fn next_before(&self, deadline: Instant) -> Result<Option<String>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        self.sock.set_read_timeout(Some(left))?;
        let mut buf = [0u8; 4096];
        match self.sock.recv(&mut buf) {
            Ok(n) => Ok(Some(String::from_utf8_lossy(&buf[..n]).into_owned())),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The messages up to and including the first with the line `line`;
    /// an error naming what came when none does within `timeout`.
    fn until(&self, line: &str, timeout: Duration, agent: &Agent) -> Result<Vec<String>> {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        while let Some(m) = self.next_before(deadline)? {
            let found = m.lines().any(|l| l == line);
            seen.push(m);
            if found {
                return Ok(seen);
            }
        }
        bail!(
            "no {line} within {timeout:?}; got {seen:?}; agent log:\n{}",
            agent.log()
        )
    }

    /// Every message that comes within `span`.
    fn collect_for(&self, span: Duration) -> Result<Vec<String>> {
        let deadline = Instant::now() + span;
        let mut seen = Vec::new();
        while let Some(m) = self.next_before(deadline)? {
            seen.push(m);
        }
        Ok(seen)
    }

    /// Drops the messages already queued.
    fn drain(&self) -> Result<()> {
        self.collect_for(Duration::from_millis(1)).map(drop)
    }
}

/// How many of `messages` have the line `line`.
fn count(messages: &[String], line: &str) -> usize {
    messages
        .iter()
        .filter(|m| m.lines().any(|l| l == line))
        .count()
}

/// The `STATUS=` texts of `messages`, in order.
fn statuses(messages: &[String]) -> Vec<String> {
    messages
        .iter()
        .flat_map(|m| m.lines())
        .filter_map(|l| l.strip_prefix("STATUS="))
        .map(str::to_string)
        .collect()
}

/// Kills a task process the test saw, also when the test fails (the
/// harness kills what mentions the data dir; this makes sure).
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0), Signal::SIGKILL);
    }
}

/// Whether `pid` runs (exists and is not a zombie).
fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rfind(')')
        .is_some_and(|i| !stat[i + 1..].trim_start().starts_with('Z'))
}

/// An agent with the server and client roles from one config file, its
/// log level `info` unless `log_level` says otherwise, talking to
/// `notify` with a 1 s watchdog.
struct Setup {
    /// Holds the config file and the notify socket.
    dir: tempfile::TempDir,
    config: PathBuf,
    http: u16,
    addr: String,
}

impl Setup {
    fn new() -> Result<Setup> {
        let dir = tempfile::Builder::new().prefix("berth-sd-").tempdir()?;
        let http = free_port();
        let config = dir.path().join("agent.hcl");
        let setup = Setup {
            config,
            http,
            addr: format!("http://127.0.0.1:{http}"),
            dir,
        };
        setup.write_config("info")?;
        Ok(setup)
    }

    fn write_config(&self, log_level: &str) -> Result<()> {
        let rpc = free_port();
        let text = format!(
            "log_level = \"{log_level}\"\nports {{\n  http = {http}\n  rpc  = {rpc}\n}}\n\
             server {{\n  enabled = true\n}}\nclient {{\n  enabled = true\n  \
             servers = [\"127.0.0.1:{rpc}\"]\n}}\n",
            http = self.http
        );
        std::fs::write(&self.config, text)?;
        Ok(())
    }

    fn start(&self, notify: &NotifySocket) -> Result<Agent> {
        let config = self.config.display().to_string();
        let socket = notify.path.display().to_string();
        Agent::start_with_env(
            &["-config", &config],
            &[
                ("NOTIFY_SOCKET", Some(&socket)),
                ("WATCHDOG_USEC", Some("1000000")),
                ("WATCHDOG_PID", None),
                // The config's log level applies only without these.
                ("BERTH_LOG", None),
                ("RUST_LOG", None),
            ],
        )
    }

    fn cli_ok(&self, args: &[&str]) -> Result<String> {
        let out = cli_at(&self.addr, args)?;
        if !out.status.success() {
            bail!(
                "berth {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The only alloc of `job`, in full.
    fn only_alloc(&self, job: &str) -> Result<Value> {
        let list = api_get_at(self.http, &format!("/v1/job/{job}/allocations"))?;
        match list.as_array().map(Vec::as_slice) {
            Some([a]) => api_get_at(
                self.http,
                &format!("/v1/allocation/{}", a["id"].as_str().unwrap_or_default()),
            ),
            other => bail!("job {job} should have one alloc, has {other:?}"),
        }
    }
}

fn started_events(alloc: &Value) -> usize {
    task_events(alloc, "sleep")
        .iter()
        .filter(|(t, _, _)| t == "Started")
        .count()
}

#[test]
fn ready_comes_after_restore_the_watchdog_is_pinged_and_stopping_leaves_the_tasks() -> Result<()> {
    let setup = Setup::new()?;
    let notify = NotifySocket::bind(setup.dir.path())?;
    let mut agent = setup.start(&notify)?;

    // First start: status lines, then READY=1 once both roles serve.
    let first = notify.until("READY=1", Duration::from_secs(60), &agent)?;
    let before_ready = statuses(&first);
    assert!(
        before_ready
            .iter()
            .any(|s| s.contains("restoring allocs, then registering")),
        "{first:?}"
    );
    assert!(
        before_ready.last().is_some_and(|s| s.starts_with("ready:")),
        "{first:?}"
    );
    // Ready means serving: the API answers and the node is registered.
    let nodes = api_get_at(setup.http, "/v1/nodes")?;
    assert_eq!(
        nodes.as_array().map(Vec::len),
        Some(1),
        "{nodes}\n{}",
        agent.log()
    );

    // WATCHDOG=1 at half of WATCHDOG_USEC (1 s): about 4 in 2 s.
    let pings = count(&notify.collect_for(Duration::from_secs(2))?, "WATCHDOG=1");
    assert!(pings >= 2, "{pings} watchdog pings in 2s");

    // A service whose task must outlive the agent.
    let job = setup.dir.path().join("sleep.hcl");
    std::fs::write(&job, sleeping_service_job("sd-sleep", 1, 0))?;
    setup.cli_ok(&["job", "run", "-detach", &job.display().to_string()])?;
    let alloc = wait_for("the alloc to run", Duration::from_secs(60), || {
        let a = setup.only_alloc("sd-sleep")?;
        Ok((a["client_status"] == "running").then_some(a))
    })
    .with_context(|| agent.log())?;
    let alloc_id = alloc["id"].as_str().context("alloc id")?.to_string();
    let pid = wait_for("the task pid", Duration::from_secs(30), || {
        Ok(recorded_task_pid(&agent.data_path(), &alloc_id, "sleep").ok())
    })?;
    let _task = KillOnDrop(pid);
    assert!(alive(pid));
    // The status line follows the allocs.
    notify
        .until(
            "STATUS=ready: server: 1 node; client: 1 alloc running",
            Duration::from_secs(10),
            &agent,
        )
        .context("the status line counts the running alloc")?;

    // SIGTERM: STOPPING=1, the agent exits, the task runs on.
    agent.signal(Signal::SIGTERM)?;
    notify.until("STOPPING=1", Duration::from_secs(15), &agent)?;
    agent.stop()?;
    assert!(alive(pid), "the task outlives the agent");

    // Restart on the same data dir: READY=1 only once the alloc is
    // restored, and then its task is the very same process.
    notify.drain()?;
    agent.start_again()?;
    let second = notify.until("READY=1", Duration::from_secs(60), &agent)?;
    let log_at_ready = agent.log();
    let restart_log = log_at_ready
        .rsplit_once("client starting")
        .map_or("", |(_, after)| after);
    assert!(
        restart_log
            .lines()
            .any(|l| l.contains("restoring alloc") && l.contains(&alloc_id)),
        "READY=1 before the alloc was restored; log:\n{log_at_ready}"
    );
    assert_eq!(
        statuses(&second).last().map(String::as_str),
        Some("ready: server: 1 node; client: 1 alloc running"),
        "{second:?}"
    );
    let at_ready = setup.only_alloc("sd-sleep")?;
    assert_eq!(at_ready["client_status"], "running", "{at_ready}");
    assert!(alive(pid), "the task still runs at READY=1");
    assert_eq!(
        recorded_task_pid(&agent.data_path(), &alloc_id, "sleep")?,
        pid
    );

    // The watchdog is pinged again, and the task was never started again.
    let pings = count(&notify.collect_for(Duration::from_secs(2))?, "WATCHDOG=1");
    assert!(pings >= 2, "{pings} watchdog pings in 2s after the restart");
    let after = setup.only_alloc("sd-sleep")?;
    assert_eq!(after["client_status"], "running", "{after}");
    assert_eq!(started_events(&after), 1, "{after}");
    assert!(alive(pid));
    assert_eq!(
        recorded_task_pid(&agent.data_path(), &alloc_id, "sleep")?,
        pid
    );
    Ok(())
}

#[test]
fn sighup_applies_a_changed_log_level_and_keeps_it_when_the_config_breaks() -> Result<()> {
    let setup = Setup::new()?;
    let notify = NotifySocket::bind(setup.dir.path())?;
    let agent = setup.start(&notify)?;
    notify.until("READY=1", Duration::from_secs(60), &agent)?;
    // At info, nothing logs at debug.
    assert!(!agent.log().contains(" DEBUG "), "{}", agent.log());

    // log_level = "debug", then SIGHUP: RELOADING=1, READY=1, and debug
    // lines from then on.
    setup.write_config("debug")?;
    agent.signal(Signal::SIGHUP)?;
    let reload = notify.until("READY=1", Duration::from_secs(15), &agent)?;
    assert!(count(&reload, "RELOADING=1") >= 1, "{reload:?}");
    assert!(
        reload
            .iter()
            .flat_map(|m| m.lines())
            .any(|l| l.starts_with("MONOTONIC_USEC=")),
        "{reload:?}"
    );
    wait_for("a debug line", Duration::from_secs(15), || {
        let log = agent.log();
        Ok((log.contains("SIGHUP: log level changed") && log.contains(" DEBUG ")).then_some(()))
    })
    .with_context(|| agent.log())?;

    // A config that no longer reads: the error is logged and debug stays.
    std::fs::write(&setup.config, "log_level = \"info\"\nnot_a_key = 1\n")?;
    agent.signal(Signal::SIGHUP)?;
    notify.until("READY=1", Duration::from_secs(15), &agent)?;
    let log = wait_for("the reload error", Duration::from_secs(15), || {
        let log = agent.log();
        Ok(log
            .contains("SIGHUP: the config files do not read; the log level stays")
            .then_some(log))
    })?;
    assert!(log.contains("not_a_key"), "the error names the key:\n{log}");
    let debug_lines = |log: &str| log.matches(" DEBUG ").count();
    let before = debug_lines(&log);
    wait_for("debug lines still", Duration::from_secs(15), || {
        Ok((debug_lines(&agent.log()) > before).then_some(()))
    })
    .with_context(|| agent.log())?;
    Ok(())
}
