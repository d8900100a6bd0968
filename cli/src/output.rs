//! How read commands print: `-json` (the API's JSON, pretty), `-t
//! TEMPLATE`, or the command's own human output; and the pieces human
//! output is made of: [`Table`], [`table`], [`titled_table`],
//! [`key_values`], [`ago`], [`format_time`], [`short_id`],
//! [`format_bytes`], and the cells of the API's JSON: [`text`],
//! [`id_cell`], [`ago_cell`].
//!
//! Templates are minijinja (Jinja2) templates with the API's JSON as
//! `value`, and an object's fields also by their own names:
//! `-t '{{ id }} {{ status }}'`, `-t '{% for j in value %}{{ j.id }}
//! {% endfor %}'`. Go template syntax (`{{range .}}`) is not understood.

use std::time::{Duration, UNIX_EPOCH};

use anyhow::{anyhow, Result};
use clap::Args;
use serde_json::Value;

/// The output flags every read command flattens in
/// (`#[command(flatten)] pub output: OutputArgs`).
#[derive(Args, Debug, Clone, Default)]
pub struct OutputArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// Format the API's JSON with a template: the JSON is `value`, an
    /// object's fields also by name ('{{ id }}',
    /// '{% for a in value %}{{ a.id }}{% endfor %}')
    #[arg(short = 't', value_name = "TEMPLATE", conflicts_with = "json")]
    pub template: Option<String>,
}

impl OutputArgs {
    /// Prints `v` as the flags ask: JSON, a template, or `human(v)`.
    pub fn emit(&self, v: &Value, human: impl FnOnce(&Value) -> Result<()>) -> Result<i32> {
        if self.json {
            println!("{}", serde_json::to_string_pretty(v)?);
        } else if let Some(t) = &self.template {
            let text = render_template(t, v)?;
            if text.ends_with('\n') {
                print!("{text}");
            } else {
                println!("{text}");
            }
        } else {
            human(v)?;
        }
        Ok(0)
    }
}

/// Asks `question` on the terminal and answers whether the person said
/// yes. Without a terminal on standard input there is no one to ask: an
/// error that says to pass `-y`.
pub fn confirm(question: &str) -> Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Err(anyhow!(
            "{question}\nNo terminal to ask on: pass -y to confirm."
        ));
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

/// Renders `template` with `v` as its context (see the module's doc).
pub fn render_template(template: &str, v: &Value) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    let mut ctx = serde_json::Map::new();
    if let Value::Object(fields) = v {
        ctx.extend(fields.clone());
    }
    ctx.insert("value".into(), v.clone());
    let ctx = minijinja::Value::from(minijinja::value::Serde(Value::Object(ctx)));
    env.render_str(template, ctx)
        .map_err(|e| anyhow!("template {template:?}: {e}"))
}

/// Rows in columns as wide as their widest cell (in chars), two spaces
/// apart, no trailing spaces. A row shorter than the header has its last
/// cell as free text: it neither widens its column nor is padded.
#[derive(Debug, Clone, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Table {
        Table {
            rows: vec![header.into_iter().map(Into::into).collect()],
        }
    }

    pub fn push<S: Into<String>>(&mut self, row: impl IntoIterator<Item = S>) {
        self.rows.push(row.into_iter().map(Into::into).collect());
    }

    pub fn lines(&self) -> Vec<String> {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0; columns];
        for row in &self.rows {
            let counted = if row.len() < columns {
                row.len().saturating_sub(1)
            } else {
                row.len()
            };
            for (i, cell) in row.iter().take(counted).enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        self.rows
            .iter()
            .map(|row| {
                let last = row.len().saturating_sub(1);
                let mut line = String::new();
                for (i, cell) in row.iter().enumerate() {
                    if i > 0 {
                        line.push_str("  ");
                    }
                    line.push_str(cell);
                    if i != last {
                        let pad = widths[i].saturating_sub(cell.chars().count());
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
                line.trim_end().to_string()
            })
            .collect()
    }
}

/// Rows (header first) in columns as wide as their widest cell; a row
/// with fewer columns than the header has its last cell as free text.
pub fn table(rows: &[Vec<String>]) -> Vec<String> {
    let mut rows = rows.iter();
    let Some(header) = rows.next() else {
        return Vec::new();
    };
    let mut t = Table::new(header.clone());
    for row in rows {
        t.push(row.clone());
    }
    t.lines()
}

/// A titled table: a blank line, the title, then the rows in columns
/// sized to their widest cell, each line ending in a newline; nothing when
/// `rows` has no data row.
pub fn titled_table(title: &str, header: &[&str], rows: Vec<Vec<String>>) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut table = Table::new(header.iter().copied());
    for row in rows {
        table.push(row);
    }
    format!("\n{title}\n{}", joined(table.lines()))
}

/// `Key = value` lines, the keys padded to the longest.
pub fn key_values(pairs: &[(&str, String)]) -> Vec<String> {
    let width = pairs
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| format!("{k:<width$} = {v}"))
        .collect()
}

/// Lines as one text, each ending in a newline.
pub fn joined(lines: Vec<String>) -> String {
    lines.into_iter().map(|l| l + "\n").collect()
}

/// Prints each line.
pub fn print_lines(lines: Vec<String>) {
    print!("{}", joined(lines));
}

/// A JSON scalar for people: a string, number or bool as it is, `none`
/// for null or an empty string; an array or object as JSON.
pub fn text_or(v: &Value, none: &str) -> String {
    match v {
        Value::String(s) if !s.is_empty() => s.clone(),
        Value::String(_) | Value::Null => none.to_string(),
        other => other.to_string(),
    }
}

