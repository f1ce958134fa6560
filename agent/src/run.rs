//! `gardenet-agent run`: wires source -> pipeline -> maps, and the datapath attachments.
use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use tokio::sync::mpsc;

use crate::{
    dataplane::lbmap::LbState,
    dataplane::mapfill::{Change, Fill, MapFills},
    dataplane::{self, Dataplane},
    desired::{Backend, Frontend, Proto},
    gardener::{
        capability::{self, LinuxHost, Requirements},
        config::{LocalRedirectRule, NodePortAddress},
    },
    pipeline::Pipeline,
    report,
    report::health::AgentState,
    report::metrics::{ErrorKind, Metrics},
    settings::{DataplaneSettings, Settings, SocketLb},
    source::listeners::ListenerWatch,
    source::{self, SourceEvent},
    translate::NodeInfo,
};

#[derive(Clone, Debug)]
pub enum SourceSpec {
    Kube,
    Dir(PathBuf),
}

fn parse_source(s: &str) -> Result<SourceSpec, String> {
    match s {
        "kube" => Ok(SourceSpec::Kube),
        _ => match s.strip_prefix("dir:") {
            Some(p) if !p.is_empty() => Ok(SourceSpec::Dir(p.into())),
            _ => Err(format!("{s:?}: expected `kube` or `dir:PATH`")),
        },
    }
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Where Services and EndpointSlices come from: `kube` or `dir:PATH`.
    #[arg(long, value_parser = parse_source, default_value = "kube")]
    pub source: SourceSpec,
    /// This node's name (its Node object gives NodePort addresses and zone).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    pub node_name: String,
    /// bpffs directory for pinned maps.
    #[arg(long, default_value = dataplane::DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// cgroup2 directory socket LB attaches to (default: the node's cgroup2 root).
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// Do not attach socket LB (TC LB only).
    #[arg(long)]
    pub no_socket_lb: bool,
    /// Interfaces to attach TC LB (and XDP) to whatever the patterns say: the same as
    /// `--interface-force` (repeat or comma-separate).
    #[arg(long = "tc-interface", value_delimiter = ',')]
    pub tc_interfaces: Vec<String>,
    #[command(flatten)]
    pub interfaces: crate::links::InterfaceArgs,
    /// NetworkConfig file (gardenet.networking.extensions.gardener.cloud/v1alpha1); flags win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where the agent publishes its state for `gardenet-agent links` (default
    /// /run/gardenet/<name of the --bpffs directory>).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// XDP on the TC interfaces: answers/drops traffic to frontends without backends before
    /// the stack sees it. `auto`: native where the driver supports it, generic otherwise.
    #[arg(long, value_enum)]
    pub xdp_mode: Option<dataplane::XdpMode>,
    /// Start from empty maps instead of adopting the pinned state of a previous run.
    #[arg(long)]
    pub reset: bool,
    /// Detach every program on exit. Off by default: pinned links keep Services working
    /// while the agent is down (e.g. during an upgrade).
    #[arg(long)]
    pub detach_on_exit: bool,
    /// Kubeconfig for `--source kube` (default: in-cluster, then KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// How often `dir:` sources look for changes, in milliseconds.
    #[arg(long, default_value_t = 300)]
    pub poll_ms: u64,
    /// Node addresses NodePorts are served on: `primary` (the first InternalIP of each family)
    /// and/or CIDRs of the Node's addresses, comma-separated; replaces the NetworkConfig's
    /// `nodePortAddresses` (default `primary`).
    #[arg(long, value_name = "primary|CIDR", value_delimiter = ',')]
    pub node_port_addresses: Vec<NodePortAddress>,
    /// Ignore Services' `spec.externalIPs` (NetworkConfig `externalIPs.enabled: false`).
    #[arg(long)]
    pub no_external_ips: bool,
    /// Send the ClusterIP traffic of Service NAMESPACE/NAME to a listener on ADDRESS on this
    /// node (same port) while one is bound there (repeatable); replaces the NetworkConfig's
    /// `localRedirects` and `nodeLocalDNS`.
    #[arg(long = "local-redirect", value_name = "NAMESPACE/NAME=ADDRESS")]
    pub local_redirects: Vec<LocalRedirectRule>,
    /// How often the local-redirect watch reads the socket tables, in milliseconds. For
    /// tests: with a long interval, a listener that goes away can only be noticed through
    /// sock_diag's socket-destroy notifications.
    #[arg(long, hide = true, default_value_t = crate::source::listeners::POLL_INTERVAL.as_millis() as u64)]
    pub local_redirect_poll_ms: u64,
    /// Map sizes (entries); default from the NetworkConfig.
    #[arg(long)]
    pub map_services: Option<u32>,
    #[arg(long)]
    pub map_backends: Option<u32>,
    #[arg(long)]
    pub map_conntrack: Option<u32>,
    /// How often the conntrack map is counted (its fill metric and pressure), in seconds.
    #[arg(long, default_value_t = 30)]
    pub conntrack_scan_secs: u64,
    /// How long the conntrack entries of a closed TCP flow (a FIN both ways or a RST) are
    /// kept before that scan removes them, in seconds (late retransmissions and the last ACK
    /// still find them); 0 leaves closed flows to the LRU.
    #[arg(long, default_value_t = 10)]
    pub conntrack_closed_secs: u64,
    /// The node's `/proc` (a hostPath mount in the DaemonSet): pods' network namespaces are
    /// found there when connected UDP sockets to a departed backend must be terminated.
    #[arg(long, default_value = "/proc")]
    pub host_proc: PathBuf,
    /// The cluster's NodePort range (the API server's `--service-node-port-range`): the part
    /// of it, and of TC LB's source-NAT ports, that the node's ephemeral port range includes
    /// is added to `net.ipv4.ip_local_reserved_ports`, so no local connection uses such a port.
    #[arg(long, default_value = "30000-32767")]
    pub node_port_range: dataplane::reserved_ports::PortRange,
    /// Leave `net.ipv4.ip_local_reserved_ports` alone.
    #[arg(long)]
    pub no_reserve_ports: bool,
    /// --health-addr, --metrics-addr, --network, --network-kubeconfig, --kube-proxy-enabled.
    #[command(flatten)]
    pub status: report::StatusArgs,
    /// --pod-network, --cni-bin-dir, --cni-conf-dir, --cni-state-dir, --cni-plugins-from.
    #[command(flatten)]
    pub pod_network: crate::podnet::PodNetArgs,
}

