//! Access control on the servers: bootstrap, policies, tokens, and
//! resolving a presented secret to what it may do ([`Acl`]). Also the
//! introduction tokens new nodes register with (see
//! `crate::node_secrets`).
//!
//! Secrets are generated here, answered once when made, and stored only
//! as their hash; a refusal never holds a secret.

use std::time::Duration;

use berth_structs::acl::{
    check_secret_text, generate_secret, secret_hash, Acl, AclPolicy, AclToken, IntroToken,
    TokenType,
};
use berth_structs::ValidationError;
use serde::{Deserialize, Serialize};

use crate::error::ServerError;
use crate::server::Server;
use crate::state::{AclBootstrap, AclRecord, Change, Tables};

/// The longest TTL a token or an introduction token may be given.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The most registrations one introduction token may allow.
pub const MAX_INTRO_USES: u32 = 100_000;

/// A token just made: its public part and its secret, shown this once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewToken {
    #[serde(flatten)]
    pub token: AclToken,
    pub secret_id: String,
}

/// The file in the server's data dir that allows one more bootstrap.
const BOOTSTRAP_RESET_FILE: &str = "acl-bootstrap-reset";

/// An introduction token just made, with its secret shown this once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewIntroToken {
    #[serde(flatten)]
    pub token: IntroToken,
    pub secret_id: String,
}

/// What `acl token create` asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default)]
    pub token_type: TokenType,
    #[serde(default)]
    pub policies: Vec<String>,
    /// How long the token works (`"1h"`); none: until deleted.
    #[serde(default)]
    pub ttl: Option<String>,
}

/// A token with the policies it holds (`acl token self`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenWithPolicies {
    #[serde(flatten)]
    pub token: AclToken,
    pub resolved_policies: Vec<AclPolicy>,
    /// What the token may do, as the servers resolve it.
    pub acl: Acl,
}

fn parse_ttl(what: &str, ttl: &str) -> Result<Duration, ServerError> {
    let d = humantime::parse_duration(ttl)
        .map_err(|e| ServerError::BadRequest(format!("{what} ttl {ttl:?}: {e}")))?;
    if d.is_zero() || d > MAX_TOKEN_TTL {
        return Err(ServerError::BadRequest(format!(
            "{what} ttl {ttl:?} must be longer than 0s and at most 10 years"
        )));
    }
    Ok(d)
}

fn expiry(now_ms: i64, ttl: Duration) -> i64 {
    now_ms.saturating_add(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX))
}

impl Server {
    /// Whether the servers require ACL tokens.
    pub fn acl_enabled(&self) -> bool {
        self.config.acl_enabled
    }

    fn acl_must_be_on(&self) -> Result<(), ServerError> {
        if self.config.acl_enabled {
            Ok(())
        } else {
            Err(ServerError::BadRequest(
                "ACLs are disabled on the servers: set acl { enabled = true }".into(),
            ))
        }
    }

    /// What the holder of `secret` may do; `None` (no token) is
    /// anonymous. With ACLs off, everything. An unknown or expired token
    /// is refused.
    pub fn resolve_token(&self, secret: Option<&str>) -> Result<Acl, ServerError> {
        if !self.config.acl_enabled {
            return Ok(Acl::management(None));
        }
        let Some(secret) = secret else {
            return Ok(Acl::anonymous());
        };
        let secret = check_secret_text(secret).map_err(ServerError::Forbidden)?;
        let hash = secret_hash(secret);
        let now = berth_structs::now_ms();
        self.store.read(|t| {
            let token = t
                .acl
                .token_by_hash(&hash)
                .ok_or_else(|| ServerError::Forbidden("ACL token not found".into()))?;
            if token.expired_at(now) {
                return Err(ServerError::Forbidden(format!(
                    "ACL token {} has expired",
                    token.accessor_id
                )));
            }
            Ok(acl_of(t, token))
        })
    }

    /// Where an operator who lost the bootstrap token writes the current
    /// bootstrap's accessor ID to bootstrap once more (Nomad's reset file).
    pub fn acl_bootstrap_reset_path(&self) -> std::path::PathBuf {
        self.config
            .data_dir
            .join("server")
            .join(BOOTSTRAP_RESET_FILE)
    }

