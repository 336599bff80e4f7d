"""The run-level settings and the contract every algorithm's settings follow (the bottom layer).

Flower hands both apps a flat mapping of dashed keys (``[tool.flwr.app.config]`` in
``pyproject.toml``, overridden by ``flwr run . --run-config "key=value ..."``). This module
declares the run-level keys (``RunSettings``), the base every algorithm's own settings derive
from (``Settings``, e.g. ``PFLEGOSettings`` in ``pflower/strategies/pflego.py``), the allowed
values (``Literal`` choices, declared once) and ``ConfigError``. It imports no algorithm:
``pflower.config.Config``, the one model of the run config, is composed above the algorithms
from ``RunSettings`` and every registered algorithm's settings. A bad value fails at start with
a ``ConfigError`` that names the key, the value and what is allowed; an unknown key fails the
same way, so a typo never silently does nothing.

Over 400 lines for a reason: ``RunSettings`` is one flat model of every run-level key (as
Flower's run config is one flat mapping), and its field list, with a comment per key, is the
reference the README's key table follows; split, the keys would be read in several places.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from pflower.config import Config
    from pflower.strategies.registry import Algorithm

#: Allowed values, declared once as ``Literal`` types (pydantic checks them; the tuples of
#: their values are for code that lists them). Algorithm-specific choices live with their
#: algorithm (``pflower/strategies/<algorithm>.py``).
ModelName = Literal[
    "logreg",
    "mlp",
    "pflego-mlp",
    "cnn-cifar",
    "cnn-apfl",
    "conv4",
    "resnet18-gn",
    "synthetic-linear",
]
SplitName = Literal["none", "head", "input", "adapter", "full"]
BuiltinDataset = Literal["mnist-5k", "digits", "synthetic-leaf", "synthetic-linear"]
#: ``auto`` is ``regression`` with ``loss = "mse"`` or the synthetic-linear problem,
#: ``classification`` otherwise.
TaskName = Literal["auto", "classification", "regression"]
#: ``auto`` is the model's own ``loss(out, target, reduction)`` method when it has one, else
#: cross-entropy (classification) or the mean squared error (regression); or
#: ``module:function`` for a loss of your own with that signature.
LossName = Literal["auto", "cross-entropy", "mse"]
PartitionerName = Literal["iid", "dirichlet", "pathological", "natural", "round-robin"]
ClassAssignment = Literal["random", "deterministic", "first-deterministic"]
DeviceName = Literal["auto", "cpu", "cuda"]
#: ``auto``: the algorithm's default (PFLEGO: Adam, its experiments), else SGD
ServerOptimizerName = Literal["auto", "sgd", "adam"]
LRSchedule = Literal["constant", "linear", "exponential"]
#: whether the clients' personal state carries across runs (``context_store.ScopedStore``)
PersonalState = Literal["experiment", "run"]
#: what the console shows of a run (``report.console``)
Console = Literal["compact", "flower"]
#: experiment tracking written next to the run's outputs (``report.Tracker``)
Tracking = Literal["none", "tensorboard"]
#: how a server mean weights the sampled clients: by training-set size or all alike
Weighting = Literal["uniform", "num-examples"]
RobustAggregator = Literal[
    "auto",
    "none",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "geometric-median",
    "centered-clipping",
]

MODELS = get_args(ModelName)
SPLITS = get_args(SplitName)
BUILTIN_DATASETS = get_args(BuiltinDataset)
TASKS = get_args(TaskName)
LOSSES = get_args(LossName)
PARTITIONERS = get_args(PartitionerName)
SERVER_OPTIMIZERS = get_args(ServerOptimizerName)[1:]
LR_SCHEDULES = get_args(LRSchedule)
ROBUST_AGGREGATORS = get_args(RobustAggregator)
#: ``hf:<hub id>`` loads a Hugging Face data set through flwr-datasets; ``disk:<path>`` a
#: directory written by ``datasets.save_to_disk`` or a folder of parquet files.
DATASET_PREFIXES = ("hf:", "disk:")
#: each device's own NumPy file, named by its node config ``data-path`` (``task/node_data.py``)
NODE_DATASET = "node"

#: Number of classes of the built-in data sets (``synthetic-leaf`` uses ``synthetic-classes``).
BUILTIN_NUM_CLASSES = {"mnist-5k": 10, "digits": 10}


#: Keys whose value means "the algorithm's default": field -> (that value, the generic
#: default when the algorithm has none). Algorithms declare theirs in the ``defaults`` of
#: their registration, next to their strategy; ``Config.resolved`` applies them.
AUTO: dict[str, tuple[Any, Any]] = {
    "server_optimizer": ("auto", "sgd"),
    "server_lr": (0.0, 1.0),
    "local_steps": (0, 0),  # generic: 0 = count local work in epochs
    "personal_lr": (0.0, 0.0),  # generic: 0 = the client lr
    "robust_aggregator": ("auto", "none"),
    "robust_bucket_size": (0, 0),
}


class ConfigError(ValueError):
    """A run-config value that is not allowed; the message names key, value and rule."""


def _allowed(names: tuple) -> str:
    return "one of " + ", ".join(repr(n) for n in names)


class Settings(BaseModel):
    """Base of the run-level keys and of every algorithm's settings: flat dashed keys,
    unknown keys refused, immutable (hashable: the apps cache per config)."""

    # inf / nan are refused for every float key: no step size, bound or fraction is infinite
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Rules across keys that hold when this settings' algorithm runs (``cfg`` is the
        whole run config); raise ``ConfigError`` naming key, value and what is allowed."""


