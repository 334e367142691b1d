"""``fixed``: every row verifies all it may (γ drafted tokens within its cap; a tree, its budget's best nodes)."""

from __future__ import annotations

from .base import VerifyMode, register


@register
class Fixed(VerifyMode):
    name = "fixed"
