//! A TCP relay for tests that can go silent: while partitioned it drops
//! every byte both ways without closing anything, and the connections it
//! carried before a heal stay silent for good (as when a firewall or NAT
//! forgets a flow), so only new connections reach the server again. A
//! client notices only by its own keepalives and deadlines.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Shared {
    partitioned: AtomicBool,
    /// While set, new connections are closed as soon as they are accepted
    /// (as by a server that is down).
    refusing: AtomicBool,
    /// How many connections were closed so.
    refused: AtomicU64,
    /// Connections numbered below this are silent for good.
    dead_below: AtomicU64,
    next_conn: AtomicU64,
}

impl Shared {
    fn passes(&self, conn: u64) -> bool {
        !self.partitioned.load(Ordering::SeqCst) && conn >= self.dead_below.load(Ordering::SeqCst)
    }
}

pub struct SilentRelay {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl SilentRelay {
    /// A relay on loopback to `upstream`, forwarding.
    pub async fn start(upstream: SocketAddr) -> SilentRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay binds");
        let addr = listener.local_addr().expect("relay address");
        let shared = Arc::new(Shared {
            partitioned: AtomicBool::new(false),
            refusing: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            dead_below: AtomicU64::new(0),
            next_conn: AtomicU64::new(0),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                if s.refusing.load(Ordering::SeqCst) {
                    s.refused.fetch_add(1, Ordering::SeqCst);
                    drop(down);
                    continue;
                }
                let conn = s.next_conn.fetch_add(1, Ordering::SeqCst);
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(up) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    let a = tokio::spawn(pump(dr, uw, s.clone(), conn));
                    let b = tokio::spawn(pump(ur, dw, s, conn));
                    let _ = tokio::join!(a, b);
                });
            }
        });
        SilentRelay {
            addr,
            shared,
            accept,
        }
    }

    /// Drops every byte from now on, closing nothing.
    pub fn partition(&self) {
        self.shared.partitioned.store(true, Ordering::SeqCst);
    }

    /// Closes every new connection at once while `on` (a server that is
    /// down but whose machine answers).
    pub fn refuse(&self, on: bool) {
        self.shared.refusing.store(on, Ordering::SeqCst);
    }

    /// How many connections were closed while refusing.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// New connections pass again; those made before stay silent.
    pub fn heal(&self) {
        let n = self.shared.next_conn.load(Ordering::SeqCst);
        self.shared.dead_below.store(n, Ordering::SeqCst);
        self.shared.partitioned.store(false, Ordering::SeqCst);
    }
}

impl Drop for SilentRelay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    conn: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if shared.passes(conn) && to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