    /// `acl bootstrap`: the first management token. Refused once done,
    /// unless the reset file holds the accessor ID of the bootstrap in
    /// force: then once more (the file is removed, and the reset logged).
    pub async fn acl_bootstrap(&self) -> Result<NewToken, ServerError> {
        self.acl_must_be_on()?;
        let reset_path = self.acl_bootstrap_reset_path();
        let reset = std::fs::read_to_string(&reset_path)
            .ok()
            .map(|s| s.trim().to_string());
        let secret = generate_secret();
        let now = berth_structs::now_ms();
        let token = AclToken {
            accessor_id: berth_structs::generate_id(),
            name: "Bootstrap Token".into(),
            token_type: TokenType::Management,
            policies: Vec::new(),
            secret_hash: secret_hash(&secret),
            create_time_ms: now,
            ..AclToken::default()
        };
        let ((written, reset_from), _) = self
            .store
            .write_async(|t, changes| {
                let mut reset_from = None;
                if let Some(b) = &t.acl.bootstrap {
                    if reset.as_deref() != Some(b.accessor_id.as_str()) {
                        return Err(ServerError::Conflict(format!(
                        "ACL bootstrap already done (token {id} made it); make more tokens with a \
                         management token. Lost it? On the server, write {id} into {path} and \
                         bootstrap again (once; the reset is logged)",
                        id = b.accessor_id,
                        path = reset_path.display()
                    )));
                    }
                    reset_from = Some(b.accessor_id.clone());
                }
                changes.push(Change::put_acl(AclRecord::Bootstrap(AclBootstrap {
                    accessor_id: token.accessor_id.clone(),
                    time_ms: now,
                })));
                changes.push(Change::put_acl(AclRecord::Token(token.clone())));
                Ok::<_, ServerError>((token.accessor_id.clone(), reset_from))
            })
            .await?;
        if let Some(old) = reset_from {
            if let Err(e) = std::fs::remove_file(&reset_path) {
                tracing::warn!(path = %reset_path.display(), error = %e, "removing the used ACL bootstrap reset file failed");
            }
            tracing::warn!(target: "berth::audit", acl_accessor = %written, replaced = %old,
                "ACL bootstrap reset from the reset file: a new management token was made");
        }
        tracing::warn!(acl_accessor = %written, "ACL bootstrap done: a management token was made");
        Ok(NewToken {
            token: self.acl_token(&written)?,
            secret_id: secret,
        })
    }

    /// Makes or replaces policy `name` from its HCL `rules`.
    pub async fn upsert_acl_policy(
        &self,
        name: &str,
        description: &str,
        rules: &str,
    ) -> Result<AclPolicy, ServerError> {
        self.acl_must_be_on()?;
        berth_structs::check_name("policy name", name)
            .map_err(|e| ValidationError(vec![e.to_string()]))?;
        let parsed = berth_structs::spec::parse_acl_policy(rules)
            .map_err(|e| ValidationError(vec![format!("policy {name:?}: {e}")]))?;
        let policy = AclPolicy {
            name: name.to_string(),
            description: description.to_string(),
            rules: rules.to_string(),
            parsed,
            ..AclPolicy::default()
        };
        self.store
            .write_async(|_, changes| {
                changes.push(Change::put_acl(AclRecord::Policy(policy.clone())));
                Ok::<_, ServerError>(())
            })
            .await?;
        self.acl_policy(name)
    }

    pub fn acl_policies(&self) -> Vec<AclPolicy> {
        self.store
            .read(|t| t.acl.policies.values().cloned().collect())
    }

    pub fn acl_policy(&self, name: &str) -> Result<AclPolicy, ServerError> {
        self.store.read(|t| {
            t.acl
                .policies
                .get(name)
                .cloned()
                .ok_or_else(|| ServerError::not_found(format!("ACL policy {name:?} not found")))
        })
    }

    /// Deletes policy `name`; tokens that name it lose what it granted.
    pub async fn delete_acl_policy(&self, name: &str) -> Result<(), ServerError> {
        self.acl_must_be_on()?;
        self.store
            .write_async(|t, changes| {
                if !t.acl.policies.contains_key(name) {
                    return Err(ServerError::not_found(format!(
                        "ACL policy {name:?} not found"
                    )));
                }
                changes.push(Change::DeleteAcl(crate::state::acl_policy_key(name)));
                Ok(())
            })
            .await?;
        Ok(())
    }

