//! Test servers and clients for the namespace labs. Servers answer with their name; clients
//! print one JSON object on stdout. Every client loop is bounded in count and time.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use serde_json::json;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// TCP and UDP server on 0.0.0.0:PORT and [::]:PORT (IPv6-only sockets, best effort)
    /// answering with NAME.
    Serve {
        #[arg(long)]
        name: String,
        /// With `--addr`, 0 picks a port free for both TCP and UDP and prints `{"port": P}`
        /// once both listen (a test that chose the port itself could lose it to another).
        #[arg(long)]
        port: u16,
        /// Listen on this address only (TCP and UDP), like node-local DNS on 169.254.20.10.
        #[arg(long)]
        addr: Option<std::net::IpAddr>,
    },
    /// COUNT TCP connections (connect, one request, one reply, close); counts answers by name.
    /// With several `--to` (comma-separated), connection i goes to the (i mod n)-th, or with
    /// `--random` to one picked uniformly at random (as a load balancer picks a backend).
    Tcp {
        #[arg(long, value_delimiter = ',', required = true)]
        to: Vec<SocketAddr>,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        /// Connect from this local port (SO_REUSEADDR), e.g. to reuse a 4-tuple on purpose.
        #[arg(long)]
        bind_port: Option<u16>,
        /// Each connection to a uniformly random `--to` instead of the next in turn.
        #[arg(long)]
        random: bool,
        /// Take turns with other clients: wait for a byte on this FIFO before each block of
        /// `--block` connections (not before the first with `--turn-first`), pass one on
        /// `--turn-out` after it. Clients in a ring measure side by side within milliseconds,
        /// so a ratio of their rates is not moved by what the host does from second to second;
        /// `per_second` is then over the blocks' time only.
        #[arg(long, requires = "turn_out")]
        turn_in: Option<std::path::PathBuf>,
        #[arg(long, requires = "turn_in")]
        turn_out: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 10)]
        block: u32,
        #[arg(long)]
        turn_first: bool,
        /// Longest wait for a turn: a ring whose other client died fails instead of hanging.
        #[arg(long, default_value_t = 60_000)]
        turn_timeout_ms: u64,
    },
    /// COUNT datagrams from one unconnected UDP socket; counts answers by name and by source.
    Udp {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// A new socket (new source port, so a new conntrack flow) per datagram.
        #[arg(long)]
        fresh_socket: bool,
        /// Send from this local port (one flow across runs, as a long-lived client socket).
        #[arg(long)]
        bind_port: Option<u16>,
        /// Pause between datagrams (ms).
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        /// Also print each datagram's send time (Unix ms) and answer ("-" for none).
        #[arg(long)]
        trace: bool,
        /// One connected socket, as a resolver keeps it; after a socket error (the socket
        /// was destroyed) a new one is connected, as resolvers do. Prints `reconnects`. With
        /// `--fresh-socket`: a new connected socket per datagram, as glibc's resolver opens
        /// one per lookup (errors such as ECONNREFUSED reach it, unlike an unconnected one).
        #[arg(long)]
        connected: bool,
    },
    /// Connect, then report getpeername() and the answering backend (TCP, or connected UDP).
    Peername {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        udp: bool,
    },
    /// One connect attempt: the outcome and how long it took.
    Connect {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
        /// IP TTL / IPv6 hop limit of the packets sent.
        #[arg(long)]
        ttl: Option<u32>,
        /// IPv6: send every packet with a destination options extension header (PadN).
        #[arg(long)]
        ipv6_dstopts: bool,
        /// Once connected, send `HELLO` and report the answering backend.
        #[arg(long)]
        hello: bool,
    },
    /// Sends BYTES to a backend and receives BYTES back over one connection.
    Bulk {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        bytes: u64,
        /// Pause between chunks (ms): stretches a transfer so it spans an event (restart).
        #[arg(long, default_value_t = 0)]
        pace_ms: u64,
        /// Bytes to receive back (default: BYTES).
        #[arg(long)]
        download: Option<u64>,
    },
    /// One TCP stream of SECONDS (client to server); prints the throughput.
    Stream {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
    /// One HTTP GET; prints the status code and body.
    HttpGet {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value = "/")]
        path: String,
    },
    /// Restart-soak load until a line (or EOF) on stdin, or MAX_SECONDS: new connections one
    /// after another (connect, one request, one reply, close), and STREAMS long connections
    /// that move CHUNK bytes each way per round, each round checked (byte counts, and the
    /// same backend throughout). Prints `{"up": ...}` once every stream has completed a round,
    /// then, at the end, the figures: attempts, failures (with their times), successes per 100
    /// ms, and per stream its backend, bytes and whether it broke.
    Soak {
        #[arg(long)]
        to: SocketAddr,
        /// Source address of every connection (default: the route's).
        #[arg(long)]
        from: Option<std::net::IpAddr>,
        #[arg(long, default_value_t = 2)]
        streams: u32,
        #[arg(long, default_value_t = 32 * 1024)]
        chunk: u64,
        /// Pause between a stream's rounds (ms).
        #[arg(long, default_value_t = 20)]
        pace_ms: u64,
        /// Pause between new connections (ms).
        #[arg(long, default_value_t = 5)]
        interval_ms: u64,
        /// Limit for each new connection (connect and answer), and the streams' I/O limit x10.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        #[arg(long, default_value_t = 300)]
        max_seconds: u64,
    },
    /// Opens CONNS connections, prints their backends, waits for a line on stdin, then checks
    /// that each connection still works and prints the result (`after`: the backend that
    /// answered, or ""; `errors`: the first error of each, or "").
    Hold {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        conns: u32,
        /// Every N-th connection (the 2nd, 4th, ... for 2) is kept busy: it asks for 1,000
        /// bytes and leaves them unread until the check, so its receive queue is not empty.
        #[arg(long)]
        busy_every: Option<u32>,
        /// Half-close every connection: shut down its writing side at once and expect the
        /// server's answer only this many milliseconds later (the check reads it).
        #[arg(long)]
        half_close_ms: Option<u64>,
        /// Bind connection i to local port BASE+i instead of an ephemeral one, so two holds
        /// from one address (one through socket LB, one through TC LB) never share a port.
        #[arg(long)]
        bind_port_base: Option<u16>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve { name, port, addr: Some(addr) } => serve_on(&name, addr, port),
        Cmd::Serve { port: 0, addr: None, .. } => bail!("--port 0 needs --addr (one port for one address)"),
        Cmd::Serve { name, port, addr: None } => serve(&name, port),
        Cmd::Tcp { to, count, timeout_ms, bind_port, random, turn_in, turn_out, block, turn_first, turn_timeout_ms } => {
            let turns = match (turn_in, turn_out) {
                (Some(i), Some(o)) => Some(Turns::open(&i, &o, block.max(1), turn_first, turn_timeout_ms.min(600_000) as i32)?),
                _ => None,
            };
            tcp(to, count.min(100_000), Duration::from_millis(timeout_ms), bind_port, random, turns)
        }
        Cmd::Udp { to, count, timeout_ms, fresh_socket, bind_port, interval_ms, trace, connected } => {
            let mode = if fresh_socket && connected {
                UdpMode::FreshConnected
            } else if fresh_socket {
                UdpMode::Fresh
            } else if connected {
                UdpMode::Connected
            } else {
                UdpMode::One
            };
            udp(to, count.min(100_000), Duration::from_millis(timeout_ms), mode, bind_port, Duration::from_millis(interval_ms.min(10_000)), trace)
        }
        Cmd::Peername { to, udp } => peername(to, udp),
        Cmd::Connect { to, timeout_ms, ttl, ipv6_dstopts, hello } => connect(to, Duration::from_millis(timeout_ms), ttl, ipv6_dstopts, hello),
        Cmd::Bulk { to, bytes, pace_ms, download } => bulk(to, bytes.min(1 << 30), pace_ms, download.unwrap_or(bytes).min(1 << 30)),
        Cmd::Hold { to, conns, busy_every, half_close_ms, bind_port_base } => {
            let opts = HoldOpts { busy_every: busy_every.filter(|n| *n > 0), half_close_ms: half_close_ms.map(|ms| ms.min(60_000)), bind_port_base };
            hold(to, conns.min(1000), opts)
        }
        Cmd::HttpGet { to, path } => http_get(to, &path),
        Cmd::Stream { to, seconds } => stream(to, seconds.clamp(0.1, 60.0)),
        Cmd::Soak { to, from, streams, chunk, pace_ms, interval_ms, timeout_ms, max_seconds } => soak(
            to,
            SoakOpts {
                from,
                streams: streams.min(64),
                chunk: chunk.clamp(1, 16 << 20),
                pace: Duration::from_millis(pace_ms.min(10_000)),
                interval: Duration::from_millis(interval_ms.min(10_000)),
                timeout: Duration::from_millis(timeout_ms.clamp(1, 60_000)),
                max: Duration::from_secs(max_seconds.min(24 * 3600)),
            },
        ),
    }
}

