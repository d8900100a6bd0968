//! Where a server keeps its state: `server { store = "embedded" | "etcd" }`
//! and, for etcd, the `etcd` block.
//!
//! ```hcl
//! server { enabled = true, store = "etcd" }
//! etcd {
//!   endpoints       = ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
//!   prefix          = "/berth"
//!   dial_timeout    = "5s"
//!   request_timeout = "10s"
//!   lease_ttl       = "10s"
//!   keyring_dir     = "/etc/berth.d/keyring"   # the same keys on every server
//! }
//! ```
//!
//! With TLS to etcd the endpoints are `https://` and a `tls` block names
//! the CA that signed the members' certificates and, for members that
//! check their clients (`--client-cert-auth`), the certificate and key the
//! servers present:
//!
//! ```hcl
//! etcd {
//!   endpoints = ["https://etcd-1.example:2379", "https://etcd-2.example:2379"]
//!   tls {
//!     ca_file   = "/etc/berth.d/etcd-ca.pem"
//!     cert_file = "/etc/berth.d/etcd-client.pem"
//!     key_file  = "/etc/berth.d/etcd-client-key.pem"
//!   }
//! }
//! ```
//!
//! The embedded store (a redb file in the data dir) is the default: one
//! server, and `-dev`.

use std::path::PathBuf;
use std::time::Duration;

use berth_server::etcd::EtcdConfig;
use berth_server::etcd_tls::EtcdTls;
use berth_server::StoreConfig;
use berth_structs::spec::hcl::{BodyReader, Source};
use berth_structs::spec::SpecError;

use crate::config::absolute_path;

/// The stores `server { store }` names.
pub const STORES: [&str; 2] = ["embedded", "etcd"];

/// The longest etcd timeout or lease a file may set.
const MAX_ETCD_DURATION: Duration = Duration::from_secs(600);

/// `etcd { ... }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdSection {
    pub endpoints: Option<Vec<String>>,
    pub prefix: Option<String>,
    pub dial_timeout: Option<Duration>,
    pub request_timeout: Option<Duration>,
    pub lease_ttl: Option<Duration>,
    pub keyring_dir: Option<std::path::PathBuf>,
    pub tls: Option<EtcdTlsSection>,
}

/// `etcd { tls { ... } }`: the members' CA, and the servers' certificate
/// and key for members that check their clients.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdTlsSection {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl EtcdTlsSection {
    /// The client configuration these files make, or why they make none
    /// (naming the key or the file).
    fn client_config(&self) -> Result<EtcdTls, String> {
        let Some(ca) = &self.ca_file else {
            return Err(
                "etcd { tls } needs ca_file: the CA that signed the etcd members' \
                 certificates"
                    .into(),
            );
        };
        let client = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            (None, None) => None,
            _ => {
                return Err(
                    "etcd { tls } sets one of cert_file and key_file: set both (the \
                     certificate the servers present to etcd, and its key) or neither"
                        .into(),
                )
            }
        };
        let config = crate::tls::etcd_client_config(ca, client).map_err(|e| format!("etcd {e}"))?;
        Ok(EtcdTls::new(config, format!("CA {}", ca.display())))
    }
}

impl EtcdSection {
    pub const BLOCK: &'static str = "etcd";

    pub fn merge(self, later: EtcdSection) -> EtcdSection {
        EtcdSection {
            endpoints: later.endpoints.or(self.endpoints),
            prefix: later.prefix.or(self.prefix),
            dial_timeout: later.dial_timeout.or(self.dial_timeout),
            request_timeout: later.request_timeout.or(self.request_timeout),
            lease_ttl: later.lease_ttl.or(self.lease_ttl),
            keyring_dir: later.keyring_dir.or(self.keyring_dir),
            tls: later.tls.or(self.tls),
        }
    }

    /// Reads `etcd { ... }` of a file's top level.
    pub fn parse(src: &Source<'_>, r: &BodyReader<'_, '_>) -> Result<EtcdSection, SpecError> {
        let Some(b) = r.optional_block(Self::BLOCK)? else {
            return Ok(EtcdSection::default());
        };
        let e = BodyReader::unlabeled(
            src,
            b,
            r.ctx(),
            &[
                "endpoints",
                "prefix",
                "dial_timeout",
                "request_timeout",
                "lease_ttl",
                "keyring_dir",
            ],
            &["tls"],
        )?;
        let endpoints = e.strings("endpoints")?;
        for url in endpoints.iter().flatten() {
            check_endpoint(url).map_err(|problem| e.invalid("endpoints", problem))?;
        }
        let prefix = e.string("prefix")?;
        if let Some(p) = &prefix {
            check_prefix(p).map_err(|problem| e.invalid("prefix", problem))?;
        }
        let positive = |name: &str| -> Result<Option<Duration>, SpecError> {
            let d = e.duration(name, MAX_ETCD_DURATION)?;
            if d.is_some_and(|d| d < Duration::from_millis(100)) {
                return Err(e.invalid(name, "must be at least 100ms"));
            }
            Ok(d)
        };
        let lease_ttl = e.duration("lease_ttl", MAX_ETCD_DURATION)?;
        if lease_ttl.is_some_and(|d| d < Duration::from_secs(2)) {
            // etcd grants leases of whole seconds, and the leader keeps it
            // alive well before it runs out.
            return Err(e.invalid("lease_ttl", "must be at least 2s"));
        }
        let keyring_dir = absolute_path(&e, "keyring_dir")?;
        let tls = match e.optional_block("tls")? {
            None => None,
            Some(b) => {
                let t = BodyReader::unlabeled(
                    src,
                    b,
                    e.ctx(),
                    &["ca_file", "cert_file", "key_file"],
                    &[],
                )?;
                Some(EtcdTlsSection {
                    ca_file: absolute_path(&t, "ca_file")?,
                    cert_file: absolute_path(&t, "cert_file")?,
                    key_file: absolute_path(&t, "key_file")?,
                })
            }
        };
        Ok(EtcdSection {
            endpoints,
            prefix,
            keyring_dir,
            tls,
            dial_timeout: positive("dial_timeout")?,
            request_timeout: positive("request_timeout")?,
            lease_ttl,
        })
    }

