//! The demo: real Service load balancing on this machine, no cluster needed.
//!
//! Builds a client, a node and three backend "pods" in network namespaces, runs
//! `gardenet-agent run --source dir:...` on the node with one ClusterIP Service, sends a few
//! hundred TCP and UDP requests to the VIP through socket LB and through TC LB, prints who
//! answered; then the pod network: pods created by podman through the CNI plugin the agent
//! installed, reaching a Service whose backends are pods. Tears everything down (also on
//! Ctrl-C or failure).
use std::process::ExitCode;

use anyhow::{bail, Result};
use gardenet_tests::{
    interrupt,
    lab::{backend_ip, backend_name, counts, service_yaml, service_yaml_dual, slice_yaml, Agent, AgentOpts, Lab, CLIENT_IP, SERVER_PORT},
    netns::{sibling_binary, Proc},
    podman::Pod,
    podnode::{PodNode, OUTSIDE_IP},
};

const VIP: &str = "198.19.0.10";
const PORT: u16 = 80;
const N: u32 = 300;

fn main() -> ExitCode {
    interrupt::install();
    match demo() {
        Ok(()) => {
            println!("\nEverything torn down (namespaces, programs, pins, cgroup).");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("\ndemo failed: {e:#}\n(everything it created has been torn down)");
            ExitCode::FAILURE
        }
    }
}

fn row(label: &str, v: &serde_json::Value) {
    let c = counts(v);
    let total: u64 = c.iter().map(|(_, n)| n).sum();
    let cells: Vec<String> = (0..3)
        .map(|i| {
            let n = c.iter().find(|(k, _)| *k == backend_name(i)).map_or(0, |(_, n)| *n);
            format!("{n:>5} ({:>4.1}%)", if total > 0 { 100.0 * n as f64 / total as f64 } else { 0.0 })
        })
        .collect();
    let errs = v["errors"].as_object().map_or(0, |e| e.values().filter_map(|x| x.as_u64()).sum::<u64>());
    println!("  {label:<40} {}   errors: {errs}", cells.join("  "));
}

fn demo() -> Result<()> {
    services()?;
    interrupt::check()?;
    pod_network()
}

fn services() -> Result<()> {
    println!("gardenet demo: one ClusterIP Service, three backends, real TCP and UDP traffic\n");
    let lab = Lab::new(3)?;
    println!("  client   {CLIENT_IP}   (namespace {})", lab.client.name);
    println!("  node     198.18.0.1 / 198.18.1.1   (namespace {}, runs gardenet-agent)", lab.node.name);
    for i in 0..3 {
        println!("  {}      {}:{SERVER_PORT}   (namespace {}, TCP+UDP server)", backend_name(i), backend_ip(i), lab.backends[i].name);
    }
    interrupt::check()?;

    let svc = service_yaml("web", VIP, PORT, &["TCP", "UDP"]);
    let eps = slice_yaml("web", &[0, 1, 2], &["TCP", "UDP"]);
    let agent = Agent::start(&lab, AgentOpts { socket_lb: true, tc: true, ..Default::default() }, &[("svc.yaml", svc.clone()), ("eps.yaml", eps)])?;
    println!("\nService ({}/svc.yaml, read by `gardenet-agent run --source dir:{}`):\n", agent.dir.display(), agent.dir.display());
    for l in svc.lines() {
        println!("    {l}");
    }
    agent.wait_backends(&format!("{VIP}:{PORT}/tcp"), 3)?;
    agent.wait_backends(&format!("{VIP}:{PORT}/udp"), 3)?;
    println!("\n`gardenet-agent lb list` (read from the pinned maps by a second process):\n");
    let out = std::process::Command::new(&agent.bin).args(["lb", "list", "--bpffs"]).arg(&agent.bpffs).output()?;
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        println!("    {l}");
    }
    interrupt::check()?;

    let to = format!("{VIP}:{PORT}");
    let n = N.to_string();
    println!("\n{N} requests to {to} per path; answers per backend:\n");
    println!("  {:<40} {:>14}  {:>14}  {:>14}", "path", "be1", "be2", "be3");
    let tcp_sock = lab.client_json(true, &["tcp", "--to", &to, "--count", &n])?;
    row("TCP via socket LB (connect4)", &tcp_sock);
    interrupt::check()?;
    let udp_sock = lab.client_json(true, &["udp", "--to", &to, "--count", &n])?;
    row("UDP via socket LB (sendmsg4)", &udp_sock);
    interrupt::check()?;
    let tcp_tc = lab.client_json(false, &["tcp", "--to", &to, "--count", &n])?;
    row("TCP via TC LB (client outside cgroup)", &tcp_tc);
    interrupt::check()?;
    // A fresh socket per datagram: one socket is one conntrack flow, pinned to one backend.
    let udp_tc = lab.client_json(false, &["udp", "--to", &to, "--count", &n, "--fresh-socket"])?;
    row("UDP via TC LB (new flow each)", &udp_tc);
    for (what, v) in [("socket LB", &udp_sock), ("TC LB", &udp_tc)] {
        let src: Vec<String> = v["sources"].as_object().into_iter().flatten().map(|(k, n)| format!("{k} x{n}")).collect();
        println!("  UDP replies via {what} came from: {}", src.join(", "));
    }
    let peer = lab.client_json(true, &["peername", "--to", &to])?;
    println!("  getpeername() on a socket-LB connection: {} (served by {})", peer["peer"].as_str().unwrap_or("?"), peer["name"].as_str().unwrap_or("?"));
    interrupt::check()?;

    println!("\nScaling down: be2 leaves the EndpointSlice (make-before-break update)...");
    agent.write("eps.yaml", &slice_yaml("web", &[0, 2], &["TCP", "UDP"]))?;
    agent.wait_backends(&format!("{VIP}:{PORT}/tcp"), 2)?;
    let after = lab.client_json(true, &["tcp", "--to", &to, "--count", "100"])?;
    row("TCP via socket LB, after scale-down", &after);
    interrupt::check()?;

    println!("\nNo backends at all: connections are refused at once instead of timing out...");
    agent.write("eps.yaml", &slice_yaml("web", &[], &["TCP", "UDP"]))?;
    agent.wait_backends(&format!("{VIP}:{PORT}/tcp"), 0)?;
    for (label, sock) in [("socket LB", true), ("TC LB", false)] {
        let v = lab.client_json(sock, &["connect", "--to", &to, "--timeout-ms", "3000"])?;
        println!("  {label:<10} {} after {:.2} ms", v["outcome"].as_str().unwrap_or("?"), v["elapsed_ms"].as_f64().unwrap_or(0.0));
    }
    let all_ok = [&tcp_sock, &udp_sock, &tcp_tc, &udp_tc].iter().all(|v| counts(v).len() == 3);
    if !all_ok {
        bail!("not every backend answered on every path");
    }
    Ok(())
}