class RunSettings(Settings):
    """The run-level keys: what to run, the data, the federation, local optimisation, the
    server optimizer, robust combining, experiments, outputs. Every algorithm reads these;
    its own keys are in its settings (``pflower/strategies/<algorithm>.py``).

    Field names are the dashed run-config keys with ``_`` for ``-``; see README.md for
    the meaning of each key.

    ``algorithms`` is the registry (name -> ``Algorithm``) that the ``algorithm`` key chooses
    from: empty here, filled in by the composed ``pflower.config.Config``; the rules of the
    chosen algorithm's settings (``Settings.check``) and its defaults for keys left at ``auto``
    (``resolved``) come from it.
    """

    algorithms: ClassVar[Mapping[str, Algorithm]] = {}

    # --- what to run -----------------------------------------------------------------------
    algorithm: str = "fedalt"
    #: a name of ``MODELS`` or ``module:attribute``, an ``nn.Module`` class or factory of your own
    model: str = "mlp"
    loss: str = "auto"
    task: TaskName = "auto"
    split: SplitName = "head"
    split_patterns: str = Field("", alias="split-patterns")

    # --- data ------------------------------------------------------------------------------
    dataset: str = "mnist-5k"
    partitioner: PartitionerName = "pathological"
    classes_per_client: int = Field(2, alias="classes-per-client", ge=1)
    class_assignment: ClassAssignment = Field("first-deterministic", alias="class-assignment")
    dirichlet_alpha: float = Field(0.3, alias="dirichlet-alpha", gt=0)
    min_partition_size: int = Field(10, alias="min-partition-size", ge=0)
    natural_column: str = Field("client_id", alias="natural-column")
    label_column: str = Field("label", alias="label-column")
    feature_column: str = Field("", alias="feature-column")
    #: ``dataset = "node"`` (each device reads its own file): what the model needs, which the
    #: server cannot read from data it does not have. ``input-shape``: one example's shape,
    #: e.g. "1,28,28" or "60"; ``num-classes``: classes (classification)
    input_shape: str = Field("", alias="input-shape")
    num_classes: int = Field(0, alias="num-classes", ge=0)
    test_fraction: float = Field(0.2, alias="test-fraction", gt=0, lt=1)
    #: a column that fixes each row's side: ``test`` / true / 1 = test split, anything else =
    #: training split; empty: split each client's partition by ``test-fraction``
    test_column: str = Field("", alias="test-column")
    max_train_samples: int = Field(0, alias="max-train-samples", ge=0)
    synthetic_gamma: float = Field(0.5, alias="synthetic-gamma", ge=0)
    synthetic_beta: float = Field(0.5, alias="synthetic-beta", ge=0)
    synthetic_dim: int = Field(60, alias="synthetic-dim", ge=1)
    synthetic_classes: int = Field(10, alias="synthetic-classes", ge=2)
    linear_n: int = Field(10_000, alias="linear-n", ge=1)
    linear_dtheta: int = Field(100, alias="linear-dtheta", ge=1)
    linear_dw: int = Field(50, alias="linear-dw", ge=1)

    # --- federation ------------------------------------------------------------------------
    num_server_rounds: int = Field(20, alias="num-server-rounds", ge=1)
    fraction_train: float = Field(0.5, alias="fraction-train", gt=0, le=1)
    fraction_evaluate: float = Field(1.0, alias="fraction-evaluate", gt=0, le=1)
    evaluate_every: int = Field(5, alias="evaluate-every", ge=1)
    #: share of the clients the final round evaluates; 0 (auto): all of them up to 100
    #: clients, else a seeded uniform sample of max(100, 10%)
    final_evaluate_fraction: float = Field(0.0, alias="final-evaluate-fraction", ge=0, le=1)
    #: at most this many messages outstanding at once; 0 (auto): 16 on Flower's simulation
    #: engine (its dispatcher costs nodes x outstanding messages per 0.1 s tick), else no limit
    max_in_flight: int = Field(0, alias="max-in-flight", ge=0)
    #: seconds to wait for a round's replies; 0: as long as the work needs (600 s for the
    #: first round, then 10 x the slowest complete round so far, at least 120 s)
    round_timeout: float = Field(0.0, alias="round-timeout", ge=0)
    holdout_fraction: float = Field(0.0, alias="holdout-fraction", ge=0, lt=1)

    # --- local optimisation ----------------------------------------------------------------
    local_epochs: int = Field(1, alias="local-epochs", ge=1)
    local_steps: int = Field(0, alias="local-steps", ge=0)
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, alias="weight-decay", ge=0)
    max_grad_norm: float = Field(0.0, alias="max-grad-norm", ge=0)
    batch_size: int = Field(32, alias="batch-size", ge=1)
    eval_batch_size: int = Field(512, alias="eval-batch-size", ge=1)
    finetune_epochs: int = Field(5, alias="finetune-epochs", ge=0)
    finetune_lr: float = Field(0.0, alias="finetune-lr", ge=0)

    # --- server optimizer and client-lr schedule (all algorithms that aggregate) ----------
    server_optimizer: ServerOptimizerName = Field("auto", alias="server-optimizer")
    #: 0: the algorithm's default (PFLEGO: 0.003 with Adam), else 1.0 (SGD with 1.0 = FedAvg)
    server_lr: float = Field(0.0, alias="server-lr", ge=0)
    server_beta1: float = Field(0.9, alias="server-beta1", ge=0, lt=1)
    server_beta2: float = Field(0.999, alias="server-beta2", ge=0, lt=1)
    server_eps: float = Field(1e-8, alias="server-eps", gt=0)
    lr_schedule: LRSchedule = Field("constant", alias="lr-schedule")
    lr_warmup_fraction: float = Field(0.1, alias="lr-warmup-fraction", ge=0, lt=1)
    lr_halve_every: int = Field(500, alias="lr-halve-every", ge=1)

    # --- personalization: FedAlt / FedSim and the 3-step pipeline -----------------------------
    personal_lr: float = Field(0.0, alias="personal-lr", ge=0)
    personal_epochs: int = Field(1, alias="personal-epochs", ge=0)
    personal_steps: int = Field(0, alias="personal-steps", ge=0)
    pretrain_rounds: int = Field(0, alias="pretrain-rounds", ge=0)
    pretrain_lr: float = Field(0.0, alias="pretrain-lr", ge=0)

    # --- Byzantine robustness (every strategy that aggregates updates) -------------------
    #: ``auto``: the algorithm's default (BR-FFGG: ``median``), else ``none``
    robust_aggregator: RobustAggregator = Field("auto", alias="robust-aggregator")
    robust_byzantine: int = Field(0, alias="robust-byzantine", ge=0)
    robust_bucket_size: int = Field(0, alias="robust-bucket-size", ge=0)
    robust_trim_beta: float = Field(0.1, alias="robust-trim-beta", ge=0, lt=0.5)
    robust_krum_m: int = Field(3, alias="robust-krum-m", ge=1)
    robust_clip_radius: float = Field(1.0, alias="robust-clip-radius", gt=0)
    robust_clip_iterations: int = Field(3, alias="robust-clip-iterations", ge=1)
    #: drop a training reply whose update norm exceeds this many times the largest round
    #: median of update norms so far in the run (rounds of 3 replies or more); 0: off
    max_update_norm: float = Field(1000.0, alias="max-update-norm", ge=0)
    #: drop a reply claiming more training examples than this; 0: more than 100 x the round's
    #: median claim (a node's claim must in any case stay what it first reported)
    max_num_examples: int = Field(0, alias="max-num-examples", ge=0)
    # --- straggler simulation (any algorithm; the ClientApp sleeps after training) -----------
    #: seconds every client adds to each training reply (0: none); node config delay-s overrides
    straggler_delay_s: float = Field(0.0, alias="straggler-delay-s", ge=0)
    #: this share of the clients (drawn by seed) is straggler-factor times slower
    straggler_fraction: float = Field(0.0, alias="straggler-fraction", ge=0, le=1)
    straggler_factor: float = Field(10.0, alias="straggler-factor", ge=1)
    #: robustness experiments only: the server simulates the omniscient ALIE / IPM adversary
    #: for nodes whose node config says byzantine = 'alie' / 'ipm' (pflower/experiments/attacks.py)
    attack_simulation: bool = Field(False, alias="attack-simulation")

    # --- run -------------------------------------------------------------------------------
    seed: int = Field(0, ge=0)
    device: DeviceName = "auto"
    outputs_dir: str = Field("outputs", alias="outputs-dir")
    #: ``compact``: one line per round and pflower's table last (Flower's per-round metric
    #: dicts and final dump left out; results.json has them); ``flower``: Flower's output too
    console: Console = "compact"
    #: ``tensorboard``: event files in the run's output directory (``tensorboard/``, extra
    #: ``tracking``); nothing is sent anywhere
    tracking: Tracking = "none"
    #: a checkpoint (``pflower/checkpoint.py``) every this many rounds into
    #: outputs/<run>/checkpoints/; 0 (auto): every round in deployment, none in simulation;
    #: -1: none
    checkpoint_every: int = Field(0, alias="checkpoint-every", ge=-1)
    #: how many of the newest checkpoints are kept
    checkpoint_keep: int = Field(3, alias="checkpoint-keep", ge=1)
    #: a checkpoint (or a run directory: its newest) continues that run after its round; a
    #: file of shared parameters (final-shared.pt) is a warm start instead of the seeded init
    resume_from: str = Field("", alias="resume-from")
    #: the federation / experiment the clients' personal state belongs to: state is loaded only
    #: by runs of the same experiment name, algorithm, model, data set and personal part
    experiment_name: str = Field("default", alias="experiment-name", min_length=1)
    #: ``experiment``: personal state carries across runs of the same scope (a deployment's
    #: next run continues the devices' layers); ``run``: every run starts fresh (a resumed run
    #: continues its own)
    personal_state: PersonalState = Field("experiment", alias="personal-state")

    @model_validator(mode="after")
    def _check_run(self) -> RunSettings:
        """Rules across run-level keys, then the chosen algorithm's own (``Settings.check``)."""
        if self.algorithms:  # the composed Config: the registered algorithms
            _one_of("algorithm", self.algorithm, tuple(self.algorithms))
        if not _import_path(self.model):
            _one_of("model", self.model, MODELS, "or 'module:Class' for a model of your own")
        if not _import_path(self.loss):
            _one_of("loss", self.loss, LOSSES, "or 'module:function' for a loss of your own")
        if self.task == "classification" and (
            self.loss == "mse" or "synthetic-linear" in (self.model, self.dataset)
        ):
            raise ConfigError(
                f"key 'task' = 'classification': loss {self.loss!r}, model {self.model!r}, "
                f"data set {self.dataset!r} make a regression problem; use task 'regression' "
                "or 'auto'"
            )
        if 0 < self.max_update_norm < 1:
            raise ConfigError(
                f"key 'max-update-norm' = {self.max_update_norm}: a multiple of the largest round "
                "median update norm, must be 0 (off) or >= 1 (the median itself is honest)"
            )
        if self.personal_epochs == 0 and self.personal_steps == 0:
            raise ConfigError(
                "key 'personal-epochs' = 0: with 'personal-steps' = 0 too there would be no "
                "personal update; set one of them > 0"
            )
        if self.dataset not in (*BUILTIN_DATASETS, NODE_DATASET) and not (
            self.dataset.startswith(DATASET_PREFIXES) and len(self.dataset) > 5
        ):
            raise ConfigError(
                f"key 'dataset' = {self.dataset!r}: must be {_allowed(BUILTIN_DATASETS)}, "
                "or 'hf:<hub id>' (e.g. 'hf:ylecun/mnist'), or 'disk:<path>' (a directory "
                "written by datasets.save_to_disk or a folder of parquet files), or 'node' "
                "(each device's own .npz file, node config 'data-path')"
            )
        if self.dataset == NODE_DATASET:
            self._check_node_data()
        for pattern in self.personal_patterns:
            if not pattern or any(c.isspace() for c in pattern):
                raise ConfigError(
                    f"key 'split-patterns' = {self.split_patterns!r}: must be a comma-"
                    "separated list of glob patterns over parameter names, e.g. 'fc.*,layer4.*'"
                )
        if self.effective_task == "regression" and self.dataset in ("mnist-5k", "digits"):
            raise ConfigError(
                f"key 'task' = {self.task!r} (loss {self.loss!r}, model {self.model!r}): data set "
                f"{self.dataset!r} is a classification problem; use a regression data set "
                "('synthetic-linear', 'disk:<path>', 'hf:<id>') or task 'classification'"
            )
        by_label = ("pathological", "round-robin", "dirichlet")
        if (
            self.effective_task == "regression"
            and self.partitioner in by_label
            # generated client by client / each device's own file: nothing is partitioned
            and self.dataset not in ("synthetic-linear", NODE_DATASET)
        ):
            raise ConfigError(
                f"key 'partitioner' = {self.partitioner!r}: partitions by class label, and this "
                "run is a regression problem; use 'iid' or 'natural' (by a column)"
            )
        num_classes = self.known_num_classes
        uses_classes = self.partitioner in ("pathological", "round-robin") and (
            self.dataset not in ("synthetic-linear", NODE_DATASET)
        )
        if uses_classes and num_classes is not None and self.classes_per_client > num_classes:
            raise ConfigError(
                f"key 'classes-per-client' = {self.classes_per_client}: data set "
                f"{self.dataset!r} has {num_classes} classes; must be in 1..{num_classes}"
            )
        for settings in self._algorithm_settings():
            settings.check(self)
        return self

    def _algorithm_settings(self) -> tuple[type[Settings], ...]:
        """The chosen algorithm's settings models (none when no registry is attached)."""
        entry = self.algorithms.get(self.algorithm)
        return entry.settings if entry else ()

    def _check_node_data(self) -> None:
        try:
            shape = self.node_input_shape
        except ValueError:
            shape = ()
        if not shape:
            raise ConfigError(
                f"key 'input-shape' = {self.input_shape!r}: with dataset 'node' the server needs "
                "one example's shape, comma-separated positive integers (e.g. '1,28,28' or '60')"
            )
        if self.effective_task == "classification" and self.num_classes < 2:
            raise ConfigError(
                f"key 'num-classes' = {self.num_classes}: with dataset 'node' and a "
                "classification task the server needs the number of classes, at least 2"
            )

    # --- derived values --------------------------------------------------------------------
    @property
    def node_input_shape(self) -> tuple[int, ...]:
        """``input-shape`` as a tuple (ValueError if it is not positive integers)."""
        if not self.input_shape.strip():
            return ()
        shape = tuple(int(d) for d in self.input_shape.split(","))
        if any(d <= 0 for d in shape):
            raise ValueError(self.input_shape)
        return shape

    @property
    def personal_patterns(self) -> list[str]:
        """Glob patterns from ``split-patterns`` (empty: use the ``split`` preset)."""
        return [p.strip() for p in self.split_patterns.split(",")] if self.split_patterns else []

    @property
    def effective_task(self) -> str:
        """``classification`` or ``regression`` (``task = "auto"`` decided from the config)."""
        if self.task != "auto":
            return self.task
        regression = self.loss == "mse" or "synthetic-linear" in (self.model, self.dataset)
        return "regression" if regression else "classification"

    @property
    def known_num_classes(self) -> int | None:
        """Number of classes when known without loading data (built-in data sets)."""
        if self.dataset == "synthetic-leaf":
            return self.synthetic_classes
        if self.dataset == NODE_DATASET:
            return self.num_classes if self.effective_task == "classification" else None
        return BUILTIN_NUM_CLASSES.get(self.dataset)

    @property
    def effective_server_lr(self) -> float:
        """``server-lr``; 0 (a config not ``resolved``) is the generic default."""
        return self.server_lr or AUTO["server_lr"][1]

    @property
    def effective_server_optimizer(self) -> str:
        """``server-optimizer``; ``auto`` (a config not ``resolved``) is the generic default."""
        auto, generic = AUTO["server_optimizer"]
        return generic if self.server_optimizer == auto else self.server_optimizer

    @property
    def effective_finetune_lr(self) -> float:
        return self.finetune_lr or self.lr

    @property
    def effective_personal_lr(self) -> float:
        return self.personal_lr or self.lr

    @property
    def effective_pretrain_lr(self) -> float:
        return self.pretrain_lr or self.lr

    @property
    def total_rounds(self) -> int:
        """FedAvg pre-training rounds plus the algorithm's rounds."""
        return self.pretrain_rounds + self.num_server_rounds

    def to_flat(self) -> dict[str, Any]:
        """The flat dashed mapping (as in ``[tool.flwr.app.config]``) of this config."""
        return self.model_dump(by_alias=True)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Self:
        """Parse Flower's flat run config; raise ``ConfigError`` naming key, value, rule.
        Keys left at their ``auto`` value take the algorithm's defaults (``resolved``)."""
        try:
            return cls.model_validate(dict(run_config)).resolved()
        except ValidationError as err:
            raise ConfigError(_describe(cls, err)) from None

    def resolved(self) -> Self:
        """This config with every key at its ``auto`` value (``AUTO``) replaced by the
        algorithm's default for it (the ``defaults`` of its registration, e.g. PFLEGO's
        server lr and tau) or by the generic one."""
        entry = self.algorithms.get(self.algorithm)
        defaults = entry.defaults if entry else {}
        update = {
            key: defaults.get(key, generic)
            for key, (auto, generic) in AUTO.items()
            if getattr(self, key) == auto and defaults.get(key, generic) != auto
        }
        return self.model_copy(update=update) if update else self

    def ignored_keys(self) -> dict[str, Any]:
        """Keys set away from their default that belong only to other algorithms' settings
        (e.g. ``ffgg-init`` in a FedAlt run): reported at start, never silently dropped."""
        mine = {f for s in self._algorithm_settings() for f in s.model_fields}
        fields = type(self).model_fields
        return {
            info.alias or name: getattr(self, name)
            for name, info in fields.items()
            if name not in RunSettings.model_fields
            and name not in mine
            and getattr(self, name) != info.default
        }


