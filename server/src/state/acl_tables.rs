//! The ACL table: policies, tokens, introduction tokens and whether ACLs
//! were bootstrapped, kept in one table of the store (`Table::Acl`).
//! Tokens are found by the hash of their secret; no secret is stored.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use berth_structs::acl::{AclPolicy, AclToken, IntroToken};
use serde::{Deserialize, Serialize};

use super::record::{Record, RecordError, RecordStore, WriteEffects};
use super::{Indexes, Table};

/// When ACLs were bootstrapped: the management token it made may be
/// deleted later, bootstrap stays done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AclBootstrap {
    pub accessor_id: String,
    pub time_ms: i64,
}

/// One record of the ACL table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AclRecord {
    Policy(AclPolicy),
    Token(AclToken),
    Intro(IntroToken),
    Bootstrap(AclBootstrap),
}

impl AclRecord {
    /// The record's key in the table: `policy/NAME`, `token/ACCESSOR`,
    /// `intro/ACCESSOR`, `bootstrap`.
    pub fn key(&self) -> String {
        match self {
            AclRecord::Policy(p) => policy_key(&p.name),
            AclRecord::Token(t) => token_key(&t.accessor_id),
            AclRecord::Intro(i) => intro_key(&i.accessor_id),
            AclRecord::Bootstrap(_) => BOOTSTRAP_KEY.to_string(),
        }
    }

    /// The create and modify index, where the record has them.
    pub fn indexes(&self) -> [u64; 2] {
        match self {
            AclRecord::Policy(p) => [p.create_index, p.modify_index],
            AclRecord::Token(t) => [t.create_index, t.modify_index],
            AclRecord::Intro(i) => [i.create_index, i.modify_index],
            AclRecord::Bootstrap(_) => [0, 0],
        }
    }
}

pub const BOOTSTRAP_KEY: &str = "bootstrap";

pub fn policy_key(name: &str) -> String {
    format!("policy/{name}")
}

pub fn token_key(accessor_id: &str) -> String {
    format!("token/{accessor_id}")
}

pub fn intro_key(accessor_id: &str) -> String {
    format!("intro/{accessor_id}")
}

/// The ACL records in memory, with lookups by secret hash.
#[derive(Debug, Clone, Default)]
pub struct AclTables {
    pub policies: BTreeMap<String, AclPolicy>,
    /// By accessor ID.
    pub tokens: BTreeMap<String, AclToken>,
    /// By accessor ID.
    pub intros: BTreeMap<String, IntroToken>,
    pub bootstrap: Option<AclBootstrap>,
    token_by_hash: HashMap<String, String>,
    intro_by_hash: HashMap<String, String>,
}

impl AclTables {
    /// The tables holding `records` (as loaded).
    pub fn from_records(records: impl IntoIterator<Item = AclRecord>) -> AclTables {
        let mut t = AclTables::default();
        for r in records {
            t.put(r);
        }
        t
    }

    pub fn put(&mut self, record: AclRecord) {
        match record {
            AclRecord::Policy(p) => {
                self.policies.insert(p.name.clone(), p);
            }
            AclRecord::Token(tok) => {
                if let Some(old) = self.tokens.get(&tok.accessor_id) {
                    self.token_by_hash.remove(&old.secret_hash);
                }
                self.token_by_hash
                    .insert(tok.secret_hash.clone(), tok.accessor_id.clone());
                self.tokens.insert(tok.accessor_id.clone(), tok);
            }
            AclRecord::Intro(i) => {
                if let Some(old) = self.intros.get(&i.accessor_id) {
                    self.intro_by_hash.remove(&old.secret_hash);
                }
                self.intro_by_hash
                    .insert(i.secret_hash.clone(), i.accessor_id.clone());
                self.intros.insert(i.accessor_id.clone(), i);
            }
            AclRecord::Bootstrap(b) => self.bootstrap = Some(b),
        }
    }

    /// Removes the record under `key`.
    pub fn delete(&mut self, key: &str) {
        if let Some(name) = key.strip_prefix("policy/") {
            self.policies.remove(name);
        } else if let Some(id) = key.strip_prefix("token/") {
            if let Some(old) = self.tokens.remove(id) {
                self.token_by_hash.remove(&old.secret_hash);
            }
        } else if let Some(id) = key.strip_prefix("intro/") {
            if let Some(old) = self.intros.remove(id) {
                self.intro_by_hash.remove(&old.secret_hash);
            }
        } else if key == BOOTSTRAP_KEY {
            self.bootstrap = None;
        }
    }

    /// The token whose secret hashes to `hash`.
    pub fn token_by_hash(&self, hash: &str) -> Option<&AclToken> {
        self.token_by_hash
            .get(hash)
            .and_then(|id| self.tokens.get(id))
    }

