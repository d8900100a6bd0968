//! CSI volume stats end to end: a server and a client agent (the client
//! collecting stats every second, set in its config file), the example
//! hostpath plugin keeping its volumes on a 64 MiB tmpfs of their own (so
//! that a few MiB written show in the volume's figures), a service job
//! writing nothing, the CLI. `berth alloc status` and `berth volume status
//! -verbose` show the bytes and inodes and the condition, `-json` the
//! numbers; 5 MiB written into the volume show up in the bytes used; the
//! volume's data removed behind the plugin turns its condition abnormal,
//! once, as a node event.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::cluster::{marked_service_job, shared_plugin_job, writer_volume, Client, Server};
use berth_tests::{cli_json_at, node_events, wait_for};
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// Mounts a tmpfs of `size_mib` at `dir` (made first). The client agent's
/// cleanup unmounts it with everything else below its data dir.
fn mount_tmpfs(dir: &Path, size_mib: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some(format!("size={size_mib}m,mode=0755").as_str()),
    )
    .with_context(|| format!("mounting a tmpfs at {}", dir.display()))
}

/// The stats the servers have of the alloc's volume "data", once they
/// satisfy `want`.
fn wait_stats(
    server: &Server,
    alloc_id: &str,
    what: &str,
    want: impl Fn(&Value) -> bool,
) -> Result<Value> {
    wait_for(what, Duration::from_secs(60), || {
        let a = server.get(&format!("/v1/allocation/{alloc_id}"))?;
        let s = &a["csi_volume_stats"]["data"];
        Ok((s.is_object() && want(s)).then(|| s.clone()))
    })
}

fn figure(stats: &Value, key: &str) -> Result<u64> {
    stats[key]
        .as_u64()
        .with_context(|| format!("{key} in {stats}"))
}

