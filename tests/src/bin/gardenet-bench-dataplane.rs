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
//! Phases (each measures "direct" interleaved with its mode, as a control):
//!   A. agent with socket LB on the lab cgroup, no TC: direct (client outside the cgroup,
//!      no datapath on its path; backends in turn, and each connection to a random backend as
//!      the LB picks them) and socket LB (client inside the cgroup -> VIP);
//!   B. agent with TC LB on `nc0`, no socket LB: TC LB (client -> VIP) and direct from the lab's
//!      side client (its link has no datapath attached; in turn, at random, and to one backend
//!      only, one destination as the VIP is), then a short probe of direct
//!      connections from the main client (which stale TC conntrack entries can break, see
//!      `stale_ct_probe`), and (`tc-iptables`) TC LB in one ring with kube-proxy's iptables-nft
//!      rules on a peer node in front of the same backends (`tc_beside_iptables`);
//!   C. no agent: kube-proxy-style nat ruleset loaded with iptables-restore in the node
//!      namespace (nft backend, then legacy if installed): iptables (client -> VIP);
//!   D. kube-proxy's nftables-mode ruleset, loaded in one transaction: nftables (client -> VIP);
//!   E. ablation: TC LB and direct with each piece of the datapath taken away in turn, with
//!      the programs' run-time statistics;
//!   F. per packet: each path through the TC programs run on its own (`BPF_PROG_TEST_RUN`).
use std::{
    collections::BTreeMap,
    io::Write,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use gardenet_tests::{
    interrupt,
    lab::{backend_ip, counts, service_yaml, slice_yaml, Agent, AgentOpts, Lab, SERVER_PORT, SHARED_IP},
    netns::Netns,
};

/// Benchmark of the Service datapaths in a namespace lab (needs root).
#[derive(Parser)]
struct Args {
    /// Connections per measured run.
    #[arg(long, default_value_t = 3000)]
    count: u32,
    /// Measured runs per cell (the cell shows the median). Nine, so that the interval of a
    /// run-by-run ratio's median leaves out the lowest and the highest run: with five it is
    /// their whole range, and one disturbed run leaves the verdict undecided.
    #[arg(long, default_value_t = 9)]
    runs: usize,
    /// Connections per turn when the modes of a phase take turns within each run (see
    /// `tcp_ring`); 0: each mode's run on its own, one after the other (before 2026-12-01).
    /// Smaller turns measure the modes closer together: TC LB / direct beside it ranged
    /// 0.79-1.13x run by run with 0, 0.79-1.07x with 200, 0.84-1.04x with 50, 0.89-1.01x
    /// with 10 (2026-12-01, docs/benchmarks.md).
    #[arg(long, default_value_t = 10)]
    block: u32,
    /// Service counts (columns), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,1000,10000,30000")]
    services: Vec<usize>,
    /// Skip the iptables-legacy row even if iptables-legacy-restore is installed.
    #[arg(long)]
    no_legacy: bool,
    /// Nice value for the bench and everything it starts (0: leave as is).
    #[arg(long, default_value_t = -10, allow_hyphen_values = true)]
    nice: i32,
    /// Run the bench and everything it starts on this one CPU. Then no wakeup crosses CPUs,
    /// and a mode's cost per connection is its CPU time; by default the scheduler spreads
    /// client, servers and softirq work over the CPUs, and on a small VM where a wakeup lands
    /// moves a cell by more than a datapath costs.
    #[arg(long)]
    cpu: Option<usize>,
    /// Longest wait for the agent to program a manifest change (seconds).
    #[arg(long, default_value_t = 300)]
    program_timeout_s: u64,
    /// Longest wait for `nft -f` to load kube-proxy's nftables ruleset (seconds). One
    /// transaction of that ruleset takes time quadratic in the number of services on this
    /// kernel (docs/benchmarks.md): a count whose load, predicted from the last one, would
    /// take longer is not measured, and a load that takes longer is stopped; either is said
    /// in the results, and the bench goes on.
    #[arg(long, default_value_t = 600)]
    nft_load_limit_s: u64,
    /// Backends per Service (and backend hosts in the lab). With 1, "direct" and the LB
    /// modes talk to the very same server, which isolates the cost of the LB itself.
    #[arg(long, default_value_t = 3)]
    backends: usize,
    /// Phases to run: socket, tc, iptables, nftables, ablation, packets; and tc-iptables (with
    /// tc: at each service count, TC LB and iptables-nft in one ring, see `tc_beside_iptables`).
    #[arg(long, value_delimiter = ',', default_value = "socket,tc,tc-iptables,iptables,nftables,ablation,packets")]
    phases: Vec<String>,
    /// Length of the one long TCP stream per mode (seconds; 0: none).
    #[arg(long, default_value_t = 10.0)]
    stream_seconds: f64,
    /// Service count at which the streams run (default: the first of --services).
    #[arg(long)]
    stream_at: Option<usize>,
    /// Service count of the ablation phase (each datapath piece taken away in turn).
    #[arg(long, default_value_t = 1)]
    ablation_services: usize,
    /// An extra argument for the agent of the socket LB and TC LB phases (repeatable), to
    /// measure one of its settings: `--agent-arg=--map-conntrack=16384`.
    #[arg(long = "agent-arg", allow_hyphen_values = true)]
    agent_args: Vec<String>,
    /// Where the results (JSON) and the plot (PNG) go.
    #[arg(long, default_value = "target/bench")]
    out_dir: std::path::PathBuf,
    /// Only render the plot from an earlier run's JSON (no lab, no root needed), as a PNG of
    /// the same name next to it (`x.json` -> `x.png`).
    #[arg(long)]
    plot_only: Option<std::path::PathBuf>,
}

const PORT: u16 = 80;
static NBE_CELL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Backends per Service (`--backends`).
fn nbe() -> usize {
    *NBE_CELL.get().unwrap_or(&3)
}
const MAX_SERVICES: usize = 60_000;

/// Sleeps in small steps so Ctrl-C is noticed.
fn nap(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        interrupt::check()?;
        std::thread::sleep(Duration::from_millis(50).min(end.saturating_duration_since(Instant::now())));
    }
    interrupt::check()
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
        interrupt::check()?;
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

/// Waits (up to 30 s) until the agent has finished what a manifest change started (reading the
/// file, programming, freeing the old objects) and the machine has finished what the last
/// phase left (freeing maps, sockets): the agent under 2% of a CPU and the machine under 10%
/// of its CPUs over half a second. A cell measured while either still works measures that.
fn wait_quiet(agent: &Agent, what: &str, res: &mut Results) -> Result<()> {
    const WINDOW: Duration = Duration::from_millis(500);
    let t0 = Instant::now();
    let (mut agent0, mut sys0) = (agent.cpu_time()?, system_busy()?);
    loop {
        interrupt::check()?;
        std::thread::sleep(WINDOW);
        let (agent1, sys1) = (agent.cpu_time()?, system_busy()?);
        let a = agent1.saturating_sub(agent0).as_secs_f64() / WINDOW.as_secs_f64();
        let s = (sys1.0 - sys0.0) as f64 / (sys1.1 - sys0.1).max(1) as f64;
        if a < 0.02 && s < 0.10 {
            res.timing(format!("{what}: agent and machine idle after"), t0.elapsed());
            return Ok(());
        }
        (agent0, sys0) = (agent1, sys1);
        if t0.elapsed() > Duration::from_secs(30) {
            eprintln!("bench: WARNING: {what}: still busy after 30 s (agent {:.0}%, machine {:.0}% of a CPU); measuring anyway", a * 100.0, s * 100.0);
            res.timings.push((
                format!("{what}: still busy after 30 s (agent {:.0}% of a CPU, machine {:.0}% of all)", a * 100.0, s * 100.0),
                "measured anyway".into(),
            ));
            return Ok(());
        }
    }
}

/// (busy, total) jiffies of all CPUs from /proc/stat: busy is user + nice + system + irq +
/// softirq; total adds idle and iowait (steal, time the hypervisor took, counts as neither).
fn system_busy() -> Result<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat")?;
    parse_cpu_line(text.lines().next().unwrap_or_default()).context("parsing /proc/stat")
}

fn parse_cpu_line(line: &str) -> Option<(u64, u64)> {
    let v: Vec<u64> = line.strip_prefix("cpu ")?.split_whitespace().map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let (user, nice, system, idle, iowait, irq, softirq) = (*v.first()?, *v.get(1)?, *v.get(2)?, *v.get(3)?, *v.get(4)?, *v.get(5)?, *v.get(6)?);
    let busy = user + nice + system + irq + softirq;
    Some((busy, busy + idle + iowait))
}

/// How a direct run spreads its connections over the backends.
#[derive(Clone, Copy)]
enum Pick {
    /// Each backend in turn.
    Turn,
    /// A uniformly random backend per connection, as the LB's own pick spreads them.
    Random,
    /// The first backend only: one destination address and port for every connection, as
    /// a client of a VIP has (its ephemeral ports are chosen per destination).
    One,
    /// One address that every backend holds, the node spreading the connections over them by
    /// an ECMP route (`Lab::add_shared_address`): one destination as with `One`, every server
    /// as with `Random`, no translation. Side client only.
    Shared,
}

/// Where a measured client connects to.
#[derive(Clone)]
enum Target {
    /// A backend IP directly (the stream rotates over the backends run by run).
    Direct(Pick),
    /// The same from the lab's side client, whose link has no datapath attached (phase B).
    DirectSide(Pick),
    Vip(String),
    /// A VIP from the peer node's client (`Lab::add_peer_node`): kube-proxy's rules on that
    /// node translate it while TC LB on the lab's node translates the main client's
    /// (`tc_beside_iptables`).
    VipPeer(String),
    /// The backends in turn from the peer node's client, through that node.
    DirectPeer,
}

struct Mode {
    row: String,
    in_cgroup: bool,
    target: Target,
}

