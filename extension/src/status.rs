//! The Network status the extension writes, as merge patches for the `status` subresource.
//! Each patch names only the extension's fields, so fields of other writers survive
//! (`state` and `resources` belong to gardenlet, foreign conditions to their owners).

use gardenet_agent::gardener::aggregate::{self, AggregateInput, RoutingMode, PROVIDER_STATUS_KIND};
use gardenet_agent::gardener::network::{
    Condition, LastOperationState, LastOperationType, Network, NetworkStatus, ERR_CONFIGURATION_PROBLEM,
};
use gardenet_agent::gardener::aggregate::NodeReadiness;
use gardenet_agent::gardener::PROVIDER_API_VERSION;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;
use serde_json::{json, Value};

use crate::contract::Plan;
use crate::operation::ANNOTATION_TIMESTAMP;

/// gardenet's `providerStatus` as the extension writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderStatus {
    pub api_version: &'static str,
    pub kind: &'static str,
    /// Who routes Services.
    pub mode: RoutingMode,
    /// The ManagedResource Secret the shoot was last reconciled from.
    pub secret: String,
}

/// The time to record: now, but never before gardenlet's `gardener.cloud/timestamp`
/// (gardenlet waits for a `lastUpdateTime` after the time it asked; clocks differ). The
/// result is rounded up to whole seconds, because that is all a `metav1.Time` keeps: a
/// truncated time from the same second would read as older than the request.
pub fn operation_time(now: Time, network: &Network) -> Time {
    let asked = network
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TIMESTAMP))
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    let Some(asked) = asked else { return now };
    let t = asked.max(now.0);
    if t.subsec_nanosecond() == 0 {
        return Time(t);
    }
    Time(k8s_openapi::jiff::Timestamp::from_second(t.as_second() + 1).unwrap_or(t))
}

fn last_operation(type_: &LastOperationType, state: LastOperationState, progress: i32, description: &str, at: &Time) -> Value {
    json!({"type": type_, "state": state, "progress": progress, "description": description, "lastUpdateTime": at})
}

/// What an operation is called in descriptions ("Reconciling the network").
pub fn verb(type_: &LastOperationType) -> (&'static str, &'static str) {
    match type_ {
        LastOperationType::Create | LastOperationType::Reconcile => ("Reconciling", "reconciled"),
        LastOperationType::Delete => ("Deleting", "deleted"),
        LastOperationType::Migrate => ("Migrating", "migrated"),
        LastOperationType::Restore => ("Restoring", "restored"),
        _ => ("Processing", "processed"),
    }
}

pub fn processing(type_: &LastOperationType, at: &Time) -> Value {
    let description = format!("{} the network", verb(type_).0);
    json!({"status": {"lastOperation": last_operation(type_, LastOperationState::Processing, 1, &description, at)}})
}

/// Success; a reconcile also records what it reconciled to.
pub fn succeeded(type_: &LastOperationType, generation: i64, reconciled: Option<(&Plan, ProviderStatus)>, at: &Time) -> Value {
    let description = format!("Successfully {} the network", verb(type_).1);
    let mut status = json!({
        "lastOperation": last_operation(type_, LastOperationState::Succeeded, 100, &description, at),
        "lastError": null,
        "observedGeneration": generation,
    });
    if let Some((plan, provider)) = reconciled {
        status["providerStatus"] = serde_json::to_value(provider).unwrap_or(Value::Null);
        status["ipFamilies"] = json!(plan.ip_families);
    }
    json!({"status": status})
}

/// A failed operation: `state: Error` and a `lastError`, with `ERR_CONFIGURATION_PROBLEM`
/// when only a change of the configuration can fix it.
pub fn error(type_: &LastOperationType, generation: i64, description: &str, configuration_problem: bool, at: &Time) -> Value {
    let text = format!("Error {} the network: {description}", verb(type_).0.to_lowercase());
    let codes: Vec<&str> = if configuration_problem { vec![ERR_CONFIGURATION_PROBLEM] } else { Vec::new() };
    json!({"status": {
        "lastOperation": last_operation(type_, LastOperationState::Error, 50, &text, at),
        "lastError": {"description": text, "codes": codes, "lastUpdateTime": at},
        "observedGeneration": generation,
    }})
}

pub fn provider_status(plan: &Plan, secret: &str) -> ProviderStatus {
    ProviderStatus {
        api_version: PROVIDER_API_VERSION,
        kind: PROVIDER_STATUS_KIND,
        mode: plan.routing.into(),
        secret: secret.to_owned(),
    }
}

