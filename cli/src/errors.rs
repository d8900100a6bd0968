//! How the CLI reports a failure: one line `Error: <message>` on stderr.
//! A command line that berth cannot make sense of ([`UsageError`]) exits 2
//! with the usage after the error line; every other failure exits 1.

use std::fmt;

/// Exit code of a failed command.
pub const EXIT_FAILURE: i32 = 1;
/// Exit code of a command line berth cannot make sense of. As in Nomad,
/// `job run` and a followed `node drain` also exit 2 when what they
/// followed ended short of its goal without an error (allocs left
/// unplaced, a drain that did not complete); the README says both.
pub const EXIT_USAGE: i32 = 2;

/// An unknown command or flag, a flag without its value, missing or extra
/// arguments: reported with the command's usage, exit 2.
#[derive(Debug)]
pub struct UsageError {
    message: String,
    usage: String,
}

impl UsageError {
    pub fn new(message: impl Into<String>, usage: impl Into<String>) -> UsageError {
        UsageError {
            message: message.into(),
            usage: usage.into(),
        }
    }

    /// The usage text shown after the error (empty when there is none).
    pub fn usage(&self) -> &str {
        &self.usage
    }
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for UsageError {}

/// An error and its causes on one line, joined with `: `. A cause whose
/// text its parent already shows (an error type that prints its source in
/// its own message) is said once, and a message over several lines is
/// joined with `; `.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut parent: Option<String> = None;
    for cause in e.chain() {
        let text = flatten(&cause.to_string());
        let shown_by_parent = parent.as_deref().is_some_and(|p| p.contains(&text));
        if !text.is_empty() && !shown_by_parent {
            parts.push(text.clone());
        }
        // A cause hidden in its parent's text may still hide its own
        // cause there: compare the next one with the text that shows it.
        if !shown_by_parent {
            parent = Some(text);
        }
    }
    parts.join(": ")
}

fn flatten(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Prints `e` as the CLI reports failures and returns the exit code.
/// The API's answer `e` carries, when the failure is one (a non-2xx).
pub fn api_answer(e: &anyhow::Error) -> Option<&berth_api::ApiError> {
    e.downcast_ref::<berth_api::Error>()
        .and_then(berth_api::Error::api)
}

pub fn report(e: &anyhow::Error) -> i32 {
    match e.downcast_ref::<UsageError>() {
        Some(usage) => {
            eprintln!(
                "Error: {}\n\n{}",
                flatten(&usage.message),
                usage.usage.trim_end()
            );
            EXIT_USAGE
        }
        None => {
            eprintln!("Error: {}", one_line(e));
            EXIT_FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[derive(Debug, thiserror::Error)]
    #[error("Database already open. Cannot acquire lock.")]
    struct Locked;

    #[derive(Debug, thiserror::Error)]
    #[error("opening the state database /d/server/state.redb: {source}")]
    struct Open {
        #[source]
        source: Locked,
    }

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("state store: {0}")]
        Store(#[from] Open),
    }

    #[test]
    fn a_cause_its_parent_already_shows_is_said_once() {
        let e = Err::<(), _>(Outer::from(Open { source: Locked }))
            .context("opening the server state")
            .unwrap_err();
        let line = one_line(&e);
        assert_eq!(
            line,
            "opening the server state: state store: opening the state database \
             /d/server/state.redb: Database already open. Cannot acquire lock."
        );
        assert_eq!(line.matches("Database already open").count(), 1);
    }

    #[test]
    fn contexts_are_joined_on_one_line() {
        let io = std::io::Error::from_raw_os_error(2);
        let e = Err::<(), _>(io).context("reading x.hcl").unwrap_err();
        assert_eq!(
            one_line(&e),
            "reading x.hcl: No such file or directory (os error 2)"
        );
        let e = anyhow::anyhow!("first line\nsecond line\n");
        assert_eq!(one_line(&e), "first line; second line");
    }

    #[test]
    fn usage_errors_are_told_apart() {
        let e: anyhow::Error = UsageError::new("berth job: unknown command", "Usage: x").into();
        assert!(e.downcast_ref::<UsageError>().is_some());
        let wrapped = Err::<(), _>(e).context("running").unwrap_err();
        assert!(wrapped.downcast_ref::<UsageError>().is_some());
    }
}
