//! Node readiness -> Network status.
//!
//! Every agent publishes its own readiness as a condition on its Node ([`node_condition`]);
//! the one agent holding the election Lease reads all Nodes ([`node_readiness`]), computes
//! the status gardenet wants ([`aggregate`]), folds it into the Network's current status
//! ([`merge`]) and, if that changed anything, sends [`status_patch`] to the `status`
//! subresource; [`status_update`] does those three steps in one call. All of it is pure;
//! time comes in as a parameter.
//!
//! The rules, in order:
//! - kube-proxy disabled but `kubeProxyReplacement.enabled: false`: nothing routes Services;
//!   `lastError` with `ERR_CONFIGURATION_PROBLEM`, `lastOperation.state: Error`.
//! - gardenet routes Services but some node cannot run the dataplane (or the Network asks
//!   for an IP family gardenet cannot route): `lastOperation.state: Error` and a `lastError`
//!   saying what is missing where; with kube-proxy disabled (Gardener's contract) it carries
//!   `ERR_CONFIGURATION_PROBLEM`. With kube-proxy running, kube-proxy still routes, so no code.
//! - otherwise `Processing` with progress = ready schedulable nodes in percent, until every
//!   schedulable node's agent is ready: then `Succeeded` and `ServiceRoutingReady=True`.
//! - kube-proxy routes Services and gardenet is not asked to take over: `Succeeded`.

use k8s_openapi::api::core::v1::{Node, NodeCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::capability::CapabilityReport;
use super::config::{NetworkConfig, ServiceRouting};
use super::network::{
    Condition, ConditionStatus, IpFamily, LastError, LastOperation, LastOperationState, LastOperationType, Network, NetworkSpec, NetworkStatus,
    ERR_CONFIGURATION_PROBLEM,
};
use super::PROVIDER_API_VERSION;

/// The Network condition gardenet owns.
pub const CONDITION_SERVICE_ROUTING_READY: &str = "ServiceRoutingReady";

/// The Node condition each agent maintains on its own Node.
pub const NODE_CONDITION_AGENT_READY: &str = "GardenetAgentReady";
/// Node condition: a datapath map is at least 90% full (written only once it has been True).
pub const NODE_CONDITION_MAP_PRESSURE: &str = "GardenetMapPressure";
pub const REASON_MAP_PRESSURE: &str = "MapPressure";
pub const REASON_MAPS_HAVE_ROOM: &str = "MapsHaveRoom";

/// `kind` of gardenet's `providerStatus`.
pub const PROVIDER_STATUS_KIND: &str = "NetworkStatus";

/// Families the dataplane routes: every IPv4 map has an IPv6 twin, the socket LB hooks
/// connect6/sendmsg6/recvmsg6, TC and XDP parse both; a dual-stack Service gets frontends of
/// both families (see `translate`).
pub const SUPPORTED_IP_FAMILIES: &[IpFamily] = &[IpFamily::IPv4, IpFamily::IPv6];

/// At most this many not-ready nodes are named in a message; status fields are read by
/// humans and must stay short on large clusters.
const MAX_NAMED_NODES: usize = 10;

/// Node condition reasons.
pub const REASON_AGENT_READY: &str = "AgentReady";
pub const REASON_AGENT_NOT_READY: &str = "AgentNotReady";
pub const REASON_DATAPLANE_UNAVAILABLE: &str = "DataplaneUnavailable";

/// One node as the aggregation sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeReadiness {
    pub name: String,
    /// Unschedulable (cordoned) nodes are not counted.
    pub schedulable: bool,
    /// `None`: no (live) gardenet agent has reported for this node.
    pub agent_ready: Option<bool>,
    /// Why the agent is not ready, if it said.
    pub reason: Option<String>,
    /// Dataplane prerequisites the node's agent found missing ([`CapabilityReport`]).
    pub missing: Vec<String>,
}

impl NodeReadiness {
    /// A node whose prerequisites are missing cannot be ready, whatever else it claims.
    fn is_ready(&self) -> bool {
        self.agent_ready == Some(true) && self.missing.is_empty()
    }

    fn why_not_ready(&self) -> String {
        if !self.missing.is_empty() {
            return self.missing.join("; ");
        }
        match (&self.agent_ready, &self.reason) {
            (None, _) => "no gardenet agent".to_owned(),
            (_, Some(r)) if !r.is_empty() => r.clone(),
            _ => "agent not ready".to_owned(),
        }
    }
}

/// Everything the aggregation depends on.
#[derive(Clone, Debug)]
pub struct AggregateInput<'a> {
    /// `metadata.generation` of the Network.
    pub generation: i64,
    pub spec: &'a NetworkSpec,
    pub config: &'a NetworkConfig,
    /// Whether the shoot runs kube-proxy (`spec.kubernetes.kubeProxy.enabled`).
    pub kube_proxy_enabled: bool,
    pub nodes: &'a [NodeReadiness],
    pub now: Time,
}

