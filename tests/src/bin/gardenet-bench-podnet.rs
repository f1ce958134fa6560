//! `cargo xtask bench podnet`: what the pod network costs on one node.
//!
//! 1. `cni`: CNI `ADD` and `DEL` latency (the plugin run as libcni runs it: environment,
//!    stdin, exit), gardenet against the reference `ptp` plugin, both delegating addresses
//!    to `host-local` over the same dual-stack ranges; `--pods` pods each, the two plugins
//!    taking turns pod by pod so both see the same moments of the machine. p50/p99.
//! 2. `pod`: TCP connect+request rate (`netkit tcp`, one request and one reply per
//!    connection) and bulk throughput (`netkit stream`), between two pods wired by gardenet
//!    on one node, against two pods wired by `ptp` on the same node and against two hosts on
//!    one plain veth ("host to host": no node, no routing hop). The three take turns within
//!    each run; ratios are taken run by run, then their median.
//!
//! Everything runs in network namespaces this process creates (addresses from
//! 198.18.0.0/15, no default routes) and is removed at the end, also on failure or Ctrl-C.
use std::{
    process::{ExitCode, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use gardenet_tests::{
    cni::CniNode,
    interrupt, machine,
    netns::{require_root, sibling_binary, sweep_leftovers, unique_tag, Netns, Proc},
};
use serde_json::{json, Value};

#[derive(Parser)]
struct Args {
    /// Phases: cni, pod (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "cni,pod")]
    phases: Vec<String>,
    /// Pods per plugin in the `cni` phase.
    #[arg(long, default_value_t = 200)]
    pods: usize,
    /// Runs of the `pod` phase (each: every path in turn).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Connections per path and run.
    #[arg(long, default_value_t = 3000)]
    count: u32,
    /// Seconds of each bulk stream.
    #[arg(long, default_value_t = 3)]
    stream_seconds: u32,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    interrupt::install();
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench podnet failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
}

fn bench() -> Result<()> {
    let args = Args::parse();
    require_root();
    sweep_leftovers();
    println!("gardenet bench podnet: {}; {}", machine::load_latency_line(), machine::cpu_idle_line());
    let mut out = json!({});
    if args.phases.iter().any(|p| p == "cni") {
        out["cni"] = cni_phase(&args)?;
    }
    if args.phases.iter().any(|p| p == "pod") {
        out["pod"] = pod_phase(&args)?;
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
}

fn ptp_conf(node: &CniNode) -> Value {
    json!({
        "cniVersion": "1.0.0", "name": "ptp", "type": "ptp", "mtu": 1400,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": "198.18.101.0/24"}], [{"subnet": "fd00:18:101::/64"}]], "dataDir": node.ipam_dir()},
    })
}

/// Times one plugin call; fails on a plugin error.
fn timed(node: &CniNode, plugin: &std::path::Path, cmd: &str, id: &str, ns: &Netns, conf: &[u8]) -> Result<f64> {
    let t = Instant::now();
    let a = node.invoke_from(plugin, &node.bin_dir(), cmd, Some((id, "eth0")), Some(&ns.path()), conf)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !a.ok {
        bail!("{} {cmd} {id}: {}", plugin.display(), a.json);
    }
    Ok(ms)
}

fn cni_phase(args: &Args) -> Result<Value> {
    let node = CniNode::new()?;
    let gardenet = node.plugin.clone();
    let ptp = node.bin_dir().join("ptp");
    let confs = [serde_json::to_vec(&node.conf("1.0.0"))?, serde_json::to_vec(&ptp_conf(&node))?];
    let plugins = [gardenet, ptp];
    let mut times: [[Vec<f64>; 2]; 2] = Default::default(); // [plugin][add, del]
                                                            // A batch of pods lives at once (as on a node), created then removed; each plugin's
                                                            // pods in namespaces of their own.
    let pods: Vec<[Netns; 2]> = (0..args.pods).map(|_| Ok([Netns::new(&unique_tag())?, Netns::new(&unique_tag())?])).collect::<Result<_>>()?;
    for (step, cmd) in [(0, "ADD"), (1, "DEL")] {
        for (i, pair) in pods.iter().enumerate() {
            interrupt::check()?;
            for p in 0..2 {
                times[p][step].push(timed(&node, &plugins[p], cmd, &format!("b{p}x{i}"), &pair[p], &confs[p])?);
            }
        }
    }
    println!("\nCNI ADD and DEL ({} pods each, dual stack, addresses from host-local; ms per call, as libcni runs a plugin)", args.pods);
    println!("  {:<22} {:>9} {:>9} {:>9} {:>9}", "plugin", "ADD p50", "ADD p99", "DEL p50", "DEL p99");
    let mut res = json!({"pods": args.pods});
    for (p, name) in ["gardenet", "ptp (reference)"].iter().enumerate() {
        let q = |v: &[f64], x| quantile(&mut v.to_vec(), x);
        let (a50, a99, d50, d99) = (q(&times[p][0], 0.5), q(&times[p][0], 0.99), q(&times[p][1], 0.5), q(&times[p][1], 0.99));
        println!("  {name:<22} {a50:>9.2} {a99:>9.2} {d50:>9.2} {d99:>9.2}");
        res[name.split(' ').next().unwrap_or(name)] = json!({"add_p50_ms": a50, "add_p99_ms": a99, "del_p50_ms": d50, "del_p99_ms": d99});
    }
    Ok(res)
}

/// Two endpoints of a path: the server's address and the namespaces of client and server.
struct Path2 {
    name: &'static str,
    client: Netns,
    to: String,
    _server: Proc,
    _keep: Vec<Netns>,
}

fn serve(ns: &Netns, name: &str) -> Result<Proc> {
    let mut cmd = ns.command(sibling_binary("gardenet-netkit")?, None)?;
    cmd.args(["serve", "--name", name, "--port", "8080"]);
    Proc::spawn(cmd, name)
}

fn netkit(ns: &Netns, args: &[&str]) -> Result<Value> {
    let out = ns.command(sibling_binary("gardenet-netkit")?, None)?.args(args).stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("netkit {args:?}: {}", out.status);
    }
    serde_json::from_slice(&out.stdout).context("netkit output")
}

/// Two pods on `node` wired by `plugin` with `conf`.
fn pod_pair(node: &CniNode, plugin: &std::path::Path, conf: &Value, tag: &str, name: &'static str) -> Result<Path2> {
    let (a, b) = (Netns::new(&unique_tag())?, Netns::new(&unique_tag())?);
    let conf = serde_json::to_vec(conf)?;
    let mut addr = String::new();
    for (i, ns) in [&a, &b].into_iter().enumerate() {
        let r = node.invoke_from(plugin, &node.bin_dir(), "ADD", Some((&format!("{tag}{i}"), "eth0")), Some(&ns.path()), &conf)?;
        if !r.ok {
            bail!("{name}: ADD: {}", r.json);
        }
        addr = r.json["ips"][0]["address"].as_str().unwrap_or_default().split('/').next().unwrap_or_default().to_owned();
    }
    let server = serve(&b, "srv")?;
    Ok(Path2 { name, client: a, to: format!("{addr}:8080"), _server: server, _keep: vec![b] })
}

fn pod_phase(args: &Args) -> Result<Value> {
    let node = CniNode::new()?;
    let gardenet = pod_pair(&node, &node.plugin.clone(), &node.conf("1.0.0"), "g", "gardenet pod -> pod")?;
    let ptp = pod_pair(&node, &node.bin_dir().join("ptp"), &ptp_conf(&node), "p", "ptp pod -> pod")?;
    let (h1, h2) = (Netns::new(&unique_tag())?, Netns::new(&unique_tag())?);
    h1.ip(&["link", "add", "hv", "type", "veth", "peer", "name", "hv", "netns", &h2.name])?;
    h1.ip(&["addr", "add", "198.18.102.1/24", "dev", "hv"])?;
    h2.ip(&["addr", "add", "198.18.102.2/24", "dev", "hv"])?;
    h1.ip(&["link", "set", "hv", "up"])?;
    h2.ip(&["link", "set", "hv", "up"])?;
    let host = Path2 { name: "host -> host (one veth)", _server: serve(&h2, "srv")?, client: h1, to: "198.18.102.2:8080".into(), _keep: vec![h2] };
    let paths = [host, gardenet, ptp];
    for p in &paths {
        // As in the dataplane bench: tens of thousands of connections per minute to one
        // destination must not run out of ports in TIME_WAIT, or late runs measure the port
        // search (they fell to ~1,000 conn/s without these).
        p.client.sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
        p.client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    }
    for p in &paths {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while !netkit(&p.client, &["tcp", "--to", &p.to, "--count", "1", "--timeout-ms", "300"])
            .map(|v| v["counts"].as_object().is_some_and(|c| !c.is_empty()))
            .unwrap_or(false)
        {
            if Instant::now() > deadline {
                bail!("{}: {} does not answer", p.name, p.to);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
    let (count, secs) = (args.count.to_string(), args.stream_seconds.to_string());
    let mut rate = vec![Vec::new(); paths.len()];
    let mut p50 = vec![Vec::new(); paths.len()];
    let mut bulk = vec![Vec::new(); paths.len()];
    for run in 0..args.runs {
        interrupt::check()?;
        // The order rotates, so no path always runs first.
        for k in 0..paths.len() {
            let i = (k + run) % paths.len();
            let v = netkit(&paths[i].client, &["tcp", "--to", &paths[i].to, "--count", &count])?;
            rate[i].push(v["per_second"].as_f64().unwrap_or(0.0));
            p50[i].push(v["latency_us"]["p50"].as_f64().unwrap_or(0.0));
            let s = netkit(&paths[i].client, &["stream", "--to", &paths[i].to, "--seconds", &secs])?;
            bulk[i].push(s["bits_per_second"].as_f64().unwrap_or(0.0) / 1e9);
        }
    }
    let med = |v: &[f64]| quantile(&mut v.to_vec(), 0.5);
    let ratio = |a: &[f64], b: &[f64]| med(&a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>());
    println!("\nPod to pod on one node ({} runs; {} connections and a {} s stream per path and run; medians)", args.runs, args.count, args.stream_seconds);
    println!("  {:<28} {:>10} {:>12} {:>10} {:>14} {:>14}", "path", "conn/s", "p50 (us)", "Gbit/s", "conn/s vs host", "Gbit/s vs host");
    let mut res = json!({"runs": args.runs, "count": args.count});
    for (i, p) in paths.iter().enumerate() {
        let (r, l, b) = (med(&rate[i]), med(&p50[i]), med(&bulk[i]));
        let (rr, br) = (ratio(&rate[i], &rate[0]), ratio(&bulk[i], &bulk[0]));
        println!("  {:<28} {r:>10.0} {l:>12.0} {b:>10.2} {rr:>13.2}x {br:>13.2}x", p.name);
        res[p.name] = json!({"conn_per_s": r, "p50_us": l, "gbit_per_s": b, "conn_ratio_to_host": rr, "bulk_ratio_to_host": br, "runs_conn_per_s": rate[i], "runs_gbit_per_s": bulk[i]});
    }
    println!("  gardenet / ptp: conn/s {:.2}x, Gbit/s {:.2}x", ratio(&rate[1], &rate[2]), ratio(&bulk[1], &bulk[2]));
    Ok(res)
}
