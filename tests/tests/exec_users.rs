//! Who a task runs as, and what it cannot take from the node: a task's
//! `user` is switched to (raw_exec too), root is refused to an exec task
//! unless the node allows it, and a fork bomb in an exec task stops at its
//! `pids_limit` while the agent keeps answering.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::cluster::{logs, Client, Server};
use berth_tests::wait_for;
use serde_json::Value;

fn batch_job(job: &str, driver: &str, user: &str, script: &str) -> String {
    format!(
        r#"
job "{job}" {{
  type = "batch"
  group "g" {{
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    reschedule {{
      attempts  = 0
      unlimited = false
    }}
    task "t" {{
      driver = "{driver}"
      user   = "{user}"
      config {{
        command = "/bin/sh"
        args    = ["-c", {script:?}]
      }}
    }}
  }}
}}
"#
    )
}

fn alloc_dir(client: &Client, alloc: &Value) -> Result<PathBuf> {
    Ok(client
        .agent
        .data_path()
        .join("alloc")
        .join(alloc["id"].as_str().context("alloc ID")?))
}

#[test]
fn a_tasks_user_is_switched_to_and_root_is_refused_to_an_exec_task() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "u1", false, "")?;
    server
        .wait_nodes_ready(&["u1"])
        .with_context(|| logs(&server, &[&client]))?;

    // raw_exec drops to the task's user, whose own dirs are its.
    let script = "echo uid=$(id -u); echo x > local/out && echo local=written";
    server.run_job(
        "raw-nobody",
        &batch_job("raw-nobody", "raw_exec", "nobody", script),
    )?;
    let alloc = server
        .finished_alloc("raw-nobody")
        .with_context(|| logs(&server, &[&client]))?;
    let dir = alloc_dir(&client, &alloc)?;
    let out = std::fs::read_to_string(dir.join("alloc/logs/t.stdout.0")).unwrap_or_default();
    let err = std::fs::read_to_string(dir.join("alloc/logs/t.stderr.0")).unwrap_or_default();
    assert_eq!(alloc["client_status"], "complete", "{alloc}\n{out}\n{err}");
    assert!(
        out.contains("uid=65534") && out.contains("local=written"),
        "{out}\n{err}"
    );

    // An exec task may not be root unless the node allows it.
    server.run_job(
        "exec-root",
        &batch_job("exec-root", "exec", "root", "id -u"),
    )?;
    let alloc = server
        .finished_alloc("exec-root")
        .with_context(|| logs(&server, &[&client]))?;
    assert_eq!(alloc["client_status"], "failed", "{alloc}");
    let events = alloc["task_states"]["t"]["events"].to_string();
    assert!(
        events.contains(
            r#"exec tasks may not run as user \"root\" (uid 0): this node denies uids 0"#
        ),
        "{events}"
    );
    Ok(())
}

/// The pids hierarchy's dir of the cgroup of task `t` of `alloc`.
fn pids_cgroup(client: &Client, alloc: &str) -> PathBuf {
    let mount = Path::new("/sys/fs/cgroup");
    let base = if mount.join("cgroup.controllers").exists() {
        mount.to_path_buf()
    } else {
        mount.join("pids")
    };
    base.join(client.agent.cgroup_parent())
        .join(alloc)
        .join("t")
}