/// The part of the Network status gardenet writes.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredStatus {
    pub condition: Condition,
    pub last_operation: LastOperation,
    /// `None` clears a previous error.
    pub last_error: Option<LastError>,
    pub observed_generation: i64,
    pub ip_families: Vec<IpFamily>,
    pub provider_status: ProviderStatus,
}

/// gardenet's `providerStatus`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderStatus {
    pub api_version: String,
    pub kind: String,
    pub mode: RoutingMode,
    pub ready_nodes: u32,
    pub total_nodes: u32,
}

/// Who routes Services, as reported in `providerStatus.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RoutingMode {
    /// kube-proxy is disabled; gardenet routes Services.
    Replacement,
    /// kube-proxy runs, gardenet took over Service routing on request.
    Takeover,
    /// kube-proxy routes Services; gardenet does not.
    Passive,
    /// kube-proxy is disabled and gardenet is configured not to route: nobody does.
    Disabled,
}

impl From<ServiceRouting> for RoutingMode {
    fn from(r: ServiceRouting) -> Self {
        match r {
            ServiceRouting::Required => Self::Replacement,
            ServiceRouting::Requested => Self::Takeover,
            ServiceRouting::Off => Self::Passive,
            ServiceRouting::Refused => Self::Disabled,
        }
    }
}

/// Computes the status gardenet wants the Network to have.
pub fn aggregate(input: &AggregateInput<'_>) -> DesiredStatus {
    let routing = input.config.service_routing(input.kube_proxy_enabled);
    let counted: Vec<&NodeReadiness> = input.nodes.iter().filter(|n| n.schedulable).collect();
    let total = counted.len();
    let ready = counted.iter().filter(|n| n.is_ready()).count();
    // No nodes: nothing to wait for (see the NoSchedulableNodes case below).
    let progress = (ready * 100).checked_div(total).map_or(100, |p| p as i32);
    let requested_families = input.spec.effective_ip_families();

    let mut problems = Vec::new();
    if routing.active() {
        for family in requested_families.iter().filter(|f| !SUPPORTED_IP_FAMILIES.contains(f)) {
            problems.push(format!("{family} Service routing is not supported by gardenet"));
        }
        let mut incapable: Vec<&&NodeReadiness> = counted.iter().filter(|n| !n.missing.is_empty()).collect();
        incapable.sort_by(|a, b| a.name.cmp(&b.name));
        let named = incapable.len().min(MAX_NAMED_NODES);
        for n in &incapable[..named] {
            problems.push(format!("node {}: {}", n.name, n.missing.join("; ")));
        }
        if incapable.len() > named {
            problems.push(format!("and {} more nodes", incapable.len() - named));
        }
    }

    let (cond_status, reason, message, last_error) = match routing {
        ServiceRouting::Refused => {
            let msg = "kube-proxy is disabled, but providerConfig.kubeProxyReplacement.enabled is false: \
                       nothing routes Services"
                .to_owned();
            let err = new_last_error(&msg, true, &input.now);
            (ConditionStatus::False, "ServiceRoutingDisabled", msg, Some(err))
        }
        _ if !problems.is_empty() => {
            let required = routing == ServiceRouting::Required;
            let msg = if required {
                format!("kube-proxy is disabled, so gardenet must route Services, but cannot: {}", problems.join("; "))
            } else {
                format!(
                    "gardenet was asked to take over Service routing from kube-proxy, but cannot \
                     (kube-proxy keeps routing): {}",
                    problems.join("; ")
                )
            };
            let err = new_last_error(&msg, required, &input.now);
            (ConditionStatus::False, REASON_DATAPLANE_UNAVAILABLE, msg, Some(err))
        }
        ServiceRouting::Off => (
            ConditionStatus::True,
            "KubeProxyRoutesServices",
            "kube-proxy routes Services; gardenet does not take over (kubeProxyReplacement.enabled is not true)".to_owned(),
            None,
        ),
        ServiceRouting::Required | ServiceRouting::Requested if total == 0 => (
            ConditionStatus::True,
            "NoSchedulableNodes",
            // Gardener reconciles the Network before workers join; waiting for nodes here
            // would hold up shoot creation.
            "no schedulable nodes yet".to_owned(),
            None,
        ),
        ServiceRouting::Required | ServiceRouting::Requested if ready == total => {
            (ConditionStatus::True, REASON_AGENT_READY, format!("gardenet agents ready on all {total} schedulable nodes"), None)
        }
        ServiceRouting::Required | ServiceRouting::Requested => {
            let mut not_ready: Vec<&&NodeReadiness> = counted.iter().filter(|n| !n.is_ready()).collect();
            not_ready.sort_by(|a, b| a.name.cmp(&b.name));
            let mut names: Vec<String> = not_ready.iter().take(MAX_NAMED_NODES).map(|n| format!("{} ({})", n.name, n.why_not_ready())).collect();
            if not_ready.len() > MAX_NAMED_NODES {
                names.push(format!("and {} more", not_ready.len() - MAX_NAMED_NODES));
            }
            let msg = format!("{} of {total} schedulable nodes not ready: {}", not_ready.len(), names.join(", "));
            (ConditionStatus::False, REASON_AGENT_NOT_READY, msg, None)
        }
    };

    let (state, description) = if let Some(err) = &last_error {
        (LastOperationState::Error, err.description.clone())
    } else if cond_status == ConditionStatus::True {
        (LastOperationState::Succeeded, format!("Service routing reconciled: {message}"))
    } else {
        (LastOperationState::Processing, format!("Waiting for gardenet agents: {message}"))
    };
    let progress = if state == LastOperationState::Succeeded { 100 } else { progress };

    let ip_families =
        if routing.active() { requested_families.into_iter().filter(|f| SUPPORTED_IP_FAMILIES.contains(f)).collect() } else { requested_families };

    DesiredStatus {
        condition: Condition {
            type_: CONDITION_SERVICE_ROUTING_READY.to_owned(),
            status: cond_status,
            last_transition_time: Some(input.now.clone()),
            last_update_time: Some(input.now.clone()),
            reason: reason.to_owned(),
            message,
            codes: last_error.as_ref().map(|e| e.codes.clone()).unwrap_or_default(),
            extra: Default::default(),
        },
        last_operation: LastOperation { description, last_update_time: Some(input.now.clone()), progress, state, type_: LastOperationType::Reconcile },
        last_error,
        observed_generation: input.generation,
        ip_families,
        provider_status: ProviderStatus {
            api_version: PROVIDER_API_VERSION.to_owned(),
            kind: PROVIDER_STATUS_KIND.to_owned(),
            mode: routing.into(),
            ready_nodes: ready as u32,
            total_nodes: total as u32,
        },
    }
}

