"""Full cache: the reference every compressed method is measured against. Keeps everything."""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import Method
from kvbench.registry import METHODS


@METHODS.register("full")
@dataclass
class Full(Method):
    """No compression. `budget` is ignored (recorded as given)."""

    @property
    def compresses(self) -> bool:
        return False

    def check_budget(self, budget: int | None) -> None:
        if budget is not None:  # ignored, but a nonsensical value is still a mistake worth reporting
            super().check_budget(budget)

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int | None) -> list[int]:
        return [prompt_len] * n_layers
