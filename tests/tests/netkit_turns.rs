//! `gardenet-netkit tcp --turn-in/--turn-out`, which the dataplane benchmark uses to measure
//! the modes of a phase side by side: clients in a ring of FIFOs make their connections in
//! blocks, one client at a time. Unprivileged: one server on loopback.
use std::{
    net::{Ipv4Addr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

const NETKIT: &str = env!("CARGO_BIN_EXE_gardenet-netkit");

/// The server; killed on drop, also when an assertion fails.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server() -> (Server, u16) {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
    let child = Command::new(NETKIT).args(["serve", "--name", "s1", "--addr", "127.0.0.1", "--port", &port.to_string()]).spawn().unwrap();
    let s = Server(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !answers(port) {
        assert!(Instant::now() < deadline, "netkit serve on 127.0.0.1:{port} does not answer");
        std::thread::sleep(Duration::from_millis(20));
    }
    (s, port)
}

/// Whether the server answers with its name, asked the way the lab asks its servers (one
/// `netkit tcp` connection). Once (CI, 2026-12-02) the readiness check was a bare connect and
/// the ring's first block then met a refused port; the cause was not found (not a
/// self-connect: none in 40,000 tries here), so wait for an answer.
fn answers(port: u16) -> bool {
    let out = Command::new(NETKIT).args(["tcp", "--to", &format!("127.0.0.1:{port}"), "--count", "1", "--timeout-ms", "300"]).output();
    out.ok().and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok()).is_some_and(|v| v["counts"]["s1"] == 1)
}

/// A directory of its own under the system's temporary directory, removed on drop.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
}

fn run(port: u16, dir: &Path, n: usize, count: u32, block: u32) -> Vec<serde_json::Value> {
    let fifos: Vec<PathBuf> = (0..n).map(|k| dir.join(format!("turn-{k}"))).collect();
    fifos.iter().for_each(|f| mkfifo(f));
    let to = format!("127.0.0.1:{port}");
    let children: Vec<Child> = (0..n)
        .map(|k| {
            let mut c = Command::new(NETKIT);
            c.args(["tcp", "--to", &to, "--count", &count.to_string(), "--block", &block.to_string()]);
            c.arg("--turn-in").arg(&fifos[k]).arg("--turn-out").arg(&fifos[(k + 1) % n]);
            if k == 0 {
                c.arg("--turn-first");
            }
            c.stdout(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "netkit tcp in the ring failed: {}", out.status);
            serde_json::from_slice(&out.stdout).unwrap()
        })
        .collect()
}

#[test]
fn clients_in_a_ring_take_turns_block_by_block() {
    let (_server, port) = server();
    let dir = Dir(std::env::temp_dir().join(format!("gardenet-netkit-turns-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let (n, count, block) = (3, 95, 10);
    let out = run(port, &dir.0, n, count, block);

    // Every client made all of its connections, in ceil(95 / 10) = 10 blocks.
    let mut all: Vec<(u128, u128, usize)> = Vec::new();
    for (k, v) in out.iter().enumerate() {
        assert_eq!(v["counts"]["s1"], count, "client {k}: {v}");
        let blocks = v["blocks"].as_array().unwrap_or_else(|| panic!("client {k}: no blocks in {v}"));
        assert_eq!(blocks.len(), 10, "client {k}: {v}");
        for b in blocks {
            let (s, e) = (b[0].as_u64().unwrap() as u128, b[1].as_u64().unwrap() as u128);
            assert!(s <= e);
            all.push((s, e, k));
        }
        // The rate is over the client's own blocks, not the time it waited for its turns.
        let (secs, wall) = (v["seconds"].as_f64().unwrap(), v["wall_seconds"].as_f64().unwrap());
        assert!(secs < wall, "client {k}: active {secs} s, wall {wall} s");
    }
    // One client at a time, in ring order starting with the first.
    all.sort();
    for w in all.windows(2) {
        assert!(w[0].1 <= w[1].0, "blocks overlap: {w:?}");
        assert_eq!(w[1].2, (w[0].2 + 1) % n, "out of turn: {w:?}");
    }
    assert_eq!(all[0].2, 0);
}

#[test]
fn a_ring_whose_peer_never_passes_the_turn_fails_instead_of_hanging() {
    let (_server, port) = server();
    let dir = Dir(std::env::temp_dir().join(format!("gardenet-netkit-noturn-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let (a, b) = (dir.0.join("a"), dir.0.join("b"));
    mkfifo(&a);
    mkfifo(&b);
    // Nobody holds the turn: the client waits for it, bounded by its --turn-timeout-ms.
    let t0 = Instant::now();
    let out = Command::new(NETKIT)
        .args(["tcp", "--to", &format!("127.0.0.1:{port}"), "--count", "5", "--turn-timeout-ms", "300"])
        .arg("--turn-in")
        .arg(&a)
        .arg("--turn-out")
        .arg(&b)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no turn within"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(t0.elapsed() < Duration::from_secs(30));
}
