//! What `gardenet-agent run` needs to start and stop everything in this module: the
//! command-line flags ([`StatusArgs`], flattened into `RunArgs`), the HTTP endpoints, and
//! the reporters ([`Reporting`]). Kept here so `run.rs` only wires, and so the wiring is
//! compiled and tested with the parts it wires.

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use kube::Client;
use tokio::{sync::watch, task::JoinHandle};

use super::{
    lease::{Elector, LeaseTiming},
    network::{NetworkRef, NetworkReporter, NetworkReporterConfig},
    node::{NodeReporter, NodeReporterConfig},
    shutdown_channel,
};
use crate::{
    gardener::config::NetworkConfig,
    report::events::Warnings,
    report::health::{self, AgentState, InterfaceState},
    report::metrics::{ErrorKind, Metrics},
    source,
};

/// Flags of `gardenet-agent run` for health, metrics and status reporting.
#[derive(clap::Args, Clone, Debug)]
pub struct StatusArgs {
    /// Address of `/healthz` and `/readyz` (and `/metrics`).
    #[arg(long, default_value = "0.0.0.0:9878")]
    pub health_addr: SocketAddr,
    /// Address of `/metrics`; may be the same as `--health-addr`.
    #[arg(long, default_value = "0.0.0.0:9879")]
    pub metrics_addr: SocketAddr,
    /// Address of kube-proxy's health check (`/healthz`, `/livez`), which cloud load
    /// balancers probe; served only while gardenet routes Services. `off` disables it.
    #[arg(long, default_value = "0.0.0.0:10256", value_name = "ADDR|off")]
    pub proxy_healthz_addr: OptionalAddr,
    /// The Gardener Network (`NAMESPACE/NAME`) whose status the elected agent maintains.
    /// Without it, agents only report their own Node's condition.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub network: Option<NetworkRef>,
    /// Kubeconfig of the cluster holding the Network (Gardener: the seed). Default: the
    /// cluster the agent watches.
    #[arg(long, value_name = "PATH")]
    pub network_kubeconfig: Option<PathBuf>,
    /// Whether the shoot runs kube-proxy (the Shoot's `spec.kubernetes.kubeProxy.enabled`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub kube_proxy_enabled: bool,
    // `--config PATH` (the NetworkConfig file) is a `RunArgs` flag: the dataplane reads it
    // too. `Reporting::start` takes the loaded config.
}

/// A socket address, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionalAddr(pub Option<SocketAddr>);

impl std::str::FromStr for OptionalAddr {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" | "" => Ok(OptionalAddr(None)),
            _ => s.parse().map(|a| OptionalAddr(Some(a))),
        }
    }
}

