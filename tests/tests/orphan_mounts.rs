//! Orphaned mounts at agent start, with a server and a client agent in
//! separate processes, the example hostpath plugin and real mounts.
//!
//! A service holds the volume `data` on the client (a staging mount, a
//! publish mount, and the bind into its task dir). The client agent stops;
//! meanwhile the service is stopped on the server and the client's record
//! of its alloc is damaged (it no longer decodes: quarantined at start),
//! so the restarted client does not restore it and nothing it restores
//! owns those mounts. At start the client removes all three: the bind in
//! the dead alloc's dir by a lazy unmount, the publish and staging mounts
//! through the plugin (`NodeUnpublishVolume`, `NodeUnstageVolume`, which
//! the plugin's log shows), each with a `Storage` node event
//! `Orphaned mount removed`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{marked_service_job, with_status, writer_volume, Client, Server};
use berth_tests::{example, mounts_under, node_events, plugin_stderr, wait_for};
use serde_json::Value;

const ALLOCS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("allocs");

/// Overwrites the client's record of `alloc_id` with bytes that do not
/// decode, as a damaged record would be (the agent must be stopped).
fn damage_alloc_record(data_dir: &Path, alloc_id: &str) -> Result<()> {
    let db = redb::Database::open(data_dir.join("client").join("state.redb"))
        .context("opening the client state database")?;
    let tx = db.begin_write()?;
    {
        let mut t = tx.open_table(ALLOCS)?;
        let old = t.insert(alloc_id, b"not an alloc".as_slice())?;
        anyhow::ensure!(old.is_some(), "the client had no record of {alloc_id}");
    }
    tx.commit()?;
    Ok(())
}

fn id(v: &Value) -> String {
    v["id"].as_str().unwrap_or_default().to_string()
}

#[test]
fn mounts_of_an_alloc_that_was_not_restored_are_removed_through_the_plugin_at_start() -> Result<()>
{
    let mut server = Server::start("")?;
    let mut client = Client::start(&server, "c1", false, "")?;
    let node_id = server.wait_nodes_ready(&["c1"])?.remove(0);
    let data_dir = client.agent.data_path().canonicalize()?;

    server.run_job(
        "plugin",
        &std::fs::read_to_string(example("jobs/hostpath-plugin.hcl"))?,
    )?;
    server.wait_plugin_nodes(1)?;
    wait_for("the volume created", Duration::from_secs(60), || {
        Ok(server.create_volume("data", &writer_volume("data")).ok())
    })
    .with_context(|| client.agent.log())?;
    server.run_job(
        "holder",
        &marked_service_job("holder", 1, None, Some("data")),
    )?;
    let holder = wait_for("the holder to run", Duration::from_secs(60), || {
        let allocs = server.allocs("holder")?;
        Ok(with_status(&allocs, "running").first().map(|a| id(a)))
    })
    .with_context(|| client.agent.log())?;
    let plugin_alloc = id(server
        .allocs("hostpath-plugin")?
        .first()
        .context("the plugin alloc")?);
    let staging = client.mounts_with("/staging/");
    let publish = client.mounts_with(&format!("/per-alloc/{holder}/"));
    let bind = client.mounts_with(&format!("/alloc/{holder}/"));
    assert_eq!(
        (staging.len(), publish.len(), bind.len()),
        (1, 1, 1),
        "{:?}",
        mounts_under(&data_dir)
    );

    // While the client is away its alloc is stopped on the server, and its
    // record on the client is damaged.
    client.agent.stop()?;
    // -detach: the client is away, so the alloc cannot stop yet.
    server.cli(&["job", "stop", "-detach", "holder"])?;
    damage_alloc_record(&data_dir, &holder)?;
    client.agent.start_again()?;

    let removed = wait_for(
        "three orphaned mounts removed, as node events",
        Duration::from_secs(60),
        || {
            let node = server.get(&format!("/v1/node/{node_id}"))?;
            let removed: Vec<Value> = node_events(&node, "Storage")
                .into_iter()
                .filter(|e| e["message"] == "Orphaned mount removed")
                .cloned()
                .collect();
            Ok((removed.len() >= 3).then_some(removed))
        },
    )
    .with_context(|| client.agent.log())?;
    let event_for = |path: &Path| {
        removed
            .iter()
            .find(|e| e["details"]["path"] == path.display().to_string().as_str())
            .with_context(|| format!("no event for {}: {removed:?}", path.display()))
    };
    for (path, how) in [
        (&staging[0], "plugin"),
        (&publish[0], "plugin"),
        (&bind[0], "unmount"),
    ] {
        let e = event_for(path)?;
        assert_eq!(e["details"]["how"], how, "{e}");
        assert_eq!(e["details"]["error"], "", "{e}");
    }
    assert_eq!(event_for(&staging[0])?["details"]["volume_id"], "data");
    assert_eq!(event_for(&publish[0])?["details"]["volume_id"], "data");

    // The plugin unpublished and unstaged.
    let log = plugin_stderr(&data_dir, &plugin_alloc);
    for path in [&publish[0], &staging[0]] {
        let shown = path.display().to_string();
        assert!(
            log.lines()
                .any(|l| l.contains("unmounted volume") && l.contains(&shown)),
            "the plugin did not unmount {shown}:\n{log}"
        );
    }
    let left = mounts_under(&data_dir);
    assert!(left.is_empty(), "mounts left: {left:?}");
    // The client came up and the plugin is still healthy on it.
    server.wait_plugin_nodes(1)?;
    client.agent.check_running()?;
    Ok(())
}
