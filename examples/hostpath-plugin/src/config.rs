//! Command line flags.
//!
//! Parsed by hand: every flag accepts both `--flag value` and `--flag=value`.
//! `--fail`, `--delay` and `--topology` may be given more than once.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

use crate::faults::{parse_delay_spec, parse_fail_spec, parse_hold_spec, FaultPlan};

/// Name of the environment variable through which a CO hands the endpoint.
pub const CSI_ENDPOINT_ENV: &str = "CSI_ENDPOINT";

pub const USAGE: &str = "\
hostpath-plugin: a CSI plugin that backs each volume with a directory on the host

USAGE:
    hostpath-plugin --endpoint unix:///path/to/csi.sock --state-dir DIR [OPTIONS]

OPTIONS:
    --endpoint unix://PATH   Unix socket to serve CSI on (default: $CSI_ENDPOINT)
    --state-dir DIR          Where volumes and the plugin state live (required).
                             May be shared by instances on several nodes
                             (see SHARED STATE)
    --node-id ID             Node ID reported by NodeGetInfo (default: the hostname)
    --enable-attach          Serve ControllerPublishVolume/ControllerUnpublishVolume
                             and require them before NodeStageVolume
    --stage-noop             NodeStageVolume of a directory volume mounts nothing
                             at the staging path (the CSI spec allows it; the
                             public hostpath driver does so), and
                             NodePublishVolume binds the volume's directory
    --topology KEY=VALUE[,KEY=VALUE...]
                             The topology segments this instance serves, e.g.
                             topology.hostpath.csi/node=node-a. Repeatable.
                             Reported by NodeGetInfo; volumes created through
                             this instance are accessible from these segments
                             only (see TOPOLOGY)
    --fail RPC=CODE[:COUNT]  Answer RPC with gRPC CODE (e.g. unavailable, internal),
                             for the first COUNT calls or, without COUNT, always.
                             Repeatable; rules for one RPC apply in order
    --delay RPC=DURATION     Delay every RPC call by DURATION (e.g. 500ms, 2s).
                             Repeatable
    --hold-after RPC=FILE    Once the work of an RPC call is done, hold its answer
                             until FILE exists. Repeatable
    -h, --help               Print this help
    -V, --version            Print the version

RPC is a CSI method name, e.g. NodeStageVolume. Logging is configured with
RUST_LOG (default: info) and goes to stderr.

SHARED STATE:
    Instances given the same --state-dir (a directory every node sees, e.g.
    over NFS) act as one storage system: a volume created through any of them
    can be staged and published through every one. Every change to
    DIR/state.json is made under an exclusive flock on DIR/state.lock, after
    re-reading the file, and written atomically; reads take a shared lock.
    Each instance registers its --node-id in the state, and with
    --enable-attach any registered node can be published to. Give each
    instance its own --node-id and --endpoint. What is staged or published on
    a node is never written to DIR: the node's own mount table is the record.
    Without --topology no topology is reported, so every node can reach
    every volume.

TOPOLOGY:
    With --topology, GetPluginCapabilities reports
    VOLUME_ACCESSIBILITY_CONSTRAINTS and NodeGetInfo the given segments.
    CreateVolume places the volume in this instance's segments (recorded in
    the state, answered as accessible_topology) and answers
    RESOURCE_EXHAUSTED when accessibility_requirements.requisite is given
    and no entry of it is satisfied by them (an entry is satisfied when each
    of its keys has this instance's value). NodeStageVolume of a volume on
    an instance whose segments do not satisfy the volume's topology answers
    FAILED_PRECONDITION. Volumes created without --topology are accessible
    from every instance.
";

/// The plugin configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Config {
    /// Path of the unix socket to listen on.
    pub socket_path: PathBuf,
    /// Directory holding the volumes and the state file.
    pub state_dir: PathBuf,
    /// The node ID reported by NodeGetInfo and accepted by ControllerPublishVolume.
    pub node_id: String,
    /// Whether the controller publish/unpublish RPCs are served.
    pub enable_attach: bool,
    /// NodeStageVolume of a directory volume mounts nothing
    /// (`--stage-noop`).
    pub stage_noop: bool,
    /// The topology segments this instance serves (`--topology`); empty
    /// when it reports no topology.
    pub topology: BTreeMap<String, String>,
    /// Injected failures and delays.
    pub faults: FaultPlan,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Run(Config),
    Help,
    Version,
}

