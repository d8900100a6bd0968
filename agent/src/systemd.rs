//! systemd integration through the service notification protocol
//! (`sd_notify(3)`, `Type=notify`). When `NOTIFY_SOCKET` is not set (the
//! agent does not run under systemd) every function here does nothing.
//!
//! - `READY=1` once the agent serves (see `crate::agent::run`: a server
//!   once its state is loaded and its RPC listener is up, a client once
//!   its allocs are restored and it has registered or given up reaching
//!   the servers for now), with `STATUS=` lines on the way there and
//!   after.
//! - `RELOADING=1` (with `MONOTONIC_USEC`), then `READY=1` again, around
//!   a SIGHUP reload of the log level.
//! - `STOPPING=1` on SIGTERM or SIGINT, before the agent shuts down; the
//!   tasks keep running.
//! - `WATCHDOG=1` every half `WATCHDOG_USEC` (systemd's `WatchdogSec=`),
//!   sent by [`run_watchdog`] only after that period's checks of the
//!   agent's components pass, each within a quarter of the watchdog
//!   period:
//!   1. the async runtime runs a freshly spawned task (its workers are not
//!      all stuck);
//!   2. the server role's state tables can be read (no write holds them
//!      locked);
//!   3. the client's state database answers a read, and its alloc runners
//!      table, which the alloc watch holds while it reconciles and the
//!      disconnect tracker while it stops allocs, can be taken.
//!
//!   A failed check is logged with what failed and the ping skipped: a
//!   wedged agent stops pinging, and systemd restarts it once
//!   `WatchdogSec` passes without a ping (the tasks survive that:
//!   `KillMode=process`). The same loop refreshes the `STATUS=` line.

use berth_sync::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use berth_server::Server;
use sd_notify::NotifyState;
use tokio::sync::watch;

use berth_client::Client;
use berth_structs::text::count_of;

/// Whether the agent runs under a service manager that listens.
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Sends `states` to the service manager; a failure is logged, not
/// fatal: the agent works the same without systemd.
fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}

/// `STATUS=text`: what the agent is doing, shown by `systemctl status`.
pub fn status(text: &str) {
    tracing::debug!(status = text, "systemd status");
    send(&[NotifyState::Status(text)]);
}

/// `READY=1` with `STATUS=text`.
pub fn ready(text: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(text)]);
}

/// `RELOADING=1`: a reload begins; [`ready`] ends it.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[
            NotifyState::Reloading,
            now,
            NotifyState::Status("reloading the log level"),
        ]),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the monotonic clock for systemd");
            send(&[NotifyState::Reloading]);
        }
    }
}

/// `STOPPING=1`: the agent is shutting down.
pub fn stopping() {
    send(&[
        NotifyState::Stopping,
        NotifyState::Status("stopping; tasks keep running"),
    ]);
}

/// The agent's components that the watchdog checks and the status line
/// describes.
#[derive(Clone, Default)]
pub struct Components {
    pub server: Option<Arc<Server>>,
    pub client: Option<Arc<Client>>,
}

impl Components {
    /// The watchdog's checks (see the module doc), each within `timeout`;
    /// the error says which failed.
    pub async fn check(&self, timeout: Duration) -> Result<(), String> {
        tokio::time::timeout(timeout, tokio::spawn(async {}))
            .await
            .map_err(|_| format!("the async runtime did not run a task within {timeout:?}"))?
            .map_err(|e| format!("the async runtime lost a task: {e}"))?;
        if let Some(server) = &self.server {
            let server = server.clone();
            let read = tokio::task::spawn_blocking(move || server.node_count());
            tokio::time::timeout(timeout, read)
                .await
                .map_err(|_| format!("the server state was not readable within {timeout:?}"))?
                .map_err(|e| format!("reading the server state failed: {e}"))?;
        }
        if let Some(client) = &self.client {
            client.probe(timeout).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The `STATUS=` line of a serving agent.
    pub async fn status(&self) -> String {
        let server = self
            .server
            .as_ref()
            .map(|s| format!("server: {}", count_of(s.node_count(), "node", "nodes")));
        let client = match &self.client {
            None => None,
            Some(c) => {
                let allocs = c.running_allocs().await;
                let allocs = count_of(allocs, "alloc", "allocs");
                Some(if c.registered() {
                    format!("client: {allocs} running")
                } else {
                    format!("client: {allocs} running; servers unreachable, retrying")
                })
            }
        };
        let parts: Vec<String> = [server, client].into_iter().flatten().collect();
        format!("ready: {}", parts.join("; "))
    }
}

/// The watchdog's ping period: half of `WATCHDOG_USEC`, when systemd set
/// a watchdog for this process.
pub fn watchdog_period() -> Option<Duration> {
    sd_notify::watchdog_enabled().and_then(ping_period)
}

/// Half the watchdog timeout, at least [`MIN_PING_PERIOD`] (a timeout of
/// a few microseconds would otherwise make the loop spin); none for a
/// zero timeout, which systemd never sets.
fn ping_period(timeout: Duration) -> Option<Duration> {
    (!timeout.is_zero()).then(|| (timeout / 2).max(MIN_PING_PERIOD))
}

/// The shortest period the watchdog is pinged at.
const MIN_PING_PERIOD: Duration = Duration::from_millis(10);

/// Until `stop`: every watchdog period, checks `components` and pings the
/// watchdog when they pass; refreshes the `STATUS=` line once `ready` is
/// true. Without a watchdog only the status is refreshed, every 10 s;
/// without `NOTIFY_SOCKET` it returns at once.
pub async fn run_watchdog(
    components: Components,
    ready: watch::Receiver<bool>,
    mut stop: Shutdown,
) {
    if !enabled() {
        return;
    }
    let watchdog = watchdog_period();
    let period = watchdog.unwrap_or(Duration::from_secs(10));
    if let Some(p) = watchdog {
        tracing::info!(period = ?p, "pinging the systemd watchdog");
    }
    let timeout = period / 2;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_status = String::new();
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait() => return,
        }
        if watchdog.is_some() {
            match components.check(timeout).await {
                Ok(()) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!(
                            "the agent's components answer again; pinging the systemd watchdog"
                        );
                    }
                    send(&[NotifyState::Watchdog]);
                }
                Err(problem) => {
                    failing = true;
                    tracing::error!(%problem, "an agent component is stuck; not pinging the systemd watchdog");
                }
            }
        }
        if *ready.borrow() {
            let now = components.status().await;
            if now != last_status {
                status(&now);
                last_status = now;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_pinged_at_half_its_timeout_and_never_in_a_spin() {
        assert_eq!(
            ping_period(Duration::from_secs(30)),
            Some(Duration::from_secs(15))
        );
        assert_eq!(ping_period(Duration::from_micros(1)), Some(MIN_PING_PERIOD));
        assert_eq!(ping_period(Duration::ZERO), None);
    }

    #[tokio::test]
    async fn the_checks_pass_for_a_server_that_answers() {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::open(berth_server::ServerConfig::new(dir.path())).unwrap();
        let components = Components {
            server: Some(server),
            client: None,
        };
        components.check(Duration::from_secs(5)).await.unwrap();
        assert_eq!(components.status().await, "ready: server: 0 nodes");
    }
}
