//! A CSI node plugin is never stopped under mounted volumes, whatever the
//! servers ask: on a dev agent with the real binary, the example hostpath
//! plugin and real mounts, `berth job stop` of the plugin while a service
//! has the plugin's volume mounted leaves the plugin running (the same
//! process, through an agent restart), with a task event saying what it
//! waits for. Once the service is stopped, its volume is unmounted through
//! the plugin without error, and only then does the plugin stop; nothing is
//! left mounted.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::{
    csi_volume_service_job, mounts_under, node_events, only_alloc, processes_with_cmdline, strs,
    task_events, wait_alloc_running, wait_for, DevAgent,
};
use serde_json::Value;

const WAITING: &str =
    "Waiting for 1 volume(s) of plugin \"hostpath\" to be unmounted before stopping";

/// A service that keeps the `data` volume mounted.
fn user_job() -> String {
    csi_volume_service_job(
        "user",
        "hold",
        &[
            "-c",
            "echo hello > ${BERTH_TASK_DIR}/data/hello; exec sleep 1000",
        ],
    )
}

/// The plugin task's events of the plugin alloc, as (type, message, time).
fn plugin_events(agent: &DevAgent, alloc_id: &str) -> Result<Vec<(String, String, i64)>> {
    let a = agent.cli_json(&["alloc", "status", alloc_id])?;
    Ok(task_events(&a, "plugin"))
}

fn waiting_events(agent: &DevAgent, alloc_id: &str) -> Result<usize> {
    Ok(plugin_events(agent, alloc_id)?
        .iter()
        .filter(|(t, m, _)| t == "Waiting for volumes" && m == WAITING)
        .count())
}

