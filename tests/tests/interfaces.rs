//! Privileged interface-selection tests: which interfaces get programs (checked through the
//! kernel, not the agent's own view), live tracking, no stacking, and foreign programs left
//! alone. Needs root; fails (does not skip) without it.
use std::{
    process::Command,
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use gardenet_agent::links::pinned::AttachType;
use gardenet_tests::{
    lab::{Agent, AgentOpts},
    netns::{require_root, sweep_leftovers, unique_tag, Netns},
};

static LOCK: Mutex<()> = Mutex::new(());
fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A namespace with the interface zoo of the issue. The kernel here has veth and bridge but
/// no dummy or bonding driver: veth pairs (peers named `p-*`) and bridges stand in.
fn zoo() -> (String, Netns) {
    require_root();
    sweep_leftovers();
    let tag = unique_tag();
    let ns = Netns::new(&format!("{tag}-ifs")).unwrap();
    for (name, peer) in [("eth1", "p-eth1"), ("ens5", "p-ens5"), ("enP30832s1", "p-enp3"), ("enP1s2", "p-enp1"), ("vethabc", "p-vabc")] {
        ns.ip(&["link", "add", name, "type", "veth", "peer", "name", peer]).unwrap();
        ns.ip(&["link", "set", name, "up"]).unwrap();
        ns.ip(&["link", "set", peer, "up"]).unwrap();
    }
    // The synthetic NIC (eth0) with the accelerated-networking VF enslaved to it, and docker0.
    for br in ["eth0", "docker0"] {
        ns.ip(&["link", "add", br, "type", "bridge"]).unwrap();
        ns.ip(&["link", "set", br, "up"]).unwrap();
    }
    ns.ip(&["link", "set", "enP1s2", "master", "eth0"]).unwrap();
    (tag, ns)
}

fn gardenet_hooks(ns: &Netns, iface: &str) -> Vec<String> {
    let mut v = Vec::new();
    for ty in [AttachType::TcxIngress, AttachType::TcxEgress] {
        v.extend(ns.tc_programs(iface, ty).unwrap_or_default().into_iter().filter(|n| n.starts_with("gn_")));
    }
    v
}

fn links_json(ns: &Netns, agent: &Agent) -> serde_json::Value {
    let mut cmd = ns.command(&agent.bin, None).unwrap();
    cmd.args(["links", "--json", "--bpffs"]).arg(&agent.bpffs);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn row<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v.as_array().unwrap().iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("{name} missing: {v}"))
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}

/// XDP forced to generic: `auto` attaches none on veth, and native XDP does not exist on the
/// bridge standing in for eth0.
fn start(tag: &str, ns: &Netns, keep_links: bool) -> Agent {
    Agent::start_in(tag, ns, None, AgentOpts { keep_links, extra: vec!["--xdp-mode=generic".into()], ..Default::default() }, &[]).unwrap()
}

#[test]
fn exactly_the_data_interfaces_get_programs_with_reasons() {
    let _g = serial();
    let (tag, ns) = zoo();
    let agent = start(&tag, &ns, false);
    for iface in ["eth0", "eth1", "ens5"] {
        assert_eq!(gardenet_hooks(&ns, iface), ["gn_tc_ingress", "gn_tc_egress"], "{iface}");
    }
    for iface in ["enP30832s1", "enP1s2", "lo", "docker0", "vethabc", "p-eth1"] {
        assert!(gardenet_hooks(&ns, iface).is_empty(), "{iface} must not be touched");
    }
    let v = links_json(&ns, &agent);
    eprintln!("{}", serde_json::to_string_pretty(&v).unwrap());
    let reason = |n: &str| row(&v, n)["reason"].as_str().unwrap().to_string();
    assert!(reason("eth1").starts_with("included by pattern"), "{}", reason("eth1"));
    assert_eq!(reason("enP30832s1"), "excluded by pattern ^enP");
    assert!(reason("enP1s2").starts_with("excluded by pattern ^enP") || reason("enP1s2").contains("enslaved to eth0"), "{}", reason("enP1s2"));
    assert_eq!(reason("lo"), "loopback");
    assert_eq!(reason("docker0"), "not matched by any include pattern");
    assert_eq!(reason("vethabc"), "not matched by any include pattern");
    let hooks = |n: &str| row(&v, n)["hooks"].as_array().unwrap().iter().map(|h| h.as_str().unwrap().to_string()).collect::<Vec<_>>();
    let eth1 = hooks("eth1");
    assert!(eth1.contains(&"tc/ingress".to_string()) && eth1.contains(&"tc/egress".to_string()), "{eth1:?}");
    assert!(eth1.iter().any(|h| h.starts_with("xdp/")), "XDP on the selected wire-side interface: {eth1:?}");
    assert!(hooks("enP30832s1").is_empty());
}

