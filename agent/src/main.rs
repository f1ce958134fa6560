use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use gardenet_agent::{dataplane, run};

/// gardenet: eBPF Service load balancing (a kube-proxy replacement).
#[derive(Parser)]
#[command(name = "gardenet-agent", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load the datapath, follow a source of Services and program them.
    Run(run::RunArgs),
    /// Inspect the programmed load-balancer maps.
    Lb {
        #[command(subcommand)]
        cmd: LbCmd,
    },
}

#[derive(Subcommand)]
enum LbCmd {
    /// List programmed frontends and their backends, read from the pinned maps.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// bpffs directory the agent pins its maps in.
        #[arg(long, default_value = dataplane::DEFAULT_BPFFS)]
        bpffs: PathBuf,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
            .block_on(run::run(args)),
        Cmd::Lb { cmd: LbCmd::List { json, bpffs } } => run::lb_list(&bpffs, json),
    }
}
