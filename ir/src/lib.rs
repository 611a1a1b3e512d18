//! The tensor IR.
