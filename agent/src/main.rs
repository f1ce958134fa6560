use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use gardenet_agent::{commands, dataplane, run};

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
    // A flag given twice takes the last value (wrappers can append overrides).
    #[command(args_override_self = true)]
    Run(Box<run::RunArgs>),
    /// Every network interface: selected or skipped (with the reason), and the hooks attached.
    Links {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = dataplane::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// The running agent's state directory (default /run/gardenet/<bpffs dir name>).
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// NetworkConfig file, as given to `run`.
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        interfaces: gardenet_agent::links::InterfaceArgs,
    },
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
        Cmd::Run(args) => tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(run::run(*args)),
        Cmd::Lb { cmd: LbCmd::List { json, bpffs } } => commands::lb_list(&bpffs, json),
        Cmd::Links { json, bpffs, state_dir, config, interfaces } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(commands::links_report(&bpffs, state_dir, config.as_deref(), &interfaces, json)),
    }
}
