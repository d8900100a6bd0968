//! Blocking queries on the client's own routes: `GET /v1/client/allocations`
//! and `GET /v1/client/allocation/{id}` answer `X-Berth-Index`; with
//! `?index=N&wait=D` they wait for a change of the client's allocs past
//! `N`, and answer after `wait` when none comes.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::{http_at, sleeping_service_job, wait_for, DevAgent};
use serde_json::Value;

/// GETs `path` from the agent; its status, `X-Berth-Index` and body.
fn get(port: u16, path: &str) -> Result<(u16, u64, Value)> {
    let answer = http_at(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )?;
    let index = answer
        .header("x-berth-index")
        .with_context(|| format!("GET {path}: no X-Berth-Index in {}", answer.head))?
        .parse()?;
    Ok((answer.status, index, serde_json::from_slice(&answer.body)?))
}

#[test]
fn a_blocked_client_read_wakes_on_a_task_change_and_times_out_without_one() -> Result<()> {
    let agent = DevAgent::start()?;
    let port: u16 = agent
        .http_addr
        .rsplit(':')
        .next()
        .context("the agent's port")?
        .parse()?;
    let file = agent.write_file("sleepy.hcl", &sleeping_service_job("sleepy", 1, 1))?;
    agent.cli_ok(&["job", "run", "-detach", &file])?;
    let alloc = wait_for(
        "the alloc running on the client",
        Duration::from_secs(60),
        || {
            let (_, _, allocs) = get(port, "/v1/client/allocations")?;
            Ok(allocs.as_array().into_iter().flatten().find_map(|a| {
                (a["task_states"]["sleep"]["state"] == "running")
                    .then(|| a["id"].as_str().unwrap_or_default().to_string())
            }))
        },
    )
    .with_context(|| agent.log())?;
    let one = format!("/v1/client/allocation/{alloc}");

    // Nothing changes: the read answers after its wait, at the same index.
    // The servers' answer to the client's "running" report still comes
    // back to the client after the task shows running, and is a change of
    // its view: a read that it wakes answers at a later index and is
    // asked again from there, until one sees no change.
    let (status, mut index, _) = get(port, &one)?;
    assert_eq!(status, 200);
    assert!(index > 0);
    let quiet_by = Instant::now() + Duration::from_secs(60);
    loop {
        let started = Instant::now();
        let (status, after, view) = get(port, &format!("{one}?index={index}&wait=2s"))?;
        let took = started.elapsed();
        assert_eq!(status, 200, "{view}");
        assert!(took < Duration::from_secs(10), "answered after {took:?}");
        if after == index {
            assert!(
                took >= Duration::from_millis(1900),
                "answered after {took:?} at the same index {index}: {view}"
            );
            break;
        }
        assert!(after > index, "index {after} after {index}: {view}");
        assert!(
            Instant::now() < quiet_by,
            "the client's view of its allocs kept changing for 60 s: {view}\n{}",
            agent.log()
        );
        eprintln!("the client's view changed from index {index} to {after} after {took:?}");
        index = after;
    }

    // A restart of the task wakes both reads blocked at that index.
    let list = std::thread::spawn(move || {
        let started = Instant::now();
        get(
            port,
            &format!("/v1/client/allocations?index={index}&wait=25s"),
        )
        .map(|answer| (answer, started.elapsed()))
    });
    let single = {
        let one = one.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            get(port, &format!("{one}?index={index}&wait=25s"))
                .map(|answer| (answer, started.elapsed()))
        })
    };
    // Both reads are blocked before the change comes.
    std::thread::sleep(Duration::from_millis(500));
    agent.cli_ok(&["alloc", "restart", &alloc])?;
    for (what, joined) in [("list", list.join()), ("alloc", single.join())] {
        let ((status, woke_at, body), took) = joined.expect("the read's thread")?;
        assert_eq!(status, 200, "{what}: {body}");
        assert!(woke_at > index, "{what}: index {woke_at} after {index}");
        assert!(
            took < Duration::from_secs(20),
            "the {what} read waited {took:?} although the task restarted"
        );
    }

    // A bad wait is a 400 naming it.
    let answer = http_at(
        port,
        &format!(
            "GET {one}?index=1&wait=soon HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        ),
    )?;
    assert_eq!(answer.status, 400, "{}", answer.head);
    assert!(
        String::from_utf8_lossy(&answer.body).contains("wait=\\\"soon\\\""),
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    Ok(())
}