/// [`text_or`] with `-` for none.
pub fn text(v: &Value) -> String {
    text_or(v, "-")
}

/// An ID of the API's JSON as tables show it: its first eight characters;
/// `-` for none.
pub fn id_cell(id: &Value) -> String {
    match id.as_str() {
        Some(id) if !id.is_empty() => short_id(id).to_string(),
        _ => "-".to_string(),
    }
}

/// An ID in full with -verbose, else as tables show it.
pub fn shown_id(id: &str, verbose: bool) -> &str {
    if verbose {
        id
    } else {
        short_id(id)
    }
}

/// A time of the API's JSON (unix milliseconds) as `3m ago`; `-` when
/// unknown.
pub fn ago_cell(ms: &Value) -> String {
    match ms.as_i64() {
        Some(ms) if ms > 0 => ago(ms),
        _ => "-".to_string(),
    }
}

/// The first eight characters of an ID, as tables show it.
pub fn short_id(id: &str) -> &str {
    match id.char_indices().nth(8) {
        Some((at, _)) => &id[..at],
        None => id,
    }
}

/// How long ago `ms` (unix milliseconds) was, for people: `12s ago`,
/// `3m ago`, `2h5m ago`, `4d ago`; `never` for none.
pub fn ago(ms: i64) -> String {
    ago_at(ms, berth_structs::now_ms())
}

/// [`ago`] as seen at `now_ms`.
pub fn ago_at(ms: i64, now_ms: i64) -> String {
    if ms <= 0 {
        return "never".into();
    }
    let secs = u64::try_from(now_ms.saturating_sub(ms)).unwrap_or(0) / 1000;
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let text = match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m"),
        (0, _, 0) => format!("{h}h"),
        (0, _, _) => format!("{h}h{m}m"),
        (_, 0, _) => format!("{d}d"),
        (_, _, _) => format!("{d}d{h}h"),
    };
    format!("{text} ago")
}

/// Unix milliseconds as an RFC 3339 UTC time to the second:
/// `2026-12-01T12:40:03Z`; `-` for none.
pub fn format_time(ms: i64) -> String {
    match u64::try_from(ms) {
        Ok(ms) if ms > 0 => {
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
        }
        _ => "-".to_string(),
    }
}

/// Bytes for people: `512 B`, `1.5 KiB`, `20.0 MiB`.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn columns_are_as_wide_as_their_widest_cell_without_trailing_spaces() {
        let mut t = Table::new(["ID", "Name", "Status"]);
        t.push(["0123abcd", "a-rather-long-name", "running"]);
        t.push(["ff", "é", ""]);
        t.push(["x", "free text that runs past the columns"]);
        assert_eq!(
            t.lines(),
            vec![
                "ID        Name                Status",
                "0123abcd  a-rather-long-name  running",
                "ff        é",
                "x         free text that runs past the columns",
            ]
        );
    }

    #[test]
    fn ages_times_ids_and_sizes_for_people() {
        let now = 1_000_000_000_000;
        assert_eq!(ago_at(now - 12_000, now), "12s ago");
        assert_eq!(ago_at(now - 180_000, now), "3m ago");
        assert_eq!(ago_at(now - (2 * 3600 + 5 * 60) * 1000, now), "2h5m ago");
        assert_eq!(ago_at(now - 3 * 3600 * 1000, now), "3h ago");
        assert_eq!(ago_at(now - 4 * 86_400_000, now), "4d ago");
        assert_eq!(ago_at(now - (4 * 86_400 + 7200) * 1000, now), "4d2h ago");
        assert_eq!(ago_at(0, now), "never");
        assert_eq!(ago_at(now + 5000, now), "0s ago");
        assert_eq!(format_time(1_796_120_000_000), "2026-12-01T10:13:20Z");
        assert_eq!(format_time(0), "-");
        assert_eq!(short_id("0123456789abcdef"), "01234567");
        assert_eq!(short_id("web"), "web");
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(20 << 20), "20.0 MiB");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(u64::MAX), "16.0 EiB");
        assert_eq!(text(&json!("")), "-");
        assert_eq!(text_or(&Value::Null, "<none>"), "<none>");
        assert_eq!(text(&json!(3)), "3");
        assert_eq!(text(&json!(true)), "true");
        assert_eq!(id_cell(&json!("0123456789")), "01234567");
        assert_eq!(id_cell(&Value::Null), "-");
        assert_eq!(ago_cell(&json!(0)), "-");
        assert_eq!(
            key_values(&[("ID", "a".into()), ("Name", "b".into())]),
            vec!["ID   = a", "Name = b"]
        );
        assert_eq!(titled_table("T", &["A"], Vec::new()), "");
        assert_eq!(
            titled_table("T", &["A", "B"], vec![vec!["xyz".into(), "1".into()]]),
            "\nT\nA    B\nxyz  1\n"
        );
    }

    #[test]
    fn templates_see_the_value_and_an_objects_fields() {
        let job = json!({"id": "web", "status": "running"});
        assert_eq!(
            render_template("{{ id }} is {{ value.status }}", &job).unwrap(),
            "web is running"
        );
        let jobs = json!([{"id": "a"}, {"id": "b"}]);
        assert_eq!(
            render_template("{% for j in value %}{{ j.id }};{% endfor %}", &jobs).unwrap(),
            "a;b;"
        );
        let e = render_template("{{ nope }}", &job).unwrap_err().to_string();
        assert!(e.contains("undefined"), "{e}");
        assert!(render_template("{% for %}", &job).is_err());
    }
}
