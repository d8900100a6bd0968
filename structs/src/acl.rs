//! Access control: policies (what a token may do), tokens (who presents
//! them), introduction tokens (what a new node registers with), and the
//! one check every API route and node registration passes.
//!
//! A policy grants, per namespace (berth has one, `default`), a level
//! (`deny`, `read`, `write`) and capabilities; and a level for each of
//! `node`, `agent`, `operator` and `plugin`. A token is of type
//! `management` (everything) or `client` (the union of its policies, where
//! a `deny` anywhere wins). Secrets are never stored: a token is found by
//! the SHA-256 of its secret, and only its accessor ID is shown after it is
//! made.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The namespace every object of berth lives in today.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The longest token secret accepted on the wire.
pub const MAX_TOKEN_SECRET_LEN: usize = 128;

/// A level of access to a part of the API.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Nothing was granted (the default).
    #[default]
    None,
    Read,
    Write,
    /// Explicitly refused: wins over any grant of another policy.
    Deny,
}

impl Level {
    /// Whether this level, as granted, allows `wanted` (`Read` or
    /// `Write`).
    pub fn allows(self, wanted: Level) -> bool {
        match self {
            Level::Deny | Level::None => false,
            Level::Read => wanted == Level::Read,
            Level::Write => matches!(wanted, Level::Read | Level::Write),
        }
    }

    /// Two grants of different policies together: deny wins, else the
    /// higher.
    pub fn merge(self, other: Level) -> Level {
        if self == Level::Deny || other == Level::Deny {
            Level::Deny
        } else {
            self.max(other)
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Level::None => "none",
            Level::Read => "read",
            Level::Write => "write",
            Level::Deny => "deny",
        }
    }
}

impl FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Level, String> {
        match s {
            "deny" => Ok(Level::Deny),
            "read" => Ok(Level::Read),
            "write" => Ok(Level::Write),
            other => Err(format!(
                "unknown policy {other:?} (want \"read\", \"write\" or \"deny\")"
            )),
        }
    }
}

/// A capability within a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Capability {
    /// List jobs and their allocs.
    ListJobs,
    /// Read jobs and allocs (with their task environment).
    ReadJob,
    /// Register, update, plan and stop jobs.
    SubmitJob,
    /// Stop, restart and signal allocs.
    AllocLifecycle,
    /// Read task logs.
    ReadLogs,
    /// Run a job whose task is a CSI plugin (`csi_plugin` block).
    CsiRegisterPlugin,
    /// Register, create, deregister, delete and detach volumes; snapshots.
    CsiWriteVolume,
    /// Read volumes and snapshots.
    CsiReadVolume,
    /// Run a job that mounts CSI volumes.
    CsiMountVolume,
}

impl Capability {
    pub const ALL: [Capability; 9] = [
        Capability::ListJobs,
        Capability::ReadJob,
        Capability::SubmitJob,
        Capability::AllocLifecycle,
        Capability::ReadLogs,
        Capability::CsiRegisterPlugin,
        Capability::CsiWriteVolume,
        Capability::CsiReadVolume,
        Capability::CsiMountVolume,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Capability::ListJobs => "list-jobs",
            Capability::ReadJob => "read-job",
            Capability::SubmitJob => "submit-job",
            Capability::AllocLifecycle => "alloc-lifecycle",
            Capability::ReadLogs => "read-logs",
            Capability::CsiRegisterPlugin => "csi-register-plugin",
            Capability::CsiWriteVolume => "csi-write-volume",
            Capability::CsiReadVolume => "csi-read-volume",
            Capability::CsiMountVolume => "csi-mount-volume",
        }
    }

    /// What `policy = "read"` grants in a namespace.
    pub const READ: [Capability; 3] = [
        Capability::ListJobs,
        Capability::ReadJob,
        Capability::CsiReadVolume,
    ];

    /// What `policy = "write"` grants in a namespace: everything but
    /// running CSI plugins, which is granted by name only (as Nomad).
    pub const WRITE: [Capability; 8] = [
        Capability::ListJobs,
        Capability::ReadJob,
        Capability::CsiReadVolume,
        Capability::SubmitJob,
        Capability::AllocLifecycle,
        Capability::ReadLogs,
        Capability::CsiWriteVolume,
        Capability::CsiMountVolume,
    ];
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Capability {
    type Err = String;
    fn from_str(s: &str) -> Result<Capability, String> {
        Capability::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Capability::ALL.iter().map(|c| c.as_str()).collect();
                format!("unknown capability {s:?} (known: {})", known.join(", "))
            })
    }
}

