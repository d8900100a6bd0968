//! What keeps an `exec` task from the host: its own PID, mount, IPC and
//! UTS namespaces, a root of its own (its task dir, with the host's
//! system directories bound in read-only, its alloc's shared dir at
//! `/alloc`, a fresh `/proc` and a minimal `/dev`), no new privileges,
//! a bounding set of capabilities cut to Nomad's default list, and a user
//! that is not root (`nobody` unless the task names one).
//!
//! The executor puts itself in a new PID namespace and starts a small
//! init there (the same program, `--task-init`): PID 1 of the namespace,
//! which makes the mounts in a mount namespace of its own, enters the
//! root, starts the task as its child (as the task's user), forwards the
//! signals it gets to the task's process group, reaps every orphan, and
//! exits with the task's status (128 + the signal for a task a signal
//! ended). When it exits the kernel kills whatever is left in the
//! namespace. The task sees only its own processes, its own dirs and
//! the system's programs and libraries: not the agent's data dir, not
//! other allocs, not the host's processes.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// The argument that makes the executor program the task's init.
pub const INIT_FLAG: &str = "--task-init";

/// The host directories bound read-only into a task's root, where they
/// exist (Nomad's `chroot_env` default, less what berth does not need).
pub const SYSTEM_DIRS: &[&str] = &["/bin", "/etc", "/lib", "/lib32", "/lib64", "/sbin", "/usr"];

/// The device nodes bound into the task's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// The capabilities an exec task may keep (Nomad's default for exec);
/// every other one leaves its bounding set.
const KEPT_CAPS: &[u32] = &[
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    8,  // CAP_SETPCAP
    10, // CAP_NET_BIND_SERVICE
    18, // CAP_SYS_CHROOT
    27, // CAP_MKNOD
    29, // CAP_AUDIT_WRITE
    31, // CAP_SETFCAP
];

/// The user an exec task runs as unless it names one.
pub const DEFAULT_USER: &str = "nobody";

/// How the task's root is made, and who it runs as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Isolation {
    /// The task's dir: its root.
    pub root: PathBuf,
    /// The alloc's shared dir, bound at `/alloc`.
    pub alloc_dir: PathBuf,
    /// Host directories bound read-only at the same path inside.
    pub system_dirs: Vec<PathBuf>,
    /// A user name or a numeric uid.
    pub user: String,
    pub hostname: String,
}

/// What the init is sent on its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitSpec {
    pub isolation: Isolation,
    /// As the task sees it (inside its root).
    pub command: PathBuf,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Inside the root.
    pub cwd: PathBuf,
}

/// The task's environment with the paths of its dirs as it sees them
/// from inside its root: `BERTH_TASK_DIR=/`, `BERTH_ALLOC_DIR=/alloc`,
/// `BERTH_SECRETS_DIR=/secrets`.
pub fn env_inside(mut env: BTreeMap<String, String>) -> BTreeMap<String, String> {
    env.insert("BERTH_TASK_DIR".into(), "/".into());
    env.insert("BERTH_ALLOC_DIR".into(), "/alloc".into());
    env.insert("BERTH_SECRETS_DIR".into(), "/secrets".into());
    env.insert("TMPDIR".into(), "/tmp".into());
    env
}

/// The uid and gid of `user` (a name, or a number).
pub fn resolve_user(user: &str) -> Result<(u32, u32), String> {
    if let Ok(uid) = user.parse::<u32>() {
        let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .ok()
            .flatten()
            .map_or(uid, |u| u.gid.as_raw());
        return Ok((uid, gid));
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok((u.uid.as_raw(), u.gid.as_raw())),
        Ok(None) => Err(format!("user {user:?} does not exist on this node")),
        Err(e) => Err(format!("looking up user {user:?}: {e}")),
    }
}

/// The executor's part: the init's program and arguments (this program,
/// as it was started, with [`INIT_FLAG`]), and the executor's next child
/// put in a new PID namespace, of which it is PID 1. Until the guard
/// puts that back ([`NewPidNamespace::restore`], once the init is
/// spawned) the executor can start no thread.
pub fn init_command(
    executor_args: &[String],
) -> std::io::Result<(std::process::Command, NewPidNamespace)> {
    let exe = std::env::current_exe()?;
    let all: Vec<String> = std::env::args().skip(1).collect();
    let prefix = &all[..all.len().saturating_sub(executor_args.len())];
    let own = std::fs::File::open("/proc/self/ns/pid")?;
    unshare(CloneFlags::CLONE_NEWPID).map_err(std::io::Error::from)?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(prefix).arg(INIT_FLAG);
    Ok((cmd, NewPidNamespace { own }))
}

