//! `berth config validate`, the real binary on real files: every example
//! agent config passes, and a key berth does not know is refused with the
//! file and the line it is on. Nothing is started.

use std::path::Path;
use std::process::Output;

use anyhow::{Context, Result};
use berth_tests::{binary, repo_root};

fn validate(paths: &[&Path]) -> Result<Output> {
    std::process::Command::new(binary("berth"))
        .arg("config")
        .arg("validate")
        .args(paths)
        .output()
        .context("running berth config validate")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim_end().to_string()
}

#[test]
fn every_example_agent_config_passes_validate() -> Result<()> {
    let dir = repo_root().join("examples/agent");
    let mut examples: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    examples.sort();
    assert!(
        examples.iter().any(|p| p.ends_with("server.hcl"))
            && examples.iter().any(|p| p.ends_with("client.hcl")),
        "{examples:?}"
    );
    for path in &examples {
        let out = validate(&[path])?;
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}: {stdout} {stderr}",
            path.display()
        );
        assert!(
            stdout.starts_with("Configuration is valid"),
            "{}: {stdout}",
            path.display()
        );
    }
    Ok(())
}

#[test]
fn an_unknown_key_is_refused_with_its_file_and_line() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let good = repo_root().join("examples/agent/client.hcl");
    let bad = dir.path().join("extra.hcl");
    std::fs::write(
        &bad,
        "# more for the client\nclient {\n  enabled = true\n\n  colour = \"red\"\n}\n",
    )?;
    let out = validate(&[&good, &bad])?;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "Error: {}:5: unknown attribute \"colour\" in client in the agent config",
            bad.display()
        )
    );
    assert!(text(&out.stdout).is_empty());
    Ok(())
}

#[test]
fn a_client_without_servers_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("client.hcl");
    std::fs::write(
        &path,
        "data_dir = \"/var/lib/berth/client\"\nclient {\n  enabled = true\n}\n",
    )?;
    let out = validate(&[&path])?;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with(&format!("Error: {}: ", path.display())),
        "{stderr}"
    );
    assert!(stderr.contains("the client has no servers"), "{stderr}");
    Ok(())
}

#[test]
fn a_server_on_a_public_address_without_tls_is_refused_unless_insecure_bind() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let open = dir.path().join("open.hcl");
    std::fs::write(
        &open,
        "data_dir = \"/var/lib/berth\"\nbind_addr = \"0.0.0.0\"\nserver {\n  enabled = true\n}\n",
    )?;
    let out = validate(&[&open])?;
    let stderr = text(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("0.0.0.0, which is not loopback")
            && stderr.contains("tls.rpc and tls.http are off")
            && stderr.contains("insecure_bind = true"),
        "{stderr}"
    );
    let insecure = dir.path().join("insecure.hcl");
    std::fs::write(&insecure, "insecure_bind = true\n")?;
    let out = validate(&[&open, &insecure])?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    Ok(())
}
