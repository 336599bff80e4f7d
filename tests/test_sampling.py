"""Who is sampled, and who may be (issue 45 items 6 and 7, issue 46 item 1): a secret sample by
default, nobody can predict or steer; a reproducible one when the run asks (``sample-seed``);
the start-up handshake refuses, by name, a node that claims another's partition id, reports
another ``num-partitions``, other data or another model's code."""

from __future__ import annotations

import copy
import json
import random
import time
from collections import Counter

import pytest
import torch
from flwr.app import Message
from flwr.clientapp import ClientApp
from helpers import recording
from torch import nn

from pflower.client_app import build_client_app
from pflower.config import Config
from pflower.experiment import load
from pflower.experiment.running import finished
from pflower.server_app import run
from pflower.settings import ConfigError
from pflower.strategies import FedAvg, build_run_model
from pflower.strategies.client import answer_query
from pflower.strategies.nodes import NodeSampler, SecretRandom, sample_stream
from pflower.task.fingerprint import data_kind, model_fingerprint
from pflower.testbed.local_grid import LocalGrid

N, K, ROUNDS = 10, 5, 20  # nodes, sampled per round (fraction 0.5), rounds of a run


class FakeGrid:
    """The nodes of a federation, for a sampler that asks nothing."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def Sampler(sample_seed: int, partition_of: dict[int, int] | None = None) -> NodeSampler:  # noqa: N802
    """The component alone, as ``PersonalizedStrategy`` builds it, with the partitions known."""
    sampler = NodeSampler(sample_seed)
    sampler.partition_of.update(partition_of or {})
    return sampler


# --- a secret sample: a partition-id liar or a pair of colluders gain nothing ---------------
def public_replay(public_seed: int) -> random.Random:
    """What a client can compute from the run config it receives: the stream a seeded run
    draws from (``random.Random``) under the one seed it knows, the run config's."""
    return random.Random(public_seed)


def liar_rank(public_seed: int) -> int:
    """The position in partition-id order that the public stream samples most in ``ROUNDS``
    rounds of ``K`` of ``N``: where a liar claims its partition id (an id still free)."""
    rng, counts = public_replay(public_seed), Counter()
    for _ in range(ROUNDS):
        counts.update(rng.sample(range(N), K))
    return max(range(N), key=lambda r: (counts[r], -r))


def liar_rate(runs: int, sample_seed_of) -> float:
    """The liar's share of rounds in which it is sampled, over ``runs`` runs (seeds 0..),
    each a federation in which it took the partition id it computed as best."""
    sampled = 0
    for seed in range(runs):
        rank = liar_rank(sample_seed_of(seed))
        # 9 honest nodes hold every other id of 0..N-1; the liar (node 999) takes the free one
        partition_of = {100 + p: p for p in range(N) if p != rank} | {999: rank}
        sampler = Sampler(sample_seed_of(seed), partition_of)
        grid = FakeGrid(partition_of)
        sampled += sum(999 in sampler.sample(grid, K / N, train=True) for _ in range(ROUNDS))
    return sampled / (runs * ROUNDS)


def test_a_partition_id_liar_is_sampled_at_its_fair_rate():
    """The issue's attack: a client knows the run config (every client receives it) and
    claims the free partition id whose position the run's stream samples most. Against a
    reproducible sample (``sample-seed`` public) it is sampled in ~2/3 of the rounds; against
    the default, secret one at its fair K/N = 1/2: over 100 runs x 20 rounds (2 000
    Bernoulli(1/2) draws, std 0.011) within 0.05 (4.5 std)."""
    public = liar_rate(100, lambda seed: seed)  # sample-seed = the run's seed: public
    assert public > 0.6  # the attack works where the sample is public: the test can fail
    secret = liar_rate(100, lambda seed: -1)  # the default; the liar replays Random(-1)
    assert abs(secret - K / N) < 0.05, secret


