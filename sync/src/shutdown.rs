//! Telling long-running loops to stop.
//!
//! Every loop of the agent (heartbeats, the alloc watch, the volume
//! watcher, GC, stats, the HTTP listener) takes a [`Shutdown`] and ends
//! when it fires. The owner of the loop keeps the [`ShutdownSender`]:
//! [`ShutdownSender::shutdown`] fires it, and so does dropping it, so a
//! loop whose owner is gone (a panicked task, a test that returned early)
//! does not run on unseen.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let (stop, mut shutdown) = berth_sync::Shutdown::channel();
//! let task = tokio::spawn(async move {
//!     shutdown.wait().await;
//!     "stopped"
//! });
//! stop.shutdown();
//! assert_eq!(task.await.unwrap(), "stopped");
//! # });
//! ```

use std::sync::OnceLock;

use tokio::sync::watch;

/// The side a loop waits on. Clones wait on the same signal.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// The side that fires a [`Shutdown`]; dropping it fires it too.
#[derive(Debug)]
pub struct ShutdownSender(watch::Sender<bool>);

impl Shutdown {
    /// A sender and the first [`Shutdown`] it fires.
    pub fn channel() -> (ShutdownSender, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (ShutdownSender(tx), Shutdown(rx))
    }

    /// A [`Shutdown`] that never fires: for a loop that runs as long as
    /// the process, or a test that never stops it.
    pub fn never() -> Shutdown {
        static NEVER: OnceLock<watch::Sender<bool>> = OnceLock::new();
        Shutdown(NEVER.get_or_init(|| watch::channel(false).0).subscribe())
    }

    /// Whether [`ShutdownSender::shutdown`] was called. A dropped sender
    /// does not count here; [`Shutdown::wait`] returns for it.
    pub fn is_shutdown(&self) -> bool {
        *self.0.borrow()
    }

    /// Returns once the sender fired or was dropped; at once if it
    /// already was. Cancel-safe: a `select!` branch can wait on it in a
    /// loop.
    pub async fn wait(&mut self) {
        // An error means the sender is gone, which is a shutdown too.
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    /// Returns once [`ShutdownSender::shutdown`] is called, and never if
    /// the sender is dropped first: for a wait that ends early on a stop,
    /// where a stop that can no longer come is no reason to wake.
    pub async fn wait_requested(&mut self) {
        if self.0.wait_for(|stop| *stop).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl ShutdownSender {
    /// Fires every [`Shutdown`] of this sender, now and later ones.
    pub fn shutdown(&self) {
        self.0.send_replace(true);
    }

    /// Whether [`ShutdownSender::shutdown`] was called.
    pub fn is_shutdown(&self) -> bool {
        *self.0.borrow()
    }

    /// Another [`Shutdown`] fired by this sender.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Shutdown;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn every_clone_and_subscriber_sees_the_shutdown() {
        runtime().block_on(async {
            let (stop, first) = Shutdown::channel();
            let mut clone = first.clone();
            let mut late = stop.subscribe();
            assert!(!first.is_shutdown() && !stop.is_shutdown());
            stop.shutdown();
            clone.wait().await;
            late.wait().await;
            assert!(first.is_shutdown() && stop.is_shutdown());
            // Subscribed after the shutdown: fired already.
            stop.subscribe().wait().await;
        });
    }

    #[test]
    fn a_dropped_sender_ends_the_wait() {
        runtime().block_on(async {
            let (stop, mut shutdown) = Shutdown::channel();
            drop(stop);
            tokio::time::timeout(Duration::from_secs(5), shutdown.wait())
                .await
                .expect("the wait ended when its sender was dropped");
            assert!(!shutdown.is_shutdown(), "dropping is not a shutdown() call");
        });
    }

    #[test]
    fn a_requested_wait_outlives_a_dropped_sender() {
        runtime().block_on(async {
            let (stop, mut shutdown) = Shutdown::channel();
            let mut other = stop.subscribe();
            drop(stop);
            let waited =
                tokio::time::timeout(Duration::from_millis(50), shutdown.wait_requested()).await;
            assert!(waited.is_err(), "a dropped sender ended wait_requested");
            let (stop, _) = Shutdown::channel();
            let mut fired = stop.subscribe();
            stop.shutdown();
            tokio::time::timeout(Duration::from_secs(5), fired.wait_requested())
                .await
                .expect("shutdown() ended wait_requested");
            other.wait().await;
        });
    }

    #[test]
    fn never_does_not_fire() {
        runtime().block_on(async {
            let mut never = Shutdown::never();
            let waited = tokio::time::timeout(Duration::from_millis(50), never.wait()).await;
            assert!(waited.is_err(), "Shutdown::never fired");
            assert!(!never.is_shutdown());
        });
    }
}
