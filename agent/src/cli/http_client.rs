//! A small blocking HTTP/1.1 client for the CLI: one request per
//! connection, JSON bodies. The CLI makes a handful of requests, so nothing
//! heavier is warranted.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

/// The API's base address, from `-address`, `BERTH_ADDR`, or the default.
#[derive(Debug, Clone)]
pub struct ApiClient {
    /// `host:port`.
    authority: String,
    timeout: Duration,
}

pub const DEFAULT_ADDR: &str = "http://127.0.0.1:4747";

/// A response that is not 2xx: the API's error message.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (HTTP {})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

impl ApiClient {
    pub fn new(address: &str) -> Result<ApiClient> {
        let authority = address
            .strip_prefix("http://")
            .unwrap_or(address)
            .trim_end_matches('/');
        if address.starts_with("https://") {
            bail!("address {address:?}: https is not supported yet; use http://");
        }
        if authority.is_empty() || authority.contains('/') {
            bail!("address {address:?} is not of the form http://HOST:PORT");
        }
        Ok(ApiClient {
            authority: authority.to_string(),
            timeout: Duration::from_secs(30),
        })
    }

    pub fn get(&self, path: &str) -> Result<serde_json::Value> {
        self.request("GET", path, None).map(|(v, _)| v)
    }

    /// A GET and the state index the answer reflects (`X-Berth-Index`),
    /// for blocking queries.
    pub fn get_indexed(&self, path: &str) -> Result<(serde_json::Value, u64)> {
        let (v, index) = self.request("GET", path, None)?;
        Ok((v, index.unwrap_or(0)))
    }

    pub fn put(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        self.request("PUT", path, Some(body)).map(|(v, _)| v)
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        self.request("POST", path, Some(body)).map(|(v, _)| v)
    }

    pub fn delete(&self, path: &str) -> Result<serde_json::Value> {
        self.request("DELETE", path, None).map(|(v, _)| v)
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(serde_json::Value, Option<u64>)> {
        let addr = self
            .authority
            .to_socket_addrs()
            .with_context(|| format!("resolving berth API address {}", self.authority))?
            .next()
            .ok_or_else(|| anyhow!("berth API address {} resolves to nothing", self.authority))?;
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).with_context(
            || {
                format!(
                    "cannot reach the berth API at http://{} (is an agent running? set -address or BERTH_ADDR)",
                    self.authority
                )
            },
        )?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        let body = body
            .map(serde_json::to_vec)
            .transpose()?
            .unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: berth-cli\r\nAccept: application/json\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.authority,
            body.len()
        );
        // A server may answer before it has read the whole body (a 413
        // for a body over its limit) and close the connection: writing
        // then fails, but its answer, already received, says why.
        let send_failure = match send_request(&mut stream, head.as_bytes(), &body) {
            Ok(()) => None,
            Err(e) if answered_early(&e) => Some(e),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "sending {method} {path} to the berth API at http://{}",
                        self.authority
                    )
                })
            }
        };
        let (raw, read_failure) = read_answer(&mut stream);
        let parsed = parse_response(&raw);
        let (status, index, body) = match (parsed, send_failure, read_failure) {
            (Ok(answer), _, _) => answer,
            (Err(_), Some(e), _) => {
                return Err(e).with_context(|| {
                    format!(
                        "the berth API closed the connection while {method} {path} was being sent \
                         ({} body) and gave no answer",
                        crate::http::describe_size(body.len() as u64)
                    )
                })
            }
            (Err(_), None, Some(e)) => {
                return Err(e).with_context(|| format!("reading the answer to {method} {path}"))
            }
            (Err(e), None, None) => {
                return Err(e).with_context(|| format!("malformed HTTP answer to {method} {path}"))
            }
        };
        let value: serde_json::Value = if body.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&body).unwrap_or_else(|_| {
                serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
            })
        };
        if !(200..300).contains(&status) {
            let message = value
                .get("error")
                .and_then(|e| e.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| value.to_string());
            return Err(ApiError { status, message }.into());
        }
        Ok((value, index))
    }
}

