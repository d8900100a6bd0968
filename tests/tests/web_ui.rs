//! The web UI in a real browser: headless Chromium over the DevTools
//! protocol against a dev agent that runs the example plugin, a volume and
//! a reader job. Each page loads without a console error, shows the
//! cluster's data and follows it live; a page's first load stays under
//! 200 KB. Screenshots of each page at 1280×800 go to
//! `target/ui-screenshots/`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use berth_tests::browser::Browser;
use berth_tests::{
    repo_root, sleeping_service_job, wait_alloc_running, wait_for, DevAgent, READONLY_POLICY,
};

/// A service job that reads the `data` volume and writes to its stdout
/// whatever the test leaves in its task dir as `say`.
const READER: &str = r#"
job "reader" {
  type        = "service"
  datacenters = ["dc1"]
  group "reader" {
    volume "data" {
      type            = "csi"
      source          = "data"
      read_only       = true
      access_mode     = "single-node-reader-only"
      attachment_mode = "file-system"
    }
    task "read" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "echo reader started; while true; do if [ -f \"$BERTH_TASK_DIR/say\" ]; then cat \"$BERTH_TASK_DIR/say\"; rm -f \"$BERTH_TASK_DIR/say\"; fi; sleep 0.1; done"]
      }
      volume_mount {
        volume      = "data"
        destination = "data"
        read_only   = true
      }
      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
"#;

/// Where the screenshots go.
fn screenshots() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
        .join("ui-screenshots")
}

/// A dev agent with the example plugin, the volume `data` and the
/// running reader job; the reader's alloc.
fn cluster() -> Result<(DevAgent, serde_json::Value)> {
    let agent = DevAgent::start()?;
    agent.run_plugin_and_create_volume()?;
    agent.run_job("reader", READER)?;
    let alloc = wait_alloc_running(&agent, "reader")?;
    Ok((agent, alloc))
}

const LOAD: Duration = Duration::from_secs(15);

/// Every page, from its first load: no console error or uncaught
/// exception, the right data, under 200 KB transferred; and the jobs page
/// shows a job submitted after it opened within 2 s, without a reload.
#[test]
fn each_page_loads_clean_shows_the_cluster_and_follows_it() -> Result<()> {
    let (agent, alloc) = cluster()?;
    let alloc_id = alloc["id"].as_str().context("alloc ID")?.to_string();
    let node_id = alloc["node_id"].as_str().context("node ID")?.to_string();
    let node_name = agent.api_get(&format!("/v1/node/{node_id}"))?["name"]
        .as_str()
        .context("node name")?
        .to_string();
    let mut browser = Browser::start(1280, 800)?;
    let base = format!("{}/ui/", agent.http_addr);
    let short = &alloc_id[..8];
    let pages: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "jobs",
            "#/jobs".into(),
            vec!["reader", "hostpath-plugin", "1 running"],
        ),
        (
            "job",
            "#/jobs/reader".into(),
            vec!["Job reader", short, "Versions"],
        ),
        (
            "alloc",
            format!("#/allocs/{alloc_id}"),
            vec!["reader.reader[0]", "Task read", "Started", "reader started"],
        ),
        (
            "nodes",
            "#/nodes".into(),
            vec![&node_name, "ready", "eligible"],
        ),
        (
            "node",
            format!("#/nodes/{node_id}"),
            vec!["raw_exec", "hostpath", "Node registered"],
        ),
        (
            "volumes",
            "#/volumes".into(),
            vec!["data", "hostpath", "single-node-reader-only"],
        ),
        (
            "volume",
            "#/volumes/data".into(),
            vec!["Volume data", short, "taken"],
        ),
        (
            "plugins",
            "#/plugins".into(),
            vec!["hostpath", "1/1 healthy"],
        ),
        (
            "plugin",
            "#/plugins/hostpath".into(),
            vec!["Plugin hostpath", "hostpath.csi.berth.dev", "StageUnstage"],
        ),
    ];
    for (name, hash, needles) in &pages {
        // Each page from a fresh load, as a bookmark opens it.
        browser.navigate("about:blank")?;
        let opened = Instant::now();
        let url = format!("{base}{hash}");
        browser.navigate(&url)?;
        browser
            .wait_text(LOAD, needles)
            .with_context(|| format!("the {name} page ({url})"))?;
        let errors = browser.take_errors();
        ensure!(
            errors.is_empty(),
            "the {name} page raised errors: {errors:#?}"
        );
        let bytes = browser.transferred();
        ensure!(
            bytes < 200_000,
            "the {name} page's first load took {bytes} bytes"
        );
        println!(
            "the {name} page: {bytes} bytes transferred on its first load, data shown after {:?}",
            opened.elapsed()
        );
        browser.screenshot(&screenshots().join(format!("{name}.png")))?;
    }

    // Live: a job submitted now appears without a reload.
    browser.navigate(&format!("{base}#/jobs"))?;
    browser.wait_text(LOAD, &["reader"])?;
    let submitted = Instant::now();
    agent.run_job("latecomer", &sleeping_service_job("latecomer", 1, 0))?;
    let cli_done = submitted.elapsed();
    browser.wait_text(Duration::from_secs(2), &["latecomer"])?;
    let shown = submitted.elapsed();
    println!(
        "the jobs page showed the new job {shown:?} after its submission ({cli_done:?} in the CLI)"
    );
    let errors = browser.take_errors();
    ensure!(
        errors.is_empty(),
        "the live jobs page raised errors: {errors:#?}"
    );
    Ok(())
}

