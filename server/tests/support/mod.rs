//! Shared test fixtures: a server on a real loopback gRPC port, a test
//! client that answers server calls over a real call stream, and builders
//! for nodes, jobs and volumes.
#![allow(dead_code)]

use berth_sync::{Shutdown, ShutdownSender};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::csi_volume_client::CsiVolumeClient;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_server::{Server, ServerConfig};
use berth_structs::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// The node secret the test clients present for every node they act for.
pub const TEST_SECRET: &str = "test-node-secret-0123456789abcdef";

pub fn test_secret() -> NodeSecret {
    NodeSecret::parse(TEST_SECRET).expect("test secret")
}

/// Puts a node secret (when it has one) in the metadata of every call, as
/// a client agent does.
#[derive(Clone)]
pub struct WithSecret(pub Option<String>);

impl tonic::service::Interceptor for WithSecret {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(secret) = &self.0 {
            let value = secret
                .parse()
                .map_err(|_| tonic::Status::internal("secret is not metadata"))?;
            req.metadata_mut().insert(pb::NODE_SECRET_METADATA, value);
        }
        Ok(req)
    }
}

pub type SecretChannel = InterceptedService<Channel, WithSecret>;

/// Register `node` as its client would, with [`TEST_SECRET`].
pub async fn register(server: &Server, node: Node) -> berth_server::NodeRegistration {
    server
        .register_node_with_secret(node, &test_secret())
        .await
        .expect("register node")
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "berth_server=debug".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Polls until a placement failure of `job_id` mentions `needle`.
pub async fn wait_placement_failure(server: &Server, job_id: &str, needle: &str) {
    wait_until(
        &format!("a placement failure of {job_id} naming {needle:?}"),
        Duration::from_secs(10),
        || {
            server
                .job_placement_failures(job_id)
                .iter()
                .any(|f| f.contains(needle))
        },
    )
    .await;
}

/// Poll `cond` until it holds or `timeout` passes.
pub async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if cond() {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn test_config(dir: &std::path::Path) -> ServerConfig {
    let mut c = ServerConfig::new(dir);
    c.claim_reap_grace = Duration::from_secs(3600);
    c.scheduler_retry_interval = Duration::from_millis(200);
    c.reschedule_delay = Duration::ZERO;
    c.client_call_timeout = Duration::from_secs(5);
    c
}

/// Serve `server`'s `Node` and `CSIVolume` services on a loopback port
/// until `shutdown` turns true; the address and the serving task.
pub async fn serve_grpc(
    server: &Arc<Server>,
    mut shutdown: Shutdown,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let router = tonic::transport::Server::builder()
        .add_service(berth_server::node_service(server))
        .add_service(berth_server::csi_volume_service(server));
    let grpc = tokio::spawn(async move {
        let _ = router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = shutdown.wait().await;
            })
            .await;
    });
    Ok((addr, grpc))
}

