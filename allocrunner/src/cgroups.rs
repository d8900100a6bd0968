//! The cgroups of `exec` tasks: one per task, under a parent of the
//! agent's (`client { cgroup_parent }`, `berth` unless set), on
//! whichever cgroup version the host runs. cgroup v1 keeps a hierarchy per
//! controller (`/sys/fs/cgroup/memory/berth/<alloc>/<task>`, the same under
//! `cpu`, `cpuacct` and `pids`); v2 one unified hierarchy
//! (`/sys/fs/cgroup/berth/<alloc>/<task>`), whose parents must hand the
//! controllers down (`cgroup.subtree_control`).
//!
//! A task's cgroup holds it to its `resources`: memory (`memory`, or
//! `memory_max` above it as a hard limit with `memory` as the soft one,
//! Nomad's oversubscription), no swap, a CPU weight from `cpu` MHz (CPU
//! shares on v1), and a pids limit. The executor joins it before it execs
//! the task, so every process the task starts is held too. After the task
//! the cgroup tells whether the kernel's OOM killer ran in it, and what
//! it used.

use std::io;
use std::path::{Path, PathBuf};

/// The directory every berth cgroup is under, in each hierarchy, unless
/// the agent's config names another.
pub const DEFAULT_PARENT: &str = "berth";

/// The v1 controllers a task's cgroup is made in.
const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "cpuacct", "pids"];

/// The controllers a v2 task's cgroup needs from its parents.
const V2_CONTROLLERS: &str = "+memory +cpu +pids";

/// The pids limit of a task that sets none.
pub const DEFAULT_PIDS_LIMIT: u64 = 2048;

/// Which cgroup version the host runs, where it is mounted, and the
/// parent the agent's cgroups are under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    /// The unified hierarchy at `mount` (v2); else one hierarchy per
    /// controller, at `<mount>/<controller>` (v1).
    v2: bool,
    mount: PathBuf,
    /// Relative to each hierarchy's root.
    parent: PathBuf,
}

/// What a task's cgroup holds it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The memory the task asked for, in bytes.
    pub memory: u64,
    /// The most it may use, in bytes (0: `memory` is the hard limit).
    pub memory_max: u64,
    /// MHz, as the job gives them: the task's CPU weight.
    pub cpu_mhz: u64,
    pub pids: u64,
}

impl Limits {
    /// The hard memory limit.
    pub fn hard_memory(&self) -> u64 {
        self.memory.max(self.memory_max)
    }
}

/// What a task's cgroup says it used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub memory_bytes: u64,
    /// The most it held at once (0 where the kernel does not say).
    pub memory_peak_bytes: u64,
    /// CPU time, in nanoseconds.
    pub cpu_ns: u64,
    pub throttled_periods: u64,
    pub throttled_ns: u64,
}

impl Cgroups {
    /// The cgroups of this host: v2 when `/sys/fs/cgroup` is the unified
    /// hierarchy with the memory controller, v1 when the memory, cpu,
    /// cpuacct and pids hierarchies are mounted below it; else why
    /// neither is usable.
    pub fn detect() -> Result<Cgroups, String> {
        Cgroups::detect_at(Path::new("/sys/fs/cgroup"))
    }

    /// [`Cgroups::detect`] of a cgroup file system mounted at `mount`.
    pub fn detect_at(mount: &Path) -> Result<Cgroups, String> {
        if let Ok(controllers) = std::fs::read_to_string(mount.join("cgroup.controllers")) {
            let have: Vec<&str> = controllers.split_whitespace().collect();
            let missing: Vec<&str> = ["memory", "cpu", "pids"]
                .into_iter()
                .filter(|c| !have.contains(c))
                .collect();
            if missing.is_empty() {
                return Ok(Cgroups {
                    v2: true,
                    mount: mount.to_path_buf(),
                    parent: PathBuf::from(DEFAULT_PARENT),
                });
            }
            if !mount.join("memory").is_dir() {
                return Err(format!(
                    "the cgroup v2 hierarchy at {} lacks the {} controller(s)",
                    mount.display(),
                    missing.join(", ")
                ));
            }
        }
        let missing: Vec<&str> = V1_CONTROLLERS
            .into_iter()
            .filter(|c| !mount.join(c).join("cgroup.procs").is_file())
            .collect();
        if missing.is_empty() {
            return Ok(Cgroups {
                v2: false,
                mount: mount.to_path_buf(),
                parent: PathBuf::from(DEFAULT_PARENT),
            });
        }
        Err(format!(
            "no usable cgroups at {}: the v1 hierarchies of {} are not mounted and it is not \
             a cgroup v2 hierarchy with memory, cpu and pids",
            mount.display(),
            missing.join(", ")
        ))
    }

