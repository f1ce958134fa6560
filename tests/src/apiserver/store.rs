//! The double's state: objects by collection, a global resourceVersion counter and the change
//! log that watches replay from. Plain data, no I/O; callers hold it behind one mutex.
use std::collections::BTreeMap;

use serde_json::{json, Value};

/// One API collection, e.g. `v1` `services` or `discovery.k8s.io/v1` `endpointslices`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Coll {
    /// `v1` for the core group, else `group/version`.
    pub api_version: String,
    pub plural: String,
}

/// (apiVersion, kind, plural, namespaced) of the kinds the double is used with. Kinds not
/// listed still work over HTTP (the path tells the collection); `kind`s are then derived.
const KINDS: &[(&str, &str, &str, bool)] = &[
    ("v1", "Service", "services", true),
    ("v1", "Node", "nodes", false),
    ("v1", "Namespace", "namespaces", false),
    ("v1", "Pod", "pods", true),
    ("v1", "ConfigMap", "configmaps", true),
    ("v1", "Endpoints", "endpoints", true),
    ("v1", "Event", "events", true),
    ("discovery.k8s.io/v1", "EndpointSlice", "endpointslices", true),
    ("coordination.k8s.io/v1", "Lease", "leases", true),
    ("networking.k8s.io/v1", "ServiceCIDR", "servicecidrs", false),
    ("events.k8s.io/v1", "Event", "events", true),
    ("extensions.gardener.cloud/v1alpha1", "Network", "networks", true),
    ("v1", "Secret", "secrets", true),
    ("extensions.gardener.cloud/v1alpha1", "Cluster", "clusters", false),
    ("resources.gardener.cloud/v1alpha1", "ManagedResource", "managedresources", true),
];

impl Coll {
    /// The collection of `kind`, optionally qualified as `apiVersion/Kind` (e.g.
    /// `events.k8s.io/v1/Event`); unqualified kinds take the first match above.
    pub fn of_kind(kind: &str) -> Option<Coll> {
        let (api_version, kind) = match kind.rsplit_once('/') {
            Some((av, k)) => (Some(av), k),
            None => (None, kind),
        };
        KINDS
            .iter()
            .find(|(av, k, _, _)| *k == kind && api_version.is_none_or(|want| want == *av))
            .map(|(av, _, plural, _)| Coll { api_version: av.to_string(), plural: plural.to_string() })
    }

    /// The collection an object with this apiVersion and kind lives in.
    pub fn of_object(api_version: &str, kind: &str) -> Coll {
        let plural = KINDS
            .iter()
            .find(|(av, k, _, _)| *av == api_version && *k == kind)
            .map_or_else(|| format!("{}s", kind.to_lowercase()), |(_, _, p, _)| p.to_string());
        Coll { api_version: api_version.into(), plural }
    }

    pub fn kind(&self) -> String {
        KINDS.iter().find(|(av, _, p, _)| *av == self.api_version && *p == self.plural).map_or_else(
            || {
                let singular = self.plural.strip_suffix('s').unwrap_or(&self.plural);
                let mut c = singular.chars();
                c.next().map(|f| f.to_uppercase().chain(c).collect()).unwrap_or_default()
            },
            |(_, k, _, _)| k.to_string(),
        )
    }

    /// Unknown kinds are assumed namespaced (as most custom resources are).
    pub fn namespaced(&self) -> bool {
        KINDS.iter().find(|(av, _, p, _)| *av == self.api_version && *p == self.plural).is_none_or(|(_, _, _, namespaced)| *namespaced)
    }

    /// Built-in types are listed without per-item kind/apiVersion, like the real server does;
    /// custom resources keep theirs.
    pub fn builtin(&self) -> bool {
        match self.api_version.split_once('/') {
            None => true,
            Some((group, _)) => group.ends_with(".k8s.io") || !group.contains('.'),
        }
    }
}

/// What a request path addresses.
#[derive(Debug, PartialEq)]
pub struct Target {
    pub coll: Coll,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Option<String>,
}

