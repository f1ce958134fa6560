//! Privileged dataplane tests in network namespaces: socket LB and TC LB carrying real TCP and
//! UDP traffic to real servers. Needs root; fails (does not skip) without it.
use std::{
    io::{BufRead, BufReader, Write},
    process::Stdio,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use gardenet_tests::{
    cases::{self, assert_spread},
    lab::{
        assert_connected_udp_leaves_departed_backend, assert_idle_tcp_leaves_departed_backend, assert_udp_flow_leaves_departed_backend, backend_ip,
        backend_name, counts, netkit_json, service_yaml, slice_yaml, Agent, AgentOpts, Lab, SERVER_PORT,
    },
};

/// One lab at a time: tests share the machine's two cores and keep timings sane.
static LOCK: Mutex<()> = Mutex::new(());
fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const VIP: &str = "198.19.0.10";
const PORT: u16 = 80;

fn vip() -> String {
    format!("{VIP}:{PORT}")
}

fn setup(opts: AgentOpts, backends: &[usize]) -> (Lab, Agent) {
    let lab = Lab::new(3).expect("lab");
    let agent =
        Agent::start(&lab, opts, &[("svc.yaml", service_yaml("web", VIP, PORT, &["TCP", "UDP"])), ("eps.yaml", slice_yaml("web", backends, &["TCP", "UDP"]))])
            .expect("agent");
    agent.wait_backends(&format!("{}/tcp", vip()), backends.len()).unwrap();
    agent.wait_backends(&format!("{}/udp", vip()), backends.len()).unwrap();
    (lab, agent)
}

#[test]
fn tcp_via_socket_lb_reaches_all_backends() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    cases::tcp_spreads(&lab, true, &vip(), 300);
}

#[test]
fn udp_via_socket_lb_replies_come_from_the_vip() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    cases::udp_replies_come_from_the_vip(&lab, true, &vip(), 300, true);
}

#[test]
fn getpeername_returns_the_vip() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    cases::getpeername_returns_the_vip(&lab, &vip());
}

#[test]
fn tc_lb_translates_traffic_that_socket_lb_does_not_see() {
    let _g = serial();
    // Socket LB is attached to the lab cgroup, but this client runs outside it: only the TC
    // programs on the node's interface can make the VIP work.
    let (lab, mut agent) = setup(AgentOpts { socket_lb: true, tc: true, ..Default::default() }, &[0, 1, 2]);
    cases::tcp_spreads(&lab, false, &vip(), 300);
    cases::udp_replies_come_from_the_vip(&lab, false, &vip(), 60, false);
    cases::bulk_stays_on_one_backend(&lab, &vip(), 10 << 20);

    // Conntrack as `lb list` shows it, and no failed insertions.
    let (entries, capacity) = agent.conntrack("IPv4").unwrap();
    assert!(entries > 0 && capacity > 0, "{entries} of {capacity}");
    agent.stop();
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("tc_ct_created=") && log.contains("tc_ct_insert_failed=0"), "{log}");
}

/// The bench's peer node (kube-proxy's rules in one ring with TC LB) is a path of its own to
/// the same backends: a VIP that TC LB on the lab's node serves does not answer through it, and
/// its client reaches every backend with the lab node's bridge down.
#[test]
fn the_peer_node_is_a_path_of_its_own_to_the_same_backends() {
    let _g = serial();
    let (mut lab, _agent) = setup(AgentOpts { tc: true, ..Default::default() }, &[0, 1, 2]);
    lab.add_peer_node().expect("peer node");
    let peer_json = |args: &[&str]| netkit_json(lab.peer_client_cmd(args).unwrap(), args).unwrap();
    let v = peer_json(&["connect", "--to", &vip(), "--timeout-ms", "300"]);
    assert_ne!(v["outcome"], "Connected", "no LB on the peer node: {v}");
    // Enough connections that a random pick gives every backend its 15% (30 did not, once).
    cases::tcp_spreads(&lab, false, &vip(), 300);
    lab.node.ip(&["link", "set", "br0", "down"]).unwrap();
    let all = (0..3).map(|i| format!("{}:{SERVER_PORT}", backend_ip(i))).collect::<Vec<_>>().join(",");
    let v = peer_json(&["tcp", "--to", &all, "--count", "30", "--timeout-ms", "1000"]);
    for i in 0..3 {
        assert_eq!(v["counts"][backend_name(i)], 10, "{v}");
    }
    let v = lab.client_json(false, &["connect", "--to", &format!("{}:{SERVER_PORT}", backend_ip(0)), "--timeout-ms", "300"]).unwrap();
    assert_ne!(v["outcome"], "Connected", "the lab's bridge is down: {v}");
}

