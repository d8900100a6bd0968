//! Fingerprinting, the manager's run loop and the CSI client, against the
//! real `hostpath-plugin` and, for answers it never gives, a small in-test
//! identity plugin served with tonic over a real unix socket.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use berth_sync::{Shutdown, ShutdownSender};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_csimanager::{CsiClient, CsiError, PluginRegistry};
use berth_proto::csi::v1 as csi;
use berth_structs::{CsiPluginType, NodeEvent};
use common::*;
use tonic::Code;

/// Runs `manager.run` until the returned sender flips to true or drops.
fn run_manager(h: &Harness) -> (ShutdownSender, tokio::task::JoinHandle<()>) {
    let (tx, rx) = Shutdown::channel();
    let task = tokio::spawn(h.manager.clone().run(rx));
    (tx, task)
}

#[tokio::test]
async fn a_monolith_fills_both_maps_and_becomes_healthy() {
    let h = Harness::start(&[]).await;
    let (stop, task) = run_manager(&h);
    wait_for("a fingerprint", Duration::from_secs(10), || {
        h.fingerprints
            .last()
            .is_some_and(|(n, c)| n.contains_key(PLUGIN_ID) && c.contains_key(PLUGIN_ID))
    })
    .await;
    let (nodes, controllers) = h.fingerprints.last().unwrap();
    let node = &nodes[PLUGIN_ID];
    assert!(node.healthy, "{node:?}");
    assert_eq!(node.plugin_id, PLUGIN_ID);
    assert_eq!(node.alloc_id, PLUGIN_ALLOC);
    assert!(
        !node.provider.is_empty(),
        "provider comes from GetPluginInfo"
    );
    assert!(!node.version.is_empty());
    assert_eq!(node.external_node_id, "node-1");
    assert!(node.supports_stage_unstage);
    let ctrl = &controllers[PLUGIN_ID];
    assert!(ctrl.healthy, "{ctrl:?}");
    assert!(ctrl.supports_create_delete);
    assert!(
        ctrl.supports_expand && node.supports_expand,
        "EXPAND_VOLUME of the controller and of the node service"
    );
    assert!(ctrl.supports_snapshots, "CREATE_DELETE_SNAPSHOT");
    assert!(
        !ctrl.requires_controller_publish,
        "without --enable-attach the plugin has no PUBLISH_UNPUBLISH_VOLUME"
    );

    let healthy = h
        .events
        .with_message(NodeEvent::SUBSYSTEM_CSI, "Plugin became healthy");
    assert_eq!(healthy.len(), 1);
    assert_eq!(healthy[0].details["plugin_id"], PLUGIN_ID);

    // Later rounds that find nothing changed send no update and no event.
    let n = h.fingerprints.updates().len();
    h.manager.refresh_fingerprints().await;
    h.manager.refresh_fingerprints().await;
    assert_eq!(h.fingerprints.updates().len(), n);
    assert_eq!(
        h.events
            .with_message(NodeEvent::SUBSYSTEM_CSI, "Plugin became healthy")
            .len(),
        1
    );

    stop.shutdown();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("run stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn enable_attach_sets_requires_controller_publish() {
    let h = Harness::start(&["--enable-attach"]).await;
    let (_stop, _task) = run_manager(&h);
    wait_for("a controller fingerprint", Duration::from_secs(10), || {
        h.fingerprints
            .last()
            .is_some_and(|(_, c)| c.contains_key(PLUGIN_ID))
    })
    .await;
    let (_, controllers) = h.fingerprints.last().unwrap();
    assert!(controllers[PLUGIN_ID].healthy);
    assert!(controllers[PLUGIN_ID].requires_controller_publish);
}

#[tokio::test]
async fn a_node_plugin_appears_only_in_the_node_map() {
    let h = Harness::start(&[]).await;
    h.registry
        .register(registration(&h.plugin.socket, CsiPluginType::Node));
    let (_stop, _task) = run_manager(&h);
    wait_for("a node fingerprint", Duration::from_secs(10), || {
        h.fingerprints
            .last()
            .is_some_and(|(n, c)| n.contains_key(PLUGIN_ID) && c.is_empty())
    })
    .await;
}

#[tokio::test]
async fn health_changes_emit_csi_events_and_deregistration_empties_the_maps() {
    let mut h = Harness::start(&[]).await;
    let (_stop, _task) = run_manager(&h);
    wait_for("healthy", Duration::from_secs(10), || {
        h.fingerprints
            .last()
            .is_some_and(|(n, _)| n.get(PLUGIN_ID).is_some_and(|i| i.healthy))
    })
    .await;

    h.plugin.kill();
    wait_for("an unhealthy event", Duration::from_secs(10), || {
        !h.events
            .with_message(NodeEvent::SUBSYSTEM_CSI, "Plugin became unhealthy")
            .is_empty()
    })
    .await;
    let ev = &h
        .events
        .with_message(NodeEvent::SUBSYSTEM_CSI, "Plugin became unhealthy")[0];
    assert_eq!(ev.details["plugin_id"], PLUGIN_ID);
    assert!(!ev.details["error"].is_empty());
    let (nodes, controllers) = h.fingerprints.last().unwrap();
    assert!(!nodes[PLUGIN_ID].healthy);
    assert!(!controllers[PLUGIN_ID].healthy);
    assert!(!nodes[PLUGIN_ID].health_description.is_empty());

    assert!(h.registry.deregister(PLUGIN_ID, PLUGIN_ALLOC));
    wait_for("empty maps", Duration::from_secs(10), || {
        h.fingerprints
            .last()
            .is_some_and(|(n, c)| n.is_empty() && c.is_empty())
    })
    .await;
    wait_for("the registry persisted", Duration::from_secs(5), || {
        h.store.plugins().is_empty()
    })
    .await;
    assert!(matches!(
        h.manager.client(PLUGIN_ID).await,
        Err(CsiError::PluginNotFound(_))
    ));
}

/// A plugin's supervisor saw it fail (its task died): the change is
/// recorded at once, not at the next round, and the node goes on reporting
/// the plugin, unhealthy, with its provider. A restart faster than any
/// round is recorded as healthy again, after the unhealthy event.
#[tokio::test]
async fn an_unhealthy_plugin_is_recorded_at_once_with_its_provider_and_a_quick_recovery_too() {
    let h = Harness::start(&[]).await;
    let (_stop, _task) = run_manager(&h);
    wait_for("healthy", Duration::from_secs(10), || {
        h.fingerprints
            .last()
            .is_some_and(|(n, _)| n.get(PLUGIN_ID).is_some_and(|i| i.healthy))
    })
    .await;
    let provider = h.fingerprints.last().unwrap().0[PLUGIN_ID].provider.clone();
    assert!(!provider.is_empty());
    let csi_events = || -> Vec<(String, String)> {
        h.events
            .all()
            .into_iter()
            .filter(|e| e.subsystem == NodeEvent::SUBSYSTEM_CSI)
            .map(|e| {
                (
                    e.message,
                    e.details.get("error").cloned().unwrap_or_default(),
                )
            })
            .collect()
    };

    // Only the supervisor of the registered instance speaks for it.
    h.manager
        .plugin_unhealthy(PLUGIN_ID, "another-alloc", "not mine");
    assert_eq!(csi_events().len(), 1);
    assert!(h.manager.plugin_fingerprint(PLUGIN_ID).unwrap().healthy());

    h.manager
        .plugin_unhealthy(PLUGIN_ID, PLUGIN_ALLOC, "the plugin task exited");
    assert_eq!(
        csi_events()[1],
        (
            "Plugin became unhealthy".to_string(),
            "the plugin task exited".to_string()
        ),
        "recorded at once"
    );
    let fp = h.manager.plugin_fingerprint(PLUGIN_ID).unwrap();
    assert!(!fp.healthy());
    wait_for("the servers told", Duration::from_secs(10), || {
        h.fingerprints.last().is_some_and(|(n, c)| {
            [&n[PLUGIN_ID], &c[PLUGIN_ID]]
                .iter()
                .all(|i| !i.healthy && i.provider == provider)
        })
    })
    .await;
    let (nodes, _) = h.fingerprints.last().unwrap();
    assert!(nodes[PLUGIN_ID].supports_stage_unstage, "capabilities kept");
    assert_eq!(
        nodes[PLUGIN_ID].health_description,
        "the plugin task exited"
    );

    // Rounds while it is marked keep it unhealthy without a new event.
    h.manager.refresh_fingerprints().await;
    assert_eq!(csi_events().len(), 2);
    assert!(!h.manager.plugin_fingerprint(PLUGIN_ID).unwrap().healthy());

    // The restarted task registers again before any round ran.
    h.registry
        .register(registration(&h.plugin.socket, CsiPluginType::Monolith));
    wait_for("healthy again", Duration::from_secs(10), || {
        csi_events().len() == 3
    })
    .await;
    let messages: Vec<String> = csi_events().into_iter().map(|(m, _)| m).collect();
    assert_eq!(
        messages,
        vec![
            "Plugin became healthy",
            "Plugin became unhealthy",
            "Plugin became healthy"
        ]
    );
    assert!(h.manager.plugin_fingerprint(PLUGIN_ID).unwrap().healthy());
}

#[tokio::test]
async fn the_registry_is_persisted_on_change() {
    let h = Harness::start(&[]).await;
    // `new` persisted what was registered before it.
    assert_eq!(h.store.plugins().len(), 1);
    let (_stop, _task) = run_manager(&h);
    let mut other = registration(&h.plugin.socket, CsiPluginType::Node);
    other.plugin_id = "other".into();
    h.registry.register(other.clone());
    wait_for("the new plugin persisted", Duration::from_secs(5), || {
        h.store.plugins().contains(&other)
    })
    .await;
}

#[tokio::test]
async fn a_hanging_call_is_uncertain_deadline_exceeded() {
    let h = Harness::start(&["--delay", "Probe=30s"]).await;
    let client =
        CsiClient::connect(PLUGIN_ID, &h.plugin.socket, Duration::from_millis(300)).unwrap();
    let started = Instant::now();
    let err = client.probe(csi::ProbeRequest {}).await.expect_err("hangs");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(err.is_uncertain(), "{err:?}");
    assert_eq!(err.code(), Code::DeadlineExceeded);
}

#[tokio::test]
async fn a_missing_socket_is_uncertain() {
    let dir = tempfile::tempdir().unwrap();
    let client = CsiClient::connect(
        PLUGIN_ID,
        &dir.path().join("nope.sock"),
        Duration::from_secs(1),
    )
    .unwrap();
    let err = client
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .expect_err("no plugin");
    assert!(err.is_uncertain(), "{err:?}");
}

// ---------------------------------------------------------------- in-test plugin

/// An identity-only test plugin whose GetPluginInfo answers `name`, and
/// which counts the connections it accepts.
struct TestIdentityPlugin {
    name: String,
}

#[tonic::async_trait]
impl csi::identity_server::Identity for TestIdentityPlugin {
    async fn get_plugin_info(
        &self,
        _: tonic::Request<csi::GetPluginInfoRequest>,
    ) -> Result<tonic::Response<csi::GetPluginInfoResponse>, tonic::Status> {
        Ok(tonic::Response::new(csi::GetPluginInfoResponse {
            name: self.name.clone(),
            vendor_version: "0.0.1".into(),
            manifest: Default::default(),
        }))
    }
    async fn get_plugin_capabilities(
        &self,
        _: tonic::Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<tonic::Response<csi::GetPluginCapabilitiesResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }
    async fn probe(
        &self,
        _: tonic::Request<csi::ProbeRequest>,
    ) -> Result<tonic::Response<csi::ProbeResponse>, tonic::Status> {
        Ok(tonic::Response::new(csi::ProbeResponse {
            ready: Some(true),
        }))
    }
}

/// Serves the test plugin on `socket`; returns the accepted-connection count.
fn serve_test_plugin(socket: &Path, name: &str) -> Arc<AtomicUsize> {
    let listener = tokio::net::UnixListener::bind(socket).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let incoming = async_stream_of(listener, counter);
    let svc = csi::identity_server::IdentityServer::new(TestIdentityPlugin { name: name.into() });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming),
    );
    accepted
}

