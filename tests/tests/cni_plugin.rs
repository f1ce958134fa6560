//! The `gardenet` CNI plugin invoked as libcni invokes it (environment, stdin, stdout), in
//! a node namespace with pods in namespaces of their own and host-local delegated from a
//! test-owned `CNI_PATH`: VERSION, ADD/CHECK/DEL round trips in both families, DEL
//! idempotency, a failed ADD, GC, STATUS, bad input, 200 pods of churn, and Kubernetes'
//! "Networking Granular Checks" on one node (pod-pod and node-pod, TCP and UDP).
use std::{collections::BTreeSet, path::Path, process::Stdio};

use gardenet_tests::{
    cni::{Answer, CniNode, NODE_V4, NODE_V6},
    netns::{require_root, sibling_binary, sweep_leftovers, unique_tag, Netns, Proc},
};
use serde_json::{json, Value};

fn setup() -> CniNode {
    require_root();
    sweep_leftovers();
    CniNode::new().expect("CNI node")
}

fn bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

fn add(node: &CniNode, id: &str, pod: &Netns) -> Answer {
    node.invoke("ADD", Some((id, "eth0")), Some(&pod.path()), &bytes(&node.conf("1.0.0"))).unwrap()
}

fn del(node: &CniNode, id: &str, netns: Option<&Path>) -> Answer {
    node.invoke("DEL", Some((id, "eth0")), netns, &bytes(&node.conf("1.0.0"))).unwrap()
}

fn pod_ips(a: &Answer) -> (String, String) {
    let ips: Vec<String> = a.json["ips"].as_array().unwrap().iter().map(|i| i["address"].as_str().unwrap().split('/').next().unwrap().to_owned()).collect();
    let v4 = ips.iter().find(|i| !i.contains(':')).unwrap().clone();
    let v6 = ips.iter().find(|i| i.contains(':')).unwrap().clone();
    (v4, v6)
}

fn netkit(ns: &Netns, args: &[&str]) -> Value {
    let out = ns.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap().args(args).stderr(Stdio::inherit()).output().unwrap();
    assert!(out.status.success(), "netkit {args:?}: {}", out.status);
    serde_json::from_slice(&out.stdout).unwrap()
}

fn serve(ns: &Netns, name: &str) -> Proc {
    let mut cmd = ns.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap();
    cmd.args(["serve", "--name", name, "--port", "8080"]);
    Proc::spawn(cmd, name).unwrap()
}

/// Waits until `name` answers TCP at `to` from `client`, then checks `count` TCP and UDP
/// exchanges all succeed.
fn reaches(client: &Netns, to: &str, name: &str, count: u32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while netkit(client, &["tcp", "--to", to, "--count", "1", "--timeout-ms", "300"])["counts"][name] != 1 {
        assert!(std::time::Instant::now() < deadline, "{name} at {to} never answered");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let n = count.to_string();
    assert_eq!(netkit(client, &["tcp", "--to", to, "--count", &n])["counts"][name], count, "TCP to {to}");
    assert_eq!(netkit(client, &["udp", "--to", to, "--count", &n, "--fresh-socket"])["counts"][name], count, "UDP to {to}");
}

#[test]
fn version_and_bad_input_get_the_specs_answers() {
    let node = setup();
    let v = node.invoke("VERSION", None, None, br#"{"cniVersion":"1.0.0"}"#).unwrap();
    assert!(v.ok);
    assert_eq!(v.json["supportedVersions"], json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]));
    let pod = Netns::new(&unique_tag()).unwrap();
    let conf = node.conf("1.0.0");
    let mut no_ipam = conf.clone();
    no_ipam.as_object_mut().unwrap().remove("ipam");
    let mut bad_version = conf.clone();
    bad_version["cniVersion"] = json!("0.9.9");
    let mut bad_mtu = conf.clone();
    bad_mtu["mtu"] = json!(-1);
    for (stdin, code, what) in [
        (b"not json".to_vec(), 6, "not JSON"),
        (Vec::new(), 6, "empty stdin"),
        (bytes(&json!({"name": "x"})), 7, "no cniVersion"),
        (bytes(&bad_version), 1, "unknown cniVersion"),
        (bytes(&no_ipam), 7, "no ipam"),
        (bytes(&bad_mtu), 7, "bad mtu"),
    ] {
        let a = node.invoke("ADD", Some(("c1", "eth0")), Some(&pod.path()), &stdin).unwrap();
        assert!(!a.ok, "{what}");
        assert_eq!(a.json["code"], code, "{what}: {}", a.json);
        assert!(a.json["msg"].as_str().is_some_and(|m| !m.is_empty()), "{what}");
    }
    // The environment: each missing variable is named, code 4.
    for missing in ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"] {
        let (att, ns) = match missing {
            "CNI_NETNS" => (Some(("c1", "eth0")), None),
            _ => (None, Some(pod.path())),
        };
        let a = node.invoke("ADD", att, ns.as_deref(), &bytes(&conf)).unwrap();
        assert_eq!(a.json["code"], 4, "{missing}: {}", a.json);
    }
    let a = node.invoke("ADD", Some(("c1", "eth0")), Some(Path::new("/nonexistent/netns")), &bytes(&conf)).unwrap();
    assert_eq!(a.json["code"], 4, "{}", a.json);
    let a = node.invoke("ADD", Some(("c1", "bad/name")), Some(&pod.path()), &bytes(&conf)).unwrap();
    assert_eq!(a.json["code"], 4, "{}", a.json);
    assert!(node.host_sides().unwrap().is_empty());
    assert!(node.reservations().is_empty());
}

