//! Loads the embedded eBPF object, pins its maps, attaches socket LB to a cgroup2 directory
//! and TC LB to interfaces, and gives the map writer typed access to the maps.
pub mod ctgc;
pub mod features;
pub mod layout;
pub mod lbmap;
pub mod mapfill;
pub mod reserved_ports;
pub mod sockterm;

use std::{
    fs,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{
        lpm_trie::{Key as LpmKey, LpmTrie},
        HashMap as BpfHashMap, Map, MapData, MapError as AyaMapError, PerCpuArray,
    },
    programs::{CgroupSockAddr, SchedClassifier, TcAttachType, Xdp},
    Ebpf, EbpfLoader, Pod,
};
use gardenet_common::*;

use crate::{
    dataplane::features::KernelFeatures,
    dataplane::lbmap::{one_by_one, Addr, Batch, BatchError, Elems, Entry, Key, LbMaps, MapDump, MapError, MapKind, MapWrite, RangeKey, ServiceNet, Write},
    desired::Cidr,
    links::pinned::{self, AttachType, Attached, Target},
};

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at compile time.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gardenet.bpf.o"));

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/gardenet";

/// Map sizes (entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub sock_revnat: u32,
    pub conntrack: u32,
    /// Affinity entries (clients x frontends) and affinity match entries.
    pub affinity: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes {
            services: DEFAULT_SERVICES_MAX,
            backends: DEFAULT_BACKENDS_MAX,
            sock_revnat: DEFAULT_SOCK_REVNAT_MAX,
            conntrack: DEFAULT_CT_MAX,
            affinity: DEFAULT_AFFINITY_MAX,
        }
    }
}

pub struct Dataplane {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    links: Vec<LinkRecord>,
    /// XDP mode used when the link manager attaches an interface.
    pub xdp_mode: XdpMode,
    /// What this kernel offers; decides the programs and attachments used.
    pub features: KernelFeatures,
    /// Pinned maps replaced at load, to finish once the programs are attached.
    migration: Option<crate::dataplane::layout::Migration>,
}

/// Where TC LB sits on kernels without tcx: a cls_bpf filter on the clsact qdisc at this
/// priority and handle. Fixed, so a restarted agent replaces its own filter in place (no
/// window, no second copy) and never touches filters of other tools at other handles.
pub const CLSACT_PRIORITY: u16 = 1;
pub const CLSACT_HANDLE: u32 = 0x6e00;

/// One attachment this agent made or took over.
pub struct LinkRecord {
    /// e.g. `cgroup/connect4`, `tc/ingress`.
    pub hook: String,
    /// Cgroup path or interface name.
    pub target: String,
    /// Interface index for interface hooks.
    pub ifindex: Option<u32>,
    pub how: Attached,
    /// Pin path; `None` for legacy (non-link) tc attachments.
    pub pin: Option<PathBuf>,
    _fd: Option<std::os::fd::OwnedFd>,
}

/// Makes sure `dir` sits on a bpffs, mounting one at the parent `/sys/fs/bpf` style mount
/// point when nothing is mounted there yet.
pub fn ensure_bpffs(dir: &Path) -> Result<()> {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let on_bpffs = |p: &Path| {
        mounts.lines().any(|l| {
            let mut f = l.split_whitespace();
            let (_, mp, ty) = (f.next(), f.next(), f.next());
            ty == Some("bpf") && mp.is_some_and(|mp| p.starts_with(mp))
        })
    };
    if on_bpffs(dir) {
        return Ok(());
    }
    let mp = dir.parent().unwrap_or(dir);
    fs::create_dir_all(mp).with_context(|| format!("creating {}", mp.display()))?;
    let src = std::ffi::CString::new("bpffs")?;
    let target = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
    let ty = std::ffi::CString::new("bpf")?;
    // SAFETY: plain mount(2) with valid NUL-terminated strings.
    let rc = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), ty.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        bail!("{} is not on a bpffs and mounting one at {} failed: {}", dir.display(), mp.display(), std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes all pinned maps under `dir` (used by `--reset`).
pub fn remove_pins(dir: &Path) -> Result<()> {
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("removing pins in {}", dir.display()))?;
    }
    Ok(())
}

