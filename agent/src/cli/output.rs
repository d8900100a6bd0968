//! How read commands print: `-json` (the API's JSON, pretty), `-t
//! TEMPLATE`, or the command's own human output.

use anyhow::{bail, Result};
use clap::Args;
use serde_json::Value;

/// The output flags every read command flattens in
/// (`#[command(flatten)] pub output: OutputArgs`).
#[derive(Args, Debug, Clone, Default)]
pub struct OutputArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// Format the API's JSON with a template
    #[arg(short = 't', value_name = "TEMPLATE", conflicts_with = "json")]
    pub template: Option<String>,
}

impl OutputArgs {
    /// Prints `v` as the flags ask: JSON, a template, or `human(v)`.
    pub fn emit(&self, v: &Value, human: impl FnOnce(&Value) -> Result<()>) -> Result<i32> {
        if self.json {
            println!("{}", serde_json::to_string_pretty(v)?);
        } else if self.template.is_some() {
            bail!("-t templates are not supported yet");
        } else {
            human(v)?;
        }
        Ok(0)
    }
}
