//! The CLI's answers to bad input, without an agent: each names the problem.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn berth(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        // Nothing listens here: commands that reach the API fail clearly.
        .env("BERTH_ADDR", "http://127.0.0.1:1")
        .output()
        .expect("run berth");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn job_run_names_the_unknown_attribute_and_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.hcl");
    std::fs::write(
        &f,
        "job \"x\" {\n  group \"g\" {\n    task \"t\" {\n      driver = \"raw_exec\"\n      colour = \"red\"\n    }\n  }\n}\n",
    )
    .unwrap();
    let (code, _, err) = berth(&["job", "run", f.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("line 5"), "{err}");
    assert!(err.contains("colour"), "{err}");
}

#[test]
fn job_validate_checks_a_file_without_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.hcl");
    std::fs::write(
        &good,
        "variable \"n\" {\n  default = 1\n}\njob \"v\" {\n  group \"g\" {\n    count = var.n\n    task \"t\" {\n      driver = \"raw_exec\"\n      config {\n        command = \"/bin/true\"\n      }\n    }\n  }\n}\n",
    )
    .unwrap();
    // No agent listens there: validate asks none.
    let (code, out, err) = berth(&["job", "validate", "-var", "n=3", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("Job validation successful: job \"v\", 1 group, 1 task"),
        "{out}"
    );
    let bad = dir.path().join("bad.hcl");
    std::fs::write(
        &bad,
        "job \"v\" {\n  group \"g\" {\n    count = -1\n  }\n}\n",
    )
    .unwrap();
    let (code, _, err) = berth(&["job", "validate", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("line 3") && err.contains("must not be negative"),
        "{err}"
    );
}

#[test]
fn job_run_rejects_a_mount_that_escapes_the_task_dir() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("escape.hcl");
    std::fs::write(
        &f,
        r#"job "x" {
  type = "batch"
  group "g" {
    volume "v" {
      type            = "csi"
      source          = "v"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/true"
      }
      volume_mount {
        volume      = "v"
        destination = "../../etc"
      }
    }
  }
}
"#,
    )
    .unwrap();
    let (code, _, err) = berth(&["job", "run", f.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("escapes the task directory"), "{err}");
}

/// The one line a failure prints: `Error: <message>`, nothing else.
fn single_error_line(err: &str) -> &str {
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr, got:\n{err}");
    lines[0]
        .strip_prefix("Error: ")
        .unwrap_or_else(|| panic!("the line starts with `Error: `: {err}"))
}

/// A usage error: the error line, a blank line, then the usage.
fn usage_error_line(err: &str) -> &str {
    let mut lines = err.lines();
    let first = lines.next().unwrap_or_default();
    assert_eq!(
        lines.next(),
        Some(""),
        "a blank line after the error: {err}"
    );
    assert!(
        lines.next().is_some_and(|l| l.starts_with("Usage: berth")),
        "the usage follows the error: {err}"
    );
    assert_eq!(err.matches("Error: ").count(), 1, "one error line: {err}");
    first
        .strip_prefix("Error: ")
        .unwrap_or_else(|| panic!("the line starts with `Error: `: {err}"))
}

#[test]
fn unreachable_api_is_reported_with_the_address_on_one_line() {
    let (code, _, err) = berth(&["node", "status"]);
    assert_eq!(code, 1);
    let line = single_error_line(&err);
    assert!(line.contains("http://127.0.0.1:1"), "{err}");
    assert!(line.contains("connection refused"), "{err}");
}

#[test]
fn berth_or_a_command_group_alone_shows_its_help_and_exits_2() {
    // BERTH_ADDR is set (see `berth`): the help shows all the same.
    for (args, want) in [
        (&[][..], "Usage: berth [OPTIONS] <COMMAND>"),
        (&["job"][..], "Usage: berth job [OPTIONS] <COMMAND>"),
        (&["volume", "snapshot"][..], "Usage: berth volume snapshot"),
    ] {
        let (code, out, err) = berth(args);
        assert_eq!(code, 2, "berth {args:?}: {err}");
        assert!(out.is_empty(), "berth {args:?} printed {out:?} on stdout");
        assert!(err.contains(want), "berth {args:?}: {err}");
        assert!(!err.contains("Error:"), "berth {args:?}: {err}");
    }
}

