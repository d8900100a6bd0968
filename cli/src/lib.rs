//! The command line: Nomad-shaped commands on clap. Nomad's single-dash
//! long flags (`-json`, `-detach`, `-address=...`) are rewritten to their
//! double-dash form before clap parses (see [`normalise`]), so both forms
//! work and short flags (`-h`, `-t`, `-n`) stay short. Every command but
//! `agent`, `config validate`, `version` and `completion` is a client of
//! the HTTP API.
//!
//! Each command group lives in its own module with its own
//! `clap::Subcommand` enum and a `run(cmd, &Ctx)`. The commands speak to
//! the API through `berth-api` only; the three that are no API client
//! (`agent`, `config validate`, the hidden `executor`) are run by the
//! binary, through [`Host`].

pub mod acl;
pub mod agent_args;
pub mod alloc;
pub mod alloc_logs;
pub mod alloc_ops;
pub mod deployment;
pub mod errors;
pub mod job;
pub mod node;
pub mod operator;
pub mod output;
pub mod plugin;
pub mod reschedule;
pub mod server;
pub mod snapshot;
pub mod system;
pub mod tls;
pub mod volume;
pub mod volume_stats;

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use serde_json::Value;

use berth_api::{ApiClient, DEFAULT_ADDR};
use errors::UsageError;

/// What the binary runs itself: the commands that are not clients of the
/// API.
pub trait Host {
    /// `berth agent`: runs until the agent stops; the exit code.
    fn agent(&self, args: agent_args::AgentArgs) -> Result<i32>;
    /// `berth config validate PATH...`: the merged configuration of the
    /// paths, checked; `Ok` with the roles it enables ("server", "client"
    /// or "server and client") and what an operator should know of it.
    fn validate_config(&self, paths: &[PathBuf]) -> Result<ValidConfig>;
}

/// A configuration that `berth config validate` passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidConfig {
    /// "server", "client" or "server and client".
    pub roles: &'static str,
    /// What the configuration does that its files do not say, one line
    /// each.
    pub notes: Vec<String>,
}

/// `berth version` and `berth -version`.
pub const VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));

/// berth runs workloads on a cluster of nodes: servers schedule jobs,
/// clients run their allocations and mount their CSI volumes.
#[derive(Parser, Debug)]
#[command(
    name = "berth",
    version = VERSION,
    disable_version_flag = false,
    after_help = "Flags take one dash or two: -json and --json are the same flag.\n\
                  Every API command takes -address ADDR (default BERTH_ADDR, then http://127.0.0.1:4747);\n\
                  an https:// address takes -ca-cert, -client-cert and -client-key (BERTH_CACERT,\n\
                  BERTH_CLIENT_CERT, BERTH_CLIENT_KEY)."
)]
pub struct Cli {
    /// The HTTP API of a berth agent
    #[arg(
        long,
        global = true,
        env = "BERTH_ADDR",
        default_value = DEFAULT_ADDR,
        value_name = "ADDR",
        hide_env_values = true
    )]
    pub address: String,

    /// The ACL token the API commands present (sent as X-Berth-Token)
    #[arg(
        long,
        global = true,
        env = "BERTH_TOKEN",
        value_name = "SECRET",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// The CA certificate an https:// agent's certificate must chain to
    #[arg(
        long,
        global = true,
        env = "BERTH_CACERT",
        value_name = "FILE",
        hide_env_values = true
    )]
    pub ca_cert: Option<PathBuf>,
    /// The certificate the CLI presents to an https:// agent
    #[arg(
        long,
        global = true,
        env = "BERTH_CLIENT_CERT",
        value_name = "FILE",
        hide_env_values = true
    )]
    pub client_cert: Option<PathBuf>,
    /// The key of -client-cert
    #[arg(
        long,
        global = true,
        env = "BERTH_CLIENT_KEY",
        value_name = "FILE",
        hide_env_values = true
    )]
    pub client_key: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a berth agent: a server, a client, or both in one process (-dev)
    Agent(Box<agent_args::AgentArgs>),
    /// Check agent configuration files
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Submit, inspect and stop jobs
    #[command(subcommand)]
    Job(job::JobCommand),
    /// Inspect and operate allocations
    #[command(subcommand)]
    Alloc(alloc::AllocCommand),
    /// Inspect and fail the rollouts of job versions
    #[command(subcommand)]
    Deployment(deployment::DeploymentCommand),
    /// Inspect nodes, drain them, change their eligibility
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// Create, register and inspect CSI volumes and their snapshots
    #[command(subcommand)]
    Volume(volume::VolumeCommand),
    /// Inspect CSI plugins
    #[command(subcommand)]
    Plugin(plugin::PluginCommand),
    /// Operate the cluster as a whole
    #[command(subcommand)]
    System(system::SystemCommand),
    /// ACL bootstrap, policies and tokens
    #[command(subcommand)]
    Acl(acl::AclCommand),
    /// Operate the servers themselves (the root keyring)
    #[command(subcommand)]
    Operator(operator::OperatorCommand),
    /// The servers of the cluster
    #[command(subcommand)]
    Server(server::ServerCommand),
    /// Create the agents' CA and certificates for mutual TLS
    #[command(subcommand)]
    Tls(tls::TlsCommand),
    /// Print berth's version
    Version,
    /// Print a shell completion script (bash, zsh or fish)
    Completion {
        #[arg(value_enum)]
        shell: CompletionShell,
    },
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Check agent config files, merged in order as one agent's
    /// (later files over earlier ones); starts nothing
    Validate {
        /// Config files, or directories of *.hcl read in name order
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
    },
}

