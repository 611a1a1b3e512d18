//! Execution of rank programs (filled by the runtime issue).