/// The capacities the loader gives each configurable map.
fn size_overrides(sizes: &MapSizes) -> [(&'static str, u32); 12] {
    [
        (MAP_SERVICES, sizes.services),
        (MAP_BACKENDS, sizes.backends),
        (MAP_SOCK_REVNAT, sizes.sock_revnat),
        (MAP_CT, sizes.conntrack),
        (MAP_AFFINITY, sizes.affinity),
        (MAP_AFFINITY_MATCH, sizes.affinity),
        (MAP_SERVICES6, sizes.services),
        (MAP_BACKENDS6, sizes.backends),
        (MAP_SOCK_REVNAT6, sizes.sock_revnat),
        (MAP_CT6, sizes.conntrack),
        (MAP_AFFINITY6, sizes.affinity),
        (MAP_AFFINITY_MATCH6, sizes.affinity),
    ]
}

impl Dataplane {
    /// Completes a migration of pinned maps (`crate::dataplane::layout`) once the programs are attached:
    /// copies the entries the old programs created meanwhile, removes the old pins.
    pub fn finish_migration(&mut self) -> Result<()> {
        if let Some(m) = self.migration.take() {
            let n = m.finish()?;
            tracing::info!("pinned maps migrated ({n} entries created during the switch copied)");
        }
        Ok(())
    }

    /// Loads programs and maps. Maps already pinned in `pin_dir` are reused, so a restarted
    /// agent keeps services and conntrack entries.
    pub fn load(pin_dir: &Path, sizes: MapSizes) -> Result<Self> {
        Self::load_with(pin_dir, sizes, KernelFeatures::probe())
    }

    /// [`Dataplane::load`] for a kernel described by `features` (tests pass a reduced set to
    /// exercise fallbacks on a newer kernel).
    pub fn load_with(pin_dir: &Path, sizes: MapSizes, features: KernelFeatures) -> Result<Self> {
        crate::dataplane::features::raise_memlock_limit();
        if let Some(why) = features.missing_required() {
            bail!("{why}: gardenet needs BTF, cgroup bpf_links and the getpeername hooks (Linux >= 5.10)");
        }
        ensure_bpffs(pin_dir)?;
        fs::create_dir_all(pin_dir).with_context(|| format!("creating {}", pin_dir.display()))?;
        let sizes = size_overrides(&sizes);
        let migration = crate::dataplane::layout::prepare(pin_dir, &crate::dataplane::layout::expected(EBPF_OBJECT, &sizes)?)?;
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(pin_dir);
        for (map, entries) in sizes {
            loader.map_max_entries(map, entries);
        }
        let mut ebpf = loader.load(EBPF_OBJECT).context("loading the eBPF object")?;
        migration.copy(false)?;
        crate::dataplane::layout::write_version(pin_dir)?;
        // Only the programs this kernel can run are loaded (and so verified).
        for name in sock_programs(&features).into_iter().map(|(name, _, _)| name) {
            let p: &mut CgroupSockAddr = prog_mut(&mut ebpf, name)?;
            p.load().with_context(|| format!("verifier rejected {name}"))?;
        }
        for name in [PROG_TC_INGRESS, PROG_TC_EGRESS] {
            let p: &mut SchedClassifier = prog_mut(&mut ebpf, name)?;
            p.load().with_context(|| format!("verifier rejected {name}"))?;
        }
        let p: &mut Xdp = prog_mut(&mut ebpf, PROG_XDP)?;
        p.load().with_context(|| format!("verifier rejected {PROG_XDP}"))?;
        fs::create_dir_all(pin_dir.join("links"))?;
        Ok(Dataplane {
            ebpf,
            pin_dir: pin_dir.to_owned(),
            links: Vec::new(),
            xdp_mode: XdpMode::Auto,
            features,
            migration: (!migration.is_empty()).then_some(migration),
        })
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn links(&self) -> &[LinkRecord] {
        &self.links
    }

    fn attach_link(&mut self, prog: &str, target_raw: u32, want: Target, ty: AttachType, hook: &str, target: &str) -> Result<()> {
        self.attach_link_flags(prog, target_raw, want, ty, 0, hook, target)
    }

    #[allow(clippy::too_many_arguments)]
    fn attach_link_flags(&mut self, prog: &str, target_raw: u32, want: Target, ty: AttachType, flags: u32, hook: &str, target: &str) -> Result<()> {
        use std::os::fd::AsFd;
        // Interface hooks are pinned by ifindex: a renamed interface keeps its attachment.
        let key = match want {
            Target::Ifindex(i) => format!("if{i}"),
            Target::Cgroup { .. } => target.replace('/', "_"),
        };
        let pin = self.pin_dir.join("links").join(format!("{}-{key}", hook.replace('/', "-")));
        let fd = self.ebpf.program(prog).with_context(|| format!("program {prog} missing"))?.fd()?.as_fd().try_clone_to_owned()?;
        let (link, how) =
            pinned::attach_pinned(fd.as_fd(), target_raw, want, ty, flags, &pin).with_context(|| format!("attaching {prog} ({hook}) to {target}"))?;
        self.links.retain(|l| l.pin.as_ref() != Some(&pin));
        let ifindex = match want {
            Target::Ifindex(i) => Some(i),
            Target::Cgroup { .. } => None,
        };
        self.links.push(LinkRecord { hook: hook.into(), target: target.into(), ifindex, how, pin: Some(pin), _fd: Some(link) });
        Ok(())
    }

    /// Removes every pinned link this agent holds: the hooks are detached when the process
    /// exits (`--detach-on-exit`). Without it, pinned links keep traffic flowing while the
    /// agent is down (e.g. during an upgrade).
    pub fn unpin_links(&mut self) {
        for l in &self.links {
            match (&l.pin, l.ifindex) {
                (Some(p), _) => {
                    let _ = fs::remove_file(p);
                }
                (None, Some(ifindex)) => Self::detach_clsact(ifindex),
                (None, None) => {}
            }
        }
    }

    /// Detaches TC LB and XDP from interface `ifindex` (removes its pins; the links go with
    /// our fds).
    pub fn detach_interface(&mut self, ifindex: u32) {
        let mut clsact = false;
        self.links.retain(|l| {
            let mine = l.ifindex == Some(ifindex);
            if mine {
                match &l.pin {
                    Some(p) => {
                        let _ = fs::remove_file(p);
                    }
                    None => clsact = true,
                }
            }
            !mine
        });
        if clsact {
            Self::detach_clsact(ifindex);
        }
    }

    /// Attaches the socket-LB hooks to a cgroup2 directory. These are bpf_links, which never
    /// displace other programs on the cgroup (the kernel rejects attach flags for links, so
    /// the mode must be the zero-flag `Single`).
    pub fn attach_socket_lb(&mut self, cgroup: &Path) -> Result<()> {
        use std::os::fd::AsRawFd;
        let f = fs::File::open(cgroup).with_context(|| format!("opening cgroup {}", cgroup.display()))?;
        let id = pinned::cgroup_id(cgroup)?;
        let target = cgroup.display().to_string();
        for (name, ty, hook) in sock_programs(&self.features) {
            self.attach_link(name, f.as_raw_fd() as u32, Target::Cgroup { id }, ty, hook, "cgroup").with_context(|| format!("cgroup {target}"))?;
        }
        Ok(())
    }

    /// Attaches the XDP program to `iface` as `mode` says (see `xdp_tries`). Returns the mode
    /// used, `None` for none.
    pub fn attach_xdp(&mut self, iface: &str, mode: XdpMode) -> Result<Option<XdpMode>> {
        let idx = ifindex(iface)?;
        self.attach_xdp_index(iface, idx, None, mode)
    }

    fn attach_xdp_index(&mut self, iface: &str, ifindex: u32, kind: Option<&str>, mode: XdpMode) -> Result<Option<XdpMode>> {
        let mut last = None;
        for &m in xdp_tries(mode, kind) {
            let flags = if m == XdpMode::Native { XDP_FLAGS_DRV_MODE } else { XDP_FLAGS_SKB_MODE };
            match self.attach_link_flags(PROG_XDP, ifindex, Target::Ifindex(ifindex), AttachType::Xdp, flags, "xdp", iface) {
                Ok(()) => {
                    if let Some(l) = self.links.last_mut() {
                        l.hook = format!("xdp/{}", m.as_str());
                    }
                    return Ok(Some(m));
                }
                Err(e) => last = Some(e),
            }
        }
        match last {
            // `Auto` on a driver without native XDP: TC alone, as on veth.
            Some(e) if mode == XdpMode::Auto => {
                tracing::info!("{iface}: no native XDP ({e:#}); TC LB alone");
                Ok(None)
            }
            Some(e) => Err(e.context(format!("attaching XDP to {iface}"))),
            None => Ok(None),
        }
    }

    /// Attaches TC LB (ingress DNAT + egress reverse NAT) to `iface`: tcx on kernels that have
    /// it, a clsact qdisc and cls_bpf otherwise (aya picks).
    pub fn attach_tc(&mut self, iface: &str) -> Result<()> {
        let idx = ifindex(iface)?;
        self.attach_tc_index(iface, idx)
    }

    fn attach_tc_index(&mut self, iface: &str, ifindex: u32) -> Result<()> {
        if self.features.tcx {
            for (name, ty, hook) in [(PROG_TC_INGRESS, AttachType::TcxIngress, "tc/ingress"), (PROG_TC_EGRESS, AttachType::TcxEgress, "tc/egress")] {
                self.attach_link(name, ifindex, Target::Ifindex(ifindex), ty, hook, iface)?;
            }
            return Ok(());
        }
        // Kernels before 6.6: a cls_bpf filter on clsact at our fixed priority and handle.
        // An existing one (a previous agent's) gets the new program in place, atomically;
        // only where there is none is one created. The qdisc may exist already ("exists").
        let _ = aya::programs::tc::qdisc_add_clsact(iface);
        for (name, ty, hook) in [(PROG_TC_INGRESS, TcAttachType::Ingress, "tc/ingress"), (PROG_TC_EGRESS, TcAttachType::Egress, "tc/egress")] {
            let p: &mut SchedClassifier = prog_mut(&mut self.ebpf, name)?;
            let handle = aya::programs::tc::TcHandle::from(CLSACT_HANDLE);
            let existing = aya::programs::tc::SchedClassifierLink::attached(iface, ty, CLSACT_PRIORITY, handle, None)?;
            let (id, how) = match p.attach_to_link(existing) {
                Ok(id) => (id, Attached::Updated),
                Err(_) => {
                    let opts = aya::programs::tc::NlOptions { priority: CLSACT_PRIORITY, handle, classid: None };
                    let id = p
                        .attach_with_options(iface, ty, aya::programs::tc::TcAttachOptions::Netlink(opts))
                        .with_context(|| format!("attaching {name} to {iface} (clsact)"))?;
                    (id, Attached::Created)
                }
            };
            // The filter stays when the agent exits (as pinned links do); it is removed only by
            // `detach_interface` or `--detach-on-exit`.
            std::mem::forget(p.take_link(id)?);
            self.links.retain(|l| !(l.ifindex == Some(ifindex) && l.hook == hook));
            self.links.push(LinkRecord { hook: hook.into(), target: iface.into(), ifindex: Some(ifindex), how, pin: None, _fd: None });
        }
        Ok(())
    }

    /// Removes this agent's clsact filters from `ifindex` (kernels without tcx).
    fn detach_clsact(ifindex: u32) {
        let Some(name) = ifname(ifindex) else { return };
        for ty in [TcAttachType::Ingress, TcAttachType::Egress] {
            if let Ok(l) = aya::programs::tc::SchedClassifierLink::attached(&name, ty, CLSACT_PRIORITY, CLSACT_HANDLE.into(), None) {
                use aya::programs::Link as _;
                let _ = l.detach();
            }
        }
    }

    /// Typed handles on the service, backend and source-range maps, for the map writer.
    pub fn lb_maps(&mut self) -> Result<AyaLbMaps> {
        let service_nets = self.ebpf.take_map(MAP_SERVICE_NETS).context("no service-net map")?;
        Ok(AyaLbMaps {
            v4: AyaFamily::take(&mut self.ebpf)?,
            v6: AyaFamily::take(&mut self.ebpf)?,
            service_nets: LpmTrie::try_from(service_nets)?,
            batch_unsupported: false,
        })
    }

    /// Per-CPU datapath counters, summed.
    pub fn stats(&self) -> Result<Vec<(&'static str, u64)>> {
        let m: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(self.ebpf.map(MAP_STATS).context("no stats map")?)?;
        let mut out = Vec::new();
        for (i, name) in STAT_NAMES.iter().enumerate() {
            let v = m.get(&(i as u32), 0)?;
            out.push((*name, v.iter().sum()));
        }
        Ok(out)
    }
}

/// The link manager drives interface attachments through this.
impl crate::links::Attacher for Dataplane {
    fn attach(&mut self, link: &crate::links::LinkInfo) -> Result<Vec<String>> {
        let r = self.attach_tc_index(&link.name, link.index).and_then(|()| self.attach_xdp_index(&link.name, link.index, link.kind.as_deref(), self.xdp_mode));
        if let Err(e) = r {
            // All or nothing: the manager retries the whole attach.
            self.detach_interface(link.index);
            return Err(e);
        }
        Ok(self.links.iter().filter(|l| l.ifindex == Some(link.index)).map(|l| l.hook.clone()).collect())
    }

    fn detach(&mut self, link: &crate::links::LinkInfo) -> Result<()> {
        self.detach_interface(link.index);
        Ok(())
    }

    fn forget(&mut self, link: &crate::links::LinkInfo) {
        // The kernel already dropped the links of a deleted device; the pins held dead links.
        self.detach_interface(link.index);
    }
}

fn ifindex(iface: &str) -> Result<u32> {
    let cname = std::ffi::CString::new(iface)?;
    // SAFETY: valid C string.
    let idx = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if idx == 0 {
        bail!("interface {iface}: {}", std::io::Error::last_os_error());
    }
    Ok(idx)
}

const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// The XDP modes to try, in order, on an interface of link kind `kind` (`IFLA_INFO_KIND`).
/// `Auto` means native XDP where the driver has it, and nothing otherwise: generic XDP only
/// adds a per-packet cost to what TC does anyway, and on veth native XDP moves the device
/// to its NAPI receive path, which cost 22% of the connection rate of all traffic through it
/// in `cargo xtask bench dataplane` (ablation table in docs/benchmarks.md). `Native` and
/// `Generic` are attached as asked, on any device.
pub fn xdp_tries(mode: XdpMode, kind: Option<&str>) -> &'static [XdpMode] {
    match mode {
        XdpMode::Off => &[],
        XdpMode::Native => &[XdpMode::Native],
        XdpMode::Generic => &[XdpMode::Generic],
        XdpMode::Auto if kind == Some("veth") => &[],
        XdpMode::Auto => &[XdpMode::Native],
    }
}

/// How XDP is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    Off,
    Native,
    Generic,
    /// Native where the driver supports it, except on veth; nothing otherwise.
    Auto,
}

