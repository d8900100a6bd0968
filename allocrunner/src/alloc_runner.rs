//! The alloc runner: one alloc's lifecycle from prerun hooks through its
//! task runners to postrun hooks, and the handle the agent drives it with.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use berth_csimanager::UnmountRequest;
use berth_structs::{
    AllocClientStatus, Allocation, CsiPluginType, TaskEvent, TaskGroup, TaskState, TaskStateKind,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::{error, info, warn, Instrument};

use crate::alloc_dir::AllocDir;
use crate::alloc_hooks::{self, AllocHook, AllocHookContext};
use crate::config::AllocRunnerConfig;
use crate::driver::TaskHandleRecord;
use crate::error::{AllocRunnerError, HookError};
use crate::state::{AllocState, Persist, RestoredAlloc};
use crate::task_hooks::VolumeMountsHook;
use crate::task_ops::{TaskOp, TaskOpError};
use crate::task_runner::TaskRunner;

/// The task event of a task that never started because its alloc was
/// stopped (or destroyed) first.
pub const EVENT_NOT_STARTED: &str = "Not Started";
const NOT_STARTED_MESSAGE: &str = "the alloc was stopped before it started";

pub(crate) fn not_started_event() -> TaskEvent {
    TaskEvent::new(EVENT_NOT_STARTED, NOT_STARTED_MESSAGE)
}

/// The task event of a CSI node plugin task whose alloc is stopping while
/// volumes of the plugin are still mounted on the node: the task is killed
/// only once they are unmounted.
pub const EVENT_WAITING_FOR_VOLUMES: &str = "Waiting for volumes";

/// Runs one alloc. Cheap to clone; clones drive the same alloc.
#[derive(Clone)]
pub struct AllocRunner {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<AllocRunnerConfig>,
    alloc_id: String,
    alloc: Mutex<Arc<Allocation>>,
    state: Arc<AllocState>,
    /// True once the alloc must stop.
    stop: watch::Sender<bool>,
    /// True once postrun is done (or the alloc was destroyed unrun).
    done: watch::Sender<bool>,
    started: AtomicBool,
    /// True while the store holds exactly the alloc this runner has: a
    /// restored runner's alloc is the store's own record, which `run`
    /// need not write (and sync) again. Cleared by any change.
    in_store: AtomicBool,
    /// The prerun/postrun chain; taken when the lifecycle starts.
    hooks: Mutex<Option<Vec<Box<dyn AllocHook>>>>,
    /// Set when the runner was restored after an agent restart: the last
    /// handle of each task, to reattach to. Taken when the lifecycle starts.
    restored: Mutex<Option<BTreeMap<String, TaskHandleRecord>>>,
    /// Where an operator's restarts and signals reach each task runner;
    /// a task whose runner has ended no longer takes them.
    task_ops: Mutex<HashMap<String, mpsc::UnboundedSender<TaskOp>>>,
}

impl AllocRunner {
    /// A runner with the standard hook chain (alloc dir, then CSI).
    pub fn new(config: Arc<AllocRunnerConfig>, alloc: Allocation) -> AllocRunner {
        Self::with_hooks(config, alloc, alloc_hooks::default_hooks())
    }

    /// A runner with its own alloc hook chain, in prerun order.
    pub fn with_hooks(
        config: Arc<AllocRunnerConfig>,
        alloc: Allocation,
        hooks: Vec<Box<dyn AllocHook>>,
    ) -> AllocRunner {
        Self::build(config, alloc, hooks, None)
    }

    /// A runner for an alloc this node ran before the agent restarted, as
    /// the store had it. When run, its prerun hooks run again in restore
    /// mode (the alloc dir is kept, the volumes are claimed and mounted
    /// again, which keeps what is still there), tasks whose executor still
    /// runs are reattached instead of started, tasks that exited meanwhile
    /// get their recorded exit and follow the restart policy, tasks that
    /// were done stay done, and an alloc that had finished stays finished.
    pub fn restore(config: Arc<AllocRunnerConfig>, restored: RestoredAlloc) -> AllocRunner {
        let RestoredAlloc {
            alloc,
            state,
            handles,
        } = restored;
        let runner = Self::build(config, alloc, alloc_hooks::default_hooks(), state);
        runner.inner.in_store.store(true, Ordering::SeqCst);
        *runner
            .inner
            .restored
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(handles);
        runner
    }

    fn build(
        config: Arc<AllocRunnerConfig>,
        alloc: Allocation,
        hooks: Vec<Box<dyn AllocHook>>,
        restored: Option<crate::state::PersistedAllocState>,
    ) -> AllocRunner {
        let tasks: Vec<String> = alloc
            .group()
            .map(|g| g.tasks.iter().map(|t| t.name.clone()).collect())
            .unwrap_or_default();
        let state = Arc::new(AllocState::new(
            &alloc.id,
            tasks.iter().map(String::as_str),
            config.updater.clone(),
            config.store.clone(),
            restored,
        ));
        AllocRunner {
            inner: Arc::new(Inner {
                alloc_id: alloc.id.clone(),
                alloc: Mutex::new(Arc::new(alloc)),
                config,
                state,
                stop: watch::channel(false).0,
                done: watch::channel(false).0,
                started: AtomicBool::new(false),
                in_store: AtomicBool::new(false),
                hooks: Mutex::new(Some(hooks)),
                restored: Mutex::new(None),
                task_ops: Mutex::default(),
            }),
        }
    }

    pub fn alloc_id(&self) -> &str {
        &self.inner.alloc_id
    }

    /// The latest version of the alloc given to the runner.
    pub fn alloc(&self) -> Arc<Allocation> {
        self.inner.alloc()
    }

    pub fn client_status(&self) -> AllocClientStatus {
        self.inner.state.client_status()
    }

    pub fn task_states(&self) -> BTreeMap<String, TaskState> {
        self.inner.state.task_states()
    }

    /// Whether `task` is pending, running or dead; `None` for a task the
    /// alloc has no state of. Cheap: for a caller that polls.
    pub fn task_state_kind(&self, task: &str) -> Option<TaskStateKind> {
        self.inner.state.task_state_kind(task)
    }

    pub fn alloc_dir(&self) -> AllocDir {
        AllocDir::new(&self.inner.config.alloc_root, &self.inner.alloc_id)
    }

    /// When the alloc became terminal on this node (unix ms), once it has.
    pub fn terminal_at_ms(&self) -> Option<i64> {
        self.inner.state.terminal_at_ms()
    }

    /// Whether the lifecycle has finished: postrun is done.
    pub fn is_done(&self) -> bool {
        *self.inner.done.borrow()
    }

    /// Why the alloc may not be garbage collected yet, or `None` once it
    /// may: it must be terminal with its postrun done, and no CSI volume
    /// may still be mounted for it (a postrun that failed to unmount).
    pub fn gc_blocker(&self) -> Option<String> {
        if !self.is_done() || !self.client_status().is_terminal() {
            return Some("the alloc has not finished (postrun pending)".into());
        }
        let alloc_id = &self.inner.alloc_id;
        self.inner
            .config
            .csi
            .volume_stubs_of(alloc_id)
            .first()
            .map(|s| format!("volume {:?} is still mounted for the alloc", s.volume_id))
    }

    /// Starts the lifecycle on the tokio runtime. Later calls do nothing.
    pub fn run(&self) {
        if self.inner.started.swap(true, Ordering::SeqCst) {
            return;
        }
        // A restored alloc is already in the store as it is: restoring
        // many allocs does not wait on a sync for each.
        if !self.inner.in_store.load(Ordering::SeqCst) {
            self.inner.persist_alloc(Persist::Synced);
        }
        if self.inner.alloc().server_terminal() {
            self.stop();
        }
        let inner = self.inner.clone();
        let span = tracing::info_span!("alloc", alloc_id = %inner.alloc_id);
        tokio::spawn(lifecycle(inner).instrument(span));
    }

    /// A newer version of the alloc from the servers; one they want
    /// stopped stops it.
    pub fn update(&self, alloc: Allocation) {
        if alloc.id != self.inner.alloc_id {
            warn!(alloc_id = %self.inner.alloc_id, other = %alloc.id, "ignoring an update for another alloc");
            return;
        }
        let stop = alloc.server_terminal();
        {
            let mut current = self.inner.alloc.lock().unwrap_or_else(|e| e.into_inner());
            // The servers send every alloc of the node on every change to
            // any of them: an unchanged one costs nothing, not a write.
            if **current == alloc {
                drop(current);
                if stop {
                    self.stop();
                }
                return;
            }
            *current = Arc::new(alloc);
        }
        self.inner.in_store.store(false, Ordering::SeqCst);
        if self.inner.started.load(Ordering::SeqCst) {
            // A stop is synced: a restarted agent must not run the alloc
            // again. Any other change the servers send again after a
            // restart; it rides on the next synced write.
            self.inner.persist_alloc(if stop {
                Persist::Synced
            } else {
                Persist::Unsynced
            });
        }
        if stop {
            info!(alloc_id = %self.inner.alloc_id, "the servers want the alloc stopped");
            self.stop();
        }
    }

    /// Kills the tasks (SIGTERM, SIGKILL after the kill timeout) and runs
    /// postrun. Returns at once; [`Self::wait`] for it to finish. The tasks
    /// of an alloc that runs a CSI node plugin are killed only once no
    /// other alloc on this node has a volume of the plugin mounted (or
    /// another healthy instance of the plugin serves them).
    pub fn stop(&self) {
        self.inner.stop.send_replace(true);
    }

    /// Waits until the lifecycle has finished (postrun done). Returns at
    /// once for an alloc destroyed without ever running.
    pub async fn wait(&self) {
        let mut done = self.inner.done.subscribe();
        let _ = done.wait_for(|d| *d).await;
    }

    /// Stops the alloc if it runs, waits for postrun, then removes the
    /// alloc dir (after unmounting whatever is still mounted in it).
    pub async fn destroy(&self) -> Result<(), AllocRunnerError> {
        self.stop();
        if self.inner.started.swap(true, Ordering::SeqCst) {
            self.wait().await;
        } else {
            let state = &self.inner.state;
            for task in state.task_states().keys() {
                state.task_dead(task, false, Some(not_started_event()));
            }
            state.set_terminal(
                AllocClientStatus::Complete,
                "Destroyed before it ran".into(),
            );
            self.inner.done.send_replace(true);
        }
        // Removing an alloc dir (logs, data) is disk work of any size: off
        // the async threads.
        let dir = self.alloc_dir();
        let path = dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || dir.destroy())
            .await
            .map_err(|e| AllocRunnerError::Io {
                what: "removing alloc dir",
                path,
                error: std::io::Error::other(e.to_string()),
            })??;
        // The records are what a restarted agent would clean a mount up
        // from: they go only once no CSI mount of the alloc remains.
        self.unmount_leftover_volumes().await?;
        if let Err(e) = self.inner.config.store.delete_alloc(&self.inner.alloc_id) {
            warn!(alloc_id = %self.inner.alloc_id, error = %e, "deleting the alloc's persisted state failed");
        }
        Ok(())
    }
}

