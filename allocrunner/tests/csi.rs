//! CSI through the alloc runner with the real `hostpath-plugin` run as a
//! plugin task: plugin supervision and registration, claims with retries,
//! mounts bound into the task dir, release at stop, rollback on failure,
//! and unmount before release for an alloc restored after an agent restart.
//!
//! Needs `cargo build -p hostpath-plugin` first.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_allocrunner::alloc_runner::EVENT_WAITING_FOR_VOLUMES;
use berth_allocrunner::task_hooks::MAX_SOCKET_PATH_LEN;
use berth_allocrunner::{AllocRunner, AllocStateStore, ClaimError, ClaimGrant};
use berth_structs::{
    AccessMode, AllocClientStatus, AllocDesiredStatus, AttachmentMode, ClaimMode, CsiMountOptions,
    JobType, RestartPolicy, Task, TaskStateKind, VolumeMount, VolumeRequest,
};
use common::*;

const WITHIN: Duration = Duration::from_secs(30);

struct Plugin {
    runner: AllocRunner,
    state_dir: PathBuf,
    _killer: PidFileKiller,
}

impl Plugin {
    fn backing_dir(&self, external_id: &str) -> PathBuf {
        self.state_dir.join("volumes").join(external_id)
    }

    /// Asks the plugin alloc to stop, as the servers do.
    fn ask_to_stop(&self) {
        ask_to_stop(&self.runner);
    }

    async fn stop(&self) {
        self.ask_to_stop();
        wait_done(&self.runner, WITHIN).await;
    }

    /// The plugin process's pid.
    fn pid(&self) -> nix::unistd::Pid {
        let pid = std::fs::read_to_string(&self._killer.0).expect("the plugin's pid file");
        nix::unistd::Pid::from_raw(pid.trim().parse().expect("a pid"))
    }

    /// The plugin process dies (SIGKILL) and, without restarts, its alloc
    /// fails: the plugin is gone however many volumes it served.
    async fn crash(&self) {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGKILL)
            .expect("kill the plugin");
        wait_done(&self.runner, WITHIN).await;
    }

    /// The plugin task's events, as (type, message).
    fn events(&self) -> Vec<(String, String)> {
        task_events(&self.runner, "plugin")
    }
}

