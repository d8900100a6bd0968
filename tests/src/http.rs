//! Raw HTTP/1.1 requests to an agent's API and their answers, and the
//! agent protocol's `Agent.ForwardHttp`.

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

/// An answer of the HTTP API, as read off the wire.
pub struct HttpAnswer {
    pub status: u16,
    /// The status line and the headers.
    pub head: String,
    pub body: Vec<u8>,
}

impl HttpAnswer {
    /// The value of the header `name` (in any case), when there is one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body decoded as JSON; an error with the body when it is not.
    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| self.text())
    }
}

/// `Agent.ForwardHttp` of `method path` (with `token` as `X-Berth-Token`
/// when given, and a JSON `body`) on `channel` to an agent protocol port;
/// the status of the HTTP answer.
pub async fn forward_http(
    channel: tonic::transport::Channel,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<u32> {
    use berth_proto::berth::v1 as pb;
    let mut headers = vec![pb::HttpHeader {
        name: "content-type".into(),
        value: b"application/json".to_vec(),
    }];
    if let Some(t) = token {
        headers.push(pb::HttpHeader {
            name: "x-berth-token".into(),
            value: t.as_bytes().to_vec(),
        });
    }
    let answer = pb::agent_client::AgentClient::new(channel)
        .forward_http(pb::HttpRequest {
            method: method.into(),
            path_and_query: path.into(),
            headers,
            body: body.as_bytes().to_vec(),
        })
        .await
        .with_context(|| format!("Agent.ForwardHttp of {method} {path}"))?
        .into_inner();
    Ok(answer.status)
}

/// Sends `request`, a whole raw HTTP/1.1 request (asking for
/// `Connection: close`), to the HTTP API on loopback `port` and reads the
/// answer to its end.
pub fn http_at(port: u16, request: &str) -> Result<HttpAnswer> {
    http_at_within(port, request, Duration::from_secs(30))
}

/// [`http_at`], waiting up to `timeout` for the answer (a request that
/// places thousands of allocs takes longer than a test's 30 s).
pub fn http_at_within(port: u16, request: &str, timeout: Duration) -> Result<HttpAnswer> {
    http_send_at(port, request, timeout)?.answer()
}

/// A request on its own connection whose answer is read later.
pub struct HttpSent {
    conn: std::net::TcpStream,
}

/// Sends `request` as [`http_at`] does and returns once it is on the wire,
/// before its answer: a blocking query sent before the change it waits
/// for. [`HttpSent::answer`] waits up to `timeout` for the answer.
pub fn http_send_at(port: u16, request: &str, timeout: Duration) -> Result<HttpSent> {
    use std::io::Write;
    let mut conn =
        std::net::TcpStream::connect(("127.0.0.1", port)).context("connecting to the HTTP API")?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.write_all(request.as_bytes())?;
    Ok(HttpSent { conn })
}

impl HttpSent {
    /// Reads the answer to its end.
    pub fn answer(mut self) -> Result<HttpAnswer> {
        use std::io::Read;
        let mut raw = Vec::new();
        self.conn.read_to_end(&mut raw)?;
        parse_http_answer(raw)
    }
}

/// Splits a whole raw HTTP/1.1 answer into its status, head and body.
pub(crate) fn parse_http_answer(raw: Vec<u8>) -> Result<HttpAnswer> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP answer: {:?}", String::from_utf8_lossy(&raw)))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no status in {head:?}"))?;
    Ok(HttpAnswer {
        status,
        head,
        body: raw[split + 4..].to_vec(),
    })
}

/// GETs `path` from the HTTP API on loopback `port` and decodes the JSON
/// answer; an error for any status but 200.
pub fn api_get_at(port: u16, path: &str) -> Result<Value> {
    let answer = http_at(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )
    .with_context(|| format!("GET {path}"))?;
    let body = String::from_utf8_lossy(&answer.body);
    if answer.status != 200 {
        bail!("GET {path}: {}\n{body}", answer.head);
    }
    if answer
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        bail!("GET {path}: a chunked answer is not expected");
    }
    serde_json::from_slice(&answer.body).with_context(|| format!("GET {path}: decoding {body:?}"))
}