fn backend_removal(socket_lb: bool) {
    let (lab, agent) = setup(AgentOpts { socket_lb: true, tc: !socket_lb, ..Default::default() }, &[0, 1, 2]);
    let (held, held_out, before) = hold(&lab, socket_lb, 12);
    eprintln!("held connections: {before}");

    // be2 leaves the EndpointSlice.
    agent.write("eps.yaml", &slice_yaml("web", &[0, 2], &["TCP", "UDP"])).unwrap();
    agent.wait_backends(&format!("{}/tcp", vip()), 2).unwrap();
    assert_eq!(
        agent.programmed(&format!("{}/tcp", vip())).unwrap().unwrap(),
        vec![format!("{}:{SERVER_PORT}", backend_ip(0)), format!("{}:{SERVER_PORT}", backend_ip(2))]
    );

    let v = lab.client_json(socket_lb, &["tcp", "--to", &vip(), "--count", "100"]).unwrap();
    eprintln!("after removal: {v}");
    let c = counts(&v);
    assert!(c.iter().all(|(n, _)| n != "be2"), "no new connection may reach the removed backend: {v}");
    assert_eq!(c.iter().map(|(_, n)| n).sum::<u64>(), 100, "{v}");

    let after = release(held, held_out);
    eprintln!("held connections after the update: {after}");
    let names = after["names"].as_array().unwrap();
    let again = after["after"].as_array().unwrap();
    for (n, a) in names.iter().zip(again) {
        if n != "be2" {
            assert_eq!(n, a, "an established connection to {n} broke: {after}");
        }
    }
}

#[test]
fn removed_backend_gets_no_new_connections_socket_lb() {
    let _g = serial();
    backend_removal(true);
}

#[test]
fn removed_backend_gets_no_new_connections_tc_lb() {
    let _g = serial();
    backend_removal(false);
}

#[test]
fn zero_backends_refuse_at_once() {
    let _g = serial();
    let lab = Lab::new(3).expect("lab");
    let mut agent = Agent::start(
        &lab,
        // XDP forced: the lab's interfaces are veths, where `auto` attaches none.
        AgentOpts { socket_lb: true, tc: true, extra: vec!["--xdp-mode=native".into()], ..Default::default() },
        &[("svc.yaml", service_yaml("web", VIP, PORT, &["TCP", "UDP"])), ("eps.yaml", slice_yaml("web", &[], &["TCP", "UDP"]))],
    )
    .unwrap();
    agent.wait_backends(&format!("{}/tcp", vip()), 0).unwrap();
    agent.wait_backends(&format!("{}/udp", vip()), 0).unwrap();
    // Other traffic to the empty frontend never reaches the stack: XDP drops it on the wire
    // side (TC would only see what XDP passed).
    cases::refuses_at_once(&lab, &vip());
    agent.stop();
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("xdp_drop_no_backend=5"), "{log}");
    assert!(log.contains("tc_no_backend_reset=1"), "the SYN went on to TC, which answered it: {log}");
    assert!(log.contains("tc_no_backend_drop=0"), "{log}");
}

#[test]
fn a_direct_connection_reusing_a_translated_flows_port_is_not_rewritten() {
    let _g = serial();
    let (lab, mut agent) = setup(AgentOpts { socket_lb: true, tc: true, ..Default::default() }, &[0, 1, 2]);
    // Through TC LB from a fixed port, then straight to the backend that answered, from the
    // same port: the second flow must not be mistaken for the first one's replies.
    let v = lab.client_json(false, &["tcp", "--to", &vip(), "--count", "1", "--bind-port", "40123"]).unwrap();
    let name = counts(&v)[0].0.clone();
    let i: usize = name.trim_start_matches("be").parse::<usize>().unwrap() - 1;
    let direct = format!("{}:{SERVER_PORT}", backend_ip(i));
    let d = lab.client_json(false, &["tcp", "--to", &direct, "--count", "1", "--bind-port", "40123", "--timeout-ms", "1500"]).unwrap();
    assert_eq!(counts(&d), vec![(name.clone(), 1)], "direct connection after a VIP connection from the same port: {d}");
    // And back to the VIP from that port: translated again.
    let v = lab.client_json(false, &["tcp", "--to", &vip(), "--count", "1", "--bind-port", "40123"]).unwrap();
    assert_eq!(counts(&v).iter().map(|(_, n)| n).sum::<u64>(), 1, "{v}");
    agent.stop();
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("tc_ct_stale_purged=1"), "{log}");
}

/// A long-lived UDP client (one source port) on the TC path: its conntrack entry pins it to a
/// backend. When that backend leaves the Service, the entry is removed (as kube-proxy clears
/// UDP conntrack), so the same socket's next datagrams reach a current backend instead of
/// the departed one for as long as the client keeps talking.
#[test]
fn udp_flows_move_off_a_departed_backend() {
    let _g = serial();
    let (lab, agent) = setup(AgentOpts { tc: true, ..Default::default() }, &[0, 1, 2]);
    assert_udp_flow_leaves_departed_backend(&lab, &agent, &vip(), "eps.yaml", |rest| slice_yaml("web", rest, &["TCP", "UDP"]), 41000);
}

