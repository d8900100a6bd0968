//! The alloc runner end to end with real processes: batch completion, task
//! environment, failures, restarts, stop, the alloc dir.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use berth_structs::{AllocClientStatus, AllocDesiredStatus, JobType, RestartPolicy, TaskStateKind};
use common::*;

const DONE_WITHIN: Duration = Duration::from_secs(30);

#[tokio::test]
async fn batch_alloc_completes_with_env_and_interpolation() {
    let h = Harness::new();
    let mut task = sh_task(
        "web",
        r#"env | sort > "$BERTH_TASK_DIR/local/env.txt"; echo "args:$0:$1" > "$BERTH_TASK_DIR/local/args.txt"; echo to-stdout; echo to-stderr >&2"#,
    );
    task.config.args.push("${BERTH_TASK_NAME}".into());
    task.config.args.push("${GREETING}-${NOT_SET}".into());
    task.env
        .insert("GREETING".into(), "hi-${BERTH_GROUP_NAME}".into());
    let alloc = alloc(JobType::Batch, vec![task]);
    let alloc_id = alloc.id.clone();
    let runner = h.runner(alloc);
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;

    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    let last = h.updater.last().expect("updates were reported");
    assert_eq!(last.status, AllocClientStatus::Complete);
    assert_eq!(last.description, "All tasks have completed");
    assert_eq!(
        h.updater.statuses(),
        vec![
            AllocClientStatus::Pending,
            AllocClientStatus::Running,
            AllocClientStatus::Complete
        ]
    );
    let state = &last.tasks["web"];
    assert_eq!(state.state, TaskStateKind::Dead);
    assert!(!state.failed);
    let events = h.updater.events("web");
    assert_eq!(
        events,
        vec!["Received", "Task Setup", "Started", "Terminated"]
    );
    assert_eq!(state.events.last().unwrap().exit_code, Some(0));

    let alloc_dir = h.data_dir().join("alloc").join(&alloc_id);
    let task_dir = alloc_dir.join("web");
    let env = std::fs::read_to_string(task_dir.join("local/env.txt")).unwrap();
    for want in [
        format!("BERTH_ALLOC_ID={alloc_id}"),
        format!("BERTH_ALLOC_DIR={}", alloc_dir.join("alloc").display()),
        format!("BERTH_TASK_DIR={}", task_dir.display()),
        format!("BERTH_SECRETS_DIR={}", task_dir.join("secrets").display()),
        "BERTH_JOB_NAME=j".to_string(),
        "BERTH_GROUP_NAME=g".to_string(),
        "BERTH_TASK_NAME=web".to_string(),
        "BERTH_NODE_ID=node-1".to_string(),
        "GREETING=hi-g".to_string(),
    ] {
        assert!(
            env.lines().any(|l| l == want),
            "{want} missing from:\n{env}"
        );
    }
    assert!(
        env.lines().any(|l| l.starts_with("PATH=")),
        "PATH is inherited"
    );
    assert!(
        !env.contains("CSI_ENDPOINT"),
        "only plugin tasks get CSI_ENDPOINT"
    );
    let args = std::fs::read_to_string(task_dir.join("local/args.txt")).unwrap();
    assert_eq!(args.trim(), "args:web:hi-g-${NOT_SET}");
    let logs = alloc_dir.join("alloc/logs");
    assert_eq!(
        std::fs::read_to_string(logs.join("web.stdout.0")).unwrap(),
        "to-stdout\n"
    );
    assert_eq!(
        std::fs::read_to_string(logs.join("web.stderr.0")).unwrap(),
        "to-stderr\n"
    );
}

