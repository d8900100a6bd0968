//! A server with `server { store = "etcd" }` against a real etcd member:
//! its state lives in etcd, not in its data dir, and survives the server's
//! restart; while etcd is down it gives up leading, its writes fail with a
//! retryable 503, its reads still answer, and it leads again and goes on
//! when etcd is back. It reaches etcd over mutual TLS when told to.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{Client, Server};
use berth_tests::pki::{Pki, SERVER_CERT};
use berth_tests::{cli_at, http_at, sleeping_service_job, wait_for};
use berth_testutil::etcd::{Etcd, EtcdTlsFiles};

#[test]
fn a_server_on_etcd_keeps_its_state_there_across_a_restart() -> Result<()> {
    let etcd = Etcd::start();
    let keys = tempfile::tempdir()?;
    let mut server = Server::start_on_etcd(&[etcd.endpoint()], "/it", keys.path())?;
    let client = Client::start(&server, "n1", false, "")?;
    server
        .wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    server.run_job("sleepy-etcd", &sleeping_service_job("sleepy-etcd", 1, 1))?;
    let alloc = wait_for("the alloc running", Duration::from_secs(30), || {
        server.running_alloc("sleepy-etcd")
    })
    .with_context(|| server.agent.log())?;

    // Nothing of the state is in the server's data dir.
    let redb = server.agent.data_path().join("server").join("state.redb");
    assert!(!redb.exists(), "{} was made", redb.display());

    server.agent.kill()?;
    server.agent.start_again()?;
    server.wait_serving()?;
    assert!(server.agent.log().contains("loaded server state from etcd"));
    // The job, its alloc and the node are as they were: the alloc runs
    // on, reported by its client.
    server
        .wait_nodes_ready(&["n1"])
        .with_context(|| client.agent.log())?;
    let after = wait_for("the alloc running again", Duration::from_secs(30), || {
        server.running_alloc("sleepy-etcd")
    })?;
    assert_eq!(after, alloc, "the alloc was replaced");
    Ok(())
}

#[test]
fn with_etcd_down_the_server_stops_leading_refuses_writes_and_answers_reads() -> Result<()> {
    let mut etcd = Etcd::start();
    let keys = tempfile::tempdir()?;
    let server = Server::start_on_etcd(&[etcd.endpoint()], "/it", keys.path())?;
    server.run_job("first-etcd", &sleeping_service_job("first-etcd", 0, 1))?;

    etcd.kill();
    // The server cannot keep its leadership without etcd: it gives it up,
    // and no server leads.
    wait_for(
        "the server to give up leading",
        Duration::from_secs(10),
        || Ok((server.get("/v1/status/leader")? == "").then_some(())),
    )?;
    let stop = http_at(
        server.http_port,
        "DELETE /v1/job/first-etcd HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    assert_eq!(stop.status, 503, "{}", stop.text());
    assert!(stop.text().contains("no server leads"), "{}", stop.text());
    let dir = tempfile::tempdir()?;
    let spec = dir.path().join("second.hcl");
    std::fs::write(&spec, sleeping_service_job("second-etcd", 0, 1))?;
    let run = cli_at(
        &server.addr(),
        &["job", "run", "-detach", spec.to_str().context("path")?],
    )?;
    assert!(!run.status.success(), "job run succeeded with etcd down");
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(said.contains("cannot reach etcd"), "{said}");
    // Reads answer from the server's tables: nothing moves them while no
    // server leads.
    let job = server.get("/v1/job/first-etcd")?;
    assert_eq!(job["id"], "first-etcd");

    etcd.restart();
    wait_for("writes to go on", Duration::from_secs(30), || {
        let run = cli_at(
            &server.addr(),
            &["job", "run", "-detach", spec.to_str().context("path")?],
        )?;
        Ok(run.status.success().then_some(()))
    })
    .with_context(|| server.agent.log())?;
    assert_eq!(server.get("/v1/job/second-etcd")?["id"], "second-etcd");
    Ok(())
}

#[test]
fn a_server_reaches_etcd_over_mutual_tls() -> Result<()> {
    let pki = Pki::new()?;
    let (cert, key) = pki.cert_and_key(SERVER_CERT);
    // A member that serves TLS only and wants a client certificate of the
    // agents' CA.
    let etcd = Etcd::start_tls(EtcdTlsFiles {
        cert_file: cert.clone(),
        key_file: key.clone(),
        client_ca_file: pki.ca(),
    });
    assert!(etcd.endpoint().starts_with("https://"));
    let keys = tempfile::tempdir()?;
    let tls = format!(
        "tls {{\n  ca_file = {:?}\n  cert_file = {cert:?}\n  key_file = {key:?}\n}}",
        pki.ca()
    );
    let mut server = Server::start_on_etcd_with(&[etcd.endpoint()], "/tls", keys.path(), &tls)?;
    wait_for("the server to lead", Duration::from_secs(20), || {
        Ok((!server.leader()?.is_empty()).then_some(()))
    })
    .with_context(|| server.agent.log())?;
    server.run_job("tls-etcd", &sleeping_service_job("tls-etcd", 0, 1))?;

    // The job was written to etcd over TLS: a restarted server loads it.
    server.agent.kill()?;
    server.agent.start_again()?;
    server.wait_serving()?;
    let job = server.get("/v1/job/tls-etcd")?;
    assert_eq!(job["id"], "tls-etcd", "{job}");
    assert!(
        server.agent.log().contains("loaded server state from etcd"),
        "{}",
        server.agent.log()
    );
    Ok(())
}