impl Mode {
    /// One address: a backend (rotating run by run) or the VIP.
    fn to(&self, run: usize) -> String {
        match &self.target {
            Target::Direct(_) | Target::DirectSide(_) | Target::DirectPeer => format!("{}:{SERVER_PORT}", backend_ip(run % nbe())),
            Target::Vip(v) | Target::VipPeer(v) => format!("{v}:{PORT}"),
        }
    }

    /// Where a connection run goes: "direct" spreads its connections over all backends (in
    /// turn, at random, or by the node's ECMP route to their shared address), so it reaches
    /// the same servers as the load-balanced modes; or it goes to the first backend only.
    fn to_all(&self) -> String {
        match &self.target {
            Target::Direct(Pick::One) | Target::DirectSide(Pick::One) => self.to(0),
            Target::Direct(Pick::Shared) | Target::DirectSide(Pick::Shared) => format!("{SHARED_IP}:{SERVER_PORT}"),
            Target::Direct(_) | Target::DirectSide(_) | Target::DirectPeer => {
                (0..nbe()).map(|b| format!("{}:{SERVER_PORT}", backend_ip(b))).collect::<Vec<_>>().join(",")
            }
            Target::Vip(_) | Target::VipPeer(_) => self.to(0),
        }
    }

    /// Backends that answer a run of this mode.
    fn answering(&self) -> usize {
        match self.target {
            Target::Direct(Pick::One) | Target::DirectSide(Pick::One) => 1,
            _ => nbe(),
        }
    }

    /// The netkit `tcp` flags of the pick.
    fn pick_args(&self) -> &'static [&'static str] {
        match self.target {
            Target::Direct(Pick::Random) | Target::DirectSide(Pick::Random) => &["--random"],
            _ => &[],
        }
    }
}

#[derive(Default)]
struct Cell {
    /// Connections per second, one per run.
    samples: Vec<f64>,
    /// First-reply latency p50/p90/p99 (µs), one triple per run.
    lat: Vec<[f64; 3]>,
    errors: u64,
    notes: Vec<String>,
    /// Program name -> (runs, ns) over this cell's measured runs (with statistics on).
    progs: BTreeMap<String, (u64, u64)>,
    /// Connections made in the runs `progs` covers.
    conns: u64,
}

#[derive(Default)]
struct Results {
    cells: BTreeMap<(String, usize), Cell>,
    /// Row -> (services, bits/s) of its one long stream.
    streams: BTreeMap<String, (usize, f64)>,
    /// Ablation configurations in the order measured: (configuration, rows measured in it).
    ablation: Vec<(String, Vec<String>)>,
    /// Program name -> instructions the verifier processed (`bpf_prog_info.verified_insns`).
    verified: BTreeMap<String, u32>,
    /// Per-packet phase: (path, program, run times in ns).
    packets: Vec<(&'static str, &'static str, Vec<u32>)>,
    timings: Vec<(String, String)>,
    probes: Vec<String>,
    /// Cells left out, and why.
    skipped: Vec<String>,
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
    run_json(lab.client_cmd(in_cgroup, args)?, args)
}

/// A mode's client command: the main client (in the cgroup or not), the side client, or the
/// peer node's client.
fn mode_cmd(lab: &Lab, m: &Mode, args: &[&str]) -> Result<Command> {
    match m.target {
        Target::DirectSide(_) => lab.side_client_cmd(args),
        Target::DirectPeer | Target::VipPeer(_) => lab.peer_client_cmd(args),
        _ => lab.client_cmd(m.in_cgroup, args),
    }
}

/// A mode's client run to completion.
fn mode_json(lab: &Lab, m: &Mode, args: &[&str]) -> Result<serde_json::Value> {
    run_json(mode_cmd(lab, m, args)?, args)
}

/// Runs a netkit client command to completion (killed on Ctrl-C) and parses its JSON output.
fn run_json(cmd: Command, args: &[&str]) -> Result<serde_json::Value> {
    Client::spawn(cmd)?.finish(args)
}

/// A netkit client running; killed if dropped before [`Client::finish`].
struct Client {
    child: std::process::Child,
    out: Option<std::thread::JoinHandle<Vec<u8>>>,
}