impl XdpMode {
    pub fn as_str(self) -> &'static str {
        match self {
            XdpMode::Off => "off",
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
            XdpMode::Auto => "auto",
        }
    }
}

/// The socket-LB programs for this kernel: (program, attach type, hook).
fn sock_programs(f: &KernelFeatures) -> [(&'static str, AttachType, &'static str); 8] {
    let (connect4, sendmsg4, connect6, sendmsg6) = if f.set_retval {
        (PROG_CONNECT4, PROG_SENDMSG4, PROG_CONNECT6, PROG_SENDMSG6)
    } else {
        (PROG_CONNECT4_NR, PROG_SENDMSG4_NR, PROG_CONNECT6_NR, PROG_SENDMSG6_NR)
    };
    [
        (connect4, AttachType::Connect4, "cgroup/connect4"),
        (sendmsg4, AttachType::Sendmsg4, "cgroup/sendmsg4"),
        (PROG_RECVMSG4, AttachType::Recvmsg4, "cgroup/recvmsg4"),
        (PROG_GETPEERNAME4, AttachType::Getpeername4, "cgroup/getpeername4"),
        (connect6, AttachType::Connect6, "cgroup/connect6"),
        (sendmsg6, AttachType::Sendmsg6, "cgroup/sendmsg6"),
        (PROG_RECVMSG6, AttachType::Recvmsg6, "cgroup/recvmsg6"),
        (PROG_GETPEERNAME6, AttachType::Getpeername6, "cgroup/getpeername6"),
    ]
}

