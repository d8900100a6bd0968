//! The host the tests run on: free ports, processes and their memory, and
//! waiting on a condition with a deadline.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

/// Polls `f` until it returns `Ok(Some(v))`, or fails after `timeout` with
/// the last error or `what`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() >= deadline {
            return Err(match last_err {
                Some(e) => e.context(format!("timed out after {timeout:?} waiting for {what}")),
                None => anyhow!("timed out after {timeout:?} waiting for {what}"),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().expect("local addr").port()
}

/// The fields of `/proc/<pid>/stat` after the command name (which may hold
/// spaces and parentheses: they follow its last `)`), from the state on.
pub fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// CPU time (user and system) the process `pid` has used so far.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let f = stat_fields(pid)?;
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on Linux.
    Some(Duration::from_millis(ticks * 10))
}

/// Resident memory of a process in KiB (`VmRSS`), if it runs.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// PIDs of live (non-zombie) processes whose command line contains
/// `needle`.
pub fn processes_with_cmdline(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let zombie = u32::try_from(*pid)
                .ok()
                .and_then(stat_fields)
                .is_some_and(|f| f.first().is_some_and(|state| state.starts_with('Z')));
            // Arguments are NUL-separated; match them as a command line.
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            !zombie && cmdline.contains(needle)
        })
        .collect();
    pids.sort_unstable();
    pids
}
