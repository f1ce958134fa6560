//! Socket LB: translate a frontend to a backend in the socket call itself, so no packet ever
//! carries the VIP and no per-packet NAT is needed.

use aya_ebpf::{
    bindings::bpf_sock_addr,
    helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext,
};
use gardenet_common::*;

use crate::{
    family::{Family, V4, V6},
    node_scope, select_backend_affine, service_net, stat,
};

/// sock_addr programs return 1 to let the call proceed, 0 to fail it.
const ALLOW: i32 = 1;
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;

#[cgroup_sock_addr(connect4)]
pub fn gn_connect4(ctx: SockAddrContext) -> i32 {
    fwd4::<true>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn gn_sendmsg4(ctx: SockAddrContext) -> i32 {
    fwd4::<true>(&ctx)
}

// Kernels before 5.18 have no `bpf_set_retval` (the verifier rejects the call): there the
// loader takes these twins, whose refusal reaches the caller as EPERM.
#[cgroup_sock_addr(connect4)]
pub fn gn_connect4_nr(ctx: SockAddrContext) -> i32 {
    fwd4::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn gn_sendmsg4_nr(ctx: SockAddrContext) -> i32 {
    fwd4::<false>(&ctx)
}

/// Fails the socket call of a frontend without backends (`flags`: its master's): with
/// ECONNREFUSED where the kernel lets us set the error (`RETVAL`), or EHOSTUNREACH for a
/// frontend that drops (`SVC_FLAG_DROP`: endpoints exist, none usable from here); with the
/// hook's default EPERM otherwise.
#[inline(always)]
fn refuse<const RETVAL: bool>(flags: u16) -> i32 {
    stat(Stat::SockNoBackend);
    if RETVAL {
        // The error an application expects from a closed port (or an unreachable one),
        // instead of letting the SYN go to a VIP that nothing answers (a silent timeout).
        let err = if flags & SVC_FLAG_DROP != 0 { EHOSTUNREACH } else { ECONNREFUSED };
        unsafe { bpf_set_retval(-err) };
    }
    REJECT
}

/// No frontend for the address and port: a ClusterIP on another port is refused, an
/// unallocated address of a service range unreachable (see `SVCNET_*`); anything else is
/// not ours.
#[inline(always)]
fn unknown_frontend<const RETVAL: bool>(net: u8) -> i32 {
    match net {
        SVCNET_CLUSTER_IP => refuse::<RETVAL>(SVC_FLAG_NONE),
        SVCNET_RANGE => refuse::<RETVAL>(SVC_FLAG_DROP),
        _ => ALLOW,
    }
}

#[cgroup_sock_addr(recvmsg4)]
pub fn gn_recvmsg4(ctx: SockAddrContext) -> i32 {
    rev4(&ctx);
    ALLOW // recvmsg hooks must return 1
}

#[cgroup_sock_addr(getpeername4)]
pub fn gn_getpeername4(ctx: SockAddrContext) -> i32 {
    rev4(&ctx);
    ALLOW // getpeername hooks must return 1
}

/// Where a hook finds the destination address of family `F` in its `bpf_sock_addr`.
trait Dst<F: Family> {
    fn load(sa: &bpf_sock_addr) -> F::Addr;
    fn store(sa: &mut bpf_sock_addr, a: F::Addr);
}

/// `user_ip4` (the IPv4 hooks).
struct User4;
/// `user_ip6` (the IPv6 hooks), word by word: the verifier wants 4-byte context accesses.
struct User6;
/// The IPv4 address in `user_ip6[3]`: an AF_INET6 socket dialling `::ffff:a.b.c.d`.
struct Mapped;

impl Dst<V4> for User4 {
    #[inline(always)]
    fn load(sa: &bpf_sock_addr) -> u32 {
        sa.user_ip4
    }
    #[inline(always)]
    fn store(sa: &mut bpf_sock_addr, a: u32) {
        sa.user_ip4 = a;
    }
}

impl Dst<V6> for User6 {
    #[inline(always)]
    fn load(sa: &bpf_sock_addr) -> Ip6 {
        unsafe {
            [
                core::ptr::read_volatile(&sa.user_ip6[0]),
                core::ptr::read_volatile(&sa.user_ip6[1]),
                core::ptr::read_volatile(&sa.user_ip6[2]),
                core::ptr::read_volatile(&sa.user_ip6[3]),
            ]
        }
    }
    #[inline(always)]
    fn store(sa: &mut bpf_sock_addr, a: Ip6) {
        unsafe {
            core::ptr::write_volatile(&mut sa.user_ip6[0], a[0]);
            core::ptr::write_volatile(&mut sa.user_ip6[1], a[1]);
            core::ptr::write_volatile(&mut sa.user_ip6[2], a[2]);
            core::ptr::write_volatile(&mut sa.user_ip6[3], a[3]);
        }
    }
}

impl Dst<V4> for Mapped {
    #[inline(always)]
    fn load(sa: &bpf_sock_addr) -> u32 {
        unsafe { core::ptr::read_volatile(&sa.user_ip6[3]) }
    }
    #[inline(always)]
    fn store(sa: &mut bpf_sock_addr, a: u32) {
        unsafe { core::ptr::write_volatile(&mut sa.user_ip6[3], a) };
    }
}

/// The call's protocol as the maps key it; `None` for anything but TCP and UDP.
#[inline(always)]
fn proto_of(sa: &bpf_sock_addr) -> Option<u8> {
    match sa.protocol {
        6 => Some(PROTO_TCP),
        17 => Some(PROTO_UDP),
        _ => None,
    }
}

#[inline(always)]
fn fwd4<const RETVAL: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(proto) = proto_of(sa) else { return ALLOW };
    xlate_fwd::<V4, User4, RETVAL>(ctx, sa, proto)
}

#[inline(always)]
fn fwd6<const RETVAL: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(proto) = proto_of(sa) else { return ALLOW };
    // A dual-stack (AF_INET6) socket dialling an IPv4 frontend as `::ffff:a.b.c.d`: the kernel
    // runs only the IPv6 hook for it, so translate with the IPv4 tables here. (Unconnected UDP
    // sends to mapped addresses go through sendmsg4; their replies come back through recvmsg6.)
    if is_v4_mapped(&User6::load(sa)) {
        return xlate_fwd::<V4, Mapped, RETVAL>(ctx, sa, proto);
    }
    xlate_fwd::<V6, User6, RETVAL>(ctx, sa, proto)
}

