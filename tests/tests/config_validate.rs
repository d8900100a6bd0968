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
    // The certificates they name, made by `berth tls` where they expect
    // them (a temp dir standing for /etc/berth.d/tls).
    let tls = tempfile::tempdir()?;
    for args in [
        &["tls", "ca", "create"][..],
        &["tls", "cert", "create", "-server"],
        &["tls", "cert", "create", "-client"],
    ] {
        berth_tests::pki::berth_in(tls.path(), args)?;
    }
    let copies = tempfile::tempdir()?;
    for path in &examples {
        let body = std::fs::read_to_string(path)?
            .replace("/etc/berth.d/tls", tls.path().to_str().context("UTF-8")?);
        let path = &copies.path().join(path.file_name().context("a file name")?);
        std::fs::write(path, body)?;
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

/// A `tls` block whose files are missing, or hold a certificate of
/// another CA, is refused by `config validate` naming the file (the
/// mismatched key and the expired certificate: `tls::tests`).
#[test]
fn tls_files_that_do_not_check_out_are_refused_naming_the_file() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let rogue = d.join("rogue");
    std::fs::create_dir(&rogue)?;
    for (at, args) in [
        (d, &["tls", "ca", "create"][..]),
        (d, &["tls", "cert", "create", "-server"]),
        (&rogue, &["tls", "ca", "create"]),
        (&rogue, &["tls", "cert", "create", "-server"]),
    ] {
        berth_tests::pki::berth_in(at, args)?;
    }
    let config = |name: &str, cert_dir: &Path, key_dir: &Path| -> Result<std::path::PathBuf> {
        let file = d.join(name);
        std::fs::write(
            &file,
            format!(
                "data_dir = \"/var/lib/berth\"\nserver {{\n  enabled = true\n}}\n\
                 tls {{\n  rpc = true\n  http = true\n  ca_file = {:?}\n  \
                 cert_file = {:?}\n  key_file = {:?}\n}}\n",
                d.join("berth-agent-ca.pem"),
                cert_dir.join("global-server-berth.pem"),
                key_dir.join("global-server-berth-key.pem"),
            ),
        )?;
        Ok(file)
    };
    let good = config("good.hcl", d, d)?;
    let out = validate(&[&good])?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let missing = d.join("nowhere");
    for (name, cert_dir, key_dir, needle) in [
        (
            "missing.hcl",
            missing.as_path(),
            d,
            "nowhere/global-server-berth.pem",
        ),
        (
            "stranger.hcl",
            rogue.as_path(),
            rogue.as_path(),
            "is not signed by the CA in",
        ),
        (
            "mismatch.hcl",
            d,
            rogue.as_path(),
            "is not the key of the certificate file",
        ),
    ] {
        let file = config(name, cert_dir, key_dir)?;
        let out = validate(&[&file])?;
        let stderr = text(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{name} passed");
        assert!(stderr.contains(needle), "{name}: {stderr}");
    }
    Ok(())
}

#[test]
fn an_etcd_block_an_embedded_store_server_ignores_is_named() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("server.hcl");
    std::fs::write(
        &file,
        "data_dir = \"/var/lib/berth\"\nserver {\n  enabled = true\n}\netcd {\n  endpoints = \
         [\"http://10.0.0.1:2379\"]\n}\n",
    )?;
    let out = validate(&[&file])?;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("an etcd block is set, but server { store } is \"embedded\""),
        "{stdout}"
    );
    Ok(())
}
