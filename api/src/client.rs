//! The client of the HTTP API, on ureq: blocking, JSON bodies, an error
//! that says what the API said ([`ApiError`]) or that no agent answers at
//! the address ([`Error`]).

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::{Error, Result};

/// A client of one agent's HTTP API (the CLI's `-address`, `BERTH_ADDR`,
/// or [`DEFAULT_ADDR`]).
#[derive(Debug, Clone)]
pub struct ApiClient {
    /// `http://host:port`, no trailing slash.
    base: String,
    agent: ureq::Agent,
    /// The ACL token sent with every request (`-token`, `BERTH_TOKEN`).
    token: Option<String>,
}

pub const DEFAULT_ADDR: &str = "http://127.0.0.1:4747";

/// How long connecting to the agent may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an answer may take, and past a blocking query's wait.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(15);
/// The largest answer read into memory.
const MAX_ANSWER: u64 = 512 * 1024 * 1024;
/// A request body from this size on asks the server whether it wants it
/// (`Expect: 100-continue`) before sending it, so that a refusal (413)
/// arrives as the server's answer rather than as a broken pipe.
const EXPECT_CONTINUE_FROM: usize = 64 * 1024;

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

/// A 2xx answer as it came: for bodies that are not JSON (task logs).
#[derive(Debug)]
pub struct RawAnswer {
    pub headers: ureq::http::HeaderMap,
    pub body: Vec<u8>,
}

/// The TLS files for an `https://` address. Errors name them as the CLI's
/// flags and variables do (`-ca-cert`, `-client-cert`, `-client-key`, or
/// `BERTH_CACERT`, `BERTH_CLIENT_CERT`, `BERTH_CLIENT_KEY`).
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// The CA the agent's certificate must chain to (else the system's
    /// web roots).
    pub ca_cert: Option<std::path::PathBuf>,
    /// The certificate the CLI presents, with its key.
    pub client_cert: Option<std::path::PathBuf>,
    pub client_key: Option<std::path::PathBuf>,
}

impl TlsFiles {
    fn read(what: &str, path: &std::path::Path) -> Result<Vec<u8>> {
        std::fs::read(path)
            .map_err(|e| Error::Tls(format!("reading {what} {}: {e}", path.display())))
    }

    fn certs(what: &str, path: &std::path::Path) -> Result<Vec<ureq::tls::Certificate<'static>>> {
        let pem = TlsFiles::read(what, path)?;
        let mut certs = Vec::new();
        for item in ureq::tls::parse_pem(&pem) {
            match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c),
                Ok(_) => {}
                Err(e) => {
                    return Err(Error::Tls(format!(
                        "{what} {} is not valid PEM: {e}",
                        path.display()
                    )))
                }
            }
        }
        if certs.is_empty() {
            return Err(Error::Tls(format!(
                "{what} {} holds no PEM certificate",
                path.display()
            )));
        }
        Ok(certs)
    }

    /// The TLS configuration of the CLI's HTTP agent.
    fn config(&self) -> Result<ureq::tls::TlsConfig> {
        let mut b = ureq::tls::TlsConfig::builder().provider(ureq::tls::TlsProvider::Rustls);
        if let Some(ca) = &self.ca_cert {
            let certs = TlsFiles::certs("the CA certificate (-ca-cert, BERTH_CACERT)", ca)?;
            b = b.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
        }
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                let chain = TlsFiles::certs(
                    "the client certificate (-client-cert, BERTH_CLIENT_CERT)",
                    cert,
                )?;
                let what = "the client key (-client-key, BERTH_CLIENT_KEY)";
                let key_pem = TlsFiles::read(what, key)?;
                let key = ureq::tls::PrivateKey::from_pem(&key_pem).map_err(|_| {
                    Error::Tls(format!("{what} {} holds no PEM private key", key.display()))
                })?;
                b = b.client_cert(Some(ureq::tls::ClientCert::new_with_certs(&chain, key)));
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(Error::Tls(
                    "-client-cert (BERTH_CLIENT_CERT) needs -client-key (BERTH_CLIENT_KEY)".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::Tls(
                    "-client-key (BERTH_CLIENT_KEY) needs -client-cert (BERTH_CLIENT_CERT)".into(),
                ))
            }
        }
        Ok(b.build())
    }
}