/// Pods created by a real container runtime through the CNI plugin the agent installed,
/// reaching each other, the outside (as the node) and a Service whose backends are pods.
fn pod_network() -> Result<()> {
    println!("\n\nPod network: the agent installs the gardenet CNI plugin and its conflist; podman (CNI");
    println!("backend: libcni, as containerd and CRI-O call plugins) creates pods through them\n");
    let n = PodNode::new()?;
    let conflist = n.node.dir.join("net.d/10-gardenet.conflist");
    let text = std::fs::read_to_string(&conflist)?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    println!(
        "  {} (written by the agent): pod CIDRs {}, MTU {}",
        conflist.display(),
        v["plugins"][0]["ipam"]["ranges"]
            .as_array()
            .map(|r| r.iter().map(|x| x[0]["subnet"].as_str().unwrap_or("?")).collect::<Vec<_>>().join(" + "))
            .unwrap_or_default(),
        v["plugins"][0]["mtu"]
    );
    let pods: Vec<Pod> = (0..3).map(|i| n.runtime.run_pod(&format!("pod{i}"), "gardenet", &[])).collect::<Result<_>>()?;
    let mut addrs = Vec::new();
    for p in &pods {
        let (v4, v6) = n.runtime.addresses(&p.name)?;
        println!("  {}  {v4:<15} {v6:<18} (podman pod, pid {})", p.name, p.pid);
        addrs.push((v4, v6));
    }
    interrupt::check()?;
    let _servers: Vec<_> = pods[1..].iter().map(|p| n.serve(p)).collect();
    let _outside = {
        let mut cmd = n.wire.command(sibling_binary("gardenet-netkit")?, None)?;
        cmd.args(["serve", "--name", "outside", "--port", "8080"]);
        Proc::spawn(cmd, "outside")?
    };
    let slice = |family: &str, ips: Vec<&String>| {
        let eps: Vec<String> = ips.iter().map(|a| format!("  - addresses: [\"{a}\"]\n    conditions: {{ready: true}}")).collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: pods-{family}, namespace: lab, labels: {{kubernetes.io/service-name: pods}}}}\naddressType: {family}\nports:\n  - {{name: p-tcp, port: 8080, protocol: TCP}}\nendpoints:\n{}\n",
            eps.join("\n")
        )
    };
    n.agent.write("pods.yaml", &service_yaml_dual("pods", "198.19.0.20", "fd00:19::20", 80, &["TCP"]))?;
    n.agent.write("pods-v4.yaml", &slice("IPv4", addrs[1..].iter().map(|a| &a.0).collect()))?;
    n.agent.write("pods-v6.yaml", &slice("IPv6", addrs[1..].iter().map(|a| &a.1).collect()))?;
    n.agent.wait_backends("198.19.0.20:80/tcp", 2)?;
    println!("\n  Service pods (198.19.0.20, fd00:19::20) with backends pod1 and pod2, 100 connections each from pod0:");
    for vip in ["198.19.0.20:80", "[fd00:19::20]:80"] {
        let v = n.netkit(&pods[0], &["tcp", "--to", vip, "--count", "100"]);
        println!("    {vip:<18} pod1 {:>3}  pod2 {:>3}", v["counts"]["pod1"].as_u64().unwrap_or(0), v["counts"]["pod2"].as_u64().unwrap_or(0));
    }
    for (to, what) in [(format!("{}:8080", addrs[2].0), "pod2 directly"), (format!("{OUTSIDE_IP}:8080"), "a host outside the cluster")] {
        let p = n.netkit(&pods[0], &["peername", "--to", &to]);
        println!("  pod0 -> {what:<27} seen as {}", p["seen_as"].as_str().unwrap_or("?"));
    }
    for p in &pods {
        n.runtime.rm(&p.name)?;
    }
    let left = n.node.host_sides()?.len() + n.node.pod_routes()?.len();
    println!("\n  pods removed (the runtime called DEL): {left} pod interfaces or routes left on the node");
    if left > 0 {
        bail!("the pod network left {left} interfaces or routes behind");
    }
    Ok(())
}
