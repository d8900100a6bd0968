//! Blocking queries and pages through the real router over a real server:
//! a query behind the index answers at once, one at the index waits for a
//! write to the tables it reads (a write elsewhere leaves it waiting) or
//! for its `wait`; every read answers `X-Berth-Index`; lists walk in pages.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, StatusCode};
use axum::Router;
use berth_structs::{
    AccessMode, AttachmentMode, CsiInfo, CsiVolume, Job, JobType, Node, NodeResources, Resources,
    Task, TaskConfig, TaskGroup, VolumeCapability,
};
use serde_json::Value;

use super::query::{blocking_wait, INDEX_HEADER, MAX_BLOCKING_WAIT, NEXT_TOKEN_HEADER};
use super::tests::{call, Answer, TestApi};

async fn get(router: &Router, uri: &str) -> Answer {
    call(router, Method::GET, uri, None, Body::empty()).await
}

fn index_of(a: &Answer) -> u64 {
    a.headers
        .get(INDEX_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {INDEX_HEADER} in {:?}", a.headers))
}

fn next_token_of(a: &Answer) -> Option<String> {
    a.headers
        .get(NEXT_TOKEN_HEADER)
        .map(|v| v.to_str().expect("ASCII token").to_string())
}

fn ids_of(a: &Answer) -> Vec<String> {
    assert_eq!(
        a.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&a.body)
    );
    let v: Value = serde_json::from_slice(&a.body).expect("JSON answer");
    v.as_array()
        .expect("a JSON array")
        .iter()
        .map(|x| x["id"].as_str().expect("an id").to_string())
        .collect()
}

