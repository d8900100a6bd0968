//! The command line itself, on the real binary: help on every command,
//! version, completions, single- and double-dash flags, and how it fails
//! (usage errors exit 2, everything else exits 1 with one `Error:` line).

use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result};
use berth_tests::cli_text::{stderr, stdout};
use berth_tests::{binary, cli_at, free_port, quick_batch_job, DevAgent};

/// Every command and subcommand of berth. A unit test of the berth crate
/// checks this list against its command tree.
const COMMANDS: &[&str] = &[
    "acl",
    "acl bootstrap",
    "acl policy",
    "acl policy apply",
    "acl policy delete",
    "acl policy info",
    "acl policy list",
    "acl token",
    "acl token create",
    "acl token delete",
    "acl token info",
    "acl token list",
    "acl token self",
    "agent",
    "alloc",
    "alloc logs",
    "alloc restart",
    "alloc signal",
    "alloc status",
    "alloc stop",
    "completion",
    "config",
    "config validate",
    "deployment",
    "deployment fail",
    "deployment list",
    "deployment promote",
    "deployment status",
    "job",
    "job history",
    "job inspect",
    "job plan",
    "job revert",
    "job run",
    "job scale",
    "job status",
    "job stop",
    "job validate",
    "node",
    "node drain",
    "node eligibility",
    "node intro",
    "node intro create",
    "node intro list",
    "node intro revoke",
    "node purge",
    "node status",
    "operator",
    "operator root",
    "operator root keyring",
    "operator root keyring rotate",
    "operator store",
    "plugin",
    "plugin status",
    "server",
    "server members",
    "system",
    "system gc",
    "tls",
    "tls ca",
    "tls ca create",
    "tls cert",
    "tls cert create",
    "version",
    "volume",
    "volume create",
    "volume delete",
    "volume deregister",
    "volume detach",
    "volume register",
    "volume snapshot",
    "volume snapshot create",
    "volume snapshot delete",
    "volume snapshot list",
    "volume status",
];

/// Runs berth with no agent behind its default address.
fn berth(args: &[&str]) -> Result<Output> {
    Command::new(binary("berth"))
        .args(args)
        .env("BERTH_ADDR", format!("http://127.0.0.1:{}", free_port()))
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running berth {}", args.join(" ")))
}

#[test]
fn every_command_has_help_with_h_help_and_double_dash_help() -> Result<()> {
    for command in COMMANDS {
        let words: Vec<&str> = command.split(' ').collect();
        for flag in ["-h", "-help", "--help"] {
            let mut args = words.clone();
            args.push(flag);
            let out = berth(&args)?;
            assert_eq!(
                out.status.code(),
                Some(0),
                "berth {command} {flag}: {}",
                stderr(&out)
            );
            let text = stdout(&out);
            assert!(
                text.contains(&format!("Usage: berth {command}")),
                "berth {command} {flag}: {text}"
            );
        }
    }
    let out = berth(&["help", "job", "run"])?;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("Usage: berth job run"),
        "{}",
        stdout(&out)
    );
    Ok(())
}

#[test]
fn berth_alone_or_a_group_alone_prints_its_help_and_exits_2() -> Result<()> {
    for args in [&[][..], &["job"], &["volume", "snapshot"]] {
        let out = berth(args)?;
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            stderr(&out).contains("Usage: berth"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    Ok(())
}

#[test]
fn version_in_every_form() -> Result<()> {
    for args in [&["version"][..], &["-version"], &["--version"]] {
        let out = berth(args)?;
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert_eq!(stdout(&out).trim(), "berth v0.1.0", "{args:?}");
    }
    Ok(())
}

#[test]
fn completions_for_bash_zsh_and_fish_name_the_commands() -> Result<()> {
    for shell in ["bash", "zsh", "fish"] {
        let out = berth(&["completion", shell])?;
        assert_eq!(out.status.code(), Some(0), "{shell}: {}", stderr(&out));
        let script = stdout(&out);
        assert!(
            script.contains("job") && script.contains("volume"),
            "{shell}: {script}"
        );
    }
    let out = berth(&["completion", "tcsh"])?;
    assert_eq!(out.status.code(), Some(2));
    Ok(())
}

#[test]
fn an_unknown_flag_is_a_usage_error_with_the_commands_usage() -> Result<()> {
    for flag in ["-bogus", "--bogus"] {
        let out = berth(&["job", "status", flag])?;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.starts_with("Error: unexpected argument '-bogus' found\n\nUsage: berth job status"),
            "{err}"
        );
        assert!(stdout(&out).is_empty());
    }
    // A missing argument names it.
    let out = berth(&["alloc", "status"])?;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("Error: ") && err.contains("<ALLOC>"),
        "{err}"
    );
    Ok(())
}

#[test]
fn no_agent_at_the_address_is_one_error_line_and_exit_1() -> Result<()> {
    let addr = format!("http://127.0.0.1:{}", free_port());
    for args in [&["job", "status"][..], &["node", "status", "-json"]] {
        let out = cli_at(&addr, args)?;
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert_eq!(
            stderr(&out),
            format!("Error: no berth agent answers at {addr} (connection refused)\n"),
            "{args:?}"
        );
    }
    // -address wins over BERTH_ADDR, in either form.
    let other = format!("http://127.0.0.1:{}", free_port());
    for flag in ["-address", "--address"] {
        let out = cli_at(&addr, &[flag, &other, "job", "status"])?;
        assert!(stderr(&out).contains(&other), "{flag}: {}", stderr(&out));
        let out = cli_at(&addr, &["job", "status", &format!("{flag}={other}")])?;
        assert!(stderr(&out).contains(&other), "{flag}=: {}", stderr(&out));
    }
    Ok(())
}

#[test]
fn against_an_agent_flags_ids_and_prefixes() -> Result<()> {
    let agent = DevAgent::start()?;
    for id in ["amb-one", "amb-two"] {
        let file = agent.write_file(&format!("{id}.hcl"), &quick_batch_job(id, 1))?;
        agent.cli_ok(&["job", "run", "-detach", &file])?;
    }

    // One dash or two: the same flag.
    for flag in ["-json", "--json"] {
        let out = agent.cli_ok(&["job", "status", flag])?;
        let jobs: serde_json::Value = serde_json::from_str(&out).context(out.clone())?;
        assert_eq!(jobs.as_array().map(Vec::len), Some(2), "{flag}: {out}");
    }

    // A unique prefix names its job; an ambiguous one lists the matches.
    let one: serde_json::Value =
        serde_json::from_str(&agent.cli_ok(&["job", "status", "-json", "amb-o"])?)?;
    assert_eq!(one["id"], "amb-one");
    let out = agent.cli(&["job", "status", "amb"])?;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("Error: job ID prefix \"amb\" matches 2 jobs: \"amb-one\", \"amb-two\""),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    // Unknown IDs: one line, exit 1.
    for args in [
        &["job", "status", "nope"][..],
        &["alloc", "status", "nope"],
        &["node", "status", "nope"],
        &["volume", "status", "nope"],
        &["plugin", "status", "nope"],
    ] {
        let out = agent.cli(args)?;
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("Error: ") && err.contains("not found") && err.lines().count() == 1,
            "{args:?}: {err}"
        );
    }
    Ok(())
}
