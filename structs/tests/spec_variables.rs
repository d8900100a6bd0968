//! Input variables in job files: `variable` blocks, `var.NAME` and
//! `${var.NAME}` references, `-var NAME=VALUE` overrides.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use berth_structs::spec::{parse_job, parse_job_with_variables};

const JOB: &str = r#"
variable "count" {
  type    = number
  default = 2
}

variable "tag" {
  default     = "1.0"
  description = "the release to run"
}

variable "enabled" {
  type    = bool
  default = true
}

job "web" {
  group "g" {
    count = var.count
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/echo"
        args    = ["release-${var.tag}", var.tag, "${BERTH_ALLOC_ID}"]
      }
      env {
        ENABLED = var.enabled
        TAG     = "v${var.tag}"
      }
    }
  }
}
"#;

fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn defaults_fill_references_and_task_env_references_stay() {
    let job = parse_job(JOB).unwrap();
    let g = &job.task_groups[0];
    assert_eq!(g.count, 2);
    let t = &g.tasks[0];
    assert_eq!(
        t.config.args,
        vec!["release-1.0", "1.0", "${BERTH_ALLOC_ID}"],
        "${{var.x}} is filled in, ${{NAME}} is kept for the task environment"
    );
    assert_eq!(t.env["ENABLED"], "true");
    assert_eq!(t.env["TAG"], "v1.0");
}

#[test]
fn a_var_override_wins_over_the_default() {
    let job = parse_job_with_variables(
        JOB,
        &vars(&[("count", "5"), ("tag", "2.1"), ("tag", "2.2")]),
    )
    .unwrap();
    assert_eq!(job.task_groups[0].count, 5);
    assert_eq!(
        job.task_groups[0].tasks[0].config.args[..2],
        ["release-2.2".to_string(), "2.2".to_string()],
        "the last -var of a name wins"
    );
}

#[test]
fn an_unknown_var_name_is_refused_naming_it() {
    let err = parse_job_with_variables(JOB, &vars(&[("colour", "red")])).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("no variable \"colour\" is declared"), "{msg}");
    assert!(msg.contains("\"count\", \"enabled\", \"tag\""), "{msg}");
    assert!(!msg.starts_with("line"), "a -var has no line: {msg}");
}

#[test]
fn an_override_of_the_wrong_type_is_refused() {
    let msg = parse_job_with_variables(JOB, &vars(&[("count", "many")]))
        .unwrap_err()
        .to_string();
    assert_eq!(msg, "-var count=many: variable \"count\" is a number");
    let msg = parse_job_with_variables(JOB, &vars(&[("enabled", "yes")]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("\"enabled\" is a bool"), "{msg}");
}

#[test]
fn a_variable_without_default_must_be_given() {
    let src = r#"
variable "tag" {}
job "web" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      config { command = "/bin/echo-${var.tag}" }
    }
  }
}
"#;
    let err = parse_job(src).unwrap_err();
    assert_eq!(err.line, 2);
    assert!(
        err.message
            .contains("variable \"tag\" has no default: give it a value with -var tag=..."),
        "{err}"
    );
    let job = parse_job_with_variables(src, &vars(&[("tag", "x")])).unwrap();
    assert_eq!(job.task_groups[0].tasks[0].config.command, "/bin/echo-x");
}

#[test]
fn an_undeclared_reference_is_an_error_naming_it_and_its_line() {
    let src = r#"job "web" {
  group "g" {
    count = var.size
  }
}
"#;
    let err = parse_job(src).unwrap_err();
    assert_eq!(err.line, 3, "{err}");
    assert!(err.message.contains("var.size"), "{err}");
    assert!(err.message.contains("undeclared variable"), "{err}");

    let src = r#"job "web" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      config { command = "/bin/${var.cmd}" }
    }
  }
}
"#;
    let err = parse_job(src).unwrap_err();
    assert_eq!(err.line, 5, "{err}");
    assert!(err.message.contains("var.cmd"), "{err}");
}

#[test]
fn a_variable_used_where_its_type_does_not_fit_is_a_type_error() {
    let src = r#"
variable "tag" { default = "x" }
job "web" {
  group "g" {
    count = var.tag
  }
}
"#;
    let err = parse_job(src).unwrap_err();
    assert_eq!(err.line, 5, "{err}");
    assert!(
        err.message.contains("expected a number, found a string"),
        "{err}"
    );
}

#[test]
fn bad_variable_blocks_are_refused() {
    for (src, want) in [
        (
            "variable \"a\" { type = list(string) }\njob \"j\" {}",
            "berth supports the types string, number and bool",
        ),
        (
            "variable \"a\" {\n type = number\n default = \"x\"\n}\njob \"j\" {}",
            "the variable is a number, the default is not",
        ),
        (
            "variable \"a\" {\n  validation {\n  }\n}\njob \"j\" {}",
            "unsupported block \"validation\" in variable \"a\"",
        ),
        (
            "variable \"a\" {}\nvariable \"a\" {}\njob \"j\" {}",
            "variable \"a\" is declared twice",
        ),
        (
            "variable \"a\" { default = var.b }\njob \"j\" {}",
            "defaults cannot refer to anything",
        ),
    ] {
        let err = parse_job(src).unwrap_err().to_string();
        assert!(err.contains(want), "{src:?}: {err}");
    }
}