/// Translates the call's frontend (address from `D`, port) to a backend, and remembers the
/// translation for recvmsg (UDP reply source) and getpeername.
#[inline(always)]
fn xlate_fwd<F: Family, D: Dst<F>, const RETVAL: bool>(ctx: &SockAddrContext, sa: &mut bpf_sock_addr, proto: u8) -> i32 {
    let vip = D::load(sa);
    let vport = sa.user_port as u16;
    let key = ServiceKey::master(vip, vport, proto);
    let Some(master) = F::service(&key) else {
        return unknown_frontend::<RETVAL>(service_net(F::net_key(vip)));
    };
    let (key, master) = node_scope::<F>(key, master);
    // Session affinity per pod: the network namespace cookie identifies the client.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some((_, be)) = select_backend_affine::<F>(&key, master, F::netns_client(netns), AFF_CLIENT_NETNS) else {
        return refuse::<RETVAL>(master.flags);
    };
    let (addr, port) = (be.addr, be.port);
    D::store(sa, addr);
    sa.user_port = port as u32;
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    F::remember_socket(cookie, (addr, port), (vip, vport));
    stat(Stat::SockTranslated);
    ALLOW
}

#[inline(always)]
fn rev4(ctx: &SockAddrContext) {
    xlate_rev::<V4, User4>(ctx, unsafe { &mut *ctx.sock_addr });
}

#[inline(always)]
fn rev6(ctx: &SockAddrContext) {
    let sa = unsafe { &mut *ctx.sock_addr };
    if is_v4_mapped(&User6::load(sa)) {
        xlate_rev::<V4, Mapped>(ctx, sa);
    } else {
        xlate_rev::<V6, User6>(ctx, sa);
    }
}

/// A reply's source (recvmsg) or the peer (getpeername) back from the backend to the
/// frontend the socket asked for.
#[inline(always)]
fn xlate_rev<F: Family, D: Dst<F>>(ctx: &SockAddrContext, sa: &mut bpf_sock_addr) {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some((addr, port)) = F::socket_frontend(cookie, (D::load(sa), sa.user_port as u16)) {
        D::store(sa, addr);
        sa.user_port = port as u32;
        stat(Stat::SockRevNat);
    }
}

#[cgroup_sock_addr(connect6)]
pub fn gn_connect6(ctx: SockAddrContext) -> i32 {
    fwd6::<true>(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn gn_sendmsg6(ctx: SockAddrContext) -> i32 {
    fwd6::<true>(&ctx)
}

#[cgroup_sock_addr(connect6)]
pub fn gn_connect6_nr(ctx: SockAddrContext) -> i32 {
    fwd6::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn gn_sendmsg6_nr(ctx: SockAddrContext) -> i32 {
    fwd6::<false>(&ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn gn_recvmsg6(ctx: SockAddrContext) -> i32 {
    rev6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn gn_getpeername6(ctx: SockAddrContext) -> i32 {
    rev6(&ctx);
    ALLOW
}

#[inline(always)]
fn is_v4_mapped(a: &Ip6) -> bool {
    a[0] == 0 && a[1] == 0 && a[2] == V4_MAPPED_W2
}
