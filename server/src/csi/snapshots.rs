//! Volume snapshots: create, list and delete them through a client that
//! runs the plugin's controller (`CreateSnapshot`, `ListSnapshots` with all
//! its pages, `DeleteSnapshot`). The servers keep no snapshot records: the
//! plugin is the one source of truth. A plugin whose controller lacks the
//! capability is a 400 that names it. Secrets go to the plugin only.

use std::collections::{BTreeMap, HashMap};

use crate::error::ServerError;
use crate::state::Tables;

/// A snapshot to take of a volume (`PUT /v1/volumes/snapshot`).
#[derive(Clone, Default, serde::Deserialize)]
pub struct SnapshotRequest {
    pub volume_id: String,
    /// Default: `<volume>-<unix-ms>`.
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Default: the volume's secrets.
    #[serde(default)]
    pub secrets: BTreeMap<String, String>,
}

impl std::fmt::Debug for SnapshotRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotRequest")
            .field("volume_id", &self.volume_id)
            .field("name", &self.name)
            .field("parameters", &self.parameters)
            .field(
                "secrets",
                &format_args!("<{} redacted>", self.secrets.len()),
            )
            .finish()
    }
}

/// A plugin that lacks a snapshot capability (the client answers
/// `Unimplemented`, naming it) is a bad request, not a failure.
pub(crate) fn unsupported_is_bad_request(e: ServerError) -> ServerError {
    match e {
        ServerError::Remote {
            code: tonic::Code::Unimplemented,
            message,
        } => ServerError::BadRequest(message),
        other => other,
    }
}

/// The berth volumes of `plugin_id`, by their external ID.
pub(crate) fn volumes_by_external_id(t: &Tables, plugin_id: &str) -> HashMap<String, String> {
    t.volumes
        .values()
        .filter(|v| v.plugin_id == plugin_id && !v.external_id.is_empty())
        .map(|v| (v.external_id.clone(), v.id.clone()))
        .collect()
}
