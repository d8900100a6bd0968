//! `plugin "NAME" { config { ... } }` of the agent config: the task
//! drivers' settings, in Nomad's shape: `raw_exec`'s `enabled` (a
//! raw_exec task runs as root, held to nothing, so a client agent runs
//! none unless its config turns the driver on; `-dev` does), and each
//! driver's `denied_host_uids` and `denied_host_gids` (`"0,10-20"`: the
//! users its tasks may not run as; `exec` denies uid 0 unless set).

use berth_allocrunner::users::{DeniedIds, IdRanges};
use berth_structs::spec::hcl::{BodyReader, Source};
use berth_structs::spec::SpecError;

/// The drivers whose settings the agent knows.
const PLUGINS: &[&str] = &["raw_exec", "exec"];

const DENIED_UIDS: &str = "denied_host_uids";
const DENIED_GIDS: &str = "denied_host_gids";

/// What the `plugin` blocks of a config file set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginSettings {
    /// `plugin "raw_exec" { config { enabled = ... } }`.
    pub raw_exec_enabled: Option<bool>,
    /// `plugin "exec" { config { denied_host_uids, denied_host_gids } }`.
    pub exec_denied: Option<DeniedIds>,
    /// The same of `raw_exec`.
    pub raw_exec_denied: Option<DeniedIds>,
}

impl PluginSettings {
    pub const BLOCK: &'static str = "plugin";

    /// `later` over `self`.
    pub fn merge(self, later: PluginSettings) -> PluginSettings {
        PluginSettings {
            raw_exec_enabled: later.raw_exec_enabled.or(self.raw_exec_enabled),
            exec_denied: later.exec_denied.or(self.exec_denied),
            raw_exec_denied: later.raw_exec_denied.or(self.raw_exec_denied),
        }
    }

    /// The `plugin` blocks of `r`: each names a known driver, once.
    pub fn parse(src: &Source<'_>, r: &BodyReader<'_, '_>) -> Result<PluginSettings, SpecError> {
        let mut settings = PluginSettings::default();
        let mut seen: Vec<String> = Vec::new();
        for b in r.blocks(Self::BLOCK) {
            let (name, p) =
                BodyReader::labeled(src, b, r.ctx(), "the driver's name", &[], &["config"])?;
            if !PLUGINS.contains(&name.as_str()) {
                return Err(r.invalid(
                    Self::BLOCK,
                    format!(
                        "unknown driver {name:?} (want one of {})",
                        PLUGINS.join(", ")
                    ),
                ));
            }
            if seen.contains(&name) {
                return Err(r.invalid(Self::BLOCK, format!("plugin {name:?} is set twice")));
            }
            seen.push(name.clone());
            let Some(c) = p.optional_block("config")? else {
                continue;
            };
            let keys: &[&str] = if name == "raw_exec" {
                &["enabled", DENIED_UIDS, DENIED_GIDS]
            } else {
                &[DENIED_UIDS, DENIED_GIDS]
            };
            let c = BodyReader::unlabeled(src, c, p.ctx(), keys, &[])?;
            let ranges = |key: &str| -> Result<Option<IdRanges>, SpecError> {
                c.string(key)?
                    .map(|v| v.parse::<IdRanges>().map_err(|e| c.invalid(key, e)))
                    .transpose()
            };
            let (uids, gids) = (ranges(DENIED_UIDS)?, ranges(DENIED_GIDS)?);
            let denied = (uids.is_some() || gids.is_some()).then(|| DeniedIds {
                uids: uids.unwrap_or_default(),
                gids: gids.unwrap_or_default(),
            });
            if name == "raw_exec" {
                settings.raw_exec_enabled = c.bool("enabled")?;
                settings.raw_exec_denied = denied;
            } else {
                settings.exec_denied = denied;
            }
        }
        Ok(settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PluginSettings, SpecError> {
        let src = Source::new(text);
        let body = src.parse_body()?;
        let r = BodyReader::new(&src, &body, "the agent config".into(), 1, &[], &["plugin"])?;
        PluginSettings::parse(&src, &r)
    }

    #[test]
    fn raw_exec_is_turned_on_in_nomads_shape_and_bad_blocks_are_named() {
        let on = parse("plugin \"raw_exec\" {\n config {\n enabled = true\n }\n}\n").unwrap();
        assert_eq!(on.raw_exec_enabled, Some(true));
        assert_eq!(parse("").unwrap().raw_exec_enabled, None);
        assert_eq!(
            PluginSettings::default().merge(on.clone()).raw_exec_enabled,
            Some(true)
        );
        let err = parse("plugin \"docker\" {\n}\n").unwrap_err().to_string();
        assert!(err.contains("unknown driver \"docker\""), "{err}");
        let err = parse("plugin \"raw_exec\" {\n config {\n enable = true\n }\n}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("enable"), "{err}");
        let err = parse("plugin \"raw_exec\" {\n}\nplugin \"raw_exec\" {\n}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("set twice"), "{err}");
    }

    #[test]
    fn denied_host_ids_are_read_per_driver_and_bad_ranges_are_named() {
        let s = parse(
            "plugin \"exec\" {\n config {\n denied_host_uids = \"0-999\"\n }\n}\n\
             plugin \"raw_exec\" {\n config {\n denied_host_gids = \"0\"\n }\n}\n",
        )
        .unwrap();
        let exec = s.exec_denied.expect("exec's");
        assert!(exec.uids.contains(999) && exec.gids.is_empty());
        let raw = s.raw_exec_denied.expect("raw_exec's");
        assert!(raw.gids.contains(0) && raw.uids.is_empty());
        assert_eq!(parse("").unwrap().exec_denied, None);
        let err = parse("plugin \"exec\" {\n config {\n denied_host_uids = \"x\"\n }\n}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("denied_host_uids") && err.contains("not a uid"),
            "{err}"
        );
    }
}
