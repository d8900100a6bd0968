//! The `exec` driver on a client agent (not `-dev`): a task is held to
//! its memory by a cgroup of its own, so a task that allocates past it
//! is OOM killed (and says so) while the node and its other allocs run
//! on, and the same task with room completes.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::cluster::{logs, marked_service_job, marker_pids, Client, Server};
use berth_tests::wait_for;
use serde_json::Value;

/// A batch job of one exec task that holds `mib` MiB (tail keeps a line
/// it has not seen the end of) with `memory` MiB asked for.
fn hungry_job(job: &str, memory: u32, mib: u32) -> String {
    format!(
        r#"
job "{job}" {{
  type = "batch"
  group "g" {{
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    reschedule {{
      attempts  = 0
      unlimited = false
    }}
    task "t" {{
      driver = "exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "head -c {bytes} /dev/zero | tail > /dev/null"]
      }}
      resources {{
        cpu    = 100
        memory = {memory}
      }}
    }}
  }}
}}
"#,
        bytes = u64::from(mib) << 20
    )
}

#[test]
fn an_exec_task_past_its_memory_is_oom_killed_and_the_node_runs_on() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "x1", false, "")?;
    server
        .wait_nodes_ready(&["x1"])
        .with_context(|| logs(&server, &[&client]))?;
    let node = server.get("/v1/nodes")?;
    let exec = &node[0];
    let info = server.get(&format!(
        "/v1/node/{}",
        exec["id"].as_str().context("node ID")?
    ))?;
    assert_eq!(
        info["driver_info"]["exec"]["healthy"], true,
        "{}",
        info["driver_info"]
    );

    // A neighbour that must not notice.
    let steady = "exec-steady";
    server.run_job(steady, &marked_service_job(steady, 1, None, None))?;
    let pids = wait_for("the neighbour running", Duration::from_secs(30), || {
        let pids = marker_pids(steady);
        Ok((pids.len() == 1).then_some(pids))
    })
    .with_context(|| logs(&server, &[&client]))?;

    server.run_job("exec-oom", &hungry_job("exec-oom", 32, 200))?;
    let alloc = server
        .finished_alloc("exec-oom")
        .with_context(|| logs(&server, &[&client]))?;
    assert_eq!(alloc["client_status"], "failed", "{alloc}");
    let events = alloc["task_states"]["t"]["events"]
        .as_array()
        .context("events")?;
    let stderr = client
        .agent
        .data_path()
        .join("alloc")
        .join(alloc["id"].as_str().context("alloc ID")?)
        .join("alloc/logs/t.stderr.0");
    let oom = events
        .iter()
        .find(|e| e["type"] == "OOM Killed")
        .with_context(|| {
            format!(
                "no OOM Killed event: {events:?}; stderr: {}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            )
        })?;
    assert!(
        oom["message"]
            .as_str()
            .is_some_and(|m| m.contains("memory limit of 32 MiB")),
        "{oom}"
    );
    let shown = server.cli(&["alloc", "status", alloc["id"].as_str().context("alloc ID")?])?;
    assert!(shown.contains("OOM Killed"), "{shown}");

    // The same with room completes.
    server.run_job("exec-roomy", &hungry_job("exec-roomy", 256, 200))?;
    let alloc = server
        .finished_alloc("exec-roomy")
        .with_context(|| logs(&server, &[&client]))?;
    assert_eq!(alloc["client_status"], "complete", "{alloc}");

    // So does one that asks for 32 MiB with room up to 256 (memory_max).
    let oversubscribed = hungry_job("exec-over", 32, 200)
        .replace("memory = 32", "memory = 32\n        memory_max = 256");
    assert!(
        oversubscribed.contains("memory_max = 256"),
        "{oversubscribed}"
    );
    server.run_job("exec-over", &oversubscribed)?;
    let alloc = server
        .finished_alloc("exec-over")
        .with_context(|| logs(&server, &[&client]))?;
    assert_eq!(alloc["client_status"], "complete", "{alloc}");

    // The neighbour ran throughout, and no cgroup of either is left.
    assert_eq!(marker_pids(steady), pids);
    for job in ["exec-oom", "exec-roomy", "exec-over"] {
        for a in server.allocs(job)? {
            let id = a["id"].as_str().context("alloc ID")?;
            let cgroup = memory_hierarchy()
                .join(client.agent.cgroup_parent())
                .join(id);
            assert!(!cgroup.exists(), "{} is left", cgroup.display());
        }
    }
    server.stop_marked_job(steady)?;
    Ok(())
}