/// A server running its loops and serving gRPC on a loopback port. Shuts
/// down when dropped.
pub struct TestServer {
    pub server: Arc<Server>,
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
    shutdown: ShutdownSender,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl TestServer {
    pub async fn start(tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
        init_tracing();
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = test_config(dir.path());
        tweak(&mut cfg);
        let server = Server::open(cfg).expect("open server");
        let (shutdown, rx) = Shutdown::channel();
        let (addr, grpc) = serve_grpc(&server, rx.clone()).await.expect("serve gRPC");
        let run = tokio::spawn(server.clone().run(rx));
        TestServer {
            server,
            addr,
            dir,
            shutdown,
            tasks: vec![grpc, run],
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(self.endpoint())
            .expect("endpoint")
            .connect()
            .await
            .expect("connect to the test server")
    }

    /// A `Node` client that presents [`TEST_SECRET`].
    pub async fn node_client(&self) -> NodeClient<SecretChannel> {
        self.node_client_with(Some(TEST_SECRET)).await
    }

    /// A `Node` client that presents `secret` (None: no secret at all).
    pub async fn node_client_with(&self, secret: Option<&str>) -> NodeClient<SecretChannel> {
        NodeClient::with_interceptor(self.channel().await, WithSecret(secret.map(String::from)))
    }

    /// A `CSIVolume` client that presents [`TEST_SECRET`].
    pub async fn csi_client(&self) -> CsiVolumeClient<SecretChannel> {
        self.csi_client_with(Some(TEST_SECRET)).await
    }

    /// A `CSIVolume` client that presents `secret` (None: no secret).
    pub async fn csi_client_with(&self, secret: Option<&str>) -> CsiVolumeClient<SecretChannel> {
        CsiVolumeClient::with_interceptor(
            self.channel().await,
            WithSecret(secret.map(String::from)),
        )
    }

    pub async fn stop(mut self) {
        self.shutdown.shutdown();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.shutdown();
    }
}

/// The first message of a call stream: it names the node.
pub fn hello(node_id: &str) -> pb::ClientMessage {
    pb::ClientMessage {
        msg: Some(pb::client_message::Msg::Hello(pb::ClientHello {
            node_id: node_id.to_string(),
        })),
    }
}

/// How the test client answers one server call.
pub type CallHandler = Arc<dyn Fn(&pb::ServerCall) -> pb::call_reply::Result + Send + Sync>;

pub fn ok_handler() -> CallHandler {
    Arc::new(|call| match &call.call {
        Some(pb::server_call::Call::ControllerPublish(_)) => {
            pb::call_reply::Result::ControllerPublish(pb::ControllerPublishReply {
                publish_context: [("device".to_string(), "/dev/test0".to_string())].into(),
            })
        }
        Some(pb::server_call::Call::CreateVolume(c)) => {
            pb::call_reply::Result::CreateVolume(pb::CreateVolumeReply {
                external_id: format!("ext-{}", c.name),
                capacity_bytes: c.capacity_min,
                volume_context: [("created".to_string(), "yes".to_string())].into(),
                // Created in the first required topology, as a plugin would.
                accessible_topology: c.requisite.iter().take(1).cloned().collect(),
            })
        }
        _ => pb::call_reply::Result::Empty(pb::Empty {}),
    })
}

/// A test client: opens `Node.OpenCallStream` over real gRPC as `node_id`
/// and answers every server call with `handler`, recording the calls.
pub struct TestClient {
    pub node_id: String,
    pub calls: Arc<Mutex<Vec<pb::ServerCall>>>,
    handler: Arc<Mutex<CallHandler>>,
    task: tokio::task::JoinHandle<()>,
    _out: mpsc::Sender<pb::ClientMessage>,
}

impl TestClient {
    pub async fn connect(ts: &TestServer, node_id: &str, handler: CallHandler) -> TestClient {
        let mut client = ts.node_client().await;
        let (out, rx) = mpsc::channel(16);
        out.send(hello(node_id)).await.expect("send hello");
        let mut inbound = client
            .open_call_stream(ReceiverStream::new(rx))
            .await
            .expect("open call stream")
            .into_inner();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let handler = Arc::new(Mutex::new(handler));
        let (rec, h, reply_out) = (calls.clone(), handler.clone(), out.clone());
        let task = tokio::spawn(async move {
            while let Ok(Some(call)) = inbound.message().await {
                rec.lock().unwrap().push(call.clone());
                let f = h.lock().unwrap().clone();
                let result = f(&call);
                let reply = pb::ClientMessage {
                    msg: Some(pb::client_message::Msg::Reply(pb::CallReply {
                        call_id: call.call_id,
                        result: Some(result),
                    })),
                };
                if reply_out.send(reply).await.is_err() {
                    break;
                }
            }
        });
        let c = TestClient {
            node_id: node_id.to_string(),
            calls,
            handler,
            task,
            _out: out,
        };
        let server = ts.server.clone();
        let id = node_id.to_string();
        wait_until("call stream registered", Duration::from_secs(5), || {
            server.node_connected(&id)
        })
        .await;
        c
    }

    pub fn set_handler(&self, handler: CallHandler) {
        *self.handler.lock().unwrap() = handler;
    }

    pub fn call_kinds(&self) -> Vec<&'static str> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .map(|c| match &c.call {
                Some(pb::server_call::Call::NodeDetach(_)) => "NodeDetach",
                Some(pb::server_call::Call::ControllerPublish(_)) => "ControllerPublish",
                Some(pb::server_call::Call::ControllerUnpublish(_)) => "ControllerUnpublish",
                Some(pb::server_call::Call::CreateVolume(_)) => "CreateVolume",
                Some(pb::server_call::Call::DeleteVolume(_)) => "DeleteVolume",
                Some(pb::server_call::Call::ValidateVolume(_)) => "ValidateVolume",
                Some(pb::server_call::Call::ExpandVolume(_)) => "ExpandVolume",
                Some(pb::server_call::Call::ExpandVolumeOnNode(_)) => "ExpandVolumeOnNode",
                Some(pb::server_call::Call::CreateSnapshot(_)) => "CreateSnapshot",
                Some(pb::server_call::Call::DeleteSnapshot(_)) => "DeleteSnapshot",
                Some(pb::server_call::Call::ListSnapshots(_)) => "ListSnapshots",
                Some(pb::server_call::Call::ClientHttp(_)) => "ClientHttp",
                None => "none",
            })
            .collect()
    }

    /// Drop the call stream (the client goes away).
    pub fn disconnect(self) {
        self.task.abort();
    }
}

