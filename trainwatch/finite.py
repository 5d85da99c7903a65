"""Whether training state holds NaN or inf. A NaN in the weights or optimizer
moments survives every later step, so such a state is never checkpointed and
never resumed from (trainwatch.checkpoint, the emergency checkpointer)."""

from __future__ import annotations

from typing import Any


class NonFiniteState(ValueError):
    """A state holding NaN or inf: saving it would let a restart resume a broken run."""


def nonfinite_tensors(state: Any, *, limit: int = 3) -> list[str]:
    """Dotted names of the floating-point tensors in `state` (dicts, lists,
    tuples) that hold a NaN or an inf; at most `limit` of them. A NaN in the
    weights or optimizer moments survives every later step, so one such
    tensor makes the whole state worthless to resume from."""
    import torch

    found: list[str] = []

    def walk(value: Any, name: str) -> None:
        if len(found) >= limit:
            return
        if isinstance(value, torch.Tensor):
            if (value.is_floating_point() or value.is_complex()) and value.numel() and \
                    not bool(torch.isfinite(value).all()):
                found.append(name or "state")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}[{i}]")

    walk(state, "")
    return found


def nonfinite_problem(state: Any) -> str | None:
    """Why `state` must not be saved or resumed from (NaN/inf values), else None."""
    names = nonfinite_tensors(state)
    return f"it holds non-finite values (NaN or inf in {', '.join(names)})" if names else None
