//! Returning freed heap to the kernel after bursts of alloc changes, so
//! the client's resident memory falls back once the work is done.

use berth_sync::Shutdown;
use std::time::Duration;

use tokio::sync::watch;

/// How often the heap is trimmed while the client's allocs change.
pub const HEAP_TRIM_INTERVAL: Duration = Duration::from_secs(5);

/// Gives the heap's free pages back to the kernel (`malloc_trim`) at most
/// every [`HEAP_TRIM_INTERVAL`], and only after the client's allocs changed
/// (`changes` moved): starting or restoring many allocs decodes, copies and
/// frees far more than stays live, and glibc keeps the freed pages
/// resident in the middle of the heap. An idle client trims nothing.
pub(crate) async fn trim_heap_after_changes(
    mut changes: watch::Receiver<u64>,
    mut shutdown: Shutdown,
) {
    loop {
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = shutdown.wait() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(HEAP_TRIM_INTERVAL) => {}
            _ = shutdown.wait() => return,
        }
        changes.mark_unchanged();
        trim_heap();
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_heap() {
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() {}