/// A resolver's connected UDP socket through socket LB is moved off a backend that left the
/// Service (see `assert_connected_udp_leaves_departed_backend`).
#[test]
fn connected_udp_sockets_leave_a_departed_backend_socket_lb() {
    let _g = serial();
    let (lab, agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0]);
    assert_connected_udp_leaves_departed_backend(&lab, &agent, &vip(), "eps.yaml", |b| slice_yaml("web", b, &["TCP", "UDP"]));
}

/// Idle TCP connections through socket LB leave a backend that is gone from the Service; busy
/// ones and those to a terminating backend stay (see `assert_idle_tcp_leaves_departed_backend`).
#[test]
fn idle_tcp_sockets_leave_a_backend_gone_from_the_service_socket_lb() {
    let _g = serial();
    let (lab, agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    assert_idle_tcp_leaves_departed_backend(&lab, &agent, &vip(), "eps.yaml", &backend_ip(0), |b| slice_yaml("web", b, &["TCP", "UDP"]));
}

/// `lb list`'s IPv4 conntrack line: (entries, percent full).
fn conntrack_fill(agent: &Agent) -> (usize, usize) {
    let (entries, capacity) = agent.conntrack("IPv4").unwrap();
    (entries, entries * 100 / capacity.max(1))
}

/// Conntrack pressure: with a 4,096-entry conntrack map filled past 90% by short UDP flows,
/// established TCP flows through TC LB keep working, nothing fails to insert, `lb list` shows
/// the fill and the agent reports the pressure (log; the same transition sets the
/// `GardenetMapPressure` Node condition and `gardenet_map_pressure{map="conntrack"}`).
#[test]
fn established_flows_survive_a_conntrack_map_at_ninety_percent() {
    let _g = serial();
    let extra = vec!["--map-conntrack=4096".into(), "--conntrack-scan-secs=1".into()];
    let (lab, mut agent) = setup(AgentOpts { tc: true, extra, ..Default::default() }, &[0, 1, 2]);
    let (held, held_out, before) = hold(&lab, false, 20);

    // Short flows: one datagram from a fresh socket each (a new conntrack flow), in rounds of
    // 200 until the map is at least 90% full (bounded: 30 rounds).
    let mut rounds = 0;
    let (entries, percent) = loop {
        let fill = conntrack_fill(&agent);
        if fill.1 >= 90 {
            break fill;
        }
        assert!(rounds < 30, "conntrack never reached 90%: {fill:?}");
        let v = lab.client_json(false, &["udp", "--to", &vip(), "--count", "200", "--fresh-socket", "--timeout-ms", "500"]).unwrap();
        assert_eq!(counts(&v).iter().map(|(_, n)| n).sum::<u64>(), 200, "every short flow answered: {v}");
        rounds += 1;
    };
    eprintln!("conntrack: {entries} entries ({percent}% of 4096) after {rounds} rounds of 200 short UDP flows");

    // The agent notices within its scan interval (1 s here).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !agent.log.lock().unwrap().iter().any(|l| l.contains("conntrack_ipv4 map") && l.contains("under pressure")) {
        assert!(std::time::Instant::now() < deadline, "no pressure report: {}", agent.log.lock().unwrap().join("\n"));
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    // Every established flow still works, on the backend it had.
    let after = release(held, held_out);
    assert_eq!(after["after"], before["names"], "established flows kept their backends: {after}");
    agent.stop();
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("tc_ct_insert_failed=0"), "{log}");
}

/// Closed flows leave conntrack: 100 short TCP flows through TC LB (each closed with a FIN
/// both ways) are removed by the agent's scan once closed for `--conntrack-closed-secs`,
/// while idle flows and half-closed ones (the client's FIN sent, the backend still to answer)
/// keep their entries through many scans and keep working on their backends.
#[test]
fn closed_tcp_flows_leave_conntrack_while_idle_and_half_closed_ones_stay() {
    let _g = serial();
    let extra = vec!["--conntrack-scan-secs=1".into(), "--conntrack-closed-secs=1".into()];
    let (lab, agent) = setup(AgentOpts { tc: true, extra, ..Default::default() }, &[0, 1, 2]);
    let (idle_p, idle_out, idle_before) = hold(&lab, false, 12);
    let (half_p, half_out, half_before) = hold_with(&lab, false, 6, &["--half-close-ms", "6000"]);
    let open = conntrack_fill(&agent).0;
    assert_eq!(open, 2 * 18, "a forward and a reply entry per open flow");

    let v = lab.client_json(false, &["tcp", "--to", &vip(), "--count", "100"]).unwrap();
    assert_spread(&v, 100);
    let after_short = conntrack_fill(&agent).0;
    eprintln!("conntrack: {open} entries with 18 open flows, {after_short} right after 100 short ones");
    // Bounded wait: the scan runs every second and removes flows closed for a second.
    agent.wait_conntrack("IPv4", Duration::from_secs(20), |n| n == open).unwrap();

    // The open flows kept their entries through the scans: each answers from its backend,
    // the half-closed ones with the answer their backend sends only now.
    let idle_after = release(idle_p, idle_out);
    assert_eq!(idle_after["after"], idle_before["names"], "idle flows kept their backends: {idle_after}");
    let half_after = release(half_p, half_out);
    assert_eq!(half_after["after"], half_before["names"], "half-closed flows got their backends' late answers: {half_after}");
    // Now closed too (the backends closed after answering): removed as well.
    agent.wait_conntrack("IPv4", Duration::from_secs(20), |n| n == 0).unwrap();
}

