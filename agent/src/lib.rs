//! gardenet agent: sources -> desired-state model -> map writer -> eBPF.
pub mod dataplane;
pub mod gardener;
pub mod lbmap;
pub mod model;
pub mod pipeline;
pub mod run;
pub mod source;
pub mod translate;
