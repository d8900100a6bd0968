//! Property tests of the parsers and the checks: the HCL job and volume
//! specs on arbitrary text and on generated near-valid specs, and `Job` and
//! `CsiVolume` decoded from arbitrary and mutated JSON. Whatever comes in,
//! the answer is a value or an error with a line, never a panic; and what
//! passes `validate` has names that pass the node's rule and numbers
//! within their limits.
//!
//! Each property runs a fixed number of cases (its `ProptestConfig`), so the
//! whole file finishes in a few seconds.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use berth_structs::limits::{
    MAX_COUNT, MAX_CPU_MHZ, MAX_DURATION, MAX_MEMORY_MB, MAX_RESTART_ATTEMPTS,
    MAX_VOLUME_CAPACITY_BYTES,
};
use berth_structs::spec::{parse_job, parse_volume, SpecError};
use berth_structs::{is_valid_name, CsiVolume, Job};
use berth_testutil::json;
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::Value;

const WRITER: &str = include_str!("../../examples/jobs/writer.hcl");
const HOSTPATH_PLUGIN: &str = include_str!("../../examples/jobs/hostpath-plugin.hcl");
const HOSTPATH_VOLUME: &str = include_str!("../../examples/volumes/hostpath.hcl");

fn config(cases: u32) -> Config {
    Config {
        cases,
        // Shrinking is bounded too, so a failure is reported promptly.
        max_shrink_iters: 2_000,
        ..Config::default()
    }
}

/// An error points at a line of the text (or the one after its end).
fn check_line(src: &str, e: &SpecError) -> Result<(), TestCaseError> {
    let lines = src.lines().count().max(1);
    prop_assert!(
        e.line >= 1 && e.line <= lines + 1,
        "line {} of {lines}: {e}",
        e.line
    );
    prop_assert!(!e.message.is_empty());
    Ok(())
}

/// Every name a node turns into a path, and every number with a limit, of
/// a job that passed `validate`.
fn check_validated_job(job: &Job) -> Result<(), TestCaseError> {
    prop_assert!(is_valid_name(&job.id), "job ID {:?}", job.id);
    for g in &job.task_groups {
        prop_assert!(is_valid_name(&g.name), "group {:?}", g.name);
        prop_assert!(g.count <= MAX_COUNT);
        prop_assert!(g.restart.attempts <= MAX_RESTART_ATTEMPTS);
        prop_assert!(g.restart.interval <= MAX_DURATION && g.restart.delay <= MAX_DURATION);
        prop_assert!(g
            .stop_after_client_disconnect
            .is_none_or(|d| d <= MAX_DURATION));
        for (key, v) in &g.volumes {
            prop_assert!(is_valid_name(key), "volume {key:?}");
            prop_assert!(is_valid_name(&v.source), "source {:?}", v.source);
            if v.per_alloc {
                for i in 0..g.count {
                    prop_assert!(is_valid_name(&v.source_for(i)), "{:?}", v.source_for(i));
                }
            }
        }
        for t in &g.tasks {
            prop_assert!(is_valid_name(&t.name), "task {:?}", t.name);
            prop_assert!(t.resources.cpu <= MAX_CPU_MHZ);
            prop_assert!(t.resources.memory_mb <= MAX_MEMORY_MB);
            prop_assert!(t.kill_timeout.is_none_or(|d| d <= MAX_DURATION));
            if let Some(p) = &t.csi_plugin {
                prop_assert!(is_valid_name(&p.id), "plugin {:?}", p.id);
                prop_assert!(p.health_timeout <= MAX_DURATION);
            }
        }
    }
    Ok(())
}

fn check_validated_volume(v: &CsiVolume) -> Result<(), TestCaseError> {
    prop_assert!(is_valid_name(&v.id), "volume ID {:?}", v.id);
    prop_assert!(is_valid_name(&v.plugin_id), "plugin_id {:?}", v.plugin_id);
    for c in [v.capacity_min, v.capacity_max, Some(v.capacity)]
        .into_iter()
        .flatten()
    {
        prop_assert!(c <= MAX_VOLUME_CAPACITY_BYTES);
    }
    Ok(())
}

fn check_job_spec(src: &str) -> Result<(), TestCaseError> {
    match parse_job(src) {
        Ok(job) => {
            if job.validate().is_ok() {
                check_validated_job(&job)?;
            }
        }
        Err(e) => check_line(src, &e)?,
    }
    Ok(())
}