    /// These cgroups under `parent` (see [`check_parent`]) instead.
    pub fn with_parent(self, parent: &str) -> Result<Cgroups, String> {
        check_parent(parent)?;
        Ok(Cgroups {
            parent: PathBuf::from(parent),
            ..self
        })
    }

    /// `v1` or `v2`, for logs and fingerprints.
    pub fn version(&self) -> &'static str {
        if self.v2 {
            "v2"
        } else {
            "v1"
        }
    }

    /// The parent's directory in each hierarchy.
    fn roots(&self) -> Vec<PathBuf> {
        if self.v2 {
            vec![self.mount.join(&self.parent)]
        } else {
            V1_CONTROLLERS
                .iter()
                .map(|c| self.mount.join(c).join(&self.parent))
                .collect()
        }
    }

    /// The cgroup of task `task` of alloc `alloc` (made or not).
    pub fn task(&self, alloc: &str, task: &str) -> TaskCgroup {
        TaskCgroup {
            v2: self.v2,
            dirs: self
                .roots()
                .into_iter()
                .map(|r| r.join(alloc).join(task))
                .collect(),
        }
    }

    /// Makes the cgroup of task `task` of alloc `alloc` with `limits`
    /// (again, when one is left from an earlier run).
    pub fn create(&self, alloc: &str, task: &str, limits: &Limits) -> io::Result<TaskCgroup> {
        if self.v2 {
            // Each parent hands the controllers down to its children.
            let mut dirs = vec![self.mount.clone()];
            for part in self.parent.components() {
                let below = dirs[dirs.len() - 1].join(part);
                dirs.push(below);
            }
            dirs.push(self.mount.join(&self.parent).join(alloc));
            for dir in dirs {
                std::fs::create_dir_all(&dir)?;
                let control = dir.join("cgroup.subtree_control");
                let have = std::fs::read_to_string(&control).unwrap_or_default();
                if !["memory", "cpu", "pids"]
                    .iter()
                    .all(|c| have.split_whitespace().any(|h| h == *c))
                {
                    write(&control, V2_CONTROLLERS)?;
                }
            }
        }
        let cgroup = self.task(alloc, task);
        for dir in &cgroup.dirs {
            // The alloc's dir may go between the parent's creation and
            // the child's (another task's cgroup removed it, empty).
            let mut made = std::fs::create_dir_all(dir);
            for _ in 0..3 {
                match &made {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        made = std::fs::create_dir_all(dir);
                    }
                    _ => break,
                }
            }
            made?;
        }
        cgroup.set_limits(limits)?;
        Ok(cgroup)
    }

    /// The allocs with a cgroup under the parent.
    pub fn allocs(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .roots()
            .iter()
            .flat_map(|r| std::fs::read_dir(r).into_iter().flatten().flatten())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(String::from))
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Kills what is left in the cgroups of alloc `alloc` and removes
    /// them.
    pub fn remove_alloc(&self, alloc: &str) -> io::Result<()> {
        for root in self.roots() {
            let dir = root.join(alloc);
            let tasks: Vec<PathBuf> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect();
            for task in tasks {
                remove_cgroup_dir(&task)?;
            }
            remove_cgroup_dir(&dir)?;
        }
        Ok(())
    }

    /// Removes the cgroups of allocs not in `known` (left by an agent that
    /// crashed, or whose state was lost), killing what runs in them: a
    /// task no alloc of this node wants must not run on beside the one
    /// the servers place again. Returns the allocs removed, and those that
    /// could not be, with why.
    pub fn remove_orphans(
        &self,
        known: &std::collections::BTreeSet<String>,
    ) -> (Vec<String>, Vec<(String, io::Error)>) {
        let mut removed = Vec::new();
        let mut failed = Vec::new();
        for alloc in self.allocs() {
            if known.contains(&alloc) {
                continue;
            }
            match self.remove_alloc(&alloc) {
                Ok(()) => removed.push(alloc),
                Err(e) => failed.push((alloc, e)),
            }
        }
        (removed, failed)
    }
}

