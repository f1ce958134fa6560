//! Prometheus metrics of the agent, served on `/metrics` by [`crate::report::health::serve`].
//!
//! The run loop owns no metric objects: it calls the plain methods of [`Metrics`] with what
//! it already has (a [`FlushReport`], the datapath counters, map sizes), so the pipeline and
//! dataplane stay free of any metrics dependency.
//!
//! The exposition is OpenMetrics text (what `prometheus-client` writes; Prometheus scrapes
//! it natively). Counters are registered without `_total`: the format appends it.

use std::{collections::BTreeSet, sync::Mutex, time::Duration};

use prometheus_client::{
    encoding::{text, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};

use crate::{
    pipeline::FlushReport,
    translate::{Problem, ProblemKind},
};

/// `Content-Type` of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What went wrong, as counted by `gardenet_errors_total{kind}`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ErrorKind {
    /// A Service or EndpointSlice gardenet cannot program as written.
    Translate,
    /// Two Services want the same frontend.
    Conflict,
    /// A BPF map has no room left.
    MapFull,
    /// Any other map operation failure.
    MapIo,
    /// Attaching a program to an interface or cgroup failed.
    Attach,
    /// The source of Services (API server, directory) failed.
    Source,
}

impl ErrorKind {
    /// The `kind` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Translate => "translate",
            Self::Conflict => "conflict",
            Self::MapFull => "map_full",
            Self::MapIo => "map_io",
            Self::Attach => "attach",
            Self::Source => "source",
        }
    }

    /// The label of a pipeline problem, from its kind.
    pub fn of_problem(p: &Problem) -> Self {
        match p.kind {
            ProblemKind::Translate => Self::Translate,
            ProblemKind::Conflict => Self::Conflict,
            ProblemKind::MapFull => Self::MapFull,
            ProblemKind::MapIo => Self::MapIo,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabel {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InterfaceLabel {
    interface: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FeatureLabel {
    feature: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RedirectLabel {
    service: String,
    protocol: &'static str,
    port: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TerminationLabel {
    protocol: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CounterLabel {
    counter: String,
}

/// The agent's metrics and the registry they are encoded from. Cheap to update from any
/// thread (atomics and short locks inside `prometheus-client`).
pub struct Metrics {
    registry: Registry,
    services: Gauge,
    frontends: Gauge,
    backends: Gauge,
    map_entries: Family<MapLabel, Gauge>,
    map_capacity: Family<MapLabel, Gauge>,
    map_pressure: Family<MapLabel, Gauge>,
    conntrack_entries: Gauge,
    conntrack_closed_removed: Counter,
    interface_attached: Family<InterfaceLabel, Gauge>,
    errors: Family<KindLabel, Counter>,
    map_writes: Family<OpLabel, Counter>,
    datapath_packets: Family<CounterLabel, Counter>,
    socket_terminations: Family<TerminationLabel, Counter>,
    kernel_features: Family<FeatureLabel, Gauge>,
    local_redirect_active: Family<RedirectLabel, Gauge>,
    sync_duration: Histogram,
    programming_latency: Histogram,
    /// Interfaces with a `gardenet_interface_attached` series (the family cannot be listed).
    interfaces: Mutex<BTreeSet<String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Gauges are `i64`; saturate rather than wrap for absurd sizes.
fn gauge_value(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            services: Gauge::default(),
            frontends: Gauge::default(),
            backends: Gauge::default(),
            map_entries: Family::default(),
            map_capacity: Family::default(),
            map_pressure: Family::default(),
            conntrack_entries: Gauge::default(),
            conntrack_closed_removed: Counter::default(),
            interface_attached: Family::default(),
            errors: Family::default(),
            map_writes: Family::default(),
            datapath_packets: Family::default(),
            socket_terminations: Family::default(),
            kernel_features: Family::default(),
            local_redirect_active: Family::default(),
            // One flush: 100µs .. ~3.3s.
            sync_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            // Event received -> maps written: 1ms .. ~16s (includes batching behind a slow flush).
            programming_latency: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            interfaces: Mutex::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register("gardenet_services", "Services programmed in the datapath", m.services.clone());
        r.register("gardenet_frontends", "Frontends (VIP:port/proto) programmed in the datapath", m.frontends.clone());
        r.register("gardenet_backends", "Distinct backends programmed in the datapath", m.backends.clone());
        r.register("gardenet_map_entries", "Entries in a BPF map", m.map_entries.clone());
        r.register("gardenet_map_capacity", "Capacity (max entries) of a BPF map", m.map_capacity.clone());
        r.register("gardenet_map_pressure", "1 while a BPF map is at least 90% full (reported before it overflows)", m.map_pressure.clone());
        r.register("gardenet_conntrack_entries", "Entries in the datapath's connection tracking map", m.conntrack_entries.clone());
        r.register(
            "gardenet_conntrack_closed_flows_removed",
            "Closed TCP flows (FIN both ways or RST) whose conntrack entries the agent removed",
            m.conntrack_closed_removed.clone(),
        );
        r.register("gardenet_interface_attached", "1 if the TC load balancer is attached to the interface", m.interface_attached.clone());
        r.register("gardenet_errors", "Errors by kind", m.errors.clone());
        r.register("gardenet_kernel_feature", "Kernel facilities the datapath uses: 1 present, 0 absent (a fallback is in use)", m.kernel_features.clone());
        r.register(
            "gardenet_local_redirect_active",
            "1 while a listener is bound on a local-redirect rule's address for the protocol and port",
            m.local_redirect_active.clone(),
        );
        r.register("gardenet_map_writes", "BPF map writes by operation", m.map_writes.clone());
        r.register(
            "gardenet_socket_terminations",
            "Sockets socket LB had sent to a departed backend (connected UDP, idle TCP), by protocol and result: destroyed, failed, busy (TCP with data queued, left alone)",
            m.socket_terminations.clone(),
        );
        r.register("gardenet_datapath_packets", "Datapath packet counters (summed over CPUs)", m.datapath_packets.clone());
        r.register("gardenet_sync_duration_seconds", "Duration of one flush of changes into the BPF maps", m.sync_duration.clone());
        r.register(
            "gardenet_network_programming_latency_seconds",
            "Time from receiving a Service or EndpointSlice change to its map write",
            m.programming_latency.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Records one pipeline flush: its duration, map writes and problems by kind.
    pub fn observe_flush(&self, report: &FlushReport, duration: Duration) {
        self.sync_duration.observe(duration.as_secs_f64());
        self.map_writes.get_or_create(&OpLabel { op: "put" }).inc_by(u64::from(report.writes.puts));
        self.map_writes.get_or_create(&OpLabel { op: "delete" }).inc_by(u64::from(report.writes.deletes));
        self.observe_problems(&report.problems);
    }

    /// Counts problems by kind (`gardenet_errors_total`).
    pub fn observe_problems(&self, problems: &[Problem]) {
        for p in problems {
            self.error(ErrorKind::of_problem(p));
        }
    }

    /// Records the network programming latency of one batch (first event received -> written).
    pub fn observe_programming_latency(&self, latency: Duration) {
        self.programming_latency.observe(latency.as_secs_f64());
    }

    pub fn set_programmed(&self, frontends: usize, backends: usize, services: usize) {
        self.frontends.set(gauge_value(frontends));
        self.backends.set(gauge_value(backends));
        self.services.set(gauge_value(services));
    }

    /// The datapath's per-CPU counters as summed by `Dataplane::stats()`. They are absolute
    /// (kept in pinned maps, so they survive agent restarts): stored, not added. A value that
    /// goes down (maps were recreated) is a counter reset to Prometheus, as it should be.
    pub fn set_datapath(&self, stats: &[(&str, u64)]) {
        for (name, value) in stats {
            self.datapath_packets.get_or_create(&CounterLabel { counter: (*name).to_owned() }).inner().store(*value, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// `gardenet_socket_terminations_total{protocol="udp"|"tcp", result="destroyed"|"failed"|"busy"}`.
    pub fn observe_socket_termination(&self, t: &crate::dataplane::sockterm::Terminated) {
        let protocol = match t.proto {
            crate::desired::Proto::Tcp => "tcp",
            crate::desired::Proto::Udp => "udp",
        };
        for (result, n) in [("destroyed", t.destroyed), ("failed", t.failed), ("busy", t.busy)] {
            self.socket_terminations.get_or_create(&TerminationLabel { protocol, result }).inc_by(n as u64);
        }
    }

    /// Fill level of one map: alert on `entries / capacity` or on `gardenet_map_pressure`.
    pub fn set_map_fill(&self, fill: &crate::dataplane::mapfill::Fill) {
        let label = MapLabel { map: fill.map.to_owned() };
        self.map_entries.get_or_create(&label).set(gauge_value(fill.entries));
        self.map_capacity.get_or_create(&label).set(gauge_value(fill.capacity));
        self.map_pressure.get_or_create(&label).set(i64::from(fill.under_pressure()));
    }

    /// `gardenet_kernel_feature{feature}`: 1 where the running kernel has it (see `features`).
    pub fn set_kernel_features(&self, features: &[crate::dataplane::features::Feature]) {
        for f in features {
            self.kernel_features.get_or_create(&FeatureLabel { feature: f.name.to_owned() }).set(i64::from(f.present));
        }
    }

    /// `gardenet_local_redirect_active{service,protocol,port}` (see `crate::source::listeners`).
    pub fn set_local_redirect(&self, service: &str, proto: crate::desired::Proto, port: u16, active: bool) {
        let protocol = match proto {
            crate::desired::Proto::Tcp => "tcp",
            crate::desired::Proto::Udp => "udp",
        };
        self.local_redirect_active.get_or_create(&RedirectLabel { service: service.to_owned(), protocol, port: port.to_string() }).set(i64::from(active));
    }

    pub fn set_conntrack_entries(&self, entries: usize) {
        self.conntrack_entries.set(gauge_value(entries));
    }

    pub fn add_conntrack_closed_removed(&self, flows: usize) {
        self.conntrack_closed_removed.inc_by(flows as u64);
    }

    pub fn set_interface(&self, interface: &str, attached: bool) {
        self.interface_attached.get_or_create(&InterfaceLabel { interface: interface.to_owned() }).set(i64::from(attached));
        self.known_interfaces().insert(interface.to_owned());
    }

    fn known_interfaces(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.interfaces.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces all interface series: interfaces not listed are no longer reported.
    pub fn set_interfaces<'a>(&self, interfaces: impl IntoIterator<Item = (&'a str, bool)>) {
        // Series are updated in place and only the departed removed: a scrape never sees
        // a present interface missing.
        let mut now = BTreeSet::new();
        for (name, attached) in interfaces {
            self.set_interface(name, attached);
            now.insert(name.to_owned());
        }
        let mut known = self.known_interfaces();
        for gone in known.difference(&now) {
            self.interface_attached.remove(&InterfaceLabel { interface: gone.clone() });
        }
        *known = now;
    }

    /// An interface that went away is no longer reported (rather than reported detached).
    pub fn remove_interface(&self, interface: &str) {
        self.interface_attached.remove(&InterfaceLabel { interface: interface.to_owned() });
        self.known_interfaces().remove(interface);
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors.get_or_create(&KindLabel { kind: kind.as_str() }).inc();
    }

    /// The exposition, for `/metrics`.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an encoder error would be a bug in a metric
        // name, and a partial page is better than none.
        if let Err(e) = text::encode(&mut out, &self.registry) {
            tracing::warn!("encoding metrics: {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::lbmap::Writes;

    fn problem(kind: ProblemKind, m: &str) -> Problem {
        Problem::service("d/a", kind, m)
    }

    #[test]
    fn problems_are_labelled_by_kind_not_by_message() {
        use ErrorKind::*;
        use ProblemKind as P;
        // The same text under every kind: only the kind decides.
        let kinds: Vec<ErrorKind> =
            [P::Conflict, P::MapFull, P::MapIo, P::Translate].iter().map(|k| ErrorKind::of_problem(&problem(*k, "map backends is full"))).collect();
        assert_eq!(kinds, [Conflict, MapFull, MapIo, Translate]);
    }

    #[test]
    fn exposition_has_every_metric() {
        let m = Metrics::new();
        let report = FlushReport {
            services: 2,
            writes: Writes { puts: 5, deletes: 1 },
            problems: vec![problem(ProblemKind::MapFull, "frontend 10.96.0.1:80/TCP: map backends is full (put 7)")],
            ..Default::default()
        };
        m.observe_flush(&report, Duration::from_millis(3));
        m.observe_programming_latency(Duration::from_millis(12));
        m.set_programmed(3, 4, 2);
        m.set_datapath(&[("sock_lb_hits", 42), ("tc_lb_hits", 7)]);
        m.set_datapath(&[("sock_lb_hits", 40)]);
        m.set_map_fill(&crate::dataplane::mapfill::Fill { map: "services", entries: 10, capacity: 65536 });
        m.set_map_fill(&crate::dataplane::mapfill::Fill { map: "conntrack", entries: 950, capacity: 1000 });
        m.set_conntrack_entries(9);
        m.add_conntrack_closed_removed(4);
        m.set_interface("eth0", true);
        m.set_interface("eth1", false);
        m.set_local_redirect("kube-system/kube-dns", crate::desired::Proto::Udp, 53, true);
        m.set_local_redirect("kube-system/kube-dns", crate::desired::Proto::Tcp, 53, true);
        m.set_local_redirect("kube-system/kube-dns", crate::desired::Proto::Tcp, 53, false);
        m.error(ErrorKind::Attach);
        let text = m.encode();
        for line in [
            "gardenet_services 2",
            "gardenet_frontends 3",
            "gardenet_backends 4",
            "gardenet_map_entries{map=\"services\"} 10",
            "gardenet_map_capacity{map=\"services\"} 65536",
            "gardenet_map_pressure{map=\"services\"} 0",
            "gardenet_map_pressure{map=\"conntrack\"} 1",
            "gardenet_conntrack_entries 9",
            "gardenet_conntrack_closed_flows_removed_total 4",
            "gardenet_interface_attached{interface=\"eth0\"} 1",
            "gardenet_interface_attached{interface=\"eth1\"} 0",
            "gardenet_local_redirect_active{service=\"kube-system/kube-dns\",protocol=\"udp\",port=\"53\"} 1",
            "gardenet_local_redirect_active{service=\"kube-system/kube-dns\",protocol=\"tcp\",port=\"53\"} 0",
            "gardenet_errors_total{kind=\"map_full\"} 1",
            "gardenet_errors_total{kind=\"attach\"} 1",
            "gardenet_map_writes_total{op=\"put\"} 5",
            "gardenet_map_writes_total{op=\"delete\"} 1",
            // Absolute values are stored, not summed.
            "gardenet_datapath_packets_total{counter=\"sock_lb_hits\"} 40",
            "gardenet_datapath_packets_total{counter=\"tc_lb_hits\"} 7",
            "gardenet_sync_duration_seconds_count 1",
            "gardenet_network_programming_latency_seconds_count 1",
            "# TYPE gardenet_sync_duration_seconds histogram",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        m.remove_interface("eth1");
        assert!(!m.encode().contains("eth1"));
        m.set_interfaces([("eth2", true)]);
        let text = m.encode();
        assert!(!text.contains("eth0") && text.contains("interface=\"eth2\"} 1"), "{text}");
    }
}
