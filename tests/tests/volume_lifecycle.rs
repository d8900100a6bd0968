//! The life of a volume on a dev agent, end to end: the real `berth`
//! binary, the example hostpath plugin as its supervised task, the CLI, and
//! real bind mounts. Run once with the plugin as shipped and once with
//! `--enable-attach`, which makes the servers publish through the
//! controller before the node may stage.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::{example, example_with, mounts_under, only_alloc, strs, wait_for, DevAgent};
use serde_json::Value;

/// The plugin job, with `--enable-attach` added to the plugin's args when
/// asked.
fn plugin_job(agent: &DevAgent, enable_attach: bool) -> Result<String> {
    let path = "jobs/hostpath-plugin.hcl";
    let src = if enable_attach {
        example_with(path, "args = [", "args = [\"--enable-attach\", ")?
    } else {
        std::fs::read_to_string(example(path))?
    };
    agent.write_file("hostpath-plugin.hcl", &src)
}

fn storage_events(node: &Value, message: &str, alloc_id: &str) -> Vec<Value> {
    node["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["subsystem"] == "Storage"
                && e["message"] == message
                && e["details"]["alloc_id"] == alloc_id
        })
        .cloned()
        .collect()
}

/// A volume secret that must never show.
const SECRET: &str = "s3cr3t-4f1c9e";