#[test]
fn an_enslaved_vf_is_skipped_even_when_its_name_matches() {
    let _g = serial();
    let (tag, ns) = zoo();
    // A VF with an ordinary name, enslaved to the synthetic NIC.
    ns.ip(&["link", "add", "eth9", "type", "veth", "peer", "name", "p-eth9"]).unwrap();
    ns.ip(&["link", "set", "eth9", "master", "eth0"]).unwrap();
    let agent = start(&tag, &ns, false);
    assert!(gardenet_hooks(&ns, "eth9").is_empty());
    let v = links_json(&ns, &agent);
    assert_eq!(row(&v, "eth9")["reason"], "enslaved to eth0");
}

#[test]
fn interfaces_are_tracked_live() {
    let _g = serial();
    let (tag, ns) = zoo();
    let agent = start(&tag, &ns, false);
    // Added while running: attached within a second.
    ns.ip(&["link", "add", "eth2", "type", "veth", "peer", "name", "p-eth2"]).unwrap();
    let took = wait_until("eth2 attached", Duration::from_secs(1), || gardenet_hooks(&ns, "eth2").len() == 2);
    eprintln!("new interface attached after {took:?}");
    // Renamed to an excluded name: detached; renamed back: attached again.
    ns.ip(&["link", "set", "eth2", "name", "enP9s9"]).unwrap();
    wait_until("enP9s9 detached", Duration::from_secs(1), || gardenet_hooks(&ns, "enP9s9").is_empty());
    ns.ip(&["link", "set", "enP9s9", "name", "eth2"]).unwrap();
    wait_until("eth2 re-attached", Duration::from_secs(1), || gardenet_hooks(&ns, "eth2").len() == 2);
    // Deleted: forgotten cleanly, no error loop.
    ns.ip(&["link", "del", "eth2"]).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let log = agent.log.lock().unwrap().join("\n");
    let errors = log.lines().filter(|l| l.contains("eth2") && (l.contains("WARN") || l.contains("ERROR"))).count();
    assert_eq!(errors, 0, "no error loop after the interface vanished:\n{log}");
    let v = links_json(&ns, &agent);
    assert!(v.as_array().unwrap().iter().all(|r| r["name"] != "eth2"), "{v}");
}

#[test]
fn restarts_do_not_stack_and_foreign_filters_survive() {
    let _g = serial();
    let (tag, ns) = zoo();
    let tc = |args: &[&str]| {
        let out = Command::new("tc").args(["-n", &ns.name]).args(args).output().unwrap();
        assert!(out.status.success(), "tc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Another tool's classic tc filter on a selected interface.
    tc(&["qdisc", "add", "dev", "eth1", "clsact"]);
    // (this kernel has cls_u32 but neither cls_matchall nor act_gact)
    tc(&["filter", "add", "dev", "eth1", "ingress", "pref", "7", "protocol", "all", "u32", "match", "u32", "0", "0", "classid", "1:1"]);
    let foreign = || tc(&["filter", "show", "dev", "eth1", "ingress"]).contains("u32");
    let mut agent = start(&tag, &ns, true);
    assert!(foreign());
    agent.restart_in(&ns, None).unwrap();
    agent.restart_in(&ns, None).unwrap();
    for iface in ["eth1", "ens5"] {
        assert_eq!(gardenet_hooks(&ns, iface), ["gn_tc_ingress", "gn_tc_egress"], "one program per hook on {iface} after restarts");
    }
    assert!(foreign(), "the foreign filter survives restarts");
    // `links` tells ours from the other tool's, on tcx and on clsact kernels alike.
    let v = links_json(&ns, &agent);
    let eth1: Vec<&str> = row(&v, "eth1")["hooks"].as_array().unwrap().iter().filter_map(|h| h.as_str()).collect();
    assert_eq!(eth1.iter().filter(|h| **h == "tc/ingress").count(), 1, "{eth1:?}");
    assert!(eth1.contains(&"tc/ingress(foreign:u32 pref 7)"), "{eth1:?}");
    let mut cmd = ns.command(&agent.bin, None).unwrap();
    let table = cmd.args(["links", "--bpffs"]).arg(&agent.bpffs).output().unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    let features = gardenet_agent::dataplane::features::KernelFeatures::probe();
    assert!(table.contains(&features.summary()), "links shows the kernel's facilities and fallbacks:\n{table}");
    // Stop for good with --detach-on-exit: ours go, the foreign filter stays.
    agent.stop();
    let mut agent = Agent::start_in(&tag, &ns, None, AgentOpts::default(), &[]).unwrap();
    agent.stop();
    // A clean stop logs no error (the link watch once took its own socket's close for a failure).
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("detached all programs"), "the stop's last lines are in the log:\n{log}");
    assert!(!log.lines().any(|l| l.contains("ERROR")), "errors on a clean stop:\n{log}");
    assert!(gardenet_hooks(&ns, "eth1").is_empty());
    assert!(foreign(), "the foreign filter survives the agent's stop");
}
