//! Addresses by delegation (SPEC.md, "Delegated plugins protocol"): the IPAM plugin named by
//! `ipam.type` is found in `CNI_PATH` and run with this call's environment and the same
//! configuration on stdin. host-local gives the guarantees the pod network needs (one
//! address per attachment, a file lock around allocation, release by container id and
//! ifname); GC of its reservations is done here, through its own DEL, because host-local
//! before 1.1.0 has no GC.
use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command as Process, Stdio},
};

use serde_json::{Map, Value};

use crate::env::{Attachment, Command, Env};
use crate::spec::{CniError, CniResult, Code, Outcome, Version};

/// host-local's state directory when the configuration names none.
pub const HOST_LOCAL_DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";

pub fn find_plugin(name: &str, path: &[PathBuf]) -> CniResult<PathBuf> {
    path.iter().map(|d| d.join(name)).find(|p| p.is_file()).ok_or_else(|| {
        CniError::new(
            Code::Io,
            format!("IPAM plugin {name:?} not found in CNI_PATH ({})", path.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":")),
        )
    })
}

/// The version a delegate is asked to speak: the configuration's up to 1.0.0, whose result
/// format 1.1.0 kept (host-local releases before 1.5 know no 1.1.0).
pub fn delegate_version(v: Version) -> Version {
    v.min(Version(1, 0, 0))
}

/// Runs `plugin` for `command` on `attachment` with `conf` on stdin; its result (ADD), or
/// its error as it reported it.
pub fn exec(plugin: &Path, env: &Env, command: Command, attachment: Option<&Attachment>, conf: &Map<String, Value>) -> CniResult<Option<Value>> {
    let mut stdin = conf.clone();
    let capped = !matches!(command, Command::Status | Command::Gc);
    if let Some(v) = stdin.get("cniVersion").and_then(Value::as_str).and_then(Version::parse).filter(|_| capped) {
        stdin.insert("cniVersion".into(), Value::String(delegate_version(v).to_string()));
    }
    let stdin = serde_json::to_vec(&stdin).map_err(|e| CniError::new(Code::Internal, format!("encoding the delegate's configuration: {e}")))?;
    let mut p = Process::new(plugin);
    p.env("CNI_COMMAND", command.as_str()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    if let Some(a) = attachment {
        p.env("CNI_CONTAINERID", &a.container_id).env("CNI_IFNAME", &a.ifname);
    }
    if env.netns.is_none() || (command == Command::Del && attachment != env.attachment.as_ref()) {
        // A DEL for another attachment (GC) has no namespace to name.
        p.env_remove("CNI_NETNS");
    }
    let name = plugin.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let mut child = p.spawn().map_err(|e| CniError::new(Code::Io, format!("running IPAM plugin {}: {e}", plugin.display())))?;
    if let Some(mut w) = child.stdin.take() {
        // A plugin that exits without reading is judged by its exit status below.
        let _ = w.write_all(&stdin);
    }
    let out = child.wait_with_output().map_err(|e| CniError::new(Code::Io, format!("waiting for IPAM plugin {name}: {e}")))?;
    let stdout: Option<Value> = serde_json::from_slice(&out.stdout).ok();
    if !out.status.success() {
        // The delegate's own error object, code and all, is what the runtime should see.
        let err = match stdout.as_ref().and_then(|v| Some((v.get("code")?.as_u64()?, v.get("msg")?.as_str()?.to_owned(), v))) {
            Some((code, msg, v)) => CniError { code: code as u32, msg, details: v.get("details").and_then(Value::as_str).unwrap_or_default().to_owned() },
            None => CniError::new(Code::Internal, format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim())),
        };
        return Err(err.context(&format!("IPAM plugin {name} {}", command.as_str())));
    }
    Ok(stdout)
}

/// `ADD` through the delegate: the addresses it assigned.
pub fn add(plugin: &Path, env: &Env, conf: &Map<String, Value>) -> CniResult<Outcome> {
    let v = exec(plugin, env, Command::Add, env.attachment.as_ref(), conf)?.ok_or_else(|| CniError::new(Code::Decode, "IPAM plugin ADD printed no result"))?;
    let r = Outcome::from_json(&v).map_err(|e| e.context("IPAM plugin ADD"))?;
    if r.ips.is_empty() {
        return Err(CniError::new(Code::InvalidConfig, "IPAM plugin ADD assigned no address: check ipam.ranges"));
    }
    Ok(r)
}

/// The attachments host-local holds addresses for in `dir/<network name>`: each reservation
/// is a file named by the address, holding the container id and (since 0.8) the ifname.
pub fn host_local_reservations(data_dir: &Path, network: &str) -> std::io::Result<Vec<(String, Attachment)>> {
    let dir = data_dir.join(network);
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        if file.parse::<std::net::IpAddr>().is_err() {
            continue; // lock, last_reserved_ip.N
        }
        let Ok(text) = std::fs::read_to_string(e.path()) else { continue };
        if let Some(a) = parse_reservation(&text) {
            out.push((file, a));
        }
    }
    out.sort();
    Ok(out)
}

fn parse_reservation(text: &str) -> Option<Attachment> {
    let mut lines = text.split(['\r', '\n']).filter(|l| !l.is_empty());
    let container_id = lines.next()?.trim().to_owned();
    // Files written before 0.8 hold only the id; host-local released those by id alone.
    let ifname = lines.next().map(|l| l.trim().to_owned()).unwrap_or_else(|| "eth0".into());
    (!container_id.is_empty()).then_some(Attachment { container_id, ifname })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_read_as_host_local_writes_them() {
        let dir = std::env::temp_dir().join(format!("gn-cni-ipam-{}", std::process::id()));
        let net = dir.join("gardenet");
        std::fs::create_dir_all(&net).unwrap();
        std::fs::write(net.join("198.18.100.2"), "abc\r\neth0").unwrap();
        std::fs::write(net.join("fd00:100::2"), "abc\r\nnet1").unwrap();
        std::fs::write(net.join("198.18.100.3"), "old").unwrap();
        std::fs::write(net.join("last_reserved_ip.0"), "198.18.100.3").unwrap();
        std::fs::write(net.join("lock"), "").unwrap();
        let r = host_local_reservations(&dir, "gardenet").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let at = |id: &str, ifname: &str| Attachment { container_id: id.into(), ifname: ifname.into() };
        assert_eq!(r, vec![("198.18.100.2".into(), at("abc", "eth0")), ("198.18.100.3".into(), at("old", "eth0")), ("fd00:100::2".into(), at("abc", "net1"))]);
        assert!(host_local_reservations(&dir, "none").unwrap().is_empty());
    }

    #[test]
    fn delegates_speak_at_most_1_0_0() {
        assert_eq!(delegate_version(Version(1, 1, 0)), Version(1, 0, 0));
        assert_eq!(delegate_version(Version(0, 3, 1)), Version(0, 3, 1));
    }

    #[test]
    fn a_missing_plugin_names_the_path() {
        let e = find_plugin("host-local", &[PathBuf::from("/nonexistent/a"), PathBuf::from("/nonexistent/b")]).unwrap_err();
        assert!(e.msg.contains("/nonexistent/a:/nonexistent/b"), "{}", e.msg);
    }
}
