//! The real `berth` CLI run against an agent's address.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::binary;
use crate::process::path_with_bins;

/// Runs the CLI against the HTTP API at `addr` (`http://HOST:PORT`).
pub fn cli_at(addr: &str, args: &[&str]) -> Result<Output> {
    Command::new(binary("berth"))
        .args(args)
        .env("BERTH_ADDR", addr)
        .env("PATH", path_with_bins())
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running berth {}", args.join(" ")))
}

/// Runs the CLI against `addr` and decodes its JSON output; an error with
/// its stderr unless it exits 0.
pub fn cli_json_at(addr: &str, args: &[&str]) -> Result<Value> {
    let out = cli_at(addr, args)?;
    if !out.status.success() {
        bail!(
            "berth {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("berth {}", args.join(" ")))
}

/// Runs the CLI against `addr`; its stdout, or an error with its output
/// unless it exits 0.
pub fn cli_ok_at(addr: &str, args: &[&str]) -> Result<String> {
    let out = exit_ok(cli_at(addr, args)?, args)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `out` of `berth ARGS...`, or an error with its stdout and stderr
/// unless it exited 0.
pub fn exit_ok(out: Output, args: &[&str]) -> Result<Output> {
    if !out.status.success() {
        bail!(
            "berth {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// Writes `spec` to `dir`/`name`.hcl and runs `berth job run -detach` on
/// it against `addr`; an error with its output unless it exits 0.
pub fn run_job_at(addr: &str, dir: &Path, name: &str, spec: &str) -> Result<()> {
    let file = job_file_at(dir, name, spec)?;
    cli_ok_at(addr, &["job", "run", "-detach", &file])?;
    Ok(())
}

/// Writes `spec` to `{name}.hcl` in `dir`; its path.
pub fn job_file_at(dir: &Path, name: &str, spec: &str) -> Result<String> {
    let file = dir.join(format!("{name}.hcl"));
    std::fs::write(&file, spec).with_context(|| format!("writing {}", file.display()))?;
    Ok(file.to_str().context("a UTF-8 job file path")?.to_string())
}