impl Client {
    fn spawn(mut cmd: Command) -> Result<Self> {
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn()?;
        let mut so = child.stdout.take().unwrap();
        let out = std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = std::io::Read::read_to_end(&mut so, &mut s);
            s
        });
        Ok(Client { child, out: Some(out) })
    }

    /// Waits for the client's exit (killing it on Ctrl-C) and parses its JSON output.
    fn finish(mut self, args: &[&str]) -> Result<serde_json::Value> {
        let status = loop {
            if let Some(st) = self.child.try_wait()? {
                break st;
            }
            interrupt::check()?;
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = self.out.take().and_then(|h| h.join().ok()).unwrap_or_default();
        if !status.success() {
            bail!("netkit {args:?} failed: {status}");
        }
        serde_json::from_slice(&out).with_context(|| format!("netkit output: {}", String::from_utf8_lossy(&out)))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if self.out.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The netkit `tcp` arguments of one run of `m`.
fn tcp_args(m: &Mode, count: u32) -> Vec<String> {
    let mut a: Vec<String> = ["tcp", "--to", &m.to_all(), "--count", &count.to_string(), "--timeout-ms", "2000"].map(String::from).into();
    a.extend(m.pick_args().iter().map(|s| s.to_string()));
    a
}

/// A run's output checked: (per_second, errors, answers by backend; the output also carries
/// `latency_us`).
fn tcp_result(m: &Mode, count: u32, v: serde_json::Value) -> Result<(f64, u64, serde_json::Value)> {
    let errors: u64 = v["errors"].as_object().into_iter().flatten().map(|(_, n)| n.as_u64().unwrap_or(0)).sum();
    let answered: u64 = counts(&v).iter().map(|(_, n)| n).sum();
    if answered + errors != count as u64 {
        bail!("{}: {}: {answered} answers + {errors} errors != {count}: {v}", m.row, m.to_all());
    }
    let ps = v["per_second"].as_f64().with_context(|| format!("no per_second in {v}"))?;
    Ok((ps, errors, v))
}

/// One netkit `tcp` run of `m` on its own.
fn tcp_run(lab: &Lab, m: &Mode, count: u32) -> Result<(f64, u64, serde_json::Value)> {
    interrupt::check()?;
    let a = tcp_args(m, count);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    tcp_result(m, count, mode_json(lab, m, &a)?)
}

/// A directory for the FIFOs of [`tcp_ring`], removed on drop.
struct TurnDir(std::path::PathBuf);

impl TurnDir {
    fn new() -> Result<Self> {
        let d = std::path::PathBuf::from(format!("/run/gardenet-bench-turns-{}", std::process::id()));
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        Ok(TurnDir(d))
    }
}

impl Drop for TurnDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One run of every mode of `ms` at the same time, taking turns block by block (`netkit tcp
/// --turn-in/--turn-out`, a ring of FIFOs in `dir`; `ms[0]` starts): each mode's connections
/// are made in blocks of `block`, one mode at a time, so the modes' rates are measured in the
/// same milliseconds of the host's life. Results in the order of `ms`.
fn tcp_ring(lab: &Lab, ms: &[&Mode], count: u32, block: u32, dir: &std::path::Path) -> Result<Vec<(f64, u64, serde_json::Value)>> {
    interrupt::check()?;
    let fifos: Vec<std::path::PathBuf> = (0..ms.len()).map(|k| dir.join(format!("turn-{k}"))).collect();
    for f in &fifos {
        let _ = std::fs::remove_file(f);
        let c = std::ffi::CString::new(f.as_os_str().as_encoded_bytes())?;
        // SAFETY: a NUL-terminated path.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("mkfifo {}", f.display()));
        }
    }
    let mut runs = Vec::with_capacity(ms.len());
    for (k, m) in ms.iter().enumerate() {
        let mut a = tcp_args(m, count);
        a.extend(["--turn-in".into(), fifos[k].display().to_string(), "--turn-out".into(), fifos[(k + 1) % ms.len()].display().to_string()]);
        a.extend(["--block".into(), block.to_string()]);
        if k == 0 {
            a.push("--turn-first".into());
        }
        let args: Vec<&str> = a.iter().map(String::as_str).collect();
        runs.push((Client::spawn(mode_cmd(lab, m, &args)?)?, a));
    }
    let mut out = Vec::with_capacity(ms.len());
    for ((c, a), m) in runs.into_iter().zip(ms) {
        let args: Vec<&str> = a.iter().map(String::as_str).collect();
        out.push(tcp_result(m, count, c.finish(&args)?)?);
    }
    Ok(out)
}

/// TIME_WAIT sockets in the client namespace, or in another client's if it has more
/// (/proc/net/sockstat is per network namespace).
fn client_timewait(lab: &Lab) -> Result<u64> {
    let mut most = 0;
    for ns in lab.clients() {
        let out = ns.command("cat", None)?.arg("/proc/net/sockstat").output()?;
        let s = String::from_utf8_lossy(&out.stdout);
        let tw: u64 = s
            .lines()
            .find(|l| l.starts_with("TCP:"))
            .and_then(|l| l.split_whitespace().skip_while(|w| *w != "tw").nth(1))
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no TCP tw in sockstat: {s}"))?;
        most = most.max(tw);
    }
    Ok(most)
}

/// Keeps the client's ephemeral port space from filling up with TIME_WAIT sockets (which would
/// make later runs pay for port searches): waits (bounded) while more than `limit` exist.
fn drain_timewait(lab: &Lab, limit: u64) -> Result<()> {
    let t0 = Instant::now();
    let mut tw = client_timewait(lab)?;
    if tw > limit {
        eprintln!("bench: {tw} TIME_WAIT sockets in a client namespace; waiting until <= {limit}");
    }
    while tw > limit && t0.elapsed() < Duration::from_secs(75) {
        nap(Duration::from_secs(1))?;
        tw = client_timewait(lab)?;
    }
    Ok(())
}

/// Sanity check, wait for TIME_WAIT sockets, warm-up, then `runs` interleaved measured runs of every mode. With
/// `prog_stats`, what gardenet's programs ran during each measured run is added to its cell
/// (run-time statistics must be on).
fn measure(lab: &Lab, modes: &[Mode], n: usize, args: &Args, res: &mut Results, prog_stats: bool) -> Result<()> {
    for m in modes {
        let (_, errors, v) = tcp_run(lab, m, 60)?;
        let c = counts(&v);
        let want = m.answering();
        if errors > 0 || c.len() != want {
            bail!("{} with {n} services: sanity check failed (expected {want} backend(s) answering, no errors): {v}", m.row);
        }
    }
    drain_timewait(lab, 45_000)?;
    // Warm-up right before the measured runs, not before the wait above: after seconds of
    // idling, the first run of a cell measured ~10-35% low (2026-11-27; a small VM's vCPUs).
    for m in modes {
        tcp_run(lab, m, args.count.min(1000))?;
    }
    // Modes measured side by side take turns block by block (unless `--block 0`, or the
    // programs' statistics are read per run, which needs a run to itself).
    let ring = (args.block > 0 && !prog_stats && modes.len() > 1).then(TurnDir::new).transpose()?;
    for r in 0..args.runs {
        // Rotate the order so no mode always runs right after (or starts before) the same
        // other one.
        let order: Vec<&Mode> = (0..modes.len()).map(|k| &modes[(k + r) % modes.len()]).collect();
        let mut done = Vec::with_capacity(order.len());
        if let Some(dir) = &ring {
            done = tcp_ring(lab, &order, args.count, args.block, &dir.0)?;
        } else {
            for m in &order {
                let before = if prog_stats { Some(gardenet_tests::bpfstats::programs("gn_")?) } else { None };
                let run = tcp_run(lab, m, args.count)?;
                if let Some(before) = before {
                    let d = gardenet_tests::bpfstats::delta(&before, &gardenet_tests::bpfstats::programs("gn_")?);
                    let cell = res.cell(&m.row, n);
                    cell.conns += args.count as u64;
                    for (name, (runs, ns)) in d {
                        let e = cell.progs.entry(name).or_default();
                        e.0 += runs;
                        e.1 += ns;
                    }
                }
                done.push(run);
            }
        }
        for (m, (ps, errors, v)) in order.iter().zip(done) {
            eprintln!(
                "bench: {n:>6} services  {:<28} run {}: {:>8.0} conn/s{}",
                m.row,
                r + 1,
                ps,
                if errors > 0 { format!("  ERRORS {v}") } else { String::new() }
            );
            let cell = res.cell(&m.row, n);
            cell.samples.push(ps);
            let l = &v["latency_us"];
            if let (Some(a), Some(b), Some(c)) = (l["p50"].as_f64(), l["p90"].as_f64(), l["p99"].as_f64()) {
                cell.lat.push([a, b, c]);
            }
            cell.errors += errors;
            if errors > 0 {
                cell.notes.push(v["errors"].to_string());
            }
        }
        drain_timewait(lab, 60_000)?;
    }
    Ok(())
}

fn stream_at(args: &Args) -> usize {
    args.stream_at.unwrap_or(args.services[0])
}

/// One long TCP stream per mode (`--stream-seconds`) when `n` is the stream's service count.
fn streams(lab: &Lab, modes: &[&Mode], n: usize, args: &Args, res: &mut Results) -> Result<()> {
    if n != stream_at(args) || args.stream_seconds <= 0.0 {
        return Ok(());
    }
    for m in modes {
        interrupt::check()?;
        let secs = format!("{}", args.stream_seconds);
        let v = mode_json(lab, m, &["stream", "--to", &m.to(0), "--seconds", &secs])?;
        let bps = v["bits_per_second"].as_f64().with_context(|| format!("stream {}: {v}", m.row))?;
        eprintln!("bench: {n:>6} services  {:<28} stream: {:.2} Gbit/s", m.row, bps / 1e9);
        res.streams.insert(m.row.clone(), (n, bps));
    }
    Ok(())
}

const ROW_DIRECT: &str = "direct (backend IP)";
const ROW_DIRECT_RANDOM: &str = "direct (random backend IP)";
const ROW_SOCK: &str = "socket LB";
const ROW_TC: &str = "TC LB";
const ROW_NFT: &str = "nftables (kube-proxy nftables mode)";
const ROW_NFT_CTL: &str = "direct, nftables rules loaded";
const CTL_DIRECT_A: &str = "direct, no datapath (phase A)";
const CTL_DIRECT_A_CG: &str = "direct to a random backend, client in the socket LB's cgroup (hooks run, nothing to translate; phase A)";
const CTL_DIRECT_B: &str = "direct, no datapath, side client (phase B)";
const CTL_DIRECT_B_RANDOM: &str = "direct to a random backend, no datapath, side client (phase B)";
const CTL_DIRECT_B_ONE: &str = "direct to one backend, no datapath, side client (phase B)";
const CTL_DIRECT_B_SHARED: &str = "direct to one address on every backend (ECMP), no datapath, side client (phase B)";
/// The rows of `tc_beside_iptables`: TC LB, iptables-nft on the peer node, direct through the
/// peer node under its rules; TC LB's connections tracked by its node's conntrack, then not.
const PAIR_TRACKED: [&str; 3] = [
    "TC LB, tracked by the node's conntrack (a nat table loaded), beside iptables-nft on a peer node (phase B)",
    "iptables (nft) on a peer node, beside TC LB tracked (phase B)",
    "direct through the iptables-nft peer node, beside TC LB tracked (phase B)",
];
const PAIR_UNTRACKED: [&str; 3] = [
    "TC LB, untracked (no netfilter nat on its node), beside iptables-nft on a peer node (phase B)",
    "iptables (nft) on a peer node, beside TC LB untracked (phase B)",
    "direct through the iptables-nft peer node, beside TC LB untracked (phase B)",
];

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

/// The nat part of the ruleset kube-proxy's nftables mode (`pkg/proxy/nftables`, through
/// knftables) writes for `n` ClusterIP Services: one `service-ips` verdict map from
/// `address . protocol . port` to a per-service chain, which picks an endpoint chain with
/// `numgen random mod N vmap`, which DNATs. Written as `add` commands and loaded by one
/// `nft -f -`: one transaction, as kube-proxy loads it. kube-proxy's filter-table chains
/// (firewall, reject of services without endpoints) are not built; without a cluster CIDR the
/// client is not masqueraded (as for the iptables ruleset).
fn nft_ruleset(n: usize) -> String {
    const T: &str = "ip kube-proxy";
    let mut s = String::with_capacity(n * 900);
    s.push_str(&format!(
        "add table {T} {{ comment \"rules for kube-proxy\" ; }}\n\
         add chain {T} mark-for-masquerade\n\
         add rule {T} mark-for-masquerade mark set mark or 0x4000\n\
         add chain {T} masquerading {{ type nat hook postrouting priority 100 ; }}\n\
         add rule {T} masquerading mark and 0x4000 == 0 return\n\
         add rule {T} masquerading mark set mark xor 0x4000\n\
         add rule {T} masquerading masquerade fully-random\n\
         add chain {T} services\n\
         add chain {T} nat-prerouting {{ type nat hook prerouting priority -100 ; }}\n\
         add rule {T} nat-prerouting jump services\n\
         add chain {T} nat-output {{ type nat hook output priority -100 ; }}\n\
         add rule {T} nat-output jump services\n\
         add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; }}\n\
         add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips\n"
    ));
    let mut elements = Vec::with_capacity(n);
    for i in 0..n {
        let port_name = format!("lab/{}/tcp/p-tcp", svc_name(i));
        let svc = format!("service-{}-{port_name}", &chain_hash(&port_name)[..8]);
        s.push_str(&format!("add chain {T} {svc}\n"));
        let mut vmap = Vec::new();
        for b in 0..nbe() {
            let ep = format!("{}/{SERVER_PORT}", backend_ip(b));
            let epc = format!("endpoint-{}-{port_name}__{ep}", &chain_hash(&format!("{port_name}{ep}"))[..8]);
            s.push_str(&format!(
                "add chain {T} {epc}\n\
                 add rule {T} {epc} ip saddr {ip} jump mark-for-masquerade\n\
                 add rule {T} {epc} meta l4proto tcp dnat to {ip}:{SERVER_PORT}\n",
                ip = backend_ip(b)
            ));
            vmap.push(format!("{b} : goto {epc}"));
        }
        s.push_str(&format!("add rule {T} {svc} numgen random mod {} vmap {{ {} }}\n", nbe(), vmap.join(" , ")));
        elements.push(format!("{} . tcp . {PORT} : goto {svc}", vip(i)));
    }
    for chunk in elements.chunks(1000) {
        s.push_str(&format!("add element {T} service-ips {{ {} }}\n", chunk.join(" , ")));
    }
    s
}

/// kube-proxy's nftables table loaded in the node namespace; deleted on drop.
struct NftRules<'a> {
    node: &'a Netns,
    loaded: bool,
}

impl<'a> NftRules<'a> {
    fn load(node: &'a Netns, rules: &str, limit: Duration) -> Result<Self> {
        let mut g = NftRules { node, loaded: true };
        if let Err(e) = node_run(node, "nft", &["-f", "-"], Some(rules), limit) {
            g.flush();
            return Err(e);
        }
        Ok(g)
    }

    fn flush(&mut self) {
        if std::mem::take(&mut self.loaded) {
            let _ = node_run(self.node, "nft", &["delete", "table", "ip", "kube-proxy"], None, Duration::from_secs(300));
        }
    }
}

impl Drop for NftRules<'_> {
    fn drop(&mut self) {
        self.flush();
    }
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
        if interrupt::requested() || t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            interrupt::check()?;
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
    /// The tables the rules fill (their `*table` lines).
    tables: Vec<String>,
    loaded: bool,
}

impl<'a> IptRules<'a> {
    fn load(node: &'a Netns, backend: &'a IptBackend, rules: &str) -> Result<Self> {
        let mut g = IptRules { node, backend, tables: tables_of(rules), loaded: true };
        if let Err(e) = node_run(node, backend.restore, &[], Some(rules), Duration::from_secs(600)) {
            g.flush();
            return Err(e);
        }
        Ok(g)
    }