/// The rules of one `namespace "NAME" { ... }` block.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceRule {
    #[serde(default)]
    pub policy: Level,
    #[serde(default)]
    pub capabilities: BTreeSet<Capability>,
}

/// A policy's rules, as its HCL says them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRules {
    /// By namespace name; `*` matches every namespace.
    #[serde(default)]
    pub namespaces: BTreeMap<String, NamespaceRule>,
    #[serde(default)]
    pub node: Level,
    #[serde(default)]
    pub agent: Level,
    #[serde(default)]
    pub operator: Level,
    #[serde(default)]
    pub plugin: Level,
}

/// A named policy as the servers store it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AclPolicy {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The HCL the operator wrote.
    pub rules: String,
    /// What it says.
    #[serde(default)]
    pub parsed: PolicyRules,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

/// A token's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenType {
    /// What its policies grant.
    #[default]
    Client,
    /// Everything.
    Management,
}

impl FromStr for TokenType {
    type Err = String;
    fn from_str(s: &str) -> Result<TokenType, String> {
        match s {
            "client" => Ok(TokenType::Client),
            "management" => Ok(TokenType::Management),
            other => Err(format!(
                "unknown token type {other:?} (want \"client\" or \"management\")"
            )),
        }
    }
}

/// An ACL token as the servers store it: never its secret, only the
/// secret's hash.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AclToken {
    /// The public ID that names the token in lists and logs.
    pub accessor_id: String,
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default)]
    pub token_type: TokenType,
    #[serde(default)]
    pub policies: Vec<String>,
    /// [`secret_hash`] of the secret; never answered by the API.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_hash: String,
    #[serde(default)]
    pub create_time_ms: i64,
    /// When the token stops working; `None`: never.
    #[serde(default)]
    pub expiration_time_ms: Option<i64>,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

impl AclToken {
    pub fn expired_at(&self, now_ms: i64) -> bool {
        self.expiration_time_ms.is_some_and(|t| t <= now_ms)
    }

    /// The token as the API shows it: without the secret's hash.
    pub fn public(&self) -> AclToken {
        AclToken {
            secret_hash: String::new(),
            ..self.clone()
        }
    }
}

/// An introduction token: lets new nodes register a bounded number of
/// times, until it expires.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntroToken {
    pub accessor_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_hash: String,
    /// Registrations it still allows.
    pub uses_left: u32,
    pub create_time_ms: i64,
    pub expiration_time_ms: i64,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

impl IntroToken {
    pub fn usable_at(&self, now_ms: i64) -> bool {
        self.uses_left > 0 && now_ms < self.expiration_time_ms
    }

    pub fn public(&self) -> IntroToken {
        IntroToken {
            secret_hash: String::new(),
            ..self.clone()
        }
    }
}

/// A new random token secret (a UUID, 122 random bits).
pub fn generate_secret() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The hash a token is found by: SHA-256 of the secret, as hex.
pub fn secret_hash(secret: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(secret.as_bytes());
    let mut out = String::with_capacity(64);
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// A token secret read from a request: printable ASCII, not too long. The
/// error never holds the text.
pub fn check_secret_text(text: &str) -> Result<&str, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("the ACL token is empty".into());
    }
    if t.len() > MAX_TOKEN_SECRET_LEN {
        return Err(format!(
            "the ACL token is {} characters long; the limit is {MAX_TOKEN_SECRET_LEN}",
            t.len()
        ));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the ACL token holds a character other than printable ASCII".into());
    }
    Ok(t)
}