    /// The etcd settings in force, defaults filled in, or why they do not
    /// make any (a TLS file that does not read, endpoints of the wrong
    /// scheme).
    pub fn effective(&self) -> Result<EtcdConfig, String> {
        let mut c = EtcdConfig::new(self.endpoints.clone().unwrap_or_default());
        if let Some(p) = &self.prefix {
            c.prefix = p.trim_end_matches('/').to_string();
        }
        if let Some(d) = self.dial_timeout {
            c.dial_timeout = d;
        }
        if let Some(d) = self.request_timeout {
            c.request_timeout = d;
        }
        if let Some(d) = self.lease_ttl {
            c.lease_ttl = d;
        }
        c.keyring_dir = self.keyring_dir.clone();
        let scheme = if self.tls.is_some() {
            "https://"
        } else {
            "http://"
        };
        if let Some(url) = c.endpoints.iter().find(|u| !u.starts_with(scheme)) {
            return Err(match &self.tls {
                Some(_) => format!(
                    "etcd endpoint {url:?}: etcd {{ tls }} is set, so the members are dialled \
                     over TLS: want https://HOST:PORT"
                ),
                None => format!(
                    "etcd endpoint {url:?}: an https:// endpoint needs etcd {{ tls {{ ca_file \
                     = ... }} }}, the CA that signed the members' certificates"
                ),
            });
        }
        if let Some(t) = &self.tls {
            c.tls = Some(t.client_config()?);
        }
        Ok(c)
    }
}

/// Checks `server { store }`.
pub fn check_store(store: &str) -> Result<(), String> {
    if STORES.contains(&store) {
        Ok(())
    } else {
        Err(format!(
            "unknown store {store:?} (want one of {})",
            STORES.join(", ")
        ))
    }
}

/// The store a server with `store` (from `server { store }`) and `etcd`
/// keeps its state in, or why it cannot.
pub fn store_config(store: Option<&str>, etcd: &EtcdSection) -> Result<StoreConfig, String> {
    match store {
        None | Some("embedded") => Ok(StoreConfig::Embedded),
        Some("etcd") => {
            if etcd.endpoints.as_ref().is_none_or(Vec::is_empty) {
                return Err("server { store = \"etcd\" } needs the etcd members: set \
                     etcd { endpoints = [\"http://HOST:2379\"] }"
                    .into());
            }
            Ok(StoreConfig::Etcd(etcd.effective()?))
        }
        Some(other) => Err(check_store(other).err().unwrap_or_default()),
    }
}

/// Why an `etcd` block that a server with `store` (from `server { store
/// }`) does not use is likely a mistake: a server meant to join the
/// servers on etcd would instead keep a state of its own, a cluster that
/// knows nothing of theirs. `None` when the block is used or absent.
pub fn etcd_block_unused(store: Option<&str>, etcd: &EtcdSection) -> Option<String> {
    let embedded = matches!(store, None | Some("embedded"));
    (embedded && *etcd != EtcdSection::default()).then(|| {
        "an etcd block is set, but server { store } is \"embedded\" (the default): this \
         server keeps its state in its own data dir, a cluster of its own that shares nothing \
         with servers on that etcd; set server { store = \"etcd\" } to keep it there"
            .to_string()
    })
}

/// An etcd endpoint: `http://HOST:PORT`, or `https://HOST:PORT` (with
/// `etcd { tls }`).
fn check_endpoint(url: &str) -> Result<(), String> {
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return Err(format!(
            "{url:?} is not an etcd endpoint: want http://HOST:PORT, or https://HOST:PORT \
             with etcd {{ tls }}"
        ));
    };
    let addr = rest.trim_end_matches('/');
    crate::config::check_server_addr(addr).map_err(|problem| format!("{url:?}: {problem}"))
}

