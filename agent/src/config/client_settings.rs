//! The client role's duration settings, one row each.
//!
//! A row names the key in `client { ... }` (when files may set it), the
//! `berth agent` flag (when there is one), the least value allowed and the
//! [`ClientConfig`] field it sets. The config file's allowed keys and its
//! parser, the flags' checks, the merging of files and flags and the
//! client's configuration are all read from [`CLIENT_DURATIONS`]: a new
//! setting is one row here, a field of `ClientConfig`, and (for a flag)
//! one field of `AgentArgs`, which a test holds to the table.

use std::collections::BTreeMap;
use std::time::Duration;

use berth_client::ClientConfig;

/// The least value a duration setting takes.
#[derive(Debug, Clone, Copy)]
pub enum Least {
    /// Any duration up to the largest berth reads.
    Any,
    /// Longer than 0s.
    NonZero,
    /// At least this long (whole seconds).
    AtLeast(Duration),
}

impl Least {
    /// What is wrong with `d`, in the words the messages use.
    pub fn problem(self, d: Duration) -> Option<String> {
        match self {
            Least::Any => None,
            Least::NonZero => d.is_zero().then(|| "must be longer than 0s".to_string()),
            Least::AtLeast(min) => {
                (d < min).then(|| format!("must be at least {}s", min.as_secs()))
            }
        }
    }
}

/// One duration setting of the client role.
pub struct ClientDurationSetting {
    /// The setting's name; also its key in `client { ... }` when `in_file`.
    pub key: &'static str,
    /// Whether a config file may set it.
    pub in_file: bool,
    /// The `berth agent` flag that sets it, without the dash.
    pub flag: Option<&'static str>,
    pub least: Least,
    /// Puts the value into the client's configuration.
    pub set: fn(&mut ClientConfig, Duration),
}

/// Every duration setting of the client role.
pub const CLIENT_DURATIONS: &[ClientDurationSetting] = &[
    ClientDurationSetting {
        key: "disconnect_startup_grace",
        in_file: true,
        flag: None,
        least: Least::Any,
        set: |c, d| c.disconnect_startup_grace = d,
    },
    ClientDurationSetting {
        key: "csi_volume_stats_interval",
        in_file: true,
        flag: Some("csi-volume-stats-interval"),
        least: Least::AtLeast(berth_csimanager::stats::MIN_VOLUME_STATS_INTERVAL),
        set: |c, d| c.csi_volume_stats_interval = d,
    },
    ClientDurationSetting {
        key: "csi_fingerprint_interval",
        in_file: true,
        flag: Some("csi-fingerprint-interval"),
        least: Least::NonZero,
        set: |c, d| c.csi_fingerprint_interval = d,
    },
    ClientDurationSetting {
        key: "csi_call_timeout",
        in_file: true,
        flag: None,
        least: Least::NonZero,
        set: |c, d| c.csi_call_timeout = d,
    },
    ClientDurationSetting {
        key: "gc_interval",
        in_file: false,
        flag: Some("gc-interval"),
        least: Least::NonZero,
        set: |c, d| c.gc_interval = d,
    },
    ClientDurationSetting {
        key: "gc_alloc_threshold",
        in_file: false,
        flag: Some("gc-alloc-threshold"),
        least: Least::Any,
        set: |c, d| c.gc_alloc_threshold = d,
    },
];

/// The keys of `client { ... }` that are duration settings.
pub fn file_keys() -> impl Iterator<Item = &'static str> {
    CLIENT_DURATIONS.iter().filter(|s| s.in_file).map(|s| s.key)
}

/// The setting the flag `flag` sets.
pub fn by_flag(flag: &str) -> Option<&'static ClientDurationSetting> {
    CLIENT_DURATIONS.iter().find(|s| s.flag == Some(flag))
}

/// The duration settings given, by key; what is absent keeps the client's
/// default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientDurations(BTreeMap<&'static str, Duration>);

impl ClientDurations {
    pub fn get(&self, key: &str) -> Option<Duration> {
        self.0.get(key).copied()
    }

    pub fn set(&mut self, key: &'static str, d: Duration) {
        self.0.insert(key, d);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `later` over `self`: every value `later` sets wins.
    pub fn merge(mut self, later: ClientDurations) -> ClientDurations {
        self.0.extend(later.0);
        self
    }

    /// Puts every value given into `config`.
    pub fn apply(&self, config: &mut ClientConfig) {
        for s in CLIENT_DURATIONS {
            if let Some(d) = self.get(s.key) {
                (s.set)(config, d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_of_the_table_is_a_flag_of_berth_agent() {
        use clap::Args;
        let agent = berth_cli::agent_args::AgentArgs::augment_args(clap::Command::new("agent"));
        let longs: Vec<&str> = agent.get_arguments().filter_map(|a| a.get_long()).collect();
        for s in CLIENT_DURATIONS {
            if let Some(flag) = s.flag {
                assert!(longs.contains(&flag), "-{flag} of {} is not a flag", s.key);
            }
        }
    }

    #[test]
    fn every_row_sets_its_own_field() {
        let base = ClientConfig::new("/nonexistent".into(), Vec::new());
        let mut seen = Vec::new();
        for (i, s) in CLIENT_DURATIONS.iter().enumerate() {
            let mut c = base.clone();
            // A value no default has, and different for every row.
            let d = Duration::from_secs(7_000 + i as u64);
            (s.set)(&mut c, d);
            let dbg = format!("{c:?}");
            assert_ne!(dbg, format!("{base:?}"), "{} set nothing", s.key);
            assert!(!seen.contains(&dbg), "{} sets what another row sets", s.key);
            seen.push(dbg);
        }
    }

    #[test]
    fn the_least_values_say_what_is_wrong() {
        assert_eq!(Least::Any.problem(Duration::ZERO), None);
        assert_eq!(
            Least::NonZero.problem(Duration::ZERO).as_deref(),
            Some("must be longer than 0s")
        );
        let least = Least::AtLeast(Duration::from_secs(1));
        assert_eq!(
            least.problem(Duration::from_millis(500)).as_deref(),
            Some("must be at least 1s")
        );
        assert_eq!(least.problem(Duration::from_secs(1)), None);
    }
}
