//! CSI topology on a cluster of separate processes: one `berth agent
//! -server` and two `berth agent -client`, the example hostpath plugin on
//! both with one shared state dir and a topology per node
//! (`topology.hostpath.csi/node=<node ID>`).
//!
//! A volume created with a required topology is created by the controller
//! in it, and its allocs are only ever placed on the node in it; a group
//! whose volumes are reachable from different nodes is placed nowhere, and
//! the reason names the topology; a create the plugin cannot satisfy says
//! so; `volume status` and `node status` show the topologies. With the
//! plugin job as shipped (each node's volumes in its own data dir, a
//! topology per node), a volume is placed only on the node that holds it.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::cluster::{logs, node_of, shared_plugin_job_with_args, Client, Server};
use berth_tests::{cli_at, cli_json_at, wait_for};
use serde_json::Value;

const KEY: &str = "topology.hostpath.csi/node";

/// A volume `id` of the hostpath plugin that must be created on `node`.
fn volume_on(id: &str, node: &str) -> String {
    format!(
        r#"
id        = "{id}"
type      = "csi"
plugin_id = "hostpath"
capacity_min = "1MiB"
capability {{
  access_mode     = "multi-node-multi-writer"
  attachment_mode = "file-system"
}}
capability {{
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}}
topology_request {{
  required {{
    topology {{
      segments = {{ "{KEY}" = "{node}" }}
    }}
  }}
}}
"#
    )
}

/// A batch job of `count` allocs whose task writes into each volume of
/// `volumes` (mounted at `v<i>`).
fn batch_job_using(job: &str, count: u32, volumes: &[&str]) -> String {
    let mut blocks = String::new();
    let mut mounts = String::new();
    let mut writes = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        blocks.push_str(&format!(
            r#"
    volume "v{i}" {{
      type            = "csi"
      source          = "{v}"
      access_mode     = "multi-node-multi-writer"
      attachment_mode = "file-system"
    }}"#
        ));
        mounts.push_str(&format!(
            r#"
      volume_mount {{
        volume      = "v{i}"
        destination = "v{i}"
      }}"#
        ));
        writes.push(format!(
            "echo $BERTH_ALLOC_ID > $BERTH_TASK_DIR/v{i}/$BERTH_ALLOC_ID"
        ));
    }
    let script = writes.join(" && ");
    format!(
        r#"
job "{job}" {{
  type = "batch"
  group "g" {{
    count = {count}
    {blocks}
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "{script}"]
      }}
      {mounts}
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

/// Waits until the `count` allocs of batch job `job` are complete (an
/// error if one fails); the allocs.
fn wait_batch_done(server: &Server, job: &str, count: usize) -> Result<Vec<Value>> {
    wait_for(
        &format!("the {count} allocs of {job} done"),
        Duration::from_secs(120),
        || {
            let allocs = server.allocs(job)?;
            if let Some(f) = allocs.iter().find(|a| a["client_status"] == "failed") {
                bail!("an alloc of {job} failed: {f}");
            }
            let done = allocs
                .iter()
                .filter(|a| a["client_status"] == "complete")
                .count();
            Ok((done == count).then_some(allocs))
        },
    )
}

/// The `hostpath` node plugin's topology segment on a node as the API (or
/// `node status -json`) shows it.
fn node_segment(node: &Value) -> Option<&str> {
    node["csi_node_plugins"]["hostpath"]["accessible_topology"]["segments"][KEY].as_str()
}

/// The segment values of a list of topologies as the API shows it.
fn segments(list: &Value) -> Vec<String> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["segments"][KEY].as_str().map(str::to_string))
        .collect()
}

