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
//! The embedded store (a redb file in the data dir) is the default: one
//! server, and `-dev`.

use std::time::Duration;

use berth_server::etcd::EtcdConfig;
use berth_server::StoreConfig;
use berth_structs::spec::hcl::{BodyReader, Source};
use berth_structs::spec::SpecError;

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
            &[],
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
        let keyring_dir = match e.string("keyring_dir")? {
            Some(d) if !std::path::Path::new(&d).is_absolute() => {
                return Err(e.invalid("keyring_dir", format!("{d:?} must be an absolute path")))
            }
            d => d.map(std::path::PathBuf::from),
        };
        Ok(EtcdSection {
            endpoints,
            prefix,
            keyring_dir,
            dial_timeout: positive("dial_timeout")?,
            request_timeout: positive("request_timeout")?,
            lease_ttl,
        })
    }

    /// The etcd settings in force, defaults filled in.
    pub fn effective(&self) -> EtcdConfig {
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
        c
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
            Ok(StoreConfig::Etcd(etcd.effective()))
        }
        Some(other) => Err(check_store(other).err().unwrap_or_default()),
    }
}

/// An etcd endpoint: `http://HOST:PORT`.
fn check_endpoint(url: &str) -> Result<(), String> {
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "{url:?} is not an etcd endpoint: want http://HOST:PORT (TLS to etcd is not \
             supported yet)"
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
}
