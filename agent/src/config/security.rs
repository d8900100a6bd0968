//! The security blocks of the agent configuration: `acl`, `tls` and
//! `limits`, and the secrets a file may hold.
//!
//! ```hcl
//! region = "global"
//! http_allowed_hosts = ["berth.example.com"]
//! acl    { enabled = true, token_ttl = "30s", public_metrics = false }
//! tls {
//!   http = true
//!   rpc  = true
//!   ca_file   = "/etc/berth.d/berth-agent-ca.pem"
//!   cert_file = "/etc/berth.d/global-server-berth.pem"
//!   key_file  = "/etc/berth.d/global-server-berth-key.pem"
//!   verify_server_hostname = true
//!   verify_https_client    = true
//! }
//! limits {
//!   http_max_conns_per_client = 100
//!   rpc_max_conns_per_client  = 100
//!   max_blocking_queries      = 4096
//!   max_log_follows           = 256
//!   http_header_read_timeout  = "15s"
//!   http_max_concurrent_streams = 100
//!   node_register_rate_per_client  = 10
//!   node_register_burst_per_client = 100
//! }
//! ```
//!
//! Every field is an `Option`, so that merging files can tell a value
//! from its absence; the `effective_*` helpers give the value in force.

use std::path::PathBuf;
use std::time::Duration;

use berth_structs::limits::MAX_DURATION;

use crate::tls::{TlsError, TlsFiles, TlsSettings};
use berth_structs::spec::hcl::{BodyReader, Source};
use berth_structs::spec::SpecError;

pub use berth_structs::secret::ConfigSecret;

/// `acl { ... }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AclSection {
    pub enabled: Option<bool>,
    /// How long a client agent keeps a token it resolved through the
    /// servers before it asks again.
    pub token_ttl: Option<Duration>,
    /// Serve `/v1/metrics` without a token (for a scraper that sends
    /// none); off unless set.
    pub public_metrics: Option<bool>,
}

impl AclSection {
    /// A token a client agent resolved is kept this long by default
    /// (Nomad's).
    pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(30);

    pub fn enabled(&self) -> bool {
        self.enabled == Some(true)
    }

    pub fn public_metrics(&self) -> bool {
        self.public_metrics == Some(true)
    }

    pub fn effective_token_ttl(&self) -> Duration {
        self.token_ttl.unwrap_or(Self::DEFAULT_TOKEN_TTL)
    }

    fn merge(self, later: AclSection) -> AclSection {
        AclSection {
            enabled: later.enabled.or(self.enabled),
            token_ttl: later.token_ttl.or(self.token_ttl),
            public_metrics: later.public_metrics.or(self.public_metrics),
        }
    }
}

/// `tls { ... }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSection {
    /// Serve the HTTP API over TLS.
    pub http: Option<bool>,
    /// Speak the agent protocol over mutual TLS.
    pub rpc: Option<bool>,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// A client accepts only a server certificate that names
    /// `server.<region>.berth` (default true).
    pub verify_server_hostname: Option<bool>,
    /// The HTTP API asks for a client certificate that chains to the CA
    /// (default true).
    pub verify_https_client: Option<bool>,
}

impl TlsSection {
    /// The files this block names, or what it lacks.
    pub fn files(&self) -> Result<TlsFiles, TlsError> {
        match (&self.ca_file, &self.cert_file, &self.key_file) {
            (Some(ca), Some(cert), Some(key)) => Ok(TlsFiles {
                ca_file: ca.clone(),
                cert_file: cert.clone(),
                key_file: key.clone(),
            }),
            _ => Err(TlsError::Incomplete(self.incomplete().unwrap_or_else(
                || "ca_file, cert_file and key_file must be set".to_string(),
            ))),
        }
    }

    pub fn http_enabled(&self) -> bool {
        self.http == Some(true)
    }

    pub fn rpc_enabled(&self) -> bool {
        self.rpc == Some(true)
    }

    pub fn effective_verify_server_hostname(&self) -> bool {
        self.verify_server_hostname != Some(false)
    }

    pub fn effective_verify_https_client(&self) -> bool {
        self.verify_https_client != Some(false)
    }

    fn merge(self, later: TlsSection) -> TlsSection {
        TlsSection {
            http: later.http.or(self.http),
            rpc: later.rpc.or(self.rpc),
            ca_file: later.ca_file.or(self.ca_file),
            cert_file: later.cert_file.or(self.cert_file),
            key_file: later.key_file.or(self.key_file),
            verify_server_hostname: later.verify_server_hostname.or(self.verify_server_hostname),
            verify_https_client: later.verify_https_client.or(self.verify_https_client),
        }
    }

