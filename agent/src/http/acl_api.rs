//! The ACL routes of the server API (`/v1/acl/...`) and node
//! introduction tokens (`/v1/node/intro`). Secrets are answered once, when
//! made; lists and reads carry accessor IDs only.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use berth_server::{Server, TokenRequest};
use serde::Deserialize;
use serde_json::json;

use super::{to_json, ApiError, ApiJson, ApiPath, ApiResult};

pub async fn bootstrap(State(s): State<Arc<Server>>) -> ApiResult {
    to_json(&s.acl_bootstrap().await?)
}

pub async fn list_policies(State(s): State<Arc<Server>>) -> ApiResult {
    let list: Vec<_> = s
        .acl_policies()
        .into_iter()
        .map(|p| json!({"name": p.name, "description": p.description, "create_index": p.create_index, "modify_index": p.modify_index}))
        .collect();
    Ok(Json(serde_json::Value::Array(list)))
}

pub async fn get_policy(State(s): State<Arc<Server>>, ApiPath(name): ApiPath<String>) -> ApiResult {
    to_json(&s.acl_policy(&name)?)
}

/// The body of `PUT /v1/acl/policy/{name}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyBody {
    #[serde(default)]
    description: String,
    /// The policy's HCL.
    rules: String,
}

pub async fn put_policy(
    State(s): State<Arc<Server>>,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<PolicyBody>,
) -> ApiResult {
    to_json(
        &s.upsert_acl_policy(&name, &body.description, &body.rules)
            .await?,
    )
}

pub async fn delete_policy(
    State(s): State<Arc<Server>>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult {
    s.delete_acl_policy(&name).await?;
    Ok(Json(json!({})))
}

pub async fn list_tokens(State(s): State<Arc<Server>>) -> ApiResult {
    to_json(&s.acl_tokens())
}

pub async fn create_token(
    State(s): State<Arc<Server>>,
    ApiJson(body): ApiJson<TokenRequest>,
) -> ApiResult {
    to_json(&s.create_acl_token(body).await?)
}

pub async fn token_self(State(s): State<Arc<Server>>, headers: HeaderMap) -> ApiResult {
    let secret = super::acl::token_of(&headers)?.ok_or_else(|| {
        ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "no ACL token given (header X-Berth-Token)",
        )
    })?;
    to_json(&s.acl_token_self(&secret)?)
}

pub async fn get_token(
    State(s): State<Arc<Server>>,
    ApiPath(accessor): ApiPath<String>,
) -> ApiResult {
    to_json(&s.acl_token(&accessor)?)
}

pub async fn delete_token(
    State(s): State<Arc<Server>>,
    ApiPath(accessor): ApiPath<String>,
) -> ApiResult {
    s.delete_acl_token(&accessor).await?;
    Ok(Json(json!({})))
}

/// The body of `PUT /v1/node/intro`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct IntroBody {
    /// How long the token lets nodes register (`"1h"`, the default).
    #[serde(default)]
    ttl: Option<String>,
    /// How many registrations it allows (1, the default).
    #[serde(default)]
    uses: Option<u32>,
}

pub async fn list_intros(State(s): State<Arc<Server>>) -> ApiResult {
    to_json(&s.intro_tokens())
}

pub async fn revoke_intro(
    State(s): State<Arc<Server>>,
    ApiPath(accessor): ApiPath<String>,
) -> ApiResult {
    to_json(&s.revoke_intro_token(&accessor).await?)
}

pub async fn create_intro(
    State(s): State<Arc<Server>>,
    ApiJson(body): ApiJson<IntroBody>,
) -> ApiResult {
    to_json(&s.create_intro_token(body.ttl.as_deref(), body.uses).await?)
}
