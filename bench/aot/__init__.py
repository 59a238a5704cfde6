"""Benches of the compile-only GPU environment (docs/compile.md)."""
