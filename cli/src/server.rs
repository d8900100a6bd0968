//! `berth server members`.

use anyhow::Result;
use clap::{Args, Subcommand};

use super::output::{ago_cell, print_lines, Table};
use super::{print_json, Ctx};

#[derive(Subcommand, Debug)]
pub enum ServerCommand {
    /// The servers of the cluster: name, addresses, which one leads, and
    /// when each last said it was there
    Members(MembersArgs),
}

#[derive(Args, Debug)]
pub struct MembersArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: ServerCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        ServerCommand::Members(a) => {
            let v = ctx.api().get("/v1/operator/servers")?;
            if a.json {
                return print_json(&v);
            }
            let mut table = Table::new(["Name", "Address", "HTTP", "Leader", "Last contact"]);
            for m in v.as_array().into_iter().flatten() {
                let text = |k: &str| m[k].as_str().unwrap_or_default().to_string();
                table.push([
                    text("name"),
                    text("rpc_addr"),
                    text("http_addr"),
                    m["leader"].as_bool().unwrap_or(false).to_string(),
                    ago_cell(&m["last_contact_ms"]),
                ]);
            }
            print_lines(table.lines());
            Ok(0)
        }
    }
}
