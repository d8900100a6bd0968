//! The alloc's client status and task states, and where changes go.

use berth_sync::MutexExt;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use berth_structs::{now_ms, AllocClientStatus, Allocation, TaskEvent, TaskState, TaskStateKind};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::driver::TaskHandleRecord;
use crate::error::StateError;

/// Receives every change of an alloc's client status, description or task
/// states; the agent batches them to the servers. Called with the runner's
/// state lock held, in order: implementations must return quickly and must
/// not call back into the alloc runner.
pub trait AllocStateUpdater: Send + Sync {
    /// The alloc's state changed; `status_moved` when its client status
    /// is not the one of the update before (a task's events alone, or a
    /// task's end while others run, leave it).
    fn alloc_updated(
        &self,
        alloc_id: &str,
        client_status: AllocClientStatus,
        description: &str,
        task_states: &BTreeMap<String, TaskState>,
        status_moved: bool,
    );
}

/// How soon a write must be on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persist {
    /// On disk (synced) before the call returns: a restart finds it.
    Synced,
    /// Kept in order with every other write and visible at once, but on
    /// disk only with the next synced write: a crash of the agent before
    /// that loses it. Only for what a restarted agent can do without: the
    /// task events of a transition, a task's running state (the agent
    /// reattaches to the task through its synced handle and the executor's
    /// own records), an alloc the servers send again.
    Unsynced,
}

/// What an alloc runner persists so that a restarted agent picks its allocs
/// up again instead of starting their tasks a second time. The agent
/// implements it on its state database. Writes are made with the runner's
/// state lock held: they must be quick. The `*_with` and
/// [`Self::put_task_started`] methods let a store sync less; by default
/// they make the same synced writes as the plain ones.
pub trait AllocStateStore: Send + Sync {
    /// The alloc, when its runner starts and on every update.
    fn put_alloc(&self, alloc: &Allocation) -> Result<(), StateError>;
    /// The alloc's client status and task states, on every change.
    fn put_alloc_state(
        &self,
        alloc_id: &str,
        state: &PersistedAllocState,
    ) -> Result<(), StateError>;
    /// A task's handle, right after the task started.
    fn put_task_handle(
        &self,
        alloc_id: &str,
        task: &str,
        handle: &TaskHandleRecord,
    ) -> Result<(), StateError>;
    /// Everything recorded of the alloc, once it is destroyed.
    fn delete_alloc(&self, alloc_id: &str) -> Result<(), StateError>;
    /// Every alloc recorded, for [`crate::AllocRunner::restore`].
    fn load_allocs(&self) -> Result<Vec<RestoredAlloc>, StateError>;

    /// [`Self::put_alloc`], synced only when `persist` asks for it.
    fn put_alloc_with(&self, alloc: &Allocation, persist: Persist) -> Result<(), StateError> {
        let _ = persist;
        self.put_alloc(alloc)
    }

    /// [`Self::put_alloc_state`], synced only when `persist` asks for it.
    fn put_alloc_state_with(
        &self,
        alloc_id: &str,
        state: &PersistedAllocState,
        persist: Persist,
    ) -> Result<(), StateError> {
        let _ = persist;
        self.put_alloc_state(alloc_id, state)
    }

    /// A task just started: its handle and the alloc's state (the task
    /// running) together, synced, before the start is reported. A store
    /// writes both in one transaction.
    fn put_task_started(
        &self,
        alloc_id: &str,
        task: &str,
        handle: Option<&TaskHandleRecord>,
        state: &PersistedAllocState,
    ) -> Result<(), StateError> {
        if let Some(h) = handle {
            self.put_task_handle(alloc_id, task, h)?;
        }
        self.put_alloc_state(alloc_id, state)
    }
}

/// The alloc's state as persisted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedAllocState {
    pub client_status: AllocClientStatus,
    pub description: String,
    pub task_states: BTreeMap<String, TaskState>,
    /// When the alloc became terminal (unix ms): garbage collection takes
    /// the oldest first. Absent in records written before it was kept.
    #[serde(default)]
    pub terminal_at_ms: Option<i64>,
}

/// One alloc as the store had it.
#[derive(Debug, Clone)]
pub struct RestoredAlloc {
    pub alloc: Allocation,
    pub state: Option<PersistedAllocState>,
    /// The last started run of each task.
    pub handles: BTreeMap<String, TaskHandleRecord>,
}