def test_two_colluders_are_sampled_together_at_their_fair_rate():
    """Two colluding clients take the two free ids whose positions the public stream samples
    together in round 1 (the round that seeds the update-norm reference): with a public
    sample always together; with the secret one at K(K-1) / N(N-1) = 2/9 (400 runs, std
    0.021, tolerance 0.09)."""

    def together(sample_seed: int, public_seed: int) -> bool:
        first = sorted(public_replay(public_seed).sample(range(N), K))[:2]
        partition_of = {100 + p: p for p in range(N) if p not in first}
        partition_of |= {998: first[0], 999: first[1]}
        sampled = Sampler(sample_seed, partition_of).sample(FakeGrid(partition_of), K / N)
        return {998, 999} <= set(sampled)

    assert all(together(seed, seed) for seed in range(50))  # public: the pair always meets
    rate = sum(together(-1, -1) for _ in range(400)) / 400
    assert abs(rate - K * (K - 1) / (N * (N - 1))) < 0.09, rate


def test_the_secret_stream_is_uniform_and_replays_from_its_seed():
    """``SecretRandom``: each node of 10 sampled at K/N (4 000 draws of 5 from a fixed seed,
    so that the check is deterministic; tolerance 0.036 = 4.5 std of a node's frequency),
    two secret streams differ, a stream replays from its seed and survives a pickle (a
    checkpoint) mid-way."""
    import pickle

    rng, counts = SecretRandom(2026), Counter()
    for _ in range(4000):
        counts.update(rng.sample(range(N), K))
    assert all(abs(counts[n] / 4000 - K / N) < 0.036 for n in range(N)), counts
    a, b = sample_stream(-1), sample_stream(-1)
    assert a[1]["seed"] != b[1]["seed"] and a[1]["secret"]
    assert [a[0].sample(range(N), K) for _ in range(5)] != [
        b[0].sample(range(N), K) for _ in range(5)
    ]
    stream = SecretRandom(12345)
    head = [stream.sample(range(N), K) for _ in range(3)]
    copy = pickle.loads(pickle.dumps(stream))
    tail = [stream.sample(range(N), K) for _ in range(3)]
    assert [copy.sample(range(N), K) for _ in range(3)] == tail
    replay = SecretRandom(12345)
    assert [replay.sample(range(N), K) for _ in range(6)] == head + tail
    # a reproducible sample is the stream every seeded run drew before sample-seed existed
    assert sample_stream(7)[0].sample(range(N), K) == random.Random(7).sample(range(N), K)


# --- end to end: what the clients receive, what the outputs hold ----------------------------
RUN = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "batch-size": 64,
    "max-train-samples": 60,
    "finetune-epochs": 1,
    "pretrain-rounds": 0,
    "num-server-rounds": 4,
    "evaluate-every": 4,  # the final round only: it evaluates everyone, drawing nothing
    "fraction-train": 0.5,
}
NODES = 8  # 4 of them train in each round: C(8, 4) = 70 samples a round


def run_recorded(overrides, out, grid_type=LocalGrid, **grid_kwargs):
    seen, received = {}, []
    cfg = Config.from_run_config({**overrides, "outputs-dir": str(out)})
    app = recording(overrides, seen, received)
    grid = grid_type(app, NODES, run_config=overrides, seed=cfg.seed, **grid_kwargs)
    return run(grid, cfg), seen, received