fn ifname(ifindex: u32) -> Option<String> {
    let mut buf = [0u8; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr().cast()) };
    if p.is_null() {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

fn prog_mut<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let p = ebpf.program_mut(name).with_context(|| format!("program {name} missing from the object"))?;
    Ok(p.try_into()?)
}

/// A second descriptor of a hash map, for the batch operations aya does not wrap.
fn dup_fd(m: &Map) -> Result<OwnedFd> {
    match m {
        Map::HashMap(d) | Map::LruHashMap(d) => Ok(d.fd().as_fd().try_clone_to_owned()?),
        other => bail!("batch writes: {other:?} is not a hash map"),
    }
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
/// The kernel's internal "operation not supported" (`ENOTSUPP`), which bpf(2) returns as is.
const ENOTSUPP: i32 = 524;

/// `union bpf_attr`'s `batch` member.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// One `BPF_MAP_UPDATE_BATCH` (values given) or `BPF_MAP_DELETE_BATCH` of `keys`: on error,
/// how many elements the kernel processed before the one that failed, and the error.
fn sys_batch<K, V>(fd: &OwnedFd, keys: &[K], values: Option<&[V]>) -> Result<(), (usize, std::io::Error)> {
    let n = u32::try_from(keys.len()).map_err(|_| (0, std::io::Error::from_raw_os_error(libc::E2BIG)))?;
    let mut a = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.map_or(0, |v| v.as_ptr() as u64),
        count: n,
        map_fd: fd.as_raw_fd() as u32,
        ..Default::default()
    };
    let cmd = if values.is_some() { BPF_MAP_UPDATE_BATCH } else { BPF_MAP_DELETE_BATCH };
    // SAFETY: `a` is a valid `bpf_attr.batch`; keys and values point at `n` elements of the
    // map's key and value size (the typed maps check those sizes), alive for the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, &mut a as *mut BatchAttr, std::mem::size_of::<BatchAttr>() as u32) };
    if r == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    // The kernel writes back `count` only once it has started on the elements (and then it
    // is below n); an error before that leaves our n, and nothing was written.
    let done = if a.count < n { a.count as usize } else { 0 };
    Err((done, err))
}

