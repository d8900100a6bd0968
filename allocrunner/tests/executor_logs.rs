//! The executor's log files against real tasks: everything a task writes is
//! in its files, in order, before its exit is recorded; the files rotate
//! at their size and count; a new run continues at the highest index; a
//! process that escaped the task's group and keeps the output open does not
//! hold up the exit.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use berth_allocrunner::logs::{log_files, LogRotation};
use berth_allocrunner::{Driver, RawExecDriver, TaskSpec};
use common::{sh_task_spec, test_executor, PidFileKiller};

const WITHIN: Duration = Duration::from_secs(20);

fn spec(dir: &Path, script: &str, logs: LogRotation) -> TaskSpec {
    TaskSpec {
        logs,
        ..sh_task_spec(dir, script)
    }
}

fn concat(dir: &Path, base: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for f in log_files(dir, base).unwrap() {
        out.extend(std::fs::read(&f.path).unwrap());
    }
    out
}

async fn run(dir: &Path, script: &str, logs: LogRotation) {
    let driver = RawExecDriver::with_executor(test_executor());
    let handle = driver.start(&spec(dir, script, logs)).await.unwrap();
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    assert!(exit.successful(), "{exit}");
}

/// Numbered lines `00000001 xxx...` from `from` to `to`.
fn numbered(from: u32, to: u32) -> String {
    let pad = "x".repeat(90);
    (from..=to).map(|i| format!("{i:08} {pad}\n")).collect()
}

fn awk_lines(from: u32, to: u32) -> String {
    format!(
        r#"awk 'BEGIN {{ pad = sprintf("%90s", ""); gsub(/ /, "x", pad); for (i = {from}; i <= {to}; i++) printf "%08d %s\n", i, pad }}'"#
    )
}

#[tokio::test]
async fn everything_the_task_wrote_is_in_rotated_files_when_its_exit_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let logs = LogRotation {
        max_files: 1000,
        max_file_size: 64 * 1024,
    };
    // 3 MB as fast as it can, then exit at once.
    let script = format!("{} ; echo err-line >&2", awk_lines(1, 30_000));
    run(dir.path(), &script, logs).await;
    let files = log_files(dir.path(), "t.stdout").unwrap();
    assert!(files.len() > 40, "rotated into {} files", files.len());
    assert!(files.iter().all(|f| f.len <= 64 * 1024 && f.len > 0));
    // Lines stay whole where they can: a file is cut after a newline
    // unless a line arrived in pieces right at the cut.
    let whole = files
        .iter()
        .filter(|f| std::fs::read(&f.path).unwrap().last() == Some(&b'\n'))
        .count();
    assert!(whole * 10 >= files.len() * 8, "{whole} of {}", files.len());
    assert!(
        concat(dir.path(), "t.stdout") == numbered(1, 30_000).as_bytes(),
        "the files are exactly what the task wrote"
    );
    assert_eq!(concat(dir.path(), "t.stderr"), b"err-line\n");
}

#[tokio::test]
async fn old_files_are_deleted_and_a_new_run_continues_at_the_highest_index() {
    let dir = tempfile::tempdir().unwrap();
    let logs = LogRotation {
        max_files: 3,
        max_file_size: 10_000,
    };
    run(dir.path(), &awk_lines(1, 1000), logs).await;
    let first: Vec<u64> = log_files(dir.path(), "t.stdout")
        .unwrap()
        .iter()
        .map(|f| f.index)
        .collect();
    assert_eq!(first.len(), 3, "{first:?}");
    let highest = *first.last().unwrap();
    assert!(highest >= 9, "{first:?}");
    // The newest lines are all there, in order.
    let kept = String::from_utf8(concat(dir.path(), "t.stdout")).unwrap();
    assert!(numbered(1, 1000).ends_with(&kept));

    run(dir.path(), &awk_lines(1001, 1010), logs).await;
    let files = log_files(dir.path(), "t.stdout").unwrap();
    assert!(
        files.first().unwrap().index >= highest - 2,
        "continued, not restarted at 0: {files:?}"
    );
    let text = String::from_utf8(concat(dir.path(), "t.stdout")).unwrap();
    assert!(text.ends_with(&numbered(995, 1010)), "appended in order");
}

