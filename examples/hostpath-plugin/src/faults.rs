//! Fault injection for tests: `--fail RPC=CODE[:COUNT]`, `--delay RPC=DURATION`
//! and `--hold-after RPC=FILE`.

use berth_sync::MutexExt;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use tonic::Code;

use crate::error::Error;

/// Every CSI method the plugin serves (implemented or not); the names that
/// `--fail` and `--delay` accept.
pub const RPC_NAMES: &[&str] = &[
    // Identity
    "GetPluginInfo",
    "GetPluginCapabilities",
    "Probe",
    // Controller
    "CreateVolume",
    "DeleteVolume",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "ValidateVolumeCapabilities",
    "ListVolumes",
    "GetCapacity",
    "ControllerGetCapabilities",
    "CreateSnapshot",
    "DeleteSnapshot",
    "ListSnapshots",
    "GetSnapshot",
    "ControllerExpandVolume",
    "ControllerGetVolume",
    "ControllerModifyVolume",
    // Node
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeGetVolumeStats",
    "NodeExpandVolume",
    "NodeGetCapabilities",
    "NodeGetInfo",
];

/// One `--fail` rule: answer `code` for the next `count` calls (forever when
/// `count` is `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailRule {
    pub code: Code,
    pub count: Option<u32>,
}

/// The faults asked for on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    failures: BTreeMap<&'static str, Vec<FailRule>>,
    delays: BTreeMap<&'static str, Duration>,
    holds: BTreeMap<&'static str, PathBuf>,
}

impl FaultPlan {
    /// Appends a failure rule; rules for one RPC apply in the order given.
    pub fn add_failure(&mut self, rpc: &'static str, rule: FailRule) {
        self.failures.entry(rpc).or_default().push(rule);
    }

    /// Sets the delay of an RPC (the last one given wins).
    pub fn set_delay(&mut self, rpc: &'static str, delay: Duration) {
        self.delays.insert(rpc, delay);
    }

    /// Holds the answer of every call of an RPC, once its work is done,
    /// until `file` exists (the last one given wins).
    pub fn set_hold_after(&mut self, rpc: &'static str, file: PathBuf) {
        self.holds.insert(rpc, file);
    }

    pub fn hold_after(&self, rpc: &str) -> Option<&PathBuf> {
        self.holds.get(rpc)
    }

    pub fn failures(&self, rpc: &str) -> &[FailRule] {
        self.failures.get(rpc).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn delay(&self, rpc: &str) -> Option<Duration> {
        self.delays.get(rpc).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.failures.is_empty() && self.delays.is_empty() && self.holds.is_empty()
    }
}

/// The live fault injector: counts calls down as rules are used up.
#[derive(Debug, Default)]
pub struct Faults {
    failures: HashMap<&'static str, Mutex<Vec<FailRule>>>,
    delays: HashMap<&'static str, Duration>,
    holds: HashMap<&'static str, PathBuf>,
}

/// How often a held answer looks for its file.
const HOLD_POLL: Duration = Duration::from_millis(50);

impl Faults {
    pub fn new(plan: &FaultPlan) -> Self {
        Self {
            failures: plan
                .failures
                .iter()
                .map(|(rpc, rules)| (*rpc, Mutex::new(rules.clone())))
                .collect(),
            delays: plan.delays.iter().map(|(k, v)| (*k, *v)).collect(),
            holds: plan.holds.iter().map(|(k, v)| (*k, v.clone())).collect(),
        }
    }

    /// Once the work of a call of `rpc` is done, holds its answer until
    /// the `--hold-after` file of `rpc` exists, if there is one: a test
    /// can stop the caller between the work and the answer.
    pub async fn hold_after(&self, rpc: &'static str) {
        let Some(file) = self.holds.get(rpc) else {
            return;
        };
        if !file.exists() {
            tracing::info!(rpc, file = %file.display(), "injected hold: the answer waits for the file");
            while !file.exists() {
                tokio::time::sleep(HOLD_POLL).await;
            }
        }
    }

    /// Applies the delay of `rpc`, then answers the injected failure, if any.
    pub async fn inject(&self, rpc: &'static str) -> Result<(), Error> {
        if let Some(delay) = self.delays.get(rpc) {
            tracing::info!(rpc, ?delay, "injected delay");
            tokio::time::sleep(*delay).await;
        }
        match self.next_failure(rpc) {
            Some(code) => {
                tracing::info!(rpc, ?code, "injected failure");
                Err(Error::Injected { rpc, code })
            }
            None => Ok(()),
        }
    }

