//! The retry timer: blocked jobs are evaluated again every
//! `scheduler_retry_interval`, and when a delayed replacement becomes due.

use berth_sync::{MutexExt, Shutdown};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::server::Server;

impl Server {
    /// Evaluate the blocked jobs every `scheduler_retry_interval`, and
    /// when a delayed replacement becomes due (a lost alloc's disconnect
    /// window, a reschedule delay), so that it does not wait for an
    /// unrelated event.
    pub(crate) async fn scheduler_retry_loop(self: Arc<Self>, mut shutdown: Shutdown) {
        loop {
            let changed = self.retry_due.changed.notified();
            let interval = self.config.scheduler_retry_interval;
            let sleep = match self.retry_due.next() {
                Some(due) => {
                    let wait =
                        u64::try_from(due.saturating_sub(berth_structs::now_ms())).unwrap_or(0);
                    interval.min(Duration::from_millis(wait))
                }
                None => interval,
            };
            tokio::select! {
                _ = shutdown.wait() => return,
                _ = changed => continue,
                _ = tokio::time::sleep(sleep) => {}
            }
            self.retry_due.take_due(berth_structs::now_ms());
            self.evaluate_blocked().await;
        }
    }
}

/// When the next delayed replacement becomes due (unix ms).
#[derive(Debug, Default)]
pub(crate) struct RetryDue {
    due: Mutex<Option<i64>>,
    changed: tokio::sync::Notify,
}

impl RetryDue {
    /// Evaluate the blocked jobs again at `due_ms` (or sooner).
    pub(super) fn at(&self, due_ms: i64) {
        let mut due = self.due.locked();
        if due.is_none_or(|d| due_ms < d) {
            *due = Some(due_ms);
            drop(due);
            self.changed.notify_one();
        }
    }

    fn next(&self) -> Option<i64> {
        *self.due.locked()
    }

    /// Forget a due time that has come (the evaluation it asked for is
    /// about to run; a delay still pending sets it again).
    fn take_due(&self, now_ms: i64) {
        let mut due = self.due.locked();
        if due.is_some_and(|d| d <= now_ms) {
            *due = None;
        }
    }
}