fn check_volume_spec(src: &str) -> Result<(), TestCaseError> {
    match parse_volume(src) {
        Ok(v) => {
            for register in [false, true] {
                if v.validate(register).is_ok() {
                    check_validated_volume(&v)?;
                }
            }
        }
        Err(e) => check_line(src, &e)?,
    }
    Ok(())
}

/// Names as an operator or an attacker might write them.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => "[a-z][a-z0-9_.-]{0,12}",
        1 => "[a-z]{1,4}\\[[0-9]{1,3}\\]",
        1 => Just("../x".to_string()),
        1 => Just("..".to_string()),
        1 => Just(".".to_string()),
        1 => Just(String::new()),
        1 => Just("../../../../../escape_target".to_string()),
        1 => "[a-z./ \\[\\]-]{0,8}",
        1 => "\\PC{0,6}",
        1 => "[a-z]{120,140}",
    ]
}

/// Numbers as written in HCL: small, at and beyond `u64`, negative,
/// fractional, with exponents.
fn number_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (0u64..20_000).prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => "[1-9][0-9]{19,40}",
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => "-[1-9][0-9]{19,40}",
        1 => (0u32..100_000, 0u32..1000).prop_map(|(a, b)| format!("{a}.{b}")),
        1 => "[0-9]{1,3}(\\.[0-9]{1,3})?[eE][+-]?[0-9]{1,3}",
        1 => Just("0.0".to_string()),
        1 => Just("-0".to_string()),
    ]
}

/// Durations as written: sane, huge, overflowing, malformed.
fn duration_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (0u64..100_000, prop::sample::select(vec!["ms", "s", "m", "h", "d", "y"]))
            .prop_map(|(n, u)| format!("{n}{u}")),
        1 => "[0-9]{10,30}(s|h|y)",
        1 => "[a-z0-9 ]{0,6}",
    ]
}

/// A string literal of HCL holding `s` verbatim.
fn hcl_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    // `${` and `%{` open templates; `$${` and `%%{` are their escapes.
    out.replace("${", "$${").replace("%{", "%%{")
}

/// The parts of a near-valid job spec.
#[derive(Debug, Clone)]
struct JobParts {
    job: String,
    group: String,
    task: String,
    volume: String,
    source: String,
    plugin: String,
    per_alloc: bool,
    count: String,
    cpu: String,
    memory: String,
    attempts: String,
    interval: String,
    kill_timeout: String,
}

/// Mostly a sane value, sometimes a wild one: so that many specs are valid
/// but for one or two fields, and some are valid throughout.
fn mostly<T: std::fmt::Debug + Clone>(
    sane: impl Strategy<Value = T> + 'static,
    wild: impl Strategy<Value = T> + 'static,
) -> BoxedStrategy<T> {
    prop_oneof![9 => sane, 1 => wild].boxed()
}

fn sane_name() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9_.-]{0,12}"
}

fn sane_number(max: u64) -> impl Strategy<Value = String> {
    (0..=max.min(1000)).prop_map(|n| n.to_string())
}

fn sane_duration() -> impl Strategy<Value = String> {
    (1u32..1000, prop::sample::select(vec!["ms", "s", "m", "h"]))
        .prop_map(|(n, u)| format!("{n}{u}"))
}

fn job_parts() -> impl Strategy<Value = JobParts> {
    let n = || mostly(sane_name(), name());
    (
        (n(), n(), n(), n(), n(), n(), any::<bool>()),
        (
            mostly(sane_number(u64::from(MAX_COUNT)), number_text()),
            mostly(sane_number(MAX_CPU_MHZ), number_text()),
            mostly(sane_number(MAX_MEMORY_MB), number_text()),
            mostly(sane_number(u64::from(MAX_RESTART_ATTEMPTS)), number_text()),
        ),
        (
            mostly(sane_duration(), duration_text()),
            mostly(sane_duration(), duration_text()),
        ),
    )
        .prop_map(
            |(
                (job, group, task, volume, source, plugin, per_alloc),
                (count, cpu, memory, attempts),
                (interval, kill_timeout),
            )| JobParts {
                job,
                group,
                task,
                volume,
                source,
                plugin,
                per_alloc,
                count,
                cpu,
                memory,
                attempts,
                interval,
                kill_timeout,
            },
        )
}