/// The CPU time of `pid` and of its children it waited for, in ns.
fn cpu_time_ns(pid: i32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    // utime, stime, cutime and cstime: fields 14 to 17 of proc(5), in
    // clock ticks (counted from the state, field 3, they are 11 to 14).
    let ticks: u64 = fields
        .get(11..15)
        .context("a short stat line")?
        .iter()
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?
        .and_then(|t| u64::try_from(t).ok())
        .unwrap_or(100);
    Ok(ticks * 1_000_000_000 / per_second)
}

/// Where the memory controller's cgroups are: the unified hierarchy (v2)
/// or the memory one (v1).
fn memory_hierarchy() -> std::path::PathBuf {
    let mount = std::path::Path::new("/sys/fs/cgroup");
    if mount.join("cgroup.controllers").exists() {
        mount.to_path_buf()
    } else {
        mount.join("memory")
    }
}

/// A process in a cgroup the test made, killed (and the cgroup removed)
/// when the test ends, failed or not.
struct Stray {
    cgroup: std::path::PathBuf,
    child: std::process::Child,
}

impl Drop for Stray {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.cgroup);
        if let Some(alloc) = self.cgroup.parent() {
            let _ = std::fs::remove_dir(alloc);
        }
    }
}

/// The memory cgroup `pid` is in (v1 or v2 path), as `/proc` says.
fn memory_cgroup_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.contains(":memory:") || l.starts_with("0::"))
        .map(|l| l.rsplit(':').next().unwrap_or_default().to_string())
        .unwrap_or_default()
}

