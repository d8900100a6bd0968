//! Reading the CLI's output in tests: its stdout and stderr as text, the
//! one-line error every failing command prints, and the `Key = value`
//! headers and titled sections of the status commands.

use std::process::Output;

/// The command's stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The command's stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Fails unless `out` is a one-line `Error: ...` naming `want`, exit 1.
pub fn assert_error(out: &Output, want: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.starts_with("Error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(want), "{want:?} in {err}");
}

/// The value of `key` in a `Key = value` header block.
pub fn header_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(" = ")?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// The lines of the section titled `title` (up to the next blank line),
/// its column header first.
pub fn section<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|l| l.trim() != title)
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect()
}
