//! The README's "Run a cluster" commands, as written: the code block's
//! three `berth agent` lines run (their /tmp/berth data dirs in a temp
//! dir, the checkout's examples), and its `berth node status` shows both
//! workers ready. It uses the ports the README names (4747, 4647, 4748,
//! 4749), so it waits for them to be free first.

use std::time::Duration;

use anyhow::{bail, Result};
use berth_tests::readme::{block_after, readme};
use berth_tests::{binary, repo_root, wait_for, Agent};

fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

#[test]
fn the_readme_cluster_runs_as_written() -> Result<()> {
    let commands = block_after(&readme()?, "One server and two clients on one machine")?;
    wait_for("the README's ports free", Duration::from_secs(60), || {
        Ok([4747, 4647, 4748, 4749]
            .into_iter()
            .all(port_free)
            .then_some(()))
    })?;
    let tmp = tempfile::tempdir()?;
    let root = repo_root();
    let mut agents = Vec::new();
    let mut status = None;
    for command in &commands {
        let words: Vec<String> = command
            .split_whitespace()
            .map(|w| {
                w.replace("/tmp/berth", &tmp.path().display().to_string())
                    .replace("examples/", &format!("{}/examples/", root.display()))
            })
            .collect();
        match words
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .as_slice()
        {
            ["berth", "agent", args @ ..] => agents.push(Agent::start(args)?),
            ["berth", "node", "status"] => status = Some(()),
            other => bail!("a command the test does not know: {other:?}"),
        }
    }
    anyhow::ensure!(agents.len() == 3 && status.is_some(), "{commands:?}");
    let shown = wait_for("both workers ready", Duration::from_secs(60), || {
        for a in agents.iter_mut() {
            a.check_running()?;
        }
        let out = std::process::Command::new(binary("berth"))
            .args(["node", "status"])
            .env_remove("BERTH_ADDR")
            .env_remove("BERTH_TOKEN")
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let ready = |name: &str| {
            text.lines()
                .any(|l| l.contains(name) && l.contains("ready"))
        };
        Ok((out.status.success() && ready("worker-1") && ready("worker-2")).then_some(text))
    })?;
    eprintln!("{shown}");
    assert!(
        shown.contains("worker-1") && shown.contains("worker-2"),
        "{shown}"
    );
    Ok(())
}