    /// Removes the rules and chains. For nft, each whole table (`ip nat`, `ip raw`) goes, so no
    /// empty hooks stay behind; legacy tables cannot be unregistered short of deleting the
    /// namespace, so their (empty) built-in chains stay.
    fn flush(&mut self) {
        if !std::mem::take(&mut self.loaded) {
            return;
        }
        let t = Duration::from_secs(300);
        for table in &self.tables {
            if self.backend.label == "nft" && have("nft") && node_run(self.node, "nft", &["delete", "table", "ip", table], None, t).is_ok() {
                continue;
            }
            let _ = node_run(self.node, self.backend.cli, &["-t", table, "-F"], None, t);
            let _ = node_run(self.node, self.backend.cli, &["-t", table, "-X"], None, t);
        }
    }
}

/// The tables an `iptables-restore` input fills, in order: its `*table` lines.
fn tables_of(rules: &str) -> Vec<String> {
    rules.lines().filter_map(|l| l.strip_prefix('*')).map(String::from).collect()
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
    let agent = Agent::start(lab, AgentOpts { socket_lb: true, extra: args.agent_args.clone(), ..Default::default() }, &[])?;
    res.timing("phase A: agent start, no services (ready)", t0.elapsed());
    for &n in &args.services {
        let yaml = manifests(n);
        let t0 = Instant::now();
        agent.write("services.yaml", &yaml)?;
        let d = wait_programmed(&agent, n, t0, Duration::from_secs(args.program_timeout_s))?;
        res.timing(format!("phase A: manifest rewritten with {n} services -> all programmed (lb list)"), d);
        wait_quiet(&agent, &format!("phase A: {n} services"), res)?;
        let v = vip(measured(n));
        let modes = [
            Mode { row: ROW_DIRECT.into(), in_cgroup: false, target: Target::Direct(Pick::Turn) },
            Mode { row: ROW_DIRECT_RANDOM.into(), in_cgroup: false, target: Target::Direct(Pick::Random) },
            Mode { row: ROW_SOCK.into(), in_cgroup: true, target: Target::Vip(v) },
            // The hooks' cost apart from translation: each connect() looks its address up, finds
            // no frontend and goes on.
            Mode { row: CTL_DIRECT_A_CG.into(), in_cgroup: true, target: Target::Direct(Pick::Random) },
        ];
        measure(lab, &modes, n, args, res, false)?;
        streams(lab, &[&modes[0], &modes[2]], n, args, res)?;
    }
    Ok(())
}

/// With `pair`, each service count also gets [`tc_beside_iptables`].
fn phase_tc_lb(lab: &Lab, args: &Args, pair: Option<&IptBackend>, res: &mut Results) -> Result<()> {
    eprintln!("\nbench: phase B: agent with TC LB on nc0 (no socket LB)");
    // Largest set first: a fresh agent start with all of them, then shrinking (deletions).
    let mut ns = args.services.clone();
    ns.sort_unstable_by(|a, b| b.cmp(a));
    let opts = AgentOpts { tc: true, extra: args.agent_args.clone(), ..Default::default() };
    let t0 = Instant::now();
    // The set the agent's manifest holds: the first one, unless that start failed.
    let mut written = Some(ns[0]);
    let agent = match Agent::start(lab, opts.clone(), &[("services.yaml", manifests(ns[0]))]) {
        Ok(a) => {
            res.timing(format!("phase B: fresh agent start with {} services (ready)", ns[0]), t0.elapsed());
            a
        }
        Err(e) => {
            interrupt::check()?;
            eprintln!("bench: WARNING: fresh start with {} services failed ({e:#}); starting empty instead", ns[0]);
            res.timings.push((format!("phase B: fresh agent start with {} services", ns[0]), format!("FAILED: {e:#}").replace('\n', " ")));
            written = None;
            Agent::start(lab, opts, &[])?
        }
    };
    for &n in &ns {
        let t0 = Instant::now();
        // Writing the set the agent started with again would only make it read the file again
        // while the first cell is measured.
        if written.replace(n) != Some(n) {
            agent.write("services.yaml", &manifests(n))?;
        }
        let d = wait_programmed(&agent, n, t0, Duration::from_secs(args.program_timeout_s))?;
        res.timing(format!("phase B: {n} services programmed (lb list)"), d);
        wait_quiet(&agent, &format!("phase B: {n} services"), res)?;
        // "direct" from the main client would cross the programs on nc0 (and meet stale
        // conntrack entries, see `stale_ct_probe`): the control runs from the side client.
        let modes = [
            Mode { row: ROW_TC.into(), in_cgroup: false, target: Target::Vip(vip(measured(n))) },
            Mode { row: CTL_DIRECT_B.into(), in_cgroup: false, target: Target::DirectSide(Pick::Turn) },
            Mode { row: CTL_DIRECT_B_RANDOM.into(), in_cgroup: false, target: Target::DirectSide(Pick::Random) },
            Mode { row: CTL_DIRECT_B_ONE.into(), in_cgroup: false, target: Target::DirectSide(Pick::One) },
            Mode { row: CTL_DIRECT_B_SHARED.into(), in_cgroup: false, target: Target::DirectSide(Pick::Shared) },
        ];
        measure(lab, &modes, n, args, res, false)?;
        streams(lab, &[&modes[0]], n, args, res)?;
        stale_ct_probe(lab, n, res)?;
        if let Some(b) = pair {
            tc_beside_iptables(lab, args, b, n, res)?;
        }
    }
    Ok(())
}

/// TC LB and kube-proxy's iptables rules in one ring of turns, so their ratio is measured in
/// the same milliseconds of the host's life (phases B and C run minutes apart, and the ratio
/// of their medians moved 1.66-1.81x between two runs of 2026-12-04 on one host). Each runs on
/// a node of its own, as in a cluster that has one or the other: kube-proxy's rules (phase C's)
/// on the lab's peer node, in front of the same backends, for the peer client; TC LB on the
/// lab's node for the main client. (Until 2026-12-07 the rules were loaded beside the agent,
/// and TC LB paid for the netfilter hooks of a table gardenet's nodes never have.) The ring
/// runs twice: TC LB's connections untracked, as on a node without kube-proxy, and tracked by
/// its node's conntrack, which an empty nat table turns on (a node where something else
/// needs conntrack).
fn tc_beside_iptables(lab: &Lab, args: &Args, b: &IptBackend, n: usize, res: &mut Results) -> Result<()> {
    let v = vip(measured(n));
    let peer = lab.peer.as_ref().context("the lab has no peer node")?;
    let t0 = Instant::now();
    // Removed when this returns (the guards flush on drop), as is the pass's nat table.
    let _rules = IptRules::load(&peer.node, b, &kube_ruleset(n))?;
    res.timing(format!("phase B: iptables-{} rules of {n} services on the peer node", b.label), t0.elapsed());
    for (rows, untracked) in [(PAIR_TRACKED, false), (PAIR_UNTRACKED, true)] {
        interrupt::check()?;
        let _conntrack_on = if untracked { None } else { Some(IptRules::load(&lab.node, b, NAT_TABLE_ONLY)?) };
        let modes = [
            Mode { row: rows[0].into(), in_cgroup: false, target: Target::Vip(v.clone()) },
            Mode { row: rows[1].into(), in_cgroup: false, target: Target::VipPeer(v.clone()) },
            Mode { row: rows[2].into(), in_cgroup: false, target: Target::DirectPeer },
        ];
        measure(lab, &modes, n, args, res, false)?;
    }
    Ok(())
}

/// A nat table with its built-in chains and no rules: its hooks make the node's netfilter
/// conntrack track every connection, as any nat rule would, and nothing else.
const NAT_TABLE_ONLY: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n";

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
            interrupt::check()?;
            let t0 = Instant::now();
            let mut g = IptRules::load(&lab.node, b, &rules)?;
            res.timing(format!("iptables-{}: {} restore of {n} services ({} lines)", b.label, b.restore, rules.lines().count()), t0.elapsed());
            let modes = [
                Mode { row: ipt_ctl_row(b), in_cgroup: false, target: Target::Direct(Pick::Turn) },
                Mode { row: ipt_row(b), in_cgroup: false, target: Target::Vip(vip(measured(n))) },
            ];
            measure(lab, &modes, n, args, res, false)?;
            streams(lab, &[&modes[1]], n, args, res)?;
            let t0 = Instant::now();
            g.flush();
            res.timing(format!("iptables-{}: flush of {n} services", b.label), t0.elapsed());
        }
    }
    Ok(())
}

fn phase_nftables(lab: &Lab, args: &Args, res: &mut Results) -> Result<()> {
    eprintln!("\nbench: phase D: no agent; kube-proxy's nftables-mode ruleset in the node namespace");
    if !have("nft") {
        bail!("nft is not installed: run `cargo xtask setup` (Debian package nftables)");
    }
    let limit = Duration::from_secs(args.nft_load_limit_s);
    // (services, load time) of the last load, to predict the next one.
    let mut last: Option<(usize, Duration)> = None;
    for &n in &args.services {
        interrupt::check()?;
        if let Some(p) = last.and_then(|(m, d)| predicted_load(m, d, n)).filter(|p| *p > limit) {
            let why = format!(
                "nftables, {n} services: not measured: loading kube-proxy's ruleset in one transaction would take ~{:.0} s here \
                 (quadratic from the last load), over --nft-load-limit-s {}",
                p.as_secs_f64(),
                args.nft_load_limit_s
            );
            eprintln!("bench: {why}");
            res.skipped.push(why);
            continue;
        }
        let rules = nft_ruleset(n);
        let t0 = Instant::now();
        let mut g = match NftRules::load(&lab.node, &rules, limit) {
            Ok(g) => g,
            Err(e) if t0.elapsed() >= limit => {
                interrupt::check()?;
                let why = format!("nftables, {n} services: not measured: {e:#}");
                eprintln!("bench: {why}");
                res.skipped.push(why);
                continue;
            }
            Err(e) => return Err(e),
        };
        let took = t0.elapsed();
        last = Some((n, took));
        res.timing(format!("nftables: `nft -f` of {n} services ({} commands, one transaction)", rules.lines().count()), took);
        let modes = [
            Mode { row: ROW_NFT_CTL.into(), in_cgroup: false, target: Target::Direct(Pick::Turn) },
            Mode { row: ROW_NFT.into(), in_cgroup: false, target: Target::Vip(vip(measured(n))) },
        ];
        measure(lab, &modes, n, args, res, false)?;
        streams(lab, &[&modes[1]], n, args, res)?;
        let t0 = Instant::now();
        g.flush();
        res.timing(format!("nftables: delete table with {n} services"), t0.elapsed());
    }
    Ok(())
}

