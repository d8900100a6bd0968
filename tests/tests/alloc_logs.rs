//! `berth alloc logs` against a dev agent and real tasks: a follower reads
//! every line a task writes, in order, none lost and none twice, while the
//! task's files rotate and the agent is SIGKILLed and started again under
//! it; `-stderr`, `-tail -n`, a task named or left out, and the errors.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_tests::*;
use serde_json::Value;

/// Lines of 100 bytes: 50 MB.
const LINES: u64 = 500_000;
const LINE_LEN: usize = 99;

/// Kills the follower when the test ends, however it ends.
struct Follower(Child);

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The ID of the only alloc of `job`, once it runs.
fn running_alloc(agent: &DevAgent, job: &str) -> Result<String> {
    let alloc = wait_alloc_running(agent, job)?;
    Ok(alloc["id"].as_str().context("an alloc ID")?.to_string())
}

/// Waits until the only alloc of `job` is complete.
fn wait_complete(agent: &DevAgent, job: &str) -> Result<Value> {
    wait_for(
        &format!("the {job} alloc to complete"),
        Duration::from_secs(60),
        || {
            let a = only_alloc(agent, job)?;
            Ok((a["client_status"] == "complete").then_some(a))
        },
    )
    .with_context(|| agent.log())
}

/// The sizes of the files `<task>.<stream>.N` of an alloc, by index.
fn log_file_sizes(agent: &DevAgent, alloc: &str, base: &str) -> Result<Vec<(u64, u64)>> {
    let dir = agent
        .data_dir
        .path()
        .join("alloc")
        .join(alloc)
        .join("alloc/logs");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(index) = name
            .strip_prefix(&format!("{base}."))
            .and_then(|i| i.parse().ok())
        {
            files.push((index, e.metadata()?.len()));
        }
    }
    files.sort();
    Ok(files)
}

