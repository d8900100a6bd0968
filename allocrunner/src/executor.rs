//! The per-task executor: a tiny process (the agent binary's hidden
//! `executor` subcommand) that owns one run of one task.
//!
//! It reads an [`ExecutorSpec`] as JSON on stdin, becomes a session leader
//! so that it outlives the agent, starts the task in its own process group
//! (working directory, environment, stdout and stderr on pipes that it
//! copies into rotating log files, see [`crate::logs`]), records
//! [`ExecutorState`] in `<state_dir>/state.json`, waits for the task, drains
//! its output, records its [`ExecutorExit`] in `<state_dir>/exit.json`, then
//! exits.
//! Once `state.json` is written (the task runs, or could not be started)
//! it says so on its stdout: one byte, [`STATE_WRITTEN`], on the pipe the
//! driver waits on, so the driver learns of the start without looking for
//! the file; its stdout is `/dev/null` from then on. An executor that dies
//! first closes the pipe without that byte.
//! Both files are written atomically (temp file, rename), so a reader never
//! sees half a record. `exit.json` is synced too (the file, then the
//! directory): it is the one word on a task that finished while no agent
//! ran, and must outlive a crash of the machine. `state.json` is not: it
//! describes processes that no crash of the machine leaves running, and a
//! record lost or cut short by one reads as no record, as when the executor
//! never ran. It uses plain `std`
//! and `nix`: no async runtime, no logging framework, no agent state.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::logs::{LogRotation, RotatingWriter};

/// Written once the task runs, or once it could not be started.
pub const STATE_FILE: &str = "state.json";
/// Written once the task has exited.
pub const EXIT_FILE: &str = "exit.json";
/// The executor's own stderr.
pub const LOG_FILE: &str = "executor.log";
/// The executor's protocol with the agent: bumped whenever
/// [`ExecutorSpec`], [`ExecutorState`], [`ExecutorExit`] or how the
/// executor reports its start ([`STATE_WRITTEN`]) change in a way an
/// executor and an agent of different builds would not both understand.
/// A separate executor program answers `--version` with it, and the agent
/// uses that program only when its version and protocol are its own.
///
/// 2: the executor writes [`STATE_WRITTEN`] on its stdout once `state.json`
/// is written (1 wrote nothing there; its agent looked for the file).
/// 3: [`ExecutorSpec::cgroup_procs`], which the task joins, and
/// [`ExecutorSpec::isolation`], the init of an isolated task.
/// 4: [`ExecutorSpec::disconnect`], the window the executor holds the task
/// to, and [`ExecutorExit::disconnected`].
pub const PROTOCOL: u32 = 4;
/// What the executor writes on its stdout once `state.json` is written.
pub const STATE_WRITTEN: u8 = b'\n';

/// How long the task's output is still read after the task has exited,
/// while something it left behind (outside its process group) keeps the
/// pipes open.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// What the executor runs. Sent on its stdin, never written to disk (the
/// environment may hold credentials).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecutorSpec {
    /// Resolved: absolute, or a bare name looked up in the task's `PATH`.
    pub command: PathBuf,
    pub args: Vec<String>,
    /// The whole environment of the task.
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    /// Where the task's output goes: `<stdout_path>.0`, `.1`, ... (see
    /// [`crate::logs`]).
    pub stdout_path: PathBuf,
    pub stderr_path: PathBuf,
    #[serde(default)]
    pub logs: LogRotation,
    /// The `cgroup.procs` files of the task's cgroup (an `exec` task): the
    /// task joins them before it execs, so every process it starts is in
    /// them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroup_procs: Vec<PathBuf>,
    /// The task's namespaces, root and user (an `exec` task): the
    /// executor starts an init in them (see [`crate::isolation`]), which
    /// starts the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<crate::isolation::Isolation>,
    /// The uid and gid a task without isolation runs as (its `user`);
    /// None: the executor's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<(u32, u32)>,
    /// The group's disconnect window, which the executor holds the task
    /// to whether the agent runs or not (see [`crate::lease`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disconnect: Option<crate::lease::DisconnectWatch>,
}