/// The executor's children go to a new PID namespace until
/// [`NewPidNamespace::restore`].
pub struct NewPidNamespace {
    own: std::fs::File,
}

impl NewPidNamespace {
    /// The executor's next children (and threads) are in its own PID
    /// namespace again.
    pub fn restore(self) -> std::io::Result<()> {
        nix::sched::setns(&self.own, CloneFlags::CLONE_NEWPID).map_err(std::io::Error::from)
    }
}

/// Runs as PID 1 of the task's namespace: the init. Its exit code is the
/// task's (128 + the signal that ended it); 127 when the task could not
/// be started, with why on stderr (the task's stderr log).
pub fn run_task_init() -> i32 {
    let spec: InitSpec = {
        let mut raw = Vec::new();
        if let Err(e) = std::io::stdin().read_to_end(&mut raw) {
            eprintln!("berth: reading the task's init spec: {e}");
            return 127;
        }
        match serde_json::from_slice(&raw) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("berth: decoding the task's init spec: {e}");
                return 127;
            }
        }
    };
    // Signals are taken as they come, below, not by handlers.
    let forwarded = forwarded_signals();
    if let Err(e) = forwarded.thread_block() {
        eprintln!("berth: blocking signals: {e}");
        return 127;
    }
    let (uid, gid) = match resolve_user(&spec.isolation.user) {
        Ok(ids) => ids,
        Err(e) => {
            eprintln!("berth: {e}");
            return 127;
        }
    };
    if let Err(e) = enter_root(&spec.isolation, uid, gid) {
        eprintln!("berth: making the task's root: {e}");
        return 127;
    }
    let task = match start_task(&spec, uid, gid, &forwarded) {
        Ok(pid) => pid,
        Err(e) => {
            eprintln!("berth: starting {}: {e}", spec.command.display());
            return 127;
        }
    };
    supervise(task, &forwarded)
}

/// The signals the init forwards to the task (and SIGCHLD, which tells
/// it a child ended).
fn forwarded_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGWINCH,
        Signal::SIGCONT,
        Signal::SIGCHLD,
    ] {
        set.add(s);
    }
    set
}

/// A mount namespace of its own, the root made and entered.
fn enter_root(iso: &Isolation, uid: u32, gid: u32) -> Result<(), String> {
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS)
        .map_err(|e| format!("new namespaces: {e}"))?;
    // The host's mounts (a CSI volume published later, say) still reach
    // the task; none of the task's reaches the host.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_SLAVE | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| format!("making / a slave mount: {e}"))?;
    let _ = nix::unistd::sethostname(&iso.hostname);
    let root = &iso.root;
    // The task's user goes through its root and its alloc dir (the
    // agent's data dir above them stays closed to other users of the
    // host), and its own dirs are its user's.
    open_task_dirs_to(root, &iso.alloc_dir, uid, gid)?;
    for dir in &iso.system_dirs {
        if !dir.is_dir() {
            continue;
        }
        let at = inside(root, dir);
        bind(dir, &at, true)?;
    }
    bind(&iso.alloc_dir, &root.join("alloc"), false)?;
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).map_err(|e| format!("{}: {e}", proc_dir.display()))?;
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|e| format!("mounting /proc: {e}"))?;
    make_dev(&root.join("dev"))?;
    nix::unistd::chroot(root).map_err(|e| format!("entering {}: {e}", root.display()))?;
    nix::unistd::chdir("/").map_err(|e| format!("chdir /: {e}"))?;
    Ok(())
}

/// `dir` (absolute) below `root`.
fn inside(root: &Path, dir: &Path) -> PathBuf {
    root.join(dir.strip_prefix("/").unwrap_or(dir))
}

