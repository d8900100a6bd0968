//! What the agent asks the client to prove it is not wedged (the systemd
//! watchdog, see `crate::systemd`) and to say how it is doing (systemd's
//! `STATUS=` line).

use std::time::Duration;

use super::Client;

/// Why the client failed its liveness probe.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the client state database did not answer a read within {0:?}")]
    StateSlow(Duration),
    #[error("reading the client state database failed: {0}")]
    StateRead(String),
    #[error("the alloc runners table stayed locked for {0:?}")]
    RunnersLocked(Duration),
}

impl Client {
    /// Checks, each within `timeout`, that the client's state database
    /// answers a read and that its table of alloc runners (held by the
    /// alloc watch while it reconciles and by the disconnect tracker while
    /// it stops allocs) can be taken: a client stuck in either fails.
    pub async fn probe(&self, timeout: Duration) -> Result<(), ProbeError> {
        let state = self.state.clone();
        let read = tokio::task::spawn_blocking(move || state.meta("node_id"));
        match tokio::time::timeout(timeout, read).await {
            Err(_) => return Err(ProbeError::StateSlow(timeout)),
            Ok(Err(e)) => return Err(ProbeError::StateRead(e.to_string())),
            Ok(Ok(Err(e))) => return Err(ProbeError::StateRead(e.to_string())),
            Ok(Ok(Ok(_))) => {}
        }
        let runners = tokio::time::timeout(timeout, self.runners.lock())
            .await
            .map_err(|_| ProbeError::RunnersLocked(timeout))?;
        drop(runners);
        Ok(())
    }

    /// How many of this node's allocs are not terminal.
    pub async fn running_allocs(&self) -> usize {
        self.runners
            .lock()
            .await
            .values()
            .filter(|r| !r.client_status().is_terminal())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use berth_sync::Shutdown;
    use std::time::Duration;

    use super::*;
    use crate::ClientConfig;

    #[tokio::test]
    async fn a_client_whose_runners_stay_locked_fails_the_probe() {
        let dir = tempfile::tempdir().unwrap();
        let config = ClientConfig::new(dir.path().to_path_buf(), vec!["http://127.0.0.1:1".into()]);
        let client = Client::start(config, Shutdown::channel().1)
            .await
            .expect("the client starts");
        let timeout = Duration::from_millis(200);
        client.probe(timeout).await.expect("an idle client passes");
        assert_eq!(client.running_allocs().await, 0);
        let held = client.runners.lock().await;
        let e = client.probe(timeout).await.unwrap_err();
        assert!(matches!(e, ProbeError::RunnersLocked(_)), "{e}");
        assert!(e.to_string().contains("runners"), "{e}");
        drop(held);
        client
            .probe(timeout)
            .await
            .expect("passes again once released");
    }
}
