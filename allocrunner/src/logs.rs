//! A task's log files: `<logs_dir>/<task>.stdout.N` and `<task>.stderr.N`,
//! Nomad's naming. The index grows; a file is closed once it reaches the
//! size limit and the next one opened, and only the newest `max_files` are
//! kept. The executor writes them ([`RotatingWriter`]); the agent reads
//! them ([`log_files`]).
//!
//! The concatenation of the files in index order is exactly what the task
//! wrote (less what was dropped on a full disk, which a marker line
//! reports). Files are cut after a newline where one falls in the part
//! that still fits, so lines stay whole where they can; a line longer
//! than a file is split.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How a task's log files rotate, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRotation {
    /// At least 1.
    pub max_files: u32,
    /// Bytes; at least 1.
    pub max_file_size: u64,
}

impl Default for LogRotation {
    fn default() -> Self {
        LogRotation::from(&berth_structs::LogConfig::default())
    }
}

impl From<&berth_structs::LogConfig> for LogRotation {
    fn from(c: &berth_structs::LogConfig) -> Self {
        LogRotation {
            max_files: c.max_files.max(1),
            max_file_size: c.max_file_size_bytes().max(1),
        }
    }
}

/// `stdout` or `stderr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogStream {
    Stdout,
    Stderr,
}

impl LogStream {
    pub fn as_str(&self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

impl std::str::FromStr for LogStream {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "stdout" => Ok(LogStream::Stdout),
            "stderr" => Ok(LogStream::Stderr),
            other => Err(format!(
                "unknown log type {other:?} (want stdout or stderr)"
            )),
        }
    }
}

/// The name every log file of one task and stream starts with:
/// `<task>.<stream>`; the files are `<base>.0`, `<base>.1`, ...
/// The mode of task log files: the agent's user reads and writes them, its
/// group reads them, others nothing (tasks may print secrets).
pub const LOG_FILE_MODE: u32 = 0o640;

pub fn log_base(task: &str, stream: LogStream) -> String {
    format!("{task}.{}", stream.as_str())
}

/// The path of file `index` of `base` in `dir`.
pub fn log_file_path(dir: &Path, base: &str, index: u64) -> PathBuf {
    dir.join(format!("{base}.{index}"))
}

/// One log file as it is on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFile {
    pub index: u64,
    pub path: PathBuf,
    pub len: u64,
}

/// The log files of `base` in `dir`, oldest (lowest index) first. A
/// missing directory has none.
pub fn log_files(dir: &Path, base: &str) -> std::io::Result<Vec<LogFile>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let prefix = format!("{base}.");
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(index) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .filter(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|i| i.parse::<u64>().ok())
        else {
            continue;
        };
        // Deleted by rotation between the listing and here: not there.
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        if meta.is_file() {
            files.push(LogFile {
                index,
                path: entry.path(),
                len: meta.len(),
            });
        }
    }
    files.sort_by_key(|f| f.index);
    Ok(files)
}

/// Writes one stream of a task into rotating files. Every write is a plain
/// `write(2)`: nothing is buffered that a crash would lose. It never fails
/// and never blocks on a full disk: what cannot be written is counted and
/// reported by a marker line once writing works again.
pub struct RotatingWriter {
    dir: PathBuf,
    base: String,
    rotation: LogRotation,
    /// The index of the file being written.
    index: u64,
    /// The lowest index that may still exist.
    oldest: u64,
    file: Option<File>,
    /// Bytes in the current file.
    size: u64,
    /// Bytes dropped since the last successful write.
    dropped: u64,
    /// Why the last bytes were dropped.
    drop_reason: String,
}

impl RotatingWriter {
    /// Continues the files of `base` in `dir` at the highest index there is
    /// (appending to it), or starts at 0.
    pub fn open(dir: &Path, base: &str, rotation: LogRotation) -> std::io::Result<RotatingWriter> {
        let existing = log_files(dir, base)?;
        let index = existing.last().map_or(0, |f| f.index);
        let oldest = existing.first().map_or(0, |f| f.index);
        let mut w = RotatingWriter {
            dir: dir.to_path_buf(),
            base: base.to_string(),
            rotation: LogRotation {
                max_files: rotation.max_files.max(1),
                max_file_size: rotation.max_file_size.max(1),
            },
            index,
            oldest,
            file: None,
            size: 0,
            dropped: 0,
            drop_reason: String::new(),
        };
        w.open_current()?;
        w.remove_old();
        Ok(w)
    }

    /// The path of the file being written.
    pub fn current_path(&self) -> PathBuf {
        log_file_path(&self.dir, &self.base, self.index)
    }