impl Target {
    /// Parses `/api/v1/...` and `/apis/{group}/{version}/...` paths.
    pub fn parse(path: &str) -> Option<Target> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (api_version, mut rest) = match segs.as_slice() {
            ["api", v, rest @ ..] => (v.to_string(), rest),
            ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
            _ => return None,
        };
        let mut namespace = None;
        // `namespaces/{ns}/{plural}...`, but not the Namespace object's own subresources.
        if let ["namespaces", ns, plural, ..] = rest {
            if !matches!(*plural, "status" | "finalize") {
                namespace = Some(ns.to_string());
                rest = &rest[2..];
            }
        }
        let (plural, name, subresource) = match rest {
            [p] => (p, None, None),
            [p, n] => (p, Some(n.to_string()), None),
            [p, n, s] => (p, Some(n.to_string()), Some(s.to_string())),
            _ => return None,
        };
        if plural.is_empty() {
            return None;
        }
        Some(Target { coll: Coll { api_version, plural: plural.to_string() }, namespace, name, subresource })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

/// One entry of the change log.
#[derive(Clone, Debug)]
pub struct Change {
    pub rv: u64,
    pub coll: Coll,
    pub kind: ChangeType,
    /// The object before the change (for Modified), so watches with selectors can turn a
    /// change that leaves or enters their selection into DELETED or ADDED.
    pub old: Option<Value>,
    /// The object after the change; for Deleted the last state, with the deletion's RV.
    pub new: Value,
}

/// A failed request, as a `Status` code and reason.
#[derive(Debug)]
pub struct Failure {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl Failure {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Failure { code, reason, message: message.into() }
    }

    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

type Key = (String, String);

#[derive(Default)]
pub struct Store {
    rv: u64,
    /// Watches from a resourceVersion below this get `410 Expired`.
    compacted_below: u64,
    objects: BTreeMap<Coll, BTreeMap<Key, Value>>,
    log: Vec<Change>,
    uids: u64,
    /// Paged lists in progress: continue token -> (the list's RV, the items still to send).
    /// Like the real server, later pages come from the snapshot the first page was cut from.
    pages: BTreeMap<u64, (u64, std::collections::VecDeque<Value>)>,
    next_page: u64,
}

/// At most this many paged lists are kept open; older tokens expire (`410`), as compacted
/// ones do on a real server.
const MAX_OPEN_PAGES: usize = 64;
const CONTINUE_PREFIX: &str = "gardenet-double-";

/// One page of a list.
pub struct Page {
    pub items: Vec<Value>,
    pub rv: u64,
    /// `metadata.continue` and `metadata.remainingItemCount`, when more pages follow.
    pub next: Option<(String, usize)>,
}

pub fn name_of(obj: &Value) -> &str {
    obj.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default()
}

pub fn namespace_of(obj: &Value) -> &str {
    obj.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or_default()
}

impl Store {
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Every resourceVersion handed out so far becomes too old to watch from (or to continue
    /// a paged list from).
    pub fn compact(&mut self) {
        self.rv += 1;
        self.compacted_below = self.rv;
        self.log.clear();
        self.pages.clear();
    }

    /// A list as the API server pages it: `limit` items at most (0 or `None`: all), the rest
    /// behind a continue token that later requests pass back in `cont`.
    pub fn list_page(
        &mut self,
        coll: &Coll,
        ns: Option<&str>,
        keep: impl Fn(&Value) -> bool,
        limit: Option<usize>,
        cont: Option<&str>,
    ) -> Result<Page, Failure> {
        let (rv, mut rest) = match cont.filter(|c| !c.is_empty()) {
            Some(token) => {
                let expired = || {
                    Failure::new(410, "Expired", "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.")
                };
                let id = token
                    .strip_prefix(CONTINUE_PREFIX)
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| Failure::new(400, "BadRequest", format!("invalid continue token {token:?}")))?;
                self.pages.remove(&id).ok_or_else(expired)?
            }
            None => {
                let (items, rv) = self.list(coll, ns, keep);
                (rv, items.into())
            }
        };
        let take = limit.filter(|l| *l > 0).unwrap_or(usize::MAX).min(rest.len());
        let items: Vec<Value> = rest.drain(..take).collect();
        let next = if rest.is_empty() {
            None
        } else {
            self.next_page += 1;
            let id = self.next_page;
            let remaining = rest.len();
            self.pages.insert(id, (rv, rest));
            while self.pages.len() > MAX_OPEN_PAGES {
                self.pages.pop_first();
            }
            Some((format!("{CONTINUE_PREFIX}{id}"), remaining))
        };
        Ok(Page { items, rv, next })
    }

    pub fn get(&self, coll: &Coll, ns: &str, name: &str) -> Option<&Value> {
        self.objects.get(coll)?.get(&(ns.to_string(), name.to_string()))
    }

    /// Objects of `coll` (in `ns` if given), as stored.
    pub fn iter<'a>(&'a self, coll: &Coll, ns: Option<&'a str>) -> impl Iterator<Item = &'a Value> {
        self.objects.get(coll).into_iter().flat_map(|objs| objs.iter()).filter(move |((o_ns, _), _)| ns.is_none_or(|ns| ns == o_ns)).map(|(_, obj)| obj)
    }

    /// Objects of `coll` (in `ns` if given), ready for a list response, and the list's RV.
    pub fn list(&self, coll: &Coll, ns: Option<&str>, keep: impl Fn(&Value) -> bool) -> (Vec<Value>, u64) {
        let strip = coll.builtin();
        let items = self
            .iter(coll, ns)
            .filter(|obj| keep(obj))
            .map(|obj| {
                let mut obj = obj.clone();
                if strip {
                    if let Some(map) = obj.as_object_mut() {
                        map.remove("kind");
                        map.remove("apiVersion");
                    }
                }
                obj
            })
            .collect();
        (items, self.rv)
    }

    /// The changes after `rv`, or `Expired` if the log no longer reaches back that far.
    pub fn changes_since(&self, rv: u64) -> Result<impl Iterator<Item = &Change>, Failure> {
        if rv < self.compacted_below {
            return Err(Failure::new(410, "Expired", format!("too old resource version: {rv} ({})", self.compacted_below)));
        }
        Ok(self.log.iter().filter(move |c| c.rv > rv))
    }

