//! Socket LB: translate a frontend to a backend in the socket call itself, so no packet ever
//! carries the VIP and no per-packet NAT is needed.

use aya_ebpf::{
    helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
    EbpfContext,
};
use gardenet_common::*;

use crate::{select_backend_affine, stat, GN_SK_RNAT4, GN_SVC4};

/// sock_addr programs return 1 to let the call proceed, 0 to fail it.
const ALLOW: i32 = 1;
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

#[cgroup_sock_addr(connect4)]
pub fn gn_connect4(ctx: SockAddrContext) -> i32 {
    xlate_fwd(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn gn_sendmsg4(ctx: SockAddrContext) -> i32 {
    xlate_fwd(&ctx)
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
fn xlate_fwd(ctx: &SockAddrContext) -> i32 {
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
        return ALLOW;
    };
    // Session affinity per pod: the network namespace cookie identifies the client.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some((_, be)) = select_backend_affine(&key, master, netns, AFF_CLIENT_NETNS) else {
        stat(Stat::SockNoBackend);
        // Fail fast with the error an application expects from a closed port, instead of
        // letting the SYN go to a VIP that nothing answers (a silent timeout).
        unsafe { bpf_set_retval(-ECONNREFUSED) };
        #[cfg(feature = "log")]
        aya_log_ebpf::debug!(ctx, "no backend for {:i}:{}", u32::from_be(vip), u16::from_be(vport));
        return REJECT;
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