fn render_job(p: &JobParts) -> String {
    format!(
        r#"job {job} {{
  group {group} {{
    count = {count}
    restart {{
      attempts = {attempts}
      interval = {interval}
    }}
    volume {volume} {{
      type            = "csi"
      source          = {source}
      access_mode     = "multi-node-multi-writer"
      attachment_mode = "file-system"
      per_alloc       = {per_alloc}
    }}
    task {task} {{
      driver       = "raw_exec"
      kill_timeout = {kill_timeout}
      config {{
        command = "/bin/true"
      }}
      resources {{
        cpu    = {cpu}
        memory = {memory}
      }}
      volume_mount {{
        volume      = {volume}
        destination = "data"
      }}
      csi_plugin {{
        id        = {plugin}
        type      = "monolith"
        mount_dir = "/csi"
      }}
    }}
  }}
}}
"#,
        job = hcl_quote(&p.job),
        group = hcl_quote(&p.group),
        task = hcl_quote(&p.task),
        volume = hcl_quote(&p.volume),
        source = hcl_quote(&p.source),
        plugin = hcl_quote(&p.plugin),
        per_alloc = p.per_alloc,
        count = p.count,
        cpu = p.cpu,
        memory = p.memory,
        attempts = p.attempts,
        interval = hcl_quote(&p.interval),
        kill_timeout = hcl_quote(&p.kill_timeout),
    )
}

/// What a number literal should become for an attribute whose limit is
/// `max`: Ok(value), or the end of the error message.
fn expected_number(text: &str, max: u64) -> Option<Result<u64, String>> {
    let f: f64 = text.parse().ok()?;
    if !f.is_finite() {
        // Not a number HCL can hold: some error, whichever.
        return None;
    }
    if text.starts_with('-') && f != 0.0 {
        return Some(Err(format!("{text} must not be negative")));
    }
    if f.fract() != 0.0 {
        return Some(Err(format!("must be a whole number, not {text}")));
    }
    let too_large = Err(format!("{text} is too large (at most {max})"));
    let value = if text.bytes().all(|b| b.is_ascii_digit()) {
        match text.parse::<u128>() {
            Ok(v) => v,
            Err(_) => return Some(too_large),
        }
    } else {
        // As hcl-edit reads it: a float, exact below 2^64.
        if f >= 18_446_744_073_709_551_616.0 {
            return Some(too_large);
        }
        f as u128
    };
    Some(if value > u128::from(max) {
        too_large
    } else {
        Ok(value as u64)
    })
}

/// One item of a randomly nested HCL body.
#[derive(Debug, Clone)]
enum Item {
    Attr(String, String),
    Block(String, Vec<String>, Vec<Item>),
}

fn ident() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop::sample::select(vec![
            "job", "group", "task", "volume", "config", "resources", "restart",
            "csi_plugin", "volume_mount", "meta", "env", "mount_options", "capability",
            "secrets", "parameters", "context", "id", "type", "plugin_id", "count",
            "driver", "command", "args", "cpu", "memory", "source", "access_mode",
            "attachment_mode", "per_alloc", "read_only", "destination", "mount_dir",
            "health_timeout", "kill_timeout", "capacity_min", "capacity_max", "attempts",
            "interval", "delay", "mode", "priority", "datacenters", "external_id",
        ])
        .prop_map(str::to_string),
        1 => "[a-z_][a-z0-9_]{0,6}",
    ]
}

fn value_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => name().prop_map(|n| hcl_quote(&n)),
        2 => number_text(),
        1 => duration_text().prop_map(|d| hcl_quote(&d)),
        1 => any::<bool>().prop_map(|b| b.to_string()),
        1 => prop::collection::vec(name(), 0..3)
            .prop_map(|v| format!("[{}]", v.iter().map(|s| hcl_quote(s)).collect::<Vec<_>>().join(", "))),
        1 => (ident(), name()).prop_map(|(k, v)| format!("{{ {k} = {} }}", hcl_quote(&v))),
        1 => prop::sample::select(vec![
            "null", "var.x", "x", "1 + 1", "-x", "(1)", "f(1)", "\"${a.b}\"", "\"${upper(x)}\"",
            "\"%{ if true }x%{ endif }\"", "<<EOT\nhi\nEOT", "[for x in y: x]", "true ? 1 : 2",
            "\"unterminated", "{", "]", "1e999", "0x10", "\"\\u00e9\"",
        ])
        .prop_map(str::to_string),
    ]
}

fn items() -> impl Strategy<Value = Vec<Item>> {
    let leaf = (ident(), value_text()).prop_map(|(k, v)| Item::Attr(k, v));
    let item = leaf.prop_recursive(4, 48, 6, |inner| {
        (
            ident(),
            prop::collection::vec(name(), 0..3),
            prop::collection::vec(inner, 0..6),
        )
            .prop_map(|(i, labels, body)| Item::Block(i, labels, body))
    });
    prop::collection::vec(item, 0..8)
}