/// What every API command gets: the client of the agent at `-address`.
pub struct Ctx {
    api: ApiClient,
}

impl Ctx {
    pub fn new(address: &str, tls: &berth_api::TlsFiles, token: Option<&str>) -> Result<Ctx> {
        Ok(Ctx {
            api: ApiClient::with_tls(address, tls)?.with_token(token),
        })
    }

    pub fn api(&self) -> &ApiClient {
        &self.api
    }
}

/// The whole command tree, as clap parses it: every command that has
/// subcommands prints its help when given none, and a flag given twice
/// is taken once, the last value winning (Go's flag package, which
/// Nomad's users are used to, does the same: `-json -json` is `-json`).
pub fn command() -> clap::Command {
    fn shaped(c: clap::Command) -> clap::Command {
        let c = if c.has_subcommands() {
            c.arg_required_else_help(true)
        } else {
            c
        };
        c.args_override_self(true).mut_subcommands(shaped)
    }
    shaped(Cli::command())
}

/// What parsing the command line gave: a command to run, or text to
/// print instead (help, version) with its exit code: 0 when asked for,
/// 2 for the help of a command given without its subcommand (on stderr).
pub enum Parsed {
    Run(Box<Cli>),
    Print(String, i32),
}

/// Parses `args` (without the program name). A command line clap refuses
/// is a [`UsageError`] with the failing command's usage.
pub fn parse(args: Vec<String>) -> Result<Parsed> {
    // Unbuilt: clap builds only the commands the words reach as it parses
    // them. Building the whole tree (every global flag copied into every
    // command) and cloning it cost each CLI call over a megabyte of heap
    // and most of its start; only a refused command line's help and usage
    // need the tree built.
    let mut cmd = command();
    let argv = normalise(&cmd, args);
    let matches = cmd
        .try_get_matches_from_mut(std::iter::once("berth".to_string()).chain(argv.iter().cloned()));
    let parsed = matches.and_then(|m| Cli::from_arg_matches(&m));
    if parsed.is_err() {
        cmd.build();
    }
    match parsed {
        Ok(cli) => Ok(Parsed::Run(Box::new(cli))),
        // `berth job` with BERTH_ADDR set: clap counts the variable as an
        // argument given, so it reports a missing subcommand instead of
        // showing the help it shows without the variable. Show the help
        // either way.
        Err(e) if e.kind() == clap::error::ErrorKind::MissingSubcommand => {
            let help = command_at(&mut cmd, &argv).render_help().to_string();
            Ok(Parsed::Print(single_dash(&help), errors::EXIT_USAGE))
        }
        // Some of clap's errors (a flag without its value) come without
        // the usage line: add the one of the command they concern.
        Err(e) => match clap_outcome(e) {
            Err(err) => match err.downcast::<UsageError>() {
                Ok(usage) if usage.usage().is_empty() => {
                    let line = command_at(&mut cmd, &argv).render_usage().to_string();
                    Err(UsageError::new(usage.to_string(), single_dash(line.trim_end())).into())
                }
                Ok(usage) => Err(usage.into()),
                Err(other) => Err(other),
            },
            ok => ok,
        },
    }
}

