"""The experiment ClientApp: the production ClientApp with Byzantine clients and stragglers
attached from outside.

``experiment_client_app(overrides)`` is ``pflower.client_app.build_client_app(overrides)``
whose training step runs inside ``experiment_train``: by the node config, a Byzantine node
(``byzantine``, ``attacks``) flips its labels before training or corrupts its reply after it,
an ALIE / IPM / Min-Max / Min-Sum node tags its honest reply for the server's attack
simulation, a backdoor node trains on poisoned data and boosts its update, a node with
``backdoor-target`` measures the backdoor at evaluation (``backdoor``), and a straggler
(``delay-s``, or the run config's ``straggler-*`` keys, ``stragglers``) waits before it
replies. Everything else (the job, the client half, evaluation, the start-up query) is the
production app's own code, so an honest node computes exactly what it computes there.

Not a Flower mod: a mod sees only messages, and ``label-flip`` changes the data the job trains
on. ``app`` is the component to name for ``flwr run`` in robustness and straggler experiments
(``clientapp = "pflower.testbed.client_app:app"`` in ``[tool.flwr.app.components]``);
``LocalGrid``'s ``run_local`` uses it by default.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from pflower.client_app import EvaluateStep, TrainStep, build_client_app
from pflower.strategies.client import ClientJob
from pflower.testbed import attacks, backdoor
from pflower.testbed.stragglers import straggler_delay
from pflower.wire import ARRAYS, SERVER_ROUND


def experiment_train(
    msg: Message, context: Context, job: ClientJob, config: Mapping, train: TrainStep
) -> tuple:
    """One training step of this node, with its attack and delay (none for a node config
    without ``byzantine`` / ``delay-s`` and a run without ``straggler-delay-s``)."""
    node = context.node_config
    tag = attacks.before_training(job, node, job.cfg)
    records, key, metrics = train(job, config)
    seed = job.partition_id * 7919 + int(config.get(SERVER_ROUND, 0))
    records = attacks.after_training(records, key, msg.content[ARRAYS], node, seed)
    delay = straggler_delay(job.cfg, node)
    if delay:
        time.sleep(delay)
    return records, key, {**metrics, **tag}


def experiment_evaluate(
    msg: Message, context: Context, job: ClientJob, config: Mapping, evaluate: EvaluateStep
) -> Mapping:
    """One evaluation of this node; with ``backdoor-target`` in its node config, plus the
    backdoor probe's metrics (``pflower.testbed.backdoor``)."""
    node = context.node_config
    if "backdoor-target" not in node:
        return evaluate(job, config)
    from pflower.task.data import dataset_info

    with backdoor.Probe(job, dataset_info(job.cfg).input_shape, node) as probe:
        metrics = evaluate(job, config)
    return {**metrics, **probe.metrics(metrics)}


def experiment_client_app(overrides: Mapping | None = None) -> ClientApp:
    """The production ClientApp (``build_client_app(overrides)``) with ``experiment_train``
    around its training step and ``experiment_evaluate`` around its evaluation."""
    return build_client_app(
        overrides, wrap_train=experiment_train, wrap_evaluate=experiment_evaluate
    )


app = experiment_client_app()
