"""The commands that build the shipped SmolLM2 draft (run from the repository root: ``python -m recipes.<name>``)."""
