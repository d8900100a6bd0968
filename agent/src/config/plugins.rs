//! `plugin "NAME" { config { ... } }` of the agent config: the task
//! drivers' settings, in Nomad's shape. berth reads one: `raw_exec`'s
//! `enabled` (a raw_exec task runs as root, held to nothing, so a client
//! agent runs none unless its config turns the driver on; `-dev` does).

use berth_structs::spec::hcl::{BodyReader, Source};
use berth_structs::spec::SpecError;

/// The drivers whose settings the agent knows.
const PLUGINS: &[&str] = &["raw_exec", "exec"];

/// What the `plugin` blocks of a config file set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginSettings {
    /// `plugin "raw_exec" { config { enabled = ... } }`.
    pub raw_exec_enabled: Option<bool>,
}

impl PluginSettings {
    pub const BLOCK: &'static str = "plugin";

    /// `later` over `self`.
    pub fn merge(self, later: PluginSettings) -> PluginSettings {
        PluginSettings {
            raw_exec_enabled: later.raw_exec_enabled.or(self.raw_exec_enabled),
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
                &["enabled"]
            } else {
                &[]
            };
            let c = BodyReader::unlabeled(src, c, p.ctx(), keys, &[])?;
            if name == "raw_exec" {
                settings.raw_exec_enabled = c.bool("enabled")?;
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
}