/// How long a TCP backend must stay gone from its Service before idle sockets to it are
/// terminated: an endpoint moving between EndpointSlices can be missing for one flush.
const TCP_TERMINATION_GRACE: Duration = Duration::from_secs(2);

/// Destroys socket LB's sockets of `proto` to `departed` backends (connected UDP, idle TCP)
/// in every network namespace of the node, and reports what it did. Blocking.
fn terminate_sockets(bpffs: &Path, proc_dir: &Path, proto: Proto, departed: &[(Frontend, Backend)], metrics: &Metrics) {
    let what = match proto {
        Proto::Udp => "connected UDP",
        Proto::Tcp => "idle TCP",
    };
    match crate::dataplane::sockterm::terminate(bpffs, proc_dir, proto, departed) {
        Ok(t) => {
            metrics.observe_socket_termination(&t);
            if t.destroyed + t.failed + t.busy > 0 {
                tracing::info!(
                    "terminated {} {what} sockets to departed backends ({} failed, {} busy left alone, {} namespaces searched)",
                    t.destroyed,
                    t.failed,
                    t.busy,
                    t.namespaces
                );
            }
            if let Some(why) = &t.first_skip {
                tracing::warn!("socket termination: {} of {} network namespaces not searched, e.g. {why}", t.skipped_namespaces, t.namespaces);
            }
            tracing::debug!("socket termination: {t:?}");
        }
        Err(e) => tracing::warn!("terminating {what} sockets connected to departed backends: {e}"),
    }
}