/// The deepest subcommand the words of `argv` name (flags skipped).
fn command_at<'a>(cmd: &'a mut clap::Command, argv: &[String]) -> &'a mut clap::Command {
    let mut at = cmd;
    for word in argv.iter().filter(|w| !w.starts_with('-')) {
        if at.find_subcommand(word).is_none() {
            break;
        }
        at = at.find_subcommand_mut(word).expect("found just above");
    }
    at
}

fn clap_outcome(e: clap::Error) -> Result<Parsed> {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp => Ok(Parsed::Print(single_dash(&e.render().to_string()), 0)),
        ErrorKind::DisplayVersion => Ok(Parsed::Print(e.render().to_string(), 0)),
        // `berth` or `berth job` alone: the help, as a usage error.
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Ok(Parsed::Print(
            single_dash(&e.render().to_string()),
            errors::EXIT_USAGE,
        )),
        _ => Err(clap_usage_error(&e).into()),
    }
}

/// Help and usage text with Nomad's single-dash long flags: `-json`
/// where clap writes `--json`. A flag line keeps its description where
/// it was (the dashes taken off are added as spaces after the flags), so
/// the columns stay aligned.
fn single_dash(help: &str) -> String {
    let mut out = String::with_capacity(help.len());
    for line in help.split_inclusive('\n') {
        let (body, end) = match line.strip_suffix('\n') {
            Some(body) => (body, "\n"),
            None => (line, ""),
        };
        let indent = body.len() - body.trim_start().len();
        if body.starts_with("Usage:") || body.starts_with("For more information") {
            out.push_str(&body.replace(" --", " -").replace("'--", "'-"));
        } else if body.trim_start().starts_with('-') && indent <= 6 {
            // The flags end where two spaces start the description.
            let flags_end = body[indent..]
                .find("  ")
                .map_or(body.len(), |at| indent + at);
            let (flags, description) = body.split_at(flags_end);
            let taken = flags.matches("--").count();
            out.push_str(&flags.replace("--", "-"));
            if !description.is_empty() {
                out.extend(std::iter::repeat_n(' ', taken));
                out.push_str(description);
            }
        } else {
            out.push_str(body);
        }
        out.push_str(end);
    }
    out
}

/// clap's error as berth reports command line errors: its first line
/// without clap's `error: ` prefix, then the usage of the command.
fn clap_usage_error(e: &clap::Error) -> UsageError {
    let text = e.render().to_string();
    // The message, with the lines that continue it (the arguments a
    // "required arguments were not provided" names), up to a blank line.
    let message = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    // Flags are named as berth documents them, with one dash.
    let message = message
        .strip_prefix("error: ")
        .unwrap_or(&message)
        .replace("'--", "'-")
        .replace("<--", "<-")
        .replace("|--", "|-")
        .replace(" --", " -");
    let usage: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("Usage:"))
        .collect();
    UsageError::new(message, single_dash(usage.join("\n").trim_end()))
}

