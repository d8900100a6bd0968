//! The node secret: a random value a client creates with its node ID at
//! first start and sends with every node RPC, so that the servers can tell
//! the client that registered a node from anyone else naming its ID.
//!
//! It never appears in `Debug` output, and compares in constant time.

use serde::{Deserialize, Serialize};

/// The longest node secret accepted (a generated one is 64 characters).
pub const MAX_NODE_SECRET_LEN: usize = 256;

/// A node's secret. `Debug` redacts it; [`NodeSecret::expose`] is the one
/// way to the text, for the wire and the state databases.
#[derive(Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeSecret(String);

/// A node secret that cannot be one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeSecretError {
    #[error("node secret is empty")]
    Empty,
    #[error("node secret is {len} characters long; the limit is {MAX_NODE_SECRET_LEN}")]
    TooLong { len: usize },
    #[error("node secret holds a character other than printable ASCII")]
    NotPrintable,
}

impl NodeSecret {
    /// A new random secret: 244 random bits as 64 hex characters.
    pub fn generate() -> NodeSecret {
        NodeSecret(format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        ))
    }

    /// A secret read from the wire or a database. The message of the error
    /// never holds the text.
    pub fn parse(text: &str) -> Result<NodeSecret, NodeSecretError> {
        if text.is_empty() {
            return Err(NodeSecretError::Empty);
        }
        if text.len() > MAX_NODE_SECRET_LEN {
            return Err(NodeSecretError::TooLong { len: text.len() });
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(NodeSecretError::NotPrintable);
        }
        Ok(NodeSecret(text.to_string()))
    }

    /// The secret's text.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl PartialEq for NodeSecret {
    /// Constant time in the length of the secrets, so that a caller cannot
    /// find a secret one character at a time by timing refusals.
    fn eq(&self, other: &NodeSecret) -> bool {
        let (a, b) = (self.0.as_bytes(), other.0.as_bytes());
        let mut diff = a.len() ^ b.len();
        for i in 0..a.len().max(b.len()) {
            let x = a.get(i).copied().unwrap_or(0);
            let y = b.get(i).copied().unwrap_or(0);
            diff |= usize::from(x ^ y);
        }
        diff == 0
    }
}

impl Eq for NodeSecret {}

impl std::fmt::Debug for NodeSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeSecret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_are_long_distinct_and_parse_back() {
        let a = NodeSecret::generate();
        let b = NodeSecret::generate();
        assert_eq!(a.expose().len(), 64);
        assert_ne!(a, b);
        assert_eq!(NodeSecret::parse(a.expose()).unwrap(), a);
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let s = NodeSecret::generate();
        let shown = format!("{s:?} {:?}", Some(&s));
        assert!(!shown.contains(s.expose()), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn bad_secrets_are_refused_without_echoing_them() {
        assert_eq!(NodeSecret::parse(""), Err(NodeSecretError::Empty));
        let long = "x".repeat(MAX_NODE_SECRET_LEN + 1);
        let e = NodeSecret::parse(&long).unwrap_err();
        assert_eq!(
            e.to_string(),
            "node secret is 257 characters long; the limit is 256"
        );
        let e = NodeSecret::parse("abc def").unwrap_err();
        assert!(!e.to_string().contains("abc"), "{e}");
    }

    #[test]
    fn secrets_of_different_lengths_differ() {
        let a = NodeSecret::parse("abcd").unwrap();
        assert_ne!(a, NodeSecret::parse("abc").unwrap());
        assert_ne!(a, NodeSecret::parse("abcde").unwrap());
        assert_eq!(a, NodeSecret::parse("abcd").unwrap());
    }
}