/// A bad command line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("unknown flag `{0}`")]
    UnknownFlag(String),
    #[error("unexpected argument `{0}`")]
    UnexpectedArgument(String),
    #[error("flag `--{0}` needs a value")]
    MissingValue(&'static str),
    #[error("flag `--{0}` takes no value")]
    UnexpectedValue(&'static str),
    #[error("flag `--{0}` given more than once")]
    Repeated(&'static str),
    #[error("argument `{0}` is not valid UTF-8")]
    NotUtf8(String),
    #[error("no endpoint: pass `--endpoint unix://PATH` or set {CSI_ENDPOINT_ENV}")]
    NoEndpoint,
    #[error("invalid endpoint `{0}`: expected unix:///absolute/path")]
    BadEndpoint(String),
    #[error("`--state-dir` is required")]
    NoStateDir,
    #[error("`--{0}` must not be empty")]
    Empty(&'static str),
    #[error("invalid `--{flag}` value `{value}`: {reason}")]
    BadFault {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("invalid `--topology` value `{value}`: {reason}")]
    BadTopology { value: String, reason: String },
    #[error("cannot determine the hostname for the default node ID ({0}); pass `--node-id`")]
    NoHostname(String),
}

/// The flags that take a value.
const VALUE_FLAGS: [&str; 7] = [
    "endpoint",
    "state-dir",
    "node-id",
    "fail",
    "delay",
    "hold-after",
    "topology",
];

/// Parses the command line (without the program name). `env_endpoint` is the
/// value of `CSI_ENDPOINT`, used when `--endpoint` is absent; `hostname`
/// supplies the default node ID.
pub fn parse_args<I>(
    args: I,
    env_endpoint: Option<String>,
    hostname: impl FnOnce() -> Result<String, String>,
) -> Result<Command, ConfigError>
where
    I: IntoIterator<Item = OsString>,
{
    let mut endpoint: Option<String> = None;
    let mut state_dir: Option<String> = None;
    let mut node_id: Option<String> = None;
    let mut enable_attach = false;
    let mut stage_noop = false;
    let mut faults = FaultPlan::default();
    let mut topology = BTreeMap::new();

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let arg = arg
            .into_string()
            .map_err(|a| ConfigError::NotUtf8(a.to_string_lossy().into_owned()))?;
        let Some(flag) = arg.strip_prefix("--") else {
            return match arg.as_str() {
                "-h" => Ok(Command::Help),
                "-V" => Ok(Command::Version),
                a if a.starts_with('-') => Err(ConfigError::UnknownFlag(arg)),
                _ => Err(ConfigError::UnexpectedArgument(arg)),
            };
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (flag, None),
        };
        match name {
            "help" => return Ok(Command::Help),
            "version" => return Ok(Command::Version),
            "enable-attach" | "stage-noop" => {
                let (flag, on) = if name == "enable-attach" {
                    ("enable-attach", &mut enable_attach)
                } else {
                    ("stage-noop", &mut stage_noop)
                };
                if inline.is_some() {
                    return Err(ConfigError::UnexpectedValue(flag));
                }
                *on = true;
                continue;
            }
            _ => {}
        }
        let Some(&flag_name) = VALUE_FLAGS.iter().find(|f| **f == name) else {
            return Err(ConfigError::UnknownFlag(format!("--{name}")));
        };
        let value = match inline {
            Some(v) => v,
            None => args
                .next()
                .ok_or(ConfigError::MissingValue(flag_name))?
                .into_string()
                .map_err(|a| ConfigError::NotUtf8(a.to_string_lossy().into_owned()))?,
        };
        match flag_name {
            "endpoint" => set_once(&mut endpoint, "endpoint", value)?,
            "state-dir" => set_once(&mut state_dir, "state-dir", value)?,
            "node-id" => set_once(&mut node_id, "node-id", value)?,
            "fail" => {
                let (rpc, rule) =
                    parse_fail_spec(&value).map_err(|reason| ConfigError::BadFault {
                        flag: "fail",
                        value: value.clone(),
                        reason,
                    })?;
                faults.add_failure(rpc, rule);
            }
            "delay" => {
                let (rpc, delay) =
                    parse_delay_spec(&value).map_err(|reason| ConfigError::BadFault {
                        flag: "delay",
                        value: value.clone(),
                        reason,
                    })?;
                faults.set_delay(rpc, delay);
            }
            "hold-after" => {
                let (rpc, file) =
                    parse_hold_spec(&value).map_err(|reason| ConfigError::BadFault {
                        flag: "hold-after",
                        value: value.clone(),
                        reason,
                    })?;
                faults.set_hold_after(rpc, file);
            }
            "topology" => add_topology(&mut topology, &value)?,
            _ => unreachable!("every value flag is handled"),
        }
    }

    let endpoint = endpoint
        .or(env_endpoint.filter(|e| !e.is_empty()))
        .ok_or(ConfigError::NoEndpoint)?;
    let socket_path = parse_endpoint(&endpoint)?;
    let state_dir = state_dir.ok_or(ConfigError::NoStateDir)?;
    if state_dir.is_empty() {
        return Err(ConfigError::Empty("state-dir"));
    }
    let node_id = match node_id {
        Some(id) if id.is_empty() => return Err(ConfigError::Empty("node-id")),
        Some(id) => id,
        None => hostname().map_err(ConfigError::NoHostname)?,
    };
    Ok(Command::Run(Config {
        socket_path,
        state_dir: PathBuf::from(state_dir),
        node_id,
        enable_attach,
        stage_noop,
        topology,
        faults,
    }))
}

/// Adds the segments of one `--topology KEY=VALUE[,KEY=VALUE...]` value. A
/// key given twice must have the same value.
fn add_topology(topology: &mut BTreeMap<String, String>, value: &str) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError::BadTopology {
        value: value.to_owned(),
        reason,
    };
    for segment in value.split(',') {
        let (key, val) = segment
            .split_once('=')
            .ok_or_else(|| bad(format!("segment `{segment}` is not KEY=VALUE")))?;
        let (key, val) = (key.trim(), val.trim());
        if key.is_empty() || val.is_empty() {
            return Err(bad(format!(
                "segment `{segment}` needs a non-empty key and value"
            )));
        }
        if let Some(before) = topology.insert(key.to_owned(), val.to_owned()) {
            if before != val {
                return Err(bad(format!(
                    "key `{key}` is given both as `{before}` and as `{val}`"
                )));
            }
        }
    }
    Ok(())
}

fn set_once(
    slot: &mut Option<String>,
    flag: &'static str,
    value: String,
) -> Result<(), ConfigError> {
    if slot.replace(value).is_some() {
        return Err(ConfigError::Repeated(flag));
    }
    Ok(())
}

/// Parses `unix:///abs/path` (or `unix:/abs/path`) into the socket path.
pub fn parse_endpoint(endpoint: &str) -> Result<PathBuf, ConfigError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .ok_or_else(|| ConfigError::BadEndpoint(endpoint.to_owned()))?;
    if !path.starts_with('/') || path.len() < 2 {
        return Err(ConfigError::BadEndpoint(endpoint.to_owned()));
    }
    Ok(PathBuf::from(path))
}