fn task_events(runner: &AllocRunner, task: &str) -> Vec<(String, String)> {
    runner
        .task_states()
        .get(task)
        .map(|s| {
            s.events
                .iter()
                .map(|e| (e.event_type.clone(), e.message.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs the hostpath plugin as a plugin task and waits for it to register.
async fn start_plugin(h: &Harness) -> Plugin {
    let (runner, state_dir, killer) = run_hostpath_plugin(h, WITHIN).await;
    Plugin {
        runner,
        state_dir,
        _killer: killer,
    }
}

fn grant(volume_id: &str, external_id: &str) -> ClaimGrant {
    ClaimGrant {
        volume_id: volume_id.into(),
        external_id: external_id.into(),
        plugin_id: PLUGIN_ID.into(),
        secrets: BTreeMap::from([("token".to_string(), "s3cr3t".to_string())]),
        ..ClaimGrant::default()
    }
}

fn csi_volume(name: &str, source: &str) -> VolumeRequest {
    VolumeRequest {
        name: name.into(),
        volume_type: "csi".into(),
        source: source.into(),
        access_mode: Some(AccessMode::MultiNodeMultiWriter),
        attachment_mode: Some(AttachmentMode::FileSystem),
        ..VolumeRequest::default()
    }
}

fn consumer(volumes: &[&str], task: Task) -> berth_structs::Allocation {
    let mut a = alloc(JobType::Service, vec![task]);
    group_mut(&mut a).volumes = volumes
        .iter()
        .map(|v| (v.to_string(), csi_volume(v, v)))
        .collect();
    a
}

/// An alloc whose task "web" uses volume "vol" and sleeps, and the killer
/// that ends its process when the test ends, also when it fails.
fn sleeping_user(h: &Harness) -> (berth_structs::Allocation, PidFileKiller) {
    let a = consumer(
        &["vol"],
        sh_task(
            "web",
            r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; exec sleep 1000"#,
        ),
    );
    let killer = PidFileKiller(h.data_dir().join("alloc").join(&a.id).join("web/local/pid"));
    (a, killer)
}

/// Creates the volume "vol", grants its claim, and runs an alloc whose task
/// "web" uses it until the task runs. The killer ends the task's process
/// when the test ends, also when it fails.
async fn run_volume_user(h: &Harness) -> (berth_structs::Allocation, AllocRunner, PidFileKiller) {
    let ext = create_volume(h, "vol", AccessMode::MultiNodeMultiWriter).await;
    h.claimer.grant(grant("vol", &ext));
    let (a, killer) = sleeping_user(h);
    let runner = h.runner(a.clone());
    runner.run();
    wait_running(&runner, "web", WITHIN).await;
    (a, runner, killer)
}

/// The node events of the storage subsystem that do not say success.
fn storage_failures(h: &Harness) -> Vec<berth_structs::NodeEvent> {
    h.node_events
        .all()
        .iter()
        .filter(|e| {
            e.subsystem == "Storage" && e.details.get("success").map(String::as_str) != Some("true")
        })
        .cloned()
        .collect()
}

#[tokio::test]
async fn csi_volume_is_claimed_mounted_bound_and_released() {
    let h = Harness::with(|c| c.plugin_probe_interval = Duration::from_millis(200));
    let plugin = start_plugin(&h).await;
    let plugin_events = h.updater.events("plugin");
    assert!(
        plugin_events.contains(&"Plugin became healthy".to_string()),
        "{plugin_events:?}"
    );
    let reg = h.csi.registry().get(PLUGIN_ID).unwrap();
    assert_eq!(reg.alloc_id, plugin.runner.alloc_id());
    assert_eq!(reg.provider, "hostpath.csi.berth.dev");
    assert!(reg.socket_path.ends_with("csi.sock"));

    let ext = create_volume(&h, "vol", AccessMode::MultiNodeMultiWriter).await;
    // The first claim is refused as retryable (a previous claim is being
    // freed); the hook retries.
    h.claimer.script(
        "vol",
        vec![Err(ClaimError::retryable("no free write claims"))],
    );
    h.claimer.grant(grant("vol", &ext));

    let mut task = sh_task(
        "web",
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"
echo hello > "$BERTH_TASK_DIR/data/hello"
if (echo x > "$BERTH_TASK_DIR/ro/x") 2>/dev/null; then r=writable; else r=readonly; fi
echo $r > "$BERTH_TASK_DIR/local/ro-result"
sleep 1000"#,
    );
    task.volume_mounts = vec![
        VolumeMount {
            volume: "vol".into(),
            destination: "data".into(),
            read_only: false,
            ..Default::default()
        },
        VolumeMount {
            volume: "vol".into(),
            destination: "ro".into(),
            read_only: true,
            ..Default::default()
        },
    ];
    let a = consumer(&["vol"], task);
    let task_dir = h.data_dir().join("alloc").join(&a.id).join("web");
    let _killer = PidFileKiller(task_dir.join("local/pid"));
    let runner = h.runner(a.clone());
    runner.run();
    let result = task_dir.join("local/ro-result");
    wait_for("the task to use its volume", WITHIN, || {
        std::fs::read_to_string(&result).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    assert_eq!(std::fs::read_to_string(&result).unwrap(), "readonly\n");
    assert_eq!(
        std::fs::read_to_string(plugin.backing_dir(&ext).join("hello")).unwrap(),
        "hello\n",
        "the write landed in the plugin's volume"
    );
    let claims = h.claimer.claims();
    assert_eq!(claims.len(), 2, "one refused claim, one granted");
    assert_eq!(claims[1].alloc_id, a.id);
    assert_eq!(claims[1].mode, ClaimMode::Write);
    // The task may write before the driver has reported it started.
    wait_for("the alloc to be running", WITHIN, || {
        runner.client_status() == AllocClientStatus::Running
    })
    .await;

    ask_to_stop(&runner);
    wait_done(&runner, WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), a.id.clone())]
    );
    assert!(mounts_under(&task_dir).is_empty(), "bind mounts are gone");
    assert!(
        mounts_under(&h.data_dir().join("client/csi")).is_empty(),
        "unpublished and unstaged"
    );
    assert!(h.store.volumes().is_empty());
    runner.destroy().await.expect("destroy");

    plugin.stop().await;
    assert!(h.csi.registry().get(PLUGIN_ID).is_none(), "deregistered");
}

#[tokio::test]
async fn a_failed_claim_rolls_back_the_volumes_already_mounted() {
    let h = Harness::new();
    let plugin = start_plugin(&h).await;
    let ext = create_volume(&h, "a", AccessMode::MultiNodeMultiWriter).await;
    h.claimer.grant(grant("a", &ext));
    h.claimer.script(
        "b",
        vec![Err(ClaimError::fatal("volume b has no free claims"))],
    );

    let mut task = sh_task("web", "exit 0");
    task.volume_mounts = vec![VolumeMount {
        volume: "a".into(),
        destination: "a".into(),
        read_only: false,
        ..Default::default()
    }];
    let a = consumer(&["a", "b"], task);
    let runner = h.runner(a.clone());
    runner.run();
    wait_done(&runner, WITHIN).await;

    let last = h.updater.last().unwrap();
    assert_eq!(last.status, AllocClientStatus::Failed);
    assert!(
        last.description.contains("prerun hook \"csi\" failed")
            && last.description.contains("claiming volume b"),
        "{}",
        last.description
    );
    let events = h.updater.events("web");
    assert!(events.contains(&"Setup Failure".to_string()), "{events:?}");
    assert!(!events.contains(&"Started".to_string()), "{events:?}");
    // Postrun released both: the mounted one after unmounting it, and the
    // refused one in case the servers took it anyway.
    let mut released = h.claimer.unpublishes();
    released.sort();
    assert_eq!(
        released,
        vec![
            ("a".to_string(), a.id.clone()),
            ("b".to_string(), a.id.clone())
        ]
    );
    assert!(h.store.volumes().is_empty(), "volume a was unmounted");
    assert!(mounts_under(&h.data_dir().join("client/csi")).is_empty());
    plugin.stop().await;
}

#[tokio::test]
async fn a_plugin_that_never_becomes_healthy_is_restarted_then_fails() {
    let h = Harness::new();
    let mut task = sh_task("plugin", "exec sleep 1000");
    task.csi_plugin = Some(plugin_config(Duration::from_millis(500)));
    let mut a = alloc(JobType::Service, vec![task]);
    group_mut(&mut a).restart = RestartPolicy {
        attempts: 1,
        interval: Duration::from_secs(600),
        delay: Duration::ZERO,
        mode: "fail".into(),
    };
    let runner = h.runner(a);
    runner.run();
    wait_done(&runner, WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Failed);
    let state = &h.updater.last().unwrap().tasks["plugin"];
    let count = |t: &str| state.events.iter().filter(|e| e.event_type == t).count();
    assert_eq!(count("Plugin became unhealthy"), 2, "{:?}", state.events);
    assert_eq!(count("Restarting"), 1);
    assert_eq!(count("Started"), 2);
    let unhealthy = state
        .events
        .iter()
        .find(|e| e.event_type == "Plugin became unhealthy")
        .unwrap();
    assert!(
        unhealthy.message.contains("did not become healthy within"),
        "{}",
        unhealthy.message
    );
    assert_eq!(state.events.last().unwrap().event_type, "Not Restarting");
    assert!(h.csi.registry().get(PLUGIN_ID).is_none());
}

#[tokio::test]
async fn a_plugin_socket_path_too_long_fails_setup_clearly() {
    let h = Harness::with(|c| c.plugin_root = c.plugin_root.join("x".repeat(100)));
    let mut task = sh_task("plugin", "exec sleep 1000");
    task.csi_plugin = Some(plugin_config(Duration::from_secs(5)));
    let runner = h.runner(alloc(JobType::Service, vec![task]));
    runner.run();
    wait_done(&runner, WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Failed);
    let state = &h.updater.last().unwrap().tasks["plugin"];
    let failure = state
        .events
        .iter()
        .find(|e| e.event_type == "Setup Failure")
        .expect("a Setup Failure event");
    assert!(
        failure
            .message
            .contains(&format!("longer than the {MAX_SOCKET_PATH_LEN}")),
        "{}",
        failure.message
    );
}

#[tokio::test]
async fn a_stop_while_a_claim_is_retried_gives_up_and_releases_it() {
    let h = Harness::new();
    // Refused as retryable for longer than the test runs.
    h.claimer.script(
        "vol",
        (0..1000)
            .map(|_| Err(ClaimError::retryable("no free write claims")))
            .collect(),
    );
    let a = consumer(&["vol"], sh_task("web", "sleep 1000"));
    let runner = h.runner(a.clone());
    runner.run();
    wait_for("a claim attempt", WITHIN, || !h.claimer.claims().is_empty()).await;
    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    assert!(!h.updater.events("web").contains(&"Started".to_string()));
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), a.id.clone())]
    );
}

