//! `raw_exec`: the task is a plain process on the host, in its own process
//! group, with the task dir as its working directory. It runs under a
//! per-task executor (see [`crate::executor`]) that outlives the agent and
//! writes the task's output to the alloc's rotating log files; after a
//! restart the driver reattaches to the executor through its state records
//! and never reopens the logs.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::{Driver, ExitResult, TaskHandle, TaskHandleRecord, TaskSpec};
use crate::error::DriverError;
use crate::executor::{
    self, live_process_start_ticks, ExecutorExit, ExecutorSpec, ExecutorState, StartFailure,
};

/// How long to wait for a process to go after SIGKILL before giving up on it.
const AFTER_SIGKILL: Duration = Duration::from_secs(30);
/// How long the executor may take, from its spawn, to report that the
/// task runs (or could not be started).
pub const EXECUTOR_START_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a reattached executor that has no pidfd is checked.
const EXECUTOR_POLL: Duration = Duration::from_millis(500);

/// How to run the executor: `<program> <args...> <state_dir>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// The executor-only program installed next to the agent's binary.
pub const EXECUTOR_PROGRAM: &str = "berth-executor";
/// How long [`EXECUTOR_PROGRAM`] may take to answer `--version`.
const EXECUTOR_VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`EXECUTOR_PROGRAM`] of `version` answers to `--version`: its
/// version and [`executor::PROTOCOL`].
pub fn executor_version_line(version: &str) -> String {
    format!(
        "{EXECUTOR_PROGRAM} {version} protocol {}",
        executor::PROTOCOL
    )
}

impl ExecutorCommand {
    /// `<this binary> executor`: the agent's hidden subcommand.
    pub fn current_exe() -> ExecutorCommand {
        ExecutorCommand::agent_subcommand(
            &std::env::current_exe().unwrap_or_else(|_| PathBuf::from("berth")),
        )
    }

    fn agent_subcommand(agent: &Path) -> ExecutorCommand {
        ExecutorCommand {
            program: agent.to_path_buf(),
            args: vec!["executor".into()],
        }
    }

    /// The executor this process runs its tasks under, chosen once (the
    /// first call; later calls return the same): [`EXECUTOR_PROGRAM`] next
    /// to this binary when it answers `--version` with this build's
    /// version and protocol, otherwise `<this binary> executor`, with an
    /// info log saying why. Tasks started under either are reattached the
    /// same way (their state records do not name the program).
    pub fn for_agent() -> ExecutorCommand {
        static CHOSEN: std::sync::OnceLock<ExecutorCommand> = std::sync::OnceLock::new();
        CHOSEN
            .get_or_init(|| {
                let agent = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("berth"));
                let (command, fallback) = Self::choose(&agent, env!("CARGO_PKG_VERSION"));
                match fallback {
                    None => info!(executor = %command.program.display(), "tasks run under the executor program"),
                    Some(why) => info!(
                        executor = %command.program.display(),
                        "tasks run under `berth executor` of the agent's own binary: {why}"
                    ),
                }
                command
            })
            .clone()
    }

    /// [`EXECUTOR_PROGRAM`] next to `agent` when its `--version` answer is
    /// exactly [`executor_version_line`] of `version`; otherwise `<agent>
    /// executor` and why.
    pub fn choose(agent: &Path, version: &str) -> (ExecutorCommand, Option<String>) {
        let program = agent
            .parent()
            .unwrap_or_else(|| Path::new("."))
            .join(EXECUTOR_PROGRAM);
        let want = executor_version_line(version);
        let why = match executor_version(&program) {
            Ok(got) if got == want => {
                return (
                    ExecutorCommand {
                        program,
                        args: vec![],
                    },
                    None,
                )
            }
            Ok(got) => format!(
                "{} is of another build: it answers {got:?}, this agent needs {want:?}",
                program.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                format!("{} is missing", program.display())
            }
            Err(e) => format!("{} --version failed: {e}", program.display()),
        };
        (ExecutorCommand::agent_subcommand(agent), Some(why))
    }
}