    /// What a TLS block that turns TLS on must name, `None` when it does.
    pub fn incomplete(&self) -> Option<String> {
        if !self.http_enabled() && !self.rpc_enabled() {
            return None;
        }
        let missing: Vec<&str> = [
            ("ca_file", self.ca_file.is_none()),
            ("cert_file", self.cert_file.is_none()),
            ("key_file", self.key_file.is_none()),
        ]
        .into_iter()
        .filter_map(|(k, missing)| missing.then_some(k))
        .collect();
        if missing.is_empty() {
            None
        } else {
            Some(format!(
                "tls is enabled but {} {} not set",
                missing.join(", "),
                if missing.len() == 1 { "is" } else { "are" }
            ))
        }
    }
}

/// `limits { ... }`: how much one peer, and all of them, may hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitsSection {
    pub http_max_conns_per_client: Option<u32>,
    pub rpc_max_conns_per_client: Option<u32>,
    pub max_blocking_queries: Option<u32>,
    pub max_log_follows: Option<u32>,
    /// How long a connection may take to send a request's headers.
    pub http_header_read_timeout: Option<Duration>,
    /// How many requests one HTTP/2 connection of the HTTPS API carries
    /// at once.
    pub http_max_concurrent_streams: Option<u32>,
    /// `Node.Register` calls per second one peer address may make once
    /// its burst is spent (servers only).
    pub node_register_rate_per_client: Option<u32>,
    /// `Node.Register` calls one peer address may make at once.
    pub node_register_burst_per_client: Option<u32>,
}

/// The limits in force, defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub http_max_conns_per_client: u32,
    pub rpc_max_conns_per_client: u32,
    pub max_blocking_queries: u32,
    pub max_log_follows: u32,
    pub http_header_read_timeout: Duration,
    pub http_max_concurrent_streams: u32,
    pub node_register_rate_per_client: u32,
    pub node_register_burst_per_client: u32,
}

impl Default for Limits {
    /// Nomad's defaults where it has them (100 connections per client
    /// address on each port).
    fn default() -> Self {
        Limits {
            http_max_conns_per_client: 100,
            rpc_max_conns_per_client: 100,
            max_blocking_queries: 4096,
            max_log_follows: 256,
            http_header_read_timeout: Duration::from_secs(15),
            http_max_concurrent_streams: 100,
            node_register_rate_per_client: 10,
            node_register_burst_per_client: 100,
        }
    }
}

impl LimitsSection {
    pub fn effective(&self) -> Limits {
        let d = Limits::default();
        Limits {
            http_max_conns_per_client: self
                .http_max_conns_per_client
                .unwrap_or(d.http_max_conns_per_client),
            rpc_max_conns_per_client: self
                .rpc_max_conns_per_client
                .unwrap_or(d.rpc_max_conns_per_client),
            max_blocking_queries: self.max_blocking_queries.unwrap_or(d.max_blocking_queries),
            max_log_follows: self.max_log_follows.unwrap_or(d.max_log_follows),
            http_header_read_timeout: self
                .http_header_read_timeout
                .unwrap_or(d.http_header_read_timeout),
            http_max_concurrent_streams: self
                .http_max_concurrent_streams
                .unwrap_or(d.http_max_concurrent_streams),
            node_register_rate_per_client: self
                .node_register_rate_per_client
                .unwrap_or(d.node_register_rate_per_client),
            node_register_burst_per_client: self
                .node_register_burst_per_client
                .unwrap_or(d.node_register_burst_per_client),
        }
    }

    fn merge(self, later: LimitsSection) -> LimitsSection {
        LimitsSection {
            http_max_conns_per_client: later
                .http_max_conns_per_client
                .or(self.http_max_conns_per_client),
            rpc_max_conns_per_client: later
                .rpc_max_conns_per_client
                .or(self.rpc_max_conns_per_client),
            max_blocking_queries: later.max_blocking_queries.or(self.max_blocking_queries),
            max_log_follows: later.max_log_follows.or(self.max_log_follows),
            http_header_read_timeout: later
                .http_header_read_timeout
                .or(self.http_header_read_timeout),
            http_max_concurrent_streams: later
                .http_max_concurrent_streams
                .or(self.http_max_concurrent_streams),
            node_register_rate_per_client: later
                .node_register_rate_per_client
                .or(self.node_register_rate_per_client),
            node_register_burst_per_client: later
                .node_register_burst_per_client
                .or(self.node_register_burst_per_client),
        }
    }
}

