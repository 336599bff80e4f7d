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
Flower's run config is one flat mapping), and its field list, with a description per key, is
what the docs' run-config reference is generated from; split, the keys would be read in
several places.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
DPMode = Literal["none", "central", "local"]
DPSampling = Literal["fixed", "poisson"]
#: whether the clients' personal state carries across runs (``context_store.ScopedStore``)
PersonalState = Literal["experiment", "run"]
#: what the console shows of a run (``report.console``)
Console = Literal["compact", "flower"]
#: experiment tracking written next to the run's outputs (``report.Tracker``)
Tracking = Literal["none", "tensorboard"]
#: how a server mean weights the sampled clients: by training-set size or all alike
Weighting = Literal["uniform", "num-examples"]
#: what a robust rule does in a round too small for it to outvote anyone (``robust-small-rounds``)
SmallRounds = Literal["auto", "clip", "rule"]
RobustAggregator = Literal[
    "auto",
    "none",
    "adaptive-clipping",
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
    "robust_aggregator": ("auto", "adaptive-clipping"),
    "robust_bucket_size": (0, 0),
    "robust_clip_factor": (0.0, 1.0),
    "robust_small_rounds": ("auto", "rule"),
    "robust_step_bound": ("auto", 0.0),
}


class Registered(Protocol):
    """What the run config reads of an algorithm's registration (``registry.Algorithm``,
    which sits above this module: named here by what it offers, not imported)."""

    defaults: Mapping[str, Any]
    defence: Mapping[str, Any]
    settings: tuple[type[Settings], ...]


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
    def check(cls, cfg: RunSettings) -> None:
        """Rules across keys that hold when this settings' algorithm runs (``cfg`` is the
        whole run config); raise ``ConfigError`` naming key, value and what is allowed."""


