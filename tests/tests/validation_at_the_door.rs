//! Bad names and numbers are refused when a job or volume is submitted,
//! against a real dev agent: the CLI says what is wrong (the field, the
//! value, the rule or the limit) on one line and exits 1, and nothing
//! reaches the node. (Task names and plugin IDs with `../` were once
//! accepted and failed only on the node; `volume create` took an ID of
//! `../../../../../escape_target`; a huge count was "not a whole number".)

use anyhow::Result;
use berth_tests::DevAgent;

/// Runs the CLI with `args` and a spec file of `text`; returns its stderr,
/// after checking it failed with exit code 1 and one line.
fn refused(agent: &DevAgent, args: &[&str], text: &str) -> Result<String> {
    let path = agent.data_dir.path().join("spec.hcl");
    std::fs::write(&path, text)?;
    let path = path.display().to_string();
    let mut all = args.to_vec();
    all.push(&path);
    let out = agent.cli(&all)?;
    let err = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(err.starts_with("Error: "), "{args:?}: {err}");
    Ok(err)
}

fn job(task: &str, plugin: &str, count: &str) -> String {
    format!(
        r#"job "web" {{
  group "g" {{
    count = {count}
    task "{task}" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sleep"
        args    = ["1000"]
      }}
      csi_plugin {{
        id        = "{plugin}"
        type      = "monolith"
        mount_dir = "/csi"
      }}
    }}
  }}
}}
"#
    )
}

#[test]
fn bad_names_and_numbers_are_refused_at_submit_and_never_reach_the_node() -> Result<()> {
    let agent = DevAgent::start()?;

    let err = refused(&agent, &["job", "run"], &job("../x", "p", "1"))?;
    assert!(
        err.contains("task name \"../x\" is not allowed (it contains '/')"),
        "{err}"
    );
    assert!(err.contains("use 1-128 letters, digits"), "{err}");

    let err = refused(&agent, &["job", "run"], &job("t", "../../plugins", "1"))?;
    assert!(
        err.contains("csi_plugin.id \"../../plugins\" is not allowed"),
        "{err}"
    );

    let err = refused(
        &agent,
        &["job", "run"],
        &job("t", "p", "99999999999999999999999999"),
    )?;
    assert!(
        err.contains(
            "attribute \"count\" in group \"g\": 99999999999999999999999999 is too large (at most 10000)"
        ),
        "{err}"
    );

    let volume = std::fs::read_to_string(berth_tests::example("volumes/hostpath.hcl"))?.replace(
        "id        = \"data\"",
        "id        = \"../../../../../escape_target\"",
    );
    assert!(
        volume.contains("escape_target"),
        "the example's id line moved"
    );
    for command in ["create", "register"] {
        let err = refused(&agent, &["volume", command], &volume)?;
        assert!(
            err.contains("volume ID \"../../../../../escape_target\" is not allowed"),
            "volume {command}: {err}"
        );
    }

    // Nothing was stored, placed or mounted.
    assert_eq!(agent.cli_json(&["job", "status"])?, serde_json::json!([]));
    assert_eq!(
        agent.cli_json(&["volume", "status"])?,
        serde_json::json!([])
    );
    let escaped = agent.data_dir.path().join("escape_target");
    assert!(!escaped.exists(), "{} exists", escaped.display());
    Ok(())
}