fn new_last_error(description: &str, configuration_problem: bool, now: &Time) -> LastError {
    LastError {
        description: description.to_owned(),
        task_id: None,
        codes: if configuration_problem { vec![ERR_CONFIGURATION_PROBLEM.to_owned()] } else { Vec::new() },
        last_update_time: Some(now.clone()),
    }
}

/// Folds `desired` into the Network's current status. Only gardenet's own fields change;
/// other conditions, `state` and `resources` are kept as they are. Timestamps are kept when
/// nothing they describe changed, so an unchanged cluster yields an unchanged status and
/// the caller can skip the patch (`merge(..) == current`).
pub fn merge(current: Option<&NetworkStatus>, desired: &DesiredStatus) -> NetworkStatus {
    let mut status = current.cloned().unwrap_or_default();

    let want = &desired.condition;
    match status.conditions.iter_mut().find(|c| c.type_ == want.type_) {
        Some(have) => {
            let transitioned = have.status != want.status;
            let changed = transitioned || have.reason != want.reason || have.message != want.message || have.codes != want.codes;
            if transitioned || have.last_transition_time.is_none() {
                have.last_transition_time = want.last_transition_time.clone();
            }
            if changed || have.last_update_time.is_none() {
                have.last_update_time = want.last_update_time.clone();
            }
            have.status = want.status.clone();
            have.reason = want.reason.clone();
            have.message = want.message.clone();
            have.codes = want.codes.clone();
        }
        None => status.conditions.push(want.clone()),
    }

    let mut op = desired.last_operation.clone();
    if let Some(have) = &status.last_operation {
        let same = have.type_ == op.type_ && have.state == op.state && have.progress == op.progress && have.description == op.description;
        if same && have.last_update_time.is_some() {
            op.last_update_time = have.last_update_time.clone();
        }
    }
    status.last_operation = Some(op);

    status.last_error = desired.last_error.clone().map(|mut err| {
        if let Some(have) = &status.last_error {
            if have.description == err.description && have.codes == err.codes && have.last_update_time.is_some() {
                err.last_update_time = have.last_update_time.clone();
            }
        }
        err
    });

    status.observed_generation = desired.observed_generation;
    status.ip_families = desired.ip_families.clone();
    status.provider_status = serde_json::to_value(&desired.provider_status).ok();
    status
}

