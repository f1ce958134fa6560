//! The Kubernetes API source: watches Services, EndpointSlices (all namespaces) and this
//! agent's own Node, and turns the three watch streams into one stream of [`SourceEvent`]s.
//!
//! # What is emitted
//!
//! * At start, nothing until **all three** resources have finished their initial list; then,
//!   in one uninterrupted burst: `Resync`, every Service, every EndpointSlice, the Node (if it
//!   exists), `Synced`. Within the burst objects are ordered by kind (Services, slices, Node),
//!   then by namespace and name.
//! * Afterwards, each watch change is forwarded as it arrives: `ADDED`/`MODIFIED` as
//!   `*Applied`, `DELETED` as `*Deleted`.
//! * When a resource has to be relisted (the watch fell out of the server's window, `410
//!   Gone`), its new list is collected silently. Once no relist is in progress any more, a
//!   full snapshot of **all three** resources is sent exactly as at start: `Resync`, all
//!   objects, `Synced`. The consumer's rule "objects not re-sent between `Resync` and `Synced`
//!   are gone" therefore holds even though only one resource was relisted: the others are
//!   re-sent from this source's cache (as current as their own watches are). While one
//!   resource relists, changes of the other two are still forwarded live.
//! * `Resync` is never emitted inside an open `Resync`..`Synced` burst, and no live event is
//!   ever sent inside one.
//! * The Node has no `Deleted` event: if the watch reports this agent's Node deleted, a full
//!   snapshot (without Node) is sent instead, which tells the consumer the same thing.
//!
//! An unreachable API server never makes this loop spin: every watcher retries with kube's
//! default exponential backoff (0.8 s doubling up to 30 s, with jitter). Errors are logged and
//! the watch goes on; the function only returns when the event receiver is dropped.
//!
//! Cost: like a reflector, this keeps one copy of every watched object, digested to what
//! translation reads (`crate::source::objects`); the Node whole, without managedFields.
use std::{collections::BTreeMap, fmt::Debug, path::PathBuf, sync::Arc};

use anyhow::Context as _;
use futures::{stream, Stream, StreamExt};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use kube::{
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        watcher::{self, Event},
        WatchStreamExt,
    },
    Api, Client, Config, Resource, ResourceExt,
};
use serde::de::DeserializeOwned;

use super::{EventTx, SourceEvent};
use crate::source::objects::{ServiceCidrView, ServiceView, SliceView};

/// Builds a client from `kubeconfig` if given, else from the environment (`KUBECONFIG`,
/// `~/.kube/config`, then the in-cluster service account).
pub async fn client_from_env(kubeconfig: Option<PathBuf>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(&path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => Config::infer().await.context("inferring Kubernetes client config")?,
    };
    Client::try_from(config).context("building Kubernetes client")
}

/// Watches the API server and sends what it sees to `tx` (see the module docs for the exact
/// sequence). Runs until `tx`'s receiver is dropped.
pub async fn run(client: Client, node_name: String, tx: EventTx) -> anyhow::Result<()> {
    let node_selector = format!("metadata.name={node_name}");
    // Lists come in pages (kube's default, spelled out because the memory budget rests on
    // it): 100,000 endpoints decoded in one response would be a peak of over 100 MiB.
    let paged = || watcher::Config::default().page_size(500);
    let service_cidrs = has_service_cidrs(&client).await;
    let mut streams = vec![
        watch(Api::<Service>::all(client.clone()), paged(), Kind::Service).boxed(),
        watch(Api::<EndpointSlice>::all(client.clone()), paged(), Kind::Slice).boxed(),
        watch(Api::<Node>::all(client.clone()), paged().fields(&node_selector), Kind::Node).boxed(),
    ];
    let mut kinds = vec![Kind::Service, Kind::Slice, Kind::Node];
    if service_cidrs {
        streams.push(watch(Api::<ServiceCIDR>::all(client), paged(), Kind::ServiceCidr).boxed());
        kinds.push(Kind::ServiceCidr);
    }
    let mut events = stream::select_all(streams);

    let mut sync = SyncState::new(&kinds);
    while let Some((kind, event)) = events.next().await {
        match event {
            Ok(event) => {
                for out in sync.handle(kind, event) {
                    if tx.send(out).await.is_err() {
                        tracing::debug!("event receiver dropped, stopping the Kubernetes source");
                        return Ok(());
                    }
                }
            }
            // The watcher recovers by itself on the next poll (after the backoff delay).
            Err(error) => tracing::warn!(?kind, %error, "watching the API server failed"),
        }
    }
    anyhow::bail!("the Kubernetes watch streams ended")
}

