//! Validation at the door: names that become paths on a node and numbers
//! with limits, refused when a job or volume is parsed or validated, with a
//! message that names the field, the value and what is allowed.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use berth_structs::limits::{
    MAX_COUNT, MAX_CPU_MHZ, MAX_DURATION, MAX_MEMORY_MB, MAX_VOLUME_CAPACITY_BYTES,
};
use berth_structs::names::NAME_RULE;
use berth_structs::spec::{parse_job, parse_volume, SpecError};
use berth_structs::{AccessMode, AttachmentMode, CsiVolume, Job, VolumeCapability, VolumeRequest};

/// A valid one-group, one-task job with `{group}`, `{task}`, `{count}`,
/// `{plugin}` and `{source}` to fill in; the count is on line 3.
const TEMPLATE: &str = r#"job "{job}" {
  group "{group}" {
    count = {count}
    volume "{volume}" {
      type            = "csi"
      source          = "{source}"
      access_mode     = "multi-node-multi-writer"
      attachment_mode = "file-system"
      per_alloc       = {per_alloc}
    }
    task "{task}" {
      driver = "raw_exec"
      config {
        command = "/bin/true"
      }
      resources {
        cpu    = {cpu}
        memory = {memory}
      }
      csi_plugin {
        id        = "{plugin}"
        type      = "monolith"
        mount_dir = "/csi"
      }
    }
  }
}
"#;

fn job_src(replace: &[(&str, &str)]) -> String {
    let defaults = [
        ("{job}", "j"),
        ("{group}", "g"),
        ("{count}", "1"),
        ("{volume}", "data"),
        ("{source}", "data"),
        ("{per_alloc}", "false"),
        ("{task}", "web"),
        ("{cpu}", "100"),
        ("{memory}", "64"),
        ("{plugin}", "hostpath"),
    ];
    let mut src = TEMPLATE.to_string();
    for (key, default) in defaults {
        let value = replace
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(default, |(_, v)| v);
        src = src.replace(key, value);
    }
    src
}

fn parsed(replace: &[(&str, &str)]) -> Job {
    parse_job(&job_src(replace)).expect("parse")
}

fn parse_err(replace: &[(&str, &str)]) -> SpecError {
    match parse_job(&job_src(replace)) {
        Ok(job) => panic!("expected a parse error, got {job:#?}"),
        Err(e) => e,
    }
}

fn validation_messages(job: &Job) -> Vec<String> {
    match job.validate() {
        Ok(()) => panic!("expected validation to fail for {job:#?}"),
        Err(e) => e.0,
    }
}

#[test]
fn the_template_is_valid() {
    parsed(&[]).validate().expect("validate");
}

#[test]
fn task_name_with_dot_dot_is_refused_naming_the_field() {
    let msgs = validation_messages(&parsed(&[("{task}", "../x")]));
    assert_eq!(
        msgs,
        [format!(
            "group \"g\" task \"../x\": task name \"../x\" is not allowed (it contains '/'): \
             {NAME_RULE}"
        )]
    );
}

#[test]
fn csi_plugin_id_with_dot_dot_is_refused_naming_the_field() {
    let msgs = validation_messages(&parsed(&[("{plugin}", "../../etc")]));
    assert_eq!(
        msgs,
        [format!(
            "group \"g\" task \"web\": csi_plugin.id \"../../etc\" is not allowed \
             (it contains '/'): {NAME_RULE}"
        )]
    );
}

#[test]
fn every_name_that_becomes_a_path_is_checked() {
    for (key, value, field) in [
        ("{job}", "../j", "job ID"),
        ("{job}", "a b", "job ID"),
        ("{group}", "..", "group name"),
        ("{task}", ".", "task name"),
        ("{task}", ".executor", "task name"),
        ("{volume}", "x/y", "volume name"),
        ("{source}", "../../../../../escape_target", "source"),
        ("{plugin}", "", "csi_plugin.id"),
    ] {
        let msgs = validation_messages(&parsed(&[(key, value)]));
        let wanted = format!("{field} {value:?} is not allowed");
        assert!(
            msgs.iter().any(|m| m.contains(&wanted)),
            "{key} = {value:?}: {msgs:?}"
        );
    }
}

#[test]
fn task_name_alloc_is_reserved() {
    let msgs = validation_messages(&parsed(&[("{task}", "alloc")]));
    assert_eq!(
        msgs,
        [
            "group \"g\" task \"alloc\": task name \"alloc\" is reserved for the alloc's shared \
          directory"
        ]
    );
}

