//! What `gardenet-agent run` does, resolved once from its flags and the NetworkConfig (flags
//! win; each stage is started from its own part): the dataplane (maps, XDP, socket LB), the
//! node's Service settings, interface selection and reserved ports, conntrack upkeep, the
//! poll intervals and the pod network. Pure: unit-tested without privileges.
use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Result};

use crate::{
    dataplane::{
        reserved_ports::{Guard, PortRange, SysctlDirs},
        MapSizes, XdpMode,
    },
    gardener::config::{LocalRedirectRule, NetworkConfig, NodePortAddress},
    links::Selector,
    podnet::PodNetSettings,
    run::{default_state_dir, RunArgs},
};

/// Everything after the NetworkConfig is known.
#[derive(Clone, Debug)]
pub struct Settings {
    pub node_name: String,
    pub dataplane: DataplaneSettings,
    pub node: NodeSettings,
    pub links: LinkSettings,
    pub conntrack: ConntrackSettings,
    /// How often a `dir:` source looks for changes.
    pub source_poll: Duration,
    /// How often the local-redirect watch reads the socket tables.
    pub listener_poll: Duration,
    /// `None`: another plugin provides the pod network (`--pod-network off`).
    pub pod_network: Option<PodNetSettings>,
    /// Where `links.json` is published.
    pub state_dir: PathBuf,
    /// The node's /proc: every network namespace, for socket termination.
    pub host_proc: PathBuf,
}

#[derive(Clone, Debug, PartialEq)]
pub struct DataplaneSettings {
    pub bpffs: PathBuf,
    pub sizes: MapSizes,
    pub xdp_mode: XdpMode,
    pub socket_lb: SocketLb,
    pub detach_on_exit: bool,
}

/// Where socket LB attaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketLb {
    Off,
    /// The node's cgroup2 root (found at attach time).
    NodeRoot,
    At(PathBuf),
}

/// What the agent tells translation about this node besides the Node object: NodePort
/// address selection, the externalIPs switch and the local-redirect rules.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSettings {
    pub node_port_addresses: Vec<NodePortAddress>,
    pub no_external_ips: bool,
    pub local_redirects: Vec<LocalRedirectRule>,
}

#[derive(Clone, Debug)]
pub struct LinkSettings {
    /// Which interfaces TC LB attaches to.
    pub selector: Selector,
    /// The cluster's NodePort range, when it is to be kept out of the node's ephemeral ports.
    pub reserve: Option<PortRange>,
}