#[tokio::test]
async fn a_claim_carries_the_jobs_mount_options() {
    let h = Harness::new();
    let mut a = consumer(&["vol"], sh_task("web", "exit 0"));
    let options = CsiMountOptions {
        fs_type: String::new(),
        mount_flags: vec!["noatime".into()],
    };
    group_mut(&mut a)
        .volumes
        .get_mut("vol")
        .expect("the group's volume")
        .mount_options = Some(options.clone());
    // No grant: the claim is refused, and the request is what counts here.
    let runner = h.runner(a.clone());
    runner.run();
    wait_done(&runner, WITHIN).await;
    let claims = h.claimer.claims();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0].volume_id, "vol");
    assert_eq!(claims[0].alloc_id, a.id);
    assert_eq!(claims[0].mount_options, options);
}

/// The node's state when the servers were asked to release a claim.
#[derive(Debug)]
struct AtUnpublish {
    volume_id: String,
    alloc_id: String,
    /// Mounts below `<data>/client/csi` (staging and publish targets).
    csi_mounts: Vec<PathBuf>,
    /// Mounts below the alloc's dir (the task's binds of the volume).
    alloc_mounts: Vec<PathBuf>,
    /// Whether csimanager still recorded a mount of the alloc.
    stubs_list_alloc: bool,
}

/// What the first agent left behind: the plugin and the task still run, the
/// volume is staged, published and bound into the task.
struct LeftRunning {
    h: Harness,
    allocs: Arc<MemAllocStore>,
    _plugin: Plugin,
    a: berth_structs::Allocation,
    _task_killer: PidFileKiller,
    csi_dir: PathBuf,
    alloc_dir: PathBuf,
}

/// An agent mounts a volume for an alloc (bound into its task) and goes
/// away without stopping it.
fn mount_and_leave_running() -> LeftRunning {
    mount_and_leave_running_with(&["vol"])
}

