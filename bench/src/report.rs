//! What every figure prints: samples summed up as median, p99 and max;
//! ratios against a baseline measured in the same run; a target and
//! whether it was met; and how a cost grows over three sizes.
//!
//! With `BERTH_BENCH_RECORD=FILE` each figure printed is also appended to
//! FILE as one JSON line (`{"key", "value", "unit"}`): what `berth-bench
//! ab` compares between two builds.

use std::fmt;
use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use berth_sync::MutexExt;

/// The heading printed last: the figure the next lines belong to.
static FIGURE: Mutex<String> = Mutex::new(String::new());

/// Appends one printed figure to `BERTH_BENCH_RECORD`'s file, if set.
fn record(label: &str, value: f64, unit: &str) {
    let Some(path) = std::env::var_os("BERTH_BENCH_RECORD").filter(|p| !p.is_empty()) else {
        return;
    };
    let figure = FIGURE.locked().clone();
    let line = serde_json::json!({
        "key": format!("{figure}: {}", label.trim()),
        "value": value,
        "unit": unit,
    });
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        eprintln!("berth-bench: recording to {}: {e}", path.to_string_lossy());
    }
}

/// The number a printed value starts with and the unit after it
/// (`"2,345 allocs/s"`, `"12.3ms"`, `"0.87x"`); a duration's unit is
/// made ms, so that one figure printed as `980ms` and as `1.0s` compares.
pub fn number_of(text: &str) -> Option<(f64, String)> {
    let text = text.trim();
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ',' || c == '-'))
        .unwrap_or(text.len());
    let number: f64 = text[..end].replace(',', "").parse().ok()?;
    let unit = text[end..].trim();
    // Several figures on one line ("7.4 s / 19.1 s"): not one number.
    if unit.contains(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let scale = match unit {
        "ns" => Some(1e-6),
        "µs" | "us" => Some(1e-3),
        "ms" => Some(1.0),
        "s" => Some(1000.0),
        _ => None,
    };
    Some(match scale {
        Some(k) => (number * k, "ms".to_string()),
        None => (number, unit.to_string()),
    })
}

/// Durations measured for one thing, in any order.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    values: Vec<Duration>,
}

impl Samples {
    pub fn new() -> Samples {
        Samples::default()
    }

    pub fn push(&mut self, d: Duration) {
        self.values.push(d);
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The `p` quantile (0.0..=1.0), nearest rank; zero when empty.
    pub fn quantile(&self, p: f64) -> Duration {
        if self.values.is_empty() {
            return Duration::ZERO;
        }
        let mut sorted = self.values.clone();
        sorted.sort();
        let rank = (p.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
        sorted[rank.saturating_sub(1).min(sorted.len() - 1)]
    }

    pub fn median(&self) -> Duration {
        self.quantile(0.5)
    }

    pub fn p99(&self) -> Duration {
        self.quantile(0.99)
    }

    pub fn max(&self) -> Duration {
        self.values.iter().max().copied().unwrap_or_default()
    }
}

impl FromIterator<Duration> for Samples {
    fn from_iter<I: IntoIterator<Item = Duration>>(iter: I) -> Samples {
        Samples {
            values: iter.into_iter().collect(),
        }
    }
}

/// Sizes in KiB measured for one thing (the RSS of several processes,
/// or of one process read several times), in any order.
#[derive(Debug, Clone, Default)]
pub struct Sizes {
    kib: Vec<u64>,
}

impl Sizes {
    pub fn push(&mut self, kib: u64) {
        self.kib.push(kib);
    }

    pub fn len(&self) -> usize {
        self.kib.len()
    }

    /// The `p` quantile (0.0..=1.0) in KiB, nearest rank; zero when empty.
    pub fn quantile(&self, p: f64) -> u64 {
        if self.kib.is_empty() {
            return 0;
        }
        let mut sorted = self.kib.clone();
        sorted.sort_unstable();
        let rank = (p.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
        sorted[rank.saturating_sub(1).min(sorted.len() - 1)]
    }

    pub fn median(&self) -> u64 {
        self.quantile(0.5)
    }

    pub fn p99(&self) -> u64 {
        self.quantile(0.99)
    }

    pub fn max(&self) -> u64 {
        self.kib.iter().max().copied().unwrap_or_default()
    }
}

/// A duration in milliseconds with two decimals.
pub struct Ms(pub Duration);

impl fmt::Display for Ms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} ms", self.0.as_secs_f64() * 1000.0)
    }
}

/// A size in KiB shown in MiB with two decimals.
pub struct Mib(pub u64);

impl fmt::Display for Mib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} MiB", self.0 as f64 / 1024.0)
    }
}

/// Print the figure's heading: what is measured, and how often.
pub fn heading(figure: &str, what: &str) {
    *FIGURE.locked() = figure.to_string();
    println!("figure: {figure}: {what}");
}

/// Print one line of samples: `label  median X  p99 Y  max Z  (n=N)`.
pub fn samples(label: &str, s: &Samples) {
    record(label, s.median().as_secs_f64() * 1000.0, "ms");
    record(
        &format!("{label} (p99)"),
        s.p99().as_secs_f64() * 1000.0,
        "ms",
    );
    println!(
        "  {label:<34} median {:>10}  p99 {:>10}  max {:>10}  (n={})",
        Ms(s.median()).to_string(),
        Ms(s.p99()).to_string(),
        Ms(s.max()).to_string(),
        s.len()
    );
}