impl ApiClient {
    /// A client of the API at `address` over plain HTTP, or HTTPS with the
    /// system's roots and no client certificate.
    pub fn new(address: &str) -> Result<ApiClient> {
        ApiClient::with_tls(address, &TlsFiles::default())
    }

    /// A client of the API at `address` (`http://HOST:PORT` or
    /// `https://HOST:PORT`); `tls` applies to an `https://` address.
    pub fn with_tls(address: &str, tls: &TlsFiles) -> Result<ApiClient> {
        let (scheme, rest) = match address.split_once("://") {
            Some(("http", rest)) => ("http", rest),
            Some(("https", rest)) => ("https", rest),
            Some(_) => return Err(Error::Address(address.to_string())),
            None => ("http", address),
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') || authority.contains("://") {
            return Err(Error::Address(address.to_string()));
        }
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .max_redirects(0)
            .user_agent("berth-cli")
            .accept("application/json");
        if scheme == "https" {
            config = config.tls_config(tls.config()?);
        }
        Ok(ApiClient {
            base: format!("{scheme}://{authority}"),
            agent: config.build().into(),
            token: None,
        })
    }

    /// This client, presenting `token` (an empty one counts as none).
    pub fn with_token(mut self, token: Option<&str>) -> ApiClient {
        self.token = token
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string);
        self
    }

    pub fn get(&self, path: &str) -> Result<Value> {
        self.json("GET", path, None).map(|(v, _)| v)
    }

    /// A GET and the state index the answer reflects (`X-Berth-Index`),
    /// for blocking queries.
    pub fn get_indexed(&self, path: &str) -> Result<(Value, u64)> {
        let (v, index) = self.json("GET", path, None)?;
        Ok((v, index.unwrap_or(0)))
    }

    pub fn put(&self, path: &str, body: &Value) -> Result<Value> {
        self.json("PUT", path, Some(body)).map(|(v, _)| v)
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Value> {
        self.json("POST", path, Some(body)).map(|(v, _)| v)
    }

    pub fn delete(&self, path: &str) -> Result<Value> {
        self.json("DELETE", path, None).map(|(v, _)| v)
    }

    /// A GET whose answer is decoded as `T`.
    pub fn get_as<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        decode(path, self.get(path)?)
    }

    /// A PUT of `body` whose answer is decoded as `T`.
    pub fn put_as<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T> {
        let body = serde_json::to_value(body).map_err(Error::Encode)?;
        decode(path, self.put(path, &body)?)
    }

    /// A POST of `body` whose answer is decoded as `T`.
    pub fn post_as<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T> {
        let body = serde_json::to_value(body).map_err(Error::Encode)?;
        decode(path, self.post(path, &body)?)
    }

    /// A GET whose body is kept as bytes; a non-2xx is an [`ApiError`].
    pub fn get_bytes(&self, path: &str) -> Result<RawAnswer> {
        let mut resp = self.send("GET", path, None, answer_timeout(path))?;
        let status = resp.status().as_u16();
        let body = read_body(&mut resp, "GET", path)?;
        if !(200..300).contains(&status) {
            return Err(api_error(status, &body).into());
        }
        Ok(RawAnswer {
            headers: resp.headers().clone(),
            body,
        })
    }

    fn json(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(Value, Option<u64>)> {
        let mut resp = self.send(method, path, body, answer_timeout(path))?;
        let status = resp.status().as_u16();
        let index = resp
            .headers()
            .get("x-berth-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let raw = read_body(&mut resp, method, path)?;
        if !(200..300).contains(&status) {
            return Err(api_error(status, &raw).into());
        }
        Ok((json_value(&raw), index))
    }

    /// Sends one request; `timeout` bounds the wait for the answer (none:
    /// no bound).
    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Option<Duration>,
    ) -> Result<ureq::http::Response<ureq::Body>> {
        let url = format!("{}{path}", self.base);
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(Error::Encode)?;
        let mut req = ureq::http::Request::builder()
            .method(method)
            .uri(&url)
            .header("content-type", "application/json");
        if let Some(token) = &self.token {
            req = req.header("x-berth-token", token);
        }
        if body
            .as_ref()
            .is_some_and(|b| b.len() >= EXPECT_CONTINUE_FROM)
        {
            req = req.header("expect", "100-continue");
        }
        let req = req
            .body(body.unwrap_or_default())
            .map_err(|e| Error::Transport(format!("{method} {url}: {e}")))?;
        let req = self
            .agent
            .configure_request(req)
            .timeout_recv_response(timeout)
            .timeout_recv_body(timeout)
            .build();
        self.agent
            .run(req)
            .map_err(|e| self.transport_error(e, method, path))
    }

    /// What a TLS failure with the agent means, and what to set.
    fn tls_failure(&self, e: &rustls::Error) -> Error {
        match e {
            rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer | rustls::CertificateError::BadSignature,
            ) => Error::Transport(format!(
                "TLS with the berth API at {} failed: its certificate is not signed by the CA \
                 given in -ca-cert (BERTH_CACERT); give the CA that signed the agents' certificates",
                self.base
            )),
            e => Error::Transport(format!(
                "TLS with the berth API at {} failed: {e} (check -ca-cert, -client-cert and -client-key, or BERTH_CACERT, BERTH_CLIENT_CERT and BERTH_CLIENT_KEY)",
                self.base
            )),
        }
    }

    fn transport_error(&self, e: ureq::Error, method: &str, path: &str) -> Error {
        let refused = |why: String| Error::Unreachable {
            base: self.base.clone(),
            why,
        };
        match e {
            ureq::Error::Io(io) => match io.kind() {
                std::io::ErrorKind::ConnectionRefused => refused("connection refused".into()),
                std::io::ErrorKind::AddrNotAvailable
                | std::io::ErrorKind::NetworkUnreachable
                | std::io::ErrorKind::HostUnreachable => refused(io.to_string()),
                _ => match io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    Some(tls) => self.tls_failure(tls),
                    None => Error::Transport(format!(
                        "{method} {path} at the berth API {}: {io}",
                        self.base
                    )),
                },
            },
            ureq::Error::HostNotFound => refused("host not found".into()),
            ureq::Error::ConnectionFailed => refused("connection failed".into()),
            ureq::Error::Timeout(ureq::Timeout::Connect) => {
                refused(format!("no connection in {}s", CONNECT_TIMEOUT.as_secs()))
            }
            ureq::Error::Rustls(e) => self.tls_failure(&e),
            // Plain HTTP sent to an agent that speaks TLS: its answer (a TLS
            // alert) does not parse as HTTP.
            ureq::Error::Protocol(_) | ureq::Error::Http(_) if self.base.starts_with("http://") => {
                Error::Transport(format!(
                    "{method} {path}: the agent at {} did not answer in HTTP ({e}); if it serves \
                     HTTPS (tls {{ http = true }}), use an https:// address (-address or \
                     BERTH_ADDR) with -ca-cert (BERTH_CACERT)",
                    self.base
                ))
            }
            ureq::Error::Tls(e) => Error::Transport(format!(
                "TLS with the berth API at {} failed: {e}",
                self.base
            )),
            ureq::Error::Timeout(t) => Error::Transport(format!(
                "{method} {path}: the berth API at {} did not answer in time ({t})",
                self.base
            )),
            other => Error::Transport(format!(
                "{method} {path} at the berth API {}: {other}",
                self.base
            )),
        }
    }
}

