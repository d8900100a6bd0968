//! Two instances of one CSI plugin on a node (a plugin upgrade: the old
//! alloc runs on while it waits to stop), with the real `hostpath-plugin`
//! run as plugin tasks: the newer alloc's instance holds the registration,
//! and the old one, healthy or healthy again, never takes it back.
//!
//! Needs `cargo build -p hostpath-plugin` first.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use berth_allocrunner::AllocRunner;
use berth_structs::JobType;
use common::*;

const WITHIN: Duration = Duration::from_secs(30);

/// Starts a hostpath plugin task in an alloc whose create index is
/// `create_index`, every instance on the same state dir; its runner and
/// the guard that kills its process.
fn start_instance(h: &Harness, create_index: u64) -> (AllocRunner, String, PidFileKiller) {
    let task = hostpath_plugin_task("$BERTH_NODE_DATA_DIR");
    let mut a = alloc(JobType::System, vec![task]);
    a.create_index = create_index;
    let id = a.id.clone();
    let killer = PidFileKiller(
        h.data_dir()
            .join("alloc")
            .join(&id)
            .join("plugin/local/pid"),
    );
    let runner = h.runner(a);
    runner.run();
    (runner, id, killer)
}

fn healthy_events(runner: &AllocRunner) -> Vec<String> {
    runner
        .task_states()
        .get("plugin")
        .map(|s| {
            s.events
                .iter()
                .filter(|e| e.event_type == "Plugin became healthy")
                .map(|e| e.message.clone())
                .collect()
        })
        .unwrap_or_default()
}

fn registered_alloc(h: &Harness) -> Option<String> {
    h.csi.registry().get(PLUGIN_ID).map(|r| r.alloc_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_plugin_instance_never_takes_the_registration_from_a_newer_one() {
    let h = Harness::with(|c| c.plugin_probe_interval = Duration::from_millis(100));
    let (new, new_id, _new_killer) = start_instance(&h, 20);
    wait_for("the newer instance to register", WITHIN, || {
        registered_alloc(&h).as_deref() == Some(new_id.as_str())
    })
    .await;

    // The older alloc's instance (as after an agent restart, both
    // reattached) becomes healthy after it: it stays out.
    let (old, _old_id, old_killer) = start_instance(&h, 10);
    wait_for("the older instance to be healthy", WITHIN, || {
        !healthy_events(&old).is_empty()
    })
    .await;
    let events = healthy_events(&old);
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].ends_with("is healthy; a newer instance of it is registered"),
        "{events:?}"
    );
    assert!(healthy_events(&new)[0].ends_with("is healthy and registered"));
    // Through many probe rounds.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(registered_alloc(&h).as_deref(), Some(new_id.as_str()));

    // The old instance stops: the newer one stays registered.
    old.stop();
    wait_done(&old, WITHIN).await;
    drop(old_killer);
    assert_eq!(registered_alloc(&h).as_deref(), Some(new_id.as_str()));
    new.stop();
    wait_done(&new, WITHIN).await;
    assert_eq!(registered_alloc(&h), None);
}
