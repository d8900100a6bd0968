//! A TCP relay the test controls, put between a client agent and its
//! server to make network partitions on one machine.
//!
//! While forwarding, bytes pass both ways unchanged. A *silent* partition
//! drops every byte in both directions without closing or resetting any
//! connection, as a broken switch or a firewall that drops packets would:
//! the client sees nothing but silence, and must notice by its own
//! deadlines and keepalives. New connections made during the partition are
//! accepted (the kernel would complete the handshake on the relay's side
//! anyway) and go nowhere. When the partition heals, connections that lost
//! bytes to it are closed (their byte streams are broken), and new ones
//! reach the server again.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};

/// How often a pump looks at the relay's mode while its socket is quiet.
const POLL: Duration = Duration::from_millis(50);

struct Shared {
    upstream: SocketAddr,
    partitioned: AtomicBool,
    closed: AtomicBool,
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
    /// Starts relaying to `upstream` (`HOST:PORT`).
    pub fn start(upstream: &str) -> Result<Relay> {
        let upstream: SocketAddr = upstream
            .parse()
            .with_context(|| format!("relay upstream {upstream:?}"))?;
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the relay")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            partitioned: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("relay-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(Relay { addr, shared })
    }

    /// `HOST:PORT` the client dials.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Drops every byte from now on, closing nothing.
    pub fn partition(&self) {
        self.shared.partitioned.store(true, Ordering::SeqCst);
    }

    /// Forwards again; connections that lost bytes are closed.
    pub fn heal(&self) {
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        self.shared.partitioned.store(false, Ordering::SeqCst);
        let mut conns = lock(&self.shared.conns);
        conns.retain(|c| {
            let broken = c.broken.load(Ordering::SeqCst);
            if broken {
                c.close();
            }
            !broken
        });
    }

    pub fn is_partitioned(&self) -> bool {
        self.shared.partitioned.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        for c in lock(&self.shared.conns).drain(..) {
            c.close();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.closed.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((down, _)) => {
                if let Err(e) = relay_conn(down, &shared) {
                    eprintln!("relay: connection failed: {e:#}");
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
    lock(&shared.conns).push(conn);
    match up {
        Some(up) => {
            spawn_pump(
                down.try_clone()?,
                Some(up.try_clone()?),
                shared,
                &broken,
                generation,
            )?;
            spawn_pump(up, Some(down), shared, &broken, generation)?;
        }
        None => spawn_pump(down, None, shared, &broken, generation)?,
    }
    Ok(())
}

fn spawn_pump(
    from: TcpStream,
    to: Option<TcpStream>,
    shared: &Arc<Shared>,
    broken: &Arc<AtomicBool>,
    generation: u64,
) -> Result<()> {
    let shared = shared.clone();
    let broken = broken.clone();
    std::thread::Builder::new()
        .name("relay-pump".into())
        .spawn(move || pump(from, to, &shared, &broken, generation))?;
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
    generation: u64,
) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.closed.load(Ordering::SeqCst) {
            break;
        }
        let healed_since = shared.generation.load(Ordering::SeqCst) != generation;
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
        if shared.partitioned.load(Ordering::SeqCst) || to.is_none() {
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
    fn echo() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
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
        let relay = Relay::start(&echo()).unwrap();
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
        let closed = crate::wait_for("the broken stream closed", Duration::from_secs(5), || {
            Ok(match c.read(&mut buf) {
                Ok(0) => Some(()),
                Err(e) if e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::TimedOut => {
                    Some(())
                }
                _ => None,
            })
        });
        assert!(closed.is_ok());
        let mut fresh = TcpStream::connect(relay.addr()).unwrap();
        fresh
            .set_read_timeout(Some(Duration::from_millis(2000)))
            .unwrap();
        assert_eq!(round_trip(&mut fresh, b"again").unwrap(), b"again");
    }
}