    /// Creates the object, failing if it exists.
    pub fn create(&mut self, coll: &Coll, ns: &str, obj: Value) -> Result<&Change, Failure> {
        if self.get(coll, ns, name_of(&obj)).is_some() {
            return Err(Failure::new(409, "AlreadyExists", format!("{} \"{}\" already exists", coll.plural, name_of(&obj))));
        }
        Ok(self.put(coll, ns, obj))
    }

    /// Replaces an existing object; a `metadata.resourceVersion` in `obj` must match (optimistic
    /// concurrency, as Leases rely on).
    pub fn replace(&mut self, coll: &Coll, ns: &str, obj: Value) -> Result<&Change, Failure> {
        let name = name_of(&obj);
        let Some(current) = self.get(coll, ns, name) else {
            return Err(not_found(coll, name));
        };
        if let Some(want) = obj.pointer("/metadata/resourceVersion").and_then(Value::as_str) {
            let have = current.pointer("/metadata/resourceVersion").and_then(Value::as_str);
            if have != Some(want) {
                return Err(Failure::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been \
                         modified; please apply your changes to the latest version and try again",
                        coll.plural
                    ),
                ));
            }
        }
        Ok(self.put(coll, ns, obj))
    }

    /// Creates or replaces, whatever the object's resourceVersion says.
    pub fn put(&mut self, coll: &Coll, ns: &str, mut obj: Value) -> &Change {
        self.rv += 1;
        let name = name_of(&obj).to_string();
        let key = (ns.to_string(), name);
        let old = self.objects.get(coll).and_then(|objs| objs.get(&key)).cloned();
        let meta = obj.as_object_mut().expect("objects are JSON objects").entry("metadata").or_insert_with(|| json!({}));
        if !ns.is_empty() {
            meta["namespace"] = ns.into();
        }
        meta["resourceVersion"] = self.rv.to_string().into();
        // Server-owned fields survive updates, as they do on a real server.
        for field in ["uid", "creationTimestamp"] {
            match old.as_ref().and_then(|o| o["metadata"].get(field)) {
                Some(v) => meta[field] = v.clone(),
                None if meta.get(field).is_none() => {
                    meta[field] = match field {
                        "uid" => {
                            self.uids += 1;
                            format!("00000000-0000-4000-8000-{:012}", self.uids).into()
                        }
                        _ => "2025-01-01T00:00:00Z".into(),
                    }
                }
                None => {}
            }
        }
        obj["apiVersion"] = coll.api_version.clone().into();
        obj["kind"] = coll.kind().into();
        self.objects.entry(coll.clone()).or_default().insert(key, obj.clone());
        let kind = if old.is_some() { ChangeType::Modified } else { ChangeType::Added };
        self.log.push(Change { rv: self.rv, coll: coll.clone(), kind, old, new: obj });
        self.log.last().expect("just pushed")
    }

    pub fn remove(&mut self, coll: &Coll, ns: &str, name: &str) -> Result<&Change, Failure> {
        let key = (ns.to_string(), name.to_string());
        let mut obj = self.objects.get_mut(coll).and_then(|objs| objs.remove(&key)).ok_or_else(|| not_found(coll, name))?;
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = self.rv.to_string().into();
        self.log.push(Change { rv: self.rv, coll: coll.clone(), kind: ChangeType::Deleted, old: None, new: obj });
        Ok(self.log.last().expect("just pushed"))
    }
}

pub fn not_found(coll: &Coll, name: &str) -> Failure {
    Failure::new(404, "NotFound", format!("{} \"{name}\" not found", coll.plural))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_paths() {
        let t = Target::parse("/api/v1/namespaces/ns1/services/web").unwrap();
        assert_eq!(t.coll, Coll { api_version: "v1".into(), plural: "services".into() });
        assert_eq!((t.namespace.as_deref(), t.name.as_deref()), (Some("ns1"), Some("web")));
        let t = Target::parse("/apis/discovery.k8s.io/v1/endpointslices").unwrap();
        assert_eq!(t.coll.api_version, "discovery.k8s.io/v1");
        assert_eq!((t.namespace, t.name), (None, None));
        let t = Target::parse("/api/v1/nodes/n1/status").unwrap();
        assert_eq!(t.subresource.as_deref(), Some("status"));
        let t = Target::parse("/api/v1/namespaces/ns1/status").unwrap();
        assert_eq!((t.coll.plural.as_str(), t.name.as_deref()), ("namespaces", Some("ns1")));
        assert!(Target::parse("/healthz").is_none());
    }

    #[test]
    fn kinds() {
        assert_eq!(Coll::of_kind("EndpointSlice").unwrap().api_version, "discovery.k8s.io/v1");
        assert_eq!(Coll::of_kind("events.k8s.io/v1/Event").unwrap().api_version, "events.k8s.io/v1");
        let c = Coll { api_version: "example.com/v1".into(), plural: "widgets".into() };
        assert_eq!(c.kind(), "Widget");
        assert!(c.namespaced());
    }
}
