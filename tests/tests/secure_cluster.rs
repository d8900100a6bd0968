//! A cluster with everything on at once, as it would be put on a network:
//! one server and two client agents as separate processes, mutual TLS on
//! both ports of every agent (certificates made by `berth tls`) and ACLs
//! on every agent. Only a client with a certificate of the agents' CA
//! becomes a node; a job runs on both; without a token nothing is served,
//! a read-only token reads and is refused every write, over the server's
//! HTTPS API, over a client agent's HTTPS API that forwards to it, and
//! through `Agent.ForwardHttp` on the agent protocol port; and a peer
//! with a certificate that is not an agent's cannot register a node.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::{Context, Result};
use berth_proto::berth::v1 as pb;
use berth_proto::berth::v1::node_client::NodeClient;
use berth_tests::pki::{
    grpc_channel, https_request_on, tls_connect, Pki, CLIENT_CERT, CLI_CERT, SERVER_CERT,
};
use berth_tests::{
    binary, exit_ok, forward_http, free_port, wait_for, writes_refused_to_readers, Agent,
    HttpAnswer, READONLY_POLICY,
};
use serde_json::Value;

const SYSTEM_JOB: &str = r#"
job "everywhere" {
  type = "system"
  group "g" {
    task "sleep" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["300"]
      }
      resources {
        cpu    = 10
        memory = 8
      }
    }
  }
}
"#;

struct Cluster {
    pki: Pki,
    server: Agent,
    http_port: u16,
    rpc: String,
}

