//! The demo: real Service load balancing on this machine, no cluster needed.
//!
//! Builds a client, a node and three backend "pods" in network namespaces, runs
//! `gardenet-agent run --source dir:...` on the node with one ClusterIP Service, sends a few
//! hundred TCP and UDP requests to the VIP through socket LB and through TC LB, prints who
//! answered, and tears everything down (also on Ctrl-C or failure).
use std::process::ExitCode;

use anyhow::{bail, Result};
use gardenet_tests::{
    interrupt,
    lab::{backend_ip, backend_name, counts, service_yaml, slice_yaml, Agent, AgentOpts, Lab, CLIENT_IP, SERVER_PORT},
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
