//! `berth plugin status`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use super::http_client::ApiClient;
use super::{enc, print_json, Ctx};

#[derive(Subcommand, Debug)]
pub enum PluginCommand {
    /// Show CSI plugins, or one plugin
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    /// The plugin's ID (none: every plugin)
    #[arg(value_name = "PLUGIN")]
    pub plugin: Option<String>,
}

pub fn run(cmd: PluginCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        PluginCommand::Status(a) => plugin_status(a, ctx.api()),
    }
}

fn plugin_status(a: StatusArgs, api: &ApiClient) -> Result<i32> {
    let v = match &a.plugin {
        Some(id) => api.get(&format!("/v1/plugin/csi/{}", enc(&id)))?,
        None => api.get("/v1/plugins")?,
    };
    if a.json {
        return print_json(&v);
    }
    let plugins = match &v {
        Value::Array(a) => a.clone(),
        other => vec![other.clone()],
    };
    println!(
        "{:<20} {:<28} {:<20} {:<20}",
        "ID", "Provider", "Controllers", "Nodes"
    );
    for p in &plugins {
        println!(
            "{:<20} {:<28} {:<20} {:<20}",
            p["id"].as_str().unwrap_or_default(),
            p["provider"].as_str().unwrap_or_default(),
            format!(
                "{}/{} healthy",
                p["controllers_healthy"], p["controllers_expected"]
            ),
            format!("{}/{} healthy", p["nodes_healthy"], p["nodes_expected"])
        );
    }
    Ok(0)
}
