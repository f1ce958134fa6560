//! `cargo xtask bench dataplane`: TCP connections per second (connect, one request, one reply,
//! close) from the lab client to a Service VIP through socket LB, through TC LB, directly to a
//! backend, and through a kube-proxy-style iptables DNAT ruleset, with 1, 1,000 and 10,000
//! Services programmed. Prints a markdown table.
//!
//! Everything happens inside one namespace lab (see `gardenet_tests::lab`): addresses from
//! 198.18.0.0/15 that exist only in namespaces this process created, no default routes. Every
//! loop is bounded; namespaces, cgroup, pins, manifests and iptables rules are removed on exit,
//! also on error or Ctrl-C (the handler only sets a flag; drop guards do the cleanup).
//!
//! Phases (A and C measure "direct" interleaved with their mode, as a control):
//!   A. agent with socket LB on the lab cgroup, no TC: direct (client outside the cgroup,
//!      no datapath on its path) and socket LB (client inside the cgroup -> VIP);
//!   B. agent with TC LB on `nc0`, no socket LB: TC LB (client -> VIP), then a short probe of
//!      direct connections (which stale TC conntrack entries can break, see `stale_ct_probe`);
//!   C. no agent: kube-proxy-style nat ruleset loaded with iptables-restore in the node
//!      namespace (nft backend, then legacy if installed): iptables (client -> VIP).
use std::{
    collections::BTreeMap,
    io::Write,
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use gardenet_tests::{
    lab::{backend_ip, counts, service_yaml, slice_yaml, Agent, AgentOpts, Lab, SERVER_PORT},
    netns::Netns,
};

/// Benchmark of the Service datapaths in a namespace lab (needs root).
#[derive(Parser)]
struct Args {
    /// Connections per measured run.
    #[arg(long, default_value_t = 3000)]
    count: u32,
    /// Measured runs per cell (the cell shows the median).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Service counts (columns), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,1000,10000")]
    services: Vec<usize>,
    /// Skip the iptables-legacy row even if iptables-legacy-restore is installed.
    #[arg(long)]
    no_legacy: bool,
    /// Nice value for the bench and everything it starts (0: leave as is).
    #[arg(long, default_value_t = -10, allow_hyphen_values = true)]
    nice: i32,
    /// Longest wait for the agent to program a manifest change (seconds).
    #[arg(long, default_value_t = 300)]
    program_timeout_s: u64,
    /// Backends per Service (and backend hosts in the lab). With 1, "direct" and the LB
    /// modes talk to the very same server, which isolates the cost of the LB itself.
    #[arg(long, default_value_t = 3)]
    backends: usize,
    /// Phases to run: socket, tc, iptables.
    #[arg(long, value_delimiter = ',', default_value = "socket,tc,iptables")]
    phases: Vec<String>,
}

const PORT: u16 = 80;
static NBE_CELL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Backends per Service (`--backends`).
fn nbe() -> usize {
    *NBE_CELL.get().unwrap_or(&3)
}
const MAX_SERVICES: usize = 60_000;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// Sleeps in small steps so Ctrl-C is noticed.
fn nap(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        check_stop()?;
        std::thread::sleep(Duration::from_millis(50).min(end.saturating_duration_since(Instant::now())));
    }
    check_stop()
}

/// VIP of service `i`: 198.19.(1 + i/250).(1 + i%250).
fn vip(i: usize) -> String {
    format!("198.19.{}.{}", 1 + i / 250, 1 + i % 250)
}

fn vip_index(addr: &str) -> Option<usize> {
    let o: Vec<usize> = addr.split('.').map(|p| p.parse().ok()).collect::<Option<_>>()?;
    (o.len() == 4 && o[0] == 198 && o[1] == 19 && o[2] >= 1 && (1..=250).contains(&o[3])).then(|| (o[2] - 1) * 250 + o[3] - 1)
}

fn svc_name(i: usize) -> String {
    format!("svc-{i:05}")
}

