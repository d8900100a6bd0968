//! Snapshot tests of the CLI's human output (insta): what changes from
//! run to run is redacted, so a snapshot shows the layout and the words.
//! A short ID's placeholder is as wide as the ID, and an age followed by
//! a column gap keeps a gap of two spaces, so the columns of a table stay
//! where the CLI put them (but for those after an age, whose width varies).
//!
//! ```text
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
    (r"\b[0-9a-f]{8}\b", "[id....]"),
    // Ages: "12s ago", "2h5m ago", "1m 5s ago", "in 3m"; one in a column
    // keeps a two-space gap after it.
    (r"\b(\d+(ms|[smhd]|y|w) ?)+ago {2,}", "[age] ago  "),
    (r"\b(\d+(ms|[smhd]|y|w) ?)+ago\b", "[age] ago"),
    (
        r"\bin \d+(ms|[smhd]|y|w)( ?\d+(ms|[smhd]|y|w))*\b",
        "in [duration]",
    ),
    // Raft indexes: `Modify Index = 12`, `Job Modify Index: 12`,
    // `-check-index 12`, `(index 12)`.
    (
        r"((?:Create|Modify) Index\s*= |Job Modify Index: |-check-index |\(index )\d+",
        "${1}[index]",
    ),
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
3f2a9c1f  ab12cd35  2026-12-01T10:13:21Z  2h5m ago  running
alloc 6f1c2a10-1b2c-4d5e-8f90-a1b2c3d4e5f6 on 127.0.0.1:41234 in /tmp/.tmpXy12/data,
heartbeat 1m 5s ago; deadline in 2h5m
in 3m 5s or in 4s, not in 5 minutes
Modify Index = 17; Job Modify Index: 9; berth job run -check-index 9 (index 12)";
        settings().bind(|| {
            insta::assert_snapshot!(out, @r"
            ID        Node      Created               Age
            [id....]  [id....]  [time]  [age] ago
            [id....]  [id....]  [time]  [age] ago  running
            alloc [uuid] on 127.0.0.1:[port] in [tmp],
            heartbeat [age] ago; deadline in [duration]
            in [duration] or in [duration], not in 5 minutes
            Modify Index = [index]; Job Modify Index: [index]; berth job run -check-index [index] (index [index])
            ");
        });
    }
}