/// The first line `program --version` prints (trimmed), once it exits 0
/// within [`EXECUTOR_VERSION_TIMEOUT`].
fn executor_version(program: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut child = std::process::Command::new(program)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = std::time::Instant::now() + EXECUTOR_VERSION_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {EXECUTOR_VERSION_TIMEOUT:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    if !status.success() {
        return Err(std::io::Error::other(format!("it exited with {status}")));
    }
    let mut out = String::new();
    if let Some(stdout) = child.stdout.take() {
        stdout.take(4096).read_to_string(&mut out)?;
    }
    Ok(out.lines().next().unwrap_or_default().trim().to_string())
}

#[derive(Debug, Clone)]
pub struct RawExecDriver {
    executor: ExecutorCommand,
    start_timeout: Duration,
    /// Off: new tasks are refused, the ones already started are still
    /// reattached to and stopped.
    enabled: bool,
    /// The uids and gids its tasks may not run as (the agent's own
    /// included, for a task that names no user).
    denied: crate::users::DeniedIds,
}

/// Why a node without `raw_exec` turned on runs no raw_exec task, and how
/// to turn it on.
pub const RAW_EXEC_DISABLED: &str = "raw_exec is not enabled on this node (a task runs as root, \
     held to nothing; enable it with plugin \"raw_exec\" { config { enabled = true } } in the \
     agent config, or use the exec driver)";

impl Default for RawExecDriver {
    fn default() -> Self {
        RawExecDriver::with_executor(ExecutorCommand::for_agent())
    }
}

impl RawExecDriver {
    /// Runs tasks under [`ExecutorCommand::for_agent`].
    pub fn new() -> RawExecDriver {
        RawExecDriver::default()
    }

    pub fn with_executor(executor: ExecutorCommand) -> RawExecDriver {
        RawExecDriver {
            executor,
            start_timeout: EXECUTOR_START_TIMEOUT,
            enabled: true,
            denied: crate::users::DeniedIds::default(),
        }
    }

    /// Its tasks may not run as the uids and gids of `denied`.
    pub fn denying(mut self, denied: crate::users::DeniedIds) -> RawExecDriver {
        self.denied = denied;
        self
    }

    /// The driver of a node that has not turned raw_exec on: it starts no
    /// task (see [`RAW_EXEC_DISABLED`]) but finds and stops those an
    /// earlier agent started.
    pub fn disabled(mut self) -> RawExecDriver {
        self.enabled = false;
        self
    }

    /// How long an executor may take to report its task's start before it
    /// is given up on ([`EXECUTOR_START_TIMEOUT`] unless set).
    pub fn with_start_timeout(mut self, timeout: Duration) -> RawExecDriver {
        self.start_timeout = timeout;
        self
    }

    /// Starts the executor for `spec` in a session of its own, its log in
    /// the executor dir, and hands it the spec on its stdin.
    fn spawn_executor(
        &self,
        spec: &TaskSpec,
        run_as: Option<(u32, u32)>,
    ) -> Result<ExecutorStart, DriverError> {
        let dir = &spec.executor_dir;
        prepare_executor_dir(dir).map_err(|error| DriverError::Spawn {
            command: spec.command.clone(),
            error,
        })?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(crate::logs::LOG_FILE_MODE)
            .open(dir.join(executor::LOG_FILE))
            .map_err(|error| DriverError::Logs {
                path: dir.join(executor::LOG_FILE),
                error,
            })?;
        let exec_spec = ExecutorSpec {
            command: program_path(spec),
            args: spec.args.clone(),
            env: spec.env.clone(),
            cwd: spec.task_dir.clone(),
            stdout_path: spec.stdout_path.clone(),
            stderr_path: spec.stderr_path.clone(),
            logs: spec.logs,
            cgroup_procs: spec.cgroup_procs.clone(),
            isolation: spec.isolation.clone(),
            run_as,
            disconnect: spec.disconnect.clone(),
        };
        let input = serde_json::to_vec(&exec_spec).map_err(|e| DriverError::Spawn {
            command: spec.command.clone(),
            error: std::io::Error::other(e),
        })?;
        let program = self.executor.program.clone();
        let mut command = tokio::process::Command::new(&program);
        command
            .args(&self.executor.args)
            .arg(dir)
            .env_clear()
            .stdin(Stdio::piped())
            // Where it reports that its state is recorded.
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(false);
        // A session (and so a process group) of its own from its first
        // instruction: a signal to the agent's group or terminal never
        // reaches it, not even before it has read its spec.
        // SAFETY: the closure runs in the forked child before exec and only
        // calls setsid, which is async-signal-safe and touches no memory.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|error| DriverError::Executor {
            program: program.clone(),
            error,
        })?;
        Ok(ExecutorStart {
            child,
            input,
            deadline: Instant::now() + self.start_timeout,
        })
    }

    /// Sends the executor its spec and waits, until the start deadline,
    /// for the state it records: the running task, or why it did not
    /// start. An executor given up on is killed.
    async fn await_started(
        &self,
        start: &mut ExecutorStart,
        spec: &TaskSpec,
    ) -> Result<ExecutorState, DriverError> {
        let dir = &spec.executor_dir;
        let timeout = self.start_timeout;
        let (child, deadline) = (&mut start.child, start.deadline);
        let executor_failed = |message: String| executor_failed(spec, message);
        if let Some(mut stdin) = child.stdin.take() {
            // A failed write shows as the executor exiting without a state;
            // one that does not read its spec is given up on at the deadline.
            match tokio::time::timeout_at(deadline, stdin.write_all(&start.input)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    warn!(alloc_id = %spec.alloc_id, task = %spec.task, error = %e, "sending the spec to the executor")
                }
                Err(_) => {
                    abandon_start(child, dir).await;
                    return Err(executor_failed(format!(
                        "it did not read its spec within {timeout:?}"
                    )));
                }
            }
        }
        let Some(mut reports) = child.stdout.take() else {
            abandon_start(child, dir).await;
            return Err(executor_failed("its stdout is not a pipe".into()));
        };
        // Woken by the executor's report, by its exit, or by the deadline:
        // never by a timer that looks for the state record.
        let ended = tokio::time::timeout_at(deadline, async {
            let mut byte = [0u8; 1];
            tokio::select! {
                biased;
                read = reports.read(&mut byte) => match read {
                    // The report, or its stdout closed: it has exited or
                    // will, without a report.
                    Ok(n) => StartReport::Reported(n == 1),
                    Err(e) => {
                        debug!(error = %e, "reading the executor's report");
                        StartReport::Reported(false)
                    }
                },
                status = child.wait() => StartReport::Exited(status),
            }
        })
        .await;
        drop(reports);
        let read_state = || executor::read_record::<ExecutorState>(dir, executor::STATE_FILE);
        let state = match ended {
            Err(_) => None,
            Ok(StartReport::Reported(true)) => match read_state() {
                Ok(Some(state)) => Some(state),
                Ok(None) => {
                    abandon_start(child, dir).await;
                    return Err(executor_failed(
                        "it reported its state, but none is recorded".into(),
                    ));
                }
                Err(e) => {
                    abandon_start(child, dir).await;
                    return Err(executor_failed(format!("reading its state: {e}")));
                }
            },
            // No report: only its exit (or the deadline) is left to wait for.
            Ok(StartReport::Reported(false)) => {
                match tokio::time::timeout_at(deadline, child.wait()).await {
                    Ok(status) => {
                        exited_without_state(status, dir, read_state(), &executor_failed)?
                    }
                    Err(_) => None,
                }
            }
            Ok(StartReport::Exited(status)) => {
                exited_without_state(status, dir, read_state(), &executor_failed)?
            }
        };
        let Some(state) = state else {
            abandon_start(child, dir).await;
            return Err(executor_failed(format!(
                "the task did not start within {timeout:?}: {}",
                executor_log(dir)
            )));
        };
        Ok(state)
    }

    /// The handle of the task the executor started, as its recorded
    /// `state` says; the error of a start that failed.
    async fn handle_of(
        &self,
        start: ExecutorStart,
        spec: &TaskSpec,
        state: ExecutorState,
    ) -> Result<Arc<dyn TaskHandle>, DriverError> {
        let dir = &spec.executor_dir;
        let mut child = start.child;
        if let ExecutorState::StartFailed { kind, message } = state {
            let _ = child.wait().await;
            let command = spec.command.clone();
            return Err(match kind {
                StartFailure::NotFound => DriverError::CommandNotFound { command },
                StartFailure::PermissionDenied => DriverError::PermissionDenied { command },
                StartFailure::Other => DriverError::Spawn {
                    command,
                    error: std::io::Error::other(message),
                },
            });
        }
        let Some(record) = TaskHandleRecord::from_state(self.name(), dir, &state) else {
            abandon_start(&mut child, dir).await;
            return Err(executor_failed(
                spec,
                "its state names no running task".into(),
            ));
        };
        debug!(alloc_id = %spec.alloc_id, task = %spec.task, pid = record.task_pid, executor_pid = record.executor_pid, "started raw_exec task");
        let (tx, exit) = watch::channel(None);
        let waited = record.clone();
        tokio::spawn(async move {
            if let Err(e) = child.wait().await {
                warn!(executor_pid = waited.executor_pid, error = %e, "waiting for the executor; polling it");
                until_gone(&waited).await;
            }
            tx.send_replace(Some(exit_of(&waited).await));
        });
        Ok(Arc::new(ExecutorHandle { record, exit }))
    }
}