#[test]
fn add_check_del_round_trip_in_both_families() {
    let node = setup();
    let pod = Netns::new(&unique_tag()).unwrap();
    for version in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let conf = node.conf(version);
        let a = node.invoke("ADD", Some(("c1", "eth0")), Some(&pod.path()), &bytes(&conf)).unwrap();
        assert!(a.ok, "{version}: {}", a.json);
        assert_eq!(a.json["cniVersion"], version);
        assert_eq!(a.json["interfaces"][1]["name"], "eth0");
        assert_eq!(a.json["interfaces"][1]["sandbox"], pod.path().display().to_string());
        assert_eq!(a.json["ips"][0].get("version").is_some(), version < "1.0.0", "{version}: {}", a.json);
        let (v4, v6) = pod_ips(&a);
        assert!(v4.starts_with("198.18.100.") && v6.starts_with("fd00:18:100::"), "{}", a.json);
        assert_eq!(node.reservations().len(), 2);
        assert_eq!(node.host_sides().unwrap().len(), 1);
        if version >= "0.4.0" {
            let mut check = conf.clone();
            check["prevResult"] = a.json.clone();
            let c = node.invoke("CHECK", Some(("c1", "eth0")), Some(&pod.path()), &bytes(&check)).unwrap();
            assert!(c.ok, "CHECK {version}: {}", c.json);
            // CHECK notices a lost address.
            pod.ip(&["addr", "del", &format!("{v4}/32"), "dev", "eth0"]).unwrap();
            let c = node.invoke("CHECK", Some(("c1", "eth0")), Some(&pod.path()), &bytes(&check)).unwrap();
            assert!(!c.ok && c.json["msg"].as_str().unwrap().contains(&v4), "{}", c.json);
        }
        let d = node.invoke("DEL", Some(("c1", "eth0")), Some(&pod.path()), &bytes(&conf)).unwrap();
        assert!(d.ok && d.json.is_null(), "DEL {version}: {}", d.json);
        assert!(node.host_sides().unwrap().is_empty());
        assert!(node.pod_routes().unwrap().is_empty(), "{:?}", node.pod_routes());
        assert!(node.reservations().is_empty());
    }
    // DEL is idempotent: again, without a namespace, for a container never seen.
    for (id, ns) in [("c1", Some(pod.path())), ("c1", None), ("never-added", None), ("never-added", Some(pod.path()))] {
        let d = del(&node, id, ns.as_deref());
        assert!(d.ok, "DEL {id} {ns:?}: {}", d.json);
    }
}