    /// `acl token create`: a client token of existing policies, or a
    /// management token (which takes none).
    pub async fn create_acl_token(&self, req: TokenRequest) -> Result<NewToken, ServerError> {
        self.acl_must_be_on()?;
        if req.name.len() > 256 {
            return Err(ServerError::BadRequest(
                "token name is longer than 256 bytes".into(),
            ));
        }
        match req.token_type {
            TokenType::Management if !req.policies.is_empty() => {
                return Err(ServerError::BadRequest(
                    "a management token takes no policies: it may do everything".into(),
                ))
            }
            TokenType::Client if req.policies.is_empty() => {
                return Err(ServerError::BadRequest(
                    "a client token needs at least one policy (-policy NAME)".into(),
                ))
            }
            _ => {}
        }
        let now = berth_structs::now_ms();
        let expiration_time_ms = req
            .ttl
            .as_deref()
            .map(|ttl| parse_ttl("token", ttl).map(|d| expiry(now, d)))
            .transpose()?;
        let secret = generate_secret();
        let mut policies = req.policies.clone();
        policies.sort();
        policies.dedup();
        let token = AclToken {
            accessor_id: berth_structs::generate_id(),
            name: req.name,
            token_type: req.token_type,
            policies,
            secret_hash: secret_hash(&secret),
            create_time_ms: now,
            expiration_time_ms,
            ..AclToken::default()
        };
        self.store
            .write_async(|t, changes| {
                let missing: Vec<&str> = token
                    .policies
                    .iter()
                    .filter(|p| !t.acl.policies.contains_key(*p))
                    .map(String::as_str)
                    .collect();
                if !missing.is_empty() {
                    return Err(ServerError::BadRequest(format!(
                        "no ACL policy named {}",
                        missing.join(", ")
                    )));
                }
                changes.push(Change::put_acl(AclRecord::Token(token.clone())));
                Ok(())
            })
            .await?;
        Ok(NewToken {
            token: self.acl_token(&token.accessor_id)?,
            secret_id: secret,
        })
    }

    /// The tokens, without their hashes.
    pub fn acl_tokens(&self) -> Vec<AclToken> {
        self.store
            .read(|t| t.acl.tokens.values().map(AclToken::public).collect())
    }

    /// A token by accessor ID or unique prefix of one.
    pub fn acl_token(&self, accessor: &str) -> Result<AclToken, ServerError> {
        self.store.read(|t| {
            if let Some(tok) = t.acl.tokens.get(accessor) {
                return Ok(tok.public());
            }
            let found: Vec<&AclToken> = t
                .acl
                .tokens
                .values()
                .filter(|tok| !accessor.is_empty() && tok.accessor_id.starts_with(accessor))
                .collect();
            match found.as_slice() {
                [one] => Ok(one.public()),
                [] => Err(ServerError::not_found(format!(
                    "ACL token {accessor:?} not found"
                ))),
                many => Err(ServerError::BadRequest(format!(
                    "ACL token prefix {accessor:?} matches {} tokens",
                    many.len()
                ))),
            }
        })
    }

    /// The token of `secret` with its policies and what it may do.
    pub fn acl_token_self(&self, secret: &str) -> Result<TokenWithPolicies, ServerError> {
        self.acl_must_be_on()?;
        let acl = self.resolve_token(Some(secret))?;
        let hash = secret_hash(check_secret_text(secret).map_err(ServerError::Forbidden)?);
        self.store.read(|t| {
            let token = t
                .acl
                .token_by_hash(&hash)
                .ok_or_else(|| ServerError::Forbidden("ACL token not found".into()))?;
            Ok(TokenWithPolicies {
                token: token.public(),
                resolved_policies: token
                    .policies
                    .iter()
                    .filter_map(|p| t.acl.policies.get(p).cloned())
                    .collect(),
                acl,
            })
        })
    }

    pub async fn delete_acl_token(&self, accessor: &str) -> Result<(), ServerError> {
        self.acl_must_be_on()?;
        let id = self.acl_token(accessor)?.accessor_id;
        self.store
            .write_async(|_, changes| {
                changes.push(Change::DeleteAcl(crate::state::acl_token_key(&id)));
                Ok::<_, ServerError>(())
            })
            .await?;
        Ok(())
    }

    /// `node intro list`: the introduction tokens, never their secrets,
    /// oldest first.
    pub fn intro_tokens(&self) -> Vec<IntroToken> {
        let mut list: Vec<IntroToken> = self
            .store
            .read(|t| t.acl.intros.values().map(IntroToken::public).collect());
        list.sort_by(|a, b| {
            (a.create_time_ms, &a.accessor_id).cmp(&(b.create_time_ms, &b.accessor_id))
        });
        list
    }

