//! The runtime's side of a call: the `CNI_*` environment variables (SPEC.md, "Parameters"),
//! checked per command as the spec requires them.
use std::path::PathBuf;

use crate::spec::{CniError, CniResult, Code};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Status,
    Gc,
}

impl Command {
    fn parse(s: &str) -> Option<Command> {
        Some(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Version => "VERSION",
            Command::Status => "STATUS",
            Command::Gc => "GC",
        }
    }
}

/// One attachment: what the runtime names with `CNI_CONTAINERID` and `CNI_IFNAME`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Env {
    pub command: Command,
    /// ADD, DEL, CHECK.
    pub attachment: Option<Attachment>,
    /// ADD and CHECK; DEL may come without (the namespace is gone).
    pub netns: Option<PathBuf>,
    /// `CNI_ARGS`: `K=V;K2=V2`.
    pub args: Vec<(String, String)>,
    /// `CNI_PATH`: where delegated plugins are looked for.
    pub path: Vec<PathBuf>,
}

impl Env {
    pub fn from_process() -> CniResult<Env> {
        Env::from_vars(|k| std::env::var(k).ok())
    }

    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> CniResult<Env> {
        let bad = |msg: String| CniError::new(Code::InvalidEnvironment, msg);
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        let command = var("CNI_COMMAND").ok_or_else(|| bad("CNI_COMMAND is not set".into()))?;
        let command = Command::parse(&command).ok_or_else(|| bad(format!("CNI_COMMAND {command:?}: expected ADD, DEL, CHECK, VERSION, STATUS or GC")))?;
        if command == Command::Version {
            return Ok(Env { command, attachment: None, netns: None, args: Vec::new(), path: Vec::new() });
        }
        let required = |k: &str| var(k).ok_or_else(|| bad(format!("{k} is not set (required for {})", command.as_str())));
        let path: Vec<PathBuf> = required("CNI_PATH")?.split(':').filter(|p| !p.is_empty()).map(PathBuf::from).collect();
        let per_attachment = matches!(command, Command::Add | Command::Del | Command::Check);
        let attachment = if per_attachment {
            let container_id = required("CNI_CONTAINERID")?;
            check_container_id(&container_id).map_err(bad)?;
            let ifname = required("CNI_IFNAME")?;
            check_ifname(&ifname).map_err(bad)?;
            Some(Attachment { container_id, ifname })
        } else {
            None
        };
        let netns = match command {
            Command::Add | Command::Check => Some(PathBuf::from(required("CNI_NETNS")?)),
            Command::Del => var("CNI_NETNS").map(PathBuf::from),
            _ => None,
        };
        let args = match var("CNI_ARGS") {
            Some(a) => parse_args(&a).map_err(bad)?,
            None => Vec::new(),
        };
        Ok(Env { command, attachment, netns, args, path })
    }
}

/// SPEC.md: "must be unique, non-empty, alphanumeric plus underscore, period and hyphen".
fn check_container_id(id: &str) -> Result<(), String> {
    if !id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric()) || !id.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
        return Err(format!("CNI_CONTAINERID {id:?}: must start with a letter or digit and hold only letters, digits, '_', '.' and '-'"));
    }
    Ok(())
}

/// SPEC.md: a valid Linux interface name: at most 15 bytes, not `.` or `..`, no `/`,
/// `:` or white space.
pub fn check_ifname(name: &str) -> Result<(), String> {
    if name.len() > 15 || name == "." || name == ".." || name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control()) {
        return Err(format!("CNI_IFNAME {name:?}: not a valid interface name (at most 15 bytes, no '/', ':' or spaces)"));
    }
    Ok(())
}

fn parse_args(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(';')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(format!("CNI_ARGS: {kv:?} is not KEY=VALUE")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> CniResult<Env> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Env::from_vars(|k| m.get(k).cloned())
    }

    const ADD: [(&str, &str); 5] = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc-1.2_3"),
        ("CNI_NETNS", "/run/netns/x"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin:/usr/lib/cni"),
    ];

    #[test]
    fn add_needs_the_whole_environment() {
        let e = env(&ADD).unwrap();
        assert_eq!(e.command, Command::Add);
        assert_eq!(e.attachment, Some(Attachment { container_id: "abc-1.2_3".into(), ifname: "eth0".into() }));
        assert_eq!(e.path, vec![PathBuf::from("/opt/cni/bin"), PathBuf::from("/usr/lib/cni")]);
        for missing in ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"] {
            let vars: Vec<_> = ADD.iter().copied().filter(|(k, _)| *k != missing).collect();
            let err = env(&vars).unwrap_err();
            assert_eq!(err.code, 4, "{missing}");
            assert!(err.msg.contains(missing), "{}", err.msg);
        }
    }

    #[test]
    fn del_may_come_without_a_namespace() {
        let vars: Vec<_> = ADD.iter().copied().filter(|(k, _)| *k != "CNI_NETNS").map(|(k, v)| if k == "CNI_COMMAND" { (k, "DEL") } else { (k, v) }).collect();
        let e = env(&vars).unwrap();
        assert_eq!((e.command, e.netns), (Command::Del, None));
    }

    #[test]
    fn version_status_and_gc_need_less() {
        assert_eq!(env(&[("CNI_COMMAND", "VERSION")]).unwrap().command, Command::Version);
        assert_eq!(env(&[("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/x")]).unwrap().attachment, None);
        assert_eq!(env(&[("CNI_COMMAND", "GC")]).unwrap_err().code, 4);
    }

    #[test]
    fn bad_values_are_named() {
        assert!(env(&[]).unwrap_err().msg.contains("CNI_COMMAND"));
        assert!(env(&[("CNI_COMMAND", "add")]).unwrap_err().msg.contains("\"add\""));
        let with = |k: &str, v: &'static str| -> CniError {
            let vars: Vec<_> = ADD.iter().copied().map(|(kk, vv)| if kk == k { (kk, v) } else { (kk, vv) }).collect();
            env(&vars).unwrap_err()
        };
        assert_eq!(with("CNI_CONTAINERID", "-abc").code, 4);
        assert_eq!(with("CNI_CONTAINERID", "a/b").code, 4);
        assert_eq!(with("CNI_IFNAME", "a-name-longer-than-15").code, 4);
        assert_eq!(with("CNI_IFNAME", "eth:0").code, 4);
        assert_eq!(with("CNI_IFNAME", "..").code, 4);
        let mut vars = ADD.to_vec();
        vars.push(("CNI_ARGS", "K8S_POD_NAME=web;IgnoreUnknown=1"));
        assert_eq!(env(&vars).unwrap().args[0], ("K8S_POD_NAME".into(), "web".into()));
        vars.pop();
        vars.push(("CNI_ARGS", "novalue"));
        assert_eq!(env(&vars).unwrap_err().code, 4);
    }
}