    /// The code the next call of `rpc` must fail with, if any; uses up one
    /// call of the first rule that has calls left.
    fn next_failure(&self, rpc: &str) -> Option<Code> {
        let rules = self.failures.get(rpc)?;
        let mut rules = rules.locked();
        for rule in rules.iter_mut() {
            match &mut rule.count {
                None => return Some(rule.code),
                Some(0) => continue,
                Some(n) => {
                    *n -= 1;
                    return Some(rule.code);
                }
            }
        }
        None
    }
}

/// Looks up a CSI method name, returning its canonical static spelling.
fn rpc_name(name: &str) -> Result<&'static str, String> {
    RPC_NAMES
        .iter()
        .copied()
        .find(|r| *r == name)
        .ok_or_else(|| format!("unknown CSI RPC `{name}`"))
}

/// Parses `RPC=CODE[:COUNT]`.
pub fn parse_fail_spec(spec: &str) -> Result<(&'static str, FailRule), String> {
    let (rpc, value) = spec
        .split_once('=')
        .ok_or_else(|| "expected RPC=CODE[:COUNT]".to_owned())?;
    let rpc = rpc_name(rpc)?;
    let (code, count) = match value.split_once(':') {
        Some((code, count)) => {
            let count: u32 = count
                .parse()
                .ok()
                .filter(|c| *c > 0)
                .ok_or_else(|| format!("COUNT `{count}` is not a positive integer"))?;
            (code, Some(count))
        }
        None => (value, None),
    };
    Ok((
        rpc,
        FailRule {
            code: parse_code(code)?,
            count,
        },
    ))
}

/// Parses `RPC=DURATION`.
pub fn parse_delay_spec(spec: &str) -> Result<(&'static str, Duration), String> {
    let (rpc, value) = spec
        .split_once('=')
        .ok_or_else(|| "expected RPC=DURATION".to_owned())?;
    Ok((rpc_name(rpc)?, parse_duration(value)?))
}

/// Parses `RPC=FILE`.
pub fn parse_hold_spec(spec: &str) -> Result<(&'static str, PathBuf), String> {
    let (rpc, file) = spec
        .split_once('=')
        .ok_or_else(|| "expected RPC=FILE".to_owned())?;
    if file.is_empty() {
        return Err("FILE is empty".to_owned());
    }
    Ok((rpc_name(rpc)?, PathBuf::from(file)))
}

/// Parses a gRPC status code: a name in any case, with or without
/// underscores (`unavailable`, `DEADLINE_EXCEEDED`, `NotFound`), or its
/// number (1-16).
pub fn parse_code(s: &str) -> Result<Code, String> {
    if let Ok(n) = s.parse::<i32>() {
        return match Code::from_i32(n) {
            Code::Ok => Err("code 0 (OK) is not a failure".to_owned()),
            Code::Unknown if n != 2 => Err(format!("`{s}` is not a gRPC status code")),
            code => Ok(code),
        };
    }
    let norm: String = s
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let code = match norm.as_str() {
        "cancelled" | "canceled" => Code::Cancelled,
        "unknown" => Code::Unknown,
        "invalidargument" => Code::InvalidArgument,
        "deadlineexceeded" => Code::DeadlineExceeded,
        "notfound" => Code::NotFound,
        "alreadyexists" => Code::AlreadyExists,
        "permissiondenied" => Code::PermissionDenied,
        "resourceexhausted" => Code::ResourceExhausted,
        "failedprecondition" => Code::FailedPrecondition,
        "aborted" => Code::Aborted,
        "outofrange" => Code::OutOfRange,
        "unimplemented" => Code::Unimplemented,
        "internal" => Code::Internal,
        "unavailable" => Code::Unavailable,
        "dataloss" => Code::DataLoss,
        "unauthenticated" => Code::Unauthenticated,
        _ => return Err(format!("`{s}` is not a gRPC status code")),
    };
    Ok(code)
}