/// [`mount_and_leave_running`] with the group's volumes `volumes`, each
/// bound into the task at its own name.
fn mount_and_leave_running_with(volumes: &[&str]) -> LeftRunning {
    let allocs = Arc::new(MemAllocStore::default());
    let s = allocs.clone();
    let h = Harness::with(move |c| c.store = s);
    let csi_dir = h.data_dir().join("client/csi");

    let first = runtime();
    let (plugin, a, task_killer) = first.block_on(async {
        let plugin = start_plugin(&h).await;
        for v in volumes {
            let ext = create_volume(&h, v, AccessMode::MultiNodeMultiWriter).await;
            h.claimer.grant(grant(v, &ext));
        }
        let mut task = sh_task(
            "web",
            r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; exec sleep 1000"#,
        );
        task.volume_mounts = volumes
            .iter()
            .map(|v| VolumeMount {
                volume: v.to_string(),
                destination: if volumes.len() == 1 {
                    "data".into()
                } else {
                    v.to_string()
                },
                read_only: false,
                ..Default::default()
            })
            .collect();
        let a = consumer(volumes, task);
        let task_dir = h.data_dir().join("alloc").join(&a.id).join("web");
        let killer = PidFileKiller(task_dir.join("local/pid"));
        let runner = h.runner(a.clone());
        runner.run();
        wait_for("the task to run with its volume", WITHIN, || {
            runner
                .task_states()
                .get("web")
                .is_some_and(|st| st.state == TaskStateKind::Running)
                && allocs.handle(&a.id, "web").is_some()
        })
        .await;
        let alloc_dir = h.data_dir().join("alloc").join(&a.id);
        assert!(
            !mounts_under(&alloc_dir).is_empty(),
            "the volume is bound into the running task; task states: {:?}",
            runner.task_states()
        );
        (plugin, a, killer)
    });
    first.shutdown_timeout(Duration::from_secs(5));
    let alloc_dir = h.data_dir().join("alloc").join(&a.id);
    assert!(
        !mounts_under(&csi_dir).is_empty(),
        "the volume is staged and published"
    );
    assert!(
        !mounts_under(&alloc_dir).is_empty(),
        "the volume is bound into the task (and stays bound when its agent goes away)"
    );
    LeftRunning {
        h,
        allocs,
        _plugin: plugin,
        a,
        _task_killer: task_killer,
        csi_dir,
        alloc_dir,
    }
}

/// The restored runner of `left`'s alloc, over a restarted csimanager.
fn restored_runner(left: &LeftRunning, csi: Arc<berth_csimanager::CsiManager>) -> AllocRunner {
    let restored = left
        .allocs
        .load_allocs()
        .expect("load allocs")
        .into_iter()
        .find(|r| r.alloc.id == left.a.id)
        .expect("the alloc was persisted");
    AllocRunner::restore(left.h.config_with(left.allocs.clone(), csi), restored)
}

/// After a restart, a volume still published for the alloc is kept as it
/// is: the task goes on with it without a new claim, so servers that are
/// unreachable (here: refusing every claim) cost the running task nothing.
#[test]
fn a_restored_alloc_keeps_its_published_volume_without_a_new_claim() {
    let left = mount_and_leave_running();
    let h = &left.h;
    let claims_before = h.claimer.claims().len();
    h.claimer.script(
        "vol",
        vec![Err(ClaimError::fatal("the servers refuse every claim"))],
    );
    let csi = h.restarted_csi();
    let rt = runtime();
    rt.block_on(async {
        let runner = restored_runner(&left, csi.clone());
        runner.run();
        wait_reattached(&runner, "web", WITHIN).await;
        assert_eq!(h.claimer.claims().len(), claims_before, "no new claim");
        assert_eq!(runner.client_status(), AllocClientStatus::Running);
        assert!(!mounts_under(&left.csi_dir).is_empty(), "still published");

        runner.stop();
        wait_done(&runner, WITHIN).await;
        assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), left.a.id.clone())],
        "the claim is released at the end"
    );
    assert!(mounts_under(&left.csi_dir).is_empty());
    assert!(mounts_under(&left.alloc_dir).is_empty());
}

/// A restored alloc that is stopped at once, before its hooks run again,
/// still unmounts and releases what the previous agent mounted and claimed.
#[test]
fn a_restored_alloc_stopped_before_its_prerun_still_releases_its_volume() {
    let left = mount_and_leave_running();
    let h = &left.h;
    let csi = h.restarted_csi();
    let rt = runtime();
    rt.block_on(async {
        let runner = restored_runner(&left, csi.clone());
        runner.stop();
        runner.run();
        wait_done(&runner, WITHIN).await;
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), left.a.id.clone())],
        "the claim is released"
    );
    assert!(
        mounts_under(&left.csi_dir).is_empty(),
        "unpublished and unstaged"
    );
    assert!(
        mounts_under(&left.alloc_dir).is_empty(),
        "unbound from the task"
    );
    assert!(csi.volume_stubs().is_empty(), "{:?}", csi.volume_stubs());
}

