//! `berth alloc logs`: a task's stdout or stderr, written out byte for byte
//! as the task wrote it.
//!
//! It reads `GET /v1/client/fs/logs/{alloc}` page by page, each page
//! starting at the cursor the previous answer gave (`X-Berth-Log-File`,
//! `X-Berth-Log-Offset`). With `-f` it asks the agent to wait for new
//! bytes, rides out an agent that restarts (a refused connection or a 5xx
//! is tried again with backoff, the cursor kept), and ends once the task
//! is dead and everything is read.

use std::io::Write;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use backon::{BlockingRetryable, ExponentialBuilder};
use clap::Args;

use super::{enc, Ctx};
#[cfg(test)]
use berth_api::ApiError;
use berth_api::{ApiClient, RawAnswer};

/// Bytes asked for per answer.
const PAGE: u64 = 1 << 20;
/// How long the agent waits for new bytes before answering with none.
const FOLLOW_WAIT: &str = "30s";
/// How long a follower keeps trying to reach an agent that went away.
const RETRY_FOR: Duration = Duration::from_secs(180);

#[derive(Args, Debug)]
pub struct LogsArgs {
    /// Keep printing the log as the task writes it, until the task is dead
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Print the task's stderr instead of its stdout
    #[arg(long)]
    pub stderr: bool,
    /// Start at the end of the log: its last lines (10, or -n)
    #[arg(long)]
    pub tail: bool,
    /// How many lines -tail prints
    #[arg(short = 'n', value_name = "N", requires = "tail")]
    pub lines: Option<u64>,
    /// The alloc's ID or a unique prefix of it
    #[arg(value_name = "ALLOC")]
    pub alloc: String,
    /// The task (default: the alloc's only task)
    #[arg(value_name = "TASK")]
    pub task: Option<String>,
}

/// Where the next read starts.
enum ReadFrom {
    Start,
    LastLines(u64),
    Cursor { file: u64, offset: u64 },
}

/// What an answer said besides its bytes.
struct Page {
    body: Vec<u8>,
    /// The alloc's full ID and the task, as the agent resolved them.
    alloc: String,
    task: String,
    file: u64,
    offset: u64,
    dead: bool,
    lost: bool,
}

pub fn run(args: LogsArgs, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    let stream = if args.stderr { "stderr" } else { "stdout" };
    let mut alloc = args.alloc.clone();
    let mut task = args.task.clone();
    let mut from = if args.tail {
        ReadFrom::LastLines(args.lines.unwrap_or(10))
    } else {
        ReadFrom::Start
    };
    let mut out = std::io::stdout().lock();
    let mut started = false;
    loop {
        let mut path = format!("/v1/client/fs/logs/{}?type={stream}", enc(&alloc));
        if let Some(t) = &task {
            path.push_str(&format!("&task={}", enc(t)));
        }
        match from {
            ReadFrom::Start => {}
            ReadFrom::LastLines(n) => path.push_str(&format!("&lines={n}")),
            ReadFrom::Cursor { file, offset } => {
                path.push_str(&format!("&file={file}&offset={offset}"))
            }
        }
        path.push_str(&format!("&limit={PAGE}"));
        if args.follow {
            path.push_str(&format!("&wait={FOLLOW_WAIT}"));
        }
        // Once the alloc's log has been read, a follower outlasts the
        // agent's restarts; an agent or alloc that is not there at all is
        // said at once.
        let page = if args.follow && started {
            fetch_retrying(api, &path)?
        } else {
            fetch(api, &path)?
        };
        started = true;
        if page.lost {
            eprintln!(
                "Warning: some of the log of task {:?} was rotated away before it was read; going on with the oldest there is",
                page.task
            );
        }
        match out.write_all(&page.body).and_then(|()| out.flush()) {
            Ok(()) => {}
            // The reader went away (`| head`): nothing left to do.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(0),
            Err(e) => return Err(e).context("writing the log to stdout"),
        }
        alloc = page.alloc;
        task = Some(page.task);
        from = ReadFrom::Cursor {
            file: page.file,
            offset: page.offset,
        };
        let done = if args.follow {
            page.body.is_empty() && page.dead
        } else {
            // A page that is not full reached the end there was.
            (page.body.len() as u64) < PAGE
        };
        if done {
            return Ok(0);
        }
    }
}

fn fetch(api: &ApiClient, path: &str) -> Result<Page> {
    page_of(api.get_bytes(path)?)
}

/// [`fetch`], trying again while the agent is away or failing (a restart):
/// with backoff, for up to [`RETRY_FOR`], with a note on stderr.
fn fetch_retrying(api: &ApiClient, path: &str) -> Result<Page> {
    let mut noted = false;
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(3))
        .with_jitter()
        .without_max_times()
        .with_total_delay(Some(RETRY_FOR));
    (|| fetch(api, path))
        .retry(backoff)
        .sleep(std::thread::sleep)
        .when(worth_retrying)
        .notify(|e, _| {
            if !std::mem::replace(&mut noted, true) {
                eprintln!("Note: {}; trying again", super::errors::one_line(e));
            }
        })
        .call()
}

/// Whether a failed read may work when tried again: the agent did not
/// answer, or answered with a 5xx (it is starting, or its client role
/// is). An answer that names a problem (404, 400) is final.
fn worth_retrying(e: &anyhow::Error) -> bool {
    match super::errors::api_answer(e) {
        Some(api) => api.status >= 500,
        None => true,
    }
}

fn page_of(answer: RawAnswer) -> Result<Page> {
    let header = |name: &str| -> Result<String> {
        answer
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| anyhow!("the agent's answer has no {name} header"))
    };
    let number = |name: &str| -> Result<u64> {
        header(name)?
            .parse()
            .map_err(|e| anyhow!("the agent's {name} header is not a number: {e}"))
    };
    Ok(Page {
        alloc: header("x-berth-log-alloc")?,
        task: header("x-berth-log-task")?,
        file: number("x-berth-log-file")?,
        offset: number("x-berth-log-offset")?,
        dead: header("x-berth-log-task-state")? == "dead",
        lost: answer.headers.contains_key("x-berth-log-lost"),
        body: answer.body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_agent_away_or_failing_is_tried_again() {
        let api = |status| {
            anyhow::Error::from(berth_api::Error::Api(ApiError {
                status,
                message: "x".into(),
            }))
        };
        assert!(worth_retrying(&api(503)));
        assert!(worth_retrying(&api(500)));
        assert!(!worth_retrying(&api(404)));
        assert!(!worth_retrying(&api(400)));
        assert!(worth_retrying(&anyhow!(
            "no berth agent answers at http://127.0.0.1:1 (connection refused)"
        )));
    }
}
