//! One alloc's lifecycle, step by step: the prerun hooks, then its tasks
//! (or, for an alloc that will not run, what is left of tasks an earlier
//! agent ran), then the postrun hooks and the alloc's final status.

use berth_sync::MutexExt;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use berth_structs::{AllocClientStatus, Allocation, TaskEvent, TaskGroup, TaskStateKind};
use tokio::sync::{mpsc, watch};
use tokio::task::{Id, JoinError, JoinSet};
use tracing::{error, info, warn, Instrument};

use super::{not_started_event, Inner};
use crate::alloc_dir::AllocDir;
use crate::alloc_hooks::csi::node_plugins;
use crate::alloc_hooks::{AllocHook, AllocHookContext};
use crate::driver::TaskHandleRecord;
use crate::error::HookError;
use crate::state::AllocState;
use crate::task_hooks::VolumeMountsHook;
use crate::task_runner::TaskRunner;

type Hooks = Vec<Box<dyn AllocHook>>;

/// How far the prerun hooks got.
struct Prerun {
    /// How many hooks' prerun was started.
    ran: usize,
    /// Why a prerun hook failed; the tasks then fail with it.
    failure: Option<String>,
    /// A prerun hook gave up because the alloc was stopped, or a stop came
    /// before the next hook.
    stopped: bool,
    /// A restored alloc that runs a CSI node plugin is stopped through its
    /// task runners even when the stop came first: the plugin is
    /// reattached (supervised, restarted if it dies) and its kill waits,
    /// as for a running alloc, for the volumes other allocs still have
    /// mounted.
    stop_through_tasks: bool,
}

impl Prerun {
    /// Whether a stop asked for now keeps the tasks from running.
    fn stop_now(&self, ctx: &AllocHookContext) -> bool {
        ctx.stop.is_shutdown() && !self.stop_through_tasks
    }
}

pub(super) async fn lifecycle(inner: Arc<Inner>) {
    let restored = inner.restored.locked().take();
    let Some((alloc, group)) = begin(&inner, restored.is_some()) else {
        inner.done.send_replace(true);
        return;
    };
    let ctx = inner.hook_context(alloc, restored.is_some());
    let mut hooks = inner.take_hooks();
    let stop_through_tasks = restored.is_some() && !node_plugins(&group).is_empty();
    let prerun = run_preruns(&mut hooks, &ctx, stop_through_tasks).await;
    settle_tasks(&inner, &group, &ctx, &mut hooks, restored, &prerun).await;
    // A restored alloc's hooks all ran their prerun before the restart, so
    // all of them undo, even those this run stopped short of.
    let undo = if ctx.restoring {
        hooks.len()
    } else {
        prerun.ran
    };
    let postrun_errors = run_postruns(&mut hooks[..undo], &ctx).await;
    finish(&inner.state, prerun.failure.as_deref(), &postrun_errors);
    inner.put_back_hooks(hooks);
    inner.done.send_replace(true);
}

/// Reports the alloc as its lifecycle starts. `None` when there is nothing
/// to run: a restored alloc that had finished, or one whose group is not in
/// its job (it fails).
fn begin(inner: &Inner, restoring: bool) -> Option<(Arc<Allocation>, TaskGroup)> {
    let state = &inner.state;
    if restoring && state.client_status().is_terminal() {
        // Postrun ran before the restart.
        info!("restored alloc had finished; nothing to run");
        state.report();
        return None;
    }
    if restoring {
        info!("restoring alloc");
    }
    state.report();
    let alloc = inner.alloc();
    let Some(group) = alloc.group().cloned() else {
        let msg = format!(
            "group {:?} is not in job {:?}",
            alloc.task_group, alloc.job_id
        );
        error!(error = %msg, "cannot run alloc");
        state.set_terminal(AllocClientStatus::Failed, msg);
        return None;
    };
    Some((alloc, group))
}