#[tokio::test]
async fn alloc_dir_has_its_layout_and_destroy_removes_it() {
    let h = Harness::new();
    let alloc = alloc(
        JobType::Batch,
        vec![sh_task("a", "true"), sh_task("b", "true")],
    );
    let runner = h.runner(alloc.clone());
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    let dir = h.data_dir().join("alloc").join(&alloc.id);
    for d in ["alloc/data", "alloc/logs", "alloc/tmp"] {
        assert!(dir.join(d).is_dir(), "{d}");
    }
    for t in ["a", "b"] {
        for d in ["local", "secrets", "tmp"] {
            assert!(dir.join(t).join(d).is_dir(), "{t}/{d}");
        }
        let mode = std::fs::metadata(dir.join(t).join("secrets"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "secrets dir of {t}");
    }
    assert_eq!(runner.alloc_dir().path(), dir);
    runner.destroy().await.expect("destroy");
    assert!(!dir.exists());
}

#[tokio::test]
async fn a_failing_task_fails_the_alloc_with_its_exit_code() {
    let h = Harness::new();
    let runner = h.runner(alloc(JobType::Batch, vec![sh_task("web", "exit 3")]));
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Failed);
    let last = h.updater.last().unwrap();
    assert_eq!(last.description, "Failed tasks: web");
    let state = &last.tasks["web"];
    assert!(state.failed);
    let terminated = state
        .events
        .iter()
        .find(|e| e.event_type == "Terminated")
        .expect("a Terminated event");
    assert_eq!(terminated.exit_code, Some(3));
    assert_eq!(terminated.message, "Exit Code: 3");
    assert_eq!(state.events.last().unwrap().event_type, "Not Restarting");
}

#[tokio::test]
async fn failed_tasks_restart_per_policy_then_fail() {
    let h = Harness::new();
    let mut alloc = alloc(
        JobType::Batch,
        vec![sh_task(
            "web",
            r#"echo run >> "$BERTH_TASK_DIR/local/runs"; exit 1"#,
        )],
    );
    group_mut(&mut alloc).restart = RestartPolicy {
        attempts: 2,
        interval: Duration::from_secs(600),
        delay: Duration::from_millis(10),
        mode: "fail".into(),
    };
    let runner = h.runner(alloc.clone());
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Failed);
    let runs = std::fs::read_to_string(
        h.data_dir()
            .join("alloc")
            .join(&alloc.id)
            .join("web/local/runs"),
    )
    .unwrap();
    assert_eq!(runs.lines().count(), 3, "the first run and 2 restarts");
    let state = &h.updater.last().unwrap().tasks["web"];
    assert_eq!(state.restarts, 2);
    let restarting = state
        .events
        .iter()
        .filter(|e| e.event_type == "Restarting")
        .count();
    assert_eq!(restarting, 2);
    let last = state.events.last().unwrap();
    assert_eq!(last.event_type, "Not Restarting");
    assert!(
        last.message.contains("Exceeded allowed attempts 2"),
        "{}",
        last.message
    );
}

#[tokio::test]
async fn a_missing_command_fails_the_task_with_a_clear_event() {
    let h = Harness::new();
    let mut task = sh_task("web", "");
    task.config.command = "definitely-not-a-command-xyz".into();
    task.config.args.clear();
    let runner = h.runner(alloc(JobType::Batch, vec![task]));
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Failed);
    let state = &h.updater.last().unwrap().tasks["web"];
    let failure = state
        .events
        .iter()
        .find(|e| e.event_type == "Driver Failure")
        .expect("a Driver Failure event");
    assert!(
        failure
            .message
            .contains("command \"definitely-not-a-command-xyz\" not found"),
        "{}",
        failure.message
    );
}