/// Binds an IPv6-only socket on [::]:port (so it does not collide with the IPv4 one).
fn bind_v6only(ty: libc::c_int, port: u16) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a fresh fd we own; the sockaddr is fully initialised.
    unsafe {
        let fd = libc::socket(libc::AF_INET6, ty | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let one: libc::c_int = 1;
        let sz = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        libc::setsockopt(raw, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &one as *const _ as *const libc::c_void, sz);
        libc::setsockopt(raw, libc::SOL_SOCKET, libc::SO_REUSEADDR, &one as *const _ as *const libc::c_void, sz);
        let mut sa: libc::sockaddr_in6 = std::mem::zeroed();
        sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        sa.sin6_port = port.to_be();
        if libc::bind(raw, &sa as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if ty == libc::SOCK_STREAM && libc::listen(raw, 1024) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(fd)
    }
}

fn serve_udp(udp: UdpSocket, name: String) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((_, peer)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(name.as_bytes(), peer);
        }
    });
}

/// Serves TCP on `l` until the process ends: a pool of threads that each accept a connection
/// and serve it themselves. Creating a thread per connection cost more than the datapaths
/// the benches compare; an acceptor that takes the last idle place starts another one, so
/// connections held open never keep new ones waiting.
fn serve_tcp(l: TcpListener, name: String) {
    let pool = Arc::new(Acceptors { listener: l, name, idle: AtomicUsize::new(0) });
    accept_loop(&pool, true);
}

