//! Prometheus metrics of the controller: reconciles by operation, and their errors by
//! operation and kind.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabel {
    operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    operation: String,
    kind: String,
}

pub struct Metrics {
    registry: Registry,
    reconciles: Family<OperationLabel, Counter>,
    errors: Family<ErrorLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<OperationLabel, Counter>::default();
        let errors = Family::<ErrorLabel, Counter>::default();
        registry.register("gardenet_extension_reconciles", "Network operations run, by operation", reconciles.clone());
        registry.register("gardenet_extension_reconcile_errors", "Network operations that failed, by operation and kind (configuration, api)", errors.clone());
        Metrics { registry, reconciles, errors }
    }
}

impl Metrics {
    pub fn reconciled(&self, operation: &str) {
        self.reconciles.get_or_create(&OperationLabel { operation: operation.to_owned() }).inc();
    }

    pub fn failed(&self, operation: &str, kind: &str) {
        self.errors.get_or_create(&ErrorLabel { operation: operation.to_owned(), kind: kind.to_owned() }).inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_label() {
        let m = Metrics::default();
        m.reconciled("reconcile");
        m.reconciled("reconcile");
        m.failed("delete", "api");
        let text = m.encode();
        assert!(text.contains("gardenet_extension_reconciles_total{operation=\"reconcile\"} 2"), "{text}");
        assert!(text.contains("gardenet_extension_reconcile_errors_total{operation=\"delete\",kind=\"api\"} 1"), "{text}");
    }
}