/// A usage error of the command at `path` (`["node", "drain"]`): reported
/// with that command's usage line, exit 2. For checks clap's attributes
/// cannot say.
pub fn usage_error(path: &[&str], message: impl Into<String>) -> anyhow::Error {
    let mut cmd = command();
    cmd.build();
    let mut names = path.iter();
    let usage = loop {
        match names.next() {
            Some(name) => match cmd.find_subcommand(name) {
                Some(sub) => cmd = sub.clone(),
                None => break cmd.render_usage().to_string(),
            },
            None => break cmd.render_usage().to_string(),
        }
    };
    let help = format!(
        "For more information, try 'berth {} -help'.",
        path.join(" ")
    );
    UsageError::new(
        message,
        format!("{}\n\n{help}", single_dash(usage.trim_end())),
    )
    .into()
}

/// Rewrites Nomad's single-dash long flags to clap's double-dash ones:
/// `-json` to `--json`, `-address=A` to `--address=A`, when the command
/// reached so far has a long flag of that name (its own or a global one).
/// A single-dash word whose first letter is no short flag of the command
/// is rewritten too, so that clap names the unknown flag as given rather
/// than its first letter. Short flags (`-t`, `-n 5`, `-n5`) and everything
/// after `--` are kept as they are; a flag's value is never rewritten.
pub fn normalise(root: &clap::Command, args: Vec<String>) -> Vec<String> {
    let mut at = Flags {
        cmd: root,
        globals: Vec::new(),
        root: true,
    };
    let mut out = Vec::with_capacity(args.len());
    let mut value_next = false;
    let mut raw = false;
    for a in args {
        if raw || std::mem::take(&mut value_next) {
            out.push(a);
            continue;
        }
        if a == "--" {
            raw = true;
            out.push(a);
            continue;
        }
        if let Some(flag) = a.strip_prefix("--") {
            if !flag.contains('=') {
                value_next = at.long(flag).is_some_and(takes_value);
            }
            out.push(a);
            continue;
        }
        if let Some(flag) = a.strip_prefix('-') {
            let name = flag.split_once('=').map_or(flag, |(n, _)| n);
            let first = name.chars().next();
            if name.len() > 1 && first.is_some_and(|c| c.is_ascii_alphabetic()) {
                let long = at.long(name);
                let builtin = at.builtin(name);
                if long.is_some() || builtin || first.is_none_or(|c| at.short(c).is_none()) {
                    value_next = !flag.contains('=') && long.is_some_and(takes_value);
                    out.push(format!("-{a}"));
                    continue;
                }
            } else if let Some(c) = first.filter(|_| name.len() == 1 && !flag.contains('=')) {
                value_next = at.short(c).is_some_and(takes_value);
            }
            out.push(a);
            continue;
        }
        if let Some(sub) = at.cmd.find_subcommand(&a) {
            at.descend(sub);
        }
        out.push(a);
    }
    out
}

/// The flags of the command the words reached: its own, and the global
/// ones of the commands above it (an unbuilt tree has not copied those
/// down yet).
struct Flags<'a> {
    cmd: &'a clap::Command,
    globals: Vec<&'a clap::Arg>,
    root: bool,
}

impl<'a> Flags<'a> {
    fn descend(&mut self, sub: &'a clap::Command) {
        let globals = self.cmd.get_arguments().filter(|a| a.is_global_set());
        self.globals.extend(globals);
        self.cmd = sub;
        self.root = false;
    }

    fn all(&self) -> impl Iterator<Item = &'a clap::Arg> + '_ {
        self.cmd.get_arguments().chain(self.globals.iter().copied())
    }

    fn long(&self, name: &str) -> Option<&'a clap::Arg> {
        self.all().find(|a| {
            a.get_long() == Some(name)
                || a.get_all_aliases()
                    .is_some_and(|aliases| aliases.contains(&name))
        })
    }

    fn short(&self, c: char) -> Option<&'a clap::Arg> {
        self.all().find(|a| {
            a.get_short() == Some(c)
                || a.get_all_short_aliases()
                    .is_some_and(|aliases| aliases.contains(&c))
        })
    }

    /// A flag clap adds as it builds a command, which an unbuilt one does
    /// not list yet: `help` everywhere, `version` at the root. Neither
    /// takes a value.
    fn builtin(&self, name: &str) -> bool {
        name == "help" || (self.root && name == "version")
    }
}