/// A JSON merge patch for the Network's `status` subresource carrying gardenet's fields of
/// `status` (as returned by [`merge`]). `conditions` is a list and is replaced whole, which
/// is why [`merge`] starts from the current list; `lastError` is sent as `null` to clear it.
/// With `resource_version` (of the object `merge` started from) the API server rejects the
/// patch with 409 Conflict if someone else changed the Network meanwhile, so a concurrent
/// writer's condition is never overwritten with a stale list: re-read and retry.
pub fn status_patch(status: &NetworkStatus, resource_version: Option<&str>) -> Value {
    let mut patch = json!({
        "status": {
            "conditions": status.conditions,
            "lastOperation": status.last_operation,
            "lastError": status.last_error,
            "observedGeneration": status.observed_generation,
            "ipFamilies": status.ip_families,
            "providerStatus": status.provider_status,
        }
    });
    if let Some(rv) = resource_version {
        patch["metadata"] = json!({ "resourceVersion": rv });
    }
    patch
}

/// The whole aggregation step for one Network: the merge patch to send to its `status`
/// subresource, or `None` when the status is already what gardenet wants (no write, no
/// event churn).
pub fn status_update(network: &Network, config: &NetworkConfig, kube_proxy_enabled: bool, nodes: &[NodeReadiness], now: Time) -> Option<Value> {
    let desired =
        aggregate(&AggregateInput { generation: network.metadata.generation.unwrap_or(0), spec: &network.spec, config, kube_proxy_enabled, nodes, now });
    let current = network.status.as_ref();
    let merged = merge(current, &desired);
    if current == Some(&merged) {
        return None;
    }
    Some(status_patch(&merged, network.metadata.resource_version.as_deref()))
}

/// The condition an agent puts on its own Node (`nodes/status`, strategic merge by `type`).
/// `ready` is the agent's own verdict (dataplane loaded and synced); missing prerequisites
/// override it.
pub fn node_condition(ready: bool, capability: &CapabilityReport, detail: Option<&str>, now: &Time) -> NodeCondition {
    let (status, reason, message) = if !capability.is_capable() {
        ("False", REASON_DATAPLANE_UNAVAILABLE, capability.summary())
    } else if ready {
        ("True", REASON_AGENT_READY, "gardenet dataplane is loaded and in sync".to_owned())
    } else {
        ("False", REASON_AGENT_NOT_READY, detail.unwrap_or("gardenet agent is starting").to_owned())
    };
    agent_condition(NODE_CONDITION_AGENT_READY, status, reason, message, now)
}

/// A condition the agent writes on its Node, stamped `now`.
fn agent_condition(kind: &str, status: &str, reason: &str, message: String, now: &Time) -> NodeCondition {
    NodeCondition {
        type_: kind.to_owned(),
        status: status.to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message),
        last_heartbeat_time: Some(now.clone()),
        // The API server does not keep transition times for us; the agent should keep the
        // previous value when the status did not change.
        last_transition_time: Some(now.clone()),
    }
}

/// The Node condition that says a datapath map is at least 90% full (`crate::dataplane::mapfill`): True
/// with one line per map under pressure, False once all are below again.
pub fn map_pressure_condition(pressure: &[String], now: &Time) -> NodeCondition {
    let (status, reason, message) = if pressure.is_empty() {
        ("False", REASON_MAPS_HAVE_ROOM, "gardenet's datapath maps are below 90% of their capacity".to_owned())
    } else {
        ("True", REASON_MAP_PRESSURE, format!("{}; raise the map sizes in the NetworkConfig before they overflow", pressure.join("; ")))
    };
    agent_condition(NODE_CONDITION_MAP_PRESSURE, status, reason, message, now)
}

