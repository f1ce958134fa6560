//! Socket LB: translate a frontend to a backend in the socket call itself, so no packet ever
//! carries the VIP and no per-packet NAT is needed.

use aya_ebpf::{
    helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext,
};
use gardenet_common::*;

use crate::{node_scope4, node_scope6, select_backend_affine, select_backend_affine6, service_net, stat, GN_SK_RNAT4, GN_SK_RNAT6, GN_SVC4, GN_SVC6};

/// sock_addr programs return 1 to let the call proceed, 0 to fail it.
const ALLOW: i32 = 1;
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;

#[cgroup_sock_addr(connect4)]
pub fn gn_connect4(ctx: SockAddrContext) -> i32 {
    xlate_fwd::<true>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn gn_sendmsg4(ctx: SockAddrContext) -> i32 {
    xlate_fwd::<true>(&ctx)
}

// Kernels before 5.18 have no `bpf_set_retval` (the verifier rejects the call): there the
// loader takes these twins, whose refusal reaches the caller as EPERM.
#[cgroup_sock_addr(connect4)]
pub fn gn_connect4_nr(ctx: SockAddrContext) -> i32 {
    xlate_fwd::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn gn_sendmsg4_nr(ctx: SockAddrContext) -> i32 {
    xlate_fwd::<false>(&ctx)
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
    xlate_rev(&ctx);
    ALLOW // recvmsg hooks must return 1
}

#[cgroup_sock_addr(getpeername4)]
pub fn gn_getpeername4(ctx: SockAddrContext) -> i32 {
    xlate_rev(&ctx);
    ALLOW // getpeername hooks must return 1
}

#[inline(always)]
fn xlate_fwd<const RETVAL: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let proto = match sa.protocol {
        6 => PROTO_TCP,
        17 => PROTO_UDP,
        _ => return ALLOW,
    };
    let vip = sa.user_ip4;
    let vport = sa.user_port as u16;
    let key = ServiceKey4::master(vip, vport, proto);
    let Some(master) = (unsafe { GN_SVC4.get(&key) }) else {
        return unknown_frontend::<RETVAL>(service_net([0, 0, V4_MAPPED_W2, vip]));
    };
    let (key, master) = node_scope4(key, master);
    // Session affinity per pod: the network namespace cookie identifies the client.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some((_, be)) = select_backend_affine(&key, master, netns, AFF_CLIENT_NETNS) else {
        #[cfg(feature = "log")]
        aya_log_ebpf::debug!(ctx, "no backend for {:i}:{}", u32::from_be(vip), u16::from_be(vport));
        return refuse::<RETVAL>(master.flags);
    };
    sa.user_ip4 = be.addr;
    sa.user_port = be.port as u32;
    // Remember the translation for recvmsg (UDP reply source) and getpeername.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let rkey = SockRevNatKey4 { cookie, addr: be.addr, port: be.port, _pad: 0 };
    let rval = SockRevNatValue4 { addr: vip, port: vport, _pad: 0 };
    let _ = GN_SK_RNAT4.insert(&rkey, &rval, 0);
    stat(Stat::SockTranslated);
    ALLOW
}

#[inline(always)]
fn xlate_rev(ctx: &SockAddrContext) {
    let sa = unsafe { &mut *ctx.sock_addr };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let rkey = SockRevNatKey4 { cookie, addr: sa.user_ip4, port: sa.user_port as u16, _pad: 0 };
    if let Some(v) = unsafe { GN_SK_RNAT4.get(&rkey) } {
        sa.user_ip4 = v.addr;
        sa.user_port = v.port as u32;
        stat(Stat::SockRevNat);
    }
}

