//! Which interfaces get gardenet's programs, and why (pure: no netlink, no sysfs).
//!
//! Rules, first match wins:
//! 1. loopback: never (there is no uplink traffic to balance, and programs there would see
//!    every host-local packet twice);
//! 2. gardenet's own devices (name starts with [`OWN_DEVICE_PREFIX`]): never;
//! 3. a name listed with `--interface-force`: always ("forced", with the reason it would
//!    otherwise have been skipped);
//! 4. a name matching an exclude pattern: skipped (exclude wins over include);
//! 5. enslaved (`IFLA_MASTER` set: bridge and bond ports, Azure accelerated-networking VFs
//!    under their synthetic NIC): skipped, because the master carries the traffic;
//! 6. an SR-IOV virtual function (`device/physfn` in sysfs) without a master: skipped, it is
//!    normally handed to a VM or a pod and not the node's uplink;
//! 7. a name matching an include pattern: attached; otherwise skipped.
//!
//! Down interfaces are *selected*: a tc/tcx attachment works on a down device, and attaching
//! early means the programs are in place the moment it comes up (no window in which Service
//! traffic bypasses them). The reason says so, so `gardenet-agent links` does not look
//! wrong for a down uplink.

use serde::{Deserialize, Serialize};

use crate::gardener::config::{Interfaces, Pattern};

/// Names starting with this are devices gardenet creates itself; programs never go there.
pub const OWN_DEVICE_PREFIX: &str = "gardenet";

/// Drivers whose devices are SR-IOV VFs when enslaved: Mellanox ConnectX (Azure's
/// accelerated networking before MANA) and MANA (Azure Boost). The same drivers also run
/// physical NICs, so without a master they are treated as ordinary uplinks.
pub const VF_DRIVERS: &[&str] = &["mlx4_en", "mlx5_core", "mana"];

/// What the selector needs to know about a link (see `watch` for where each field comes from).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkInfo {
    /// ifindex; stable for the life of the device, unlike its name.
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `bond`, ...); `None` for physical NICs.
    pub kind: Option<String>,
    /// The master (`IFLA_MASTER`) as index and name.
    pub master: Option<(u32, String)>,
    pub is_loopback: bool,
    /// Operationally up (`IFLA_OPERSTATE` up, or unknown with `IFF_UP|IFF_LOWER_UP`).
    pub oper_up: bool,
    /// An SR-IOV virtual function (`/sys/class/net/<name>/device/physfn` exists).
    pub is_vf: bool,
    /// Kernel driver (`/sys/class/net/<name>/device/driver`), if the device has one.
    pub driver: Option<String>,
}

impl LinkInfo {
    /// A link with just a name and an index, up, everything else unset (for tests and
    /// callers that build links by hand).
    pub fn named(index: u32, name: &str) -> Self {
        Self { index, name: name.to_owned(), kind: None, master: None, is_loopback: false, oper_up: true, is_vf: false, driver: None }
    }

    /// Whether this looks like an SR-IOV VF: by sysfs, or by a VF driver under a master.
    pub fn is_vf_like(&self) -> bool {
        self.is_vf || (self.master.is_some() && self.driver.as_deref().is_some_and(|d| VF_DRIVERS.contains(&d)))
    }
}

/// The outcome for one link: attach or not, and a human-readable reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub attach: bool,
    pub reason: String,
}

impl Decision {
    fn attach(reason: impl Into<String>) -> Self {
        Self { attach: true, reason: reason.into() }
    }

    fn skip(reason: impl Into<String>) -> Self {
        Self { attach: false, reason: reason.into() }
    }
}

/// Include/exclude patterns plus the forced names. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Selector {
    include: Vec<Pattern>,
    exclude: Vec<Pattern>,
    force: Vec<String>,
}

impl Default for Selector {
    /// The NetworkConfig defaults (`interfaces` block left out), nothing forced.
    fn default() -> Self {
        Self::from_config(&Interfaces::default(), Vec::new())
    }
}

