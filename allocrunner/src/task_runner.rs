//! The task runner: runs one task of an alloc through its hook chain, its
//! driver and its restart policy until it is done for good.
//!
//! Each run of the task is a few steps ([`Running::run_once`]): prestart
//! hooks, start (or reattach), poststart hooks, waiting for the exit (and
//! acting on kills, signals and restarts meanwhile), `exited` hooks, then
//! the restart policy's word. Once the task is done for good its `stop`
//! hooks run and its last state is recorded ([`Running::finish`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_csimanager::MountInfo;
use berth_structs::{Allocation, Task, TaskEvent};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::alloc_dir::AllocDir;
use crate::config::AllocRunnerConfig;
use crate::driver::{Driver, ExitResult, TaskHandle, TaskHandleRecord, TaskSpec};
use crate::env;
use crate::restart::{RestartDecision, RestartTracker};
use crate::state::{AllocState, TaskEvents};
use crate::task_hooks::{self, KillRequest, TaskControl, TaskHook, TaskHookContext};
use crate::task_ops::{
    TaskOp, TaskOpError, EVENT_RESTART_SIGNALED, EVENT_SIGNALING, USER_RESTART_REASON,
};

pub(crate) struct TaskRunner {
    pub config: Arc<AllocRunnerConfig>,
    pub alloc: Arc<Allocation>,
    pub task: Task,
    pub alloc_dir: AllocDir,
    pub state: Arc<AllocState>,
    pub mounts: Arc<BTreeMap<String, MountInfo>>,
    /// Becomes `Some(reason)` when the task must be killed and not
    /// restarted (the alloc stops, or a sibling failed).
    pub kill: watch::Receiver<Option<String>>,
    /// After an agent restart: the handle of the task's last run, to
    /// reattach to instead of starting the task again.
    pub reattach: Option<TaskHandleRecord>,
    /// An operator's restarts and signals, acted on while the task runs.
    pub ops: mpsc::UnboundedReceiver<TaskOp>,
}

/// Why a run of the task ended.
enum Ending {
    Exited,
    Killed,
    Restart,
    /// An operator asked for a restart: not counted by the restart policy.
    UserRestart,
    Failed(String),
}

/// What comes after a run of the task (or an attempt at one).
enum Next {
    /// Run the task again.
    Again,
    /// The task is done for good: whether it failed, and its last event.
    Done(bool, Option<TaskEvent>),
}

/// A task that failed in a way no restart mends.
fn unrecoverable() -> Next {
    Next::Done(true, Some(not_restarting("Error was unrecoverable")))
}

/// Waits until a kill is asked for; never returns if the sender is gone.
async fn killed(kill: &mut watch::Receiver<Option<String>>) -> String {
    let reason = kill
        .wait_for(|r| r.is_some())
        .await
        .map(|r| r.clone().unwrap_or_default());
    match reason {
        Ok(reason) => reason,
        Err(_) => std::future::pending().await,
    }
}

impl TaskRunner {
    /// Runs the task until it is done; returns whether it failed.
    pub(crate) async fn run(self) -> bool {
        let mut running = Running::new(self);
        let (failed, last_event) = loop {
            match running.run_once().await {
                Next::Again => continue,
                Next::Done(failed, last_event) => break (failed, last_event),
            }
        };
        running.finish(failed, last_event).await
    }
}

/// A task runner at work: what stays the same from one run of the task
/// to the next.
struct Running {
    alloc: Arc<Allocation>,
    task: Task,
    alloc_dir: AllocDir,
    state: Arc<AllocState>,
    kill: watch::Receiver<Option<String>>,
    reattach: Option<TaskHandleRecord>,
    ops: mpsc::UnboundedReceiver<TaskOp>,
    name: String,
    events: TaskEvents,
    base_env: BTreeMap<String, String>,
    tracker: RestartTracker,
    kill_timeout: std::time::Duration,
    driver: Option<Arc<dyn Driver>>,
    ctx: TaskHookContext,
    hooks: Vec<Box<dyn TaskHook>>,
    /// How many hooks' `prestart` was started: their `stop` runs.
    prestarted: usize,
    /// Whether this runner started the task (or reattached to it) yet: a
    /// task killed before that never ran. A task to reattach to is
    /// reattached even when the kill came first, so that it is stopped
    /// rather than left running.
    ran: bool,
}

