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

/// Publishes each distinct (Service, problem) once; publishing happens off the run loop so an
/// unreachable API server never delays programming.
pub struct ProblemEvents {
    recorder: Recorder,
    seen: HashSet<(String, String)>,
    node: String,
}

/// Bound on remembered problems; past it the memory is reset (repeats are then re-published,
/// which the API server folds into an event series).
const MAX_SEEN: usize = 10_000;

impl ProblemEvents {
    pub fn new(client: Client, node_name: &str) -> Self {
        let reporter = Reporter { controller: "gardenet-agent".into(), instance: Some(node_name.to_owned()) };
        ProblemEvents { recorder: Recorder::new(client, reporter), seen: HashSet::new(), node: node_name.to_owned() }
    }

    /// A Warning Event on the agent's own Node (e.g. a map under pressure).
    pub fn node_warning(&self, reason: &str, note: &str) {
        let reference = ObjectReference { api_version: Some("v1".into()), kind: Some("Node".into()), name: Some(self.node.clone()), ..Default::default() };
        self.publish(
            Event {
                type_: EventType::Warning,
                reason: reason.into(),
                note: Some(note.chars().take(1000).collect()),
                action: "Program".into(),
                secondary: None,
            },
            reference,
        );
    }

    fn publish(&self, ev: Event, reference: ObjectReference) {
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::debug!("publishing an event for {}/{}: {e}", reference.namespace.unwrap_or_default(), reference.name.unwrap_or_default());
            }
        });
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
            let reference = ObjectReference {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
                namespace: Some(ns.to_owned()),
                name: Some(name.to_owned()),
                ..Default::default()
            };
            let ev = Event {
                type_: EventType::Warning,
                reason: p.kind.event_reason().into(),
                note: Some(p.message.chars().take(1000).collect()),
                action: "Program".into(),
                secondary: None,
            };
            self.publish(ev, reference);
        }
    }
}