/// A key prefix: absolute, printable, no spaces.
fn check_prefix(prefix: &str) -> Result<(), String> {
    let ok = prefix.starts_with('/')
        && prefix.len() > 1
        && prefix.len() <= 256
        && prefix.chars().all(|c| c.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{prefix:?} is not a key prefix: want a path such as \"/berth\" (printable ASCII, \
             no spaces, at most 256 characters)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    #[test]
    fn an_etcd_block_a_server_does_not_use_is_named() {
        let etcd = "etcd {\n endpoints = [\"http://10.0.0.1:2379\"]\n}\n";
        for server in ["", "server {\n store = \"embedded\"\n}\n"] {
            let c = parse(&format!("{server}{etcd}")).expect("parses");
            let why = etcd_block_unused(c.server.store.as_deref(), &c.etcd)
                .expect("an unused etcd block is named");
            assert!(why.contains("store = \"etcd\""), "{why}");
        }
        let used = parse(&format!("server {{\n store = \"etcd\"\n}}\n{etcd}")).expect("parses");
        assert_eq!(
            etcd_block_unused(used.server.store.as_deref(), &used.etcd),
            None
        );
        let none = parse("server {\n store = \"embedded\"\n}\n").expect("parses");
        assert_eq!(
            etcd_block_unused(none.server.store.as_deref(), &none.etcd),
            None
        );
    }

    #[test]
    fn an_etcd_block_is_read_and_filled_with_defaults() {
        let c = parse(
            "server {\n store = \"etcd\"\n}\netcd {\n endpoints = [\"http://10.0.0.1:2379\", \
             \"http://etcd-2.example:2379\"]\n prefix = \"/prod/berth/\"\n lease_ttl = \"15s\"\n}\n",
        )
        .expect("parses");
        let store = store_config(c.server.store.as_deref(), &c.etcd).expect("a store");
        let StoreConfig::Etcd(e) = store else {
            panic!("not etcd: {store:?}")
        };
        assert_eq!(e.endpoints.len(), 2);
        assert_eq!(e.prefix, "/prod/berth");
        assert_eq!(e.lease_ttl, Duration::from_secs(15));
        assert_eq!(e.dial_timeout, EtcdConfig::new(vec![]).dial_timeout);
        assert_eq!(
            store_config(None, &EtcdSection::default()),
            Ok(StoreConfig::Embedded)
        );
    }

    #[test]
    fn bad_store_settings_name_the_key_and_the_problem() {
        for (text, want) in [
            ("server {\n store = \"raft\"\n}", "unknown store \"raft\""),
            (
                "etcd {\n endpoints = [\"10.0.0.1:2379\"]\n}",
                "want http://HOST:PORT",
            ),
            ("etcd {\n endpoints = [\"http://h:0\"]\n}", "\"http://h:0\""),
            ("etcd {\n prefix = \"berth\"\n}", "not a key prefix"),
            ("etcd {\n lease_ttl = \"1s\"\n}", "at least 2s"),
            ("etcd {\n dial_timeout = \"1ms\"\n}", "at least 100ms"),
            (
                "etcd {\n keyring_dir = \"keys\"\n}",
                "must be an absolute path",
            ),
            ("etcd {\n endpoint = []\n}", "\"endpoint\" in etcd"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
        let none = store_config(Some("etcd"), &EtcdSection::default()).unwrap_err();
        assert!(none.contains("etcd { endpoints"), "{none}");
    }

    #[test]
    fn tls_to_etcd_wants_https_endpoints_a_ca_and_both_or_neither_of_cert_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-ca.pem");
        for (body, want) in [
            (
                "endpoints = [\"https://10.0.0.1:2379\"]".to_string(),
                "needs etcd { tls { ca_file".to_string(),
            ),
            (
                format!(
                    "endpoints = [\"http://10.0.0.1:2379\"]\n tls {{\n ca_file = {missing:?}\n }}"
                ),
                "want https://HOST:PORT".to_string(),
            ),
            (
                "endpoints = [\"https://10.0.0.1:2379\"]\n tls {\n cert_file = \"/c.pem\"\n }"
                    .into(),
                "needs ca_file".into(),
            ),
            (
                format!(
                    "endpoints = [\"https://10.0.0.1:2379\"]\n tls {{\n ca_file = {missing:?}\n \
                     key_file = \"/k.pem\"\n }}"
                ),
                "set both".into(),
            ),
            (
                format!(
                    "endpoints = [\"https://10.0.0.1:2379\"]\n tls {{\n ca_file = {missing:?}\n }}"
                ),
                format!("reading the CA file {}", missing.display()),
            ),
        ] {
            let text = format!("server {{\n store = \"etcd\"\n}}\netcd {{\n {body}\n}}\n");
            let c = parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let e = store_config(c.server.store.as_deref(), &c.etcd).expect_err(&text);
            assert!(e.contains(&want), "{text}: {e}");
        }
        let relative = parse("etcd {\n tls {\n ca_file = \"ca.pem\"\n }\n}").unwrap_err();
        assert!(
            relative.to_string().contains("must be an absolute path"),
            "{relative}"
        );
    }
}