#[test]
fn follow_reads_every_line_in_order_while_files_rotate_and_the_agent_is_killed() -> Result<()> {
    let mut agent = DevAgent::start()?;
    // Numbered lines, paced (about 4 MB/s) so that the 30 files kept are
    // more than the follower falls behind while the agent is down. Half
    // way, the writer waits for `resume`, made once the agent is back: the
    // agent is killed in the middle of the task however slow the test.
    let resume = agent.data_dir.path().join("resume");
    let half = LINES / 2;
    let script = agent.write_file(
        "writer.sh",
        &format!(
            r#"echo "stderr line 1" >&2
awk 'BEGIN {{
  pad = sprintf("%90s", ""); gsub(/ /, "x", pad)
  for (i = 1; i <= {LINES}; i++) {{
    printf "%08d %s\n", i, pad
    if (i % 10000 == 0) {{ fflush(); system("sleep 0.25") }}
    if (i == {half}) {{ while (system("test -e {resume}") != 0) system("sleep 0.05") }}
  }}
}}'
echo "stderr line 2" >&2
"#,
            resume = resume.display()
        ),
    )?;
    let job = agent.write_file(
        "logs.hcl",
        &format!(
            r#"job "logs" {{
  type = "batch"
  group "g" {{
    task "w" {{
      driver = "raw_exec"
      logs {{
        max_files     = 30
        max_file_size = 1
      }}
      config {{
        command = "/bin/sh"
        args    = ["{script}"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
        ),
    )?;
    agent.cli_ok(&["job", "run", "-detach", &job])?;
    let alloc = running_alloc(&agent, "logs")?;

    let mut child = Command::new(binary("berth"))
        .args(["alloc", "logs", "-f", &alloc])
        .env("BERTH_ADDR", &agent.http_addr)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the follower")?;
    let stdout = child.stdout.take().context("the follower's stdout")?;
    let stderr = child.stderr.take().context("the follower's stderr")?;
    let mut follower = Follower(child);
    let read = Arc::new(AtomicU64::new(0));
    let checker = {
        let read = read.clone();
        std::thread::spawn(move || -> Result<u64> {
            let mut expected = 1u64;
            for line in BufReader::with_capacity(1 << 20, stdout).split(b'\n') {
                let line = line?;
                let n: Option<u64> = std::str::from_utf8(&line[..line.len().min(8)])
                    .ok()
                    .and_then(|s| s.parse().ok());
                if n != Some(expected) || line.len() != LINE_LEN {
                    bail!(
                        "line {expected} expected, got {:?}",
                        String::from_utf8_lossy(&line[..line.len().min(120)])
                    );
                }
                read.store(expected, Ordering::Relaxed);
                expected += 1;
            }
            Ok(expected - 1)
        })
    };
    let notes = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut s);
        s
    });

    wait_for(
        "the follower to read a fifth of the lines",
        Duration::from_secs(60),
        || Ok((read.load(Ordering::Relaxed) >= LINES / 5).then_some(())),
    )?;
    agent.kill_agent()?;
    let at_kill = read.load(Ordering::Relaxed);
    assert!(at_kill < LINES, "the agent was killed in the middle");
    eprintln!("killed the agent after {at_kill} lines");
    agent.start_again()?;
    std::fs::write(&resume, "")?;

    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = follower.0.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            bail!(
                "the follower did not end; it read {} lines; agent log:\n{}",
                read.load(Ordering::Relaxed),
                agent.log()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let notes = notes.join().expect("the stderr reader");
    let lines = checker.join().expect("the checker")?;
    assert!(status.success(), "follower: {status}; stderr: {notes}");
    assert_eq!(lines, LINES, "every line, once, in order; stderr: {notes}");
    assert!(
        notes.contains("trying again"),
        "the follower saw the agent go away and kept following: {notes:?}"
    );
    assert!(
        !notes.contains("Warning"),
        "the follower was not outrun: {notes}"
    );

    // The files rotated at 1 MiB, and only the newest 30 are kept.
    let files = log_file_sizes(&agent, &alloc, "w.stdout")?;
    assert!(files.len() > 1 && files.len() <= 30, "{files:?}");
    assert!(files.iter().all(|(_, len)| *len <= 1 << 20), "{files:?}");
    let highest = files.last().map(|(i, _)| *i).unwrap_or_default();
    assert!(highest >= 47, "50 MB in 1 MiB files: {files:?}");

    // A cursor on a file rotated away reads on from the oldest file there
    // is, and says so.
    let oldest = files.first().map(|(i, _)| *i).unwrap_or_default();
    let answer = agent.http(&format!(
        "GET /v1/client/fs/logs/{alloc}?file=0&offset=0&limit=100 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    ))?;
    assert_eq!(answer.status, 200, "{}", answer.head);
    assert_eq!(
        answer.header("x-berth-log-lost"),
        Some("true"),
        "{}",
        answer.head
    );
    assert_eq!(
        answer.header("x-berth-log-file"),
        Some(oldest.to_string().as_str())
    );
    assert_eq!(answer.body.len(), 100);

    wait_complete(&agent, "logs")?;
    let err = agent.cli_ok(&["alloc", "logs", "-stderr", &alloc])?;
    assert_eq!(err, "stderr line 1\nstderr line 2\n");
    let tail = agent.cli_ok(&["alloc", "logs", "-tail", "-n", "3", &alloc, "w"])?;
    let numbers: Vec<&str> = tail.lines().map(|l| &l[..8]).collect();
    assert_eq!(numbers, ["00499998", "00499999", "00500000"]);
    Ok(())
}

#[test]
fn logs_of_a_task_by_name_the_tail_and_the_errors() -> Result<()> {
    let agent = DevAgent::start()?;
    let job = agent.write_file(
        "two.hcl",
        r#"job "two" {
  type = "batch"
  group "g" {
    task "a" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo a-$i; done; echo oops >&2"]
      }
    }
    task "b" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "echo b-out"]
      }
    }
  }
}
"#,
    )?;
    agent.cli_ok(&["job", "run", "-detach", &job])?;
    let alloc = wait_complete(&agent, "two")?;
    let id = alloc["id"].as_str().context("an alloc ID")?.to_string();

    let all: String = (1..=12).map(|i| format!("a-{i}\n")).collect();
    assert_eq!(agent.cli_ok(&["alloc", "logs", &id, "a"])?, all);
    assert_eq!(agent.cli_ok(&["alloc", "logs", &id, "b"])?, "b-out\n");
    assert_eq!(
        agent.cli_ok(&["alloc", "logs", "-stderr", &id, "a"])?,
        "oops\n"
    );
    // -tail prints the last 10 lines unless -n says otherwise; an ID
    // prefix is enough.
    let last10: String = (3..=12).map(|i| format!("a-{i}\n")).collect();
    assert_eq!(
        agent.cli_ok(&["alloc", "logs", "-tail", &id[..8], "a"])?,
        last10
    );
    assert_eq!(
        agent.cli_ok(&["alloc", "logs", "-tail", "-n", "2", &id, "a"])?,
        "a-11\na-12\n"
    );
    // -f on a dead task prints what there is and ends, from the tail too.
    assert_eq!(agent.cli_ok(&["alloc", "logs", "-f", &id, "b"])?, "b-out\n");
    assert_eq!(
        agent.cli_ok(&["alloc", "logs", "-f", "-tail", "-n", "1", &id, "a"])?,
        "a-12\n"
    );
    // -n goes with -tail.
    let out = agent.cli(&["alloc", "logs", "-n", "2", &id, "a"])?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");

    // Two tasks: which one must be said.
    let out = agent.cli(&["alloc", "logs", &id])?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("Error: "), "{err}");
    assert!(err.contains("a, b"), "{err}");
    // An unknown task or alloc.
    let out = agent.cli(&["alloc", "logs", &id, "nope"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no task \"nope\""),
        "{:?}",
        out
    );
    let out = agent.cli(&["alloc", "logs", "ffffffff-0000"])?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("Error: ") && err.contains("ffffffff-0000"),
        "{err}"
    );
    // Usage errors.
    let out = agent.cli(&["alloc", "logs"])?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");

    // The API: raw bytes, the cursor and the task's state in headers.
    let answer = agent.http(&format!(
        "GET /v1/client/fs/logs/{id}?task=a&type=stdout&limit=5 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    ))?;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, b"a-1\na");
    assert_eq!(
        answer.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(answer.header("x-berth-log-file"), Some("0"));
    assert_eq!(answer.header("x-berth-log-offset"), Some("5"));
    assert_eq!(answer.header("x-berth-log-task-state"), Some("dead"));
    let answer = agent.http(&format!(
        "GET /v1/client/fs/logs/{id}?task=a&file=0&offset=5&lines=2 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    ))?;
    assert_eq!(answer.status, 400);
    let body: Value = serde_json::from_slice(&answer.body)?;
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("lines cannot be used together")),
        "{body}"
    );

    // The help names the flags.
    let help = agent.cli_ok(&["alloc", "logs", "-h"])?;
    for flag in ["-f", "-stderr", "-tail", "-n", "ALLOC", "TASK"] {
        assert!(help.contains(flag), "{flag} in {help}");
    }
    Ok(())
}
