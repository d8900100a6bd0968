//! The CLI's answers to bad input, without an agent: each names the problem.

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

#[test]
fn unreachable_api_is_reported_with_the_address() {
    let (code, _, err) = berth(&["node", "status"]);
    assert_eq!(code, 1);
    assert!(err.contains("http://127.0.0.1:1"), "{err}");
}

#[test]
fn unknown_command_and_flag_are_errors() {
    let (code, _, err) = berth(&["frobnicate"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown command"), "{err}");
    let (code, _, err) = berth(&["job", "status", "-bogus"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown flag -bogus"), "{err}");
    let (code, _, err) = berth(&["agent", "-data-dir"]);
    assert_eq!(code, 1);
    assert!(err.contains("-data-dir needs a value"), "{err}");
}
