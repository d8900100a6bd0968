//! What the agent protocol reads of a peer before it knows who the peer
//! is. tonic reserves a buffer of the size a message announces as soon as
//! it has read the message's 5-byte header, and a handler authenticates
//! only once its request is decoded; so without these limits any peer
//! that can open a connection makes the agent hold whatever it announces.
//!
//! [`Limited`] wraps a gRPC service and, before tonic sees anything:
//! - refuses a call with no well-formed node secret in its metadata
//!   (every `Node` and `CSIVolume` method), and takes `Node.Register`'s
//!   rate limit from the peer's address, both from the headers alone;
//! - refuses a message larger than its method's limit as soon as the
//!   header announcing it arrives ([`MethodLimit`]: a heartbeat is a few
//!   bytes, a register at most a node's JSON; only the call stream's
//!   replies, read after the stream's hello was authenticated, may be
//!   large);
//! - counts the bytes of messages announced and not yet wholly received
//!   against a budget per peer address and one for the whole agent
//!   ([`PartialBudget`]), and refuses a message that does not fit.
//!
//! A refusal is a `ResourceExhausted` (or `PermissionDenied`) status that
//! names the limit; the stream ends and what it held is freed.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use berth_proto::berth::v1::NODE_SECRET_METADATA;
use http_body::Frame;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::{BoxFuture, Bytes, Service};
use tonic::server::NamedService;
use tonic::Status;

use crate::partial_budget::{Charge, PartialBudget};
use crate::server::Server;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// What a method may be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodLimit {
    /// The method's path, `/<package>.<Service>/<Method>`.
    pub path: &'static str,
    /// The most bytes of the first message of a call.
    pub first: usize,
    /// The most bytes of each later message (a client stream's).
    pub rest: usize,
    /// Whether the call must carry a node secret in its metadata.
    pub node_secret: bool,
    /// Whether the call counts against `Node.Register`'s rate limit.
    pub register_rate: bool,
    /// Whether the handler authenticates the first message before it
    /// reads a later one (the call stream's hello): later messages then
    /// count against the agent's whole budget only, not the peer's.
    pub rest_authenticated: bool,
}

impl MethodLimit {
    /// A unary method of a node, whose request is at most `max` bytes.
    pub const fn node(path: &'static str, max: usize) -> MethodLimit {
        MethodLimit {
            path,
            first: max,
            rest: max,
            node_secret: true,
            register_rate: false,
            rest_authenticated: false,
        }
    }

    /// A method any agent may call, with requests of at most `max` bytes.
    pub const fn open(path: &'static str, max: usize) -> MethodLimit {
        MethodLimit {
            path,
            first: max,
            rest: max,
            node_secret: false,
            register_rate: false,
            rest_authenticated: false,
        }
    }
}

/// The limit of a path no table names: tonic answers it `Unimplemented`,
/// after reading at most this much.
const UNKNOWN_METHOD: MethodLimit = MethodLimit::open("", 4 * KIB);

use crate::partial_budget::CALL_REPLY;

/// The `Node` service's methods.
pub const NODE_METHODS: &[MethodLimit] = &[
    MethodLimit {
        register_rate: true,
        ..MethodLimit::node(
            "/berth.v1.Node/Register",
            berth_proto::berth::v1::MAX_REGISTER_NODE_JSON + 64 * KIB,
        )
    },
    MethodLimit::node("/berth.v1.Node/Heartbeat", 4 * KIB),
    MethodLimit::node("/berth.v1.Node/WatchAllocations", 4 * KIB),
    // The client sends batches of about 1 MiB; one alloc with a long
    // history of task events goes alone.
    MethodLimit::node("/berth.v1.Node/UpdateAllocations", 16 * MIB),
    MethodLimit::node("/berth.v1.Node/EmitEvents", 4 * MIB),
    MethodLimit::node("/berth.v1.Node/UpdatePlugins", 4 * MIB),
    // The hello is read and authenticated before any reply.
    MethodLimit {
        first: 4 * KIB,
        rest: CALL_REPLY,
        rest_authenticated: true,
        ..MethodLimit::node("/berth.v1.Node/OpenCallStream", 0)
    },
];