/// Parses a duration such as `500ms`, `2s`, `1.5s`, `1m`, `100us` or `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration `{s}` has no unit (ns, us, ms, s, m, h)"))?;
    let (number, unit) = s.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{number}` in duration `{s}` is not a number"))?;
    let unit_secs = match unit {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("unknown unit `{unit}` in duration `{s}`")),
    };
    Duration::try_from_secs_f64(value * unit_secs)
        .map_err(|e| format!("duration `{s}` is out of range: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_held_answer_waits_for_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        let mut plan = FaultPlan::default();
        plan.set_hold_after("NodeUnstageVolume", go.clone());
        let faults = std::sync::Arc::new(Faults::new(&plan));
        // Another RPC is not held.
        tokio::time::timeout(Duration::from_secs(5), faults.hold_after("NodeStageVolume"))
            .await
            .expect("not held");
        let held = tokio::spawn({
            let faults = faults.clone();
            async move { faults.hold_after("NodeUnstageVolume").await }
        });
        tokio::time::sleep(HOLD_POLL * 4).await;
        assert!(!held.is_finished(), "held while the file is missing");
        std::fs::write(&go, "").unwrap();
        tokio::time::timeout(Duration::from_secs(5), held)
            .await
            .expect("let go once the file exists")
            .unwrap();
        assert_eq!(
            parse_hold_spec("NodeUnstageVolume=/go"),
            Ok(("NodeUnstageVolume", PathBuf::from("/go")))
        );
        assert!(parse_hold_spec("NodeUnstageVolume=").is_err());
        assert!(parse_hold_spec("Nope=/go").is_err());
    }

    #[test]
    fn fail_specs() {
        assert_eq!(
            parse_fail_spec("NodeStageVolume=unavailable:2"),
            Ok((
                "NodeStageVolume",
                FailRule {
                    code: Code::Unavailable,
                    count: Some(2)
                }
            ))
        );
        assert_eq!(
            parse_fail_spec("Probe=DEADLINE_EXCEEDED"),
            Ok((
                "Probe",
                FailRule {
                    code: Code::DeadlineExceeded,
                    count: None
                }
            ))
        );
        assert_eq!(
            parse_fail_spec("CreateVolume=6:1").map(|(_, r)| r.code),
            Ok(Code::AlreadyExists)
        );
        assert_eq!(
            parse_fail_spec("CreateVolume=NotFound").map(|(_, r)| r.code),
            Ok(Code::NotFound)
        );
        for bad in [
            "NodeStageVolume",
            "NodeStageVolume=",
            "nodestagevolume=internal",
            "NodeStageVolume=bogus",
            "NodeStageVolume=internal:0",
            "NodeStageVolume=internal:-1",
            "NodeStageVolume=internal:x",
            "NodeStageVolume=0",
            "NodeStageVolume=17",
            "=internal",
        ] {
            assert!(parse_fail_spec(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn codes() {
        assert_eq!(parse_code("unavailable"), Ok(Code::Unavailable));
        assert_eq!(parse_code("Unavailable"), Ok(Code::Unavailable));
        assert_eq!(
            parse_code("failed_precondition"),
            Ok(Code::FailedPrecondition)
        );
        assert_eq!(
            parse_code("resource-exhausted"),
            Ok(Code::ResourceExhausted)
        );
        assert_eq!(parse_code("canceled"), Ok(Code::Cancelled));
        assert_eq!(parse_code("2"), Ok(Code::Unknown));
        assert_eq!(parse_code("16"), Ok(Code::Unauthenticated));
        assert!(parse_code("ok").is_err());
        assert!(parse_code("0").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "5", "s", "-1s", "1d", "1.2.3s", "ms500"] {
            assert!(parse_duration(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn delay_specs() {
        assert_eq!(
            parse_delay_spec("NodePublishVolume=2s"),
            Ok(("NodePublishVolume", Duration::from_secs(2)))
        );
        assert!(parse_delay_spec("NodePublishVolume").is_err());
        assert!(parse_delay_spec("Bogus=1s").is_err());
    }

    #[test]
    fn counted_rules_run_out_in_order() {
        let mut plan = FaultPlan::default();
        plan.add_failure(
            "NodeStageVolume",
            FailRule {
                code: Code::Unavailable,
                count: Some(2),
            },
        );
        plan.add_failure(
            "NodeStageVolume",
            FailRule {
                code: Code::Internal,
                count: Some(1),
            },
        );
        let faults = Faults::new(&plan);
        let got: Vec<_> = (0..5)
            .map(|_| faults.next_failure("NodeStageVolume"))
            .collect();
        assert_eq!(
            got,
            [
                Some(Code::Unavailable),
                Some(Code::Unavailable),
                Some(Code::Internal),
                None,
                None
            ]
        );
        assert_eq!(faults.next_failure("Probe"), None);
    }

    #[test]
    fn uncounted_rule_is_forever() {
        let mut plan = FaultPlan::default();
        plan.add_failure(
            "Probe",
            FailRule {
                code: Code::Unavailable,
                count: None,
            },
        );
        let faults = Faults::new(&plan);
        for _ in 0..10 {
            assert_eq!(faults.next_failure("Probe"), Some(Code::Unavailable));
        }
    }

    #[tokio::test]
    async fn inject_delays_then_fails() {
        let mut plan = FaultPlan::default();
        plan.set_delay("Probe", Duration::from_millis(50));
        plan.add_failure(
            "Probe",
            FailRule {
                code: Code::Aborted,
                count: Some(1),
            },
        );
        let faults = Faults::new(&plan);
        let start = tokio::time::Instant::now();
        let err = faults.inject("Probe").await.unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert_eq!(tonic::Status::from(err).code(), Code::Aborted);
        assert!(faults.inject("Probe").await.is_ok());
    }
}