/// An executor just spawned: the spec it is to read, and when its task
/// must have started.
struct ExecutorStart {
    child: tokio::process::Child,
    input: Vec<u8>,
    deadline: Instant,
}

/// The executor of `spec` failed with `message`.
fn executor_failed(spec: &TaskSpec, message: String) -> DriverError {
    DriverError::ExecutorFailed {
        command: spec.command.clone(),
        message,
    }
}

/// A relative command with a `/` is relative to the task dir.
fn program_path(spec: &TaskSpec) -> PathBuf {
    let p = Path::new(&spec.command);
    if p.is_relative() && spec.command.contains('/') {
        spec.task_dir.join(p)
    } else {
        p.to_path_buf()
    }
}

/// Makes the executor's state dir (0700) and removes the records of a
/// previous run.
fn prepare_executor_dir(dir: &Path) -> Result<(), std::io::Error> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    for name in [executor::STATE_FILE, executor::EXIT_FILE] {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn executor_log(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join(executor::LOG_FILE)).unwrap_or_default();
    let text = text.trim();
    if text.is_empty() {
        "no output".into()
    } else {
        text.lines().last().unwrap_or_default().to_string()
    }
}

#[async_trait::async_trait]
impl Driver for RawExecDriver {
    fn name(&self) -> &'static str {
        "raw_exec"
    }

    /// Healthy while the executor program is an executable file: every
    /// task runs under it.
    fn fingerprint(&self) -> berth_structs::DriverInfo {
        use std::os::unix::fs::PermissionsExt;
        if !self.enabled {
            return berth_structs::DriverInfo {
                detected: false,
                ..berth_structs::DriverInfo::unhealthy(RAW_EXEC_DISABLED)
            };
        }
        let program = &self.executor.program;
        match std::fs::metadata(program) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {
                berth_structs::DriverInfo::healthy("Healthy")
            }
            Ok(_) => berth_structs::DriverInfo::unhealthy(format!(
                "the executor {} is not an executable file",
                program.display()
            )),
            Err(e) => berth_structs::DriverInfo::unhealthy(format!(
                "the executor {} cannot be read: {e}",
                program.display()
            )),
        }
    }

    async fn start(&self, spec: &TaskSpec) -> Result<Arc<dyn TaskHandle>, DriverError> {
        if !self.enabled {
            return Err(DriverError::refused(&spec.command, RAW_EXEC_DISABLED));
        }
        if !spec.task_dir.is_dir() {
            return Err(DriverError::Spawn {
                command: spec.command.clone(),
                error: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("working directory {} is missing", spec.task_dir.display()),
                ),
            });
        }
        let dir = &spec.executor_dir;
        // An executor of an earlier run that still runs (the agent lost the
        // handle it persisted) keeps its task: reattach, never start a
        // second copy next to it.
        if let Some(record) = TaskHandleRecord::from_executor_dir(self.name(), dir) {
            if executor_alive(&record) {
                info!(
                    alloc_id = %spec.alloc_id,
                    task = %spec.task,
                    pid = record.task_pid,
                    executor_pid = record.executor_pid,
                    "the task's executor still runs; reattaching instead of starting it again"
                );
                return self.reattach(&record).await;
            }
        }
        let run_as = crate::users::run_as(spec, &self.denied)?;
        let mut start = self.spawn_executor(spec, run_as)?;
        let state = self.await_started(&mut start, spec).await?;
        self.handle_of(start, spec, state).await
    }

    async fn reattach(
        &self,
        record: &TaskHandleRecord,
    ) -> Result<Arc<dyn TaskHandle>, DriverError> {
        let (tx, exit) = watch::channel(None);
        match open_executor(record) {
            ExecutorWatch::Poll => {
                warn!(
                    pid = record.task_pid,
                    executor_pid = record.executor_pid,
                    "reattached to a running executor that cannot be watched through a pidfd; polling it"
                );
                let waited = record.clone();
                tokio::spawn(async move {
                    until_gone(&waited).await;
                    tx.send_replace(Some(exit_of(&waited).await));
                });
            }
            ExecutorWatch::Pidfd(pidfd) => {
                debug!(
                    pid = record.task_pid,
                    executor_pid = record.executor_pid,
                    "reattached to a running executor"
                );
                let waited = record.clone();
                tokio::spawn(async move {
                    // SAFETY: the AsyncFd owns the OwnedFd, which stays open
                    // and names the same pidfd until the AsyncFd is dropped.
                    let registered = unsafe {
                        AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
                    };
                    match registered {
                        Ok(fd) => {
                            // Readable once the process has exited. An
                            // error says nothing about the process.
                            if fd.readable().await.is_err() {
                                until_gone(&waited).await;
                            }
                        }
                        Err(e) => {
                            warn!(executor_pid = waited.executor_pid, error = %e, "watching the executor; polling instead");
                            until_gone(&waited).await;
                        }
                    }
                    tx.send_replace(Some(exit_of(&waited).await));
                });
            }
            ExecutorWatch::Gone => {
                debug!(
                    pid = record.task_pid,
                    executor_pid = record.executor_pid,
                    "the task's executor is gone"
                );
                tx.send_replace(Some(exit_of(record).await));
            }
        }
        Ok(Arc::new(ExecutorHandle {
            record: record.clone(),
            exit,
        }))
    }
}