#[test]
fn per_alloc_expansions_are_checked_for_every_alloc() {
    // 124 bytes of source: `[99]` fits in 128 bytes, `[100]` does not.
    let source = "s".repeat(124);
    let job = parsed(&[
        ("{source}", &source),
        ("{per_alloc}", "true"),
        ("{count}", "100"),
    ]);
    job.validate().expect("the last, ...[99], is 128 bytes");
    let job = parsed(&[
        ("{source}", &source),
        ("{per_alloc}", "true"),
        ("{count}", "101"),
    ]);
    let msgs = validation_messages(&job);
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert!(
        msgs[0].contains("per_alloc volume ID") && msgs[0].contains("(it is 129 bytes long)"),
        "{msgs:?}"
    );
}

#[test]
fn a_request_whose_name_differs_from_its_key_is_refused() {
    let mut job = parsed(&[]);
    let g = &mut job.task_groups[0];
    let mut request = g.volumes.remove("data").expect("volume data");
    request.name = "../other".into();
    g.volumes.insert("data".into(), request);
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter().any(|m| m.contains("differs from its key")),
        "{msgs:?}"
    );
}

#[test]
fn huge_count_is_too_large_as_written() {
    let e = parse_err(&[("{count}", "99999999999999999999999999")]);
    assert_eq!(e.line, 3);
    assert_eq!(
        e.message,
        "attribute \"count\" in group \"g\": 99999999999999999999999999 is too large (at most 10000)"
    );

    let e = parse_err(&[("{count}", "10001")]);
    assert_eq!(
        e.message,
        "attribute \"count\" in group \"g\": 10001 is too large (at most 10000)"
    );
    // Written as a float it is still too large, shown as written.
    let e = parse_err(&[("{count}", "1e26")]);
    assert!(
        e.message.ends_with("1e26 is too large (at most 10000)"),
        "{e}"
    );

    assert_eq!(
        parsed(&[("{count}", &MAX_COUNT.to_string())]).task_groups[0].count,
        MAX_COUNT
    );
}

#[test]
fn negative_and_fractional_numbers_say_so() {
    let e = parse_err(&[("{count}", "-99999999999999999999999999")]);
    assert_eq!(
        e.message,
        "attribute \"count\" in group \"g\": -99999999999999999999999999 must not be negative"
    );
    let e = parse_err(&[("{count}", "-3")]);
    assert!(e.message.ends_with("-3 must not be negative"), "{e}");
    let e = parse_err(&[("{count}", "2.5")]);
    assert!(
        e.message.ends_with("must be a whole number, not 2.5"),
        "{e}"
    );
    let e = parse_err(&[("{count}", "1.5e30")]);
    assert!(
        e.message.ends_with("1.5e30 is too large (at most 10000)"),
        "{e}"
    );
    // A whole number written with a fraction is that number.
    assert_eq!(parsed(&[("{count}", "2.0")]).task_groups[0].count, 2);
}

#[test]
fn resources_have_limits_at_parse_time() {
    let e = parse_err(&[("{cpu}", "18446744073709551615")]);
    assert_eq!(
        e.message,
        "attribute \"cpu\" in resources in task \"web\": 18446744073709551615 is too large \
         (at most 10000000)"
    );
    let e = parse_err(&[("{memory}", "18446744073709551616")]);
    assert!(
        e.message.starts_with(
            "attribute \"memory\" in resources in task \"web\": 18446744073709551616 is too large"
        ),
        "{e}"
    );
    let job = parsed(&[
        ("{cpu}", &MAX_CPU_MHZ.to_string()),
        ("{memory}", &MAX_MEMORY_MB.to_string()),
    ]);
    job.validate().expect("the limits themselves are allowed");
}

#[test]
fn durations_have_limits_at_parse_time() {
    let src = job_src(&[]).replace(
        "driver = \"raw_exec\"",
        "driver = \"raw_exec\"\n      kill_timeout = \"2y\"",
    );
    let e = parse_job(&src).unwrap_err();
    assert_eq!(
        e.message,
        "attribute \"kill_timeout\" in task \"web\": \"2y\" is too large (at most 1year)"
    );
    // Too large for any duration at all: the same message, not an overflow.
    let src = job_src(&[]).replace(
        "count = 1",
        "count = 1\n    restart {\n      delay = \"99999999999999999999999h\"\n    }",
    );
    let e = parse_job(&src).unwrap_err();
    assert!(e.message.ends_with("is too large (at most 1year)"), "{e}");
    assert!(
        e.message.contains("\"delay\" in restart in group \"g\""),
        "{e}"
    );
}

