//! The alloc's client status and task states, and where changes go.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use berth_structs::{now_ms, AllocClientStatus, TaskEvent, TaskState, TaskStateKind};
use tracing::info;

/// Receives every change of an alloc's client status, description or task
/// states; the agent batches them to the servers. Called with the runner's
/// state lock held, in order: implementations must return quickly and must
/// not call back into the alloc runner.
pub trait AllocStateUpdater: Send + Sync {
    fn alloc_updated(
        &self,
        alloc_id: &str,
        client_status: AllocClientStatus,
        description: &str,
        task_states: &BTreeMap<String, TaskState>,
    );
}

struct Inner {
    client_status: AllocClientStatus,
    description: String,
    task_states: BTreeMap<String, TaskState>,
}

/// The state of one alloc, shared by its runner, task runners and hooks.
pub(crate) struct AllocState {
    alloc_id: String,
    updater: Arc<dyn AllocStateUpdater>,
    inner: Mutex<Inner>,
}

impl AllocState {
    /// Every task starts `pending` with a `Received` event.
    pub(crate) fn new<'a>(
        alloc_id: &str,
        tasks: impl IntoIterator<Item = &'a str>,
        updater: Arc<dyn AllocStateUpdater>,
    ) -> AllocState {
        let task_states = tasks
            .into_iter()
            .map(|t| {
                let mut s = TaskState::default();
                s.push_event(TaskEvent::new("Received", "Task received by client"));
                (t.to_string(), s)
            })
            .collect();
        AllocState {
            alloc_id: alloc_id.to_string(),
            updater,
            inner: Mutex::new(Inner {
                client_status: AllocClientStatus::Pending,
                description: "No tasks have started".into(),
                task_states,
            }),
        }
    }

    /// Changes the state under the lock, then reports it.
    fn update(&self, f: impl FnOnce(&mut Inner)) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut inner);
        if !inner.client_status.is_terminal()
            && inner.client_status == AllocClientStatus::Pending
            && inner
                .task_states
                .values()
                .any(|s| s.state == TaskStateKind::Running)
        {
            inner.client_status = AllocClientStatus::Running;
            inner.description = "Tasks are running".into();
        }
        self.updater.alloc_updated(
            &self.alloc_id,
            inner.client_status,
            &inner.description,
            &inner.task_states,
        );
    }

    pub(crate) fn report(&self) {
        self.update(|_| {});
    }

    pub(crate) fn task_event(&self, task: &str, event: TaskEvent) {
        info!(
            alloc_id = %self.alloc_id,
            task,
            event = %event.event_type,
            message = %event.message,
            exit_code = event.exit_code,
            signal = event.signal,
            "task event"
        );
        self.update(|i| {
            i.task_states
                .entry(task.to_string())
                .or_default()
                .push_event(event)
        });
    }

    pub(crate) fn task_running(&self, task: &str) {
        self.update(|i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            s.state = TaskStateKind::Running;
            s.started_at_ms = Some(now_ms());
        });
    }

    pub(crate) fn task_restarting(&self, task: &str) {
        self.update(|i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            s.state = TaskStateKind::Pending;
            s.restarts += 1;
        });
    }

    /// The task is done for good; `event`, if any, is its last event.
    pub(crate) fn task_dead(&self, task: &str, failed: bool, event: Option<TaskEvent>) {
        self.update(|i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            if let Some(e) = event {
                s.push_event(e);
            }
            s.state = TaskStateKind::Dead;
            s.failed |= failed;
            s.finished_at_ms = Some(now_ms());
        });
    }

    pub(crate) fn set_terminal(&self, status: AllocClientStatus, description: String) {
        self.update(|i| {
            i.client_status = status;
            i.description = description;
        });
    }

    pub(crate) fn client_status(&self) -> AllocClientStatus {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .client_status
    }

    pub(crate) fn task_states(&self) -> BTreeMap<String, TaskState> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .task_states
            .clone()
    }
}

/// Records events of one task. Cheap to clone; hooks keep one to report
/// from background work (the plugin supervisor's probes).
#[derive(Clone)]
pub struct TaskEvents {
    state: Arc<AllocState>,
    task: Arc<str>,
}

impl TaskEvents {
    pub(crate) fn new(state: Arc<AllocState>, task: &str) -> TaskEvents {
        TaskEvents {
            state,
            task: Arc::from(task),
        }
    }

    pub fn emit(&self, event_type: &str, message: impl Into<String>) {
        self.state
            .task_event(&self.task, TaskEvent::new(event_type, message));
    }

    pub fn emit_event(&self, event: TaskEvent) {
        self.state.task_event(&self.task, event);
    }

    pub fn task(&self) -> &str {
        &self.task
    }
}
