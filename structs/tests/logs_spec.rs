//! The task's `logs` block: Nomad's defaults, the values that survive
//! parsing, and the errors that name the field.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use berth_structs::spec::parse_job;
use berth_structs::{Job, LogConfig, Task};

fn job_with(logs: &str) -> String {
    format!(
        r#"job "j" {{
  group "g" {{
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/true"
      }}
{logs}
    }}
  }}
}}
"#
    )
}

fn task(job: &Job) -> &Task {
    &job.task_groups[0].tasks[0]
}

#[test]
fn a_task_without_a_logs_block_gets_nomads_defaults() {
    let job = parse_job(&job_with("")).expect("parse");
    assert_eq!(
        task(&job).logs,
        LogConfig {
            max_files: 10,
            max_file_size: 10
        }
    );
    assert_eq!(task(&job).logs.max_file_size_bytes(), 10 << 20);
    job.validate().expect("valid");
}

#[test]
fn the_logs_block_is_parsed() {
    let src =
        job_with("      logs {\n        max_files     = 3\n        max_file_size = 1\n      }");
    let job = parse_job(&src).expect("parse");
    assert_eq!(
        task(&job).logs,
        LogConfig {
            max_files: 3,
            max_file_size: 1
        }
    );
    // Either may be left out.
    let job = parse_job(&job_with("      logs {\n        max_files = 2\n      }")).unwrap();
    assert_eq!(task(&job).logs.max_files, 2);
    assert_eq!(task(&job).logs.max_file_size, 10);
}

#[test]
fn bad_logs_values_are_errors_that_name_the_field() {
    for (body, wanted) in [
        (
            "max_files = 0",
            r#"attribute "max_files" in logs in task "t""#,
        ),
        (
            "max_file_size = 0",
            r#"attribute "max_file_size" in logs in task "t""#,
        ),
        ("max_files = 1001", "is too large (at most 1000)"),
        ("max_file_size = 99999999", "is too large (at most 16384)"),
        ("max_files = \"x\"", "max_files"),
        ("max_size = 1", "max_size"),
    ] {
        let src = job_with(&format!("      logs {{\n        {body}\n      }}"));
        let e = parse_job(&src).expect_err(body);
        assert!(e.message.contains(wanted), "{body}: {e}");
        assert_eq!(e.line, 9, "{body}: {e}");
    }
}

#[test]
fn logs_from_json_are_checked_by_validate() {
    let mut job = parse_job(&job_with("")).unwrap();
    job.task_groups[0].tasks[0].logs = LogConfig {
        max_files: 0,
        max_file_size: u64::MAX,
    };
    let msgs = job.validate().unwrap_err().0;
    assert!(
        msgs.iter()
            .any(|m| m == "group \"g\" task \"t\": logs.max_files must be at least 1"),
        "{msgs:#?}"
    );
    assert!(
        msgs.iter().any(|m| m.starts_with(
            "group \"g\" task \"t\": logs.max_file_size 18446744073709551615 is too large"
        )),
        "{msgs:#?}"
    );
}

#[test]
fn a_task_stored_before_logs_existed_still_decodes() {
    let json = r#"{"name":"t","driver":"raw_exec","config":{"command":"/bin/true"}}"#;
    let t: Task = serde_json::from_str(json).expect("decode");
    assert_eq!(t.logs, LogConfig::default());
}
