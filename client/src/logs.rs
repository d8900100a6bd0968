//! Reading a task's log files for `GET /v1/client/fs/logs/{alloc_id}`.
//!
//! The executor writes each stream of a task into `<task>.<stream>.N`
//! files that rotate (see [`berth_allocrunner::logs`]). A reader names a
//! place in them with a cursor, [`LogPosition`] (file index, byte offset
//! in that file), and gets back the bytes from there and the cursor after
//! them. A cursor whose file was deleted by rotation reads on from the
//! oldest file there is and says that bytes were lost.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_allocrunner::logs::{log_base, log_file_path, log_files, LogFile, LogStream};
use berth_allocrunner::AllocRunner;
use berth_structs::TaskStateKind;
use serde::Deserialize;

use super::Client;

/// Bytes per answer unless the reader asks for fewer or more.
pub const DEFAULT_LIMIT: u64 = 1 << 20;
/// The most bytes one answer carries.
pub const MAX_LIMIT: u64 = 8 << 20;
/// The longest a reader may wait for new bytes.
pub const MAX_WAIT: Duration = Duration::from_secs(300);
/// How often a waiting reader looks for new bytes.
const WAIT_POLL: Duration = Duration::from_millis(100);
/// What is read at once when looking back for lines.
const BACK_BLOCK: u64 = 64 * 1024;

/// A place in a stream's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPosition {
    /// The file's index (`<task>.<stream>.<file>`).
    pub file: u64,
    /// Bytes into that file.
    pub offset: u64,
}

/// Where a read starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogStart {
    /// A cursor from an earlier answer.
    Cursor(LogPosition),
    /// This many bytes after the oldest byte there is.
    FromStart(u64),
    /// This many bytes before the newest byte.
    FromEnd(u64),
    /// The start of the last this many lines.
    LastLines(u64),
}

/// Bytes read and the cursor after them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRead {
    pub data: Vec<u8>,
    pub next: LogPosition,
    /// The cursor's file had already been deleted by rotation: the bytes
    /// start at the oldest file there is.
    pub lost: bool,
}

/// Reads at most `limit` bytes of the files of `base` in `dir` from
/// `start`, across files.
pub fn read_logs(dir: &Path, base: &str, start: LogStart, limit: u64) -> std::io::Result<LogRead> {
    // A follower's reads (and each look of a waiting read) go by name,
    // without listing the directory, whatever else it holds.
    if let LogStart::Cursor(at) = start {
        if let Some(read) = read_from_cursor(dir, base, at, limit)? {
            return Ok(read);
        }
    }
    // A file may be deleted by rotation between the listing and the
    // read: list again, and the cursor then reads as lost.
    let mut tries = 0;
    loop {
        let files = log_files(dir, base)?;
        match read_listed(&files, start, limit) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 10 => tries += 1,
            other => return other,
        }
    }
}

/// Reads from `at` by the files' names: `at`'s file, then the next index
/// while there is one (the writer makes them one after the other). `None`
/// when `at`'s file is not there (deleted by rotation, or not made yet):
/// only a listing tells where to go on from.
fn read_from_cursor(
    dir: &Path,
    base: &str,
    at: LogPosition,
    limit: u64,
) -> std::io::Result<Option<LogRead>> {
    let open = |index| match std::fs::File::open(log_file_path(dir, base, index)) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    };
    let Some(mut file) = open(at.file)? else {
        return Ok(None);
    };
    let LogPosition {
        file: mut index,
        mut offset,
    } = at;
    let mut data = Vec::new();
    let read_on = |file: &mut std::fs::File, offset: &mut u64, data: &mut Vec<u8>| {
        file.seek(SeekFrom::Start(*offset))?;
        let want = limit - data.len() as u64;
        *offset += file.take(want).read_to_end(data)? as u64;
        std::io::Result::Ok(data.len() as u64 >= limit)
    };
    loop {
        if read_on(&mut file, &mut offset, &mut data)? {
            break;
        }
        let Some(next) = index.checked_add(1).map(open).transpose()?.flatten() else {
            break;
        };
        // The next file exists, so this one was complete before it was
        // made: read what was written to it since the look above.
        if read_on(&mut file, &mut offset, &mut data)? {
            break;
        }
        file = next;
        index += 1;
        offset = 0;
    }
    Ok(Some(LogRead {
        data,
        next: LogPosition {
            file: index,
            offset,
        },
        lost: false,
    }))
}