/// Print one line of sizes: `label  median X MiB  p99 Y MiB  max Z MiB  (n=N)`.
pub fn sizes(label: &str, s: &Sizes) {
    record(label, s.median() as f64 / 1024.0, "MiB");
    println!(
        "  {label:<34} median {:>10}  p99 {:>10}  max {:>10}  (n={})",
        Mib(s.median()).to_string(),
        Mib(s.p99()).to_string(),
        Mib(s.max()).to_string(),
        s.len()
    );
}

/// Print one labelled value (an RSS, a rate, a count).
pub fn value(label: &str, value: impl fmt::Display) {
    let value = value.to_string();
    if let Some((number, unit)) = number_of(&value) {
        record(label, number, &unit);
    }
    println!("  {label:<34} {value}");
}

/// The ratio of two medians, as printed (`2.31x`).
pub fn ratio(measured: &Samples, baseline: &Samples) -> f64 {
    let b = baseline.median().as_secs_f64();
    if b == 0.0 {
        return f64::INFINITY;
    }
    measured.median().as_secs_f64() / b
}

/// Print the ratio of `measured`'s median to `baseline`'s.
pub fn ratio_line(label: &str, measured: &Samples, baseline: &Samples) {
    value(label, format!("{:.2}x", ratio(measured, baseline)));
}

/// Print the target and whether it was met. Returns `met`, so a figure
/// can say so in its exit status when it wants to.
pub fn target(text: &str, met: bool) -> bool {
    println!(
        "  {:<34} {text}: {}",
        "target",
        if met { "MET" } else { "NOT MET" }
    );
    met
}

/// How a cost grows with size, from (size, cost) points of three or more
/// sizes: the exponent k of cost ~ size^k fitted between the smallest and
/// the largest size, and a word for it. `k` near 1 is linear; n log n
/// over 100..10,000 fits k of about 1.2.
pub fn growth(points: &[(f64, f64)]) -> Growth {
    let first = points.first().copied().unwrap_or((1.0, 1.0));
    let last = points.last().copied().unwrap_or(first);
    let k = if last.0 > first.0 && first.1 > 0.0 && last.1 > 0.0 {
        (last.1 / first.1).ln() / (last.0 / first.0).ln()
    } else {
        0.0
    };
    Growth { exponent: k }
}

#[derive(Debug, Clone, Copy)]
pub struct Growth {
    pub exponent: f64,
}

impl Growth {
    pub fn word(&self) -> &'static str {
        match self.exponent {
            k if k < 0.25 => "flat",
            k if k < 0.8 => "sublinear",
            k if k < 1.3 => "linear (or n log n)",
            k if k < 1.8 => "worse than n log n",
            _ => "quadratic or worse",
        }
    }
}

impl fmt::Display for Growth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (cost ~ n^{:.2})", self.word(), self.exponent)
    }
}

/// Print a growth table: one line per size, then the fitted growth.
pub fn growth_table(label: &str, unit: &str, points: &[(f64, f64)]) -> Growth {
    println!("  growth of {label}:");
    for (size, cost) in points {
        println!("    n = {size:>8}  {cost:>12.3} {unit}");
    }
    let g = growth(points);
    println!("    grows {g}");
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let s: Samples = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(s.median(), Duration::from_millis(50));
        assert_eq!(s.p99(), Duration::from_millis(99));
        assert_eq!(s.max(), Duration::from_millis(100));
        assert_eq!(Samples::new().median(), Duration::ZERO);
    }

    #[test]
    fn size_quantiles_are_nearest_rank() {
        let mut s = Sizes::default();
        for kib in (1..=100).rev() {
            s.push(kib);
        }
        assert_eq!((s.median(), s.p99(), s.max(), s.len()), (50, 99, 100, 100));
        assert_eq!(Sizes::default().median(), 0);
    }

    #[test]
    fn printed_values_are_read_back_as_numbers_and_units() {
        let read = |t: &str| number_of(t).map(|(n, u)| ((n * 1000.0).round() / 1000.0, u));
        assert_eq!(read("2,345 allocs/s"), Some((2345.0, "allocs/s".into())));
        assert_eq!(read("12.3ms"), Some((12.3, "ms".into())));
        assert_eq!(read("1.5s"), Some((1500.0, "ms".into())));
        assert_eq!(read("250µs"), Some((0.25, "ms".into())));
        assert_eq!(read("0.87x"), Some((0.87, "x".into())));
        assert_eq!(read("1.82 MiB"), Some((1.82, "MiB".into())));
        assert_eq!(read("/usr/bin/berth"), None);
        assert_eq!(read("7.4 s / 19.1 s / 9.5 s"), None);
    }

    #[test]
    fn growth_tells_linear_from_quadratic() {
        let linear = [(100.0, 1.0), (1000.0, 10.0), (10000.0, 100.0)];
        let quadratic = [(100.0, 1.0), (1000.0, 100.0), (10000.0, 10000.0)];
        let nlogn: Vec<(f64, f64)> = [100.0f64, 1000.0, 10000.0]
            .iter()
            .map(|n| (*n, n * n.ln()))
            .collect();
        assert!((growth(&linear).exponent - 1.0).abs() < 1e-9);
        assert_eq!(growth(&linear).word(), "linear (or n log n)");
        assert_eq!(growth(&nlogn).word(), "linear (or n log n)");
        assert_eq!(growth(&quadratic).word(), "quadratic or worse");
    }
}