fn async_stream_of(
    listener: tokio::net::UnixListener,
    counter: Arc<AtomicUsize>,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::UnixStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::UnixListenerStream::new(listener).map(move |s| {
        counter.fetch_add(1, Ordering::SeqCst);
        s
    })
}

#[tokio::test]
async fn a_plugin_info_without_a_name_is_a_final_error_and_unhealthy() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("garbage.sock");
    serve_test_plugin(&socket, "");
    let client = CsiClient::connect("garbage", &socket, Duration::from_secs(2)).unwrap();
    let err = client
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .expect_err("an empty name is invalid");
    assert!(matches!(err, CsiError::Final { .. }), "{err:?}");
    assert!(err.to_string().contains("name"), "{err}");

    let mut reg = registration(&socket, CsiPluginType::Node);
    reg.plugin_id = "garbage".into();
    let fp = berth_csimanager::fingerprint::fingerprint(&client, &reg).await;
    let node = fp.node.expect("a node entry");
    assert!(!node.healthy);
    assert!(node.health_description.contains("invalid response"));
    assert!(fp.controller.is_none());
}

#[tokio::test]
async fn the_manager_reuses_one_connection_per_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("id.sock");
    let accepted = serve_test_plugin(&socket, "test.berth.dev");
    let store = Arc::new(MemStore::default());
    let events = Arc::new(EventLog::default());
    let fingerprints = Arc::new(FingerprintLog::default());
    let registry = PluginRegistry::new();
    let mut reg = registration(&socket, CsiPluginType::Node);
    reg.plugin_id = "id-only".into();
    registry.register(reg);
    let manager = new_manager(
        &dir.path().join("csi"),
        Duration::from_secs(2),
        registry,
        &store,
        &events,
        &fingerprints,
    );
    for _ in 0..5 {
        let c = manager.client("id-only").await.unwrap();
        let info = c
            .get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .unwrap();
        assert_eq!(info.name, "test.berth.dev");
        c.probe(csi::ProbeRequest {}).await.unwrap();
    }
    // Fingerprinting goes through the same cached client.
    manager.refresh_fingerprints().await;
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection, reused");
}

