//! Secrets at rest and file modes, on a dev agent running the example
//! hostpath plugin: a volume's secret goes through its whole life
//! (created, claimed by a job, released, deregistered) and its bytes are
//! in neither state database file, while the agent runs and after it
//! stopped, nor in the agent's trace-level log. The data dir, state dirs,
//! keyring, databases, alloc dirs and task logs have their modes, and an
//! old data dir with looser ones is narrowed with a warning. `operator
//! root keyring rotate` makes a new key, removes the old one, and the
//! volume still works afterwards and after a restart.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use berth_tests::{csi_volume_service_job, example, wait_alloc_running, DevAgent};

/// A volume secret whose bytes must be nowhere on disk in the clear.
const SECRET: &str = "at-rest-5f0c2a91d7e4";

fn volume_spec() -> Result<String> {
    let src = std::fs::read_to_string(example("volumes/hostpath.hcl"))?;
    Ok(format!("{src}\nsecrets {{\n  token = \"{SECRET}\"\n}}\n"))
}

fn mode(path: &Path) -> Result<u32> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .permissions()
        .mode()
        & 0o777)
}

fn assert_mode(path: &Path, want: u32) -> Result<()> {
    let found = mode(path)?;
    ensure!(
        found == want,
        "{} has mode {found:o}, want {want:o}",
        path.display()
    );
    Ok(())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn server_db(agent: &DevAgent) -> PathBuf {
    agent.data_dir.path().join("server/state.redb")
}

fn client_db(agent: &DevAgent) -> PathBuf {
    agent.data_dir.path().join("client/state.redb")
}

fn keyring_dir(agent: &DevAgent) -> PathBuf {
    agent.data_dir.path().join("server/keyring")
}

/// The key files of the keyring.
fn key_files(agent: &DevAgent) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(keyring_dir(agent))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            out.push(path);
        }
    }
    Ok(out)
}

/// Neither database file holds the secret's bytes.
fn assert_secret_not_in_databases(agent: &DevAgent, when: &str) -> Result<()> {
    for db in [server_db(agent), client_db(agent)] {
        let bytes = std::fs::read(&db).with_context(|| format!("reading {}", db.display()))?;
        ensure!(
            !contains(&bytes, SECRET.as_bytes()),
            "{} holds the volume secret in the clear {when}",
            db.display()
        );
    }
    Ok(())
}

/// The modes of the data dir, the state dirs, the keyring and the
/// databases.
fn assert_state_modes(agent: &DevAgent) -> Result<()> {
    let data = agent.data_dir.path();
    for dir in [
        data.to_path_buf(),
        data.join("server"),
        data.join("client"),
        keyring_dir(agent),
    ] {
        assert_mode(&dir, 0o700)?;
    }
    assert_mode(&server_db(agent), 0o600)?;
    assert_mode(&client_db(agent), 0o600)?;
    let keys = key_files(agent)?;
    ensure!(!keys.is_empty(), "the keyring has a key");
    for key in keys {
        assert_mode(&key, 0o600)?;
    }
    Ok(())
}