/// Why a task could not be started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartFailure {
    NotFound,
    PermissionDenied,
    Other,
}

/// `state.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ExecutorState {
    Running {
        executor_pid: u32,
        /// The executor's own start time, like `task_start_ticks`.
        executor_start_ticks: u64,
        task_pid: u32,
        /// The task's process group (its pid).
        pgid: i32,
        /// The task's start time in clock ticks since boot
        /// (`/proc/<pid>/stat` field 22): tells a reused pid apart.
        task_start_ticks: u64,
        started_at_ms: i64,
        /// The directories of the cgroup the task joined (an `exec` task).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cgroup: Vec<PathBuf>,
    },
    StartFailed {
        kind: StartFailure,
        message: String,
    },
}

/// `exit.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutorExit {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub finished_at_ms: i64,
    /// The executor stopped the task: its disconnect window closed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disconnected: bool,
}

/// The start time of `pid` in clock ticks since boot, `None` when there is
/// no such process (or it is a zombie already reaped).
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command (field 2) is in parentheses and may hold spaces; fields
    // after it start with field 3 (state). Field 22 is starttime.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split(' ').nth(19)?.parse().ok()
}

/// Like [`process_start_ticks`], but `None` for a zombie too: a process
/// that has exited and waits to be reaped.
pub fn live_process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    if rest.starts_with('Z') || rest.starts_with('X') {
        return None;
    }
    rest.split(' ').nth(19)?.parse().ok()
}

/// Writes `value` as JSON to `dir/name` atomically and durably (synced).
pub fn write_record<T: Serialize>(dir: &Path, name: &str, value: &T) -> std::io::Result<()> {
    write_record_with(dir, name, value, true)
}

/// Writes `value` as JSON to `dir/name` atomically: every reader sees the
/// old record or the new one, whatever process dies when. Not synced: a
/// crash of the machine may lose it (see the module's doc for why
/// `state.json` may be).
fn write_state_record<T: Serialize>(dir: &Path, name: &str, value: &T) -> std::io::Result<()> {
    write_record_with(dir, name, value, false)
}

fn write_record_with<T: Serialize>(
    dir: &Path,
    name: &str,
    value: &T,
    sync: bool,
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        if sync {
            f.sync_all()?;
        }
    }
    std::fs::rename(&tmp, dir.join(name))?;
    if sync {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Reads `dir/name`; `Ok(None)` when it does not exist.
pub fn read_record<T: for<'de> Deserialize<'de>>(
    dir: &Path,
    name: &str,
) -> std::io::Result<Option<T>> {
    match std::fs::read(dir.join(name)) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(std::io::Error::other),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A rotating writer for the log files named by `base` (`<dir>/<name>`).
fn open_log(base: &Path, rotation: LogRotation) -> std::io::Result<RotatingWriter> {
    let (Some(dir), Some(name)) = (base.parent(), base.file_name().and_then(|n| n.to_str())) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} names no log file", base.display()),
        ));
    };
    RotatingWriter::open(dir, name, rotation)
}

/// How much of the task's output is read at once: a pipe's default
/// capacity.
const READ_SIZE: usize = 64 * 1024;

/// Copies what the task writes on `pipe` into `log` until every writer has
/// closed the pipe, then says so on `done`. Says on `started` when it is
/// about to read: the thread has run its start. Never stops reading
/// because of the log: a task is never blocked on a full disk.
fn copy_output(
    pipe: OwnedFd,
    mut log: RotatingWriter,
    started: std::sync::mpsc::Sender<()>,
    done: std::sync::mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        // Never written but by `read`: a task that writes little keeps the
        // buffer's pages untouched, out of the executor's memory.
        let mut buf = Vec::with_capacity(READ_SIZE);
        let _ = started.send(());
        drop(started);
        loop {
            match read_into(&pipe, &mut buf) {
                Ok(0) => break,
                Ok(_) => log.write_chunk(&buf),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    eprintln!("berth executor: reading the task's output: {e}");
                    break;
                }
            }
        }
        if log.dropped() > 0 {
            eprintln!(
                "berth executor: {} bytes of output to {} were dropped",
                log.dropped(),
                log.current_path().display()
            );
        }
        let _ = done.send(());
    });
}

