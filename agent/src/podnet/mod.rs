//! The pod network on this node: the agent installs gardenet's CNI plugin (and the
//! reference plugins it delegates to and chains) into the runtime's bin dir, and, once its
//! Node's `spec.podCIDRs` are known and the node is programmed, writes the conflist and the
//! readiness marker the plugin's `STATUS` looks for. The plugin itself (crate `cni/`) does
//! the wiring of each pod; no daemon is on its `ADD` path.
pub mod conflist;
pub mod install;
pub mod masq;

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use k8s_openapi::api::core::v1::Node;

use conflist::PodNetwork;

use crate::{desired::Cidr, gardener::config::Masquerade};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

#[derive(clap::Args, Debug, Clone)]
pub struct PodNetArgs {
    /// Install the pod network (CNI plugin and configuration): `off` where another plugin
    /// provides it.
    #[arg(long, value_enum, default_value = "on")]
    pub pod_network: Switch,
    /// Where the container runtime looks for CNI plugins.
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// Where the container runtime looks for CNI configurations.
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// The pod network's node-local state: the plugin's readiness marker and host-local's
    /// reservations. On tmpfs (default), so a reboot, which ends every pod, ends them too.
    #[arg(long, default_value = "/run/gardenet/cni")]
    pub cni_state_dir: PathBuf,
    /// Directories the plugins are copied from, first match wins (default: the agent's own
    /// directory, then /usr/lib/cni).
    #[arg(long, value_delimiter = ',')]
    pub cni_plugins_from: Vec<PathBuf>,
}

impl PodNetArgs {
    fn plugin_sources(&self) -> Vec<PathBuf> {
        if !self.cni_plugins_from.is_empty() {
            return self.cni_plugins_from.clone();
        }
        let own = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf));
        own.into_iter().chain([PathBuf::from("/usr/lib/cni")]).collect()
    }
}

/// The pod network's part of the agent's settings (`--pod-network on`).
#[derive(Clone, Debug)]
pub struct PodNetSettings {
    pub args: PodNetArgs,
    pub mtu: Option<u32>,
    pub masquerade: Masquerade,
}

impl PodNetSettings {
    pub fn resolve(args: &PodNetArgs, config: &crate::gardener::config::NetworkConfig) -> Option<PodNetSettings> {
        (args.pod_network == Switch::On).then(|| PodNetSettings { args: args.clone(), mtu: config.mtu, masquerade: config.masquerade.clone() })
    }
}

/// The installer's state, driven by the run loop.
pub struct PodNet {
    args: PodNetArgs,
    mtu: Option<u32>,
    pod_cidrs: Vec<String>,
    node_ips: Vec<IpAddr>,
    plugins: Result<(), String>,
    written: Option<PodNetwork>,
    masquerade: Masquerade,
    /// The nftables ruleset in force.
    masq_loaded: Option<String>,
}

impl PodNet {
    /// Copies the plugins now (the runtime may look for them before the conflist exists).
    pub fn start(settings: &PodNetSettings) -> PodNet {
        let PodNetSettings { args, mtu, masquerade } = settings;
        let plugins = match install::install_plugins(&args.plugin_sources(), &args.cni_bin_dir) {
            Ok(changed) => {
                if !changed.is_empty() {
                    tracing::info!("installed CNI plugins {} into {}", changed.join(", "), args.cni_bin_dir.display());
                }
                Ok(())
            }
            Err(e) => {
                tracing::error!("installing the CNI plugins: {e:#}");
                Err(format!("{e:#}"))
            }
        };
        PodNet {
            args: args.clone(),
            mtu: *mtu,
            pod_cidrs: Vec::new(),
            node_ips: Vec::new(),
            plugins,
            written: None,
            masquerade: masquerade.clone(),
            masq_loaded: None,
        }
    }

    /// This agent's Node: its pod CIDRs and InternalIPs.
    pub fn observe_node(&mut self, node: &Node) {
        let spec = node.spec.as_ref();
        self.pod_cidrs = spec
            .and_then(|s| s.pod_cidrs.clone())
            .filter(|c| !c.is_empty())
            .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
            .unwrap_or_default();
        self.node_ips = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
    }

