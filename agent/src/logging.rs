//! Logging set-up: events go to stderr as text or as JSON lines
//! (`log_json`), through a level filter that SIGHUP can change while the
//! agent runs (see [`LogControl::set_level`]).

use berth_sync::MutexExt;
use std::sync::Mutex;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// The environment variables that set the log filter, over the config's
/// `log_level`, in the order they are looked at.
const FILTER_VARS: [&str; 2] = ["BERTH_LOG", "RUST_LOG"];

/// Why a new log level was not applied.
#[derive(Debug, thiserror::Error)]
pub enum LogLevelError {
    #[error("log level {level:?} is not a log filter: {source}")]
    BadFilter {
        level: String,
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("the log filter cannot be changed: {0}")]
    Reload(#[from] reload::Error),
}

/// What [`LogControl::set_level`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LevelChange {
    /// The filter went from `from` to `to`.
    Changed { from: String, to: String },
    /// The filter already was this.
    Unchanged(String),
    /// `BERTH_LOG` or `RUST_LOG` sets the filter: the config's level does
    /// not apply.
    SetByEnvironment(String),
}

/// Changes the filter of the logging that [`init`] set up.
pub struct LogControl {
    handle: reload::Handle<EnvFilter, Registry>,
    /// The filter the environment sets, if it does.
    from_env: Option<String>,
    /// The filter in force.
    current: Mutex<String>,
}

/// Logs go to stderr, as JSON lines when `json`; `BERTH_LOG` (or
/// `RUST_LOG`) sets the filter, else `default_level` (the config's
/// `log_level`), else `info`. Returns the control that changes the level
/// later.
pub fn init(default_level: Option<&str>, json: bool) -> LogControl {
    let from_env = FILTER_VARS.iter().find_map(|var| std::env::var(var).ok());
    let ansi = !json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (subscriber, control) = subscriber(from_env, default_level, json, ansi, std::io::stderr);
    let _ = tracing::subscriber::set_global_default(subscriber);
    control
}

/// The subscriber [`init`] installs, writing to `writer`, and its control.
fn subscriber<W>(
    from_env: Option<String>,
    default_level: Option<&str>,
    json: bool,
    ansi: bool,
    writer: W,
) -> (impl tracing::Subscriber + Send + Sync, LogControl)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + Clone + 'static,
{
    let wanted = filter(from_env.clone(), default_level);
    // A filter the environment got wrong still leaves the agent logging:
    // its valid directives apply, the others are ignored.
    let (reload_layer, handle) = reload::Layer::new(EnvFilter::new(&wanted));
    let text = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(writer.clone())
            .with_ansi(ansi)
    });
    // A JSON line carries the fields of the spans it was logged in (the
    // alloc, task and volume an operation is about: `alloc_id`, `task`,
    // `volume_id`, `plugin_id`): the innermost as `span`, all of them,
    // outermost first, as `spans`.
    let json_lines = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(writer)
            .with_current_span(true)
            .with_span_list(true)
    });
    let subscriber = tracing_subscriber::registry()
        .with(reload_layer)
        .with(text)
        .with(json_lines);
    let control = LogControl {
        handle,
        from_env,
        current: Mutex::new(wanted),
    };
    (subscriber, control)
}

/// The log filter: the environment's, else the config's level, else
/// `info`.
fn filter(from_env: Option<String>, default_level: Option<&str>) -> String {
    from_env
        .or_else(|| default_level.map(str::to_string))
        .unwrap_or_else(|| "info".to_string())
}

