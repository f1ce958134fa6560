//! `gardenet-extension run` (the controller) and `gardenet-extension admission` (the webhook).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use gardenet_agent::report::{shutdown_channel, Elector, LeaseTiming};
use gardenet_extension::{admission, controller, metrics::Metrics, serve};
use kube::Client;

#[derive(Parser)]
#[command(name = "gardenet-extension", about = "Gardener network extension of type gardenet")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The controller: reconciles Networks of type gardenet in the seed.
    Run(RunArgs),
    /// The validating webhook for Shoots of networking type gardenet.
    Admission(AdmissionArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Kubeconfig of the seed; default: in-cluster or $KUBECONFIG.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The gardenet-agent image rendered into shoots.
    #[arg(long, env = "GARDENET_AGENT_IMAGE")]
    agent_image: String,
    /// `/healthz`, `/readyz` and `/metrics`.
    #[arg(long, default_value = "0.0.0.0:8080")]
    health_addr: SocketAddr,
    /// Namespace of the leader election Lease (the extension's own namespace).
    #[arg(long, env = "LEADER_ELECTION_NAMESPACE", default_value = "default")]
    leader_election_namespace: String,
    #[arg(long, default_value = "gardenet-extension-leader-election")]
    leader_election_name: String,
    /// Unique per replica; default: the pod name.
    #[arg(long, env = "POD_NAME")]
    identity: String,
    /// How long Delete and Migrate wait for the ManagedResource to disappear.
    #[arg(long, default_value = "120", value_name = "SECONDS")]
    delete_timeout: u64,
}

#[derive(clap::Args)]
struct AdmissionArgs {
    #[arg(long, default_value = "0.0.0.0:10250")]
    addr: SocketAddr,
    /// PEM certificate chain.
    #[arg(long)]
    tls_cert: PathBuf,
    /// PEM private key.
    #[arg(long)]
    tls_key: PathBuf,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())).json().init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
    runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Admission(args) => admission::run(args.addr, &args.tls_cert, &args.tls_key).await,
        }
    })
}

/// SIGTERM (what Kubernetes sends) or SIGINT.
async fn terminated() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = Client::try_from(config)?;
    let metrics = Arc::new(Metrics::default());
    let health = Arc::new(serve::Health::default());
    let listener = tokio::net::TcpListener::bind(args.health_addr).await.with_context(|| format!("binding {}", args.health_addr))?;
    tokio::spawn(serve::serve(listener, health.clone(), metrics.clone()));

    let (stop_tx, stop) = shutdown_channel();
    let (namespace, name) = (&args.leader_election_namespace, &args.leader_election_name);
    let elector = Elector::new(client.clone(), namespace, name, args.identity.clone(), LeaseTiming::default())?;
    let leadership = elector.leadership();
    let election = tokio::spawn(elector.run(stop.clone()));
    let mut changes = leadership.subscribe();
    tracing::info!(identity = %args.identity, "waiting for leadership");
    while !leadership.is_leader() {
        tokio::select! {
            _ = changes.changed() => {}
            _ = terminated() => return Ok(()),
        }
    }
    tracing::info!("leading; starting the controller");
    let settings = controller::Settings { image: args.agent_image, delete_timeout: Duration::from_secs(args.delete_timeout), ..Default::default() };
    // Stop reconciling as soon as leadership is lost (another replica takes over) or on a signal.
    let lost = async move {
        let lost = async {
            while leadership.is_leader() {
                tokio::select! {
                    _ = changes.changed() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        };
        tokio::select! {
            _ = lost => tracing::warn!("lost leadership"),
            _ = terminated() => tracing::info!("stopping"),
        }
    };
    controller::run(client, settings, metrics, health, lost).await;
    let _ = stop_tx.send(true);
    let _ = election.await;
    Ok(())
}