/// What ended the wait for an executor's start.
enum StartReport {
    /// Its stdout gave the report (`true`) or closed without it.
    Reported(bool),
    /// It exited.
    Exited(std::io::Result<std::process::ExitStatus>),
}

/// The state an executor that `status` ended recorded before it exited
/// (`recorded`, read after its exit), or why it has none.
fn exited_without_state(
    status: std::io::Result<std::process::ExitStatus>,
    dir: &Path,
    recorded: std::io::Result<Option<ExecutorState>>,
    executor_failed: &dyn Fn(String) -> DriverError,
) -> Result<Option<ExecutorState>, DriverError> {
    if let Ok(Some(state)) = recorded {
        return Ok(Some(state));
    }
    let how = match status {
        Ok(status) => status.to_string(),
        Err(e) => format!("waiting for it: {e}"),
    };
    Err(executor_failed(format!(
        "it exited ({how}) before the task started: {}",
        executor_log(dir)
    )))
}

/// How to learn that a reattached executor has exited.
enum ExecutorWatch {
    /// The recorded executor no longer runs (or its pid was reused).
    Gone,
    /// Readable once it exits.
    Pidfd(OwnedFd),
    /// It runs but no pidfd could be had (no pidfd_open, seccomp, out of
    /// fds): poll its pid and start time.
    Poll,
}