/// The cluster autoscaler's taint on a node it is about to remove.
const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether load balancers should still send traffic to this node (kube-proxy's
/// `nodeEligible`): not while it is being deleted or drained for removal.
pub fn node_eligible(node: &k8s_openapi::api::core::v1::Node) -> bool {
    let tainted = node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    node.metadata.deletion_timestamp.is_none() && !tainted
}

/// Records a map's fill (metrics) and reports when it comes under pressure or leaves it
/// (log, Node condition via the agent state, Warning Event on the Node).
fn note_fill(fills: &mut MapFills, fill: Fill, metrics: &Metrics, state: &AgentState, events: Option<&crate::report::events::ProblemEvents>) {
    metrics.set_map_fill(&fill);
    match fills.set(fill) {
        Some(Change::Pressure(f)) => {
            tracing::warn!(
                "{f}: at {}% it is under pressure; raise its size in the NetworkConfig before it overflows",
                crate::dataplane::mapfill::PRESSURE_PERCENT
            );
            if let Some(ev) = events {
                ev.node_warning("MapPressure", &format!("{f}; raise its size in the NetworkConfig before it overflows"));
            }
        }
        Some(Change::Relieved(f)) => tracing::info!("{f}: no longer under pressure"),
        None => return,
    }
    state.set_map_pressure(fills.pressure());
}

fn note_node(state: &AgentState, ev: &SourceEvent) {
    if let SourceEvent::NodeApplied(n) = ev {
        state.set_node_eligible(node_eligible(n));
    }
}

/// The state directory for a bpffs directory.
pub fn default_state_dir(bpffs: &Path) -> PathBuf {
    PathBuf::from("/run/gardenet").join(bpffs.file_name().unwrap_or_default())
}

pub fn load_config(path: Option<&Path>) -> Result<crate::gardener::config::NetworkConfig> {
    match path {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            crate::gardener::config::NetworkConfig::from_yaml_str(&text).with_context(|| format!("{}", p.display()))
        }
        None => Ok(Default::default()),
    }
}

/// The node's cgroup2 root: the first cgroup2 mount.
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .next()
        .context("no cgroup2 hierarchy is mounted: mount one (mount -t cgroup2 none /run/gardenet/cgroupv2) and pass --cgroup")
}