    /// Bytes dropped and not yet reported by a marker line.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    fn open_current(&mut self) -> std::io::Result<()> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(LOG_FILE_MODE)
            .open(self.current_path())?;
        let meta = file.metadata()?;
        // A file an older berth made (0644) is narrowed.
        if meta.permissions().mode() & 0o777 & !LOG_FILE_MODE != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(LOG_FILE_MODE))?;
        }
        self.size = meta.len();
        self.file = Some(file);
        Ok(())
    }

    /// Closes the current file and opens the next index.
    fn rotate(&mut self) -> std::io::Result<()> {
        let Some(next) = self.index.checked_add(1) else {
            return Err(std::io::Error::other(
                "the log files' index is at its largest: no next file",
            ));
        };
        self.file = None;
        self.index = next;
        self.size = 0;
        self.open_current()?;
        self.remove_old();
        Ok(())
    }

    /// Deletes the files beyond the newest `max_files`.
    fn remove_old(&mut self) {
        let keep_from = self
            .index
            .saturating_add(1)
            .saturating_sub(u64::from(self.rotation.max_files));
        if keep_from.saturating_sub(self.oldest) > 64 {
            // A wide gap between the oldest index and the newest (files
            // this writer did not make, or fewer kept than before): delete
            // the files there are, not every index between.
            self.remove_listed_below(keep_from);
            return;
        }
        while self.oldest < keep_from {
            let path = log_file_path(&self.dir, &self.base, self.oldest);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    // Tried again at the next rotation.
                    eprintln!(
                        "berth executor: removing the old log file {}: {e}",
                        path.display()
                    );
                    return;
                }
            }
            self.oldest += 1;
        }
    }

    /// Deletes the listed files below `keep_from`.
    fn remove_listed_below(&mut self, keep_from: u64) {
        let files = match log_files(&self.dir, &self.base) {
            Ok(f) => f,
            Err(e) => {
                eprintln!(
                    "berth executor: listing the old log files in {}: {e}",
                    self.dir.display()
                );
                return;
            }
        };
        for f in files.iter().filter(|f| f.index < keep_from) {
            match std::fs::remove_file(&f.path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    eprintln!(
                        "berth executor: removing the old log file {}: {e}",
                        f.path.display()
                    );
                    self.oldest = f.index;
                    return;
                }
            }
        }
        self.oldest = keep_from;
    }

    /// Writes `data` (what the task wrote), rotating as needed.
    pub fn write_chunk(&mut self, data: &[u8]) {
        if self.dropped > 0 {
            let marker = format!(
                "\n[berth: {} bytes of this task's output were dropped: {}]\n",
                self.dropped, self.drop_reason
            );
            let dropped = self.dropped;
            self.dropped = 0;
            if let Err(e) = self.write_rotating(marker.as_bytes()) {
                self.dropped = dropped + data.len() as u64;
                self.drop_reason = e.to_string();
                return;
            }
        }
        if let Err(e) = self.write_rotating(data) {
            self.drop_reason = e.to_string();
        }
    }

    /// Writes `data`, counting what could not be written as dropped.
    fn write_rotating(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        let max = self.rotation.max_file_size;
        while !data.is_empty() {
            let result = self.write_some(&mut data, max);
            if let Err(e) = result {
                self.dropped += data.len() as u64;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Writes the next part of `data` into the current file (or rotates),
    /// advancing `data` past what was written.
    fn write_some(&mut self, data: &mut &[u8], max: u64) -> std::io::Result<()> {
        if self.file.is_none() {
            // A rotation that failed to open its file: try again.
            self.open_current()?;
            self.remove_old();
        }
        let room = max.saturating_sub(self.size);
        if room == 0 {
            return self.rotate();
        }
        let len = data.len() as u64;
        let (take, then_rotate) = if len >= room {
            // The bytes fill the file: cut after the last newline that
            // fits.
            match data[..room as usize].iter().rposition(|&b| b == b'\n') {
                Some(i) => (i + 1, false),
                // The line goes whole into the next file, if it fits there.
                None if self.size > 0 => return self.rotate(),
                // Longer than a file: split.
                None => (room as usize, false),
            }
        } else if room - len < self.slack() && data.last() != Some(&b'\n') {
            // They fit, but leave the file nearly full with a line begun
            // that the next bytes would carry past its end: cut after the
            // last newline, and the line starts the next file.
            match data.iter().rposition(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (data.len(), false),
            }
        } else {
            (data.len(), false)
        };
        let Some(file) = self.file.as_mut() else {
            return Err(std::io::Error::other("no log file is open"));
        };
        let mut part = &data[..take];
        while !part.is_empty() {
            match file.write(part) {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        "the log file took no bytes",
                    ))
                }
                Ok(n) => {
                    self.size += n as u64;
                    part = &part[n..];
                    *data = &data[n..];
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if then_rotate {
            self.rotate()?;
        }
        Ok(())
    }

    /// How near its end a file is cut at a newline rather than filled:
    /// an eighth of a file, at most 64 KiB.
    fn slack(&self) -> u64 {
        (self.rotation.max_file_size / 8).min(64 * 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotation(max_files: u32, max_file_size: u64) -> LogRotation {
        LogRotation {
            max_files,
            max_file_size,
        }
    }

    fn concat(dir: &Path, base: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for f in log_files(dir, base).unwrap() {
            out.extend(std::fs::read(&f.path).unwrap());
        }
        out
    }

    fn indexes(dir: &Path, base: &str) -> Vec<u64> {
        log_files(dir, base)
            .unwrap()
            .iter()
            .map(|f| f.index)
            .collect()
    }

    #[test]
    fn files_are_cut_after_the_last_newline_that_fits() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(10, 10)).unwrap();
        w.write_chunk(b"aaa\nbbb\ncccc\n");
        let files = log_files(dir.path(), "t.stdout").unwrap();
        let texts: Vec<String> = files
            .iter()
            .map(|f| std::fs::read_to_string(&f.path).unwrap())
            .collect();
        assert_eq!(texts, ["aaa\nbbb\n", "cccc\n"]);
        assert!(files.iter().all(|f| f.len <= 10));
    }

    #[test]
    fn a_line_that_does_not_fit_starts_the_next_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(10, 10)).unwrap();
        w.write_chunk(b"abc\n");
        w.write_chunk(b"defghij\n");
        let texts: Vec<String> = log_files(dir.path(), "t.stdout")
            .unwrap()
            .iter()
            .map(|f| std::fs::read_to_string(&f.path).unwrap())
            .collect();
        assert_eq!(texts, ["abc\n", "defghij\n"]);
    }

    #[test]
    fn a_line_begun_near_the_end_of_a_file_starts_the_next_one() {
        // 80-byte files: the last 10 bytes are where a begun line is not
        // started but carried to the next file.
        let dir = tempfile::tempdir().unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(10, 80)).unwrap();
        let first = format!("{}\n", "x".repeat(59));
        w.write_chunk(format!("{first}partial-line").as_bytes());
        w.write_chunk(b" ends here\n");
        let texts: Vec<String> = log_files(dir.path(), "t.stdout")
            .unwrap()
            .iter()
            .map(|f| std::fs::read_to_string(&f.path).unwrap())
            .collect();
        assert_eq!(texts, [first, "partial-line ends here\n".to_string()]);
        // Bytes that leave room to spare stay in the file, line begun or not.
        let dir = tempfile::tempdir().unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(10, 80)).unwrap();
        w.write_chunk(b"short\npart");
        w.write_chunk(b"ial\n");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("t.stdout.0")).unwrap(),
            "short\npartial\n"
        );
    }

    #[test]
    fn a_line_longer_than_a_file_is_split_and_nothing_is_lost() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(100, 4)).unwrap();
        let input = b"0123456789abcdef\nxy\n";
        w.write_chunk(input);
        assert_eq!(concat(dir.path(), "t.stdout"), input);
        let files = log_files(dir.path(), "t.stdout").unwrap();
        assert!(files.iter().all(|f| f.len <= 4 && f.len > 0), "{files:?}");
        assert_eq!(
            std::fs::read_to_string(&files[0].path).unwrap(),
            "0123",
            "the long line fills a file"
        );
    }

    #[test]
    fn only_the_newest_max_files_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stderr", rotation(3, 5)).unwrap();
        for i in 0..10 {
            w.write_chunk(format!("l{i:02}\n").as_bytes());
        }
        assert_eq!(indexes(dir.path(), "t.stderr"), [7, 8, 9]);
        assert_eq!(
            String::from_utf8(concat(dir.path(), "t.stderr")).unwrap(),
            "l07\nl08\nl09\n"
        );
        // Another stream's files in the same dir are not touched.
        std::fs::write(dir.path().join("t.stdout.0"), "x").unwrap();
        w.write_chunk(b"l10\n");
        assert_eq!(indexes(dir.path(), "t.stdout"), [0]);
        assert_eq!(indexes(dir.path(), "t.stderr"), [8, 9, 10]);
    }

    #[test]
    fn a_reopened_writer_continues_at_the_highest_index() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(5, 8)).unwrap();
            w.write_chunk(b"one\ntwo\nthree\n");
        }
        assert_eq!(indexes(dir.path(), "t.stdout"), [0, 1]);
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(2, 8)).unwrap();
        assert_eq!(w.current_path(), dir.path().join("t.stdout.1"));
        w.write_chunk(b"4\n");
        w.write_chunk(b"five\n");
        assert_eq!(indexes(dir.path(), "t.stdout"), [1, 2]);
        assert_eq!(
            String::from_utf8(concat(dir.path(), "t.stdout")).unwrap(),
            "three\n4\nfive\n"
        );
    }

    #[test]
    fn the_files_concatenate_to_the_input_whatever_the_chunks() {
        // Numbered lines of varying length, written in chunks of varying
        // size, with small files: the concatenation is the input.
        let mut input = Vec::new();
        for i in 0..2000u32 {
            let pad = "x".repeat((i as usize * 7) % 23);
            input.extend(format!("{i:06} {pad}\n").as_bytes());
        }
        for (size, chunk) in [(16u64, 1usize), (64, 7), (100, 333), (1000, 4096), (7, 50)] {
            let dir = tempfile::tempdir().unwrap();
            let mut w =
                RotatingWriter::open(dir.path(), "t.stdout", rotation(100_000, size)).unwrap();
            for c in input.chunks(chunk) {
                w.write_chunk(c);
            }
            assert_eq!(w.dropped(), 0);
            let files = log_files(dir.path(), "t.stdout").unwrap();
            assert!(files.iter().all(|f| f.len <= size), "size {size}");
            assert_eq!(
                files.iter().map(|f| f.index).collect::<Vec<_>>(),
                (0..files.len() as u64).collect::<Vec<_>>()
            );
            assert!(
                concat(dir.path(), "t.stdout") == input,
                "size {size} chunk {chunk}"
            );
        }
    }

    #[test]
    fn bytes_that_cannot_be_written_are_counted_and_reported_once_writing_works() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        std::fs::create_dir(&logs).unwrap();
        let mut w = RotatingWriter::open(&logs, "t.stdout", rotation(100, 8)).unwrap();
        w.write_chunk(b"ok\n");
        // The next file cannot be created: the dir is gone.
        std::fs::remove_dir_all(&logs).unwrap();
        w.write_chunk(b"lost one\n");
        w.write_chunk(b"lost two\n");
        assert_eq!(w.dropped(), 18);
        std::fs::create_dir(&logs).unwrap();
        w.write_chunk(b"back\n");
        assert_eq!(w.dropped(), 0);
        let text = String::from_utf8(concat(&logs, "t.stdout")).unwrap();
        assert!(
            text.contains("[berth: 18 bytes of this task's output were dropped: "),
            "{text:?}"
        );
        assert!(text.ends_with("back\n"), "{text:?}");
    }

    #[test]
    fn a_writer_at_the_largest_index_drops_what_does_not_fit_and_never_panics() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(format!("t.stdout.{}", u64::MAX)), "").unwrap();
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(3, 4)).unwrap();
        w.write_chunk(b"abc\ndef\n");
        assert_eq!(indexes(dir.path(), "t.stdout"), [u64::MAX]);
        assert_eq!(concat(dir.path(), "t.stdout"), b"abc\n");
        assert_eq!(w.dropped(), 4);
    }

    #[test]
    fn a_wide_gap_of_indexes_is_cleaned_by_listing_not_index_by_index() {
        // Files 0 and 10^15: a writer that tried every index between
        // would never get to write.
        let dir = tempfile::tempdir().unwrap();
        let far = 1_000_000_000_000_000u64;
        for i in [0, 1, far] {
            std::fs::write(dir.path().join(format!("t.stdout.{i}")), "x\n").unwrap();
        }
        let mut w = RotatingWriter::open(dir.path(), "t.stdout", rotation(2, 4)).unwrap();
        assert_eq!(indexes(dir.path(), "t.stdout"), [far]);
        w.write_chunk(b"ab\ncd\n");
        assert_eq!(indexes(dir.path(), "t.stdout"), [far + 1, far + 2]);
        assert_eq!(concat(dir.path(), "t.stdout"), b"ab\ncd\n");
    }

    #[test]
    fn log_files_ignores_other_names() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "t.stdout.2",
            "t.stdout.10",
            "t.stdout.x",
            "t.stdout.",
            "tt.stdout.1",
            "t.stderr.0",
        ] {
            std::fs::write(dir.path().join(name), "a").unwrap();
        }
        assert_eq!(indexes(dir.path(), "t.stdout"), [2, 10]);
        assert!(log_files(&dir.path().join("none"), "t.stdout")
            .unwrap()
            .is_empty());
    }
}