#[test]
fn pods_reach_each_other_and_the_node_in_both_families() {
    let node = setup();
    let (p1, p2) = (Netns::new(&unique_tag()).unwrap(), Netns::new(&unique_tag()).unwrap());
    let (a1, a2) = (add(&node, "c1", &p1), add(&node, "c2", &p2));
    assert!(a1.ok && a2.ok, "{} {}", a1.json, a2.json);
    let ((p1v4, p1v6), (p2v4, p2v6)) = (pod_ips(&a1), pod_ips(&a2));
    let _s1 = serve(&p1, "pod1");
    let _s2 = serve(&p2, "pod2");
    let _sn = serve(&node.ns, "node");
    // Kubernetes' granular checks: intra-node pod-pod, node-pod (http/udp), and back.
    for (client, to, name) in [
        (&p2, format!("{p1v4}:8080"), "pod1"),
        (&p2, format!("[{p1v6}]:8080"), "pod1"),
        (&p1, format!("{p2v4}:8080"), "pod2"),
        (&p1, format!("[{p2v6}]:8080"), "pod2"),
        (&node.ns, format!("{p1v4}:8080"), "pod1"),
        (&node.ns, format!("[{p2v6}]:8080"), "pod2"),
        (&p1, format!("{NODE_V4}:8080"), "node"),
        (&p2, format!("[{NODE_V6}]:8080"), "node"),
    ] {
        reaches(client, &to, name, 20);
    }
    // The receiver sees the sender's pod address (no NAT between pods).
    let peer = netkit(&p2, &["peername", "--to", &format!("{p1v4}:8080")]);
    assert_eq!(peer["name"], "pod1", "{peer}");
    assert!(peer["seen_as"].as_str().is_some_and(|a| a.starts_with(&format!("{p2v4}:"))), "pod1 sees pod2 as {peer}");
    for (id, ns) in [("c1", &p1), ("c2", &p2)] {
        assert!(del(&node, id, Some(&ns.path())).ok);
    }
    assert!(node.host_sides().unwrap().is_empty() && node.reservations().is_empty());
}

#[test]
fn a_failed_add_leaves_nothing_behind() {
    let node = setup();
    let pod = Netns::new(&unique_tag()).unwrap();
    // The pod already has an eth0: the pair cannot be created there.
    pod.ip(&["link", "add", "eth0", "type", "bridge"]).unwrap();
    let a = add(&node, "c1", &pod);
    assert!(!a.ok, "{}", a.json);
    assert!(a.json["msg"].as_str().unwrap().contains("eth0"), "{}", a.json);
    assert!(node.host_sides().unwrap().is_empty(), "{:?}", node.host_sides());
    assert!(node.reservations().is_empty(), "{:?}", node.reservations());
    assert!(node.pod_routes().unwrap().is_empty());
    // host-local itself failing (no such plugin in CNI_PATH) is reported with its cause.
    std::fs::remove_file(node.bin_dir().join("host-local")).unwrap();
    let pod2 = Netns::new(&unique_tag()).unwrap();
    let a = add(&node, "c2", &pod2);
    assert!(!a.ok && a.json["msg"].as_str().unwrap().contains("host-local"), "{}", a.json);
    assert!(node.host_sides().unwrap().is_empty());
}

#[test]
fn gc_releases_everything_of_other_attachments() {
    let node = setup();
    let pods: Vec<Netns> = (0..3).map(|_| Netns::new(&unique_tag()).unwrap()).collect();
    for (i, p) in pods.iter().enumerate() {
        assert!(add(&node, &format!("c{i}"), p).ok);
    }
    assert_eq!(node.reservations().len(), 6);
    let mut gc = node.conf("1.1.0");
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "c1", "ifname": "eth0"}]);
    let a = node.invoke("GC", None, None, &bytes(&gc)).unwrap();
    assert!(a.ok, "{}", a.json);
    assert_eq!(node.host_sides().unwrap().len(), 1);
    assert_eq!(node.reservations().len(), 2);
    // The valid attachment still works.
    let mut check = node.conf("1.1.0");
    check["prevResult"] = json!({"cniVersion": "1.1.0", "interfaces": [{"name": "eth0", "sandbox": pods[1].path()}], "ips": []});
    assert!(node.invoke("CHECK", Some(("c1", "eth0")), Some(&pods[1].path()), &bytes(&check)).unwrap().ok);
    gc["cni.dev/valid-attachments"] = json!([]);
    assert!(node.invoke("GC", None, None, &bytes(&gc)).unwrap().ok);
    assert!(node.host_sides().unwrap().is_empty() && node.reservations().is_empty());
}

#[test]
fn status_is_not_available_until_the_agent_has_programmed_the_node() {
    let node = setup();
    let conf = bytes(&node.conf("1.1.0"));
    let a = node.invoke("STATUS", None, None, &conf).unwrap();
    assert!(!a.ok);
    assert_eq!(a.json["code"], 50, "{}", a.json);
    std::fs::write(node.dir.join("ready"), "").unwrap();
    let a = node.invoke("STATUS", None, None, &conf).unwrap();
    assert!(a.ok && a.json.is_null(), "{}", a.json);
    std::fs::remove_file(node.bin_dir().join("host-local")).unwrap();
    let a = node.invoke("STATUS", None, None, &conf).unwrap();
    assert_eq!(a.json["code"], 50, "{}", a.json);
}

