//! Words for counts, one rule for every message and output: "1 claim",
//! "2 claims", "0 claims".

/// `n` and the word for one thing or for many, as `n` asks.
pub fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

/// [`count`] of a `usize` (a length).
pub fn count_of(n: usize, one: &str, many: &str) -> String {
    count(u64::try_from(n).unwrap_or(u64::MAX), one, many)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_thing_is_singular_and_any_other_count_plural() {
        assert_eq!(count(1u32, "claim", "claims"), "1 claim");
        assert_eq!(count(0u32, "claim", "claims"), "0 claims");
        assert_eq!(count(2u64, "alloc", "allocs"), "2 allocs");
        assert_eq!(count_of(1, "node secret", "node secrets"), "1 node secret");
    }
}