    /// Writes the conflist and the readiness marker once the node is programmed and its
    /// pod CIDRs are known (again whenever what it says changes). `Err` says what is
    /// missing: the pod network is not ready.
    pub fn reconcile(&mut self, programmed: bool) -> Result<(), String> {
        self.plugins.clone()?;
        if !programmed {
            return Err("waiting for the node to be programmed".into());
        }
        let pod_cidrs = conflist::parse_pod_cidrs(&self.pod_cidrs)?;
        self.masquerade(&pod_cidrs)?;
        let mtu = self.mtu.unwrap_or_else(|| self.node_ips.iter().find_map(|ip| interface_mtu(*ip)).unwrap_or(1500));
        let want = PodNetwork { pod_cidrs: self.pod_cidrs.clone(), mtu };
        if self.written.as_ref() == Some(&want) {
            return Ok(());
        }
        let state = &self.args.cni_state_dir;
        let text = conflist::render(&want, state);
        let path = self.args.cni_conf_dir.join(conflist::CONFLIST);
        let written = (|| -> anyhow::Result<bool> {
            std::fs::create_dir_all(state.join("ipam"))?;
            install::write_atomic(&state.join("ready"), b"", 0o644)?;
            install::write_atomic(&path, text.as_bytes(), 0o644)
        })()
        .map_err(|e| format!("{e:#}"))?;
        if written {
            tracing::info!(pod_cidrs = %want.pod_cidrs.join(","), mtu, "pod network installed: {}", path.display());
        }
        self.written = Some(want);
        Ok(())
    }

    /// Loads the masquerade rules for these pod CIDRs, unless they are in force already.
    fn masquerade(&mut self, pod_cidrs: &[Cidr]) -> Result<(), String> {
        if !self.masquerade.enabled {
            return Ok(());
        }
        let node_ips = self.node_ips.iter().filter_map(|ip| Cidr::new(*ip, if ip.is_ipv4() { 32 } else { 128 }));
        let keep: Vec<Cidr> = self.masquerade.non_masquerade_cidrs.iter().filter_map(|c| c.parse().ok()).chain(node_ips).collect();
        let rules = masq::ruleset(pod_cidrs, &keep);
        if self.masq_loaded.as_ref() == Some(&rules) {
            return Ok(());
        }
        masq::apply(&rules).map_err(|e| format!("loading the masquerade rules: {e:#}"))?;
        tracing::info!("masquerading pods' traffic that leaves the pod network (nftables table inet {})", masq::TABLE);
        self.masq_loaded = Some(rules);
        Ok(())
    }

    /// The dataplane is being removed (`--detach-on-exit`): the plugin's STATUS must say so,
    /// and the masquerade rules go too. The conflist stays (a restart or upgrade never
    /// removes it).
    pub fn withdraw(&self) {
        let _ = std::fs::remove_file(self.args.cni_state_dir.join("ready"));
        if self.masq_loaded.is_some() {
            if let Err(e) = masq::remove() {
                tracing::warn!("removing the masquerade rules: {e:#}");
            }
        }
    }
}

/// The MTU of the interface that holds `ip`.
fn interface_mtu(ip: IpAddr) -> Option<u32> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below; entries are read only while it lives.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut name = None;
    let mut cur = ifap;
    while !cur.is_null() && name.is_none() {
        // SAFETY: `cur` is an entry of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr of the family it names.
            let addr = unsafe {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => Some(IpAddr::from(u32::from_be((*ifa.ifa_addr.cast::<libc::sockaddr_in>()).sin_addr.s_addr).to_be_bytes())),
                    libc::AF_INET6 => Some(IpAddr::from((*ifa.ifa_addr.cast::<libc::sockaddr_in6>()).sin6_addr.s6_addr)),
                    _ => None,
                }
            };
            if addr == Some(ip) {
                // SAFETY: ifa_name is a NUL-terminated string of the entry.
                name = Some(unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned());
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifap) };
    mtu_of(&name?)
}

/// An interface's MTU, asked of the kernel through a socket of this network namespace
/// (`/sys/class/net` shows the namespace `/sys` was mounted in, not the agent's).
fn mtu_of(name: &str) -> Option<u32> {
    // SAFETY: a plain socket, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: ifreq is plain data; zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads ifr_name and writes ifru_mtu of `req`.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
    // SAFETY: closing the socket opened above.
    unsafe { libc::close(fd) };
    if rc != 0 {
        return None;
    }
    // SAFETY: the union member SIOCGIFMTU wrote.
    Some(unsafe { req.ifr_ifru.ifru_mtu } as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopbacks_mtu_is_found_by_its_address() {
        let lo: u32 = std::fs::read_to_string("/sys/class/net/lo/mtu").unwrap().trim().parse().unwrap();
        assert_eq!(interface_mtu("127.0.0.1".parse().unwrap()), Some(lo));
        assert_eq!(interface_mtu("198.19.255.254".parse().unwrap()), None);
    }
}
