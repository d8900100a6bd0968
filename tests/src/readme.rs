//! Running the README's commands as written: its indented code blocks, and
//! [`Shell`], which runs their lines one by one as a person at one shell
//! would, keeping the exported variables and the working directory from
//! one line to the next, and keeping `berth agent` lines running (as in a
//! terminal of their own) until it is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::path_with_bins;
use crate::{repo_root, wait_for};

/// The README's text.
pub fn readme() -> Result<String> {
    std::fs::read_to_string(repo_root().join("README.md")).context("reading README.md")
}

/// The lines of an indented code block (trimmed; a line ending in `\`
/// joined with the next).
fn block_lines<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut open = false;
    for line in lines {
        let line = line.trim();
        match out.last_mut() {
            Some(last) if open => {
                last.push(' ');
                last.push_str(line);
            }
            _ => out.push(line.to_string()),
        }
        open = line.ends_with('\\');
        if open {
            let last = out.last_mut().expect("just pushed");
            last.truncate(last.len() - 1);
            let kept = last.trim_end().len();
            last.truncate(kept);
        }
    }
    out
}

/// The commands of the first code block after `intro` in the README.
pub fn block_after(readme: &str, intro: &str) -> Result<Vec<String>> {
    let at = readme
        .find(intro)
        .with_context(|| format!("the README no longer says {intro:?}"))?;
    let commands = block_lines(
        readme[at..]
            .lines()
            .skip_while(|l| !l.starts_with("    "))
            .take_while(|l| l.starts_with("    ")),
    );
    anyhow::ensure!(!commands.is_empty(), "no code block after {intro:?}");
    Ok(commands)
}

/// The commands of every code block from `intro` to the next `## `
/// heading, in order.
pub fn blocks_from(readme: &str, intro: &str) -> Result<Vec<String>> {
    let at = readme
        .find(intro)
        .with_context(|| format!("the README no longer says {intro:?}"))?;
    let section: Vec<&str> = readme[at..]
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .collect();
    let mut commands = Vec::new();
    let mut i = 0;
    while i < section.len() {
        let start = i;
        while i < section.len() && section[i].starts_with("    ") {
            i += 1;
        }
        commands.extend(block_lines(section[start..i].iter().copied()));
        i = i.max(start + 1);
    }
    anyhow::ensure!(!commands.is_empty(), "no code block after {intro:?}");
    Ok(commands)
}

/// One shell session, as a person types into it; see the module docs.
pub struct Shell {
    /// `export -p` and the two `cd`s that restore the session.
    state: PathBuf,
    dir: tempfile::TempDir,
    agents: Vec<(String, Child, PathBuf)>,
}

impl Shell {
    /// A session in `cwd` with the workspace's binaries first on PATH and
    /// no `BERTH_*` variables.
    pub fn new(cwd: &Path) -> Result<Shell> {
        let dir = tempfile::Builder::new().prefix("berth-shell-").tempdir()?;
        let state = dir.path().join("state.sh");
        let mut start = format!("export PATH={}\n", quote(&path_with_bins()));
        for (name, _) in std::env::vars() {
            if name.starts_with("BERTH_") {
                start.push_str(&format!("unset {name}\n"));
            }
        }
        start.push_str(&format!("cd -- {}\n", quote(&cwd.display().to_string())));
        std::fs::write(&state, start)?;
        Ok(Shell {
            state,
            dir,
            agents: Vec::new(),
        })
    }

    /// Runs one command line, then keeps its exports and directory.
    pub fn run(&mut self, line: &str) -> Result<Output> {
        let state = quote(&self.state.display().to_string());
        let script = format!(
            "source {state}\n{line}\nrc=$?\n\
             {{ export -p; printf 'cd -- %q\\ncd -- %q\\n' \"${{OLDPWD:-$PWD}}\" \"$PWD\"; }} > {state}\n\
             exit $rc\n"
        );
        Command::new("bash")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {line:?}"))
    }

    /// [`Shell::run`], an error with its output unless it succeeds.
    pub fn run_ok(&mut self, line: &str) -> Result<String> {
        let out = self.run(line)?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "{line:?} failed ({}):\n{stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(stdout)
    }

    /// Starts a long-running line (`berth agent ...`) as in a terminal of
    /// its own, and waits until its log says `agent ready`.
    pub fn start_agent(&mut self, line: &str) -> Result<()> {
        let log = self
            .dir
            .path()
            .join(format!("agent-{}.log", self.agents.len()));
        let file = std::fs::File::create(&log)?;
        let state = quote(&self.state.display().to_string());
        let child = Command::new("bash")
            .args(["-c", &format!("source {state}\nexec {line}")])
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {line:?}"))?;
        self.agents.push((line.to_string(), child, log.clone()));
        wait_for(&format!("{line:?} ready"), Duration::from_secs(60), || {
            self.check_agents()?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            Ok(text.contains("agent ready").then_some(()))
        })
    }

    /// An error with its log when one of the agents has exited.
    pub fn check_agents(&mut self) -> Result<()> {
        for (line, child, log) in &mut self.agents {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{line:?} exited ({status}); log:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
        Ok(())
    }

    /// The logs of the agents started so far.
    pub fn agent_logs(&self) -> String {
        self.agents
            .iter()
            .map(|(line, _, log)| {
                format!(
                    "--- {line}\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            })
            .collect()
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.agents {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `s` as one single-quoted shell word.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