pub async fn run(args: RunArgs) -> Result<()> {
    // Endpoints first: /healthz answers and /readyz says why not ready during a slow start.
    let state = Arc::new(AgentState::default());
    let metrics = Arc::new(Metrics::new());
    let endpoints = report::serve_endpoints(&args.status, state.clone(), metrics.clone()).await?;
    let cgroup_needed = if args.no_socket_lb { None } else { args.cgroup.clone().or_else(|| cgroup2_root().ok()) };
    state.set_missing(capability::check(&LinuxHost, &Requirements::new(&args.bpffs, cgroup_needed)).missing);
    if args.reset {
        dataplane::remove_pins(&args.bpffs)?;
    }
    let config = match (&args.config, &args.status.network, &args.source) {
        (None, Some(network), SourceSpec::Kube) => config_from_network(&args, network).await,
        _ => load_config(args.config.as_deref())?,
    };
    // Gardener's contract: while kube-proxy routes Services, gardenet stays out of the way
    // unless the NetworkConfig asks it to take over.
    let routing = config.service_routing(args.status.kube_proxy_enabled);
    if let (SourceSpec::Kube, false) = (&args.source, routing.active()) {
        tracing::info!(?routing, "kube-proxy routes Services here (--kube-proxy-enabled); gardenet stays passive");
        state.set_programs_loaded(true);
        state.set_synced(true);
        report_until_shutdown(&args, &config, &state).await?;
        endpoints.iter().for_each(|h| h.abort());
        return Ok(());
    }
    // The cluster's client (kube source only): Warning Events from here on, the watch later.
    let kube_client = match args.source {
        SourceSpec::Kube => Some(source::kube::client_from_env(args.kubeconfig.clone()).await?),
        SourceSpec::Dir(_) => None,
    };
    let warnings = kube_client.as_ref().map(|c| crate::report::events::Warnings::new(c.clone(), &args.node_name));
    // From here on gardenet is the Service proxy: answer kube-proxy's health check too
    // (unhealthy until the dataplane is loaded and the first sync programmed).
    let proxy_healthz = report::serve_proxy_healthz(&args.status, state.clone(), warnings.clone());
    // Flags and the NetworkConfig, resolved once; each stage starts from its part.
    let settings = Settings::resolve(&args, &config)?;
    // What this kernel offers decides programs and attachments: said once, and exported.
    let features = crate::dataplane::features::KernelFeatures::probe();
    tracing::info!("{}", features.summary());
    metrics.set_kernel_features(&features.list());
    let mut dp = match setup_dataplane(&settings.dataplane, features) {
        Ok(dp) => dp,
        Err(e) => {
            metrics.error(ErrorKind::Attach);
            tracing::error!("the eBPF dataplane cannot run on this node: {e:#}");
            // In a cluster the node keeps reporting why it cannot route Services (Node
            // condition, and through the leader the Network's lastError), instead of
            // crash-looping where nobody reads the reason.
            if let (SourceSpec::Kube, false) = (&args.source, args.node_name.is_empty()) {
                state.update(|r| r.missing.push(format!("eBPF dataplane: {e:#}")));
                report_until_shutdown(&args, &config, &state).await?;
                endpoints.iter().for_each(|h| h.abort());
                return Ok(());
            }
            return Err(e);
        }
    };
    state.set_programs_loaded(true);
    // The pod network: plugins installed now, the conflist once the node is programmed.
    let podnet = settings.pod_network.as_ref().map(crate::podnet::PodNet::start);
    if podnet.is_some() {
        state.update(|r| r.pod_network = Some("waiting for the node to be programmed".into()));
    }
    // Source NAT for remote endpoints asks the FIB for the node's source address
    // (BPF_FIB_LOOKUP_SRC); without it external traffic is only DNATed (the start log said so).
    let no_source_nat = !dp.features.fib_lookup_src;
    let (pipeline, listeners) = start_pipeline(&mut dp, &settings, args.reset, &metrics)?;

    let (tx, mut rx) = mpsc::channel::<SourceEvent>(4096);
    // Polls the socket tables while there are rules; ends with the sources.
    let listener_task = tokio::spawn(crate::source::listeners::run(listeners, settings.listener_poll, tx.downgrade(), metrics.clone()));
    let mut reporting = None;
    let mut problem_events: Option<crate::report::events::ProblemEvents> = None;
    let src = match args.source.clone() {
        SourceSpec::Dir(d) => {
            if !d.is_dir() {
                bail!("--source dir:{}: not a directory", d.display());
            }
            tokio::spawn(source::dir::run(d, settings.source_poll, settings.node_name.clone(), tx))
        }
        SourceSpec::Kube => {
            let client = kube_client.context("the kube source has a client")?;
            if args.node_name.is_empty() {
                tracing::warn!("no --node-name (NODE_NAME): not reporting readiness to Kubernetes");
            } else {
                let r = report::Reporting::start(&args.status, client.clone(), &args.node_name, state.clone(), config.clone(), args.detach_on_exit);
                reporting = Some(r.await?);
            }
            problem_events = warnings.clone().map(crate::report::events::ProblemEvents::new);
            tokio::spawn(source::kube::run(client, args.node_name.clone(), tx))
        }
    };

    // Interfaces: selection by pattern, attached and kept attached as links come and go.
    let (links, mut watcher) = crate::links::watch(crate::links::WatchOptions::default()).await?;
    let reserved_ports = settings.links.reserved_ports(&settings.host_proc, no_source_nat);
    let mut mgr = crate::links::LinkManager::new(settings.links.selector.clone(), dp);
    mgr.sync(links, Instant::now());
    // Socket LB and the interfaces present now run the new programs: the old maps are done.
    if let Err(e) = mgr.attacher_mut().finish_migration() {
        tracing::warn!("finishing the migration of pinned maps: {e:#}");
    }
    for st in mgr.snapshot() {
        tracing::info!(interface = %st.name, selected = st.selected, hooks = %st.hooks.join(","), "{}", st.reason);
    }
    let state_dir = settings.state_dir.clone();
    links_changed(&state_dir, &state, &metrics, &mgr.snapshot());
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut conntrack_tick = tokio::time::interval(settings.conntrack.scan_every);
    let (ct_tx, mut ct_rx) = tokio::sync::mpsc::channel::<dataplane::ctgc::Scan>(1);
    let closed_hold = settings.conntrack.closed_hold;
    state.beat();
    let mut agent = Agent {
        bpffs: settings.dataplane.bpffs.clone(),
        host_proc: settings.host_proc.clone(),
        state,
        metrics,
        pipeline,
        links: mgr,
        state_dir,
        problem_events,
        fills: MapFills::default(),
        map_services: settings.dataplane.sizes.services as usize,
        map_backends: settings.dataplane.sizes.backends as usize,
        health_checks: crate::report::healthcheck::HealthCheckServers::new(warnings),
        departed_tcp: Vec::new(),
        reserved_ports,
        ready: false,
        podnet,
    };
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else { break };
                agent.on_source_events(ev, &mut rx);
            }
            lev = watcher.recv() => {
                match lev {
                    Some(ev) => {
                        agent.links.handle(ev, Instant::now());
                        while let Some(ev) = watcher.try_recv() {
                            agent.links.handle(ev, Instant::now());
                        }
                    }
                    None => {
                        tracing::warn!("link notifications stopped; watching again");
                        let (links, w) = crate::links::watch(crate::links::WatchOptions::default()).await?;
                        watcher = w;
                        agent.links.sync(links, Instant::now());
                    }
                }
                agent.links_changed();
            }
            _ = tick.tick() => agent.on_tick(),
            _ = conntrack_tick.tick() => {
                // Walks the conntrack maps (counts them, removes closed flows): off the run
                // loop; the result comes back below.
                let (bpffs, ct_tx) = (agent.bpffs.clone(), ct_tx.clone());
                tokio::task::spawn_blocking(move || match dataplane::ctgc::scan(&bpffs, closed_hold) {
                    Ok(scan) => {
                        let _ = ct_tx.try_send(scan);
                    }
                    Err(e) => tracing::warn!("conntrack scan: {e:#}"),
                });
            }
            Some(scan) = ct_rx.recv() => agent.on_conntrack_scan(scan),
            _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted, exiting"); break }
            _ = sigterm.recv() => { tracing::info!("terminated, exiting"); break }
        }
    }
    let (state_dir, mut mgr, podnet) = (agent.state_dir, agent.links, agent.podnet);
    src.abort();
    listener_task.abort();
    let _ = std::fs::remove_file(state_dir.join("links.json"));
    let dp = mgr.attacher_mut();
    if let Ok(stats) = dp.stats() {
        tracing::info!("datapath counters: {}", stats.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
    }
    if settings.dataplane.detach_on_exit {
        if let Some(p) = &podnet {
            p.withdraw();
        }
        dp.unpin_links();
        tracing::info!("detached all programs (--detach-on-exit)");
    }
    // Releases the election Lease; with --detach-on-exit also marks the Node not ready.
    if let Some(reporting) = reporting {
        reporting.stop().await;
    }
    endpoints.iter().for_each(|e| e.abort());
    if let Some(h) = proxy_healthz {
        h.abort();
    }
    // Maps (and, without --detach-on-exit, links) stay pinned for the next run.
    Ok(())
}

