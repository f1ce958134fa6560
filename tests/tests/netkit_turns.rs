//! `gardenet-netkit tcp --turn-in/--turn-out`, which the dataplane benchmark uses to measure
//! the modes of a phase side by side: clients in a ring of FIFOs make their connections in
//! blocks, one client at a time. Unprivileged: one server on loopback.
use std::{
    io::{BufRead, BufReader},
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

/// A server on a port it picks itself: a port the test picked and freed could be taken (by
/// the other test's server, too) before the server binds it. It prints the port once it
/// listens, so no wait is needed.
fn server() -> (Server, u16) {
    let mut child = Command::new(NETKIT).args(["serve", "--name", "s1", "--addr", "127.0.0.1", "--port", "0"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let s = Server(child);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("netkit serve printed {line:?}: {e}"));
    (s, v["port"].as_u64().and_then(|p| u16::try_from(p).ok()).unwrap_or_else(|| panic!("no port in {line:?}")))
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
