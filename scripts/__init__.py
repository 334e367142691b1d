"""Maintainer scripts (data copies, results pages, cross-checks against other implementations)."""