/// The service the bench connects to: the middle of the set (for iptables, the middle of the
/// linear `KUBE-SERVICES` chain: the average position).
fn measured(n: usize) -> usize {
    n / 2
}

/// One multi-document YAML file with `n` Services and their EndpointSlices (3 backends each).
fn manifests(n: usize) -> String {
    let bes: Vec<usize> = (0..nbe()).collect();
    let mut s = String::with_capacity(n * 700);
    for i in 0..n {
        let name = svc_name(i);
        s.push_str("---\n");
        s.push_str(&service_yaml(&name, &vip(i), PORT, &["TCP"]));
        s.push_str("---\n");
        s.push_str(&slice_yaml(&name, &bes, &["TCP"]));
    }
    s
}

/// Polls `lb list` until exactly the first `n` VIPs are programmed with 3 backends each.
fn wait_programmed(agent: &Agent, n: usize, t0: Instant, timeout: Duration) -> Result<Duration> {
    loop {
        check_stop()?;
        let v = agent.lb_list()?;
        let fes = v.as_array().map(|a| a.as_slice()).unwrap_or_default();
        let ours = fes
            .iter()
            .filter(|f| {
                let fe = &f["frontend"];
                fe["proto"] == "tcp"
                    && fe["port"] == PORT
                    && fe["addr"].as_str().and_then(vip_index).is_some_and(|i| i < n)
                    && f["backends"].as_array().is_some_and(|b| b.len() == nbe())
            })
            .count();
        if ours == n && fes.len() == n {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > timeout {
            bail!("agent did not program {n} services within {timeout:?}: {ours} of them programmed, {} frontends in total", fes.len());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Where a measured client connects to.
#[derive(Clone)]
enum Target {
    /// A backend IP directly (rotates over the backends run by run).
    Direct,
    Vip(String),
}

struct Mode {
    row: String,
    in_cgroup: bool,
    target: Target,
}

impl Mode {
    fn to(&self, run: usize) -> String {
        match &self.target {
            Target::Direct => format!("{}:{SERVER_PORT}", backend_ip(run % nbe())),
            Target::Vip(v) => format!("{v}:{PORT}"),
        }
    }
}

#[derive(Default)]
struct Cell {
    samples: Vec<f64>,
    errors: u64,
    notes: Vec<String>,
}

#[derive(Default)]
struct Results {
    cells: BTreeMap<(String, usize), Cell>,
    timings: Vec<(String, String)>,
    probes: Vec<String>,
}

impl Results {
    fn cell(&mut self, row: &str, n: usize) -> &mut Cell {
        self.cells.entry((row.to_owned(), n)).or_default()
    }
    fn timing(&mut self, what: impl Into<String>, d: Duration) {
        let (w, s) = (what.into(), format!("{:.2} s", d.as_secs_f64()));
        eprintln!("bench: {w}: {s}");
        self.timings.push((w, s));
    }
}

/// Like `Lab::client_json`, but the client is killed as soon as Ctrl-C is seen.
fn client_json(lab: &Lab, in_cgroup: bool, args: &[&str]) -> Result<serde_json::Value> {
    let mut child = lab.client_cmd(in_cgroup, args)?.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn()?;
    let mut so = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = std::io::Read::read_to_end(&mut so, &mut s);
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if STOP.load(Ordering::SeqCst) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("interrupted");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = reader.join().unwrap_or_default();
    if !status.success() {
        bail!("netkit {args:?} failed: {status}");
    }
    serde_json::from_slice(&out).with_context(|| format!("netkit output: {}", String::from_utf8_lossy(&out)))
}

/// One netkit `tcp` run: (per_second, errors, answers by backend).
fn tcp_run(lab: &Lab, m: &Mode, run: usize, count: u32) -> Result<(f64, u64, serde_json::Value)> {
    check_stop()?;
    let to = m.to(run);
    let v = client_json(lab, m.in_cgroup, &["tcp", "--to", &to, "--count", &count.to_string(), "--timeout-ms", "2000"])?;
    let errors: u64 = v["errors"].as_object().into_iter().flatten().map(|(_, n)| n.as_u64().unwrap_or(0)).sum();
    let answered: u64 = counts(&v).iter().map(|(_, n)| n).sum();
    if answered + errors != count as u64 {
        bail!("{}: {to}: {answered} answers + {errors} errors != {count}: {v}", m.row);
    }
    let ps = v["per_second"].as_f64().with_context(|| format!("no per_second in {v}"))?;
    Ok((ps, errors, v))
}

/// TIME_WAIT sockets in the client namespace (/proc/net/sockstat is per network namespace).
fn client_timewait(lab: &Lab) -> Result<u64> {
    let out = lab.client.command("cat", None)?.arg("/proc/net/sockstat").output()?;
    let s = String::from_utf8_lossy(&out.stdout);
    let tw = s
        .lines()
        .find(|l| l.starts_with("TCP:"))
        .and_then(|l| l.split_whitespace().skip_while(|w| *w != "tw").nth(1))
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no TCP tw in sockstat: {s}"))?;
    Ok(tw)
}

/// Keeps the client's ephemeral port space from filling up with TIME_WAIT sockets (which would
/// make later runs pay for port searches): waits (bounded) while more than `limit` exist.
fn drain_timewait(lab: &Lab, limit: u64) -> Result<()> {
    let t0 = Instant::now();
    let mut tw = client_timewait(lab)?;
    if tw > limit {
        eprintln!("bench: {tw} TIME_WAIT sockets in the client namespace; waiting until <= {limit}");
    }
    while tw > limit && t0.elapsed() < Duration::from_secs(75) {
        nap(Duration::from_secs(1))?;
        tw = client_timewait(lab)?;
    }
    Ok(())
}

/// Sanity check, warm-up, then `runs` interleaved measured runs of every mode.
fn measure(lab: &Lab, modes: &[Mode], n: usize, args: &Args, res: &mut Results) -> Result<()> {
    for m in modes {
        let (_, errors, v) = tcp_run(lab, m, 0, 60)?;
        let c = counts(&v);
        let want = match m.target {
            Target::Direct => 1,
            Target::Vip(_) => nbe(),
        };
        if errors > 0 || c.len() != want {
            bail!("{} with {n} services: sanity check failed (expected {want} backend(s) answering, no errors): {v}", m.row);
        }
        tcp_run(lab, m, 1, 300)?; // warm-up
    }
    drain_timewait(lab, 45_000)?;
    for r in 0..args.runs {
        // Rotate the order so no mode always runs right after the same other one.
        for k in 0..modes.len() {
            let m = &modes[(k + r) % modes.len()];
            let (ps, errors, v) = tcp_run(lab, m, r, args.count)?;
            eprintln!(
                "bench: {n:>6} services  {:<28} run {}: {:>8.0} conn/s{}",
                m.row,
                r + 1,
                ps,
                if errors > 0 { format!("  ERRORS {v}") } else { String::new() }
            );
            let cell = res.cell(&m.row, n);
            cell.samples.push(ps);
            cell.errors += errors;
            if errors > 0 {
                cell.notes.push(v["errors"].to_string());
            }
        }
        drain_timewait(lab, 60_000)?;
    }
    Ok(())
}

const ROW_DIRECT: &str = "direct (backend IP)";
const ROW_SOCK: &str = "socket LB";
const ROW_TC: &str = "TC LB";
const CTL_DIRECT_A: &str = "direct, no datapath (phase A)";

fn ipt_row(b: &IptBackend) -> String {
    format!("iptables ({})", b.label)
}

fn ipt_ctl_row(b: &IptBackend) -> String {
    format!("direct, iptables-{} rules loaded", b.label)
}

// ---------------------------------------------------------------------------------------------
// iptables

struct IptBackend {
    label: &'static str,
    restore: &'static str,
    cli: &'static str,
}

fn have(cmd: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {cmd} >/dev/null 2>&1")).status().is_ok_and(|s| s.success())
}

fn cmd_output(prog: &str, args: &[&str]) -> String {
    Command::new(prog)
        .args(args)
        .output()
        .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)).trim().to_owned())
        .unwrap_or_else(|e| format!("({prog}: {e})"))
}

/// The iptables variants to measure: nft (Debian 12's default), then legacy (kube-proxy's
/// classic backend) if installed.
fn ipt_backends(no_legacy: bool) -> Result<Vec<IptBackend>> {
    let mut v = Vec::new();
    if have("iptables-nft-restore") {
        v.push(IptBackend { label: "nft", restore: "iptables-nft-restore", cli: "iptables-nft" });
    }
    if !no_legacy && have("iptables-legacy-restore") {
        v.push(IptBackend { label: "legacy", restore: "iptables-legacy-restore", cli: "iptables-legacy" });
    }
    if v.is_empty() {
        if !have("iptables-restore") {
            bail!("iptables-restore is not installed: run `cargo xtask setup` (Debian package iptables)");
        }
        let label = if cmd_output("iptables", &["-V"]).contains("nf_tables") { "nft" } else { "legacy" };
        v.push(IptBackend { label, restore: "iptables-restore", cli: "iptables" });
    }
    Ok(v)
}

/// kube-proxy's chain-name hash: 16 base32 characters of a hash of the name (kube-proxy uses
/// SHA-256; any stable hash gives chains of the same shape).
fn chain_hash(s: &str) -> String {
    const B32: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let fnv = |seed: u64| s.bytes().fold(seed, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let (a, b) = (fnv(0xcbf29ce484222325), fnv(0x84222325cbf29ce4));
    (0..16).map(|i| B32[(if i < 8 { a >> (i * 5) } else { b >> ((i - 8) * 5) } & 31) as usize] as char).collect()
}

/// A nat table built the way kube-proxy's iptables mode builds it for `n` ClusterIP Services
/// with 3 endpoints each (no cluster CIDR configured, so client traffic is not masqueraded;
/// the KUBE-MARK-MASQ hairpin rules are there as kube-proxy writes them).
fn kube_ruleset(n: usize) -> String {
    let mut chains = String::from(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
         :KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n",
    );
    let mut rules = String::from(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
         -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
         -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n",
    );
    let mut per_svc = String::new();
    for i in 0..n {
        let port_name = format!("lab/{}:p-tcp", svc_name(i));
        let svc = format!("KUBE-SVC-{}", chain_hash(&format!("{port_name}tcp")));
        chains.push_str(&format!(":{svc} - [0:0]\n"));
        rules.push_str(&format!("-A KUBE-SERVICES -d {}/32 -p tcp -m comment --comment \"{port_name} cluster IP\" -m tcp --dport {PORT} -j {svc}\n", vip(i)));
        for b in 0..nbe() {
            let ep = format!("{}:{SERVER_PORT}", backend_ip(b));
            let sep = format!("KUBE-SEP-{}", chain_hash(&format!("{port_name}tcp{ep}")));
            chains.push_str(&format!(":{sep} - [0:0]\n"));
            let left = nbe() - b;
            if left > 1 {
                per_svc.push_str(&format!(
                    "-A {svc} -m comment --comment \"{port_name} -> {ep}\" -m statistic --mode random --probability {:.11} -j {sep}\n",
                    1.0 / left as f64
                ));
            } else {
                per_svc.push_str(&format!("-A {svc} -m comment --comment \"{port_name} -> {ep}\" -j {sep}\n"));
            }
            per_svc.push_str(&format!("-A {sep} -s {}/32 -m comment --comment \"{port_name}\" -j KUBE-MARK-MASQ\n", backend_ip(b)));
            per_svc.push_str(&format!("-A {sep} -p tcp -m comment --comment \"{port_name}\" -m tcp -j DNAT --to-destination {ep}\n"));
        }
    }
    rules.push_str(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" \
         -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n",
    );
    format!("{chains}{rules}{per_svc}COMMIT\n")
}

/// Runs a command in the node namespace with a bounded wait; feeds `stdin` if given.
fn node_run(node: &Netns, prog: &str, args: &[&str], stdin: Option<&str>, timeout: Duration) -> Result<String> {
    let mut cmd = node.command(prog, None)?;
    cmd.args(args).stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {prog}"))?;
    if let Some(text) = stdin {
        let mut w = child.stdin.take().unwrap();
        let text = text.to_owned();
        // A writer thread: the child may fill its stdout/stderr pipes before reading all input.
        std::thread::spawn(move || {
            let _ = w.write_all(text.as_bytes());
        });
    }
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let ro = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut so, &mut s);
        s
    });
    let re = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut se, &mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if STOP.load(Ordering::SeqCst) || t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            check_stop()?;
            bail!("{prog} {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (ro.join().unwrap_or_default(), re.join().unwrap_or_default());
    if !status.success() {
        bail!("{prog} {args:?} in {}: {status}: {}", node.name, err.trim());
    }
    Ok(out)
}

