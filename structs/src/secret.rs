//! Secrets that configuration carries (an introduction token, say): kept
//! out of every `Debug` and `Display`.

/// A secret read from a configuration file: its value never reaches a
/// `Debug` or `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfigSecret(String);

impl ConfigSecret {
    pub fn new(value: impl Into<String>) -> ConfigSecret {
        ConfigSecret(value.into())
    }

    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ConfigSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConfigSecret(<redacted>)")
    }
}