impl Drop for TestClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn node(id: &str) -> Node {
    Node {
        id: id.to_string(),
        name: id.to_string(),
        datacenter: "dc1".into(),
        resources: NodeResources {
            cpu: 4000,
            memory_mb: 8192,
            disk_mb: 0,
        },
        drivers: vec!["raw_exec".into()],
        ..Default::default()
    }
}

pub fn plugin_info(plugin_id: &str, healthy: bool, requires_publish: bool) -> CsiInfo {
    CsiInfo {
        plugin_id: plugin_id.to_string(),
        alloc_id: "plugin-alloc".into(),
        provider: "test.csi.berth".into(),
        version: "1.0.0".into(),
        healthy,
        requires_controller_publish: requires_publish,
        supports_create_delete: true,
        external_node_id: "ext-node".into(),
        ..Default::default()
    }
}

/// Give `node_id` a node plugin (and a controller when `controller`).
pub async fn give_plugin(
    server: &Server,
    node_id: &str,
    plugin_id: &str,
    healthy: bool,
    controller: bool,
    requires_publish: bool,
) {
    let nodes = BTreeMap::from([(
        plugin_id.to_string(),
        plugin_info(plugin_id, healthy, requires_publish),
    )]);
    let controllers = if controller {
        BTreeMap::from([(
            plugin_id.to_string(),
            plugin_info(plugin_id, healthy, requires_publish),
        )])
    } else {
        BTreeMap::new()
    };
    server
        .update_node_plugins(node_id, nodes, controllers)
        .await
        .expect("update plugins");
}

pub fn task(name: &str) -> Task {
    Task {
        name: name.into(),
        driver: "raw_exec".into(),
        config: TaskConfig {
            command: "/bin/sleep".into(),
            args: vec!["1000".into()],
            ..berth_structs::TaskConfig::default()
        },
        resources: Resources {
            cpu: 100,
            memory_mb: 128,
            ..berth_structs::Resources::default()
        },
        ..Default::default()
    }
}

/// A job of one group "g" of `count` allocs of task "t". A failed alloc
/// of it is replaced at once, without end (the tests of rescheduling set
/// their own policy).
pub fn job(id: &str, job_type: JobType, count: u32) -> Job {
    Job {
        id: id.into(),
        name: id.into(),
        job_type,
        task_groups: vec![TaskGroup {
            name: "g".into(),
            count,
            tasks: vec![task("t")],
            ..Default::default()
        }],
        reschedule: Some(berth_structs::ReschedulePolicy {
            delay: Duration::ZERO,
            delay_function: berth_structs::DelayFunction::Constant,
            unlimited: true,
            ..berth_structs::ReschedulePolicy::default_for(job_type)
        }),
        ..Default::default()
    }
}

/// A service job whose group mounts CSI volume `volume_id`.
pub fn volume_job(id: &str, volume_id: &str, access: AccessMode) -> Job {
    let mut j = job(id, JobType::Service, 1);
    let g = &mut j.task_groups[0];
    g.volumes.insert(
        "data".into(),
        VolumeRequest {
            name: "data".into(),
            volume_type: "csi".into(),
            source: volume_id.into(),
            read_only: access.is_reader_only(),
            access_mode: Some(access),
            attachment_mode: Some(AttachmentMode::FileSystem),
            ..Default::default()
        },
    );
    g.tasks[0].volume_mounts.push(VolumeMount {
        volume: "data".into(),
        destination: "data".into(),
        read_only: access.is_reader_only(),
        ..Default::default()
    });
    j
}

