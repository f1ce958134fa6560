//! The network configuration on stdin: the common keys (SPEC.md, "Plugin configuration
//! objects"), gardenet's own (`mtu`, `agentReadyFile`) and what the runtime adds
//! (`prevResult`, `cni.dev/valid-attachments`). Unknown keys are kept: runtimes add their
//! own (`runtimeConfig`, `args`) and `ipam` is passed on whole to the delegated plugin.
use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::env::{check_ifname, Attachment, Command};
use crate::spec::{CniError, CniResult, Code, Outcome, Version, LATEST};

/// The pod's MTU when the configuration names none: the agent writes the node's value.
pub const DEFAULT_MTU: u32 = 1500;

#[derive(Clone, Debug)]
pub struct NetConf {
    pub version: Version,
    pub name: String,
    pub mtu: u32,
    /// `ipam.type`: the delegated IPAM plugin.
    pub ipam_type: Option<String>,
    /// `ipam.dataDir` (host-local's state; its default otherwise).
    pub ipam_data_dir: Option<PathBuf>,
    /// Exists once the node's agent has programmed the node (`STATUS`).
    pub agent_ready_file: Option<PathBuf>,
    pub prev_result: Option<Outcome>,
    /// `GC`: the attachments the runtime still has; everything else is released.
    pub valid_attachments: Option<Vec<Attachment>>,
    /// The whole object, for delegation.
    pub raw: Map<String, Value>,
}

/// The version errors are reported in: the configuration's when it names one this plugin
/// speaks, else the newest.
pub fn reply_version(stdin: &[u8]) -> Version {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion").and_then(Value::as_str).and_then(Version::parse))
        .filter(|v| v.supported())
        .unwrap_or(LATEST)
}