/// Opens `conns` connections to the VIP that wait for a line on stdin (netkit `hold`).
fn hold(lab: &Lab, socket_lb: bool, conns: u32) -> (std::process::Child, BufReader<std::process::ChildStdout>, serde_json::Value) {
    hold_with(lab, socket_lb, conns, &[])
}

/// `hold` with more of netkit's `hold` options.
fn hold_with(lab: &Lab, socket_lb: bool, conns: u32, more: &[&str]) -> (std::process::Child, BufReader<std::process::ChildStdout>, serde_json::Value) {
    let (to, conns) = (vip(), conns.to_string());
    let args: Vec<&str> = ["hold", "--to", &to, "--conns", &conns].into_iter().chain(more.iter().copied()).collect();
    let mut p = lab.client_cmd(socket_lb, &args).unwrap().stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    (p, out, serde_json::from_str(&line).unwrap())
}

/// Tells a `hold` to check its connections; returns what they answered.
fn release(mut p: std::process::Child, mut out: BufReader<std::process::ChildStdout>) -> serde_json::Value {
    p.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    p.wait().unwrap();
    serde_json::from_str(&line).unwrap()
}

/// An upgrade onto maps of another layout: the agent stops with its links in place (as in a
/// rolling update) and a new one starts with a bigger conntrack map, on pins without a layout
/// version (as a release before the version left them). The conntrack and socket LB maps are
/// migrated (entries copied into new maps, links switched to the new programs), and
/// established connections through TC LB and socket LB keep working on their backends.
#[test]
fn an_upgrade_onto_maps_of_another_size_keeps_established_connections() {
    let _g = serial();
    let opts = AgentOpts { socket_lb: true, tc: true, keep_links: true, extra: vec!["--map-conntrack=4096".into()], ..Default::default() };
    let (lab, mut agent) = setup(opts, &[0, 1, 2]);
    let (tc_p, tc_out, tc_before) = hold(&lab, false, 12);
    // Socket LB connects client:P straight to backend:8080, which is exactly the backend side
    // of a TC LB flow from client:P; sharing an ephemeral port, the programs would take it for
    // the TC flow's client reusing its port and forget that flow. Ports below the ephemeral
    // range keep the two holds apart.
    let (sock_p, sock_out, sock_before) = hold_with(&lab, true, 12, &["--bind-port-base", "20000"]);
    std::fs::remove_file(agent.bpffs.join("GN_LAYOUT")).unwrap();
    agent.set_extra(vec!["--map-conntrack=8192".into()]);
    agent.restart(&lab).unwrap();
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("pinned map GN_CT4:") && log.contains("(layout 0)") && log.contains(": Copy"), "{log}");
    assert!(log.contains("pinned maps migrated"), "{log}");
    assert!(!std::fs::exists(agent.bpffs.join("GN_CT4_old")).unwrap(), "old pins are removed");
    assert!(std::fs::exists(agent.bpffs.join("GN_LAYOUT")).unwrap(), "a map the old release did not have is created");
    assert_eq!(agent.conntrack("IPv4").unwrap().1, 8192);

    let tc_after = release(tc_p, tc_out);
    let sock_after = release(sock_p, sock_out);
    assert_eq!(tc_after["after"], tc_before["names"], "TC LB connections kept their backends: {tc_after}");
    assert_eq!(sock_after["after"], sock_before["names"], "socket LB connections kept their backends: {sock_after}");
    let v = lab.client_json(false, &["tcp", "--to", &vip(), "--count", "150"]).unwrap();
    assert_spread(&v, 150);

    // Started again with the same sizes: everything is adopted as it is.
    let before = agent.log.lock().unwrap().len();
    agent.restart(&lab).unwrap();
    let log = agent.log.lock().unwrap()[before..].join("\n");
    assert!(!log.contains("pinned map GN_"), "nothing to migrate: {log}");
    agent.set_extra(Vec::new());
}
