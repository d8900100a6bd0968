//! Snapshot tests of the CLI's human output (insta): what changes from
//! run to run is redacted, so a snapshot shows the layout and the words.
//!
//! ```ignore
//! berth_tests::snapshot::settings().bind(|| insta::assert_snapshot!("job_status", out));
//! ```
//!
//! Snapshots live in tests/tests/snapshots/; accept new ones with
//! `INSTA_UPDATE=always`, review the .snap files and commit them (CI,
//! with CI=true, fails on a missing one).

/// The redactions, in the order they apply: (regex, replacement).
pub const FILTERS: &[(&str, &str)] = &[
    // RFC 3339 times, with or without fractions and an offset.
    (
        r"\b\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})",
        "[time]",
    ),
    // UUIDs, then the eight-character short IDs tables show.
    (
        r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
        "[uuid]",
    ),
    (r"\b[0-9a-f]{8}\b", "[short-id]"),
    // Ages: "12s ago", "2h5m ago", "1m 5s ago", "in 3m".
    (r"\b(\d+(ms|[smhd]|y|w)\s?)+ago\b", "[age] ago"),
    (r"\bin (\d+(ms|[smhd]|y|w)\s?)+", "in [duration]"),
    // Local ports and temporary paths.
    (r"127\.0\.0\.1:\d+", "127.0.0.1:[port]"),
    (r"/tmp/[^\s\x22',)\]]+", "[tmp]"),
];

/// insta settings with [`FILTERS`] and the snapshots in
/// tests/tests/snapshots/, named without the module prefix.
pub fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/snapshots"));
    s.set_prepend_module_to_snapshot(false);
    for (regex, replacement) in FILTERS {
        s.add_filter(regex, *replacement);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_changes_from_run_to_run_is_redacted() {
        let out = "\
ID        Node      Created               Age
3f2a9c1e  ab12cd34  2026-12-01T10:13:20Z  12s ago
alloc 6f1c2a10-1b2c-4d5e-8f90-a1b2c3d4e5f6 on 127.0.0.1:41234 in /tmp/.tmpXy12/data,
heartbeat 1m 5s ago; deadline in 2h5m";
        settings().bind(|| {
            insta::assert_snapshot!(out, @r"
            ID        Node      Created               Age
            [short-id]  [short-id]  [time]  [age] ago
            alloc [uuid] on 127.0.0.1:[port] in [tmp],
            heartbeat [age] ago; deadline in [duration]
            ");
        });
    }
}
