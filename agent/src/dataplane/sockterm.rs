//! Terminating sockets that socket LB pointed at a departed backend.
//!
//! Socket LB translates a connected socket once, at `connect()`: from then on the socket
//! talks to the backend's address itself, and no map change moves it. A resolver that keeps
//! its UDP socket (glibc, musl, NGINX) would ask a deleted CoreDNS pod forever (cilium
//! #27300), and a pooled, idle TCP connection to a deleted pod only finds out when its next
//! request times out. kube-proxy clears UDP conntrack entries of departed endpoints for the
//! same reason; the socket-level equivalent is to destroy the socket, so the application sees
//! an error and connects again (through socket LB, to a current backend), as resolvers and
//! connection pools do.
//!
//! Which sockets:
//! - **connected UDP** sockets, as soon as their backend leaves the frontend's backends;
//! - **idle TCP** sockets (established, nothing unread, nothing unacknowledged) once their
//!   backend's address is in none of the Service's EndpointSlices any more, under any
//!   condition. A terminating or not-ready endpoint is still listed: its connections drain,
//!   as with kube-proxy. A TCP socket with data queued is never cut: it ends by itself.
//!
//! How: `GN_SK_RNAT4/6` (written at `connect()`) map each translated socket's cookie to the
//! backend it talks to and the frontend it asked for. The cookies of sockets translated to a
//! departed (frontend, backend) pair are looked up in every network namespace on the node
//! (pods' sockets live in theirs: found through `/proc/<pid>/ns/net`), with sock_diag; each
//! socket of the protocol with one of those cookies and the backend as peer gets
//! `SOCK_DESTROY` (kernel `CONFIG_INET_DIAG_DESTROY`; `udp_abort`/`tcp_abort` report
//! `ECONNABORTED` to the socket's next call; TCP also sends the peer a reset).
//!
//! The kernel also has `bpf_sock_destroy` (6.5) for socket iterators, which would avoid the
//! per-namespace walk; it is a kfunc, and aya 0.14's loader does not relocate kfunc calls, so
//! every kernel takes the sock_diag path here.
use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use gardenet_common::{ip6_octets, Ip6, SockRevNatKey4, SockRevNatKey6, SockRevNatValue4, SockRevNatValue6, MAP_SOCK_REVNAT, MAP_SOCK_REVNAT6};

use crate::desired::{Backend, Frontend, Proto};

/// Why terminating sockets failed as a whole (single sockets that fail are counted instead).
#[derive(Debug, thiserror::Error)]
pub enum TerminateError {
    #[error("reading socket LB's reverse translations ({map}): {source}")]
    RevNat { map: &'static str, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("listing network namespaces in {dir}: {source}")]
    Namespaces { dir: PathBuf, source: io::Error },
}

/// What one round of termination did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Terminated {
    /// Which sockets were looked for: connected UDP or idle TCP.
    pub proto: Proto,
    /// Socket LB translations to a departed pair (sockets that may still exist).
    pub candidates: usize,
    /// Network namespaces searched.
    pub namespaces: usize,
    pub destroyed: usize,
    /// Sockets found but not destroyed (e.g. a kernel without `CONFIG_INET_DIAG_DESTROY`).
    pub failed: usize,
    /// TCP sockets to a departed backend with data queued: left to end by themselves.
    pub busy: usize,
    /// Namespaces that could not be entered or queried (e.g. the process exited meanwhile).
    pub skipped_namespaces: usize,
    /// Why the first skipped namespace was skipped.
    pub first_skip: Option<String>,
}