/// Returns once the record's executor is gone, looking every
/// [`EXECUTOR_POLL`].
async fn until_gone(record: &TaskHandleRecord) {
    while executor_alive(record) {
        tokio::time::sleep(EXECUTOR_POLL).await;
    }
}

/// Whether the record's executor still runs: its pid names a process with
/// the recorded start time (the pid was not reused).
fn executor_alive(record: &TaskHandleRecord) -> bool {
    record.executor_pid != 0
        && live_process_start_ticks(record.executor_pid) == Some(record.executor_start_ticks)
}

/// How to watch the record's executor. Only a process that is not the
/// recorded one makes it [`ExecutorWatch::Gone`]; a failing pidfd_open
/// never does.
fn open_executor(record: &TaskHandleRecord) -> ExecutorWatch {
    let pid = record.executor_pid;
    if !executor_alive(record) {
        return ExecutorWatch::Gone;
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        let error = std::io::Error::last_os_error();
        return if error.raw_os_error() == Some(libc::ESRCH) {
            ExecutorWatch::Gone
        } else {
            debug!(executor_pid = pid, error = %error, "pidfd_open failed");
            ExecutorWatch::Poll
        };
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // Checked again with the fd held: the fd names the process we checked.
    if executor_alive(record) {
        ExecutorWatch::Pidfd(fd)
    } else {
        ExecutorWatch::Gone
    }
}

/// Gives up on an executor that did not report its task in time: kills
/// it, waits for it, and kills the task's group too if it had started
/// the task (its own group, which the executor's death does not reach).
async fn abandon_start(child: &mut tokio::process::Child, dir: &Path) {
    let _ = child.start_kill();
    if tokio::time::timeout(AFTER_SIGKILL, child.wait())
        .await
        .is_err()
    {
        warn!(executor_dir = %dir.display(), "the executor did not exit after SIGKILL");
    }
    let Some(record) = TaskHandleRecord::from_executor_dir("raw_exec", dir) else {
        return;
    };
    if task_alive(&record) {
        warn!(
            pid = record.task_pid,
            "the abandoned executor had started its task; killing the task"
        );
        match signal_group(record.pgid, Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => warn!(pgid = record.pgid, error = %e, "killing the task's process group"),
        }
    }
}

/// Signals a task's process group. A group of 0 or 1 (the caller's own, or
/// every process) never comes from a started task: a record that says so
/// is refused, not obeyed.
fn signal_group(pgid: i32, signal: Signal) -> Result<(), Errno> {
    if pgid <= 1 {
        return Err(Errno::EINVAL);
    }
    killpg(Pid::from_raw(pgid), signal)
}

/// Whether the record's task process still runs (not reused, not a zombie).
fn task_alive(record: &TaskHandleRecord) -> bool {
    record.task_pid != 0
        && live_process_start_ticks(record.task_pid) == Some(record.task_start_ticks)
}

/// How long a task its executor left running may take to die of the
/// SIGKILL it is sent.
const ORPHAN_KILL_WAIT: Duration = Duration::from_secs(10);

/// The exit the executor recorded, once it is gone. An executor that died
/// without recording one leaves its task unwatched: the task is killed,
/// and the exit is known only once it is gone, so that nothing the task
/// held (a volume's claim, its mounts) is let go while it still runs.
async fn exit_of(record: &TaskHandleRecord) -> ExitResult {
    match executor::read_record::<ExecutorExit>(&record.executor_dir, executor::EXIT_FILE) {
        Ok(Some(e)) => ExitResult {
            exit_code: e.exit_code,
            signal: e.signal,
            error: None,
            oom_killed: None,
            disconnected: e.disconnected,
        },
        Ok(None) => {
            if task_alive(record) {
                warn!(
                    pid = record.task_pid,
                    "the executor died and left its task running; killing the task"
                );
                let _ = signal_group(record.pgid, Signal::SIGKILL);
                let deadline = tokio::time::Instant::now() + ORPHAN_KILL_WAIT;
                while task_alive(record) && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if task_alive(record) {
                    error!(
                        pid = record.task_pid,
                        "the task its executor left is still running {ORPHAN_KILL_WAIT:?} after SIGKILL"
                    );
                }
            }
            ExitResult {
                error: Some(format!(
                    "the executor (pid {}) died without recording the task's exit: {}",
                    record.executor_pid,
                    executor_log(&record.executor_dir)
                )),
                ..ExitResult::default()
            }
        }
        Err(e) => ExitResult {
            error: Some(format!("reading the task's recorded exit: {e}")),
            ..ExitResult::default()
        },
    }
}

struct ExecutorHandle {
    record: TaskHandleRecord,
    exit: watch::Receiver<Option<ExitResult>>,
}

#[async_trait::async_trait]
impl TaskHandle for ExecutorHandle {
    fn pid(&self) -> u32 {
        self.record.task_pid
    }

    fn record(&self) -> Option<TaskHandleRecord> {
        Some(self.record.clone())
    }

    async fn wait(&self) -> ExitResult {
        let mut rx = self.exit.clone();
        let exit = rx
            .wait_for(|e| e.is_some())
            .await
            .map(|e| e.clone().unwrap_or_default());
        match exit {
            Ok(exit) => exit,
            // The waiter sends an exit only once the executor is gone; it
            // goes away without one only with the runtime it ran on, when
            // the agent shuts down and leaves its tasks running. The task
            // has not exited: nothing may act as if it had (its volumes
            // would be unbound under it). The caller goes with the runtime.
            Err(_) => std::future::pending().await,
        }
    }

    fn try_exit(&self) -> Option<ExitResult> {
        self.exit.borrow().clone()
    }

    fn signal(&self, signal: Signal) -> Result<(), DriverError> {
        if self.try_exit().is_some() {
            return Ok(());
        }
        match signal_group(self.record.pgid, signal) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(errno) => Err(DriverError::Signal {
                pgid: self.record.pgid,
                errno,
            }),
        }
    }

    async fn stop(&self, kill_timeout: Duration) -> ExitResult {
        let pid = self.record.task_pid;
        // The executor kills what is left of the group before it records
        // the exit, while the leader's zombie still holds the group id; a
        // kill from here after that could reach a group that reused it.
        if let Some(exit) = self.try_exit() {
            return exit;
        }
        if let Err(e) = self.signal(Signal::SIGTERM) {
            warn!(pid, error = %e, "sending SIGTERM");
        }
        if let Ok(exit) = tokio::time::timeout(kill_timeout, self.wait()).await {
            return exit;
        }
        warn!(
            pid,
            ?kill_timeout,
            "task did not exit after SIGTERM; sending SIGKILL"
        );
        if let Err(e) = self.signal(Signal::SIGKILL) {
            warn!(pid, error = %e, "sending SIGKILL");
        }
        match tokio::time::timeout(AFTER_SIGKILL, self.wait()).await {
            Ok(exit) => exit,
            Err(_) => ExitResult {
                error: Some(format!(
                    "process {pid} did not exit {AFTER_SIGKILL:?} after SIGKILL"
                )),
                ..ExitResult::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::{CommandExt, ExitStatusExt};

    use super::*;

    /// Writes an executable shell script `dir`/`name` and waits until it
    /// can be run (a process forked meanwhile by another test may briefly
    /// hold it open for writing: ETXTBSY).
    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match std::process::Command::new(&path)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
            {
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                    assert!(std::time::Instant::now() < deadline, "{e}");
                    std::thread::sleep(Duration::from_millis(5));
                }
                _ => return path,
            }
        }
    }

    /// The runtime a task's waiter ran on shuts down (the agent goes
    /// away and leaves its tasks running): the task has not exited, and
    /// its handle never says it has (its runner would unbind its volumes).
    #[tokio::test]
    async fn a_handle_whose_waiter_went_away_never_reports_an_exit() {
        let (tx, exit) = watch::channel(None);
        let handle = ExecutorHandle {
            record: TaskHandleRecord {
                driver: "raw_exec".into(),
                executor_dir: PathBuf::new(),
                executor_pid: 0,
                executor_start_ticks: 0,
                task_pid: 0,
                pgid: 0,
                task_start_ticks: 0,
                started_at_ms: 0,
                cgroup: Vec::new(),
            },
            exit,
        };
        drop(tx);
        let waited = tokio::time::timeout(Duration::from_millis(200), handle.wait()).await;
        assert!(waited.is_err(), "wait answered {waited:?}");
        assert_eq!(handle.try_exit(), None);
    }

    #[test]
    fn the_agent_falls_back_to_its_own_executor_when_berth_executor_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("berth");
        let (command, why) = ExecutorCommand::choose(&agent, "1.2.3");
        assert_eq!(
            command,
            ExecutorCommand {
                program: agent.clone(),
                args: vec!["executor".into()]
            }
        );
        let why = why.expect("a reason for the fallback");
        assert!(why.contains("missing"), "{why}");
        assert!(
            why.contains(&dir.path().join(EXECUTOR_PROGRAM).display().to_string()),
            "{why}"
        );
    }

    #[test]
    fn the_agent_falls_back_to_its_own_executor_when_berth_executor_is_of_another_version() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("berth");
        let other = format!("{EXECUTOR_PROGRAM} 1.2.4 protocol {}", executor::PROTOCOL);
        script(dir.path(), EXECUTOR_PROGRAM, &format!("echo '{other}'"));
        let (command, why) = ExecutorCommand::choose(&agent, "1.2.3");
        assert_eq!(command.program, agent);
        assert_eq!(command.args, ["executor"]);
        let why = why.expect("a reason for the fallback");
        assert!(why.contains(&other), "names the found version: {why}");
        assert!(
            why.contains(&executor_version_line("1.2.3")),
            "names the agent's version: {why}"
        );

        // The same version of another protocol is another version too.
        let other = format!(
            "{EXECUTOR_PROGRAM} 1.2.3 protocol {}",
            executor::PROTOCOL + 1
        );
        script(dir.path(), EXECUTOR_PROGRAM, &format!("echo '{other}'"));
        let (command, why) = ExecutorCommand::choose(&agent, "1.2.3");
        assert_eq!(command.program, agent);
        assert!(why.expect("a fallback").contains(&other));

        // A program that fails its --version is not used either.
        script(dir.path(), EXECUTOR_PROGRAM, "echo oops >&2; exit 3");
        let (command, why) = ExecutorCommand::choose(&agent, "1.2.3");
        assert_eq!(command.program, agent);
        assert!(why.expect("a fallback").contains("failed"));
    }

    #[test]
    fn the_agent_runs_berth_executor_of_its_own_version_and_protocol() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("berth");
        let program = script(
            dir.path(),
            EXECUTOR_PROGRAM,
            &format!("echo '{}'", executor_version_line("1.2.3")),
        );
        let (command, why) = ExecutorCommand::choose(&agent, "1.2.3");
        assert_eq!(why, None);
        assert_eq!(
            command,
            ExecutorCommand {
                program,
                args: vec![]
            }
        );
    }

    #[test]
    fn raw_exec_is_healthy_only_while_its_executor_is_an_executable_file() {
        let dir = tempfile::tempdir().unwrap();
        let driver = |program: PathBuf| {
            RawExecDriver::with_executor(ExecutorCommand {
                program,
                args: vec![],
            })
        };
        let healthy = driver(PathBuf::from("/bin/sh")).fingerprint();
        assert!(healthy.detected && healthy.healthy, "{healthy:?}");
        assert!(healthy.update_time_ms > 0);

        let missing = dir.path().join("gone");
        let info = driver(missing.clone()).fingerprint();
        assert!(info.detected && !info.healthy, "{info:?}");
        assert!(
            info.health_description
                .contains(&missing.display().to_string()),
            "{info:?}"
        );

        let plain = dir.path().join("plain");
        std::fs::write(&plain, "").unwrap();
        let info = driver(plain).fingerprint();
        assert!(!info.healthy);
        assert!(
            info.health_description.contains("not an executable file"),
            "{info:?}"
        );
    }

    /// An executor given up on after it started its task (its state shows
    /// the task running) takes the task's group down with it.
    #[tokio::test]
    async fn abandoning_a_start_kills_a_task_the_executor_had_started() {
        let dir = tempfile::tempdir().unwrap();
        let mut executor = tokio::process::Command::new("sleep")
            .arg("1000")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut task = std::process::Command::new("sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .unwrap();
        struct Reap<'a>(&'a mut std::process::Child);
        impl Drop for Reap<'_> {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let task_pid = task.id();
        let task = Reap(&mut task);
        let executor_pid = executor.id().unwrap();
        let state = ExecutorState::Running {
            executor_pid,
            executor_start_ticks: live_process_start_ticks(executor_pid).unwrap(),
            task_pid,
            pgid: task_pid as i32,
            task_start_ticks: live_process_start_ticks(task_pid).unwrap(),
            started_at_ms: 0,
            cgroup: Vec::new(),
        };
        executor::write_record(dir.path(), executor::STATE_FILE, &state).unwrap();

        abandon_start(&mut executor, dir.path()).await;

        assert!(
            executor.try_wait().unwrap().is_some(),
            "the executor is gone"
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = task.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the task was left running"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}