/// The three resources this source watches, in the order snapshots list them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Service,
    Slice,
    Node,
    ServiceCidr,
}

#[derive(Clone, Debug)]
enum Obj {
    Service(Arc<ServiceView>),
    Slice(Arc<SliceView>),
    Node(Arc<Node>),
    ServiceCidr(Arc<ServiceCidrView>),
}

// Services and slices are digested on arrival (the object itself is dropped right away);
// only this agent's Node is kept whole.
impl From<Service> for Obj {
    fn from(o: Service) -> Self {
        Obj::Service(Arc::new(ServiceView::from(&o)))
    }
}
impl From<EndpointSlice> for Obj {
    fn from(o: EndpointSlice) -> Self {
        Obj::Slice(Arc::new(SliceView::from(&o)))
    }
}
impl From<Node> for Obj {
    fn from(o: Node) -> Self {
        Obj::Node(Arc::new(o))
    }
}
impl From<ServiceCIDR> for Obj {
    fn from(o: ServiceCIDR) -> Self {
        Obj::ServiceCidr(Arc::new(ServiceCidrView::from(&o)))
    }
}

/// (namespace, name): unique within one kind.
type Key = (String, String);

impl Obj {
    fn key(&self) -> Key {
        match self {
            Obj::Service(o) => (o.namespace.clone(), o.name.clone()),
            Obj::Slice(o) => (o.namespace.clone(), o.name.clone()),
            Obj::Node(o) => (String::new(), o.name_any()),
            Obj::ServiceCidr(o) => (String::new(), o.name.clone()),
        }
    }

    fn applied(self) -> SourceEvent {
        match self {
            Obj::Service(o) => SourceEvent::ServiceApplied(o),
            Obj::Slice(o) => SourceEvent::SliceApplied(o),
            Obj::Node(o) => SourceEvent::NodeApplied(o),
            Obj::ServiceCidr(o) => SourceEvent::ServiceCidrApplied(o),
        }
    }

    /// `None` for the Node, which `SourceEvent` has no deletion for.
    fn deleted(self) -> Option<SourceEvent> {
        match self {
            Obj::Service(o) => Some(SourceEvent::ServiceDeleted(o)),
            Obj::Slice(o) => Some(SourceEvent::SliceDeleted(o)),
            Obj::Node(_) => None,
            Obj::ServiceCidr(o) => Some(SourceEvent::ServiceCidrDeleted(o)),
        }
    }
}

/// A backed-off watcher for one resource, tagged with its kind.
fn watch<K>(api: Api<K>, config: watcher::Config, kind: Kind) -> impl Stream<Item = (Kind, Result<Event<Obj>, watcher::Error>)> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    Obj: From<K>,
{
    watcher::watcher(api, config).default_backoff().map(move |event| (kind, event.map(|event| into_obj(trim(event)))))
}

/// Managed fields are large and nobody downstream reads them; they would only bloat the cache.
fn trim<K: Resource>(event: Event<K>) -> Event<K> {
    event.modify(|o| o.managed_fields_mut().clear())
}

fn into_obj<K>(event: Event<K>) -> Event<Obj>
where
    Obj: From<K>,
{
    match event {
        Event::Apply(o) => Event::Apply(o.into()),
        Event::Delete(o) => Event::Delete(o.into()),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(o.into()),
        Event::InitDone => Event::InitDone,
    }
}

/// Turns the watchers' events into `SourceEvent`s, keeping a copy of every object so that a
/// relist of one resource can be reported as a full snapshot of all of them.
struct SyncState {
    /// The state the consumer has been (or is about to be) told, per kind.
    known: BTreeMap<Kind, BTreeMap<Key, Obj>>,
    /// Kinds whose (re)list is in progress, with what has been listed so far. Nothing of a
    /// list is sent before it is complete: a list that fails halfway and restarts must not
    /// leave objects behind that the complete list would have dropped.
    listing: BTreeMap<Kind, BTreeMap<Key, Obj>>,
    /// A full snapshot is owed to the consumer (sent once `listing` is empty).
    snapshot_due: bool,
}