/// The load time of `n` services' ruleset predicted from `m` services' (`d`): quadratic, as
/// measured (2,000 / 4,000 / 8,000 services: 0.85 / 2.7 / 8.8 s), never below `d`. None from a
/// load under 2 s: that is mostly starting `nft` and parsing, not the quadratic part.
fn predicted_load(m: usize, d: Duration, n: usize) -> Option<Duration> {
    if d < Duration::from_secs(2) {
        return None;
    }
    let r = n as f64 / m.max(1) as f64;
    Some(d.mul_f64((r * r).max(1.0)))
}

/// One configuration of the ablation phase: how the agent runs and what the bench takes off.
struct Ablation {
    label: &'static str,
    xdp: &'static str,
    /// Detach the TC egress program after the start (replies are then not reverse-NATed, so
    /// only untranslated traffic can be measured).
    no_egress: bool,
    /// More agent flags.
    extra: &'static [&'static str],
}

const ABLATIONS: &[Ablation] = &[
    Ablation { label: "TC + XDP native", xdp: "native", no_egress: false, extra: &[] },
    Ablation { label: "TC + XDP generic", xdp: "generic", no_egress: false, extra: &[] },
    Ablation { label: "TC, XDP off", xdp: "off", no_egress: false, extra: &[] },
    Ablation {
        label: "TC, XDP off, 16,384-entry maps",
        xdp: "off",
        no_egress: false,
        extra: &["--map-conntrack=16384", "--map-services=16384", "--map-backends=16384"],
    },
    Ablation { label: "TC ingress only, XDP off", xdp: "off", no_egress: true, extra: &[] },
];

const ABL_NONE: &str = "no agent";

fn abl_row(cfg: &str, what: &str) -> String {
    format!("{cfg}: {what}")
}

/// The datapath with each piece taken away in turn, at `--ablation-services`, with run-time
/// statistics on: conn/s and latency of direct (untranslated, every program runs and finds
/// nothing) and TC LB connections, and what each program costs per run and per connection.
fn phase_ablation(lab: &Lab, args: &Args, res: &mut Results) -> Result<()> {
    eprintln!("\nbench: phase E: ablation (each piece of the TC datapath taken away in turn)");
    let n = args.ablation_services;
    let _stats = gardenet_tests::bpfstats::enable()?;
    let tc = Target::Vip(vip(measured(n)));
    // Baseline: nothing of ours on the path.
    let base = Mode { row: abl_row(ABL_NONE, "direct"), in_cgroup: false, target: Target::Direct(Pick::Turn) };
    measure(lab, std::slice::from_ref(&base), n, args, res, true)?;
    res.ablation.push((ABL_NONE.into(), vec![base.row.clone()]));
    for a in ABLATIONS {
        interrupt::check()?;
        let mut extra = vec![format!("--xdp-mode={}", a.xdp)];
        extra.extend(a.extra.iter().map(|x| x.to_string()));
        let opts = AgentOpts { tc: true, extra, ..Default::default() };
        let agent = Agent::start(lab, opts, &[("services.yaml", manifests(n))])?;
        if res.verified.is_empty() {
            // Every program of the object is loaded (attached or not): the verifier's work for
            // each, as `bpftool prog show` reports it.
            for p in gardenet_tests::bpfstats::programs("gn_")?.into_values() {
                res.verified.insert(p.name, p.verified_insns);
            }
        }
        wait_programmed(&agent, n, Instant::now(), Duration::from_secs(args.program_timeout_s))?;
        wait_quiet(&agent, &format!("ablation, {}", a.label), res)?;
        let mut modes = vec![Mode { row: abl_row(a.label, "direct"), in_cgroup: false, target: Target::Direct(Pick::Turn) }];
        if a.no_egress {
            let links = agent.bpffs.join("links");
            let mut n_detached = 0;
            for e in std::fs::read_dir(&links).with_context(|| format!("reading {}", links.display()))? {
                let p = e?.path();
                if p.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with("tc-egress")) {
                    gardenet_tests::bpfstats::detach_pinned_link(&p)?;
                    n_detached += 1;
                }
            }
            if n_detached == 0 {
                bail!("no tc-egress link pinned under {} (tcx needed for this configuration)", links.display());
            }
        } else {
            modes.push(Mode { row: abl_row(a.label, "TC LB"), in_cgroup: false, target: tc.clone() });
        }
        measure(lab, &modes, n, args, res, true)?;
        res.ablation.push((a.label.into(), modes.iter().map(|m| m.row.clone()).collect()));
        drop(agent);
    }
    Ok(())
}

/// One path through a TC program for the per-packet phase: which program, the packet, and
/// whether the program rewrites it (checked once before the timed runs, so each row
/// measures the path it names).
struct PacketCase {
    path: &'static str,
    prog: &'static str,
    packet: Vec<u8>,
    rewritten: bool,
}

/// A TCP frame with 64 payload bytes and the given flags (valid checksums).
fn tcp_frame(src: &str, dst: &str, sport: u16, dport: u16, flags: u8) -> Result<Vec<u8>> {
    use gardenet_tests::corpus::build::{Spec, L4};
    let l4 = L4::Tcp { sport, dport, seq: 1, ack: 1, flags, window: 512, opts: vec![], payload: vec![0x61; 64] };
    Ok(Spec::new(src.parse()?, dst.parse()?, l4).build())
}