impl Selector {
    pub fn new(include: Vec<Pattern>, exclude: Vec<Pattern>, force: Vec<String>) -> Self {
        Self { include, exclude, force }
    }

    /// Whether any interface could ever be selected (an include pattern or a forced name).
    pub fn may_select(&self) -> bool {
        !self.include.is_empty() || !self.force.is_empty()
    }

    /// From the NetworkConfig's `interfaces` block plus the `--interface-force` names.
    pub fn from_config(interfaces: &Interfaces, force: Vec<String>) -> Self {
        Self::new(interfaces.include.clone(), interfaces.exclude.clone(), force)
    }

    pub fn include(&self) -> &[Pattern] {
        &self.include
    }

    pub fn exclude(&self) -> &[Pattern] {
        &self.exclude
    }

    pub fn force(&self) -> &[String] {
        &self.force
    }

    /// Decides whether programs go on `link`; see the module docs for the rules.
    pub fn decide(&self, link: &LinkInfo) -> Decision {
        if link.is_loopback {
            return Decision::skip("loopback");
        }
        if link.name.starts_with(OWN_DEVICE_PREFIX) {
            return Decision::skip("gardenet's own device");
        }
        let unforced = self.decide_unforced(link);
        let decision = if self.force.contains(&link.name) {
            // Keep the reason it would have been skipped for: a forced VF is a deliberate
            // exception an operator should be able to see.
            if unforced.attach {
                Decision::attach("forced")
            } else {
                Decision::attach(format!("forced (otherwise: {})", unforced.reason))
            }
        } else {
            unforced
        };
        if decision.attach && !link.oper_up {
            return Decision::attach(format!("{}; down, attached anyway (programs run once it is up)", decision.reason));
        }
        decision
    }