/// A ruleset loaded in the node namespace; flushed on drop.
struct IptRules<'a> {
    node: &'a Netns,
    backend: &'a IptBackend,
    loaded: bool,
}

impl<'a> IptRules<'a> {
    fn load(node: &'a Netns, backend: &'a IptBackend, rules: &str) -> Result<Self> {
        let mut g = IptRules { node, backend, loaded: true };
        if let Err(e) = node_run(node, backend.restore, &[], Some(rules), Duration::from_secs(600)) {
            g.flush();
            return Err(e);
        }
        Ok(g)
    }

    /// Removes the nat rules and chains. For nft, the whole `ip nat` table goes, so no empty
    /// nat hooks stay behind; legacy tables cannot be unregistered short of deleting the
    /// namespace, so their (empty) built-in chains stay.
    fn flush(&mut self) {
        if !std::mem::take(&mut self.loaded) {
            return;
        }
        let t = Duration::from_secs(300);
        if self.backend.label == "nft" && have("nft") && node_run(self.node, "nft", &["delete", "table", "ip", "nat"], None, t).is_ok() {
            return;
        }
        let _ = node_run(self.node, self.backend.cli, &["-t", "nat", "-F"], None, t);
        let _ = node_run(self.node, self.backend.cli, &["-t", "nat", "-X"], None, t);
    }
}