/// Runs the prerun hooks in order until one fails or the alloc is stopped.
async fn run_preruns(
    hooks: &mut Hooks,
    ctx: &AllocHookContext,
    stop_through_tasks: bool,
) -> Prerun {
    let mut prerun = Prerun {
        ran: 0,
        failure: None,
        stopped: false,
        stop_through_tasks,
    };
    for hook in hooks.iter_mut() {
        if prerun.stop_now(ctx) {
            prerun.stopped = true;
            break;
        }
        prerun.ran += 1;
        let span = tracing::info_span!("prerun", hook = hook.name());
        match hook.prerun(ctx).instrument(span).await {
            Ok(()) => {}
            Err(HookError::Stopped) => {
                prerun.stopped = true;
                break;
            }
            Err(e) => {
                let msg = format!("prerun hook {:?} failed: {e}", hook.name());
                error!(hook = hook.name(), error = %e, "prerun hook failed");
                prerun.failure = Some(msg);
                break;
            }
        }
    }
    prerun
}

/// Runs the tasks once every prerun hook succeeded; otherwise stops what
/// an earlier agent left running of them and records why they did not run.
async fn settle_tasks(
    inner: &Arc<Inner>,
    group: &TaskGroup,
    ctx: &AllocHookContext,
    hooks: &mut Hooks,
    restored: Option<BTreeMap<String, TaskHandleRecord>>,
    prerun: &Prerun,
) {
    let state = &inner.state;
    let mut killed_leftovers = BTreeSet::new();
    if prerun.failure.is_some() || prerun.stopped || prerun.stop_now(ctx) {
        // Tasks left running by the previous agent must not outlive an
        // alloc that will not run: those of a restored alloc, and those a
        // fresh runner finds through their executors' records (the agent
        // lost the alloc's own records).
        let none = BTreeMap::new();
        killed_leftovers =
            stop_leftover_tasks(inner, group, restored.as_ref().unwrap_or(&none)).await;
    }
    if let Some(msg) = &prerun.failure {
        for task in &group.tasks {
            state.task_dead(
                &task.name,
                true,
                Some(TaskEvent::new("Setup Failure", msg.clone())),
            );
        }
    } else if prerun.stopped || prerun.stop_now(ctx) {
        let task_states = state.task_states();
        for task in &group.tasks {
            // A restored task that ran before the restart was killed above;
            // any other never ran.
            let ran = killed_leftovers.contains(&task.name)
                || task_states
                    .get(&task.name)
                    .is_some_and(|s| s.started_at_ms.is_some());
            let event = if ran {
                TaskEvent::new("Killed", "The alloc was stopped")
            } else {
                not_started_event()
            };
            state.task_dead(&task.name, false, Some(event));
        }
    } else {
        run_tasks(inner, group, ctx, hooks, restored).await;
    }
}

/// Runs the postrun hooks given, in reverse; what failed, as messages.
async fn run_postruns(hooks: &mut [Box<dyn AllocHook>], ctx: &AllocHookContext) -> Vec<String> {
    let mut postrun_errors = Vec::new();
    for hook in hooks.iter_mut().rev() {
        let span = tracing::info_span!("postrun", hook = hook.name());
        if let Err(e) = hook.postrun(ctx).instrument(span).await {
            error!(hook = hook.name(), error = %e, "postrun hook failed");
            postrun_errors.push(format!("postrun hook {:?} failed: {e}", hook.name()));
        }
    }
    postrun_errors
}

/// Records the alloc's final status: failed with the prerun failure or its
/// failed tasks, else complete; postrun failures are added to it.
fn finish(state: &AllocState, prerun_failure: Option<&str>, postrun_errors: &[String]) {
    let failed_tasks: Vec<String> = state
        .task_states()
        .into_iter()
        .filter(|(_, s)| s.failed)
        .map(|(t, _)| t)
        .collect();
    let (status, mut description) = match (prerun_failure, failed_tasks.is_empty()) {
        (Some(msg), _) => (AllocClientStatus::Failed, msg.to_string()),
        (None, false) => (
            AllocClientStatus::Failed,
            format!("Failed tasks: {}", failed_tasks.join(", ")),
        ),
        (None, true) => (
            AllocClientStatus::Complete,
            "All tasks have completed".into(),
        ),
    };
    for e in postrun_errors {
        description.push_str("; ");
        description.push_str(e);
    }
    info!(status = status.as_str(), description = %description, "alloc finished");
    state.set_terminal(status, description);
}

