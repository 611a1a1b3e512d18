//! The .dpl frontend.
