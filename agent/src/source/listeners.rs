//! Local-redirect listeners: for each local-redirect rule (NetworkConfig `localRedirects`,
//! `nodeLocalDNS`), which `(protocol, port)` have a socket bound to the rule's address in the
//! agent's network namespace (the node's: the agent runs with `hostNetwork`).
//!
//! The kernel's socket tables `/proc/net/{tcp,tcp6,udp,udp6}` are read every
//! [`POLL_INTERVAL`] (`--local-redirect-poll-ms`, hidden, for tests), and only while there
//! are rules. A TCP socket counts when it is in
//! `LISTEN` on the rule's address, a UDP socket when it is bound to it and not connected (a
//! connected UDP socket only hears its peer). The address must match exactly: a socket bound
//! to the wildcard (`0.0.0.0`, `::`) does not count, even though it would receive traffic to
//! the address too; node-local DNS binds its address explicitly. An IPv4 address bound
//! through an IPv6 socket (`::ffff:169.254.20.10`) counts for the IPv4 address.
//!
//! A change of a rule's set goes to the pipeline as [`SourceEvent::LocalRedirectChanged`],
//! which translates the rule's Service again.
//!
//! A listener that goes away must be noticed at once, not at the next poll: until the maps
//! change, queries go to an address where nothing answers (a DNS cache restarting). The
//! kernel announces every socket it destroys to sock_diag's `SKNLGRP_INET*_DESTROY`
//! multicast groups; the watch subscribes and reads the tables again as soon as a socket on
//! a rule's address is destroyed. New listeners are found by the poll (until then traffic
//! goes to the Service's endpoints, which is harmless).
use std::{
    collections::BTreeSet,
    io::BufRead,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
    time::Duration,
};

use tokio::sync::mpsc::WeakSender;

use crate::{desired::Proto, gardener::config::LocalRedirectRule, report::metrics::Metrics, source::SourceEvent, translate::LocalRedirect};

/// How often the socket tables are read.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// `TCP_LISTEN` in the `st` column.
const TCP_LISTEN: u8 = 0x0A;
/// `TCP_CLOSE` in the `st` column: a UDP socket that is not connected.
const UDP_UNCONNECTED: u8 = 0x07;

/// One row of a `/proc/net` socket table: the local address and port, and the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub addr: IpAddr,
    pub port: u16,
    pub state: u8,
}

/// Parses one line of `/proc/net/{tcp,tcp6,udp,udp6}`:
/// `  sl: LOCAL:PORT REMOTE:PORT ST ...`. The header and malformed lines give `None`.
///
/// Addresses are hex dumps of the kernel's `__be32` words printed as host-order integers:
/// on little-endian machines 127.0.0.1 reads `0100007F`; an IPv6 address is four such words.
/// The port is a plain hex number.
pub fn parse_line(line: &str) -> Option<Row> {
    let mut f = line.split_whitespace();
    f.next()?.strip_suffix(':')?;
    let (addr, port) = f.next()?.split_once(':')?;
    let _remote = f.next()?;
    let state = f.next()?;
    let state = u8::try_from(hex(state).filter(|_| state.len() == 2)?).ok()?;
    let port = u16::try_from(hex(port).filter(|_| port.len() == 4)?).ok()?;
    let word = |h: &str| hex(h).map(u32::to_ne_bytes);
    let addr = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 if addr.is_ascii() => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(&addr[i * 8..i * 8 + 8])?);
            }
            let v6 = Ipv6Addr::from(b);
            // An IPv4 address bound through an IPv6 socket serves that IPv4 address.
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    Some(Row { addr, port, state })
}