struct Acceptors {
    listener: TcpListener,
    name: String,
    idle: AtomicUsize,
}

/// Idle acceptors beyond which one that finishes a connection ends.
const MAX_IDLE_ACCEPTORS: usize = 8;

/// One acceptor; the first (`permanent`, the caller's thread) never ends, so `serve_tcp`
/// returns only with the process.
fn accept_loop(pool: &Arc<Acceptors>, permanent: bool) {
    loop {
        pool.idle.fetch_add(1, Ordering::SeqCst);
        let accepted = pool.listener.accept();
        if pool.idle.fetch_sub(1, Ordering::SeqCst) == 1 {
            let next = Arc::clone(pool);
            std::thread::spawn(move || accept_loop(&next, false));
        }
        if let Ok((s, _)) = accepted {
            let _ = handle(s, &pool.name);
        }
        // Only a thread that is not waiting in accept() ends, so some always wait there.
        if !permanent && pool.idle.load(Ordering::SeqCst) >= MAX_IDLE_ACCEPTORS {
            return;
        }
    }
}

/// `serve` on one address only.
fn serve_on(name: &str, addr: std::net::IpAddr, port: u16) -> Result<()> {
    let (tcp, udp) = match port {
        0 => {
            let (tcp, udp) = bind_free_port(addr)?;
            println!("{}", json!({ "port": tcp.local_addr()?.port() }));
            std::io::Write::flush(&mut std::io::stdout())?;
            (tcp, udp)
        }
        _ => (TcpListener::bind((addr, port))?, UdpSocket::bind((addr, port))?),
    };
    serve_udp(udp, name.to_owned());
    serve_tcp(tcp, name.to_owned());
    Ok(())
}

/// A TCP listener on a port the kernel picks and a UDP socket on the same port; the UDP
/// port may be taken, so a few tries.
fn bind_free_port(addr: std::net::IpAddr) -> Result<(TcpListener, UdpSocket)> {
    let mut last = None;
    for _ in 0..16 {
        let tcp = TcpListener::bind((addr, 0))?;
        match UdpSocket::bind((addr, tcp.local_addr()?.port())) {
            Ok(udp) => return Ok((tcp, udp)),
            Err(e) => last = Some(e),
        }
    }
    bail!("no port on {addr} free for both TCP and UDP in 16 tries: {last:?}")
}

fn serve(name: &str, port: u16) -> Result<()> {
    match (bind_v6only(libc::SOCK_DGRAM, port), bind_v6only(libc::SOCK_STREAM, port)) {
        (Ok(u), Ok(t)) => {
            serve_udp(UdpSocket::from(u), name.to_owned());
            let (l, n) = (TcpListener::from(t), name.to_owned());
            std::thread::spawn(move || serve_tcp(l, n));
        }
        (u, t) => eprintln!("netkit: no IPv6 server on port {port}: udp {:?}, tcp {:?}", u.err(), t.err()),
    }
    serve_udp(UdpSocket::bind(("0.0.0.0", port))?, name.to_owned());
    serve_tcp(TcpListener::bind(("0.0.0.0", port))?, name.to_owned());
    Ok(())
}