/// The running agent: the parts the run loop drives once the dataplane is loaded, with one
/// method per kind of event (source changes, the periodic tick, conntrack fills; link
/// events go straight to `links`).
struct Agent {
    bpffs: PathBuf,
    /// The node's /proc: every network namespace, for socket termination.
    host_proc: PathBuf,
    state: Arc<AgentState>,
    metrics: Arc<Metrics>,
    pipeline: Pipeline<dataplane::AyaLbMaps>,
    links: crate::links::LinkManager<Dataplane>,
    /// Where `links.json` is published.
    state_dir: PathBuf,
    /// Events on the Node and on Services (only with the Kubernetes source).
    problem_events: Option<crate::report::events::ProblemEvents>,
    fills: MapFills,
    map_services: usize,
    map_backends: usize,
    health_checks: crate::report::healthcheck::HealthCheckServers,
    /// TCP departures waiting out `TCP_TERMINATION_GRACE`.
    departed_tcp: Vec<(Instant, crate::pipeline::Departure)>,
    /// NodePorts and source-NAT ports kept out of the node's ephemeral ports.
    reserved_ports: dataplane::reserved_ports::Guard,
    /// The first full sync is programmed.
    ready: bool,
    /// The pod network's installer (`--pod-network on`).
    podnet: Option<crate::podnet::PodNet>,
}

