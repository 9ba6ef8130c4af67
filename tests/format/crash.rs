//! Crash tests (below).
