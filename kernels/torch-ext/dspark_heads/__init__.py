"""dspark_heads: Triton kernels for DSpark's sequential and confidence heads (see README.md beside build.toml)."""

from .lowrank_step import lowrank_step, lowrank_step_reference

__all__ = ["lowrank_step", "lowrank_step_reference"]
