//! Client garbage collection on a dev agent that keeps at most three
//! terminal allocs: the oldest terminal allocs' directories go, the newest
//! stay, and an alloc whose volume is still being unmounted (its plugin is
//! frozen) is not touched until the unmount is done, then goes like any
//! other, leaving no mount behind.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{mounts_under, wait_for, DevAgent};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

const MAX_TERMINAL: &str = "3";
const WITHIN: Duration = Duration::from_secs(60);

/// A batch job that writes a line to its log and exits.
fn short_job(agent: &DevAgent, id: &str) -> Result<String> {
    agent.write_file(
        &format!("{id}.hcl"),
        &format!(
            r#"
job "{id}" {{
  type = "batch"
  group "g" {{
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "echo done"]
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
    )
}

/// A batch job that mounts the "data" volume and exits once `go` exists in
/// its task's local dir.
const HOLDER: &str = r#"
job "holder" {
  type = "batch"
  group "g" {
    volume "data" {
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "while [ ! -e ${BERTH_TASK_DIR}/local/go ]; do sleep 0.1; done"]
      }
      volume_mount {
        volume      = "data"
        destination = "data"
      }
      resources {
        cpu    = 10
        memory = 8
      }
    }
  }
}
"#;

/// The only alloc of `job`.
fn alloc_of(agent: &DevAgent, job: &str) -> Result<Value> {
    let v = agent.api_get(&format!("/v1/job/{job}/allocations"))?;
    match v.as_array().map(Vec::as_slice) {
        Some([a]) => Ok(a.clone()),
        other => bail!("job {job} should have one alloc, has {other:?}"),
    }
}

/// Runs a short job to completion; returns its alloc's directory.
fn run_short_job(agent: &DevAgent, id: &str) -> Result<PathBuf> {
    agent.cli_ok(&["job", "run", "-detach", &short_job(agent, id)?])?;
    let alloc = wait_for(&format!("{id} to complete"), WITHIN, || {
        let a = alloc_of(agent, id)?;
        Ok((a["client_status"] == "complete").then_some(a))
    })?;
    Ok(agent
        .data_dir
        .path()
        .join("alloc")
        .join(alloc["id"].as_str().unwrap_or_default()))
}

/// Waits until exactly the dirs of `gone` are gone and those of `kept`
/// remain.
fn wait_collected(gone: &[&PathBuf], kept: &[&PathBuf]) -> Result<()> {
    wait_for("the oldest terminal allocs to be collected", WITHIN, || {
        Ok(gone.iter().all(|d| !d.exists()).then_some(()))
    })?;
    for d in kept {
        if !d.exists() {
            bail!("{} was collected, but it is among the newest", d.display());
        }
    }
    Ok(())
}

/// Sends SIGCONT to a frozen plugin on drop, so a failing test does not
/// leave it stopped.
struct Thaw(i32);

impl Drop for Thaw {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.0), Signal::SIGCONT);
    }
}

#[test]
fn the_oldest_terminal_allocs_are_collected_and_none_while_its_volume_is_mounted() -> Result<()> {
    let agent = DevAgent::start_with_args(&["-gc-max-allocs", MAX_TERMINAL])?;
    let dir = agent.data_dir.path().to_path_buf();
    agent.run_plugin_and_create_volume()?;

    // The holder runs with the volume mounted.
    agent.cli_ok(&[
        "job",
        "run",
        "-detach",
        &agent.write_file("holder.hcl", HOLDER)?,
    ])?;
    let holder = wait_for("the holder to run", WITHIN, || {
        let a = alloc_of(&agent, "holder")?;
        Ok((a["client_status"] == "running").then_some(a))
    })
    .with_context(|| agent.log())?;
    let holder_dir = dir
        .join("alloc")
        .join(holder["id"].as_str().unwrap_or_default());
    let csi_dir = dir.join("client/csi");
    wait_for("the holder's volume to be mounted", WITHIN, || {
        Ok((!mounts_under(&holder_dir).is_empty()).then_some(()))
    })?;

    // Its plugin freezes, and the holder ends: its postrun cannot unmount
    // the volume until the plugin thaws.
    let needle = format!("--endpoint=unix://{}", dir.display());
    let pids = agent.processes_with_cmdline(&needle);
    let [plugin] = pids.as_slice() else {
        bail!("want one plugin process, found {pids:?}");
    };
    kill(Pid::from_raw(*plugin), Signal::SIGSTOP)?;
    let thaw = Thaw(*plugin);
    std::fs::write(holder_dir.join("t/local/go"), "")?;

    // Five allocs end; the two oldest go, the holder is not touched.
    let mut dirs = Vec::new();
    for i in 0..5 {
        dirs.push(run_short_job(&agent, &format!("gc-{i}"))?);
    }
    wait_collected(
        &[&dirs[0], &dirs[1]],
        &[&dirs[2], &dirs[3], &dirs[4], &holder_dir],
    )
    .with_context(|| agent.log())?;
    assert!(dirs[4].join("alloc/logs/t.stdout.0").exists());
    let a = alloc_of(&agent, "holder")?;
    assert!(
        a["client_status"] == "running" || a["client_status"] == "pending",
        "the holder's postrun still waits for its plugin: {a}"
    );
    assert!(
        !mounts_under(&csi_dir).is_empty(),
        "the holder's volume is still mounted"
    );

    // The plugin thaws: the holder's volume is unmounted and it completes.
    // It is now the newest terminal alloc, so the oldest other one goes.
    drop(thaw);
    wait_for("the holder to complete", WITHIN, || {
        Ok((alloc_of(&agent, "holder")?["client_status"] == "complete").then_some(()))
    })
    .with_context(|| agent.log())?;
    wait_collected(&[&dirs[2]], &[&dirs[3], &dirs[4], &holder_dir]).with_context(|| agent.log())?;

    // Three more end: the holder is among the oldest now, and goes.
    for i in 5..8 {
        dirs.push(run_short_job(&agent, &format!("gc-{i}"))?);
    }
    wait_collected(
        &[&dirs[3], &dirs[4], &holder_dir],
        &[&dirs[5], &dirs[6], &dirs[7]],
    )
    .with_context(|| agent.log())?;
    assert!(
        mounts_under(&csi_dir).is_empty(),
        "nothing stays mounted: {:?}",
        mounts_under(&csi_dir)
    );
    assert!(mounts_under(&dir.join("alloc")).is_empty());
    // The servers still know the collected allocs as complete; none of
    // them runs again.
    let again = alloc_of(&agent, "gc-0")?;
    assert_eq!(again["client_status"], "complete", "{again}");
    assert!(!dirs[0].exists());
    Ok(())
}

#[test]
fn allocs_terminal_longer_than_the_threshold_are_collected_every_interval() -> Result<()> {
    let agent = DevAgent::start_with_args(&["-gc-interval", "1s", "-gc-alloc-threshold", "2s"])?;
    let first = run_short_job(&agent, "aged")?;
    wait_for("the aged alloc to be collected", WITHIN, || {
        Ok((!first.exists()).then_some(()))
    })
    .with_context(|| agent.log())?;
    // Far below gc_max_allocs: only its age made it go.
    let a = alloc_of(&agent, "aged")?;
    assert_eq!(a["client_status"], "complete", "{a}");
    Ok(())
}