/// What a route or an action needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Need {
    /// Anyone, with or without a token (health, the API description,
    /// bootstrap, which refuses itself once done).
    Public,
    /// Any valid token (`acl token self`).
    AnyToken,
    /// A management token.
    Management,
    /// A capability in the default namespace.
    Namespace(Capability),
    Node(Level),
    Agent(Level),
    Operator(Level),
    Plugin(Level),
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Need::Public => f.write_str("none"),
            Need::AnyToken => f.write_str("any valid token"),
            Need::Management => f.write_str("a management token"),
            Need::Namespace(c) => write!(f, "namespace {DEFAULT_NAMESPACE:?} capability {c}"),
            Need::Node(l) => write!(f, "node:{}", l.as_str()),
            Need::Agent(l) => write!(f, "agent:{}", l.as_str()),
            Need::Operator(l) => write!(f, "operator:{}", l.as_str()),
            Need::Plugin(l) => write!(f, "plugin:{}", l.as_str()),
        }
    }
}

/// What a resolved token may do.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Acl {
    /// The accessor of the token, for the audit log (`None`: anonymous,
    /// or ACLs off).
    #[serde(default)]
    pub accessor_id: Option<String>,
    #[serde(default)]
    pub management: bool,
    /// The capabilities in the default namespace.
    #[serde(default)]
    pub capabilities: BTreeSet<Capability>,
    #[serde(default)]
    pub node: Level,
    #[serde(default)]
    pub agent: Level,
    #[serde(default)]
    pub operator: Level,
    #[serde(default)]
    pub plugin: Level,
}

impl Acl {
    /// Everything (a management token, or ACLs turned off).
    pub fn management(accessor_id: Option<String>) -> Acl {
        Acl {
            accessor_id,
            management: true,
            ..Acl::default()
        }
    }

    /// No token: nothing but public routes.
    pub fn anonymous() -> Acl {
        Acl::default()
    }

