"""The run configuration: the one place where defaults and limits live.

Flower hands both apps a flat mapping of dashed keys (``[tool.flwr.app.config]`` in
``pyproject.toml``, overridden by ``flwr run . --run-config "key=value ..."``). ``Config``
parses it into a validated pydantic model. A bad value fails at start with a
``ConfigError`` that names the key, the value and what is allowed; an unknown key fails the
same way, so a typo never silently does nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: Algorithms the app can run. ``fedavg``: FedAvg on the whole model. ``fedavg-ft``: FedAvg,
#: evaluated after personal-only fine-tuning. ``local``: no federation, each client alone.
#: ``fedalt`` / ``fedsim``: Pillutla et al. 2022; ``fedrep`` / ``fedper`` are the literature's
#: names for FedAlt / FedSim with the head split.
#: ``ffgg`` / ``local-ffgg``: Mishchenko et al., FFGG (Alg. 1) and Local FFGG (Alg. 4).
#: ``local-gd``: FedAvg with full-batch gradient steps (FFGG's §3.2 baseline).
#: ``scaffold``: Karimireddy et al. 2020; ``l2gd``: Hanzely & Richtárik 2020 (FFGG's §3.2
#: baselines). ``pflego``: Nikoloutsopoulos et al., PFLEGO. ``apfl``: Deng et al., APFL.
#: ``br-ffgg``: Byzantine-robust FFGG (Alg. 5): FFGG with a ``robust-aggregator``.
ALGORITHMS = (
    "fedavg",
    "fedavg-ft",
    "local",
    "fedalt",
    "fedsim",
    "fedrep",
    "fedper",
    "ffgg",
    "local-ffgg",
    "local-gd",
    "scaffold",
    "l2gd",
    "pflego",
    "apfl",
    "br-ffgg",
    "async-ffgg",
)
APFL_MIXINGS = ("parameters", "outputs")
ROBUST_AGGREGATORS = (
    "auto",
    "none",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "geometric-median",
    "centered-clipping",
)
SCAFFOLD_CONTROLS = ("local-steps", "full-gradient")
FFGG_INITS = ("random", "zeros", "received", "stored")
FFGG_SOLVERS = ("sgd", "gd", "cg")
FFGG_WEIGHTINGS = ("uniform", "num-examples")
HEAD_ALIASES = {"fedrep": "fedalt", "fedper": "fedsim"}
SERVER_OPTIMIZERS = ("sgd", "adam")
#: ``auto``: Adam for PFLEGO (its experiments), SGD for every other algorithm.
SERVER_OPTIMIZER_CHOICES = ("auto", *SERVER_OPTIMIZERS)
PFLEGO_ALPHAS = ("global", "sampled")
LR_SCHEDULES = ("constant", "linear", "exponential")
MODELS = (
    "logreg",
    "mlp",
    "pflego-mlp",
    "cnn-cifar",
    "cnn-apfl",
    "conv4",
    "resnet18-gn",
    "synthetic-linear",
)
SPLITS = ("none", "head", "input", "adapter", "full")
BUILTIN_DATASETS = ("mnist-5k", "digits", "synthetic-leaf", "synthetic-linear")
#: ``task``: ``auto`` is ``regression`` with ``loss = "mse"`` or the synthetic-linear problem,
#: ``classification`` otherwise.
TASKS = ("auto", "classification", "regression")
#: ``loss``: ``auto`` is the model's own ``loss(out, target, reduction)`` method when it has
#: one, else cross-entropy (classification) or the mean squared error (regression); or
#: ``module:function`` for a loss of your own with that signature.
LOSSES = ("auto", "cross-entropy", "mse")
#: ``hf:<hub id>`` loads a Hugging Face data set through flwr-datasets; ``disk:<path>`` a
#: directory written by ``datasets.save_to_disk`` or a folder of parquet files.
DATASET_PREFIXES = ("hf:", "disk:")
PARTITIONERS = ("iid", "dirichlet", "pathological", "natural", "round-robin")
CLASS_ASSIGNMENTS = ("random", "deterministic", "first-deterministic")
DEVICES = ("auto", "cpu", "cuda")

#: Number of classes of the built-in data sets (``synthetic-leaf`` uses ``synthetic-classes``).
BUILTIN_NUM_CLASSES = {"mnist-5k": 10, "digits": 10}


#: Keys whose value means "the algorithm's default": field -> (that value, the generic
#: default when the algorithm has none). Algorithms declare theirs in ``DEFAULTS`` next to
#: their strategy; ``Config.resolved`` applies them.
AUTO: dict[str, tuple[Any, Any]] = {
    "server_lr": (0.0, 1.0),
    "local_steps": (0, 0),  # generic: 0 = count local work in epochs
    "personal_lr": (0.0, 0.0),  # generic: 0 = the client lr
    "robust_aggregator": ("auto", "none"),
    "robust_bucket_size": (0, 0),
}


class ConfigError(ValueError):
    """A run-config value that is not allowed; the message names key, value and rule."""


def _allowed(names: tuple[str, ...]) -> str:
    return "one of " + ", ".join(repr(n) for n in names)


class Config(BaseModel):
    """Validated run configuration shared by the ServerApp and the ClientApp.

    Field names are the dashed run-config keys with ``_`` for ``-``; see README.md for
    the meaning of each key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # --- what to run -----------------------------------------------------------------------
    algorithm: str = "fedalt"
    #: a name of ``MODELS`` or ``module:attribute``, an ``nn.Module`` class or factory of your own
    model: str = "mlp"
    loss: str = "auto"
    task: str = "auto"
    split: str = "head"
    split_patterns: str = Field("", alias="split-patterns")

    # --- data ------------------------------------------------------------------------------
    dataset: str = "mnist-5k"
    partitioner: str = "pathological"
    classes_per_client: int = Field(2, alias="classes-per-client", ge=1)
    class_assignment: str = Field("first-deterministic", alias="class-assignment")
    dirichlet_alpha: float = Field(0.3, alias="dirichlet-alpha", gt=0)
    min_partition_size: int = Field(10, alias="min-partition-size", ge=0)
    natural_column: str = Field("client_id", alias="natural-column")
    label_column: str = Field("label", alias="label-column")
    feature_column: str = Field("", alias="feature-column")
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
    round_timeout: float = Field(3600.0, alias="round-timeout", gt=0)
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
    server_optimizer: str = Field("auto", alias="server-optimizer")
    #: 0: the algorithm's default (PFLEGO: 0.003 with Adam), else 1.0 (SGD with 1.0 = FedAvg)
    server_lr: float = Field(0.0, alias="server-lr", ge=0)
    server_beta1: float = Field(0.9, alias="server-beta1", ge=0, lt=1)
    server_beta2: float = Field(0.999, alias="server-beta2", ge=0, lt=1)
    server_eps: float = Field(1e-8, alias="server-eps", gt=0)
    lr_schedule: str = Field("constant", alias="lr-schedule")
    lr_warmup_fraction: float = Field(0.1, alias="lr-warmup-fraction", ge=0, lt=1)
    lr_halve_every: int = Field(500, alias="lr-halve-every", ge=1)

    # --- personalization: FedAlt / FedSim and the 3-step pipeline -----------------------------
    personal_lr: float = Field(0.0, alias="personal-lr", ge=0)
    personal_epochs: int = Field(1, alias="personal-epochs", ge=0)
    personal_steps: int = Field(0, alias="personal-steps", ge=0)
    stateful: bool = True
    #: FedAlt / FedSim server mean: ``num-examples`` (alpha_i ~ N_i, the paper's objective)
    #: or ``uniform`` (every sampled client counts the same)
    fedalt_weighting: str = Field("num-examples", alias="fedalt-weighting")
    pretrain_rounds: int = Field(0, alias="pretrain-rounds", ge=0)
    pretrain_lr: float = Field(0.0, alias="pretrain-lr", ge=0)

    # --- FFGG / Local FFGG ---------------------------------------------------------------------
    ffgg_init: str = Field("random", alias="ffgg-init")
    ffgg_solver: str = Field("sgd", alias="ffgg-solver")
    ffgg_weighting: str = Field("uniform", alias="ffgg-weighting")

    # --- Scaffold / L2GD (FFGG's §3.2 baselines) --------------------------------------------
    scaffold_control: str = Field("local-steps", alias="scaffold-control")
    l2gd_lambda: float = Field(0.1, alias="l2gd-lambda", ge=0)
    l2gd_p: float = Field(0.0, alias="l2gd-p", ge=0, lt=1)

    # --- PFLEGO ----------------------------------------------------------------------------
    pflego_alpha: str = Field("global", alias="pflego-alpha")
    pflego_head_alpha: bool = Field(False, alias="pflego-head-alpha")
    pflego_local_labels: bool = Field(False, alias="pflego-local-labels")

    # --- APFL ------------------------------------------------------------------------------
    #: the initial (or fixed) alpha. The paper's synthetic runs start at 0.01; from there the
    #: adaptive alpha collapses to 0 for many clients on pathological splits (v then stops
    #: moving: its step carries the factor alpha) and APFL personalizes nothing, so 0.5
    apfl_alpha: float = Field(0.5, alias="apfl-alpha", ge=0, le=1)
    apfl_adaptive: bool = Field(True, alias="apfl-adaptive")
    apfl_mixing: str = Field("parameters", alias="apfl-mixing")
    apfl_lr_decay: float = Field(0.99, alias="apfl-lr-decay", gt=0, le=1)
    apfl_weighting: str = Field("uniform", alias="apfl-weighting")

    # --- Byzantine robustness (every strategy that aggregates updates) -------------------
    #: ``auto``: the algorithm's default (BR-FFGG: ``median``), else ``none``
    robust_aggregator: str = Field("auto", alias="robust-aggregator")
    robust_byzantine: int = Field(0, alias="robust-byzantine", ge=0)
    robust_bucket_size: int = Field(0, alias="robust-bucket-size", ge=0)
    robust_trim_beta: float = Field(0.1, alias="robust-trim-beta", ge=0, lt=0.5)
    robust_krum_m: int = Field(3, alias="robust-krum-m", ge=1)
    robust_clip_radius: float = Field(1.0, alias="robust-clip-radius", gt=0)
    robust_clip_iterations: int = Field(3, alias="robust-clip-iterations", ge=1)
    # --- asynchronous FFGG (Alg. 3) -------------------------------------------------------
    #: clients computing at any time; 0: round(fraction-train x trainable nodes)
    async_concurrency: int = Field(0, alias="async-concurrency", ge=0)
    #: server updates to apply; 0: num-server-rounds x concurrency
    async_updates: int = Field(0, alias="async-updates", ge=0)
    #: drop updates computed on a theta more than this many versions old; -1: keep all
    async_max_staleness: int = Field(-1, alias="async-max-staleness", ge=-1)
    #: a in the step gamma / (1 + staleness)^a; 0: the paper's constant step
    async_staleness_power: float = Field(0.0, alias="async-staleness-power", ge=0)
    #: stop after this many seconds of training; 0: no limit
    async_time_budget_s: float = Field(0.0, alias="async-time-budget-s", ge=0)
    #: evaluate every this many updates; 0: evaluate-every x concurrency
    async_evaluate_every: int = Field(0, alias="async-evaluate-every", ge=0)
    #: a message unanswered this long frees its slot for another client
    async_client_timeout_s: float = Field(600.0, alias="async-client-timeout-s", gt=0)
    # --- straggler simulation (any algorithm; the ClientApp sleeps after training) -----------
    #: seconds every client adds to each training reply (0: none); node config delay-s overrides
    straggler_delay_s: float = Field(0.0, alias="straggler-delay-s", ge=0)
    #: this share of the clients (drawn by seed) is straggler-factor times slower
    straggler_fraction: float = Field(0.0, alias="straggler-fraction", ge=0, le=1)
    straggler_factor: float = Field(10.0, alias="straggler-factor", ge=1)
    #: robustness experiments only: the server simulates the omniscient ALIE / IPM adversary
    #: for nodes whose node config says byzantine = 'alie' / 'ipm' (pflower/attacks.py)
    attack_simulation: bool = Field(False, alias="attack-simulation")

    # --- run -------------------------------------------------------------------------------
    seed: int = 0
    device: str = "auto"
    outputs_dir: str = Field("outputs", alias="outputs-dir")
    #: save the shared parameters every this many rounds (outputs/<run>/checkpoints/); 0: only
    #: the final ones (final-shared.pt)
    checkpoint_every: int = Field(0, alias="checkpoint-every", ge=0)
    #: start from these shared parameters (a final-shared.pt or a checkpoint) instead of the
    #: seeded init: resumes a run (the clients' personal state is on their side)
    resume_from: str = Field("", alias="resume-from")

    @model_validator(mode="after")
    def _check_names(self) -> Config:
        _one_of("algorithm", self.algorithm, ALGORITHMS)
        if not _import_path(self.model):
            _one_of("model", self.model, MODELS, "or 'module:Class' for a model of your own")
        if not _import_path(self.loss):
            _one_of("loss", self.loss, LOSSES, "or 'module:function' for a loss of your own")
        _one_of("task", self.task, TASKS)
        if self.task == "classification" and (
            self.loss == "mse" or "synthetic-linear" in (self.model, self.dataset)
        ):
            raise ConfigError(
                f"key 'task' = 'classification': loss {self.loss!r}, model {self.model!r}, "
                f"data set {self.dataset!r} make a regression problem; use task 'regression' "
                "or 'auto'"
            )
        _one_of("split", self.split, SPLITS)
        _one_of("partitioner", self.partitioner, PARTITIONERS)
        _one_of("class-assignment", self.class_assignment, CLASS_ASSIGNMENTS)
        _one_of("device", self.device, DEVICES)
        _one_of("server-optimizer", self.server_optimizer, SERVER_OPTIMIZER_CHOICES)
        _one_of("pflego-alpha", self.pflego_alpha, PFLEGO_ALPHAS)
        _one_of("apfl-mixing", self.apfl_mixing, APFL_MIXINGS)
        _one_of("robust-aggregator", self.robust_aggregator, ROBUST_AGGREGATORS)
        if self.algorithm == "br-ffgg" and self.robust_aggregator == "none":  # not "auto"
            raise ConfigError(
                "key 'robust-aggregator' = 'none': br-ffgg steps with a robust aggregate; "
                f"choose one of {ROBUST_AGGREGATORS[1:]} (with 'robust-bucket-size' = 2 for "
                "the agnostic robust rules of the paper's Def. 2)"
            )
        if self.algorithm == "async-ffgg" and self.pretrain_rounds:
            raise ConfigError(
                f"key 'pretrain-rounds' = {self.pretrain_rounds}: async-ffgg applies single "
                "client updates as they arrive and has no FedAvg pre-training rounds; set 0"
            )
        if self.algorithm == "async-ffgg" and self.robust_aggregator not in ("auto", "none"):
            raise ConfigError(
                f"key 'robust-aggregator' = {self.robust_aggregator!r}: async-ffgg applies "
                "single client updates, there is nothing to combine robustly; set 'none'"
            )
        _one_of("apfl-weighting", self.apfl_weighting, FFGG_WEIGHTINGS)
        _one_of("fedalt-weighting", self.fedalt_weighting, FFGG_WEIGHTINGS)
        _one_of("lr-schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("ffgg-init", self.ffgg_init, FFGG_INITS)
        _one_of("ffgg-solver", self.ffgg_solver, FFGG_SOLVERS)
        _one_of("ffgg-weighting", self.ffgg_weighting, FFGG_WEIGHTINGS)
        _one_of("scaffold-control", self.scaffold_control, SCAFFOLD_CONTROLS)
        if self.algorithm == "l2gd" and self.fraction_train != 1:
            raise ConfigError(
                f"key 'fraction-train' = {self.fraction_train}: l2gd needs 1.0 (every client "
                "takes every step of L2GD)"
            )
        if self.algorithm == "l2gd" and self.l2gd_p == 0 and self.local_steps == 1:
            raise ConfigError(
                "key 'l2gd-p' = 0 means p = 1/local-steps, and 'local-steps' = 1: set "
                "'local-steps' >= 2 (0: L2GD's default, 10) or 'l2gd-p' in (0, 1)"
            )
        if self.ffgg_solver in ("gd", "cg") and self.personal_steps == 0:
            raise ConfigError(
                f"key 'personal-steps' = 0: ffgg-solver {self.ffgg_solver!r} runs "
                "'personal-steps' full-batch iterations; set it > 0"
            )
        if self.algorithm in HEAD_ALIASES and (self.split != "head" or self.split_patterns):
            raise ConfigError(
                f"key 'split' = {self.split!r}: algorithm {self.algorithm!r} is "
                f"{HEAD_ALIASES[self.algorithm]!r} with the head split; use split 'head', or "
                f"algorithm {HEAD_ALIASES[self.algorithm]!r} for other splits"
            )
        if self.personal_epochs == 0 and self.personal_steps == 0:
            raise ConfigError(
                "key 'personal-epochs' = 0: with 'personal-steps' = 0 too there would be no "
                "personal update; set one of them > 0"
            )
        if self.dataset not in BUILTIN_DATASETS and not (
            self.dataset.startswith(DATASET_PREFIXES) and len(self.dataset) > 5
        ):
            raise ConfigError(
                f"key 'dataset' = {self.dataset!r}: must be {_allowed(BUILTIN_DATASETS)}, "
                "or 'hf:<hub id>' (e.g. 'hf:ylecun/mnist'), or 'disk:<path>' (a directory "
                "written by datasets.save_to_disk or a folder of parquet files)"
            )
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
            and self.dataset != "synthetic-linear"  # generated client by client
        ):
            raise ConfigError(
                f"key 'partitioner' = {self.partitioner!r}: partitions by class label, and this "
                "run is a regression problem; use 'iid' or 'natural' (by a column)"
            )
        num_classes = self.known_num_classes
        uses_classes = self.partitioner in ("pathological", "round-robin") and (
            self.dataset != "synthetic-linear"
        )
        if uses_classes and num_classes is not None and self.classes_per_client > num_classes:
            raise ConfigError(
                f"key 'classes-per-client' = {self.classes_per_client}: data set "
                f"{self.dataset!r} has {num_classes} classes; must be in 1..{num_classes}"
            )
        return self

    # --- derived values --------------------------------------------------------------------
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
        return BUILTIN_NUM_CLASSES.get(self.dataset)

    @property
    def effective_server_lr(self) -> float:
        """``server-lr``; 0 (a config not ``resolved``) is the generic default."""
        return self.server_lr or AUTO["server_lr"][1]

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
    def effective_server_optimizer(self) -> str:
        if self.server_optimizer != "auto":
            return self.server_optimizer
        return "adam" if self.algorithm == "pflego" else "sgd"

    @property
    def effective_l2gd_p(self) -> float:
        """L2GD's probability of an averaging step: ``l2gd-p``, or 1/local-steps."""
        return self.l2gd_p or 1.0 / self.local_steps

    @property
    def base_algorithm(self) -> str:
        """``fedrep`` -> ``fedalt``, ``fedper`` -> ``fedsim``; others unchanged."""
        return HEAD_ALIASES.get(self.algorithm, self.algorithm)

    @property
    def total_rounds(self) -> int:
        """FedAvg pre-training rounds plus the algorithm's rounds."""
        return self.pretrain_rounds + self.num_server_rounds

    def to_flat(self) -> dict[str, Any]:
        """The flat dashed mapping (as in ``[tool.flwr.app.config]``) of this config."""
        return self.model_dump(by_alias=True)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Config:
        """Parse Flower's flat run config; raise ``ConfigError`` naming key, value, rule.
        Keys left at their ``auto`` value take the algorithm's defaults (``resolved``)."""
        try:
            return cls.model_validate(dict(run_config)).resolved()
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None

    def resolved(self) -> Config:
        """This config with every key at its ``auto`` value (``AUTO``) replaced by the
        algorithm's default for it (the ``DEFAULTS`` in the algorithm's own file, e.g.
        PFLEGO's server lr and tau) or by the generic one."""
        from pflower.strategies import get_algorithm  # the registry (it imports this module)

        defaults = get_algorithm(self.algorithm).defaults
        update = {
            key: defaults.get(key, generic)
            for key, (auto, generic) in AUTO.items()
            if getattr(self, key) == auto and defaults.get(key, generic) != auto
        }
        return self.model_copy(update=update) if update else self


def _one_of(key: str, value: str, names: tuple[str, ...], alternative: str = "") -> None:
    if value not in names:
        close = difflib.get_close_matches(value, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        extra = f", {alternative}" if alternative else ""
        raise ConfigError(f"key {key!r} = {value!r}: must be {_allowed(names)}{extra}{hint}")


def _import_path(value: str) -> bool:
    """Whether ``value`` looks like ``module.path:attribute`` (a user's own object)."""
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr) and all(
        part.isidentifier() for part in [*module.split("."), *attr.split(".")]
    )


def _describe(err: ValidationError) -> str:
    """Turn pydantic's errors into 'key = value: what is allowed' phrases."""
    lines = []
    for e in err.errors():
        if not e["loc"]:  # raised by _check_names: already phrased with key and value
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        key = str(e["loc"][0]).replace("_", "-")
        if e["type"] == "extra_forbidden":
            lines.append(f"key {key!r} = {e['input']!r}: unknown key; README.md lists the keys")
        else:
            lines.append(f"key {key!r} = {e['input']!r}: {e['msg'].lower()}")
    return "invalid run config: " + "; ".join(lines)
