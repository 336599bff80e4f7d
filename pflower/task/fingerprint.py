"""What a node reports at the start-up handshake about the computation it will run: a
fingerprint of its model (``model_fingerprint``) and the kind of data it trains on
(``data_kind``). The server compares both with its own (``pflower.strategies.nodes``); the
run config alone (the settings fingerprint of every message) does not see a node that runs
another version of the model's code under the same run config, or whose node config points
it at other data.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import textwrap

from torch import nn

from pflower.settings import BUILTIN_DATASETS, NODE_DATASET

#: ``data_kind`` of a node whose data are its own loaders (``PersonalizedClient``)
OWN_LOADERS = "own loaders"


@functools.lru_cache(maxsize=256)
def _code_of(obj) -> str:
    """The code of a class or function outside torch as its syntax tree (comments and layout
    left out), or its qualified name where the source cannot be read (built in a REPL)."""
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
    if name.startswith(("torch.", "builtins.")):
        return name  # torch's own layers: their repr holds their settings
    try:
        source = textwrap.dedent(inspect.getsource(obj))
        return f"{name}\n{ast.dump(ast.parse(source))}"
    except (OSError, TypeError, SyntaxError):
        return name


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of what a model computes, as far as it can be read without running it:
    the names, shapes and dtypes of its parameters and buffers, the module tree's ``repr``
    (every layer's type and settings: ``ReLU`` / ``Tanh``, ``GELU(approximate='tanh')``,
    ``Dropout(p=0.5)``), the code of every module class outside torch (its ``forward``, which
    may call ``torch.relu`` or ``torch.tanh``) and of the loss attached to it
    (``train.set_objective``). Two nodes with the same names and shapes but another
    activation differ. Not covered: code a ``forward`` calls outside its class, torch's own
    version, the initial values (the server sends the shared ones)."""
    tensors = [
        (kind, name, list(t.shape), str(t.dtype))
        for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers()))
        for name, t in named
    ]
    classes = sorted({_code_of(type(m)) for m in model.modules()})
    loss = getattr(model, "loss", None)
    content = {
        "tensors": tensors,
        "repr": repr(model),
        "classes": classes,
        "loss": _code_of(getattr(loss, "__func__", loss)) if loss is not None else None,
    }
    text = json.dumps(content, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_kind(dataset: str, data_path: str | None) -> str:
    """Where a node's training data come from, from the run config's ``dataset`` and the
    node config's ``data-path``: ``built-in``, ``hub`` (``hf:``), ``disk`` (``disk:``) or
    ``node file`` (``dataset = "node"``: the device's own file); a ``data-path`` the data
    set ignores, or a ``node`` data set without one, is said, so that a node configured for
    other data than it would train on is told apart."""
    if dataset == NODE_DATASET:
        return "node file" if data_path else "node file missing (no data-path)"
    if dataset in BUILTIN_DATASETS:
        kind = "built-in"
    elif dataset.startswith("hf:"):
        kind = "hub"
    elif dataset.startswith("disk:"):
        kind = "disk"
    else:
        kind = "other"
    return f"{kind} (data-path ignored)" if data_path else kind


def expected_data_kind(dataset: str) -> str:
    """The ``data_kind`` every node of a run on ``dataset`` reports when configured for it
    (``node``: a ``data-path``; any other data set: none)."""
    return data_kind(dataset, "its own file" if dataset == NODE_DATASET else None)