    /// The introduction token whose secret hashes to `hash`.
    pub fn intro_by_hash(&self, hash: &str) -> Option<&IntroToken> {
        self.intro_by_hash
            .get(hash)
            .and_then(|id| self.intros.get(id))
    }

    /// Sets the create and modify index of a record about to be written.
    pub fn stamp(&self, record: &mut AclRecord, index: u64) {
        match record {
            AclRecord::Policy(p) => {
                p.create_index = self.policies.get(&p.name).map_or(index, |o| o.create_index);
                p.modify_index = index;
            }
            AclRecord::Token(t) => {
                t.create_index = self
                    .tokens
                    .get(&t.accessor_id)
                    .map_or(index, |o| o.create_index);
                t.modify_index = index;
            }
            AclRecord::Intro(i) => {
                i.create_index = self
                    .intros
                    .get(&i.accessor_id)
                    .map_or(index, |o| o.create_index);
                i.modify_index = index;
            }
            AclRecord::Bootstrap(_) => {}
        }
    }
}

impl Record for AclRecord {
    const TABLE: Table = Table::Acl;
    type Store = AclTables;

    fn key(&self) -> Cow<'_, str> {
        Cow::Owned(AclRecord::key(self))
    }

    fn indexes(&self) -> [u64; 2] {
        AclRecord::indexes(self)
    }

    fn stamp(&mut self, old: Option<&Self>, index: u64, _now_ms: i64) {
        let create_index = old.map_or(index, |o| AclRecord::indexes(o)[0]);
        let (create, modify) = match self {
            AclRecord::Policy(p) => (&mut p.create_index, &mut p.modify_index),
            AclRecord::Token(t) => (&mut t.create_index, &mut t.modify_index),
            AclRecord::Intro(i) => (&mut i.create_index, &mut i.modify_index),
            AclRecord::Bootstrap(_) => return,
        };
        *create = create_index;
        *modify = index;
    }

    fn report_bad(key: &str, decoded: Option<&Self>, error: Option<&RecordError>) {
        match (decoded, error) {
            (_, Some(e)) => tracing::error!(table = "acl", key = %key, error = %e,
                "ACL record failed to decode; quarantining it"),
            (Some(_), None) => tracing::error!(table = "acl", key = %key,
                "ACL record does not match its key or has an impossible index; quarantining it"),
            (None, None) => {}
        }
    }
}

/// The ACL records keep their own lookups (by secret hash), none in
/// [`Indexes`], and wake no alloc or node watch.
impl RecordStore<AclRecord> for AclTables {
    fn stamp(&self, record: &mut AclRecord, index: u64, _now_ms: i64) {
        AclTables::stamp(self, record, index);
    }

    fn put(&mut self, record: AclRecord, _idx: &mut Indexes, _fx: &mut WriteEffects) {
        AclTables::put(self, record);
    }

    fn delete(&mut self, key: &str, _idx: &mut Indexes, _fx: &mut WriteEffects) {
        AclTables::delete(self, key);
    }

    fn insert_loaded(&mut self, record: AclRecord) {
        AclTables::put(self, record);
    }

    fn index_all(&self, _idx: &mut Indexes) {}

    /// ACL records do not count: the store's index is kept above those of
    /// the jobs, allocs, nodes and volumes (and the tables' indexes).
    fn max_modify_index(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_found_by_its_hash_until_replaced_or_deleted() {
        let mut t = AclTables::default();
        let tok = AclToken {
            accessor_id: "a1".into(),
            secret_hash: "h1".into(),
            ..AclToken::default()
        };
        t.put(AclRecord::Token(tok.clone()));
        assert_eq!(
            t.token_by_hash("h1").map(|t| t.accessor_id.as_str()),
            Some("a1")
        );
        t.put(AclRecord::Token(AclToken {
            secret_hash: "h2".into(),
            ..tok
        }));
        assert!(t.token_by_hash("h1").is_none());
        assert!(t.token_by_hash("h2").is_some());
        t.delete(&token_key("a1"));
        assert!(t.token_by_hash("h2").is_none());
        assert!(t.tokens.is_empty());
    }

    #[test]
    fn records_round_trip_through_json_with_their_keys() {
        for r in [
            AclRecord::Policy(AclPolicy {
                name: "ops".into(),
                ..AclPolicy::default()
            }),
            AclRecord::Intro(IntroToken {
                accessor_id: "i".into(),
                ..IntroToken::default()
            }),
            AclRecord::Bootstrap(AclBootstrap {
                accessor_id: "a".into(),
                time_ms: 1,
            }),
        ] {
            let json = serde_json::to_vec(&r).unwrap();
            let back: AclRecord = serde_json::from_slice(&json).unwrap();
            assert_eq!(back.key(), r.key());
            assert_eq!(back, r);
        }
    }
}