impl Default for SyncState {
    fn default() -> Self {
        SyncState::new(&[Kind::Service, Kind::Slice, Kind::Node])
    }
}

impl SyncState {
    /// Until every one of `kinds` has listed once, no snapshot (and so no `Synced`) goes out.
    fn new(kinds: &[Kind]) -> Self {
        let empty = || kinds.iter().map(|k| (*k, BTreeMap::new())).collect::<BTreeMap<_, _>>();
        SyncState { known: empty(), listing: empty(), snapshot_due: true }
    }
}

/// Whether the API server serves ServiceCIDRs (`networking.k8s.io/v1`, Kubernetes 1.33+).
/// Asked until it answers either way: an API server that is down now must not turn the
/// feature off for the agent's lifetime.
async fn has_service_cidrs(client: &Client) -> bool {
    let api = Api::<ServiceCIDR>::all(client.clone());
    let mut delay = std::time::Duration::from_millis(200);
    loop {
        match api.list_metadata(&kube::api::ListParams::default().limit(1)).await {
            Ok(_) => return true,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                tracing::info!("the API server has no networking.k8s.io/v1 ServiceCIDRs (Kubernetes < 1.33): service ranges are not enforced");
                return false;
            }
            Err(kube::Error::Api(e)) if e.code == 403 => {
                tracing::warn!(
                    "not allowed to list ServiceCIDRs ({}): service ranges are not enforced; grant list/watch on servicecidrs.networking.k8s.io",
                    e.message
                );
                return false;
            }
            Err(e) => {
                tracing::warn!("asking for ServiceCIDRs: {e}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(10));
            }
        }
    }
}

impl SyncState {
    fn handle(&mut self, kind: Kind, event: Event<Obj>) -> Vec<SourceEvent> {
        match event {
            Event::Init => {
                // Also discards a half-done list if the watcher restarted it.
                self.listing.insert(kind, BTreeMap::new());
                self.snapshot_due = true;
                Vec::new()
            }
            Event::InitApply(obj) => {
                self.listing.entry(kind).or_default().insert(obj.key(), obj);
                Vec::new()
            }
            Event::InitDone => {
                if let Some(listed) = self.listing.remove(&kind) {
                    self.known.insert(kind, listed);
                }
                self.flush()
            }
            Event::Apply(obj) => {
                self.known.entry(kind).or_default().insert(obj.key(), obj.clone());
                vec![obj.applied()]
            }
            Event::Delete(obj) => {
                self.known.entry(kind).or_default().remove(&obj.key());
                match obj.deleted() {
                    Some(event) => vec![event],
                    None => {
                        self.snapshot_due = true;
                        self.flush()
                    }
                }
            }
        }
    }

    /// The owed snapshot, if any and if no list is in progress.
    fn flush(&mut self) -> Vec<SourceEvent> {
        if !self.snapshot_due || !self.listing.is_empty() {
            return Vec::new();
        }
        self.snapshot_due = false;
        let objects = self.known.values().flat_map(|objs| objs.values().cloned().map(Obj::applied));
        std::iter::once(SourceEvent::Resync).chain(objects).chain(std::iter::once(SourceEvent::Synced)).collect()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn meta(ns: &str, name: &str) -> ObjectMeta {
        ObjectMeta { namespace: (!ns.is_empty()).then(|| ns.into()), name: Some(name.into()), ..Default::default() }
    }
    fn svc(name: &str) -> Obj {
        Service { metadata: meta("default", name), ..Default::default() }.into()
    }
    fn slice(name: &str) -> Obj {
        EndpointSlice { metadata: meta("default", name), ..Default::default() }.into()
    }
    fn node(name: &str) -> Obj {
        Node { metadata: meta("", name), ..Default::default() }.into()
    }

    fn names(events: &[SourceEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                SourceEvent::ServiceApplied(o) => format!("+svc {}", o.name),
                SourceEvent::ServiceDeleted(o) => format!("-svc {}", o.name),
                SourceEvent::SliceApplied(o) => format!("+slice {}", o.name),
                SourceEvent::SliceDeleted(o) => format!("-slice {}", o.name),
                SourceEvent::NodeApplied(o) => format!("+node {}", o.name_any()),
                SourceEvent::Synced => "synced".into(),
                SourceEvent::Resync => "resync".into(),
                SourceEvent::LocalRedirectChanged(r) => format!("redirect {}", r.service),
                SourceEvent::ServiceCidrApplied(o) => format!("+servicecidr {}", o.name),
                SourceEvent::ServiceCidrDeleted(o) => format!("-servicecidr {}", o.name),
            })
            .collect()
    }