fn takes_value(arg: &clap::Arg) -> bool {
    arg.get_action().takes_values()
}

/// Runs the command line (without the program name); returns the process
/// exit code. A [`UsageError`] says the command line itself is wrong.
pub fn run(args: Vec<String>, host: &dyn Host) -> Result<i32> {
    let cli = match parse(args)? {
        Parsed::Run(cli) => *cli,
        Parsed::Print(text, 0) => {
            print!("{text}");
            return Ok(0);
        }
        Parsed::Print(text, code) => {
            eprint!("{text}");
            return Ok(code);
        }
    };
    let tls = berth_api::TlsFiles {
        ca_cert: cli.ca_cert.clone(),
        client_cert: cli.client_cert.clone(),
        client_key: cli.client_key.clone(),
    };
    let ctx = || Ctx::new(&cli.address, &tls, cli.token.as_deref());
    match cli.command {
        Command::Agent(a) => host.agent(*a),
        Command::Config(ConfigCommand::Validate { paths }) => {
            let valid = host.validate_config(&paths)?;
            println!("Configuration is valid ({})", valid.roles);
            for note in &valid.notes {
                println!("Note: {note}");
            }
            Ok(0)
        }
        Command::Job(cmd) => job::run(cmd, &ctx()?),
        Command::Alloc(cmd) => alloc::run(cmd, &ctx()?),
        Command::Deployment(cmd) => deployment::run(cmd, &ctx()?),
        Command::Node(cmd) => node::run(cmd, &ctx()?),
        Command::Volume(cmd) => volume::run(cmd, &ctx()?),
        Command::Plugin(cmd) => plugin::run(cmd, &ctx()?),
        Command::System(cmd) => system::run(cmd, &ctx()?),
        Command::Acl(cmd) => acl::run(cmd, &ctx()?),
        Command::Operator(cmd) => operator::run(cmd, &ctx()?),
        Command::Server(cmd) => server::run(cmd, &ctx()?),
        Command::Tls(cmd) => tls::run(cmd),
        Command::Version => {
            println!("berth {VERSION}");
            Ok(0)
        }
        Command::Completion { shell } => {
            let shell = match shell {
                CompletionShell::Bash => clap_complete::Shell::Bash,
                CompletionShell::Zsh => clap_complete::Shell::Zsh,
                CompletionShell::Fish => clap_complete::Shell::Fish,
            };
            clap_complete::generate(shell, &mut command(), "berth", &mut std::io::stdout());
            Ok(0)
        }
    }
}

/// Percent-encodes an ID for a URL path segment or query value.
fn enc(id: &str) -> String {
    berth_api::path_segment(id)
}

fn print_json(v: &Value) -> Result<i32> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(0)
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// What an operator's release could not do (the claims were freed anyway).
fn print_release_warnings(resp: &Value) {
    for w in strs(&resp["warnings"]) {
        println!("Warning: {w}");
    }
}

fn allocs_phrase(n: usize) -> String {
    berth_structs::text::count_of(n, "alloc", "allocs")
}