/// Reads from `fd` into `buf`'s free capacity, replacing what `buf`
/// held; the number of bytes read.
fn read_into(fd: &OwnedFd, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    buf.clear();
    let spare = buf.spare_capacity_mut();
    // SAFETY: read(2) writes at most `spare.len()` bytes at `spare`, memory
    // that `buf` owns and that outlives the call.
    let n = unsafe { libc::read(fd.as_raw_fd(), spare.as_mut_ptr().cast(), spare.len()) };
    let Ok(n) = usize::try_from(n) else {
        return Err(std::io::Error::last_os_error());
    };
    // SAFETY: the kernel initialised the first `n` bytes, `n <= capacity`.
    unsafe { buf.set_len(n) };
    Ok(n)
}

/// One malloc arena for all the executor's threads, not one for each
/// copy thread: an arena costs its first pages even when little is
/// allocated in it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn limit_arenas() {
    // SAFETY: mallopt only sets malloc's tunables; called before the
    // executor starts any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn limit_arenas() {}

/// What the executor holds on to once its task runs, for days: neither
/// the heap the start used (the spec, the command) nor the pages of the
/// program's read-only segments (its code and constants, and the
/// relocation tables the loader read once at start). Those are the agent
/// binary's pages, in the page cache and shared with the agent: this only
/// takes them out of the executor's page tables, and what the executor
/// runs later (the copy loop, recording the exit) is mapped back from the
/// page cache when it is touched. Writable segments (the relocated data
/// among them) are left alone: their pages are the executor's own.
fn release_start_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    #[cfg(target_os = "linux")]
    release_program_pages();
}

/// Unmaps the pages of the program's read-only loaded segments from this
/// process (`MADV_DONTNEED`): they are clean file pages, mapped back from
/// the page cache on their next touch.
#[cfg(target_os = "linux")]
fn release_program_pages() {
    /// Start and end of the program's loaded segments that are not
    /// writable; at most 8 (a program has 2: constants and code).
    struct Segments {
        spans: [(usize, usize); 8],
        len: usize,
    }
    /// Called for every loaded object, the program first: takes the
    /// program's segments, then stops the walk.
    unsafe extern "C" fn program(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: dl_iterate_phdr passes a valid info for the call, and
        // `data` is the `Segments` given below, borrowed by nothing else.
        let (info, out) = unsafe { (&*info, &mut *data.cast::<Segments>()) };
        if info.dlpi_phdr.is_null() {
            return 1;
        }
        // SAFETY: dlpi_phdr points at dlpi_phnum program headers.
        let headers =
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        for h in headers {
            if h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_W == 0 && out.len < out.spans.len()
            {
                let start = (info.dlpi_addr as usize).wrapping_add(h.p_vaddr as usize);
                out.spans[out.len] = (start, start.saturating_add(h.p_memsz as usize));
                out.len += 1;
            }
        }
        1
    }
    let mut segments = Segments {
        spans: [(0, 0); 8],
        len: 0,
    };
    // SAFETY: the callback only reads the headers it is given and writes
    // into `segments`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(Some(program), (&raw mut segments).cast());
    }
    // SAFETY: sysconf has no preconditions.
    let page = match usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) {
        Ok(p) if p.is_power_of_two() => p,
        _ => return,
    };
    for &(start, end) in &segments.spans[..segments.len] {
        // Whole pages inside the segment only.
        let start = start.next_multiple_of(page);
        let end = end & !(page - 1);
        if end > start {
            // SAFETY: the span is page-aligned and lies in a mapped,
            // read-only, private file mapping of the program: nothing in
            // it was ever written, so dropping its pages loses nothing.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
            }
        }
    }
}