/// How often forks in `cgroup` failed on its pids limit.
fn forks_refused(cgroup: &Path) -> u64 {
    std::fs::read_to_string(cgroup.join("pids.events"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("max ")?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_fork_bomb_in_an_exec_task_stops_at_its_pids_limit_and_the_agent_answers() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "u2", false, "")?;
    server
        .wait_nodes_ready(&["u2"])
        .with_context(|| logs(&server, &[&client]))?;
    let spec = r#"
job "bomb" {
  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }
    task "t" {
      driver = "exec"
      config {
        command    = "/bin/sh"
        args       = ["-c", "b() { b | b & }; b; while :; do sleep 1; done"]
        pids_limit = 64
      }
      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
"#;
    server.run_job("bomb", spec)?;
    let alloc = wait_for("the bomb running", Duration::from_secs(30), || {
        let allocs = server.allocs("bomb")?;
        Ok(allocs
            .into_iter()
            .find(|a| a["client_status"] == "running")
            .and_then(|a| a["id"].as_str().map(String::from)))
    })
    .with_context(|| logs(&server, &[&client]))?;
    let cgroup = pids_cgroup(&client, &alloc);
    wait_for(
        "forks refused at the limit",
        Duration::from_secs(30),
        || Ok((forks_refused(&cgroup) > 0).then_some(())),
    )?;
    let max: u64 = std::fs::read_to_string(cgroup.join("pids.max"))?
        .trim()
        .parse()?;
    assert_eq!(max, 64);

    // While it keeps trying, the agent and the server answer at once.
    let mut slowest = Duration::ZERO;
    for _ in 0..10 {
        let asked = Instant::now();
        client.get("/v1/agent/self")?;
        slowest = slowest.max(asked.elapsed());
        let asked = Instant::now();
        server.get("/v1/nodes")?;
        slowest = slowest.max(asked.elapsed());
    }
    assert!(
        slowest < Duration::from_secs(1),
        "an answer took {slowest:?}"
    );
    let current: u64 = std::fs::read_to_string(cgroup.join("pids.current"))?
        .trim()
        .parse()?;
    assert!(current <= 64, "{current} processes");

    // Stopped, every process of it goes with its cgroup.
    server.cli(&["job", "stop", "bomb"])?;
    wait_for("the bomb's cgroup removed", Duration::from_secs(60), || {
        Ok((!cgroup.exists()).then_some(()))
    })
    .with_context(|| logs(&server, &[&client]))?;
    Ok(())
}

#[test]
fn an_exec_task_as_nobody_reads_and_writes_its_csi_volume_at_its_destination() -> Result<()> {
    let shared_state = tempfile::tempdir()?;
    let mut server = Server::start("")?;
    let client = Client::start(&server, "u3", false, "")?;
    server
        .wait_nodes_ready(&["u3"])
        .with_context(|| logs(&server, &[&client]))?;
    server.run_job(
        "plugin",
        &berth_tests::cluster::shared_plugin_job(shared_state.path())?,
    )?;
    server
        .wait_plugin_nodes(1)
        .with_context(|| logs(&server, &[&client]))?;
    server.create_volume("vol-x", &berth_tests::cluster::writer_volume("vol-x"))?;
    let script = "echo uid=$(id -u); echo hello > /data/f && echo wrote=$(cat /data/f)";
    let spec = batch_job("exec-vol", "exec", "", script)
        .replace("      user   = \"\"\n", "")
        .replace(
            "  group \"g\" {\n",
            "  group \"g\" {\n    volume \"data\" {\n      type            = \"csi\"\n      \
             source          = \"vol-x\"\n      access_mode     = \"single-node-writer\"\n      \
             attachment_mode = \"file-system\"\n    }\n",
        )
        .replace(
            "      config {",
            "      volume_mount {\n        volume      = \"data\"\n        \
             destination = \"data\"\n      }\n      config {",
        );
    assert!(
        spec.contains("volume_mount") && !spec.contains("user"),
        "{spec}"
    );
    server.run_job("exec-vol", &spec)?;
    let alloc = server
        .finished_alloc("exec-vol")
        .with_context(|| logs(&server, &[&client]))?;
    let dir = alloc_dir(&client, &alloc)?;
    let out = std::fs::read_to_string(dir.join("alloc/logs/t.stdout.0")).unwrap_or_default();
    let err = std::fs::read_to_string(dir.join("alloc/logs/t.stderr.0")).unwrap_or_default();
    assert_eq!(
        alloc["client_status"],
        "complete",
        "{out}\n{err}\n{}",
        logs(&server, &[&client])
    );
    assert!(
        out.contains("uid=65534") && out.contains("wrote=hello"),
        "{out}\n{err}\n{}",
        logs(&server, &[&client])
    );
    // What it wrote is in the volume, on the host, and no mount of the
    // task's is left once its claim is freed.
    wait_for("the claim freed", Duration::from_secs(30), || {
        let v = server.volume("vol-x")?;
        let claims = v["write_claims"].as_object().map_or(0, |c| c.len());
        Ok((claims == 0).then_some(()))
    })?;
    wait_for("the task's mounts gone", Duration::from_secs(30), || {
        Ok(berth_testutil::mounts_under(&dir).is_empty().then_some(()))
    })?;
    Ok(())
}