/// Line protocol: `HELLO` -> name; `SINK n` -> reads n bytes, answers `name n`;
/// `SOURCE n` -> answers `name` then n bytes; `PING` -> name (repeatable); `WHO` -> `name
/// peer` (the client address as this server sees it).
fn handle(s: TcpStream, name: &str) -> Result<()> {
    let peer = s.peer_addr()?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut w = s;
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next().and_then(|n| n.parse::<u64>().ok())) {
            (Some("SINK"), Some(n)) => {
                let got = std::io::copy(&mut (&mut r).take(n), &mut std::io::sink())?;
                writeln!(w, "{name} {got}")?;
            }
            (Some("SOURCE"), Some(n)) => {
                writeln!(w, "{name}")?;
                let chunk = vec![0x5au8; 64 * 1024];
                let mut left = n;
                while left > 0 {
                    let k = left.min(chunk.len() as u64) as usize;
                    w.write_all(&chunk[..k])?;
                    left -= k as u64;
                }
            }
            (Some("WHO"), _) => writeln!(w, "{name} {peer}")?,
            (Some("LATER"), Some(ms)) => {
                // Half-closed from the client's side: it shuts its writing down now, and
                // this end answers once more `ms` after the request, then closes.
                let due = std::time::Instant::now() + Duration::from_millis(ms.min(60_000));
                writeln!(w, "{name}")?;
                while r.read_line(&mut line)? > 0 {}
                std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
                writeln!(w, "{name}")?;
                return Ok(());
            }
            _ => writeln!(w, "{name}")?,
        }
    }
}

fn err_kind(e: &std::io::Error) -> String {
    format!("{:?}", e.kind())
}

/// Connects from local address `from` (any when `None`) and port `bind_port` (SO_REUSEADDR;
/// without one the kernel picks the port at connect(), as for an unbound socket).
fn dial_from(to: SocketAddr, timeout: Duration, from: Option<std::net::IpAddr>, bind_port: Option<u16>) -> std::io::Result<TcpStream> {
    if from.is_none() && bind_port.is_none() {
        return TcpStream::connect_timeout(&to, timeout);
    }
    let s = socket2::Socket::new(socket2::Domain::for_address(to), socket2::Type::STREAM, None)?;
    match bind_port {
        Some(_) => s.set_reuse_address(true)?,
        None => {
            // IP_BIND_ADDRESS_NO_PORT: the port is chosen at connect() for the 4-tuple, so
            // sockets toward other destinations (and their TIME_WAIT) do not use ports up.
            const IP_BIND_ADDRESS_NO_PORT: libc::c_int = 24;
            let one: libc::c_int = 1;
            // SAFETY: a valid fd and an int option of the given size.
            unsafe {
                libc::setsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(&s),
                    libc::IPPROTO_IP,
                    IP_BIND_ADDRESS_NO_PORT,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }
    let ip = from.unwrap_or_else(|| any_for(to).ip());
    s.bind(&SocketAddr::new(ip, bind_port.unwrap_or(0)).into())?;
    s.connect_timeout(&to.into(), timeout)?;
    Ok(s.into())
}

fn request(to: SocketAddr, timeout: Duration, bind_port: Option<u16>) -> std::io::Result<String> {
    request_from(to, timeout, None, bind_port)
}

fn request_from(to: SocketAddr, timeout: Duration, from: Option<std::net::IpAddr>, bind_port: Option<u16>) -> std::io::Result<String> {
    let s = dial_from(to, timeout, from, bind_port)?;
    s.set_read_timeout(Some(timeout))?;
    (&s).write_all(b"HELLO\n")?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    let _ = s.shutdown(Shutdown::Both);
    if line.is_empty() {
        return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "no answer"));
    }
    Ok(line.trim().to_owned())
}

/// A place in a ring of clients taking turns (`tcp --turn-in/--turn-out`). Both FIFOs are
/// opened read-write, which never blocks and keeps each one open while any client runs, so a
/// byte passed on is kept until its reader takes it.
struct Turns {
    rx: std::fs::File,
    tx: std::fs::File,
    block: u32,
    /// Whether this client's next block needs a turn first.
    waits: bool,
    timeout_ms: i32,
}

impl Turns {
    fn open(rx: &std::path::Path, tx: &std::path::Path, block: u32, first: bool, timeout_ms: i32) -> Result<Self> {
        let open = |p: &std::path::Path| std::fs::OpenOptions::new().read(true).write(true).open(p).with_context(|| format!("opening {}", p.display()));
        Ok(Turns { rx: open(rx)?, tx: open(tx)?, block, waits: !first, timeout_ms })
    }

    fn wait(&mut self) -> Result<()> {
        if !std::mem::replace(&mut self.waits, true) {
            return Ok(());
        }
        let mut pfd = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&self.rx), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut pfd, 1, self.timeout_ms) } {
            1 => {}
            0 => bail!("no turn within {} ms (another client of the ring is gone?)", self.timeout_ms),
            _ => return Err(std::io::Error::last_os_error()).context("poll on the turn FIFO"),
        }
        let mut b = [0u8; 1];
        self.rx.read_exact(&mut b).context("reading a turn")
    }

    fn pass(&mut self) -> Result<()> {
        self.tx.write_all(b"t").context("passing the turn on")
    }
}

