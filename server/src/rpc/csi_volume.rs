//! `berth.v1.CSIVolume`: claims and unpublish for clients.

use std::sync::Arc;

use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::csi_volume_server::CsiVolume;
use berth_structs::CsiMountOptions;
use tonic::{Request, Response, Status};

use super::{parse, presented_secret};
use crate::csi::{ReleaseOrigin, VolumeClaimRequest};
use crate::error::ServerError;
use crate::server::Server;

pub struct CsiVolumeService {
    server: Arc<Server>,
}

impl CsiVolumeService {
    pub(crate) fn new(server: Arc<Server>) -> CsiVolumeService {
        CsiVolumeService { server }
    }
}

fn claim_request(r: pb::ClaimRequest) -> Result<VolumeClaimRequest, ServerError> {
    let cap = r
        .capability
        .ok_or_else(|| ServerError::BadRequest("claim: capability is required".into()))?;
    if r.volume_id.is_empty() || r.alloc_id.is_empty() || r.node_id.is_empty() {
        return Err(ServerError::BadRequest(
            "claim: volume_id, alloc_id and node_id are required".into(),
        ));
    }
    Ok(VolumeClaimRequest {
        mode: parse("mode", &r.mode)?,
        access_mode: parse("capability.access_mode", &cap.access_mode)?,
        attachment_mode: parse("capability.attachment_mode", &cap.attachment_mode)?,
        volume_id: r.volume_id,
        alloc_id: r.alloc_id,
        node_id: r.node_id,
        mount_options: CsiMountOptions {
            fs_type: cap.fs_type,
            mount_flags: cap.mount_flags,
        },
    })
}

#[tonic::async_trait]
impl CsiVolume for CsiVolumeService {
    async fn claim(
        &self,
        req: Request<pb::ClaimRequest>,
    ) -> Result<Response<pb::ClaimResponse>, Status> {
        let presented = presented_secret(&req);
        let req = claim_request(req.into_inner())?;
        self.server
            .authenticate_node("Claim", &req.node_id, &presented)?;
        self.server
            .authorize_claim_call("Claim", &req.node_id, &req.volume_id, &req.alloc_id)?;
        let (vid, aid, nid) = (
            req.volume_id.clone(),
            req.alloc_id.clone(),
            req.node_id.clone(),
        );
        let mode = req.mode.as_str();
        let started = std::time::Instant::now();
        let grant = self.server.claim_volume(req).await;
        berth_metrics::metrics()
            .server_claim_duration
            .get_or_create(&berth_metrics::ModeOutcomeLabels {
                mode,
                outcome: berth_metrics::Outcome::of(&grant),
            })
            .observe(started.elapsed().as_secs_f64());
        let grant = grant.inspect_err(|e| match e {
            // A node asking for what was not placed on it: audited.
            ServerError::Forbidden(_) => tracing::warn!(target: "berth::audit",
                node_id = %nid, volume_id = %vid, alloc_id = %aid, error = %e, "claim refused"),
            _ => tracing::info!(volume_id = %vid, alloc_id = %aid, error = %e, "claim refused"),
        })?;
        Ok(Response::new(pb::ClaimResponse {
            volume_id: grant.volume_id,
            external_id: grant.external_id,
            plugin_id: grant.plugin_id,
            publish_context: grant.publish_context.into_iter().collect(),
            volume_context: grant.volume_context.into_iter().collect(),
            secrets: grant.secrets.into_iter().collect(),
            mount_flags: grant.mount_options.mount_flags,
            fs_type: grant.mount_options.fs_type,
        }))
    }

    async fn unpublish(
        &self,
        req: Request<pb::UnpublishRequest>,
    ) -> Result<Response<pb::UnpublishResponse>, Status> {
        let presented = presented_secret(&req);
        let r = req.into_inner();
        if r.volume_id.is_empty() || r.alloc_id.is_empty() || r.node_id.is_empty() {
            return Err(ServerError::BadRequest(
                "unpublish: volume_id, alloc_id and node_id are required".into(),
            )
            .into());
        }
        self.server
            .authenticate_node("Unpublish", &r.node_id, &presented)?;
        self.server
            .authorize_claim_call("Unpublish", &r.node_id, &r.volume_id, &r.alloc_id)?;
        let origin = ReleaseOrigin::Client { node_id: r.node_id };
        self.server
            .unpublish_claim(&r.volume_id, &r.alloc_id, origin)
            .await?;
        Ok(Response::new(pb::UnpublishResponse {}))
    }
}
