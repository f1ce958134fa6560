//! gardenet agent: sources -> desired-state model -> map writer -> eBPF.
pub mod dataplane;
pub mod events;
pub mod features;
pub mod gardener;
pub mod healthcheck;
pub mod lbmap;
pub mod links;
pub mod model;
pub mod pinned_link;
pub mod pipeline;
pub mod run;
pub mod source;
pub mod translate;
pub mod view;
pub mod health;
pub mod metrics;
pub mod status;