/// How long the answer to a GET of `path` may take: a blocking query's
/// `wait` (default 5m, as the server's) and then some; others a fixed time.
fn answer_timeout(path: &str) -> Option<Duration> {
    let query = path.split_once('?').map_or("", |(_, q)| q);
    let mut blocking = false;
    let mut wait = None;
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("index", v)) => blocking = v.parse::<u64>().is_ok_and(|i| i > 0),
            Some(("wait", v)) => wait = berth_structs::spec::parse_duration(v).ok(),
            _ => {}
        }
    }
    let wait = match (wait, blocking) {
        (Some(w), _) => w,
        (None, true) => Duration::from_secs(300),
        (None, false) => Duration::ZERO,
    };
    Some(wait.saturating_add(ANSWER_TIMEOUT))
}

fn read_body(
    resp: &mut ureq::http::Response<ureq::Body>,
    method: &str,
    path: &str,
) -> Result<Vec<u8>> {
    resp.body_mut()
        .with_config()
        .limit(MAX_ANSWER)
        .read_to_vec()
        .map_err(|e| Error::Transport(format!("reading the answer to {method} {path}: {e}")))
}

pub(crate) fn decode<T: DeserializeOwned>(path: &str, v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(|source| Error::Decode {
        path: path.to_string(),
        source,
    })
}