impl Drop for IptRules<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

// ---------------------------------------------------------------------------------------------
// phases

fn phase_socket_lb(lab: &Lab, args: &Args, res: &mut Results) -> Result<()> {
    eprintln!("\nbench: phase A: agent with socket LB on the lab cgroup (no TC)");
    let t0 = Instant::now();
    let agent = Agent::start(lab, AgentOpts { socket_lb: true, ..Default::default() }, &[])?;
    res.timing("phase A: agent start, no services (ready)", t0.elapsed());
    for &n in &args.services {
        let yaml = manifests(n);
        let t0 = Instant::now();
        agent.write("services.yaml", &yaml)?;
        let d = wait_programmed(&agent, n, t0, Duration::from_secs(args.program_timeout_s))?;
        res.timing(format!("phase A: manifest rewritten with {n} services -> all programmed (lb list)"), d);
        let v = vip(measured(n));
        let modes =
            [Mode { row: ROW_DIRECT.into(), in_cgroup: false, target: Target::Direct }, Mode { row: ROW_SOCK.into(), in_cgroup: true, target: Target::Vip(v) }];
        measure(lab, &modes, n, args, res)?;
    }
    Ok(())
}

fn phase_tc_lb(lab: &Lab, args: &Args, res: &mut Results) -> Result<()> {
    eprintln!("\nbench: phase B: agent with TC LB on nc0 (no socket LB)");
    // Largest set first: a fresh agent start with all of them, then shrinking (deletions).
    let mut ns = args.services.clone();
    ns.sort_unstable_by(|a, b| b.cmp(a));
    let opts = AgentOpts { tc: true, ..Default::default() };
    let t0 = Instant::now();
    let agent = match Agent::start(lab, opts.clone(), &[("services.yaml", manifests(ns[0]))]) {
        Ok(a) => {
            res.timing(format!("phase B: fresh agent start with {} services (ready)", ns[0]), t0.elapsed());
            a
        }
        Err(e) => {
            check_stop()?;
            eprintln!("bench: WARNING: fresh start with {} services failed ({e:#}); starting empty instead", ns[0]);
            res.timings.push((format!("phase B: fresh agent start with {} services", ns[0]), format!("FAILED: {e:#}").replace('\n', " ")));
            Agent::start(lab, opts, &[])?
        }
    };
    for &n in &ns {
        let yaml = manifests(n);
        let t0 = Instant::now();
        agent.write("services.yaml", &yaml)?;
        let d = wait_programmed(&agent, n, t0, Duration::from_secs(args.program_timeout_s))?;
        res.timing(format!("phase B: {n} services programmed (lb list)"), d);
        // No "direct" control in this phase: see `stale_ct_probe`.
        let modes = [Mode { row: ROW_TC.into(), in_cgroup: false, target: Target::Vip(vip(measured(n))) }];
        measure(lab, &modes, n, args, res)?;
        stale_ct_probe(lab, n, res)?;
    }
    Ok(())
}

