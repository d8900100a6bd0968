//! A block volume end to end on a dev agent: the real `berth` binary, the
//! example hostpath plugin, the CLI, a real loop device. An image-backed
//! volume is created with `attachment_mode = "block-device"`; a batch job's
//! task finds a block device at its `volume_mount` destination and writes
//! bytes to it with `dd`; once its claim is released, another job's task
//! reads the same bytes back from the device. Where loop devices cannot be
//! used, the test says why and returns.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{loops_backed_under, only_alloc, wait_for, DevAgent};
use serde_json::Value;

/// The bytes the writer puts at offset 4096 of the device.
const MARKER: &str = "berth-block-volume-e2e";

const VOLUME: &str = r#"
id        = "disk"
name      = "disk"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "16MiB"
capacity_max = "16MiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "block-device"
}

parameters {
  backing = "image"
}
"#;

/// A batch job whose task gets volume "disk" as a block device at
/// `<task_dir>/disk` and runs `script` there.
fn block_job(id: &str, script: &str) -> String {
    let script = Value::from(script).to_string();
    format!(
        r#"
job "{id}" {{
  type        = "batch"
  datacenters = ["dc1"]

  group "g" {{
    volume "disk" {{
      type            = "csi"
      source          = "disk"
      access_mode     = "single-node-writer"
      attachment_mode = "block-device"
    }}

    restart {{
      attempts = 0
      mode     = "fail"
    }}

    task "t" {{
      driver = "raw_exec"

      config {{
        command = "/bin/sh"
        args    = ["-c", {script}]
      }}

      volume_mount {{
        volume      = "disk"
        destination = "disk"
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

/// Waits for the only alloc of `job` to finish; fails if it did not
/// complete.
fn wait_complete(agent: &DevAgent, job: &str) -> Result<Value> {
    let alloc = wait_for(
        &format!("the {job} alloc to finish"),
        Duration::from_secs(90),
        || {
            let a = only_alloc(agent, job)?;
            Ok(matches!(a["client_status"].as_str(), Some("complete" | "failed")).then_some(a))
        },
    )
    .with_context(|| agent.log())?;
    if alloc["client_status"] != "complete" {
        bail!(
            "{job} did not complete: {alloc:#}\nagent log:\n{}",
            agent.log()
        );
    }
    Ok(alloc)
}

#[test]
fn bytes_written_to_a_block_volume_are_read_back_by_a_later_alloc() -> Result<()> {
    if let Some(why) = berth_tests::loop_devices_unusable() {
        println!("skipping: loop devices cannot be used here: {why}");
        return Ok(());
    }
    let agent = DevAgent::start()?;

    agent.run_example_plugin()?;
    let spec = agent.write_file("disk.hcl", VOLUME)?;
    agent.cli_ok(&["volume", "create", &spec])?;

    // The writer: the destination must be a block device of the volume's
    // size; the marker goes at offset 4096.
    let write = format!(
        r#"set -e
dev="$BERTH_TASK_DIR/disk"
test -b "$dev" || {{ echo "$dev is not a block device" >&2; exit 3; }}
printf '%s' '{MARKER}' | dd of="$dev" bs=4096 seek=1 conv=notrunc,fsync 2>/dev/null
"#
    );
    let writer = agent.write_file("writer.hcl", &block_job("writer", &write))?;
    agent.cli_ok(&["job", "run", "-detach", &writer])?;
    let written = wait_complete(&agent, "writer")?;
    println!("writer alloc {}", written["id"]);
    agent.wait_volume_unclaimed("disk")?;

    // The reader: another alloc, the same bytes.
    let read = r#"set -e
dev="$BERTH_TASK_DIR/disk"
test -b "$dev" || { echo "$dev is not a block device" >&2; exit 3; }
dd if="$dev" bs=4096 skip=1 count=1 2>/dev/null | head -c 64 > "$BERTH_TASK_DIR/local/read"
"#;
    let reader = agent.write_file("reader.hcl", &block_job("reader", read))?;
    agent.cli_ok(&["job", "run", "-detach", &reader])?;
    let alloc = wait_complete(&agent, "reader")?;
    let alloc_id = alloc["id"].as_str().context("alloc id")?;
    assert_ne!(Some(alloc_id), written["id"].as_str(), "another alloc");
    let out = task_path(&agent, alloc_id, "local/read");
    let bytes = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
    assert!(
        bytes.starts_with(MARKER.as_bytes()),
        "read back {:?}",
        String::from_utf8_lossy(&bytes)
    );

    // Nothing of the volume stays mounted or attached once the claims are
    // gone.
    agent.wait_volume_unclaimed("disk")?;
    wait_loops_detached(&agent)
}

/// `rel` in the dir of task `t` of the alloc `alloc_id`.
fn task_path(agent: &DevAgent, alloc_id: &str, rel: &str) -> PathBuf {
    agent
        .data_dir
        .path()
        .join("alloc")
        .join(alloc_id)
        .join("t")
        .join(rel)
}

/// Waits until no loop device is backed by an image below the data dir.
fn wait_loops_detached(agent: &DevAgent) -> Result<()> {
    wait_for(
        "the image's loop device to be detached",
        Duration::from_secs(60),
        || {
            Ok(loops_backed_under(agent.data_dir.path())
                .is_empty()
                .then_some(()))
        },
    )
}

/// The mount options (per-mount flags) of every ext4 mount below `dir`.
fn ext4_mounts_under(dir: &Path) -> Vec<(PathBuf, Vec<String>)> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let fields: Vec<&str> = left.split(' ').collect();
            let mount_point = PathBuf::from(fields.get(4)?.replace("\\040", " "));
            let options = fields.get(5)?.split(',').map(str::to_string).collect();
            (right.starts_with("ext4 ") && mount_point.starts_with(dir))
                .then_some((mount_point, options))
        })
        .collect()
}

#[test]
fn job_mount_flags_replace_the_volume_s_on_the_image_s_mounts() -> Result<()> {
    if let Some(why) = berth_tests::loop_devices_unusable() {
        println!("skipping: loop devices cannot be used here: {why}");
        return Ok(());
    }
    let agent = DevAgent::start()?;
    agent.run_example_plugin()?;
    let volume = r#"
id        = "fsvol"
name      = "fsvol"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "16MiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

mount_options {
  fs_type     = "ext4"
  mount_flags = ["noatime"]
}

parameters {
  backing = "image"
}
"#;
    agent.cli_ok(&["volume", "create", &agent.write_file("fsvol.hcl", volume)?])?;
    // The job's flags are taken whole; its fs_type is left to the volume.
    // (Every "data" becomes "fsvol": the volume, its request and the
    // destination.)
    let job = berth_tests::csi_volume_service_job("app", "t", &["-c", "sleep 1000"])
        .replace("\"data\"", "\"fsvol\"")
        .replace(
            "attachment_mode = \"file-system\"",
            "attachment_mode = \"file-system\"\n      mount_options {\n        mount_flags = [\"nodev\", \"noexec\"]\n      }",
        );
    assert!(job.contains("mount_flags"), "{job}");
    agent.cli_ok(&["job", "run", "-detach", &agent.write_file("app.hcl", &job)?])?;
    let alloc = berth_tests::wait_alloc_running(&agent, "app")?;
    let alloc_id = alloc["id"].as_str().context("alloc id")?;

    let mounts = ext4_mounts_under(agent.data_dir.path());
    // Staging, publish target and the bind in the task dir: one filesystem.
    assert!(mounts.len() >= 3, "{mounts:#?}");
    for (mount_point, options) in &mounts {
        for want in ["nodev", "noexec"] {
            assert!(
                options.iter().any(|o| o == want),
                "{want} on {}: {options:?}",
                mount_point.display()
            );
        }
        assert!(
            !options.iter().any(|o| o == "noatime"),
            "the volume's flags were replaced on {}: {options:?}",
            mount_point.display()
        );
    }
    let in_task = task_path(&agent, alloc_id, "fsvol");
    assert!(
        mounts.iter().any(|(m, _)| *m == in_task),
        "the task dir has the volume: {mounts:#?}"
    );
    agent.cli_ok(&["job", "stop", "app"])?;
    agent.wait_volume_unclaimed("fsvol")?;
    wait_for("the image's mounts to go", Duration::from_secs(60), || {
        Ok(ext4_mounts_under(agent.data_dir.path())
            .is_empty()
            .then_some(()))
    })?;
    wait_loops_detached(&agent)
}