fn tcp(to: Vec<SocketAddr>, count: u32, timeout: Duration, bind_port: Option<u16>, random: bool, mut turns: Option<Turns>) -> Result<()> {
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    let mut errors: BTreeMap<String, u32> = BTreeMap::new();
    // Per answered connection: connect() start to the first byte of the reply, as the
    // Kubernetes blog on kube-proxy's nftables mode measures "first packet" latency.
    let mut latencies_us: Vec<f64> = Vec::with_capacity(count as usize);
    // A random pick spreads connections over the backends the way the LB's own pick does (no
    // regular pattern for caches or for TIME_WAIT reuse to favour), so a direct run compares
    // like with like.
    let mut rng = SmallRng::from_entropy();
    let block = turns.as_ref().map_or(count, |t| t.block).max(1);
    let t0 = Instant::now();
    let mut active = Duration::ZERO;
    // In a ring: each block's start and end, in ns since the epoch, to check taking turns.
    let mut blocks: Vec<[u128; 2]> = Vec::new();
    let mut i = 0;
    while i < count {
        if let Some(t) = turns.as_mut() {
            t.wait()?;
        }
        let (tb, start_ns) = (Instant::now(), unix_ns());
        for _ in 0..block.min(count - i) {
            let target = if random { to[rng.gen_range(0..to.len())] } else { to[i as usize % to.len()] };
            let t = Instant::now();
            match request(target, timeout, bind_port) {
                Ok(n) => {
                    latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
                    *counts.entry(n).or_default() += 1
                }
                Err(e) => *errors.entry(err_kind(&e)).or_default() += 1,
            }
            i += 1;
        }
        active += tb.elapsed();
        if let Some(t) = turns.as_mut() {
            blocks.push([start_ns, unix_ns()]);
            t.pass()?;
        }
    }
    let (secs, wall) = (active.as_secs_f64(), t0.elapsed().as_secs_f64());
    latencies_us.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| latencies_us.get(((latencies_us.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied();
    let latency = json!({"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": latencies_us.last()});
    let mut out = json!({"counts": counts, "errors": errors, "seconds": secs, "wall_seconds": wall, "per_second": count as f64 / secs, "latency_us": latency});
    if turns.is_some() {
        out["blocks"] = json!(blocks);
    }
    println!("{out}");
    Ok(())
}

/// One TCP stream for `seconds`: the client writes as fast as it can, the server sinks (the
/// payload crosses the ingress translation, the ACKs the reverse one); prints bytes/s.
fn stream(to: SocketAddr, seconds: f64) -> Result<()> {
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut w = s;
    writeln!(w, "SINK {}", u64::MAX / 2)?;
    let chunk = vec![0xa5u8; 256 * 1024];
    let (t0, mut sent) = (Instant::now(), 0u64);
    while t0.elapsed().as_secs_f64() < seconds {
        w.write_all(&chunk)?;
        sent += chunk.len() as u64;
    }
    w.shutdown(Shutdown::Write)?;
    // The server answers `name bytes` at end of stream: everything sent has arrived.
    let mut line = String::new();
    r.read_line(&mut line)?;
    let secs = t0.elapsed().as_secs_f64();
    let mut it = line.split_whitespace();
    let backend = it.next().unwrap_or("").to_owned();
    let got: u64 = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    if got != sent {
        bail!("sent {sent} bytes, the server got {got} ({line:?})");
    }
    println!("{}", json!({"backend": backend, "bytes": got, "seconds": secs, "bits_per_second": got as f64 * 8.0 / secs}));
    Ok(())
}

/// The wildcard address of `to`'s family, port 0 (a client socket's local address).
fn any_for(to: SocketAddr) -> SocketAddr {
    if to.is_ipv6() {
        "[::]:0".parse().unwrap()
    } else {
        "0.0.0.0:0".parse().unwrap()
    }
}

/// How `udp` uses its sockets.
#[derive(Clone, Copy, PartialEq, Eq)]
enum UdpMode {
    /// One unconnected socket (`sendto`).
    One,
    /// A new socket (new source port, so a new conntrack flow) per datagram.
    Fresh,
    /// One connected socket, replaced by a newly connected one after a socket error.
    Connected,
    /// A new connected socket per datagram.
    FreshConnected,
}

fn udp(to: SocketAddr, count: u32, timeout: Duration, mode: UdpMode, bind_port: Option<u16>, interval: Duration, trace: bool) -> Result<()> {
    let local = match bind_port {
        Some(p) => SocketAddr::new(any_for(to).ip(), p),
        None => any_for(to),
    };
    let open = |local: SocketAddr| -> std::io::Result<UdpSocket> {
        let s = UdpSocket::bind(local)?;
        s.set_read_timeout(Some(timeout))?;
        if matches!(mode, UdpMode::Connected | UdpMode::FreshConnected) {
            s.connect(to)?;
        }
        Ok(s)
    };
    let mut s = open(local)?;
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    let mut sources: BTreeMap<String, u32> = BTreeMap::new();
    let mut errors: BTreeMap<String, u32> = BTreeMap::new();
    let mut buf = [0u8; 2048];
    let mut traced: Vec<(u128, String)> = Vec::new();
    let mut reconnects = 0u32;
    for i in 0..count {
        if i > 0 && !interval.is_zero() {
            std::thread::sleep(interval);
        }
        if matches!(mode, UdpMode::Fresh | UdpMode::FreshConnected) {
            s = open(any_for(to))?;
        }
        let sent = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
        let r = match mode {
            UdpMode::Connected | UdpMode::FreshConnected => s.send(b"HELLO"),
            _ => s.send_to(b"HELLO", to),
        };
        let r = r.and_then(|_| s.recv_from(&mut buf));
        match r {
            Ok((n, from)) => {
                let name = String::from_utf8_lossy(&buf[..n]).into_owned();
                *counts.entry(name.clone()).or_default() += 1;
                *sources.entry(from.to_string()).or_default() += 1;
                traced.push((sent, name));
            }
            Err(e) => {
                let timed_out = matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
                *errors.entry(err_kind(&e)).or_default() += 1;
                traced.push((sent, "-".into()));
                if mode == UdpMode::Connected && !timed_out {
                    s = open(any_for(to))?;
                    reconnects += 1;
                }
            }
        }
    }
    let mut out = json!({"counts": counts, "sources": sources, "errors": errors});
    if trace {
        out["trace"] = json!(traced);
    }
    if mode == UdpMode::Connected {
        out["reconnects"] = json!(reconnects);
    }
    println!("{out}");
    Ok(())
}

fn peername(to: SocketAddr, udp: bool) -> Result<()> {
    let (peer, name) = if udp {
        let s = UdpSocket::bind(any_for(to))?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.send(b"HELLO")?;
        let mut buf = [0u8; 2048];
        let n = s.recv(&mut buf)?;
        (s.peer_addr()?, String::from_utf8_lossy(&buf[..n]).into_owned())
    } else {
        let s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        (&s).write_all(b"WHO\n")?;
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line)?;
        (s.peer_addr()?, line.trim().to_owned())
    };
    // TCP answers "name client-as-seen-by-the-server".
    let (name, seen_as) = name.split_once(' ').map_or((name.as_str(), None), |(n, a)| (n, Some(a)));
    println!("{}", json!({"peer": peer.to_string(), "name": name, "seen_as": seen_as}));
    Ok(())
}

fn connect(to: SocketAddr, timeout: Duration, ttl: Option<u32>, ipv6_dstopts: bool, hello: bool) -> Result<()> {
    let s = socket2::Socket::new(socket2::Domain::for_address(to), socket2::Type::STREAM, None)?;
    if let Some(t) = ttl {
        if to.is_ipv4() {
            s.set_ttl_v4(t)?;
        } else {
            s.set_unicast_hops_v6(t)?;
        }
    }
    if ipv6_dstopts {
        // Next header (filled in by the kernel), length 0 (8 octets), PadN with 4 octets.
        let opts: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
        const IPV6_DSTOPTS: libc::c_int = 59;
        // SAFETY: a valid fd and a buffer of the given length.
        let rc = unsafe {
            libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(&s), libc::IPPROTO_IPV6, IPV6_DSTOPTS, opts.as_ptr().cast(), opts.len() as libc::socklen_t)
        };
        if rc != 0 {
            bail!("IPV6_DSTOPTS: {}", std::io::Error::last_os_error());
        }
    }
    let t0 = Instant::now();
    let r = s.connect_timeout(&to.into(), timeout);
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let outcome = match &r {
        Ok(_) => "Connected".to_string(),
        Err(e) => err_kind(e),
    };
    let mut backend = None;
    if hello && r.is_ok() {
        let s: TcpStream = s.into();
        s.set_read_timeout(Some(timeout))?;
        (&s).write_all(b"HELLO\n")?;
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line)?;
        backend = Some(line.trim().to_owned());
    }
    println!("{}", json!({"outcome": outcome, "elapsed_ms": ms, "error": r.err().map(|e| e.to_string()), "backend": backend}));
    Ok(())
}

