//! `berth-bench ab`: one figure measured against two builds of berth, in
//! one run. The figure runs with the old build's binaries and with this
//! build's in turn (old first in odd rounds, new first in even ones, so
//! that a machine that warms up or slows down over the run favours
//! neither), and the medians of each printed line are set side by side:
//! the ratio new/old, and whether the two differ by more than the spread
//! of their rounds. The measuring code is this build's for both sides;
//! only the binaries it drives differ (`BERTH_BIN_DIR`).
//!
//! `scripts/bench ab REV FIGURE [ARGS]` builds REV's binaries and runs
//! this.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The binaries a figure drives: each side must have them all.
const BINARIES: [&str; 3] = ["berth", "berth-executor", "hostpath-plugin"];

#[derive(clap::Args)]
pub struct Args {
    /// The older build's binaries (its `target/release`)
    #[arg(long, value_name = "DIR")]
    pub old: PathBuf,
    /// This build's binaries (default: the directory of berth-bench)
    #[arg(long, value_name = "DIR")]
    pub new: Option<PathBuf>,
    /// Runs of the figure with each build (3 or more tell a difference
    /// from noise)
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// What the old build is called in the table (e.g. its commit)
    #[arg(long, default_value = "old")]
    pub old_name: String,
    /// The figure and its arguments, as `berth-bench` takes them
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub figure: Vec<String>,
}

/// One side of the comparison.
struct Side {
    name: String,
    dir: PathBuf,
}

/// Each printed line's values, by side, in the order first printed.
#[derive(Default)]
struct Table {
    keys: Vec<(String, String)>,
    values: BTreeMap<String, [Vec<f64>; 2]>,
}

pub fn run(a: &Args) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if a.figure.first().is_some_and(|f| f == "ab" || f == "smoke") {
        bail!("ab compares one figure: name it (job-run, claims-release, ...)");
    }
    let new = match &a.new {
        Some(dir) => dir.clone(),
        None => berth_testutil::bin_dir(),
    };
    let mut sides = [
        Side {
            name: a.old_name.clone(),
            dir: a.old.clone(),
        },
        Side {
            name: "new".into(),
            dir: new,
        },
    ];
    for side in &mut sides {
        // Absolute: the agents a figure starts find their binaries from
        // other working directories.
        side.dir = std::fs::canonicalize(&side.dir)
            .with_context(|| format!("the binaries' directory {}", side.dir.display()))?;
        check_binaries(&side.dir)?;
    }
    let me = std::env::current_exe().context("berth-bench's own path")?;
    let records = tempfile::tempdir().context("a directory for the records")?;
    let mut table = Table::default();
    let mut failed = Vec::new();
    for round in 0..a.rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let side = &sides[i];
            println!(
                "== ab round {}/{}: {} ({})",
                round + 1,
                a.rounds,
                side.name,
                side.dir.display()
            );
            let file = records.path().join(format!("{round}-{i}.jsonl"));
            let status = Command::new(&me)
                .args(&a.figure)
                .env("BERTH_BIN_DIR", &side.dir)
                .env("BERTH_BENCH_RECORD", &file)
                .status()
                .with_context(|| format!("running {}", me.display()))?;
            if !status.success() {
                failed.push(format!("round {} of {}: {status}", round + 1, side.name));
            }
            table.read(&file, i)?;
        }
    }
    print_table(&table, &sides, a.rounds);
    if !failed.is_empty() {
        bail!("the figure failed in {}", failed.join(", "));
    }
    Ok(())
}

fn check_binaries(dir: &Path) -> Result<()> {
    let missing: Vec<&str> = BINARIES
        .iter()
        .copied()
        .filter(|b| !dir.join(b).is_file())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} lacks {} (build them there: cargo build --release -p berth -p hostpath-plugin)",
            dir.display(),
            missing.join(", ")
        );
    }
    Ok(())
}

impl Table {
    /// Adds one run's records (absent when it printed none) to side `i`.
    fn read(&mut self, file: &Path, i: usize) -> Result<()> {
        let Ok(text) = std::fs::read_to_string(file) else {
            return Ok(());
        };
        for line in text.lines() {
            let r: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("a record: {line}"))?;
            let (Some(key), Some(value)) = (r["key"].as_str(), r["value"].as_f64()) else {
                continue;
            };
            if !self.values.contains_key(key) {
                let unit = r["unit"].as_str().unwrap_or_default().to_string();
                self.keys.push((key.to_string(), unit));
            }
            self.values.entry(key.to_string()).or_default()[i].push(value);
        }
        Ok(())
    }
}

fn print_table(table: &Table, sides: &[Side; 2], rounds: usize) {
    println!(
        "\nA/B over {rounds} {}: {} = {}, new = {}",
        if rounds == 1 { "round" } else { "rounds each" },
        sides[0].name,
        sides[0].dir.display(),
        sides[1].dir.display()
    );
    let width = table.keys.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!(
        "  {:<width$}  {:>14}  {:>14}  {:>8}  beyond the spread",
        "median of the rounds' medians", sides[0].name, "new", "new/old"
    );
    for (key, unit) in &table.keys {
        let [old, new] = &table.values[key];
        let (Some(o), Some(n)) = (median(old), median(new)) else {
            println!("  {key:<width$}  (printed by one side only)");
            continue;
        };
        let ratio = if o == 0.0 {
            "-".to_string()
        } else {
            format!("{:.2}x", n / o)
        };
        println!(
            "  {key:<width$}  {:>14}  {:>14}  {ratio:>8}  {}",
            format!("{} {unit}", shown(o)),
            format!("{} {unit}", shown(n)),
            beyond_spread(old, new)
        );
    }
}

/// A value with three significant digits or more.
fn shown(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// "yes" when every round of one side lies beyond every round of the
/// other (their ranges do not overlap); "no" when they overlap; "-" with
/// fewer than two rounds a side, where there is no spread to speak of.
fn beyond_spread(old: &[f64], new: &[f64]) -> &'static str {
    if old.len() < 2 || new.len() < 2 {
        return "-";
    }
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lo, hi)
    };
    let ((olo, ohi), (nlo, nhi)) = (range(old), range(new));
    if nhi < olo || nlo > ohi {
        "yes"
    } else {
        "no"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_counts_only_beyond_the_spread_of_the_rounds() {
        assert_eq!(beyond_spread(&[10.0, 11.0, 12.0], &[8.0, 9.0, 9.5]), "yes");
        assert_eq!(beyond_spread(&[10.0, 11.0, 12.0], &[9.0, 10.5, 9.5]), "no");
        assert_eq!(beyond_spread(&[10.0], &[8.0]), "-");
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