/// Runs the executor: `args` is what follows `executor` on the command
/// line, the state directory. Returns the executor's exit code: 0 once the
/// task's exit is recorded, 1 when the task could not be started or its
/// exit not recorded, 2 on bad usage.
pub fn run_executor(args: &[String]) -> i32 {
    if let [flag] = args {
        if flag == crate::isolation::INIT_FLAG {
            return crate::isolation::run_task_init();
        }
    }
    let [state_dir] = args else {
        eprintln!("usage: berth executor STATE_DIR  (internal; the spec is read from stdin)");
        return 2;
    };
    let state_dir = PathBuf::from(state_dir);
    limit_arenas();
    let (raw, spec) = match read_spec() {
        Ok(read) => read,
        Err(code) => return code,
    };
    become_session_leader();
    let started = match start_task(&state_dir, &spec, args) {
        Ok(started) => started,
        Err(code) => return code,
    };
    let StartedTask {
        mut child,
        cmd,
        readers,
        started,
        drained,
    } = started;
    let task_pid = child.id();
    if let Err(code) = record_running(&state_dir, &mut child, &spec.cgroup_procs) {
        return code;
    }
    report_state_written();
    let gate = std::sync::Arc::new(crate::lease::WatchGate::default());
    if let Some(watch) = spec.disconnect.clone() {
        crate::lease::spawn_watch(watch, task_pid as i32, gate.clone());
    }
    // The copy threads have run their start (and touched its pages)
    // before the start's memory is given back; a thread that died instead
    // ends its channel.
    for _ in 0..readers {
        if started.recv().is_err() {
            break;
        }
    }
    drop((raw, spec, cmd, started));
    release_start_memory();
    wait_and_record_exit(&state_dir, child, task_pid, readers, drained, &gate)
}

/// The spec on stdin: its bytes and what they decode to. An exit code
/// when it cannot be read.
fn read_spec() -> Result<(Vec<u8>, ExecutorSpec), i32> {
    let mut raw = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut raw) {
        eprintln!("berth executor: reading the spec from stdin: {e}");
        return Err(1);
    }
    match serde_json::from_slice(&raw) {
        Ok(spec) => Ok((raw, spec)),
        Err(e) => {
            eprintln!("berth executor: decoding the spec: {e}");
            Err(1)
        }
    }
}

/// A session of its own: no terminal, no signals meant for the agent's
/// group; the executor lives on when the agent stops. The driver makes it
/// a session leader before exec; this covers an executor started by other
/// means.
fn become_session_leader() {
    let me = nix::unistd::getpid();
    if nix::unistd::getsid(None).ok() != Some(me) {
        if let Err(e) = nix::unistd::setsid() {
            eprintln!("berth executor: setsid: {e}");
        }
    }
}

/// A started task whose output the copy threads read.
struct StartedTask {
    child: std::process::Child,
    cmd: std::process::Command,
    /// How many copy threads read the task's output.
    readers: usize,
    /// Each copy thread says here that it has run its start.
    started: std::sync::mpsc::Receiver<()>,
    /// Each copy thread says here that its pipe is drained.
    drained: std::sync::mpsc::Receiver<()>,
}