fn read_listed(files: &[LogFile], start: LogStart, limit: u64) -> std::io::Result<LogRead> {
    let Some(last) = files.last() else {
        let next = match start {
            LogStart::Cursor(p) => p,
            _ => LogPosition { file: 0, offset: 0 },
        };
        return Ok(LogRead {
            data: Vec::new(),
            next,
            lost: false,
        });
    };
    let mut lost = false;
    let (mut i, mut offset) = match start {
        LogStart::Cursor(p) => match files.iter().position(|f| f.index >= p.file) {
            Some(i) if files[i].index == p.file => (i, p.offset),
            Some(i) => {
                lost = true;
                (i, 0)
            }
            // Past the newest file: nothing there yet.
            None => {
                return Ok(LogRead {
                    data: Vec::new(),
                    next: p,
                    lost: false,
                })
            }
        },
        LogStart::FromStart(mut skip) => {
            let mut at = (files.len() - 1, last.len);
            for (i, f) in files.iter().enumerate() {
                if skip < f.len {
                    at = (i, skip);
                    break;
                }
                skip -= f.len;
            }
            at
        }
        LogStart::FromEnd(mut back) => {
            let mut at = (0, 0);
            for (i, f) in files.iter().enumerate().rev() {
                if back <= f.len {
                    at = (i, f.len - back);
                    break;
                }
                back -= f.len;
            }
            at
        }
        LogStart::LastLines(n) => last_lines_start(files, n)?,
    };
    let mut data = Vec::new();
    loop {
        let want = limit - data.len() as u64;
        let mut file = std::fs::File::open(&files[i].path)?;
        file.seek(SeekFrom::Start(offset))?;
        let n = file.take(want).read_to_end(&mut data)? as u64;
        offset += n;
        if data.len() as u64 >= limit || i + 1 == files.len() {
            break;
        }
        // This file is complete once a newer one exists: go on in the
        // next one.
        i += 1;
        offset = 0;
    }
    Ok(LogRead {
        data,
        next: LogPosition {
            file: files[i].index,
            offset,
        },
        lost,
    })
}

/// Where the last `n` lines start: after the `n`th newline from the end,
/// not counting one that ends the last line.
fn last_lines_start(files: &[LogFile], n: u64) -> std::io::Result<(usize, u64)> {
    let last = files.len() - 1;
    if n == 0 {
        return Ok((last, std::fs::metadata(&files[last].path)?.len()));
    }
    let mut found = 0;
    let mut first_byte = true;
    let mut buf = Vec::new();
    for (i, f) in files.iter().enumerate().rev() {
        let mut file = std::fs::File::open(&f.path)?;
        let mut end = file.metadata()?.len();
        while end > 0 {
            let start = end.saturating_sub(BACK_BLOCK);
            buf.clear();
            file.seek(SeekFrom::Start(start))?;
            (&mut file).take(end - start).read_to_end(&mut buf)?;
            for (j, &b) in buf.iter().enumerate().rev() {
                if std::mem::take(&mut first_byte) && b == b'\n' {
                    continue;
                }
                if b == b'\n' {
                    found += 1;
                    if found == n {
                        return Ok((i, start + j as u64 + 1));
                    }
                }
            }
            end = start;
        }
    }
    Ok((0, 0))
}

/// The query of `GET /v1/client/fs/logs/{alloc_id}`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LogsQuery {
    /// Optional when the alloc has one task.
    pub task: Option<String>,
    /// `stdout` (the default) or `stderr`.
    #[serde(rename = "type")]
    pub stream: Option<String>,
    /// `start` (the default) or `end`: where `offset` counts from.
    pub origin: Option<String>,
    pub offset: Option<u64>,
    /// With `offset`: a cursor from an earlier answer.
    pub file: Option<u64>,
    /// The last this many lines.
    pub lines: Option<u64>,
    /// At most this many bytes (default 1 MiB, at most 8 MiB).
    pub limit: Option<u64>,
    /// When there is nothing new, wait this long for it ("30s").
    pub wait: Option<String>,
}