/// Opens the task dir `task_dir` and its alloc dir `alloc_dir` for the
/// task's user (`uid`, `gid`) to go through (the agent's data dir above
/// them stays closed to other users of the host), and makes the task's
/// own dirs (`local`, `secrets`, `tmp`, the alloc's `data` and `tmp`)
/// its user's.
pub fn open_task_dirs_to(
    task_dir: &Path,
    alloc_dir: &Path,
    uid: u32,
    gid: u32,
) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    for dir in [task_dir, alloc_dir] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    for dir in ["local", "secrets", "tmp"] {
        let _ = chown(&task_dir.join(dir), uid, gid);
    }
    for dir in ["data", "tmp"] {
        let _ = chown(&alloc_dir.join(dir), uid, gid);
    }
    Ok(())
}

fn chown(path: &Path, uid: u32, gid: u32) -> nix::Result<()> {
    nix::unistd::chown(
        path,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
}

/// Binds `from` at `to` (made first), read-only when `read_only`.
fn bind(from: &Path, to: &Path, read_only: bool) -> Result<(), String> {
    if from.is_dir() {
        std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    } else if !to.exists() {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        std::fs::File::create(to).map_err(|e| format!("{}: {e}", to.display()))?;
    }
    let flags = MsFlags::MS_BIND | MsFlags::MS_REC;
    mount(Some(from), to, None::<&str>, flags, None::<&str>)
        .map_err(|e| format!("binding {} at {}: {e}", from.display(), to.display()))?;
    if read_only {
        mount(
            None::<&str>,
            to,
            None::<&str>,
            flags | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(|e| format!("making {} read-only: {e}", to.display()))?;
    }
    Ok(())
}

/// A tmpfs `/dev` with the usual device nodes bound from the host, and
/// `/dev/shm`.
fn make_dev(dev: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dev).map_err(|e| format!("{}: {e}", dev.display()))?;
    mount(
        Some("tmpfs"),
        dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=755,size=64k"),
    )
    .map_err(|e| format!("mounting /dev: {e}"))?;
    for d in DEVICES {
        let host = Path::new("/dev").join(d);
        if host.exists() {
            bind(&host, &dev.join(d), false)?;
        }
    }
    let shm = dev.join("shm");
    std::fs::create_dir_all(&shm).map_err(|e| format!("{}: {e}", shm.display()))?;
    mount(
        Some("tmpfs"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777,size=64m"),
    )
    .map_err(|e| format!("mounting /dev/shm: {e}"))?;
    Ok(())
}

/// Starts the task as the init's child, in a process group of its own,
/// as `uid`:`gid` with no new privileges and the capabilities cut; its
/// stdin `/dev/null`, its stdout and stderr the init's.
fn start_task(spec: &InitSpec, uid: u32, gid: u32, blocked: &SigSet) -> std::io::Result<Pid> {
    let mut cmd = std::process::Command::new(&spec.command);
    cmd.args(&spec.args)
        .env_clear()
        .envs(&spec.env)
        .current_dir(&spec.cwd)
        .stdin(std::process::Stdio::null())
        .process_group(0);
    let blocked = *blocked;
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe system calls (sigprocmask, prctl, setgroups,
    // setgid, setuid) on values computed before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::pthread_sigmask(libc::SIG_UNBLOCK, blocked.as_ref(), std::ptr::null_mut()) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            for cap in 0..=63u32 {
                if !KEPT_CAPS.contains(&cap) {
                    // A capability the kernel does not know fails: fine.
                    libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0);
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    Ok(Pid::from_raw(child.id() as i32))
}

/// Forwards the signals it gets to the task's group, reaps every child,
/// and returns the task's exit code once it has ended.
fn supervise(task: Pid, signals: &SigSet) -> i32 {
    let mut status = None;
    loop {
        // Reap whatever has ended: the task, or an orphan re-parented to
        // the init.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == task => status = Some(code),
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == task => {
                    status = Some(128 + sig as i32)
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => {}
            }
        }
        if let Some(code) = status {
            return code;
        }
        match signals.wait() {
            Ok(Signal::SIGCHLD) => {}
            Ok(sig) => {
                let _ = nix::sys::signal::killpg(task, sig);
            }
            Err(e) => {
                // No signal can be taken: wait for the task alone.
                eprintln!("berth: waiting for signals: {e}");
                return match waitpid(task, None) {
                    Ok(WaitStatus::Exited(_, code)) => code,
                    Ok(WaitStatus::Signaled(_, sig, _)) => 128 + sig as i32,
                    _ => 127,
                };
            }
        }
    }
}