/// Every entry of a hash map, read with `BPF_MAP_LOOKUP_BATCH` and handed to `each`: a call
/// per few thousand entries instead of two per entry (aya's iterator: next key, then lookup),
/// and memory for one call's entries only. An error the kernel gives (no batch lookup for
/// this map: before 5.6) is returned; entries that change meanwhile may be seen in their old
/// or new state, as with any walk. Returns the number of entries.
pub(crate) fn walk_hash_batched<K: Pod, V: Pod>(fd: std::os::fd::BorrowedFd<'_>, mut each: impl FnMut(K, V)) -> std::io::Result<usize> {
    let mut chunk = 4096usize;
    let mut total = 0;
    // The kernel's position between calls (a bucket index for hash maps); 8 bytes hold it.
    let (mut token, mut first) = (0u64, true);
    loop {
        let mut keys: Vec<K> = Vec::with_capacity(chunk);
        let mut values: Vec<V> = Vec::with_capacity(chunk);
        let mut next = 0u64;
        let mut a = BatchAttr {
            in_batch: if first { 0 } else { &token as *const u64 as u64 },
            out_batch: &mut next as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `a` is a valid `bpf_attr.batch`; keys and values have room for `count`
        // elements of the map's key and value size (the caller's types are the map's), and
        // the kernel writes at most `count` of each.
        let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_BATCH, &mut a as *mut BatchAttr, std::mem::size_of::<BatchAttr>() as u32) };
        let err = (r != 0).then(std::io::Error::last_os_error);
        match err.as_ref().and_then(|e| e.raw_os_error()) {
            // A bucket holds more entries than fit: again from the same place, with more room.
            Some(libc::ENOSPC) if chunk < 1 << 20 => {
                chunk *= 4;
                continue;
            }
            None | Some(libc::ENOENT) => {}
            _ => return Err(err.unwrap_or_else(|| std::io::Error::other("batch lookup"))),
        }
        let n = (a.count as usize).min(chunk);
        // SAFETY: the kernel wrote `n` keys and values.
        unsafe {
            keys.set_len(n);
            values.set_len(n);
        }
        total += n;
        keys.into_iter().zip(values).for_each(|(k, v)| each(k, v));
        if err.is_some() {
            return Ok(total); // ENOENT: that was the end
        }
        token = next;
        first = false;
    }
}

