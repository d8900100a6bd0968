use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};

use super::*;

/// A body that never ends: a node's stream while the node is there.
struct Open;

impl http_body::Body for Open {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Pending
    }
}

/// An HTTP/2 server that takes `streams` streams on one connection and
/// answers each with headers and a body that stays open; its address,
/// and how many requests it took.
async fn leader(streams: u32) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let taken = Arc::new(AtomicUsize::new(0));
    let counted = taken.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            let svc = hyper::service::service_fn(move |_req| {
                counted.fetch_add(1, Ordering::SeqCst);
                async {
                    let resp = axum::http::Response::builder()
                        .header("content-type", "application/grpc")
                        .body(Open)
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(streams)
                    .serve_connection(TokioIo::new(tcp), svc),
            );
        }
    });
    (addr, taken)
}

fn request(path: &str) -> axum::http::Request<Body> {
    axum::http::Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap()
}

const WATCH: &str = "/berth.v1.Node/WatchAllocations";
const HEARTBEAT: &str = "/berth.v1.Node/Heartbeat";

#[tokio::test]
async fn long_lived_streams_past_a_connections_share_go_over_new_connections() {
    // The leader takes three streams a connection; two of them may be
    // long-lived.
    let (addr, taken) = leader(3).await;
    let conns = LeaderConns::with_limits(None, "c1", 2, 3);
    let mut open = Vec::new();
    for n in 1..=6 {
        // Each answer comes: none waits for another stream to end.
        let resp = tokio::time::timeout(Duration::from_secs(10), conns.send(&addr, request(WATCH)))
            .await
            .unwrap_or_else(|_| panic!("stream {n} was held back"))
            .unwrap();
        assert_eq!(resp.status(), 200);
        open.push(resp);
    }
    assert_eq!(taken.load(Ordering::SeqCst), 6);
    assert_eq!(conns.open(), vec![(2, 2), (2, 2), (2, 2)]);

    // Past its connections a follower refuses a long-lived stream, naming
    // why, rather than holding it...
    let e = conns.send(&addr, request(WATCH)).await.unwrap_err();
    assert!(
        e.contains("6 long-lived streams to the leader already"),
        "{e}"
    );
    assert_eq!(taken.load(Ordering::SeqCst), 6);
    // ...while a short call still goes, in the room kept for them.
    let short = tokio::time::timeout(
        Duration::from_secs(10),
        conns.send(&addr, request(HEARTBEAT)),
    )
    .await
    .expect("a short call was held back")
    .unwrap();
    assert_eq!(taken.load(Ordering::SeqCst), 7);
    assert_eq!(conns.open()[0], (3, 2));
    drop(short);

    // Streams that end give their places back; an idle connection past
    // the first closes.
    open.truncate(1);
    let (_, slot) = conns.slot(&addr, true).unwrap();
    assert_eq!(conns.open(), vec![(2, 2)]);
    drop(slot);
    drop(open);
    assert_eq!(conns.open(), vec![(0, 0)]);
}

#[tokio::test]
async fn a_new_leader_gets_new_connections() {
    let (first, _) = leader(8).await;
    let (second, taken) = leader(8).await;
    let conns = LeaderConns::with_limits(None, "c1", 8, 2);
    let _at_first = conns.send(&first, request(WATCH)).await.unwrap();
    let _at_second = conns.send(&second, request(WATCH)).await.unwrap();
    assert_eq!(taken.load(Ordering::SeqCst), 1);
    assert_eq!(conns.open(), vec![(1, 1)]);
}