def _one_of(key: str, value: str, names: tuple[str, ...], alternative: str = "") -> None:
    if value not in names:
        extra = f", {alternative}" if alternative else ""
        raise ConfigError(f"key {key!r} = {value!r}: must be {_choices(value, names)}{extra}")


def _choices(value: Any, names: tuple[str, ...]) -> str:
    """'one of 'a', 'b' (did you mean 'a'?)'."""
    close = difflib.get_close_matches(str(value), [str(n) for n in names], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return _allowed(names) + hint


def _import_path(value: str) -> bool:
    """Whether ``value`` looks like ``module.path:attribute`` (a user's own object)."""
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr) and all(
        part.isidentifier() for part in [*module.split("."), *attr.split(".")]
    )


def _describe(cls: type[BaseModel], err: ValidationError) -> str:
    """Turn pydantic's errors into 'key = value: what is allowed' phrases."""
    lines = []
    for e in err.errors():
        if not e["loc"]:  # raised by a model validator: already phrased with key and value
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        name = str(e["loc"][0])
        key = name.replace("_", "-")
        if e["type"] == "extra_forbidden":
            lines.append(f"key {key!r} = {e['input']!r}: unknown key; README.md lists the keys")
        elif e["type"] == "literal_error" and name.replace("-", "_") in cls.model_fields:
            names = get_args(cls.model_fields[name.replace("-", "_")].annotation)
            lines.append(f"key {key!r} = {e['input']!r}: must be {_choices(e['input'], names)}")
        else:
            lines.append(f"key {key!r} = {e['input']!r}: {e['msg'].lower()}")
    return "invalid run config: " + "; ".join(lines)