fn json_value(raw: &[u8]) -> Value {
    if raw.is_empty() {
        return Value::Null;
    }
    serde_json::from_slice(raw)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(raw).into_owned()))
}

/// The API's `{"error": ...}`, else the body as it is.
fn api_error(status: u16, raw: &[u8]) -> ApiError {
    let value = json_value(raw);
    let message = match value.get("error").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => match value {
            Value::String(s) => s.trim().to_string(),
            Value::Null => format!("HTTP {status} with no body"),
            other => other.to_string(),
        },
    };
    ApiError { status, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_testutil::one_answer_server;

    /// A server that answers 413 after the request head and closes the
    /// connection without reading the body, as a server with a body limit
    /// does.
    fn early_answering_server() -> (String, std::thread::JoinHandle<Vec<u8>>) {
        let body = r#"{"error":"request body is larger than the 2 MiB limit"}"#;
        one_answer_server(format!(
            "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        ))
    }

    #[test]
    fn an_early_answer_is_reported_instead_of_a_broken_pipe() {
        let (addr, server) = early_answering_server();
        let api = ApiClient::new(&addr).unwrap();
        let big = serde_json::json!({ "job": "x".repeat(32 * 1024 * 1024) });
        let err = api.put("/v1/jobs", &big).unwrap_err();
        server.join().unwrap();
        let api_err = err
            .api()
            .unwrap_or_else(|| panic!("expected the server's answer, got {err:#}"));
        assert_eq!(api_err.status, 413);
        assert_eq!(
            api_err.message,
            "request body is larger than the 2 MiB limit"
        );
    }

    #[test]
    fn address_forms() {
        assert!(ApiClient::new("http://127.0.0.1:4747").is_ok());
        assert!(ApiClient::new("127.0.0.1:4747").is_ok());
        assert!(ApiClient::new("https://x:1").is_ok());
        assert!(ApiClient::new("ftp://x:1").is_err());
        assert!(ApiClient::new("http://x:1/path").is_err());
    }

    #[test]
    fn raw_bodies_and_the_state_index_are_read() {
        let (addr, server) = one_answer_server(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-berth-index: 42\r\n\
              transfer-encoding: chunked\r\nconnection: close\r\n\r\n\
              3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        );
        let raw = ApiClient::new(&addr).unwrap().get_bytes("/x").unwrap();
        server.join().unwrap();
        assert_eq!(raw.body, b"abcde");
        assert_eq!(raw.headers["x-berth-index"], "42");

        let (addr, server) = one_answer_server(
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\nx-berth-index: 7\r\n\
              connection: close\r\n\r\n[1, 2, 3]",
        );
        let (v, index) = ApiClient::new(&addr).unwrap().get_indexed("/x").unwrap();
        server.join().unwrap();
        assert_eq!((v, index), (serde_json::json!([1, 2, 3]), 7));
    }

    #[test]
    fn a_non_2xx_is_the_apis_error_message() {
        let (addr, server) = one_answer_server(
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 27\r\nconnection: close\r\n\r\n\
              {\"error\":\"job x not found\"}",
        );
        let err = ApiClient::new(&addr).unwrap().get("/v1/job/x").unwrap_err();
        server.join().unwrap();
        let api = err.api().expect("an ApiError");
        assert_eq!((api.status, api.message.as_str()), (404, "job x not found"));
    }

    #[test]
    fn no_agent_at_the_address_is_said_so() {
        // A port nothing listens on: bound, then closed.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let err = ApiClient::new(&format!("http://{addr}"))
            .unwrap()
            .get("/v1/jobs")
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("no berth agent answers at http://{addr} (connection refused)")
        );
    }

    #[test]
    fn a_blocking_query_may_take_its_wait_and_then_some() {
        assert_eq!(answer_timeout("/v1/jobs"), Some(ANSWER_TIMEOUT));
        assert_eq!(
            answer_timeout("/v1/job/x/allocations?index=5&wait=10s"),
            Some(Duration::from_secs(25))
        );
        assert_eq!(
            answer_timeout("/v1/node/n/allocations?index=9"),
            Some(Duration::from_secs(315))
        );
    }
}