/// Checks, for `period`, that the plugin alloc still runs the same process
/// and the volume stays mounted.
fn assert_plugin_keeps_running(
    agent: &DevAgent,
    plugin_id: &str,
    needle: &str,
    pids: &[i32],
    period: Duration,
) -> Result<()> {
    let data_dir = agent.data_dir.path();
    let until = Instant::now() + period;
    while Instant::now() < until {
        let plugin = agent.cli_json(&["alloc", "status", plugin_id])?;
        assert_eq!(plugin["client_status"], "running", "{plugin}");
        assert_eq!(plugin["desired_status"], "stop", "{plugin}");
        assert_eq!(
            processes_with_cmdline(needle),
            pids,
            "the same plugin process runs"
        );
        assert!(
            !mounts_under(data_dir).is_empty(),
            "the volume stays mounted"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

#[test]
fn stopping_the_plugin_job_waits_until_its_volume_is_unmounted() -> Result<()> {
    let mut agent = DevAgent::start()?;
    let data_dir = agent.data_dir.path().canonicalize()?;
    agent.run_plugin_and_create_volume()?;
    let user_file = agent.write_file("user.hcl", &user_job())?;
    agent.cli_ok(&["job", "run", "-detach", &user_file])?;
    let user_id = wait_alloc_running(&agent, "user")?["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let user_dir = data_dir.join("alloc").join(&user_id);
    wait_for("the user to write", Duration::from_secs(30), || {
        Ok(user_dir.join("hold/data/hello").is_file().then_some(()))
    })?;
    let plugin = only_alloc(&agent, "hostpath-plugin")?;
    let plugin_id = plugin["id"].as_str().unwrap_or_default().to_string();
    let node_id = plugin["node_id"].as_str().unwrap_or_default().to_string();
    let needle = format!("--state-dir={}", data_dir.display());
    let pids = processes_with_cmdline(&needle);
    assert_eq!(pids.len(), 1, "one plugin process: {pids:?}");

    // The operator stops the plugin while the volume is mounted: it waits
    // (so `job stop` would too: -detach).
    agent.cli_ok(&["job", "stop", "-detach", "hostpath-plugin"])?;
    wait_for(
        "the plugin to say it waits for the volume",
        Duration::from_secs(30),
        || Ok((waiting_events(&agent, &plugin_id)? == 1).then_some(())),
    )
    .with_context(|| agent.log())?;
    assert_plugin_keeps_running(&agent, &plugin_id, &needle, &pids, Duration::from_secs(3))?;

    // An agent restart decides the stop again, from the persisted desired
    // status: the plugin is reattached, not killed, and waits again.
    agent.restart()?;
    wait_for(
        "the restored plugin to say it waits again",
        Duration::from_secs(30),
        || Ok((waiting_events(&agent, &plugin_id)? == 2).then_some(())),
    )
    .with_context(|| agent.log())?;
    assert_plugin_keeps_running(&agent, &plugin_id, &needle, &pids, Duration::from_secs(2))?;

    // The user stops: its volume is unmounted through the plugin, then the
    // plugin stops.
    agent.cli_ok(&["job", "stop", "user"])?;
    wait_for("the plugin process to go", Duration::from_secs(60), || {
        Ok(processes_with_cmdline(&needle).is_empty().then_some(()))
    })
    .with_context(|| agent.log())?;
    let (user, plugin) = wait_for("both allocs to finish", Duration::from_secs(30), || {
        let user = agent.cli_json(&["alloc", "status", &user_id])?;
        let plugin = agent.cli_json(&["alloc", "status", &plugin_id])?;
        let done = |a: &Value| a["client_status"] == "complete";
        Ok((done(&user) && done(&plugin)).then_some((user, plugin)))
    })
    .with_context(|| agent.log())?;
    assert_eq!(
        user["task_states"]["hold"]["failed"], false,
        "the user stopped cleanly: {user}"
    );

    // Node events reach the servers on their own, after the alloc's
    // status may have: wait for the unmount's.
    let node = wait_for("the unmount's node event", Duration::from_secs(30), || {
        let node = agent.cli_json(&["node", "status", &node_id])?;
        let seen = node_events(&node, "Storage").iter().any(|e| {
            e["message"] == "Unmount volume" && e["details"]["alloc_id"] == user_id.as_str()
        });
        Ok(seen.then_some(node))
    })
    .with_context(|| agent.log())?;
    let storage = node_events(&node, "Storage");
    let unmounted = storage
        .iter()
        .find(|e| {
            e["message"] == "Unmount volume"
                && e["details"]["alloc_id"] == user_id.as_str()
                && e["details"]["success"] == "true"
        })
        .with_context(|| format!("no successful unmount of the user's volume: {storage:?}"))?;
    assert!(
        !storage.iter().any(|e| e["details"]["success"] == "false"),
        "no mount or unmount failed: {storage:?}"
    );
    // The plugin was killed only after the unmount, and after waiting.
    let events = plugin_events(&agent, &plugin_id)?;
    let killing = events
        .iter()
        .find(|(t, _, _)| t == "Killing")
        .with_context(|| format!("the plugin was killed: {events:?}"))?;
    assert!(
        killing.2 >= unmounted["timestamp"].as_i64().unwrap_or(i64::MAX),
        "the plugin was killed before the volume was unmounted: {events:?} {unmounted}"
    );
    let last_wait = events
        .iter()
        .rposition(|(t, _, _)| t == "Waiting for volumes");
    let killed_at = events.iter().position(|(t, _, _)| t == "Killing");
    assert!(last_wait < killed_at, "{events:?}");
    assert_eq!(plugin["task_states"]["plugin"]["failed"], false, "{plugin}");

    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert!(strs(&vol["write_allocs"]).is_empty(), "{vol}");
    let left = mounts_under(&data_dir);
    assert!(left.is_empty(), "mounts left: {left:?}");
    Ok(())
}

/// `berth job stop` of the plugin job while two services hold its volume:
/// within 2 s it says which allocs it waits for, keeps that current as
/// they stop, and returns once the plugin has stopped.
#[test]
fn job_stop_of_the_plugin_says_what_it_waits_for_and_ends_when_the_users_stop() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_plugin_and_create_volume()?;
    wait_alloc_running(&agent, "hostpath-plugin")?;
    agent.run_job("user", &user_job())?;
    let user = wait_alloc_running(&agent, "user")?;
    let user_id = user["id"].as_str().context("user alloc id")?.to_string();

    let out_path = agent.data_dir.path().join("job-stop.out");
    let out = std::fs::File::create(&out_path)?;
    let mut stop = std::process::Command::new(berth_tests::binary("berth"))
        .args(["job", "stop", "hostpath-plugin"])
        .env("BERTH_ADDR", &agent.http_addr)
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()?;
    let started = Instant::now();
    let said = wait_for(
        "job stop to say what it waits for",
        Duration::from_secs(10),
        || {
            let text = std::fs::read_to_string(&out_path)?;
            Ok(text
                .lines()
                .find(|l| l.contains("waits for 1 volume user(s) to unmount"))
                .map(str::to_string))
        },
    );
    let said = match said {
        Ok(said) => said,
        Err(e) => {
            let _ = stop.kill();
            return Err(e.context(std::fs::read_to_string(&out_path).unwrap_or_default()));
        }
    };
    let after = started.elapsed();
    assert!(
        after <= Duration::from_secs(2),
        "said after {after:?}: {said}"
    );
    assert!(
        said.contains(&format!("alloc {}", &user_id[..8])) && said.contains("(user.user[0])"),
        "{said}"
    );
    assert!(stop.try_wait()?.is_none(), "job stop still waits");

    agent.cli_ok(&["job", "stop", "-detach", "user"])?;
    let status = wait_for("job stop to return", Duration::from_secs(60), || {
        Ok(stop.try_wait()?)
    })?;
    let text = std::fs::read_to_string(&out_path)?;
    assert!(status.success(), "{text}");
    assert!(
        text.contains("hostpath-plugin.plugin[0] on") && text.contains("running -> complete"),
        "it followed the plugin to its stop: {text}"
    );
    Ok(())
}
