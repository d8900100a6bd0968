//! The README's set-up on a machine with systemd, held to what it names:
//! it builds what it installs, every file it installs exists after the
//! build (the binaries as the workspace builds them, the example files in
//! the repository), the example plugin the plugin job runs from `PATH` is
//! among them, and `systemd-analyze verify` finds nothing to say of the
//! unit. This machine runs no systemd as PID 1: the unit is verified, not
//! started (`tests/tests/systemd_notify.rs` holds the agent to the unit's
//! notify contract).

use std::process::Command;

use anyhow::{ensure, Context, Result};
use berth_tests::readme::{block_after, readme};
use berth_tests::{binary, repo_root};

/// The set-up's commands.
fn setup() -> Result<Vec<String>> {
    block_after(&readme()?, "### On real machines, with systemd")
}

#[test]
fn the_systemd_setup_builds_and_installs_what_exists() -> Result<()> {
    let commands = setup()?;
    let build = commands
        .iter()
        .position(|c| c.starts_with("cargo build --release"))
        .context("the set-up builds the release binaries")?;
    let mut installed = Vec::new();
    for (i, c) in commands.iter().enumerate() {
        let words: Vec<&str> = c
            .split('#')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if words.first() != Some(&"install") || words.contains(&"-d") {
            continue;
        }
        // install -m MODE SOURCE DEST
        let source = words
            .get(3)
            .with_context(|| format!("the source of {c:?}"))?;
        if let Some(bin) = source.strip_prefix("target/release/") {
            ensure!(i > build, "{c:?} comes before the build");
            ensure!(
                commands[build].contains(&format!("-p {}", package_of(bin))),
                "{:?} does not build {bin}",
                commands[build]
            );
            // The workspace builds a binary of that name (the tests run
            // the debug build of the same targets).
            ensure!(binary(bin).is_file(), "no binary {bin} is built");
        } else {
            ensure!(
                repo_root().join(source).is_file(),
                "{source} does not exist"
            );
        }
        installed.push(source.to_string());
    }
    for needed in [
        "target/release/berth",
        "target/release/berth-executor",
        "target/release/hostpath-plugin",
        "examples/systemd/berth.service",
    ] {
        ensure!(
            installed.iter().any(|s| s == needed),
            "the set-up does not install {needed}: {installed:?}"
        );
    }
    // The plugin job finds the plugin on PATH, where it is installed.
    let job = std::fs::read_to_string(repo_root().join("examples/jobs/hostpath-plugin.hcl"))?;
    ensure!(
        job.contains("command = \"hostpath-plugin\""),
        "the plugin job runs the plugin by another name"
    );
    Ok(())
}

/// The package that builds binary `bin`.
fn package_of(bin: &str) -> &str {
    match bin {
        "berth-executor" => "berth",
        other => other,
    }
}

#[test]
fn systemd_analyze_finds_nothing_to_say_of_the_unit() -> Result<()> {
    let found = Command::new("sh")
        .args(["-c", "command -v systemd-analyze"])
        .output()?
        .status
        .success();
    if !found {
        println!("systemd-analyze is not installed (Debian's systemd): the unit was not verified");
        return Ok(());
    }
    // The unit as installed, but for the binary's place: verify checks that
    // ExecStart names an executable, and this machine has none at
    // /usr/local/bin.
    let unit = std::fs::read_to_string(repo_root().join("examples/systemd/berth.service"))?;
    ensure!(unit.contains("ExecStart=/usr/local/bin/berth "), "{unit}");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("berth.service");
    std::fs::write(
        &path,
        unit.replace(
            "/usr/local/bin/berth",
            &binary("berth").display().to_string(),
        ),
    )?;
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {}\n{said}",
        out.status
    );
    Ok(())
}