/// Up to 8 hex digits, nothing else (no sign, no prefix).
fn hex(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 8 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

/// Whether a socket in `state` accepts new traffic to its local address: TCP in `LISTEN`,
/// UDP unconnected.
pub fn serves(proto: Proto, state: u8) -> bool {
    match proto {
        Proto::Tcp => state == TCP_LISTEN,
        Proto::Udp => state == UDP_UNCONNECTED,
    }
}

/// The `(address, port)` of the sockets in one table's text that accept traffic
/// ([`serves`]). Malformed lines are skipped.
pub fn parse_table(text: &str, proto: Proto) -> Vec<(IpAddr, u16)> {
    text.lines().filter_map(parse_line).filter(|r| serves(proto, r.state)).map(|r| (r.addr, r.port)).collect()
}

/// A rule's listeners that appeared or went away in one poll.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// The rule with its new set.
    pub redirect: LocalRedirect,
    pub appeared: Vec<(Proto, u16)>,
    pub gone: Vec<(Proto, u16)>,
}

/// The rules and what listens on their addresses, as of the last poll.
#[derive(Clone, Debug, Default)]
pub struct ListenerWatch {
    redirects: Vec<LocalRedirect>,
}

impl ListenerWatch {
    /// Rules with nothing seen listening yet.
    pub fn new(rules: &[LocalRedirectRule]) -> Self {
        let redirects = rules.iter().map(|r| LocalRedirect { service: r.service.clone(), to: r.address, listening: BTreeSet::new() }).collect();
        Self { redirects }
    }

    /// The rules with their current sets, for the pipeline's NodeInfo.
    pub fn redirects(&self) -> &[LocalRedirect] {
        &self.redirects
    }

    pub fn is_empty(&self) -> bool {
        self.redirects.is_empty()
    }

    /// Applies a new view of the bound sockets (`(protocol, address, port)`), logs and returns
    /// the rules whose sets changed.
    pub fn update(&mut self, bound: &[(Proto, IpAddr, u16)]) -> Vec<Change> {
        let mut changes = Vec::new();
        for r in &mut self.redirects {
            let now: BTreeSet<(Proto, u16)> = bound.iter().filter(|(_, a, _)| *a == r.to).map(|(p, _, port)| (*p, *port)).collect();
            if now == r.listening {
                continue;
            }
            let appeared: Vec<(Proto, u16)> = now.difference(&r.listening).copied().collect();
            let gone: Vec<(Proto, u16)> = r.listening.difference(&now).copied().collect();
            for (what, list) in [("appeared", &appeared), ("went away", &gone)] {
                for (proto, port) in list {
                    tracing::info!("local redirect {}: listener on {} {proto}/{port} {what}", r.service, r.to);
                }
            }
            r.listening = now;
            changes.push(Change { redirect: r.clone(), appeared, gone });
        }
        changes
    }

    /// Reads the socket tables and applies them ([`ListenerWatch::update`]). Nothing is read
    /// without rules.
    pub fn poll(&mut self) -> Vec<Change> {
        if self.redirects.is_empty() {
            return Vec::new();
        }
        let mut bound = Vec::new();
        for (proto, table) in [(Proto::Tcp, "tcp"), (Proto::Tcp, "tcp6"), (Proto::Udp, "udp"), (Proto::Udp, "udp6")] {
            read_table(&format!("/proc/net/{table}"), proto, &mut bound);
        }
        self.update(&bound)
    }
}

/// Appends the serving sockets of one table. A missing table (IPv6 disabled) is empty.
///
/// The kernel lists listening TCP sockets before all others (it walks the listening hash
/// first), and generates the file as it is read: reading stops at the first TCP row that is
/// not `LISTEN`, so a node with many connections costs no more than one with few. (Kernels
/// before 4.4 listed pending connections after their listener; there listeners after the
/// first pending connection are missed.) Should the order ever differ, listeners are missed
/// and traffic keeps going to the Service's endpoints: the safe side.
fn read_table(path: &str, proto: Proto, out: &mut Vec<(Proto, IpAddr, u16)>) {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::debug!("reading {path}: {e}");
            }
            return;
        }
    };
    for line in std::io::BufReader::new(file).lines() {
        let Ok(line) = line else { break };
        let Some(row) = parse_line(&line) else { continue };
        if serves(proto, row.state) {
            out.push((proto, row.addr, row.port));
        } else if proto == Proto::Tcp {
            break;
        }
    }
}