/// The `CSIVolume` service's methods.
pub const CSI_VOLUME_METHODS: &[MethodLimit] = &[
    MethodLimit::node("/berth.v1.CSIVolume/Claim", 64 * KIB),
    MethodLimit::node("/berth.v1.CSIVolume/Unpublish", 64 * KIB),
];

/// A gRPC service behind the checks of this module.
#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    methods: &'static [MethodLimit],
    budget: Arc<PartialBudget>,
    server: Arc<Server>,
}

impl<S> Limited<S> {
    /// `inner`, whose methods are `methods`, counting against `server`'s
    /// budget of partly received messages.
    pub fn new(inner: S, methods: &'static [MethodLimit], server: &Arc<Server>) -> Limited<S> {
        Limited {
            inner,
            methods,
            budget: server.partial_budget().clone(),
            server: server.clone(),
        }
    }

    fn method(&self, path: &str) -> MethodLimit {
        self.methods
            .iter()
            .find(|m| m.path == path)
            .copied()
            .unwrap_or(UNKNOWN_METHOD)
    }

    /// The address of the node that made `req` (see
    /// [`crate::peer::node_addr_of`]).
    fn node_addr<B>(&self, req: &Request<B>) -> Option<SocketAddr> {
        crate::peer::node_addr_of(req, &self.server.config().region)
    }

    /// Why a call is refused from its headers alone, if it is.
    fn refusal<B>(&self, method: &MethodLimit, req: &Request<B>) -> Option<Status> {
        if method.node_secret {
            let header = req.headers().get(NODE_SECRET_METADATA);
            let why = super::secret_of(header.map(|v| v.to_str().map_err(drop))).err();
            if let Some(why) = why {
                tracing::warn!(peer = ?self.node_addr(req), rpc = method.path, "node RPC refused: {why}");
                return Some(Status::permission_denied(format!("{}: {why}", method.path)));
            }
        }
        if method.register_rate {
            if let Err(e) =
                super::check_register_rate(self.server.register_limiter(), self.node_addr(req))
            {
                return Some(e.into());
            }
        }
        None
    }
}

impl<S: NamedService> NamedService for Limited<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for Limited<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Response<Body>, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let method = self.method(req.uri().path());
        if let Some(status) = self.refusal(&method, &req) {
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let peer = self.node_addr(&req).map(|a| a.ip());
        let budget = self.budget.clone();
        let req = req.map(|body| {
            Body::new(LimitedBody {
                inner: body,
                method,
                peer,
                budget,
                header: [0; 5],
                header_read: 0,
                remaining: 0,
                messages: 0,
                charge: None,
            })
        });
        Box::pin(self.inner.call(req))
    }
}

/// A request body read frame by frame, checking each gRPC message's
/// header (1 byte of compression flag, 4 of length) as it passes.
struct LimitedBody {
    inner: Body,
    method: MethodLimit,
    peer: Option<IpAddr>,
    budget: Arc<PartialBudget>,
    header: [u8; 5],
    header_read: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
    /// Messages whose header was read.
    messages: u64,
    /// What the current message holds of the budget.
    charge: Option<Charge>,
}

impl LimitedBody {
    /// Walks `data` through the message framing; an error for a message
    /// over its limit or the budget.
    fn check(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut pos = 0;
        while pos < data.len() {
            if self.remaining > 0 {
                let take = self.remaining.min(data.len() - pos);
                self.remaining -= take;
                pos += take;
                if self.remaining == 0 {
                    self.charge = None;
                }
                continue;
            }
            self.header[self.header_read] = data[pos];
            self.header_read += 1;
            pos += 1;
            if self.header_read < self.header.len() {
                continue;
            }
            self.header_read = 0;
            let len = u32::from_be_bytes([
                self.header[1],
                self.header[2],
                self.header[3],
                self.header[4],
            ]) as usize;
            self.start_message(len)?;
        }
        Ok(())
    }