/// Reads a Node (and the condition its agent maintains) for the aggregation. A condition
/// whose heartbeat is older than `max_age_seconds` counts as no agent: a crashed agent cannot
/// withdraw its `True`, so agents must refresh the heartbeat more often than that.
pub fn node_readiness(node: &Node, now: &Time, max_age_seconds: i64) -> NodeReadiness {
    let name = node.metadata.name.clone().unwrap_or_default();
    let schedulable = !node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    let cond = node.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| cs.iter().find(|c| c.type_ == NODE_CONDITION_AGENT_READY));
    let Some(cond) = cond else {
        return NodeReadiness { name, schedulable, ..Default::default() };
    };
    let age = cond.last_heartbeat_time.as_ref().map(|hb| now.0.as_second() - hb.0.as_second());
    if age.is_none_or(|a| a > max_age_seconds) {
        return NodeReadiness { name, schedulable, agent_ready: None, reason: Some("gardenet agent stopped reporting".to_owned()), missing: Vec::new() };
    }
    let ready = cond.status == "True";
    let message = cond.message.clone().filter(|m| !m.is_empty());
    let missing = match (cond.reason.as_deref(), &message) {
        (Some(REASON_DATAPLANE_UNAVAILABLE), Some(m)) => vec![m.clone()],
        (Some(REASON_DATAPLANE_UNAVAILABLE), None) => {
            vec!["dataplane prerequisites missing".to_owned()]
        }
        _ => Vec::new(),
    };
    NodeReadiness { name, schedulable, agent_ready: Some(ready), reason: if ready { None } else { message.or_else(|| cond.reason.clone()) }, missing }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gardener::config::KubeProxyReplacement;
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};
    use k8s_openapi::jiff::Timestamp;

    fn t(secs: i64) -> Time {
        Time(Timestamp::from_second(1_700_000_000 + secs).unwrap())
    }

    fn spec() -> NetworkSpec {
        NetworkSpec {
            type_: "gardenet".into(),
            pod_cidr: "100.96.0.0/11".into(),
            service_cidr: "100.64.0.0/13".into(),
            ip_families: vec![IpFamily::IPv4],
            ..Default::default()
        }
    }

    fn node(name: &str, ready: Option<bool>) -> NodeReadiness {
        NodeReadiness { name: name.into(), schedulable: true, agent_ready: ready, ..Default::default() }
    }

    fn run(kube_proxy: bool, config: &NetworkConfig, nodes: &[NodeReadiness]) -> DesiredStatus {
        let spec = spec();
        aggregate(&AggregateInput { generation: 7, spec: &spec, config, kube_proxy_enabled: kube_proxy, nodes, now: t(0) })
    }

    #[test]
    fn all_ready() {
        let nodes = [node("a", Some(true)), node("b", Some(true))];
        let d = run(false, &NetworkConfig::default(), &nodes);
        assert_eq!(d.condition.type_, CONDITION_SERVICE_ROUTING_READY);
        assert_eq!(d.condition.status, ConditionStatus::True);
        assert_eq!(d.last_operation.state, LastOperationState::Succeeded);
        assert_eq!(d.last_operation.type_, LastOperationType::Reconcile);
        assert_eq!(d.last_operation.progress, 100);
        assert_eq!(d.last_error, None);
        assert_eq!(d.observed_generation, 7);
        assert_eq!(d.ip_families, vec![IpFamily::IPv4]);
        assert_eq!(
            d.provider_status,
            ProviderStatus {
                api_version: PROVIDER_API_VERSION.into(),
                kind: "NetworkStatus".into(),
                mode: RoutingMode::Replacement,
                ready_nodes: 2,
                total_nodes: 2,
            }
        );
    }

    #[test]
    fn some_not_ready_are_named_and_progress_is_percent() {
        let mut c = node("c", Some(false));
        c.reason = Some("syncing Services".into());
        let nodes = [node("a", Some(true)), node("b", Some(true)), c, node("d", Some(true))];
        let d = run(false, &NetworkConfig::default(), &nodes);
        assert_eq!(d.condition.status, ConditionStatus::False);
        assert_eq!(d.condition.reason, REASON_AGENT_NOT_READY);
        assert_eq!(d.condition.message, "1 of 4 schedulable nodes not ready: c (syncing Services)");
        assert_eq!(d.last_operation.state, LastOperationState::Processing);
        assert_eq!(d.last_operation.progress, 75);
        assert_eq!(d.last_error, None);
        assert_eq!((d.provider_status.ready_nodes, d.provider_status.total_nodes), (3, 4));
    }

    #[test]
    fn node_without_agent_counts_as_not_ready() {
        let nodes = [node("a", Some(true)), node("b", None), node("c", Some(true))];
        let d = run(false, &NetworkConfig::default(), &nodes);
        assert_eq!(d.condition.status, ConditionStatus::False);
        assert!(d.condition.message.contains("b (no gardenet agent)"), "{}", d.condition.message);
        assert_eq!(d.last_operation.progress, 66);
    }

    #[test]
    fn unschedulable_nodes_are_not_counted() {
        let mut cordoned = node("z", None);
        cordoned.schedulable = false;
        let nodes = [node("a", Some(true)), cordoned];
        let d = run(false, &NetworkConfig::default(), &nodes);
        assert_eq!(d.condition.status, ConditionStatus::True);
        assert_eq!((d.provider_status.ready_nodes, d.provider_status.total_nodes), (1, 1));
    }

    #[test]
    fn many_not_ready_nodes_are_truncated() {
        let nodes: Vec<_> = (0..25).map(|i| node(&format!("n{i:02}"), None)).collect();
        let d = run(false, &NetworkConfig::default(), &nodes);
        assert!(d.condition.message.starts_with("25 of 25 schedulable nodes not ready: n00 (no gardenet agent)"));
        assert!(d.condition.message.ends_with("and 15 more"), "{}", d.condition.message);
        assert_eq!(d.last_operation.progress, 0);
    }

    #[test]
    fn kube_proxy_disabled_but_routing_impossible() {
        let mut b = node("b", Some(false));
        b.missing = vec!["bpf() is not permitted (EPERM)".into(), "cgroup2 is not mounted".into()];
        let nodes = [node("a", Some(true)), b];
        let d = run(false, &NetworkConfig::default(), &nodes);
        let err = d.last_error.as_ref().expect("lastError");
        assert_eq!(err.codes, vec![ERR_CONFIGURATION_PROBLEM.to_owned()]);
        assert!(err.description.starts_with("kube-proxy is disabled, so gardenet must route Services"));
        assert!(err.description.contains("node b: bpf() is not permitted (EPERM); cgroup2 is not mounted"), "{}", err.description);
        assert_eq!(err.last_update_time, Some(t(0)));
        assert_eq!(d.last_operation.state, LastOperationState::Error);
        assert_eq!(d.last_operation.description, err.description);
        assert_eq!(d.condition.status, ConditionStatus::False);
        assert_eq!(d.condition.reason, REASON_DATAPLANE_UNAVAILABLE);
        assert_eq!(d.condition.codes, vec![ERR_CONFIGURATION_PROBLEM.to_owned()]);
    }

    #[test]
    fn takeover_that_cannot_work_is_an_error_without_the_contract_code() {
        let config = NetworkConfig { kube_proxy_replacement: KubeProxyReplacement { enabled: Some(true) }, ..Default::default() };
        let mut a = node("a", Some(false));
        a.missing = vec!["kernel 4.19 is too old".into()];
        let d = run(true, &config, &[a]);
        let err = d.last_error.expect("lastError");
        assert!(err.codes.is_empty());
        assert!(err.description.contains("kube-proxy keeps routing"));
        assert_eq!(d.last_operation.state, LastOperationState::Error);
        assert_eq!(d.provider_status.mode, RoutingMode::Takeover);
    }

    #[test]
    fn dual_stack_is_supported_and_unknown_families_are_a_configuration_problem() {
        let config = NetworkConfig::default();
        let nodes = [node("a", Some(true))];
        let run_with = |families: Vec<IpFamily>| {
            let mut s = spec();
            s.ip_families = families;
            aggregate(&AggregateInput { generation: 1, spec: &s, config: &config, kube_proxy_enabled: false, nodes: &nodes, now: t(0) })
        };
        for families in [vec![IpFamily::IPv6], vec![IpFamily::IPv4, IpFamily::IPv6], vec![IpFamily::IPv6, IpFamily::IPv4]] {
            let d = run_with(families.clone());
            assert!(d.last_error.is_none(), "{families:?}: {:?}", d.last_error);
            assert_eq!(d.last_operation.state, LastOperationState::Succeeded);
            assert_eq!(d.ip_families, families);
        }
        let d = run_with(vec![IpFamily::IPv4, IpFamily::Other("IPv7".into())]);
        let err = d.last_error.expect("lastError");
        assert!(err.description.contains("IPv7 Service routing is not supported"), "{}", err.description);
        assert_eq!(err.codes, vec![ERR_CONFIGURATION_PROBLEM.to_owned()]);
        assert_eq!(d.ip_families, vec![IpFamily::IPv4]);
    }

    #[test]
    fn kube_proxy_disabled_and_replacement_refused() {
        let config = NetworkConfig { kube_proxy_replacement: KubeProxyReplacement { enabled: Some(false) }, ..Default::default() };
        let d = run(false, &config, &[node("a", Some(true))]);
        let err = d.last_error.expect("lastError");
        assert_eq!(err.codes, vec![ERR_CONFIGURATION_PROBLEM.to_owned()]);
        assert!(err.description.contains("nothing routes Services"));
        assert_eq!(d.last_operation.state, LastOperationState::Error);
        assert_eq!(d.provider_status.mode, RoutingMode::Disabled);
    }

    #[test]
    fn kube_proxy_enabled_gardenet_stays_passive() {
        let mut b = node("b", None);
        b.missing = vec!["bpf() is not permitted".into()];
        let d = run(true, &NetworkConfig::default(), &[node("a", Some(true)), b]);
        assert_eq!(d.last_error, None, "kube-proxy routes: missing prerequisites do not matter");
        assert_eq!(d.condition.status, ConditionStatus::True);
        assert_eq!(d.condition.reason, "KubeProxyRoutesServices");
        assert_eq!(d.last_operation.state, LastOperationState::Succeeded);
        assert_eq!(d.provider_status.mode, RoutingMode::Passive);
        assert_eq!((d.provider_status.ready_nodes, d.provider_status.total_nodes), (1, 2));
    }

    #[test]
    fn no_nodes_yet_succeeds() {
        let d = run(false, &NetworkConfig::default(), &[]);
        assert_eq!(d.condition.status, ConditionStatus::True);
        assert_eq!(d.condition.reason, "NoSchedulableNodes");
        assert_eq!(d.last_operation.state, LastOperationState::Succeeded);
        assert_eq!(d.last_operation.progress, 100);
    }

    fn foreign_condition() -> Condition {
        let mut extra = std::collections::BTreeMap::new();
        extra.insert("futureField".to_owned(), json!(42));
        Condition {
            type_: "HealthCheck".into(),
            status: ConditionStatus::True,
            last_transition_time: Some(t(-100)),
            last_update_time: None,
            reason: "Other".into(),
            message: "someone else's".into(),
            codes: vec![],
            extra,
        }
    }

    #[test]
    fn merge_preserves_foreign_fields() {
        let current = NetworkStatus {
            conditions: vec![foreign_condition()],
            state: Some(json!({"opaque": 1})),
            resources: vec![json!({"name": "r"})],
            ..Default::default()
        };
        let desired = run(false, &NetworkConfig::default(), &[node("a", Some(true))]);
        let merged = merge(Some(&current), &desired);
        assert_eq!(merged.conditions.len(), 2);
        assert_eq!(merged.conditions[0], foreign_condition());
        assert_eq!(merged.conditions[1], desired.condition);
        assert_eq!(merged.state, current.state);
        assert_eq!(merged.resources, current.resources);
        assert_eq!(merged.observed_generation, 7);
        let ps = merged.provider_status.as_ref().unwrap();
        assert_eq!(ps["apiVersion"], PROVIDER_API_VERSION);
        assert_eq!(ps["kind"], "NetworkStatus");
        assert_eq!(ps["mode"], "replacement");
        assert_eq!(ps["readyNodes"], 1);
        assert_eq!(ps["totalNodes"], 1);
    }

    #[test]
    fn merge_is_stable_when_nothing_changed() {
        let spec = spec();
        let config = NetworkConfig::default();
        let nodes = [node("a", Some(true)), node("b", None)];
        let at = |now| aggregate(&AggregateInput { generation: 1, spec: &spec, config: &config, kube_proxy_enabled: false, nodes: &nodes, now });
        let first = merge(None, &at(t(0)));
        let second = merge(Some(&first), &at(t(60)));
        assert_eq!(first, second, "timestamps must not move when nothing changed");
    }

    #[test]
    fn merge_moves_timestamps_on_change() {
        let spec = spec();
        let config = NetworkConfig::default();
        let before = [node("a", Some(true)), node("b", None)];
        let after = [node("a", Some(true)), node("b", Some(true))];
        let d1 = aggregate(&AggregateInput { generation: 1, spec: &spec, config: &config, kube_proxy_enabled: false, nodes: &before, now: t(0) });
        let d2 = aggregate(&AggregateInput { generation: 1, spec: &spec, config: &config, kube_proxy_enabled: false, nodes: &after, now: t(60) });
        let s1 = merge(None, &d1);
        let s2 = merge(Some(&s1), &d2);
        let c = s2.conditions.iter().find(|c| c.type_ == CONDITION_SERVICE_ROUTING_READY).unwrap();
        assert_eq!(c.status, ConditionStatus::True);
        assert_eq!(c.last_transition_time, Some(t(60)));
        assert_eq!(s2.last_operation.as_ref().unwrap().last_update_time, Some(t(60)));
        assert_eq!(s2.last_operation.as_ref().unwrap().state, LastOperationState::Succeeded);

        // Same status, new message (another node joined not ready): transition time stays.
        let later = [node("a", Some(true)), node("b", Some(false)), node("c", None)];
        let d3 = aggregate(&AggregateInput { generation: 1, spec: &spec, config: &config, kube_proxy_enabled: false, nodes: &later, now: t(120) });
        let s3 = merge(Some(&s2), &d3);
        let fewer = [node("a", Some(true)), node("b", None)];
        let d4 = aggregate(&AggregateInput { generation: 1, spec: &spec, config: &config, kube_proxy_enabled: false, nodes: &fewer, now: t(180) });
        let s4 = merge(Some(&s3), &d4);
        let c = s4.conditions.iter().find(|c| c.type_ == CONDITION_SERVICE_ROUTING_READY).unwrap();
        assert_eq!(c.status, ConditionStatus::False);
        assert_eq!(c.last_transition_time, Some(t(120)));
        assert_eq!(c.last_update_time, Some(t(180)));
    }

    #[test]
    fn merge_clears_last_error_and_patch_says_null() {
        let spec = spec();
        let config = NetworkConfig::default();
        let mut broken = node("a", Some(false));
        broken.missing = vec!["no bpf".into()];
        let fixed = [node("a", Some(true))];
        let mk =
            |nodes: &[NodeReadiness]| aggregate(&AggregateInput { generation: 2, spec: &spec, config: &config, kube_proxy_enabled: false, nodes, now: t(0) });
        let s1 = merge(None, &mk(&[broken]));
        assert!(s1.last_error.is_some());
        let patch = status_patch(&s1, None);
        assert_eq!(patch["status"]["lastError"]["codes"][0], ERR_CONFIGURATION_PROBLEM);
        assert_eq!(patch["status"]["lastOperation"]["state"], "Error");
        let s2 = merge(Some(&s1), &mk(&fixed));
        assert_eq!(s2.last_error, None);
        let patch = status_patch(&s2, Some("42"));
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        assert!(patch["status"]["lastError"].is_null());
        assert!(patch["status"].as_object().unwrap().contains_key("lastError"));
        assert_eq!(patch["status"]["lastOperation"]["state"], "Succeeded");
        assert_eq!(patch["status"]["lastOperation"]["type"], "Reconcile");
        assert_eq!(patch["status"]["lastOperation"]["lastUpdateTime"], "2023-11-14T22:13:20Z");
        assert_eq!(patch["status"]["observedGeneration"], 2);
        assert_eq!(patch["status"]["ipFamilies"], json!(["IPv4"]));
        assert_eq!(patch["status"]["conditions"][0]["type"], CONDITION_SERVICE_ROUTING_READY);
        assert!(patch["status"].get("state").is_none(), "fields gardenet does not own are not sent");
    }

    #[test]
    fn status_update_writes_only_on_change() {
        let mut net = Network::new("n", spec());
        net.metadata.generation = Some(3);
        net.metadata.resource_version = Some("100".into());
        let config = NetworkConfig::default();
        let nodes = [node("a", Some(true))];
        let patch = status_update(&net, &config, false, &nodes, t(0)).expect("first write");
        assert_eq!(patch["metadata"]["resourceVersion"], "100");
        assert_eq!(patch["status"]["observedGeneration"], 3);
        assert_eq!(patch["status"]["lastOperation"]["state"], "Succeeded");

        // The API server applies the patch; the next round sees it and has nothing to do.
        net.status = Some(serde_json::from_value(patch["status"].clone()).unwrap());
        assert_eq!(status_update(&net, &config, false, &nodes, t(60)), None);

        // A new generation is observed.
        net.metadata.generation = Some(4);
        let patch = status_update(&net, &config, false, &nodes, t(120)).expect("generation changed");
        assert_eq!(patch["status"]["observedGeneration"], 4);
    }

    fn k8s_node(name: &str, unschedulable: bool, cond: Option<NodeCondition>) -> Node {
        Node {
            metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
            spec: Some(NodeSpec { unschedulable: Some(unschedulable), ..Default::default() }),
            status: Some(NodeStatus { conditions: cond.map(|c| vec![c]), ..Default::default() }),
        }
    }

    #[test]
    fn node_condition_round_trip() {
        let ok = CapabilityReport::default();
        let c = node_condition(true, &ok, None, &t(0));
        let r = node_readiness(&k8s_node("a", false, Some(c)), &t(10), 120);
        assert_eq!(r, NodeReadiness { name: "a".into(), schedulable: true, agent_ready: Some(true), reason: None, missing: vec![] });

        let c = node_condition(false, &ok, Some("waiting for Services sync"), &t(0));
        let r = node_readiness(&k8s_node("a", true, Some(c)), &t(10), 120);
        assert_eq!(r.agent_ready, Some(false));
        assert!(!r.schedulable);
        assert_eq!(r.reason.as_deref(), Some("waiting for Services sync"));

        let mut bad = CapabilityReport::default();
        bad.add("bpf() is not permitted (EPERM)");
        let c = node_condition(true, &bad, None, &t(0));
        assert_eq!(c.status, "False");
        let r = node_readiness(&k8s_node("a", false, Some(c)), &t(10), 120);
        assert_eq!(r.missing, vec!["bpf() is not permitted (EPERM)".to_owned()]);
        assert!(!r.is_ready());
    }

    #[test]
    fn stale_or_absent_agent_condition_means_no_agent() {
        let r = node_readiness(&k8s_node("a", false, None), &t(0), 120);
        assert_eq!(r.agent_ready, None);
        let c = node_condition(true, &CapabilityReport::default(), None, &t(0));
        let r = node_readiness(&k8s_node("a", false, Some(c)), &t(121), 120);
        assert_eq!(r.agent_ready, None);
        assert_eq!(r.reason.as_deref(), Some("gardenet agent stopped reporting"));
    }
}