/// What a read asks for, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogsRequest {
    pub task: Option<String>,
    pub stream: LogStream,
    pub start: LogStart,
    pub limit: u64,
    pub wait: Duration,
}

impl LogsQuery {
    /// The request this query makes, or why it makes none.
    pub fn request(&self) -> Result<LogsRequest, LogsError> {
        let bad = |m: String| Err(LogsError::BadRequest(m));
        let stream = match self.stream.as_deref() {
            None => LogStream::Stdout,
            Some(s) => match s.parse() {
                Ok(s) => s,
                Err(e) => return bad(e),
            },
        };
        let from_end = match self.origin.as_deref() {
            None | Some("start") => false,
            Some("end") => true,
            Some(other) => return bad(format!("unknown origin {other:?} (want start or end)")),
        };
        let start = match (self.file, self.lines) {
            (Some(_), Some(_)) => {
                return bad("file (a cursor) and lines cannot be used together".into())
            }
            (Some(_), None) if self.origin.is_some() => {
                return bad("file (a cursor) and origin cannot be used together".into())
            }
            (Some(file), None) => LogStart::Cursor(LogPosition {
                file,
                offset: self.offset.unwrap_or(0),
            }),
            (None, Some(_)) if self.offset.is_some() => {
                return bad("lines and offset cannot be used together".into())
            }
            (None, Some(_)) if self.origin.as_deref() == Some("start") => {
                return bad("lines counts from the end: origin=start cannot be used with it".into())
            }
            (None, Some(n)) => LogStart::LastLines(n),
            (None, None) if from_end => LogStart::FromEnd(self.offset.unwrap_or(0)),
            (None, None) => LogStart::FromStart(self.offset.unwrap_or(0)),
        };
        let limit = match self.limit {
            None => DEFAULT_LIMIT,
            Some(0) => return bad("limit must be at least 1 (byte)".into()),
            Some(l) if l > MAX_LIMIT => {
                return bad(format!(
                    "limit {l} is too large (at most {MAX_LIMIT} bytes, 8 MiB)"
                ))
            }
            Some(l) => l,
        };
        let wait = match self.wait.as_deref() {
            None => Duration::ZERO,
            Some(w) => match humantime::parse_duration(w) {
                Ok(d) if d > MAX_WAIT => {
                    return bad(format!(
                        "wait {w:?} is too long (at most {})",
                        humantime::format_duration(MAX_WAIT)
                    ))
                }
                Ok(d) => d,
                Err(e) => return bad(format!("invalid wait {w:?}: {e}")),
            },
        };
        Ok(LogsRequest {
            task: self.task.clone(),
            stream,
            start,
            limit,
            wait,
        })
    }
}

/// Why a log read has no answer.
#[derive(Debug, thiserror::Error)]
pub enum LogsError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    /// Not now: the client is starting.
    #[error("{0}")]
    Unavailable(String),
    #[error("reading the task's logs: {0}")]
    Io(#[from] std::io::Error),
}

/// The answer to a log read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogAnswer {
    pub alloc_id: String,
    pub task: String,
    pub read: LogRead,
    /// The task's state when the read began: once it is `dead` and a read
    /// brings no bytes, everything has been read.
    pub task_state: TaskStateKind,
}

/// One task's log files, and how to tell whether it still runs.
struct LogSource {
    runner: AllocRunner,
    alloc_id: String,
    task: String,
    dir: PathBuf,
    base: String,
}

impl LogSource {
    fn task_state(&self) -> TaskStateKind {
        match self.runner.task_state_kind(&self.task) {
            Some(s) => s,
            None if self.runner.is_done() => TaskStateKind::Dead,
            None => TaskStateKind::Pending,
        }
    }

    async fn read(&self, start: LogStart, limit: u64) -> Result<LogRead, LogsError> {
        let (dir, base) = (self.dir.clone(), self.base.clone());
        tokio::task::spawn_blocking(move || read_logs(&dir, &base, start, limit))
            .await
            .map_err(|e| LogsError::Io(std::io::Error::other(e)))?
            .map_err(LogsError::Io)
    }
}

