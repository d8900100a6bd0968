//! How a server that does not lead sends the agent protocol on to the
//! leader: the request of a node (a register, a heartbeat, an alloc watch,
//! the call stream...) goes to the leader as it came, bodies streamed both
//! ways, and the leader's answer comes back as this server's, so a node
//! may stay with whichever server it reached (as Nomad's followers forward
//! RPCs). The leader takes it as the node's own, but for two headers this
//! server sets: [`SENT_ON_BY_HEADER`], so that a request is sent on once
//! at most (a server that does not lead either refuses it), and
//! [`SENT_ON_FOR_HEADER`], the node's address, which the leader's
//! per-address limits count instead of this server's.

use std::future::Future;
use std::pin::Pin;

use tonic::body::Body;
use tonic::codegen::http::{HeaderValue, Request, Response};

use crate::leader::ServerIdentity;
use crate::peer::peer_of;

/// How many calls one agent protocol connection carries at once (a
/// client holds a few streams and short calls; a forwarded blocking query
/// holds one while it waits). A server that sends the nodes' streams on
/// to the leader spreads them over as many connections as they need.
pub const MAX_RPC_STREAMS_PER_CONNECTION: u32 = 256;

/// Names the server that sent a request on to the leader.
pub const SENT_ON_BY_HEADER: &str = "x-berth-sent-on-by";

/// The address of the node a server sent a request on for.
pub const SENT_ON_FOR_HEADER: &str = "x-berth-sent-on-for";

/// The answer of a request sent on, or why it got none.
pub type SentOn = Pin<Box<dyn Future<Output = Result<Response<Body>, String>> + Send>>;

/// A way to the leader's agent protocol, with this agent's TLS: the
/// agent provides it (it holds the certificates).
pub trait LeaderLink: Send + Sync + 'static {
    /// Sends `req` to the agent protocol at `rpc_addr` (`HOST:PORT`).
    fn send(&self, rpc_addr: &str, req: Request<Body>) -> SentOn;
}

/// Sends the node's request `req` on to `leader` over `link`, as this
/// server (`by`); the leader's answer, or `UNAVAILABLE` naming why there
/// is none (which sends the node on to its next server).
pub(crate) async fn send_on(
    link: &dyn LeaderLink,
    by: &HeaderValue,
    leader: &ServerIdentity,
    mut req: Request<Body>,
) -> Response<Body> {
    let peer = peer_of(&req);
    let headers = req.headers_mut();
    headers.insert(SENT_ON_BY_HEADER, by.clone());
    headers.remove(SENT_ON_FOR_HEADER);
    if let Some(value) = peer.and_then(|p| HeaderValue::from_str(&p.to_string()).ok()) {
        headers.insert(SENT_ON_FOR_HEADER, value);
    }
    match link.send(&leader.rpc_addr, req).await {
        Ok(resp) => resp,
        Err(why) => {
            tracing::debug!(leader = %leader.rpc_addr, error = %why, "sending a node's request on to the leader failed");
            tonic::Status::unavailable(format!(
                "this server does not lead, and sending the request on to the leader {} ({}) \
                 failed: {why}",
                leader.name, leader.rpc_addr
            ))
            .into_http()
        }
    }
}

