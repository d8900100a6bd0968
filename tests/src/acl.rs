//! The read-only ACL policy and the writes it refuses, a request with a
//! token, and the bootstrap token of an agent.

/// An ACL policy that reads jobs, nodes and plugins and writes nothing.
pub const READONLY_POLICY: &str = r#"
namespace "default" {
  policy = "read"
}
node   { policy = "read" }
plugin { policy = "read" }
"#;

/// Writes a token of [`READONLY_POLICY`] must be refused, as (method,
/// path, body): a job submit of `job_body`, a node purge and drain,
/// `system gc`, a volume create.
pub fn writes_refused_to_readers(job_body: &str) -> Vec<(&'static str, &'static str, String)> {
    vec![
        ("PUT", "/v1/jobs", job_body.to_string()),
        ("PUT", "/v1/node/x/purge", "{}".into()),
        ("POST", "/v1/node/x/drain", r#"{"enable": true}"#.into()),
        ("PUT", "/v1/system/gc", "{}".into()),
        (
            "PUT",
            "/v1/volume/csi/v1/create",
            r#"{"volume": {"id": "v1"}}"#.into(),
        ),
    ]
}

/// An HTTP/1.1 request of `method` on `path` with a JSON `body` and, when
/// given, an ACL token; the connection closes after the answer.
pub fn token_request(method: &str, path: &str, token: Option<&str>, body: &str) -> String {
    let auth = token.map_or(String::new(), |t| format!("X-Berth-Token: {t}\r\n"));
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The management token of the one ACL bootstrap of the agent whose HTTP
/// API is on `port` (plain HTTP), asked for until it answers (at most
/// 30 s, failing early should `agent` exit).
pub fn bootstrap_token(agent: &mut crate::Agent, port: u16) -> anyhow::Result<String> {
    crate::wait_for(
        "the ACL bootstrap",
        std::time::Duration::from_secs(30),
        || {
            agent.check_running()?;
            let Ok(a) = crate::http_at(
                port,
                &token_request("POST", "/v1/acl/bootstrap", None, "{}"),
            ) else {
                return Ok(None);
            };
            Ok((a.status == 200)
                .then(|| a.json().ok())
                .flatten()
                .and_then(|v| v["secret_id"].as_str().map(str::to_string)))
        },
    )
}