fn job(id: &str) -> Job {
    Job {
        id: id.into(),
        name: id.into(),
        job_type: JobType::Service,
        datacenters: vec!["dc1".into()],
        task_groups: vec![TaskGroup {
            name: "g".into(),
            count: 1,
            tasks: vec![Task {
                name: "t".into(),
                driver: "raw_exec".into(),
                config: TaskConfig {
                    command: "/bin/sleep".into(),
                    args: vec!["1000".into()],
                    ..berth_structs::TaskConfig::default()
                },
                resources: Resources {
                    cpu: 100,
                    memory_mb: 64,
                    ..berth_structs::Resources::default()
                },
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn node(id: &str) -> Node {
    Node {
        id: id.into(),
        name: id.into(),
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

async fn register_job(api: &TestApi, id: &str) {
    api.server
        .register_job(job(id))
        .await
        .unwrap_or_else(|e| panic!("register job {id}: {e}"));
}

async fn register_node(api: &TestApi, id: &str) {
    api.server
        .register_node(node(id))
        .await
        .unwrap_or_else(|e| panic!("register node {id}: {e}"));
}

/// The alloc placed for `job_id` (polled with a deadline).
async fn wait_for_alloc(api: &TestApi, job_id: &str) -> berth_structs::Allocation {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(a) = api.server.job_allocations(job_id).expect("allocs").pop() {
            return a;
        }
        assert!(Instant::now() < deadline, "no alloc of {job_id} was placed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type Pending = tokio::task::JoinHandle<Answer>;

/// A GET in flight.
fn spawn_get(api: &TestApi, uri: &str) -> Pending {
    let router = api.router.clone();
    let uri = uri.to_string();
    tokio::spawn(async move { get(&router, &uri).await })
}

/// `pending` has not answered within `quiet` (a blocking query with
/// nothing to wake it).
async fn assert_waiting(pending: &mut Pending, what: &str) {
    assert!(
        tokio::time::timeout(Duration::from_millis(400), &mut *pending)
            .await
            .is_err(),
        "the blocking query answered {what}"
    );
}

/// The answer of `pending`, which must come soon.
async fn answer(pending: Pending, what: &str) -> Answer {
    tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .unwrap_or_else(|_| panic!("the blocking query did not answer {what}"))
        .expect("the request task")
}

#[tokio::test]
async fn a_blocking_query_behind_the_index_answers_at_once() {
    let api = TestApi::new();
    register_node(&api, "n1").await;
    register_job(&api, "web").await;
    let now = index_of(&get(&api.router, "/v1/jobs").await);
    assert!(now > 1, "a node, then a job was written: {now}");
    let started = Instant::now();
    let a = get(&api.router, &format!("/v1/jobs?index={}&wait=60s", now - 1)).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(ids_of(&a), ["web"]);
    assert_eq!(index_of(&a), now);
    // Index 0 never blocks (the first query of a watch).
    let a = get(&api.router, "/v1/nodes?index=0&wait=60s").await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(index_of(&a) >= 1, "never 0, so that sending it back blocks");
}

#[tokio::test]
async fn a_blocking_query_wakes_for_a_write_to_its_tables_and_not_to_another() {
    let api = TestApi::new();
    // A node first, so that the job is placed at once: a blocked job would
    // be written again when a node comes.
    register_node(&api, "n0").await;
    register_job(&api, "first").await;
    wait_for_alloc(&api, "first").await;
    let jobs_index = index_of(&get(&api.router, "/v1/jobs").await);

    let mut jobs = spawn_get(&api, &format!("/v1/jobs?index={jobs_index}&wait=60s"));
    assert_waiting(&mut jobs, "before any write").await;
    register_node(&api, "n1").await;
    assert_waiting(&mut jobs, "after a write to the nodes table").await;
    register_job(&api, "second").await;
    let a = answer(jobs, "after a job write").await;
    assert_eq!(ids_of(&a), ["first", "second"]);
    assert!(index_of(&a) > jobs_index);

    // The other way round: a node list waits through a job write.
    let nodes_index = index_of(&get(&api.router, "/v1/nodes").await);
    let mut nodes = spawn_get(&api, &format!("/v1/nodes?index={nodes_index}"));
    register_job(&api, "third").await;
    assert_waiting(&mut nodes, "after a write to the jobs table").await;
    register_node(&api, "n2").await;
    let a = answer(nodes, "after a node write").await;
    assert_eq!(ids_of(&a), ["n0", "n1", "n2"]);
    assert!(index_of(&a) > nodes_index);

    // One job's query wakes for that table too.
    let job_index = index_of(&get(&api.router, "/v1/job/first").await);
    let mut one = spawn_get(&api, &format!("/v1/job/first?index={job_index}&wait=30s"));
    assert_waiting(&mut one, "before any write").await;
    api.server.stop_job("first").await.expect("stop job");
    let a = answer(one, "after the job was stopped").await;
    assert!(index_of(&a) > job_index);
}

#[tokio::test]
async fn a_blocking_query_answers_after_its_wait_and_a_bad_wait_is_a_400() {
    let api = TestApi::new();
    register_job(&api, "web").await;
    let now = index_of(&get(&api.router, "/v1/jobs").await);
    let started = Instant::now();
    let a = get(&api.router, &format!("/v1/jobs?index={now}&wait=300ms")).await;
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(ids_of(&a), ["web"]);
    assert_eq!(index_of(&a), now, "nothing changed");

    for uri in ["/v1/jobs?index=3&wait=soon", "/v1/job/web?wait=10"] {
        let a = get(&api.router, uri).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{uri}");
        let m = a.error_message();
        assert!(
            m.starts_with("wait=") && m.contains("such as 10s"),
            "{uri}: {m}"
        );
    }
    assert_eq!(blocking_wait(Some("99999h")).ok(), Some(MAX_BLOCKING_WAIT));
    assert_eq!(blocking_wait(None).ok(), Some(MAX_BLOCKING_WAIT));
    assert_eq!(blocking_wait(Some("2s")).ok(), Some(Duration::from_secs(2)));
}

/// An API with one of everything: a ready node with a CSI plugin, a job
/// placed there, a volume of that plugin.
async fn api_with_one_of_everything() -> (TestApi, BTreeMap<&'static str, String>) {
    let api = TestApi::new();
    register_node(&api, "n1").await;
    let info = CsiInfo {
        plugin_id: "hostpath".into(),
        alloc_id: "plugin-alloc".into(),
        provider: "test.csi.berth".into(),
        version: "1.0.0".into(),
        healthy: true,
        supports_create_delete: true,
        external_node_id: "ext-n1".into(),
        ..Default::default()
    };
    api.server
        .update_node_plugins(
            "n1",
            BTreeMap::from([("hostpath".to_string(), info.clone())]),
            BTreeMap::from([("hostpath".to_string(), info)]),
        )
        .await
        .expect("node plugins");
    api.server
        .register_volume(CsiVolume {
            id: "data".into(),
            name: "data".into(),
            external_id: "ext-data".into(),
            plugin_id: "hostpath".into(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        })
        .await
        .expect("register volume");
    // The job's group mounts the volume, so its alloc may claim it.
    let mut web = job("web");
    // A rolling update block: the version is a deployment.
    web.update = Some(berth_structs::UpdateStrategy::default());
    web.task_groups[0].volumes.insert(
        "data".into(),
        berth_structs::VolumeRequest {
            name: "data".into(),
            volume_type: "csi".into(),
            source: "data".into(),
            access_mode: Some(AccessMode::SingleNodeWriter),
            attachment_mode: Some(AttachmentMode::FileSystem),
            ..Default::default()
        },
    );
    web.task_groups[0].tasks[0]
        .volume_mounts
        .push(berth_structs::VolumeMount {
            volume: "data".into(),
            destination: "data".into(),
            ..Default::default()
        });
    api.server
        .register_job(web)
        .await
        .expect("register job web");
    let alloc = wait_for_alloc(&api, "web").await;
    let deployment = api.server.job_deployments("web").expect("deployments")[0]
        .id
        .clone();
    let ids = BTreeMap::from([
        ("job", "web".to_string()),
        ("deployment", deployment),
        ("node", "n1".to_string()),
        ("alloc", alloc.id),
        ("volume", "data".to_string()),
        ("plugin", "hostpath".to_string()),
    ]);
    (api, ids)
}

#[tokio::test]
async fn every_read_of_the_server_api_answers_its_index_and_blocks() {
    let (api, ids) = api_with_one_of_everything().await;
    let reads: Vec<&str> = super::server_routes()
        .table()
        .iter()
        .filter(|r| {
            // ACL reads (and the introduction tokens') are not blocking
            // queries.
            r.method == Method::GET
                && !matches!(
                    r.path,
                    "/v1/agent/health"
                        | "/v1/status/leader"
                        | "/v1/status/peers"
                        | "/v1/operator/servers"
                        | "/v1/operator/store"
                        | "/v1/volumes/snapshot"
                        | "/v1/node/intros"
                )
                && !r.path.starts_with("/v1/acl/")
        })
        .map(|r| r.path)
        .collect();
    assert!(reads.len() >= 12, "{reads:?}");
    for path in reads {
        let id = match path.split('/').nth(2) {
            Some("job") => &ids["job"],
            Some("allocation") => &ids["alloc"],
            Some("node") => &ids["node"],
            Some("volume") => &ids["volume"],
            Some("plugin") => &ids["plugin"],
            Some("deployment") => &ids["deployment"],
            _ => "",
        };
        let uri = path.replace("{id}", id);
        let a = get(&api.router, &uri).await;
        assert_eq!(
            a.status,
            StatusCode::OK,
            "GET {uri}: {}",
            String::from_utf8_lossy(&a.body)
        );
        let index = index_of(&a);
        assert!(index >= 1, "GET {uri}: {index}");
        // Behind the index: at once; at it: after the wait.
        let behind = get(&api.router, &format!("{uri}?index={}&wait=30s", index - 1)).await;
        assert_eq!(behind.status, StatusCode::OK, "GET {uri} behind its index");
        let started = Instant::now();
        let at = get(&api.router, &format!("{uri}?index={index}&wait=50ms")).await;
        assert_eq!(at.status, StatusCode::OK, "GET {uri} at its index");
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "GET {uri} waited"
        );
        assert_eq!(index_of(&at), index, "GET {uri}");
    }
}

#[tokio::test]
async fn a_list_walks_in_pages_by_id_and_filters_by_prefix() {
    let api = TestApi::new();
    for i in 0..25 {
        register_job(&api, &format!("job-{i:02}")).await;
    }
    let all: Vec<String> = (0..25).map(|i| format!("job-{i:02}")).collect();

    let mut walked = Vec::new();
    let mut tokens = Vec::new();
    let mut uri = "/v1/jobs?per_page=10".to_string();
    loop {
        let a = get(&api.router, &uri).await;
        let page = ids_of(&a);
        assert!(page.len() <= 10);
        walked.extend(page);
        match next_token_of(&a) {
            Some(t) => {
                tokens.push(t.clone());
                uri = format!("/v1/jobs?per_page=10&next_token={t}");
            }
            None => break,
        }
        assert!(tokens.len() < 5, "the walk does not end: {tokens:?}");
    }
    assert_eq!(tokens, ["job-10", "job-20"], "3 pages");
    assert_eq!(walked, all);

    // A page that ends the list exactly has no token.
    let a = get(&api.router, "/v1/jobs?per_page=5&next_token=job-20").await;
    assert_eq!(ids_of(&a).len(), 5);
    assert_eq!(next_token_of(&a), None);

    // prefix filters, also with pages.
    let a = get(&api.router, "/v1/jobs?prefix=job-1").await;
    assert_eq!(ids_of(&a), &all[10..20]);
    assert_eq!(next_token_of(&a), None);
    let a = get(&api.router, "/v1/jobs?prefix=job-1&per_page=4").await;
    assert_eq!(ids_of(&a), &all[10..14]);
    assert_eq!(next_token_of(&a).as_deref(), Some("job-14"));
    let a = get(&api.router, "/v1/jobs?prefix=nothing").await;
    assert!(ids_of(&a).is_empty());

    // Bad pages are 400s that name the parameter.
    for (uri, names) in [
        ("/v1/jobs?per_page=0", "per_page=0"),
        ("/v1/jobs?per_page=ten", "per_page"),
        ("/v1/nodes?per_page=-1", "per_page"),
    ] {
        let a = get(&api.router, uri).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{uri}");
        let m = a.error_message();
        assert!(m.contains(names), "{uri}: {m}");
    }
}

/// A node's answer lists the CSI volumes claimed on it, so its read wakes
/// for a claim there, a write to the volumes table.
#[tokio::test]
async fn a_node_read_wakes_for_a_volume_claimed_on_it() {
    let (api, ids) = api_with_one_of_everything().await;
    let uri = format!("/v1/node/{}", ids["node"]);
    let index = index_of(&get(&api.router, &uri).await);
    let mut pending = spawn_get(&api, &format!("{uri}?index={index}&wait=30s"));
    assert_waiting(&mut pending, "before the claim").await;
    api.server
        .claim_volume(berth_server::VolumeClaimRequest {
            volume_id: ids["volume"].clone(),
            alloc_id: ids["alloc"].clone(),
            node_id: ids["node"].clone(),
            mode: berth_structs::ClaimMode::Write,
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
            mount_options: Default::default(),
        })
        .await
        .expect("claim");
    let a = answer(pending, "after a claim on the node").await;
    assert!(index_of(&a) > index);
    let v: Value = serde_json::from_slice(&a.body).expect("JSON answer");
    assert_eq!(
        v["csi_volumes"][0]["volume_id"],
        ids["volume"].as_str(),
        "{v}"
    );
    assert_eq!(
        v["csi_volumes"][0]["alloc_id"],
        ids["alloc"].as_str(),
        "{v}"
    );
}