class RunSettings(Settings):
    """The run-level keys: what to run, the data, the federation, local optimisation, the
    server optimizer, robust combining, experiments, outputs. Every algorithm reads these;
    its own keys are in its settings (``pflower/strategies/<algorithm>.py``).

    Field names are the dashed run-config keys with ``_`` for ``-``; each field's
    ``description`` is its entry in the docs' run-config reference (docs/reference/run-config.md).

    ``algorithms`` is the registry (name -> ``Algorithm``) that the ``algorithm`` key chooses
    from: empty here, filled in by the composed ``pflower.config.Config``; the rules of the
    chosen algorithm's settings (``Settings.check``) and its defaults for keys left at ``auto``
    (``resolved``) come from it.
    """

    algorithms: ClassVar[Mapping[str, Registered]] = {}

    # --- what to run -----------------------------------------------------------------------
    algorithm: str = Field(
        "fedalt",
        description=(
            "the algorithm to run (Algorithms page); `fedrep` / `fedper` are FedAlt / FedSim under "
            "the names of the papers that use them with a personal head"
        ),
    )
    model: str = Field(
        "mlp",
        description=(
            "`mlp` (784→200→200→C, APFL), `logreg`, `pflego-mlp` (784→200 body + head), "
            "`cnn-cifar` (PFLEGO's CIFAR CNN), `cnn-apfl` (APFL's CIFAR CNN), `conv4` (Omniglot), "
            "`resnet18-gn` (torchvision ResNet-18, GroupNorm, 3×3 stem, no first max-pool), "
            "`synthetic-linear` (FFGG's §3.1 model θ·p + w·q; inputs of `linear-dtheta` + "
            "`linear-dw` features). No BatchNorm anywhere. Or your own: `module:Class`, an "
            "`nn.Module` class or factory"
        ),
    )
    loss: str = Field(
        "auto",
        description=(
            "`auto`: the model's own `loss` method if it has one, else `cross-entropy` for "
            "classification, `mse` for regression; or `module:function` for a loss of your own"
        ),
    )
    task: TaskName = Field(
        "auto",
        description=(
            "`classification` (accuracy reported) or `regression` (loss and RMSE); `auto`: "
            'regression with `loss = "mse"` or the synthetic-linear problem, classification '
            "otherwise"
        ),
    )
    split: SplitName = Field(
        "head",
        description=(
            "the personal part: `none`, `head` (output layer), `input` (first layer), `adapter` "
            "(residual adapters + all norm layers; the model is built with adapters), `full`"
        ),
    )
    split_patterns: str = Field(
        "",
        alias="split-patterns",
        description=(
            "comma-separated glob patterns over parameter names (e.g. `fc.*,layer4.*`); overrides "
            "`split`"
        ),
    )

    # --- data ------------------------------------------------------------------------------
    dataset: str = Field(
        "mnist-5k",
        description=(
            "`mnist-5k`, `digits` (scikit-learn 8×8), `synthetic-leaf` (LEAF Synthetic(γ, β), one "
            "natural client per node), `synthetic-linear` (FFGG's quadratic problem, one generated "
            "client per node; regression: losses, no accuracy), `hf:<hub id>`, `disk:<path>`, "
            "`node` (each device's own `.npz` file, node config `data-path`; needs `input-shape`, "
            "`num-classes`)"
        ),
    )
    partitioner: PartitionerName = Field(
        "pathological",
        description=(
            "`iid`, `dirichlet`, `pathological` (K classes per client), `natural` (by a column), "
            "`round-robin` (PFLEGO's class dealing)"
        ),
    )
    classes_per_client: int = Field(
        2,
        alias="classes-per-client",
        ge=1,
        description="K of `pathological` / `round-robin`",
    )
    class_assignment: ClassAssignment = Field(
        "first-deterministic",
        alias="class-assignment",
        description=(
            "how classes are assigned to clients (flwr-datasets' `PathologicalPartitioner`)"
        ),
    )
    dirichlet_alpha: float = Field(
        0.3,
        alias="dirichlet-alpha",
        gt=0,
        description="concentration of `dirichlet`",
    )
    min_partition_size: int = Field(
        10,
        alias="min-partition-size",
        ge=0,
        description="`dirichlet` resamples until every client has this many samples",
    )
    natural_column: str = Field(
        "client_id",
        alias="natural-column",
        description="column of `natural` (e.g. `writer_id` for FEMNIST)",
    )
    label_column: str = Field(
        "label",
        alias="label-column",
        description="label column of hub/disk data",
    )
    feature_column: str = Field(
        "",
        alias="feature-column",
        description=(
            "feature column of hub/disk data (empty: first of `image`, `img`, `pixels`, `x`, "
            "`features`)"
        ),
    )
    input_shape: str = Field(
        "",
        alias="input-shape",
        description=(
            '`dataset = "node"`: one example\'s shape, e.g. `"1,28,28"` or `"60"` (the server has '
            "no data to read it from)"
        ),
    )
    num_classes: int = Field(
        0,
        alias="num-classes",
        ge=0,
        description='`dataset = "node"`, classification: the number of classes (≥ 2)',
    )
    test_fraction: float = Field(
        0.2,
        alias="test-fraction",
        gt=0,
        lt=1,
        description=(
            "share of each client's partition held out as its test split, stratified by label "
            "(regression: at random)"
        ),
    )
    test_column: str = Field(
        "",
        alias="test-column",
        description=(
            "a column that fixes each row's side (`test`/`true`/`1`: test, else train) instead of "
            "`test-fraction`; a `DatasetDict` with `train` and `test` splits on disk fixes it the "
            "same way"
        ),
    )
    max_train_samples: int = Field(
        0,
        alias="max-train-samples",
        ge=0,
        description="cap on each client's training samples (0: no cap)",
    )
    synthetic_gamma: float = Field(
        0.5,
        alias="synthetic-gamma",
        ge=0,
        description="γ of `synthetic-leaf`",
    )
    synthetic_beta: float = Field(
        0.5,
        alias="synthetic-beta",
        ge=0,
        description="β of `synthetic-leaf`",
    )
    synthetic_dim: int = Field(
        60,
        alias="synthetic-dim",
        ge=1,
        description="input dimension of `synthetic-leaf`",
    )
    synthetic_classes: int = Field(
        10,
        alias="synthetic-classes",
        ge=2,
        description="classes of `synthetic-leaf`",
    )
    linear_n: int = Field(
        10_000,
        alias="linear-n",
        ge=1,
        description=(
            "`synthetic-linear`: rows per client (`pflower/task/linear.py` has θ* and F(θ) in "
            "closed form)"
        ),
    )
    linear_dtheta: int = Field(
        100,
        alias="linear-dtheta",
        ge=1,
        description="`synthetic-linear`: dim θ",
    )
    linear_dw: int = Field(50, alias="linear-dw", ge=1, description="`synthetic-linear`: dim w")

    # --- federation ------------------------------------------------------------------------
    num_server_rounds: int = Field(
        20,
        alias="num-server-rounds",
        ge=1,
        description="rounds of the algorithm (after any pre-training)",
    )
    fraction_train: float = Field(
        0.5,
        alias="fraction-train",
        gt=0,
        le=1,
        description="fraction of clients sampled (uniformly, without replacement) each round",
    )
    fraction_evaluate: float = Field(
        1.0,
        alias="fraction-evaluate",
        gt=0,
        le=1,
        description="fraction of clients evaluated in intermediate evaluations",
    )
    evaluate_every: int = Field(
        5,
        alias="evaluate-every",
        ge=1,
        description="evaluate every this many rounds, and in the final round",
    )
    final_evaluate_fraction: float = Field(
        0.0,
        alias="final-evaluate-fraction",
        ge=0,
        le=1,
        description=(
            "share of the clients the final round evaluates; `0` (auto): every client up to 100 "
            "clients, else a uniform sample (`sample-seed`) of max(100, 10%) (the per-client "
            "statistics are then over that sample)"
        ),
    )
    max_in_flight: int = Field(
        0,
        alias="max-in-flight",
        ge=0,
        description=(
            "at most this many messages outstanding at once; `0` (auto): 16 on Flower's simulation "
            "engine (its dispatcher costs nodes × outstanding messages every 0.1 s), no limit in "
            "deployment"
        ),
    )
    pull_interval: float = Field(
        0.05,
        alias="pull-interval",
        ge=0.01,
        le=60,
        description=(
            "seconds between the server's pulls for replies while it waits (on Flower's "
            "simulation engine and in deployment, where Flower 1.41's own grid waits 3 s between "
            "pulls); in deployment also the first retry of a reply whose arrays have not all "
            "arrived (Flower's: 1 s; at most 1 s)"
        ),
    )
    round_timeout: float = Field(
        0.0,
        alias="round-timeout",
        ge=0,
        description=(
            "seconds to wait for the replies of a round; `0`: as long as the work needs — 600 s "
            "for the first round (start-up, data loading), then 10 × the slowest complete round so "
            "far, at least 120 s (a dead node costs about ten normal rounds, not an hour)"
        ),
    )
    holdout_fraction: float = Field(
        0.0,
        alias="holdout-fraction",
        ge=0,
        lt=1,
        description=(
            "share of the clients (highest partition ids) never trained: evaluated at the end as "
            "new clients (e.g. APFL's eq. 17)"
        ),
    )

    # --- local optimisation ----------------------------------------------------------------
    local_epochs: int = Field(1, alias="local-epochs", ge=1, description="local epochs per round")
    local_steps: int = Field(
        0,
        alias="local-steps",
        ge=0,
        description=(
            "local minibatch steps per round instead of epochs (0: use epochs; PFLEGO: τ = 50; "
            "L2GD: 10)"
        ),
    )
    lr: float = Field(0.05, gt=0, description="client learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="client SGD momentum")
    weight_decay: float = Field(
        0.0,
        alias="weight-decay",
        ge=0,
        description="client SGD weight decay (only touches the parameters being trained)",
    )
    max_grad_norm: float = Field(
        0.0,
        alias="max-grad-norm",
        ge=0,
        description="clip the gradient norm of the trained parameters (0: off)",
    )
    batch_size: int = Field(32, alias="batch-size", ge=1, description="training minibatch size")
    eval_batch_size: int = Field(
        512,
        alias="eval-batch-size",
        ge=1,
        description="evaluation minibatch size",
    )
    finetune_epochs: int = Field(
        5,
        alias="finetune-epochs",
        ge=0,
        description="personal-only fine-tuning epochs before evaluating the personalized model",
    )
    finetune_lr: float = Field(
        0.0,
        alias="finetune-lr",
        ge=0,
        description="learning rate of that fine-tuning (0: `lr`)",
    )

    # --- server optimizer and client-lr schedule (all algorithms that aggregate) ----------
    server_optimizer: ServerOptimizerName = Field(
        "auto",
        alias="server-optimizer",
        description=(
            "`sgd` or `adam` on the pseudo-gradient (all aggregating algorithms); `auto`: `adam` "
            "for `pflego` (its experiments), `sgd` otherwise"
        ),
    )
    server_lr: float = Field(
        0.0,
        alias="server-lr",
        ge=0,
        description=(
            "server learning rate (`sgd` with 1.0 is FedAvg; FFGG's γθ); 0: the algorithm's "
            "default, 0.003 for PFLEGO (Adam's ρ), 0.2 for `async-ffgg` (one client's gradient per "
            "step: 1/C of the synchronous step at the default C = 5), 1.0 otherwise"
        ),
    )
    server_beta1: float = Field(0.9, alias="server-beta1", ge=0, lt=1, description="Adam's β1")
    server_beta2: float = Field(0.999, alias="server-beta2", ge=0, lt=1, description="Adam's β2")
    server_eps: float = Field(1e-8, alias="server-eps", gt=0, description="Adam's ε")
    lr_schedule: LRSchedule = Field(
        "constant",
        alias="lr-schedule",
        description=(
            "client lr across rounds: `constant`, `linear` (warm-up, then linear decay to 0), "
            "`exponential` (halving); `personal-lr` follows the same factor"
        ),
    )
    lr_warmup_fraction: float = Field(
        0.1,
        alias="lr-warmup-fraction",
        ge=0,
        lt=1,
        description="`linear`: warm-up share of the rounds",
    )
    lr_halve_every: int = Field(
        500,
        alias="lr-halve-every",
        ge=1,
        description="`exponential`: rounds between halvings",
    )

    # --- personalization: FedAlt / FedSim and the 3-step pipeline -----------------------------
    personal_lr: float = Field(
        0.0,
        alias="personal-lr",
        ge=0,
        description="FedAlt/FedSim step size of the personal part (0: `lr`)",
    )
    personal_epochs: int = Field(
        1,
        alias="personal-epochs",
        ge=0,
        description="FedAlt's personal phase τ_v in epochs (FFGG's `sgd` fine-tuner too)",
    )
    personal_steps: int = Field(
        0,
        alias="personal-steps",
        ge=0,
        description=(
            "FedAlt's personal phase τ_v in steps instead of epochs when > 0 (FFGG's `gd` / `cg` "
            "iterations)"
        ),
    )
    pretrain_rounds: int = Field(
        0,
        alias="pretrain-rounds",
        ge=0,
        description="FedAvg rounds on the whole model before the algorithm",
    )
    pretrain_lr: float = Field(
        0.0,
        alias="pretrain-lr",
        ge=0,
        description="client lr of those rounds (0: `lr`)",
    )

    # --- Byzantine robustness (every strategy that aggregates updates) -------------------
    robust_aggregator: RobustAggregator = Field(
        "auto",
        alias="robust-aggregator",
        description=(
            "robust rule over the clients' updates (gradients, deltas, or current − returned "
            "weights) for every aggregating strategy (`pflower/strategies/aggregators.py`); "
            "`auto`: the algorithm's default defence: `median` after buckets of 2 for `br-ffgg`, "
            "`geometric-median` over buckets of 2 for `ffgg` (without DP), `none` for "
            "`async-ffgg` (its own bounds), `adaptive-clipping` otherwise; `none`: the papers' "
            "plain mean"
        ),
    )
    robust_byzantine: int = Field(
        0,
        alias="robust-byzantine",
        ge=0,
        description=(
            "Byzantine clients per round to tolerate among the replies kept (a failed or "
            "silent node is not one of them); refused before the first round if the rule's "
            "breakdown point over the sample is lower; a round whose kept replies cannot meet "
            "it falls back to the default defence's clip (counted), never a smaller f"
        ),
    )
    robust_bucket_size: int = Field(
        0,
        alias="robust-bucket-size",
        ge=0,
        description=(
            "> 1: bucketing (random buckets of this size, averaged) before the rule; 0: `br-ffgg` "
            "uses 2 (the agnostic default, 1 disables) and so does `ffgg`'s default defence, the "
            'others none. Beside `robust-small-rounds = "clip"` a round\'s buckets shrink (to 1: '
            "the rule on the replies) wherever fewer than 5 bucket means would remain"
        ),
    )
    robust_small_rounds: SmallRounds = Field(
        "auto",
        alias="robust-small-rounds",
        description=(
            "a robust rule in the rounds where it combines fewer than 5 values (a median of 1 or "
            "2 is their mean: one reply moves it by its whole share). `clip`: buckets shrink "
            "first (`robust-bucket-size`), and in rounds of fewer than 5 replies adaptive "
            "clipping's bound replaces the rule (see "
            "`adaptive-clipping`; with 1 or 2 replies each is clipped to `update-norm-growth` × "
            "what the last round of 3 or more applied, or before one to that × the nodes' lower "
            "median norm); `rule`: the rule as configured (exact to its paper); `auto`: "
            "`clip` for `ffgg`'s default defence, `rule` otherwise; `clip` needs a rule and no DP"
        ),
    )
    robust_trim_beta: float = Field(
        0.1,
        alias="robust-trim-beta",
        ge=0,
        lt=0.5,
        description="trimmed-mean share trimmed per side",
    )
    robust_krum_m: int = Field(3, alias="robust-krum-m", ge=1, description="Multi-Krum's m")
    robust_clip_radius: float = Field(
        1.0,
        alias="robust-clip-radius",
        gt=0,
        description="centered clipping's radius",
    )
    robust_clip_factor: float = Field(
        0.0,
        alias="robust-clip-factor",
        ge=0,
        description=(
            "adaptive clipping's radius: this many times the lower median of the updates' "
            "distances to the round's robust centre (>= 1); 0: the algorithm's default, 2 for "
            "PFLEGO (its server's Adam step is scale-free), 1 otherwise"
        ),
    )
    robust_copy_votes: bool = Field(
        True,
        alias="robust-copy-votes",
        description=(
            "the default defence's shared votes: replies that are the same vector, bit for "
            "bit, count as one reply between them (their weights split one reply's), so that "
            "clients sending one vector cannot outvote the honest ones; false: off"
        ),
    )
    robust_node_history: bool = Field(
        True,
        alias="robust-node-history",
        description=(
            "the default defence's node history: a node whose replies were clipped to less "
            "than half their length in most of its last 8 rounds loses its say in the round's "
            "centre, radius and mean in proportion; false: every node votes alike"
        ),
    )
    robust_step_bound: float | Literal["auto"] = Field(
        "auto",
        alias="robust-step-bound",
        description=(
            "beside the default defence or a robust rule: each round's combined update is "
            "scaled down to this many times the median norm of the last 10 applied ones of its "
            "kind (>= 1; 0: off), so that a round a Byzantine majority takes moves theta by at "
            "most that; `auto`: 2 for `ffgg`'s default defence (a gradient step that one "
            "poisoned round sends into a steep region does not run away), off otherwise"
        ),
    )
    robust_clip_iterations: int = Field(
        3,
        alias="robust-clip-iterations",
        ge=1,
        description="centered clipping's iterations",
    )
    max_update_norm: float = Field(
        1000.0,
        alias="max-update-norm",
        ge=0,
        description=(
            "drop a training reply whose update norm exceeds this many times the reference, at "
            "every round size: the reference starts at the shared parameters' norm / this factor "
            "and follows the rounds' lower median of update norms, by at most `update-norm-growth` "
            "per round (`pflower/strategies/checks.py`); `0`: off"
        ),
    )
    update_norm_growth: float = Field(
        2.0,
        alias="update-norm-growth",
        ge=1,
        description="the update-norm reference grows by at most this factor per round",
    )
    max_num_examples: int = Field(
        0,
        alias="max-num-examples",
        ge=0,
        description=(
            "the largest weight a reply's `num-examples` claim gets (a claim above it is capped, "
            "never dropped); `0`: 10 × the lower median of the nodes' first claims, each node "
            "counted once (a node weighs in any case at most what it first reported); set it above "
            "every honest size to weigh replies by their claims as the papers do"
        ),
    )
    max_failed_rounds: int = Field(
        3,
        alias="max-failed-rounds",
        ge=0,
        description=(
            "stop the run (non-zero exit, with the drop reasons) after this many consecutive "
            "training rounds that applied no reply; `0`: never"
        ),
    )
    # --- differential privacy of the shared updates (pflower/strategies/privacy.py) --------
    dp: DPMode = Field(
        "none",
        description=(
            "user-level DP on each client's shared update (weights: sent − returned; gradients, "
            "deltas, Scaffold's control deltas: themselves): `central` (the server clips each "
            "update to `dp-clip`, averages over the sample, adds Gaussian noise), `local` (each "
            "client clips and noises its own update before sending), `none`"
        ),
    )
    dp_clip: float = Field(
        1.0,
        alias="dp-clip",
        gt=0,
        description="clipping norm C of a client's whole shared update (the start, if adaptive)",
    )
    dp_noise: float = Field(
        -1.0,
        alias="dp-noise",
        ge=-1,
        description=(
            "noise multiplier z: noise std z·C on the sum of clipped updates (central), on each "
            "update (local); `-1`: calibrated so the planned rounds spend `dp-epsilon`; `0`: "
            "clipping only (ε = ∞)"
        ),
    )
    dp_epsilon: float = Field(
        0.0,
        alias="dp-epsilon",
        ge=0,
        description=(
            "privacy budget ε at `dp-delta` (Flower's RDP accountant); with `dp-noise` set, a "
            "plan that exceeds it is refused and a round that would exceed it stops the run; "
            "`0`: no budget (then `dp-noise` >= 0 is required)"
        ),
    )
    dp_delta: float = Field(
        1e-5,
        alias="dp-delta",
        gt=0,
        lt=1,
        description="δ of the reported (ε, δ)",
    )
    dp_adaptive_clip: bool = Field(
        False,
        alias="dp-adaptive-clip",
        description=(
            "central: adapt C toward the `dp-clip-quantile` of the update norms (Andrew et al. "
            "2021, a noised count of unclipped updates; its share of the budget is accounted)"
        ),
    )
    dp_clip_quantile: float = Field(
        0.5,
        alias="dp-clip-quantile",
        gt=0,
        lt=1,
        description="adaptive clipping's target share of unclipped updates",
    )
    dp_clip_lr: float = Field(
        0.2, alias="dp-clip-lr", gt=0, description="adaptive clipping's geometric step"
    )
    dp_clip_count_stddev: float = Field(
        0.0,
        alias="dp-clip-count-stddev",
        ge=0,
        description=(
            "std s of the noise on the unclipped count; needs s > z / 2; `0`: sample size / 20 "
            "(Flower's) where that is above z, else z"
        ),
    )
    dp_sampling: DPSampling = Field(
        "fixed",
        alias="dp-sampling",
        description=(
            "central DP: how the training clients are drawn and accounted: `fixed` (`fraction-"
            "train` × the eligible nodes, without replacement; replace-one neighbours, RDP) or "
            "`poisson` (each eligible node on its own coin with probability `fraction-train`, "
            "the mean over the expected size; add/remove neighbours as DP-FedAvg, RDP and PLD, "
            "the tighter)"
        ),
    )
    dp_canaries: int = Field(
        0,
        alias="dp-canaries",
        ge=0,
        description=(
            "central DP: this many canary clients (random directions, sampled like a client) "
            "for a one-shot empirical ε of the final model (Andrew et al. 2024), reported "
            "beside the accountant's; they move the model a little: audits, not production; "
            "`0`: none"
        ),
    )
    dp_noise_seed: int = Field(
        -1,
        alias="dp-noise-seed",
        description=(
            "`-1`: noise from OS entropy; >= 0: a seeded, reproducible noise, which anyone "
            "knowing the seed can remove (tests and experiments only)"
        ),
    )
    # --- straggler simulation (any algorithm; the ClientApp sleeps after training) -----------
    straggler_delay_s: float = Field(
        0.0,
        alias="straggler-delay-s",
        ge=0,
        description=(
            "compute-time model for wall-clock experiments: every training reply waits this many "
            "seconds (node config `delay-s` overrides)"
        ),
    )
    straggler_fraction: float = Field(
        0.0,
        alias="straggler-fraction",
        ge=0,
        le=1,
        description=(
            "the share of the clients, drawn by `seed`, that wait `straggler-factor` times longer"
        ),
    )
    straggler_factor: float = Field(
        10.0,
        alias="straggler-factor",
        ge=1,
        description="how many times longer the stragglers wait",
    )
    attack_simulation: bool = Field(
        False,
        alias="attack-simulation",
        description=(
            "robustness experiments only: the testbed's ServerApp (`pflower.testbed.server_app`) "
            "replaces the replies of nodes with `byzantine = 'alie'`/`'ipm'` by the omniscient "
            "adversary's vector; the production ServerApp refuses it (Running experiments: "
            "Byzantine clients)"
        ),
    )

    # --- run -------------------------------------------------------------------------------
    seed: int = Field(
        0,
        ge=0,
        description=(
            "seeds partitions, model init and local training: every client receives it "
            "(client sampling draws from `sample-seed`)"
        ),
    )
    sample_seed: int = Field(
        -1,
        alias="sample-seed",
        ge=-1,
        description=(
            "who trains and is evaluated in each round: `-1`, a secret seed the server draws "
            "from OS entropy at start and never sends (no client can predict or steer the "
            "sample; the server's own `results.json` and checkpoints record it, key "
            "`sampling`, and under `dp` the checkpoints only); >= 0: a reproducible sample "
            "from that seed, which every client receives with the run config and can predict "
            "(tests and experiments: `pflower experiment` sets it to each run's `seed`; under "
            "`dp` accounted without amplification)"
        ),
    )
    device: DeviceName = Field("auto", description="`auto` (GPU if present), `cpu`, `cuda`")
    outputs_dir: str = Field(
        "outputs",
        alias="outputs-dir",
        description=(
            "where results go, one directory per run: an absolute path as it is; a relative "
            "one against the working directory for a run in process (`pflower experiment`) "
            "and against `~/pflower` under `flwr run`, whose ServerApp runs in the SuperLink's "
            "working directory, which may be any project's; the run logs the directory at its "
            "start and prints it at its end"
        ),
    )
    console: Console = Field(
        "compact",
        description=(
            "`compact`: one aligned line per round (seconds, training loss, personalized / global "
            "accuracy, clients, dropped, bytes down / up) and pflower's table last, Flower's "
            "per-round metric dicts and final dump left out (`results.json` has every number); "
            "`flower`: Flower's output as well"
        ),
    )
    tracking: Tracking = Field(
        "none",
        description=(
            "`tensorboard`: every round's numbers as TensorBoard scalars in `<run>/tensorboard/` "
            "(`torch.utils.tensorboard`, extra `tracking`; `tensorboard --logdir outputs`); "
            "nothing is sent over the network"
        ),
    )
    checkpoint_every: int = Field(
        0,
        alias="checkpoint-every",
        ge=-1,
        description=(
            "a checkpoint (shared parameters, server-optimizer state, round, sampler state, "
            "history) every this many rounds into `outputs/<run>/checkpoints/round-<r>.pt`; `0` "
            "(auto): every round in deployment, none in simulation; `-1`: none (`final-shared.pt` "
            "is always written)"
        ),
    )
    checkpoint_keep: int = Field(
        3,
        alias="checkpoint-keep",
        ge=1,
        description="how many of the newest checkpoints are kept",
    )
    resume_from: str = Field(
        "",
        alias="resume-from",
        description=(
            "a checkpoint, or a run directory (its newest checkpoint): the run continues after "
            "that round, with the same settings; a file of shared parameters (`final-shared.pt`): "
            "a warm start instead of the seeded init"
        ),
    )
    experiment_name: str = Field(
        "default",
        alias="experiment-name",
        min_length=1,
        description=(
            "the experiment (federation) the clients' personal state belongs to: a client loads "
            "only state written under the same name, algorithm, model, data set, partition and "
            "personal part (names, shapes, dtypes); anything else starts fresh with one warning "
            "line"
        ),
    )
    personal_state: PersonalState = Field(
        "experiment",
        alias="personal-state",
        description=(
            "`experiment`: personal state carries across runs of the same experiment (a "
            "deployment's next run continues the devices' layers); `run`: every run starts fresh "
            "(a resumed run continues its own)"
        ),
    )

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
        if self.robust_step_bound != "auto" and (
            self.robust_step_bound < 0 or 0 < self.robust_step_bound < 1
        ):
            raise ConfigError(
                f"key 'robust-step-bound' = {self.robust_step_bound}: a multiple of the median "
                "applied step: must be 0 (off), >= 1 or 'auto'"
            )
        if 0 < self.robust_clip_factor < 1:
            raise ConfigError(
                f"key 'robust-clip-factor' = {self.robust_clip_factor}: a multiple of the lower "
                "median distance, must be 0 (the algorithm's default) or >= 1"
            )
        if self.robust_small_rounds == "clip" and self.robust_aggregator in (
            "none",
            "adaptive-clipping",
        ):
            raise ConfigError(
                "key 'robust-small-rounds' = 'clip': clips the rounds a robust rule is too small "
                f"for, and 'robust-aggregator' = {self.robust_aggregator!r} names no rule"
            )
        if self.robust_small_rounds == "clip" and self.dp != "none":
            raise ConfigError(
                f"key 'robust-small-rounds' = 'clip': with 'dp' = {self.dp!r} the DP clip bounds "
                "every round, and adaptive clipping would decide one reply by the others; "
                "leave it at 'auto'"
            )
        if 0 < self.max_update_norm < 1:
            raise ConfigError(
                f"key 'max-update-norm' = {self.max_update_norm}: a multiple of the reference "
                "(a round's lower median update norm), must be 0 (off) or >= 1"
            )
        if self.dp != "none":
            self._check_dp()
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

    def _check_dp(self) -> None:
        if -1 < self.dp_noise < 0:
            raise ConfigError(
                f"key 'dp-noise' = {self.dp_noise}: must be -1 (calibrated from 'dp-epsilon') "
                "or >= 0"
            )
        if self.dp_noise < 0 and not self.dp_epsilon:
            raise ConfigError(
                f"key 'dp' = {self.dp!r}: needs 'dp-noise' (the noise multiplier, >= 0) or "
                "'dp-epsilon' (a budget the noise is calibrated to); neither is set"
            )
        rule = self.robust_aggregator
        if rule == "auto" and self.algorithm in self.algorithms:  # the algorithm's own rule
            rule = self.algorithms[self.algorithm].defaults.get("robust_aggregator", "none")
        problem = modes_problem(self.dp == "central", rule not in ("none", "auto"), False)
        if problem:
            raise ConfigError(f"key 'robust-aggregator' = {rule!r} with dp = 'central': {problem}")
        if self.dp == "local" and self.dp_sampling == "poisson":
            raise ConfigError(
                "key 'dp-sampling' = 'poisson' with dp = 'local': local DP is accounted per "
                "client without amplification, so the sampling changes nothing; use 'fixed'"
            )
        if self.dp == "local" and self.dp_canaries:
            raise ConfigError(
                f"key 'dp-canaries' = {self.dp_canaries} with dp = 'local': the canaries enter "
                "the server's noised sum, which local DP does not have; use dp = 'central' or 0"
            )
        if self.dp_adaptive_clip and self.dp_clip_count_stddev and self.dp_noise > 0:
            problem = dp_adaptive_problem(self.dp_noise, self.dp_clip_count_stddev)
            if problem:
                raise ConfigError(problem)
        if self.dp == "local" and self.dp_adaptive_clip:
            raise ConfigError(
                "key 'dp-adaptive-clip' = true with dp = 'local': adaptive clipping needs the "
                "server to count unclipped updates, which local DP does not reveal; use a fixed "
                "'dp-clip' or dp = 'central'"
            )

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

    def resolved(
        self,
        defaults: Mapping[str, Any] | None = None,
        defence: Mapping[str, Any] | None = None,
    ) -> Self:
        """This config with every key at its ``auto`` value (``AUTO``) replaced by the
        algorithm's default for it (``defaults``; ``None``: those of the chosen algorithm's
        registration, e.g. PFLEGO's server lr and tau) or by the generic one; with
        ``robust-aggregator`` at ``auto`` and no differential privacy, the keys of the
        algorithm's default ``defence`` too (FFGG's: the geometric median in place of
        adaptive clipping). A strategy built
        by hand takes its defaults from ``RunSettings().resolved(its class's defaults and
        defence)``, so that it runs what the app runs (``PersonalizedStrategy.app_settings``)."""
        if defaults is None:
            entry = self.algorithms.get(self.algorithm)
            defaults = entry.defaults if entry else {}
            defence = entry.defence if entry else {}
        if defence and self.dp == "none" and self.robust_aggregator == "auto":
            defaults = {**defence, **defaults}  # a rule the run names keeps its own keys
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


def modes_problem(central_dp: bool, rule: bool, clip: bool) -> str:
    """Why the reply pipeline's combine modes do not compose ('' if they do): the one rule of
    their composition, which the run config's check and the pipeline's builder
    (``strategies.pipeline.build``) both apply. Central DP calibrates its noise to the mean's
    sensitivity, one clipped reply: a robust rule has no such sensitivity, and its or the
    default defence's statistics across replies would decide one reply by the others."""
    if central_dp and (rule or clip):
        return (
            "central DP's noise is calibrated to the mean's sensitivity, which a robust rule "
            "does not have, and the statistics of a rule or of the default defence's clip "
            "across replies would decide one reply by the others; use dp = 'local' (the rule "
            "then only post-processes noised updates) or robust-aggregator = 'none'"
        )
    return ""


def dp_adaptive_problem(noise: float, stddev: float, sample: float | None = None) -> str:
    """Why adaptive clipping cannot run at noise multiplier ``noise`` with count noise
    ``stddev`` ('' if it can): the updates' share of the budget, ``z^-2 - (2 s)^-2`` (Flower's
    ``compute_adaptive_noise_params``), must be positive: ``z < 2 s``."""
    if noise <= 0 or noise < 2 * stddev:
        return ""
    per_round = f"; {sample:g} clients per round" if sample else ""
    return (
        f"keys 'dp-adaptive-clip' = true, 'dp-noise' = {noise:.4g}, 'dp-clip-count-stddev' = "
        f"{stddev:g}: the count's noise must be more than half the noise multiplier (z < 2 s"
        f"{per_round}); set 'dp-clip-count-stddev' >= {noise:.4g} (or 0: chosen so it works) "
        "or a fixed clip"
    )


def _one_of(key: str, value: str, names: tuple[str, ...], alternative: str = "") -> None:
    if value not in names:
        extra = f", {alternative}" if alternative else ""
        raise ConfigError(f"key {key!r} = {value!r}: must be {_choices(value, names)}{extra}")


def _member(part: Any) -> str:
    """A union member in words: 'a number', ''auto''."""
    names = get_args(part)
    if names:
        return repr(names[0]) if len(names) == 1 else _allowed(names)
    return {float: "a number", int: "a whole number", str: "a string"}.get(part, str(part))


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
    unions: set[str] = set()
    for e in err.errors():
        if not e["loc"]:  # raised by a model validator: already phrased with key and value
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        name = str(e["loc"][0])
        key = name.replace("_", "-")
        if len(e["loc"]) > 1 and name.replace("-", "_") in cls.model_fields:
            # one error per member of a union (``float | Literal["auto"]``): said once
            if name not in unions:
                unions.add(name)
                parts = get_args(cls.model_fields[name.replace("-", "_")].annotation)
                allowed = [_member(part) for part in parts]
                lines.append(f"key {key!r} = {e['input']!r}: must be {' or '.join(allowed)}")
            continue
        if e["type"] == "extra_forbidden":
            keys = [info.alias or k.replace("_", "-") for k, info in cls.model_fields.items()]
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(
                f"key {key!r} = {e['input']!r}: unknown key{hint}; every key is in "
                "docs/reference/run-config.md"
            )
        elif e["type"] == "literal_error" and name.replace("-", "_") in cls.model_fields:
            names = get_args(cls.model_fields[name.replace("-", "_")].annotation)
            lines.append(f"key {key!r} = {e['input']!r}: must be {_choices(e['input'], names)}")
        else:
            lines.append(f"key {key!r} = {e['input']!r}: {e['msg'].lower()}")
    return "invalid run config: " + "; ".join(lines)
