"""Which engine a ``Grid`` belongs to, from what it is, never from its class name alone.

pflower's server adapts to its engine: in Flower's simulation (``InMemoryGrid``, the engine
in this process) it indexes the dispatcher and keeps a window of messages in flight; in
deployment (``HttpGrid``; ``GrpcGrid`` in older releases) it pulls replies every
``pull-interval`` instead of Flower's 3 s and shortens the object backoff; pflower's own
``LocalGrid`` says what it is (``ENGINE``). Flower's classes are looked up where Flower 1.41
keeps them, lazily and guarded; where they are not there (an upgrade moved them) their names
are a second guess. A grid recognised as none of them (a user's own, or Flower's renamed)
gets the safe path, not the fast one: its replies are pulled through pflower's ``Window``
(whose arrival times the round deadline learns from) every ``pull-interval``, checkpoints
are written as in deployment, and the run says once which grid it did not know.
"""

from __future__ import annotations

import importlib

from pflower.flower import fall_back

SIMULATION, DEPLOYMENT, LOCAL, OTHER = "simulation", "deployment", "local", "other"
#: where Flower 1.41 defines its grids; the names are the fallback guess
_FLOWER_GRIDS = {
    SIMULATION: [("flwr.superlink.grid.inmemory_grid", "InMemoryGrid")],
    DEPLOYMENT: [
        ("flwr.superlink.grid.http_grid", "HttpGrid"),
        ("flwr.superlink.grid.grpc_grid", "GrpcGrid"),
    ],
}


def innermost(grid):
    """The grid under pflower's wrappers (``Window``, ``RoundDeadline``: each has ``grid``)."""
    while hasattr(grid, "grid"):
        grid = grid.grid
    return grid


def _flower_class(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def engine_of(grid) -> str:
    """``simulation``, ``deployment``, ``local`` (pflower's ``LocalGrid``) or ``other``."""
    grid = innermost(grid)
    own = getattr(type(grid), "ENGINE", None)
    if own in (SIMULATION, DEPLOYMENT, LOCAL):
        return own
    for engine, places in _FLOWER_GRIDS.items():
        classes = [c for c in (_flower_class(m, n) for m, n in places) if c is not None]
        if classes and isinstance(grid, tuple(classes)):
            return engine
        if type(grid).__name__ in {n for _, n in places}:  # moved, but still so named
            return engine
    fall_back(
        f"recognising the grid ({type(grid).__module__}.{type(grid).__qualname__})",
        LookupError("neither Flower's simulation nor its deployment grid"),
        "replies are pulled every pull-interval through pflower's window, with the round "
        "deadline, and checkpoints are written as in deployment",
    )
    return OTHER
