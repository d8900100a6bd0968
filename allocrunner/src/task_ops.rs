//! What an operator asks of a running task: a restart in place (not counted
//! against the restart policy, no rescheduling) and signals. The alloc
//! runner hands each request to the task runner of the task, which acts on
//! the running process through its driver handle.

use std::str::FromStr;

use nix::sys::signal::Signal;
use tokio::sync::oneshot;

/// The task event of a restart an operator asked for.
pub const EVENT_RESTART_SIGNALED: &str = "Restart Signaled";
/// The message of that event.
pub const USER_RESTART_REASON: &str = "user requested restart";
/// The task event of a signal an operator sent.
pub const EVENT_SIGNALING: &str = "Signaling";

/// Why an operator's request on a task was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskOpError {
    #[error("unknown signal {0:?} (give a name such as SIGHUP or HUP, or a number such as 1)")]
    UnknownSignal(String),
    #[error("task {task:?} is not in the alloc (its tasks: {})", tasks.join(", "))]
    UnknownTask { task: String, tasks: Vec<String> },
    #[error("task {task:?} is not running (it is {state})")]
    NotRunning { task: String, state: String },
    #[error("no task of the alloc is running")]
    NothingRunning,
    #[error("the alloc is {0}: its tasks no longer run")]
    AllocTerminal(String),
    #[error("sending {signal} to task {task:?}: {message}")]
    SignalFailed {
        task: String,
        signal: String,
        message: String,
    },
}

impl TaskOpError {
    /// The HTTP status that says what went wrong: a bad signal is the
    /// request's fault, an unknown task is not found, a task or alloc that
    /// does not run is a conflict with its state.
    pub fn http_status(&self) -> u16 {
        match self {
            TaskOpError::UnknownSignal(_) => 400,
            TaskOpError::UnknownTask { .. } => 404,
            TaskOpError::NotRunning { .. }
            | TaskOpError::NothingRunning
            | TaskOpError::AllocTerminal(_) => 409,
            TaskOpError::SignalFailed { .. } => 500,
        }
    }
}

/// A request handed to a task runner, answered once it is done.
pub(crate) enum TaskOp {
    /// Kill the task (kill timeout as for a stop) and start it again at
    /// once.
    Restart {
        reply: oneshot::Sender<Result<(), TaskOpError>>,
    },
    /// Send `signal` to the task's process group.
    Signal {
        signal: Signal,
        reply: oneshot::Sender<Result<(), TaskOpError>>,
    },
}

impl TaskOp {
    /// Answers the request with `error` without acting on it.
    pub(crate) fn refuse(self, error: TaskOpError) {
        let reply = match self {
            TaskOp::Restart { reply } | TaskOp::Signal { reply, .. } => reply,
        };
        let _ = reply.send(Err(error));
    }
}

/// How a task's state reads in a message.
pub(crate) fn state_name(state: berth_structs::TaskStateKind) -> &'static str {
    match state {
        berth_structs::TaskStateKind::Pending => "pending",
        berth_structs::TaskStateKind::Running => "running",
        berth_structs::TaskStateKind::Dead => "dead",
    }
}

/// A signal by its name (`SIGHUP`, `HUP`, any case) or number (`1`).
pub fn parse_signal(name: &str) -> Result<Signal, TaskOpError> {
    let trimmed = name.trim();
    let unknown = || TaskOpError::UnknownSignal(name.to_string());
    if trimmed.is_empty() {
        return Err(unknown());
    }
    if let Ok(n) = trimmed.parse::<i32>() {
        return Signal::try_from(n).map_err(|_| unknown());
    }
    let upper = trimmed.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    Signal::from_str(&full).map_err(|_| unknown())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_is_named_with_or_without_sig_in_any_case_or_by_number() {
        for name in ["SIGHUP", "HUP", "hup", "SigHup", "1", " SIGHUP "] {
            assert_eq!(parse_signal(name), Ok(Signal::SIGHUP), "{name}");
        }
        assert_eq!(parse_signal("SIGUSR1"), Ok(Signal::SIGUSR1));
        assert_eq!(parse_signal("usr2"), Ok(Signal::SIGUSR2));
        assert_eq!(parse_signal("9"), Ok(Signal::SIGKILL));
        assert_eq!(parse_signal("KILL"), Ok(Signal::SIGKILL));
    }

    #[test]
    fn an_unknown_signal_is_an_error_naming_it() {
        for name in ["SIGNOPE", "NOPE", "", "0", "99", "-1", "SIG"] {
            let e = parse_signal(name).expect_err(name);
            assert_eq!(e, TaskOpError::UnknownSignal(name.to_string()));
            assert_eq!(e.http_status(), 400);
            assert!(e.to_string().contains(&format!("{name:?}")), "{e}");
        }
    }
}