/// The hostname of this machine, the default node ID.
pub fn hostname() -> Result<String, String> {
    let name = nix::unistd::gethostname().map_err(|e| e.to_string())?;
    let name = name
        .into_string()
        .map_err(|_| "hostname is not valid UTF-8".to_owned())?;
    if name.is_empty() {
        return Err("hostname is empty".to_owned());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::faults::FailRule;

    fn parse(args: &[&str]) -> Result<Command, ConfigError> {
        parse_args(args.iter().map(OsString::from), None, || {
            Ok("host-a".to_owned())
        })
    }

    fn run(args: &[&str]) -> Config {
        match parse(args) {
            Ok(Command::Run(c)) => c,
            other => panic!("expected a config, got {other:?}"),
        }
    }

    #[test]
    fn both_flag_forms() {
        let c = run(&[
            "--endpoint",
            "unix:///run/csi/hp.sock",
            "--state-dir=/var/lib/hp",
            "--node-id=n1",
            "--enable-attach",
        ]);
        assert_eq!(c.socket_path, PathBuf::from("/run/csi/hp.sock"));
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/hp"));
        assert_eq!(c.node_id, "n1");
        assert!(c.enable_attach);
        assert!(c.faults.is_empty());
    }

    #[test]
    fn defaults_from_env_and_hostname() {
        let cmd = parse_args(
            ["--state-dir", "/s"].map(OsString::from),
            Some("unix:///e.sock".to_owned()),
            || Ok("host-b".to_owned()),
        )
        .unwrap();
        let Command::Run(c) = cmd else {
            panic!("expected run")
        };
        assert_eq!(c.socket_path, PathBuf::from("/e.sock"));
        assert_eq!(c.node_id, "host-b");
        assert!(!c.enable_attach);
    }

    #[test]
    fn flag_overrides_env() {
        let cmd = parse_args(
            ["--state-dir", "/s", "--endpoint", "unix:///flag.sock"].map(OsString::from),
            Some("unix:///env.sock".to_owned()),
            || Ok("h".to_owned()),
        )
        .unwrap();
        let Command::Run(c) = cmd else {
            panic!("expected run")
        };
        assert_eq!(c.socket_path, PathBuf::from("/flag.sock"));
    }

    #[test]
    fn help_and_version() {
        assert_eq!(parse(&["--help"]), Ok(Command::Help));
        assert_eq!(parse(&["-h"]), Ok(Command::Help));
        assert_eq!(parse(&["--version"]), Ok(Command::Version));
        assert_eq!(parse(&["--endpoint", "x", "--help"]), Ok(Command::Help));
    }

    #[test]
    fn faults_are_repeatable() {
        let c = run(&[
            "--endpoint=unix:///a.sock",
            "--state-dir=/s",
            "--fail",
            "NodeStageVolume=unavailable:2",
            "--fail=NodeStageVolume=internal",
            "--delay",
            "NodePublishVolume=2s",
            "--delay=Probe=500ms",
            "--hold-after",
            "NodeUnstageVolume=/tmp/go",
        ]);
        assert_eq!(
            c.faults.failures("NodeStageVolume"),
            &[
                FailRule {
                    code: tonic::Code::Unavailable,
                    count: Some(2)
                },
                FailRule {
                    code: tonic::Code::Internal,
                    count: None
                },
            ]
        );
        assert_eq!(
            c.faults.delay("NodePublishVolume"),
            Some(Duration::from_secs(2))
        );
        assert_eq!(c.faults.delay("Probe"), Some(Duration::from_millis(500)));
        assert_eq!(c.faults.delay("NodeStageVolume"), None);
        assert_eq!(
            c.faults.hold_after("NodeUnstageVolume"),
            Some(&PathBuf::from("/tmp/go"))
        );
        assert_eq!(c.faults.hold_after("NodeStageVolume"), None);
    }

    #[test]
    fn topology_is_repeatable_and_commaed() {
        let c = run(&["--endpoint=unix:///a.sock", "--state-dir=/s"]);
        assert!(c.topology.is_empty(), "no topology by default");
        let c = run(&[
            "--endpoint=unix:///a.sock",
            "--state-dir=/s",
            "--topology",
            "topology.hostpath.csi/node=node-a,zone=z1",
            "--topology=rack=r7",
            "--topology=zone=z1",
        ]);
        assert_eq!(
            c.topology,
            BTreeMap::from([
                ("rack".to_owned(), "r7".to_owned()),
                ("topology.hostpath.csi/node".to_owned(), "node-a".to_owned()),
                ("zone".to_owned(), "z1".to_owned()),
            ])
        );
        for bad in ["zone", "zone=", "=z1", "zone=z1,", "zone=z1,zone=z2", ""] {
            let err = parse(&[
                "--endpoint=unix:///a.sock",
                "--state-dir=/s",
                "--topology",
                bad,
            ])
            .unwrap_err();
            assert!(
                matches!(&err, ConfigError::BadTopology { value, .. } if value == bad),
                "{bad}: {err}"
            );
        }
        assert_eq!(
            parse(&["--endpoint=unix:///a.sock", "--state-dir=/s", "--topology"]),
            Err(ConfigError::MissingValue("topology"))
        );
    }

    #[test]
    fn errors() {
        let base = ["--endpoint=unix:///a.sock", "--state-dir=/s"];
        let with = |extra: &[&str]| {
            let mut v: Vec<&str> = base.to_vec();
            v.extend_from_slice(extra);
            parse(&v)
        };
        assert_eq!(
            with(&["--bogus"]),
            Err(ConfigError::UnknownFlag("--bogus".into()))
        );
        assert_eq!(with(&["-x"]), Err(ConfigError::UnknownFlag("-x".into())));
        assert_eq!(
            with(&["stray"]),
            Err(ConfigError::UnexpectedArgument("stray".into()))
        );
        assert_eq!(
            with(&["--node-id"]),
            Err(ConfigError::MissingValue("node-id"))
        );
        assert_eq!(
            with(&["--enable-attach=yes"]),
            Err(ConfigError::UnexpectedValue("enable-attach"))
        );
        assert_eq!(
            with(&["--state-dir=/t"]),
            Err(ConfigError::Repeated("state-dir"))
        );
        assert_eq!(with(&["--node-id="]), Err(ConfigError::Empty("node-id")));
        assert!(matches!(
            with(&["--fail", "NodeStageVolume=bogus"]),
            Err(ConfigError::BadFault { flag: "fail", .. })
        ));
        assert!(matches!(
            with(&["--delay", "NoSuchRpc=1s"]),
            Err(ConfigError::BadFault { flag: "delay", .. })
        ));
        assert_eq!(
            parse(&["--state-dir=/s"]),
            Err(ConfigError::NoEndpoint),
            "no endpoint and no CSI_ENDPOINT"
        );
        assert_eq!(
            parse(&["--endpoint=unix:///a.sock"]),
            Err(ConfigError::NoStateDir)
        );
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("unix:///tmp/x.sock"),
            Ok(PathBuf::from("/tmp/x.sock"))
        );
        assert_eq!(
            parse_endpoint("unix:/tmp/x.sock"),
            Ok(PathBuf::from("/tmp/x.sock"))
        );
        for bad in [
            "/tmp/x.sock",
            "tcp://1.2.3.4:5",
            "unix://relative.sock",
            "unix://",
            "unix:///",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad} should be rejected");
        }
    }
}
