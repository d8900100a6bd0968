//! The task runner: runs one task of an alloc through its hook chain, its
//! driver and its restart policy until it is done for good.

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_csimanager::MountInfo;
use berth_structs::{Allocation, Task, TaskEvent};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::alloc_dir::AllocDir;
use crate::config::AllocRunnerConfig;
use crate::driver::{ExitResult, TaskHandleRecord, TaskSpec};
use crate::env;
use crate::restart::{RestartDecision, RestartTracker};
use crate::state::{AllocState, TaskEvents};
use crate::task_hooks::{self, KillRequest, TaskControl, TaskHookContext};
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
        let TaskRunner {
            config,
            alloc,
            task,
            alloc_dir,
            state,
            mounts,
            mut kill,
            mut reattach,
            mut ops,
        } = self;
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
        let mut tracker = RestartTracker::new(group.restart.clone(), alloc.job.job_type);
        let kill_timeout = task.kill_timeout.unwrap_or(config.default_kill_timeout);
        let driver = config.drivers.get(&task.driver).cloned();
        let mut ctx = TaskHookContext {
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
        let mut hooks = task_hooks::hooks_for(&task);
        let mut prestarted = 0usize;
        // Whether this runner started the task (or reattached to it) yet: a
        // task killed before that never ran. A task to reattach to is
        // reattached even when the kill came first, so that it is stopped
        // rather than left running.
        let mut ran = false;

        let (failed, last_event) = 'run: loop {
            if kill.borrow().is_some() && reattach.is_none() {
                break (false, (!ran).then(crate::alloc_runner::not_started_event));
            }
            ctx.env = base_env.clone();
            let reattaching = reattach.take();
            ctx.restoring = reattaching.is_some();
            if !ctx.restoring {
                events.emit("Task Setup", "Building Task Directory");
            }
            for (i, hook) in hooks.iter_mut().enumerate() {
                prestarted = prestarted.max(i + 1);
                if let Err(e) = hook.prestart(&mut ctx).await {
                    events.emit(
                        "Setup Failure",
                        format!("prestart hook {:?} failed: {e}", hook.name()),
                    );
                    break 'run (true, Some(not_restarting("Error was unrecoverable")));
                }
            }
            if kill.borrow().is_some() && reattaching.is_none() {
                break (false, (!ran).then(crate::alloc_runner::not_started_event));
            }
            let Some(driver) = &driver else {
                events.emit(
                    "Driver Failure",
                    crate::DriverError::UnknownDriver(task.driver.clone()).to_string(),
                );
                break (true, Some(not_restarting("Error was unrecoverable")));
            };
            let env = env::with_task_env(ctx.env.clone(), &task.env);
            let spec = TaskSpec {
                alloc_id: alloc.id.clone(),
                task: name.clone(),
                command: env::interpolate(&task.config.command, &env),
                args: task
                    .config
                    .args
                    .iter()
                    .map(|a| env::interpolate(a, &env))
                    .collect(),
                task_dir: ctx.task_dir.dir.clone(),
                stdout_path: alloc_dir.stdout_path(&name),
                stderr_path: alloc_dir.stderr_path(&name),
                logs: crate::logs::LogRotation::from(&task.logs),
                executor_dir: alloc_dir.executor_dir(&name),
                env,
            };
            let handle = if let Some(record) = &reattaching {
                // Never started again here: a task the driver cannot tell
                // about may still run, and two copies must not.
                match driver.reattach(record).await {
                    Ok(h) => {
                        info!(alloc_id = %alloc.id, task = %name, pid = h.pid(), running = h.try_exit().is_none(), "reattached to the task");
                        state.task_reattached(&name);
                        ran = true;
                        h
                    }
                    Err(e) => {
                        events.emit("Driver Failure", format!("failed to reattach: {e}"));
                        break (true, Some(not_restarting("Error was unrecoverable")));
                    }
                }
            } else {
                let handle = match driver.start(&spec).await {
                    Ok(h) => h,
                    Err(e) => {
                        events.emit("Driver Failure", format!("failed to start task: {e}"));
                        break (true, Some(not_restarting("Error was unrecoverable")));
                    }
                };
                // The handle is synced with the running state, before the
                // task is reported running: a restart from here on finds
                // it.
                state.task_started(
                    &name,
                    handle.record().as_ref(),
                    TaskEvent::new("Started", "Task started by client"),
                );
                ran = true;
                berth_metrics::metrics().task_starts.inc();
                handle
            };

            let (kill_tx, mut kill_rx) = mpsc::unbounded_channel::<KillRequest>();
            let control = TaskControl {
                kill: kill_tx,
                pid: handle.pid(),
            };
            let mut poststart_failure = None;
            for hook in hooks.iter_mut() {
                if let Err(e) = hook.poststart(&ctx, &control).await {
                    poststart_failure =
                        Some(format!("poststart hook {:?} failed: {e}", hook.name()));
                    break;
                }
            }
            drop(control);

            let (exit, ending) = if let Some(msg) = poststart_failure {
                events.emit("Setup Failure", msg.clone());
                events.emit("Killing", msg.clone());
                (handle.stop(kill_timeout).await, Ending::Failed(msg))
            } else {
                loop {
                    tokio::select! {
                        exit = handle.wait() => break (exit, Ending::Exited),
                        reason = killed(&mut kill) => {
                            events.emit("Killing", reason);
                            break (handle.stop(kill_timeout).await, Ending::Killed);
                        }
                        Some(req) = kill_rx.recv() => {
                            events.emit("Killing", req.reason.clone());
                            let exit = handle.stop(kill_timeout).await;
                            break (exit, if req.restart { Ending::Restart } else { Ending::Failed(req.reason) });
                        }
                        Some(op) = ops.recv() => match op {
                            TaskOp::Signal { signal, reply } => {
                                let mut event = TaskEvent::new(
                                    EVENT_SIGNALING,
                                    format!("Task being sent signal {}", signal.as_str()),
                                );
                                event.signal = Some(signal as i32);
                                events.emit_event(event);
                                info!(alloc_id = %alloc.id, task = %name, signal = signal.as_str(), "signaling the task");
                                let sent = handle.signal(signal).map_err(|e| TaskOpError::SignalFailed {
                                    task: name.clone(),
                                    signal: signal.as_str().to_string(),
                                    message: e.to_string(),
                                });
                                let _ = reply.send(sent);
                            }
                            TaskOp::Restart { reply } => {
                                events.emit(EVENT_RESTART_SIGNALED, USER_RESTART_REASON);
                                info!(alloc_id = %alloc.id, task = %name, "restarting the task: {USER_RESTART_REASON}");
                                let exit = handle.stop(kill_timeout).await;
                                let _ = reply.send(Ok(()));
                                break (exit, Ending::UserRestart);
                            }
                        },
                    }
                }
            };
            for hook in hooks.iter_mut() {
                hook.exited(&ctx).await;
            }
            let outcome = match (&ending, exit.successful()) {
                (Ending::Exited, true) => "success",
                (Ending::Exited, false) => "failure",
                _ => "killed",
            };
            berth_metrics::metrics()
                .task_exits
                .get_or_create(&berth_metrics::OutcomeLabels { outcome })
                .inc();
            let mut terminated = TaskEvent::new("Terminated", exit.to_string());
            terminated.exit_code = exit.exit_code;
            terminated.signal = exit.signal;
            events.emit_event(terminated);

            let decision = match ending {
                Ending::Killed => {
                    break (
                        false,
                        Some(TaskEvent::new("Killed", "Task successfully killed")),
                    )
                }
                Ending::Failed(msg) => break (true, Some(not_restarting(msg))),
                Ending::Restart => tracker.on_exit(
                    &ExitResult {
                        error: Some("killed for a restart".into()),
                        ..exit
                    },
                    Instant::now(),
                ),
                Ending::Exited => tracker.on_exit(&exit, Instant::now()),
                Ending::UserRestart => {
                    berth_metrics::metrics().task_restarts.inc();
                    events.emit("Restarting", "Task restarting in 0s");
                    state.task_restarting_in_place(&name);
                    continue 'run;
                }
            };
            match decision {
                RestartDecision::Complete => break (false, None),
                RestartDecision::Fail(msg) => break (true, Some(not_restarting(msg))),
                RestartDecision::Restart(delay) => {
                    berth_metrics::metrics().task_restarts.inc();
                    events.emit("Restarting", format!("Task restarting in {delay:?}"));
                    state.task_restarting(&name);
                    let wait = tokio::time::sleep(delay);
                    tokio::pin!(wait);
                    loop {
                        tokio::select! {
                            _ = &mut wait => break,
                            _ = killed(&mut kill) => break 'run (false, None),
                            Some(op) = ops.recv() => op.refuse(TaskOpError::NotRunning {
                                task: name.clone(),
                                state: "waiting to restart".into(),
                            }),
                        }
                    }
                }
            }
        };

        for hook in hooks[..prestarted].iter_mut().rev() {
            if let Err(e) = hook.stop(&ctx).await {
                error!(alloc_id = %alloc.id, task = %name, hook = hook.name(), error = %e, "stop hook failed");
                events.emit(
                    "Task Hook Failed",
                    format!("stop hook {:?} failed: {e}", hook.name()),
                );
            }
        }
        if failed {
            warn!(alloc_id = %alloc.id, task = %name, "task failed");
        }
        state.task_dead(&name, failed, last_event);
        failed
    }
}

fn not_restarting(message: impl Into<String>) -> TaskEvent {
    TaskEvent::new("Not Restarting", message)
}
