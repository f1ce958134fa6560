//! Where Services and EndpointSlices come from. Every source turns its input into the same
//! stream of [`SourceEvent`]s, so the rest of the agent does not know (or care) which one runs.
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use crate::{
    source::objects::{ServiceCidrView, ServiceView, SliceView},
    translate::LocalRedirect,
};

pub mod dir;
pub mod kube;
pub mod listeners;
pub mod objects;

/// One change seen by a source. Services and EndpointSlices arrive digested (only what
/// translation reads) and shared (`Arc`): a source that keeps its own cache and the pipeline
/// hold one small allocation per object between them.
#[derive(Clone, Debug)]
pub enum SourceEvent {
    ServiceApplied(Arc<ServiceView>),
    ServiceDeleted(Arc<ServiceView>),
    SliceApplied(Arc<SliceView>),
    SliceDeleted(Arc<SliceView>),
    /// This agent's own Node (addresses, zone).
    NodeApplied(Arc<Node>),
    /// A ServiceCIDR (service ranges): unallocated addresses in them are dropped.
    ServiceCidrApplied(Arc<ServiceCidrView>),
    ServiceCidrDeleted(Arc<ServiceCidrView>),
    /// Everything the source had at start (or after a relist) has been sent: the agent may
    /// now program the dataplane and report ready. Objects not re-sent since the last
    /// `Resync` started are gone.
    Synced,
    /// A full relist begins (e.g. after `410 Gone`); followed by the objects and `Synced`.
    Resync,
    /// What listens on a local-redirect rule's address changed (`crate::source::listeners`): the
    /// rule's Service is translated again. Not sent by the Service sources.
    LocalRedirectChanged(LocalRedirect),
}

/// Sources hand events to the pipeline through this channel.
pub type EventTx = tokio::sync::mpsc::Sender<SourceEvent>;
pub type EventRx = tokio::sync::mpsc::Receiver<SourceEvent>;
