"""What crosses the wire: record, config and metric keys both halves use, and the reply
check every aggregating strategy applies (pflower's and ``RobustFedAvg``).

DESIGN.md, "What crosses the wire": the server sends ``arrays`` (the shared parameters),
``personal-init`` (after pre-training), algorithm records (Scaffold's ``control``) and a
``config`` record; a client replies with exactly one of ``arrays`` / ``delta`` /
``gradient`` (different keys, so no strategy can average a gradient as if it were a model),
any records its algorithm adds, and one ``metrics`` record with ``num-examples``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from io import BytesIO

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

ARRAYS, DELTA, GRADIENT = "arrays", "delta", "gradient"
CONFIG, METRICS = "config", "metrics"
NUM_EXAMPLES = "num-examples"
PERSONAL_INIT = "personal-init"  # server -> client: the pre-trained model's personal slice

# config-record keys the server sends with every message
SERVER_ROUND, PHASE, LR, LR_SCALE, FINAL = "server-round", "phase", "lr", "lr-scale", "final"
PRETRAIN, TRAIN = "pretrain", "train"  # values of PHASE
QUERY = "query"  # the start-up query's question (comma-separated)
#: the start-up query's questions (``QUERY``) and the metrics a node answers them with
PARTITION_ID, NUM_PARTITIONS, NUM_TRAIN = "partition-id", "num-partitions", "num-train"
#: the question for the node's facts, and the config record of its answer: what changes the
#: computation besides the run config (``task.fingerprint``; checked in ``strategies.nodes``)
NODE_FACTS = "node-facts"
DATA_KIND, MODEL_FINGERPRINT = "data-kind", "model-fingerprint"
#: the run's tag: a resumed run keeps it, so a device tells its own run's state by it
RUN_TAG = "run-tag"
#: the handshake, in every message's config: the server's algorithm and a fingerprint of the
#: settings its clients must share (``pflower.strategies.checks``); a client running anything
#: else raises ``ConfigMismatch`` and the server counts the reply as a ``config mismatch``
ALGORITHM, SETTINGS_FINGERPRINT = "algorithm", "settings-fingerprint"
CONFIG_MISMATCH = "config mismatch"
#: metric by which a node of a robustness experiment asks the server to simulate the
#: omniscient adversary (ALIE / IPM) in its place; a server not told to drops such a reply
OMNISCIENT_TAG = "byzantine-omniscient"
#: true in a node's training message after its replies were dropped for their values in
#: consecutive rounds: the node starts this round from its personal init, not its stored state
PERSONAL_RESET = "personal-reset"
#: evaluation-reply metric tag (``local-part-loss``, ``-accuracy``) beside ``personal``,
#: ``global`` and APFL's ``localized``: the algorithm's personal part on its own (APFL's v;
#: a head method's stored personal head as its training left it, on the received body)
LOCAL_PART = "local-part"
#: evaluation-reply metric: the mixing weight of the client's personalized model (APFL's
#: alpha), in [0, 1]; the server summarizes it per round (mean, min, max over clients)
ALPHA = "alpha"
#: training-reply metric: the norm of the shared gradient the reply carries (FFGG's split
#: diagnostic, ||Delta_m||)
GRAD_NORM = "grad-norm"
#: training-reply metrics that are norms of the shared update: a central-DP run releases none
#: of them (the clip is there to hide a reply's norm; ``PersonalizedStrategy.round_metrics``)
UPDATE_NORM_METRICS = frozenset({GRAD_NORM})


class ConfigMismatch(ValueError):
    """A message from a server whose algorithm or client settings differ from this client's
    (its text starts with ``CONFIG_MISMATCH``, which the server counts by)."""


#: run-config keys only the server reads (or that reach the client in each message, like the
#: scheduled ``lr``): left out of the handshake's fingerprint, so a resumed run may change them
SERVER_ONLY_KEYS = frozenset(
    [
        "num-server-rounds",
        "pretrain-rounds",
        "fraction-train",
        "fraction-evaluate",
        "evaluate-every",
        "final-evaluate-fraction",
        "max-in-flight",
        "pull-interval",
        "round-timeout",
        "holdout-fraction",
        "lr",
        "lr-schedule",
        "lr-warmup-fraction",
        "lr-halve-every",
        "pretrain-lr",
        "server-optimizer",
        "server-lr",
        "server-beta1",
        "server-beta2",
        "server-eps",
        "robust-aggregator",
        "robust-byzantine",
        "robust-bucket-size",
        "robust-trim-beta",
        "robust-krum-m",
        "robust-clip-radius",
        "robust-clip-iterations",
        "max-update-norm",
        "update-norm-growth",
        "max-num-examples",
        "max-failed-rounds",
        "async-concurrency",
        "async-updates",
        "async-max-staleness",
        "async-staleness-power",
        "async-time-budget-s",
        "async-evaluate-every",
        "async-client-timeout-s",
        "async-max-share",
        "async-clip-factor",
        "attack-simulation",
        "straggler-delay-s",
        "straggler-fraction",
        "straggler-factor",
        "device",
        "outputs-dir",
        "console",
        "tracking",
        "checkpoint-every",
        "checkpoint-keep",
        "resume-from",
        "sample-seed",
    ]
)


def settings_fingerprint(cfg) -> str:
    """A short hash of the settings a server and its clients must share: every run-config
    key of ``cfg`` (a pydantic settings model) but ``SERVER_ONLY_KEYS`` (the algorithm,
    model, split, data set and partition, seed, local training, the algorithm's own keys...).
    Sent with every message; a client whose own differs refuses the message. Computed once
    per settings (they are frozen, so hashable): a dump, JSON and SHA-256 of ~100 keys cost
    ~0.1 ms, which every message paid."""
    try:
        return _cached_fingerprint(cfg)
    except TypeError:  # settings that are not hashable (a user's model of their own)
        return _fingerprint(cfg)


@functools.lru_cache(maxsize=64)
def _cached_fingerprint(cfg) -> str:
    return _fingerprint(cfg)


def _fingerprint(cfg) -> str:
    items = {k: v for k, v in cfg.model_dump(by_alias=True).items() if k not in SERVER_ONLY_KEYS}
    text = json.dumps(items, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def handshake_problem(cfg, config: Mapping, settings: bool = True) -> str:
    """Why a client of settings ``cfg`` must not answer a message with config record
    ``config`` ('' if it may): another algorithm (not among the server's ``algorithm``
    names), or other shared settings (with ``settings``; not for the NumPyClient adapter,
    whose model and data are the user's, not its run config's). A message without the
    handshake (a server of an older pflower, a user's own) is answered."""
    algorithm = config.get(ALGORITHM)
    theirs = config.get(SETTINGS_FINGERPRINT) if settings else None
    mine = settings_fingerprint(cfg) if theirs is not None else None
    # a run config's server sends its algorithm; a strategy built by hand the names of the
    # client halves it serves (``PersonalizedStrategy.serves``)
    names = [algorithm] if isinstance(algorithm, str) else list(algorithm or ())
    if algorithm is not None and cfg.algorithm not in names:
        return (
            f"{CONFIG_MISMATCH}: the server runs algorithm {' or '.join(map(repr, names))}, "
            f"this client {cfg.algorithm!r}; start both from the same run config"
        )
    if theirs is not None and theirs != mine:
        return (
            f"{CONFIG_MISMATCH}: the server's client settings (fingerprint {theirs}) differ "
            f"from this client's ({mine}) under algorithm {cfg.algorithm!r}: another seed, "
            "split, model, data set, partition, local training or algorithm setting; start "
            "both from the same run config"
        )
    return ""


@dataclass
class ClientUpdate:
    """A checked training reply: the sender, its tensors (numpy) and its metrics."""

    node_id: int
    tensors: dict[str, np.ndarray]
    metrics: dict[str, float]
    #: further records of the reply (``extra_reply_keys``), same names and shapes
    extra: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: its update norm, where the value check computed it (``checks.update_norm``); a new
    #: ClientUpdate of other tensors (an attack simulation's) has none, so it is computed
    norm: float | None = None

    @property
    def num_examples(self) -> float:
        """The reply's weight in every aggregation: once the claim checks have run
        (``checks.ReplyChecks.bound_updates``) its ``num-examples`` claim *bounded*
        (``checks.ClaimBound``: at most its node's first claim and the cap), which they
        write into a copy of ``metrics``; before them, the claim as sent."""
        return float(self.metrics[NUM_EXAMPLES])


def is_loss(key: str) -> bool:
    """Whether a metric is a loss (``loss``, ``*-loss``) or an RMSE (``*-rmse``): a value
    of a non-negative function (cross-entropy, squared error, a loss of one's own), which a
    pooled figure clips (``history.clip_losses``)."""
    return key == "loss" or key.endswith(("-loss", "-rmse"))


def metrics_problem(metrics: Mapping, required: tuple[str, ...] = (NUM_EXAMPLES,)) -> str:
    """Why a reply's metrics cannot be aggregated ('' if they can): a required key
    missing, a value that is not a finite number, an accuracy or ``alpha`` outside [0, 1], a
    loss or RMSE below 0 (``is_loss``: one client's -1e300 set the pooled loss), or a
    ``num-examples`` that is not a positive integer. The metric check every aggregating
    strategy applies (pflower's and ``RobustFedAvg``)."""
    for key in required:
        if key not in metrics:
            return f"metric {key!r} missing"
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metric {key!r} is not a number"
        if not np.isfinite(value):
            return f"metric {key!r} is not finite"
        if (key.endswith("accuracy") or key == ALPHA) and not 0 <= value <= 1:
            return f"metric {key!r} = {value} outside [0, 1]"
        if is_loss(key) and value < 0:
            return f"metric {key!r} = {value} below 0"
        if key == NUM_EXAMPLES and (value < 1 or value != int(value)):
            return "num-examples is not a positive integer"
    return ""


#: NumPy's ``.npy`` magic, which starts every ``Array`` Flower serializes (``np.save``)
_NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=1024)
def _parse_npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of a ``.npy`` header, by NumPy's own reader. Cached:
    the shared parameters' headers repeat in every message, and the reader's
    ``ast.literal_eval`` cost ~0.1 ms per array, in every message."""
    stream = BytesIO(header)
    version = np.lib.format.read_magic(stream)
    reader = {
        (1, 0): np.lib.format.read_array_header_1_0,
        (2, 0): np.lib.format.read_array_header_2_0,
    }.get(version)
    if reader is None:
        raise ValueError(f"unsupported .npy version {version}")
    return reader(stream)


def array_view(array: Array) -> np.ndarray:
    """The array a message carries, as a read-only view of its bytes (``Array.numpy()``
    copies them: one more copy of every reply while the server aggregates). The bytes are
    NumPy's ``.npy`` format; the header says dtype, shape and order (parsed once per
    distinct header, ``_parse_npy_header``).

    Raises ``ValueError`` if the bytes are not the array the ``Array`` says it is: its
    ``shape`` and ``dtype`` are what the layout checks read (``layout_problem``), and a
    sender controls both them and the bytes, so a reply stating the shared shape with the
    bytes of one value (which broadcasts into every coordinate of a mean) or of a complex
    array must never decode."""
    data = array.data
    if (
        array.stype != "numpy.ndarray"
        or data[:6] != _NPY_MAGIC
        or data[6:8]
        not in (
            b"\x01\x00",
            b"\x02\x00",
        )
    ):
        return _as_stated(array, array.numpy())  # Flower's path (its error for the rest)
    if data[6] == 1:
        end = 10 + int.from_bytes(data[8:10], "little")
    else:
        end = 12 + int.from_bytes(data[8:12], "little")
    shape, fortran, dtype = _parse_npy_header(bytes(data[:end]))
    if dtype.hasobject:  # never unpickle (as Array.numpy: allow_pickle=False)
        raise ValueError("object arrays are not accepted")
    count = math.prod(shape)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=end)  # short data raises
    return _as_stated(array, flat.reshape(shape, order="F" if fortran else "C"))


#: how much of a client's own error text a drop reason keeps (the reasons are the keys of
#: the drop counts in ``results.json``: a client must not fill them with megabytes)
REASON_CHARS = 1000

#: the drop reason of a reply with an array ``array_view`` refuses (one reason, not the
#: sender's own header text: a client must not choose the server's counters' keys)
UNDECODABLE = "undecodable array: its bytes are not the dtype and shape it states"


def _as_stated(array: Array, value: np.ndarray) -> np.ndarray:
    """``value``, if it has the ``shape`` and ``dtype`` that ``array`` states."""
    if tuple(value.shape) != tuple(array.shape) or str(value.dtype) != array.dtype:
        raise ValueError(
            f"the array's bytes hold {value.dtype} {tuple(value.shape)}, "
            f"it states {array.dtype} {tuple(array.shape)}"
        )
    return value


def to_torch(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """A record's arrays as writable tensors (``ArrayRecord.to_torch_state_dict``, without
    re-parsing the same ``.npy`` headers in every message)."""
    return {k: torch.from_numpy(_native_copy(array_view(a))) for k, a in record.items()}


def _native_copy(a: np.ndarray) -> np.ndarray:
    """A writable copy in native byte order (torch refuses a big-endian array)."""
    return a.astype(a.dtype.newbyteorder("="), copy=True)


@functools.lru_cache(maxsize=1024)
def _npy_layout(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, str] | None:
    """``np.save``'s header for a C-ordered array of this dtype and shape, and the dtype's
    name (None when the header needs a version past 1.0: ``to_array`` then leaves it to
    ``np.save``). Cached: the same layouts repeat in every message, and the header and even
    ``str(dtype)`` cost microseconds each."""
    stream = BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(stream, d)
    except ValueError:
        return None
    return stream.getvalue(), str(dtype)


def to_array(value) -> Array:
    """An ``Array`` of a tensor or NumPy array, with the bytes ``np.save`` writes
    (``Array.from_numpy_ndarray``) but the header built once per dtype and shape."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    a = np.asarray(value)
    if not a.flags.c_contiguous:  # (not ascontiguousarray: it turns a 0-dim array into (1,))
        a = np.ascontiguousarray(a)
    if a.dtype.hasobject:
        return Array(a)  # Flower's refusal
    shape = tuple(a.shape)
    layout = _npy_layout(a.dtype, shape)
    if layout is None:
        return Array.from_numpy_ndarray(a)
    header, dtype = layout
    # one copy of the values: bytes.join reads the array's buffer (``header + a.tobytes()``
    # copied them twice, ~15 us per 0.6 MB layer)
    data = b"".join((header, a.data))
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def to_record(tensors: Mapping) -> ArrayRecord:
    """An ``ArrayRecord`` of named tensors or arrays, through ``to_array`` (filled in place:
    ``ArrayRecord(dict)`` would build every ``Array`` a second time)."""
    record = ArrayRecord()
    for k, v in tensors.items():
        record[k] = to_array(v)
    return record


def layout_problem(record: ArrayRecord, expected: Mapping[str, tuple]) -> str | None:
    """Why ``record`` is not a set of shared parameters (``expected``: name -> (shape,
    dtype)), or None: the reply check every aggregating strategy applies before values."""
    got = {k: (tuple(a.shape), a.dtype) for k, a in record.items()}
    if got == dict(expected):
        return None
    lacking = sorted(set(expected) - set(got))
    if lacking and set(got.items()) < set(expected.items()):
        # the server sent parameters its clients keep: it started from the whole model where
        # the algorithm shares a part (a user's own ServerApp without shared_arrays)
        shown = ", ".join(lacking[:3]) + (
            f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        )
        return (
            f"the reply lacks {shown}, which the server sent: if the clients keep them as "
            "their personal part, start the strategy from the shared parameters only, "
            "initial_arrays=shared_arrays(model, algorithm, personal=...) "
            "(pflower.personal_client), or pre-train the whole model with pretrain_rounds and "
            "shared_names"
        )
    wrong = sorted(set(got.items()) ^ set(expected.items()), key=str)[:3]
    return f"names/shapes/dtypes differ from the shared parameters: {wrong}"