fn bulk(to: SocketAddr, bytes: u64, pace_ms: u64, download: u64) -> Result<()> {
    let t0 = Instant::now();
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut w = s;
    // Upload: every packet crosses the ingress DNAT.
    writeln!(w, "SINK {bytes}")?;
    let chunk = vec![0xa5u8; 64 * 1024];
    let mut left = bytes;
    while left > 0 {
        let k = left.min(chunk.len() as u64) as usize;
        w.write_all(&chunk[..k])?;
        left -= k as u64;
        if pace_ms > 0 {
            std::thread::sleep(Duration::from_millis(pace_ms));
        }
    }
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut it = line.split_whitespace();
    let up_name = it.next().unwrap_or("").to_owned();
    let up_got: u64 = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    // Download on the same connection: every reply packet crosses the reverse NAT.
    writeln!(w, "SOURCE {download}")?;
    line.clear();
    r.read_line(&mut line)?;
    let down_name = line.trim().to_owned();
    let down_got = std::io::copy(&mut (&mut r).take(download), &mut std::io::sink())?;
    if up_name.is_empty() {
        bail!("no answer to SINK");
    }
    println!(
        "{}",
        json!({"upload_backend": up_name, "uploaded": up_got, "download_backend": down_name, "downloaded": down_got,
               "seconds": t0.elapsed().as_secs_f64()})
    );
    Ok(())
}