#[cgroup_sock_addr(connect6)]
pub fn gn_connect6(ctx: SockAddrContext) -> i32 {
    xlate_fwd6::<true>(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn gn_sendmsg6(ctx: SockAddrContext) -> i32 {
    xlate_fwd6::<true>(&ctx)
}

#[cgroup_sock_addr(connect6)]
pub fn gn_connect6_nr(ctx: SockAddrContext) -> i32 {
    xlate_fwd6::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn gn_sendmsg6_nr(ctx: SockAddrContext) -> i32 {
    xlate_fwd6::<false>(&ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn gn_recvmsg6(ctx: SockAddrContext) -> i32 {
    xlate_rev6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn gn_getpeername6(ctx: SockAddrContext) -> i32 {
    xlate_rev6(&ctx);
    ALLOW
}

/// `user_ip6` word by word: the verifier wants 4-byte context accesses.
#[inline(always)]
fn load_ip6(sa: &aya_ebpf::bindings::bpf_sock_addr) -> Ip6 {
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
fn store_ip6(sa: &mut aya_ebpf::bindings::bpf_sock_addr, a: &Ip6) {
    unsafe {
        core::ptr::write_volatile(&mut sa.user_ip6[0], a[0]);
        core::ptr::write_volatile(&mut sa.user_ip6[1], a[1]);
        core::ptr::write_volatile(&mut sa.user_ip6[2], a[2]);
        core::ptr::write_volatile(&mut sa.user_ip6[3], a[3]);
    }
}

#[inline(always)]
fn xlate_fwd6<const RETVAL: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let proto = match sa.protocol {
        6 => PROTO_TCP,
        17 => PROTO_UDP,
        _ => return ALLOW,
    };
    let vip = load_ip6(sa);
    let vport = sa.user_port as u16;
    if is_v4_mapped(&vip) {
        return xlate_fwd_mapped::<RETVAL>(ctx, sa, proto, vip[3], vport);
    }
    let key = ServiceKey6::master(vip, vport, proto);
    let Some(master) = (unsafe { GN_SVC6.get(&key) }) else {
        return unknown_frontend::<RETVAL>(service_net(vip));
    };
    let (key, master) = node_scope6(key, master);
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let client = [netns as u32, (netns >> 32) as u32, 0, 0];
    let Some((_, be)) = select_backend_affine6(&key, master, client, AFF_CLIENT_NETNS) else {
        return refuse::<RETVAL>(master.flags);
    };
    store_ip6(sa, &be.addr);
    sa.user_port = be.port as u32;
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let rkey = SockRevNatKey6 { cookie, addr: be.addr, port: be.port, _pad: 0, _pad2: 0 };
    let rval = SockRevNatValue6 { addr: vip, port: vport, _pad: 0 };
    let _ = GN_SK_RNAT6.insert(&rkey, &rval, 0);
    stat(Stat::SockTranslated);
    ALLOW
}

#[inline(always)]
fn is_v4_mapped(a: &Ip6) -> bool {
    a[0] == 0 && a[1] == 0 && a[2] == V4_MAPPED_W2
}

/// A dual-stack (AF_INET6) socket dialling an IPv4 frontend as `::ffff:a.b.c.d`: the kernel
/// runs only the IPv6 hook for it, so translate with the IPv4 tables here. (Unconnected UDP
/// sends to mapped addresses go through sendmsg4; their replies come back through recvmsg6.)
#[inline(always)]
fn xlate_fwd_mapped<const RETVAL: bool>(ctx: &SockAddrContext, sa: &mut aya_ebpf::bindings::bpf_sock_addr, proto: u8, vip: u32, vport: u16) -> i32 {
    let key = ServiceKey4::master(vip, vport, proto);
    let Some(master) = (unsafe { GN_SVC4.get(&key) }) else {
        return unknown_frontend::<RETVAL>(service_net([0, 0, V4_MAPPED_W2, vip]));
    };
    let (key, master) = node_scope4(key, master);
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some((_, be)) = select_backend_affine(&key, master, netns, AFF_CLIENT_NETNS) else {
        return refuse::<RETVAL>(master.flags);
    };
    unsafe { core::ptr::write_volatile(&mut sa.user_ip6[3], be.addr) };
    sa.user_port = be.port as u32;
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let rkey = SockRevNatKey4 { cookie, addr: be.addr, port: be.port, _pad: 0 };
    let rval = SockRevNatValue4 { addr: vip, port: vport, _pad: 0 };
    let _ = GN_SK_RNAT4.insert(&rkey, &rval, 0);
    stat(Stat::SockTranslated);
    ALLOW
}

#[inline(always)]
fn xlate_rev6(ctx: &SockAddrContext) {
    let sa = unsafe { &mut *ctx.sock_addr };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let addr = load_ip6(sa);
    if is_v4_mapped(&addr) {
        let rkey = SockRevNatKey4 { cookie, addr: addr[3], port: sa.user_port as u16, _pad: 0 };
        if let Some(v) = unsafe { GN_SK_RNAT4.get(&rkey) } {
            unsafe { core::ptr::write_volatile(&mut sa.user_ip6[3], v.addr) };
            sa.user_port = v.port as u32;
            stat(Stat::SockRevNat);
        }
        return;
    }
    let rkey = SockRevNatKey6 { cookie, addr, port: sa.user_port as u16, _pad: 0, _pad2: 0 };
    if let Some(v) = unsafe { GN_SK_RNAT6.get(&rkey) } {
        store_ip6(sa, &v.addr);
        sa.user_port = v.port as u32;
        stat(Stat::SockRevNat);
    }
}