#[test]
fn a_missing_file_is_one_line_with_its_cause() {
    let (code, _, err) = berth(&["job", "run", "/nonexistent/x.hcl"]);
    assert_eq!(code, 1);
    assert_eq!(
        single_error_line(&err),
        "reading /nonexistent/x.hcl: No such file or directory (os error 2)"
    );
}

#[test]
fn usage_errors_exit_2_with_the_usage_after_the_error() {
    let cases: &[(&[&str], &str)] = &[
        (&["frobnicate"], "unrecognized subcommand 'frobnicate'"),
        (
            &["job", "status", "-bogus"],
            "unexpected argument '-bogus' found",
        ),
        (
            &["job", "stop"],
            "the following required arguments were not provided: <JOB>",
        ),
        (&["job", "stop", "a", "b"], "unexpected argument 'b' found"),
        (
            &["node", "status", "-address"],
            "a value is required for '-address <ADDR>' but none was supplied",
        ),
        (
            &["volume", "detach", "v"],
            "the following required arguments were not provided: <NODE>",
        ),
        (
            &["agent", "-data-dir"],
            "a value is required for '-data-dir <DIR>' but none was supplied",
        ),
        (&["agent", "-bogus"], "unexpected argument '-bogus' found"),
        (
            &["node", "drain", "n1"],
            "the following required arguments were not provided: <-enable|-disable>",
        ),
        (
            &["node", "drain", "-disable", "-force", "n1"],
            "the argument '-disable' cannot be used with '-force'",
        ),
        (
            &[
                "node",
                "drain",
                "-enable",
                "-deadline",
                "1h",
                "-force",
                "n1",
            ],
            "the argument '-deadline <D>' cannot be used with '-force'",
        ),
        (
            &["node", "drain", "-enable", "-bogus", "n1"],
            "unexpected argument '-bogus' found",
        ),
        (
            &["node", "eligibility", "-enable"],
            "the following required arguments were not provided: <NODE>",
        ),
        (
            &["node", "eligibility", "-enable", "-deadline", "1h", "n1"],
            "unexpected argument '-deadline' found",
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = berth(args);
        assert_eq!(code, 2, "berth {args:?}: {err}");
        assert_eq!(usage_error_line(&err), *want, "berth {args:?}");
        assert!(out.is_empty(), "berth {args:?} printed {out:?} on stdout");
    }
}

#[test]
fn a_job_file_over_the_api_limit_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("big.hcl");
    // Sparse: the size is what counts, and the CLI must not read it.
    std::fs::File::create(&f)
        .unwrap()
        .set_len(50 * 1024 * 1024)
        .unwrap();
    let path = f.to_str().unwrap();
    let (code, _, err) = berth(&["job", "run", path]);
    assert_eq!(code, 1);
    assert_eq!(
        single_error_line(&err),
        format!("job file {path} is 50 MiB; the limit is 2 MiB")
    );
    for sub in ["create", "register"] {
        let (code, _, err) = berth(&["volume", sub, path]);
        assert_eq!(code, 1);
        assert_eq!(
            single_error_line(&err),
            format!("volume file {path} is 50 MiB; the limit is 2 MiB")
        );
    }
}

#[test]
fn a_spec_from_a_pipe_over_the_limit_is_refused_too() {
    // /dev/stdin has no size up front: the read stops past the limit.
    let mut child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["job", "run", "/dev/stdin"])
        .env("BERTH_ADDR", "http://127.0.0.1:1")
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run berth");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let chunk = vec![b'#'; 1024 * 1024];
        for _ in 0..8 {
            if stdin.write_all(&chunk).is_err() {
                break; // berth stopped reading, as it should
            }
        }
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        single_error_line(&err),
        "job file /dev/stdin is more than 2 MiB; the limit is 2 MiB"
    );
}