impl LinkSettings {
    /// The ports TC LB translates on the node's own addresses, to keep from local sockets:
    /// none when no interface can be selected (socket LB alone translates no packet
    /// addressed to the node) or with `--no-reserve-ports`; source NAT's only where the
    /// kernel lets TC LB source-NAT.
    pub fn reserved_ports(&self, host_proc: &std::path::Path, no_source_nat: bool) -> Guard {
        let mut want = Vec::new();
        if let (Some(np), true) = (self.reserve, self.selector.may_select()) {
            want.push(("NodePorts", np));
            if !no_source_nat {
                let snat = PortRange::new(gardenet_common::SNAT_PORT_MIN, gardenet_common::SNAT_PORT_MIN + (gardenet_common::SNAT_PORT_COUNT - 1));
                want.extend(snat.map(|r| ("source NAT", r)));
            }
        }
        Guard::new(SysctlDirs::of_node(host_proc), want)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackSettings {
    /// How often the conntrack maps are counted and closed flows removed.
    pub scan_every: Duration,
    /// How long a closed TCP flow stays; `None` leaves closed flows to the LRU.
    pub closed_hold: Option<Duration>,
}

impl Settings {
    pub fn resolve(args: &RunArgs, config: &NetworkConfig) -> Result<Settings> {
        let sizes = MapSizes {
            services: args.map_services.unwrap_or(config.map_sizes.services),
            backends: args.map_backends.unwrap_or(config.map_sizes.backends),
            sock_revnat: config.map_sizes.sock_rev_nat,
            conntrack: args.map_conntrack.unwrap_or(config.map_sizes.conntrack),
            ..Default::default()
        };
        let socket_lb = match (args.no_socket_lb || !config.socket_lb.enabled, &args.cgroup) {
            (true, _) => SocketLb::Off,
            (false, Some(c)) => SocketLb::At(c.clone()),
            (false, None) => SocketLb::NodeRoot,
        };
        let dataplane = DataplaneSettings {
            bpffs: args.bpffs.clone(),
            sizes,
            xdp_mode: args.xdp_mode.unwrap_or_else(|| xdp_from_config(config.xdp.mode)),
            socket_lb,
            detach_on_exit: args.detach_on_exit,
        };
        let mut iface_args = args.interfaces.clone();
        iface_args.force.extend(args.tc_interfaces.iter().cloned());
        let links = LinkSettings { selector: iface_args.selector(&config.interfaces), reserve: (!args.no_reserve_ports).then_some(args.node_port_range) };
        Ok(Settings {
            node_name: args.node_name.clone(),
            dataplane,
            node: node_settings(args, config)?,
            links,
            conntrack: ConntrackSettings {
                scan_every: Duration::from_secs(args.conntrack_scan_secs.max(1)),
                closed_hold: (args.conntrack_closed_secs > 0).then(|| Duration::from_secs(args.conntrack_closed_secs)),
            },
            source_poll: Duration::from_millis(args.poll_ms),
            listener_poll: Duration::from_millis(args.local_redirect_poll_ms.max(1)),
            pod_network: PodNetSettings::resolve(&args.pod_network, config),
            state_dir: args.state_dir.clone().unwrap_or_else(|| default_state_dir(&args.bpffs)),
            host_proc: args.host_proc.clone(),
        })
    }
}

fn node_settings(args: &RunArgs, config: &NetworkConfig) -> Result<NodeSettings> {
    let node_port_addresses = if args.node_port_addresses.is_empty() { config.node_port_addresses.clone() } else { args.node_port_addresses.clone() };
    let local_redirects = if args.local_redirects.is_empty() { config.local_redirect_rules() } else { args.local_redirects.clone() };
    for (i, r) in local_redirects.iter().enumerate() {
        if let Some(o) = local_redirects[..i].iter().find(|o| o.service == r.service) {
            bail!("--local-redirect: {} is redirected twice ({} and {})", r.service, o.address, r.address);
        }
    }
    Ok(NodeSettings { node_port_addresses, no_external_ips: args.no_external_ips || !config.external_ips.enabled, local_redirects })
}

fn xdp_from_config(m: crate::gardener::config::XdpMode) -> XdpMode {
    use crate::gardener::config::XdpMode as C;
    match m {
        C::Off => XdpMode::Off,
        C::Generic => XdpMode::Generic,
        C::Native => XdpMode::Native,
        C::Auto => XdpMode::Auto,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `gardenet-agent run`'s flags as main.rs declares them (args_override_self).
    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Run {
        #[command(flatten)]
        args: RunArgs,
    }

    fn run_args(flags: &[&str]) -> RunArgs {
        Run::try_parse_from(["run"].iter().chain(flags)).unwrap_or_else(|e| panic!("{flags:?}: {e}")).args
    }

    fn config(yaml: &str) -> NetworkConfig {
        NetworkConfig::from_yaml_str(&format!("apiVersion: gardenet.networking.extensions.gardener.cloud/v1alpha1\nkind: NetworkConfig\n{yaml}")).unwrap()
    }

    fn resolve(flags: &[&str], cfg: &NetworkConfig) -> Settings {
        Settings::resolve(&run_args(flags), cfg).unwrap()
    }

    #[test]
    fn node_settings_come_from_the_config_and_flags_win() {
        let config = config("nodePortAddresses: [10.250.0.0/16]\nexternalIPs: {enabled: false}\nnodeLocalDNS: {enabled: true}\n");
        let s = resolve(&[], &config).node;
        assert_eq!(s.node_port_addresses, ["10.250.0.0/16".parse().unwrap()]);
        assert!(s.no_external_ips);
        assert_eq!(s.local_redirects, ["kube-system/kube-dns=169.254.20.10".parse().unwrap()]);

        let s = resolve(&[], &NetworkConfig::default()).node;
        assert_eq!(s, NodeSettings { node_port_addresses: vec![NodePortAddress::Primary], no_external_ips: false, local_redirects: vec![] });

        let s = resolve(
            &[
                "--node-port-addresses",
                "primary,192.168.0.0/16",
                "--no-external-ips",
                "--local-redirect",
                "a/dns=169.254.0.53",
                "--local-redirect",
                "b/otel=fd00::10",
            ],
            &config,
        )
        .node;
        assert_eq!(s.node_port_addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["primary", "192.168.0.0/16"]);
        assert!(s.no_external_ips);
        let r: Vec<String> = s.local_redirects.iter().map(|r| format!("{}={}", r.service, r.address)).collect();
        assert_eq!(r, ["a/dns=169.254.0.53", "b/otel=fd00::10"], "repeatable; replaces the config's rules");

        let a = run_args(&["--local-redirect", "a/dns=169.254.0.53", "--local-redirect", "a/dns=169.254.0.54"]);
        assert!(Settings::resolve(&a, &config).is_err(), "one Service redirected twice is refused");
        for bad in [
            &["--node-port-addresses", "10.0.0.1"][..],
            &["--node-port-addresses", "nonsense/8"],
            &["--local-redirect", "dns=169.254.0.53"],
            &["--local-redirect", "a/dns"],
        ] {
            assert!(Run::try_parse_from(["run"].iter().chain(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_dataplane_takes_the_configs_sizes_and_modes_and_flags_win() {
        let cfg = config("mapSizes: {services: 1024, backends: 2048, sockRevNat: 4096, conntrack: 8192}\nxdp: {mode: native}\n");
        let d = resolve(&[], &cfg).dataplane;
        assert_eq!((d.sizes.services, d.sizes.backends, d.sizes.sock_revnat, d.sizes.conntrack), (1024, 2048, 4096, 8192));
        assert_eq!(d.xdp_mode, XdpMode::Native);
        assert_eq!(d.socket_lb, SocketLb::NodeRoot);
        let d = resolve(&["--map-services=10", "--map-backends=20", "--map-conntrack=30", "--xdp-mode=off", "--cgroup=/run/x"], &cfg).dataplane;
        assert_eq!((d.sizes.services, d.sizes.backends, d.sizes.sock_revnat, d.sizes.conntrack), (10, 20, 4096, 30));
        assert_eq!(d.xdp_mode, XdpMode::Off);
        assert_eq!(d.socket_lb, SocketLb::At("/run/x".into()));
        assert_eq!(resolve(&["--no-socket-lb", "--cgroup=/run/x"], &cfg).dataplane.socket_lb, SocketLb::Off);
        assert_eq!(resolve(&[], &config("socketLB: {enabled: false}\n")).dataplane.socket_lb, SocketLb::Off);
        assert_eq!(resolve(&[], &NetworkConfig::default()).dataplane.xdp_mode, XdpMode::Auto, "the NetworkConfig's default");
    }

    #[test]
    fn upkeep_intervals_and_the_state_directory() {
        let s = resolve(&["--bpffs=/sys/fs/bpf/lab1"], &NetworkConfig::default());
        assert_eq!(s.state_dir, PathBuf::from("/run/gardenet/lab1"));
        assert_eq!(s.conntrack, ConntrackSettings { scan_every: Duration::from_secs(30), closed_hold: Some(Duration::from_secs(10)) });
        assert_eq!((s.source_poll, s.listener_poll), (Duration::from_millis(300), Duration::from_millis(100)));
        let s =
            resolve(&["--conntrack-scan-secs=0", "--conntrack-closed-secs=0", "--state-dir=/tmp/s", "--local-redirect-poll-ms=0"], &NetworkConfig::default());
        assert_eq!(s.conntrack, ConntrackSettings { scan_every: Duration::from_secs(1), closed_hold: None });
        assert_eq!((s.state_dir, s.listener_poll), (PathBuf::from("/tmp/s"), Duration::from_millis(1)));
    }

    #[test]
    fn the_pod_network_is_on_by_default_with_the_configs_mtu_and_masquerade() {
        let cfg = config("mtu: 1400\nmasquerade: {nonMasqueradeCIDRs: [100.64.0.0/10]}\n");
        let p = resolve(&[], &cfg).pod_network.expect("on by default");
        assert_eq!(p.mtu, Some(1400));
        assert_eq!(p.masquerade.non_masquerade_cidrs, ["100.64.0.0/10"]);
        assert_eq!(p.args.cni_conf_dir, PathBuf::from("/etc/cni/net.d"));
        assert!(resolve(&["--pod-network=off"], &cfg).pod_network.is_none());
    }

    #[test]
    fn reserved_ports_follow_what_tc_lb_may_translate() {
        use crate::gardener::config::Interfaces;
        let want = |flags: &[&str], interfaces: &Interfaces, no_snat: bool| {
            let cfg = NetworkConfig { interfaces: interfaces.clone(), ..Default::default() };
            resolve(flags, &cfg).links.reserved_ports(std::path::Path::new("/proc"), no_snat).wanted().to_vec()
        };
        let (np, snat) = (PortRange::new(30000, 32767).unwrap(), PortRange::new(61000, 65535).unwrap());
        let none = Interfaces { include: vec![], ..Default::default() };
        assert_eq!(want(&[], &Interfaces::default(), false), [("NodePorts", np), ("source NAT", snat)]);
        assert_eq!(want(&[], &Interfaces::default(), true), [("NodePorts", np)], "no source NAT on this kernel");
        assert_eq!(want(&["--node-port-range=20000-22767"], &Interfaces::default(), true), [("NodePorts", PortRange::new(20000, 22767).unwrap())]);
        assert_eq!(want(&[], &none, false), [], "socket LB alone translates no packet to the node");
        assert_eq!(want(&["--tc-interface=eth0"], &none, false).len(), 2);
        assert_eq!(want(&["--no-reserve-ports"], &Interfaces::default(), false), []);
        assert!(Run::try_parse_from(["run", "--node-port-range=32767-30000"]).is_err());
    }
}
