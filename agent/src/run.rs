//! `gardenet-agent run`: wires source -> pipeline -> maps, and the datapath attachments.
use std::{
    io::Write,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use tokio::sync::mpsc;

use crate::{
    dataplane::{self, Dataplane, MapSizes},
    lbmap::LbState,
    pipeline::Pipeline,
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
    /// Interfaces to attach TC LB to (repeat or comma-separate).
    #[arg(long = "tc-interface", value_delimiter = ',')]
    pub tc_interfaces: Vec<String>,
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
    /// Map sizes (entries).
    #[arg(long, default_value_t = gardenet_common::DEFAULT_SERVICES_MAX)]
    pub map_services: u32,
    #[arg(long, default_value_t = gardenet_common::DEFAULT_BACKENDS_MAX)]
    pub map_backends: u32,
    #[arg(long, default_value_t = gardenet_common::DEFAULT_CT_MAX)]
    pub map_conntrack: u32,
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
    if args.reset {
        dataplane::remove_pins(&args.bpffs)?;
    }
    let sizes = MapSizes {
        services: args.map_services,
        backends: args.map_backends,
        conntrack: args.map_conntrack,
        ..Default::default()
    };
    let mut dp = Dataplane::load(&args.bpffs, sizes)?;
    if !args.no_socket_lb {
        let cg = match &args.cgroup {
            Some(c) => c.clone(),
            None => cgroup2_root()?,
        };
        dp.attach_socket_lb(&cg)?;
        tracing::info!("socket LB attached to cgroup {} ({:?})", cg.display(), dp.links().last().map(|l| l.how));
    }
    for iface in &args.tc_interfaces {
        dp.attach_tc(iface)?;
        tracing::info!("TC LB attached to {iface} ({:?})", dp.links().last().map(|l| l.how));
    }
    let maps = dp.lb_maps()?;
    let lb = if args.reset { LbState::new() } else { LbState::adopt(&maps.dump()) };
    if lb.frontend_count() > 0 {
        tracing::info!("adopted {} frontends and {} backends from pinned maps", lb.frontend_count(), lb.backend_count());
    }
    let node = NodeInfo { name: args.node_name.clone(), ..Default::default() };
    let mut pipeline = Pipeline::new(maps, lb, node);

    let (tx, mut rx) = mpsc::channel::<SourceEvent>(4096);
    let src = match args.source.clone() {
        SourceSpec::Dir(d) => {
            if !d.is_dir() {
                bail!("--source dir:{}: not a directory", d.display());
            }
            tokio::spawn(source::dir::run(d, Duration::from_millis(args.poll_ms), args.node_name.clone(), tx))
        }
        SourceSpec::Kube => {
            let client = source::kube::client_from_env(args.kubeconfig.clone()).await?;
            tokio::spawn(source::kube::run(client, args.node_name.clone(), tx))
        }
    };

    let mut health_checks = crate::healthcheck::HealthCheckServers::default();
    let mut ready = false;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else { break };
                let t0 = Instant::now();
                pipeline.handle(ev);
                while let Ok(ev) = rx.try_recv() {
                    pipeline.handle(ev);
                }
                let rep = pipeline.flush();
                health_checks.update(pipeline.health_checks());
                if rep.services > 0 {
                    tracing::debug!(services = rep.services, puts = rep.writes.puts, deletes = rep.writes.deletes, "programmed in {:?}", t0.elapsed());
                }
                if !ready && pipeline.is_synced() {
                    ready = true;
                    tracing::info!(
                        frontends = pipeline.lb().frontend_count(),
                        backends = pipeline.lb().backend_count(),
                        "ready: first full sync programmed in {:?}", t0.elapsed()
                    );
                }
            }
            _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted, exiting"); break }
            _ = sigterm.recv() => { tracing::info!("terminated, exiting"); break }
        }
    }
    src.abort();
    if let Ok(stats) = dp.stats() {
        tracing::info!("datapath counters: {}", stats.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
    }
    if args.detach_on_exit {
        dp.unpin_links();
        tracing::info!("detached all programs (--detach-on-exit)");
    }
    // Maps (and, without --detach-on-exit, links) stay pinned for the next run.
    Ok(())
}

pub fn lb_list(bpffs: &Path, json: bool) -> Result<()> {
    let dump = dataplane::dump_pinned(bpffs)?;
    let fes = dump.frontends();
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &fes)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(out, "{:<28} {}", "FRONTEND", "BACKENDS")?;
    for f in fes {
        let bes: Vec<String> = f.backends.iter().map(|b| b.to_string()).collect();
        let bes = if bes.is_empty() { "(none: connections refused)".to_string() } else { bes.join(" ") };
        writeln!(out, "{:<28} {}", f.frontend.to_string(), bes)?;
    }
    if let Ok(n) = dataplane::conntrack_entries(bpffs) {
        writeln!(out, "conntrack entries: {n}")?;
    }
    Ok(())
}