/// Each path through the TC programs on its own, with `BPF_PROG_TEST_RUN`: the kernel runs
/// the program once on a fresh skb built from a given packet and reports the run time. No
/// scheduling, no other traffic: what the programs and their helpers cost per packet, with
/// hot caches, so two builds of the programs can be compared on a busy machine. (In traffic
/// a packet also pays cache misses, and the first rewrite of a cloned skb copies its header.)
fn phase_packets(lab: &Lab, args: &Args, res: &mut Results) -> Result<()> {
    use gardenet_common::{MAP_CT, MAP_SERVICES};
    eprintln!("\nbench: phase F: per packet (each TC path on its own, BPF_PROG_TEST_RUN)");
    const TCP_SYN: u8 = 0x02;
    const TCP_ACK: u8 = 0x10;
    // Frontends: 80 -> 8080 (address and port rewritten; IPv4 and IPv6) and 8080 -> 8080
    // (address only).
    let (fe, fe_same, fe6) = ("198.19.0.10", "198.19.0.11", "fd00:19::10");
    let manifests = [
        ("svc.yaml", gardenet_tests::lab::service_yaml_dual("web", fe, fe6, PORT, &["TCP"])),
        ("eps.yaml", slice_yaml("web", &[0], &["TCP"])),
        ("eps6.yaml", gardenet_tests::lab::slice_yaml6("web", &[0], &["TCP"])),
        ("same.yaml", service_yaml("same", fe_same, SERVER_PORT, &["TCP"])),
        ("same-eps.yaml", slice_yaml("same", &[0], &["TCP"])),
    ];
    let agent = Agent::start(lab, AgentOpts { tc: true, extra: vec!["--xdp-mode=off".into()], ..Default::default() }, &manifests)?;
    agent.wait_backends(&format!("{fe}:{PORT}/tcp"), 1)?;
    agent.wait_backends(&format!("{fe_same}:{SERVER_PORT}/tcp"), 1)?;
    agent.wait_backends(&format!("[{fe6}]:{PORT}/tcp"), 1)?;
    // This agent's programs: the instances that use its pinned maps.
    let pinned = [MAP_SERVICES, MAP_CT].iter().map(|m| Ok(aya::maps::MapData::from_pin(agent.bpffs.join(m))?.info()?.id())).collect::<Result<Vec<u32>>>()?;
    let mut fds = BTreeMap::new();
    for p in ["gn_tc_ingress", "gn_tc_egress"] {
        let ids = gardenet_tests::bpfstats::programs_using_maps(p, &pinned)?;
        let [id] = ids[..] else { bail!("{p}: expected one instance using this agent's maps, found {ids:?}") };
        fds.insert(p, gardenet_tests::bpfstats::prog_fd(id)?);
    }
    let (client, be) = (gardenet_tests::lab::CLIENT_IP, backend_ip(0));
    let (client6, be6) = (gardenet_tests::lab::CLIENT_IP6, gardenet_tests::lab::backend_ip6(0));
    let cases = [
        PacketCase {
            path: "new flow: SYN to a frontend (backend chosen, 2 conntrack entries written)",
            prog: "gn_tc_ingress",
            packet: tcp_frame(client, fe, 40000, PORT, TCP_SYN)?,
            rewritten: true,
        },
        PacketCase {
            path: "established flow: DNAT of address and port",
            prog: "gn_tc_ingress",
            packet: tcp_frame(client, fe, 40000, PORT, TCP_ACK)?,
            rewritten: true,
        },
        PacketCase {
            path: "established flow: DNAT, same port",
            prog: "gn_tc_ingress",
            packet: tcp_frame(client, fe_same, 40002, SERVER_PORT, TCP_ACK)?,
            rewritten: true,
        },
        PacketCase {
            path: "reply: reverse NAT of address and port",
            prog: "gn_tc_egress",
            packet: tcp_frame(&be, client, SERVER_PORT, 40000, TCP_ACK)?,
            rewritten: true,
        },
        PacketCase {
            path: "reply: reverse NAT, same port",
            prog: "gn_tc_egress",
            packet: tcp_frame(&be, client, SERVER_PORT, 40002, TCP_ACK)?,
            rewritten: true,
        },
        PacketCase {
            path: "untranslated (client -> backend address)",
            prog: "gn_tc_ingress",
            packet: tcp_frame(client, &be, 40001, SERVER_PORT, TCP_ACK)?,
            rewritten: false,
        },
        PacketCase {
            path: "untranslated (backend -> client)",
            prog: "gn_tc_egress",
            packet: tcp_frame(&be, client, SERVER_PORT, 40001, TCP_ACK)?,
            rewritten: false,
        },
        PacketCase {
            path: "IPv6, established flow: DNAT of address and port",
            prog: "gn_tc_ingress",
            packet: tcp_frame(client6, fe6, 40000, PORT, TCP_ACK)?,
            rewritten: true,
        },
        PacketCase {
            path: "IPv6, reply: reverse NAT of address and port",
            prog: "gn_tc_egress",
            packet: tcp_frame(&be6, client6, SERVER_PORT, 40000, TCP_ACK)?,
            rewritten: true,
        },
        PacketCase {
            path: "IPv6, untranslated (client -> backend address)",
            prog: "gn_tc_ingress",
            packet: tcp_frame(client6, &be6, 40001, SERVER_PORT, TCP_ACK)?,
            rewritten: false,
        },
    ];
    let syn_same = tcp_frame(client, fe_same, 40002, SERVER_PORT, TCP_SYN)?;
    let syn6 = tcp_frame(client6, fe6, 40000, PORT, TCP_SYN)?;
    let mut times: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    lab.node.run_in(|| -> Result<()> {
        // As if the packets came in on the client's link (source NAT's FIB lookups use it).
        // SAFETY: a NUL-terminated literal.
        let nc0 = unsafe { libc::if_nametoindex(c"nc0".as_ptr()) };
        let mut ctx = vec![0u8; 44];
        ctx[40..44].copy_from_slice(&nc0.to_ne_bytes()); // __sk_buff.ifindex
        let mut out = vec![0u8; 2048];
        let run = |out: &mut [u8], c: &PacketCase| gardenet_tests::bpfstats::test_run_timed(&fds[c.prog], &c.packet, Some(&ctx), out);
        // The flows the "established" and "reply" packets belong to.
        for (syn, to) in [(&cases[0].packet, fe), (&syn_same, fe_same), (&syn6, fe6)] {
            let r = gardenet_tests::bpfstats::test_run_timed(&fds["gn_tc_ingress"], syn, Some(&ctx), &mut out)?;
            // The destination address: at 30 in IPv4, at 38 in IPv6 (after the Ethernet header).
            let dst = match to.parse::<std::net::IpAddr>()? {
                std::net::IpAddr::V4(a) => (30, a.octets().to_vec()),
                std::net::IpAddr::V6(a) => (38, a.octets().to_vec()),
            };
            if r.len < dst.0 + dst.1.len() || out[dst.0..dst.0 + dst.1.len()] == dst.1[..] {
                bail!("the SYN to {to} was not translated");
            }
        }
        for c in &cases {
            let r = run(&mut out, c)?;
            if (out[..r.len] != c.packet[..]) != c.rewritten {
                bail!("{}: the program {} the packet", c.path, if c.rewritten { "did not rewrite" } else { "rewrote" });
            }
        }
        // Rounds of every case in turn, so a disturbance hits all of them alike.
        for _ in 0..args.runs {
            interrupt::check()?;
            for (c, t) in cases.iter().zip(&mut times) {
                for _ in 0..args.count {
                    t.push(run(&mut out, c)?.duration_ns);
                }
            }
        }
        Ok(())
    })??;
    for (c, mut t) in cases.into_iter().zip(times) {
        t.sort_unstable();
        res.packets.push((c.path, c.prog, t));
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

/// A markdown table: one row per mode, one column per service count, each cell as `cell` says.
fn grid(out: &mut String, res: &Results, head: &str, rows: &[String], ns: &[usize], cell: impl Fn(Option<&Cell>) -> String) {
    out.push_str(&format!("| {head} |"));
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
            out.push_str(&format!(" {} |", cell(res.cells.get(&(r.clone(), *n)))));
        }
        out.push('\n');
    }
}

fn table(out: &mut String, res: &Results, rows: &[String], ns: &[usize]) {
    grid(out, res, "mode", rows, ns, fmt_cell);
}

fn med(res: &Results, row: &str, n: usize) -> Option<f64> {
    res.cells.get(&(row.to_owned(), n)).filter(|c| !c.samples.is_empty()).map(|c| median(&c.samples))
}

fn lat_med(c: &Cell, k: usize) -> Option<f64> {
    (!c.lat.is_empty()).then(|| median(&c.lat.iter().map(|l| l[k]).collect::<Vec<_>>()))
}

/// Latency table: "p50 / p90 / p99" in µs per cell (medians over the runs).
fn lat_table(out: &mut String, res: &Results, rows: &[String], ns: &[usize]) {
    grid(out, res, "mode (µs: p50 / p90 / p99)", rows, ns, |c| match c.and_then(|c| Some((lat_med(c, 0)?, lat_med(c, 1)?, lat_med(c, 2)?))) {
        Some((a, b, c)) => format!("{a:.0} / {b:.0} / {c:.0}"),
        None => "n/a".into(),
    });
}

/// "a / b: ratio of the medians (target)"; with `paired` (the two rows were measured
/// interleaved, run i of one right beside run i of the other) also the median and range of the
/// run-by-run ratios, which the host's drift from run to run moves less.
fn ratio_line(o: &mut String, what: &str, res: &Results, (a, b): (&str, &str), n: usize, target: f64, paired: bool) {
    let cell = |row: &str| res.cells.get(&(row.to_owned(), n)).filter(|c| !c.samples.is_empty());
    let (Some(ca), Some(cb)) = (cell(a), cell(b)) else { return };
    let r = median(&ca.samples) / median(&cb.samples);
    let mut line = format!("- {what}, {} services: {r:.2}x (target >= {target:.2}x: {})", thousands(n as f64), if r >= target { "met" } else { "MISSED" });
    if let Some(r) = paired.then(|| run_by_run_cells(res, (a, b), n)).flatten() {
        let (m, lo, hi) = median_min_max(&r);
        line.push_str(&format!("; run by run {m:.2}x ({lo:.2}-{hi:.2}x)"));
        if let Some((lo, hi, cover)) = median_interval(&r, 0.9) {
            let verdict = if lo >= target {
                "met"
            } else if hi < target {
                "MISSED"
            } else {
                "undecided: more runs or a calmer host"
            };
            line.push_str(&format!("; its median lies in {lo:.2}-{hi:.2}x with {:.0}% confidence: {verdict}", cover * 100.0));
        }
    }
    o.push_str(&line);
    o.push('\n');
}

/// Row `a`'s runs over row `b`'s at `n` services, run by run (see [`run_by_run`]).
fn run_by_run_cells(res: &Results, (a, b): (&str, &str), n: usize) -> Option<Vec<f64>> {
    let cell = |row: &str| res.cells.get(&(row.to_owned(), n));
    run_by_run(&cell(a)?.samples, &cell(b)?.samples)
}

/// a[i] / b[i] (None unless both have the same, non-zero number of runs).
fn run_by_run(a: &[f64], b: &[f64]) -> Option<Vec<f64>> {
    (a.len() == b.len() && !a.is_empty()).then(|| a.iter().zip(b).map(|(x, y)| x / y).collect())
}

fn median_min_max(r: &[f64]) -> (f64, f64, f64) {
    (median(r), r.iter().copied().fold(f64::INFINITY, f64::min), r.iter().copied().fold(f64::NEG_INFINITY, f64::max))
}

/// A distribution-free confidence interval for the median of `v`: the pair of order statistics
/// (k-th smallest, k-th largest) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k),
/// is at least `min_coverage`; with that coverage. None when even the whole range falls short
/// (fewer than 5 values for 90%). Assumes the values are independent draws, which paired runs
/// taken alternately are as near as this host allows.
fn median_interval(v: &[f64], min_coverage: f64) -> Option<(f64, f64, f64)> {
    let n = v.len();
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    // P(Binomial(n, 1/2) <= i) for i = 0, 1, ...
    let mut tail = 0.0;
    let mut choose = 1.0;
    let mut best = None;
    for k in 1..=n / 2 {
        tail += choose / 2f64.powi(n as i32);
        choose = choose * (n - (k - 1)) as f64 / k as f64;
        let cover = 1.0 - 2.0 * tail;
        if cover < min_coverage {
            break;
        }
        best = Some((s[k - 1], s[n - k], cover));
    }
    best
}

/// The rows of the main tables and of the plot, one per mode.
fn mode_rows(backends: &[IptBackend]) -> Vec<String> {
    let mut rows = vec![ROW_DIRECT.to_string(), ROW_DIRECT_RANDOM.into(), ROW_SOCK.into(), ROW_TC.into()];
    rows.extend(backends.iter().map(ipt_row));
    rows.push(ROW_NFT.into());
    rows
}

