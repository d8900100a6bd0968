//! DNS rebinding refusal: a request whose `Host` does not name this agent
//! is answered 403 before any route sees it.
//!
//! A web page from `evil.example` whose name the attacker then points at
//! 127.0.0.1 can make the browser send requests to an agent that listens
//! on loopback, as if from the same site. The browser still names
//! `evil.example` in `Host`, so an agent that answers only requests naming
//! itself is out of reach. The check applies to a listener bound to a
//! loopback address, and to any listener once `http_allowed_hosts` is set.
//!
//! A `Host` names this agent when it is the listener's IP, `localhost`,
//! `127.0.0.1` or `::1` (on the listener's port, or without a port), or
//! one of `http_allowed_hosts` (on any port: a proxy in front may name
//! its own).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::agent_api::AgentInfo;
use super::ApiError;

/// Which `Host` values an agent answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedHosts {
    /// `http_allowed_hosts`, lowercase; `None` when not set.
    configured: Option<Vec<String>>,
}

/// The names that are loopback on every machine.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

impl AllowedHosts {
    pub fn new(configured: Option<Vec<String>>) -> AllowedHosts {
        AllowedHosts { configured }
    }

    /// Whether requests to a listener on `listen` are checked at all.
    fn applies(&self, listen: SocketAddr) -> bool {
        listen.ip().is_loopback() || self.configured.is_some()
    }

    /// Why `host` (a `Host` header) does not name the agent listening on
    /// `listen`, `None` when it does (or when no check applies).
    pub fn refusal(&self, listen: SocketAddr, host: Option<&str>) -> Option<String> {
        if !self.applies(listen) {
            return None;
        }
        let Some(host) = host else {
            return Some("the request has no Host header naming this agent".to_string());
        };
        let refused = || {
            Some(format!(
                "Host {:?} does not name this agent (listening on {listen}); \
                 add the name to http_allowed_hosts to reach it so",
                super::shown_path(host)
            ))
        };
        let Ok(authority) = host.parse::<Authority>() else {
            return refused();
        };
        // An authority with user info is no Host.
        if authority.as_str().contains('@') {
            return refused();
        }
        let name = authority.host().trim_end_matches('.').to_ascii_lowercase();
        let port = authority.port_u16();
        let configured = self
            .configured
            .iter()
            .flatten()
            .any(|c| name == *c || name.trim_matches(['[', ']']) == c.as_str());
        if configured {
            return None;
        }
        let own_ip = match listen {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        };
        let own_name = name == own_ip || LOOPBACK_NAMES.contains(&name.as_str());
        let own_port = port.is_none_or(|p| p == listen.port());
        if own_name && own_port {
            None
        } else {
            refused()
        }
    }
}

/// The middleware: a request whose `Host` does not name this agent gets a
/// 403 in the API's error shape. An agent whose listener is not bound yet
/// (a router served in-process) lets every request through.
pub async fn refuse_foreign_host(
    State(info): State<Arc<AgentInfo>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(listen) = info.http_addr.get().copied() else {
        return next.run(req).await;
    };
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("<not text>"))
        .or_else(|| req.uri().authority().map(Authority::as_str));
    if let Some(why) = info.allowed_hosts.refusal(listen, host) {
        tracing::debug!(path = %req.uri().path(), host = ?host.map(super::shown_path), "request refused: its Host does not name this agent");
        return ApiError::new(StatusCode::FORBIDDEN, why).into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lo() -> SocketAddr {
        "127.0.0.1:4747".parse().expect("an address")
    }

    #[test]
    fn a_loopback_agent_answers_its_own_names_only() {
        let open = AllowedHosts::default();
        for host in [
            "127.0.0.1:4747",
            "localhost:4747",
            "LocalHost:4747",
            "localhost.:4747",
            "[::1]:4747",
            "127.0.0.1",
            "localhost",
        ] {
            assert_eq!(open.refusal(lo(), Some(host)), None, "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:4747",
            "127.0.0.1:9999",
            "localhost:80",
            "127.0.0.1.evil.example:4747",
            "user@127.0.0.1:4747",
            "",
            "not a host",
        ] {
            let why = open.refusal(lo(), Some(host)).expect(host);
            assert!(why.contains("does not name this agent"), "{host}: {why}");
        }
        assert!(open
            .refusal(lo(), None)
            .is_some_and(|w| w.contains("no Host header")));
    }

    #[test]
    fn the_listeners_own_ip_is_its_name() {
        let open = AllowedHosts::default();
        let other_lo: SocketAddr = "127.0.0.2:80".parse().expect("an address");
        assert_eq!(open.refusal(other_lo, Some("127.0.0.2")), None);
        assert_eq!(open.refusal(other_lo, Some("127.0.0.2:80")), None);
        assert!(open.refusal(other_lo, Some("127.0.0.3:80")).is_some());
        let v6: SocketAddr = "[::1]:4747".parse().expect("an address");
        assert_eq!(open.refusal(v6, Some("[::1]:4747")), None);
        assert!(open.refusal(v6, Some("evil.example:4747")).is_some());
    }

    #[test]
    fn configured_names_are_answered_on_any_port() {
        let hosts = AllowedHosts::new(Some(vec![
            "berth.example.com".to_string(),
            "::1".to_string(),
        ]));
        assert_eq!(hosts.refusal(lo(), Some("Berth.Example.com")), None);
        assert_eq!(hosts.refusal(lo(), Some("berth.example.com:443")), None);
        assert_eq!(hosts.refusal(lo(), Some("[::1]:8080")), None);
        assert!(hosts.refusal(lo(), Some("evil.example")).is_some());
    }

    #[test]
    fn only_loopback_listeners_are_checked_unless_names_are_set() {
        let any: SocketAddr = "0.0.0.0:4747".parse().expect("an address");
        let lan: SocketAddr = "10.1.2.3:4747".parse().expect("an address");
        let open = AllowedHosts::default();
        assert_eq!(open.refusal(any, Some("evil.example")), None);
        assert_eq!(open.refusal(lan, Some("evil.example")), None);
        let named = AllowedHosts::new(Some(vec!["berth.lan".to_string()]));
        assert!(named.refusal(lan, Some("evil.example")).is_some());
        assert_eq!(named.refusal(lan, Some("berth.lan:4747")), None);
        assert_eq!(named.refusal(lan, Some("10.1.2.3:4747")), None);
    }
}