    /// The union of `policies` for `accessor_id`: deny wins, else grants
    /// add up. A `namespace "*"` rule counts for the default namespace
    /// unless a `namespace "default"` rule of the same policy says
    /// otherwise.
    pub fn from_policies<'a>(
        accessor_id: Option<String>,
        policies: impl IntoIterator<Item = &'a PolicyRules>,
    ) -> Acl {
        let mut acl = Acl {
            accessor_id,
            ..Acl::default()
        };
        let mut ns_level = Level::None;
        for p in policies {
            let rule = p
                .namespaces
                .get(DEFAULT_NAMESPACE)
                .or_else(|| p.namespaces.get("*"));
            if let Some(rule) = rule {
                ns_level = ns_level.merge(rule.policy);
                let granted: &[Capability] = match rule.policy {
                    Level::Read => &Capability::READ,
                    Level::Write => &Capability::WRITE,
                    Level::None | Level::Deny => &[],
                };
                acl.capabilities.extend(granted.iter().copied());
                acl.capabilities.extend(rule.capabilities.iter().copied());
            }
            acl.node = acl.node.merge(p.node);
            acl.agent = acl.agent.merge(p.agent);
            acl.operator = acl.operator.merge(p.operator);
            acl.plugin = acl.plugin.merge(p.plugin);
        }
        if ns_level == Level::Deny {
            acl.capabilities.clear();
        }
        acl
    }

    /// Whether this ACL allows `need`.
    pub fn allows(&self, need: Need) -> bool {
        if self.management {
            return true;
        }
        match need {
            Need::Public => true,
            Need::AnyToken => self.accessor_id.is_some(),
            Need::Management => false,
            Need::Namespace(c) => self.capabilities.contains(&c),
            Need::Node(l) => self.node.allows(l),
            Need::Agent(l) => self.agent.allows(l),
            Need::Operator(l) => self.operator.allows(l),
            Need::Plugin(l) => self.plugin.allows(l),
        }
    }

    /// `Ok` when this ACL allows `need`, else the refusal's message.
    pub fn check(&self, need: Need) -> Result<(), String> {
        if self.allows(need) {
            return Ok(());
        }
        Err(match &self.accessor_id {
            None => format!("permission denied: this request needs an ACL token with {need}"),
            Some(_) => format!("permission denied: the ACL token does not grant {need}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(ns: Level, caps: &[Capability]) -> PolicyRules {
        PolicyRules {
            namespaces: [(
                DEFAULT_NAMESPACE.to_string(),
                NamespaceRule {
                    policy: ns,
                    capabilities: caps.iter().copied().collect(),
                },
            )]
            .into(),
            ..PolicyRules::default()
        }
    }

    #[test]
    fn read_grants_reads_and_write_grants_all_but_plugins() {
        let read = Acl::from_policies(Some("a".into()), [&rules(Level::Read, &[])]);
        assert!(read.allows(Need::Namespace(Capability::ReadJob)));
        assert!(!read.allows(Need::Namespace(Capability::SubmitJob)));
        let write = Acl::from_policies(Some("a".into()), [&rules(Level::Write, &[])]);
        assert!(write.allows(Need::Namespace(Capability::SubmitJob)));
        assert!(!write.allows(Need::Namespace(Capability::CsiRegisterPlugin)));
        assert!(!write.allows(Need::Node(Level::Read)));
        assert!(!write.allows(Need::Management));
    }

    #[test]
    fn deny_in_any_policy_wins() {
        let write = rules(Level::Write, &[]);
        let deny = rules(Level::Deny, &[]);
        let acl = Acl::from_policies(Some("a".into()), [&write, &deny]);
        assert!(!acl.allows(Need::Namespace(Capability::ReadJob)));
        let node_write = PolicyRules {
            node: Level::Write,
            ..PolicyRules::default()
        };
        let node_deny = PolicyRules {
            node: Level::Deny,
            ..PolicyRules::default()
        };
        let acl = Acl::from_policies(Some("a".into()), [&node_write, &node_deny]);
        assert!(!acl.allows(Need::Node(Level::Read)));
    }

    #[test]
    fn capabilities_add_to_a_level_and_levels_nest() {
        let p = rules(Level::Read, &[Capability::CsiRegisterPlugin]);
        let acl = Acl::from_policies(Some("a".into()), [&p]);
        assert!(acl.allows(Need::Namespace(Capability::CsiRegisterPlugin)));
        assert!(Level::Write.allows(Level::Read));
        assert!(!Level::Read.allows(Level::Write));
        assert!(!Level::Deny.allows(Level::Read));
    }

    #[test]
    fn anonymous_reaches_public_routes_only() {
        let a = Acl::anonymous();
        assert!(a.allows(Need::Public));
        assert!(!a.allows(Need::AnyToken));
        assert!(!a.allows(Need::Namespace(Capability::ListJobs)));
        assert!(a
            .check(Need::Namespace(Capability::ListJobs))
            .unwrap_err()
            .contains("needs an ACL token"));
        assert!(Acl::management(None).allows(Need::Management));
    }

    #[test]
    fn a_secret_is_found_by_its_hash_only() {
        let s = generate_secret();
        assert_eq!(secret_hash(&s), secret_hash(&s));
        assert_ne!(secret_hash(&s), secret_hash(&generate_secret()));
        assert_eq!(secret_hash(&s).len(), 64);
        assert!(!secret_hash(&s).contains(&s));
        assert!(check_secret_text("").is_err());
        assert!(check_secret_text("a\u{7f}").is_err());
        assert_eq!(check_secret_text(" abc ").unwrap(), "abc");
    }

    #[test]
    fn the_public_view_of_a_token_has_no_hash() {
        let t = AclToken {
            accessor_id: "a".into(),
            secret_hash: secret_hash("s"),
            ..AclToken::default()
        };
        let json = serde_json::to_string(&t.public()).unwrap();
        assert!(!json.contains("secret_hash"), "{json}");
    }
}