/// Serves kube-proxy's health check on `--proxy-healthz-addr`. A taken port (kube-proxy still
/// running?) is reported, not fatal: the Services are routed all the same, and the port is
/// tried again until it is free (kube-proxy removed), so cloud load balancers reach the
/// node's health check without an agent restart. With `warnings`, the taken port is also a
/// Warning Event on the Node, as kube-proxy reports it.
pub fn serve_proxy_healthz(args: &StatusArgs, state: Arc<AgentState>, warnings: Option<Warnings>) -> Option<JoinHandle<anyhow::Result<()>>> {
    let addr = args.proxy_healthz_addr.0?;
    Some(tokio::spawn(async move {
        let listener = health::bind_retrying(addr, "kube-proxy's health check", |e| {
            if let Some(w) = &warnings {
                w.on_node("FailedToStartProxierHealthcheck", "StartKubeProxy", &format!("Failed to start node healthz on {addr}: {e}"));
            }
        })
        .await;
        tracing::info!("serving kube-proxy's health check (/healthz, /livez) on {addr}");
        health::serve_proxy_healthz(listener, state).await
    }))
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `--health-addr`, and on `--metrics-addr`
/// if that differs (both listeners serve every path: a probe or scraper pointed at either
/// works). Binds before returning, so a taken port fails the start.
pub async fn serve_endpoints(args: &StatusArgs, state: Arc<AgentState>, metrics: Arc<Metrics>) -> anyhow::Result<Vec<JoinHandle<anyhow::Result<()>>>> {
    let mut addrs = vec![args.health_addr];
    if args.metrics_addr != args.health_addr {
        addrs.push(args.metrics_addr);
    }
    let mut tasks = Vec::new();
    for addr in addrs {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the health/metrics endpoint {addr}"))?;
        tracing::info!("serving /healthz, /readyz and /metrics on {addr}");
        tasks.push(tokio::spawn(health::serve_on(listener, state.clone(), metrics.clone())));
    }
    Ok(tasks)
}

/// Feeds the selected interfaces (`(name, attached, last attach error)`, e.g. from the
/// link manager's snapshot) into readiness and metrics; counts each new attach error once.
pub fn report_interfaces(state: &AgentState, metrics: &Metrics, selected: impl IntoIterator<Item = (String, bool, Option<String>)>) {
    let before = state.snapshot().interfaces;
    let mut now = BTreeMap::new();
    for (name, attached, error) in selected {
        if error.is_some() && before.get(&name).and_then(|s| s.error.as_ref()) != error.as_ref() {
            metrics.error(ErrorKind::Attach);
        }
        now.insert(name, InterfaceState { attached, error });
    }
    metrics.set_interfaces(now.iter().map(|(name, s)| (name.as_str(), s.attached)));
    state.set_interfaces(now);
}

/// The running reporters; [`stop`](Self::stop) them to release the Lease.
pub struct Reporting {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Reporting {
    /// Starts the Node reporter, and with `--network` the election and the Network
    /// reporter. `client` talks to the cluster the agent watches; `config` is the agent's
    /// NetworkConfig (`--config`), used when the Network's providerConfig is unusable.
    pub async fn start(
        args: &StatusArgs,
        client: Client,
        node_name: &str,
        state: Arc<AgentState>,
        config: NetworkConfig,
        detach_on_exit: bool,
    ) -> anyhow::Result<Reporting> {
        let (stop, shutdown) = shutdown_channel();
        let mut tasks = Vec::new();
        let node_config = NodeReporterConfig { report_stopping: detach_on_exit, ..Default::default() };
        let node = NodeReporter::new(client.clone(), node_name, state, node_config)?;
        tasks.push(tokio::spawn(node.run(shutdown.clone())));

        if let Some(network) = &args.network {
            let network_client = match &args.network_kubeconfig {
                Some(path) => source::kube::client_from_env(Some(path.clone())).await.context("--network-kubeconfig")?,
                None => client.clone(),
            };
            // Unique per process: two pods of the DaemonSet on one node (rolling update
            // with surge) must not both believe they hold the Lease.
            let identity = format!("{node_name}_{:08x}", rand::random::<u32>());
            let elector = Elector::gardenet(client.clone(), identity, LeaseTiming::default())?;
            let config = NetworkReporterConfig { kube_proxy_enabled: args.kube_proxy_enabled, fallback_config: config, ..Default::default() };
            let reporter = NetworkReporter::new(client, network_client, network, elector.leadership(), config);
            tasks.push(tokio::spawn(reporter.run(shutdown.clone())));
            tasks.push(tokio::spawn(async move {
                if let Err(e) = elector.run(shutdown).await {
                    tracing::warn!("leader election: {e:#}");
                }
            }));
        }
        Ok(Reporting { stop, tasks })
    }

    /// Stops the reporters: releases the Lease (a successor need not wait for it to
    /// expire) and, with `--detach-on-exit`, marks the Node not ready. Bounded: shutdown
    /// must not hang on an unreachable API server.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let all = futures::future::join_all(self.tasks);
        if tokio::time::timeout(Duration::from_secs(10), all).await.is_err() {
            tracing::warn!("status reporters did not stop within 10s");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        status: StatusArgs,
    }

    #[test]
    fn interfaces_feed_readiness_and_metrics() {
        let (state, metrics) = (AgentState::default(), Metrics::new());
        let err = || Some("EBUSY".to_owned());
        report_interfaces(&state, &metrics, [("eth0".into(), true, None), ("eth1".into(), false, err())]);
        report_interfaces(&state, &metrics, [("eth0".into(), true, None), ("eth1".into(), false, err())]);
        assert_eq!(state.snapshot().interfaces.len(), 2);
        let text = metrics.encode();
        assert!(text.contains("gardenet_errors_total{kind=\"attach\"} 1"), "{text}");
        assert!(text.contains("gardenet_interface_attached{interface=\"eth1\"} 0"), "{text}");
        report_interfaces(&state, &metrics, [("eth0".into(), true, None)]);
        assert_eq!(state.snapshot().interfaces.keys().collect::<Vec<_>>(), ["eth0"]);
        assert!(!metrics.encode().contains("eth1"));
    }

    /// kube-proxy still holding 10256 when the agent starts: the agent serves the port once
    /// kube-proxy is gone, with no restart.
    #[tokio::test]
    async fn proxy_healthz_served_once_kube_proxy_lets_go() {
        let kube_proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = kube_proxy.local_addr().unwrap();
        let cli = Cli::try_parse_from(["x", &format!("--proxy-healthz-addr={addr}")]).unwrap();
        let task = serve_proxy_healthz(&cli.status, Arc::new(AgentState::default()), None).expect("a task");
        // Long enough for the first bind to fail.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!task.is_finished(), "the server gave up on a taken port");
        drop(kube_proxy);
        // Retries come 0.5, 1 and 2 s apart.
        let reply = crate::report::health::test_http::get_once_served(addr, "/livez").await;
        assert!(reply.starts_with("HTTP/1.1 "), "{reply}");
        assert!(reply.contains("lastUpdated"), "kube-proxy's JSON body: {reply}");
        task.abort();
    }

    #[test]
    fn flags() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.status.health_addr, "0.0.0.0:9878".parse().unwrap());
        assert_eq!(cli.status.metrics_addr, "0.0.0.0:9879".parse().unwrap());
        assert_eq!(cli.status.proxy_healthz_addr, OptionalAddr(Some("0.0.0.0:10256".parse().unwrap())));
        assert!(cli.status.kube_proxy_enabled);
        assert_eq!(cli.status.network, None);

        let cli = Cli::try_parse_from(["x", "--network", "shoot--a--b/b", "--kube-proxy-enabled", "false", "--metrics-addr", "127.0.0.1:9878"]).unwrap();
        assert_eq!(cli.status.network.unwrap().to_string(), "shoot--a--b/b");
        assert!(!cli.status.kube_proxy_enabled);
        assert!(Cli::try_parse_from(["x", "--network", "nonamespace"]).is_err());
        assert!(Cli::try_parse_from(["x", "--kube-proxy-enabled", "maybe"]).is_err());
    }
}