pub fn volume(id: &str, plugin_id: &str, caps: &[AccessMode]) -> CsiVolume {
    CsiVolume {
        id: id.into(),
        name: id.into(),
        external_id: format!("ext-{id}"),
        plugin_id: plugin_id.into(),
        capabilities: caps
            .iter()
            .map(|a| VolumeCapability {
                access_mode: *a,
                attachment_mode: AttachmentMode::FileSystem,
            })
            .collect(),
        secrets: [("token".to_string(), "s3cret".to_string())].into(),
        ..Default::default()
    }
}

/// The claim request a client sends for alloc `alloc`.
pub fn claim_request(volume_id: &str, alloc: &Allocation, access: AccessMode) -> pb::ClaimRequest {
    pb::ClaimRequest {
        volume_id: volume_id.into(),
        alloc_id: alloc.id.clone(),
        node_id: alloc.node_id.clone(),
        mode: access.claim_mode().as_str().into(),
        capability: Some(pb::VolumeCapability {
            access_mode: access.as_str().into(),
            attachment_mode: "file-system".into(),
            fs_type: String::new(),
            mount_flags: vec![],
        }),
    }
}

/// Report an alloc's client status as its client would.
pub async fn report(server: &Server, alloc: &Allocation, status: AllocClientStatus) {
    server
        .update_allocations(
            &alloc.node_id,
            vec![berth_server::AllocUpdate {
                alloc_id: alloc.id.clone(),
                client_status: status,
                client_description: String::new(),
                task_states: None,
                ..Default::default()
            }],
        )
        .await
        .expect("update allocs");
}

pub fn live_allocs(server: &Server, job_id: &str) -> Vec<Allocation> {
    server
        .job_allocations(job_id)
        .unwrap_or_default()
        .into_iter()
        .filter(|a| !a.is_terminal())
        .collect()
}

/// Poll until `job` has a live alloc; that alloc.
pub async fn wait_for_live(server: &Server, job_id: &str) -> Allocation {
    let mut found = None;
    wait_until("a live alloc", Duration::from_secs(10), || {
        found = live_allocs(server, job_id).pop();
        found.is_some()
    })
    .await;
    found.expect("a live alloc")
}

/// Poll until `job` has a live alloc on `node_id`; that alloc.
pub async fn wait_for_live_on(server: &Server, job_id: &str, node_id: &str) -> Allocation {
    let mut found = None;
    wait_until(
        &format!("a live alloc of {job_id} on {node_id}"),
        Duration::from_secs(10),
        || {
            found = live_allocs(server, job_id)
                .into_iter()
                .find(|a| a.node_id == node_id);
            found.is_some()
        },
    )
    .await;
    found.expect("a live alloc")
}

/// The state of `alloc_id`'s claim on `volume_id` and whether it is being
/// released; None without such a claim (or volume).
pub fn claim_of(server: &Server, volume_id: &str, alloc_id: &str) -> Option<(ClaimState, bool)> {
    server
        .volume(volume_id)
        .ok()?
        .claim_for(alloc_id)
        .map(|c| (c.state, c.releasing))
}

/// n1 with a node plugin "hostpath" (and, with `controller`, a controller
/// plugin that needs publish), a volume "data" of `caps` and a job "db"
/// placed on n1; db's alloc.
pub async fn place_db_on_n1(ts: &TestServer, controller: bool, caps: &[AccessMode]) -> Allocation {
    let s = &ts.server;
    register(s, node("n1")).await;
    give_plugin(s, "n1", "hostpath", true, controller, controller).await;
    s.register_volume(volume("data", "hostpath", caps))
        .await
        .unwrap();
    s.register_job(volume_job("db", "data", caps[0]))
        .await
        .unwrap();
    live_allocs(s, "db").pop().expect("db placed")
}

