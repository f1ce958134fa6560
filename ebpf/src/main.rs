//! gardenet datapath: socket LB (cgroup sock_addr hooks) and interface LB (TC).
//!
//! All addresses and ports are kept in network byte order end to end (see `gardenet-common`).
#![no_std]
#![no_main]

mod sock;
mod tc;
mod xdp;

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use gardenet_common::*;

#[map]
static GN_SVC4: HashMap<ServiceKey4, ServiceValue4> = HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

#[map]
static GN_BE4: HashMap<u32, Backend4> = HashMap::pinned(DEFAULT_BACKENDS_MAX, 0);

#[map]
static GN_SK_RNAT4: LruHashMap<SockRevNatKey4, SockRevNatValue4> = LruHashMap::pinned(DEFAULT_SOCK_REVNAT_MAX, 0);

#[map]
static GN_CT4: LruHashMap<CtKey4, CtValue4> = LruHashMap::pinned(DEFAULT_CT_MAX, 0);

#[map]
static GN_AFF4: LruHashMap<AffinityKey4, AffinityValue4> = LruHashMap::pinned(DEFAULT_AFFINITY_MAX, 0);

#[map]
static GN_AFFMATCH4: HashMap<AffinityMatchKey4, u8> = HashMap::pinned(DEFAULT_AFFINITY_MATCH_MAX, 0);

#[map]
static GN_SVC6: HashMap<ServiceKey6, ServiceValue4> = HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

#[map]
static GN_BE6: HashMap<u32, Backend6> = HashMap::pinned(DEFAULT_BACKENDS_MAX, 0);

#[map]
static GN_SK_RNAT6: LruHashMap<SockRevNatKey6, SockRevNatValue6> = LruHashMap::pinned(DEFAULT_SOCK_REVNAT_MAX, 0);

#[map]
static GN_CT6: LruHashMap<CtKey6, CtValue6> = LruHashMap::pinned(DEFAULT_CT_MAX, 0);

#[map]
static GN_AFF6: LruHashMap<AffinityKey6, AffinityValue4> = LruHashMap::pinned(DEFAULT_AFFINITY_MAX, 0);

#[map]
static GN_AFFMATCH6: HashMap<AffinityMatchKey6, u8> = HashMap::pinned(DEFAULT_AFFINITY_MATCH_MAX, 0);

#[map]
static GN_SRCRANGE4: LpmTrie<SourceRange4, u8> = LpmTrie::pinned(DEFAULT_SOURCE_RANGES_MAX, 0);

#[map]
static GN_SRCRANGE6: LpmTrie<SourceRange6, u8> = LpmTrie::pinned(DEFAULT_SOURCE_RANGES_MAX, 0);

/// `loadBalancerSourceRanges`: whether `client` may open a flow to the frontend of `key`
/// (only asked for frontends whose master entry has `SVC_FLAG_SOURCE_RANGES`).
#[inline(always)]
fn source_allowed(key: &ServiceKey4, client: u32) -> bool {
    let data = SourceRange4 { fe_addr: key.addr, fe_port: key.port, proto: key.proto, _pad: 0, client };
    GN_SRCRANGE4.get(Key::new(SOURCE_RANGE_FE_BITS4 + 32, data)).is_some()
}

/// IPv6 twin of `source_allowed`.
#[inline(always)]
fn source_allowed6(key: &ServiceKey6, client: Ip6) -> bool {
    let data = SourceRange6 { fe_addr: key.addr, fe_port: key.port, proto: key.proto, _pad: 0, client };
    GN_SRCRANGE6.get(Key::new(SOURCE_RANGE_FE_BITS6 + 128, data)).is_some()
}

#[map]
static GN_SVCNET: LpmTrie<Ip6, u8> = LpmTrie::pinned(DEFAULT_SERVICE_NETS_MAX, 0);

/// What `GN_SVCNET` says about a destination without a frontend (`SVCNET_*`, 0: nothing).
#[inline(always)]
fn service_net(addr: Ip6) -> u8 {
    GN_SVCNET.get(Key::new(128, addr)).copied().unwrap_or(0)
}

/// The pinned maps' layout version (`LAYOUT_VERSION`), written by the agent; no program
/// reads it.
#[map]
static GN_LAYOUT: Array<u32> = Array::pinned(1, 0);

#[map]
static GN_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STATS_LEN, 0);

#[inline(always)]
fn stat(s: Stat) {
    if let Some(p) = GN_STATS.get_ptr_mut(s as u32) {
        // Per-CPU slot: no other writer, a plain increment is enough.
        unsafe { *p += 1 };
    }
}

