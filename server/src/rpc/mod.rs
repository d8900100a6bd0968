//! The gRPC services of `berth.v1`: thin adapters that decode requests,
//! call the [`Server`](crate::Server) and map errors in one place
//! (`From<ServerError> for tonic::Status`).

pub(crate) mod calls;
mod csi_volume;
mod node;

pub use csi_volume::CsiVolumeService;
pub use node::NodeService;

use berth_structs::ValidationError;

use crate::error::ServerError;

pub(crate) fn decode_json<T: serde::de::DeserializeOwned>(
    what: &str,
    bytes: &[u8],
) -> Result<T, ServerError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ServerError::BadRequest(format!("decoding {what} JSON: {e}")))
}

pub(crate) fn parse<T: std::str::FromStr<Err = String>>(
    field: &str,
    value: &str,
) -> Result<T, ServerError> {
    value.parse().map_err(|e: String| {
        ServerError::Validation(ValidationError(vec![format!("{field}: {e}")]))
    })
}