#[test]
fn a_volume_with_a_topology_is_used_only_where_it_is_reachable() -> Result<()> {
    let shared_state = tempfile::tempdir()?;
    let mut server = Server::start("")?;
    let a = Client::start(&server, "topo-a", false, "")?;
    let b = Client::start(&server, "topo-b", false, "")?;
    let ids = server.wait_nodes_ready(&["topo-a", "topo-b"])?;
    let (id_a, id_b) = (ids[0].clone(), ids[1].clone());
    let topology_arg = format!("--topology={KEY}=${{BERTH_NODE_ID}}");
    server.run_job(
        "plugin",
        &shared_plugin_job_with_args(shared_state.path(), &[&topology_arg])?,
    )?;
    wait_for(
        "the plugin healthy with its topology on both nodes",
        Duration::from_secs(60),
        || {
            let p = server.get("/v1/plugin/csi/hostpath")?;
            if p["nodes_healthy"].as_u64() != Some(2)
                || p["controllers_healthy"].as_u64() != Some(2)
            {
                return Ok(None);
            }
            let at = |name: &str| {
                server
                    .node(name)
                    .ok()
                    .and_then(|n| node_segment(&n).map(str::to_string))
            };
            Ok((at("topo-a").as_deref() == Some(id_a.as_str())
                && at("topo-b").as_deref() == Some(id_b.as_str()))
            .then_some(()))
        },
    )
    .with_context(|| logs(&server, &[&a, &b]))?;

    // Created through the controller on the node in the required topology
    // (the other one could not create it there), reachable from there.
    server
        .create_volume("on-a", &volume_on("on-a", &id_a))
        .with_context(|| logs(&server, &[&a, &b]))?;
    server.create_volume("on-b", &volume_on("on-b", &id_b))?;
    let vol = server.volume("on-a")?;
    assert_eq!(
        segments(&vol["accessible_topology"]),
        vec![id_a.clone()],
        "{vol}"
    );

    // A topology no instance serves: the plugin refuses, and the error
    // says it is the topology.
    let spec = shared_state.path().join("nowhere.hcl");
    std::fs::write(&spec, volume_on("nowhere", "no-such-node"))?;
    let out = cli_at(
        &server.addr(),
        &["volume", "create", spec.to_str().context("a UTF-8 path")?],
    )?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "created: {stderr}");
    assert!(
        stderr.contains("cannot create volume \"nowhere\" in the requested topology")
            && stderr.contains(&format!("{{{KEY}=no-such-node}}")),
        "{stderr}"
    );
    assert!(server.get("/v1/volume/csi/nowhere").is_err());

    // 1. Twenty allocs of a batch job using on-a, which the scheduler
    // would otherwise spread over both nodes: every one runs on topo-a.
    server.run_job("use-a", &batch_job_using("use-a", 20, &["on-a"]))?;
    let allocs = wait_batch_done(&server, "use-a", 20).with_context(|| logs(&server, &[&a, &b]))?;
    assert_eq!(allocs.len(), 20);
    for alloc in &allocs {
        assert_eq!(node_of(alloc), id_a, "alloc placed off topology: {alloc}");
        let id = alloc["id"].as_str().unwrap_or_default();
        let written = shared_state.path();
        assert!(
            walk_has(written, id),
            "alloc {id} wrote into on-a (under {})",
            written.display()
        );
    }

    // 2. A group needing on-a and on-b fits no node; the reason names the
    // topologies.
    server.run_job("both", &batch_job_using("both", 1, &["on-a", "on-b"]))?;
    let job = cli_json_at(&server.addr(), &["job", "status", "-json", "both"])?;
    let failures = job["placement_failures"].to_string();
    for id in [&id_a, &id_b] {
        assert!(
            failures.contains(&format!("is reachable only from topology {{{KEY}={id}}}")),
            "{failures}"
        );
    }
    let text = server.cli(&["job", "status", "both"])?;
    assert!(
        text.contains("Placement failures")
            && text.contains(&format!("is reachable only from topology {{{KEY}={id_a}}}")),
        "{text}"
    );
    assert!(server.allocs("both")?.is_empty(), "nothing placed");
    cli_at(&server.addr(), &["job", "stop", "both"])?;

    // 3. The CLI shows the topologies, as JSON and as text.
    let vol = cli_json_at(&server.addr(), &["volume", "status", "-json", "on-b"])?;
    assert_eq!(
        segments(&vol["accessible_topology"]),
        vec![id_b.clone()],
        "{vol}"
    );
    assert_eq!(
        segments(&vol["requested_topologies"]["required"]),
        vec![id_b.clone()],
        "{vol}"
    );
    let text = server.cli(&["volume", "status", "-verbose", "on-b"])?;
    let shown = |key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(" = ")?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let on_b = format!("{{{KEY}={id_b}}}");
    assert_eq!(shown("Topology").as_deref(), Some(on_b.as_str()), "{text}");
    assert_eq!(shown("Required").as_deref(), Some(on_b.as_str()), "{text}");
    assert_eq!(shown("Preferred").as_deref(), Some("-"), "{text}");
    let node = cli_json_at(&server.addr(), &["node", "status", "-json", &id_b])?;
    assert_eq!(node_segment(&node), Some(id_b.as_str()), "{node}");
    let text = server.cli(&["node", "status", &id_b])?;
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("hostpath")
            && l.contains("node")
            && l.contains(&format!("  {{{KEY}={id_b}}}  "))),
        "{text}"
    );
    Ok(())
}