impl Running {
    fn new(runner: TaskRunner) -> Running {
        let TaskRunner {
            config,
            alloc,
            task,
            alloc_dir,
            state,
            mounts,
            kill,
            reattach,
            ops,
        } = runner;
        let name = task.name.clone();
        let events = TaskEvents::new(state.clone(), &name);
        let task_dir = alloc_dir.task_dir(&name);
        let base_env = env::base_env(
            &alloc,
            &task,
            &config.node_id,
            &alloc_dir,
            &task_dir,
            config.extra_path.as_deref(),
        );
        let group = alloc.group().cloned().unwrap_or_default();
        let tracker = RestartTracker::new(group.restart.clone(), alloc.job.job_type);
        let kill_timeout = task.kill_timeout.unwrap_or(config.default_kill_timeout);
        let driver = config.drivers.get(&task.driver).cloned();
        let ctx = TaskHookContext {
            config: config.clone(),
            alloc: alloc.clone(),
            task: task.clone(),
            alloc_dir: alloc_dir.clone(),
            task_dir,
            env: base_env.clone(),
            mounts,
            events: events.clone(),
            restoring: false,
        };
        let hooks = task_hooks::hooks_for(&task);
        Running {
            alloc,
            task,
            alloc_dir,
            state,
            kill,
            reattach,
            ops,
            name,
            events,
            base_env,
            tracker,
            kill_timeout,
            driver,
            ctx,
            hooks,
            prestarted: 0,
            ran: false,
        }
    }

    /// One run of the task, from its prestart hooks to the restart
    /// policy's word on its exit.
    async fn run_once(&mut self) -> Next {
        if self.kill.borrow().is_some() && self.reattach.is_none() {
            return self.not_started();
        }
        self.ctx.env = self.base_env.clone();
        let reattaching = self.reattach.take();
        self.ctx.restoring = reattaching.is_some();
        if !self.ctx.restoring {
            self.events.emit("Task Setup", "Building Task Directory");
        }
        if let Err(next) = self.prestart().await {
            return next;
        }
        if self.kill.borrow().is_some() && reattaching.is_none() {
            return self.not_started();
        }
        let handle = match self.start(reattaching.as_ref()).await {
            Ok(handle) => handle,
            Err(next) => return next,
        };
        let (exit, ending) = self.supervise(&handle).await;
        self.state.note_sample(&self.name, None);
        for hook in self.hooks.iter_mut() {
            hook.exited(&self.ctx).await;
        }
        self.record_exit(&ending, &exit);
        self.after_exit(ending, exit).await
    }

    /// Killed before this run started the task: a task this runner never
    /// ran says so.
    fn not_started(&self) -> Next {
        Next::Done(
            false,
            (!self.ran).then(crate::alloc_runner::not_started_event),
        )
    }

    /// Runs every prestart hook in order; a failure ends the task.
    async fn prestart(&mut self) -> Result<(), Next> {
        for (i, hook) in self.hooks.iter_mut().enumerate() {
            self.prestarted = self.prestarted.max(i + 1);
            if let Err(e) = hook.prestart(&mut self.ctx).await {
                self.events.emit(
                    "Setup Failure",
                    format!("prestart hook {:?} failed: {e}", hook.name()),
                );
                return Err(unrecoverable());
            }
        }
        Ok(())
    }

