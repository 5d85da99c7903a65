"""trainwatch: resilience and observability for distributed PyTorch training.

    import trainwatch
    tw = trainwatch.init()
    tw.register_state(model, optimizer)
    for batch in loader:
        with tw.phase("forward"):
            loss = model(batch)
        ...
        tw.step(loss=loss.item(), grad_norm=norm)

Importing trainwatch is cheap; torch is imported only when needed.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["init", "__version__"]


def init(**kwargs):
    """Return this process's telemetry handle (see trainwatch.rank.telemetry.Telemetry)."""
    from trainwatch.rank.handle import init as _init

    return _init(**kwargs)
