//! gardenet agent, in the order the data flows:
//!
//! - [`source`]: Services, EndpointSlices, Nodes, ServiceCIDRs (API server or a directory)
//!   and local listeners, digested on arrival ([`source::objects`]);
//! - [`translate`] and [`pipeline`]: what the cluster says -> the desired dataplane state
//!   ([`desired`]: frontends and their backends), per Service, as objects change;
//! - [`dataplane`]: the map writer ([`dataplane::lbmap`], make-before-break), the loader and
//!   the pinned maps' layout, socket termination, map fill;
//! - [`links`]: which interfaces get TC/XDP programs, attached through pinned bpf_links;
//! - [`report`]: health and metrics endpoints, Events, Node conditions, the Network status;
//! - [`run`] wires them; [`commands`] are the inspection subcommands; [`gardener`] is the
//!   pure Gardener side (NetworkConfig, aggregation, capability).
pub mod commands;
pub mod dataplane;
pub mod desired;
pub mod gardener;
pub mod links;
pub mod pipeline;
pub mod podnet;
pub mod report;
pub mod run;
pub mod settings;
pub mod source;
pub mod translate;