/// The task's latest run: the executor's own record whenever there is one
/// (its dir is cleared before each start, so it is always the latest run,
/// whatever the wall clock said), else the persisted handle. The agent may
/// have died after the executor started a task and before the handle was
/// persisted.
fn last_run(
    persisted: Option<TaskHandleRecord>,
    driver: &str,
    executor_dir: &std::path::Path,
) -> Option<TaskHandleRecord> {
    TaskHandleRecord::from_executor_dir(driver, executor_dir).or(persisted)
}

/// Stops the tasks of an alloc that will not run that an earlier agent
/// left running, and unbinds the volumes bound into their task dirs.
/// Returns the tasks it stopped.
async fn stop_leftover_tasks(
    inner: &Inner,
    group: &TaskGroup,
    handles: &BTreeMap<String, TaskHandleRecord>,
) -> BTreeSet<String> {
    let alloc_dir = AllocDir::new(&inner.config.alloc_root, &inner.alloc_id);
    if handles.is_empty() && !alloc_dir.path().exists() {
        // Never set up on this node: nothing can be left of it.
        return BTreeSet::new();
    }
    let stopped = kill_leftover_tasks(inner, group, handles, &alloc_dir).await;
    unbind_leftover_volumes(group, &alloc_dir);
    stopped
}

/// Kills each task whose last run still runs; returns those it killed.
async fn kill_leftover_tasks(
    inner: &Inner,
    group: &TaskGroup,
    handles: &BTreeMap<String, TaskHandleRecord>,
    alloc_dir: &AllocDir,
) -> BTreeSet<String> {
    let mut stopped = BTreeSet::new();
    for task in &group.tasks {
        let Some(record) = last_run(
            handles.get(&task.name).cloned(),
            &task.driver,
            &alloc_dir.executor_dir(&task.name),
        ) else {
            continue;
        };
        let Some(driver) = inner.config.drivers.get(&record.driver) else {
            warn!(task = %task.name, driver = %record.driver, "cannot stop a restored task: its driver is not available");
            continue;
        };
        match driver.reattach(&record).await {
            Ok(handle) if handle.try_exit().is_none() => {
                info!(task = %task.name, pid = handle.pid(), "stopping a restored task of an alloc that will not run");
                let kill_timeout = task
                    .kill_timeout
                    .unwrap_or(inner.config.default_kill_timeout);
                handle.stop(kill_timeout).await;
                stopped.insert(task.name.clone());
            }
            Ok(_) => {}
            Err(e) => warn!(task = %task.name, error = %e, "cannot stop a restored task"),
        }
    }
    stopped
}

/// The task runners will not run, so their volume-mounts hooks will not
/// unbind what the previous agent bound: it is done here, before postrun
/// unmounts the volumes and releases their claims.
fn unbind_leftover_volumes(group: &TaskGroup, alloc_dir: &AllocDir) {
    for task in &group.tasks {
        let task_dir = alloc_dir.task_dir(&task.name);
        let mut binds = VolumeMountsHook::default();
        let unbound = binds
            .adopt_existing(&task_dir.dir, &task.volume_mounts)
            .and_then(|()| binds.unmount_all());
        if let Err(e) = unbound {
            warn!(task = %task.name, error = %e, "cannot unbind a restored task's volumes");
        }
    }
}

/// The running task runners, and each one's task by its join ID.
struct TaskRunners {
    set: JoinSet<bool>,
    names: HashMap<Id, String>,
}

/// Runs every task of the group at once until all are done. A task that
/// fails for good kills its siblings; a stop kills them all, once the
/// hooks' `pre_kill` is done. Newer versions of the alloc reach the hooks'
/// `update` meanwhile.
async fn run_tasks(
    inner: &Arc<Inner>,
    group: &TaskGroup,
    ctx: &AllocHookContext,
    hooks: &mut Hooks,
    restored: Option<BTreeMap<String, TaskHandleRecord>>,
) {
    let (kill_tx, kill_rx) = watch::channel::<Option<String>>(None);
    let mut runners = spawn_task_runners(inner, group, ctx, restored, &kill_rx);
    let mut stop = inner.stop.subscribe();
    let mut updates = inner.alloc.subscribe();
    loop {
        let killing = kill_tx.borrow().is_some();
        tokio::select! {
            joined = runners.set.join_next_with_id() => match joined {
                None => break,
                Some(joined) => runner_ended(inner, &runners.names, &kill_tx, joined, killing),
            },
            () = stop.wait(), if !killing => {
                if pre_kill_then_kill(inner, hooks, ctx, &mut runners, &kill_tx).await {
                    break;
                }
            }
            Ok(()) = updates.changed() => {
                let alloc = updates.borrow_and_update().clone();
                for hook in hooks.iter_mut() {
                    hook.update(ctx, &alloc).await;
                }
            }
        }
    }
}