#[test]
fn numbers_from_json_are_checked_by_validate() {
    let mut job = parsed(&[]);
    job.task_groups[0].count = u32::MAX;
    job.task_groups[0].restart.attempts = u32::MAX;
    job.task_groups[0].restart.interval = Duration::from_secs(u64::MAX);
    job.task_groups[0].stop_after_client_disconnect = Some(MAX_DURATION + Duration::from_secs(1));
    let t = &mut job.task_groups[0].tasks[0];
    t.resources.cpu = u64::MAX;
    t.resources.memory_mb = u64::MAX;
    t.kill_timeout = Some(Duration::from_secs(400 * 86_400));
    t.csi_plugin.as_mut().expect("csi_plugin").health_timeout = Duration::MAX;
    let msgs = validation_messages(&job);
    for wanted in [
        "group \"g\": count 4294967295 is too large (at most 10000)",
        "group \"g\" restart: attempts 4294967295 is too large (at most 10000)",
        "group \"g\" restart: interval ",
        "group \"g\": stop_after_client_disconnect 1year 1s is too large (at most 1year)",
        "group \"g\" task \"web\": resources.cpu 18446744073709551615 is too large (at most 10000000 MHz)",
        "group \"g\" task \"web\": resources.memory 18446744073709551615 is too large (at most 67108864 MiB)",
        "group \"g\" task \"web\": kill_timeout ",
        "group \"g\" task \"web\": csi_plugin.health_timeout ",
    ] {
        assert!(
            msgs.iter().any(|m| m.starts_with(wanted)),
            "no message starting {wanted:?} in {msgs:#?}"
        );
    }
    assert_eq!(msgs.len(), 8, "{msgs:#?}");
}

#[test]
fn a_job_from_json_with_bad_names_is_refused() {
    let json = serde_json::json!({
        "id": "../j",
        "name": "j",
        "type": "batch",
        "task_groups": [{
            "name": "g/../h",
            "count": 1,
            "tasks": [{"name": "..", "driver": "raw_exec", "config": {"command": "x"}}],
        }],
    });
    let job: Job = serde_json::from_value(json).expect("decode");
    let msgs = validation_messages(&job);
    assert!(
        msgs[0].starts_with("job: job ID \"../j\" is not allowed"),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("group name \"g/../h\"")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("task name \"..\"")),
        "{msgs:?}"
    );
}

fn volume(id: &str, plugin_id: &str) -> CsiVolume {
    CsiVolume {
        id: id.into(),
        plugin_id: plugin_id.into(),
        external_id: "ext".into(),
        capabilities: vec![VolumeCapability {
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
        }],
        ..Default::default()
    }
}

#[test]
fn volume_id_that_escapes_is_refused_at_create_and_register() {
    let src = "id = \"../../../../../escape_target\"\ntype = \"csi\"\nplugin_id = \"hostpath\"\n\
               capability {\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}\n";
    let v = parse_volume(src).expect("parse");
    for register in [false, true] {
        let e = v.validate(register).unwrap_err();
        assert_eq!(
            e.0[0],
            format!(
                "volume: volume ID \"../../../../../escape_target\" is not allowed \
                 (it contains '/'): {NAME_RULE}"
            )
        );
    }
    let e = volume("v", "host/path").validate(true).unwrap_err();
    assert_eq!(
        e.0,
        [format!(
            "volume \"v\": plugin_id \"host/path\" is not allowed (it contains '/'): {NAME_RULE}"
        )]
    );
    volume("data[0]", "hostpath")
        .validate(true)
        .expect("a per_alloc ID");
}

#[test]
fn volume_capacities_have_limits() {
    let base = "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\n";
    let e = parse_volume(&format!("{base}capacity_max = 99999999999999999999999\n")).unwrap_err();
    assert_eq!(e.line, 4);
    assert_eq!(
        e.message,
        "attribute \"capacity_max\" in the volume spec: 99999999999999999999999 is too large \
         (at most 1152921504606846976 bytes, 1 EiB)"
    );
    let e = parse_volume(&format!("{base}capacity_min = \"2000000 TiB\"\n")).unwrap_err();
    assert_eq!(
        e.message,
        "attribute \"capacity_min\" in the volume spec: \"2000000 TiB\" is too large \
         (at most 1152921504606846976 bytes, 1 EiB)"
    );
    let v = parse_volume(&format!("{base}capacity_max = \"1048576 TiB\"\n")).expect("1 EiB");
    assert_eq!(v.capacity_max, Some(MAX_VOLUME_CAPACITY_BYTES));

    let mut v = volume("v", "p");
    v.capacity_min = Some(u64::MAX);
    v.capacity_max = Some(u64::MAX);
    let msgs = v.validate(false).unwrap_err().0;
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    assert!(msgs[0].starts_with("volume \"v\": capacity_min 18446744073709551615 is too large"));
}

#[test]
fn a_volume_request_struct_builds_per_alloc_ids_the_node_accepts() {
    let r = VolumeRequest {
        source: "data".into(),
        per_alloc: true,
        ..Default::default()
    };
    for i in [0, 9, MAX_COUNT - 1] {
        berth_structs::check_name("volume ID", &r.source_for(i)).expect("valid");
    }
}

