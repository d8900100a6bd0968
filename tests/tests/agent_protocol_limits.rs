//! The agent protocol reads little of a peer it does not know: on a real
//! `berth agent -dev`, streams that announce huge messages and hold back
//! their last byte are refused at the message's header, streams within
//! their method's limit hold at most the peer's budget, and the agent's
//! resident memory stays small throughout.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use berth_tests::{free_port, rss_kib, DevAgent};
use http_body::Frame;
use tonic::codegen::http;
use tonic::codegen::Bytes;
use tower::{Service, ServiceExt};

const MIB: usize = 1024 * 1024;
/// What the agent may reach under the attack.
const RSS_LIMIT_KIB: u64 = 100 * 1024;

/// A gRPC request body that announces one message of `len` bytes, sends
/// all of it but the last byte, and then waits forever.
struct Announce {
    header: Option<Bytes>,
    left: usize,
}

impl Announce {
    fn new(len: usize) -> Announce {
        let mut h = vec![0u8];
        h.extend_from_slice(&(len as u32).to_be_bytes());
        Announce {
            header: Some(Bytes::from(h)),
            left: len.saturating_sub(1),
        }
    }
}

impl http_body::Body for Announce {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(h) = self.header.take() {
            return Poll::Ready(Some(Ok(Frame::data(h))));
        }
        if self.left > 0 {
            let n = self.left.min(MIB);
            self.left -= n;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![0u8; n])))));
        }
        // The last byte never comes.
        Poll::Pending
    }
}

/// Sends `method` on `channel` with a body announcing `len` bytes; the
/// gRPC status of the answer (`None`: no answer within `wait`).
async fn announce(
    channel: tonic::transport::Channel,
    method: &str,
    len: usize,
    wait: Duration,
) -> Result<Option<String>> {
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("/berth.v1.Node/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(
            berth_proto::berth::v1::NODE_SECRET_METADATA,
            "made-up-secret-0123456789abcdef0123",
        )
        .body(tonic::body::Body::new(Announce::new(len)))?;
    let mut channel = channel;
    let call = async {
        let svc = channel.ready().await?;
        let resp = svc.call(req).await?;
        anyhow::Ok(
            resp.headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_string(),
        )
    };
    match tokio::time::timeout(wait, call).await {
        Ok(status) => status.map(Some),
        Err(_) => Ok(None),
    }
}

/// The agent's resident memory now, in KiB.
fn rss(agent: &DevAgent) -> Result<u64> {
    rss_kib(agent.pid().context("the agent runs")?).context("the agent's VmRSS")
}

#[test]
fn streams_announcing_huge_messages_do_not_grow_the_agent() -> Result<()> {
    let rpc = format!("127.0.0.1:{}", free_port());
    let agent = DevAgent::start_with_args(&["-rpc-addr", &rpc])?;
    let before = rss(&agent)?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut peak = before;
    rt.block_on(async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{rpc}"))?
            .connect()
            .await?;
        // 16 streams each announcing 64 MiB, as the review's attack did:
        // each is refused at its header (RESOURCE_EXHAUSTED, 8).
        let calls: Vec<_> = (0..16)
            .map(|i| {
                let method = if i % 2 == 0 { "Heartbeat" } else { "Register" };
                tokio::spawn(announce(
                    channel.clone(),
                    method,
                    64 * MIB,
                    Duration::from_secs(20),
                ))
            })
            .collect();
        for c in calls {
            let status = c.await??;
            assert_eq!(status.as_deref(), Some("8"), "a 64 MiB announcement");
        }
        peak = peak.max(rss(&agent)?);

        // Streams within their method's limit that never finish hold the
        // peer's budget at most: of 40 registers of 1 MiB held open, the
        // ones past 24 MiB are refused at once.
        let held: Vec<_> = (0..40)
            .map(|_| {
                tokio::spawn(announce(
                    channel.clone(),
                    "Register",
                    MIB,
                    Duration::from_secs(3),
                ))
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            peak = peak.max(rss(&agent)?);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut refused = 0;
        let mut waiting = 0;
        for c in held {
            match c.await?? {
                Some(s) if s == "8" => refused += 1,
                None => waiting += 1,
                other => bail!("a held register answered {other:?}"),
            }
        }
        assert!(refused >= 16, "only {refused} of 40 were refused");
        assert!(waiting >= 16, "only {waiting} of 40 were held");
        anyhow::Ok(())
    })?;
    drop(rt);
    eprintln!("agent RSS: {before} KiB before, at most {peak} KiB under the attack");
    assert!(
        peak < RSS_LIMIT_KIB,
        "the agent grew from {before} KiB to {peak} KiB under the attack"
    );
    // The agent still serves.
    agent.cli_ok(&["node", "status"])?;
    Ok(())
}