/// Opens the task's logs and starts it with copy threads on its output.
/// A start that fails is recorded in the state dir; its exit code is the
/// error.
fn start_task(state_dir: &Path, spec: &ExecutorSpec, args: &[String]) -> Result<StartedTask, i32> {
    let failed = |kind, message: String| {
        eprintln!("berth executor: {message}");
        match write_state_record(
            state_dir,
            STATE_FILE,
            &ExecutorState::StartFailed { kind, message },
        ) {
            Ok(()) => report_state_written(),
            Err(e) => eprintln!("berth executor: recording the start failure: {e}"),
        }
        1
    };
    let (stdout_log, stderr_log) = match (
        open_log(&spec.stdout_path, spec.logs),
        open_log(&spec.stderr_path, spec.logs),
    ) {
        (Ok(o), Ok(e)) => (o, e),
        (Err(e), _) | (_, Err(e)) => {
            return Err(failed(
                StartFailure::Other,
                format!("opening the task's logs: {e}"),
            ))
        }
    };
    let (mut cmd, init_spec) = match task_command(spec, args) {
        Ok(made) => made,
        Err(e) => {
            return Err(failed(
                StartFailure::Other,
                format!("isolating the task: {e}"),
            ))
        }
    };
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let cgroup = match join_cgroup_before_exec(&mut cmd, &spec.cgroup_procs) {
        Ok(fds) => fds,
        Err(e) => {
            return Err(failed(
                StartFailure::Other,
                format!("opening the task's cgroup: {e}"),
            ))
        }
    };
    if let (Some((uid, gid)), None) = (spec.run_as, &spec.isolation) {
        run_as_before_exec(&mut cmd, uid, gid);
    }
    let spawned = cmd.spawn();
    let init_spec = match init_spec {
        Some((bytes, pid_ns)) => {
            // Threads can be started again (the copy threads below).
            if let Err(e) = pid_ns.restore() {
                return Err(failed(
                    StartFailure::Other,
                    format!("leaving the task's PID namespace: {e}"),
                ));
            }
            Some(bytes)
        }
        None => None,
    };
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let kind = match e.kind() {
                std::io::ErrorKind::NotFound => StartFailure::NotFound,
                std::io::ErrorKind::PermissionDenied => StartFailure::PermissionDenied,
                _ => StartFailure::Other,
            };
            return Err(failed(
                kind,
                format!("starting {}: {e}", spec.command.display()),
            ));
        }
    };
    drop(cgroup);
    if let (Some(init), Some(mut stdin)) = (init_spec, child.stdin.take()) {
        // The init reads it to its end, then starts the task.
        if let Err(e) = stdin.write_all(&init) {
            eprintln!("berth executor: sending the task's init its spec: {e}");
        }
    }
    // The read ends are close-on-exec: only the task holds the write ends.
    let (drained_tx, drained) = std::sync::mpsc::channel();
    let (started_tx, started) = std::sync::mpsc::channel();
    let mut readers = 0;
    if let Some(out) = child.stdout.take() {
        copy_output(
            out.into(),
            stdout_log,
            started_tx.clone(),
            drained_tx.clone(),
        );
        readers += 1;
    }
    if let Some(err) = child.stderr.take() {
        copy_output(err.into(), stderr_log, started_tx.clone(), drained_tx);
        readers += 1;
    }
    drop(started_tx);
    Ok(StartedTask {
        child,
        cmd,
        readers,
        started,
        drained,
    })
}

/// The command the executor starts: the task itself, or (an isolated
/// task) its init in a new PID namespace, with the init's spec to send
/// it on its stdin.
fn task_command(spec: &ExecutorSpec, args: &[String]) -> std::io::Result<TaskCommand> {
    let Some(iso) = &spec.isolation else {
        let mut cmd = std::process::Command::new(&spec.command);
        cmd.args(&spec.args)
            .env_clear()
            .envs(&spec.env)
            .current_dir(&spec.cwd)
            .stdin(Stdio::null());
        return Ok((cmd, None));
    };
    // The command and the working dir as the task sees them, from its
    // root.
    let seen = |p: &Path| match p.strip_prefix(&iso.root) {
        Ok(rel) => Path::new("/").join(rel),
        Err(_) => p.to_path_buf(),
    };
    let init = crate::isolation::InitSpec {
        isolation: iso.clone(),
        command: seen(&spec.command),
        args: spec.args.clone(),
        env: spec.env.clone(),
        cwd: seen(&spec.cwd),
    };
    let bytes = serde_json::to_vec(&init).map_err(std::io::Error::other)?;
    let (mut cmd, pid_ns) = crate::isolation::init_command(args)?;
    cmd.env_clear().stdin(Stdio::piped());
    Ok((cmd, Some((bytes, pid_ns))))
}