/// One family's service, backend, affinity-match and source-range maps.
struct AyaFamily<A> {
    services: BpfHashMap<MapData, ServiceKey<A>, ServiceValue>,
    backends: BpfHashMap<MapData, u32, Backend<A>>,
    matches: BpfHashMap<MapData, AffinityMatchKey<A>, u8>,
    ranges: LpmTrie<MapData, SourceRange<A>, u8>,
    /// Second descriptors of the hash maps, for the batch operations aya does not wrap.
    services_fd: OwnedFd,
    backends_fd: OwnedFd,
    matches_fd: OwnedFd,
}

/// Why a batch was not written.
enum BatchFailure {
    /// The kernel refused the command before any element (or refused the first element).
    Refused(std::io::Error),
    Failed(BatchError),
}

impl<A: Addr> AyaFamily<A>
where
    ServiceKey<A>: Pod,
    Backend<A>: Pod,
    AffinityMatchKey<A>: Pod,
    SourceRange<A>: Pod,
{
    fn take(ebpf: &mut Ebpf) -> Result<Self> {
        let mut take = |name: &str| ebpf.take_map(name).with_context(|| format!("no map {name}"));
        let (services, backends, matches, ranges) = (take(A::MAPS.services)?, take(A::MAPS.backends)?, take(A::MAPS.matches)?, take(A::MAPS.ranges)?);
        Ok(AyaFamily {
            services_fd: dup_fd(&services)?,
            backends_fd: dup_fd(&backends)?,
            matches_fd: dup_fd(&matches)?,
            services: BpfHashMap::try_from(services)?,
            backends: BpfHashMap::try_from(backends)?,
            matches: BpfHashMap::try_from(matches)?,
            ranges: LpmTrie::try_from(ranges)?,
        })
    }

    fn write(&mut self, w: Write<A>) -> Result<(), MapError> {
        match w {
            Write::Put(Entry::Backend(id, b)) => self.backends.insert(id, b, 0).map_err(|e| map_err(A::MAPS.backends, format!("put backend {id}"), e)),
            Write::Put(Entry::Service(k, v)) => self.services.insert(k, v, 0).map_err(|e| map_err(A::MAPS.services, format!("put {k:?}"), e)),
            Write::Put(Entry::Match(k)) => self.matches.insert(k, 1, 0).map_err(|e| map_err(A::MAPS.matches, format!("put {k:?}"), e)),
            Write::Del(Key::Backend(id)) => ignore_missing(self.backends.remove(&id)).map_err(|e| map_err(A::MAPS.backends, format!("delete backend {id}"), e)),
            Write::Del(Key::Service(k)) => ignore_missing(self.services.remove(&k)).map_err(|e| map_err(A::MAPS.services, format!("delete {k:?}"), e)),
            Write::Del(Key::Match(k)) => ignore_missing(self.matches.remove(&k)).map_err(|e| map_err(A::MAPS.matches, format!("delete {k:?}"), e)),
        }
    }

    fn range(&mut self, len: u32, d: SourceRange<A>, put: bool) -> Result<(), MapError> {
        let k = LpmKey::new(len, d);
        let r = if put { self.ranges.insert(&k, 1, 0) } else { ignore_missing(self.ranges.remove(&k)) };
        r.map_err(|e| map_err(A::MAPS.ranges, format!("{} {len} {d:?}", if put { "put" } else { "delete" }), e))
    }

    /// `e` with `BPF_MAP_UPDATE_BATCH`/`BPF_MAP_DELETE_BATCH`, as [`LbMaps::write_batch`].
    fn write_batch(&self, e: Elems<'_, A>) -> Result<(), BatchFailure> {
        let (map, fd) = match e.map() {
            MapKind::Backends => (A::MAPS.backends, &self.backends_fd),
            MapKind::Services => (A::MAPS.services, &self.services_fd),
            MapKind::Matches => (A::MAPS.matches, &self.matches_fd),
        };
        let (n, is_delete) = (e.len(), e.is_delete());
        let mut from = 0;
        while from < n {
            let r = match e.from(from) {
                Elems::PutBackends(k, v) => sys_batch(fd, k, Some(v)),
                Elems::PutServices(k, v) => sys_batch(fd, k, Some(v)),
                Elems::PutMatches(k) => sys_batch(fd, k, Some(&vec![1u8; k.len()][..])),
                Elems::DelBackends(k) => sys_batch::<_, u8>(fd, k, None),
                Elems::DelServices(k) => sys_batch::<_, u8>(fd, k, None),
                Elems::DelMatches(k) => sys_batch::<_, u8>(fd, k, None),
            };
            let Err((done, err)) = r else { return Ok(()) };
            let code = err.raw_os_error();
            if from == 0 && done == 0 && matches!(code, Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)) {
                return Err(BatchFailure::Refused(err));
            }
            let at = from + done;
            if is_delete && code == Some(libc::ENOENT) {
                // Deleting a missing key is not an error (as for single deletes): go on
                // after it.
                from = at + 1;
                continue;
            }
            let op = if is_delete { format!("batch delete, element {at} of {n}") } else { format!("batch update, element {at} of {n}") };
            let error = if code == Some(libc::E2BIG) { MapError::Full { map, op } } else { MapError::Io { map, op, source: err } };
            return Err(BatchFailure::Failed(BatchError { done: at, error }));
        }
        Ok(())
    }
}