/// n1's client connected with `handler`, and `alloc`'s single-node-writer
/// claim of "data" taken over gRPC; the client and the CSI service.
pub async fn connect_and_claim_data(
    ts: &TestServer,
    alloc: &Allocation,
    handler: CallHandler,
) -> (TestClient, CsiVolumeClient<SecretChannel>) {
    let client = TestClient::connect(ts, "n1", handler).await;
    let mut csi = ts.csi_client().await;
    csi.claim(claim_request("data", alloc, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    (client, csi)
}

/// [`place_db_on_n1`] with a single-node-writer volume, then
/// [`connect_and_claim_data`]: db holds the write claim of "data".
pub async fn claimed_db_on_n1(
    ts: &TestServer,
    controller: bool,
    handler: CallHandler,
) -> (Allocation, TestClient, CsiVolumeClient<SecretChannel>) {
    let alloc = place_db_on_n1(ts, controller, &[AccessMode::SingleNodeWriter]).await;
    let (client, csi) = connect_and_claim_data(ts, &alloc, handler).await;
    (alloc, client, csi)
}

/// Registers volume "data": plugin "hostpath", single-node-writer.
pub async fn register_data_volume(server: &Server) {
    server
        .register_volume(volume("data", "hostpath", &[AccessMode::SingleNodeWriter]))
        .await
        .expect("register volume");
}

/// Register volume "data" (plugin "hostpath", single-node-writer) and
/// `job`, which mounts it; the alloc placed for the job.
pub async fn place_on_data(server: &Server, job: Job) -> Allocation {
    register_data_volume(server).await;
    let job_id = job.id.clone();
    server.register_job(job).await.expect("register job");
    live_allocs(server, &job_id)
        .pop()
        .unwrap_or_else(|| panic!("{job_id} placed"))
}

/// Job "db" writing volume "data", whose allocs a client cut off from the
/// servers stops `window` after its last heartbeat.
pub fn windowed_db_job(window: Duration) -> Job {
    let mut j = volume_job("db", "data", AccessMode::SingleNodeWriter);
    j.task_groups[0].stop_after_client_disconnect = Some(window);
    j
}

/// `next`, the replacement of an alloc whose write claim was freed, claims
/// volume "data" over gRPC as its client would.
pub async fn replacement_claims_data(ts: &TestServer, next: &Allocation) {
    ts.csi_client()
        .await
        .claim(claim_request("data", next, AccessMode::SingleNodeWriter))
        .await
        .expect("the replacement claims the freed volume");
}

/// Opens the alloc watch of `node_id` over `nc`, as a client that takes
/// full sets does.
pub async fn open_watch(
    nc: &mut NodeClient<SecretChannel>,
    node_id: &str,
) -> tonic::Streaming<pb::AllocationsUpdate> {
    open_watch_with(nc, node_id, false).await
}

/// Opens the alloc watch of `node_id` over `nc`, asking for `deltas` or
/// not.
pub async fn open_watch_with(
    nc: &mut NodeClient<SecretChannel>,
    node_id: &str,
    deltas: bool,
) -> tonic::Streaming<pb::AllocationsUpdate> {
    nc.watch_allocations(pb::WatchAllocationsRequest {
        node_id: node_id.into(),
        deltas,
    })
    .await
    .expect("the alloc watch opens")
    .into_inner()
}

/// A client's report that its alloc `alloc_id` is now `client_status`
/// (with `description` and no task states).
/// The client's report that the alloc runs, its task "t" running.
pub fn running_update(node_id: &str, alloc_id: &str) -> pb::UpdateAllocationsRequest {
    let states = BTreeMap::from([(
        "t".to_string(),
        TaskState {
            state: TaskStateKind::Running,
            ..Default::default()
        },
    )]);
    let mut req = status_update(node_id, alloc_id, "running", "Tasks are running");
    req.updates[0].task_states_json = serde_json::to_vec(&states).unwrap();
    req
}

pub fn status_update(
    node_id: &str,
    alloc_id: &str,
    client_status: &str,
    description: &str,
) -> pb::UpdateAllocationsRequest {
    pb::UpdateAllocationsRequest {
        node_id: node_id.into(),
        updates: vec![pb::AllocStatusUpdate {
            alloc_id: alloc_id.into(),
            client_status: client_status.into(),
            client_description: description.into(),
            task_states_json: vec![],
            ..Default::default()
        }],
    }
}
