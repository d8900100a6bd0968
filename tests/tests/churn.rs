//! Churn on a dev agent: many rounds of submitting, re-submitting a changed
//! job and stopping it, with and without a CSI volume, as impatient
//! operators and deploy scripts do. Afterwards no alloc may be stuck
//! pending and no volume claim left, and `berth system gc` must leave
//! nothing of the stopped jobs on the servers or on the node.

use std::time::Duration;

use anyhow::{bail, Result};
use berth_tests::{mounts_under, sleeping_service_job, strs, wait_for, DevAgent};
use serde_json::Value;

/// Rounds of submit, changed re-submit and stop.
const ROUNDS: usize = 100;

/// A batch job that writes into the "data" volume; `version` changes it.
fn volume_job(id: &str, version: usize) -> String {
    format!(
        r#"
job "{id}" {{
  type = "batch"
  group "w" {{
    volume "data" {{
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}
    task "write" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "echo {version} > ${{BERTH_TASK_DIR}}/data/round; sleep 0.2"]
      }}
      volume_mount {{
        volume      = "data"
        destination = "data"
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

/// Every alloc of the churned jobs the servers keep (all versions; not
/// the plugin's).
fn churned_allocs(agent: &DevAgent) -> Result<Vec<Value>> {
    let out = agent.cli_ok(&["job", "status", "-json", "-all-allocs"])?;
    let jobs: Value = serde_json::from_str(&out)?;
    Ok(jobs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|j| j["id"] != "hostpath-plugin")
        .flat_map(|j| j["allocations"].as_array().cloned().unwrap_or_default())
        .collect())
}

#[test]
fn churn_leaves_no_pending_alloc_no_claim_and_gc_removes_what_is_done() -> Result<()> {
    let agent = DevAgent::start()?;
    let dir = agent.data_dir.path().to_path_buf();

    agent.run_plugin_and_create_volume()?;

    for round in 0..ROUNDS {
        // Five service jobs and one volume job take turns, so that a job
        // is submitted again while its earlier allocs are still stopping.
        let (id, first, second) = if round % 3 == 2 {
            let id = format!("vol-{}", round % 2);
            (
                id.clone(),
                volume_job(&id, round),
                volume_job(&id, round + 1000),
            )
        } else {
            let id = format!("svc-{}", round % 5);
            (
                id.clone(),
                sleeping_service_job(&id, 3, round),
                sleeping_service_job(&id, 2, round + 1000),
            )
        };
        let a = agent.write_file(&format!("{id}-a.hcl"), &first)?;
        let b = agent.write_file(&format!("{id}-b.hcl"), &second)?;
        agent.cli_ok(&["job", "run", "-detach", &a])?;
        agent.cli_ok(&["job", "run", "-detach", &b])?;
        agent.cli_ok(&["job", "stop", &id])?;
    }

    // Everything settles: every alloc of the churned jobs terminal, none
    // left pending, and the volume free.
    wait_for(
        "every churned alloc to be terminal and the volume free",
        Duration::from_secs(120),
        || {
            let churned = churned_allocs(&agent)?;
            let unsettled: Vec<String> = churned
                .iter()
                .filter(|a| {
                    !matches!(
                        a["client_status"].as_str(),
                        Some("complete" | "failed" | "lost")
                    )
                })
                .map(|a| {
                    format!(
                        "{} {} {}",
                        a["name"], a["desired_status"], a["client_status"]
                    )
                })
                .collect();
            let vol = agent.cli_json(&["volume", "status", "data"])?;
            let claims = strs(&vol["read_allocs"]).len() + strs(&vol["write_allocs"]).len();
            if unsettled.is_empty() && claims == 0 && !churned.is_empty() {
                return Ok(Some(()));
            }
            if unsettled.len() < 5 {
                eprintln!("waiting for: {unsettled:?}, {claims} claims");
            }
            Ok(None)
        },
    )
    .map_err(|e| e.context(agent.log()))?;

    // No alloc ever stayed pending for good: the ones stopped before they
    // started say so.
    let allocs = churned_allocs(&agent)?;
    let never_started = allocs
        .iter()
        .filter(|a| a["desired_status"] == "stop" && a["client_status"] == "pending")
        .count();
    assert_eq!(never_started, 0, "allocs stuck pending");
    let churned: Vec<String> = allocs
        .iter()
        .filter_map(|a| a["id"].as_str().map(str::to_string))
        .collect();
    assert!(
        churned.len() >= 2 * ROUNDS,
        "each round placed allocs: {}",
        churned.len()
    );

    // `job status` shows the latest version's allocs, newest first;
    // `-all-allocs` shows the earlier versions' too.
    let job = agent.cli_json(&["job", "status", "svc-0"])?;
    let latest: Vec<&Value> = job["allocations"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    assert!(!latest.is_empty(), "{job}");
    assert!(
        latest.iter().all(|a| a["job_version"] == job["version"]),
        "only the latest version: {job}"
    );
    let created: Vec<u64> = latest
        .iter()
        .map(|a| a["create_index"].as_u64().unwrap_or(0))
        .collect();
    assert!(
        created.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {created:?}"
    );
    let all: Value = serde_json::from_str(&agent.cli_ok(&[
        "job",
        "status",
        "-json",
        "-all-allocs",
        "svc-0",
    ])?)?;
    assert!(
        all["allocations"].as_array().map_or(0, Vec::len) > latest.len(),
        "earlier versions' allocs with -all-allocs: {all}"
    );

    // A forced garbage collection removes the stopped jobs and their
    // allocs from the servers, and their alloc dirs from the node.
    let out = agent.cli_ok(&["system", "gc"])?;
    assert!(out.contains("Garbage collected"), "{out}");
    let jobs: Value = serde_json::from_str(&agent.cli_ok(&["job", "status", "-json"])?)?;
    let ids: Vec<&str> = jobs
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|j| j["id"].as_str())
        .collect();
    assert_eq!(ids, vec!["hostpath-plugin"], "only the plugin job is left");
    for id in &churned {
        let out = agent.cli(&["alloc", "status", id])?;
        if out.status.success() {
            bail!("alloc {id} is still on the servers after system gc");
        }
    }
    let alloc_root = dir.join("alloc");
    wait_for(
        "the collected allocs' dirs to be removed from the node",
        Duration::from_secs(60),
        || {
            let left: Vec<&String> = churned
                .iter()
                .filter(|id| alloc_root.join(id).exists())
                .collect();
            Ok(left.is_empty().then_some(()))
        },
    )?;
    // The plugin's alloc and its dir stay; no mount of a churned alloc.
    let mounts = mounts_under(&alloc_root);
    for id in &churned {
        assert!(
            !mounts
                .iter()
                .any(|m| m.to_string_lossy().contains(id.as_str())),
            "a mount of collected alloc {id} is left: {mounts:?}"
        );
    }
    Ok(())
}