#[tokio::test]
async fn an_unhealthy_plugin_keeps_its_last_good_capability_flags() {
    let mut h = Harness::start(&["--enable-attach"]).await;
    let (_stop, _task) = run_manager(&h);
    wait_for("healthy", Duration::from_secs(10), || {
        h.fingerprints.last().is_some_and(|(n, c)| {
            n.get(PLUGIN_ID).is_some_and(|i| i.healthy)
                && c.get(PLUGIN_ID).is_some_and(|i| i.healthy)
        })
    })
    .await;
    let (good_nodes, good_controllers) = h.fingerprints.last().unwrap();

    h.plugin.kill();
    wait_for("an unhealthy fingerprint", Duration::from_secs(10), || {
        h.fingerprints.last().is_some_and(|(n, c)| {
            n.get(PLUGIN_ID).is_some_and(|i| !i.healthy)
                && c.get(PLUGIN_ID).is_some_and(|i| !i.healthy)
        })
    })
    .await;
    let (nodes, controllers) = h.fingerprints.last().unwrap();
    for (now, good) in [
        (&nodes[PLUGIN_ID], &good_nodes[PLUGIN_ID]),
        (&controllers[PLUGIN_ID], &good_controllers[PLUGIN_ID]),
    ] {
        assert!(!now.health_description.is_empty());
        assert_ne!(now.health_description, good.health_description);
        assert_eq!(
            now.requires_controller_publish,
            good.requires_controller_publish
        );
        assert_eq!(now.supports_stage_unstage, good.supports_stage_unstage);
        assert_eq!(now.supports_create_delete, good.supports_create_delete);
        assert_eq!(now.external_node_id, good.external_node_id);
        assert_eq!(now.max_volumes, good.max_volumes);
    }
    assert!(controllers[PLUGIN_ID].requires_controller_publish);
    assert!(controllers[PLUGIN_ID].supports_create_delete);
    assert!(nodes[PLUGIN_ID].supports_stage_unstage);
    assert_eq!(nodes[PLUGIN_ID].external_node_id, "node-1");
}