/// The service, backend and source-range maps of both families and the service-net trie,
/// owned by the writer.
pub struct AyaLbMaps {
    v4: AyaFamily<u32>,
    v6: AyaFamily<Ip6>,
    service_nets: LpmTrie<MapData, Ip6, u8>,
    /// The kernel refused a batch command (older than 5.6): single writes from then on.
    batch_unsupported: bool,
}

impl AyaLbMaps {
    pub fn dump(&self) -> MapDump {
        let mut d = dump_maps(&self.v4.services, &self.v4.backends);
        d.services6 = self.v6.services.iter().filter_map(|r| r.ok()).collect();
        d.backends6 = self.v6.backends.iter().filter_map(|r| r.ok()).collect();
        d.ranges = dump_ranges(&self.v4.ranges, &self.v6.ranges);
        d.service_nets = dump_service_nets(&self.service_nets);
        d
    }
}

fn dump_service_nets(m: &LpmTrie<MapData, Ip6, u8>) -> Vec<(Cidr, ServiceNet)> {
    m.iter()
        .filter_map(|r| r.ok())
        .filter_map(|(k, v)| Some((crate::dataplane::lbmap::service_net_of_key(k.prefix_len(), k.data())?, ServiceNet::from_value(v)?)))
        .collect()
}

fn dump_ranges(r4: &LpmTrie<MapData, SourceRange4, u8>, r6: &LpmTrie<MapData, SourceRange6, u8>) -> Vec<RangeKey> {
    let v4 = r4.keys().filter_map(|k| k.ok()).map(|k| RangeKey::V4(k.prefix_len(), k.data()));
    let v6 = r6.keys().filter_map(|k| k.ok()).map(|k| RangeKey::V6(k.prefix_len(), k.data()));
    v4.chain(v6).collect()
}

fn map_err(map: &'static str, op: String, e: AyaMapError) -> MapError {
    match e {
        AyaMapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG) => MapError::Full { map, op },
        AyaMapError::SyscallError(s) => MapError::Io { map, op, source: s.io_error },
        other => MapError::Other(format!("map {map}: {op}: {other}")),
    }
}