/// Destroys the sockets of `proto` (connected UDP, or idle TCP) that socket LB translated to
/// one of the `departed` (frontend, backend) pairs; pairs of other protocols are ignored. A
/// backend port 0 (never a real one) stands for any port of the backend's address.
/// `proc_dir` is the node's `/proc` (all its processes' network namespaces are searched).
/// Blocking: run it off the agent's event loop.
pub fn terminate(pin_dir: &Path, proc_dir: &Path, proto: Proto, departed: &[(Frontend, Backend)]) -> Result<Terminated, TerminateError> {
    let pairs: HashSet<(SocketAddr, SocketAddr)> = departed
        .iter()
        .filter(|(f, b)| f.proto == proto && f.addr.is_ipv4() == b.addr.is_ipv4())
        .map(|(f, b)| (SocketAddr::new(f.addr, f.port), SocketAddr::new(b.addr, b.port)))
        .collect();
    let mut out = Terminated { proto, candidates: 0, namespaces: 0, destroyed: 0, failed: 0, busy: 0, skipped_namespaces: 0, first_skip: None };
    if pairs.is_empty() {
        return Ok(out);
    }
    let cookies = departed_cookies(pin_dir, &pairs)?;
    out.candidates = cookies.len();
    if cookies.is_empty() {
        return Ok(out);
    }
    for ns in namespaces(proc_dir)? {
        out.namespaces += 1;
        match destroy_in(&ns, proto, &cookies) {
            Ok(c) => {
                out.destroyed += c.destroyed;
                out.failed += c.failed;
                out.busy += c.busy;
            }
            Err(e) => {
                tracing::debug!("socket termination: skipping {}: {e}", ns.display());
                out.first_skip.get_or_insert_with(|| format!("{}: {e}", ns.display()));
                out.skipped_namespaces += 1;
            }
        }
    }
    Ok(out)
}

/// Whether this kernel destroys UDP sockets through sock_diag: connects a UDP socket of our
/// own on loopback and destroys it the way [`terminate`] would.
pub fn probe() -> io::Result<()> {
    let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
    s.connect(s.local_addr()?)?;
    let cookies = HashMap::from([(cookie(&s)?, s.local_addr()?)]);
    match destroy_in(Path::new("/proc/thread-self/ns/net"), Proto::Udp, &cookies)? {
        Found { destroyed: 1, failed: 0, .. } => Ok(()),
        c => Err(io::Error::other(format!("probe socket: {} destroyed, {} failed", c.destroyed, c.failed))),
    }
}

/// The socket's cookie (`SO_COOKIE`), as socket LB's maps and sock_diag know it.
fn cookie(s: &impl AsRawFd) -> io::Result<u64> {
    let mut c = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: SO_COOKIE writes a u64 into `c`, `len` says how much room there is.
    if unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_COOKIE, (&mut c as *mut u64).cast(), &mut len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(c)
}

/// A socket LB reverse-translation entry of either family.
trait RevNatEntry: aya::Pod + Copy {
    type Value: aya::Pod + Copy;
    const MAP: &'static str;
    /// (cookie, backend, frontend).
    fn parts(&self, v: &Self::Value) -> (u64, SocketAddr, SocketAddr);
}

impl RevNatEntry for SockRevNatKey4 {
    type Value = SockRevNatValue4;
    const MAP: &'static str = MAP_SOCK_REVNAT;
    fn parts(&self, v: &SockRevNatValue4) -> (u64, SocketAddr, SocketAddr) {
        let sa = |a: u32, p: u16| SocketAddr::new(Ipv4Addr::from(u32::from_be(a)).into(), u16::from_be(p));
        (self.cookie, sa(self.addr, self.port), sa(v.addr, v.port))
    }
}

impl RevNatEntry for SockRevNatKey6 {
    type Value = SockRevNatValue6;
    const MAP: &'static str = MAP_SOCK_REVNAT6;
    fn parts(&self, v: &SockRevNatValue6) -> (u64, SocketAddr, SocketAddr) {
        let sa = |a: Ip6, p: u16| SocketAddr::new(Ipv6Addr::from(ip6_octets(a)).into(), u16::from_be(p));
        (self.cookie, sa(self.addr, self.port), sa(v.addr, v.port))
    }
}