impl LogControl {
    /// Applies the config's `log_level` (`None`: the default, `info`),
    /// unless the environment sets the filter. A level that is not a
    /// filter is refused and the one in force kept.
    pub fn set_level(&self, level: Option<&str>) -> Result<LevelChange, LogLevelError> {
        if let Some(env) = &self.from_env {
            return Ok(LevelChange::SetByEnvironment(env.clone()));
        }
        let wanted = filter(None, level);
        let new = EnvFilter::try_new(&wanted).map_err(|source| LogLevelError::BadFilter {
            level: wanted.clone(),
            source,
        })?;
        let mut current = self.current.locked();
        if *current == wanted {
            return Ok(LevelChange::Unchanged(wanted));
        }
        self.handle.reload(new)?;
        let from = std::mem::replace(&mut *current, wanted.clone());
        Ok(LevelChange::Changed { from, to: wanted })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Everything the subscriber writes, for the test to read.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Captured {
        type Writer = Captured;
        fn make_writer(&'w self) -> Captured {
            self.clone()
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[test]
    fn log_level_sets_the_filter_unless_the_environment_does() {
        assert_eq!(filter(None, None), "info");
        assert_eq!(filter(None, Some("debug")), "debug");
        assert_eq!(filter(Some("warn".into()), Some("debug")), "warn");
    }

    #[test]
    fn set_level_changes_what_is_logged_while_running() {
        let out = Captured::default();
        let (subscriber, control) = subscriber(None, Some("info"), false, false, out.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::debug!("hidden at info");
            assert_eq!(
                control.set_level(Some("debug")).unwrap(),
                LevelChange::Changed {
                    from: "info".into(),
                    to: "debug".into()
                }
            );
            tracing::debug!("shown at debug");
            assert_eq!(
                control.set_level(Some("debug")).unwrap(),
                LevelChange::Unchanged("debug".into())
            );
            // A level that is no filter is refused; debug stays.
            let e = control.set_level(Some("loud=[")).unwrap_err();
            assert!(e.to_string().contains("\"loud=[\""), "{e}");
            tracing::debug!("still shown");
            // No level is the default, info.
            control.set_level(None).unwrap();
            tracing::debug!("hidden again");
            tracing::info!("info is shown");
        });
        let text = out.text();
        assert!(!text.contains("hidden"), "{text}");
        for shown in ["shown at debug", "still shown", "info is shown"] {
            assert!(text.contains(shown), "{shown}: {text}");
        }
    }

    #[test]
    fn the_environment_filter_is_kept_over_a_reloaded_level() {
        let out = Captured::default();
        let (subscriber, control) =
            subscriber(Some("warn".into()), None, false, false, out.clone());
        tracing::subscriber::with_default(subscriber, || {
            assert_eq!(
                control.set_level(Some("debug")).unwrap(),
                LevelChange::SetByEnvironment("warn".into())
            );
            tracing::info!("hidden at warn");
        });
        assert!(!out.text().contains("hidden"));
    }

    #[test]
    fn log_json_writes_one_json_object_a_line_with_the_fields() {
        let out = Captured::default();
        let (subscriber, _control) = subscriber(None, None, true, false, out.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(alloc_id = "a1", tasks = 2, "restoring alloc");
            tracing::warn!("second line");
        });
        let text = out.text();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["level"], "INFO");
        assert_eq!(lines[0]["fields"]["message"], "restoring alloc");
        assert_eq!(lines[0]["fields"]["alloc_id"], "a1");
        assert_eq!(lines[0]["fields"]["tasks"], 2);
        assert_eq!(lines[1]["level"], "WARN");
    }

    #[test]
    fn log_json_lines_carry_the_fields_of_their_spans() {
        let out = Captured::default();
        let (subscriber, _control) = subscriber(None, None, true, false, out.clone());
        tracing::subscriber::with_default(subscriber, || {
            let alloc = tracing::info_span!("alloc", alloc_id = "a1");
            let _alloc = alloc.enter();
            let task = tracing::info_span!("task", alloc_id = "a1", task = "web");
            let _task = task.enter();
            tracing::info!(volume_id = "data", "task started");
        });
        let text = out.text();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["fields"]["volume_id"], "data", "{text}");
        assert_eq!(line["span"]["alloc_id"], "a1", "{text}");
        assert_eq!(line["span"]["task"], "web", "{text}");
        assert_eq!(line["spans"][0]["name"], "alloc", "{text}");
        assert_eq!(line["spans"][1]["task"], "web", "{text}");
    }
}
