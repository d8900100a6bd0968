//! The repository's example files and the job specs the tests run.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repo root")
        .to_path_buf()
}

/// Path of an example file, e.g. `jobs/writer.hcl`.
pub fn example(path: &str) -> String {
    repo_root()
        .join("examples")
        .join(path)
        .display()
        .to_string()
}

/// The text of an example file with the first `from` replaced by `to`; an
/// error when the example has no `from` (it changed under the test).
pub fn example_with(path: &str, from: &str, to: &str) -> Result<String> {
    let src = std::fs::read_to_string(example(path))
        .with_context(|| format!("reading example {path}"))?;
    if !src.contains(from) {
        bail!("example {path} has no {from:?} to replace");
    }
    Ok(src.replacen(from, to, 1))
}

/// A service job `id` of `count` allocs whose one task sleeps for five
/// minutes; `version` goes into the task's env, so that each value is a
/// changed spec.
pub fn sleeping_service_job(id: &str, count: u32, version: usize) -> String {
    format!(
        r#"
job "{id}" {{
  type = "service"
  group "web" {{
    count = {count}
    task "sleep" {{
      driver = "raw_exec"
      env {{
        VERSION = "{version}"
      }}
      config {{
        command = "/bin/sleep"
        args    = ["300"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// A batch job `id` of `count` allocs whose one task exits 0 at once,
/// asking for 10 MHz and 8 MB.
pub fn quick_batch_job(id: &str, count: u32) -> String {
    format!(
        r#"
job "{id}" {{
  type = "batch"
  group "g" {{
    count = {count}
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "exit 0"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// A service job `job` of one group `job` whose task `task` runs
/// `/bin/sh` with `args`, with the CSI volume "data" (single node writer)
/// mounted at `data` in its task dir.
pub fn csi_volume_service_job(job: &str, task: &str, args: &[&str]) -> String {
    let args = args
        .iter()
        .map(|a| Value::from(*a).to_string())
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"
job "{job}" {{
  type        = "service"
  datacenters = ["dc1"]

  group "{job}" {{
    volume "data" {{
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}

    task "{task}" {{
      driver = "raw_exec"

      config {{
        command = "/bin/sh"
        args    = [{args}]
      }}

      volume_mount {{
        volume      = "data"
        destination = "data"
      }}

      resources {{
        cpu    = 50
        memory = 32
      }}
    }}
  }}
}}
"#
    )
}