/// The command the executor starts, and for an isolated task the init's
/// spec and the PID namespace to put back once it is spawned.
type TaskCommand = (
    std::process::Command,
    Option<(Vec<u8>, crate::isolation::NewPidNamespace)>,
);

/// Has the task join the cgroup whose `cgroup.procs` files are `procs`
/// between its fork and its exec: each file is opened here, and the child
/// writes `0` (itself) into each. The files, which the caller keeps open
/// until the task is spawned.
fn join_cgroup_before_exec(
    cmd: &mut std::process::Command,
    procs: &[PathBuf],
) -> std::io::Result<Vec<std::fs::File>> {
    let files = procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    if files.is_empty() {
        return Ok(files);
    }
    let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    // SAFETY: the closure runs in the forked child before exec; it only
    // calls write(2), which is async-signal-safe, on descriptors opened
    // above (still open: the caller keeps `files` until the spawn), and
    // allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &fds {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(files)
}

/// Has the task drop to `uid` and `gid` (and no supplementary groups)
/// between fork and exec, after it joined its cgroup and went to its
/// working directory: the task dir's parents (the agent's data dir) need
/// not be open to the task's user.
fn run_as_before_exec(cmd: &mut std::process::Command, uid: u32, gid: u32) {
    // SAFETY: the closure runs in the forked child before exec; it only
    // calls setgroups(2), setgid(2) and setuid(2), which are
    // async-signal-safe, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Records the running task in the state dir. A task nobody could find
/// again is not left running: it is killed, and the exit code is the
/// error.
fn record_running(
    state_dir: &Path,
    child: &mut std::process::Child,
    cgroup_procs: &[PathBuf],
) -> Result<(), i32> {
    let task_pid = child.id();
    let state = ExecutorState::Running {
        executor_pid: std::process::id(),
        executor_start_ticks: process_start_ticks(std::process::id()).unwrap_or_default(),
        task_pid,
        pgid: task_pid as i32,
        task_start_ticks: process_start_ticks(task_pid).unwrap_or_default(),
        started_at_ms: berth_structs::now_ms(),
        cgroup: cgroup_procs
            .iter()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .collect(),
    };
    if let Err(e) = write_state_record(state_dir, STATE_FILE, &state) {
        eprintln!("berth executor: recording the task's state: {e}; killing the task");
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(task_pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = child.wait();
        return Err(1);
    }
    Ok(())
}

/// Waits for the task to exit, kills what is left of its group, lets its
/// output drain into the logs, then records its exit. The executor's exit
/// code.
fn wait_and_record_exit(
    state_dir: &Path,
    mut child: std::process::Child,
    task_pid: u32,
    readers: usize,
    drained: std::sync::mpsc::Receiver<()>,
    gate: &crate::lease::WatchGate,
) -> i32 {
    // Wait for the leader without reaping it: its zombie keeps the group
    // id reserved, so the kill below reaches the task's own leftovers and
    // never a group that reused the id.
    let ended = match wait_unreaped(task_pid) {
        Ok(ended) => Some(ended),
        Err(e) => {
            eprintln!("berth executor: waiting for the task: {e}");
            None
        }
    };
    match nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(task_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    ) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
        Err(e) => eprintln!("berth executor: killing what is left of the task's group: {e}"),
    }
    // Everything the task wrote is in its log files before its exit is
    // recorded; a process that escaped the group and keeps the pipes open
    // gets a short grace, then is no longer read. The leader is reaped
    // only after that: until its exit is recorded, the agent may still
    // signal the group, and the zombie keeps the group id from reuse.
    let drain_until = std::time::Instant::now() + DRAIN_GRACE;
    for _ in 0..readers {
        let left = drain_until.saturating_duration_since(std::time::Instant::now());
        if drained.recv_timeout(left).is_err() {
            eprintln!(
                "berth executor: the task's output is still open {DRAIN_GRACE:?} after it exited; no longer reading it"
            );
            break;
        }
    }
    gate.close();
    let (exit_code, signal) = match ended {
        Some(ended) => ended,
        // Not known without reaping it.
        None => match child.wait() {
            Ok(status) => (status.code(), status.signal()),
            Err(e) => {
                eprintln!("berth executor: waiting for the task: {e}");
                return 1;
            }
        },
    };
    let exit = ExecutorExit {
        exit_code,
        signal,
        finished_at_ms: berth_structs::now_ms(),
        disconnected: gate.fired(),
    };
    let recorded = write_record(state_dir, EXIT_FILE, &exit);
    // Reaped only now that its exit is recorded (see above).
    if ended.is_some() {
        if let Err(e) = child.wait() {
            eprintln!("berth executor: reaping the task: {e}");
        }
    }
    match recorded {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("berth executor: recording the task's exit: {e}");
            1
        }
    }
}

