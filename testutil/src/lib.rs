//! What berth's tests share, and nothing the product uses: reading and
//! cleaning up mounts, a deliberately small disk, the location of the
//! example plugin binary, polling a condition with a deadline, and damaged
//! JSON for property tests ([`json`]). It knows no berth type, so that
//! every crate's tests can use it.

pub mod etcd;
pub mod json;
pub mod loops;
pub mod relay;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Threads of this process named `name` (every thread of a tokio runtime
/// built with that name: its workers and its blocking pool).
pub fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .flatten()
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|comm| comm.trim() == name)
                })
                .count()
        })
        .unwrap_or(0)
}

/// Mount points at or below `dir` (from /proc/self/mountinfo), deepest
/// first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// How many mounts sit exactly at `path`.
pub fn mount_count_at(path: &Path) -> usize {
    mounts_under(path).iter().filter(|p| *p == path).count()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(n) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    PathBuf::from(String::from_utf8_lossy(&out).into_owned())
}

/// Bind-mounts `src` at `target`, making both dirs first.
pub fn bind_mount(src: &Path, target: &Path) {
    std::fs::create_dir_all(src).unwrap();
    std::fs::create_dir_all(target).unwrap();
    nix::mount::mount(
        Some(src),
        target,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap_or_else(|e| panic!("bind mount {}: {e}", target.display()));
}

/// Lazily unmounts everything below its dir on drop, deepest first, so a
/// failing test leaves no mount behind.
pub struct MountCleanup(pub PathBuf);

impl Drop for MountCleanup {
    fn drop(&mut self) {
        unmount_all_under(&self.0);
    }
}

/// Lazily unmounts everything below `dir`, deepest first.
pub fn unmount_all_under(dir: &Path) {
    for _ in 0..10 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            return;
        }
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// PIDs of processes (other than this one) whose command line or
/// environment mentions `needle`: with a test's temp dir as the needle,
/// every process the test started, however detached (tasks run under
/// executors that outlive whoever started them).
pub fn pids_mentioning(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let read = |f: &str| std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
            let hay = |b: Vec<u8>| String::from_utf8_lossy(&b).contains(needle);
            hay(read("cmdline")) || hay(read("environ"))
        })
        .collect()
}

/// SIGKILLs every process that mentions `dir`, until none is left (or a
/// few rounds have passed).
pub fn kill_all_mentioning(dir: &Path) {
    let needle = dir.display().to_string();
    for _ in 0..20 {
        let pids = pids_mentioning(&needle);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills, on drop, every process that mentions its dir, so a test leaves
/// no process behind, also when it fails. Drop it before the dir goes.
pub struct ProcessCleanup(pub PathBuf);

impl Drop for ProcessCleanup {
    fn drop(&mut self) {
        kill_all_mentioning(&self.0);
    }
}

/// A tmpfs of a few MiB, for running out of disk space; unmounted when
/// dropped (also when the test fails). Needs root.
pub struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// `size` as tmpfs takes it: "4m".
    pub fn new(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().expect("a temp dir");
        nix::mount::mount(
            Some("tmpfs"),
            dir.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size={size}").as_str()),
        )
        .expect("mounting a tmpfs (the tests run as root)");
        SmallDisk { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes zeros until the disk is full; returns the file to remove to
    /// free the space again.
    pub fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.dir.path().join("fill");
        let mut f = std::fs::File::create(&path).expect("creating the fill file");
        let chunk = vec![0u8; 64 * 1024];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// The directory holding the workspace's built binaries
/// (`target/<profile>`): the one the running test or bench executable was
/// built into (tests live in `<profile>/deps/`, a workspace binary such as
/// `berth-bench` in `<profile>/` itself), which is where cargo put the
/// binaries it built with it, whatever `CARGO_TARGET_DIR` or
/// `build.target-dir` said. `BERTH_BIN_DIR` names another (`berth-bench
/// ab` runs a figure against an older build's binaries with it).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BERTH_BIN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    match std::env::current_exe() {
        Ok(exe) => profile_dir_of(&exe),
        Err(_) => target_dir().join("debug"),
    }
}

fn profile_dir_of(exe: &Path) -> PathBuf {
    let dir = exe.parent().unwrap_or(Path::new("."));
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().unwrap_or(dir).to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// The workspace's target directory as cargo has it: `CARGO_TARGET_DIR`,
/// else what `cargo metadata` says (which honours `build.target-dir`),
/// else `target/` beside the workspace's manifest.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let metadata = std::process::Command::new(std::env::var("CARGO").unwrap_or("cargo".into()))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(&workspace)
        .output();
    if let Some(out) = metadata.ok().filter(|o| o.status.success()) {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            if let Some(dir) = v["target_directory"].as_str() {
                return PathBuf::from(dir);
            }
        }
    }
    workspace.join("target")
}

/// Path of a workspace binary, which `cargo test --workspace` builds: in
/// [`bin_dir`], else in the target directory's `debug/`. A test that
/// cannot find it fails saying so.
pub fn binary(name: &str) -> PathBuf {
    let beside = bin_dir().join(name);
    if beside.is_file() {
        return beside;
    }
    // Only on a miss: target_dir may run `cargo metadata`.
    let in_target = target_dir().join("debug").join(name);
    if in_target.is_file() {
        return in_target;
    }
    panic!(
        "{name} not found (looked for {} and {}): run the tests with `cargo test --workspace`, which builds it",
        beside.display(),
        in_target.display()
    );
}

/// The example `hostpath-plugin` binary. `cargo test --workspace` builds
/// it; a test that cannot find it fails saying so.
pub fn hostpath_plugin_binary() -> PathBuf {
    binary("hostpath-plugin")
}

/// A server on a loopback port that answers the first request on its first
/// connection with `answer`, without reading the request's body, and closes
/// the connection; joining it gives the request head. The answer goes out in
/// one write, so the kernel sends it before the reset that closing with
/// unread data makes.
pub fn one_answer_server(answer: impl Into<Vec<u8>>) -> (String, std::thread::JoinHandle<Vec<u8>>) {
    use std::io::{Read, Write};
    let answer = answer.into();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            conn.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        conn.write_all(&answer).unwrap();
        head
    });
    (format!("http://{addr}"), server)
}

/// Polls `cond` every 20 ms until it holds; fails the test naming `what`
/// once `within` has passed.
pub async fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binaries_are_found_beside_the_running_executable() {
        let exe = Path::new("/t/debug/deps/layout-0a1b");
        assert_eq!(profile_dir_of(exe), Path::new("/t/debug"));
        assert_eq!(
            profile_dir_of(Path::new("/t/release/berth-bench")),
            Path::new("/t/release")
        );
        // This test's own executable is in the directory it reports.
        let dir = bin_dir();
        assert!(dir.join("deps").is_dir(), "{}", dir.display());
        assert!(target_dir().is_dir(), "{}", target_dir().display());
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mountinfo("/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape_mountinfo("/end\\040"), PathBuf::from("/end "));
        assert_eq!(unescape_mountinfo("/plain"), PathBuf::from("/plain"));
    }

    #[test]
    fn a_small_disk_fills_up_and_frees_again() {
        let disk = SmallDisk::new("1m");
        assert_eq!(mount_count_at(disk.path()), 1);
        let fill = disk.fill();
        assert!(std::fs::write(disk.path().join("more"), vec![0u8; 64 * 1024]).is_err());
        std::fs::remove_file(fill).unwrap();
        std::fs::write(disk.path().join("more"), b"x").unwrap();
        let path = disk.path().to_path_buf();
        drop(disk);
        assert_eq!(mount_count_at(&path), 0);
    }
}