/// After TC LB traffic, direct connections from the same client to the backends: with TC LB
/// on nc0, a new direct connection from a source port that an earlier (closed) VIP connection
/// to that backend used times out (its replies get reverse-NATed to the VIP). Bounded: short
/// timeouts, few connections. The count of failures goes into the report.
fn stale_ct_probe(lab: &Lab, n: usize, res: &mut Results) -> Result<()> {
    let (per, mut failed, mut total) = (100u32, 0u64, 0u64);
    for b in 0..nbe() {
        let to = format!("{}:{SERVER_PORT}", backend_ip(b));
        let v = client_json(lab, false, &["tcp", "--to", &to, "--count", &per.to_string(), "--timeout-ms", "300"])?;
        failed += v["errors"].as_object().into_iter().flatten().map(|(_, n)| n.as_u64().unwrap_or(0)).sum::<u64>();
        total += per as u64;
    }
    let line =
        format!("TC phase, {n} services: {failed} of {total} direct connections (client -> backend IP, right after the TC LB runs) failed (300 ms timeout)");
    eprintln!("bench: {line}");
    res.probes.push(line);
    Ok(())
}

fn phase_iptables(lab: &Lab, args: &Args, backends: &[IptBackend], res: &mut Results) -> Result<()> {
    eprintln!("\nbench: phase C: no agent; kube-proxy-style iptables nat rules in the node namespace");
    // With the agent gone nothing may translate the VIP: its TC links must have gone with it.
    let probe = Mode { row: "VIP without any LB".into(), in_cgroup: false, target: Target::Vip(vip(0)) };
    let v = client_json(lab, false, &["connect", "--to", &probe.to(0), "--timeout-ms", "500"])?;
    if v["outcome"] == "Connected" {
        bail!("the VIP still answers with the agent stopped (TC programs left on nc0?): {v}");
    }
    for &n in &args.services {
        let rules = kube_ruleset(n);
        for b in backends {
            check_stop()?;
            let t0 = Instant::now();
            let mut g = IptRules::load(&lab.node, b, &rules)?;
            res.timing(format!("iptables-{}: {} restore of {n} services ({} lines)", b.label, b.restore, rules.lines().count()), t0.elapsed());
            let modes = [
                Mode { row: ipt_ctl_row(b), in_cgroup: false, target: Target::Direct },
                Mode { row: ipt_row(b), in_cgroup: false, target: Target::Vip(vip(measured(n))) },
            ];
            measure(lab, &modes, n, args, res)?;
            let t0 = Instant::now();
            g.flush();
            res.timing(format!("iptables-{}: flush of {n} services", b.label), t0.elapsed());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// report

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let k = s.len();
    if k == 0 {
        f64::NAN
    } else if k % 2 == 1 {
        s[k / 2]
    } else {
        (s[k / 2 - 1] + s[k / 2]) / 2.0
    }
}

fn thousands(x: f64) -> String {
    let s = format!("{:.0}", x);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn fmt_cell(c: Option<&Cell>) -> String {
    let Some(c) = c.filter(|c| !c.samples.is_empty()) else { return "n/a".into() };
    let m = median(&c.samples);
    let (lo, hi) = c.samples.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let mut s = format!("{} (±{:.1}%)", thousands(m), (hi - lo) / 2.0 / m * 100.0);
    if c.errors > 0 {
        s.push_str(&format!(" **{} errors**", c.errors));
    }
    s
}

fn table(out: &mut String, res: &Results, rows: &[String], ns: &[usize]) {
    out.push_str("| mode |");
    for n in ns {
        out.push_str(&format!(" {} service{} |", thousands(*n as f64), if *n == 1 { "" } else { "s" }));
    }
    out.push_str("\n|---|");
    for _ in ns {
        out.push_str("---:|");
    }
    out.push('\n');
    for r in rows {
        out.push_str(&format!("| {r} |"));
        for n in ns {
            out.push_str(&format!(" {} |", fmt_cell(res.cells.get(&(r.clone(), *n)))));
        }
        out.push('\n');
    }
}

fn med(res: &Results, row: &str, n: usize) -> Option<f64> {
    res.cells.get(&(row.to_owned(), n)).filter(|c| !c.samples.is_empty()).map(|c| median(&c.samples))
}

fn pct(a: f64, b: f64) -> String {
    format!("{:+.1}%", (a / b - 1.0) * 100.0)
}

fn report(res: &Results, args: &Args, backends: &[IptBackend], env: &[(String, String)]) -> String {
    let mut o = String::new();
    o.push_str("## Dataplane benchmark: TCP connections per second\n\n");
    for (k, v) in env {
        o.push_str(&format!("- {k}: {v}\n"));
    }
    o.push_str(&format!(
        "- each cell: median of {} runs of {} sequential connections (connect, one request, one reply, close) \
         by one client; ± is half the min-max range relative to the median\n\n",
        args.runs, args.count
    ));
    let mut rows = vec![ROW_DIRECT.to_string(), ROW_SOCK.into(), ROW_TC.into()];
    rows.extend(backends.iter().map(ipt_row));
    table(&mut o, res, &rows, &args.services);
    o.push('\n');
    for &n in &args.services {
        if let (Some(s), Some(d)) = (med(res, ROW_SOCK, n), med(res, ROW_DIRECT, n)) {
            let ok = (s / d - 1.0).abs() <= 0.05 || s >= d;
            o.push_str(&format!(
                "- socket LB vs direct, {} services: {} ({})\n",
                thousands(n as f64),
                pct(s, d),
                if ok { "within the 5% target" } else { "MISSES the 5% target" }
            ));
        }
    }
    let big = *args.services.iter().max().unwrap_or(&0);
    for b in backends {
        if let (Some(t), Some(i)) = (med(res, ROW_TC, big), med(res, &ipt_row(b), big)) {
            o.push_str(&format!(
                "- TC LB vs iptables ({}), {} services: {} ({})\n",
                b.label,
                thousands(big as f64),
                pct(t, i),
                if t > i { "TC LB ahead" } else { "TC LB NOT ahead" }
            ));
        }
    }
    o.push_str("\nControls: \"direct\" measured again in each phase, interleaved with that phase's mode:\n\n");
    let mut ctl = vec![ROW_DIRECT.to_string()];
    ctl.extend(backends.iter().map(ipt_ctl_row));
    let ctl_table = {
        let mut t = String::new();
        table(&mut t, res, &ctl, &args.services);
        t.replacen(&format!("| {ROW_DIRECT} |"), &format!("| {CTL_DIRECT_A} |"), 1)
    };
    o.push_str(&ctl_table);
    o.push_str("\nProgramming and rule-loading times:\n\n");
    for (w, t) in &res.timings {
        o.push_str(&format!("- {w}: {t}\n"));
    }
    if !res.probes.is_empty() {
        o.push_str("\nDirect traffic after TC LB traffic (stale conntrack probe):\n\n");
        for p in &res.probes {
            o.push_str(&format!("- {p}\n"));
        }
    }
    let errs: Vec<String> =
        res.cells.iter().filter(|(_, c)| c.errors > 0).map(|((r, n), c)| format!("- {r}, {n} services: {} errors: {}", c.errors, c.notes.join(" "))).collect();
    if !errs.is_empty() {
        o.push_str("\nErrors:\n\n");
        o.push_str(&errs.join("\n"));
        o.push('\n');
    }
    o
}

fn environment(backends: &[IptBackend]) -> Vec<(String, String)> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_owned()))
        .unwrap_or_default();
    let mut v = vec![
        ("kernel".to_string(), kernel),
        ("CPUs".into(), format!("{cpus} ({model})")),
        ("`iptables -V` (the system default backend)".into(), cmd_output("iptables", &["-V"])),
        ("load average (1/5/15 min) at the start".into(), loadavg()),
        // SAFETY: getpriority(2) on this process.
        ("bench priority".into(), format!("nice {}", unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) })),
        (
            "agent binary".into(),
            gardenet_tests::netns::sibling_binary("gardenet-agent")
                .map(|p| format!("{} ({})", p.display(), cmd_output(&p.display().to_string(), &["--version"])))
                .unwrap_or_else(|e| format!("{e:#}")),
        ),
    ];
    for b in backends {
        v.push((format!("measured iptables-{}", b.label), cmd_output(b.cli, &["-V"])));
    }
    v
}