    fn start_message(&mut self, len: usize) -> Result<(), Status> {
        let limit = if self.messages == 0 {
            self.method.first
        } else {
            self.method.rest
        };
        self.messages += 1;
        let path = self.method.path;
        if len > limit {
            tracing::warn!(peer = ?self.peer, rpc = path, len, limit, "agent protocol: message over its method's limit refused");
            return Err(Status::resource_exhausted(format!(
                "{path}: a message of {len} bytes is over the method's limit of {limit} bytes"
            )));
        }
        self.charge = None;
        if len > 0 {
            let peer = if self.messages > 1 && self.method.rest_authenticated {
                None
            } else {
                self.peer
            };
            let charge = self.budget.charge(peer, len).map_err(|why| {
                tracing::warn!(peer = ?self.peer, rpc = path, len, "agent protocol: message refused: {why}");
                Status::resource_exhausted(format!("{path}: a message of {len} bytes refused: {why}"))
            })?;
            self.charge = Some(charge);
        }
        self.remaining = len;
        Ok(())
    }
}

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if let Err(status) = this.check(data) {
                        this.charge = None;
                        return Poll::Ready(Some(Err(status)));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(method: MethodLimit, budget: &Arc<PartialBudget>) -> LimitedBody {
        LimitedBody {
            inner: Body::empty(),
            method,
            peer: Some("10.0.0.1".parse().unwrap()),
            budget: budget.clone(),
            header: [0; 5],
            header_read: 0,
            remaining: 0,
            messages: 0,
            charge: None,
        }
    }

    fn header(len: u32) -> Vec<u8> {
        let mut h = vec![0u8];
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    #[test]
    fn a_message_over_its_methods_limit_is_refused_at_its_header() {
        let budget = PartialBudget::new(MIB, 4 * MIB);
        let mut b = body(MethodLimit::node("/x/Heartbeat", 4 * KIB), &budget);
        let status = b
            .check(&header(64 * MIB as u32))
            .expect_err("over the limit");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status.message().contains("limit of 4096 bytes"),
            "{status:?}"
        );
        assert_eq!(budget.total_held(), 0);
    }

    #[test]
    fn a_header_split_across_frames_is_read_whole() {
        let budget = PartialBudget::new(MIB, 4 * MIB);
        let mut b = body(MethodLimit::node("/x/Heartbeat", 16), &budget);
        let mut msg = header(10);
        msg.extend_from_slice(&[7; 10]);
        msg.extend_from_slice(&header(17));
        for chunk in msg[..13].chunks(2) {
            b.check(chunk).expect("within the limit");
        }
        let err = b.check(&msg[13..]).expect_err("the second is too large");
        assert!(err.message().contains("17 bytes"), "{err:?}");
    }

    #[test]
    fn partial_messages_count_against_the_peer_until_they_are_whole() {
        let budget = PartialBudget::new(100, 1000);
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let method = MethodLimit::node("/x/Big", 80);
        let mut one = body(method, &budget);
        one.check(&header(80)).expect("first");
        one.check(&[0; 30]).expect("part of it");
        assert_eq!(budget.held_by(peer), 80);
        let mut two = body(method, &budget);
        let err = two.check(&header(30)).expect_err("over the peer's budget");
        assert!(err.message().contains("10.0.0.1 already has"), "{err:?}");
        one.check(&[0; 50]).expect("the rest");
        assert_eq!(
            budget.held_by(peer),
            0,
            "a whole message gives its bytes back"
        );
        two.check(&header(30)).expect("fits now");
        drop(two);
        assert_eq!(
            budget.held_by(peer),
            0,
            "a dropped body gives its bytes back"
        );
    }

    #[test]
    fn the_first_message_of_a_stream_has_its_own_limit() {
        let budget = PartialBudget::new(MIB, 4 * MIB);
        let stream = NODE_METHODS
            .iter()
            .find(|m| m.path.ends_with("OpenCallStream"))
            .copied()
            .unwrap();
        let mut b = body(stream, &budget);
        assert!(b.check(&header(64 * KIB as u32)).is_err(), "a large hello");
        let mut b = body(stream, &budget);
        let mut hello = header(4);
        hello.extend_from_slice(&[1; 4]);
        b.check(&hello).expect("a small hello");
        b.check(&header(2 * MIB as u32))
            .expect("a large reply after it");
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(budget.held_by(peer), 0, "a reply counts in the total only");
        assert_eq!(budget.total_held(), 2 * MIB);
    }
}