#[tokio::test]
async fn stop_kills_the_process_group_and_runs_postrun() {
    let h = Harness::new();
    // The task and a background child share its process group.
    let task = sh_task(
        "web",
        r#"echo $$ > "$BERTH_TASK_DIR/local/pid"; sleep 1000 & sleep 1000; wait"#,
    );
    let alloc = alloc(JobType::Service, vec![task]);
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut hooks = berth_allocrunner::alloc_hooks::default_hooks();
    hooks.push(Box::new(RecordingHook {
        name: "recorder",
        fail: false,
        log: log.clone(),
    }));
    let runner = berth_allocrunner::AllocRunner::with_hooks(h.config.clone(), alloc.clone(), hooks);
    runner.run();
    let pid_file = h
        .data_dir()
        .join("alloc")
        .join(&alloc.id)
        .join("web/local/pid");
    wait_for("the task to start", DONE_WITHIN, || {
        std::fs::read_to_string(&pid_file).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    let pgid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _guard = GroupKiller(Some(pgid));
    wait_for("the sleeps to run", DONE_WITHIN, || {
        live_group_members(pgid).len() >= 3
    })
    .await;
    wait_for("the alloc to be running", DONE_WITHIN, || {
        runner.client_status() == AllocClientStatus::Running
    })
    .await;

    ask_to_stop(&runner);
    wait_done(&runner, DONE_WITHIN).await;

    assert!(
        live_group_members(pgid).is_empty(),
        "the task's process group is gone"
    );
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    let events = h.updater.events("web");
    assert!(events.contains(&"Killing".to_string()), "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("Killed"));
    assert!(!h.updater.last().unwrap().tasks["web"].failed);
    assert_eq!(
        *log.lock().unwrap(),
        vec!["prerun recorder", "postrun recorder"],
        "postrun ran"
    );
    runner.destroy().await.expect("destroy");
}

#[tokio::test]
async fn a_failed_task_kills_its_siblings() {
    let h = Harness::new();
    let alloc = alloc(
        JobType::Service,
        vec![sh_task("long", "sleep 1000"), sh_task("short", "exit 2")],
    );
    let runner = h.runner(alloc);
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    let last = h.updater.last().unwrap();
    assert_eq!(last.status, AllocClientStatus::Failed);
    assert!(last.tasks["short"].failed);
    let long = &last.tasks["long"];
    assert!(!long.failed);
    assert!(long
        .events
        .iter()
        .any(|e| e.event_type == "Killing" && e.message == "Sibling task short failed"));
}

/// Every task of the last update never started: dead, not failed, its
/// last event `Not Started`.
fn assert_tasks_not_started(h: &Harness, tasks: &[&str]) {
    let last = h.updater.last().expect("updates were reported");
    for task in tasks {
        let state = &last.tasks[*task];
        assert_eq!(state.state, TaskStateKind::Dead, "{task}: {state:?}");
        assert!(!state.failed, "{task}: {state:?}");
        assert!(state.started_at_ms.is_none(), "{task}: {state:?}");
        let event = state.events.last().expect("events");
        assert_eq!(event.event_type, "Not Started", "{task}: {state:?}");
        assert_eq!(event.message, "the alloc was stopped before it started");
        assert!(
            !state.events.iter().any(|e| e.event_type == "Started"),
            "{task}: {state:?}"
        );
    }
}

#[tokio::test]
async fn an_alloc_stopped_before_it_runs_starts_no_task_and_says_so() {
    let h = Harness::new();
    let mut a = alloc(
        JobType::Service,
        vec![sh_task("web", "sleep 1000"), sh_task("db", "sleep 1000")],
    );
    a.desired_status = AllocDesiredStatus::Stop;
    let runner = h.runner(a);
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    assert_eq!(
        h.updater.statuses(),
        vec![AllocClientStatus::Pending, AllocClientStatus::Complete]
    );
    assert_tasks_not_started(&h, &["web", "db"]);
    assert!(runner.is_done());
    assert!(runner.terminal_at_ms().is_some());
    assert_eq!(runner.gc_blocker(), None);
}

#[tokio::test]
async fn an_alloc_stopped_during_its_prerun_ends_complete_with_its_tasks_not_started() {
    let h = Harness::new();
    // A prerun that waits until the alloc is stopped, as a claim does
    // while the servers keep the volume busy.
    let hooks: Vec<Box<dyn berth_allocrunner::alloc_hooks::AllocHook>> =
        vec![Box::new(WaitForStop)];
    let runner = berth_allocrunner::AllocRunner::with_hooks(
        h.config.clone(),
        alloc(JobType::Batch, vec![sh_task("web", "true")]),
        hooks,
    );
    runner.run();
    wait_for("the alloc to report pending", DONE_WITHIN, || {
        h.updater.last().is_some()
    })
    .await;
    assert_eq!(runner.client_status(), AllocClientStatus::Pending);
    assert_eq!(
        runner.gc_blocker().as_deref(),
        Some("the alloc has not finished (postrun pending)")
    );
    runner.stop();
    wait_done(&runner, DONE_WITHIN).await;
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    assert_tasks_not_started(&h, &["web"]);
}

#[tokio::test]
async fn an_alloc_destroyed_before_it_runs_reports_its_tasks_not_started() {
    let h = Harness::new();
    let runner = h.runner(alloc(JobType::Batch, vec![sh_task("web", "true")]));
    runner.destroy().await.expect("destroy");
    assert_eq!(runner.client_status(), AllocClientStatus::Complete);
    assert_tasks_not_started(&h, &["web"]);
}

/// An alloc hook whose prerun waits until the alloc is stopped.
struct WaitForStop;

#[async_trait::async_trait]
impl berth_allocrunner::alloc_hooks::AllocHook for WaitForStop {
    fn name(&self) -> &'static str {
        "wait_for_stop"
    }
    async fn prerun(
        &mut self,
        ctx: &berth_allocrunner::alloc_hooks::AllocHookContext,
    ) -> Result<(), berth_allocrunner::HookError> {
        let mut stop = ctx.stop.clone();
        stop.wait().await;
        Err(berth_allocrunner::HookError::Stopped)
    }
    async fn postrun(
        &mut self,
        _ctx: &berth_allocrunner::alloc_hooks::AllocHookContext,
    ) -> Result<(), berth_allocrunner::HookError> {
        Ok(())
    }
}

/// An alloc hook that records its calls and fails its prerun if told to.
struct RecordingHook {
    name: &'static str,
    fail: bool,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl berth_allocrunner::alloc_hooks::AllocHook for RecordingHook {
    fn name(&self) -> &'static str {
        self.name
    }
    async fn prerun(
        &mut self,
        _ctx: &berth_allocrunner::alloc_hooks::AllocHookContext,
    ) -> Result<(), berth_allocrunner::HookError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("prerun {}", self.name));
        if self.fail {
            return Err(berth_allocrunner::HookError::Invalid("boom".into()));
        }
        Ok(())
    }
    async fn postrun(
        &mut self,
        _ctx: &berth_allocrunner::alloc_hooks::AllocHookContext,
    ) -> Result<(), berth_allocrunner::HookError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("postrun {}", self.name));
        Ok(())
    }
}

#[tokio::test]
async fn a_prerun_failure_rolls_back_the_hooks_that_ran_in_reverse() {
    let h = Harness::new();
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook = |name, fail| -> Box<dyn berth_allocrunner::alloc_hooks::AllocHook> {
        Box::new(RecordingHook {
            name,
            fail,
            log: log.clone(),
        })
    };
    let hooks = vec![hook("one", false), hook("two", true), hook("three", false)];
    let runner = berth_allocrunner::AllocRunner::with_hooks(
        h.config.clone(),
        alloc(JobType::Batch, vec![sh_task("web", "true")]),
        hooks,
    );
    runner.run();
    wait_done(&runner, DONE_WITHIN).await;
    assert_eq!(
        *log.lock().unwrap(),
        vec!["prerun one", "prerun two", "postrun two", "postrun one"]
    );
    let last = h.updater.last().unwrap();
    assert_eq!(last.status, AllocClientStatus::Failed);
    assert_eq!(last.description, "prerun hook \"two\" failed: boom");
    let web = &last.tasks["web"];
    assert!(web.failed);
    assert_eq!(
        web.events
            .iter()
            .map(|e| e.event_type.as_str())
            .collect::<Vec<_>>(),
        vec!["Received", "Setup Failure"]
    );
}