/// The restarted agent finds the volume's publish target gone (unmounted
/// while it was down), so it must claim again, and the servers refuse for
/// good: the runner goes to postrun. Returns what the node had mounted when
/// postrun asked the servers to release the claim, and the alloc's id.
fn restore_with_a_refused_claim() -> (AtUnpublish, String) {
    let left = mount_and_leave_running();
    let LeftRunning {
        h,
        a,
        csi_dir,
        alloc_dir,
        ..
    } = &left;
    let (h, a, csi_dir, alloc_dir) = (h, a.clone(), csi_dir.clone(), alloc_dir.clone());

    // The restarted agent: a new CsiManager from the same store, and the
    // servers refuse the restored alloc's claim for good.
    h.claimer.script(
        "vol",
        vec![Err(ClaimError::fatal("volume vol has no free claims"))],
    );
    let csi = h.restarted_csi();
    let target = csi
        .volume_stubs()
        .iter()
        .find(|s| s.volume_id == "vol")
        .and_then(|s| s.allocs.get(&a.id).cloned())
        .expect("the restarted csimanager knows the alloc's mount");
    nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH).expect("unmount the target");
    let observed: Arc<Mutex<Vec<AtUnpublish>>> = Arc::default();
    {
        let observed = observed.clone();
        let csi = csi.clone();
        let csi_dir = csi_dir.clone();
        let alloc_dir = alloc_dir.clone();
        h.claimer.observe_unpublish(move |volume_id, alloc_id| {
            let at = AtUnpublish {
                volume_id: volume_id.to_string(),
                alloc_id: alloc_id.to_string(),
                csi_mounts: mounts_under(&csi_dir),
                alloc_mounts: mounts_under(&alloc_dir),
                stubs_list_alloc: csi
                    .volume_stubs()
                    .iter()
                    .any(|s| s.allocs.contains_key(alloc_id)),
            };
            observed.lock().unwrap().push(at);
        });
    }
    let second = runtime();
    second.block_on(async {
        let runner = restored_runner(&left, csi.clone());
        runner.run();
        wait_done(&runner, WITHIN).await;
        assert_eq!(runner.client_status(), AllocClientStatus::Failed);
        let last = h.updater.last().unwrap();
        assert!(
            last.description.contains("claiming volume vol"),
            "{}",
            last.description
        );
    });
    second.shutdown_timeout(Duration::from_secs(5));

    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), a.id.clone())],
        "the claim is released"
    );
    assert!(
        mounts_under(&csi_dir).is_empty(),
        "unpublished and unstaged"
    );
    assert!(
        h.store
            .volumes()
            .values()
            .all(|s| !s.allocs.contains_key(&a.id)),
        "{:?}",
        h.store.volumes()
    );
    let mut observed = std::mem::take(&mut *observed.lock().unwrap());
    assert_eq!(observed.len(), 1, "one unpublish: {observed:?}");
    let at = observed.remove(0);
    assert_eq!(
        (at.volume_id.as_str(), at.alloc_id.as_str()),
        ("vol", a.id.as_str())
    );
    (at, a.id)
}

/// Postrun unpublishes and unstages what csimanager recorded for the alloc
/// before the previous agent's restart, even though this run never got to
/// mount, and only then asks the servers to release the claim (which then
/// run ControllerUnpublish).
#[test]
fn a_restored_alloc_whose_claim_is_refused_unmounts_before_releasing() {
    let (at, _) = restore_with_a_refused_claim();
    assert!(
        at.csi_mounts.is_empty(),
        "unpublished and unstaged before the claim was released: {:?}",
        at.csi_mounts
    );
    assert!(
        !at.stubs_list_alloc,
        "csimanager forgot the alloc's mount before the claim was released"
    );
}

/// The task's bind of the volume, made by the previous agent, keeps the
/// volume's filesystem mounted on this node; it must be gone too before the
/// claim is released.
#[test]
fn a_restored_alloc_whose_claim_is_refused_unbinds_its_tasks_before_releasing() {
    let (at, alloc_id) = restore_with_a_refused_claim();
    assert!(
        at.alloc_mounts.is_empty(),
        "alloc {alloc_id}: the task's binds were gone before the claim was released: {:?}",
        at.alloc_mounts
    );
}

