//! The Network status the extension writes, as merge patches for the `status` subresource,
//! with the fields and texts of Gardener's `StatusUpdater` (`extensions/pkg/controller/status.go`)
//! as the network reconciler calls it: `Processing` (progress 1, "Reconciling the Network"),
//! `Error` (progress 50, observedGeneration, lastError "Error reconciling Network: ..." with
//! the codes the error carries) and `Success` (progress 100, observedGeneration, no lastError).
//! Each patch names only the extension's fields, so fields of other writers survive
//! (`state` and `resources` belong to gardenlet, foreign conditions to their owners).

use gardenet_agent::gardener::aggregate::NodeReadiness;
use gardenet_agent::gardener::aggregate::{self, AggregateInput, RoutingMode, PROVIDER_STATUS_KIND};
use gardenet_agent::gardener::network::{Condition, LastOperationState, LastOperationType, Network, NetworkStatus, ERR_CONFIGURATION_PROBLEM};
use gardenet_agent::gardener::PROVIDER_API_VERSION;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;
use serde_json::{json, Value};

use crate::contract::Plan;

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

fn last_operation(type_: &LastOperationType, state: LastOperationState, progress: i32, description: &str, at: &Time) -> Value {
    json!({"type": type_, "state": state, "progress": progress, "description": description, "lastUpdateTime": at})
}

/// What an operation is called in descriptions: ("Reconciling", "reconciling", "reconciled").
pub fn verb(type_: &LastOperationType) -> (&'static str, &'static str, &'static str) {
    match type_ {
        LastOperationType::Create | LastOperationType::Reconcile => ("Reconciling", "reconciling", "reconciled"),
        LastOperationType::Delete => ("Deleting", "deleting", "deleted"),
        LastOperationType::Migrate => ("Migrating", "migrating", "migrated"),
        LastOperationType::Restore => ("Restoring", "restoring", "restored"),
        _ => ("Processing", "processing", "processed"),
    }
}

pub fn processing(type_: &LastOperationType, at: &Time) -> Value {
    let description = format!("{} the Network", verb(type_).0);
    json!({"status": {"lastOperation": last_operation(type_, LastOperationState::Processing, 1, &description, at)}})
}

/// Success; a reconcile also records what it reconciled to.
pub fn succeeded(type_: &LastOperationType, generation: i64, reconciled: Option<(&Plan, ProviderStatus)>, at: &Time) -> Value {
    let description = format!("Successfully {} Network", verb(type_).2);
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
/// when only a change of the configuration can fix it (no `codes` otherwise, as
/// `ExtractErrorCodes` finds none). The description starts upper-case
/// (`FormatLastErrDescription`).
pub fn error(type_: &LastOperationType, generation: i64, description: &str, configuration_problem: bool, at: &Time) -> Value {
    let text = format!("Error {} Network: {description}", verb(type_).1);
    let mut last_error = json!({"description": text, "lastUpdateTime": at});
    if configuration_problem {
        last_error["codes"] = json!([ERR_CONFIGURATION_PROBLEM]);
    }
    json!({"status": {
        "lastOperation": last_operation(type_, LastOperationState::Error, 50, &text, at),
        "lastError": last_error,
        "observedGeneration": generation,
    }})
}

pub fn provider_status(plan: &Plan, secret: &str) -> ProviderStatus {
    ProviderStatus { api_version: PROVIDER_API_VERSION, kind: PROVIDER_STATUS_KIND, mode: plan.routing.into(), secret: secret.to_owned() }
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
    fn patches_have_gardeners_shape() {
        let at = time("2025-01-01T10:00:00Z");
        let p = processing(&LastOperationType::Create, &at);
        assert_eq!(p["status"]["lastOperation"]["state"], "Processing");
        assert_eq!(p["status"]["lastOperation"]["type"], "Create");
        assert_eq!(p["status"]["lastOperation"]["lastUpdateTime"], "2025-01-01T10:00:00Z");
        assert_eq!(p["status"]["lastOperation"]["description"], "Reconciling the Network");
        assert_eq!(p["status"]["lastOperation"]["progress"], 1);
        assert_eq!(p["status"].as_object().unwrap().len(), 1);

        let plan = plan();
        let s = succeeded(&LastOperationType::Reconcile, 3, Some((&plan, provider_status(&plan, "s1"))), &at);
        assert_eq!(s["status"]["lastOperation"]["progress"], 100);
        assert_eq!(s["status"]["lastOperation"]["description"], "Successfully reconciled Network");
        assert_eq!(s["status"]["lastError"], Value::Null);
        assert_eq!(s["status"]["observedGeneration"], 3);
        assert_eq!(s["status"]["ipFamilies"], json!(["IPv4"]));
        assert_eq!(s["status"]["providerStatus"]["kind"], "NetworkStatus");
        assert_eq!(s["status"]["providerStatus"]["apiVersion"], PROVIDER_API_VERSION);
        assert_eq!(s["status"]["providerStatus"]["mode"], "replacement");

        let e = error(&LastOperationType::Reconcile, 3, "bad", true, &at);
        assert_eq!(e["status"]["lastOperation"]["state"], "Error");
        assert_eq!(e["status"]["lastError"]["codes"], json!([ERR_CONFIGURATION_PROBLEM]));
        assert_eq!(e["status"]["lastError"]["description"], "Error reconciling Network: bad");
        assert_eq!(e["status"]["lastOperation"]["progress"], 50);
        let e = error(&LastOperationType::Delete, 3, "timeout", false, &at);
        assert_eq!(e["status"]["lastError"]["description"], "Error deleting Network: timeout");
        assert!(e["status"]["lastError"].get("codes").is_none(), "{e}");
    }

    #[test]
    fn condition_names_not_ready_nodes_and_is_written_only_on_change() {
        let nodes = [
            NodeReadiness { name: "a".into(), schedulable: true, agent_ready: Some(true), ..Default::default() },
            NodeReadiness { name: "b".into(), schedulable: true, agent_ready: Some(false), reason: Some("syncing".into()), ..Default::default() },
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