def replayed(rng: random.Random, rounds: int) -> dict[int, set[int]]:
    """The partitions a stream samples for training in each round: 4 of the 8 nodes in
    partition-id order, one draw per round (the final round evaluates everyone)."""
    return {r: set(rng.sample(range(NODES), NODES // 2)) for r in range(1, rounds + 1)}


def test_the_default_sample_is_secret_new_in_every_run_and_recorded_by_the_server_only(
    tmp_path,
):
    first, seen_a, received = run_recorded(RUN, tmp_path / "a")
    second, seen_b, _ = run_recorded(RUN, tmp_path / "b")
    assert len(seen_a) == 4 and all(len(s) == 4 for s in seen_a.values())
    assert seen_a != seen_b  # two runs of one config: (1/70)^4 that they would agree
    seed = first.sampling["seed"]
    assert first.sampling["secret"] and seed != second.sampling["seed"] and seed >= 2**64
    # the server's own results.json records it; the public config.json does not
    results = json.loads((first.path / "results.json").read_text())
    assert results["sampling"] == {"seed": seed, "secret": True, "generator": "SecretRandom"}
    assert str(seed) not in (first.path / "config.json").read_text()
    # nothing a client receives holds it, and no stream a client can seed from what it
    # receives draws the run's sample; the seed the server recorded does
    assert all(str(seed) not in str(value) for value in received)
    numbers = {int(v) for v in received if isinstance(v, (int, float)) and v == int(v)}
    assert {0, 1, 4} <= numbers  # seed, rounds, partition ids...: what a replay would try
    numbers.add(-1)  # and sample-seed, which a client of `flwr run` receives
    for x in numbers:
        assert replayed(random.Random(x), 4) != seen_a
        assert replayed(SecretRandom(x), 4) != seen_a
    assert replayed(SecretRandom(seed), 4) == seen_a


def test_a_reproducible_sample_is_the_seeded_stream_in_partition_order(tmp_path):
    report, seen, _ = run_recorded({**RUN, "sample-seed": 7}, tmp_path)
    assert report.sampling == {"seed": 7, "secret": False, "generator": "random.Random"}
    # an independent computation: Random(7) over the partition ids, whatever the node ids
    assert seen == replayed(random.Random(7), 4)


class DyingGrid(LocalGrid):
    """A LocalGrid whose server dies once round ``dies_in``'s training replies are back."""

    dies_in: int | None = None

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        train = [m for m in messages if m.metadata.message_type == "train"]
        if train and int(train[0].content["config"]["server-round"]) == self.dies_in:
            raise RuntimeError("the server died")
        return replies


def test_a_resumed_run_continues_the_secret_stream(tmp_path):
    """Killed in round 3, resumed from round 2's checkpoint: rounds 3 and 4 sample what the
    secret stream of the crashed run draws next, and the resumed run records its seed."""
    overrides = {**RUN, "checkpoint-every": 1}
    seen, received = {}, []
    cfg = Config.from_run_config({**overrides, "outputs-dir": str(tmp_path / "crashed")})
    devices = DyingGrid(recording(overrides, seen, received), NODES, seed=cfg.seed)
    devices.dies_in = 3
    with pytest.raises(RuntimeError, match="died"):
        run(devices, cfg)
    (crashed,) = (tmp_path / "crashed").iterdir()
    checkpoint = torch.load(crashed / "checkpoints" / "round-2.pt", weights_only=True)
    assert "SecretRandom" in bytes(checkpoint["strategy"].numpy()).decode("latin-1")
    before = {r: set(s) for r, s in seen.items()}
    devices.dies_in, seen_after = None, {}
    seen.clear()
    resumed = run(
        devices,
        Config.from_run_config(
            {**overrides, "outputs-dir": str(tmp_path / "resumed"), "resume-from": str(crashed)}
        ),
    )
    seed = resumed.sampling["seed"]
    stream = replayed(SecretRandom(seed), 4)
    assert before == {r: stream[r] for r in (1, 2, 3)}  # the crashed run drew from it
    seen_after = {r: set(s) for r, s in seen.items()}
    assert seen_after == {3: stream[3], 4: stream[4]}  # and the resumed one goes on


# --- the handshake ---------------------------------------------------------------------------
def with_tanh(model: nn.Module) -> nn.Module:
    """The same model with every ReLU a Tanh: another version of the model code, the same
    parameter names and shapes."""
    for name, child in model.named_children():
        if isinstance(child, nn.ReLU):
            setattr(model, name, nn.Tanh())
        else:
            with_tanh(child)
    return model


def answering(overrides, other_models: dict[int, nn.Module]):
    """pflower's ClientApp, except that the nodes of ``other_models``' partitions run that
    model (they answer the start-up query with it; none of them is ever sampled)."""
    honest = build_client_app(overrides)
    app = ClientApp()

    @app.train()
    def train(msg, context):
        return honest(msg, context)

    @app.evaluate()
    def evaluate(msg, context):
        return honest(msg, context)

    @app.query()
    def query(msg, context):
        model = other_models.get(int(context.node_config["partition-id"]))
        if model is None:
            return honest(msg, context)
        kind = data_kind(overrides.get("dataset", "mnist-5k"), None)
        return answer_query(msg, context.node_config, kind, lambda: model, lambda: 0)

    return app


def test_nodes_that_would_compute_something_else_are_refused_by_name(tmp_path):
    """Of 7 nodes: partition 2 runs the MLP with Tanh for ReLU, 3 has a data-path the data
    set ignores, 4 reports num-partitions 9 (the others 7), and the node of index 6 claims
    partition 5 too. Each is refused at start-up, listed with its reason, never sampled or
    evaluated; the run goes on with partitions 0 and 1."""
    overrides = {**RUN, "num-server-rounds": 2, "evaluate-every": 2, "fraction-train": 1.0}
    cfg = Config.from_run_config(overrides)
    tanh = with_tanh(build_run_model(cfg))
    assert [(n, p.shape) for n, p in tanh.named_parameters()] == [
        (n, p.shape) for n, p in build_run_model(cfg).named_parameters()
    ]
    seen: dict = {}
    node_configs = {
        3: {"data-path": "/nowhere.npz"},
        4: {"num-partitions": 9},
        6: {"partition-id": 5},
    }
    app = recording_app(answering(overrides, {2: tanh}), seen)
    grid = LocalGrid(app, 7, node_configs=node_configs, seed=cfg.seed)
    report = run(grid, Config.from_run_config({**overrides, "outputs-dir": str(tmp_path)}))
    assert seen == {1: {0, 1}, 2: {0, 1}}
    assert report.final["clients"] == 2  # the refused are not evaluated either
    reasons = {r["partition-id"]: r["reason"] for r in report.refused}
    assert len(report.refused) == 5 and set(reasons) == {2, 3, 4, 5}
    fingerprint = model_fingerprint(build_run_model(cfg))
    assert (
        reasons[2]
        == f"model-fingerprint {model_fingerprint(tanh)!r} (the server's: {fingerprint!r})"
    )
    assert reasons[3] == "data-kind 'built-in (data-path ignored)' (the server's: 'built-in')"
    assert reasons[4] == "num-partitions 9 (the federation's: 7)"
    assert "partition-id 5 claimed by 2 nodes" in reasons[5]
    both = [r["node"] for r in report.refused if r["partition-id"] == 5]
    assert len(set(both)) == 2 and all(str(n) in reasons[5] for n in both)
    results = json.loads((report.path / "results.json").read_text())
    assert results["refused-nodes"] == report.refused


def recording_app(app, seen: dict):
    def call(msg, context):
        if msg.metadata.message_type == "train":
            r = int(msg.content["config"]["server-round"])
            seen.setdefault(r, set()).add(int(context.node_config["partition-id"]))
        return app(msg, context)

    return call


class Joining(LocalGrid):
    """A LocalGrid whose ``hidden`` nodes are not connected (yet, or any more)."""

    hidden: set = set()

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.hidden]


def test_a_duplicate_partition_id_refuses_both_nodes_at_start_and_later():
    """Nodes of index 3 and 4 both claim partition 3: both refused, whichever answered
    first. A node that connects later claiming partition 1 is asked before it is sampled and
    refused with the holder while both are connected; when the holder leaves, it may be."""
    node_configs = {4: {"partition-id": 3}, 5: {"partition-id": 1}}
    overrides = {**RUN, "fraction-train": 1.0}
    grid = Joining(build_client_app(overrides), 6, node_configs=node_configs)
    late = list(grid.contexts)[5]  # index 5 (LocalGrid: in index order), partition 1
    grid.hidden = {late}  # connects later
    strategy = FedAvg(fraction_train=1.0)
    strategy.nodes.learn_partitions(grid, timeout=10)
    pid = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    holder = next(n for n in grid.contexts if pid[n] == 1 and n != late)
    twins = {n for n in grid.contexts if pid[n] == 3}
    assert set(strategy.nodes.refused) == twins
    assert {pid[n] for n in strategy.nodes.sample(grid, 1.0, train=True)} == {0, 1, 2}
    grid.hidden = set()  # the late node connects
    assert {pid[n] for n in strategy.nodes.sample(grid, 1.0, train=True)} == {0, 2}
    assert set(strategy.nodes.refused) == twins | {late, holder}
    grid.hidden = {holder}  # the holder leaves: the newcomer's claim is now unique
    sampled = strategy.nodes.sample(grid, 1.0, train=True)
    assert late in sampled and {pid[n] for n in sampled} == {0, 1, 2}
    assert {r["node"] for r in strategy.nodes.refusals} == twins | {late, holder}


def test_a_strategy_built_by_hand_compares_the_nodes_with_each_other_or_its_own_model():
    """No model of its own: the node running Tanh is refused against the fingerprint most
    nodes report; given one (``model_fingerprint``), every node that differs from it; and a
    federation every node of which is refused fails at start, naming them."""
    overrides = {**RUN}
    cfg = Config.from_run_config(overrides)
    tanh = with_tanh(build_run_model(cfg))
    grid = LocalGrid(answering(overrides, {2: tanh}), 5)
    pid = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    plain = FedAvg()
    plain.nodes.learn_partitions(grid, timeout=10)
    assert {pid[n] for n in plain.nodes.refused} == {2}
    assert "(most nodes': " in plain.nodes.refused[next(iter(plain.nodes.refused))]
    theirs = FedAvg(model_fingerprint=model_fingerprint(tanh))
    theirs.nodes.learn_partitions(grid, timeout=10)
    assert {pid[n] for n in theirs.nodes.refused} == {0, 1, 3, 4}
    nobody = FedAvg(model_fingerprint="0" * 16)
    with pytest.raises(ConfigError, match="every node that answered was refused"):
        nobody.nodes.learn_partitions(grid, timeout=10)


class ReluNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TanhNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ReluNetAgain(nn.Module):
    def __init__(self):
        super().__init__()
        # the same code as ReluNet's, another comment and layout
        self.fc1, self.fc2 = (nn.Linear(4, 8), nn.Linear(8, 2))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))  # the same