#[test]
fn a_volume_secret_is_sealed_at_rest_through_its_life_and_a_rotation() -> Result<()> {
    let mut agent = DevAgent::start_with_args(&["-log-level", "trace"])?;
    assert_state_modes(&agent)?;

    agent.run_example_plugin()?;
    let spec = agent.write_file("data.hcl", &volume_spec()?)?;
    agent.cli_ok(&["volume", "create", &spec])?;
    let job = agent.write_file(
        "holder.hcl",
        &csi_volume_service_job("holder", "holder", &["-c", "echo started; sleep 3600"]),
    )?;
    agent.cli_ok(&["job", "run", "-detach", &job])?;
    let alloc = wait_alloc_running(&agent, "holder")?;
    let alloc_id = alloc["id"].as_str().context("alloc ID")?.to_string();

    // The alloc dir and what it holds.
    let alloc_dir = agent.data_dir.path().join("alloc").join(&alloc_id);
    for dir in [
        alloc_dir.clone(),
        alloc_dir.join("alloc"),
        alloc_dir.join("alloc/data"),
        alloc_dir.join("alloc/logs"),
        alloc_dir.join("alloc/tmp"),
        alloc_dir.join("holder"),
        alloc_dir.join("holder/local"),
        alloc_dir.join("holder/tmp"),
    ] {
        assert_mode(&dir, 0o750)?;
    }
    assert_mode(&alloc_dir.join("holder/secrets"), 0o700)?;
    for log in ["holder.stdout.0", "holder.stderr.0"] {
        assert_mode(&alloc_dir.join("alloc/logs").join(log), 0o640)?;
    }

    // While the volume is claimed and the agent runs.
    assert_secret_not_in_databases(&agent, "while the volume is claimed")?;

    // A rotation: a new key, the old one removed, every secret sealed
    // again.
    let old_keys = key_files(&agent)?;
    ensure!(old_keys.len() == 1, "one key before rotating: {old_keys:?}");
    let rotation = agent.cli_json(&["operator", "root", "keyring", "rotate"])?;
    let key_id = rotation["key_id"].as_str().context("key_id")?.to_string();
    ensure!(rotation["volumes"] == 1, "{rotation}");
    ensure!(rotation["node_secrets"] == 1, "{rotation}");
    ensure!(
        !rotation.to_string().contains("\"key\""),
        "no key material in {rotation}"
    );
    let new_keys = key_files(&agent)?;
    ensure!(
        new_keys == [keyring_dir(&agent).join(format!("{key_id}.json"))],
        "only the new key is left: {new_keys:?}"
    );
    ensure!(!old_keys[0].exists(), "the old key file is gone");
    let text = agent.cli_ok(&["operator", "root", "keyring", "rotate"])?;
    ensure!(text.contains("Key ID: "), "{text}");
    assert_secret_not_in_databases(&agent, "after the rotations")?;

    // The volume still works after a restart: the job is stopped, run
    // again, and claims it again with the secrets that load from the
    // sealed record.
    agent.restart()?;
    assert_state_modes(&agent)?;
    agent.cli_ok(&["job", "stop", "holder"])?;
    agent.wait_volume_unclaimed("data")?;
    let job2 = agent.write_file(
        "holder2.hcl",
        &csi_volume_service_job("holder2", "holder2", &["-c", "sleep 3600"]),
    )?;
    agent.cli_ok(&["job", "run", "-detach", &job2])?;
    wait_alloc_running(&agent, "holder2")?;
    agent.cli_ok(&["job", "stop", "holder2"])?;
    agent.wait_volume_unclaimed("data")?;
    agent.cli_ok(&["volume", "deregister", "data"])?;
    assert_secret_not_in_databases(&agent, "after the volume was deregistered")?;

    agent.stop_agent()?;
    assert_secret_not_in_databases(&agent, "after the agent stopped")?;
    let log = agent.log();
    ensure!(
        log.contains(" DEBUG ") || log.contains(" TRACE "),
        "the agent logged at its most verbose level"
    );
    ensure!(!log.contains(SECRET), "the agent log holds the secret");
    Ok(())
}

#[test]
fn an_old_data_dir_with_loose_modes_is_narrowed_with_a_warning() -> Result<()> {
    let mut agent = DevAgent::start()?;
    agent.stop_agent()?;
    let data = agent.data_dir.path().to_path_buf();
    let key = key_files(&agent)?
        .into_iter()
        .next()
        .context("a key file")?;
    let loose: Vec<(PathBuf, u32, u32)> = vec![
        (data.clone(), 0o755, 0o700),
        (data.join("server"), 0o755, 0o700),
        (data.join("client"), 0o755, 0o700),
        (keyring_dir(&agent), 0o755, 0o700),
        (server_db(&agent), 0o644, 0o600),
        (client_db(&agent), 0o644, 0o600),
        (key, 0o644, 0o600),
    ];
    for (path, m, _) in &loose {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(*m))?;
    }
    agent.start_again()?;
    for (path, found, want) in &loose {
        assert_mode(path, *want)?;
        let shown = path.display().to_string();
        let log = agent.log();
        let warned = log.lines().any(|l| {
            l.contains("WARN")
                && l.contains(&format!("path={shown} "))
                && l.contains(&format!("{found:o}"))
                && l.contains(&format!("{want:o}"))
        });
        ensure!(
            warned,
            "no warning naming {shown}, {found:o} and {want:o}:\n{log}"
        );
    }
    Ok(())
}