    /// Feeds events and returns everything emitted, flattened.
    fn feed(sync: &mut SyncState, events: Vec<(Kind, Event<Obj>)>) -> Vec<String> {
        events.into_iter().flat_map(|(k, e)| names(&sync.handle(k, e))).collect()
    }

    fn initial(sync: &mut SyncState) -> Vec<String> {
        feed(
            sync,
            vec![
                (Kind::Service, Event::Init),
                (Kind::Slice, Event::Init),
                (Kind::Node, Event::Init),
                (Kind::Service, Event::InitApply(svc("b"))),
                (Kind::Service, Event::InitApply(svc("a"))),
                (Kind::Service, Event::InitDone),
                (Kind::Node, Event::InitApply(node("n"))),
                (Kind::Node, Event::InitDone),
                (Kind::Slice, Event::InitApply(slice("a-1"))),
                (Kind::Slice, Event::InitDone),
            ],
        )
    }

    #[test]
    fn one_snapshot_after_all_initial_lists() {
        let mut sync = SyncState::default();
        assert_eq!(initial(&mut sync), ["resync", "+svc a", "+svc b", "+slice a-1", "+node n", "synced"]);
    }

    #[test]
    fn relist_of_one_kind_resends_all_and_live_events_go_on() {
        let mut sync = SyncState::default();
        initial(&mut sync);
        let out = feed(
            &mut sync,
            vec![
                (Kind::Service, Event::Init),
                (Kind::Service, Event::InitApply(svc("a"))),
                // Slices keep flowing while Services relist.
                (Kind::Slice, Event::Apply(slice("a-2"))),
                (Kind::Slice, Event::Delete(slice("a-1"))),
            ],
        );
        assert_eq!(out, ["+slice a-2", "-slice a-1"]);
        let out = feed(&mut sync, vec![(Kind::Service, Event::InitDone)]);
        assert_eq!(out, ["resync", "+svc a", "+slice a-2", "+node n", "synced"]);
    }

    #[test]
    fn restarted_list_drops_the_half_done_one() {
        let mut sync = SyncState::default();
        initial(&mut sync);
        let out = feed(
            &mut sync,
            vec![
                (Kind::Service, Event::Init),
                (Kind::Service, Event::InitApply(svc("a"))),
                (Kind::Service, Event::Init),
                (Kind::Service, Event::InitApply(svc("b"))),
                (Kind::Service, Event::InitDone),
            ],
        );
        assert_eq!(out, ["resync", "+svc b", "+slice a-1", "+node n", "synced"]);
    }

    #[test]
    fn overlapping_relists_give_one_snapshot() {
        let mut sync = SyncState::default();
        initial(&mut sync);
        let out = feed(
            &mut sync,
            vec![
                (Kind::Service, Event::Init),
                (Kind::Node, Event::Init),
                (Kind::Service, Event::InitDone),
                (Kind::Service, Event::Apply(svc("c"))),
                (Kind::Node, Event::InitApply(node("n"))),
                (Kind::Node, Event::InitDone),
            ],
        );
        assert_eq!(out, ["+svc c", "resync", "+svc c", "+slice a-1", "+node n", "synced"]);
    }

    #[test]
    fn node_deletion_is_a_snapshot_without_the_node() {
        let mut sync = SyncState::default();
        initial(&mut sync);
        let out = feed(&mut sync, vec![(Kind::Node, Event::Delete(node("n")))]);
        assert_eq!(out, ["resync", "+svc a", "+svc b", "+slice a-1", "synced"]);
    }
}