#[test]
fn two_hundred_pods_created_concurrently_and_removed_leave_nothing_behind() {
    let node = setup();
    // Under software emulation (the kernel matrix's VMs) every exec costs a hundred times
    // more: 40 pods there check the same kernel behaviour.
    let n = if std::env::var_os("GARDENET_EMULATED").is_some() { 40 } else { 200 };
    let pods: Vec<Netns> = (0..n).map(|_| Netns::new(&unique_tag()).unwrap()).collect();
    // Four runtimes' worth of concurrent ADDs: host-local's lock keeps addresses unique.
    let answers: Vec<(usize, Answer)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (node, pods) = (&node, &pods);
                s.spawn(move || (t..pods.len()).step_by(4).map(|i| (i, add(node, &format!("pod{i}"), &pods[i]))).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut seen = BTreeSet::new();
    for (i, a) in &answers {
        assert!(a.ok, "pod{i}: {}", a.json);
        let (v4, v6) = pod_ips(a);
        assert!(seen.insert(v4.clone()) && seen.insert(v6.clone()), "pod{i} got an address twice: {v4} {v6}");
    }
    assert_eq!(node.host_sides().unwrap().len(), n);
    assert_eq!(node.reservations().len(), 2 * n);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (node, pods) = (&node, &pods);
            s.spawn(move || {
                for i in (t..pods.len()).step_by(4) {
                    let d = del(node, &format!("pod{i}"), Some(&pods[i].path()));
                    assert!(d.ok, "DEL pod{i}: {}", d.json);
                }
            });
        }
    });
    assert!(node.host_sides().unwrap().is_empty(), "{:?}", node.host_sides());
    assert!(node.pod_routes().unwrap().is_empty(), "{:?}", node.pod_routes());
    assert!(node.reservations().is_empty(), "{:?}", node.reservations());
    for p in &pods {
        let out = p.command("ip", None).unwrap().args(["-o", "link", "show"]).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1, "only lo is left in {}", p.name);
    }
}

