//! Kubernetes Events for Services gardenet cannot program as asked (bad addresses, ports out
//! of range, conflicting frontends, full maps) and for EndpointSlices without a Service:
//! `kubectl describe` shows why. Node-level warnings (a map under pressure) go on the Node.
use std::collections::HashSet;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    runtime::events::{Event, EventType, Recorder, Reporter},
    Client,
};

use crate::translate::{Problem, ProblemObject};

/// Warning Events on this node's objects; cloneable, so servers running in their own tasks
/// (the health check ports) keep one. Publishing happens off the caller's task so an
/// unreachable API server never delays anything.
#[derive(Clone)]
pub struct Warnings {
    recorder: Recorder,
    node: String,
}

impl Warnings {
    pub fn new(client: Client, node_name: &str) -> Self {
        let reporter = Reporter { controller: "gardenet-agent".into(), instance: Some(node_name.to_owned()) };
        Warnings { recorder: Recorder::new(client, reporter), node: node_name.to_owned() }
    }

    /// The node this agent runs on (kube-proxy names it in its messages too).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// A Warning Event on the agent's own Node (e.g. a map under pressure).
    pub fn on_node(&self, reason: &str, action: &str, note: &str) {
        let reference = ObjectReference { api_version: Some("v1".into()), kind: Some("Node".into()), name: Some(self.node.clone()), ..Default::default() };
        self.publish(warning(reason, action, note), reference);
    }

    /// A Warning Event on a Service.
    pub fn on_service(&self, namespace: &str, name: &str, reason: &str, action: &str, note: &str) {
        self.publish(warning(reason, action, note), reference("v1", "Service", namespace, name));
    }

    fn publish(&self, ev: Event, reference: ObjectReference) {
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::debug!("publishing an event for {}/{}: {e}", reference.namespace.unwrap_or_default(), reference.name.unwrap_or_default());
            }
        });
    }
}

fn warning(reason: &str, action: &str, note: &str) -> Event {
    Event { type_: EventType::Warning, reason: reason.into(), note: Some(note.chars().take(1000).collect()), action: action.into(), secondary: None }
}

fn reference(api_version: &str, kind: &str, namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(kind.into()),
        namespace: Some(namespace.to_owned()),
        name: Some(name.to_owned()),
        ..Default::default()
    }
}

/// Publishes each distinct (Service, problem) once.
pub struct ProblemEvents {
    warnings: Warnings,
    seen: HashSet<(String, String)>,
}

/// Bound on remembered problems; past it the memory is reset (repeats are then re-published,
/// which the API server folds into an event series).
const MAX_SEEN: usize = 10_000;

impl ProblemEvents {
    pub fn new(warnings: Warnings) -> Self {
        ProblemEvents { warnings, seen: HashSet::new() }
    }

    /// A Warning Event on the agent's own Node (e.g. a map under pressure).
    pub fn node_warning(&self, reason: &str, note: &str) {
        self.warnings.on_node(reason, "Program", note);
    }

    pub fn report(&mut self, problems: &[Problem]) {
        for p in problems {
            let Some((ns, name)) = p.service.split_once('/') else { continue };
            if !self.seen.insert((p.service.clone(), p.message.clone())) {
                continue;
            }
            if self.seen.len() > MAX_SEEN {
                self.seen.clear();
            }
            let (api_version, kind) = match p.object {
                ProblemObject::Service => ("v1", "Service"),
                ProblemObject::EndpointSlice => ("discovery.k8s.io/v1", "EndpointSlice"),
            };
            self.warnings.publish(warning(p.kind.event_reason(), "Program", &p.message), reference(api_version, kind, ns, name));
        }
    }
}