/// Cookie -> backend of every socket LB translation to one of `pairs`.
fn departed_cookies(pin_dir: &Path, pairs: &HashSet<(SocketAddr, SocketAddr)>) -> Result<HashMap<u64, SocketAddr>, TerminateError> {
    let mut out = HashMap::new();
    if pairs.iter().any(|(f, _)| f.is_ipv4()) {
        collect::<SockRevNatKey4>(pin_dir, pairs, &mut out)?;
    }
    if pairs.iter().any(|(f, _)| f.is_ipv6()) {
        collect::<SockRevNatKey6>(pin_dir, pairs, &mut out)?;
    }
    Ok(out)
}

fn collect<K: RevNatEntry>(pin_dir: &Path, pairs: &HashSet<(SocketAddr, SocketAddr)>, out: &mut HashMap<u64, SocketAddr>) -> Result<(), TerminateError> {
    let err = |e: Box<dyn std::error::Error + Send + Sync>| TerminateError::RevNat { map: K::MAP, source: e };
    let data = MapData::from_pin(pin_dir.join(K::MAP)).map_err(|e| err(e.into()))?;
    let map: BpfHashMap<MapData, K, K::Value> = BpfHashMap::try_from(Map::LruHashMap(data)).map_err(|e| err(e.into()))?;
    // Entries of closed sockets stay until the LRU evicts them; they simply match no socket.
    for (k, v) in map.iter().flatten() {
        let (cookie, backend, frontend) = k.parts(&v);
        if pairs.contains(&(frontend, backend)) || pairs.contains(&(frontend, SocketAddr::new(backend.ip(), 0))) {
            out.insert(cookie, backend);
        }
    }
    Ok(())
}

/// One `/proc/<pid>/ns/net` per distinct network namespace (the node's own included).
fn namespaces(proc_dir: &Path) -> Result<Vec<PathBuf>, TerminateError> {
    let entries = std::fs::read_dir(proc_dir).map_err(|e| TerminateError::Namespaces { dir: proc_dir.to_owned(), source: e })?;
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for e in entries.flatten() {
        if !e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        let ns = e.path().join("ns/net");
        // Processes come and go (and kernel threads have no readable ns): skip what fails.
        if let Ok(m) = std::fs::metadata(&ns) {
            if seen.insert((m.dev(), m.ino())) {
                out.push(ns);
            }
        }
    }
    Ok(out)
}

/// What [`destroy_in`] found in one namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Found {
    destroyed: usize,
    failed: usize,
    busy: usize,
}

/// Enters the namespace `ns` on a thread of its own (setns changes only the calling thread)
/// and destroys the matching sockets of `proto` there.
fn destroy_in(ns: &Path, proto: Proto, cookies: &HashMap<u64, SocketAddr>) -> io::Result<Found> {
    let file = File::open(ns)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: plain syscall on a valid fd; affects only this (scoped, short-lived) thread.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let diag = diag::Socket::open()?;
            let mut found = Found::default();
            for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
                for sock in diag.established(proto, family)? {
                    if cookies.get(&sock.cookie) != Some(&sock.peer()) {
                        continue;
                    }
                    // Data in flight either way: the connection is in use, not stale.
                    if proto == Proto::Tcp && !sock.idle() {
                        found.busy += 1;
                        continue;
                    }
                    match diag.destroy(&sock) {
                        Ok(()) => found.destroyed += 1,
                        Err(e) => {
                            tracing::warn!("destroying {proto:?} socket {} -> {}: {e}", sock.local(), sock.peer());
                            found.failed += 1;
                        }
                    }
                }
            }
            Ok(found)
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("socket termination thread panicked")))
    })
}

/// sock_diag (`NETLINK_SOCK_DIAG`): dumps of UDP and TCP sockets and `SOCK_DESTROY`
/// (linux/inet_diag.h, linux/sock_diag.h).
mod diag {
    use super::*;

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const SOCK_DESTROY: u16 = 21;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const HDR: usize = 16;
    /// `struct inet_diag_req_v2`.
    const REQ: usize = 56;
    /// `struct inet_diag_sockid`.
    const ID: usize = 48;
    /// `TCP_ESTABLISHED`: an established TCP socket's state, and a connected UDP socket's.
    const ESTABLISHED: u32 = 1;
    /// `struct inet_diag_msg` up to `idiag_wqueue` (family, state, timer, retrans, id,
    /// expires, rqueue, wqueue).
    const QUEUES: usize = 64;