/// The alloc page tails the task's stdout: a line the task writes after
/// the page opened shows within 2 s; and its Stop button, once confirmed,
/// stops the alloc.
#[test]
fn the_alloc_page_tails_the_log_and_stops_the_alloc() -> Result<()> {
    let (agent, alloc) = cluster()?;
    let alloc_id = alloc["id"].as_str().context("alloc ID")?.to_string();
    let mut browser = Browser::start(1280, 800)?;
    browser.navigate(&format!("{}/ui/#/allocs/{alloc_id}", agent.http_addr))?;
    browser.wait_text(LOAD, &["reader started", "following"])?;

    let line = format!("written after the page opened {}", std::process::id());
    let say = agent
        .data_dir
        .path()
        .join("alloc")
        .join(&alloc_id)
        .join("read")
        .join("say");
    let tmp = say.with_extension("tmp");
    std::fs::write(&tmp, format!("{line}\n"))?;
    let written = Instant::now();
    std::fs::rename(&tmp, &say)?;
    browser.wait_until(
        "the log tail to show the new line",
        Duration::from_secs(2),
        &format!(
            "document.querySelector('pre[data-log]').textContent.includes({})",
            serde_json::to_string(&line)?
        ),
    )?;
    println!(
        "the log tail showed the line {:?} after it was written",
        written.elapsed()
    );

    browser.click("button", "Stop")?;
    browser.wait_until(
        "the confirmation dialog",
        LOAD,
        "document.getElementById('confirm').open",
    )?;
    browser.click("#confirm-ok", "Stop")?;
    wait_for("the alloc to stop", Duration::from_secs(30), || {
        let a = agent.api_get(&format!("/v1/allocation/{alloc_id}"))?;
        Ok((a["desired_status"] == "stop" && a["client_status"] == "complete").then_some(()))
    })
    .with_context(|| agent.log())?;
    browser.wait_text(LOAD, &["complete"])?;
    let errors = browser.take_errors();
    ensure!(
        errors.is_empty(),
        "the alloc page raised errors: {errors:#?}"
    );
    Ok(())
}

/// Gives the token dialog `secret` and confirms it.
fn give_token(browser: &mut Browser, secret: &str) -> Result<()> {
    browser.wait_until(
        "the token dialog",
        LOAD,
        "document.getElementById('token').open",
    )?;
    browser.eval(&format!(
        "document.getElementById('token-secret').value = {}",
        serde_json::to_string(secret)?
    ))?;
    browser.click("#token button", "Use token")
}

/// Whether the page shows a button labelled `label`.
fn has_button(browser: &mut Browser, label: &str) -> Result<bool> {
    Ok(browser.eval(&format!(
        "[...document.querySelectorAll('main button')].some((b) => b.textContent === {})",
        serde_json::to_string(label)?
    ))? == serde_json::json!(true))
}

