//! Node identity: the secret each node registered with, and the check
//! every node RPC passes before it acts. A node unknown to the servers
//! (never seen, or purged) registers with the secret it brings; from then on
//! only a caller with that secret acts for the node, and only for allocs
//! placed on it. Secrets live in their own table of the store, never on a
//! [`Node`], so no API answer can carry one; refusals name the node, never a
//! secret.

use berth_structs::{Node, NodeSecret};

use super::nodes::NodeRegistration;
use crate::error::ServerError;
use crate::server::Server;
use crate::state::{Change, Tables};

/// The secret a caller presented: the secret, or why there is none.
pub(crate) type Presented = Result<NodeSecret, String>;

fn refused(node_id: &str, why: &str) -> ServerError {
    ServerError::Forbidden(format!("node {node_id}: {why}"))
}

/// What a registration brings besides its node secret to be let in as a
/// node the servers do not know.
#[derive(Debug, Clone, Default)]
pub struct Enrollment {
    /// Whether the servers demand proof (ACLs or TLS on); when not, a
    /// node the servers do not know takes the secret it brings.
    pub required: bool,
    /// The caller presented a client (or server) certificate of the
    /// region, verified at the TLS handshake.
    pub certificate: bool,
    /// The introduction token the caller presented, if any.
    pub intro_token: Option<String>,
}

/// Check a registration of `node_id` with `secret` and record the secret;
/// runs inside the registration's write (so that an introduction token's
/// use is spent in the same write).
///
/// - A registered node keeps its secret: any other is refused.
/// - The secret a node had before it was purged or collected still
///   proves it.
/// - Otherwise, with enrollment required, the caller needs an
///   introduction token (which loses a use), or a certificate for a node
///   ID never seen; without, it takes the secret it brings.
///
/// The accessor of the introduction token it spent, if it spent one (the
/// caller logs the enrollment once it is written).
pub(crate) fn admit_registration(
    t: &Tables,
    node_id: &str,
    secret: &NodeSecret,
    enrollment: &Enrollment,
    changes: &mut Vec<Change>,
) -> Result<Option<String>, ServerError> {
    let known = t.node_secrets.get(node_id);
    if t.nodes.contains_key(node_id) && known.is_some_and(|k| k != secret) {
        return Err(refused(
            node_id,
            "is registered with another node secret; a node ID belongs to the client that registered it first",
        ));
    }
    let proven = known == Some(secret);
    let mut spent = None;
    if !proven && enrollment.required {
        match &enrollment.intro_token {
            Some(token) => {
                let accessor = super::acl::spend_intro_token(t, token, changes)
                    .map_err(|why| refused(node_id, &why))?;
                spent = Some(accessor);
            }
            None if enrollment.certificate && known.is_none() => {}
            None if known.is_some() => {
                return Err(refused(
                    node_id,
                    "was registered before with another node secret; it registers again only with that secret or a new introduction token",
                ))
            }
            None => {
                return Err(refused(
                    node_id,
                    "is not known to the servers: a new node registers with an introduction token (client { intro_token }, made by `berth node intro create`) or a client certificate",
                ))
            }
        }
    }
    if known != Some(secret) {
        changes.push(Change::PutNodeSecret {
            node_id: node_id.to_string(),
            secret: secret.clone(),
        });
    }
    Ok(spent)
}

/// Whether `presented` proves the caller is the registered node `node_id`.
/// An unknown node is NotFound (it must register first).
fn check(t: &Tables, node_id: &str, presented: &Presented) -> Result<(), ServerError> {
    if !t.nodes.contains_key(node_id) {
        return Err(ServerError::not_found(format!(
            "node {node_id:?} is not registered"
        )));
    }
    let secret = presented.as_ref().map_err(|why| refused(node_id, why))?;
    match t.node_secrets.get(node_id) {
        Some(known) if known == secret => Ok(()),
        Some(_) => Err(refused(
            node_id,
            "the node secret is not the one the node registered with",
        )),
        // Known from before node secrets (servers upgraded under running
        // clients): NotFound makes the client register again, which
        // records the secret it brings, instead of a refusal it would
        // repeat until its node is marked down.
        None => Err(ServerError::not_found(format!(
            "node {node_id:?} has no node secret on record; it must register again"
        ))),
    }
}

