//! Real etcd members for the tests of the etcd store: the `etcd` binary
//! (Debian's `etcd-server`, which CI installs) started on free loopback
//! ports with its data in a temp dir, and killed when dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd member: a cluster of its own ([`Etcd::start`]), or one of an
/// [`EtcdCluster`].
pub struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    name: String,
    client_port: u16,
    peer_port: u16,
    /// `--initial-cluster`: every member's name and peer URL.
    initial_cluster: String,
    /// Serves its clients over TLS with these files.
    tls: Option<EtcdTlsFiles>,
    /// Where it serves `/health` in plain HTTP (`--listen-metrics-urls`).
    metrics_port: u16,
}

/// The files a member serves TLS with: its certificate and key, and the
/// CA its clients' certificates must chain to (`--client-cert-auth`).
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: PathBuf,
}

/// Several etcd members that form one cluster.
pub struct EtcdCluster {
    pub members: Vec<Etcd>,
}

impl EtcdCluster {
    /// Starts `n` members and waits until each answers healthy. Ports
    /// taken meanwhile by another test (they are picked free, then bound
    /// by etcd) are picked again.
    pub fn start(n: usize) -> EtcdCluster {
        for _ in 1..PORT_ATTEMPTS {
            match EtcdCluster::try_start(n) {
                Ok(cluster) => return cluster,
                Err(log) if lost_a_port(&log) => continue,
                Err(log) => panic!("etcd exited: {log}"),
            }
        }
        EtcdCluster::try_start(n).unwrap_or_else(|log| panic!("etcd exited: {log}"))
    }

    fn try_start(n: usize) -> Result<EtcdCluster, String> {
        // Distinct: a port picked and let go may be picked again.
        let mut free = free_ports(3 * n).into_iter();
        let mut next = || free.next().expect("as many ports as asked for");
        let ports: Vec<(u16, u16, u16)> = (0..n).map(|_| (next(), next(), next())).collect();
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer, _))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<Etcd> = ports
            .iter()
            .enumerate()
            .map(|(i, &(client_port, peer_port, metrics_port))| Etcd {
                child: None,
                dir: tempfile::tempdir().expect("etcd temp dir"),
                name: format!("m{i}"),
                client_port,
                peer_port,
                initial_cluster: initial_cluster.clone(),
                tls: None,
                metrics_port,
            })
            .collect();
        // All at once: a member waits for the others to elect a leader.
        for m in &mut members {
            m.spawn();
        }
        for m in &mut members {
            m.ready_or_exited()?;
        }
        Ok(EtcdCluster { members })
    }

    /// Every member's endpoint.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Etcd::endpoint).collect()
    }
}

/// The etcd binary: `$BERTH_TEST_ETCD`, or `etcd` on the `PATH`.
pub fn etcd_binary() -> PathBuf {
    std::env::var_os("BERTH_TEST_ETCD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("etcd"))
}

/// How many times a member is started on freshly picked ports.
const PORT_ATTEMPTS: usize = 3;

/// Whether a member's log says another process took one of its ports.
fn lost_a_port(log: &str) -> bool {
    log.contains("address already in use")
}

/// `count` distinct free loopback ports: each is held until all are
/// picked, so none is handed out twice.
fn free_ports(count: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("a bound port").port())
        .collect()
}

impl Etcd {
    /// Starts a one-member cluster and waits until it answers.
    pub fn start() -> Etcd {
        Etcd::start_with(None)
    }

    /// Starts a one-member cluster that serves its clients over TLS only
    /// and wants their certificates, and waits until it answers.
    pub fn start_tls(tls: EtcdTlsFiles) -> Etcd {
        Etcd::start_with(Some(tls))
    }

    /// A one-member cluster on free ports, picked again when another
    /// test took one meanwhile.
    fn start_with(tls: Option<EtcdTlsFiles>) -> Etcd {
        let attempt = || {
            let mut etcd = Etcd::on_free_ports(tls.clone());
            etcd.spawn();
            etcd.ready_or_exited().map(|()| etcd)
        };
        for _ in 1..PORT_ATTEMPTS {
            match attempt() {
                Ok(etcd) => return etcd,
                Err(log) if lost_a_port(&log) => continue,
                Err(log) => panic!("etcd exited: {log}"),
            }
        }
        attempt().unwrap_or_else(|log| panic!("etcd exited: {log}"))
    }

    fn on_free_ports(tls: Option<EtcdTlsFiles>) -> Etcd {
        let [client_port, peer_port, metrics_port] = free_ports(3)[..] else {
            unreachable!("free_ports gives as many as asked for")
        };
        Etcd {
            child: None,
            dir: tempfile::tempdir().expect("etcd temp dir"),
            name: "m0".into(),
            client_port,
            peer_port,
            initial_cluster: format!("m0=http://127.0.0.1:{peer_port}"),
            tls,
            metrics_port,
        }
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS), what the servers
    /// are given.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    fn run(&mut self) {
        self.spawn();
        self.wait_until_ready();
    }

    fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let mut command = Command::new(etcd_binary());
        if let Some(tls) = &self.tls {
            command
                .arg(format!("--cert-file={}", tls.cert_file.display()))
                .arg(format!("--key-file={}", tls.key_file.display()))
                .arg(format!(
                    "--trusted-ca-file={}",
                    tls.client_ca_file.display()
                ))
                .arg("--client-cert-auth");
        }
        let child = command
            .arg(format!("--name={}", self.name))
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={}", self.endpoint()))
            .arg(format!("--advertise-client-urls={}", self.endpoint()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={}", self.initial_cluster))
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ))
            .arg("--max-txn-ops=10000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting {} (install Debian's etcd-server): {e}",
                    etcd_binary().display()
                )
            });
        self.child = Some(child);
    }

    /// Waits until the member serves its health endpoint.
    fn wait_until_ready(&mut self) {
        if let Err(log) = self.ready_or_exited() {
            panic!("etcd exited: {log}");
        }
    }

    /// Waits until the member serves its health endpoint; Err with its
    /// exit status and log if it exits first.
    fn ready_or_exited(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = format!("127.0.0.1:{}", self.metrics_port);
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!("{status}: {}", self.log()));
            }
            if health_ok(&addr) {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy in 30s: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the member logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// Kills the member (SIGKILL); its data stays for [`Etcd::restart`].
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the member again on its data and ports, and waits until it
    /// answers healthy (in a cluster: until it has a leader).
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }

    /// Starts a killed member again without waiting (a member of a
    /// cluster without quorum waits for the others).
    pub fn restart_in_background(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Stops the member (SIGSTOP): it holds its connections and answers
    /// nothing, as a machine cut off from the network.
    pub fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Lets a paused member go on (SIGCONT).
    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(child) = &self.child {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            nix::sys::signal::kill(pid, signal).expect("signal etcd");
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // A paused member does not die of SIGKILL until it runs again.
        self.resume();
        self.kill();
    }
}

/// Whether `GET /health` on `addr` answers `"health":"true"`.
fn health_ok(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.contains("\"health\":\"true\"")
}