#[tokio::test]
async fn a_process_that_escaped_the_group_does_not_hold_up_the_exit() {
    let dir = tempfile::tempdir().unwrap();
    // `setsid` puts the child in a new session (and group), out of reach
    // of the group kill; it keeps stdout open for a long time.
    let pidfile = dir.path().join("escaped.pid");
    let script = format!(
        r#"echo before; setsid sh -c 'echo $$ > {}; exec sleep 60' & sleep 0.2; echo after"#,
        pidfile.display()
    );
    let started = Instant::now();
    run(dir.path(), &script, LogRotation::default()).await;
    let took = started.elapsed();
    if let Ok(pid) = std::fs::read_to_string(&pidfile) {
        if let Ok(pid) = pid.trim().parse::<i32>() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(concat(dir.path(), "t.stdout"), b"before\nafter\n");
}

/// Waits until `f` holds, for at most [`WITHIN`].
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WITHIN;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_full_disk_never_blocks_the_task_and_what_was_dropped_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let disk = berth_testutil::SmallDisk::new("1m");
    let marks = dir.path().join("marks");
    std::fs::create_dir(&marks).unwrap();
    // More than a pipe holds is written while the disk is full: a task
    // whose output were not read would block.
    let script = format!(
        r#"echo before
while [ ! -e {m}/filled ]; do sleep 0.02; done
awk 'BEGIN {{ for (i = 0; i < 40000; i++) print "lost line " i }}'
touch {m}/written
while [ ! -e {m}/go ]; do sleep 0.02; done
echo after"#,
        m = marks.display()
    );
    let mut task = spec(dir.path(), &script, LogRotation::default());
    task.stdout_path = disk.path().join("t.stdout");
    task.stderr_path = disk.path().join("t.stderr");
    let driver = RawExecDriver::with_executor(test_executor());
    let handle = driver.start(&task).await.unwrap();

    let first = disk.path().join("t.stdout.0");
    until("the first line", || {
        std::fs::read(&first).is_ok_and(|b| b.starts_with(b"before\n"))
    })
    .await;
    let fill = disk.fill();
    std::fs::write(marks.join("filled"), "").unwrap();
    until("the task to write through a full disk", || {
        marks.join("written").exists()
    })
    .await;
    std::fs::remove_file(&fill).unwrap();
    std::fs::write(marks.join("go"), "").unwrap();
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    assert!(exit.successful(), "{exit}");

    let text = String::from_utf8(concat(disk.path(), "t.stdout")).unwrap();
    assert!(
        text.starts_with("before\n"),
        "{:?}",
        &text[..40.min(text.len())]
    );
    let marker = text
        .lines()
        .find(|l| l.starts_with("[berth: "))
        .unwrap_or_else(|| panic!("no marker in {:?}", &text[text.len().saturating_sub(300)..]));
    assert!(
        marker.contains("bytes of this task's output were dropped"),
        "{marker}"
    );
    assert!(
        text.ends_with("]\nafter\n"),
        "{:?}",
        &text[text.len().saturating_sub(200)..]
    );
    // What was written and what was dropped add up to what the task wrote.
    let dropped: usize = marker["[berth: ".len()..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a byte count");
    let lost_lines: usize = (0..40000).map(|i| format!("lost line {i}\n").len()).sum();
    let kept = text.len() - "before\n".len() - "after\n".len() - marker.len() - 2;
    assert_eq!(kept + dropped, lost_lines, "{marker}");
}

/// While the executor drains the output of a task that has exited, the
/// task's zombie keeps its process group id taken: a signal the agent
/// sends the group before the exit is recorded cannot reach a group that
/// reused the id.
#[tokio::test]
async fn the_task_group_id_stays_taken_until_the_exit_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let task_pid_file = dir.path().join("task.pid");
    let escaped_pid_file = dir.path().join("escaped.pid");
    // The escaped child keeps stdout open: the executor drains for its
    // grace after the task has exited.
    let script = format!(
        r#"echo $$ > {}; setsid sh -c 'echo $$ > {}; exec sleep 60' & sleep 0.2; exit 0"#,
        task_pid_file.display(),
        escaped_pid_file.display()
    );
    // setsid: the escaped child leads its own group.
    let _escaped = PidFileKiller(escaped_pid_file);
    let driver = RawExecDriver::with_executor(test_executor());
    let task = spec(dir.path(), &script, LogRotation::default());
    let exit_file = task
        .executor_dir
        .join(berth_allocrunner::executor::EXIT_FILE);
    let handle = driver.start(&task).await.unwrap();
    until("the task's pid", || {
        std::fs::read_to_string(&task_pid_file).is_ok_and(|p| p.ends_with('\n'))
    })
    .await;
    let task_pid = std::fs::read_to_string(&task_pid_file).unwrap();
    let stat = format!("/proc/{}/stat", task_pid.trim());
    let (mut zombie_seen, mut gone_before_exit) = (false, false);
    let deadline = Instant::now() + WITHIN;
    while !exit_file.exists() {
        assert!(Instant::now() < deadline, "no exit recorded");
        match std::fs::read_to_string(&stat) {
            Ok(s) => zombie_seen |= s.rsplit(')').next().is_some_and(|r| r.starts_with(" Z")),
            // Gone, but only a fault if the exit is still not recorded.
            Err(_) => gone_before_exit |= !exit_file.exists(),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let exit = tokio::time::timeout(WITHIN, handle.wait()).await.unwrap();
    assert!(exit.successful(), "{exit}");
    assert!(
        zombie_seen,
        "the exited task was never seen waiting to be reaped"
    );
    assert!(
        !gone_before_exit,
        "the task was reaped (its group id freed) before its exit was recorded"
    );
}