/// Other work on the machine skews the numbers: the report shows the load around the run.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.runs == 0 || args.runs > 50 || args.count == 0 || args.count > 100_000 {
        bail!("--runs must be 1..=50 and --count 1..=100000");
    }
    if args.services.is_empty() || args.services.iter().any(|&n| n == 0 || n > MAX_SERVICES) {
        bail!("--services: counts must be 1..={MAX_SERVICES}");
    }
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
    if args.nice != 0 {
        // Inherited by the lab's servers, the agent and the clients: other work on a small
        // machine then disturbs the measurement less.
        // SAFETY: setpriority(2) on this process.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, args.nice) } != 0 {
            eprintln!("bench: setpriority({}): {}", args.nice, std::io::Error::last_os_error());
        }
    }
    let backends = ipt_backends(args.no_legacy)?;
    let env = environment(&backends);
    for (k, v) in &env {
        eprintln!("bench: {k}: {v}");
    }

    let _ = NBE_CELL.set(args.backends.clamp(1, 3));
    let t0 = Instant::now();
    let lab = Lab::new(nbe())?;
    // A wide ephemeral port range in the client namespace: tens of thousands of connections
    // per minute to one destination must not run out of ports in TIME_WAIT.
    lab.client.sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
    // And reuse of TIME_WAIT ports for new outgoing connections: without it, runs late in a
    // phase search a nearly exhausted port space and measure that instead of the datapath.
    lab.client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    eprintln!("bench: lab {} up in {:.1} s", lab.tag, t0.elapsed().as_secs_f64());

    let mut res = Results::default();
    let run = (|| -> Result<()> {
        let on = |p: &str| args.phases.iter().any(|x| x == p);
        if on("socket") {
            phase_socket_lb(&lab, &args, &mut res)?;
        }
        if on("tc") {
            phase_tc_lb(&lab, &args, &mut res)?;
        }
        if on("iptables") {
            phase_iptables(&lab, &args, &backends, &mut res)?;
        }
        Ok(())
    })();
    let mut env = env;
    env.push(("load average (1/5/15 min) at the end".into(), loadavg()));
    env.push(("wall time".into(), format!("{:.0} s", t0.elapsed().as_secs_f64())));
    let table = report(&res, &args, &backends, &env);
    println!("{table}");
    drop(lab);
    run.context("benchmark aborted; the table above has what was measured")
}