impl Agent {
    /// Takes `first` and whatever else is queued, programs it in one flush and reports.
    fn on_source_events(&mut self, first: SourceEvent, rx: &mut mpsc::Receiver<SourceEvent>) {
        self.state.beat();
        let t0 = Instant::now();
        self.note_node(&first);
        self.pipeline.handle(first);
        while let Ok(ev) = rx.try_recv() {
            self.note_node(&ev);
            self.pipeline.handle(ev);
        }
        let t_flush = Instant::now();
        let rep = self.pipeline.flush();
        self.metrics.observe_flush(&rep, t_flush.elapsed());
        self.clean_up_after(&rep);
        if let Some(ev) = self.problem_events.as_mut() {
            ev.report(&rep.problems);
        }
        if rep.services > 0 {
            self.metrics.observe_programming_latency(t0.elapsed());
            tracing::debug!(services = rep.services, puts = rep.writes.puts, deletes = rep.writes.deletes, "programmed in {:?}", t0.elapsed());
        }
        let lb = self.pipeline.lb();
        self.metrics.set_programmed(lb.frontend_count(), lb.backend_count(), self.pipeline.service_count());
        for fill in [
            Fill { map: "services", entries: lb.service_entries(), capacity: self.map_services },
            Fill { map: "backends", entries: lb.backend_count(), capacity: self.map_backends },
            Fill { map: "service_nets", entries: self.pipeline.service_nets().len(), capacity: gardenet_common::DEFAULT_SERVICE_NETS_MAX as usize },
        ] {
            note_fill(&mut self.fills, fill, &self.metrics, &self.state, self.problem_events.as_ref());
        }
        self.state.set_synced(self.pipeline.is_synced());
        if let Some(p) = self.podnet.as_mut() {
            let pending = p.reconcile(self.pipeline.is_synced()).err();
            self.state.update(|r| r.pod_network = pending);
        }
        self.health_checks.update(self.pipeline.health_checks());
        if !self.ready && self.pipeline.is_synced() {
            self.ready = true;
            tracing::info!(
                frontends = self.pipeline.lb().frontend_count(),
                backends = self.pipeline.lb().backend_count(),
                "ready: first full sync programmed in {:?}",
                t0.elapsed()
            );
        }
    }

    fn note_node(&mut self, ev: &SourceEvent) {
        note_node(&self.state, ev);
        if let (SourceEvent::NodeApplied(n), Some(p)) = (ev, self.podnet.as_mut()) {
            p.observe_node(n);
        }
    }

    /// What departed backends leave behind: UDP conntrack entries and connected UDP sockets
    /// now (off the run loop), idle TCP sockets after the grace period (`on_tick`).
    fn clean_up_after(&mut self, rep: &crate::pipeline::FlushReport) {
        if !rep.stale_udp.is_empty() {
            let (bpffs, proc_dir, stale, metrics) = (self.bpffs.clone(), self.host_proc.clone(), rep.stale_udp.clone(), self.metrics.clone());
            tokio::task::spawn_blocking(move || {
                match dataplane::ctgc::purge_departed(&bpffs, &stale) {
                    Ok(n) => tracing::debug!("removed {n} UDP flows to {} departed backends", stale.len()),
                    Err(e) => tracing::warn!("removing UDP flows to departed backends: {e:#}"),
                }
                // Socket LB's connected UDP sockets (none when socket LB is off).
                terminate_sockets(&bpffs, &proc_dir, Proto::Udp, &stale, &metrics);
            });
        }
        let due = Instant::now() + TCP_TERMINATION_GRACE;
        self.departed_tcp.extend(rep.departed_tcp.iter().cloned().map(|d| (due, d)));
    }

