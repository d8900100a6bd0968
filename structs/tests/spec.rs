//! The HCL job and volume specs: the example files, the errors operators see
//! (with lines), and the values that must survive parsing untouched.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use berth_structs::spec::{parse_job, parse_volume, SpecError};
use berth_structs::{
    AccessMode, AttachmentMode, CsiPluginType, Job, JobType, TaskCsiPluginConfig, VolumeCapability,
};

const HOSTPATH_PLUGIN: &str = include_str!("../../examples/jobs/hostpath-plugin.hcl");
const WRITER: &str = include_str!("../../examples/jobs/writer.hcl");
const READER: &str = include_str!("../../examples/jobs/reader.hcl");
const HOSTPATH_VOLUME: &str = include_str!("../../examples/volumes/hostpath.hcl");
const HOSTPATH_TOPOLOGY_VOLUME: &str = include_str!("../../examples/volumes/hostpath-topology.hcl");

fn job_err(src: &str) -> SpecError {
    match parse_job(src) {
        Ok(job) => panic!("expected an error, parsed {job:#?}"),
        Err(e) => e,
    }
}

fn volume_err(src: &str) -> SpecError {
    match parse_volume(src) {
        Ok(v) => panic!("expected an error, parsed {v:#?}"),
        Err(e) => e,
    }
}

/// A one-task job around `task_body`, the task block opening on line 4.
fn job_with_task(task_body: &str) -> String {
    format!(
        "job \"j\" {{\n  group \"g\" {{\n    # task\n    task \"web\" {{\n      driver = \"raw_exec\"\n{task_body}\n    }}\n  }}\n}}\n"
    )
}

fn validation_messages(job: &Job) -> Vec<String> {
    match job.validate() {
        Ok(()) => panic!("expected validation to fail for {job:#?}"),
        Err(e) => e.0,
    }
}

#[test]
fn hostpath_plugin_example_parses_and_validates() {
    let job = parse_job(HOSTPATH_PLUGIN).expect("parse");
    job.validate().expect("validate");
    assert_eq!(job.id, "hostpath-plugin");
    assert_eq!(job.name, "hostpath-plugin");
    assert_eq!(job.job_type, JobType::System);
    let group = job.lookup_group("plugin").expect("group plugin");
    assert_eq!(group.count, 1);
    let task = &group.tasks[0];
    assert_eq!(task.name, "plugin");
    assert_eq!(task.driver, "raw_exec");
    assert_eq!(task.config.command, "hostpath-plugin");
    assert_eq!(
        task.config.args,
        [
            "--endpoint=${CSI_ENDPOINT}",
            "--node-id=${BERTH_NODE_ID}",
            "--state-dir=${BERTH_NODE_DATA_DIR}",
            "--topology=topology.hostpath.csi/node=${BERTH_NODE_ID}",
        ]
    );
    assert_eq!(
        task.csi_plugin,
        Some(TaskCsiPluginConfig {
            id: "hostpath".into(),
            plugin_type: CsiPluginType::Monolith,
            mount_dir: "/csi".into(),
            stage_publish_base_dir: None,
            health_timeout: Duration::from_secs(30),
        })
    );
    assert_eq!(task.resources.cpu, 100);
    assert_eq!(task.resources.memory_mb, 64);
}

#[test]
fn writer_example_parses_and_validates() {
    let job = parse_job(WRITER).expect("parse");
    job.validate().expect("validate");
    assert_eq!(job.job_type, JobType::Batch);
    let group = job.lookup_group("writer").expect("group writer");
    let v = &group.volumes["data"];
    assert_eq!(v.name, "data");
    assert_eq!(v.volume_type, "csi");
    assert_eq!(v.source, "data");
    assert!(!v.read_only);
    assert_eq!(v.access_mode, Some(AccessMode::SingleNodeWriter));
    assert_eq!(v.attachment_mode, Some(AttachmentMode::FileSystem));
    let task = &group.tasks[0];
    assert_eq!(task.config.command, "/bin/sh");
    assert_eq!(
        task.config.args,
        [
            "-c",
            "echo 'hello from berth' > ${BERTH_TASK_DIR}/data/hello"
        ]
    );
    assert_eq!(task.volume_mounts.len(), 1);
    assert_eq!(task.volume_mounts[0].volume, "data");
    assert_eq!(task.volume_mounts[0].destination, "data");
    assert!(!task.volume_mounts[0].read_only);
}

#[test]
fn reader_example_parses_and_validates() {
    let job = parse_job(READER).expect("parse");
    job.validate().expect("validate");
    let group = job.lookup_group("reader").expect("group reader");
    let v = &group.volumes["data"];
    assert!(v.read_only);
    assert_eq!(v.access_mode, Some(AccessMode::SingleNodeReader));
    let task = &group.tasks[0];
    assert_eq!(task.name, "read");
    assert_eq!(
        task.config.args,
        [
            "-c",
            r#"test "$(cat ${BERTH_TASK_DIR}/data/hello)" = "hello from berth""#
        ]
    );
    assert!(task.volume_mounts[0].read_only);
}

