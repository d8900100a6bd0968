//! The one rule for names that become a path component or a map key on a
//! node: job IDs, group, task and volume names, volume IDs (and their
//! `per_alloc` expansions), plugin IDs, node names and IDs, alloc IDs.
//!
//! The servers check it when a job, a volume or a node arrives; the client
//! checks it again before it builds a path from a name. Both call
//! [`check_name`], so the rule cannot drift between them.
//!
//! The rule, like Nomad's: 1 to [`MAX_NAME_LEN`] bytes of ASCII letters,
//! digits, `-`, `_`, `.`, `[` and `]` (a `per_alloc` volume ID is
//! `data[0]`), starting with a letter, a digit or `_` (so never `.`, `..` or
//! a hidden file).

/// The longest name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// What a name may be, as messages say it.
pub const NAME_RULE: &str =
    "use 1-128 letters, digits, '-', '_', '.', '[' or ']', starting with a letter, digit or '_'";

/// Names longer than this are cut short in messages.
const SHOWN_LEN: usize = 64;

/// A name that breaks the rule: which field, its value, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {shown} is not allowed ({problem}): {NAME_RULE}", shown = quoted(value))]
pub struct NameError {
    /// What the name is: `task name`, `csi_plugin.id`, `volume ID`.
    pub field: &'static str,
    pub value: String,
    pub problem: NameProblem,
}

/// What is wrong with a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameProblem {
    #[error("it is empty")]
    Empty,
    #[error("it is {0} bytes long")]
    TooLong(usize),
    #[error("it contains {0:?}")]
    BadChar(char),
    #[error("it starts with {0:?}")]
    BadStart(char),
}

/// Checks `name` against the rule; `field` names it in the error.
pub fn check_name(field: &'static str, name: &str) -> Result<(), NameError> {
    name_problem(name).map_or(Ok(()), |problem| {
        Err(NameError {
            field,
            value: name.to_string(),
            problem,
        })
    })
}

/// Whether `name` passes the rule.
pub fn is_valid_name(name: &str) -> bool {
    name_problem(name).is_none()
}

fn name_problem(name: &str) -> Option<NameProblem> {
    if name.is_empty() {
        return Some(NameProblem::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Some(NameProblem::TooLong(name.len()));
    }
    if let Some(c) = name.chars().find(|&c| !is_name_char(c)) {
        return Some(NameProblem::BadChar(c));
    }
    match name.chars().next() {
        Some(c) if c.is_ascii_alphanumeric() || c == '_' => None,
        Some(c) => Some(NameProblem::BadStart(c)),
        None => Some(NameProblem::Empty),
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '[' | ']')
}

/// A name as messages show it: quoted, and cut short (with its length)
/// when it is long, so that a megabyte of name does not become a megabyte
/// of error.
pub fn quoted(name: &str) -> String {
    if name.len() <= SHOWN_LEN {
        return format!("{name:?}");
    }
    let mut end = SHOWN_LEN;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &name[..end], name.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass() {
        for good in [
            "web",
            "hostpath-plugin",
            "data[0]",
            "data[12]",
            "a.b.c",
            "_x",
            "0",
            "8c2f6a1e-1b2c-4d3e-9f00-0123456789ab",
            &"x".repeat(MAX_NAME_LEN),
        ] {
            assert_eq!(check_name("name", good), Ok(()), "{good:?}");
        }
    }

    #[test]
    fn names_that_could_escape_a_path_are_refused() {
        for (bad, problem) in [
            ("", NameProblem::Empty),
            (".", NameProblem::BadStart('.')),
            ("..", NameProblem::BadStart('.')),
            (".hidden", NameProblem::BadStart('.')),
            ("../x", NameProblem::BadChar('/')),
            ("a/b", NameProblem::BadChar('/')),
            ("/etc", NameProblem::BadChar('/')),
            ("a\0b", NameProblem::BadChar('\0')),
            ("a b", NameProblem::BadChar(' ')),
            ("a\\b", NameProblem::BadChar('\\')),
            ("ünï", NameProblem::BadChar('ü')),
            ("-x", NameProblem::BadStart('-')),
            ("[0]", NameProblem::BadStart('[')),
        ] {
            let e = check_name("task name", bad).unwrap_err();
            assert_eq!(e.problem, problem, "{bad:?}");
            assert!(!is_valid_name(bad));
        }
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert_eq!(
            check_name("n", &long).unwrap_err().problem,
            NameProblem::TooLong(129)
        );
    }

    #[test]
    fn the_error_names_field_value_and_rule() {
        let e = check_name("task name", "../x").unwrap_err();
        assert_eq!(
            e.to_string(),
            "task name \"../x\" is not allowed (it contains '/'): use 1-128 letters, digits, \
             '-', '_', '.', '[' or ']', starting with a letter, digit or '_'"
        );
    }

    #[test]
    fn long_names_are_cut_short_in_messages() {
        let name = "é".repeat(1000);
        let e = check_name("job ID", &name).unwrap_err().to_string();
        assert!(e.len() < 400, "{e}");
        assert!(e.contains("(2000 bytes)"), "{e}");
    }
}
