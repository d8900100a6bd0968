//! The web UI, served by every agent under `/ui/`: one page, its script
//! and its style sheet (`agent/ui/`), built into the binary. They are
//! plain HTML, JavaScript modules and CSS with no build step, so that a
//! fresh clone builds with cargo alone and what is served is what is in
//! the repository; the page reads the same HTTP API the CLI does (through
//! this agent, with the token it is given), following it with blocking
//! queries.
//!
//! The files hold no data and need no token. Each answer carries a content
//! security policy that lets the page run only its own script and style
//! and talk only to this agent, and an ETag of its content: a browser asks
//! again each time (`no-cache`) and gets a 304 while the binary is the
//! same.

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// One file of the UI.
struct Asset {
    /// Its name under `/ui/` (the page itself: empty).
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const ASSETS: &[Asset] = &[
    Asset {
        name: "",
        content_type: "text/html; charset=utf-8",
        body: include_str!("../../ui/index.html"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../../ui/app.js"),
    },
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../../ui/app.css"),
    },
];

/// Only the UI's own files, and requests to this agent.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
     frame-ancestors 'none'";

/// The UI's routes, for any router state.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|| async { Redirect::temporary("/ui/") }))
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|headers: HeaderMap| async move { serve("", &headers) }))
        .route(
            "/ui/{file}",
            get(|Path(file): Path<String>, headers: HeaderMap| async move {
                serve(&file, &headers)
            }),
        )
}

/// The asset `name` (404 for any other), or 304 when the browser holds it.
fn serve(name: &str, headers: &HeaderMap) -> Response {
    let Some(asset) = ASSETS.iter().find(|a| a.name == name) else {
        return super::errors::error_response(
            StatusCode::NOT_FOUND,
            &format!("no UI file {name:?}"),
        );
    };
    let etag = format!("\"{:016x}\"", fnv1a(asset.body.as_bytes()));
    let held = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut resp = if held {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, asset.content_type)], asset.body).into_response()
    };
    let h = resp.headers_mut();
    for (name, value) in [
        (header::CACHE_CONTROL, "no-cache"),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ] {
        h.insert(name, HeaderValue::from_static(value));
    }
    if let Ok(v) = HeaderValue::from_str(&etag) {
        h.insert(header::ETAG, v);
    }
    resp
}

/// FNV-1a, 64 bits: the ETag of a file's content.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get_with(path: &str, etag: Option<&str>) -> Response {
        let mut req = Request::get(path);
        if let Some(e) = etag {
            req = req.header(header::IF_NONE_MATCH, e);
        }
        routes::<()>()
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn each_file_is_served_with_its_type_and_policy() {
        for (path, kind) in [
            ("/ui/", "text/html"),
            ("/ui/app.js", "text/javascript"),
            ("/ui/app.css", "text/css"),
        ] {
            let resp = get_with(path, None).await;
            assert_eq!(resp.status(), StatusCode::OK, "{path}");
            let h = resp.headers();
            assert!(h[header::CONTENT_TYPE].to_str().unwrap().starts_with(kind));
            assert!(h[header::CONTENT_SECURITY_POLICY]
                .to_str()
                .unwrap()
                .contains("script-src 'self'"));
            assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        }
        assert_eq!(
            get_with("/ui/x.js", None).await.status(),
            StatusCode::NOT_FOUND
        );
        let r = get_with("/ui", None).await;
        assert_eq!(r.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(r.headers()[header::LOCATION], "/ui/");
        assert_eq!(
            get_with("/", None).await.headers()[header::LOCATION],
            "/ui/"
        );
    }

    #[tokio::test]
    async fn a_file_the_browser_holds_is_not_sent_again() {
        let first = get_with("/ui/app.js", None).await;
        let etag = first.headers()[header::ETAG].to_str().unwrap().to_string();
        let again = get_with("/ui/app.js", Some(&etag)).await;
        assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
        let other = get_with("/ui/app.js", Some("\"0\"")).await;
        assert_eq!(other.status(), StatusCode::OK);
    }

    /// Page weight: the first load of any page (the page, its script and
    /// its style sheet; the data comes after) stays well under 200 KB.
    #[test]
    fn the_ui_weighs_under_200_kb() {
        let total: usize = ASSETS.iter().map(|a| a.body.len()).sum();
        assert!(total < 150 * 1024, "the UI's files weigh {total} bytes");
    }
}