#[test]
fn hostpath_volume_example_parses_and_validates() {
    let v = parse_volume(HOSTPATH_VOLUME).expect("parse");
    v.validate(false).expect("validate for create");
    assert_eq!(v.id, "data");
    assert_eq!(v.name, "data");
    assert_eq!(v.plugin_id, "hostpath");
    assert_eq!(v.capacity_min, Some(1 << 20));
    assert_eq!(v.capacity_max, Some(100 << 20));
    assert_eq!(
        v.capabilities,
        [
            VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
            VolumeCapability {
                access_mode: AccessMode::SingleNodeReader,
                attachment_mode: AttachmentMode::FileSystem,
            },
        ]
    );
    // Registering needs the provider's ID, which a create spec leaves out.
    assert!(v.validate(true).is_err());
}

#[test]
fn unknown_attribute_is_named_with_its_line() {
    let e = job_err(&job_with_task("      foo = \"bar\""));
    assert_eq!(e.line, 6);
    assert_eq!(
        e.to_string(),
        r#"line 6: unknown attribute "foo" in task "web""#
    );
}

#[test]
fn unknown_block_is_named_with_its_line() {
    let e = job_err(&job_with_task(
        "      template {\n        data = \"x\"\n      }",
    ));
    assert_eq!(e.line, 6);
    assert_eq!(
        e.to_string(),
        r#"line 6: unsupported block "template" in task "web""#
    );

    let src = "job \"j\" {\n  group \"g\" {\n    network {\n    }\n  }\n}\n";
    let e = job_err(src);
    assert_eq!(e.line, 3);
    assert_eq!(e.message, r#"unsupported block "network" in group "g""#);

    let e = job_err("locals {}\njob \"j\" {}\n");
    assert_eq!(e.line, 1);
    assert!(e.message.contains(r#"unsupported block "locals""#), "{e}");
}

#[test]
fn unknown_attribute_in_nested_block_is_named() {
    let e = job_err(&job_with_task(
        "      config {\n        command = \"x\"\n        image = \"redis\"\n      }",
    ));
    assert_eq!(e.line, 8);
    assert_eq!(
        e.message,
        r#"unknown attribute "image" in config in task "web""#
    );
}

#[test]
fn attribute_written_as_block_is_an_error() {
    let e = job_err(&job_with_task("      driver {\n      }"));
    // The duplicate `driver` is reported where the block opens.
    assert_eq!(e.line, 6);
    assert!(
        e.message
            .contains(r#""driver" in task "web" is an attribute"#),
        "{e}"
    );
}

#[test]
fn interpolations_are_kept_verbatim() {
    let task = r#"      config {
        command = "${BERTH_TASK_DIR}/bin/run"
        args    = ["--endpoint=${CSI_ENDPOINT}", "${BERTH_NODE_ID}", "a ${node.unique.id} b", "esc $${NOT_ME}", "q\"uote"]
      }
      env {
        DATA = "${BERTH_ALLOC_DIR}/data"
        PORT = 8080
      }"#;
    let job = parse_job(&job_with_task(task)).expect("parse");
    let t = &job.task_groups[0].tasks[0];
    assert_eq!(t.config.command, "${BERTH_TASK_DIR}/bin/run");
    assert_eq!(
        t.config.args,
        [
            "--endpoint=${CSI_ENDPOINT}",
            "${BERTH_NODE_ID}",
            "a ${node.unique.id} b",
            // `$${` is HCL's escape for a literal `${`.
            "esc ${NOT_ME}",
            "q\"uote",
        ]
    );
    assert_eq!(t.env["DATA"], "${BERTH_ALLOC_DIR}/data");
    assert_eq!(t.env["PORT"], "8080");
}

#[test]
fn heredoc_strings_keep_interpolations() {
    let task = "      config {\n        command = \"/bin/sh\"\n        args = [\"-c\", <<-EOT\n          echo ${BERTH_TASK_NAME}\n            exit 0\n          EOT\n        ]\n      }";
    let job = parse_job(&job_with_task(task)).expect("parse");
    let t = &job.task_groups[0].tasks[0];
    assert_eq!(t.config.args, ["-c", "echo ${BERTH_TASK_NAME}\n  exit 0\n"]);
}

#[test]
fn expressions_are_rejected_with_their_line() {
    for (value, found) in [
        ("local.command", "attribute or index access"),
        ("upper(\"x\")", "function call"),
        ("cmd", "variable reference"),
        ("\"a\" == \"b\" ? \"x\" : \"y\"", "conditional"),
    ] {
        let e = job_err(&job_with_task(&format!(
            "      config {{\n        command = {value}\n      }}"
        )));
        assert_eq!(e.line, 7, "{value}: {e}");
        assert!(
            e.message.contains("expressions are not supported") && e.message.contains(found),
            "{value}: {e}"
        );
    }

    // A variable reference needs a declared variable (see spec_variables.rs).
    let e = job_err(&job_with_task(
        "      config {\n        command = var.command\n      }",
    ));
    assert_eq!(e.line, 7, "{e}");
    assert!(e.message.contains("undeclared variable"), "{e}");

    let src = "job \"j\" {\n  group \"g\" {\n    count = 1 + 1\n  }\n}\n";
    let e = job_err(src);
    assert_eq!(e.line, 3);
    assert!(e.message.contains("expressions are not supported"), "{e}");

    let e = job_err(&job_with_task(
        "      config {\n        command = \"/bin/sh\"\n        args = [\"${upper(X)}\"]\n      }",
    ));
    assert_eq!(e.line, 8);
    assert!(e.message.contains("expressions are not supported"), "{e}");

    let e = job_err(&job_with_task(
        "      config {\n        command = \"%{ if true }x%{ endif }\"\n      }",
    ));
    assert_eq!(e.line, 7);
    assert!(e.message.contains("directives"), "{e}");
}

#[test]
fn durations_are_parsed() {
    let src = r#"job "j" {
  group "g" {
    stop_after_client_disconnect = "5m"
    restart {
      attempts = 5
      interval = "1h30m"
      delay    = "250ms"
      mode     = "delay"
    }
    task "t" {
      driver       = "raw_exec"
      kill_timeout = "45s"
      config {
        command = "/bin/true"
      }
      csi_plugin {
        id             = "p"
        type           = "node"
        mount_dir      = "/csi"
        health_timeout = "2m"
      }
    }
  }
}
"#;
    let job = parse_job(src).expect("parse");
    let g = &job.task_groups[0];
    assert_eq!(
        g.stop_after_client_disconnect,
        Some(Duration::from_secs(300))
    );
    assert_eq!(g.restart.attempts, 5);
    assert_eq!(g.restart.interval, Duration::from_secs(5400));
    assert_eq!(g.restart.delay, Duration::from_millis(250));
    assert_eq!(g.restart.mode, "delay");
    let t = &g.tasks[0];
    assert_eq!(t.kill_timeout, Some(Duration::from_secs(45)));
    let p = t.csi_plugin.as_ref().expect("csi_plugin");
    assert_eq!(p.plugin_type, CsiPluginType::Node);
    assert_eq!(p.health_timeout, Duration::from_secs(120));

    let e = job_err(&src.replace("\"45s\"", "\"soon\""));
    assert_eq!(e.line, 12);
    assert!(
        e.message
            .contains(r#"attribute "kill_timeout" in task "t""#),
        "{e}"
    );
    assert!(e.message.contains("invalid duration"), "{e}");

    let e = job_err(&src.replace("\"45s\"", "45"));
    assert_eq!(e.line, 12);
    assert!(
        e.message.contains("expected a string, found a number"),
        "{e}"
    );
}

#[test]
fn defaults_fill_what_the_spec_leaves_out() {
    let job = parse_job(&job_with_task(
        "      config {\n        command = \"/bin/true\"\n      }",
    ))
    .expect("parse");
    job.validate().expect("validate");
    assert_eq!(job.name, "j");
    assert_eq!(job.job_type, JobType::Service);
    assert_eq!(job.priority, 50);
    let g = &job.task_groups[0];
    assert_eq!(g.count, 1);
    assert_eq!(g.restart, Default::default());
    assert_eq!(g.stop_after_client_disconnect, None);
    let t = &g.tasks[0];
    assert_eq!(t.resources, Default::default());
    assert_eq!(t.kill_timeout, None);
    assert!(t.csi_plugin.is_none());
}

#[test]
fn sizes_are_parsed() {
    let base = "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\n";
    let v = parse_volume(&format!(
        "{base}capacity_min = 1048576\ncapacity_max = \"2 GiB\"\n"
    ))
    .expect("parse");
    assert_eq!(v.capacity_min, Some(1 << 20));
    assert_eq!(v.capacity_max, Some(2 << 30));
    // Name defaults to the ID.
    assert_eq!(v.name, "v");

    let v = parse_volume(&format!("{base}capacity_min = \"10MB\"\n")).expect("parse");
    assert_eq!(v.capacity_min, Some(10_000_000));

    let e = volume_err(&format!("{base}\ncapacity_max = \"10 parsecs\"\n"));
    assert_eq!(e.line, 5);
    assert!(e.message.contains(r#"attribute "capacity_max""#), "{e}");
    assert!(e.message.contains("unknown unit"), "{e}");
}

#[test]
fn wrong_types_are_errors_with_lines() {
    let src = "job \"j\" {\n  group \"g\" {\n    count = \"3\"\n  }\n}\n";
    let e = job_err(src);
    assert_eq!(e.line, 3);
    assert_eq!(
        e.message,
        r#"attribute "count" in group "g": expected a number, found a string"#
    );

    let e = job_err(&src.replace("\"3\"", "-1"));
    assert_eq!(e.line, 3);
    assert!(e.message.contains("must not be negative"), "{e}");

    let e = job_err(&src.replace("\"3\"", "1.5"));
    assert!(e.message.contains("whole number"), "{e}");

    let e = job_err(&job_with_task(
        "      config {\n        command = \"x\"\n        args = \"--flag\"\n      }",
    ));
    assert_eq!(e.line, 8);
    assert!(
        e.message
            .contains("expected a list of strings, found a string"),
        "{e}"
    );

    let e = job_err(&job_with_task(
        "      volume_mount {\n        volume = \"v\"\n        destination = \"d\"\n        read_only = \"yes\"\n      }",
    ));
    assert_eq!(e.line, 9);
    assert!(e.message.contains("expected a bool"), "{e}");

    let e = job_err(&job_with_task(
        "      resources {\n        memory = \"64MB\"\n      }",
    ));
    assert_eq!(e.line, 7);
    assert!(
        e.message
            .contains(r#"attribute "memory" in resources in task "web""#),
        "{e}"
    );

    let e = job_err("job \"j\" {\n  type = \"sysbatch\"\n}\n");
    assert_eq!(e.line, 2);
    assert!(e.message.contains("not supported"), "{e}");
}

#[test]
fn missing_labels_and_required_attributes_are_errors() {
    let e = job_err("job {\n}\n");
    assert_eq!(e.line, 1);
    assert!(e.message.contains("needs exactly one label"), "{e}");

    let e = job_err("job \"j\" {\n  group \"g\" {\n    task {\n    }\n  }\n}\n");
    assert_eq!(e.line, 3);
    assert!(e.message.contains("the task name"), "{e}");

    let e = job_err("job \"j\" {\n  group \"g\" {\n    task \"t\" {\n    }\n  }\n}\n");
    assert_eq!(e.line, 3);
    assert_eq!(
        e.message,
        r#"missing required attribute "driver" in task "t""#
    );

    let e = job_err(&job_with_task(
        "      csi_plugin {\n        id = \"p\"\n      }",
    ));
    assert_eq!(e.line, 6);
    assert!(
        e.message.contains(r#"missing required attribute "type""#),
        "{e}"
    );

    let e = job_err("# nothing here\n");
    assert!(e.message.contains("no job block"), "{e}");
}

#[test]
fn duplicate_attributes_and_blocks_are_errors() {
    let e = job_err(&job_with_task("      driver = \"raw_exec\""));
    assert_eq!(e.line, 6);
    assert!(
        e.message.contains(r#"attribute "driver" is defined twice"#),
        "{e}"
    );

    let e = job_err(&job_with_task(
        "      resources {\n      }\n      resources {\n      }",
    ));
    assert_eq!(e.line, 8);
    assert!(e.message.contains("may appear only once"), "{e}");

    let src = "job \"j\" {\n  group \"g\" {}\n  group \"g\" {}\n}\n";
    let e = job_err(src);
    assert_eq!(e.line, 3);
    assert!(e.message.contains("defined twice"), "{e}");
}

#[test]
fn syntax_errors_carry_their_line() {
    let e = job_err("job \"j\" {\n  group \"g\" {\n    count = \n  }\n");
    assert!(e.line >= 3, "{e}");
    assert!(e.message.contains("syntax error"), "{e}");
}

#[test]
fn maps_may_be_blocks_or_attributes() {
    let src = r#"job "j" {
  meta = { owner = "ops", "team.name" = "storage" }
  group "g" {
    meta {
      tier = "gold"
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/true"
      }
      env = { A = "1", B = true }
    }
  }
}
"#;
    let job = parse_job(src).expect("parse");
    assert_eq!(job.meta["owner"], "ops");
    assert_eq!(job.meta["team.name"], "storage");
    assert_eq!(job.task_groups[0].meta["tier"], "gold");
    assert_eq!(job.task_groups[0].tasks[0].env["B"], "true");
}

/// A writer job with the group volume and task mount replaced.
fn writer_with(replace: &[(&str, &str)]) -> Job {
    let mut src = WRITER.to_string();
    for (from, to) in replace {
        assert!(src.contains(from), "writer.hcl lacks {from:?}");
        src = src.replacen(from, to, 1);
    }
    parse_job(&src).expect("parse")
}

#[test]
fn validation_requires_access_mode() {
    let job = writer_with(&[("access_mode     = \"single-node-writer\"", "")]);
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter().any(|m| m.contains("need access_mode")),
        "{msgs:?}"
    );
}

#[test]
fn validation_requires_read_only_for_reader_modes() {
    let src = READER.replacen("read_only       = true", "", 1);
    let job = parse_job(&src).expect("parse");
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter().any(|m| m.contains("needs read_only = true")),
        "{msgs:?}"
    );
}

#[test]
fn validation_requires_per_alloc_for_single_node_with_count() {
    let job = writer_with(&[("group \"writer\" {", "group \"writer\" {\n    count = 3")]);
    assert_eq!(job.task_groups[0].count, 3);
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter().any(|m| m.contains("needs per_alloc = true")),
        "{msgs:?}"
    );

    let job = writer_with(&[
        ("group \"writer\" {", "group \"writer\" {\n    count = 3"),
        (
            "source          = \"data\"",
            "source = \"data\"\n      per_alloc = true",
        ),
    ]);
    assert!(job.task_groups[0].volumes["data"].per_alloc);
    job.validate().expect("per_alloc makes count 3 valid");
}

#[test]
fn validation_rejects_destination_escaping_the_task_dir() {
    let job = writer_with(&[("destination = \"data\"", "destination = \"../x\"")]);
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter()
            .any(|m| m.contains("escapes the task directory")),
        "{msgs:?}"
    );
}

#[test]
fn volume_spec_errors_name_their_line() {
    let e = volume_err("id = \"v\"\nplugin_id = \"p\"\n");
    assert_eq!(
        e.message,
        r#"missing required attribute "type" in the volume spec"#
    );

    let e = volume_err("id = \"v\"\ntype = \"host\"\nplugin_id = \"p\"\n");
    assert_eq!(e.line, 2);
    assert!(
        e.message.contains(r#"volume type "host" is not supported"#),
        "{e}"
    );

    let e = volume_err(
        "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\nplacement {\n  required {}\n}\n",
    );
    assert_eq!(e.line, 4);
    assert_eq!(
        e.message,
        r#"unsupported block "placement" in the volume spec"#
    );

    let e = volume_err(
        "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\ncapability {\n  access_mode = \"single-node\"\n  attachment_mode = \"file-system\"\n}\n",
    );
    assert_eq!(e.line, 5);
    assert!(e.message.contains("unknown access_mode"), "{e}");

    let e = volume_err(
        "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\ncapability {\n  access_mode = \"single-node-writer\"\n}\n",
    );
    assert_eq!(e.line, 4);
    assert!(
        e.message
            .contains(r#"missing required attribute "attachment_mode""#),
        "{e}"
    );

    let e = volume_err("id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\nsnapshot_ids = \"s\"\n");
    assert_eq!(e.line, 4);
    assert_eq!(
        e.message,
        r#"unknown attribute "snapshot_ids" in the volume spec"#
    );
}

#[test]
fn volume_spec_reads_options_secrets_and_parameters() {
    let src = r#"id          = "v"
type        = "csi"
plugin_id   = "p"
external_id = "vol-123"
capability {
  access_mode     = "multi-node-multi-writer"
  attachment_mode = "block-device"
}
mount_options {
  fs_type     = "ext4"
  mount_flags = ["noatime", "nodev"]
}
secrets {
  token = "s3cr3t"
}
parameters = { iops = 3000 }
context {
  zone = "a"
}
"#;
    let v = parse_volume(src).expect("parse");
    v.validate(true).expect("validate for register");
    assert_eq!(v.external_id, "vol-123");
    assert_eq!(v.mount_options.fs_type, "ext4");
    assert_eq!(v.mount_options.mount_flags, ["noatime", "nodev"]);
    assert_eq!(v.secrets["token"], "s3cr3t");
    assert_eq!(v.parameters["iops"], "3000");
    assert_eq!(v.context["zone"], "a");
    assert!(v.has_capability(
        AccessMode::MultiNodeMultiWriter,
        AttachmentMode::BlockDevice
    ));
}

#[test]
fn group_volume_reads_mount_options_and_modes() {
    let job = writer_with(&[(
        "attachment_mode = \"file-system\"",
        "attachment_mode = \"file-system\"\n      mount_options {\n        fs_type = \"xfs\"\n        mount_flags = [\"ro\"]\n      }",
    )]);
    let opts = job.task_groups[0].volumes["data"]
        .mount_options
        .as_ref()
        .expect("mount_options");
    assert_eq!(opts.fs_type, "xfs");
    assert_eq!(opts.mount_flags, ["ro"]);

    let src = WRITER.replacen("\"file-system\"", "\"filesystem\"", 1);
    let e = job_err(&src);
    assert_eq!(e.line, 11);
    assert!(e.message.contains("unknown attachment_mode"), "{e}");
    assert!(e.message.contains(r#"in volume "data""#), "{e}");
}

#[test]
fn a_topology_request_is_read_in_nomads_shape() {
    let v = parse_volume(HOSTPATH_TOPOLOGY_VOLUME).expect("parse");
    let node = |n: &str| {
        berth_structs::CsiTopology::new(
            [("topology.hostpath.csi/node".to_string(), n.to_string())].into(),
        )
    };
    assert_eq!(
        v.requested_topologies.required,
        vec![node("node-a"), node("node-b")]
    );
    assert_eq!(v.requested_topologies.preferred, vec![node("node-a")]);
    assert!(
        v.accessible_topology.is_empty(),
        "only a plugin or a register sets it"
    );

    // Segments as a block, several keys, and only `required`.
    let base = "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\n";
    let v = parse_volume(&format!(
        "{base}topology_request {{\n  required {{\n    topology {{\n      segments {{\n        zone = \"a\"\n        rack = \"r1\"\n      }}\n    }}\n  }}\n}}\n"
    ))
    .expect("parse");
    assert_eq!(v.requested_topologies.required.len(), 1);
    assert_eq!(
        v.requested_topologies.required[0].to_string(),
        "{rack=r1,zone=a}"
    );
    assert!(v.requested_topologies.preferred.is_empty());
}

#[test]
fn a_topology_request_refuses_what_it_does_not_know_with_the_line() {
    let base = "id = \"v\"\ntype = \"csi\"\nplugin_id = \"p\"\n";
    // Line 4 opens topology_request.
    let e = volume_err(&format!(
        "{base}topology_request {{\n  requisite {{\n  }}\n}}\n"
    ));
    assert_eq!(e.line, 5, "{e}");
    assert!(e.message.contains("unsupported block \"requisite\""), "{e}");

    let e = volume_err(&format!(
        "{base}topology_request {{\n  required {{\n    topology {{\n      zone = \"a\"\n    }}\n  }}\n}}\n"
    ));
    assert_eq!(e.line, 7, "{e}");
    assert!(e.message.contains("unknown attribute \"zone\""), "{e}");

    let e = volume_err(&format!(
        "{base}topology_request {{\n  required {{\n    topology {{\n      segments = {{}}\n    }}\n  }}\n}}\n"
    ));
    assert_eq!(e.line, 6, "{e}");
    assert!(e.message.contains("at least one segment"), "{e}");

    let e = volume_err(&format!(
        "{base}topology_request {{\n  required {{\n  }}\n}}\n"
    ));
    assert_eq!(e.line, 5, "{e}");
    assert!(e.message.contains("at least one topology block"), "{e}");

    let e = volume_err(&format!("{base}topology_request = {{}}\n"));
    assert_eq!(e.line, 4, "{e}");
    assert!(e.message.contains("is a block"), "{e}");
}

#[test]
fn volume_mount_propagation_mode_parses_and_bad_values_name_value_and_line() {
    use berth_structs::PropagationMode;
    let mounts = |extra: &str| {
        format!(
            "      volume_mount {{\n        volume = \"v\"\n        destination = \"d\"\n{extra}      }}"
        )
    };
    let job = parse_job(&job_with_task(&mounts(""))).unwrap();
    let task = &job.task_groups[0].tasks[0];
    assert_eq!(
        task.volume_mounts[0].propagation_mode,
        PropagationMode::Private
    );
    for (text, mode) in [
        ("private", PropagationMode::Private),
        ("host-to-task", PropagationMode::HostToTask),
        ("bidirectional", PropagationMode::Bidirectional),
    ] {
        let src = job_with_task(&mounts(&format!("        propagation_mode = \"{text}\"\n")));
        let job = parse_job(&src).unwrap();
        assert_eq!(
            job.task_groups[0].tasks[0].volume_mounts[0].propagation_mode,
            mode
        );
    }
    let e = job_err(&job_with_task(&mounts(
        "        propagation_mode = \"rshared\"\n",
    )));
    assert_eq!(e.line, 9, "{e}");
    assert!(e.message.contains("\"rshared\""), "{e}");
    assert!(e.message.contains("propagation_mode"), "{e}");
}

#[test]
fn validation_refuses_a_read_only_mount_of_a_writable_block_volume() {
    let job = writer_with(&[
        (
            "attachment_mode = \"file-system\"",
            "attachment_mode = \"block-device\"",
        ),
        (
            "destination = \"data\"",
            "destination = \"data\"\n        read_only   = true",
        ),
    ]);
    let msgs = validation_messages(&job);
    assert!(
        msgs.iter().any(|m| m.contains("block-device volume")
            && m.contains("read_only = true on the group's volume")),
        "{msgs:?}"
    );
    // Writable mount of a writable block volume: fine.
    let job = writer_with(&[(
        "attachment_mode = \"file-system\"",
        "attachment_mode = \"block-device\"",
    )]);
    job.validate().unwrap();
}

#[test]
fn block_volume_examples_parse_and_validate() {
    let volume = parse_volume(include_str!("../../examples/volumes/hostpath-block.hcl"))
        .expect("parse the block volume example");
    assert!(volume
        .capabilities
        .iter()
        .all(|c| c.attachment_mode == AttachmentMode::BlockDevice));
    assert_eq!(
        volume.parameters.get("backing").map(String::as_str),
        Some("image")
    );
    volume.validate(false).expect("valid volume");

    let job = parse_job(include_str!("../../examples/jobs/block-writer.hcl"))
        .expect("parse the block writer example");
    let group = &job.task_groups[0];
    assert_eq!(
        group.volumes["disk"].attachment_mode,
        Some(AttachmentMode::BlockDevice)
    );
    assert_eq!(
        group.tasks[0].volume_mounts[0].propagation_mode,
        berth_structs::PropagationMode::Private
    );
    job.validate().expect("valid job");
}

/// A one-group job with `group_body` before its task.
fn job_with_group(group_body: &str) -> String {
    format!(
        "job \"j\" {{\n  group \"g\" {{\n{group_body}\n    task \"t\" {{\n      driver = \"raw_exec\"\n      config {{\n        command = \"/bin/true\"\n      }}\n    }}\n  }}\n}}\n"
    )
}

#[test]
fn the_disconnect_block_is_parsed_with_nomad_s_defaults() {
    let job = parse_job(&job_with_group(
        "    disconnect {\n      lost_after = \"1m\"\n      replace = false\n      reconcile = \"keep_original\"\n      stop_on_client_after = \"30s\"\n    }",
    ))
    .expect("parse");
    let g = &job.task_groups[0];
    let d = g.disconnect.clone().expect("the block");
    assert_eq!(d.lost_after, Some(Duration::from_secs(60)));
    assert!(!d.replace);
    assert_eq!(d.reconcile, berth_structs::ReconcileStrategy::KeepOriginal);
    assert_eq!(g.stop_on_client_after(), Some(Duration::from_secs(30)));
    job.validate().expect("valid");

    let job = parse_job(&job_with_group(
        "    disconnect {\n      lost_after = \"5m\"\n    }",
    ))
    .expect("parse");
    let rule = job.task_groups[0].on_disconnect(JobType::Service, Duration::ZERO);
    assert_eq!(rule.lost_after, Some(Duration::from_secs(300)));
    assert!(rule.replace, "replace defaults to true");
    assert_eq!(rule.reconcile, berth_structs::ReconcileStrategy::BestScore);
}

#[test]
fn the_old_names_work_alone_and_are_refused_beside_the_block() {
    let job = parse_job(&job_with_group(
        "    max_client_disconnect = \"2m\"\n    stop_after_client_disconnect = \"1m\"",
    ))
    .expect("parse");
    let g = &job.task_groups[0];
    assert_eq!(g.stop_on_client_after(), Some(Duration::from_secs(60)));
    assert_eq!(
        g.on_disconnect(JobType::Service, Duration::ZERO).lost_after,
        Some(Duration::from_secs(120))
    );

    let e = job_err(&job_with_group(
        "    stop_after_client_disconnect = \"1m\"\n    disconnect {\n      lost_after = \"1m\"\n    }",
    ));
    assert_eq!(e.line, 3, "{e}");
    assert!(
        e.message.contains(
            "stop_after_client_disconnect is the old name of disconnect { stop_on_client_after }"
        ),
        "{e}"
    );
    let e = job_err(&job_with_group(
        "    disconnect {\n      reconcile = \"newest\"\n    }",
    ));
    assert!(
        e.message.contains("reconcile \"newest\" is not one of best_score, keep_original, keep_replacement, longest_running"),
        "{e}"
    );
}

#[test]
fn system_groups_are_never_replaced_and_held_by_the_servers_default() {
    let job = parse_job(&job_with_group("")).expect("parse");
    let g = &job.task_groups[0];
    let hour = Duration::from_secs(3600);
    let rule = g.on_disconnect(JobType::System, hour);
    assert_eq!(rule.lost_after, Some(hour));
    assert!(!rule.replace);
    assert_eq!(
        g.on_disconnect(JobType::System, Duration::ZERO).lost_after,
        None
    );
    assert_eq!(g.on_disconnect(JobType::Service, hour).lost_after, None);
}

#[test]
fn constraints_are_read_at_every_level_and_checked() {
    let job = parse_job(
        r#"
job "j" {
  constraint {
    attribute = "${attr.kernel.name}"
    value     = "linux"
  }
  group "g" {
    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }
    constraint {
      attribute = "${meta.rack}"
      operator  = "distinct_property"
    }
    task "web" {
      driver = "raw_exec"
      config { command = "/bin/true" }
      constraint {
        attribute = "${attr.kernel.version}"
        operator  = "version"
        value     = ">= 5.4, < 99"
      }
    }
  }
}
"#,
    )
    .unwrap();
    job.validate().unwrap();
    assert_eq!(job.constraints[0].attribute, "${attr.kernel.name}");
    assert_eq!(job.constraints[0].operator, berth_structs::Operator::Equal);
    let g = &job.task_groups[0];
    assert_eq!(
        g.constraints[0].operator,
        berth_structs::Operator::DistinctHosts
    );
    assert_eq!(
        g.constraints[1].operator,
        berth_structs::Operator::DistinctProperty
    );
    assert_eq!(g.tasks[0].constraints[0].value, ">= 5.4, < 99");

    let e = job_err(&job_with_task(
        "      constraint {\n        attribute = \"${meta.a}\"\n        operator = \"~=\"\n      }",
    ));
    assert_eq!(e.line, 8, "{e}");
    assert!(e.to_string().contains("unknown operator \"~=\""), "{e}");

    let mut bad = job.clone();
    bad.task_groups[0].tasks[0].constraints[0].value = ">= five".into();
    bad.task_groups[0].tasks[0]
        .constraints
        .push(berth_structs::Constraint {
            operator: berth_structs::Operator::DistinctHosts,
            ..Default::default()
        });
    let errs = validation_messages(&bad);
    assert!(
        errs[0].contains("group \"g\" task \"web\": constraint")
            && errs[0].contains("not a version"),
        "{errs:?}"
    );
    assert!(
        errs[1].contains("applies to a job or a group, not a task"),
        "{errs:?}"
    );
}

#[test]
fn affinities_and_spreads_are_read_and_checked() {
    let job = parse_job(
        r#"
job "j" {
  spread {
    attribute = "${meta.rack}"
    weight    = 80
    target "r1" {
      percent = 60
    }
    target "r2" {
      percent = 40
    }
  }
  group "g" {
    affinity {
      attribute = "${node.class}"
      value     = "fast"
      weight    = -30
    }
    task "web" {
      driver = "raw_exec"
      config { command = "/bin/true" }
      affinity {
        attribute = "${attr.cpu.numcores}"
        operator  = ">="
        value     = "8"
      }
    }
  }
}
"#,
    )
    .unwrap();
    job.validate().unwrap();
    let spread = &job.spreads[0];
    assert_eq!(
        (spread.attribute.as_str(), spread.weight),
        ("${meta.rack}", 80)
    );
    assert_eq!(spread.targets.len(), 2);
    assert_eq!(
        (spread.targets[1].value.as_str(), spread.targets[1].percent),
        ("r2", 40)
    );
    assert_eq!(job.task_groups[0].affinities[0].weight, -30);
    assert_eq!(job.task_groups[0].tasks[0].affinities[0].weight, 50);

    let e = job_err(&job_with_task(
        "      affinity {\n        attribute = \"${meta.a}\"\n        value = \"x\"\n        weight = 0\n      }",
    ));
    assert!(
        e.to_string()
            .contains("not between -100 and 100 (and not 0)"),
        "{e}"
    );

    let mut bad = job.clone();
    bad.spreads[0].targets[0].percent = 70;
    bad.spreads[0].attribute = "rack".into();
    let errs = validation_messages(&bad);
    assert!(errs.iter().any(|e| e.contains("add up to 110")), "{errs:?}");
    assert!(
        errs.iter().any(|e| e.contains("must name a node value")),
        "{errs:?}"
    );
}

#[test]
fn reschedule_blocks_take_the_job_types_defaults_and_the_jobs_block() {
    let job = parse_job(
        r#"
job "j" {
  type = "batch"
  reschedule {
    delay = "10s"
  }
  group "g" {
    reschedule {
      attempts       = 3
      interval       = "1h"
      delay_function = "exponential"
      max_delay      = "2m"
    }
    task "web" {
      driver = "raw_exec"
      config { command = "/bin/true" }
    }
  }
  group "h" {
    task "web" {
      driver = "raw_exec"
      config { command = "/bin/true" }
    }
  }
}
"#,
    )
    .unwrap();
    job.validate().unwrap();
    let g = job.reschedule_policy(&job.task_groups[0]);
    assert_eq!(g.attempts, 3);
    assert_eq!(g.delay, Duration::from_secs(10), "the job's block");
    assert_eq!(g.max_delay, Duration::from_secs(120));
    assert_eq!(g.delay_function, berth_structs::DelayFunction::Exponential);
    assert!(!g.unlimited);
    // No block of its own: the job's, over the batch defaults.
    let h = job.reschedule_policy(&job.task_groups[1]);
    assert_eq!((h.attempts, h.delay), (1, Duration::from_secs(10)));
    assert_eq!(h.interval, Duration::from_secs(24 * 3600));

    let e = job_err(&job_with_task(
        "    }\n    reschedule {\n      delay_function = \"linear\"\n",
    ));
    assert!(
        e.to_string()
            .contains("delay function \"linear\" is not supported"),
        "{e}"
    );
}

#[test]
fn update_blocks_take_the_jobs_block_and_nomads_defaults() {
    let job = parse_job(
        r#"
job "j" {
  update {
    max_parallel = 2
  }
  group "g" {
    update {
      min_healthy_time = "3s"
    }
    task "web" {
      driver = "raw_exec"
      config { command = "/bin/true" }
    }
  }
  group "h" {
    task "web" {
      driver = "raw_exec"
      config { command = "/bin/true" }
    }
  }
}
"#,
    )
    .unwrap();
    job.validate().unwrap();
    let g = job.update_strategy(&job.task_groups[0]).unwrap();
    assert_eq!(
        (g.max_parallel, g.min_healthy_time),
        (2, Duration::from_secs(3))
    );
    assert_eq!(g.healthy_deadline, Duration::from_secs(300));
    let h = job.update_strategy(&job.task_groups[1]).unwrap();
    assert_eq!(
        (h.max_parallel, h.min_healthy_time),
        (2, Duration::from_secs(10))
    );

    let mut canary = job.clone();
    canary.task_groups[0].update.as_mut().unwrap().canary = 1;
    canary.validate().expect("a canary is accepted");
    canary.task_groups[0].update.as_mut().unwrap().max_parallel = 0;
    let errs = validation_messages(&canary);
    assert!(
        errs[0].contains("canary needs max_parallel > 0"),
        "{errs:?}"
    );
    let mut promote = job.clone();
    promote.task_groups[0].update.as_mut().unwrap().auto_promote = true;
    let errs = validation_messages(&promote);
    assert!(
        errs[0].contains("auto_promote needs canary > 0"),
        "{errs:?}"
    );
}