impl AllocRunner {
    /// Restarts `task` (or every running task) in place, as an operator
    /// asked: each is killed as for a stop and started again at once, with
    /// a `Restart Signaled` event. The restart policy does not count it and
    /// the alloc stays where it is. Returns the tasks restarted.
    pub async fn restart_tasks(&self, task: Option<&str>) -> Result<Vec<String>, TaskOpError> {
        self.task_op(task, |reply| TaskOp::Restart { reply }).await
    }

    /// Sends `signal` to `task` (or every running task), with a
    /// `Signaling` event. Returns the tasks signaled.
    pub async fn signal_tasks(
        &self,
        task: Option<&str>,
        signal: nix::sys::signal::Signal,
    ) -> Result<Vec<String>, TaskOpError> {
        self.task_op(task, |reply| TaskOp::Signal { signal, reply })
            .await
    }

    /// Hands the op made by `make` to each task it is for and waits for
    /// their answers. A terminal alloc, an unknown task or one that does
    /// not run is refused before anything is done.
    async fn task_op(
        &self,
        task: Option<&str>,
        make: impl Fn(oneshot::Sender<Result<(), TaskOpError>>) -> TaskOp,
    ) -> Result<Vec<String>, TaskOpError> {
        let status = self.client_status();
        if status.is_terminal() || *self.inner.stop.borrow() {
            let what = if status.is_terminal() {
                status.as_str().to_string()
            } else {
                "stopping".to_string()
            };
            return Err(TaskOpError::AllocTerminal(what));
        }
        let states = self.task_states();
        let targets: Vec<String> = match task {
            Some(t) => {
                let Some(s) = states.get(t) else {
                    return Err(TaskOpError::UnknownTask {
                        task: t.to_string(),
                        tasks: states.keys().cloned().collect(),
                    });
                };
                if s.state != TaskStateKind::Running {
                    return Err(TaskOpError::NotRunning {
                        task: t.to_string(),
                        state: crate::task_ops::state_name(s.state).to_string(),
                    });
                }
                vec![t.to_string()]
            }
            None => {
                let running: Vec<String> = states
                    .iter()
                    .filter(|(_, s)| s.state == TaskStateKind::Running)
                    .map(|(t, _)| t.clone())
                    .collect();
                if running.is_empty() {
                    return Err(TaskOpError::NothingRunning);
                }
                running
            }
        };
        let mut waiting = Vec::new();
        for t in &targets {
            let (reply, answer) = oneshot::channel();
            let sent = self
                .inner
                .task_ops
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(t)
                .is_some_and(|ops| ops.send(make(reply)).is_ok());
            if !sent {
                return Err(TaskOpError::NotRunning {
                    task: t.clone(),
                    state: crate::task_ops::state_name(TaskStateKind::Dead).to_string(),
                });
            }
            waiting.push((t.clone(), answer));
        }
        for (t, answer) in waiting {
            // A runner that ends before it answers drops the request.
            answer.await.unwrap_or_else(|_| {
                Err(TaskOpError::NotRunning {
                    task: t.clone(),
                    state: crate::task_ops::state_name(TaskStateKind::Dead).to_string(),
                })
            })?;
        }
        Ok(targets)
    }

