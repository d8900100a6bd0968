//! Growing a volume in use and taking snapshots of one, end to end on a dev
//! agent: the real `berth` binary, the example hostpath plugin, the CLI,
//! real mounts. An image-backed volume (an ext4 image on a loop device)
//! mounted by a running task is grown by `volume create` of its spec with a
//! larger `capacity_min`, and the task sees the new size; a snapshot of a
//! volume with data is listed, restored into a new volume, whose data a job
//! reads, a clone likewise, and deleting the snapshot removes it from the
//! list.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::cluster::writer_volume_with;
use berth_tests::{
    loop_devices_unusable, loops_backed_under, only_alloc, wait_alloc_running, wait_for, DevAgent,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// Whether this process may grow a mounted filesystem (`CAP_SYS_RESOURCE`,
/// which online `resize2fs` needs).
fn has_cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("CapEff:"))?;
            u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// A job `job` of type `job_type` whose task `main` runs `/bin/sh -c
/// script` with the CSI volume `volume` mounted at `data` in its task dir.
fn volume_job(job: &str, job_type: &str, volume: &str, script: &str) -> String {
    let script = Value::from(script).to_string();
    format!(
        r#"
job "{job}" {{
  type        = "{job_type}"
  datacenters = ["dc1"]

  group "{job}" {{
    volume "vol" {{
      type            = "csi"
      source          = "{volume}"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}

    task "main" {{
      driver = "raw_exec"

      config {{
        command = "/bin/sh"
        args    = ["-c", {script}]
      }}

      volume_mount {{
        volume      = "vol"
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

/// Runs a batch job to completion; fails unless its alloc completed.
fn run_batch(agent: &DevAgent, job: &str, volume: &str, script: &str) -> Result<()> {
    let file = agent.write_file(
        &format!("{job}.hcl"),
        &volume_job(job, "batch", volume, script),
    )?;
    let out = agent.cli(&["job", "run", &file])?;
    let alloc = only_alloc(agent, job)?;
    if alloc["client_status"] != "complete" {
        bail!(
            "job {job} did not complete ({}): {alloc}\n{}",
            String::from_utf8_lossy(&out.stdout),
            agent.log()
        );
    }
    Ok(())
}

/// The filesystem size the task last wrote (`df -B1` of its mount).
fn size_seen_by_task(agent: &DevAgent, alloc_id: &str) -> Result<Option<u64>> {
    let path = agent
        .data_dir
        .path()
        .join("alloc")
        .join(alloc_id)
        .join("main/local/size");
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(s.trim().parse().ok()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

#[test]
fn a_volume_in_use_grows_and_its_task_sees_the_new_size() -> Result<()> {
    if let Some(why) = loop_devices_unusable() {
        println!("skipping: image-backed volumes need loop devices here: {why}");
        return Ok(());
    }
    let agent = DevAgent::start()?;
    agent.run_example_plugin()?;

    let backing = "parameters {\n  backing = \"image\"\n}";
    let small = agent.write_file("grow-20.hcl", &writer_volume_with("grow", "20MiB", backing))?;
    agent.cli_ok(&["volume", "create", &small])?;
    let vol = agent.cli_json(&["volume", "status", "grow"])?;
    assert_eq!(vol["capacity"].as_u64(), Some(20 * MIB), "{vol}");

    // The task writes the size of its volume's filesystem, again and again.
    let script = "while true; do df -B1 --output=size \"$BERTH_TASK_DIR/data\" | tail -n 1 | tr -d ' ' > \"$BERTH_TASK_DIR/local/size.tmp\" && mv \"$BERTH_TASK_DIR/local/size.tmp\" \"$BERTH_TASK_DIR/local/size\"; sleep 0.2; done";
    let job = agent.write_file("df.hcl", &volume_job("df", "service", "grow", script))?;
    agent.cli_ok(&["job", "run", &job])?;
    let alloc = wait_alloc_running(&agent, "df")?;
    let alloc_id = alloc["id"].as_str().unwrap_or_default().to_string();
    let before = wait_for(
        "the task to report its volume's size",
        Duration::from_secs(60),
        || size_seen_by_task(&agent, &alloc_id),
    )?;
    assert!(
        before > 10 * MIB && before <= 20 * MIB,
        "a 20 MiB ext4 filesystem: {before}"
    );

    // The same spec with a larger capacity_min grows it, in use.
    let large = agent.write_file("grow-40.hcl", &writer_volume_with("grow", "40MiB", backing))?;
    let alloc_id = if has_cap_sys_resource() {
        let out = agent.cli_ok(&["volume", "create", &large])?;
        assert!(out.contains("Expanded volume \"grow\""), "{out}");
        alloc_id
    } else {
        // Growing a mounted ext4 (resize2fs online) needs CAP_SYS_RESOURCE.
        // Without it the node step fails, named, after the controller grew
        // the image; the filesystem grows when the volume is staged again.
        println!(
            "this process lacks CAP_SYS_RESOURCE: a mounted filesystem cannot grow here, \
             so the task sees the new size once it mounts the volume again"
        );
        let out = agent.cli(&["volume", "create", &large])?;
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("NodeExpandVolume") && err.contains("node "),
            "the failure names the step and the node: {err}"
        );
        assert!(err.contains("expanded it to 41943040 bytes"), "{err}");
        agent.cli_ok(&["job", "stop", "df"])?;
        agent.wait_volume_unclaimed("grow")?;
        // The same spec again finishes the expansion.
        let out = agent.cli_ok(&["volume", "create", &large])?;
        assert!(out.contains("requests are updated"), "{out}");
        agent.cli_ok(&["job", "run", &job])?;
        let alloc = wait_alloc_running(&agent, "df")?;
        alloc["id"].as_str().unwrap_or_default().to_string()
    };
    let vol = agent.cli_json(&["volume", "status", "grow"])?;
    assert!(
        vol["capacity"].as_u64().unwrap_or(0) >= 40 * MIB,
        "the new capacity is stored: {vol}"
    );
    assert_eq!(vol["capacity_min"].as_u64(), Some(40 * MIB), "{vol}");
    let after = wait_for(
        "the task to see the grown filesystem",
        Duration::from_secs(60),
        || Ok(size_seen_by_task(&agent, &alloc_id)?.filter(|&s| s > before + 15 * MIB)),
    )
    .with_context(|| agent.log())?;
    assert!(after <= 40 * MIB, "{after}");
    assert_eq!(
        agent.cli_json(&["alloc", "status", &alloc_id])?["client_status"],
        "running",
        "the task kept running"
    );

    // Asking for less is refused; the same spec again changes nothing.
    let shrink = agent.write_file("grow-10.hcl", &writer_volume_with("grow", "10MiB", backing))?;
    let out = agent.cli(&["volume", "create", &shrink])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("volumes cannot shrink"), "{err}");
    let out = agent.cli_ok(&["volume", "create", &large])?;
    assert!(out.contains("unchanged"), "{out}");

    // Clean up through berth: the loop device goes with the volume.
    agent.cli_ok(&["job", "stop", "df"])?;
    agent.wait_volume_unclaimed("grow")?;
    agent.cli_ok(&["volume", "delete", "grow"])?;
    assert!(
        loops_backed_under(agent.data_dir.path()).is_empty(),
        "no loop device left attached"
    );
    Ok(())
}

#[test]
fn a_snapshot_restores_into_a_new_volume_and_a_clone_copies_one() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_example_plugin()?;

    let src = agent.write_file("src.hcl", &writer_volume_with("src", "1MiB", ""))?;
    agent.cli_ok(&["volume", "create", &src])?;
    run_batch(
        &agent,
        "write-src",
        "src",
        "echo 'kept in the snapshot' > \"$BERTH_TASK_DIR/data/hello\"",
    )?;
    agent.wait_volume_unclaimed("src")?;

    // Snapshot it; the list shows the snapshot and where it came from.
    let snap = agent.cli_json(&["volume", "snapshot", "create", "src", "nightly"])?;
    let snap_id = snap["id"].as_str().unwrap_or_default().to_string();
    assert!(!snap_id.is_empty(), "{snap}");
    assert_eq!(snap["name"], "nightly");
    assert_eq!(snap["source_volume_id"], "src");
    let listed = |agent: &DevAgent| -> Result<Vec<Value>> {
        let list = agent.cli_json(&["volume", "snapshot", "list", "-plugin", "hostpath"])?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["id"] == snap_id.as_str())
            .cloned()
            .collect())
    };
    let found = listed(&agent)?;
    assert_eq!(found.len(), 1, "the list shows the snapshot once");
    assert_eq!(found[0]["source_volume_id"], "src", "{}", found[0]);
    assert_eq!(found[0]["ready_to_use"], true, "{}", found[0]);
    let table = agent.cli_ok(&["volume", "snapshot", "list"])?;
    assert!(table.contains(&snap_id) && table.contains("src"), "{table}");

    // The data changes after the snapshot; the snapshot keeps the old.
    run_batch(
        &agent,
        "change-src",
        "src",
        "echo 'changed later' > \"$BERTH_TASK_DIR/data/hello\"",
    )?;
    agent.wait_volume_unclaimed("src")?;

    // A volume made from the snapshot has the data it had.
    let restored = agent.write_file(
        "restored.hcl",
        &writer_volume_with("restored", "1MiB", &format!("snapshot_id = \"{snap_id}\"")),
    )?;
    agent.cli_ok(&["volume", "create", &restored])?;
    run_batch(
        &agent,
        "read-restored",
        "restored",
        "test \"$(cat \"$BERTH_TASK_DIR/data/hello\")\" = 'kept in the snapshot'",
    )?;

    // A clone has what the source has now.
    let ext = agent.cli_json(&["volume", "status", "src"])?["external_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let clone = agent.write_file(
        "cloned.hcl",
        &writer_volume_with("cloned", "1MiB", &format!("clone_id = \"{ext}\"")),
    )?;
    agent.cli_ok(&["volume", "create", &clone])?;
    run_batch(
        &agent,
        "read-cloned",
        "cloned",
        "test \"$(cat \"$BERTH_TASK_DIR/data/hello\")\" = 'changed later'",
    )?;

    // Both a snapshot and a clone: refused, naming the line.
    let both = agent.write_file(
        "both.hcl",
        &writer_volume_with(
            "both",
            "1MiB",
            &format!("snapshot_id = \"{snap_id}\"\nclone_id = \"{ext}\""),
        ),
    )?;
    let out = agent.cli(&["volume", "create", &both])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exclusive") && err.contains("line"), "{err}");

    // The API never echoes a snapshot request's secrets.
    let body = r#"{"volume_id":"src","name":"with-secret","secrets":{"token":"s3cr3t-snap"}}"#;
    let answer = agent.http(&format!(
        "PUT /v1/volumes/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    ))?;
    let text = String::from_utf8_lossy(&answer.body).to_string();
    assert_eq!(answer.status, 200, "{text}");
    assert!(!text.contains("s3cr3t-snap"), "{text}");
    assert!(!agent.log().contains("s3cr3t-snap"), "secrets never logged");
    let second: Value = serde_json::from_str(&text)?;
    let second_id = second["id"].as_str().unwrap_or_default().to_string();

    // Deleting the snapshot removes it from the list.
    agent.cli_ok(&["volume", "snapshot", "delete", "hostpath", &snap_id])?;
    assert!(listed(&agent)?.is_empty(), "the deleted snapshot is gone");
    agent.cli_ok(&["volume", "snapshot", "delete", "hostpath", &second_id])?;
    Ok(())
}
