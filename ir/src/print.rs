//! The stable textual form of a graph, read by golden tests.