/// Reads a spec file (`kind` says which: "job file"). A file larger than
/// the API accepts is refused before it is read, so a huge file costs
/// neither memory nor a request.
fn read_spec(kind: &str, path: &str) -> Result<String> {
    use std::io::Read;
    let limit = berth_api::MAX_REQUEST_BODY as u64;
    let too_large = |size: String| {
        anyhow!(
            "{kind} {path} is {size}; the limit is {}",
            berth_api::describe_size(limit)
        )
    };
    let file = std::fs::File::open(path).with_context(|| format!("reading {path}"))?;
    let meta = file.metadata().with_context(|| format!("reading {path}"))?;
    if meta.is_dir() {
        bail!("{kind} {path} is a directory");
    }
    if meta.len() > limit {
        return Err(too_large(berth_api::describe_size(meta.len())));
    }
    // A pipe or a file that grows has no size up front: read one byte past
    // the limit at most.
    let mut raw = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut raw)
        .with_context(|| format!("reading {path}"))?;
    if raw.len() as u64 > limit {
        return Err(too_large(format!(
            "more than {}",
            berth_api::describe_size(limit)
        )));
    }
    String::from_utf8(raw).map_err(|e| {
        anyhow!(
            "{kind} {path} is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    /// `v` normalised as `parse` does it, on the unbuilt tree; the same
    /// on the built one (every global flag copied down).
    fn normalised(v: &[&str]) -> Vec<String> {
        let unbuilt = normalise(&command(), s(v));
        let mut built = command();
        built.build();
        assert_eq!(unbuilt, normalise(&built, s(v)), "{v:?}");
        unbuilt
    }

    fn parsed(v: &[&str]) -> Cli {
        match parse(s(v)) {
            Ok(Parsed::Run(cli)) => *cli,
            Ok(Parsed::Print(_, code)) => panic!("{v:?}: help, exit {code}"),
            Err(e) => panic!("{v:?}: {e:#}"),
        }
    }

    /// Every command path of the tree (`job`, `job run`, ...), without
    /// clap's `help` subcommands and hidden commands.
    fn command_paths(cmd: &clap::Command, prefix: &str, out: &mut Vec<String>) {
        for sub in cmd.get_subcommands() {
            if sub.get_name() == "help" || sub.is_hide_set() {
                continue;
            }
            let path = format!("{prefix}{}", sub.get_name());
            out.push(path.clone());
            command_paths(sub, &format!("{path} "), out);
        }
    }

    /// The e2e test of help on every command walks a static list of the
    /// commands: it has to name each command of the tree, and only those.
    #[test]
    fn the_e2e_list_of_commands_is_the_command_tree() {
        let mut tree = Vec::new();
        command_paths(&command(), "", &mut tree);
        tree.sort();
        let test = include_str!("../../tests/tests/cli_basics.rs");
        let start = test
            .find("const COMMANDS: &[&str] = &[")
            .expect("cli_basics.rs lists COMMANDS");
        let end = start + test[start..].find("];").expect("the end of COMMANDS");
        let mut listed: Vec<String> = test[start..end]
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        listed.sort();
        assert_eq!(
            listed, tree,
            "tests/tests/cli_basics.rs COMMANDS must list every command of the tree"
        );
    }

    #[test]
    fn the_command_tree_is_well_formed() {
        command().debug_assert();
    }

    #[test]
    fn ids_are_percent_encoded() {
        assert_eq!(enc("data[0]"), "data%5B0%5D");
        assert_eq!(enc("a/b c"), "a%2Fb%20c");
        assert_eq!(enc("plain-id_1.x~"), "plain-id_1.x~");
    }

    #[test]
    fn single_dash_long_flags_become_double_dash_ones() {
        assert_eq!(
            normalised(&["job", "status", "-json", "-address=http://h:1", "web"]),
            s(&["job", "status", "--json", "--address=http://h:1", "web"])
        );
        assert_eq!(
            normalised(&["-address", "http://h:1", "job", "run", "-detach", "x.hcl"]),
            s(&["--address", "http://h:1", "job", "run", "--detach", "x.hcl"])
        );
        // A value that looks like a flag is the flag's value, untouched.
        assert_eq!(
            normalised(&["agent", "-node", "-dev", "-dev"]),
            s(&["agent", "--node", "-dev", "--dev"])
        );
        // After `--` nothing is rewritten.
        assert_eq!(
            normalised(&["job", "status", "--", "-json"]),
            s(&["job", "status", "--", "-json"])
        );
        // -h stays short; -help is the long flag.
        assert_eq!(normalised(&["job", "-h"]), s(&["job", "-h"]));
        assert_eq!(normalised(&["job", "-help"]), s(&["job", "--help"]));
        // -tail is the long flag, not -t with "ail"; -n, -s, -f stay short.
        assert_eq!(
            normalised(&["alloc", "logs", "-tail", "-n", "5", "-f", "-stderr", "a1", "t"]),
            s(&["alloc", "logs", "--tail", "-n", "5", "-f", "--stderr", "a1", "t"])
        );
        assert_eq!(
            normalised(&["alloc", "signal", "-s", "-HUP", "a1"]),
            s(&["alloc", "signal", "-s", "-HUP", "a1"])
        );
        // An unknown word is named as given.
        assert_eq!(
            normalised(&["job", "status", "-bogus"]),
            s(&["job", "status", "--bogus"])
        );
    }

    #[test]
    fn flags_and_positionals() {
        let cli = parsed(&["job", "run", "-detach", "x.hcl"]);
        match cli.command {
            Command::Job(job::JobCommand::Run(a)) => {
                assert!(a.detach);
                assert_eq!(a.file, "x.hcl");
            }
            other => panic!("{other:?}"),
        }
        let cli = parsed(&["job", "status", "-address=http://h:1", "--json"]);
        assert_eq!(cli.address, "http://h:1");
        let e = match parse(s(&["job", "stop", "-json", "x"])) {
            Err(e) => e,
            Ok(_) => panic!("job stop takes no -json"),
        };
        let usage = e.downcast_ref::<UsageError>().expect("a usage error");
        assert_eq!(usage.to_string(), "unexpected argument '-json' found");
        assert!(parse(s(&["job", "stop", "-address"])).is_err());
    }

    #[test]
    fn help_shows_single_dash_long_flags_in_aligned_columns() {
        let Ok(Parsed::Print(help, 0)) = parse(s(&["job", "status", "-h"])) else {
            panic!("job status -h prints help");
        };
        assert!(!help.contains("--"), "{help}");
        // Where the description of the flag line starting with `flag` begins.
        let described = |flag: &str| {
            let line = help
                .lines()
                .find(|l| l.trim_start().starts_with(flag))
                .unwrap_or_else(|| panic!("{flag} in {help}"));
            let start = line.len() - line.trim_start().len();
            let gap = start + line[start..].find("  ").expect("a description");
            gap + line[gap..].len() - line[gap..].trim_start().len()
        };
        let columns: Vec<usize> = [
            "-json",
            "-t <TEMPLATE>",
            "-verbose",
            "-all-allocs",
            "-h, -help",
        ]
        .iter()
        .map(|f| described(f))
        .collect();
        assert!(
            columns.windows(2).all(|w| w[0] == w[1]),
            "{columns:?}: {help}"
        );
        assert_eq!(
            single_dash("Usage: berth alloc logs --tail -n <N> <ALLOC>\n\nOptions:\n  -f, --follow  Keep\n      --stderr  Print\n                more --text\n"),
            "Usage: berth alloc logs -tail -n <N> <ALLOC>\n\nOptions:\n  -f, -follow   Keep\n      -stderr   Print\n                more --text\n"
        );
    }

    #[test]
    fn help_and_version_print_and_exit_0() {
        for argv in [&["-h"][..], &["-help"], &["--help"], &["job", "run", "-h"]] {
            assert!(
                matches!(parse(s(argv)), Ok(Parsed::Print(ref help, 0)) if help.contains("Usage")),
                "{argv:?}"
            );
        }
        assert!(
            matches!(parse(s(&["-version"])), Ok(Parsed::Print(ref v, 0)) if v == "berth v0.1.0\n")
        );
        assert!(matches!(parse(s(&[])), Ok(Parsed::Print(_, 2))));
        // A missing flag is named with one dash too.
        match parse(s(&["alloc", "logs", "-n", "3", "a1"])) {
            Err(e) => assert_eq!(
                e.to_string(),
                "the following required arguments were not provided: -tail"
            ),
            Ok(_) => panic!("-n without -tail is a usage error"),
        }
        assert!(
            matches!(parse(s(&[])), Ok(Parsed::Print(ref help, 2)) if help.contains(" -address <ADDR>"))
        );
        assert!(matches!(parse(s(&["job"])), Ok(Parsed::Print(_, 2))));
    }
}
