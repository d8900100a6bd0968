//! Not measured yet.

use anyhow::{bail, Result};

#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: &Args) -> Result<()> {
    bail!("this figure is not written yet")
}

pub fn smoke() -> Result<()> {
    run(&Args {})
}