/// Whether `req` was sent on by another server.
pub(crate) fn was_sent_on<B>(req: &Request<B>) -> bool {
    req.headers().contains_key(SENT_ON_BY_HEADER)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tower::{Layer, ServiceExt};

    use std::net::SocketAddr;

    use super::*;
    use crate::leader::Role;
    use crate::peer::PeerIdentity;

    /// A link that records what it was given and answers `OK`.
    #[derive(Default)]
    struct Recorded(Mutex<Vec<(String, Request<Body>)>>);

    impl LeaderLink for Recorded {
        fn send(&self, rpc_addr: &str, req: Request<Body>) -> SentOn {
            self.0.lock().unwrap().push((rpc_addr.to_string(), req));
            Box::pin(async { Ok(tonic::Status::ok("").into_http()) })
        }
    }

    fn request(headers: &[(&'static str, &str)]) -> Request<Body> {
        let mut req = Request::new(Body::empty());
        *req.uri_mut() = "/berth.v1.Node/Heartbeat".parse().unwrap();
        for (name, value) in headers {
            req.headers_mut().insert(*name, value.parse().unwrap());
        }
        req
    }

    fn grpc_status(resp: &Response<Body>) -> String {
        let status = resp.headers().get("grpc-status").unwrap().to_str().unwrap();
        status.to_string()
    }

    #[tokio::test]
    async fn a_standby_sends_a_request_on_once_naming_itself_and_the_node() {
        let leader = ServerIdentity {
            name: "s1".into(),
            rpc_addr: "10.0.0.1:4647".into(),
            http_addr: "10.0.0.1:4646".into(),
        };
        let (_tx, role) = tokio::sync::watch::channel(Role::Standby {
            leader: Some(leader),
        });
        let link = Arc::new(Recorded::default());
        let layer = crate::ClusterIdLayer::new("c1")
            .unwrap()
            .leader_only(role)
            .sending_on(link.clone(), "s2");
        // What the standby's own services would answer.
        let served = tower::service_fn(|_req: Request<Body>| async {
            let mut here = tonic::Status::internal("served by the standby").into_http();
            here.headers_mut()
                .insert("x-served-here", HeaderValue::from_static("1"));
            Ok::<_, std::convert::Infallible>(here)
        });
        let svc = layer.layer(served);

        let mut req = request(&[(SENT_ON_FOR_HEADER, "6.6.6.6:1")]);
        let node: SocketAddr = "10.0.0.9:5000".parse().unwrap();
        req.extensions_mut().insert(PeerIdentity {
            remote_addr: Some(node),
            cert_names: vec![],
        });
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert!(!resp.headers().contains_key("x-served-here"));
        assert_eq!(grpc_status(&resp), "0");
        assert_eq!(
            resp.headers()[berth_proto::berth::v1::CLUSTER_ID_HEADER],
            "c1"
        );
        {
            let sent = link.0.lock().unwrap();
            let (to, sent) = &sent[0];
            assert_eq!(to, "10.0.0.1:4647");
            assert_eq!(sent.headers()[SENT_ON_BY_HEADER], "s2");
            // The node's own address, not what the node claimed.
            assert_eq!(sent.headers()[SENT_ON_FOR_HEADER], "10.0.0.9:5000");
        }

        // A request another server sent on is not sent on again.
        let resp = svc
            .oneshot(request(&[(SENT_ON_BY_HEADER, "s3")]))
            .await
            .unwrap();
        assert!(!resp.headers().contains_key("x-served-here"));
        assert_eq!(grpc_status(&resp), "14");
        assert_eq!(link.0.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_standby_serves_alloc_watches_itself_only_while_its_tables_are_current() {
        let (_tx, role) = tokio::sync::watch::channel(Role::Standby {
            leader: Some(ServerIdentity {
                name: "s1".into(),
                rpc_addr: "10.0.0.1:4647".into(),
                http_addr: "10.0.0.1:4646".into(),
            }),
        });
        let (current, tables_current) = tokio::sync::watch::channel(true);
        let link = Arc::new(Recorded::default());
        let layer = crate::ClusterIdLayer::new("c1")
            .unwrap()
            .leader_only(role)
            .sending_on(link.clone(), "s2")
            .watching_locally_while(tables_current);
        let served = tower::service_fn(|_req: Request<Body>| async {
            let mut here = tonic::Status::ok("").into_http();
            here.headers_mut()
                .insert("x-served-here", HeaderValue::from_static("1"));
            Ok::<_, std::convert::Infallible>(here)
        });
        let svc = layer.layer(served);
        let watch = || {
            let mut req = request(&[]);
            *req.uri_mut() = "/berth.v1.Node/WatchAllocations".parse().unwrap();
            req
        };

        let resp = svc.clone().oneshot(watch()).await.unwrap();
        assert!(resp.headers().contains_key("x-served-here"));
        // Anything else goes to the leader.
        let resp = svc.clone().oneshot(request(&[])).await.unwrap();
        assert!(!resp.headers().contains_key("x-served-here"));
        assert_eq!(link.0.lock().unwrap().len(), 1);

        current.send_replace(false);
        let resp = svc.oneshot(watch()).await.unwrap();
        assert!(!resp.headers().contains_key("x-served-here"));
        assert_eq!(link.0.lock().unwrap().len(), 2);
    }
}