/// Starts a task runner for each task of the group that is not done (a
/// restored task reattaches to its last run).
fn spawn_task_runners(
    inner: &Arc<Inner>,
    group: &TaskGroup,
    ctx: &AllocHookContext,
    restored: Option<BTreeMap<String, TaskHandleRecord>>,
    kill: &watch::Receiver<Option<String>>,
) -> TaskRunners {
    let alloc = &ctx.alloc;
    let mounts = Arc::new(ctx.mounts.locked().clone());
    let mut runners = TaskRunners {
        set: JoinSet::new(),
        names: HashMap::new(),
    };
    let task_states = inner.state.task_states();
    for task in &group.tasks {
        let mut reattach = None;
        if let Some(handles) = &restored {
            let dead = task_states
                .get(&task.name)
                .is_some_and(|s| s.state == TaskStateKind::Dead);
            if dead {
                info!(task = %task.name, "restored task was done; not running it");
                continue;
            }
            reattach = last_run(
                handles.get(&task.name).cloned(),
                &task.driver,
                &ctx.alloc_dir.executor_dir(&task.name),
            );
        }
        let (ops_tx, ops) = mpsc::unbounded_channel();
        inner.task_ops.locked().insert(task.name.clone(), ops_tx);
        let runner = TaskRunner {
            ops,
            reattach,
            config: inner.config.clone(),
            alloc: alloc.clone(),
            task: task.clone(),
            alloc_dir: ctx.alloc_dir.clone(),
            state: inner.state.clone(),
            mounts: mounts.clone(),
            kill: kill.clone(),
        };
        let span = tracing::info_span!("task", alloc_id = %alloc.id, task = %task.name);
        let handle = runners.set.spawn(runner.run().instrument(span));
        runners.names.insert(handle.id(), task.name.clone());
    }
    runners
}

/// A task runner ended: one whose task failed for good (or that panicked)
/// kills its siblings, unless they are being killed already.
fn runner_ended(
    inner: &Inner,
    names: &HashMap<Id, String>,
    kill_tx: &watch::Sender<Option<String>>,
    joined: Result<(Id, bool), JoinError>,
    killing: bool,
) {
    match joined {
        Ok((id, failed)) => {
            if failed && !killing {
                let name = names.get(&id).cloned().unwrap_or_default();
                kill_tx.send_replace(Some(format!("Sibling task {name} failed")));
            }
        }
        Err(e) => {
            let name = names.get(&e.id()).cloned().unwrap_or_default();
            error!(task = %name, error = %e, "task runner panicked");
            inner.state.task_dead(
                &name,
                true,
                Some(TaskEvent::new(
                    "Driver Failure",
                    format!("task runner crashed: {e}"),
                )),
            );
            if !killing {
                kill_tx.send_replace(Some(format!("Sibling task {name} failed")));
            }
        }
    }
}

/// The alloc is stopping: runs the hooks' `pre_kill` (in prerun order)
/// while the task runners go on, then asks them to kill their tasks. A
/// task that fails for good meanwhile kills its siblings at once instead.
/// True once every task runner has ended.
async fn pre_kill_then_kill(
    inner: &Inner,
    hooks: &mut Hooks,
    ctx: &AllocHookContext,
    runners: &mut TaskRunners,
    kill_tx: &watch::Sender<Option<String>>,
) -> bool {
    let pre_kill = async {
        for hook in hooks.iter_mut() {
            hook.pre_kill(ctx).await;
        }
    };
    tokio::pin!(pre_kill);
    loop {
        tokio::select! {
            () = &mut pre_kill => {
                kill_tx.send_replace(Some("The alloc is being stopped".into()));
                return false;
            }
            joined = runners.set.join_next_with_id() => match joined {
                None => return true,
                Some(joined) => {
                    let killing = kill_tx.borrow().is_some();
                    runner_ended(inner, &runners.names, kill_tx, joined, killing);
                    if kill_tx.borrow().is_some() {
                        return false;
                    }
                }
            },
        }
    }
}