impl Client {
    /// Reads a task's logs: `id` is an alloc ID or a prefix of one that
    /// only one alloc of this node has. With a wait, an answer with no
    /// bytes comes only once the wait has passed, the task is dead or the
    /// client stops (the agent's shutdown is not held up by followers).
    pub async fn read_task_logs(
        &self,
        id: &str,
        req: &LogsRequest,
    ) -> Result<LogAnswer, LogsError> {
        let source = self.log_source(id, req.task.as_deref(), req.stream).await?;
        let deadline = tokio::time::Instant::now() + req.wait;
        let mut shutdown = self.shutdown.clone();
        let mut start = req.start;
        loop {
            // The state first: a dead task has written everything, so a
            // read after seeing it dead that brings nothing is the end.
            let task_state = source.task_state();
            let read = source.read(start, req.limit).await?;
            if !read.data.is_empty()
                || read.lost
                || task_state == TaskStateKind::Dead
                || tokio::time::Instant::now() >= deadline
                || shutdown.is_shutdown()
            {
                return Ok(LogAnswer {
                    alloc_id: source.alloc_id.clone(),
                    task: source.task.clone(),
                    read,
                    task_state,
                });
            }
            // Nothing yet: wait on the cursor this read settled on (a
            // position given from the start or the end is fixed now).
            start = LogStart::Cursor(read.next);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            tokio::select! {
                _ = tokio::time::sleep(WAIT_POLL.min(left)) => {}
                _ = shutdown.wait_requested() => {}
            }
        }
    }