def test_the_model_fingerprint_sees_code_and_settings_not_values():
    sequential = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    assert model_fingerprint(sequential) != model_fingerprint(other)  # the repr: the layer
    assert model_fingerprint(ReluNet()) != model_fingerprint(TanhNet())  # forward's code
    torch.manual_seed(1)
    first = model_fingerprint(ReluNet())
    assert model_fingerprint(ReluNet()) == first  # other initial values: the same model
    # a layer's settings, which only the module repr holds (same classes, same parameters)
    leaky = [nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(a), nn.Linear(8, 2)) for a in (0.01, 0.2)]
    assert model_fingerprint(leaky[0]) != model_fingerprint(leaky[1])
    wider = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2))
    assert model_fingerprint(wider) != model_fingerprint(sequential)
    assert model_fingerprint(copy.deepcopy(sequential).double()) != model_fingerprint(sequential)
    # the class's code is read as its syntax tree: its comments and layout are not part of it
    from pflower.task.fingerprint import _code_of

    def tree(cls):
        return _code_of(cls).split("\n", 1)[1].replace(cls.__name__, "ReluNet")

    assert "relu" in tree(ReluNet) and tree(ReluNet) == tree(ReluNetAgain)


NETMOD = """import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.{activation}(self.fc1(x)))
"""