    /// Unmounts (with retries) every CSI volume csimanager still records
    /// as mounted for this alloc; an error when one remains.
    async fn unmount_leftover_volumes(&self) -> Result<(), AllocRunnerError> {
        let alloc_id = &self.inner.alloc_id;
        let csi = self.inner.config.csi.clone();
        let total = self.inner.config.release_retry_timeout;
        for stub in csi.volume_stubs_of(alloc_id) {
            warn!(alloc_id = %alloc_id, volume_id = %stub.volume_id, plugin_id = %stub.plugin_id, "a volume is still mounted for the destroyed alloc; unmounting it");
            let req = UnmountRequest::for_stub(&stub, alloc_id);
            let unmounted = berth_csimanager::retry_notify(
                crate::alloc_hooks::csi::backoff(total),
                || {
                    let csi = csi.clone();
                    let req = req.clone();
                    async move { csi.unmount_volume(req).await }
                },
                |_| true,
                |e, wait: std::time::Duration| {
                    warn!(alloc_id = %alloc_id, volume_id = %stub.volume_id, error = %e, retry_in_ms = wait.as_millis() as u64, "unmount failed; retrying");
                },
            )
            .await;
            if let Err(error) = unmounted {
                error!(alloc_id = %alloc_id, volume_id = %stub.volume_id, plugin_id = %stub.plugin_id, error = %error, "cannot unmount a volume of the destroyed alloc; keeping its records");
                return Err(AllocRunnerError::VolumeStillMounted {
                    volume_id: stub.volume_id,
                    error,
                });
            }
        }
        if let Some(stub) = csi.volume_stubs_of(alloc_id).into_iter().next() {
            return Err(AllocRunnerError::VolumeStillRecorded {
                volume_id: stub.volume_id,
            });
        }
        Ok(())
    }
}