    /// A socket as sock_diag reports it: its family and `inet_diag_sockid` (kept verbatim,
    /// `SOCK_DESTROY` finds the socket by it).
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Sock {
        pub proto: Proto,
        pub family: u8,
        pub id: [u8; ID],
        pub cookie: u64,
        /// TCP: bytes received and not read by the application; UDP: the receive queue.
        pub rqueue: u32,
        /// TCP: bytes sent and not acknowledged (or not sent yet); UDP: the send queue.
        pub wqueue: u32,
    }

    impl Sock {
        fn addr(&self, at: usize, port_at: usize) -> SocketAddr {
            let port = u16::from_be_bytes([self.id[port_at], self.id[port_at + 1]]);
            let ip = if self.family == libc::AF_INET as u8 {
                IpAddr::V4(Ipv4Addr::new(self.id[at], self.id[at + 1], self.id[at + 2], self.id[at + 3]))
            } else {
                let b: [u8; 16] = self.id[at..at + 16].try_into().expect("16 bytes");
                // An IPv4 peer of an IPv6 socket (socket LB translated a v4-mapped connect).
                let v6 = Ipv6Addr::from(b);
                v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
            };
            SocketAddr::new(ip, port)
        }
        pub fn local(&self) -> SocketAddr {
            self.addr(4, 0)
        }
        pub fn peer(&self) -> SocketAddr {
            self.addr(20, 2)
        }
        /// Nothing waits in either direction.
        pub fn idle(&self) -> bool {
            self.rqueue == 0 && self.wqueue == 0
        }
    }

    /// `nlmsghdr` + `inet_diag_req_v2` for sockets of `proto` and `family`.
    pub fn request(kind: u16, flags: u16, proto: Proto, family: u8, states: u32, id: &[u8; ID]) -> Vec<u8> {
        let len = (HDR + REQ) as u32;
        let mut m = Vec::with_capacity(HDR + REQ);
        m.extend_from_slice(&len.to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&(libc::NLM_F_REQUEST as u16 | flags).to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes()); // seq
        m.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
        let protocol = match proto {
            Proto::Tcp => libc::IPPROTO_TCP,
            Proto::Udp => libc::IPPROTO_UDP,
        };
        m.extend_from_slice(&[family, protocol as u8, 0, 0]);
        m.extend_from_slice(&states.to_ne_bytes());
        m.extend_from_slice(id);
        m
    }

    /// One reply datagram: its messages, `Ok(None)` at `NLMSG_DONE`, errors as errors.
    pub fn parse(mut b: &[u8], proto: Proto, out: &mut Vec<Sock>) -> io::Result<bool> {
        while b.len() >= HDR {
            let len = u32::from_ne_bytes(b[0..4].try_into().expect("4")) as usize;
            let kind = u16::from_ne_bytes(b[4..6].try_into().expect("2"));
            if len < HDR || len > b.len() {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated netlink message"));
            }
            let body = &b[HDR..len];
            match kind {
                NLMSG_DONE => return Ok(true),
                NLMSG_ERROR => {
                    let errno = body.get(0..4).map_or(0, |e| i32::from_ne_bytes(e.try_into().expect("4")));
                    if errno != 0 {
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    // An ACK (error 0) ends a request without a dump.
                    return Ok(true);
                }
                SOCK_DIAG_BY_FAMILY if body.len() >= 4 + ID => {
                    let id: [u8; ID] = body[4..4 + ID].try_into().expect("ID bytes");
                    let cookie = u64::from(u32::from_ne_bytes(id[40..44].try_into().expect("4")))
                        | u64::from(u32::from_ne_bytes(id[44..48].try_into().expect("4"))) << 32;
                    let queue = |at: usize| body.get(at..at + 4).map_or(0, |q| u32::from_ne_bytes(q.try_into().expect("4")));
                    let (rqueue, wqueue) = if body.len() >= QUEUES { (queue(QUEUES - 8), queue(QUEUES - 4)) } else { (0, 0) };
                    out.push(Sock { proto, family: body[0], id, cookie, rqueue, wqueue });
                }
                _ => {}
            }
            b = &b[len.next_multiple_of(4).min(b.len())..];
        }
        Ok(false)
    }

    pub struct Socket(OwnedFd);

    impl Socket {
        pub fn open() -> io::Result<Self> {
            // SAFETY: socket(2) returns a new fd or -1.
            let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd is a fresh descriptor we own.
            let s = Socket(unsafe { OwnedFd::from_raw_fd(fd) });
            // A dump or an ACK that never comes must not hang the agent's blocking pool.
            let tv = libc::timeval { tv_sec: 5, tv_usec: 0 };
            // SAFETY: valid fd and option value of the right size.
            unsafe {
                libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), std::mem::size_of::<libc::timeval>() as u32)
            };
            Ok(s)
        }