    /// Every 500 ms: liveness, TCP departures that are due, orphaned slices, link retries,
    /// datapath counters.
    fn on_tick(&mut self) {
        self.state.beat();
        // Also after the start: a node's tuning may widen its ephemeral ports at any time.
        self.reserved_ports.check();
        // TCP backends that left their Service and stayed away for the grace period: idle
        // sockets that socket LB sent there are terminated (see `sockterm`).
        let now = Instant::now();
        let (due, waiting): (Vec<_>, Vec<_>) = self.departed_tcp.drain(..).partition(|(t, _)| *t <= now);
        self.departed_tcp = waiting;
        // Port 0: any port of the address (see `sockterm::terminate`).
        let gone: Vec<(Frontend, Backend)> =
            due.into_iter().filter(|(_, d)| self.pipeline.still_departed(d)).map(|(_, d)| (d.frontend, Backend::new(d.addr, 0))).collect();
        if !gone.is_empty() {
            let (bpffs, proc_dir, metrics) = (self.bpffs.clone(), self.host_proc.clone(), self.metrics.clone());
            tokio::task::spawn_blocking(move || terminate_sockets(&bpffs, &proc_dir, Proto::Tcp, &gone, &metrics));
        }
        let orphans = self.pipeline.orphan_slices(now);
        if !orphans.is_empty() {
            self.metrics.observe_problems(&orphans);
            if let Some(ev) = self.problem_events.as_mut() {
                ev.report(&orphans);
            }
        }
        self.links.tick(now);
        self.links_changed();
        if let Ok(stats) = self.links.attacher_mut().stats() {
            self.metrics.set_datapath(&stats);
        }
    }

    fn on_conntrack_scan(&mut self, scan: dataplane::ctgc::Scan) {
        if scan.removed_flows > 0 {
            tracing::debug!("removed {} closed flows from conntrack", scan.removed_flows);
        }
        self.metrics.add_conntrack_closed_removed(scan.removed_flows);
        self.metrics.set_conntrack_entries(scan.fills.iter().map(|f| f.entries).sum());
        for fill in scan.fills {
            note_fill(&mut self.fills, fill, &self.metrics, &self.state, self.problem_events.as_ref());
        }
    }

    fn links_changed(&self) {
        links_changed(&self.state_dir, &self.state, &self.metrics, &self.links.snapshot());
    }
}

/// The NetworkConfig from the `providerConfig` of the Network the agent is pointed at (it
/// may live in another cluster: `--network-kubeconfig`). An unreadable or invalid one is
/// reported and the defaults are used, so the node still routes Services.
async fn config_from_network(args: &RunArgs, network: &report::network::NetworkRef) -> crate::gardener::config::NetworkConfig {
    let fetched = async {
        let kubeconfig = args.status.network_kubeconfig.clone().or_else(|| args.kubeconfig.clone());
        let client = source::kube::client_from_env(kubeconfig).await?;
        let api: kube::Api<crate::gardener::network::Network> = kube::Api::namespaced(client, &network.namespace);
        let n = tokio::time::timeout(Duration::from_secs(10), api.get(&network.name)).await??;
        Ok::<_, anyhow::Error>(crate::gardener::config::NetworkConfig::from_network(&n)?)
    };
    match fetched.await {
        Ok(c) => {
            tracing::info!("NetworkConfig read from Network {network}");
            c
        }
        Err(e) => {
            tracing::warn!("NetworkConfig from Network {network}: {e:#}; using the defaults");
            Default::default()
        }
    }
}

/// The pipeline over the dataplane's maps: it adopts what a previous agent programmed
/// (unless `--reset`), with this node's settings and the local redirects as they listen now
/// (so the first sync already uses them).
fn start_pipeline(dp: &mut Dataplane, settings: &Settings, reset: bool, metrics: &Metrics) -> Result<(Pipeline<dataplane::AyaLbMaps>, ListenerWatch)> {
    let maps = dp.lb_maps()?;
    let dump = if reset { Default::default() } else { maps.dump() };
    let lb = LbState::adopt(&dump);
    if lb.frontend_count() > 0 {
        tracing::info!("adopted {} frontends and {} backends from pinned maps", lb.frontend_count(), lb.backend_count());
    }
    let no_source_nat = !dp.features.fib_lookup_src;
    let node_settings = &settings.node;
    let npa: Vec<String> = node_settings.node_port_addresses.iter().map(|a| a.to_string()).collect();
    tracing::info!("NodePorts on the node addresses selected by {}", npa.join(","));
    if node_settings.no_external_ips {
        tracing::info!("externalIPs of Services are ignored");
    }
    // Local redirects start from what listens now, so the first sync already uses them.
    let mut listeners = ListenerWatch::new(&node_settings.local_redirects);
    for r in listeners.redirects() {
        tracing::info!("local redirect {}: ClusterIP traffic goes to {} while something listens there", r.service, r.to);
    }
    for c in listeners.poll() {
        crate::source::listeners::report(metrics, &c);
    }
    let node = NodeInfo {
        name: settings.node_name.clone(),
        no_source_nat,
        no_external_ips: node_settings.no_external_ips,
        local_redirects: listeners.redirects().to_vec(),
        ..Default::default()
    };
    let pipeline = Pipeline::new(maps, lb, node).with_node_port_addresses(node_settings.node_port_addresses.clone()).with_service_nets(&dump.service_nets);
    Ok((pipeline, listeners))
}