    /// What the driver starts: the task's command in its environment.
    fn spec(&self) -> TaskSpec {
        let base = if self.task.driver == "exec" {
            // The task sees its dirs from inside its root.
            crate::isolation::env_inside(self.ctx.env.clone())
        } else {
            self.ctx.env.clone()
        };
        let env = env::with_task_env(base, &self.task.env);
        let name = &self.name;
        TaskSpec {
            alloc_id: self.alloc.id.clone(),
            task: name.clone(),
            command: env::interpolate(&self.task.config.command, &env),
            args: self
                .task
                .config
                .args
                .iter()
                .map(|a| env::interpolate(a, &env))
                .collect(),
            task_dir: self.ctx.task_dir.dir.clone(),
            stdout_path: self.alloc_dir.stdout_path(name),
            stderr_path: self.alloc_dir.stderr_path(name),
            logs: crate::logs::LogRotation::from(&self.task.logs),
            executor_dir: self.alloc_dir.executor_dir(name),
            env,
            limits: crate::driver::TaskLimits {
                cpu_mhz: self.task.resources.cpu,
                memory_mb: self.task.resources.memory_mb,
                memory_max_mb: self.task.resources.memory_max_mb,
                pids: self.task.config.pids_limit,
            },
            cgroup_procs: Vec::new(),
            isolation: None,
            user: (!self.task.user.is_empty()).then(|| self.task.user.clone()),
            disconnect: self.disconnect_watch(),
        }
    }

