//! Whether the servers enforce ACL tokens, as the client last heard: kept
//! across restarts, and what decides whether a client agent checks tokens
//! on its own routes.

use berth_sync::Shutdown;
use tokio::sync::watch;

use crate::state::ClientState;
use crate::Client;

impl Client {
    /// Whether the servers enforce ACL tokens, as they last said (kept
    /// across restarts); `None` before they ever said. A client agent
    /// checks tokens on its own routes when they do.
    pub fn cluster_acl(&self) -> Option<bool> {
        self.conn.cluster_acl()
    }

    /// Whether this client checks ACL tokens on its own routes: when its
    /// servers enforce them; before they ever said, while it runs any
    /// alloc (a client upgraded from a version that did not record their
    /// answer, restarted while they are unreachable). A client that never
    /// heard from its servers runs nothing they placed, so nothing of its
    /// routes is theirs to protect yet.
    pub fn checks_tokens(&self) -> bool {
        match self.cluster_acl() {
            Some(enforced) => enforced,
            None => self.runners.try_lock().map_or(true, |r| !r.is_empty()),
        }
    }

    /// The servers' index of their last change to ACL tokens and
    /// policies: a client agent drops the tokens it resolved when it
    /// moves.
    pub fn acl_index(&self) -> u64 {
        self.conn.acl_index()
    }

    /// Changes of [`Self::cluster_acl`].
    pub fn cluster_acl_changes(&self) -> watch::Receiver<Option<bool>> {
        self.conn.cluster_acl_changes()
    }
}

/// Records every change of what the servers say of enforcing ACL tokens,
/// so that a restarted client knows it before it reaches them.
pub(crate) async fn record(
    mut changes: watch::Receiver<Option<bool>>,
    state: ClientState,
    mut shutdown: Shutdown,
) {
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
        let Some(enabled) = *changes.borrow_and_update() else {
            continue;
        };
        if let Err(e) = state.set_cluster_acl(enabled) {
            tracing::warn!(error = %e, "recording whether the servers enforce ACLs failed");
        }
    }
}