fn volume_life(enable_attach: bool) -> Result<()> {
    let mut agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().to_path_buf();

    // The plugin runs as a supervised task and becomes healthy.
    let job_file = plugin_job(&agent, enable_attach)?;
    agent.cli_ok(&["job", "run", "-detach", &job_file])?;
    agent.wait_plugin_healthy("hostpath")?;
    let plugin = agent.cli_json(&["plugin", "status", "hostpath"])?;
    assert_eq!(plugin["id"], "hostpath");
    assert_eq!(plugin["provider"], "hostpath.csi.berth.dev");
    assert_eq!(plugin["nodes_expected"], 1);
    assert_eq!(plugin["controllers_expected"], 1);

    // volume create makes the volume through the controller. The volume
    // carries a secret, which every CSI call gets and no log or answer may
    // show.
    let volume_file = data_dir.join("hostpath-volume.hcl");
    std::fs::write(
        &volume_file,
        format!(
            "{}\nsecrets {{\n  token = \"{SECRET}\"\n}}\n",
            std::fs::read_to_string(example("volumes/hostpath.hcl"))?
        ),
    )?;
    agent.cli_ok(&["volume", "create", &volume_file.display().to_string()])?;
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert_eq!(vol["id"], "data");
    assert_eq!(vol["plugin_id"], "hostpath");
    assert!(
        !vol["external_id"].as_str().unwrap_or_default().is_empty(),
        "the plugin's volume ID is recorded: {vol}"
    );
    assert_eq!(vol["schedulable"], true);

    // The writer runs to completion and its claim is freed promptly.
    agent.cli_ok(&["job", "run", &example("jobs/writer.hcl")])?;
    let completed = Instant::now();
    let writer = only_alloc(&agent, "writer")?;
    assert_eq!(
        writer["client_status"], "complete",
        "writer alloc: {writer}"
    );
    let writer_id = writer["id"].as_str().unwrap_or_default().to_string();
    wait_for(
        "the writer's claim to be freed",
        Duration::from_secs(5),
        || {
            let v = agent.cli_json(&["volume", "status", "data"])?;
            Ok(
                (strs(&v["read_allocs"]).is_empty() && strs(&v["write_allocs"]).is_empty())
                    .then_some(()),
            )
        },
    )
    .with_context(|| format!("{:?} after the writer completed", completed.elapsed()))?;

    // The reader mounts the same volume read-only and finds the text.
    agent.cli_ok(&["job", "run", &example("jobs/reader.hcl")])?;
    let reader = only_alloc(&agent, "reader")?;
    assert_eq!(
        reader["client_status"], "complete",
        "reader alloc: {reader}"
    );
    assert_eq!(reader["task_states"]["read"]["failed"], false, "{reader}");
    let reader_id = reader["id"].as_str().unwrap_or_default().to_string();
    wait_for(
        "the reader's claim to be freed",
        Duration::from_secs(5),
        || {
            let v = agent.cli_json(&["volume", "status", "data"])?;
            Ok(
                (strs(&v["read_allocs"]).is_empty() && strs(&v["write_allocs"]).is_empty())
                    .then_some(()),
            )
        },
    )?;

    // Every mount and unmount left a Storage node event.
    let node_id = writer["node_id"].as_str().unwrap_or_default().to_string();
    let node = wait_for("storage node events", Duration::from_secs(10), || {
        let node = agent.cli_json(&["node", "status", &node_id])?;
        let complete = [&writer_id, &reader_id].iter().all(|a| {
            !storage_events(&node, "Mount volume", a).is_empty()
                && !storage_events(&node, "Unmount volume", a).is_empty()
        });
        Ok(complete.then_some(node))
    })?;
    for alloc in [&writer_id, &reader_id] {
        for message in ["Mount volume", "Unmount volume"] {
            let evs = storage_events(&node, message, alloc);
            assert!(
                evs.iter().any(|e| e["details"]["volume_id"] == "data"
                    && e["details"]["success"] == "true"
                    && e["details"]["error"] == ""),
                "{message} event for alloc {alloc}: {evs:?}"
            );
        }
    }

    // With attach, the servers published through the controller for each
    // claim and unpublished it when the claim was released.
    if enable_attach {
        let plugin_alloc = only_alloc(&agent, "hostpath-plugin")?;
        let log_path = data_dir
            .join("alloc")
            .join(plugin_alloc["id"].as_str().unwrap_or_default())
            .join("alloc/logs/plugin.stderr.0");
        let log = std::fs::read_to_string(&log_path)
            .with_context(|| format!("reading {}", log_path.display()))?;
        assert_eq!(log.matches("published volume to node").count(), 2, "{log}");
        assert_eq!(log.matches("unpublished volume").count(), 2, "{log}");
    }

    // The secret reached no log line and no API answer.
    let mut seen = vec![("agent log".to_string(), agent.log())];
    for args in [
        vec!["volume", "status", "data"],
        vec!["node", "status", node_id.as_str()],
        vec!["alloc", "status", writer_id.as_str()],
        vec!["alloc", "status", reader_id.as_str()],
        vec!["job", "status"],
        vec!["plugin", "status", "hostpath"],
    ] {
        seen.push((args.join(" "), agent.cli_json(&args)?.to_string()));
    }
    for alloc in std::fs::read_dir(data_dir.join("alloc"))? {
        let logs = alloc?.path().join("alloc/logs");
        for f in std::fs::read_dir(&logs).into_iter().flatten() {
            let f = f?.path();
            seen.push((f.display().to_string(), std::fs::read_to_string(&f)?));
        }
    }
    for (what, text) in &seen {
        assert!(
            !text.contains(SECRET),
            "the volume's secret shows in {what}"
        );
    }

    // No volume mount is left behind once both jobs are done.
    let left = mounts_under(&data_dir);
    assert!(
        left.is_empty(),
        "mounts left after the jobs finished: {left:?}"
    );

    // Stopping the plugin job stops the plugin task.
    agent.cli_ok(&["job", "stop", "hostpath-plugin"])?;
    wait_for("the plugin alloc to stop", Duration::from_secs(30), || {
        let a = only_alloc(&agent, "hostpath-plugin")?;
        Ok((a["client_status"] == "complete" || a["client_status"] == "failed").then_some(()))
    })?;
    agent.stop_agent()?;
    assert!(mounts_under(&data_dir).is_empty());
    Ok(())
}

#[test]
fn volume_life_on_a_dev_agent() {
    volume_life(false).unwrap();
}

#[test]
fn volume_life_with_controller_attach() {
    volume_life(true).unwrap();
}