def test_another_version_of_the_model_module_is_another_fingerprint(tmp_path, monkeypatch):
    """The issue's node: the same module, class and parameter names and shapes (the same
    repr), another activation in ``forward``; and the same code with a comment more."""
    import importlib.util
    import sys

    versions = [("relu", ""), ("tanh", ""), ("relu", "\n# a comment, another layout\n")]
    prints = []
    for i, (activation, extra) in enumerate(versions):
        (tmp_path / str(i)).mkdir()
        path = tmp_path / str(i) / "netmod.py"
        path.write_text(NETMOD.format(activation=activation) + extra)
        spec = importlib.util.spec_from_file_location("netmod", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "netmod", module)  # as each node imports it
        spec.loader.exec_module(module)
        prints.append((repr(module.Net()), model_fingerprint(module.Net())))
    assert prints[0][0] == prints[1][0]  # nothing but the code tells them apart
    assert prints[0][1] != prints[1][1]
    assert prints[0][1] == prints[2][1]


def test_the_apps_answer_the_handshake_with_their_run_model():
    """The production ClientApp and PersonalizedClient report the fingerprint of the model
    they run: the app's is the server's own run model's (the server compares them)."""
    from flwr.app import ConfigRecord, MessageType, RecordDict

    cfg = Config.from_run_config(RUN)
    grid = LocalGrid(build_client_app(RUN), 2)
    content = RecordDict({"config": ConfigRecord({"query": "partition-id,node-facts"})})
    messages = [
        Message(content=content, message_type=MessageType.QUERY, dst_node_id=n)
        for n in grid.get_node_ids()
    ]
    replies = list(grid.send_and_receive(messages))
    assert len(replies) == 2
    for reply in replies:
        facts = reply.content["node-facts"]
        assert facts["model-fingerprint"] == model_fingerprint(build_run_model(cfg))
        assert facts["data-kind"] == "built-in"
        assert reply.content["metrics"]["num-partitions"] == 2