fn ignore_missing(r: Result<(), AyaMapError>) -> Result<(), AyaMapError> {
    match r {
        Err(AyaMapError::KeyNotFound) => Ok(()),
        Err(AyaMapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

impl LbMaps for AyaLbMaps {
    fn write(&mut self, w: MapWrite) -> Result<(), MapError> {
        match w {
            MapWrite::V4(w) => self.v4.write(w),
            MapWrite::V6(w) => self.v6.write(w),
            MapWrite::PutRange(k) | MapWrite::DelRange(k) => {
                let put = matches!(w, MapWrite::PutRange(_));
                match k {
                    RangeKey::V4(len, d) => self.v4.range(len, d, put),
                    RangeKey::V6(len, d) => self.v6.range(len, d, put),
                }
            }
        }
    }

    fn put_service_net(&mut self, net: &Cidr, kind: ServiceNet) -> Result<(), MapError> {
        let (len, data) = crate::dataplane::lbmap::service_net_key(net);
        self.service_nets.insert(&LpmKey::new(len, data), kind.value(), 0).map_err(|e| map_err(MAP_SERVICE_NETS, format!("put {net}"), e))
    }

    fn del_service_net(&mut self, net: &Cidr) -> Result<(), MapError> {
        let (len, data) = crate::dataplane::lbmap::service_net_key(net);
        ignore_missing(self.service_nets.remove(&LpmKey::new(len, data))).map_err(|e| map_err(MAP_SERVICE_NETS, format!("delete {net}"), e))
    }

    fn write_batch(&mut self, b: Batch<'_>) -> Result<(), BatchError> {
        if b.is_empty() {
            return Ok(());
        }
        if self.batch_unsupported {
            return one_by_one(self, b);
        }
        let r = self.kernel_batch(b);
        self.settle_batch(b, r)
    }

    fn write_batches(&mut self, a: Batch<'_>, b: Batch<'_>) -> [Result<(), BatchError>; 2] {
        // A second thread pays off on a full sync's batches, not on a few elements.
        if self.batch_unsupported || a.len().min(b.len()) < PARALLEL_BATCH_MIN {
            return [self.write_batch(a), self.write_batch(b)];
        }
        let this = &*self;
        let (ra, rb) = std::thread::scope(|s| {
            let Ok(h) = std::thread::Builder::new().name("gardenet-batch".into()).spawn_scoped(s, || this.kernel_batch(a)) else {
                return (this.kernel_batch(a), this.kernel_batch(b));
            };
            let rb = this.kernel_batch(b);
            // The thread only makes one syscall; should it panic, count every element as
            // written, so that an undo takes them all back.
            let ra = h
                .join()
                .unwrap_or_else(|_| Err(BatchFailure::Failed(BatchError { done: a.len(), error: MapError::Other("batch writer thread panicked".into()) })));
            (ra, rb)
        });
        [self.settle_batch(a, ra), self.settle_batch(b, rb)]
    }
}

/// Elements each of two batches must have before [`AyaLbMaps`] writes them from two threads.
const PARALLEL_BATCH_MIN: usize = 256;

impl AyaLbMaps {
    /// `b` with one batch command (shared access: two can run at once on different maps).
    fn kernel_batch(&self, b: Batch<'_>) -> Result<(), BatchFailure> {
        match b {
            Batch::V4(e) => self.v4.write_batch(e),
            Batch::V6(e) => self.v6.write_batch(e),
        }
    }

    /// The outcome of [`AyaLbMaps::kernel_batch`]: a command the kernel does not have makes
    /// this and every later batch single writes.
    fn settle_batch(&mut self, b: Batch<'_>, r: Result<(), BatchFailure>) -> Result<(), BatchError> {
        match r {
            Ok(()) => Ok(()),
            Err(BatchFailure::Failed(e)) => Err(e),
            Err(BatchFailure::Refused(err)) => {
                // No batch operations here (kernel < 5.6), or the first element itself is
                // refused: single writes tell the two apart.
                one_by_one(self, b)?;
                tracing::info!("map batch operations unavailable ({err}); writing maps one entry at a time");
                self.batch_unsupported = true;
                Ok(())
            }
        }
    }
}

fn dump_maps(services: &BpfHashMap<MapData, ServiceKey4, ServiceValue>, backends: &BpfHashMap<MapData, u32, Backend4>) -> MapDump {
    MapDump { services: services.iter().filter_map(|r| r.ok()).collect(), backends: backends.iter().filter_map(|r| r.ok()).collect(), ..Default::default() }
}

/// Reads the pinned maps of a (possibly running) agent: what `lb list` shows.
pub fn dump_pinned(pin_dir: &Path) -> Result<MapDump> {
    let open = |name: &str| -> Result<Map> {
        let p = pin_dir.join(name);
        let data =
            MapData::from_pin(&p).with_context(|| format!("opening pinned map {} (is the agent running with --bpffs {}?)", p.display(), pin_dir.display()))?;
        Ok(Map::HashMap(data))
    };
    let services: BpfHashMap<MapData, ServiceKey4, ServiceValue> = BpfHashMap::try_from(open(MAP_SERVICES)?)?;
    let backends: BpfHashMap<MapData, u32, Backend4> = BpfHashMap::try_from(open(MAP_BACKENDS)?)?;
    let mut d = dump_maps(&services, &backends);
    // Pins of an agent from before dual stack have no IPv6 maps: show IPv4 only then.
    if pin_dir.join(MAP_SERVICES6).exists() {
        let services6: BpfHashMap<MapData, ServiceKey6, ServiceValue> = BpfHashMap::try_from(open(MAP_SERVICES6)?)?;
        let backends6: BpfHashMap<MapData, u32, Backend6> = BpfHashMap::try_from(open(MAP_BACKENDS6)?)?;
        d.services6 = services6.iter().filter_map(|r| r.ok()).collect();
        d.backends6 = backends6.iter().filter_map(|r| r.ok()).collect();
    }
    if pin_dir.join(MAP_SOURCE_RANGES).exists() && pin_dir.join(MAP_SOURCE_RANGES6).exists() {
        let lpm = |name: &str| -> Result<Map> { Ok(Map::LpmTrie(MapData::from_pin(pin_dir.join(name))?)) };
        let r4: LpmTrie<MapData, SourceRange4, u8> = LpmTrie::try_from(lpm(MAP_SOURCE_RANGES)?)?;
        let r6: LpmTrie<MapData, SourceRange6, u8> = LpmTrie::try_from(lpm(MAP_SOURCE_RANGES6)?)?;
        d.ranges = dump_ranges(&r4, &r6);
    }
    if pin_dir.join(MAP_SERVICE_NETS).exists() {
        let m: LpmTrie<MapData, Ip6, u8> = LpmTrie::try_from(Map::LpmTrie(MapData::from_pin(pin_dir.join(MAP_SERVICE_NETS))?))?;
        d.service_nets = dump_service_nets(&m);
    }
    Ok(d)
}

/// Fill of each family's conntrack map (`conntrack_ipv4`, and `conntrack_ipv6` where it is
/// pinned). Walks the maps: keep it off the run loop.
pub fn conntrack_fill(pin_dir: &Path) -> Result<Vec<crate::dataplane::mapfill::Fill>> {
    Ok(ctgc::scan(pin_dir, None)?.fills)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_xdp_is_native_only_and_never_on_veth() {
        assert_eq!(xdp_tries(XdpMode::Auto, None), [XdpMode::Native]);
        assert_eq!(xdp_tries(XdpMode::Auto, Some("veth")), [] as [XdpMode; 0]);
        assert_eq!(xdp_tries(XdpMode::Native, Some("veth")), [XdpMode::Native]);
        assert_eq!(xdp_tries(XdpMode::Generic, Some("veth")), [XdpMode::Generic]);
        assert!(xdp_tries(XdpMode::Off, None).is_empty());
    }
}