    async fn log_source(
        &self,
        id: &str,
        task: Option<&str>,
        stream: LogStream,
    ) -> Result<LogSource, LogsError> {
        if id.is_empty() {
            return Err(LogsError::BadRequest("an alloc ID is required".into()));
        }
        let runner = match self.alloc_runner(id).await {
            Ok(r) => r,
            // Right after a restart the allocs are not all picked up yet.
            Err(none) if none.is_empty() && !*self.ready.borrow() => {
                return Err(LogsError::Unavailable(format!(
                    "alloc {id:?} is not known here yet: the client is still restoring its allocs"
                )))
            }
            Err(none) if none.is_empty() => {
                return Err(LogsError::NotFound(format!(
                    "alloc {id:?} does not run on this client"
                )))
            }
            Err(many) => {
                return Err(LogsError::BadRequest(format!(
                    "alloc ID prefix {id:?} matches {} allocs: {}",
                    many.len(),
                    many.iter()
                        .map(|m| format!("{m:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        };
        let alloc = runner.alloc();
        let tasks: Vec<String> = alloc
            .job
            .lookup_group(&alloc.task_group)
            .map(|g| g.tasks.iter().map(|t| t.name.clone()).collect())
            .unwrap_or_default();
        let task = match (task, tasks.as_slice()) {
            (Some(t), _) if tasks.iter().any(|n| n == t) => t.to_string(),
            (Some(t), _) => {
                return Err(LogsError::NotFound(format!(
                    "alloc {} has no task {t:?} (its tasks: {})",
                    alloc.id,
                    tasks.join(", ")
                )))
            }
            (None, [one]) => one.clone(),
            (None, _) => {
                return Err(LogsError::BadRequest(format!(
                    "alloc {} has {} tasks ({}): name one with task=",
                    alloc.id,
                    tasks.len(),
                    tasks.join(", ")
                )))
            }
        };
        Ok(LogSource {
            alloc_id: alloc.id.clone(),
            dir: runner.alloc_dir().logs_dir(),
            base: log_base(&task, stream),
            task,
            runner,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `files` as `t.stdout.<index>`.
    fn dir_with(files: &[(u64, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (i, text) in files {
            std::fs::write(dir.path().join(format!("t.stdout.{i}")), text).unwrap();
        }
        dir
    }

    fn read(dir: &Path, start: LogStart, limit: u64) -> LogRead {
        read_logs(dir, "t.stdout", start, limit).unwrap()
    }

    fn text(r: &LogRead) -> &str {
        std::str::from_utf8(&r.data).unwrap()
    }

    fn at(file: u64, offset: u64) -> LogPosition {
        LogPosition { file, offset }
    }

    #[test]
    fn a_cursor_reads_across_files_and_ends_where_the_bytes_end() {
        let dir = dir_with(&[(3, "aaa\n"), (4, "bbb\n"), (5, "cc")]);
        let r = read(dir.path(), LogStart::FromStart(0), 1 << 20);
        assert_eq!(text(&r), "aaa\nbbb\ncc");
        assert_eq!(r.next, at(5, 2));
        assert!(!r.lost);

        // Page by page, each answer's cursor starts the next.
        let mut got = String::new();
        let mut start = LogStart::FromStart(0);
        loop {
            let r = read(dir.path(), start, 3);
            if r.data.is_empty() {
                break;
            }
            assert!(r.data.len() <= 3);
            got.push_str(text(&r));
            start = LogStart::Cursor(r.next);
        }
        assert_eq!(got, "aaa\nbbb\ncc");

        // New bytes and a new file after the cursor are picked up.
        std::fs::write(dir.path().join("t.stdout.5"), "cc\n").unwrap();
        std::fs::write(dir.path().join("t.stdout.6"), "dd\n").unwrap();
        let r = read(dir.path(), LogStart::Cursor(at(5, 2)), 1 << 20);
        assert_eq!(text(&r), "\ndd\n");
        assert_eq!(r.next, at(6, 3));
        // A cursor at the end of a file that has a newer one moves on.
        let r = read(dir.path(), LogStart::Cursor(at(4, 4)), 1 << 20);
        assert_eq!(text(&r), "cc\ndd\n");
    }

    #[test]
    fn a_cursor_on_a_deleted_file_reads_on_from_the_oldest_and_says_lost() {
        let dir = dir_with(&[(7, "new\n"), (8, "newer\n")]);
        let r = read(dir.path(), LogStart::Cursor(at(5, 10)), 1 << 20);
        assert!(r.lost);
        assert_eq!(text(&r), "new\nnewer\n");
        assert_eq!(r.next, at(8, 6));
        // A cursor past the newest file waits there.
        let r = read(dir.path(), LogStart::Cursor(at(9, 0)), 1 << 20);
        assert!(!r.lost && r.data.is_empty());
        assert_eq!(r.next, at(9, 0));
    }

    #[test]
    fn a_cursor_goes_by_file_names_and_never_lists_the_directory() {
        // The writer makes files one index after the other; a cursor
        // follows the names, so a file past a gap (never written by
        // berth) is not reached, and what else the directory holds costs
        // a follower nothing.
        let dir = dir_with(&[(5, "five\n"), (6, "six\n"), (9, "nine\n")]);
        let r = read(dir.path(), LogStart::Cursor(at(5, 2)), 1 << 20);
        assert_eq!(text(&r), "ve\nsix\n");
        assert_eq!(r.next, at(6, 4));
        assert!(!r.lost);
        // The limit stops it inside a file, the cursor there.
        let r = read(dir.path(), LogStart::Cursor(at(5, 0)), 7);
        assert_eq!(text(&r), "five\nsi");
        assert_eq!(r.next, at(6, 2));
        // A cursor whose file is gone still reads on from the oldest.
        std::fs::remove_file(dir.path().join("t.stdout.5")).unwrap();
        let r = read(dir.path(), LogStart::Cursor(at(5, 2)), 1 << 20);
        assert!(r.lost);
        assert_eq!(text(&r), "six\nnine\n");
        // The highest index there can be has no next file.
        std::fs::write(dir.path().join(format!("t.stdout.{}", u64::MAX)), "max\n").unwrap();
        let r = read(dir.path(), LogStart::Cursor(at(u64::MAX, 1)), 1 << 20);
        assert_eq!(text(&r), "ax\n");
        assert_eq!(r.next, at(u64::MAX, 4));
    }

    #[test]
    fn offsets_count_from_the_start_or_the_end_across_files() {
        let dir = dir_with(&[(0, "0123"), (1, "4567"), (2, "89")]);
        assert_eq!(
            text(&read(dir.path(), LogStart::FromStart(5), 100)),
            "56789"
        );
        assert_eq!(
            text(&read(dir.path(), LogStart::FromStart(4), 100)),
            "456789"
        );
        assert_eq!(text(&read(dir.path(), LogStart::FromStart(99), 100)), "");
        assert_eq!(text(&read(dir.path(), LogStart::FromEnd(3), 100)), "789");
        assert_eq!(text(&read(dir.path(), LogStart::FromEnd(0), 100)), "");
        assert_eq!(
            text(&read(dir.path(), LogStart::FromEnd(99), 100)),
            "0123456789"
        );
    }

    #[test]
    fn the_last_lines_are_found_across_file_boundaries() {
        let dir = dir_with(&[(0, "l1\nl2\nl"), (1, "3\nl4\n"), (2, ""), (3, "l5\nl6\n")]);
        let lines = |n| read(dir.path(), LogStart::LastLines(n), 100);
        assert_eq!(text(&lines(0)), "");
        assert_eq!(text(&lines(1)), "l6\n");
        assert_eq!(text(&lines(2)), "l5\nl6\n");
        assert_eq!(text(&lines(3)), "l4\nl5\nl6\n");
        assert_eq!(text(&lines(4)), "l3\nl4\nl5\nl6\n");
        assert_eq!(text(&lines(6)), "l1\nl2\nl3\nl4\nl5\nl6\n");
        assert_eq!(text(&lines(60)), "l1\nl2\nl3\nl4\nl5\nl6\n");
        // A last line without its newline counts as a line.
        std::fs::write(dir.path().join("t.stdout.4"), "l7").unwrap();
        assert_eq!(text(&lines(2)), "l6\nl7");
    }

    #[test]
    fn the_last_lines_of_a_file_larger_than_a_block() {
        let body: String = (0..20_000).map(|i| format!("{i:08}\n")).collect();
        let dir = dir_with(&[(0, &body)]);
        let r = read(dir.path(), LogStart::LastLines(3), 1 << 20);
        assert_eq!(text(&r), "00019997\n00019998\n00019999\n");
    }

    #[test]
    fn no_files_yet_is_an_empty_answer() {
        let dir = tempfile::tempdir().unwrap();
        let r = read(dir.path(), LogStart::LastLines(5), 100);
        assert!(r.data.is_empty() && !r.lost);
        assert_eq!(r.next, at(0, 0));
    }

    fn query(pairs: &str) -> Result<LogsRequest, String> {
        let q: LogsQuery = serde_urlencoded_like(pairs);
        q.request().map_err(|e| e.to_string())
    }

    /// The query as axum's `Query` decodes it.
    fn serde_urlencoded_like(pairs: &str) -> LogsQuery {
        let uri: axum::http::Uri = format!("/x?{pairs}").parse().unwrap();
        axum::extract::Query::<LogsQuery>::try_from_uri(&uri)
            .unwrap()
            .0
    }

    #[test]
    fn queries_are_checked() {
        let r = query("").unwrap();
        assert_eq!(r.stream, LogStream::Stdout);
        assert_eq!(r.start, LogStart::FromStart(0));
        assert_eq!(r.limit, DEFAULT_LIMIT);
        assert_eq!(r.wait, Duration::ZERO);
        let r = query("task=web&type=stderr&file=3&offset=9&limit=10&wait=30s").unwrap();
        assert_eq!(r.task.as_deref(), Some("web"));
        assert_eq!(r.stream, LogStream::Stderr);
        assert_eq!(r.start, LogStart::Cursor(at(3, 9)));
        assert_eq!(r.wait, Duration::from_secs(30));
        assert_eq!(
            query("origin=end&offset=5").unwrap().start,
            LogStart::FromEnd(5)
        );
        assert_eq!(query("lines=5").unwrap().start, LogStart::LastLines(5));
        assert_eq!(
            query("lines=5&origin=end").unwrap().start,
            LogStart::LastLines(5)
        );
        for (q, wanted) in [
            ("type=stdin", "unknown log type \"stdin\""),
            ("origin=middle", "unknown origin \"middle\""),
            ("file=1&lines=2", "file (a cursor) and lines"),
            ("file=1&origin=end", "file (a cursor) and origin"),
            ("lines=2&offset=1", "lines and offset"),
            ("lines=2&origin=start", "origin=start"),
            ("limit=0", "limit must be at least 1"),
            ("limit=8388609", "limit 8388609 is too large"),
            ("wait=forever", "invalid wait \"forever\""),
            ("wait=1h", "wait \"1h\" is too long"),
        ] {
            let e = query(q).unwrap_err();
            assert!(e.contains(wanted), "{q}: {e}");
        }
    }
}
