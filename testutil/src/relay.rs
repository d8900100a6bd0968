//! A TCP relay a test controls, put between a client and its server to
//! make network partitions on one machine.
//!
//! While forwarding, bytes pass both ways unchanged. A *silent* partition
//! drops every byte in both directions without closing or resetting any
//! connection, as a broken switch or a firewall that drops packets would:
//! the client sees nothing but silence, and must notice by its own
//! deadlines and keepalives. New connections made during the partition are
//! accepted (the kernel would complete the handshake on the relay's side
//! anyway) and go nowhere. [`Relay::heal`] closes the connections that lost
//! bytes (their byte streams are broken) and lets new ones through;
//! [`Relay::heal_new_only`] leaves every older connection silent for good,
//! as a firewall or NAT that forgot the flows would, so that only the
//! client's keepalives can notice. [`Relay::refuse`] closes every new
//! connection at once, as a machine whose server is down does.

use berth_sync::MutexExt;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::io::Result;

/// How often a pump looks at the relay's mode while its socket is quiet.
const POLL: Duration = Duration::from_millis(50);

struct Shared {
    upstream: SocketAddr,
    partitioned: AtomicBool,
    closed: AtomicBool,
    refusing: AtomicBool,
    refused: AtomicU64,
    /// Connections numbered below this stay silent for good.
    dead_below: AtomicU64,
    next_conn: AtomicU64,
    /// Bumped at each heal: a connection that saw a partition of an older
    /// generation is closed.
    generation: AtomicU64,
    conns: Mutex<Vec<Conn>>,
}

struct Conn {
    downstream: TcpStream,
    upstream: Option<TcpStream>,
    /// Set when the connection lost bytes to a partition.
    broken: Arc<AtomicBool>,
}

impl Conn {
    fn close(&self) {
        let _ = self.downstream.shutdown(Shutdown::Both);
        if let Some(u) = &self.upstream {
            let _ = u.shutdown(Shutdown::Both);
        }
    }
}