/// Whether a file named `name` exists below `dir`.
fn walk_has(dir: &std::path::Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p = e.path();
        if p.file_name().is_some_and(|n| n == name) {
            return true;
        }
        p.is_dir() && !p.is_symlink() && walk_has(&p, name)
    })
}

#[test]
fn a_volume_of_the_shipped_plugin_job_is_placed_only_on_the_node_that_holds_it() -> Result<()> {
    let mut server = Server::start("")?;
    let a = Client::start(&server, "ship-a", false, "")?;
    let b = Client::start(&server, "ship-b", false, "")?;
    let ids = server.wait_nodes_ready(&["ship-a", "ship-b"])?;
    let shipped = std::fs::read_to_string(berth_tests::example("jobs/hostpath-plugin.hcl"))?;
    server.run_job("plugin", &shipped)?;
    wait_for(
        "the shipped plugin job healthy on both nodes",
        Duration::from_secs(60),
        || {
            let p = server.get("/v1/plugin/csi/hostpath")?;
            Ok((p["nodes_healthy"].as_u64() == Some(2)).then_some(()))
        },
    )
    .with_context(|| logs(&server, &[&a, &b]))?;
    // A volume without a topology request: created through one node's
    // plugin, in that node's data dir, and reachable from it alone.
    let local = r#"
id        = "local"
type      = "csi"
plugin_id = "hostpath"
capacity_min = "1MiB"
capability {
  access_mode     = "multi-node-multi-writer"
  attachment_mode = "file-system"
}
"#;
    server.create_volume("local", local)?;
    let holder = segments(&server.volume("local")?["accessible_topology"]);
    let [holder] = holder.as_slice() else {
        bail!("the volume names one node: {holder:?}");
    };
    anyhow::ensure!(ids.contains(holder), "{holder} is one of {ids:?}");
    let other = ids
        .iter()
        .find(|id| *id != holder)
        .context("the other node")?;

    // Twenty allocs, which the scheduler would otherwise spread: each on
    // the holder.
    server.run_job("use-local", &batch_job_using("use-local", 20, &["local"]))?;
    let allocs =
        wait_batch_done(&server, "use-local", 20).with_context(|| logs(&server, &[&a, &b]))?;
    for alloc in &allocs {
        anyhow::ensure!(node_of(alloc) == holder, "placed off its node: {alloc}");
    }

    // With the holder ineligible, the volume's alloc waits rather than go
    // to the other node, and the reason names the topology.
    server.cli(&["node", "eligibility", "-disable", holder])?;
    server.run_job("later", &batch_job_using("later", 1, &["local"]))?;
    let job = cli_json_at(&server.addr(), &["job", "status", "-json", "later"])?;
    let failures = job["placement_failures"].to_string();
    anyhow::ensure!(
        failures.contains(&format!(
            "is reachable only from topology {{{KEY}={holder}}}"
        )),
        "{failures}"
    );
    anyhow::ensure!(
        server.allocs("later")?.iter().all(|a| node_of(a) != other),
        "nothing placed on the other node"
    );
    Ok(())
}