/// The security blocks of one file, or of several merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecuritySections {
    /// The region the agent's certificates name (`global` by default).
    pub region: Option<String>,
    /// Bind a server's listeners to a non-loopback address without TLS.
    pub insecure_bind: Option<bool>,
    /// The names besides the agent's own address (and `localhost`) that
    /// a request's `Host` may name; with a list set, or on a loopback
    /// listener, any other `Host` is refused (DNS rebinding). Lowercase,
    /// no port: a name matches on any port.
    pub http_allowed_hosts: Option<Vec<String>>,
    pub acl: AclSection,
    pub tls: TlsSection,
    pub limits: LimitsSection,
}

pub use berth_api::tls::{check_region, DEFAULT_REGION};

impl SecuritySections {
    /// The attributes and blocks this module reads at the top level.
    pub const ATTRIBUTES: [&'static str; 3] = ["region", "insecure_bind", "http_allowed_hosts"];
    pub const BLOCKS: [&'static str; 3] = ["acl", "tls", "limits"];

    pub fn effective_region(&self) -> &str {
        self.region.as_deref().unwrap_or(DEFAULT_REGION)
    }

    /// What the agent's TLS is made of: `None` when neither `tls.rpc` nor
    /// `tls.http` is on.
    pub fn tls_settings(&self) -> Result<Option<TlsSettings>, TlsError> {
        let tls = &self.tls;
        if !tls.rpc_enabled() && !tls.http_enabled() {
            return Ok(None);
        }
        Ok(Some(TlsSettings {
            rpc: tls.rpc_enabled(),
            http: tls.http_enabled(),
            verify_server_hostname: tls.effective_verify_server_hostname(),
            verify_https_client: tls.effective_verify_https_client(),
            region: self.effective_region().to_string(),
            files: tls.files()?,
        }))
    }

    /// Why a server listening on `binds` must not start: an address that
    /// is not loopback while `tls.rpc` or `tls.http` is off, unless
    /// `insecure_bind = true`. `None` when it may.
    pub fn insecure_bind_problem(
        &self,
        server: bool,
        binds: &[std::net::IpAddr],
    ) -> Option<String> {
        if !server || self.insecure_bind == Some(true) {
            return None;
        }
        let open = binds.iter().find(|a| !a.is_loopback())?;
        let off: Vec<&str> = [
            ("tls.rpc", !self.tls.rpc_enabled()),
            ("tls.http", !self.tls.http_enabled()),
        ]
        .into_iter()
        .filter_map(|(k, off)| off.then_some(k))
        .collect();
        if off.is_empty() {
            return None;
        }
        Some(format!(
            "the server listens on {open}, which is not loopback, while {} {} off: \
             anyone who reaches its ports would be trusted. Turn TLS on \
             (tls {{ rpc = true, http = true, ca_file, cert_file, key_file }}; \
             berth tls makes the certificates), bind to 127.0.0.1, or set \
             insecure_bind = true to accept an unprotected cluster",
            off.join(" and "),
            if off.len() == 1 { "is" } else { "are" }
        ))
    }

    pub fn merge(self, later: SecuritySections) -> SecuritySections {
        SecuritySections {
            region: later.region.or(self.region),
            insecure_bind: later.insecure_bind.or(self.insecure_bind),
            http_allowed_hosts: later.http_allowed_hosts.or(self.http_allowed_hosts),
            acl: self.acl.merge(later.acl),
            tls: self.tls.merge(later.tls),
            limits: self.limits.merge(later.limits),
        }
    }

    /// Reads the security attributes and blocks of a file's top level.
    pub fn parse(src: &Source<'_>, r: &BodyReader<'_, '_>) -> Result<SecuritySections, SpecError> {
        let region = r.string("region")?;
        if let Some(reg) = &region {
            check_region(reg).map_err(|e| r.invalid("region", e))?;
        }
        let http_allowed_hosts = match r.strings("http_allowed_hosts")? {
            None => None,
            Some(names) => Some(
                names
                    .into_iter()
                    .map(|n| allowed_host(&n).map_err(|e| r.invalid("http_allowed_hosts", e)))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let acl = match r.optional_block("acl")? {
            None => AclSection::default(),
            Some(b) => {
                let a = BodyReader::unlabeled(
                    src,
                    b,
                    r.ctx(),
                    &["enabled", "token_ttl", "public_metrics"],
                    &[],
                )?;
                AclSection {
                    enabled: a.bool("enabled")?,
                    token_ttl: a.duration("token_ttl", MAX_DURATION)?,
                    public_metrics: a.bool("public_metrics")?,
                }
            }
        };
        let tls = match r.optional_block("tls")? {
            None => TlsSection::default(),
            Some(b) => {
                let t = BodyReader::unlabeled(
                    src,
                    b,
                    r.ctx(),
                    &[
                        "http",
                        "rpc",
                        "ca_file",
                        "cert_file",
                        "key_file",
                        "verify_server_hostname",
                        "verify_https_client",
                    ],
                    &[],
                )?;
                let path = |key: &str| crate::config::absolute_path(&t, key);
                TlsSection {
                    http: t.bool("http")?,
                    rpc: t.bool("rpc")?,
                    ca_file: path("ca_file")?,
                    cert_file: path("cert_file")?,
                    key_file: path("key_file")?,
                    verify_server_hostname: t.bool("verify_server_hostname")?,
                    verify_https_client: t.bool("verify_https_client")?,
                }
            }
        };
        let limits = match r.optional_block("limits")? {
            None => LimitsSection::default(),
            Some(b) => {
                let l = BodyReader::unlabeled(
                    src,
                    b,
                    r.ctx(),
                    &[
                        "http_max_conns_per_client",
                        "rpc_max_conns_per_client",
                        "max_blocking_queries",
                        "max_log_follows",
                        "http_header_read_timeout",
                        "http_max_concurrent_streams",
                        "node_register_rate_per_client",
                        "node_register_burst_per_client",
                    ],
                    &[],
                )?;
                let count = |key: &str| -> Result<Option<u32>, SpecError> {
                    match l.u32(key, 1_000_000)? {
                        Some(0) => Err(l.invalid(key, "must be at least 1")),
                        v => Ok(v),
                    }
                };
                let timeout = l.duration("http_header_read_timeout", Duration::from_secs(3600))?;
                if timeout.is_some_and(|d| d.is_zero()) {
                    return Err(l.invalid("http_header_read_timeout", "must be longer than 0s"));
                }
                LimitsSection {
                    http_max_conns_per_client: count("http_max_conns_per_client")?,
                    rpc_max_conns_per_client: count("rpc_max_conns_per_client")?,
                    max_blocking_queries: count("max_blocking_queries")?,
                    max_log_follows: count("max_log_follows")?,
                    http_header_read_timeout: timeout,
                    http_max_concurrent_streams: count("http_max_concurrent_streams")?,
                    node_register_rate_per_client: count("node_register_rate_per_client")?,
                    node_register_burst_per_client: count("node_register_burst_per_client")?,
                }
            }
        };
        Ok(SecuritySections {
            region,
            insecure_bind: r.bool("insecure_bind")?,
            http_allowed_hosts,
            acl,
            tls,
            limits,
        })
    }
}

/// A name of `http_allowed_hosts`, lowercased, or why it is none: a DNS
/// name or an IP address, without a scheme, a port or a path.
fn allowed_host(name: &str) -> Result<String, String> {
    let n = name.trim_end_matches('.').to_ascii_lowercase();
    if n.parse::<std::net::IpAddr>().is_ok() {
        return Ok(n);
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if n.is_empty() || n.len() > 253 || !n.split('.').all(label_ok) {
        return Err(format!(
            "{name:?} is not a host name (letters, digits, '-' and '.', no scheme, port or path)"
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SecuritySections, SpecError> {
        super::super::parse(text).map(|c| c.security)
    }

    #[test]
    fn every_security_key_is_read() {
        let s = parse(
            r#"
region = "eu-west"
insecure_bind = true
http_allowed_hosts = ["Berth.Example.com.", "10.0.0.7"]
acl {
  enabled   = true
  token_ttl = "1m"
}
tls {
  http = true
  rpc  = true
  ca_file   = "/etc/berth/ca.pem"
  cert_file = "/etc/berth/cert.pem"
  key_file  = "/etc/berth/key.pem"
  verify_server_hostname = false
  verify_https_client    = false
}
limits {
  http_max_conns_per_client = 10
  rpc_max_conns_per_client  = 20
  max_blocking_queries      = 30
  max_log_follows           = 40
  http_header_read_timeout  = "5s"
  http_max_concurrent_streams = 50
  node_register_rate_per_client  = 2
  node_register_burst_per_client = 7
}
"#,
        )
        .expect("a full security config");
        assert_eq!(s.effective_region(), "eu-west");
        assert_eq!(s.insecure_bind, Some(true));
        assert_eq!(
            s.http_allowed_hosts.as_deref(),
            Some(&["berth.example.com".to_string(), "10.0.0.7".to_string()][..])
        );
        assert!(s.acl.enabled());
        assert_eq!(s.acl.effective_token_ttl(), Duration::from_secs(60));
        assert!(s.tls.http_enabled() && s.tls.rpc_enabled());
        assert!(!s.tls.effective_verify_server_hostname());
        assert!(!s.tls.effective_verify_https_client());
        assert_eq!(s.tls.incomplete(), None);
        assert_eq!(
            s.limits.effective(),
            Limits {
                http_max_conns_per_client: 10,
                rpc_max_conns_per_client: 20,
                max_blocking_queries: 30,
                max_log_follows: 40,
                http_header_read_timeout: Duration::from_secs(5),
                http_max_concurrent_streams: 50,
                node_register_rate_per_client: 2,
                node_register_burst_per_client: 7,
            }
        );
    }

    #[test]
    fn defaults_are_open_and_nomad_like() {
        let s = parse("").expect("an empty config");
        assert_eq!(s.effective_region(), "global");
        assert!(!s.acl.enabled());
        assert!(!s.tls.http_enabled() && !s.tls.rpc_enabled());
        assert!(s.tls.effective_verify_server_hostname());
        assert_eq!(s.limits.effective(), Limits::default());
    }

    #[test]
    fn bad_security_values_name_the_key() {
        for (text, wanted) in [
            ("region = \"EU\"", "is not a region name"),
            (
                "tls {\n ca_file = \"ca.pem\"\n}",
                "must be an absolute path",
            ),
            ("limits {\n max_log_follows = 0\n}", "at least 1"),
            (
                "limits {\n http_header_read_timeout = \"0s\"\n}",
                "longer than 0s",
            ),
            ("acl {\n bootstrap = true\n}", "\"bootstrap\""),
            (
                "http_allowed_hosts = [\"http://berth.example.com\"]",
                "is not a host name",
            ),
            (
                "http_allowed_hosts = [\"a.example:4646\"]",
                "no scheme, port",
            ),
            ("http_allowed_hosts = \"a.example\"", "http_allowed_hosts"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.message.contains(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn tls_on_needs_its_three_files() {
        let s = parse("tls {\n rpc = true\n ca_file = \"/ca.pem\"\n}").expect("parses");
        assert_eq!(
            s.tls.incomplete().as_deref(),
            Some("tls is enabled but cert_file, key_file are not set")
        );
    }

    #[test]
    fn later_files_win_key_by_key() {
        let a = parse("acl {\n enabled = true\n}\nlimits {\n max_log_follows = 5\n}").unwrap();
        let b = parse("acl {\n token_ttl = \"5s\"\n}\nlimits {\n max_log_follows = 6\n}").unwrap();
        let m = a.merge(b);
        assert!(m.acl.enabled());
        assert_eq!(m.acl.effective_token_ttl(), Duration::from_secs(5));
        assert_eq!(m.limits.effective().max_log_follows, 6);
    }

    #[test]
    fn a_server_on_a_public_address_needs_tls_or_insecure_bind() {
        let public: std::net::IpAddr = "0.0.0.0".parse().unwrap();
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let s = parse("").unwrap();
        let e = s.insecure_bind_problem(true, &[public]).expect("refused");
        assert!(
            e.contains("0.0.0.0") && e.contains("tls.rpc and tls.http are off"),
            "{e}"
        );
        assert!(e.contains("insecure_bind = true"), "{e}");
        assert_eq!(s.insecure_bind_problem(true, &[lo]), None);
        assert_eq!(
            s.insecure_bind_problem(false, &[public]),
            None,
            "a client only dials"
        );
        let half = parse("tls {\n rpc = true\n}").unwrap();
        let e = half
            .insecure_bind_problem(true, &[public])
            .expect("http still open");
        assert!(e.contains("tls.http is off"), "{e}");
        let both = parse("tls {\n rpc = true\n http = true\n}").unwrap();
        assert_eq!(both.insecure_bind_problem(true, &[public]), None);
        let insecure = parse("insecure_bind = true").unwrap();
        assert_eq!(insecure.insecure_bind_problem(true, &[public]), None);
    }

    #[test]
    fn a_config_secret_is_never_printed() {
        let s = ConfigSecret::new("s3cr3t");
        assert!(!format!("{s:?}").contains("s3cr3t"));
        assert_eq!(s.expose(), "s3cr3t");
    }
}
