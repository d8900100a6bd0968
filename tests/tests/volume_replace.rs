//! A destructive update of a job whose single-writer volume is held by the
//! alloc it replaces, on a dev agent with the example hostpath plugin: the
//! plan says the new alloc waits for the old one's claim and exits 1 (a
//! change, not an error); `job run` places it at once, says what it waits
//! for, follows it to running and exits 0; while the old alloc stops
//! (its task takes a few seconds to end) `job status` shows both, the
//! stopping one and the waiting one. Never two writers: the new task
//! starts only after the old one ended.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cli_text::{stderr, stdout};
use berth_tests::{csi_volume_service_job, example, wait_alloc_running, wait_for, DevAgent};

/// The swap job: its task writes its `tag` to the volume and loops,
/// taking 2 s to end on SIGTERM (a task that flushes before it exits).
fn swap_job(tag: &str) -> String {
    let script = format!(
        "trap 'sleep 2; exit 0' TERM; echo {tag} >> data/writers; while :; do sleep 0.2; done"
    );
    csi_volume_service_job("swap", "swap", &["-c", &script]).replacen(
        "      driver = \"raw_exec\"\n",
        "      driver = \"raw_exec\"\n      kill_timeout = \"5s\"\n",
        1,
    )
}

#[test]
fn a_replacement_waits_for_the_claim_and_job_run_follows_it() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_example_plugin()?;
    let spec = std::fs::read_to_string(example("volumes/hostpath.hcl"))?;
    let spec = agent.write_file("data.hcl", &spec)?;
    agent.cli_ok(&["volume", "create", &spec])?;

    let v1 = agent.write_file("swap-v1.hcl", &swap_job("v1"))?;
    agent.cli_ok(&["job", "run", "-detach", &v1])?;
    let old = wait_alloc_running(&agent, "swap")?;
    let old_id = old["id"].as_str().context("alloc ID")?.to_string();

    // The plan: a change (exit 1) whose new alloc waits for the claim.
    let v2 = agent.write_file("swap-v2.hcl", &swap_job("v2"))?;
    let out = agent.cli(&["job", "plan", &v2])?;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!(
            "swap.swap[0] waits for the claims of alloc {} to be released",
            &old_id[..8]
        )),
        "{text}"
    );
    assert!(text.contains("All tasks successfully allocated"), "{text}");

    // The run, followed, while `job status` is watched.
    let (run, both) = std::thread::scope(|s| {
        let run = s.spawn(|| agent.cli(&["job", "run", &v2]));
        let both = wait_for(
            "job status with both allocs",
            Duration::from_secs(20),
            || {
                let status = agent.cli_ok(&["job", "status", "swap"])?;
                Ok((status.contains("\nWaiting\n")
                    && status.contains("older ones stopping")
                    && status.contains(&old_id[..8]))
                .then_some(status))
            },
        );
        (run.join(), both)
    });
    let run = run.map_err(|_| anyhow::anyhow!("job run panicked"))??;
    let both = both?;
    let run_text = stdout(&run);
    assert_eq!(run.status.code(), Some(0), "{run_text}{}", stderr(&run));
    assert!(
        run_text.contains(&format!("waits for the claims of alloc {}", &old_id[..8])),
        "{run_text}"
    );
    assert!(
        both.contains("swap.swap[0] waits for the claims of alloc"),
        "{both}"
    );

    // One writer at a time: the new task started after the old one ended.
    let new = wait_alloc_running(&agent, "swap")?;
    assert_ne!(new["id"], old["id"]);
    let old = agent.api_get(&format!("/v1/allocation/{old_id}"))?;
    let ended = old["task_states"]["swap"]["finished_at_ms"]
        .as_i64()
        .context("the old task's end")?;
    let started = new["task_states"]["swap"]["started_at_ms"]
        .as_i64()
        .context("the new task's start")?;
    assert!(started >= ended, "started {started}, old one ended {ended}");
    let volume = agent.api_get("/v1/volume/csi/data")?;
    let writers = volume["write_claims"].as_object().map_or(0, |m| m.len());
    assert_eq!(writers, 1, "{volume}");
    agent.cli_ok(&["job", "stop", "swap"])?;
    Ok(())
}