fn report(res: &Results, args: &Args, backends: &[IptBackend], env: &[(String, String)]) -> String {
    let mut o = String::new();
    o.push_str("## Dataplane benchmark\n\n");
    for (k, v) in env {
        o.push_str(&format!("- {k}: {v}\n"));
    }
    o.push_str(&format!(
        "- each cell: median of {} runs of {} sequential connections (connect, one request, one reply, close) \
         by one client; ± is half the min-max range relative to the median\n\n",
        args.runs, args.count
    ));
    let rows = mode_rows(backends);
    o.push_str("### TCP connections per second\n\n");
    table(&mut o, res, &rows, &args.services);
    o.push('\n');
    // Each load balancer against the "direct" rows measured in its phase: (line, (mode, control),
    // target, whether the runs are paired).
    let ratios: [(&str, (&str, &str), f64, bool); 8] = [
        ("socket LB / direct", (ROW_SOCK, ROW_DIRECT), 0.97, true),
        ("socket LB / direct to a random backend", (ROW_SOCK, ROW_DIRECT_RANDOM), 0.97, true),
        ("socket LB / direct to a random backend from the same cgroup", (ROW_SOCK, CTL_DIRECT_A_CG), 0.97, true),
        ("TC LB / direct", (ROW_TC, ROW_DIRECT), 0.90, false),
        ("TC LB / direct measured beside it (phase B)", (ROW_TC, CTL_DIRECT_B), 0.90, true),
        ("TC LB / direct to a random backend measured beside it (phase B)", (ROW_TC, CTL_DIRECT_B_RANDOM), 0.90, true),
        ("TC LB / direct to one backend measured beside it (phase B)", (ROW_TC, CTL_DIRECT_B_ONE), 0.90, true),
        ("TC LB / direct to one address on every backend (ECMP) measured beside it (phase B)", (ROW_TC, CTL_DIRECT_B_SHARED), 0.90, true),
    ];
    for &n in &args.services {
        for (line, rows, target, paired) in ratios {
            ratio_line(&mut o, line, res, rows, n, target, paired);
        }
    }
    if let Some(b) = backends.iter().find(|b| b.label == "nft") {
        if args.services.contains(&10_000) {
            ratio_line(&mut o, "TC LB / iptables (nft), phases B and C", res, (ROW_TC, &ipt_row(b)), 10_000, 1.8, false);
            for (what, rows) in [("untracked", PAIR_UNTRACKED), ("tracked by the node's conntrack", PAIR_TRACKED)] {
                ratio_line(&mut o, &format!("TC LB {what} / iptables (nft) beside it in one ring (phase B)"), res, (rows[0], rows[1]), 10_000, 1.8, true);
            }
        }
    }
    let pair_rows: Vec<String> = PAIR_UNTRACKED.iter().chain(&PAIR_TRACKED).map(|r| r.to_string()).collect();
    if res.cells.keys().any(|(r, _)| pair_rows.contains(r)) {
        o.push_str("\n### TC LB and iptables-nft in one ring (phase B: TC LB on the lab's node, kube-proxy's rules on a peer node)\n\n");
        table(&mut o, res, &pair_rows, &args.services);
        o.push('\n');
        for &n in &args.services {
            for (what, rows) in [("untracked", PAIR_UNTRACKED), ("tracked", PAIR_TRACKED)] {
                if let Some(r) = run_by_run_cells(res, (rows[0], rows[1]), n) {
                    let (m, lo, hi) = median_min_max(&r);
                    o.push_str(&format!(
                        "- TC LB {what} / iptables (nft) beside it, {} services: run by run {m:.2}x ({lo:.2}-{hi:.2}x)\n",
                        thousands(n as f64)
                    ));
                }
            }
        }
    }
    o.push_str("\n### First-reply latency of new connections (connect() to the first byte of the reply)\n\n");
    lat_table(&mut o, res, &rows, &args.services);
    if !res.streams.is_empty() {
        o.push_str(&format!("\n### One TCP stream of {} s (client to backend, through each path)\n\n", args.stream_seconds));
        o.push_str("| mode | services | Gbit/s |\n|---|---:|---:|\n");
        for r in &rows {
            if let Some((n, bps)) = res.streams.get(r) {
                o.push_str(&format!("| {r} | {} | {:.2} |\n", thousands(*n as f64), bps / 1e9));
            }
        }
    }
    if !res.ablation.is_empty() {
        let n = args.ablation_services;
        o.push_str(&format!(
            "\n### Ablation: each piece of the TC datapath taken away in turn ({} service{}, run-time statistics on)\n\n",
            thousands(n as f64),
            if n == 1 { "" } else { "s" }
        ));
        o.push_str(
            "| configuration | direct conn/s | direct p50 µs | TC LB conn/s | TC LB p50 µs | TC LB / direct (no agent) |\n|---|---:|---:|---:|---:|---:|\n",
        );
        let base = med(res, &abl_row(ABL_NONE, "direct"), n);
        for (cfg, _) in &res.ablation {
            let d = res.cells.get(&(abl_row(cfg, "direct"), n));
            let t = res.cells.get(&(abl_row(cfg, "TC LB"), n));
            let p50 = |c: Option<&Cell>| c.and_then(|c| lat_med(c, 0)).map(|x| format!("{x:.0}")).unwrap_or_else(|| "n/a".into());
            let ratio = match (t.filter(|c| !c.samples.is_empty()).map(|c| median(&c.samples)), base) {
                (Some(t), Some(b)) => format!("{:.2}x", t / b),
                _ => "n/a".into(),
            };
            o.push_str(&format!("| {cfg} | {} | {} | {} | {} | {ratio} |\n", fmt_cell(d), p50(d), fmt_cell(t), p50(t)));
        }
        o.push_str("\nWhat each program ran, per connection (`bpf_prog_info` run_cnt and run_time_ns over the measured runs):\n\n");
        o.push_str("| configuration, traffic | program | runs per connection | ns per run | ns per connection |\n|---|---|---:|---:|---:|\n");
        for (_, rows) in &res.ablation {
            for r in rows {
                let Some(c) = res.cells.get(&(r.clone(), n)) else { continue };
                for (name, (runs, ns)) in &c.progs {
                    if *runs == 0 || c.conns == 0 {
                        continue;
                    }
                    o.push_str(&format!(
                        "| {r} | {name} | {:.1} | {:.0} | {:.0} |\n",
                        *runs as f64 / c.conns as f64,
                        *ns as f64 / *runs as f64,
                        *ns as f64 / c.conns as f64
                    ));
                }
            }
        }
    }
    if !res.verified.is_empty() {
        o.push_str("\n### Verifier: instructions processed per program (`bpf_prog_info.verified_insns`)\n\n| program | instructions |\n|---|---:|\n");
        for (name, n) in &res.verified {
            o.push_str(&format!("| {name} | {} |\n", thousands(*n as f64)));
        }
    }
    if !res.packets.is_empty() {
        o.push_str(&format!(
            "\n### Per packet: each TC path on its own (`BPF_PROG_TEST_RUN` on a fresh skb, {} x {} runs per path)\n\n\
             | path | program | ns p50 | ns p90 |\n|---|---|---:|---:|\n",
            args.runs, args.count
        ));
        for (path, prog, t) in &res.packets {
            let q = |p: f64| t.get(((t.len() as f64 * p).ceil() as usize).saturating_sub(1)).map(|v| v.to_string()).unwrap_or_else(|| "n/a".into());
            o.push_str(&format!("| {path} | {prog} | {} | {} |\n", q(0.5), q(0.9)));
        }
    }
    o.push_str("\n### Controls\n\n\"direct\" measured again in each phase, interleaved with that phase's mode:\n\n");
    let mut ctl = vec![
        ROW_DIRECT.to_string(),
        CTL_DIRECT_A_CG.into(),
        CTL_DIRECT_B.into(),
        CTL_DIRECT_B_RANDOM.into(),
        CTL_DIRECT_B_ONE.into(),
        CTL_DIRECT_B_SHARED.into(),
    ];
    ctl.extend(backends.iter().map(ipt_ctl_row));
    ctl.push(ROW_NFT_CTL.into());
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
    if !res.skipped.is_empty() {
        o.push_str("\nNot measured:\n\n");
        for p in &res.skipped {
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

/// The figures the plot needs, as JSON: {"services": [...], "modes": {row: [{"services",
/// "conn_per_s", "p99_us"}, ...]}}.
fn plot_data(res: &Results, args: &Args, backends: &[IptBackend]) -> serde_json::Value {
    let rows = mode_rows(backends);
    let mut modes = serde_json::Map::new();
    for r in rows {
        let pts: Vec<serde_json::Value> = args
            .services
            .iter()
            .filter_map(|&n| {
                let c = res.cells.get(&(r.clone(), n)).filter(|c| !c.samples.is_empty())?;
                Some(serde_json::json!({"services": n, "conn_per_s": median(&c.samples), "p99_us": lat_med(c, 2)}))
            })
            .collect();
        if !pts.is_empty() {
            modes.insert(r, pts.into());
        }
    }
    serde_json::json!({"services": args.services, "modes": modes})
}

/// This process's CPU affinity (`--cpu`, or `taskset` around the bench).
fn cpus_allowed() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_owned()).unwrap_or_default()
}

fn environment(backends: &[IptBackend], agent_args: &[String]) -> Vec<(String, String)> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_owned()))
        .unwrap_or_default();
    let mut v = vec![
        ("kernel".to_string(), kernel),
        ("CPUs".into(), format!("{cpus} ({model})")),
        ("CPUs the bench and everything it starts may run on".into(), cpus_allowed()),
        ("`iptables -V` (the system default backend)".into(), cmd_output("iptables", &["-V"])),
        ("load average (1/5/15 min) at the start".into(), gardenet_tests::machine::loadavg()),
        ("fresh memory at the start".into(), gardenet_tests::machine::fresh_memory_line()),
        ("memory latency at the start".into(), gardenet_tests::machine::load_latency_line()),
        ("idle CPUs (cpuidle)".into(), gardenet_tests::machine::cpu_idle_line()),
        // SAFETY: getpriority(2) on this process.
        ("bench priority".into(), format!("nice {}", unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) })),
        (
            "agent binary".into(),
            gardenet_tests::netns::sibling_binary("gardenet-agent")
                .map(|p| format!("{} ({})", p.display(), cmd_output(&p.display().to_string(), &["--version"])))
                .unwrap_or_else(|e| format!("{e:#}")),
        ),
    ];
    if !agent_args.is_empty() {
        v.push(("extra agent arguments (socket LB and TC LB phases)".into(), agent_args.join(" ")));
    }
    for b in backends {
        v.push((format!("measured iptables-{}", b.label), cmd_output(b.cli, &["-V"])));
    }
    v
}