/// Tells the driver that `state.json` is written: [`STATE_WRITTEN`] on
/// stdout, then stdout becomes `/dev/null`, so that the driver's end of the
/// pipe is no longer written to (nor held open by this process). Failing
/// to say so is not fatal: the driver still learns of the start when this
/// process exits or its deadline passes.
fn report_state_written() {
    // Straight to fd 1: std's stdout would keep a buffer for the
    // executor's whole life.
    let byte = STATE_WRITTEN;
    // SAFETY: write(2) reads one byte from a live local.
    let written = unsafe { libc::write(libc::STDOUT_FILENO, (&raw const byte).cast(), 1) };
    if written != 1 {
        eprintln!(
            "berth executor: reporting the task's state on stdout: {}",
            std::io::Error::last_os_error()
        );
    }
    match std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto fd 1, which this process owns as its stdout;
        // no Rust object owns fd 1 as a file of its own.
        Ok(null) => unsafe {
            libc::dup2(null.as_raw_fd(), libc::STDOUT_FILENO);
        },
        Err(e) => eprintln!("berth executor: opening /dev/null: {e}"),
    }
}

/// Waits until `pid` (a child) has exited, leaving it unreaped; how it
/// ended: its exit code, or the signal that ended it.
fn wait_unreaped(pid: u32) -> std::io::Result<(Option<i32>, Option<i32>)> {
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid writes only into `info`, which outlives the call.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            // SAFETY: waitid succeeded for a child's exit: `info` holds a
            // SIGCHLD siginfo, whose si_status field is set.
            let status = unsafe { info.si_status() };
            return Ok(match info.si_code {
                libc::CLD_EXITED => (Some(status), None),
                libc::CLD_KILLED | libc::CLD_DUMPED => (None, Some(status)),
                code => {
                    return Err(std::io::Error::other(format!(
                        "waitid reported no exit (si_code {code})"
                    )))
                }
            });
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_ticks_of_this_process_are_read() {
        let mine = process_start_ticks(std::process::id());
        assert!(mine.is_some());
        assert_eq!(mine, process_start_ticks(std::process::id()));
        assert_eq!(process_start_ticks(u32::MAX), None);
    }

    #[test]
    fn records_round_trip_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let exit = ExecutorExit {
            exit_code: Some(3),
            signal: None,
            finished_at_ms: 7,
            disconnected: false,
        };
        write_record(dir.path(), EXIT_FILE, &exit).unwrap();
        assert_eq!(
            read_record::<ExecutorExit>(dir.path(), EXIT_FILE).unwrap(),
            Some(exit)
        );
        assert_eq!(
            read_record::<ExecutorExit>(dir.path(), STATE_FILE).unwrap(),
            None
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(EXIT_FILE)]);
    }
}