/// A store that keeps nothing: runners built on it cannot be restored.
#[derive(Debug, Default)]
pub struct NoopStateStore;

impl AllocStateStore for NoopStateStore {
    fn put_alloc(&self, _alloc: &Allocation) -> Result<(), StateError> {
        Ok(())
    }
    fn put_alloc_state(&self, _id: &str, _state: &PersistedAllocState) -> Result<(), StateError> {
        Ok(())
    }
    fn put_task_handle(
        &self,
        _id: &str,
        _task: &str,
        _h: &TaskHandleRecord,
    ) -> Result<(), StateError> {
        Ok(())
    }
    fn delete_alloc(&self, _alloc_id: &str) -> Result<(), StateError> {
        Ok(())
    }
    fn load_allocs(&self) -> Result<Vec<RestoredAlloc>, StateError> {
        Ok(Vec::new())
    }
}

struct Inner {
    client_status: AllocClientStatus,
    description: String,
    task_states: BTreeMap<String, TaskState>,
    terminal_at_ms: Option<i64>,
}

/// The state of one alloc, shared by its runner, task runners and hooks.
pub(crate) struct AllocState {
    alloc_id: String,
    updater: Arc<dyn AllocStateUpdater>,
    store: Arc<dyn AllocStateStore>,
    inner: Mutex<Inner>,
    /// The latest usage sample of each running task that is measured
    /// (reported or not): what the stats API and the metrics answer.
    samples: Mutex<BTreeMap<String, berth_structs::TaskUsage>>,
}