/// Loads the programs and attaches socket LB (interfaces come later, from the link manager).
fn setup_dataplane(d: &DataplaneSettings, features: crate::dataplane::features::KernelFeatures) -> Result<Dataplane> {
    let mut dp = Dataplane::load_with(&d.bpffs, d.sizes, features)?;
    dp.xdp_mode = d.xdp_mode;
    let cg = match &d.socket_lb {
        SocketLb::Off => return Ok(dp),
        SocketLb::At(c) => c.clone(),
        SocketLb::NodeRoot => cgroup2_root()?,
    };
    dp.attach_socket_lb(&cg)?;
    tracing::info!("socket LB attached to cgroup {} ({:?})", cg.display(), dp.links().last().map(|l| l.how));
    Ok(dp)
}

/// Without a dataplane (passive or degraded): report this node's state to Kubernetes, when
/// there is a node to report on, until SIGTERM or Ctrl-C.
async fn report_until_shutdown(args: &RunArgs, config: &crate::gardener::config::NetworkConfig, state: &Arc<AgentState>) -> Result<()> {
    if args.node_name.is_empty() {
        return wait_for_shutdown(state).await;
    }
    let client = source::kube::client_from_env(args.kubeconfig.clone()).await?;
    let reporting = report::Reporting::start(&args.status, client, &args.node_name, state.clone(), config.clone(), false).await?;
    wait_for_shutdown(state).await?;
    reporting.stop().await;
    Ok(())
}

/// The link manager's view went (or may have gone) out: one snapshot for `links`, /readyz,
/// the Node condition and the metrics.
fn links_changed(state_dir: &Path, state: &AgentState, metrics: &Metrics, snap: &[crate::links::LinkStatus]) {
    publish_links(state_dir, snap);
    report_links(state, metrics, snap);
}

/// Keeps /healthz alive until SIGTERM or Ctrl-C (degraded mode: nothing to program).
async fn wait_for_shutdown(state: &AgentState) -> Result<()> {
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut beat = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = beat.tick() => state.beat(),
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = sigterm.recv() => return Ok(()),
        }
    }
}

/// Selected interfaces and whether gardenet's programs are on them: /readyz, the Node
/// condition and gardenet_interface_attached.
fn report_links(state: &AgentState, metrics: &Metrics, snap: &[crate::links::LinkStatus]) {
    let selected = snap.iter().filter(|l| l.selected);
    report::report_interfaces(state, metrics, selected.map(|l| (l.name.clone(), !l.hooks.is_empty(), l.error.clone())));
}

/// Writes the link manager's view for `gardenet-agent links` (atomically; only on change).
fn publish_links(dir: &Path, snap: &[crate::links::LinkStatus]) {
    let Ok(text) = serde_json::to_string_pretty(snap) else { return };
    let path = dir.join("links.json");
    if std::fs::read_to_string(&path).is_ok_and(|old| old == text) {
        return;
    }
    let tmp = dir.join(".links.json.tmp");
    let r = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, &text)).and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = r {
        tracing::debug!("publishing link state to {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_on_their_way_out_are_not_eligible() {
        let node = |yaml: &str| serde_yaml::from_str::<k8s_openapi::api::core::v1::Node>(yaml).unwrap();
        assert!(node_eligible(&node("metadata: {name: n}")));
        assert!(!node_eligible(&node("metadata: {name: n}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}")));
        assert!(!node_eligible(&node("metadata: {name: n, deletionTimestamp: \"2026-01-01T00:00:00Z\"}")));
        assert!(node_eligible(&node("metadata: {name: n}\nspec: {taints: [{key: other, effect: NoSchedule}]}")));
    }
}
