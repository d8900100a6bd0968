//! The README's "A cluster with TLS and ACLs, step by step", run as
//! written, line by line at one shell, from the checkout: a CA and
//! certificates for one server and two clients in distinct files, three
//! agents under mutual TLS and ACLs, the bootstrap token kept in a file,
//! `node status` with both workers, a job run, a curl call and a
//! Prometheus-style scrape with a token of its own. It runs in a mount and
//! network namespace of its own ([`HostSandbox`]): `/etc/berth.d` and
//! `/var/lib` are empty there, and the README's ports are free.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use berth_tests::readme::{blocks_from, readme, Shell};
use berth_tests::sandbox::HostSandbox;
use berth_tests::{repo_root, wait_for};
use std::os::unix::fs::PermissionsExt;

#[test]
fn the_readme_secure_cluster_runs_as_written() -> Result<()> {
    let commands = blocks_from(&readme()?, "A cluster with TLS and ACLs, step by step")?;
    let _sandbox = HostSandbox::enter(&["/etc/berth.d", "/var/lib"])?;
    let mut shell = Shell::new(&repo_root())?;
    let result = run_all(&mut shell, &commands);
    if result.is_err() {
        eprintln!("{}", shell.agent_logs());
    }
    result
}

fn run_all(shell: &mut Shell, commands: &[String]) -> Result<()> {
    let mut agents = 0;
    let mut outputs = Vec::new();
    for line in commands {
        eprintln!("$ {line}");
        if line.starts_with("berth agent ") {
            shell.start_agent(line)?;
            agents += 1;
        } else if line == "berth node status" {
            // Shown once both workers are ready, as a person would wait.
            let shown = wait_for("both workers ready", Duration::from_secs(60), || {
                shell.check_agents()?;
                let out = shell.run(line)?;
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let ready = |name: &str| {
                    text.lines()
                        .any(|l| l.contains(name) && l.contains("ready"))
                };
                Ok(
                    (out.status.success() && ready("worker-1") && ready("worker-2"))
                        .then_some(text),
                )
            })?;
            eprintln!("{shown}");
            outputs.push((line.clone(), shown));
        } else {
            let out = shell.run_ok(line)?;
            eprintln!("{}", out.chars().take(2000).collect::<String>());
            outputs.push((line.clone(), out));
        }
    }
    ensure!(agents == 3, "the README starts {agents} agents, not 3");
    shell.check_agents()?;

    // Distinct certificates for the two clients; the CA key stays in the
    // directory it was made in.
    let tls = std::path::Path::new("/etc/berth.d/tls");
    for file in [
        "berth-agent-ca.pem",
        "berth-agent-ca-key.pem",
        "global-server-berth.pem",
        "global-client-berth.pem",
        "global-client-berth-1.pem",
        "global-cli-berth.pem",
    ] {
        ensure!(tls.join(file).exists(), "{file} was not made");
    }
    let bootstrap = std::fs::metadata("/etc/berth.d/bootstrap-token.json")?;
    ensure!(
        bootstrap.permissions().mode() & 0o077 == 0,
        "the saved bootstrap token is readable by others: {:o}",
        bootstrap.permissions().mode()
    );

    let output_of = |prefix: &str| -> Result<&str> {
        outputs
            .iter()
            .find(|(l, _)| l.starts_with(prefix))
            .map(|(_, o)| o.as_str())
            .with_context(|| format!("the README no longer runs {prefix:?}"))
    };
    let jobs = output_of("curl --cacert \"$BERTH_CACERT\" --cert \"$BERTH_CLIENT_CERT\" --key \"$BERTH_CLIENT_KEY\" -H \"X-Berth-Token")?;
    ensure!(
        jobs.contains("\"hostpath-plugin\""),
        "curl /v1/jobs: {jobs}"
    );
    let metrics = output_of("curl --cacert \"$BERTH_CACERT\" --cert \"$BERTH_CLIENT_CERT\" --key \"$BERTH_CLIENT_KEY\" -H \"Authorization: Bearer")?;
    ensure!(
        metrics.contains("# TYPE berth_"),
        "the scrape is not Prometheus text: {metrics}"
    );

    // The plugin job runs on both workers, placed through mutual TLS.
    let run = output_of("berth job run")?;
    ensure!(run.contains("2 allocs running"), "berth job run: {run}");
    Ok(())
}