        fn exchange(&self, req: &[u8], proto: Proto, out: &mut Vec<Sock>) -> io::Result<()> {
            // SAFETY: the buffer is valid for its length; the kernel's netlink address is the default.
            if unsafe { libc::send(self.0.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                // SAFETY: receives into our buffer, at most its length.
                let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                if parse(&buf[..n as usize], proto, out)? {
                    return Ok(());
                }
            }
        }

        /// The established TCP (or connected UDP) sockets of `family` in this thread's
        /// network namespace.
        pub fn established(&self, proto: Proto, family: u8) -> io::Result<Vec<Sock>> {
            let mut out = Vec::new();
            self.exchange(&request(SOCK_DIAG_BY_FAMILY, libc::NLM_F_DUMP as u16, proto, family, 1 << ESTABLISHED, &[0; ID]), proto, &mut out)?;
            Ok(out)
        }

        pub fn destroy(&self, s: &Sock) -> io::Result<()> {
            self.exchange(&request(SOCK_DESTROY, libc::NLM_F_ACK as u16, s.proto, s.family, u32::MAX, &s.id), s.proto, &mut Vec::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{net::UdpSocket, time::Duration};

    use super::*;

    #[test]
    fn parses_a_dump_message_and_stops_at_done() {
        let mut id = [0u8; 48];
        id[0..2].copy_from_slice(&5353u16.to_be_bytes());
        id[2..4].copy_from_slice(&53u16.to_be_bytes());
        id[4..8].copy_from_slice(&[10, 0, 0, 9]);
        id[20..24].copy_from_slice(&[10, 1, 0, 2]);
        id[40..44].copy_from_slice(&7u32.to_ne_bytes());
        id[44..48].copy_from_slice(&1u32.to_ne_bytes());
        let mut msg = Vec::new();
        let body_len = 72 + 8; // inet_diag_msg + one attribute we must skip
        msg.extend_from_slice(&((16 + body_len) as u32).to_ne_bytes());
        msg.extend_from_slice(&20u16.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&[libc::AF_INET as u8, 1, 0, 0]);
        msg.extend_from_slice(&id);
        msg.extend_from_slice(&[0; 4]); // expires
        msg.extend_from_slice(&5u32.to_ne_bytes()); // rqueue
        msg.extend_from_slice(&[0; 72 - 60 + 8]);
        let mut done = 20u32.to_ne_bytes().to_vec();
        done.extend_from_slice(&3u16.to_ne_bytes());
        done.extend_from_slice(&[0; 14]);
        msg.extend_from_slice(&done);
        let mut out = Vec::new();
        assert!(diag::parse(&msg, Proto::Udp, &mut out).unwrap(), "NLMSG_DONE ends the dump");
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].cookie, 7 | 1 << 32);
        assert_eq!(out[0].local(), "10.0.0.9:5353".parse().unwrap());
        assert_eq!(out[0].peer(), "10.1.0.2:53".parse().unwrap());
        assert_eq!((out[0].rqueue, out[0].wqueue, out[0].idle()), (5, 0, false));
        // Truncated input is an error, not a panic.
        assert!(diag::parse(&msg[..40], Proto::Udp, &mut Vec::new()).is_err());
    }

    #[test]
    fn an_error_reply_is_an_error() {
        let mut m = 36u32.to_ne_bytes().to_vec();
        m.extend_from_slice(&2u16.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&(-libc::EOPNOTSUPP).to_ne_bytes());
        m.extend_from_slice(&[0; 16]);
        let e = diag::parse(&m, Proto::Udp, &mut Vec::new()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
    }

    /// Needs CAP_NET_ADMIN (SOCK_DESTROY), like the namespace suites: finds this process's own
    /// connected UDP sockets by cookie and destroys only the one asked for.
    #[test]
    fn destroys_exactly_the_socket_with_the_cookie() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let (keep, kill) = (UdpSocket::bind("127.0.0.1:0").unwrap(), UdpSocket::bind("[::]:0").unwrap());
        keep.connect(to).unwrap();
        // An IPv6 socket with an IPv4 peer, as socket LB's v4-mapped translation leaves it.
        kill.connect(SocketAddr::new(Ipv4Addr::LOCALHOST.to_ipv6_mapped().into(), to.port())).unwrap();
        let cookies = HashMap::from([(cookie(&kill).unwrap(), to), (cookie(&keep).unwrap(), "127.0.0.1:1".parse().unwrap())]);
        let ns = PathBuf::from(format!("/proc/{}/ns/net", std::process::id()));
        assert_eq!(destroy_in(&ns, Proto::Udp, &cookies).unwrap(), Found { destroyed: 1, ..Found::default() }, "only the cookie whose peer matches");
        kill.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let e = kill.recv(&mut [0; 16]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNABORTED), "{e}");
        keep.send(b"x").unwrap();
        assert_eq!(server.recv(&mut [0; 16]).unwrap(), 1, "the other socket still works");
    }