/// With ACLs on, a page the API refuses asks for a token and keeps it
/// for the tab only; the actions the token cannot take are not shown: a
/// read-only token sees the alloc without Stop or Restart, the
/// management token with both.
#[test]
fn with_acls_the_page_asks_for_a_token_and_hides_what_it_cannot_do() -> Result<()> {
    let agent = DevAgent::start_with_args(&["-acl-enabled"])?;
    let management = agent.token.clone().context("the bootstrap token")?;
    agent.run_plugin_and_create_volume()?;
    agent.run_job("reader", READER)?;
    let alloc = wait_alloc_running(&agent, "reader")?;
    let alloc_id = alloc["id"].as_str().context("alloc ID")?.to_string();
    let policy = agent.write_file("readonly.hcl", READONLY_POLICY)?;
    agent.cli_ok(&["acl", "policy", "apply", "readonly", &policy])?;
    let created: serde_json::Value = serde_json::from_str(&agent.cli_ok(&[
        "acl",
        "token",
        "create",
        "-json",
        "-name",
        "ui-reader",
        "-policy",
        "readonly",
    ])?)?;
    let reader = created["secret_id"]
        .as_str()
        .context("the token")?
        .to_string();

    let mut browser = Browser::start(1280, 800)?;
    browser.navigate(&format!("{}/ui/#/allocs/{alloc_id}", agent.http_addr))?;
    give_token(&mut browser, &reader)?;
    browser.wait_text(LOAD, &["reader.reader[0]", "Task read"])?;
    ensure!(
        !has_button(&mut browser, "Stop")? && !has_button(&mut browser, "Restart")?,
        "a read-only token is offered Stop or Restart"
    );
    let kept = browser.eval(&format!(
        "sessionStorage.getItem('berth.token') === {} && localStorage.length === 0",
        serde_json::to_string(&reader)?
    ))?;
    ensure!(
        kept == serde_json::json!(true),
        "the token is not kept in session storage alone"
    );

    browser.click("#token-button", "")?;
    give_token(&mut browser, &management)?;
    browser.wait_until(
        "Stop and Restart for the management token",
        LOAD,
        "['Stop', 'Restart'].every((l) => [...document.querySelectorAll('main button')].some((b) => b.textContent === l))",
    )?;
    Ok(())
}

/// Without a mouse: Tab reaches the skip link and then the sections, and
/// Enter follows a link. In a narrow window (390×844) no page is wider
/// than the window (wide tables scroll in their own box). When the agent
/// stops answering, the header says so; when it is back, the page goes on.
#[test]
fn the_ui_works_from_the_keyboard_in_a_narrow_window_and_says_when_the_agent_is_gone() -> Result<()>
{
    let (mut agent, alloc) = cluster()?;
    let alloc_id = alloc["id"].as_str().context("alloc ID")?.to_string();
    let mut browser = Browser::start(1280, 800)?;
    let base = format!("{}/ui/", agent.http_addr);
    browser.navigate(&format!("{base}#/jobs"))?;
    browser.wait_text(LOAD, &["reader"])?;
    browser.press("Tab")?;
    let focused = browser.eval("document.activeElement.textContent")?;
    ensure!(
        focused == "Skip to content",
        "the first Tab focuses {focused}"
    );
    // Past the brand to the sections: Nodes is the third link after it.
    for _ in 0..3 {
        browser.press("Tab")?;
    }
    let focused = browser.eval("document.activeElement.textContent")?;
    ensure!(
        focused == "Nodes",
        "Tab reached {focused}, not the Nodes section"
    );
    browser.press("Enter")?;
    browser.wait_until(
        "Enter to open the nodes page",
        LOAD,
        "location.hash === '#/nodes'",
    )?;
    browser.wait_text(LOAD, &["eligible"])?;

    browser.resize(390, 844)?;
    for hash in [
        "#/jobs".to_string(),
        format!("#/allocs/{alloc_id}"),
        "#/nodes".into(),
        "#/volumes/data".into(),
    ] {
        browser.navigate("about:blank")?;
        browser.navigate(&format!("{base}{hash}"))?;
        browser.wait_until(
            "the page's data",
            LOAD,
            "!document.body.innerText.includes('Loading')",
        )?;
        let fits = browser.eval("document.documentElement.scrollWidth <= window.innerWidth")?;
        ensure!(
            fits == serde_json::json!(true),
            "{hash} is wider than a 390 px window"
        );
        let name = hash
            .trim_start_matches("#/")
            .split('/')
            .next()
            .unwrap_or("page")
            .to_string();
        browser.screenshot(&screenshots().join(format!("narrow-{name}.png")))?;
    }

    agent.stop_agent()?;
    browser.wait_text(Duration::from_secs(30), &["Agent unreachable"])?;
    agent.start_again()?;
    browser.wait_until(
        "the header to clear once the agent is back",
        Duration::from_secs(60),
        "document.getElementById('conn').textContent === ''",
    )?;
    Ok(())
}