/// Writes the results as JSON and renders the plot next to it.
fn write_outputs(data: &serde_json::Value, out_dir: &std::path::Path, title: &str) -> Result<()> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let json = out_dir.join("dataplane.json");
    std::fs::write(&json, serde_json::to_string_pretty(data)?)?;
    let png = out_dir.join("dataplane.png");
    render_plot(data, title, &png)?;
    eprintln!("bench: results in {}, plot in {}", json.display(), png.display());
    Ok(())
}

fn render_plot(data: &serde_json::Value, title: &str, png: &std::path::Path) -> Result<()> {
    let series = gardenet_tests::plot::series_from_json(data)?;
    gardenet_tests::plot::render(&series, title, png)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(j) = &args.plot_only {
        let data: serde_json::Value = serde_json::from_slice(&std::fs::read(j).with_context(|| format!("reading {}", j.display()))?)?;
        let title = data["title"].as_str().unwrap_or("gardenet dataplane benchmark");
        let png = j.with_extension("png");
        render_plot(&data, title, &png)?;
        eprintln!("bench: plot in {}", png.display());
        return Ok(());
    }
    if args.runs == 0 || args.runs > 50 || args.count == 0 || args.count > 100_000 {
        bail!("--runs must be 1..=50 and --count 1..=100000");
    }
    if args.services.is_empty() || args.services.iter().any(|&n| n == 0 || n > MAX_SERVICES) {
        bail!("--services: counts must be 1..={MAX_SERVICES}");
    }
    interrupt::install();
    if args.nice != 0 {
        // Inherited by the lab's servers, the agent and the clients: other work on a small
        // machine then disturbs the measurement less.
        // SAFETY: setpriority(2) on this process.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, args.nice) } != 0 {
            eprintln!("bench: setpriority({}): {}", args.nice, std::io::Error::last_os_error());
        }
    }
    if let Some(cpu) = args.cpu {
        if cpu >= libc::CPU_SETSIZE as usize {
            bail!("--cpu {cpu}: no such CPU (at most {})", libc::CPU_SETSIZE - 1);
        }
        // SAFETY: a zeroed cpu_set_t with one CPU set, for this process (inherited by children).
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if rc != 0 {
            bail!("--cpu {cpu}: sched_setaffinity: {}", std::io::Error::last_os_error());
        }
    }
    let backends = ipt_backends(args.no_legacy)?;
    let env = environment(&backends, &args.agent_args);
    for (k, v) in &env {
        eprintln!("bench: {k}: {v}");
    }

    let _ = NBE_CELL.set(args.backends.clamp(1, 3));
    let t0 = Instant::now();
    let mut lab = Lab::new(nbe())?;
    lab.add_side_client()?;
    lab.add_shared_address()?;
    if args.phases.iter().any(|p| p == "tc-iptables") {
        // kube-proxy's rules of `tc_beside_iptables` run there, not beside the agent.
        lab.add_peer_node()?;
    }
    for client in lab.clients() {
        // A wide ephemeral port range in the client namespaces: tens of thousands of
        // connections per minute to one destination must not run out of ports in TIME_WAIT.
        client.sysctl("net.ipv4.ip_local_port_range", "1024 65535")?;
        // And reuse of TIME_WAIT ports for new outgoing connections: without it, runs late in
        // a phase search a nearly exhausted port space and measure that instead of the datapath.
        client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    }
    eprintln!("bench: lab {} up in {:.1} s", lab.tag, t0.elapsed().as_secs_f64());

    let mut res = Results::default();
    let run = (|| -> Result<()> {
        let on = |p: &str| args.phases.iter().any(|x| x == p);
        if on("socket") {
            phase_socket_lb(&lab, &args, &mut res)?;
        }
        if on("tc") {
            let pair = backends.iter().find(|b| b.label == "nft").filter(|_| on("tc-iptables"));
            if on("tc-iptables") && pair.is_none() {
                res.skipped.push("TC LB beside iptables-nft (phase B): no iptables-nft-restore".into());
            }
            phase_tc_lb(&lab, &args, pair, &mut res)?;
        }
        if on("iptables") {
            phase_iptables(&lab, &args, &backends, &mut res)?;
        }
        if on("nftables") {
            phase_nftables(&lab, &args, &mut res)?;
        }
        if on("ablation") {
            phase_ablation(&lab, &args, &mut res)?;
        }
        if on("packets") {
            phase_packets(&lab, &args, &mut res)?;
        }
        Ok(())
    })();
    let mut env = env;
    env.push(("load average (1/5/15 min) at the end".into(), gardenet_tests::machine::loadavg()));
    env.push(("wall time".into(), format!("{:.0} s", t0.elapsed().as_secs_f64())));
    let table = report(&res, &args, &backends, &env);
    println!("{table}");
    let mut data = plot_data(&res, &args, &backends);
    let title = format!(
        "gardenet dataplane: TCP connect + request + reply, {} backends per Service ({}, {} CPUs)",
        nbe(),
        env.iter().find(|(k, _)| k == "kernel").map(|(_, v)| v.as_str()).unwrap_or("?"),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    data["title"] = title.clone().into();
    if let Err(e) = write_outputs(&data, &args.out_dir, &title) {
        eprintln!("bench: WARNING: no plot: {e:#}");
    }
    drop(lab);
    run.context("benchmark aborted; the table above has what was measured")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nft_load_is_predicted_quadratic_and_never_below_the_last() {
        let s = |n, d: f64, m| predicted_load(n, Duration::from_secs_f64(d), m).map(|p| p.as_secs_f64());
        assert_eq!(s(10_000, 12.0, 30_000), Some(108.0));
        assert_eq!(s(4_000, 2.5, 8_000), Some(10.0));
        assert_eq!(s(10_000, 12.0, 1_000), Some(12.0));
        // Short loads are mostly fixed costs: no prediction from them.
        assert_eq!(s(1, 0.07, 1_000), None);
        assert_eq!(s(1_000, 0.6, 30_000), None);
    }

    #[test]
    fn the_tracked_pass_loads_a_nat_table_without_rules_and_its_removal_names_it() {
        // Built-in chains only: conntrack comes on, no packet of TC LB's walks a rule.
        assert_eq!(tables_of(NAT_TABLE_ONLY), ["nat"]);
        assert!(NAT_TABLE_ONLY.lines().all(|l| !l.starts_with("-A")), "{NAT_TABLE_ONLY}");
        let chains: Vec<&str> = NAT_TABLE_ONLY.lines().filter_map(|l| l.strip_prefix(':')?.split_whitespace().next()).collect();
        assert_eq!(chains, ["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]);
        // The peer node's rules are phase C's: one portal jump for every link.
        let _ = NBE_CELL.set(3);
        let jumps: Vec<String> = kube_ruleset(2).lines().filter(|l| l.starts_with("-A PREROUTING")).map(String::from).collect();
        assert_eq!(jumps, ["-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"]);
        assert_eq!(tables_of(&kube_ruleset(2)), ["nat"]);
    }

    #[test]
    fn direct_picks_reach_the_backends_they_name() {
        let _ = NBE_CELL.set(3);
        let m = |target| Mode { row: String::new(), in_cgroup: false, target };
        let all = format!("{b0}:{SERVER_PORT},{b1}:{SERVER_PORT},{b2}:{SERVER_PORT}", b0 = backend_ip(0), b1 = backend_ip(1), b2 = backend_ip(2));
        for (t, to, answering, flags) in [
            (Target::Direct(Pick::Turn), all.clone(), 3, &[][..]),
            (Target::DirectSide(Pick::Random), all.clone(), 3, &["--random"][..]),
            (Target::DirectSide(Pick::One), format!("{}:{SERVER_PORT}", backend_ip(0)), 1, &[][..]),
            (Target::DirectSide(Pick::Shared), format!("{SHARED_IP}:{SERVER_PORT}"), 3, &[][..]),
            (Target::Vip("198.19.0.1".into()), format!("198.19.0.1:{PORT}"), 3, &[][..]),
            (Target::VipPeer("198.19.0.1".into()), format!("198.19.0.1:{PORT}"), 3, &[][..]),
            (Target::DirectPeer, all.clone(), 3, &[][..]),
        ] {
            let m = m(t);
            assert_eq!((m.to_all(), m.answering(), m.pick_args()), (to, answering, flags));
        }
    }

    #[test]
    fn cpu_line_of_proc_stat() {
        assert_eq!(parse_cpu_line("cpu  100 5 50 800 10 3 2 7 0 0"), Some((160, 970)));
        assert_eq!(parse_cpu_line("cpu0 1 2 3 4 5 6 7"), None);
        assert_eq!(parse_cpu_line("cpu  1 2"), None);
    }

    #[test]
    fn run_by_run_ratios() {
        let r = run_by_run(&[9.0, 8.0, 10.0], &[10.0, 10.0, 10.0]).unwrap();
        assert_eq!(median_min_max(&r), (0.9, 0.8, 1.0));
        assert_eq!(run_by_run(&[1.0], &[1.0, 2.0]), None);
        assert_eq!(run_by_run(&[], &[]), None);
    }

    #[test]
    fn median_interval_from_order_statistics() {
        // n = 5: only the whole range reaches 90% (1 - 2/32 = 93.75%).
        let (lo, hi, c) = median_interval(&[0.95, 0.82, 1.10, 0.91, 0.88], 0.9).unwrap();
        assert_eq!((lo, hi), (0.82, 1.10));
        assert!((c - 0.9375).abs() < 1e-12);
        // n = 4 cannot reach 90%: 1 - 2/16.
        assert_eq!(median_interval(&[1.0, 2.0, 3.0, 4.0], 0.9), None);
        // n = 10: k = 2 covers 1 - 2 * 11/1024 = 97.9%, k = 3 1 - 2 * 56/1024 = 89.1%.
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let (lo, hi, c) = median_interval(&v, 0.9).unwrap();
        assert_eq!((lo, hi), (2.0, 9.0));
        assert!((c - (1.0 - 22.0 / 1024.0)).abs() < 1e-12);
    }
}