/// The agent installs the pod network: plugins into `--cni-bin-dir`, and once its Node's
/// `spec.podCIDRs` are known and the node is programmed, `10-gardenet.conflist` (MTU from
/// the interface holding the node's InternalIP) and the marker STATUS looks for. A pod
/// created through what it installed gets its address from the Node's pod CIDRs; a changed
/// Node rewrites the conflist; an agent that removes the dataplane on exit withdraws the
/// marker and leaves the conflist.
#[test]
fn the_agent_installs_the_plugins_and_the_conflist_for_its_nodes_pod_cidrs() {
    use gardenet_tests::lab::{Agent, AgentOpts};
    let node = setup();
    let wire = Netns::new(&unique_tag()).unwrap();
    node.ns.ip(&["link", "add", "up0", "mtu", "1450", "type", "veth", "peer", "name", "up1", "netns", &wire.name]).unwrap();
    // The wire: an outside host that knows nothing of pods (no route to their CIDRs).
    node.ns.ip(&["addr", "add", "198.18.1.1/24", "dev", "up0"]).unwrap();
    node.ns.ip(&["-6", "addr", "add", "fd00:18:1::1/64", "dev", "up0", "nodad"]).unwrap();
    node.ns.ip(&["link", "set", "up0", "up"]).unwrap();
    wire.ip(&["addr", "add", "198.18.1.2/24", "dev", "up1"]).unwrap();
    wire.ip(&["-6", "addr", "add", "fd00:18:1::2/64", "dev", "up1", "nodad"]).unwrap();
    wire.ip(&["link", "set", "up1", "up"]).unwrap();
    let (bin, conf_dir, state) = (node.dir.join("agent-bin"), node.dir.join("net.d"), node.dir.join("state"));
    let target = sibling_binary("gardenet").unwrap().parent().unwrap().to_path_buf();
    let node_yaml = |cidrs: &str| {
        format!("apiVersion: v1\nkind: Node\nmetadata: {{name: lab-node}}\nspec: {{podCIDRs: [{cidrs}]}}\nstatus:\n  addresses: [{{type: InternalIP, address: 198.18.1.1}}, {{type: InternalIP, address: \"fd00:18:1::1\"}}]\n")
    };
    let opts = AgentOpts {
        extra: vec![
            "--pod-network=on".into(),
            format!("--cni-bin-dir={}", bin.display()),
            format!("--cni-conf-dir={}", conf_dir.display()),
            format!("--cni-state-dir={}", state.display()),
            format!("--cni-plugins-from={},/usr/lib/cni", target.display()),
        ],
        ..Default::default()
    };
    let tag = unique_tag();
    let mut agent = Agent::start_in(&tag, &node.ns, None, opts, &[("node.yaml", node_yaml("198.18.100.0/24, \"fd00:18:100::/64\""))]).unwrap();
    for p in ["gardenet", "host-local", "portmap"] {
        assert!(bin.join(p).is_file(), "{p} installed");
    }
    let conflist_path = conf_dir.join("10-gardenet.conflist");
    let conflist: Value = serde_json::from_slice(&std::fs::read(&conflist_path).expect("conflist written by the time the agent is ready")).unwrap();
    let plugin = &conflist["plugins"][0];
    assert_eq!(plugin["type"], "gardenet");
    assert_eq!(plugin["mtu"], 1450, "the MTU of the interface with the node's InternalIP");
    assert_eq!(plugin["ipam"]["ranges"], json!([[{"subnet": "198.18.100.0/24"}], [{"subnet": "fd00:18:100::/64"}]]));
    assert!(std::fs::read_dir(&conf_dir).unwrap().count() == 1, "no temporary file left");
    // The runtime's view: the network's cniVersion and name with the plugin's own keys.
    let mut conf = plugin.clone();
    conf["cniVersion"] = conflist["cniVersion"].clone();
    conf["name"] = conflist["name"].clone();
    let installed = bin.join("gardenet");
    let run = |cmd: &str, att: Option<(&str, &str)>, ns: Option<&Path>, conf: &Value| node.invoke_from(&installed, &bin, cmd, att, ns, &bytes(conf)).unwrap();
    let mut status = conf.clone();
    status["cniVersion"] = json!("1.1.0");
    assert!(run("STATUS", None, None, &status).ok, "STATUS once the agent is ready");
    let pod = Netns::new(&unique_tag()).unwrap();
    let a = run("ADD", Some(("agentpod", "eth0")), Some(&pod.path()), &conf);
    assert!(a.ok, "{}", a.json);
    assert!(pod_ips(&a).0.starts_with("198.18.100."), "{}", a.json);
    let (v4, v6) = pod_ips(&a);
    let _s = serve(&node.ns, "node");
    let _o = serve(&wire, "outside");
    reaches(&pod, "198.18.1.1:8080", "node", 5);
    // Leaving the pod network: masqueraded to the node's address (the outside host has no
    // route back to pods); to the node itself: the pod's own address.
    for (to, name, seen) in [
        ("198.18.1.2:8080", "outside", "198.18.1.1:"),
        ("[fd00:18:1::2]:8080", "outside", "[fd00:18:1::1]:"),
        ("198.18.1.1:8080", "node", &format!("{v4}:") as &str),
        ("[fd00:18:1::1]:8080", "node", &format!("[{v6}]:")),
    ] {
        reaches(&pod, to, name, 5);
        let p = netkit(&pod, &["peername", "--to", to]);
        assert!(p["seen_as"].as_str().is_some_and(|s| s.starts_with(seen)), "{to} sees the pod as {p}, expected {seen}...");
    }
    assert!(run("DEL", Some(("agentpod", "eth0")), Some(&pod.path()), &conf).ok);
    // A changed Node rewrites the conflist.
    agent.write("node.yaml", &node_yaml("198.18.101.0/24")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&conflist_path).unwrap();
        if text.contains("198.18.101.0/24") {
            assert!(!text.contains("fd00:18:100::/64"), "{text}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "conflist not rewritten: {text}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // --detach-on-exit (the lab's default): the dataplane goes, STATUS says so; the
    // conflist stays for the next agent.
    agent.stop();
    let s = run("STATUS", None, None, &status);
    assert_eq!(s.json["code"], 50, "{}", s.json);
    assert!(conflist_path.is_file());
    let tables = node.ns.command("nft", None).unwrap().args(["list", "tables"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&tables.stdout).contains("gardenet_masq"), "masquerade rules removed with the dataplane");
}