/// Polls every `interval` ([`POLL_INTERVAL`] unless a test asks otherwise) and whenever a
/// socket on a rule's address is destroyed, and sends each change to the pipeline; also
/// keeps `gardenet_local_redirect_active` current. Ends when the pipeline's channel has no
/// sources left (or is closed). Does nothing without rules.
pub async fn run(mut watch: ListenerWatch, interval: Duration, tx: WeakSender<SourceEvent>, metrics: Arc<Metrics>) {
    if watch.is_empty() {
        return;
    }
    let addrs: Vec<IpAddr> = watch.redirects().iter().map(|r| r.to).collect();
    let mut destroyed = match destroy::Events::open() {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!("local redirect: no socket-destroy notifications ({e}); a listener that goes away is noticed within {interval:?}");
            None
        }
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut notified = false;
        match &mut destroyed {
            Some(d) => tokio::select! {
                _ = tick.tick() => {}
                r = d.wait_for(&addrs) => match r {
                    Ok(()) => notified = true,
                    Err(e) => tracing::warn!("local redirect: socket-destroy notifications: {e}"),
                }
            },
            None => {
                tick.tick().await;
            }
        }
        let changes = watch.poll();
        if notified && !changes.is_empty() {
            // Says which path noticed (the namespace suite checks that it was this one).
            tracing::info!("local redirect: noticed on a socket-destroy notification");
        }
        for c in changes {
            report(&metrics, &c);
            let Some(tx) = tx.upgrade() else { return };
            if tx.send(SourceEvent::LocalRedirectChanged(c.redirect)).await.is_err() {
                return;
            }
        }
    }
}

/// sock_diag's socket-destroy multicast groups.
mod destroy {
    use std::{
        io,
        net::IpAddr,
        os::fd::{AsRawFd, FromRawFd, OwnedFd},
    };

    use tokio::io::{unix::AsyncFd, Interest};

    /// `SKNLGRP_INET_TCP_DESTROY` .. `SKNLGRP_INET6_UDP_DESTROY` (linux/sock_diag.h).
    const GROUPS: [libc::c_int; 4] = [1, 2, 3, 4];
    /// Offsets in a notification: `nlmsghdr` (16 bytes), then `inet_diag_msg`: family (u8),
    /// state, timer, retrans, then `inet_diag_sockid`: sport, dport (be16), src (16 bytes).
    const FAMILY: usize = 16;
    const SRC: usize = 24;

    pub struct Events {
        fd: AsyncFd<OwnedFd>,
        /// Receive buffer, kept across waits (one allocation per watch, not per wake-up).
        buf: Vec<u8>,
    }