/// The entry set socket LB uses for a frontend: the `SCOPE_THIS_NODE` set when the master
/// says there is one (external frontends of `externalTrafficPolicy: Local` Services: clients
/// on this node get the cluster-wide endpoints, as with kube-proxy), else the master's.
#[inline(always)]
fn node_scope4(key: ServiceKey4, master: &'static ServiceValue4) -> (ServiceKey4, &'static ServiceValue4) {
    if master.flags & SVC_FLAG_TWO_SCOPES != 0 {
        let k = key.with_scope(SCOPE_THIS_NODE);
        if let Some(m) = unsafe { GN_SVC4.get(&k) } {
            return (k, m);
        }
    }
    (key, master)
}

/// IPv6 twin of `node_scope4`.
#[inline(always)]
fn node_scope6(key: ServiceKey6, master: &'static ServiceValue4) -> (ServiceKey6, &'static ServiceValue4) {
    if master.flags & SVC_FLAG_TWO_SCOPES != 0 {
        let k = key.with_scope(SCOPE_THIS_NODE);
        if let Some(m) = unsafe { GN_SVC6.get(&k) } {
            return (k, m);
        }
    }
    (key, master)
}

/// Picks a backend of the frontend whose master entry is `master`, uniformly at random.
/// `None` when the frontend has no backends (the caller rejects) or the table is being
/// rewritten under us and a slot is missing (should not happen: slots are written first).
#[inline(always)]
fn select_backend(key: &ServiceKey4, master: &ServiceValue4) -> Option<(u32, Backend4)> {
    let count = master.count as u32;
    if count == 0 {
        return None;
    }
    let slot = (unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() } % count) as u16 + 1;
    let sv = unsafe { GN_SVC4.get(&key.with_slot(slot)) }?;
    let be = unsafe { GN_BE4.get(&sv.backend_id) }?;
    Some((sv.backend_id, *be))
}

/// Backend selection honouring ClientIP affinity: a client that used a backend of this
/// frontend within the timeout gets it again, as long as the backend still belongs to the
/// frontend (the match map) and exists.
#[inline(always)]
fn select_backend_affine(key: &ServiceKey4, master: &ServiceValue4, client: u64, kind: u8) -> Option<(u32, Backend4)> {
    if master.affinity_timeout == 0 {
        return select_backend(key, master);
    }
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    let akey = AffinityKey4 { client, addr: key.addr, port: key.port, proto: key.proto, kind };
    if let Some(a) = GN_AFF4.get_ptr_mut(&akey) {
        let a = unsafe { &mut *a };
        let fresh = now.wrapping_sub(a.last_used_ns) <= master.affinity_timeout as u64 * 1_000_000_000;
        let mkey = AffinityMatchKey4 { backend_id: a.backend_id, addr: key.addr, port: key.port, proto: key.proto, scope: key.scope };
        if fresh && unsafe { GN_AFFMATCH4.get(&mkey) }.is_some() {
            if let Some(be) = unsafe { GN_BE4.get(&a.backend_id) } {
                a.last_used_ns = now;
                stat(Stat::AffinityHit);
                return Some((a.backend_id, *be));
            }
        }
    }
    let (id, be) = select_backend(key, master)?;
    let _ = GN_AFF4.insert(&akey, &AffinityValue4 { backend_id: id, _pad: 0, last_used_ns: now }, 0);
    Some((id, be))
}

/// IPv6 twin of `select_backend`.
#[inline(always)]
fn select_backend6(key: &ServiceKey6, master: &ServiceValue4) -> Option<(u32, Backend6)> {
    let count = master.count as u32;
    if count == 0 {
        return None;
    }
    let slot = (unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() } % count) as u16 + 1;
    let sv = unsafe { GN_SVC6.get(&key.with_slot(slot)) }?;
    let be = unsafe { GN_BE6.get(&sv.backend_id) }?;
    Some((sv.backend_id, *be))
}

/// IPv6 twin of `select_backend_affine`.
#[inline(always)]
fn select_backend_affine6(key: &ServiceKey6, master: &ServiceValue4, client: Ip6, kind: u8) -> Option<(u32, Backend6)> {
    if master.affinity_timeout == 0 {
        return select_backend6(key, master);
    }
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    let akey = AffinityKey6 { client, addr: key.addr, port: key.port, proto: key.proto, kind };
    if let Some(a) = GN_AFF6.get_ptr_mut(&akey) {
        let a = unsafe { &mut *a };
        let fresh = now.wrapping_sub(a.last_used_ns) <= master.affinity_timeout as u64 * 1_000_000_000;
        let mkey = AffinityMatchKey6 { backend_id: a.backend_id, addr: key.addr, port: key.port, proto: key.proto, scope: key.scope };
        if fresh && unsafe { GN_AFFMATCH6.get(&mkey) }.is_some() {
            if let Some(be) = unsafe { GN_BE6.get(&a.backend_id) } {
                a.last_used_ns = now;
                stat(Stat::AffinityHit);
                return Some((a.backend_id, *be));
            }
        }
    }
    let (id, be) = select_backend6(key, master)?;
    let _ = GN_AFF6.insert(&akey, &AffinityValue4 { backend_id: id, _pad: 0, last_used_ns: now }, 0);
    Some((id, be))
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