/// A relay on a loopback port in front of `upstream`. Dropping it closes
/// every connection.
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Relay {
    /// Starts relaying to `upstream`.
    pub fn start(upstream: SocketAddr) -> Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            partitioned: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            refusing: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            dead_below: AtomicU64::new(0),
            next_conn: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("relay-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(Relay { addr, shared })
    }

    /// The address the client dials.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every byte from now on, closing nothing.
    pub fn partition(&self) {
        self.shared.partitioned.store(true, Ordering::SeqCst);
    }

    /// Forwards again; connections that lost bytes are closed.
    pub fn heal(&self) {
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        self.shared.partitioned.store(false, Ordering::SeqCst);
        let mut conns = self.shared.conns.locked();
        conns.retain(|c| {
            let broken = c.broken.load(Ordering::SeqCst);
            if broken {
                c.close();
            }
            !broken
        });
    }

    /// Forwards again for new connections only: every connection made
    /// before stays silent for good.
    pub fn heal_new_only(&self) {
        let n = self.shared.next_conn.load(Ordering::SeqCst);
        self.shared.dead_below.store(n, Ordering::SeqCst);
        self.shared.partitioned.store(false, Ordering::SeqCst);
    }

    /// While `on`, closes every new connection as soon as it is accepted.
    pub fn refuse(&self, on: bool) {
        self.shared.refusing.store(on, Ordering::SeqCst);
    }

    /// How many connections were closed while refusing.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    pub fn is_partitioned(&self) -> bool {
        self.shared.partitioned.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        for c in self.shared.conns.locked().drain(..) {
            c.close();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.closed.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((down, _)) => {
                if shared.refusing.load(Ordering::SeqCst) {
                    shared.refused.fetch_add(1, Ordering::SeqCst);
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                }
                if let Err(e) = relay_conn(down, &shared) {
                    eprintln!("relay: connection failed: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) => {
                eprintln!("relay: accept failed: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

fn relay_conn(down: TcpStream, shared: &Arc<Shared>) -> Result<()> {
    down.set_nonblocking(false)?;
    let number = shared.next_conn.fetch_add(1, Ordering::SeqCst);
    down.set_nodelay(true)?;
    let broken = Arc::new(AtomicBool::new(false));
    // During a partition the server is not reached at all: the connection
    // is held open and swallows what the client sends.
    let up = if shared.partitioned.load(Ordering::SeqCst) {
        broken.store(true, Ordering::SeqCst);
        None
    } else {
        match TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(2)) {
            Ok(u) => {
                u.set_nodelay(true)?;
                Some(u)
            }
            // Nothing listens upstream: refuse as the server would.
            Err(_) => {
                let _ = down.shutdown(Shutdown::Both);
                return Ok(());
            }
        }
    };
    let generation = shared.generation.load(Ordering::SeqCst);
    let conn = Conn {
        downstream: down.try_clone()?,
        upstream: match &up {
            Some(u) => Some(u.try_clone()?),
            None => None,
        },
        broken: broken.clone(),
    };
    shared.conns.locked().push(conn);
    match up {
        Some(up) => {
            let ends = Ends { number, generation };
            spawn_pump(
                down.try_clone()?,
                Some(up.try_clone()?),
                shared,
                &broken,
                ends,
            )?;
            spawn_pump(up, Some(down), shared, &broken, ends)?;
        }
        None => spawn_pump(down, None, shared, &broken, Ends { number, generation })?,
    }
    Ok(())
}

/// Which connection a pump serves: its number, and the heal generation
/// it was made in.
#[derive(Clone, Copy)]
struct Ends {
    number: u64,
    generation: u64,
}

fn spawn_pump(
    from: TcpStream,
    to: Option<TcpStream>,
    shared: &Arc<Shared>,
    broken: &Arc<AtomicBool>,
    ends: Ends,
) -> Result<()> {
    let shared = shared.clone();
    let broken = broken.clone();
    std::thread::Builder::new()
        .name("relay-pump".into())
        .spawn(move || pump(from, to, &shared, &broken, ends))?;
    Ok(())
}

/// Copies `from` to `to`, or drops what it reads while partitioned (or
/// when there is no `to`). Ends when either side closes, or when a heal
/// finds the connection broken.
fn pump(
    mut from: TcpStream,
    mut to: Option<TcpStream>,
    shared: &Shared,
    broken: &AtomicBool,
    ends: Ends,
) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.closed.load(Ordering::SeqCst) {
            break;
        }
        let healed_since = shared.generation.load(Ordering::SeqCst) != ends.generation;
        if broken.load(Ordering::SeqCst) && healed_since {
            break;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let silent_for_good = ends.number < shared.dead_below.load(Ordering::SeqCst);
        if shared.partitioned.load(Ordering::SeqCst) || to.is_none() || silent_for_good {
            broken.store(true, Ordering::SeqCst);
            continue;
        }
        let Some(out) = to.as_mut() else { continue };
        if out.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    if let Some(out) = to {
        let _ = out.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    let mut w = s;
                    let _ = std::io::copy(&mut r, &mut w);
                });
            }
        });
        addr
    }

    fn round_trip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn a_silent_partition_drops_bytes_without_closing_and_a_heal_closes_broken_streams() {
        let relay = Relay::start(echo()).unwrap();
        let mut c = TcpStream::connect(relay.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        assert_eq!(round_trip(&mut c, b"hello").unwrap(), b"hello");

        relay.partition();
        // Nothing comes back, and the connection is not closed either.
        let e = round_trip(&mut c, b"lost").unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{e:?}"
        );
        // A connection made during the partition reaches nothing.
        let mut during = TcpStream::connect(relay.addr()).unwrap();
        during
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert!(round_trip(&mut during, b"x").is_err());

        relay.heal();
        // The broken connection is closed; a new one works.
        let mut buf = [0u8; 8];
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            match c.read(&mut buf) {
                Ok(0) => break,
                Err(e) if e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::TimedOut => {
                    break
                }
                _ => assert!(
                    std::time::Instant::now() < deadline,
                    "the broken stream was not closed"
                ),
            }
        }
        let mut fresh = TcpStream::connect(relay.addr()).unwrap();
        fresh
            .set_read_timeout(Some(Duration::from_millis(2000)))
            .unwrap();
        assert_eq!(round_trip(&mut fresh, b"again").unwrap(), b"again");
    }

    fn echoes(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut got = [0u8; 2];
        s.write_all(b"hi").is_ok() && s.read_exact(&mut got).is_ok() && &got == b"hi"
    }

    #[test]
    fn heal_new_only_leaves_older_connections_silent_for_good() {
        let relay = Relay::start(echo()).unwrap();
        let mut old = TcpStream::connect(relay.addr()).unwrap();
        assert!(echoes(&mut old));
        relay.partition();
        relay.heal_new_only();
        assert!(!echoes(&mut old), "an older connection stays silent");
        let mut new = TcpStream::connect(relay.addr()).unwrap();
        assert!(echoes(&mut new), "a new connection passes");
    }

    #[test]
    fn refuse_closes_new_connections_and_counts_them() {
        let relay = Relay::start(echo()).unwrap();
        relay.refuse(true);
        let mut c = TcpStream::connect(relay.addr()).unwrap();
        assert!(!echoes(&mut c));
        assert!(relay.refused() >= 1);
        relay.refuse(false);
        let mut c = TcpStream::connect(relay.addr()).unwrap();
        assert!(echoes(&mut c));
    }
}