    /// Needs CAP_NET_ADMIN: of two TCP connections to one peer, both socket LB's, the idle one
    /// is destroyed (its owner sees ECONNABORTED, the peer a reset) and the one with unread
    /// data is left alone.
    #[test]
    fn destroys_idle_tcp_sockets_and_leaves_busy_ones() {
        use std::io::{Read, Write};
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let idle = std::net::TcpStream::connect(to).unwrap();
        let (mut idle_peer, _) = server.accept().unwrap();
        let mut busy = std::net::TcpStream::connect(to).unwrap();
        let (mut busy_peer, _) = server.accept().unwrap();
        busy_peer.write_all(b"unread").unwrap();
        let cookies = HashMap::from([(cookie(&idle).unwrap(), to), (cookie(&busy).unwrap(), to)]);
        let ns = PathBuf::from(format!("/proc/{}/ns/net", std::process::id()));
        // The bytes reach the busy socket's receive queue over loopback at once; wait for them
        // anyway rather than race (bounded).
        for _ in 0..100 {
            let mut b = [0u8; 6];
            if busy.peek(&mut b).unwrap_or(0) == 6 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(destroy_in(&ns, Proto::Tcp, &cookies).unwrap(), Found { destroyed: 1, failed: 0, busy: 1 });
        let e = (&idle).write_all(b"PING\n").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNABORTED), "{e}");
        idle_peer.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let reset = idle_peer.read(&mut [0; 8]);
        assert!(matches!(&reset, Ok(0)) || reset.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset), "peer saw {reset:?}");
        let mut got = [0u8; 6];
        busy.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"unread");
        busy.write_all(b"x").unwrap();
        assert_eq!(busy_peer.read(&mut [0; 8]).unwrap(), 1, "the busy connection still works");
    }

    #[test]
    fn this_kernel_destroys_udp_sockets() {
        probe().unwrap();
    }

    #[test]
    fn namespaces_are_listed_once() {
        let all = namespaces(Path::new("/proc")).unwrap();
        let own = std::fs::metadata("/proc/self/ns/net").unwrap();
        let same: Vec<_> = all.iter().filter(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == own.ino() && m.dev() == own.dev())).collect();
        assert_eq!(same.len(), 1, "{same:?}");
    }
}
