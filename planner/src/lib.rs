//! Strategy search and cost model (filled by the planner issue).