/// A restored alloc stopped while its prerun waits on the claim of its
/// first volume releases the volumes the prerun never reached too: what the
/// previous agent mounted is unmounted and every claim released.
#[test]
fn a_restored_alloc_stopped_during_its_prerun_releases_every_volume() {
    let left = mount_and_leave_running_with(&["va", "vb"]);
    let h = &left.h;
    let a = &left.a;
    // The first volume's publish target is gone: it needs a new claim,
    // which the servers keep refusing for now.
    h.claimer.script(
        "va",
        (0..1000)
            .map(|_| Err(ClaimError::retryable("no free write claims")))
            .collect(),
    );
    let csi = h.restarted_csi();
    let target = csi
        .volume_stubs()
        .iter()
        .find(|s| s.volume_id == "va")
        .and_then(|s| s.allocs.get(&a.id).cloned())
        .expect("the restarted csimanager knows the alloc's mount");
    nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH).expect("unmount the target");
    let claims_before = h.claimer.claims().len();
    let rt = runtime();
    rt.block_on(async {
        let runner = restored_runner(&left, csi.clone());
        runner.run();
        wait_for("the restored prerun to claim va", WITHIN, || {
            h.claimer.claims().len() > claims_before
        })
        .await;
        runner.stop();
        wait_done(&runner, WITHIN).await;
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    let mut released = h.claimer.unpublishes();
    released.sort();
    assert_eq!(
        released,
        vec![
            ("va".to_string(), a.id.clone()),
            ("vb".to_string(), a.id.clone())
        ],
        "both claims are released"
    );
    assert!(
        mounts_under(&left.csi_dir).is_empty(),
        "unpublished and unstaged: {:?}",
        mounts_under(&left.csi_dir)
    );
    assert!(csi.volume_stubs().is_empty(), "{:?}", csi.volume_stubs());
}

/// A destroyed alloc whose volume cannot be unmounted (its plugin is gone)
/// keeps its records, which are what a restarted agent cleans up from.
#[tokio::test]
async fn destroy_keeps_the_alloc_records_while_a_volume_stays_mounted() {
    let allocs = Arc::new(MemAllocStore::default());
    let s = allocs.clone();
    let h = Harness::with(move |c| c.store = s);
    let plugin = start_plugin(&h).await;
    let (a, runner, _killer) = run_volume_user(&h).await;
    // The plugin goes away: nothing can unmount the volume now.
    plugin.crash().await;
    wait_for("the plugin to be deregistered", WITHIN, || {
        h.csi.registry().get(PLUGIN_ID).is_none()
    })
    .await;
    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert!(
        h.csi
            .volume_stubs()
            .iter()
            .any(|s| s.allocs.contains_key(&a.id)),
        "the volume is still mounted for the alloc"
    );
    let err = runner
        .destroy()
        .await
        .expect_err("a volume of the alloc is still mounted");
    assert!(err.to_string().contains("vol"), "{err}");
    assert!(allocs.contains(&a.id), "the alloc's records are kept");
}

/// A terminal alloc whose postrun could not unmount its volume is not one
/// garbage collection may take; once the volume is unmounted it is.
#[tokio::test]
async fn an_alloc_whose_volume_stays_mounted_is_not_collectable() {
    let h = Harness::new();
    let plugin = start_plugin(&h).await;
    let (_, runner, _killer) = run_volume_user(&h).await;
    assert!(
        runner.gc_blocker().is_some(),
        "a running alloc is not collectable"
    );
    // The plugin goes away: postrun cannot unmount the volume.
    plugin.crash().await;
    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert!(runner.client_status().is_terminal());
    let blocker = runner.gc_blocker().expect("the volume is still mounted");
    assert!(blocker.contains("\"vol\""), "{blocker}");

    // With the plugin back, the volume is unmounted and the alloc goes.
    let plugin = start_plugin(&h).await;
    runner
        .destroy()
        .await
        .expect("destroy once the plugin is back");
    assert_eq!(runner.gc_blocker(), None);
    assert!(!runner.alloc_dir().path().exists());
    assert!(mounts_under(&h.data_dir().join("client/csi")).is_empty());
    plugin.stop().await;
}

/// A plugin task killed with SIGKILL is reported unhealthy (a task event,
/// a CSI node event, an unhealthy fingerprint that keeps its provider)
/// before it restarts, then healthy again: the kill is never hidden behind
/// a second "became healthy".
#[tokio::test]
async fn a_killed_plugin_task_is_unhealthy_until_it_restarts_and_is_healthy_again() {
    let h = Harness::new();
    let (stop_csi, rx) = berth_sync::Shutdown::channel();
    let manager = tokio::spawn(h.csi.clone().run(rx));
    let task = hostpath_plugin_task("$BERTH_TASK_DIR/local/state");
    let mut a = alloc(JobType::Service, vec![task]);
    group_mut(&mut a).restart = RestartPolicy {
        attempts: 2,
        interval: Duration::from_secs(600),
        delay: Duration::from_secs(1),
        mode: "fail".into(),
    };
    let pid_file = h
        .data_dir()
        .join("alloc")
        .join(&a.id)
        .join("plugin/local/pid");
    let _killer = PidFileKiller(pid_file.clone());
    let runner = h.runner(a.clone());
    runner.run();
    let node_events = |message: &str| {
        h.node_events
            .all()
            .iter()
            .filter(|e| e.subsystem == "CSI" && e.message == message)
            .count()
    };
    wait_for("the plugin to be fingerprinted healthy", WITHIN, || {
        node_events("Plugin became healthy") == 1
    })
    .await;
    let healthy = h.csi.plugin_fingerprint(PLUGIN_ID).expect("a fingerprint");
    assert!(healthy.healthy());

    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let pid = nix::unistd::Pid::from_raw(pid.trim().parse().unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();

    // Unhealthy while the task waits to restart: still registered, with
    // the provider it had.
    wait_for("the plugin to be unhealthy", WITHIN, || {
        h.csi
            .plugin_fingerprint(PLUGIN_ID)
            .is_some_and(|fp| !fp.healthy())
    })
    .await;
    let down = h.csi.plugin_fingerprint(PLUGIN_ID).unwrap();
    for info in [
        down.node.as_ref().unwrap(),
        down.controller.as_ref().unwrap(),
    ] {
        assert_eq!(info.provider, "hostpath.csi.berth.dev", "{info:?}");
        assert_eq!(info.health_description, "the plugin task exited");
    }
    assert_eq!(
        down.node.unwrap().external_node_id,
        "node-1",
        "capabilities are kept"
    );
    assert_eq!(node_events("Plugin became unhealthy"), 1);
    assert_eq!(
        h.csi.registry().get(PLUGIN_ID).map(|r| r.alloc_id),
        Some(a.id.clone())
    );

    wait_for("the plugin to be healthy again", WITHIN, || {
        node_events("Plugin became healthy") == 2
    })
    .await;
    let events: Vec<(String, String)> = runner.task_states()["plugin"]
        .events
        .iter()
        .map(|e| (e.event_type.clone(), e.message.clone()))
        .filter(|(t, _)| t.starts_with("Plugin became") || t == "Restarting")
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(
        kinds,
        vec![
            "Plugin became healthy",
            "Plugin became unhealthy",
            "Restarting",
            "Plugin became healthy"
        ],
        "{events:?}"
    );
    assert_eq!(events[1].1, "the plugin task exited");
    let csi_events: Vec<String> = h
        .node_events
        .all()
        .iter()
        .filter(|e| e.subsystem == "CSI")
        .map(|e| e.message.clone())
        .collect();
    assert_eq!(
        csi_events,
        vec![
            "Plugin became healthy",
            "Plugin became unhealthy",
            "Plugin became healthy"
        ]
    );
    assert!(h.csi.plugin_fingerprint(PLUGIN_ID).unwrap().healthy());

    runner.stop();
    wait_done(&runner, WITHIN).await;
    assert!(
        h.csi.registry().get(PLUGIN_ID).is_none(),
        "deregistered at stop"
    );
    stop_csi.shutdown();
    manager.await.unwrap();
}

/// What the plugin task says while its stop waits for one volume.
const WAITING_FOR_ONE: &str =
    "Waiting for 1 volume(s) of plugin \"hostpath\" to be unmounted before stopping";

/// Checks, for `period`, that the plugin alloc keeps running: its process
/// alive, its alloc running, the plugin registered.
async fn assert_plugin_keeps_running(h: &Harness, plugin: &Plugin, period: Duration) {
    let until = std::time::Instant::now() + period;
    while std::time::Instant::now() < until {
        assert!(
            nix::sys::signal::kill(plugin.pid(), None).is_ok(),
            "the plugin process runs"
        );
        assert!(!plugin.runner.is_done(), "the plugin alloc is not done");
        assert_eq!(plugin.runner.client_status(), AllocClientStatus::Running);
        assert_eq!(
            h.csi.registry().get(PLUGIN_ID).map(|r| r.alloc_id),
            Some(plugin.runner.alloc_id().to_string()),
            "the plugin stays registered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A plugin alloc asked to stop while another alloc on the node has a
/// volume of the plugin mounted keeps its plugin running, says why on the
/// plugin task (once), and stops only after that alloc stopped and its
/// unmount, made through the plugin, succeeded.
#[tokio::test]
async fn a_stopped_plugin_runs_until_the_volumes_mounted_through_it_are_unmounted() {
    let h = Harness::new();
    let plugin = start_plugin(&h).await;
    let (a, runner, _killer) = run_volume_user(&h).await;
    let pid = plugin.pid();

    plugin.ask_to_stop();
    wait_for("the plugin to say it waits for the volume", WITHIN, || {
        plugin
            .events()
            .iter()
            .any(|(t, m)| t == EVENT_WAITING_FOR_VOLUMES && m == WAITING_FOR_ONE)
    })
    .await;
    assert_plugin_keeps_running(&h, &plugin, Duration::from_secs(2)).await;
    assert_eq!(plugin.pid(), pid, "the same plugin process");

    runner.stop();
    wait_done(&runner, WITHIN).await;
    let last = h.updater.updates();
    let description = &last
        .iter()
        .rev()
        .find(|u| u.tasks.contains_key("web"))
        .expect("an update of the volume user")
        .description;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    assert!(!description.contains("postrun"), "{description}");
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), a.id.clone())],
        "unmounted, then released"
    );
    wait_done(&plugin.runner, WITHIN).await;
    let failures = storage_failures(&h);
    assert!(failures.is_empty(), "{failures:?}");

    let events = plugin.events();
    let waits: Vec<_> = events
        .iter()
        .filter(|(t, _)| t == EVENT_WAITING_FOR_VOLUMES)
        .collect();
    assert_eq!(
        waits.len(),
        1,
        "one event while the count stays: {events:?}"
    );
    let waited_at = events
        .iter()
        .position(|(t, _)| t == EVENT_WAITING_FOR_VOLUMES);
    let killed_at = events.iter().position(|(t, _)| t == "Killing");
    assert!(waited_at < killed_at, "{events:?}");
    assert!(h.csi.registry().get(PLUGIN_ID).is_none(), "deregistered");
    assert!(mounts_under(&h.data_dir().join("client/csi")).is_empty());
    assert!(h.store.volumes().is_empty());
}

/// The stop of a plugin alloc, persisted before an agent restart, waits
/// again after it: the restored plugin is reattached and keeps serving the
/// volume of the restored alloc that still uses it, which unmounts it
/// through the plugin when it stops; only then does the plugin stop.
#[test]
fn a_restored_plugin_alloc_asked_to_stop_waits_for_the_volumes_mounted_through_it() {
    let left = mount_and_leave_running();
    let h = &left.h;
    let plugin = &left._plugin;
    let pid = plugin.pid();
    // The servers asked for the plugin's stop before the agent went away.
    let mut stopped = (*plugin.runner.alloc()).clone();
    stopped.desired_status = AllocDesiredStatus::Stop;
    left.allocs.put_alloc(&stopped).expect("persist the stop");

    let csi = h.restarted_csi();
    let restored = left.allocs.load_allocs().expect("load allocs");
    let find = |id: &str| {
        restored
            .iter()
            .find(|r| r.alloc.id == id)
            .cloned()
            .expect("the alloc was persisted")
    };
    let config = h.config_with(left.allocs.clone(), csi.clone());
    let rt = runtime();
    rt.block_on(async {
        let plugin_runner = AllocRunner::restore(config.clone(), find(plugin.runner.alloc_id()));
        let web = AllocRunner::restore(config, find(&left.a.id));
        plugin_runner.run();
        web.run();
        wait_reattached(&web, "web", WITHIN).await;
        wait_for("the restored plugin to say it waits", WITHIN, || {
            task_events(&plugin_runner, "plugin")
                .iter()
                .any(|(t, m)| t == EVENT_WAITING_FOR_VOLUMES && m == WAITING_FOR_ONE)
        })
        .await;
        assert!(
            task_events(&plugin_runner, "plugin")
                .iter()
                .any(|(t, _)| t == "Reattached"),
            "the plugin task was reattached, not stopped"
        );
        assert!(nix::sys::signal::kill(pid, None).is_ok(), "the plugin runs");
        assert!(!plugin_runner.is_done());

        web.stop();
        wait_done(&web, WITHIN).await;
        assert_eq!(web.client_status(), AllocClientStatus::Complete);
        wait_done(&plugin_runner, WITHIN).await;
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), left.a.id.clone())],
        "unmounted, then released"
    );
    assert!(
        mounts_under(&left.csi_dir).is_empty(),
        "unpublished and unstaged through the plugin"
    );
    assert!(mounts_under(&left.alloc_dir).is_empty());
    assert!(csi.volume_stubs().is_empty(), "{:?}", csi.volume_stubs());
}

