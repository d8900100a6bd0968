//! Rescheduling with backoff on a cluster of one server and one client: a
//! service job whose command fails is replaced again and again, each
//! replacement after a longer delay (an exponential policy of 1 s, so the
//! test runs in seconds what Nomad's default of 30 s does in minutes);
//! each replacement records the attempts before it, `job status` says
//! when the next attempt is and `alloc status` shows the history. A
//! policy of one attempt stops after it, and the job is dead.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{logs, Client, Server};
use berth_tests::wait_for;
use serde_json::Value;

fn failing(job: &str, reschedule: &str) -> String {
    format!(
        r#"
job "{job}" {{
  group "g" {{
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    reschedule {{
{reschedule}
    }}
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "exit 7"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// The `Status = ...` line of `job status`.
fn status_line(shown: &str) -> &str {
    shown
        .lines()
        .find(|l| l.starts_with("Status "))
        .unwrap_or_default()
}

/// When (unix ms) the alloc's task finished, its failure.
fn failed_at(a: &Value) -> i64 {
    a["task_states"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, s)| s["finished_at_ms"].as_i64())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_failing_service_job_is_rescheduled_with_growing_delays() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "resched-c1", false, "")?;
    server
        .wait_nodes_ready(&["resched-c1"])
        .with_context(|| logs(&server, &[&client]))?;
    let job = "resched-backoff";
    server.run_job(
        job,
        &failing(
            job,
            "delay = \"1s\"\ndelay_function = \"exponential\"\nmax_delay = \"30s\"",
        ),
    )?;
    // Four failed allocs: the first and three replacements, after 1, 2
    // and 4 s.
    let allocs = wait_for("four failed allocs", Duration::from_secs(40), || {
        let mut allocs = server.allocs(job)?;
        allocs.retain(|a| a["client_status"] == "failed");
        allocs.sort_by_key(|a| a["create_index"].as_u64());
        Ok((allocs.len() >= 4).then_some(allocs))
    })
    .with_context(|| logs(&server, &[&client]))?;
    let mut gaps = Vec::new();
    for pair in allocs.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        assert_eq!(after["previous_allocation"], before["id"]);
        assert_eq!(before["next_allocation"], after["id"]);
        gaps.push(after["create_time_ms"].as_i64().unwrap_or(0) - failed_at(before));
    }
    let delays: Vec<u64> = allocs[3]["reschedule_events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["delay_ms"].as_u64())
        .collect();
    assert_eq!(delays, [1000, 2000, 4000]);
    // Each gap is at least its delay, and they grow.
    for (gap, delay) in gaps.iter().zip(&delays) {
        assert!(
            *gap >= i64::try_from(*delay)? - 50,
            "gaps {gaps:?}, delays {delays:?}"
        );
    }
    assert!(gaps.windows(2).all(|w| w[1] > w[0]), "gaps {gaps:?}");

    // The newest failure waits 8 s: `job status` and `alloc status` say so.
    let newest = wait_for(
        "the fourth replacement to fail",
        Duration::from_secs(20),
        || {
            let mut allocs = server.allocs(job)?;
            allocs.sort_by_key(|a| a["create_index"].as_u64());
            let last = allocs.pop();
            Ok(last.filter(|a| {
                a["client_status"] == "failed"
                    && a["reschedule_events"].as_array().map(Vec::len) == Some(4)
            }))
        },
    )?;
    let status = server.cli(&["job", "status", job])?;
    assert!(status.contains("\nRescheduling\n"), "{status}");
    assert!(
        status.contains("resched-backoff.g[0] failed after 4 reschedules: next attempt in "),
        "{status}"
    );
    let id = newest["id"].as_str().unwrap_or_default();
    let detail = server.cli(&["alloc", "status", id])?;
    assert!(detail.contains("Reschedule Attempts"), "{detail}");
    assert!(detail.contains("Reschedule Eligibility = in "), "{detail}");
    server.cli(&["job", "stop", job])?;
    Ok(())
}

#[test]
fn a_failing_job_is_failed_in_job_run_and_job_status_alike() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "resched-c2", false, "")?;
    server
        .wait_nodes_ready(&["resched-c2"])
        .with_context(|| logs(&server, &[&client]))?;
    let job = "resched-once";
    // A batch job: `job run` follows it until its alloc is done.
    let spec = failing(job, "attempts = 1\ninterval = \"1h\"\ndelay = \"8s\"").replacen(
        "{\n  group",
        "{\n  type = \"batch\"\n  group",
        1,
    );
    let file = server.job_file(job, &spec)?;
    // `job run` follows the alloc until it fails, and says so.
    let run = berth_tests::cli_at(&server.addr(), &["job", "run", &file])?;
    let said = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!("==> Job {job:?} failed: 1 alloc of 1 failed")),
        "{said}"
    );
    // The job status says the same while its replacement waits for the
    // reschedule delay, not "pending".
    let j = server.get(&format!("/v1/job/{job}"))?;
    assert_eq!(
        server.allocs(job)?.len(),
        1,
        "replaced within the 8 s delay"
    );
    assert_eq!(j["status"], "failed", "{j}");
    let shown = server.cli(&["job", "status", job])?;
    assert!(status_line(&shown).ends_with("= failed"), "{shown}");
    // The one reschedule fails too, and the policy allows no more: failed
    // for good, and garbage collection takes it.
    wait_for("the reschedule to fail", Duration::from_secs(30), || {
        let allocs = server.allocs(job)?;
        Ok(
            (allocs.len() == 2 && allocs.iter().all(|a| a["client_status"] == "failed"))
                .then_some(()),
        )
    })
    .with_context(|| logs(&server, &[&client]))?;
    wait_for("the job status to follow", Duration::from_secs(10), || {
        let j = server.get(&format!("/v1/job/{job}"))?;
        Ok((j["status"] == "failed").then_some(()))
    })?;
    let status = server.cli(&["job", "status", job])?;
    assert!(status_line(&status).ends_with("= failed"), "{status}");
    assert!(
        status.contains("failed after 1 reschedule: no more attempts"),
        "{status}"
    );
    server.cli(&["system", "gc"])?;
    let gone = server.get(&format!("/v1/job/{job}")).unwrap_err();
    assert!(format!("{gone:#}").contains(" 404 "), "{gone:#}");
    Ok(())
}
