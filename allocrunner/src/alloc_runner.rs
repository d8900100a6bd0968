//! The alloc runner: the handle the agent drives one alloc with. Its
//! lifecycle, from prerun hooks through its task runners to postrun hooks,
//! is in [`lifecycle`].

use berth_sync::MutexExt;
use berth_sync::{Shutdown, ShutdownSender};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use berth_structs::{AllocClientStatus, Allocation, TaskEvent, TaskState, TaskStateKind};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn, Instrument};

use crate::alloc_dir::AllocDir;
use crate::alloc_hooks::{self, AllocHook, AllocHookContext};
use crate::config::AllocRunnerConfig;
use crate::driver::TaskHandleRecord;
use crate::error::AllocRunnerError;
use crate::state::{AllocState, Persist, RestoredAlloc};
use crate::task_ops::{TaskOp, TaskOpError};

mod lifecycle;

use lifecycle::lifecycle;

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
    /// The latest version of the alloc; its subscribers (the lifecycle's
    /// hooks) hear of every change.
    alloc: watch::Sender<Arc<Allocation>>,
    state: Arc<AllocState>,
    /// True once the alloc must stop.
    stop: ShutdownSender,
    /// True once postrun is done (or the alloc was destroyed unrun).
    done: watch::Sender<bool>,
    started: AtomicBool,
    /// True while the store holds exactly the alloc this runner has: a
    /// restored runner's alloc is the store's own record, which `run`
    /// need not write (and sync) again. Cleared by any change.
    in_store: AtomicBool,
    /// The alloc hook chain; the lifecycle has it while it runs, and
    /// gives it back for the destroy.
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
        *runner.inner.restored.locked() = Some(handles);
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
                alloc: watch::channel(Arc::new(alloc)).0,
                config,
                state,
                stop: Shutdown::channel().0,
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

    /// The latest usage sample of each running task its driver measures
    /// (`exec`), taken every [`AllocRunnerConfig::stats_interval`].
    pub fn task_samples(&self) -> BTreeMap<String, berth_structs::TaskUsage> {
        self.inner.state.samples()
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
        // Servers that send full sets send every alloc of the node on
        // every change to any of them: an unchanged one costs nothing, not
        // a write. Nor does the servers' copy after this node's own report
        // of the alloc (its status, task states, volume stats): it is
        // kept, not written; a restarted agent is sent it again.
        let mut reported_only = false;
        let changed = self.inner.alloc.send_if_modified(|current| {
            if **current == alloc {
                return false;
            }
            reported_only = current.same_but_node_reports(&alloc);
            *current = Arc::new(alloc);
            true
        });
        if !changed {
            if stop {
                self.stop();
            }
            return;
        }
        self.inner.in_store.store(false, Ordering::SeqCst);
        if self.inner.started.load(Ordering::SeqCst) && !reported_only {
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
        self.inner.stop.shutdown();
    }

    /// Waits until the lifecycle has finished (postrun done). Returns at
    /// once for an alloc destroyed without ever running.
    pub async fn wait(&self) {
        let mut done = self.inner.done.subscribe();
        let _ = done.wait_for(|d| *d).await;
    }

    /// Stops the alloc if it runs, waits for postrun, then removes the
    /// alloc dir (after unmounting whatever is still mounted in it) and
    /// runs the hooks' `destroy` (the CSI hook unmounts the volumes still
    /// recorded for the alloc) before its persisted records go.
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
        self.destroy_hooks().await?;
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
        if status.is_terminal() || self.inner.stop.is_shutdown() {
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
                .locked()
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
}

impl AllocRunner {
    /// Runs each hook's `destroy` in order; the first error ends it.
    async fn destroy_hooks(&self) -> Result<(), AllocRunnerError> {
        let mut hooks = self.inner.take_hooks();
        let ctx = self.inner.hook_context(self.inner.alloc(), false);
        let mut destroyed = Ok(());
        for hook in hooks.iter_mut() {
            destroyed = hook.destroy(&ctx).await;
            if destroyed.is_err() {
                break;
            }
        }
        self.inner.put_back_hooks(hooks);
        destroyed
    }
}

impl Inner {
    fn alloc(&self) -> Arc<Allocation> {
        self.alloc.borrow().clone()
    }

    /// What the alloc hooks see of `alloc`.
    fn hook_context(&self, alloc: Arc<Allocation>, restoring: bool) -> AllocHookContext {
        AllocHookContext::new(self.config.clone(), alloc, self.stop.subscribe(), restoring)
            .with_state(self.state.clone())
    }

    /// The hook chain, while the lifecycle or the destroy has it.
    fn take_hooks(&self) -> Vec<Box<dyn AllocHook>> {
        self.hooks.locked().take().unwrap_or_default()
    }

    fn put_back_hooks(&self, hooks: Vec<Box<dyn AllocHook>>) {
        *self.hooks.locked() = Some(hooks);
    }

    fn persist_alloc(&self, persist: Persist) {
        if let Err(e) = self.config.store.put_alloc_with(&self.alloc(), persist) {
            warn!(alloc_id = %self.alloc_id, error = %e, "persisting the alloc failed; a restarted agent will not find it");
        }
    }
}