/// A fingerprint sink whose calls block until released, like the agent's
/// sink retrying against unreachable servers.
struct BlockedSink {
    calls: std::sync::Mutex<Vec<PluginMaps>>,
    release: tokio::sync::Semaphore,
}

impl Default for BlockedSink {
    fn default() -> Self {
        BlockedSink {
            calls: std::sync::Mutex::default(),
            release: tokio::sync::Semaphore::new(0),
        }
    }
}

impl BlockedSink {
    fn calls(&self) -> Vec<PluginMaps> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl berth_csimanager::FingerprintSink for BlockedSink {
    async fn update_plugins(
        &self,
        node_plugins: std::collections::BTreeMap<String, berth_structs::CsiInfo>,
        controller_plugins: std::collections::BTreeMap<String, berth_structs::CsiInfo>,
    ) {
        self.calls
            .lock()
            .unwrap()
            .push((node_plugins, controller_plugins));
        let _ = self.release.acquire().await;
    }
}

#[tokio::test]
async fn a_blocked_fingerprint_sink_holds_up_neither_the_registry_nor_health() {
    let h = Harness::start(&[]).await;
    let sink = Arc::new(BlockedSink::default());
    let store = Arc::new(MemStore::default());
    let events = Arc::new(EventLog::default());
    let registry = PluginRegistry::new();
    registry.register(registration(&h.plugin.socket, CsiPluginType::Monolith));
    let manager = berth_csimanager::CsiManager::new(
        berth_csimanager::ManagerConfig {
            root_dir: h.dir.path().join("csi2"),
            node_id: "node-1".into(),
            call_timeout: Duration::from_secs(5),
            fingerprint_interval: Duration::from_millis(200),
        },
        registry.clone(),
        store.clone(),
        events.clone(),
        sink.clone(),
    )
    .unwrap();
    let (stop, rx) = Shutdown::channel();
    let task = tokio::spawn(manager.clone().run(rx));
    wait_for("the first set sent", Duration::from_secs(10), || {
        sink.calls().len() == 1
    })
    .await;

    // The sink is stuck in the first send; the loop still persists the
    // registry and fingerprints new plugins.
    let reg_of = |id: &str| {
        let mut r = registration(&h.plugin.socket, CsiPluginType::Node);
        r.plugin_id = id.into();
        registry.register(r.clone());
        r
    };
    let other = reg_of("other");
    wait_for("other persisted", Duration::from_secs(5), || {
        store.plugins().contains(&other)
    })
    .await;
    wait_for("other fingerprinted", Duration::from_secs(5), || {
        manager
            .plugin_fingerprint("other")
            .is_some_and(|fp| fp.healthy())
    })
    .await;
    let third = reg_of("third");
    wait_for("third fingerprinted", Duration::from_secs(5), || {
        store.plugins().contains(&third)
            && manager
                .plugin_fingerprint("third")
                .is_some_and(|fp| fp.healthy())
    })
    .await;
    assert_eq!(sink.calls().len(), 1, "one send at a time");

    // Released, the sink gets the newest set; the one in between is skipped.
    sink.release.add_permits(1);
    wait_for("the newest set sent", Duration::from_secs(5), || {
        sink.calls()
            .last()
            .is_some_and(|(n, _)| n.contains_key("other") && n.contains_key("third"))
    })
    .await;
    assert_eq!(sink.calls().len(), 2, "sets sent while blocked coalesce");

    stop.shutdown();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("run stops on shutdown")
        .unwrap();
}