/// The `ServiceRoutingReady` condition from the shoot's Nodes, merged into the current
/// conditions (others kept, times kept while nothing changed). `None`: nothing to write.
/// The patch carries the resourceVersion it was computed from: merge patches replace whole
/// lists, so a concurrent change of another condition must make this write fail, not vanish.
pub fn condition_patch(network: &Network, plan: &Plan, nodes: &[NodeReadiness], now: Time) -> Option<Value> {
    let desired = aggregate::aggregate(&AggregateInput {
        generation: network.metadata.generation.unwrap_or_default(),
        spec: &network.spec,
        config: &plan.config,
        kube_proxy_enabled: plan.kube_proxy_enabled,
        nodes,
        now,
    });
    let current = network.status.clone().unwrap_or_default();
    // Only the condition is taken from the aggregation: lastOperation stays the extension's.
    let merged: NetworkStatus = aggregate::merge(Some(&current), &desired);
    let conditions: Vec<Condition> = merged.conditions;
    if conditions == current.conditions {
        return None;
    }
    Some(json!({
        "metadata": {"resourceVersion": network.metadata.resource_version},
        "status": {"conditions": conditions},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ApiServerEndpoint;
    use gardenet_agent::gardener::config::{NetworkConfig, ServiceRouting};
    use gardenet_agent::gardener::network::{IpFamily, NetworkSpec};

    fn time(s: &str) -> Time {
        Time(s.parse().unwrap())
    }

    fn network(annotations: Option<(&str, &str)>) -> Network {
        let mut n = Network::new("n", NetworkSpec { type_: "gardenet".into(), ..Default::default() });
        n.metadata.generation = Some(3);
        n.metadata.resource_version = Some("7".into());
        if let Some((k, v)) = annotations {
            n.metadata.annotations = Some([(k.to_owned(), v.to_owned())].into());
        }
        n
    }

    fn plan() -> Plan {
        Plan {
            config: NetworkConfig::default(),
            routing: ServiceRouting::Required,
            kube_proxy_enabled: false,
            api_server: Some(ApiServerEndpoint { host: "a".into(), port: 443 }),
            ip_families: vec![IpFamily::IPv4],
        }
    }

    #[test]
    fn time_is_never_before_gardenlets_request() {
        let now = time("2025-01-01T10:00:00Z");
        assert_eq!(operation_time(now.clone(), &network(None)), now);
        let later = network(Some((ANNOTATION_TIMESTAMP, "2025-01-01T10:00:05Z")));
        assert_eq!(operation_time(now.clone(), &later), time("2025-01-01T10:00:05Z"));
        let earlier = network(Some((ANNOTATION_TIMESTAMP, "2025-01-01T09:00:00Z")));
        assert_eq!(operation_time(now.clone(), &earlier), now);
        // Sub-second requests round up: the written (whole-second) time is not before them.
        let same_second = network(Some((ANNOTATION_TIMESTAMP, "2025-01-01T10:00:00.5Z")));
        assert_eq!(operation_time(now.clone(), &same_second), time("2025-01-01T10:00:01Z"));
        let garbage = network(Some((ANNOTATION_TIMESTAMP, "yesterday")));
        assert_eq!(operation_time(now.clone(), &garbage), now);
    }

    #[test]
    fn patches_have_gardeners_shape() {
        let at = time("2025-01-01T10:00:00Z");
        let p = processing(&LastOperationType::Create, &at);
        assert_eq!(p["status"]["lastOperation"]["state"], "Processing");
        assert_eq!(p["status"]["lastOperation"]["type"], "Create");
        assert_eq!(p["status"]["lastOperation"]["lastUpdateTime"], "2025-01-01T10:00:00Z");
        assert_eq!(p["status"].as_object().unwrap().len(), 1);

        let plan = plan();
        let s = succeeded(&LastOperationType::Reconcile, 3, Some((&plan, provider_status(&plan, "s1"))), &at);
        assert_eq!(s["status"]["lastOperation"]["progress"], 100);
        assert_eq!(s["status"]["lastError"], Value::Null);
        assert_eq!(s["status"]["observedGeneration"], 3);
        assert_eq!(s["status"]["ipFamilies"], json!(["IPv4"]));
        assert_eq!(s["status"]["providerStatus"]["kind"], "NetworkStatus");
        assert_eq!(s["status"]["providerStatus"]["apiVersion"], PROVIDER_API_VERSION);
        assert_eq!(s["status"]["providerStatus"]["mode"], "replacement");

        let e = error(&LastOperationType::Reconcile, 3, "bad", true, &at);
        assert_eq!(e["status"]["lastOperation"]["state"], "Error");
        assert_eq!(e["status"]["lastError"]["codes"], json!([ERR_CONFIGURATION_PROBLEM]));
        assert!(e["status"]["lastError"]["description"].as_str().unwrap().ends_with(": bad"));
        let e = error(&LastOperationType::Delete, 3, "timeout", false, &at);
        assert_eq!(e["status"]["lastError"]["codes"], json!([]));
    }

    #[test]
    fn condition_names_not_ready_nodes_and_is_written_only_on_change() {
        let nodes = [
            NodeReadiness { name: "a".into(), schedulable: true, agent_ready: Some(true), ..Default::default() },
            NodeReadiness {
                name: "b".into(),
                schedulable: true,
                agent_ready: Some(false),
                reason: Some("syncing".into()),
                ..Default::default()
            },
        ];
        let mut n = network(None);
        let patch = condition_patch(&n, &plan(), &nodes, time("2025-01-01T10:00:00Z")).unwrap();
        assert_eq!(patch["metadata"]["resourceVersion"], "7");
        let cond = &patch["status"]["conditions"][0];
        assert_eq!(cond["type"], "ServiceRoutingReady");
        assert_eq!(cond["status"], "False");
        assert!(cond["message"].as_str().unwrap().contains("b (syncing)"), "{cond}");
        let conditions = serde_json::from_value(patch["status"]["conditions"].clone()).unwrap();
        n.status = Some(NetworkStatus { conditions, ..Default::default() });
        assert_eq!(condition_patch(&n, &plan(), &nodes, time("2025-01-01T10:01:00Z")), None);
    }
}