impl Cluster {
    /// An HTTPS request to the agent at `port` with the CLI's certificate.
    fn request(
        &self,
        port: u16,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> Result<HttpAnswer> {
        let cli = self.pki.client_config(Some(CLI_CERT))?;
        https_request_on(tls_connect(&cli, port)?, method, path, token, body)
    }

    /// Runs the CLI against the server over HTTPS; its stdout, or an
    /// error with its output unless it exits 0.
    fn cli(&self, token: Option<&str>, args: &[&str]) -> Result<String> {
        let mut cmd = std::process::Command::new(binary("berth"));
        cmd.args(self.pki.cli_flags(self.http_port))
            .args(args)
            .env_remove("BERTH_TOKEN")
            .current_dir(self.pki.path(""))
            .stdin(std::process::Stdio::null());
        if let Some(t) = token {
            cmd.env("BERTH_TOKEN", t);
        }
        let out = cmd
            .output()
            .with_context(|| format!("berth {}", args.join(" ")))?;
        let out = exit_ok(out, args)?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The nodes as the server lists them to `token`.
    fn nodes(&self, token: &str) -> Result<Vec<Value>> {
        let a = self.request(self.http_port, "GET", "/v1/nodes", Some(token), "")?;
        anyhow::ensure!(a.status == 200, "GET /v1/nodes: {} {}", a.status, a.text());
        Ok(a.json()?.as_array().cloned().unwrap_or_default())
    }
}

fn names(nodes: &[Value]) -> Vec<String> {
    let mut n: Vec<String> = nodes
        .iter()
        .filter_map(|n| n["name"].as_str().map(str::to_string))
        .collect();
    n.sort();
    n
}

fn logged(agent: &Agent, needle: &str) -> usize {
    agent.log().matches(needle).count()
}

/// `Agent.ForwardHttp` on the server's agent protocol port, over TLS with
/// a client agent's certificate (as a client agent forwards); the answer's
/// status.
async fn forward(
    pki: &Pki,
    rpc: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<u32> {
    let config = pki.client_config(Some(CLIENT_CERT))?;
    let channel = grpc_channel(config, rpc, "server.global.berth").await?;
    forward_http(channel, method, path, token, body).await
}

#[test]
fn a_cluster_with_tls_and_acls_serves_only_its_agents_and_tokens() -> Result<()> {
    let pki = Pki::new()?;
    let server_config = pki.config(
        "server.hcl",
        &format!(
            "server {{\n  enabled = true\n}}\nacl {{\n  enabled = true\n}}\n{}",
            pki.tls_block(SERVER_CERT, true)
        ),
    )?;
    let http_port = free_port();
    let rpc = format!("127.0.0.1:{}", free_port());
    let server = Agent::start(&[
        "-config",
        server_config.to_str().context("UTF-8")?,
        "-http-addr",
        &format!("127.0.0.1:{http_port}"),
        "-rpc-addr",
        &rpc,
    ])?;
    let cluster = Cluster {
        pki,
        server,
        http_port,
        rpc,
    };

    // The management token, from the one bootstrap, over HTTPS.
    let boot = wait_for("the ACL bootstrap", Duration::from_secs(30), || {
        let Ok(out) = cluster.cli(None, &["acl", "bootstrap", "-json"]) else {
            return Ok(None);
        };
        let v: Value = serde_json::from_str(&out).with_context(|| out.clone())?;
        Ok(v["secret_id"].as_str().map(str::to_string))
    })?;

    let client_config = format!(
        "acl {{\n  enabled = true\n}}\n{}",
        cluster.pki.tls_block(CLIENT_CERT, true)
    );
    let (mut c1, c1_port) = cluster
        .pki
        .start_client("c1", &cluster.rpc, &client_config)?;
    let (mut c2, _) = cluster
        .pki
        .start_client("c2", &cluster.rpc, &client_config)?;
    // Trusts the agents' CA but presents a certificate of another (its
    // CA file holds both CAs, so that its own certificate checks out at
    // its start); and one that speaks plaintext.
    let both = cluster.pki.path("rogue/both-ca.pem");
    std::fs::write(
        &both,
        [
            std::fs::read_to_string(cluster.pki.ca())?,
            std::fs::read_to_string(cluster.pki.path("rogue/berth-agent-ca.pem"))?,
        ]
        .concat(),
    )?;
    let rogue_config = format!(
        "acl {{\n  enabled = true\n}}\n{}",
        cluster
            .pki
            .tls_block("rogue/global-client-berth", true)
            .replace(&format!("{:?}", cluster.pki.ca()), &format!("{both:?}"))
    );
    let (_rogue, _) = cluster
        .pki
        .start_client("rogue", &cluster.rpc, &rogue_config)?;
    let (_plain, _) =
        cluster
            .pki
            .start_client("plain", &cluster.rpc, "acl {\n  enabled = true\n}\n")?;

    // A TLS peer that presents no certificate is refused at the handshake.
    let bare = cluster.pki.client_config(None)?;
    let rpc_port: u16 = cluster.rpc.rsplit(':').next().unwrap_or("").parse()?;
    let refused = match tls_connect(&bare, rpc_port) {
        Err(_) => true,
        // TLS 1.3: the client finishes first; the server's alert follows.
        Ok(mut c) => {
            let _ = c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
            let mut buf = [0u8; 64];
            matches!(c.read(&mut buf), Ok(0) | Err(_))
        }
    };
    assert!(refused, "a peer without a certificate was served");

    let nodes = wait_for("c1 and c2 ready", Duration::from_secs(60), || {
        c1.check_running()?;
        c2.check_running()?;
        let nodes = cluster.nodes(&boot)?;
        let ready = nodes
            .iter()
            .filter(|n| n["status"] == "ready")
            .cloned()
            .collect::<Vec<_>>();
        Ok((names(&ready) == ["c1", "c2"]).then_some(nodes))
    })?;
    wait_for(
        "the plaintext client told to turn TLS on",
        Duration::from_secs(60),
        || {
            Ok(
                logged(&cluster.server, "the peer spoke plaintext to a TLS port")
                    .gt(&0)
                    .then_some(()),
            )
        },
    )?;
    wait_for(
        "the rogue, plaintext and bare peers refused",
        Duration::from_secs(60),
        || {
            Ok(
                (logged(&cluster.server, "agent protocol: TLS handshake refused") >= 3)
                    .then_some(()),
            )
        },
    )?;
    assert_eq!(names(&cluster.nodes(&boot)?), ["c1", "c2"]);
    let c1_id = nodes
        .iter()
        .find(|n| n["name"] == "c1")
        .and_then(|n| n["id"].as_str())
        .context("c1's ID")?
        .to_string();

    // No token: 403 and no job.
    let job_file = cluster.pki.config("everywhere.hcl", SYSTEM_JOB)?;
    let job_file = job_file.to_str().context("UTF-8")?;
    let job_body = cluster
        .cli(Some(&boot), &["job", "run", "-output", job_file])?
        .trim()
        .to_string();
    let anon = cluster.request(http_port, "PUT", "/v1/jobs", None, &job_body)?;
    assert_eq!(anon.status, 403, "{}", anon.text());
    let jobs = cluster.request(http_port, "GET", "/v1/jobs", Some(&boot), "")?;
    assert_eq!(
        jobs.json()?,
        Value::Array(vec![]),
        "a refused submit wrote a job"
    );
    let anon_read = cluster.request(http_port, "GET", "/v1/jobs", None, "")?;
    assert_eq!(anon_read.status, 403, "{}", anon_read.text());

    // The bootstrap token runs a system job: one alloc on each node.
    cluster.cli(Some(&boot), &["job", "run", "-detach", job_file])?;
    wait_for(
        "the job running on c1 and c2",
        Duration::from_secs(60),
        || {
            c1.check_running()?;
            c2.check_running()?;
            let a = cluster.request(
                http_port,
                "GET",
                "/v1/job/everywhere/allocations",
                Some(&boot),
                "",
            )?;
            let allocs = a.json()?;
            let mut running: Vec<String> = allocs
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["client_status"] == "running")
                .filter_map(|a| a["node_id"].as_str().map(str::to_string))
                .collect();
            running.sort();
            running.dedup();
            Ok((running.len() == 2).then_some(()))
        },
    )?;

    // A read-only token reads, and is refused every write, at the server
    // and at a client agent, which forwards to it.
    let policy = cluster.pki.config("readonly.hcl", READONLY_POLICY)?;
    cluster.cli(
        Some(&boot),
        &[
            "acl",
            "policy",
            "apply",
            "readonly",
            policy.to_str().context("UTF-8")?,
        ],
    )?;
    let created: Value = serde_json::from_str(&cluster.cli(
        Some(&boot),
        &[
            "acl", "token", "create", "-json", "-name", "ro", "-policy", "readonly",
        ],
    )?)?;
    let ro = created["secret_id"].as_str().context("secret")?.to_string();
    for (agent, port) in [("server", http_port), ("client c1", c1_port)] {
        let read = cluster.request(port, "GET", "/v1/jobs", Some(&ro), "")?;
        assert_eq!(read.status, 200, "{agent}: {}", read.text());
        assert!(
            read.text().contains("everywhere"),
            "{agent}: {}",
            read.text()
        );
        let anon = cluster.request(port, "GET", "/v1/jobs", None, "")?;
        assert_eq!(anon.status, 403, "{agent}: {}", anon.text());
        for (method, path, body) in writes_refused_to_readers(&job_body) {
            let a = cluster.request(port, method, path, Some(&ro), &body)?;
            assert_eq!(a.status, 403, "{agent}: {method} {path}: {}", a.text());
        }
    }

    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let (pki, rpc) = (&cluster.pki, cluster.rpc.as_str());
        // The same refusals through Agent.ForwardHttp on the agent
        // protocol port, over TLS.
        assert_eq!(
            forward(pki, rpc, "PUT", "/v1/jobs", None, &job_body).await?,
            403
        );
        assert_eq!(forward(pki, rpc, "GET", "/v1/jobs", None, "").await?, 403);
        assert_eq!(
            forward(pki, rpc, "GET", "/v1/jobs", Some(&ro), "").await?,
            200
        );
        for (method, path, body) in writes_refused_to_readers(&job_body) {
            let status = forward(pki, rpc, method, path, Some(&ro), &body).await?;
            assert_eq!(status, 403, "forwarded {method} {path}");
        }

        let register = |id: &str| -> Result<tonic::Request<pb::RegisterRequest>> {
            let mut req = tonic::Request::new(pb::RegisterRequest {
                node_json: format!(r#"{{"id": "{id}", "name": "intruder"}}"#).into_bytes(),
                node_id: id.into(),
            });
            req.metadata_mut().insert(
                pb::NODE_SECRET_METADATA,
                "made-up-secret-0123456789abcdef0123".parse()?,
            );
            Ok(req)
        };
        // A peer whose certificate is the CLI's, not an agent's, cannot
        // speak the agent protocol at all: neither register a node nor
        // forward a request.
        let cli_peer = async {
            let channel = grpc_channel(
                pki.client_config(Some(CLI_CERT))?,
                rpc,
                "server.global.berth",
            )
            .await?;
            NodeClient::new(channel)
                .register(register("a-node-nobody-knows")?)
                .await
                .map_err(anyhow::Error::from)
        };
        assert!(
            cli_peer.await.is_err(),
            "a peer with the CLI's certificate was served on the agent port"
        );
        // A client agent's certificate does not make c1's ID its own.
        let channel = grpc_channel(
            pki.client_config(Some(CLIENT_CERT))?,
            rpc,
            "server.global.berth",
        )
        .await?;
        let err = NodeClient::new(channel)
            .register(register(c1_id.as_str())?)
            .await
            .expect_err("a register of c1 with another secret");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
        anyhow::Ok(())
    })?;
    wait_for(
        "the refusal of the CLI's certificate in the server's log",
        Duration::from_secs(10),
        || {
            let seen = logged(
                &cluster.server,
                "the certificate names no client or server agent",
            );
            Ok((seen > 0).then_some(()))
        },
    )?;
    let nodes = cluster.nodes(&boot)?;
    assert_eq!(names(&nodes), ["c1", "c2"]);
    assert!(
        nodes.iter().all(|n| n["status"] == "ready"),
        "a refused register changed a node: {nodes:?}"
    );

    // Neither token's secret reached a log.
    for (who, agent) in [("server", &cluster.server), ("c1", &c1), ("c2", &c2)] {
        let log = agent.log();
        assert!(
            !log.contains(&boot) && !log.contains(&ro),
            "a token secret is in the {who}'s log"
        );
    }

    cluster.cli(Some(&boot), &["job", "stop", "-purge", "everywhere"])?;
    Ok(())
}