impl NetConf {
    pub fn parse(stdin: &[u8], command: Command) -> CniResult<NetConf> {
        let value: Value =
            serde_json::from_slice(stdin).map_err(|e| CniError::new(Code::Decode, format!("the network configuration on stdin is not JSON: {e}")))?;
        let Value::Object(raw) = value else {
            return Err(CniError::new(Code::Decode, "the network configuration on stdin is not a JSON object"));
        };
        let invalid = |field: &str, msg: String| CniError::new(Code::InvalidConfig, format!("{field}: {msg}"));
        let string = |field: &str| -> CniResult<Option<String>> {
            match raw.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(invalid(field, format!("expected a string, got {other}"))),
            }
        };
        let v = string("cniVersion")?.ok_or_else(|| invalid("cniVersion", "missing".into()))?;
        let version = Version::parse(&v).filter(|v| v.supported()).ok_or_else(|| {
            CniError::new(Code::IncompatibleVersion, format!("cniVersion {v:?} is not supported (supported: {})", crate::spec::SUPPORTED_VERSIONS.join(", ")))
        })?;
        let name = string("name")?.ok_or_else(|| invalid("name", "missing".into()))?;
        if !name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric()) || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
            return Err(invalid("name", format!("{name:?}: letters, digits, '_', '.' and '-', starting with a letter or digit")));
        }
        string("type")?.ok_or_else(|| invalid("type", "missing".into()))?;
        let mtu = match raw.get("mtu") {
            None | Some(Value::Null) => DEFAULT_MTU,
            Some(v) => match v.as_u64() {
                Some(m) if (68..=65535).contains(&m) => m as u32,
                _ => return Err(invalid("mtu", format!("{v} is not an MTU (68-65535)"))),
            },
        };
        let (ipam_type, ipam_data_dir) = match raw.get("ipam") {
            None | Some(Value::Null) => (None, None),
            Some(Value::Object(ipam)) => {
                let t = match ipam.get("type") {
                    Some(Value::String(t)) if !t.is_empty() && !t.contains('/') => t.clone(),
                    other => return Err(invalid("ipam.type", format!("expected the name of an IPAM plugin, got {}", other.unwrap_or(&Value::Null)))),
                };
                let dir = match ipam.get("dataDir") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(d)) => Some(PathBuf::from(d)),
                    Some(other) => return Err(invalid("ipam.dataDir", format!("expected a path, got {other}"))),
                };
                (Some(t), dir)
            }
            Some(other) => return Err(invalid("ipam", format!("expected an object, got {other}"))),
        };
        if ipam_type.is_none() && matches!(command, Command::Add | Command::Check | Command::Del | Command::Gc) {
            return Err(invalid("ipam", "missing: gardenet delegates addresses to an IPAM plugin (e.g. {\"type\": \"host-local\", ...})".into()));
        }
        let agent_ready_file = string("agentReadyFile")?.map(PathBuf::from);
        let prev_result = match raw.get("prevResult") {
            None | Some(Value::Null) => None,
            Some(v) => Some(Outcome::from_json(v).map_err(|e| e.context("prevResult"))?),
        };
        if command == Command::Check && prev_result.is_none() {
            return Err(invalid("prevResult", "CHECK needs the result of ADD".into()));
        }
        let valid_attachments = match raw.get("cni.dev/valid-attachments") {
            None | Some(Value::Null) => None,
            Some(Value::Array(list)) => Some(
                list.iter()
                    .map(|a| {
                        let field = |k: &str| a.get(k).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_owned);
                        match (field("containerID"), field("ifname")) {
                            (Some(container_id), Some(ifname)) if check_ifname(&ifname).is_ok() => Ok(Attachment { container_id, ifname }),
                            _ => Err(invalid("cni.dev/valid-attachments", format!("{a}: expected {{\"containerID\": ..., \"ifname\": ...}}"))),
                        }
                    })
                    .collect::<CniResult<Vec<_>>>()?,
            ),
            Some(other) => Err(invalid("cni.dev/valid-attachments", format!("expected a list, got {other}")))?,
        };
        if command == Command::Gc && valid_attachments.is_none() {
            return Err(invalid("cni.dev/valid-attachments", "GC needs the list of valid attachments".into()));
        }
        Ok(NetConf { version, name, mtu, ipam_type, ipam_data_dir, agent_ready_file, prev_result, valid_attachments, raw })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(extra: Value) -> Vec<u8> {
        let mut base = serde_json::json!({"cniVersion": "1.0.0", "name": "gardenet", "type": "gardenet", "ipam": {"type": "host-local", "ranges": [[{"subnet": "198.18.100.0/24"}]]}});
        for (k, v) in extra.as_object().unwrap() {
            if v.is_null() {
                base.as_object_mut().unwrap().remove(k);
            } else {
                base[k] = v.clone();
            }
        }
        serde_json::to_vec(&base).unwrap()
    }

    #[test]
    fn a_conflist_entry_parses() {
        let c = NetConf::parse(
            &conf(serde_json::json!({"mtu": 1450, "agentReadyFile": "/run/gardenet/cni/ready", "runtimeConfig": {"portMappings": []}})),
            Command::Add,
        )
        .unwrap();
        assert_eq!((c.version, c.name.as_str(), c.mtu), (Version(1, 0, 0), "gardenet", 1450));
        assert_eq!(c.ipam_type.as_deref(), Some("host-local"));
        assert_eq!(c.agent_ready_file, Some(PathBuf::from("/run/gardenet/cni/ready")));
        assert!(c.raw.contains_key("runtimeConfig"));
        assert_eq!(NetConf::parse(&conf(serde_json::json!({})), Command::Add).unwrap().mtu, DEFAULT_MTU);
    }

    #[test]
    fn bad_configurations_get_the_spec_codes_and_name_the_field() {
        let code = |stdin: &[u8], cmd| NetConf::parse(stdin, cmd).unwrap_err();
        assert_eq!(code(b"", Command::Add).code, 6);
        assert_eq!(code(b"{not json", Command::Add).code, 6);
        assert_eq!(code(b"[1,2]", Command::Add).code, 6);
        assert_eq!(code(&[0xff, 0xfe, 0x00], Command::Add).code, 6);
        let e = code(&conf(serde_json::json!({"cniVersion": "9.9.9"})), Command::Add);
        assert_eq!(e.code, 1);
        assert!(e.msg.contains("9.9.9"));
        for (field, v) in [
            ("cniVersion", Value::Null),
            ("name", Value::Null),
            ("name", serde_json::json!("bad name")),
            ("type", Value::Null),
            ("mtu", serde_json::json!(20)),
            ("mtu", serde_json::json!("1500")),
            ("ipam", Value::Null),
            ("ipam", serde_json::json!({"type": "../evil"})),
            ("ipam", serde_json::json!("host-local")),
            ("agentReadyFile", serde_json::json!(1)),
        ] {
            let e = code(&conf(serde_json::json!({ field: v })), Command::Add);
            assert_eq!(e.code, 7, "{field}: {e}");
            assert!(e.msg.starts_with(field), "{field}: {}", e.msg);
        }
    }

    #[test]
    fn check_needs_a_previous_result_and_gc_the_valid_attachments() {
        assert!(NetConf::parse(&conf(serde_json::json!({})), Command::Check).unwrap_err().msg.contains("prevResult"));
        let prev = serde_json::json!({"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}], "ips": [{"address": "198.18.100.2/32", "interface": 0}]});
        let c = NetConf::parse(&conf(serde_json::json!({ "prevResult": prev })), Command::Check).unwrap();
        assert_eq!(c.prev_result.unwrap().ips.len(), 1);
        assert_eq!(NetConf::parse(&conf(serde_json::json!({ "prevResult": {"ips": 1} })), Command::Check).unwrap_err().code, 6);
        assert!(NetConf::parse(&conf(serde_json::json!({})), Command::Gc).unwrap_err().msg.contains("valid-attachments"));
        let gc = serde_json::json!({"cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]});
        assert_eq!(NetConf::parse(&conf(gc), Command::Gc).unwrap().valid_attachments.unwrap()[0].container_id, "a");
        let bad = serde_json::json!({"cni.dev/valid-attachments": [{"containerID": "a"}]});
        assert_eq!(NetConf::parse(&conf(bad), Command::Gc).unwrap_err().code, 7);
    }

    #[test]
    fn errors_answer_in_the_configurations_version() {
        assert_eq!(reply_version(br#"{"cniVersion":"0.4.0"}"#), Version(0, 4, 0));
        assert_eq!(reply_version(br#"{"cniVersion":"7.0.0"}"#), LATEST);
        assert_eq!(reply_version(b"garbage"), LATEST);
    }
}
