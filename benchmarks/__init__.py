"""Benchmarks: scripts that print tables and write JSON (run from the repository root: ``python -m
benchmarks.<name>``); speed and memory targets are met here, never in timed tests."""