fn send_request(stream: &mut TcpStream, head: &[u8], body: &[u8]) -> std::io::Result<()> {
    stream.write_all(head)?;
    stream.write_all(body)?;
    stream.flush()
}

/// Whether a failed write means the server stopped reading, which it does
/// after answering early.
fn answered_early(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}

/// Reads the answer until the server closes the connection. What arrived
/// before a read error (a reset right after an early answer) is kept.
fn read_answer(stream: &mut TcpStream) -> (Vec<u8>, Option<std::io::Error>) {
    let mut raw = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return (raw, None),
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return (raw, Some(e)),
        }
    }
}

/// Splits a full HTTP/1.1 response into its status, its `X-Berth-Index`
/// and its decoded body.
fn parse_response(raw: &[u8]) -> Result<(u16, Option<u64>, Vec<u8>)> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..split])?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    let mut chunked = false;
    let mut index = None;
    let mut length: Option<usize> = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "transfer-encoding" && value.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        } else if name == "x-berth-index" {
            index = value.parse().ok();
        } else if name == "content-length" {
            length = value.parse().ok();
        }
    }
    let body = &raw[split + 4..];
    let body = match (chunked, length) {
        (true, _) => decode_chunked(body)?,
        (false, Some(n)) if body.len() < n => {
            bail!("truncated body: {} of {n} bytes", body.len())
        }
        (false, Some(n)) => body[..n].to_vec(),
        (false, None) => body.to_vec(),
    };
    Ok((status, index, body))
}

fn decode_chunked(mut body: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("truncated chunk header"))?;
        let size_str = std::str::from_utf8(&body[..eol])?;
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| anyhow!("bad chunk size {size_str:?}"))?;
        body = &body[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if body.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let (s, i, b) =
            parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nX-Berth-Index: 42\r\n\r\n{}")
                .unwrap();
        assert_eq!((s, i, b.as_slice()), (200, Some(42), b"{}".as_slice()));
        let (s, _, b) = parse_response(
            b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((s, b.as_slice()), (404, b"abcde".as_slice()));
        assert!(parse_response(b"garbage").is_err());
    }

    /// A server that answers 413 after the request head and closes the
    /// connection without reading the body, as a server with a body limit
    /// does.
    fn early_answering_server() -> (String, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                conn.read_exact(&mut byte).unwrap();
                head.push(byte[0]);
            }
            let body = br#"{"error":"request body is larger than the 2 MiB limit"}"#;
            let answer = format!(
                "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            // One write: the kernel sends it before the reset that
            // dropping the connection with unread data makes.
            let mut whole = answer.into_bytes();
            whole.extend_from_slice(body);
            conn.write_all(&whole).unwrap();
            // Dropped with the body unread: the kernel resets the
            // connection while the client still writes.
        });
        (format!("http://{addr}"), server)
    }

    #[test]
    fn an_early_answer_is_reported_instead_of_a_broken_pipe() {
        let (addr, server) = early_answering_server();
        let api = ApiClient::new(&addr).unwrap();
        let big = serde_json::json!({ "job": "x".repeat(32 * 1024 * 1024) });
        let err = api.put("/v1/jobs", &big).unwrap_err();
        server.join().unwrap();
        let api_err = err
            .downcast_ref::<ApiError>()
            .unwrap_or_else(|| panic!("expected the server's answer, got {err:#}"));
        assert_eq!(api_err.status, 413);
        assert_eq!(
            api_err.message,
            "request body is larger than the 2 MiB limit"
        );
    }

    #[test]
    fn a_truncated_answer_is_an_error() {
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}").is_err());
    }

    #[test]
    fn address_forms() {
        assert!(ApiClient::new("http://127.0.0.1:4747").is_ok());
        assert!(ApiClient::new("127.0.0.1:4747").is_ok());
        assert!(ApiClient::new("https://x:1").is_err());
        assert!(ApiClient::new("http://x:1/path").is_err());
    }
}