struct HoldOpts {
    busy_every: Option<u32>,
    half_close_ms: Option<u64>,
    bind_port_base: Option<u16>,
}

fn hold(to: SocketAddr, conns: u32, opts: HoldOpts) -> Result<()> {
    const UNREAD: usize = 1000;
    let HoldOpts { busy_every, half_close_ms, bind_port_base } = opts;
    let mut socks = Vec::new();
    let mut names = Vec::new();
    let mut busy = Vec::new();
    for i in 0..conns {
        let port = bind_port_base.map(|b| u16::try_from(u32::from(b) + i).context("--bind-port-base + --conns is above 65535")).transpose()?;
        let s = dial_from(to, Duration::from_secs(2), None, port).context("connect")?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        (&s).write_all(b"PING\n")?;
        let mut r = BufReader::new(s.try_clone()?);
        let mut line = String::new();
        r.read_line(&mut line)?;
        names.push(line.trim().to_owned());
        let b = busy_every.is_some_and(|n| (i + 1) % n == 0);
        if b {
            (&s).write_all(format!("SOURCE {UNREAD}\n").as_bytes())?;
        }
        if let Some(ms) = half_close_ms {
            (&s).write_all(format!("LATER {ms}\n").as_bytes())?;
            line.clear();
            r.read_line(&mut line)?;
            s.shutdown(Shutdown::Write)?;
            s.set_read_timeout(Some(Duration::from_millis(ms + 5_000)))?;
        }
        busy.push(b);
        socks.push((s, r));
    }
    println!("{}", json!({"names": names, "busy": busy}));
    std::io::stdout().flush()?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    let mut after = Vec::new();
    let mut errors = Vec::new();
    for ((s, r), b) in socks.iter_mut().zip(&busy) {
        let mut line = String::new();
        let mut check = || -> std::io::Result<()> {
            if *b {
                // The answer to SOURCE, read only now.
                r.read_line(&mut line)?;
                let mut rest = [0u8; UNREAD];
                r.read_exact(&mut rest)?;
                line.clear();
            }
            if half_close_ms.is_none() {
                (&*s).write_all(b"PING\n")?;
            }
            r.read_line(&mut line)?;
            Ok(())
        };
        let res = check();
        errors.push(res.as_ref().err().map(err_kind).unwrap_or_default());
        after.push(if res.is_ok() && !line.trim().is_empty() { line.trim().to_owned() } else { String::new() });
    }
    println!("{}", json!({"names": names, "busy": busy, "after": after, "errors": errors}));
    Ok(())
}

fn http_get(to: SocketAddr, path: &str) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status: u16 = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    println!("{}", json!({"status": status, "body": body}));
    Ok(())
}

struct SoakOpts {
    from: Option<std::net::IpAddr>,
    streams: u32,
    chunk: u64,
    pace: Duration,
    interval: Duration,
    timeout: Duration,
    max: Duration,
}

/// One long connection of `soak`.
#[derive(Default)]
struct StreamReport {
    backend: String,
    rounds: u64,
    up: u64,
    down: u64,
    max_round_ms: f64,
    error: Option<String>,
}

fn unix_ns() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos()
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis()
}

/// A long connection: rounds of `SINK chunk` (the server reports what it got) and `SOURCE
/// chunk` (every byte read back) until `stop`. Any I/O error, short count or change of
/// backend ends it as broken.
struct SoakStream {
    r: BufReader<TcpStream>,
    w: TcpStream,
    rep: StreamReport,
}

impl SoakStream {
    fn open(to: SocketAddr, o: &SoakOpts) -> Result<Self> {
        let s = dial_from(to, o.timeout, o.from, None)?;
        // Far longer than any round should take: a stall this long is a broken transfer.
        s.set_read_timeout(Some(o.timeout * 10))?;
        s.set_write_timeout(Some(o.timeout * 10))?;
        let mut st = SoakStream { r: BufReader::new(s.try_clone()?), w: s, rep: StreamReport::default() };
        st.round(o.chunk)?;
        Ok(st)
    }