/// The plugin alloc and the alloc that uses its volume asked to stop at
/// the same moment (a node back from a partition finds both stopped): the
/// volume is unmounted through the plugin, without error, before the plugin
/// stops.
#[tokio::test]
async fn a_plugin_and_its_volume_user_stopped_together_unmount_before_the_plugin_stops() {
    let h = Harness::new();
    let plugin = start_plugin(&h).await;
    let (a, runner, _killer) = run_volume_user(&h).await;

    plugin.ask_to_stop();
    ask_to_stop(&runner);
    wait_done(&runner, WITHIN).await;
    wait_done(&plugin.runner, WITHIN).await;

    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    let failures = storage_failures(&h);
    assert!(failures.is_empty(), "no unmount failed: {failures:?}");
    assert_eq!(
        h.claimer.unpublishes(),
        vec![("vol".to_string(), a.id.clone())],
        "unmounted, then released"
    );
    assert!(h.store.volumes().is_empty(), "{:?}", h.store.volumes());
    assert!(mounts_under(&h.data_dir().join("client/csi")).is_empty());
    assert!(h.csi.registry().get(PLUGIN_ID).is_none(), "deregistered");
}

#[tokio::test]
async fn a_claim_refused_because_the_alloc_is_terminal_ends_it_not_started_not_failed() {
    let h = Harness::new();
    h.claimer.script(
        "vol",
        vec![Err(ClaimError {
            alloc_terminal: true,
            ..ClaimError::fatal(format!(
                "claiming volume \"vol\": alloc x {} \"vol\"",
                berth_structs::CLAIM_REFUSED_ALLOC_TERMINAL
            ))
        })],
    );
    let a = consumer(&["vol"], sh_task("web", "exit 0"));
    let runner = h.runner(a);
    runner.run();
    wait_done(&runner, WITHIN).await;
    let last = h.updater.last().unwrap();
    assert_ne!(last.status, AllocClientStatus::Failed, "{last:?}");
    let events = h.updater.events("web");
    assert!(!events.contains(&"Setup Failure".to_string()), "{events:?}");
    assert!(!events.contains(&"Started".to_string()), "{events:?}");
}