    impl Events {
        pub fn open() -> io::Result<Self> {
            // SAFETY: plain socket(2); the fd is owned right away.
            let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, libc::NETLINK_SOCK_DIAG) };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `raw` is a fresh, valid fd nobody else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // Bound before joining: the kernel sends the notifications with port id 0 and
            // skips every member whose own port id equals the sender's (`do_one_broadcast`),
            // so an unbound socket (port id 0) is a member that never receives anything.
            // `nl_pid` 0 asks the kernel to assign a port id.
            // SAFETY: an all-zero `sockaddr_nl` is valid; only the family is set.
            let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            // SAFETY: a valid fd and a `sockaddr_nl` of the size given.
            let rc = unsafe { libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_nl).cast(), size_of::<libc::sockaddr_nl>() as libc::socklen_t) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            for g in GROUPS {
                // SAFETY: a valid fd and an int option of the right size.
                let rc = unsafe {
                    libc::setsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_NETLINK,
                        libc::NETLINK_ADD_MEMBERSHIP,
                        (&g as *const libc::c_int).cast(),
                        size_of::<libc::c_int>() as libc::socklen_t,
                    )
                };
                if rc != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // SAFETY: the fd is owned by the AsyncFd and closed only when it drops.
            let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(io::Error::from)?;
            Ok(Events { fd, buf: vec![0u8; 64 * 1024] })
        }

        /// Returns once a socket bound to one of `addrs` has been destroyed. Notifications
        /// lost to a full buffer (ENOBUFS) count as one: the caller reads the tables again.
        pub async fn wait_for(&mut self, addrs: &[IpAddr]) -> io::Result<()> {
            let buf = &mut self.buf;
            loop {
                let mut guard = self.fd.readable().await?;
                loop {
                    // SAFETY: reading into a buffer we own, of the length given.
                    let n = unsafe { libc::recv(self.fd.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                    if n < 0 {
                        let e = io::Error::last_os_error();
                        match e.raw_os_error() {
                            Some(libc::EAGAIN) => {
                                guard.clear_ready();
                                break;
                            }
                            Some(libc::ENOBUFS) => return Ok(()),
                            Some(libc::EINTR) => continue,
                            _ => return Err(e),
                        }
                    }
                    if messages(&buf[..n as usize]).any(|m| source(m).is_some_and(|a| addrs.contains(&a))) {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The netlink messages in one datagram.
    fn messages(mut b: &[u8]) -> impl Iterator<Item = &[u8]> {
        std::iter::from_fn(move || {
            let len = u32::from_ne_bytes(b.get(..4)?.try_into().ok()?) as usize;
            if len < 16 || len > b.len() {
                return None;
            }
            let (m, rest) = b.split_at(len);
            // Messages are 4-byte aligned.
            b = rest.get(rest.len().min((4 - len % 4) % 4)..).unwrap_or_default();
            Some(m)
        })
    }

    /// The destroyed socket's local address.
    pub(super) fn source(m: &[u8]) -> Option<IpAddr> {
        let src: [u8; 16] = m.get(SRC..SRC + 16)?.try_into().ok()?;
        match i32::from(*m.get(FAMILY)?) {
            libc::AF_INET => Some(IpAddr::from([src[0], src[1], src[2], src[3]])),
            libc::AF_INET6 => Some(std::net::Ipv6Addr::from(src).to_canonical()),
            _ => None,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reads_the_source_of_a_destroy_notification() {
            let mut m = vec![0u8; 72];
            m[..4].copy_from_slice(&72u32.to_ne_bytes());
            m[FAMILY] = libc::AF_INET as u8;
            m[SRC..SRC + 4].copy_from_slice(&[169, 254, 20, 10]);
            let mut two = m.clone();
            two.extend_from_slice(&m);
            let got: Vec<_> = messages(&two).filter_map(source).collect();
            assert_eq!(got, ["169.254.20.10".parse::<IpAddr>().unwrap(); 2]);
            m[FAMILY] = libc::AF_INET6 as u8;
            m[SRC..SRC + 16].copy_from_slice(&"::ffff:169.254.20.10".parse::<std::net::Ipv6Addr>().unwrap().octets());
            assert_eq!(source(&m), Some("169.254.20.10".parse().unwrap()));
            assert!(messages(&m[..10]).next().is_none(), "truncated: nothing");
        }

        /// Needs CAP_NET_ADMIN (the groups), like the namespace suites: a real socket's
        /// destruction wakes the watch, and only a socket on one of the addresses asked for.
        /// (Until 2026-12-07 the netlink socket was never bound and received nothing: the
        /// watch only ever noticed through the poll.)
        #[tokio::test]
        async fn a_destroyed_socket_on_the_address_wakes_the_watch() {
            use std::time::Duration;
            // Loopback addresses no other test binds.
            let (watched, other): (IpAddr, IpAddr) = ("127.79.0.1".parse().unwrap(), "127.79.0.2".parse().unwrap());
            let mut events = Events::open().expect("sock_diag destroy groups (needs CAP_NET_ADMIN)");
            let quiet = tokio::time::timeout(Duration::from_millis(100), events.wait_for(&[watched])).await;
            assert!(quiet.is_err(), "woken with no socket destroyed: {quiet:?}");
            drop(std::net::UdpSocket::bind((other, 0)).unwrap());
            let not_ours = tokio::time::timeout(Duration::from_millis(300), events.wait_for(&[watched])).await;
            assert!(not_ours.is_err(), "woken by a socket on another address: {not_ours:?}");
            let udp: fn(IpAddr) = |a| drop(std::net::UdpSocket::bind((a, 0)).unwrap());
            let tcp: fn(IpAddr) = |a| drop(std::net::TcpListener::bind((a, 0)).unwrap());
            for bind in [udp, tcp] {
                bind(watched);
                let woken = tokio::time::timeout(Duration::from_secs(5), events.wait_for(&[watched])).await;
                assert!(matches!(woken, Ok(Ok(()))), "no destroy notification for a socket on {watched} within 5 s: {woken:?}");
            }
        }
    }
}

/// `gardenet_local_redirect_active{service,protocol,port}`: 1 while a listener is there.
pub fn report(metrics: &Metrics, c: &Change) {
    for (proto, port) in &c.appeared {
        metrics.set_local_redirect(&c.redirect.service, *proto, *port, true);
    }
    for (proto, port) in &c.gone {
        metrics.set_local_redirect(&c.redirect.service, *proto, *port, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real lines (Linux 6.1, x86_64): sockets bound to 127.0.0.1 / ::1 / ::ffff:127.0.0.1.
    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F75 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 25140 1 00000000c1790eb3 100 0 0 10 0
   1: 0100007F:81A7 0100007F:8970 06 00000000:00000000 03:000012CC 00000000     0        0 0 3 000000007d7d295a
   2: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1171 1 00000000d5851642 100 0 0 10 0
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:1F76 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 25142 1 00000000b0ff6eb5 100 0 0 10 0
   1: 00000000000000000000000001000000:1F75 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 25141 1 00000000aab6bc4f 100 0 0 10 0
";
    const UDP: &str = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
15108: 0100007F:14E9 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 25138 2 000000008e3c00ff 0
15109: 0100007F:14EA 0100007F:14E9 01 00000000:00000000 00:00000000 00000000     0        0 25139 2 00000000cf82dd4d 0
";
    const UDP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
15108: 00000000000000000000000001000000:14E9 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 25143 2 000000001fdfc031 0
";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    // The tables are in host byte order: these samples are from a little-endian machine.
    #[cfg(target_endian = "little")]
    #[test]
    fn parses_the_four_tables() {
        assert_eq!(parse_table(TCP, Proto::Tcp), [(ip("127.0.0.1"), 8053), (ip("0.0.0.0"), 2024)], "LISTEN only");
        assert_eq!(parse_table(TCP6, Proto::Tcp), [(ip("127.0.0.1"), 8054), (ip("::1"), 8053)], "v4-mapped reads as IPv4");
        assert_eq!(parse_table(UDP, Proto::Udp), [(ip("127.0.0.1"), 5353)], "unconnected only");
        assert_eq!(parse_table(UDP6, Proto::Udp), [(ip("::1"), 5353)]);
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn decodes_node_local_dns_addresses() {
        let r = parse_line("   7: 0A14FEA9:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 4711 2 0000000000000000 0").unwrap();
        assert_eq!(r, Row { addr: ip("169.254.20.10"), port: 53, state: 7 });
        let r = parse_line("   7: 000000FD000000000000000010000000:0035 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4711 1 0000000000000000 100 0 0 10 0").unwrap();
        assert_eq!(r, Row { addr: ip("fd00::10"), port: 53, state: 0x0A });
    }

    #[test]
    fn malformed_lines_are_skipped() {
        for line in [
            "",
            "  sl  local_address rem_address   st",
            "   0: 0100007F:1F75",
            "   0: 0100007F:1F75 00000000:0000",
            "   0: 0100007F 00000000:0000 0A",
            "   0: 0100007G:1F75 00000000:0000 0A",
            "   0: 0100007F:1F7 00000000:0000 0A",
            "   0: 0100007F:1F75F 00000000:0000 0A",
            "   0: 0100007F:1F75 00000000:0000 0AA",
            "   0: 0100007F:-1F7 00000000:0000 0A",
            "   0: 0100007F:+1F7 00000000:0000 0A",
            "   0: +100007F:1F75 00000000:0000 0A",
            "   0: 0100007F:1F75 00000000:0000 +A",
            "   0: 00007F:1F75 00000000:0000 0A",
            "   0: 000000000000000000000000010000:1F75 0:0 0A",
            "   0: 0000000000000000000000000100000\u{e9}:1F75 0:0 0A",
            "   0: 0000000000000000000000\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}:1F75 0:0 0A",
            "0 0100007F:1F75 00000000:0000 0A",
            "\u{e9}\u{e9}: \u{e9}\u{e9}\u{e9}\u{e9}:\u{e9}\u{e9} x x",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
        let text = format!("{TCP}garbage\n\n   9: zz:zz zz 0A\n");
        assert_eq!(parse_table(&text, Proto::Tcp).len(), 2);
    }

    #[test]
    fn a_rule_sees_exact_address_matches_and_reports_changes() {
        let rules = [LocalRedirectRule { service: "kube-system/kube-dns".into(), address: ip("169.254.20.10") }];
        let mut w = ListenerWatch::new(&rules);
        assert!(w.update(&[]).is_empty(), "nothing listens, nothing changed");
        let dns = [(Proto::Udp, ip("169.254.20.10"), 53), (Proto::Tcp, ip("169.254.20.10"), 53)];
        // Wildcard binds and other addresses do not count.
        let noise = [(Proto::Udp, ip("0.0.0.0"), 53), (Proto::Tcp, ip("::"), 53), (Proto::Udp, ip("169.254.20.11"), 53), (Proto::Tcp, ip("10.0.0.1"), 9253)];
        let c = w.update(&[&dns[..], &noise].concat());
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].appeared, [(Proto::Tcp, 53), (Proto::Udp, 53)]);
        assert!(c[0].gone.is_empty());
        assert_eq!(c[0].redirect.listening, [(Proto::Tcp, 53), (Proto::Udp, 53)].into());
        assert_eq!(w.redirects()[0], c[0].redirect);
        assert!(w.update(&dns).is_empty(), "unchanged");
        let c = w.update(&dns[..1]);
        assert_eq!((c[0].appeared.clone(), c[0].gone.clone()), (vec![], vec![(Proto::Tcp, 53)]));
        assert_eq!(c[0].redirect.listening, [(Proto::Udp, 53)].into());
    }

    #[test]
    fn each_rule_changes_on_its_own() {
        let rules = [
            LocalRedirectRule { service: "a/dns".into(), address: ip("169.254.20.10") },
            LocalRedirectRule { service: "b/otel".into(), address: ip("fd00::10") },
        ];
        let mut w = ListenerWatch::new(&rules);
        let c = w.update(&[(Proto::Tcp, ip("fd00::10"), 4317)]);
        assert_eq!(c.iter().map(|c| c.redirect.service.as_str()).collect::<Vec<_>>(), ["b/otel"]);
        assert!(w.redirects()[0].listening.is_empty());
    }

    #[test]
    fn sees_real_sockets_of_this_namespace() {
        // Loopback only; the rule check (no loopback) is the config's, not the watch's.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let rules = [LocalRedirectRule { service: "t/t".into(), address: ip("127.0.0.1") }];
        let mut w = ListenerWatch::new(&rules);
        w.poll();
        let l = &w.redirects()[0].listening;
        assert!(l.contains(&(Proto::Udp, udp.local_addr().unwrap().port())), "{l:?}");
        assert!(l.contains(&(Proto::Tcp, tcp.local_addr().unwrap().port())), "{l:?}");
        let port = tcp.local_addr().unwrap().port();
        drop(tcp);
        let c = w.poll();
        assert!(c.iter().any(|c| c.gone.contains(&(Proto::Tcp, port))), "{c:?}");
    }

    #[test]
    fn no_rules_no_reads() {
        let mut w = ListenerWatch::new(&[]);
        assert!(w.is_empty());
        assert!(w.poll().is_empty());
    }
}
