//! The API's one error shape and the extractors that keep to it: every
//! failure is an [`ApiError`], `{"error": "<message>"}`, whether a handler,
//! a bad body, path or query ([`ApiJson`], [`ApiPath`], [`ApiQuery`]), an
//! unknown path or axum itself ([`one_error_shape`]) gave it.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{header, request::Parts, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use berth_server::ServerError;
use serde::de::DeserializeOwned;
use serde_json::json;

use axum::Json;

use super::{describe_size, MAX_REQUEST_BODY};

/// The message of a 413 answer.
pub fn body_too_large_message() -> String {
    format!(
        "request body is larger than the {} limit",
        describe_size(MAX_REQUEST_BODY as u64)
    )
}

/// An API error: its status and a message that names the problem. Answered
/// as `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// A 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// A 500: something on our side failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl From<ServerError> for ApiError {
    fn from(e: ServerError) -> Self {
        let status =
            StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        ApiError::new(status, e.to_string())
    }
}

/// The one error body.
pub(crate) fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), error = %self.message, "API request failed");
        }
        error_response(self.status, &self.message)
    }
}

/// A request path for a message: long ones are cut.
pub(crate) fn shown_path(path: &str) -> String {
    const MAX: usize = 200;
    if path.len() <= MAX {
        return path.to_string();
    }
    let mut end = MAX;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &path[..end])
}

/// serde writes names in backticks; the API's messages quote them as JSON
/// does.
pub(crate) fn quote_names(message: &str) -> String {
    message.replace('`', "\"")
}

/// A request body decoded from JSON into `T`. Every way the body can be
/// wrong (not JSON, too large, malformed, the wrong shape) is an
/// [`ApiError`] that says where.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        check_json_content_type(req.headers())?;
        // A body announced too large is refused before any of it is read.
        let announced = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if announced.is_some_and(|n| n > MAX_REQUEST_BODY as u64) {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                body_too_large_message(),
            ));
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        decode_json(&bytes).map(ApiJson)
    }
}

pub(crate) fn check_json_content_type(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "request body must be JSON: set content-type: application/json",
        ));
    };
    let text = value.to_str().unwrap_or_default();
    let mime = text
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let is_json =
        mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "request body must be JSON: content-type is {text:?}, expected application/json"
            ),
        ));
    }
    Ok(())
}

pub(crate) fn body_rejection(r: BytesRejection) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, body_too_large_message());
    }
    let cause = std::error::Error::source(&r)
        .map(ToString::to_string)
        .unwrap_or_else(|| r.body_text());
    ApiError::bad_request(format!("reading the request body: {cause}"))
}

/// Decodes a whole JSON document: syntax errors are 400s with their line
/// and column, a document of the wrong shape is a 422 naming the field.
pub(crate) fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        json_error(e.into_inner(), &path)
    })?;
    de.end().map_err(|e| json_error(e, "."))?;
    Ok(value)
}

pub(crate) fn json_error(e: serde_json::Error, path: &str) -> ApiError {
    let full = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    let message = quote_names(full.strip_suffix(&position).unwrap_or(&full));
    match e.classify() {
        // serde's messages show the value that did not fit; a secret's
        // value is never echoed, not even to its sender.
        serde_json::error::Category::Data if path.to_ascii_lowercase().contains("secret") => {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("{path}: invalid value (secrets are not shown)"),
            )
        }
        serde_json::error::Category::Data => {
            let message = if path == "." || path.is_empty() {
                message
            } else {
                format!("{path}: {message}")
            };
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message)
        }
        _ => ApiError::bad_request(format!(
            "invalid JSON at line {} column {}: {message}",
            e.line(),
            e.column()
        )),
    }
}

/// Path parameters; a parameter that cannot be decoded is a 400.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(ApiError::bad_request(format!(
                    "invalid URL path {}: {}",
                    shown_path(parts.uri.path()),
                    quote_names(&e.kind().to_string())
                )))
            }
            Err(other) => Err(ApiError::internal(other.body_text())),
        }
    }
}

/// A query string decoded into `T`; one that does not fit is a 400 naming
/// the parameter.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::try_from_uri(&parts.uri)
            .map(|axum::extract::Query(v)| ApiQuery(v))
            .map_err(|r| {
                let cause = std::error::Error::source(&r)
                    .map(ToString::to_string)
                    .unwrap_or_else(|| r.body_text());
                ApiError::bad_request(format!(
                    "invalid query string {:?}: {}",
                    shown_path(parts.uri.query().unwrap_or_default()),
                    quote_names(&cause)
                ))
            })
    }
}

/// The answer to a path no route serves.
pub(crate) async fn unknown_api_path(uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("unknown API path {}", shown_path(uri.path())),
    )
}

/// The layer that keeps every error in the one shape: an error answer that
/// is not JSON (axum's own 405, a 413 from the body limit, anything a
/// future route lets through) is rewritten as `{"error": ...}` with a
/// message that names the problem. Its other headers (`Allow`) are kept.
pub async fn one_error_shape(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = shown_path(req.uri().path());
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json(&resp) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let message = match status {
        StatusCode::METHOD_NOT_ALLOWED => method_not_allowed_message(&method, &path, &parts),
        StatusCode::NOT_FOUND => format!("unknown API path {path}"),
        StatusCode::PAYLOAD_TOO_LARGE => body_too_large_message(),
        _ => {
            let text = axum::body::to_bytes(body, 64 * 1024)
                .await
                .map(|b| String::from_utf8_lossy(&b).trim().to_string())
                .unwrap_or_default();
            if text.is_empty() {
                status
                    .canonical_reason()
                    .unwrap_or("request failed")
                    .to_ascii_lowercase()
            } else {
                quote_names(&text)
            }
        }
    };
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    let fresh = error_response(status, &message);
    let (fresh_parts, fresh_body) = fresh.into_parts();
    parts.headers.extend(fresh_parts.headers);
    Response::from_parts(parts, fresh_body)
}

pub(crate) fn is_json(resp: &Response) -> bool {
    resp.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

pub(crate) fn method_not_allowed_message(
    method: &Method,
    path: &str,
    parts: &axum::http::response::Parts,
) -> String {
    let allowed: Vec<&str> = parts
        .headers
        .get(header::ALLOW)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .collect();
    if allowed.is_empty() {
        format!("method {method} is not allowed on {path}")
    } else {
        format!(
            "method {method} is not allowed on {path} (allowed: {})",
            allowed.join(", ")
        )
    }
}
