pub mod apiserver;
pub mod bpfstats;
pub mod cases;
pub mod corpus;
pub mod lab;
pub mod netns;
pub mod plot;
pub mod two_nodes;