    /// `node intro revoke`: the introduction token `accessor` (or the one
    /// whose accessor starts so) enrolls no node from now on. The token
    /// as it was.
    pub async fn revoke_intro_token(&self, accessor: &str) -> Result<IntroToken, ServerError> {
        if accessor.is_empty() {
            return Err(ServerError::BadRequest(
                "the accessor of the introduction token to revoke is empty".into(),
            ));
        }
        let (token, _) = self
            .store
            .write_async(|t, changes| {
                let matches: Vec<&IntroToken> = t
                    .acl
                    .intros
                    .values()
                    .filter(|i| i.accessor_id.starts_with(accessor))
                    .collect();
                let token = match matches.as_slice() {
                    [one] => (*one).clone(),
                    [] => {
                        return Err(ServerError::not_found(format!(
                            "no introduction token {accessor:?} (berth node intro list shows them)"
                        )))
                    }
                    many => {
                        let ids: Vec<&str> = many.iter().map(|i| i.accessor_id.as_str()).collect();
                        return Err(ServerError::BadRequest(format!(
                        "{accessor:?} names {} introduction tokens ({}); give more of the accessor",
                        ids.len(),
                        ids.join(", ")
                    )));
                    }
                };
                changes.push(Change::DeleteAcl(crate::state::acl_intro_key(
                    &token.accessor_id,
                )));
                Ok::<_, ServerError>(token.public())
            })
            .await?;
        tracing::info!(target: "berth::audit", accessor_id = %token.accessor_id,
            uses_left = token.uses_left, "node introduction token revoked");
        Ok(token)
    }

    /// `node intro create`: a token that lets `uses` new nodes register
    /// within `ttl`.
    pub async fn create_intro_token(
        &self,
        ttl: Option<&str>,
        uses: Option<u32>,
    ) -> Result<NewIntroToken, ServerError> {
        let ttl = ttl
            .map(|t| parse_ttl("introduction token", t))
            .transpose()?
            .unwrap_or(Duration::from_secs(3600));
        let uses = uses.unwrap_or(1);
        if uses == 0 || uses > MAX_INTRO_USES {
            return Err(ServerError::BadRequest(format!(
                "uses must be 1 to {MAX_INTRO_USES}"
            )));
        }
        let secret = generate_secret();
        let now = berth_structs::now_ms();
        let token = IntroToken {
            accessor_id: berth_structs::generate_id(),
            secret_hash: secret_hash(&secret),
            uses_left: uses,
            create_time_ms: now,
            expiration_time_ms: expiry(now, ttl),
            ..IntroToken::default()
        };
        self.store
            .write_async(|t, changes| {
                // Spent and expired introduction tokens go with each new one.
                for old in t.acl.intros.values().filter(|i| !i.usable_at(now)) {
                    changes.push(Change::DeleteAcl(crate::state::acl_intro_key(
                        &old.accessor_id,
                    )));
                }
                changes.push(Change::put_acl(AclRecord::Intro(token.clone())));
                Ok::<_, ServerError>(())
            })
            .await?;
        tracing::info!(accessor_id = %token.accessor_id, uses, "node introduction token made");
        Ok(NewIntroToken {
            token: token.public(),
            secret_id: secret,
        })
    }
}

/// What `token` may do, from the policies in `t`.
fn acl_of(t: &Tables, token: &AclToken) -> Acl {
    let accessor = Some(token.accessor_id.clone());
    match token.token_type {
        TokenType::Management => Acl::management(accessor),
        TokenType::Client => Acl::from_policies(
            accessor,
            token
                .policies
                .iter()
                .filter_map(|p| t.acl.policies.get(p))
                .map(|p| &p.parsed),
        ),
    }
}

/// Spends one use of the introduction token `secret` inside a write; the
/// refusal says why without the secret.
pub(crate) fn spend_intro_token(
    t: &Tables,
    secret: &str,
    changes: &mut Vec<Change>,
) -> Result<String, String> {
    let secret = check_secret_text(secret)?;
    let now = berth_structs::now_ms();
    let token = t
        .acl
        .intro_by_hash(&secret_hash(secret))
        .ok_or("the introduction token is not known to the servers")?;
    if !token.usable_at(now) {
        return Err(format!(
            "introduction token {} is spent or expired",
            token.accessor_id
        ));
    }
    let mut spent = token.clone();
    spent.uses_left -= 1;
    changes.push(Change::put_acl(AclRecord::Intro(spent)));
    Ok(token.accessor_id.clone())
}