/// Why `parent` cannot be the cgroup parent: it must be a relative path of
/// plain names (`berth`, `services/berth`), so that berth's cgroups stay
/// inside it.
pub fn check_parent(parent: &str) -> Result<(), String> {
    let path = Path::new(parent);
    if parent.is_empty()
        || !path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
    {
        return Err(format!(
            "cgroup parent {parent:?} must be a relative path of plain names, like \"berth\""
        ));
    }
    Ok(())
}

/// The cgroup of one task: a directory in each hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskCgroup {
    v2: bool,
    dirs: Vec<PathBuf>,
}

impl TaskCgroup {
    /// The cgroup of these directories (as a task's handle records them).
    pub fn from_dirs(dirs: Vec<PathBuf>) -> TaskCgroup {
        let v2 = dirs.len() == 1;
        TaskCgroup { v2, dirs }
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The files a process writes its PID (or `0`, itself) into to join.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// The directory of `controller` (v1), or the one directory (v2).
    fn dir_of(&self, controller: &str) -> &Path {
        if self.v2 {
            return &self.dirs[0];
        }
        // The dirs are in the order of the controllers (as
        // [`Cgroups::task`] makes them and a handle records them).
        V1_CONTROLLERS
            .iter()
            .position(|c| *c == controller)
            .and_then(|i| self.dirs.get(i))
            .unwrap_or(&self.dirs[0])
    }

    fn set_limits(&self, limits: &Limits) -> io::Result<()> {
        let hard = limits.hard_memory();
        let oversubscribed = limits.memory_max > limits.memory;
        if self.v2 {
            let dir = &self.dirs[0];
            write(&dir.join("memory.max"), &hard.to_string())?;
            write(
                &dir.join("memory.low"),
                &(if oversubscribed { limits.memory } else { 0 }).to_string(),
            )?;
            write_if_there(&dir.join("memory.swap.max"), "0")?;
            write(
                &dir.join("cpu.weight"),
                &cpu_weight(limits.cpu_mhz).to_string(),
            )?;
            write(&dir.join("pids.max"), &limits.pids.to_string())?;
            return Ok(());
        }
        let memory = self.dir_of("memory");
        // The swap limit must stay at or above the memory limit: lower
        // it after, raise it before.
        let memsw = memory.join("memory.memsw.limit_in_bytes");
        let raise = std::fs::read_to_string(memory.join("memory.limit_in_bytes"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|now| hard > now);
        if raise {
            write_if_there(&memsw, &hard.to_string())?;
        }
        write(&memory.join("memory.limit_in_bytes"), &hard.to_string())?;
        write_if_there(&memsw, &hard.to_string())?;
        if oversubscribed {
            write(
                &memory.join("memory.soft_limit_in_bytes"),
                &limits.memory.to_string(),
            )?;
        }
        write(
            &self.dir_of("cpu").join("cpu.shares"),
            &limits.cpu_mhz.max(2).to_string(),
        )?;
        write(
            &self.dir_of("pids").join("pids.max"),
            &limits.pids.to_string(),
        )
    }

    /// The PIDs in the cgroup.
    pub fn pids(&self) -> Vec<i32> {
        let procs = self.dir_of("pids").join("cgroup.procs");
        std::fs::read_to_string(procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// SIGKILLs every process in the cgroup, again until none is left
    /// (a process forking meanwhile is caught on the next pass), for at
    /// most `passes` passes. Whether the cgroup is empty.
    pub fn kill_all(&self, passes: usize) -> bool {
        for _ in 0..passes {
            let pids = self.pids();
            if pids.is_empty() {
                return true;
            }
            if self.v2 && write(&self.dirs[0].join("cgroup.kill"), "1").is_ok() {
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.pids().is_empty()
    }

    /// How many times the kernel's OOM killer killed a process of the
    /// cgroup.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = if self.v2 {
            (self.dirs[0].join("memory.events"), "oom_kill")
        } else {
            (self.dir_of("memory").join("memory.oom_control"), "oom_kill")
        };
        keyed(&file, key).unwrap_or(0)
    }

    /// The hard memory limit, in bytes.
    pub fn memory_limit(&self) -> Option<u64> {
        let file = if self.v2 {
            self.dirs[0].join("memory.max")
        } else {
            self.dir_of("memory").join("memory.limit_in_bytes")
        };
        std::fs::read_to_string(file).ok()?.trim().parse().ok()
    }

    /// What the cgroup's processes use now.
    pub fn usage(&self) -> Usage {
        let number = |p: PathBuf| -> u64 {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        if self.v2 {
            let dir = &self.dirs[0];
            let stat = dir.join("cpu.stat");
            return Usage {
                memory_bytes: number(dir.join("memory.current")),
                memory_peak_bytes: number(dir.join("memory.peak")),
                cpu_ns: keyed(&stat, "usage_usec").unwrap_or(0).saturating_mul(1000),
                throttled_periods: keyed(&stat, "nr_throttled").unwrap_or(0),
                throttled_ns: keyed(&stat, "throttled_usec")
                    .unwrap_or(0)
                    .saturating_mul(1000),
            };
        }
        let memory = self.dir_of("memory");
        let stat = self.dir_of("cpu").join("cpu.stat");
        Usage {
            memory_bytes: number(memory.join("memory.usage_in_bytes")),
            memory_peak_bytes: number(memory.join("memory.max_usage_in_bytes")),
            cpu_ns: number(self.dir_of("cpuacct").join("cpuacct.usage")),
            throttled_periods: keyed(&stat, "nr_throttled").unwrap_or(0),
            throttled_ns: keyed(&stat, "throttled_time").unwrap_or(0),
        }
    }

    /// Kills what is left in the cgroup and removes it, and its alloc's
    /// cgroup when no other task's is left in it.
    pub fn remove(&self) -> io::Result<()> {
        for dir in &self.dirs {
            remove_cgroup_dir(dir)?;
            if let Some(alloc) = dir.parent() {
                // Busy while another task's cgroup is in it: kept.
                let _ = std::fs::remove_dir(alloc);
            }
        }
        Ok(())
    }
}

/// The CPU weight (v2, 1 to 10000) of `mhz`, as the runtimes convert CPU
/// shares (v1, 2 to 262144) to it.
pub fn cpu_weight(mhz: u64) -> u64 {
    let shares = mhz.clamp(2, 262_144);
    1 + ((shares - 2) * 9999) / 262_142
}

/// The value of `key` in a `key value` lines file.
fn keyed(file: &Path, key: &str) -> Option<u64> {
    std::fs::read_to_string(file)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    std::fs::write(path, value).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("writing {value:?} to {}: {e}", path.display()),
        )
    })
}

/// Writes a file the kernel may not have (swap accounting off, say).
fn write_if_there(path: &Path, value: &str) -> io::Result<()> {
    if path.exists() {
        write(path, value)
    } else {
        Ok(())
    }
}

/// Kills the processes of a cgroup dir and removes it (a cgroup with a
/// process, or a child, cannot be removed); gone already is fine.
fn remove_cgroup_dir(dir: &Path) -> io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let cgroup = TaskCgroup {
        v2: dir.join("cgroup.controllers").exists(),
        dirs: vec![dir.to_path_buf()],
    };
    let mut last = None;
    for _ in 0..100 {
        cgroup.kill_all(10);
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Err(last.unwrap_or_else(|| io::Error::other("cgroup not removed")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_weight_maps_shares_onto_one_to_ten_thousand() {
        assert_eq!(cpu_weight(0), 1);
        assert_eq!(cpu_weight(2), 1);
        assert_eq!(cpu_weight(1024), 39);
        assert_eq!(cpu_weight(262_144), 10_000);
        assert_eq!(cpu_weight(u64::MAX), 10_000);
    }

    /// A fake cgroup v2 file system in a temp dir (this machine runs v1):
    /// the files the kernel would have, as plain files.
    fn fake_v2() -> (tempfile::TempDir, Cgroups) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .expect("controllers");
        let cgroups = Cgroups::detect_at(dir.path()).expect("v2");
        (dir, cgroups)
    }

    #[test]
    fn v2_limits_go_to_the_unified_files_and_the_parents_hand_controllers_down() {
        let (dir, cgroups) = fake_v2();
        assert_eq!(cgroups.version(), "v2");
        let limits = Limits {
            memory: 32 << 20,
            memory_max: 64 << 20,
            cpu_mhz: 500,
            pids: 64,
        };
        let cg = cgroups.create("a1", "web", &limits).expect("create");
        let task = dir.path().join("berth/a1/web");
        assert_eq!(cg.dirs(), std::slice::from_ref(&task));
        let read = |p: &str| std::fs::read_to_string(task.join(p)).expect(p);
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(read("memory.low"), (32u64 << 20).to_string());
        assert_eq!(read("cpu.weight"), cpu_weight(500).to_string());
        assert_eq!(read("pids.max"), "64");
        for parent in ["", "berth", "berth/a1"] {
            let control =
                std::fs::read_to_string(dir.path().join(parent).join("cgroup.subtree_control"))
                    .expect("subtree_control");
            assert_eq!(control, "+memory +cpu +pids", "{parent}");
        }
        assert_eq!(cg.procs_files(), [task.join("cgroup.procs")]);
        std::fs::write(
            task.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .expect("events");
        assert_eq!(cg.oom_kills(), 1);
        std::fs::write(task.join("memory.current"), "1048576\n").expect("current");
        std::fs::write(
            task.join("cpu.stat"),
            "usage_usec 2500\nuser_usec 2000\nnr_throttled 4\nthrottled_usec 30\n",
        )
        .expect("cpu.stat");
        let usage = cg.usage();
        assert_eq!(
            (
                usage.memory_bytes,
                usage.cpu_ns,
                usage.throttled_periods,
                usage.throttled_ns
            ),
            (1 << 20, 2_500_000, 4, 30_000)
        );
        assert_eq!(cgroups.allocs(), ["a1"]);

        // A nested parent: each of its levels hands them on too.
        let nested = cgroups.with_parent("system/berth").expect("parent");
        let cg = nested.create("a2", "web", &limits).expect("create");
        assert_eq!(cg.dirs(), [dir.path().join("system/berth/a2/web")]);
        for parent in ["system", "system/berth", "system/berth/a2"] {
            let control =
                std::fs::read_to_string(dir.path().join(parent).join("cgroup.subtree_control"))
                    .expect("subtree_control");
            assert_eq!(control, "+memory +cpu +pids", "{parent}");
        }
        assert_eq!(nested.allocs(), ["a2"]);
    }

    /// The host's cgroups (v1 on the machines berth's CI runs on), and a
    /// cgroup of a test alloc removed when the test ends, failed or not.
    struct HostCgroup {
        cgroups: Cgroups,
        alloc: String,
    }

    impl HostCgroup {
        /// Under a parent of the test's own, which no agent started
        /// beside the tests cleans up.
        fn new(test: &str) -> HostCgroup {
            let parent = format!("berth-test-{test}-{}", std::process::id());
            HostCgroup {
                cgroups: Cgroups::detect()
                    .expect("the host's cgroups")
                    .with_parent(&parent)
                    .expect("parent"),
                alloc: "a1".to_string(),
            }
        }
    }

    impl Drop for HostCgroup {
        fn drop(&mut self) {
            for alloc in self.cgroups.allocs() {
                let _ = self.cgroups.remove_alloc(&alloc);
            }
            for root in self.cgroups.roots() {
                let _ = std::fs::remove_dir(root);
            }
        }
    }

    #[test]
    fn the_cgroups_of_unknown_allocs_are_removed_with_what_runs_in_them() {
        let host = HostCgroup::new("orphans");
        let limits = Limits {
            memory: 64 << 20,
            memory_max: 0,
            cpu_mhz: 100,
            pids: 16,
        };
        let kept = host.cgroups.create("kept", "t", &limits).expect("create");
        let orphan = host.cgroups.create("orphan", "t", &limits).expect("create");
        run_in(&orphan, "{ sleep 60 > /dev/null & }");
        assert_eq!(orphan.pids().len(), 1, "the orphan's sleeper");
        let known = std::collections::BTreeSet::from(["kept".to_string()]);
        let (removed, failed) = host.cgroups.remove_orphans(&known);
        assert_eq!(removed, ["orphan"]);
        assert!(failed.is_empty(), "{failed:?}");
        assert!(orphan.dirs().iter().all(|d| !d.exists()));
        assert!(kept.dirs().iter().all(|d| d.exists()));
        assert_eq!(host.cgroups.allocs(), ["kept"]);
    }

    #[test]
    fn a_cgroup_parent_is_a_relative_path_of_plain_names() {
        for good in ["berth", "services/berth", "berth-test"] {
            assert_eq!(check_parent(good), Ok(()), "{good}");
        }
        for bad in ["", "/berth", "../berth", "berth/../..", "./berth"] {
            let err = check_parent(bad).expect_err(bad);
            assert!(err.contains("relative path of plain names"), "{err}");
        }
    }

    /// Runs `script` under `sh` in `cgroup` (it joins it first).
    fn run_in(cgroup: &TaskCgroup, script: &str) -> std::process::ExitStatus {
        let join: Vec<String> = cgroup
            .procs_files()
            .iter()
            .map(|p| format!("echo $$ > {}", p.display()))
            .collect();
        std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("{} && {script}", join.join(" && ")))
            .stderr(std::process::Stdio::null())
            .status()
            .expect("sh")
    }

    #[test]
    fn a_task_over_its_memory_limit_is_oom_killed_and_the_cgroup_says_so() {
        let host = HostCgroup::new("oom");
        let limits = Limits {
            memory: 16 << 20,
            memory_max: 0,
            cpu_mhz: 100,
            pids: 32,
        };
        let cg = host
            .cgroups
            .create(&host.alloc, "t", &limits)
            .expect("create");
        assert_eq!(cg.memory_limit(), Some(16 << 20));
        assert_eq!(cg.oom_kills(), 0);
        // tail holds a line it has not seen the end of: 64 MiB of zeros.
        let status = run_in(&cg, "head -c 67108864 /dev/zero | tail > /dev/null");
        assert!(!status.success(), "{status:?}");
        assert!(cg.oom_kills() >= 1, "no OOM kill counted");
        assert!(cg.usage().memory_peak_bytes <= 16 << 20 || cg.usage().memory_peak_bytes == 0);
        // Within its limit the same completes.
        let roomy = host
            .cgroups
            .create(
                &host.alloc,
                "roomy",
                &Limits {
                    memory: 256 << 20,
                    ..limits
                },
            )
            .expect("create");
        assert!(run_in(&roomy, "head -c 67108864 /dev/zero | tail > /dev/null").success());
        assert_eq!(roomy.oom_kills(), 0);
        assert_eq!(
            host.cgroups
                .allocs()
                .iter()
                .filter(|a| **a == host.alloc)
                .count(),
            1
        );
        host.cgroups.remove_alloc(&host.alloc).expect("remove");
        assert!(cg.dirs().iter().all(|d| !d.exists()));
        assert!(!host.cgroups.allocs().contains(&host.alloc));
    }

    #[test]
    fn the_pids_limit_stops_a_fork_bomb_and_kill_all_empties_the_cgroup() {
        let host = HostCgroup::new("pids");
        let limits = Limits {
            memory: 128 << 20,
            memory_max: 0,
            cpu_mhz: 100,
            pids: 16,
        };
        let cg = host
            .cgroups
            .create(&host.alloc, "t", &limits)
            .expect("create");
        // Forty sleepers in the background: a fork past the limit fails
        // (and ends the shell).
        run_in(&cg, "for i in $(seq 40); do sleep 30 & done; exit 0");
        let held = cg.pids().len();
        assert!((1..=16).contains(&held), "{held} processes in the cgroup");
        assert!(cg.kill_all(100), "processes left: {:?}", cg.pids());
        cg.remove().expect("remove");
    }

    #[test]
    fn a_v2_hierarchy_without_memory_and_no_v1_is_refused_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("cgroup.controllers"), "cpu io\n").expect("controllers");
        let err = Cgroups::detect_at(dir.path()).expect_err("unusable");
        assert!(
            err.contains("lacks the memory, pids controller(s)"),
            "{err}"
        );
    }
}
