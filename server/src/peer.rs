//! Who is at the other end of an agent-protocol request: the connection's
//! peer as the listener recorded it and, for a request a server sent on
//! to the leader (`crate::leader_link`), the node it was sent on for.

use std::net::SocketAddr;

use tonic::codegen::http::Request;

use crate::leader_link::SENT_ON_FOR_HEADER;

/// Who the peer of an agent-protocol connection proved to be when the
/// connection was set up. The agent's listener puts it into every
/// request's extensions (tonic's `Connected::connect_info`); a request
/// without one came over a listener that checks nothing (no TLS).
#[derive(Debug, Clone, Default)]
pub struct PeerIdentity {
    /// The peer's address, when the listener knows it.
    pub remote_addr: Option<SocketAddr>,
    /// The DNS names of the certificate the peer presented, which chained
    /// to the agents' CA; empty when the peer presented none.
    pub cert_names: Vec<String>,
}

impl PeerIdentity {
    /// Whether the peer's verified certificate names an agent of `region`
    /// (`client.<region>.berth` or `server.<region>.berth`).
    pub fn is_agent_of(&self, region: &str) -> bool {
        let client = format!("client.{region}.berth");
        let server = format!("server.{region}.berth");
        self.cert_names.iter().any(|n| *n == client || *n == server)
    }
}

/// The address of the node that made `req`: the connection's peer or, for
/// a request another server sent on, the node's address it names. That
/// is believed only from a peer that proved to be a server of `region`,
/// or over a connection without TLS (which proves nothing of any peer).
pub(crate) fn node_addr_of<B>(req: &Request<B>, region: &str) -> Option<SocketAddr> {
    let peer = peer_of(req);
    let named = || {
        req.headers()
            .get(SENT_ON_FOR_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    };
    match req.extensions().get::<PeerIdentity>() {
        Some(p) if !p.cert_names.is_empty() => {
            let server = format!("server.{region}.berth");
            if p.cert_names.contains(&server) {
                named().or(peer)
            } else {
                peer
            }
        }
        _ => named().or(peer),
    }
}

/// The connection's peer, as the listener recorded it.
pub(crate) fn peer_of<B>(req: &Request<B>) -> Option<SocketAddr> {
    req.extensions()
        .get::<PeerIdentity>()
        .and_then(|p| p.remote_addr)
        .or_else(|| {
            req.extensions()
                .get::<tonic::transport::server::TcpConnectInfo>()
                .and_then(tonic::transport::server::TcpConnectInfo::remote_addr)
        })
}

#[cfg(test)]
mod tests {
    use tonic::body::Body;

    use super::*;

    fn request(headers: &[(&'static str, &str)]) -> Request<Body> {
        let mut req = Request::new(Body::empty());
        for (name, value) in headers {
            req.headers_mut().insert(*name, value.parse().unwrap());
        }
        req
    }

    #[test]
    fn the_node_address_a_request_names_is_believed_from_servers_alone() {
        let peer: SocketAddr = "10.0.0.2:4000".parse().unwrap();
        let named = "10.0.0.9:5000";
        let with = |names: &[&str]| {
            let mut req = request(&[(SENT_ON_FOR_HEADER, named)]);
            req.extensions_mut().insert(PeerIdentity {
                remote_addr: Some(peer),
                cert_names: names.iter().map(|n| n.to_string()).collect(),
            });
            node_addr_of(&req, "global")
        };
        assert_eq!(with(&["server.global.berth"]), Some(named.parse().unwrap()));
        assert_eq!(with(&["client.global.berth"]), Some(peer));
        assert_eq!(with(&["server.eu.berth"]), Some(peer));
        // Without TLS nothing is proved of any peer.
        assert_eq!(with(&[]), Some(named.parse().unwrap()));
        let mut plain = request(&[]);
        plain.extensions_mut().insert(PeerIdentity {
            remote_addr: Some(peer),
            cert_names: vec![],
        });
        assert_eq!(node_addr_of(&plain, "global"), Some(peer));
    }
}