impl Server {
    /// Register (or re-register) a node that proves itself with `secret`,
    /// as `Node.Register` does. A node the servers know with another
    /// secret is refused and nothing changes.
    pub async fn register_node_with_secret(
        &self,
        node: Node,
        secret: &NodeSecret,
    ) -> Result<NodeRegistration, ServerError> {
        let enrollment = self.enrollment(false, None);
        self.register_node_enrolled(node, secret, enrollment).await
    }

    /// [`Self::register_node_with_secret`] with what the caller brings to
    /// enroll a node the servers do not know.
    pub async fn register_node_enrolled(
        &self,
        node: Node,
        secret: &NodeSecret,
        enrollment: Enrollment,
    ) -> Result<NodeRegistration, ServerError> {
        let node_id = node.id.clone();
        self.register_node_as(node, Some((secret, enrollment)))
            .await
            .inspect_err(|e| {
                if matches!(e, ServerError::Forbidden(_)) {
                    tracing::warn!(node_id, rpc = "Register", error = %e, "node RPC refused");
                }
            })
    }

    /// Whether a registration of `node_id` would be let in, checked before
    /// its node is decoded (the write checks again).
    pub(crate) fn precheck_registration(
        &self,
        node_id: &str,
        secret: &NodeSecret,
        enrollment: &Enrollment,
    ) -> Result<(), ServerError> {
        self.store
            .read(|t| {
                let mut scratch = Vec::new();
                admit_registration(t, node_id, secret, enrollment, &mut scratch).map(drop)
            })
            .inspect_err(|e| {
                tracing::warn!(node_id, rpc = "Register", error = %e, "node RPC refused");
            })
    }

    /// The enrollment rules in force, with what a caller brings.
    pub(crate) fn enrollment(&self, certificate: bool, intro_token: Option<String>) -> Enrollment {
        Enrollment {
            required: self.config.node_enrollment,
            certificate,
            intro_token,
        }
    }

    /// Check that the caller of node RPC `rpc` is the node `node_id`.
    pub(crate) fn authenticate_node(
        &self,
        rpc: &'static str,
        node_id: &str,
        presented: &Presented,
    ) -> Result<(), ServerError> {
        self.store
            .read(|t| check(t, node_id, presented))
            .inspect_err(|e| {
                if matches!(e, ServerError::Forbidden(_)) {
                    tracing::warn!(node_id, rpc, error = %e, "node RPC refused");
                }
            })
    }

    /// Check that node `node_id` may claim or release (`rpc`) a claim of
    /// `alloc_id` on `volume_id`: the alloc, and any claim it holds, are
    /// its own.
    pub(crate) fn authorize_claim_call(
        &self,
        rpc: &'static str,
        node_id: &str,
        volume_id: &str,
        alloc_id: &str,
    ) -> Result<(), ServerError> {
        self.store
            .read(|t| {
                let claim_node = t
                    .volumes
                    .get(volume_id)
                    .and_then(|v| v.claim_for(alloc_id))
                    .map(|c| c.node_id.as_str());
                let alloc_node = t.allocs.get(alloc_id).map(|a| a.node_id.as_str());
                match claim_node.into_iter().chain(alloc_node).find(|n| *n != node_id) {
                    Some(owner) => Err(refused(
                        node_id,
                        &format!(
                            "alloc {alloc_id} is placed on node {owner}; a node claims and releases volumes only for its own allocs"
                        ),
                    )),
                    None => Ok(()),
                }
            })
            .inspect_err(|e| {
                tracing::warn!(node_id, rpc, volume_id, alloc_id, error = %e, "node RPC refused");
            })
    }
}
