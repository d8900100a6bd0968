//! A job file far over the API's body limit, against a real dev agent: the
//! CLI refuses it by its size before reading it, says the size and the
//! limit on one line, exits 1, and stays small. (It once read it whole,
//! grew to ~400 MB and failed with `Broken pipe`.)
//!
//! The only test in its binary: it reads the peak memory of the children
//! this process has waited for.

use std::io::Write;

use anyhow::Result;
use berth_tests::DevAgent;

/// The largest resident set of any child waited for so far, in KiB.
// getrusage has no safe wrapper in the crates the tests use.
#[allow(unsafe_code)]
fn children_peak_rss_kib() -> i64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    assert_eq!(rc, 0, "getrusage: {}", std::io::Error::last_os_error());
    usage.ru_maxrss
}

#[test]
fn a_50_mib_job_file_gets_the_size_error_not_a_broken_pipe() -> Result<()> {
    let agent = DevAgent::start()?;
    // A valid job whose one argument is 50 MiB: read and encoded, it would
    // make a request body of that size.
    let path = agent.data_dir.path().join("big.hcl");
    let head = "job \"big\" {\n  group \"g\" {\n    task \"t\" {\n      driver = \"raw_exec\"\n      config {\n        command = \"/bin/true\"\n        args    = [\"";
    let tail = "\"]\n      }\n    }\n  }\n}\n";
    let size: usize = 50 * 1024 * 1024;
    // Written in pieces: a child's peak memory counts its parent's (ours)
    // from before its exec, so this process stays small too.
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
    file.write_all(head.as_bytes())?;
    let chunk = vec![b'x'; 1024 * 1024];
    let mut left = size - head.len() - tail.len();
    while left > 0 {
        let n = left.min(chunk.len());
        file.write_all(&chunk[..n])?;
        left -= n;
    }
    file.write_all(tail.as_bytes())?;
    file.into_inner()?.sync_all()?;
    assert_eq!(std::fs::metadata(&path)?.len(), size as u64);
    let path = path.display().to_string();

    let out = agent.cli(&["job", "run", &path])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim_end(),
        format!("Error: job file {path} is 50 MiB; the limit is 2 MiB")
    );
    assert!(!err.contains("Broken pipe"), "{err}");
    // The agent is still running, so every child waited for so far is a
    // CLI: none came near the file's size.
    let peak = children_peak_rss_kib();
    assert!(
        peak < 40 * 1024,
        "a CLI grew to {peak} KiB for a file it should not have read"
    );
    // Nothing reached the servers.
    let jobs = agent.cli_json(&["job", "status"])?;
    assert_eq!(jobs, serde_json::json!([]));
    Ok(())
}