#[test]
fn volume_stats_and_condition_show_in_alloc_and_volume_status() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "n1", false, "csi_volume_stats_interval = \"1s\"")?;
    let node_id = server.wait_nodes_ready(&["n1"])?.remove(0);
    let logs = || format!("client log:\n{}", client.agent.log());

    // The plugin's state (and so every volume's data) on a small tmpfs.
    let state = client.agent.data_dir.path().join("hostpath-state");
    mount_tmpfs(&state, 64)?;
    server.run_job("plugin", &shared_plugin_job(&state)?)?;
    server.wait_plugin_nodes(1).with_context(logs)?;
    server.create_volume("data", &writer_volume("data"))?;
    server.run_job("app", &marked_service_job("app", 1, None, Some("data")))?;
    let alloc_id = wait_for("the app running", Duration::from_secs(60), || {
        let allocs = server.allocs("app")?;
        Ok(allocs
            .iter()
            .find(|a| a["client_status"] == "running")
            .and_then(|a| a["id"].as_str().map(str::to_string)))
    })
    .with_context(logs)?;

    // The first figures: the tmpfs's, with a normal condition.
    let first = wait_stats(&server, &alloc_id, "the volume's first stats", |s| {
        s["bytes_total"].as_u64().is_some() && s["condition"]["abnormal"] == false
    })
    .with_context(logs)?;
    let total = figure(&first, "bytes_total")?;
    assert!(
        (60 * MIB..=64 * MIB).contains(&total),
        "the tmpfs is the volume: {first}"
    );
    let used_before = figure(&first, "bytes_used")?;
    assert!(figure(&first, "bytes_available")? <= total);
    assert!(figure(&first, "inodes_total")? > 0);
    assert!(figure(&first, "inodes_used")? > 0);
    assert!(first["inodes_available"].as_u64().is_some());
    assert_eq!(first["volume_id"], "data");
    assert_eq!(first["plugin_id"], "hostpath");
    assert!(first["error"].is_null(), "{first}");

    // berth alloc status: a CSI Volumes section.
    let shown = server.cli(&["alloc", "status", &alloc_id])?;
    println!("{shown}");
    let section = shown
        .split("CSI Volumes")
        .nth(1)
        .with_context(|| format!("no CSI Volumes section in:\n{shown}"))?;
    for want in [
        "Used / Total",
        "Available",
        "Inodes Used / Total",
        "Condition",
        "data",
        "hostpath",
        "MiB",
        "normal",
    ] {
        assert!(section.contains(want), "{want:?} in:\n{shown}");
    }
    let json = cli_json_at(&server.addr(), &["alloc", "status", "-json", &alloc_id])?;
    assert_eq!(json["csi_volume_stats"]["data"]["bytes_total"], total);

    // berth volume status -verbose: the claim with the same figures.
    let shown = server.cli(&["volume", "status", "-verbose", "data"])?;
    println!("{shown}");
    let claims = shown
        .split("Volume Stats")
        .nth(1)
        .with_context(|| format!("no claims section in:\n{shown}"))?;
    for want in [&alloc_id[..8], "write", "running", "MiB", "normal"] {
        assert!(claims.contains(want), "{want:?} in:\n{shown}");
    }
    let json = cli_json_at(
        &server.addr(),
        &["volume", "status", "-verbose", "-json", "data"],
    )?;
    let claim = &json["claim_allocs"][0];
    assert_eq!(claim["alloc_id"], alloc_id.as_str(), "{json}");
    assert_eq!(claim["volume_stats"]["bytes_total"], total, "{json}");
    assert!(claim["volume_stats"]["inodes_used"].as_u64().is_some());

    // 5 MiB written through the task's mount of the volume.
    let mount = client
        .agent
        .data_path()
        .join("alloc")
        .join(&alloc_id)
        .join("t/data");
    std::fs::write(mount.join("blob"), vec![7u8; 5 * MIB as usize])
        .with_context(|| format!("writing into {}", mount.display()))?;
    let after = wait_stats(&server, &alloc_id, "the 5 MiB in bytes used", |s| {
        s["bytes_used"]
            .as_u64()
            .is_some_and(|u| u >= used_before + 4 * MIB)
    })
    .with_context(logs)?;
    let grown = figure(&after, "bytes_used")? - used_before;
    assert!(
        (4 * MIB..=6 * MIB).contains(&grown),
        "5 MiB written, {grown} bytes more used: {first} then {after}"
    );
    assert!(figure(&after, "bytes_available")? + 4 * MIB <= figure(&first, "bytes_available")?);

    // The volume's data removed behind the plugin: abnormal, one event.
    let external_id = server.volume("data")?["external_id"]
        .as_str()
        .context("the volume's external ID")?
        .to_string();
    let data_dir = state.join("volumes").join(&external_id);
    if !data_dir.is_dir() {
        bail!("the volume's data is not at {}", data_dir.display());
    }
    std::fs::remove_dir_all(&data_dir)?;
    let abnormal = wait_stats(&server, &alloc_id, "an abnormal condition", |s| {
        s["condition"]["abnormal"] == true
    })
    .with_context(logs)?;
    let message = abnormal["condition"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!message.is_empty(), "{abnormal}");
    let shown = server.cli(&["alloc", "status", &alloc_id])?;
    println!("{shown}");
    assert!(shown.contains("abnormal"), "{shown}");
    let abnormal_events = || -> Result<Vec<Value>> {
        let node = server.get(&format!("/v1/node/{node_id}"))?;
        Ok(node_events(&node, "Storage")
            .into_iter()
            .filter(|e| e["message"] == "Volume condition abnormal")
            .cloned()
            .collect())
    };
    wait_for("the abnormal event", Duration::from_secs(60), || {
        Ok((!abnormal_events()?.is_empty()).then_some(()))
    })
    .with_context(logs)?;
    // Three more rounds of the same condition: still the one event.
    let rounds = || client.agent.log().matches("volume stats round").count();
    let rounds_before = rounds();
    wait_for(
        "three more volume stats rounds",
        Duration::from_secs(60),
        || Ok((rounds() >= rounds_before + 3).then_some(())),
    )
    .with_context(logs)?;
    let events = abnormal_events()?;
    assert_eq!(events.len(), 1, "{events:#?}");
    let e = &events[0];
    assert!(e["count"].as_u64().unwrap_or(1) == 1, "{e}");
    assert_eq!(e["details"]["volume_id"], "data");
    assert_eq!(e["details"]["alloc_id"], alloc_id.as_str());
    assert_eq!(e["details"]["message"], message.as_str());
    Ok(())
}