    /// The group's disconnect window, when it sets one and the client
    /// keeps a heartbeat lease.
    fn disconnect_watch(&self) -> Option<crate::lease::DisconnectWatch> {
        let window = self.alloc.group()?.stop_on_client_after()?;
        let lease = self.ctx.config.heartbeat_lease.clone()?;
        Some(crate::lease::DisconnectWatch {
            lease,
            window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
            kill_timeout_ms: u64::try_from(self.kill_timeout.as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// Starts the task, or reattaches to the run in `reattaching`. A task
    /// that cannot be reattached to is never started again here: the
    /// driver may not be able to tell about it and it may still run, and
    /// two copies must not.
    async fn start(
        &mut self,
        reattaching: Option<&TaskHandleRecord>,
    ) -> Result<Arc<dyn TaskHandle>, Next> {
        let Some(driver) = self.driver.clone() else {
            self.events.emit(
                "Driver Failure",
                crate::DriverError::UnknownDriver(self.task.driver.clone()).to_string(),
            );
            return Err(unrecoverable());
        };
        let name = &self.name;
        if let Some(record) = reattaching {
            return match driver.reattach(record).await {
                Ok(h) => {
                    info!(alloc_id = %self.alloc.id, task = %name, pid = h.pid(), running = h.try_exit().is_none(), "reattached to the task");
                    self.state.task_reattached(name);
                    self.ran = true;
                    Ok(h)
                }
                Err(e) => {
                    self.events
                        .emit("Driver Failure", format!("failed to reattach: {e}"));
                    Err(unrecoverable())
                }
            };
        }
        let spec = self.spec();
        if let Some(watch) = spec.disconnect.as_ref().filter(|w| w.closed()) {
            // Its executor would stop it at once: the servers may run its
            // replacement by now.
            return Err(Next::Done(false, Some(disconnected_event(watch))));
        }
        let handle = match driver.start(&spec).await {
            Ok(h) => h,
            Err(e) => {
                self.events
                    .emit("Driver Failure", format!("failed to start task: {e}"));
                return Err(unrecoverable());
            }
        };
        // The handle is synced with the running state, before the task is
        // reported running: a restart from here on finds it.
        self.state.task_started(
            name,
            handle.record().as_ref(),
            TaskEvent::new("Started", "Task started by client"),
        );
        self.ran = true;
        berth_metrics::metrics().task_starts.inc();
        Ok(handle)
    }

    /// Runs the poststart hooks, then watches the task until this run of
    /// it ends.
    async fn supervise(&mut self, handle: &Arc<dyn TaskHandle>) -> (ExitResult, Ending) {
        let (kill_tx, mut kill_rx) = mpsc::unbounded_channel::<KillRequest>();
        let control = TaskControl {
            kill: kill_tx,
            pid: handle.pid(),
        };
        let mut poststart_failure = None;
        for hook in self.hooks.iter_mut() {
            if let Err(e) = hook.poststart(&self.ctx, &control).await {
                poststart_failure = Some(format!("poststart hook {:?} failed: {e}", hook.name()));
                break;
            }
        }
        drop(control);
        if let Some(msg) = poststart_failure {
            self.events.emit("Setup Failure", msg.clone());
            self.events.emit("Killing", msg.clone());
            return (handle.stop(self.kill_timeout).await, Ending::Failed(msg));
        }
        self.wait_for_exit(handle, &mut kill_rx).await
    }

    /// Waits for the running task to exit, killing it when asked to and
    /// acting on an operator's signals and restarts meanwhile.
    async fn wait_for_exit(
        &mut self,
        handle: &Arc<dyn TaskHandle>,
        kill_rx: &mut mpsc::UnboundedReceiver<KillRequest>,
    ) -> (ExitResult, Ending) {
        let kill_timeout = self.kill_timeout;
        let mut sampler = crate::usage::Sampler::default();
        let mut samples = tokio::time::interval(self.ctx.config.stats_interval);
        samples.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Whether the driver measures the task at all (read once: a
        // sample reads the task's cgroup files).
        let measured = handle.usage().is_some();
        loop {
            tokio::select! {
                exit = handle.wait() => return (exit, Ending::Exited),
                _ = samples.tick(), if measured => {
                    if let Some((now, limit)) = handle.usage() {
                        let (usage, report) = sampler.sample(now, limit, berth_structs::now_ms());
                        self.state.note_sample(&self.name, Some(usage));
                        if report {
                            self.state.task_usage(&self.name, usage);
                        }
                    }
                }
                reason = killed(&mut self.kill) => {
                    self.events.emit("Killing", reason);
                    return (handle.stop(kill_timeout).await, Ending::Killed);
                }
                Some(req) = kill_rx.recv() => {
                    self.events.emit("Killing", req.reason.clone());
                    let exit = handle.stop(kill_timeout).await;
                    return (exit, if req.restart { Ending::Restart } else { Ending::Failed(req.reason) });
                }
                Some(op) = self.ops.recv() => match op {
                    TaskOp::Signal { signal, reply } => {
                        signal_task(&self.events, &self.alloc.id, &self.name, handle, signal, reply);
                    }
                    TaskOp::Restart { reply } => {
                        self.events.emit(EVENT_RESTART_SIGNALED, USER_RESTART_REASON);
                        info!(alloc_id = %self.alloc.id, task = %self.name, "restarting the task: {USER_RESTART_REASON}");
                        let exit = handle.stop(kill_timeout).await;
                        let _ = reply.send(Ok(()));
                        return (exit, Ending::UserRestart);
                    }
                },
            }
        }
    }

    /// Counts the exit and records its `Terminated` event.
    fn record_exit(&self, ending: &Ending, exit: &ExitResult) {
        let outcome = match (ending, exit.successful()) {
            (Ending::Exited, true) => "success",
            (Ending::Exited, false) => "failure",
            _ => "killed",
        };
        berth_metrics::metrics()
            .task_exits
            .get_or_create(&berth_metrics::OutcomeLabels { outcome })
            .inc();
        if let Some(limit) = exit.oom_killed {
            self.events.emit(
                "OOM Killed",
                format!(
                    "the task reached its memory limit of {} MiB and the kernel killed it",
                    limit >> 20
                ),
            );
        }
        let mut terminated = TaskEvent::new("Terminated", exit.to_string());
        terminated.exit_code = exit.exit_code;
        terminated.signal = exit.signal;
        self.events.emit_event(terminated);
    }

    /// What the ending of a run and the restart policy make of it.
    async fn after_exit(&mut self, ending: Ending, exit: ExitResult) -> Next {
        if let (true, Some(watch)) = (exit.disconnected, self.disconnect_watch()) {
            return Next::Done(false, Some(disconnected_event(&watch)));
        }
        let decision = match ending {
            Ending::Killed => {
                return Next::Done(
                    false,
                    Some(TaskEvent::new("Killed", "Task successfully killed")),
                )
            }
            Ending::Failed(msg) => return Next::Done(true, Some(not_restarting(msg))),
            Ending::Restart => self.tracker.on_exit(
                &ExitResult {
                    error: Some("killed for a restart".into()),
                    ..exit
                },
                Instant::now(),
            ),
            Ending::Exited => self.tracker.on_exit(&exit, Instant::now()),
            Ending::UserRestart => {
                berth_metrics::metrics().task_restarts.inc();
                self.events.emit("Restarting", "Task restarting in 0s");
                self.state.task_restarting_in_place(&self.name);
                return Next::Again;
            }
        };
        match decision {
            RestartDecision::Complete => Next::Done(false, None),
            RestartDecision::Fail(msg) => Next::Done(true, Some(not_restarting(msg))),
            RestartDecision::Restart(delay) => {
                berth_metrics::metrics().task_restarts.inc();
                self.events
                    .emit("Restarting", format!("Task restarting in {delay:?}"));
                self.state.task_restarting(&self.name);
                if self.wait_to_restart(delay).await {
                    Next::Again
                } else {
                    Next::Done(false, None)
                }
            }
        }
    }

    /// Waits out the restart delay, refusing an operator's ops meanwhile.
    /// False when a kill came first: the task is not started again.
    async fn wait_to_restart(&mut self, delay: std::time::Duration) -> bool {
        let wait = tokio::time::sleep(delay);
        tokio::pin!(wait);
        loop {
            tokio::select! {
                _ = &mut wait => return true,
                _ = killed(&mut self.kill) => return false,
                Some(op) = self.ops.recv() => op.refuse(TaskOpError::NotRunning {
                    task: self.name.clone(),
                    state: "waiting to restart".into(),
                }),
            }
        }
    }

    /// The task is done for good: its started hooks stop, in reverse, and
    /// its last state is recorded. Returns whether it failed.
    async fn finish(mut self, failed: bool, last_event: Option<TaskEvent>) -> bool {
        let (alloc_id, name) = (&self.alloc.id, &self.name);
        for hook in self.hooks[..self.prestarted].iter_mut().rev() {
            if let Err(e) = hook.stop(&self.ctx).await {
                error!(alloc_id = %alloc_id, task = %name, hook = hook.name(), error = %e, "stop hook failed");
                self.events.emit(
                    "Task Hook Failed",
                    format!("stop hook {:?} failed: {e}", hook.name()),
                );
            }
        }
        if failed {
            warn!(alloc_id = %alloc_id, task = %name, "task failed");
        }
        self.state.task_dead(name, failed, last_event);
        failed
    }
}

/// Sends `signal` to the running task as an operator asked, with a
/// `Signaling` event, and answers `reply`.
fn signal_task(
    events: &TaskEvents,
    alloc_id: &str,
    name: &str,
    handle: &Arc<dyn TaskHandle>,
    signal: nix::sys::signal::Signal,
    reply: oneshot::Sender<Result<(), TaskOpError>>,
) {
    let mut event = TaskEvent::new(
        EVENT_SIGNALING,
        format!("Task being sent signal {}", signal.as_str()),
    );
    event.signal = Some(signal as i32);
    events.emit_event(event);
    info!(alloc_id = %alloc_id, task = %name, signal = signal.as_str(), "signaling the task");
    let sent = handle
        .signal(signal)
        .map_err(|e| TaskOpError::SignalFailed {
            task: name.to_string(),
            signal: signal.as_str().to_string(),
            message: e.to_string(),
        });
    let _ = reply.send(sent);
}

/// The last event of a task its disconnect window ended (see
/// [`crate::lease`]), which is not started again.
fn disconnected_event(watch: &crate::lease::DisconnectWatch) -> TaskEvent {
    TaskEvent::new("Killed", format!("{}; not restarting", watch.reason()))
}

fn not_restarting(message: impl Into<String>) -> TaskEvent {
    TaskEvent::new("Not Restarting", message)
}