#[tokio::test]
async fn a_mount_waits_for_its_plugin_to_register_instead_of_failing() {
    let h = Harness::new();
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    // The volume exists in the plugin's state; then the plugin goes.
    let first = h.runner(alloc(
        JobType::Service,
        vec![hostpath_plugin_task(&state_dir)],
    ));
    first.run();
    wait_for("the first plugin registered", WITHIN, || {
        h.csi.registry().get(PLUGIN_ID).is_some()
    })
    .await;
    let ext = create_volume(&h, "vol", AccessMode::MultiNodeMultiWriter).await;
    ask_to_stop(&first);
    wait_done(&first, WITHIN).await;
    wait_for("the plugin deregistered", WITHIN, || {
        h.csi.registry().get(PLUGIN_ID).is_none()
    })
    .await;

    // A user of the volume arrives before the next instance registers: it
    // waits for it, and runs.
    h.claimer.grant(grant("vol", &ext));
    let (user, killer) = sleeping_user(&h);
    let runner = h.runner(user);
    runner.run();
    wait_for("the user waiting for its plugin", WITHIN, || {
        task_events(&runner, "web")
            .iter()
            .any(|(kind, _)| kind == "Waiting for plugin")
    })
    .await;
    let second = h.runner(alloc(
        JobType::Service,
        vec![hostpath_plugin_task(&state_dir)],
    ));
    second.run();
    wait_running(&runner, "web", WITHIN).await;
    assert!(
        !h.updater
            .events("web")
            .contains(&"Setup Failure".to_string()),
        "the user did not fail"
    );
    ask_to_stop(&runner);
    wait_done(&runner, WITHIN).await;
    drop(killer);
    ask_to_stop(&second);
    wait_done(&second, WITHIN).await;
}
