//! The CSI volume stats sections of `berth alloc status` and
//! `berth volume status -verbose`: built from the API's JSON, as lines.

use serde_json::Value;

use super::output::{format_bytes, id_cell, table, text};

fn figure(stats: &Value, key: &str) -> Option<u64> {
    stats[key].as_u64()
}

/// `used / total` with `show` for each figure; `-` for one not reported.
fn used_of_total(used: Option<u64>, total: Option<u64>, show: fn(u64) -> String) -> String {
    let shown = |v: Option<u64>| v.map_or_else(|| "-".to_string(), show);
    format!("{} / {}", shown(used), shown(total))
}

/// The condition column: `normal`, `abnormal: <message>`, or `-` when the
/// plugin does not report conditions.
fn condition_text(stats: &Value) -> String {
    let c = &stats["condition"];
    if c.is_null() {
        return "-".to_string();
    }
    if c["abnormal"].as_bool() != Some(true) {
        return "normal".to_string();
    }
    match c["message"].as_str().unwrap_or_default() {
        "" => "abnormal".to_string(),
        message => format!("abnormal: {message}"),
    }
}

/// The stats columns of one volume (used/total bytes, available bytes,
/// used/total inodes, condition), or one column saying why there are
/// none.
pub(super) fn stats_columns(stats: Option<&Value>) -> Vec<String> {
    let Some(s) = stats.filter(|s| s.is_object()) else {
        return vec!["no stats reported yet".to_string()];
    };
    if let Some(e) = s["error"].as_str() {
        return vec![format!("stats unavailable: {e}")];
    }
    vec![
        used_of_total(
            figure(s, "bytes_used"),
            figure(s, "bytes_total"),
            format_bytes,
        ),
        figure(s, "bytes_available").map_or_else(|| "-".to_string(), format_bytes),
        used_of_total(figure(s, "inodes_used"), figure(s, "inodes_total"), |n| {
            n.to_string()
        }),
        condition_text(s),
    ]
}

pub(super) const STATS_HEADER: [&str; 4] = [
    "Used / Total",
    "Available",
    "Inodes Used / Total",
    "Condition",
];

/// Whether a volume of the API's list has claims (read or write allocs):
/// only those have claims to join with their allocs.
pub fn has_claims(volume: &Value) -> bool {
    ["read_allocs", "write_allocs"]
        .iter()
        .any(|k| volume[*k].as_array().is_some_and(|l| !l.is_empty()))
}

/// The claims lines of `berth volume status -verbose VOLUME`: each claim
/// with its alloc and the stats its node reported for the volume. Empty
/// when the volume has no claims.
pub fn volume_claim_lines(volume: &Value) -> Vec<String> {
    let mut rows = Vec::new();
    for c in volume["claim_allocs"].as_array().into_iter().flatten() {
        let mut row = vec![
            id_cell(&c["alloc_id"]),
            id_cell(&c["node_id"]),
            text(&c["mode"]),
            text(&c["client_status"]),
        ];
        row.extend(stats_columns(Some(&c["volume_stats"])));
        rows.push(row);
    }
    if rows.is_empty() {
        return Vec::new();
    }
    let mut header: Vec<String> = ["Alloc ID", "Node ID", "Mode", "Status"]
        .map(String::from)
        .to_vec();
    header.extend(STATS_HEADER.map(String::from));
    rows.insert(0, header);
    table(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bytes_are_shown_in_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(5 << 20), "5.0 MiB");
        assert_eq!(format_bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn the_claims_section_joins_each_claim_with_its_stats() {
        let lines = volume_claim_lines(&json!({"claim_allocs": [
            {"alloc_id": "a1", "node_id": "n1", "mode": "write", "client_status": "running",
             "volume_stats": {"bytes_total": 1024, "bytes_used": 512, "bytes_available": 512,
                              "condition": {"abnormal": false, "message": ""}}},
            {"alloc_id": "a2", "node_id": "n1", "mode": "read", "client_status": null,
             "volume_stats": null},
        ]}));
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert!(lines[1].contains("512 B / 1.0 KiB"), "{lines:#?}");
        assert!(lines[1].contains("normal"), "{lines:#?}");
        assert!(lines[2].contains("no stats reported yet"), "{lines:#?}");
        assert!(volume_claim_lines(&json!({"claim_allocs": []})).is_empty());
        assert!(has_claims(
            &json!({"read_allocs": [], "write_allocs": ["a1"]})
        ));
        assert!(has_claims(&json!({"read_allocs": ["a2"]})));
        assert!(!has_claims(&json!({"read_allocs": [], "write_allocs": []})));
        assert!(!has_claims(&json!("not a volume")));
    }
}