    /// Rules 4-7: everything an `--interface-force` overrides.
    fn decide_unforced(&self, link: &LinkInfo) -> Decision {
        let name = link.name.as_str();
        if let Some(p) = self.exclude.iter().find(|p| p.is_match(name)) {
            return Decision::skip(format!("excluded by pattern {}", p.as_str()));
        }
        if let Some((_, master)) = &link.master {
            return if link.is_vf_like() {
                Decision::skip(format!("enslaved to {master} (accelerated networking VF)"))
            } else {
                Decision::skip(format!("enslaved to {master}"))
            };
        }
        if link.is_vf {
            return Decision::skip("SR-IOV virtual function (device/physfn present)");
        }
        match self.include.iter().find(|p| p.is_match(name)) {
            Some(p) => Decision::attach(format!("included by pattern {}", p.as_str())),
            None => Decision::skip("not matched by any include pattern"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The include pattern from the Interfaces issue (the usual systemd/udev data
    /// interface names), for tests that need `wl*`/`ww*` names.
    const ISSUE_INCLUDE: &str = r"^((en|wl|ww|sl|ib)[opsx].*|(eth|wlan|wwan).*)$";

    fn pats(sources: &[&str]) -> Vec<Pattern> {
        sources.iter().map(|s| Pattern::new(s).unwrap()).collect()
    }

    fn decide(sel: &Selector, link: &LinkInfo) -> (bool, String) {
        let d = sel.decide(link);
        (d.attach, d.reason)
    }

    fn enslaved(index: u32, name: &str, master: &str) -> LinkInfo {
        LinkInfo { master: Some((1, master.to_owned())), ..LinkInfo::named(index, name) }
    }

    #[test]
    fn default_selector_uses_network_config_defaults() {
        let sel = Selector::default();
        let defaults = Interfaces::default();
        let want: Vec<&str> = defaults.include.iter().map(|p| p.as_str()).collect();
        let got: Vec<&str> = sel.include().iter().map(|p| p.as_str()).collect();
        assert_eq!(got, want);
        assert_eq!(sel.exclude().iter().map(|p| p.as_str()).collect::<Vec<_>>(), ["^enP"]);
    }

    #[test]
    fn uplinks_are_included_by_pattern() {
        let sel = Selector::default();
        assert_eq!(decide(&sel, &LinkInfo::named(2, "eth1")), (true, format!("included by pattern {ISSUE_INCLUDE}")));
        assert_eq!(decide(&sel, &LinkInfo::named(3, "ens5")), (true, format!("included by pattern {ISSUE_INCLUDE}")));
    }

    #[test]
    fn azure_vf_names_are_excluded() {
        let sel = Selector::default();
        assert_eq!(decide(&sel, &LinkInfo::named(4, "enP30832s1")), (false, "excluded by pattern ^enP".into()));
    }

    #[test]
    fn enslaved_vf_is_skipped_even_without_the_exclude() {
        // The exclude pattern is the first line of defence; the master is the second, for
        // VFs whose names do not follow the enP convention.
        let sel = Selector::new(pats(&[".*"]), vec![], vec![]);
        let vf = LinkInfo { driver: Some("mlx5_core".into()), ..enslaved(5, "enP1s2", "eth0") };
        assert_eq!(decide(&sel, &vf), (false, "enslaved to eth0 (accelerated networking VF)".into()));
        let mana = LinkInfo { driver: Some("mana".into()), ..enslaved(6, "eth1", "eth0") };
        assert_eq!(decide(&sel, &mana), (false, "enslaved to eth0 (accelerated networking VF)".into()));
        // With the default exclude the name rule answers first.
        assert_eq!(decide(&Selector::default(), &vf), (false, "excluded by pattern ^enP".into()));
    }

    #[test]
    fn bridge_and_bond_ports_are_skipped() {
        let sel = Selector::default();
        assert_eq!(decide(&sel, &enslaved(7, "eth2", "br0")), (false, "enslaved to br0".into()));
        assert_eq!(decide(&sel, &enslaved(8, "ens6", "bond0")), (false, "enslaved to bond0".into()));
        // The bond itself is the uplink.
        assert_eq!(decide(&sel, &LinkInfo::named(9, "bond0")), (true, "included by pattern ^bond".into()));
    }

    #[test]
    fn vf_without_master() {
        let sel = Selector::default();
        let vf = LinkInfo { is_vf: true, ..LinkInfo::named(10, "ens7f0v1") };
        assert_eq!(decide(&sel, &vf), (false, "SR-IOV virtual function (device/physfn present)".into()));
        // A VF driver alone does not make a VF: bare-metal ConnectX PFs use it too.
        let pf = LinkInfo { driver: Some("mlx5_core".into()), ..LinkInfo::named(11, "ens1f0") };
        assert_eq!(decide(&sel, &pf), (true, format!("included by pattern {ISSUE_INCLUDE}")));
    }

    #[test]
    fn loopback_is_never_selected_even_when_forced() {
        let sel = Selector::new(pats(&[".*"]), vec![], vec!["lo".into()]);
        let lo = LinkInfo { is_loopback: true, ..LinkInfo::named(1, "lo") };
        assert_eq!(decide(&sel, &lo), (false, "loopback".into()));
    }

    #[test]
    fn own_devices_are_never_selected() {
        let sel = Selector::new(pats(&[".*"]), vec![], vec!["gardenet0".into()]);
        assert_eq!(decide(&sel, &LinkInfo::named(12, "gardenet0")), (false, "gardenet's own device".into()));
    }

    #[test]
    fn virtual_devices_are_not_included() {
        let sel = Selector::default();
        for name in ["docker0", "vethabc", "cni0", "cali1234", "flannel.1", "tunl0"] {
            assert_eq!(decide(&sel, &LinkInfo::named(13, name)), (false, "not matched by any include pattern".into()), "{name}");
        }
    }

    #[test]
    fn wlan_depends_on_include_patterns() {
        // In the NetworkConfig defaults (the issue's pattern), not in a narrower list.
        assert!(Selector::default().decide(&LinkInfo::named(14, "wlan0")).attach);
        assert!(!Selector::new(pats(&["^eth"]), pats(&["^enP"]), vec![]).decide(&LinkInfo::named(14, "wlan0")).attach);
        let sel = Selector::new(pats(&[ISSUE_INCLUDE]), pats(&["^enP"]), vec![]);
        assert_eq!(decide(&sel, &LinkInfo::named(14, "wlan0")), (true, format!("included by pattern {ISSUE_INCLUDE}")));
        for name in ["eth1", "ens5", "wlp2s0", "wwan0", "ibp1s0"] {
            assert!(sel.decide(&LinkInfo::named(15, name)).attach, "{name}");
        }
        for name in ["enP30832s1", "docker0", "vethabc", "bond0", "ethx-not"] {
            let d = sel.decide(&LinkInfo::named(15, name));
            // `ethx-not` matches `(eth).*`: the issue pattern is deliberately loose on eth.
            assert_eq!(d.attach, name == "ethx-not", "{name}: {}", d.reason);
        }
    }

    #[test]
    fn forced_overrides_exclude_master_and_include() {
        let sel = Selector::new(pats(&["^eth"]), pats(&["^enP"]), vec!["enP1s2".into(), "vethabc".into(), "eth1".into()]);
        let vf = LinkInfo { driver: Some("mlx5_core".into()), ..enslaved(5, "enP1s2", "eth0") };
        assert_eq!(decide(&sel, &vf), (true, "forced (otherwise: excluded by pattern ^enP)".into()));
        assert_eq!(decide(&sel, &LinkInfo::named(16, "vethabc")), (true, "forced (otherwise: not matched by any include pattern)".into()));
        assert_eq!(decide(&sel, &LinkInfo::named(2, "eth1")), (true, "forced".into()));
        // Forcing is by exact name, not by pattern.
        assert!(!sel.decide(&LinkInfo::named(17, "vethabcd")).attach);
    }

    #[test]
    fn custom_include_and_exclude_replace_defaults() {
        let sel = Selector::new(pats(&["^docker0$", "^veth"]), pats(&["^vethskip"]), vec![]);
        assert_eq!(decide(&sel, &LinkInfo::named(18, "docker0")), (true, "included by pattern ^docker0$".into()));
        assert!(sel.decide(&LinkInfo::named(19, "vethabc")).attach);
        assert!(!sel.decide(&LinkInfo::named(20, "eth0")).attach);
        assert_eq!(decide(&sel, &LinkInfo::named(21, "vethskip1")), (false, "excluded by pattern ^vethskip".into()));
    }

    #[test]
    fn exclude_wins_over_include() {
        let sel = Selector::new(pats(&["^eth"]), pats(&["^eth1$"]), vec![]);
        assert_eq!(decide(&sel, &LinkInfo::named(2, "eth1")), (false, "excluded by pattern ^eth1$".into()));
        assert!(sel.decide(&LinkInfo::named(3, "eth10")).attach);
    }

    #[test]
    fn no_include_patterns_select_nothing() {
        let sel = Selector::new(vec![], vec![], vec![]);
        assert_eq!(decide(&sel, &LinkInfo::named(2, "eth0")), (false, "not matched by any include pattern".into()));
    }

    #[test]
    fn down_interfaces_are_attached_and_say_so() {
        let sel = Selector::default();
        let down = LinkInfo { oper_up: false, ..LinkInfo::named(2, "eth1") };
        let d = sel.decide(&down);
        assert!(d.attach);
        assert_eq!(d.reason, format!("included by pattern {ISSUE_INCLUDE}; down, attached anyway (programs run once it is up)"));
        // A skipped down interface just gives the skip reason.
        let down = LinkInfo { oper_up: false, ..LinkInfo::named(3, "docker0") };
        assert_eq!(decide(&sel, &down), (false, "not matched by any include pattern".into()));
    }
}
