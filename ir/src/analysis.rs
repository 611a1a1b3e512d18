//! Analyses derived from the graph: parameters, FLOPs, stored activations.
