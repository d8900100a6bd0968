//! Durations and sizes as operators write them in specs.

use std::time::Duration;

use crate::limits;

/// A duration such as "30s", "5m", "1h30m" or "250ms".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| match e {
        humantime::DurationError::NumberOverflow => format!("duration {s:?} is too large"),
        e => format!("invalid duration {s:?} ({e}); write e.g. \"30s\" or \"5m\""),
    })
}

/// A duration of at most `max`: `"100y" is too large (at most 1year)`,
/// also when it does not even fit a [`Duration`].
pub(super) fn parse_duration_at_most(s: &str, max: Duration) -> Result<Duration, String> {
    let too_large = || limits::too_large(format!("{s:?}"), limits::duration_text(max));
    match humantime::parse_duration(s.trim()) {
        Ok(d) if d <= max => Ok(d),
        Ok(_) | Err(humantime::DurationError::NumberOverflow) => Err(too_large()),
        Err(_) => parse_duration(s),
    }
}

/// A size in bytes: a bare number of bytes ("1048576") or a number with a
/// unit, decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB), any case,
/// with or without a space: "10MiB", "1.5 GB".
pub fn parse_size(s: &str) -> Result<u64, String> {
    match size_bytes(s)? {
        Some(bytes) => u64::try_from(bytes).map_err(|_| format!("invalid size {s:?}: too large")),
        None => Err(format!("invalid size {s:?}: too large")),
    }
}

/// A size of at most `max` bytes; `limit` says the limit in messages.
pub(super) fn parse_size_at_most(s: &str, max: u64, limit: &str) -> Result<u64, String> {
    match size_bytes(s)? {
        Some(bytes) if bytes <= u128::from(max) => {
            u64::try_from(bytes).map_err(|_| limits::too_large(format!("{s:?}"), limit))
        }
        _ => Err(limits::too_large(format!("{s:?}"), limit)),
    }
}

/// The bytes `s` says, or None when they do not even fit a `u128`; an
/// error for a malformed size.
fn size_bytes(s: &str) -> Result<Option<u128>, String> {
    let text = s.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = unit.trim();
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "ki" | "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mi" | "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gi" | "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "ti" | "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "invalid size {s:?}: unknown unit {unit:?} (want B, KB, KiB, MB, MiB, GB, GiB, TB or TiB)"
            ))
        }
    };
    let bad_number = || {
        format!(
            "invalid size {s:?}: want a number of bytes or a number with a unit, e.g. \"10MiB\""
        )
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() || number.ends_with('.') || fraction.contains('.') {
        return Err(bad_number());
    }
    // Only digits are left: a whole part that does not parse is too long.
    let Ok(whole) = whole.parse::<u128>() else {
        return Ok(None);
    };
    let mut bytes = whole.checked_mul(multiplier);
    if !fraction.is_empty() {
        // At most 12 fractional digits matter below the largest unit.
        let digits = &fraction[..fraction.len().min(12)];
        let scale = 10u128.pow(digits.len() as u32);
        let frac: u128 = digits.parse().map_err(|_| bad_number())?;
        // frac < 10^12 and multiplier <= 2^40: the product fits.
        bytes = bytes.and_then(|b| b.checked_add(frac.saturating_mul(multiplier) / scale));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_with_units_become_bytes() {
        assert_eq!(parse_size("1048576"), Ok(1_048_576));
        assert_eq!(parse_size("10MiB"), Ok(10 * 1024 * 1024));
        assert_eq!(parse_size("10 MiB"), Ok(10 * 1024 * 1024));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1gib"), Ok(1 << 30));
        assert_eq!(parse_size("2KB"), Ok(2_000));
        assert_eq!(parse_size("2KiB"), Ok(2_048));
        assert_eq!(parse_size("3MB"), Ok(3_000_000));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1TB"), Ok(1_000_000_000_000));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn malformed_sizes_are_rejected() {
        for bad in [
            "",
            "MiB",
            "10XB",
            "1.2.3MiB",
            "-1MiB",
            "1.MiB",
            ".5MiB",
            "99999999999TiB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn a_fraction_that_overflows_the_whole_part_is_too_large_not_a_panic() {
        // 340282366920938463463374607431768211 KB is 455 bytes short of
        // u128::MAX; .999 KB more would overflow.
        let s = "340282366920938463463374607431768211.999KB";
        assert_eq!(parse_size(s), Err(format!("invalid size {s:?}: too large")));
        assert!(parse_size_at_most(s, 1 << 60, "1 EiB")
            .unwrap_err()
            .contains("is too large (at most 1 EiB)"));
    }

    #[test]
    fn durations_beyond_any_duration_are_too_large() {
        let s = "99999999999999999999999h";
        assert_eq!(
            parse_duration(s),
            Err(format!("duration {s:?} is too large"))
        );
        assert_eq!(
            parse_duration_at_most(s, Duration::from_secs(60)),
            Err(format!("{s:?} is too large (at most 1m)"))
        );
        assert_eq!(
            parse_duration_at_most("61s", Duration::from_secs(60)),
            Err("\"61s\" is too large (at most 1m)".to_string())
        );
        assert_eq!(
            parse_duration_at_most("60s", Duration::from_secs(60)),
            Ok(Duration::from_secs(60))
        );
    }

    #[test]
    fn durations_parse_as_humantime() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("soon").is_err());
    }
}