# --- experiments keep a reproducible sample ------------------------------------------------
EXPERIMENT = """
[experiment]
nodes = 3
seeds = [0, 4]

[base]
dataset = "digits"

[[run]]
name = "FedAvg"
algorithm = "fedavg"

[[run]]
name = "FedAvg secret"
algorithm = "fedavg"
sample-seed = -1
"""


def test_experiment_runs_sample_reproducibly_from_their_seed_unless_the_file_says(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    experiment = load(path, out=tmp_path / "out")
    keys = {(r.label, r.seed): r.config.get("sample-seed") for r in experiment.runs}
    assert keys == {
        ("FedAvg", 0): 0,
        ("FedAvg", 4): 4,
        ("FedAvg secret", 0): -1,
        ("FedAvg secret", 4): -1,
    }
    # a run finished before sample-seed existed (its config.json without the key) sampled
    # from random.Random(seed): the same run as sample-seed = seed, not rerun
    run_ = next(r for r in experiment.runs if r.label == "FedAvg" and r.seed == 4)
    directory = run_.directory(experiment.out)
    directory.mkdir(parents=True)
    flat = Config.from_run_config({**run_.config, "outputs-dir": "x"}).to_flat()
    del flat["sample-seed"]
    (directory / "config.json").write_text(json.dumps({"run-config": flat}))
    (directory / "run.json").write_text(json.dumps({}))
    assert finished(run_, experiment)
    flat["sample-seed"] = -1  # but a secret run is not that run
    (directory / "config.json").write_text(json.dumps({"run-config": flat}))
    assert not finished(run_, experiment)


def test_a_node_that_does_not_answer_is_asked_once_and_sampled_unchecked():
    """As before the handshake: a silent node is sampled (its messages still carry the
    settings handshake), and not asked again before every round."""
    grid = LocalGrid(build_client_app(RUN), 3, silent=[2])
    strategy = FedAvg()
    started = time.monotonic()
    strategy.nodes.learn_partitions(grid, timeout=5)
    asked = time.monotonic() - started
    silent = next(n for n in grid.contexts if n in grid.silent)
    assert silent not in strategy.nodes.partition_of and silent not in strategy.nodes.refused
    started = time.monotonic()
    for _ in range(3):
        assert silent in strategy.nodes.sample(grid, 1.0)  # sampled unchecked, as before
    assert time.monotonic() - started < asked
