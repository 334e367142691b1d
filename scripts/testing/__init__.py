"""Helpers the tests and cross-check scripts run: a Hub round trip, a two-process training run, speculators checks."""