impl AllocState {
    /// Every task starts `pending` with a `Received` event.
    pub(crate) fn new<'a>(
        alloc_id: &str,
        tasks: impl IntoIterator<Item = &'a str>,
        updater: Arc<dyn AllocStateUpdater>,
        store: Arc<dyn AllocStateStore>,
        restored: Option<PersistedAllocState>,
    ) -> AllocState {
        if let Some(r) = restored {
            return AllocState {
                alloc_id: alloc_id.to_string(),
                updater,
                store,
                inner: Mutex::new(Inner {
                    terminal_at_ms: r.terminal_at_ms.or_else(|| {
                        // An older record: the last task's end is close.
                        r.client_status.is_terminal().then(|| {
                            r.task_states
                                .values()
                                .filter_map(|s| s.finished_at_ms)
                                .max()
                                .unwrap_or_else(now_ms)
                        })
                    }),
                    client_status: r.client_status,
                    description: r.description,
                    task_states: r.task_states,
                }),
                samples: Mutex::default(),
            };
        }
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
            store,
            inner: Mutex::new(Inner {
                client_status: AllocClientStatus::Pending,
                description: "No tasks have started".into(),
                task_states,
                terminal_at_ms: None,
            }),
            samples: Mutex::default(),
        }
    }

    /// Keeps `sample` as `task`'s latest; None: the task no longer runs.
    pub(crate) fn note_sample(&self, task: &str, sample: Option<berth_structs::TaskUsage>) {
        let mut samples = self.samples.locked();
        match sample {
            Some(s) => {
                samples.insert(task.to_string(), s);
            }
            None => {
                samples.remove(task);
            }
        }
    }

    /// The latest usage sample of each running, measured task.
    pub(crate) fn samples(&self) -> BTreeMap<String, berth_structs::TaskUsage> {
        self.samples.locked().clone()
    }

    /// Changes the state under the lock, persists it (synced as `persist`
    /// says), then reports it.
    fn update(&self, persist: Persist, f: impl FnOnce(&mut Inner)) {
        self.update_and_store(f, |store, alloc_id, state| {
            store.put_alloc_state_with(alloc_id, state, persist)
        });
    }

    /// Changes the state under the lock, writes it with `write`, then
    /// reports it.
    fn update_and_store(
        &self,
        f: impl FnOnce(&mut Inner),
        write: impl FnOnce(&dyn AllocStateStore, &str, &PersistedAllocState) -> Result<(), StateError>,
    ) {
        let mut inner = self.inner.locked();
        let status_before = inner.client_status;
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
        let persisted = PersistedAllocState {
            client_status: inner.client_status,
            description: inner.description.clone(),
            task_states: inner.task_states.clone(),
            terminal_at_ms: inner.terminal_at_ms,
        };
        if let Err(e) = write(&*self.store, &self.alloc_id, &persisted) {
            warn!(alloc_id = %self.alloc_id, error = %e, "persisting the alloc's state failed");
        }
        self.updater.alloc_updated(
            &self.alloc_id,
            inner.client_status,
            &inner.description,
            &inner.task_states,
            inner.client_status != status_before,
        );
    }

    pub(crate) fn report(&self) {
        self.update(Persist::Unsynced, |_| {});
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
        self.update(Persist::Unsynced, |i| {
            i.task_states
                .entry(task.to_string())
                .or_default()
                .push_event(event)
        });
    }

    /// The task started: running, with `event`; its `handle` (what a
    /// restarted agent reattaches to) and the state are synced together
    /// before the start is reported.
    pub(crate) fn task_started(
        &self,
        task: &str,
        handle: Option<&TaskHandleRecord>,
        event: TaskEvent,
    ) {
        info!(
            alloc_id = %self.alloc_id,
            task,
            event = %event.event_type,
            message = %event.message,
            "task event"
        );
        self.update_and_store(
            |i| {
                let s = i.task_states.entry(task.to_string()).or_default();
                s.state = TaskStateKind::Running;
                s.started_at_ms = Some(now_ms());
                s.push_event(event);
            },
            |store, alloc_id, state| store.put_task_started(alloc_id, task, handle, state),
        );
    }

    /// A task found running after a restart: running again, keeping its
    /// start time.
    pub(crate) fn task_reattached(&self, task: &str) {
        self.update(Persist::Unsynced, |i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            s.state = TaskStateKind::Running;
            if s.started_at_ms.is_none() {
                s.started_at_ms = Some(now_ms());
            }
            s.push_event(TaskEvent::new(
                "Reattached",
                "Task reattached after an agent restart",
            ));
        });
    }

    /// What the running task uses now (reported, not synced: a sample
    /// lost to a crash is taken again).
    pub(crate) fn task_usage(&self, task: &str, usage: berth_structs::TaskUsage) {
        self.update(Persist::Unsynced, |i| {
            i.task_states.entry(task.to_string()).or_default().usage = Some(usage);
        });
    }

    pub(crate) fn task_restarting(&self, task: &str) {
        self.update(Persist::Unsynced, |i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            s.state = TaskStateKind::Pending;
            s.restarts += 1;
        });
    }

    /// The task is killed to start again at once, as an operator asked:
    /// pending, with its restart count (the restart policy's) unchanged.
    pub(crate) fn task_restarting_in_place(&self, task: &str) {
        self.update(Persist::Unsynced, |i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            s.state = TaskStateKind::Pending;
        });
    }

    /// The task is done for good; `event`, if any, is its last event.
    /// Synced: a restarted agent must not run it again.
    pub(crate) fn task_dead(&self, task: &str, failed: bool, event: Option<TaskEvent>) {
        self.update(Persist::Synced, |i| {
            let s = i.task_states.entry(task.to_string()).or_default();
            if let Some(e) = event {
                s.push_event(e);
            }
            s.state = TaskStateKind::Dead;
            s.failed |= failed;
            s.finished_at_ms = Some(now_ms());
        });
    }

    /// Synced: a restarted agent finds the alloc done.
    pub(crate) fn set_terminal(&self, status: AllocClientStatus, description: String) {
        self.update(Persist::Synced, |i| {
            i.client_status = status;
            i.description = description;
            if i.terminal_at_ms.is_none() {
                i.terminal_at_ms = Some(now_ms());
            }
        });
    }

    /// When the alloc became terminal (unix ms), once it has.
    pub(crate) fn terminal_at_ms(&self) -> Option<i64> {
        self.inner.locked().terminal_at_ms
    }

    pub(crate) fn client_status(&self) -> AllocClientStatus {
        self.inner.locked().client_status
    }

    pub(crate) fn task_states(&self) -> BTreeMap<String, TaskState> {
        self.inner.locked().task_states.clone()
    }

    /// The state of `task` alone, without a copy of its events.
    pub(crate) fn task_state_kind(&self, task: &str) -> Option<TaskStateKind> {
        self.inner.locked().task_states.get(task).map(|t| t.state)
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
