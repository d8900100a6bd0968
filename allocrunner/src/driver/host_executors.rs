//! The executors running on this host that belong to another data dir: a
//! client whose data dir was lost comes back as a new node, while the old
//! node's executors and tasks keep running (and writing to their volumes)
//! until someone stops them. The agent names them when it starts.

use std::path::{Path, PathBuf};

use super::raw_exec::EXECUTOR_PROGRAM;

/// An executor process and the executor dir it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostExecutor {
    pub pid: i32,
    pub dir: PathBuf,
}

/// The executor dir of a command line, when it is an executor's:
/// `berth-executor DIR` or `<agent> executor DIR`.
fn executor_dir(argv: &[&str]) -> Option<PathBuf> {
    let dir = match argv {
        [program, dir] if Path::new(program).file_name()? == EXECUTOR_PROGRAM => dir,
        [_, "executor", dir] => dir,
        _ => return None,
    };
    Path::new(dir).is_absolute().then(|| PathBuf::from(dir))
}

/// The executors on this host whose executor dir is not below
/// `data_dir` (which should be canonical).
pub fn executors_outside(data_dir: &Path) -> Vec<HostExecutor> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<HostExecutor> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let text = String::from_utf8(raw).ok()?;
            let argv: Vec<&str> = text.trim_end_matches('\0').split('\0').collect();
            let dir = executor_dir(&argv)?;
            (!dir.starts_with(data_dir)).then_some(HostExecutor { pid, dir })
        })
        .collect();
    found.sort_by_key(|e| e.pid);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_executor_command_lines_are_recognised_and_others_not() {
        let dir = Some(PathBuf::from("/var/lib/berth/alloc/a/t/executor"));
        assert_eq!(
            executor_dir(&[
                "/usr/local/bin/berth-executor",
                "/var/lib/berth/alloc/a/t/executor"
            ]),
            dir
        );
        assert_eq!(
            executor_dir(&[
                "/usr/local/bin/berth",
                "executor",
                "/var/lib/berth/alloc/a/t/executor"
            ]),
            dir
        );
        assert_eq!(
            executor_dir(&["/usr/local/bin/berth", "agent", "-dev"]),
            None
        );
        assert_eq!(executor_dir(&["berth-executor", "relative"]), None);
        assert_eq!(executor_dir(&["/bin/sh", "-c", "sleep 1"]), None);
    }
}
