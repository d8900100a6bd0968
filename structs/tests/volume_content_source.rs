//! A volume spec's content source: `snapshot_id` or `clone_id`, never both.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

use berth_structs::spec::parse_volume;

const BASE: &str = r#"
id        = "restored"
type      = "csi"
plugin_id = "hostpath"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}
"#;

#[test]
fn a_snapshot_or_a_clone_is_read_from_the_spec() {
    let v = parse_volume(&format!("{BASE}snapshot_id = \"snap-1\"\n")).expect("parse");
    assert_eq!(v.snapshot_id, "snap-1");
    assert!(v.clone_id.is_empty());
    v.validate(false).expect("valid");

    let v = parse_volume(&format!("{BASE}clone_id = \"vol-9\"\n")).expect("parse");
    assert_eq!(v.clone_id, "vol-9");
    assert!(v.snapshot_id.is_empty());

    // Neither: nothing is serialized for them, and old records decode.
    let v = parse_volume(BASE).expect("parse");
    let json = serde_json::to_value(&v).unwrap();
    assert!(json.get("snapshot_id").is_none() && json.get("clone_id").is_none());
    let old: berth_structs::CsiVolume =
        serde_json::from_str(r#"{"id":"v","plugin_id":"p"}"#).expect("decode");
    assert!(old.snapshot_id.is_empty() && old.clone_id.is_empty());
}

#[test]
fn both_a_snapshot_and_a_clone_is_an_error_naming_the_line() {
    let src = format!("{BASE}snapshot_id = \"snap-1\"\nclone_id = \"vol-9\"\n");
    let err = parse_volume(&src).expect_err("both").to_string();
    let line = src.lines().position(|l| l.starts_with("clone_id")).unwrap() + 1;
    assert!(err.contains(&format!("line {line}")), "{err}");
    assert!(
        err.contains("clone_id") && err.contains("exclusive"),
        "{err}"
    );

    // The same rule holds for a volume that arrives as JSON.
    let mut v = parse_volume(BASE).expect("parse");
    v.snapshot_id = "s".into();
    v.clone_id = "c".into();
    let err = v.validate(false).expect_err("both").to_string();
    assert!(err.contains("exclusive"), "{err}");
}