#[test]
fn exec_tasks_keep_their_cgroups_across_an_agent_kill_and_lose_them_when_stopped() -> Result<()> {
    let mut server = Server::start("")?;
    let mut client = Client::start(&server, "x2", false, "")?;
    server
        .wait_nodes_ready(&["x2"])
        .with_context(|| logs(&server, &[&client]))?;
    let job = "exec-reattach";
    let spec = marked_service_job(job, 20, None, None).replace("\"raw_exec\"", "\"exec\"");
    assert!(spec.contains("driver = \"exec\""), "{spec}");
    server.run_job(job, &spec)?;
    let pids = wait_for("twenty exec tasks", Duration::from_secs(60), || {
        let pids = marker_pids(job);
        Ok((pids.len() == 20).then_some(pids))
    })
    .with_context(|| logs(&server, &[&client]))?;
    let parent = format!("/{}/", client.agent.cgroup_parent());
    let cgroups: Vec<String> = pids.iter().map(|p| memory_cgroup_of(*p)).collect();
    assert!(
        cgroups.iter().all(|c| c.starts_with(&parent)),
        "{cgroups:?}"
    );
    let memory = memory_hierarchy();
    let limit_file = if memory.ends_with("memory") {
        "memory.limit_in_bytes"
    } else {
        "memory.max"
    };
    let limit_of = |cgroup: &str| {
        std::fs::read_to_string(memory.join(&cgroup[1..]).join(limit_file)).unwrap_or_default()
    };
    let limits: Vec<String> = cgroups.iter().map(|c| limit_of(c)).collect();
    assert!(
        limits.iter().all(|l| l.trim() == (8u64 << 20).to_string()),
        "{limits:?}"
    );

    // SIGKILL the agent: the tasks run on in their cgroups. A berth cgroup
    // of an alloc the node does not know, left as by a crashed agent
    // whose state was lost, has a process in it.
    client.agent.kill()?;
    let orphan = memory.join(&parent[1..]).join("0rphan-alloc").join("t");
    std::fs::create_dir_all(&orphan)?;
    let mut stray = Stray {
        cgroup: orphan.clone(),
        child: std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec sleep 300",
                orphan.display()
            ))
            .spawn()?,
    };
    wait_for(
        "the stray in the orphan cgroup",
        Duration::from_secs(10),
        || {
            let procs = std::fs::read_to_string(orphan.join("cgroup.procs"))?;
            Ok((!procs.trim().is_empty()).then_some(()))
        },
    )?;

    // Started again, the agent reattaches to its tasks and removes the
    // orphan, with what ran in it.
    client.agent.start_again()?;
    server
        .wait_nodes_ready(&["x2"])
        .with_context(|| logs(&server, &[&client]))?;
    wait_for("the allocs running again", Duration::from_secs(30), || {
        let allocs = server.allocs(job)?;
        Ok(allocs
            .iter()
            .all(|a| a["client_status"] == "running")
            .then_some(()))
    })?;
    assert_eq!(marker_pids(job), pids, "the tasks were started again");
    let after: Vec<String> = pids.iter().map(|p| memory_cgroup_of(*p)).collect();
    assert_eq!(after, cgroups);
    assert_eq!(
        cgroups.iter().map(|c| limit_of(c)).collect::<Vec<_>>(),
        limits
    );
    // And their usage is sampled again: every alloc's stats carry a
    // sample taken after the restart.
    let restarted_ms = berth_structs::now_ms();
    for a in server.allocs(job)? {
        let id = a["id"].as_str().context("alloc ID")?.to_string();
        let mut last = Value::Null;
        wait_for(
            "a sample after the restart",
            Duration::from_secs(15),
            || {
                let stats = client.get(&format!("/v1/client/allocation/{id}/stats"))?;
                let task = &stats["tasks"]["t"];
                let at = task["timestamp_ms"].as_i64().unwrap_or(0);
                let limit = task["resource_usage"]["memory_stats"]["limit"].as_u64();
                let fresh = at >= restarted_ms && limit == Some(8 << 20);
                last = stats;
                Ok(fresh.then_some(()))
            },
        )
        .with_context(|| {
            let log: Vec<String> = client
                .agent
                .log()
                .lines()
                .filter(|l| l.contains(&id[..8]))
                .map(String::from)
                .collect();
            format!(
                "restarted at {restarted_ms}, the last stats: {last}\n{}",
                log.join("\n")
            )
        })?;
    }
    // Still the same tasks, a sample interval on: none lost its way into
    // its root (an agent restart once narrowed the task dir's mode back,
    // and nobody's shell then failed every exec until its cgroup ran out
    // of memory).
    assert_eq!(marker_pids(job), pids, "tasks ended after the restart");
    wait_for("the orphan cgroup removed", Duration::from_secs(30), || {
        Ok((!orphan.exists()).then_some(()))
    })
    .with_context(|| client.agent.log())?;
    let status = wait_for("the stray killed", Duration::from_secs(10), || {
        Ok(stray.child.try_wait()?)
    })?;
    assert!(!status.success(), "{status:?}");

    // Stopped, their cgroups go.
    server.stop_marked_job(job)?;
    for c in &cgroups {
        let alloc = c
            .trim_start_matches(&parent)
            .split('/')
            .next()
            .unwrap_or_default();
        let dir = memory.join(&parent[1..]).join(alloc);
        wait_for(
            &format!("{} removed", dir.display()),
            Duration::from_secs(30),
            || Ok((!dir.exists()).then_some(())),
        )?;
    }
    Ok(())
}