    fn round(&mut self, n: u64) -> Result<()> {
        let t = Instant::now();
        writeln!(self.w, "SINK {n}")?;
        let chunk = vec![0x3cu8; n.min(64 * 1024) as usize];
        let mut left = n;
        while left > 0 {
            let k = left.min(chunk.len() as u64) as usize;
            self.w.write_all(&chunk[..k])?;
            left -= k as u64;
        }
        let mut line = String::new();
        self.r.read_line(&mut line)?;
        let mut it = line.split_whitespace();
        let (name, got) = (it.next().unwrap_or("").to_owned(), it.next().and_then(|n| n.parse::<u64>().ok()));
        if got != Some(n) {
            bail!("sent {n} bytes, the server answered {line:?}");
        }
        self.check_backend(&name)?;
        self.rep.up += n;
        writeln!(self.w, "SOURCE {n}")?;
        line.clear();
        self.r.read_line(&mut line)?;
        self.check_backend(line.trim())?;
        let down = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())?;
        self.rep.down += down;
        if down != n {
            bail!("asked for {n} bytes, got {down}");
        }
        self.rep.rounds += 1;
        self.rep.max_round_ms = self.rep.max_round_ms.max(t.elapsed().as_secs_f64() * 1000.0);
        Ok(())
    }

    fn check_backend(&mut self, name: &str) -> Result<()> {
        if self.rep.backend.is_empty() {
            self.rep.backend = name.to_owned();
        } else if self.rep.backend != name {
            bail!("the stream's backend changed from {} to {name:?}", self.rep.backend);
        }
        Ok(())
    }

    fn run(mut self, chunk: u64, pace: Duration, stop: &std::sync::atomic::AtomicBool) -> StreamReport {
        use std::sync::atomic::Ordering;
        while !stop.load(Ordering::Relaxed) {
            if let Err(e) = self.round(chunk) {
                self.rep.error = Some(format!("{e:#} at unix ms {}", unix_ms()));
                return self.rep;
            }
            std::thread::sleep(pace);
        }
        let _ = self.w.shutdown(Shutdown::Both);
        self.rep
    }
}

fn soak(to: SocketAddr, o: SoakOpts) -> Result<()> {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = Vec::new();
    for i in 0..o.streams {
        streams.push(SoakStream::open(to, &o).with_context(|| format!("opening stream {i} to {to}"))?);
    }
    println!("{}", json!({"up": streams.len(), "backends": streams.iter().map(|s| s.rep.backend.clone()).collect::<Vec<_>>()}));
    std::io::stdout().flush()?;
    let handles: Vec<_> = streams
        .into_iter()
        .map(|s| {
            let stop = stop.clone();
            let (chunk, pace) = (o.chunk, o.pace);
            std::thread::spawn(move || s.run(chunk, pace, &stop))
        })
        .collect();
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            stop.store(true, Ordering::Relaxed);
        });
    }
    let start_ms = unix_ms();
    let (mut attempted, mut failed, mut max_ms) = (0u64, 0u64, 0f64);
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut failures: Vec<u128> = Vec::new();
    // Successful new connections per 100 ms since `start_ms` (when they were started).
    let mut per_100ms: Vec<u32> = Vec::new();
    while !stop.load(Ordering::Relaxed) && t0.elapsed() < o.max {
        let (t, at) = (Instant::now(), unix_ms());
        attempted += 1;
        match request_from(to, o.timeout, o.from, None) {
            Ok(name) => {
                max_ms = max_ms.max(t.elapsed().as_secs_f64() * 1000.0);
                *counts.entry(name).or_default() += 1;
                let b = ((at - start_ms) / 100) as usize;
                if per_100ms.len() <= b {
                    per_100ms.resize(b + 1, 0);
                }
                per_100ms[b] += 1;
            }
            Err(e) => {
                failed += 1;
                *errors.entry(err_kind(&e)).or_default() += 1;
                if failures.len() < 100 {
                    failures.push(at);
                }
            }
        }
        std::thread::sleep(o.interval);
    }
    stop.store(true, Ordering::Relaxed);
    let reports: Vec<StreamReport> =
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| StreamReport { error: Some("panicked".into()), ..Default::default() })).collect();
    let streams: Vec<serde_json::Value> = reports
        .iter()
        .map(|r| json!({"backend": r.backend, "rounds": r.rounds, "up": r.up, "down": r.down, "max_round_ms": r.max_round_ms, "broken": r.error.is_some(), "error": r.error}))
        .collect();
    println!(
        "{}",
        json!({"conns": {"attempted": attempted, "failed": failed, "errors": errors, "counts": counts, "max_ms": max_ms, "failures_unix_ms": failures,
                         "start_unix_ms": start_ms, "ok_per_100ms": per_100ms},
               "streams": streams, "seconds": t0.elapsed().as_secs_f64()})
    );
    Ok(())
}