fn render_items(items: &[Item], depth: usize, out: &mut String) {
    let pad = "  ".repeat(depth);
    for item in items {
        match item {
            Item::Attr(k, v) => out.push_str(&format!("{pad}{k} = {v}\n")),
            Item::Block(i, labels, body) => {
                out.push_str(&format!("{pad}{i}"));
                for l in labels {
                    out.push(' ');
                    out.push_str(&hcl_quote(l));
                }
                out.push_str(" {\n");
                render_items(body, depth + 1, out);
                out.push_str(&format!("{pad}}}\n"));
            }
        }
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// 1024 cases.
    #[test]
    fn parsers_take_any_text(src in prop_oneof![
        any::<String>(),
        "[a-z{}\\[\\]=\" \n0-9.,-]{0,200}",
        prop::collection::vec(any::<u8>(), 0..200)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]) {
        check_job_spec(&src)?;
        check_volume_spec(&src)?;
    }

    /// 1024 cases.
    #[test]
    fn parsers_take_the_examples_cut_and_spliced(
        which in 0usize..3,
        cut in any::<prop::sample::Index>(),
        len in 0usize..40,
        insert in "[a-z{}\\[\\]=\"$%~ \n0-9.,-]{0,12}",
    ) {
        let base = [WRITER, HOSTPATH_PLUGIN, HOSTPATH_VOLUME][which];
        let mut at = cut.index(base.len() + 1);
        while !base.is_char_boundary(at) {
            at -= 1;
        }
        let mut end = (at + len).min(base.len());
        while !base.is_char_boundary(end) {
            end -= 1;
        }
        let src = format!("{}{insert}{}", &base[..at], &base[end..]);
        check_job_spec(&src)?;
        check_volume_spec(&src)?;
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// 512 cases: the job spec with every name, number and duration drawn
    /// from what operators and attackers write.
    #[test]
    fn near_valid_job_specs_parse_or_fail_with_a_line(parts in job_parts()) {
        let src = render_job(&parts);
        check_job_spec(&src)?;
        if let Ok(job) = parse_job(&src) {
            // Names survive parsing untouched.
            let plain = |s: &str| !s.contains(['$', '%', '\\']);
            let g = &job.task_groups[0];
            if plain(&parts.job) {
                prop_assert_eq!(&job.id, &parts.job);
            }
            if plain(&parts.task) {
                prop_assert_eq!(&g.tasks[0].name, &parts.task);
            }
            if plain(&parts.source) {
                prop_assert_eq!(&g.volumes[&g.volumes.keys().next().cloned().unwrap_or_default()].source, &parts.source);
            }
        }
    }

    /// 512 cases: a number in each attribute with a limit is taken, or
    /// refused as negative, fractional or too large, as written, on its
    /// line.
    #[test]
    fn numbers_are_taken_or_refused_for_the_right_reason(text in number_text()) {
        let valid = JobParts {
            job: "j".into(),
            group: "g".into(),
            task: "t".into(),
            volume: "v".into(),
            source: "v".into(),
            plugin: "p".into(),
            per_alloc: true,
            count: "1".into(),
            cpu: "100".into(),
            memory: "64".into(),
            attempts: "2".into(),
            interval: "30m".into(),
            kill_timeout: "5s".into(),
        };
        type Pick = fn(&Job) -> u64;
        let cases: [(&str, u64, usize, Pick); 4] = [
            ("count", u64::from(MAX_COUNT), 3, |j| u64::from(j.task_groups[0].count)),
            ("attempts", u64::from(MAX_RESTART_ATTEMPTS), 5, |j| {
                u64::from(j.task_groups[0].restart.attempts)
            }),
            ("cpu", MAX_CPU_MHZ, 22, |j| j.task_groups[0].tasks[0].resources.cpu),
            ("memory", MAX_MEMORY_MB, 23, |j| j.task_groups[0].tasks[0].resources.memory_mb),
        ];
        for (attr, max, line, pick) in cases {
            let mut parts = valid.clone();
            match attr {
                "count" => parts.count = text.clone(),
                "attempts" => parts.attempts = text.clone(),
                "cpu" => parts.cpu = text.clone(),
                _ => parts.memory = text.clone(),
            }
            let src = render_job(&parts);
            let got = parse_job(&src);
            match (expected_number(&text, max), got) {
                (Some(Ok(v)), Ok(job)) => {
                    prop_assert_eq!(pick(&job), v, "{} = {}", attr, text);
                    job.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                (Some(Err(end)), Err(e)) => {
                    prop_assert_eq!(e.line, line, "{}", e);
                    prop_assert!(e.message.starts_with(&format!("attribute {attr:?} in ")), "{}", e);
                    prop_assert!(e.message.ends_with(&end), "{} = {}: {} (want ...{})", attr, text, e, end);
                }
                (None, Err(e)) => check_line(&src, &e)?,
                (want, got) => prop_assert!(false, "{} = {}: want {:?}, got {:?}", attr, text, want, got.map(|_| "a job")),
            }
        }
        // A capacity in the volume spec: the same rules in bytes.
        let src = format!("id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\ncapacity_max = {text}\n");
        match (expected_number(&text, MAX_VOLUME_CAPACITY_BYTES), parse_volume(&src)) {
            (Some(Ok(v)), Ok(vol)) => prop_assert_eq!(vol.capacity_max, Some(v)),
            (Some(Err(_)), Err(e)) | (None, Err(e)) => prop_assert_eq!(e.line, 4, "{}", e),
            (want, got) => prop_assert!(false, "capacity_max = {}: want {:?}, got {:?}", text, want, got),
        }
    }

    /// 512 cases: randomly nested blocks and attributes, with and without
    /// a job block around them.
    #[test]
    fn nested_bodies_parse_or_fail_with_a_line(body in items(), wrap in any::<bool>(), label in name()) {
        let mut src = String::new();
        if wrap {
            src.push_str(&format!("job {} {{\n", hcl_quote(&label)));
            render_items(&body, 1, &mut src);
            src.push_str("}\n");
        } else {
            render_items(&body, 0, &mut src);
        }
        check_job_spec(&src)?;
        check_volume_spec(&src)?;
    }
}

/// A valid job and volume as JSON, to mutate.
fn valid_job_json() -> Value {
    serde_json::to_value(parse_job(WRITER).expect("writer parses")).expect("to JSON")
}

fn valid_volume_json() -> Value {
    let mut v = parse_volume(HOSTPATH_VOLUME).expect("volume parses");
    v.external_id = "ext-1".into();
    serde_json::to_value(v).expect("to JSON")
}

/// Edits of a valid job or volume: mostly a value of the node's own type
/// (a name or a duration for a string, an extreme number for a number),
/// which decodes far more often; else any value, or a node removed or
/// added.
fn edit() -> impl Strategy<Value = json::Edit> {
    let strings = prop_oneof![name(), duration_text()].boxed();
    let values = json::value_of(json::leaf_of(strings.clone()));
    prop_oneof![
        7 => json::replace_in_kind(strings, values.clone()),
        3 => json::replace(values.clone()),
        1 => json::remove(),
        1 => json::insert(values),
    ]
}

fn check_job_json(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(job) = serde_json::from_slice::<Job>(bytes) {
        if job.validate().is_ok() {
            check_validated_job(&job)?;
        }
    }
    Ok(())
}

fn check_volume_json(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(v) = serde_json::from_slice::<CsiVolume>(bytes) {
        for register in [false, true] {
            if v.validate(register).is_ok() {
                check_validated_volume(&v)?;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(1024))]

    /// 1024 cases.
    #[test]
    fn json_decoding_takes_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        check_job_json(&bytes)?;
        check_volume_json(&bytes)?;
    }

    /// 1024 cases: valid JSON text with bytes cut out and others spliced in.
    #[test]
    fn damaged_json_text_decodes_or_fails(damage in json::damage()) {
        for text in [valid_job_json().to_string(), valid_volume_json().to_string()] {
            let damaged = damage.apply(text.as_bytes());
            check_job_json(&damaged)?;
            check_volume_json(&damaged)?;
        }
    }
}

proptest! {
    #![proptest_config(config(1280))]

    /// 1280 cases: up to four fields of a valid job and volume replaced by
    /// extreme or wrongly typed values, removed or added, then decoded and
    /// validated.
    #[test]
    fn mutated_json_decodes_and_validates_without_panic(
        edits in prop::collection::vec(edit(), 1..5),
    ) {
        let job = json::edited(valid_job_json(), &edits);
        check_job_json(job.to_string().as_bytes())?;
        let volume = json::edited(valid_volume_json(), &edits);
        check_volume_json(volume.to_string().as_bytes())?;
    }
}

#[test]
fn the_limits_of_durations_hold_for_json_too() {
    let mut job: Job = serde_json::from_value(valid_job_json()).expect("decode");
    job.task_groups[0].restart.delay = MAX_DURATION;
    job.validate().expect("the limit itself is allowed");
    job.task_groups[0].restart.delay = MAX_DURATION + Duration::from_nanos(1);
    assert!(job.validate().is_err());
}