#[test]
fn an_exec_task_sees_its_own_root_and_processes_and_runs_as_nobody() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "x3", false, "")?;
    server
        .wait_nodes_ready(&["x3"])
        .with_context(|| logs(&server, &[&client]))?;
    let data_dir = client.agent.data_path();
    let alloc_root = data_dir.join("alloc");
    // What the task finds out about where it runs, one `key=value` a line.
    let script = format!(
        "echo pid=$$; echo uid=$(id -u); \
         echo procs=$(ls /proc | grep -c '^[0-9]'); \
         echo init=$(tr '\\0' ' ' < /proc/1/cmdline | cut -d' ' -f2-); \
         ls {data} >/dev/null 2>&1 && echo data_dir=seen || echo data_dir=hidden; \
         ls {allocs} >/dev/null 2>&1 && echo allocs=seen || echo allocs=hidden; \
         echo x > /alloc/data/out && echo alloc_data=written; \
         echo x > /local/out && echo local=written; \
         touch /usr/out 2>/dev/null && echo usr=written || echo usr=read-only; \
         echo dir=$BERTH_ALLOC_DIR",
        data = data_dir.display(),
        allocs = alloc_root.display()
    );
    let spec = format!(
        r#"
job "exec-iso" {{
  type = "batch"
  group "g" {{
    task "t" {{
      driver = "exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", {script:?}]
      }}
    }}
  }}
}}
"#
    );
    server.run_job("exec-iso", &spec)?;
    let alloc = server
        .finished_alloc("exec-iso")
        .with_context(|| logs(&server, &[&client]))?;
    let dir = alloc_root.join(alloc["id"].as_str().context("alloc ID")?);
    let out = std::fs::read_to_string(dir.join("alloc/logs/t.stdout.0"))?;
    let err = std::fs::read_to_string(dir.join("alloc/logs/t.stderr.0")).unwrap_or_default();
    assert_eq!(alloc["client_status"], "complete", "{out}\n{err}");
    let fact = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_default()
            .to_string()
    };
    // PID 2 under its init, PID 1 of its own namespace, with no host
    // process in sight.
    assert_eq!(fact("pid"), "2", "{out}");
    assert!(fact("init").trim_end().ends_with("--task-init"), "{out}");
    let procs: usize = fact("procs").parse().context("procs")?;
    assert!(procs <= 5, "{procs} processes seen: {out}");
    assert_eq!(fact("uid"), "65534", "{out}");
    assert_eq!(fact("data_dir"), "hidden", "{out}");
    assert_eq!(fact("allocs"), "hidden", "{out}");
    assert_eq!(fact("alloc_data"), "written", "{out}\n{err}");
    assert_eq!(fact("local"), "written", "{out}\n{err}");
    assert_eq!(fact("usr"), "read-only", "{out}");
    assert_eq!(fact("dir"), "/alloc", "{out}");
    // What it wrote is in its alloc dir on the host; nothing it mounted
    // is left on the host.
    assert!(dir.join("alloc/data/out").is_file());
    assert!(berth_testutil::mounts_under(&dir).is_empty());
    Ok(())
}

#[test]
fn a_raw_exec_job_waits_for_a_client_that_enables_raw_exec() -> Result<()> {
    let mut server = Server::start("")?;
    let http = format!("127.0.0.1:{}", berth_tests::free_port());
    let mut agent = berth_tests::Agent::start_without_raw_exec(&[
        "-client",
        "-servers",
        &server.rpc,
        "-node",
        "r1",
        "-http-addr",
        &http,
    ])?;
    server.wait_nodes_ready(&["r1"])?;
    let nodes = server.get("/v1/nodes")?;
    let id = nodes[0]["id"].as_str().context("node ID")?.to_string();
    let node = server.get(&format!("/v1/node/{id}"))?;
    assert_eq!(node["drivers"], serde_json::json!(["exec"]), "{node}");
    let raw = &node["driver_info"]["raw_exec"];
    assert_eq!(
        (raw["detected"].as_bool(), raw["healthy"].as_bool()),
        (Some(false), Some(false))
    );

    // Not placed, and `job run` says why.
    let job = "raw-off";
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("job.hcl");
    std::fs::write(&file, marked_service_job(job, 1, None, None))?;
    let run = berth_tests::cli_at(
        &server.addr(),
        &["job", "run", file.to_str().context("UTF-8")?],
    )?;
    let text = String::from_utf8_lossy(&run.stdout);
    assert_ne!(run.status.code(), Some(0), "{text}");
    assert!(
        text.contains("driver \"raw_exec\"")
            && text.contains("raw_exec is not enabled on this node"),
        "{text}"
    );
    assert!(marker_pids(job).is_empty());

    // Turned on and restarted, the client runs it.
    agent.stop()?;
    agent.start_again_with_config(berth_tests::RAW_EXEC_ON)?;
    wait_for("the job running on r1", Duration::from_secs(60), || {
        Ok((marker_pids(job).len() == 1).then_some(()))
    })
    .with_context(|| agent.log())?;
    server.stop_marked_job(job)?;
    Ok(())
}