impl Inner {
    fn alloc(&self) -> Arc<Allocation> {
        self.alloc.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn persist_alloc(&self, persist: Persist) {
        if let Err(e) = self.config.store.put_alloc_with(&self.alloc(), persist) {
            warn!(alloc_id = %self.alloc_id, error = %e, "persisting the alloc failed; a restarted agent will not find it");
        }
    }
}

async fn lifecycle(inner: Arc<Inner>) {
    let state = inner.state.clone();
    let restored = inner
        .restored
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if restored.is_some() && state.client_status().is_terminal() {
        // Postrun ran before the restart.
        info!("restored alloc had finished; nothing to run");
        state.report();
        inner.done.send_replace(true);
        return;
    }
    if restored.is_some() {
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
        inner.done.send_replace(true);
        return;
    };
    let ctx = AllocHookContext {
        config: inner.config.clone(),
        alloc: alloc.clone(),
        alloc_dir: AllocDir::new(&inner.config.alloc_root, &alloc.id),
        stop: inner.stop.subscribe(),
        mounts: Mutex::default(),
        restoring: restored.is_some(),
    };

    let mut hooks = inner
        .hooks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or_default();
    // A restored alloc that runs a CSI node plugin is stopped through its
    // task runners even when the stop came first: the plugin is reattached
    // (supervised, restarted if it dies) and its kill waits, as for a
    // running alloc, for the volumes other allocs still have mounted.
    let stop_through_tasks = restored.is_some() && !node_plugins(&group).is_empty();
    let stop_now = |ctx: &AllocHookContext| *ctx.stop.borrow() && !stop_through_tasks;
    let mut ran = 0usize;
    let mut prerun_failure: Option<String> = None;
    let mut stopped = false;
    for hook in hooks.iter_mut() {
        if stop_now(&ctx) {
            stopped = true;
            break;
        }
        ran += 1;
        let span = tracing::info_span!("prerun", hook = hook.name());
        match hook.prerun(&ctx).instrument(span).await {
            Ok(()) => {}
            Err(HookError::Stopped) => {
                stopped = true;
                break;
            }
            Err(e) => {
                let msg = format!("prerun hook {:?} failed: {e}", hook.name());
                error!(hook = hook.name(), error = %e, "prerun hook failed");
                prerun_failure = Some(msg);
                break;
            }
        }
    }

    let mut killed_leftovers = BTreeSet::new();
    if prerun_failure.is_some() || stopped || stop_now(&ctx) {
        // Tasks left running by the previous agent must not outlive an
        // alloc that will not run: those of a restored alloc, and those a
        // fresh runner finds through their executors' records (the agent
        // lost the alloc's own records).
        let none = BTreeMap::new();
        killed_leftovers =
            kill_restored_tasks(&inner, &group, restored.as_ref().unwrap_or(&none)).await;
    }
    if let Some(msg) = &prerun_failure {
        for task in &group.tasks {
            state.task_dead(
                &task.name,
                true,
                Some(TaskEvent::new("Setup Failure", msg.clone())),
            );
        }
    } else if stopped || stop_now(&ctx) {
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
        run_tasks(&inner, &alloc, &group, &ctx, restored).await;
    }

    // A restored alloc's hooks all ran their prerun before the restart, so
    // all of them undo, even those this run stopped short of.
    let undo = if ctx.restoring { hooks.len() } else { ran };
    let mut postrun_errors = Vec::new();
    for hook in hooks[..undo].iter_mut().rev() {
        let span = tracing::info_span!("postrun", hook = hook.name());
        if let Err(e) = hook.postrun(&ctx).instrument(span).await {
            error!(hook = hook.name(), error = %e, "postrun hook failed");
            postrun_errors.push(format!("postrun hook {:?} failed: {e}", hook.name()));
        }
    }

    let failed_tasks: Vec<String> = state
        .task_states()
        .into_iter()
        .filter(|(_, s)| s.failed)
        .map(|(t, _)| t)
        .collect();
    let (status, mut description) = match (&prerun_failure, failed_tasks.is_empty()) {
        (Some(msg), _) => (AllocClientStatus::Failed, msg.clone()),
        (None, false) => (
            AllocClientStatus::Failed,
            format!("Failed tasks: {}", failed_tasks.join(", ")),
        ),
        (None, true) => (
            AllocClientStatus::Complete,
            "All tasks have completed".into(),
        ),
    };
    for e in &postrun_errors {
        description.push_str("; ");
        description.push_str(e);
    }
    info!(status = status.as_str(), description = %description, "alloc finished");
    state.set_terminal(status, description);
    inner.done.send_replace(true);
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

/// Stops the tasks of a restored alloc that were left running, and unbinds
/// the volumes bound into their task dirs. Returns the tasks it stopped.
async fn kill_restored_tasks(
    inner: &Inner,
    group: &TaskGroup,
    handles: &BTreeMap<String, TaskHandleRecord>,
) -> BTreeSet<String> {
    let mut stopped = BTreeSet::new();
    let alloc_dir = AllocDir::new(&inner.config.alloc_root, &inner.alloc_id);
    if handles.is_empty() && !alloc_dir.path().exists() {
        // Never set up on this node: nothing can be left of it.
        return stopped;
    }
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
    // The task runners will not run, so their volume-mounts hooks will not
    // unbind what the previous agent bound: do it here, before postrun
    // unmounts the volumes and releases their claims.
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
    stopped
}

/// Runs every task of the group at once until all are done. A task that
/// fails for good kills its siblings; a stop kills them all.
async fn run_tasks(
    inner: &Arc<Inner>,
    alloc: &Arc<Allocation>,
    group: &TaskGroup,
    ctx: &AllocHookContext,
    restored: Option<BTreeMap<String, TaskHandleRecord>>,
) {
    let mounts = Arc::new(ctx.mounts.lock().unwrap_or_else(|e| e.into_inner()).clone());
    let (kill_tx, kill_rx) = watch::channel::<Option<String>>(None);
    let mut set = JoinSet::new();
    let mut names = HashMap::new();
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
        inner
            .task_ops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(task.name.clone(), ops_tx);
        let runner = TaskRunner {
            ops,
            reattach,
            config: inner.config.clone(),
            alloc: alloc.clone(),
            task: task.clone(),
            alloc_dir: ctx.alloc_dir.clone(),
            state: inner.state.clone(),
            mounts: mounts.clone(),
            kill: kill_rx.clone(),
        };
        let span = tracing::info_span!("task", alloc_id = %alloc.id, task = %task.name);
        let handle = set.spawn(runner.run().instrument(span));
        names.insert(handle.id(), task.name.clone());
    }
    let plugins = node_plugins(group);
    let mut stop = inner.stop.subscribe();
    let stopping = async {
        let _ = stop.wait_for(|s| *s).await;
        wait_for_plugin_volumes(inner, &plugins).await;
    };
    tokio::pin!(stopping);
    loop {
        let killing = kill_tx.borrow().is_some();
        tokio::select! {
            joined = set.join_next_with_id() => match joined {
                None => break,
                Some(Ok((id, failed))) => {
                    if failed && !killing {
                        let name = names.get(&id).cloned().unwrap_or_default();
                        kill_tx.send_replace(Some(format!("Sibling task {name} failed")));
                    }
                }
                Some(Err(e)) => {
                    let name = names.get(&e.id()).cloned().unwrap_or_default();
                    error!(task = %name, error = %e, "task runner panicked");
                    inner.state.task_dead(&name, true, Some(TaskEvent::new("Driver Failure", format!("task runner crashed: {e}"))));
                    if !killing {
                        kill_tx.send_replace(Some(format!("Sibling task {name} failed")));
                    }
                }
            },
            // Completes once; the kill it sends disables it.
            () = &mut stopping, if !killing => {
                kill_tx.send_replace(Some("The alloc is being stopped".into()));
            }
        }
    }
}

/// The CSI node (or monolith) plugins the group's tasks run, as (task,
/// plugin ID): volumes on this node may need them to be unmounted.
fn node_plugins(group: &TaskGroup) -> Vec<(String, String)> {
    group
        .tasks
        .iter()
        .filter_map(|t| {
            let plugin = t.csi_plugin.as_ref()?;
            (plugin.plugin_type != CsiPluginType::Controller)
                .then(|| (t.name.clone(), plugin.id.clone()))
        })
        .collect()
}

/// Before the tasks of a stopping alloc are killed: waits, for each CSI
/// node plugin the alloc runs, until no other alloc on this node has a
/// volume of the plugin mounted (their unpublish and unstage need it),
/// unless another healthy instance of the plugin serves them. No deadline:
/// a mount is never left behind a stopped plugin. The plugin task gets an
/// event, and the log a line, when the wait starts and whenever the number
/// of volumes changes; the tasks keep running (and the alloc its status)
/// meanwhile.
async fn wait_for_plugin_volumes(inner: &Inner, plugins: &[(String, String)]) {
    for (task, plugin_id) in plugins {
        let mut waited = false;
        inner
            .config
            .csi
            .wait_until_plugin_instance_unneeded(plugin_id, &inner.alloc_id, |volumes| {
                waited = true;
                let message = format!(
                    "Waiting for {volumes} volume(s) of plugin {plugin_id:?} to be unmounted before stopping"
                );
                info!(task = %task, plugin_id = %plugin_id, volumes, "waiting for the plugin's volumes to be unmounted before stopping it");
                inner
                    .state
                    .task_event(task, TaskEvent::new(EVENT_WAITING_FOR_VOLUMES, message));
            })
            .await;
        if waited {
            info!(task = %task, plugin_id = %plugin_id, "no volume needs the plugin any more; stopping it");
        }
    }
}
