//! A real container runtime on a test node: Debian's podman with `--network-backend cni`,
//! which calls CNI plugins through libcni as containerd and CRI-O do, with the conf and bin
//! directories the test (or the agent under test) filled, never the machine's.
//!
//! Every podman call of a node runs in one long-lived mount namespace (a holder process):
//! there cgroup2 is mounted at /sys/fs/cgroup (crun needs it; the machine's is hybrid) and
//! a tmpfs at /run/netns, where podman bind-mounts its pods' network namespaces. A podman in
//! a mount namespace of its own per call would lose those mounts between calls, and its
//! DEL could not join the pod's namespace. Pods' processes run in the node's network
//! namespace's child namespaces and, when given, in the test's cgroup (socket LB's).
//! Containers are a static busybox in a test-owned rootfs (`--rootfs`), running `sleep`;
//! tests act inside a pod through `/proc/<pid>/ns/net`.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::netns::{command_in, Netns, TestCgroup};

pub struct Runtime {
    holder: Child,
    dir: PathBuf,
    conf_dir: PathBuf,
    cgroup: Option<PathBuf>,
}

/// A running container.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub pid: u32,
}

impl Pod {
    /// The pod's network namespace.
    pub fn netns(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.pid))
    }

    /// A command inside the pod's network namespace (and `cgroup`).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>, cgroup: Option<&TestCgroup>) -> Result<Command> {
        command_in(&self.netns(), program, cgroup)
    }
}

impl Runtime {
    /// A runtime on `node` reading CNI configurations from `conf_dir` and plugins from
    /// `bin_dir`; state under `dir`. With `cgroup`, pods run in it.
    pub fn new(node: &Netns, dir: &Path, conf_dir: &Path, bin_dir: &Path, cgroup: Option<&TestCgroup>) -> Result<Runtime> {
        if Command::new("podman").arg("--version").output().is_err() {
            bail!("podman is not installed (apt-get install podman busybox-static; `cargo xtask setup` does it)");
        }
        std::fs::create_dir_all(dir)?;
        let rootfs = dir.join("rootfs");
        std::fs::create_dir_all(rootfs.join("bin"))?;
        for d in ["etc", "proc", "sys", "dev", "tmp"] {
            std::fs::create_dir_all(rootfs.join(d))?;
        }
        std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).context("/bin/busybox (apt-get install busybox-static)")?;
        for a in ["sh", "sleep"] {
            let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(a));
        }
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [\"{}\"]\nnetwork_config_dir = \"{}\"\n[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n",
                bin_dir.display(),
                conf_dir.display()
            ),
        )?;
        let script = "umount -l /sys/fs/cgroup 2>/dev/null; mount -t cgroup2 none /sys/fs/cgroup && mkdir -p /run/netns && mount -t tmpfs none /run/netns && echo ready && exec sleep 100000";
        let mut cmd = node.command("unshare", None)?;
        cmd.args(["-m", "--propagation", "private", "sh", "-c", script]).stdin(Stdio::null()).stdout(Stdio::piped());
        let mut holder = cmd.spawn().context("starting the runtime's mount namespace (unshare)")?;
        let mut line = String::new();
        BufReader::new(holder.stdout.take().context("holder stdout")?).read_line(&mut line)?;
        if line.trim() != "ready" {
            let _ = holder.kill();
            let _ = holder.wait();
            bail!("the runtime's mount namespace did not come up");
        }
        Ok(Runtime { holder, dir: dir.to_path_buf(), conf_dir: conf_dir.to_path_buf(), cgroup: cgroup.map(|c| c.path.clone()) })
    }

    /// Runs `podman ARGS` in the node's runtime namespaces.
    pub fn podman(&self, args: &[&str]) -> Result<Output> {
        let h = self.holder.id();
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount=/proc/{h}/ns/mnt")).arg(format!("--net=/proc/{h}/ns/net")).arg("podman");
        cmd.arg("--root").arg(self.dir.join("root")).arg("--runroot").arg(self.dir.join("runroot"));
        cmd.args(["--network-backend", "cni", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]);
        cmd.arg("--cni-config-dir").arg(&self.conf_dir).args(args).env("CONTAINERS_CONF", self.dir.join("containers.conf"));
        if let Some(cg) = &self.cgroup {
            let procs = cg.join("cgroup.procs");
            // SAFETY: one write(2) between fork and exec.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    std::fs::write(&procs, "0")?;
                    Ok(())
                });
            }
        }
        cmd.stdin(Stdio::null()).output().context("running podman")
    }

    fn podman_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.podman(args)?;
        if !out.status.success() {
            bail!("podman {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Creates a pod on network `network` (the conflist's name), with `extra` podman run
    /// options (e.g. `-p 8080:8080`).
    pub fn run_pod(&self, name: &str, network: &str, extra: &[&str]) -> Result<Pod> {
        let rootfs = self.dir.join("rootfs");
        let rootfs = rootfs.to_string_lossy();
        let mut args = vec!["run", "-d", "--name", name, "--network", network, "--cgroups", "disabled"];
        args.extend(["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]);
        args.extend_from_slice(extra);
        args.extend(["--rootfs", &rootfs, "/bin/sleep", "100000"]);
        self.podman_ok(&args)?;
        let pid: u32 = self.podman_ok(&["inspect", name, "--format", "{{.State.Pid}}"])?.parse().context("pod pid")?;
        Ok(Pod { name: name.to_owned(), pid })
    }

    /// The pod's addresses as the runtime recorded them from the plugin's result.
    pub fn addresses(&self, name: &str) -> Result<(String, String)> {
        let v = self.podman_ok(&["inspect", name, "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{.GlobalIPv6Address}}{{end}}"])?;
        let (a, b) = v.split_once(' ').with_context(|| format!("addresses of {name}: {v:?}"))?;
        Ok((a.to_owned(), b.to_owned()))
    }

    /// Removes the pod (the runtime calls the plugins' DEL).
    pub fn rm(&self, name: &str) -> Result<()> {
        self.podman_ok(&["rm", "-f", "-t", "0", name]).map(|_| ())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _ = self.podman(&["rm", "-a", "-f", "-t", "0"]);
        let _ = self.holder.kill();
        let _ = self.holder.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