#[test]
fn the_usage_of_an_exec_task_is_sampled_and_shown_in_alloc_status() -> Result<()> {
    let mut server = Server::start("")?;
    let client = Client::start(&server, "x4", false, "")?;
    server
        .wait_nodes_ready(&["x4"])
        .with_context(|| logs(&server, &[&client]))?;
    // 100 MB held in a shell variable, and a core spun.
    let spec = r#"
job "exec-usage" {
  type = "service"
  group "g" {
    task "t" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "x=$(head -c 100000000 /dev/zero | tr '\\0' a); while :; do :; done"]
      }
      resources {
        cpu    = 500
        memory = 400
      }
    }
  }
}
"#;
    server.run_job("exec-usage", spec)?;
    let usage = wait_for("the task's usage", Duration::from_secs(60), || {
        let allocs = server.allocs("exec-usage")?;
        let u = &allocs[0]["task_states"]["t"]["usage"];
        let memory = u["memory_bytes"].as_u64().unwrap_or(0);
        let cpu = u["cpu_millicores"].as_u64().unwrap_or(0);
        Ok((memory >= 95_000_000 && cpu >= 400).then(|| (memory, cpu, allocs[0].clone())))
    })
    .with_context(|| logs(&server, &[&client]))?;
    let (memory, cpu, alloc) = usage;
    assert!(memory < 300 << 20, "{memory} bytes");
    // A rate, not a total: no more than the machine's cores (while the
    // string is built, head, tr and the shell run at once, so a sample
    // may show more than the one core the loop spins afterwards).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    assert!(
        cpu <= cores * 1100,
        "{cpu} millicores on a machine of {cores} cores"
    );
    assert_eq!(
        alloc["task_states"]["t"]["usage"]["memory_limit_bytes"],
        400u64 << 20
    );
    let id = alloc["id"].as_str().context("ID")?;
    let shown = server.cli(&["alloc", "status", id])?;
    assert!(
        shown.contains("cores used of 500 MHz") && shown.contains("used of 400.0 MiB"),
        "{shown}"
    );

    // The stats route answers the latest sample, on the client and
    // through the server: memory within a tenth of the 100 MB the task
    // holds.
    let within_a_tenth = |v: u64, of: u64| v.abs_diff(of) <= of / 10;
    for stats in [
        client.get(&format!("/v1/client/allocation/{id}/stats"))?,
        server.get(&format!("/v1/client/allocation/{}/stats", &id[..8]))?,
    ] {
        let task = &stats["tasks"]["t"]["resource_usage"];
        let memory = task["memory_stats"]["usage"].as_u64().unwrap_or(0);
        assert!(within_a_tenth(memory, 100_000_000), "{stats}");
        assert!(
            task["cpu_stats"]["millicores"].as_u64() > Some(0),
            "{stats}"
        );
        assert_eq!(task["memory_stats"]["limit"], 400u64 << 20, "{stats}");
        assert_eq!(
            stats["resource_usage"]["memory_stats"]["usage"], memory,
            "{stats}"
        );
    }
    // CPU: the CPU time of a sample against the task's own (its shell's
    // and its waited-for children's, from /proc), read the moment a new
    // sample shows, once it has spun two seconds: within a tenth, however
    // busy the machine is.
    let shell = *berth_tests::processes_with_cmdline("head -c 100000000")
        .iter()
        .min()
        .context("the task's shell")?;
    let mut seen_at = 0;
    let (sampled, own) = wait_for("a fresh sample", Duration::from_secs(60), || {
        let stats = client.get(&format!("/v1/client/allocation/{id}/stats"))?;
        let task = &stats["tasks"]["t"];
        let at = task["timestamp_ms"].as_i64().unwrap_or(0);
        let own = cpu_time_ns(shell)?;
        let fresh = seen_at != 0 && at != seen_at;
        seen_at = at;
        let sampled = task["resource_usage"]["cpu_stats"]["total_ns"]
            .as_u64()
            .unwrap_or(0);
        Ok((fresh && sampled >= 2_000_000_000).then_some((sampled, own)))
    })?;
    assert!(
        within_a_tenth(sampled, own),
        "the sample says {sampled} ns of CPU, /proc {own} ns"
    );
    // And the client's metrics carry the task's gauges.
    let metrics = berth_tests::http_at(
        client.http_port,
        "GET /v1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?
    .text();
    let labels = format!("alloc_id=\"{id}\",job=\"exec-usage\",task=\"t\"");
    for family in [
        "berth_client_task_memory_bytes",
        "berth_client_task_cpu_millicores",
    ] {
        assert!(
            metrics.contains(&format!("{family}{{{labels}}}")),
            "{family} of the task:\n{metrics}"
        );
    }
    server.cli(&["job", "stop", "exec-usage"])?;
    wait_for("the spinning task stopped", Duration::from_secs(30), || {
        let allocs = server.allocs("exec-usage")?;
        Ok(allocs
            .iter()
            .all(|a| a["client_status"] == "complete" || a["client_status"] == "failed")
            .then_some(()))
    })?;
    Ok(())
}
