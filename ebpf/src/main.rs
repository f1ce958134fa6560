//! gardenet datapath: socket LB (cgroup sock_addr hooks) and interface LB (TC).
//!
//! All addresses and ports are kept in network byte order end to end (see `gardenet-common`).
#![no_std]
#![no_main]

mod family;
mod headers;
mod sock;
mod tc;
mod xdp;

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use family::Family;
use gardenet_common::*;

#[map]
static GN_SVC4: HashMap<ServiceKey4, ServiceValue> = HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

#[map]
static GN_BE4: HashMap<u32, Backend4> = HashMap::pinned(DEFAULT_BACKENDS_MAX, 0);

#[map]
static GN_SK_RNAT4: LruHashMap<SockRevNatKey4, SockRevNatValue4> = LruHashMap::pinned(DEFAULT_SOCK_REVNAT_MAX, 0);

#[map]
static GN_CT4: LruHashMap<CtKey4, CtValue4> = LruHashMap::pinned(DEFAULT_CT_MAX, 0);

#[map]
static GN_AFF4: LruHashMap<AffinityKey4, AffinityValue> = LruHashMap::pinned(DEFAULT_AFFINITY_MAX, 0);

#[map]
static GN_AFFMATCH4: HashMap<AffinityMatchKey4, u8> = HashMap::pinned(DEFAULT_AFFINITY_MATCH_MAX, 0);

#[map]
static GN_SVC6: HashMap<ServiceKey6, ServiceValue> = HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

#[map]
static GN_BE6: HashMap<u32, Backend6> = HashMap::pinned(DEFAULT_BACKENDS_MAX, 0);

#[map]
static GN_SK_RNAT6: LruHashMap<SockRevNatKey6, SockRevNatValue6> = LruHashMap::pinned(DEFAULT_SOCK_REVNAT_MAX, 0);

#[map]
static GN_CT6: LruHashMap<CtKey6, CtValue6> = LruHashMap::pinned(DEFAULT_CT_MAX, 0);

#[map]
static GN_AFF6: LruHashMap<AffinityKey6, AffinityValue> = LruHashMap::pinned(DEFAULT_AFFINITY_MAX, 0);

#[map]
static GN_AFFMATCH6: HashMap<AffinityMatchKey6, u8> = HashMap::pinned(DEFAULT_AFFINITY_MATCH_MAX, 0);

#[map]
static GN_SRCRANGE4: LpmTrie<SourceRange4, u8> = LpmTrie::pinned(DEFAULT_SOURCE_RANGES_MAX, 0);

#[map]
static GN_SRCRANGE6: LpmTrie<SourceRange6, u8> = LpmTrie::pinned(DEFAULT_SOURCE_RANGES_MAX, 0);

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
fn node_scope<F: Family>(key: ServiceKey<F::Addr>, master: &'static ServiceValue) -> (ServiceKey<F::Addr>, &'static ServiceValue) {
    if master.flags & SVC_FLAG_TWO_SCOPES != 0 {
        let k = key.with_scope(SCOPE_THIS_NODE);
        if let Some(m) = F::service(&k) {
            return (k, m);
        }
    }
    (key, master)
}

/// Picks a backend of the frontend whose master entry is `master`, uniformly at random.
/// `None` when the frontend has no backends (the caller rejects) or the table is being
/// rewritten under us and a slot is missing (should not happen: slots are written first).
#[inline(always)]
fn select_backend<F: Family>(key: &ServiceKey<F::Addr>, master: &ServiceValue) -> Option<(u32, Backend<F::Addr>)> {
    let count = master.count as u32;
    if count == 0 {
        return None;
    }
    let slot = (unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() } % count) as u16 + 1;
    let sv = F::service(&key.with_slot(slot))?;
    let be = F::backend(sv.backend_id)?;
    Some((sv.backend_id, *be))
}

/// Backend selection honouring ClientIP affinity: a client that used a backend of this
/// frontend within the timeout gets it again, as long as the backend still belongs to the
/// frontend (the match map) and exists.
#[inline(always)]
fn select_backend_affine<F: Family>(key: &ServiceKey<F::Addr>, master: &ServiceValue, client: F::Client, kind: u8) -> Option<(u32, Backend<F::Addr>)> {
    if master.affinity_timeout == 0 {
        return select_backend::<F>(key, master);
    }
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    if let Some(a) = F::affinity(client, key, kind) {
        let a = unsafe { &mut *a };
        let fresh = now.wrapping_sub(a.last_used_ns) <= master.affinity_timeout as u64 * 1_000_000_000;
        if fresh && F::belongs(a.backend_id, key) {
            if let Some(be) = F::backend(a.backend_id) {
                a.last_used_ns = now;
                stat(Stat::AffinityHit);
                return Some((a.backend_id, *be));
            }
        }
    }
    let (id, be) = select_backend::<F>(key, master)?;
    F::remember_affinity(client, key, kind, &AffinityValue { backend_id: id, _pad: 0, last_used_ns: now });
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