#[test]
fn plugin_dirs_must_be_absolute_and_not_climb() {
    for (dir, problem) in [
        ("csi", "must be an absolute path"),
        ("/csi/../etc", "must not contain \"..\""),
    ] {
        let src = job_src(&[]).replace("mount_dir = \"/csi\"", &format!("mount_dir = {dir:?}"));
        let msgs = validation_messages(&parse_job(&src).expect("parse"));
        assert_eq!(
            msgs,
            [format!(
                "group \"g\" task \"web\": csi_plugin.mount_dir {dir:?} {problem}"
            )]
        );
    }
    let mut job = parsed(&[]);
    job.task_groups[0].tasks[0]
        .csi_plugin
        .as_mut()
        .expect("csi_plugin")
        .stage_publish_base_dir = Some("../stage".into());
    let msgs = validation_messages(&job);
    assert!(
        msgs[0]
            .ends_with("csi_plugin.stage_publish_base_dir \"../stage\" must be an absolute path"),
        "{msgs:?}"
    );
}

#[test]
fn a_disconnect_block_beside_an_old_name_is_refused() {
    let mut job = parsed(&[]);
    job.task_groups[0].max_client_disconnect = Some(Duration::from_secs(60));
    job.task_groups[0].disconnect = Some(berth_structs::DisconnectPolicy::default());
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter().any(|m| m.contains(
            "max_client_disconnect is the old name of disconnect { lost_after }; set it in the disconnect block, not beside it"
        )),
        "{msgs:?}"
    );
}

/// An exec task with `resources_extra` in its resources, `config_extra`
/// in its config and `task_extra` in its body.
fn exec_task(resources_extra: &str, config_extra: &str, task_extra: &str) -> String {
    format!(
        r#"job "j" {{
  group "g" {{
    task "t" {{
      driver = "exec"
      {task_extra}
      config {{
        command = "/bin/true"
        {config_extra}
      }}
      resources {{
        memory = 64
        {resources_extra}
      }}
    }}
  }}
}}
"#
    )
}

#[test]
fn a_tasks_memory_max_pids_limit_and_user_are_read_and_checked() {
    let job = parse_job(&exec_task(
        "memory_max = 256",
        "pids_limit = 64",
        "user = \"web\"",
    ))
    .unwrap();
    let t = &job.task_groups[0].tasks[0];
    assert_eq!(t.resources.memory_max_mb, 256);
    assert_eq!(t.config.pids_limit, Some(64));
    assert_eq!(t.user, "web");
    job.validate().unwrap();

    let below = parse_job(&exec_task("memory_max = 32", "", "")).unwrap();
    let err = below.validate().unwrap_err().to_string();
    assert!(
        err.contains("resources.memory_max (32 MiB) must be at least resources.memory (64 MiB)"),
        "{err}"
    );
    let raw = parse_job(&exec_task("", "pids_limit = 64", "").replace("\"exec\"", "\"raw_exec\""))
        .unwrap();
    let err = raw.validate().unwrap_err().to_string();
    assert!(
        err.contains("config.pids_limit applies to the exec driver only, not \"raw_exec\""),
        "{err}"
    );
    let zero = parse_job(&exec_task("", "pids_limit = 0", "")).unwrap();
    let err = zero.validate().unwrap_err().to_string();
    assert!(
        err.contains("config.pids_limit must be at least 1"),
        "{err}"
    );
    let odd = parse_job(&exec_task("", "", "user = \"a b\"")).unwrap();
    let err = odd.validate().unwrap_err().to_string();
    assert!(
        err.contains("user \"a b\" is not a user name or a numeric uid"),
        "{err}"
    );
    // Unset, nothing is added to the job's JSON.
    let plain = parse_job(&exec_task("", "", "")).unwrap();
    let json = serde_json::to_string(&plain).unwrap();
    assert!(
        !json.contains("memory_max") && !json.contains("pids_limit") && !json.contains("\"user\""),
        "{json}"
    );
}

/// A driver berth does not have is named as such, with the ones it has,
/// whatever its config block holds: not an "unknown attribute" of it.
#[test]
fn a_driver_berth_does_not_have_is_refused_by_name() {
    let src = r#"job "cache" {
  group "cache" {
    task "redis" {
      driver = "docker"
      config {
        image = "redis:7"
        ports = ["db"]
      }
    }
  }
}"#;
    let job = parse_job(src).unwrap();
    let err = job.validate().unwrap_err().to_string();
    assert!(
        err.contains(r#"driver "docker" is not supported (supported: exec, raw_exec)"#),
        "{err}"
    );
    assert!(!err.contains("unknown attribute"), "{err}");
    assert!(!err.contains("config.command"), "{err}");
}
