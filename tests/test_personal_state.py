"""Personal state scoped to what produced it (``pflower.context_store.ScopedStore``): a run
loads only state of its own scope (experiment name, algorithm, model, data set, partition,
personal part), carries it across runs only with ``personal-state = "experiment"``, never
starts a round from state written in that round (a round the server may never have
committed), and every algorithm that keeps state reports ``personal-restored``."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from helpers import BASE, job_for, node_context

from pflower.client_app import build_client_app
from pflower.config import Config, ConfigError
from pflower.context_store import ContextStore, Scope, ScopedStore, open_store, stored_entries
from pflower.task.split import get_tensors
from pflower.task.state import DirectoryStore
from pflower.testbed.local_grid import run_local
from pflower.wire import RUN_TAG

SCOPE = Scope("exp", "fedalt", "mlp", "digits", "0/4", "abc")
W = {"w": torch.zeros(3)}


def _store(raw, run="r1", server_round=1, training=True, carry=True, scope=SCOPE):
    return ScopedStore(
        raw, scope, run=run, server_round=server_round, training=training, carry=carry
    )


def test_a_round_never_starts_from_state_written_in_that_round(tmp_path):
    raw = DirectoryStore(tmp_path)
    _store(raw, server_round=1).save("personal", {"w": torch.full((3,), 1.0)})
    _store(raw, server_round=2).save("personal", {"w": torch.full((3,), 2.0)})
    # the server died before committing round 2 and sends round 2 again (same run tag)
    assert torch.equal(_store(raw, server_round=2).load("personal")["w"], torch.full((3,), 1.0))
    # ... evaluation of round 1 sees round 1's state, training of round 3 round 2's
    assert _store(raw, server_round=1, training=False).load("personal")["w"][0] == 1.0
    assert _store(raw, server_round=3).load("personal")["w"][0] == 2.0
    # the repeated round 2 replaces the uncommitted entry; round 1's stays behind it
    _store(raw, server_round=2).save("personal", {"w": torch.full((3,), 2.5)})
    _store(raw, server_round=2).save("personal", {"w": torch.full((3,), 2.7)})
    assert _store(raw, server_round=2).load("personal")["w"][0] == 1.0
    assert _store(raw, server_round=3).load("personal")["w"][0] == pytest.approx(2.7)


def test_state_carries_across_runs_only_with_personal_state_experiment():
    raw = ContextStore(RecordDict())
    _store(raw, run="first", server_round=7).save("personal", {"w": torch.ones(3)})
    assert _store(raw, run="second").load("personal") is not None
    assert _store(raw, run="second", carry=False).load("personal") is None
    # the new run's first write keeps the old run's entry as the previous one: a repeat of
    # the new run's round 1 still starts from it
    _store(raw, run="second").save("personal", {"w": torch.full((3,), 5.0)})
    assert torch.equal(_store(raw, run="second").load("personal")["w"], torch.ones(3))


@pytest.mark.parametrize(
    "field, value",
    [
        ("experiment", "other"),
        ("algorithm", "pflego"),
        ("model", "logreg"),
        ("dataset", "mnist-5k"),
        ("partition", "1/4"),
        ("personal", "def"),
    ],
)
def test_state_of_another_scope_is_never_loaded(field, value, caplog):
    raw = ContextStore(RecordDict())
    other = Scope(**{**SCOPE.__dict__, field: value})
    _store(raw, scope=other).save("personal", W)
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        assert _store(raw, run="next").load("personal") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"{field} {value!r}" in lines[0] and "starting fresh" in lines[0]


def test_state_without_a_scope_is_not_loaded(tmp_path, caplog):
    DirectoryStore(tmp_path).save("personal", W)  # as pflower before scoping wrote it
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        assert _store(DirectoryStore(tmp_path)).load("personal") is None
    assert "no record of what wrote it" in caplog.text


def _train_message(shared: ArrayRecord, server_round: int, run: str) -> Message:
    config = {"server-round": server_round, "lr": 0.1, "lr-scale": 1.0, "phase": "train"}
    content = RecordDict({"arrays": shared, "config": ConfigRecord({**config, RUN_TAG: run})})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def test_fedalt_never_starts_from_the_head_a_pflego_run_left(task_identity, caplog):
    """The reported failure: names and shapes of PFLEGO's head match FedAlt's, but it was
    trained by another algorithm; FedAlt starts from its init, with one warning line."""
    model = {**BASE, "model": "pflego-mlp", "split": "head"}
    context = node_context()
    pflego = job_for({**model, "algorithm": "pflego"}, state=context.state)
    diverged = {n: torch.full_like(t, 1e3) for n, t in pflego.init_personal.items()}
    scope = Scope.of(pflego.cfg, 0, 4, pflego.init_personal)
    ScopedStore(open_store(context.state, {}), scope, run="pflego-run").save("personal", diverged)

    overrides = {**model, "algorithm": "fedalt"}
    probe = job_for(overrides)
    shared = ArrayRecord(get_tensors(probe.model, probe.split.shared))
    with caplog.at_level(logging.WARNING, logger="flwr.pflower"):
        reply = build_client_app(overrides)(_train_message(shared, 1, "fedalt-run"), context)
    assert reply.content["metrics"]["personal-restored"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "algorithm 'pflego' (this run: 'fedalt')" in warnings[0]
    stored = ContextStore(context.state).load("personal")
    assert all(stored[n].abs().max() < 100 for n in probe.split.personal)  # FedAlt's own v


def test_personal_state_keys_are_validated():
    assert Config.from_run_config({"personal-state": "run"}).personal_state == "run"
    with pytest.raises(ConfigError, match="personal-state"):
        Config.from_run_config({"personal-state": "forever"})
    with pytest.raises(ConfigError, match="experiment-name"):
        Config.from_run_config({"experiment-name": ""})


STATEFUL = {
    "fedalt": {},
    "ffgg": {"ffgg-init": "stored"},
    "pflego": {"model": "pflego-mlp", "local-steps": 2},
    "apfl": {"local-steps": 2},
    "ditto": {"local-steps": 2, "personal-steps": 2},
    "l2gd": {"local-steps": 2, "l2gd-p": 0.3, "lr": 0.01},
    "scaffold": {"local-steps": 2},
}


@pytest.mark.parametrize("algorithm", sorted(STATEFUL))
def test_every_algorithm_that_keeps_state_reports_personal_restored(algorithm):
    """Round 1: every client starts fresh (0); round 2: every client resumes its own (1)."""
    overrides = {
        **BASE,
        "algorithm": algorithm,
        "num-server-rounds": 2,
        "fraction-train": 1.0,
        "evaluate-every": 2,
        "local-epochs": 1,
        "max-train-samples": 40,
        **STATEFUL[algorithm],
    }
    report = run_local(overrides, 3)
    trained = [r.train for r in report.rounds if r.train]
    assert [t["personal-restored"] for t in trained] == [0.0, 1.0]


@pytest.mark.parametrize("backend", ["directory", "context"])
def test_rounds_version_alike_in_both_stores_and_with_a_load_before_each_save(backend, tmp_path):
    """The round versioning of the first test in either store, and a message that loads its
    state before saving (what a client half does: the save then trusts what the load read,
    ContextStore moves the newest record to ``.prev`` as it is) ends with the same entries
    as one that only saves."""

    def raw_store(name):
        if backend == "directory":
            return DirectoryStore(tmp_path / name)
        return ContextStore(RecordDict())

    plain, loading = raw_store("plain"), raw_store("loading")
    steps = [("r1", 1, 1.0), ("r1", 2, 2.0), ("r1", 2, 2.5), ("r1", 3, 3.0), ("r2", 1, 4.0)]
    for run, server_round, value in steps:
        _store(plain, run=run, server_round=server_round).save("personal", {"w": W["w"] + value})
        message = _store(loading, run=run, server_round=server_round)
        message.load("personal")
        message.save("personal", {"w": W["w"] + value})
        message.save("personal", {"w": W["w"] + value})  # twice: the second replaces
    for raw in (plain, loading):
        entries = stored_entries(raw, "personal")
        assert [(e.slot, e.run, e.round, float(e.tensors["w"][0])) for e in entries] == [
            ("personal", "r2", 1, 4.0),
            ("personal.prev", "r1", 3, 3.0),
        ]
    # a repeat of run r2's round 1 starts from what run r1 left (the previous version)
    assert _store(loading, run="r2", server_round=1).load("personal")["w"][0] == 3.0


def test_a_scoped_load_from_context_state_decodes_only_the_version_it_returns(monkeypatch):
    """context.state keeps two versions of a key; a load reads both metas but decodes the
    tensors of the one it returns only (issue 29: a whole-model state is 0.8 MB a version)."""
    import pflower.context_store as context_store

    raw = ContextStore(RecordDict())
    _store(raw, server_round=1).save("personal", {"w": torch.full((3,), 1.0)})
    _store(raw, server_round=2).save("personal", {"w": torch.full((3,), 2.0)})
    decoded = []
    real = context_store.to_torch
    monkeypatch.setattr(context_store, "to_torch", lambda r: decoded.append(r) or real(r))
    assert _store(raw, server_round=3).load("personal")["w"][0] == 2.0
    assert _store(raw, server_round=2).load("personal")["w"][0] == 1.0  # the .prev version
    assert len(decoded) == 2


@pytest.mark.parametrize("backend", ["directory", "context"])
def test_a_store_keeps_the_values_at_save_and_loads_tensors_the_caller_owns(backend, tmp_path):
    """The ``Store`` contract the client halves rely on (they save the model's own
    parameters, and step loaded state in place, without copies of their own): what a save
    was given can change afterwards, what a load returned can be written to, and neither
    reaches the stored entry. A parameter that is a view into a larger buffer is stored as
    itself (``DirectoryStore`` does not write the buffer)."""
    raw = DirectoryStore(tmp_path) if backend == "directory" else ContextStore(RecordDict())
    buffer = torch.arange(12.0)
    param = torch.nn.Parameter(buffer[4:7].view(3))  # a slice of a flat buffer, as some models
    weight = torch.nn.Parameter(torch.full((2, 2), 5.0))
    _store(raw).save("personal", {"v": param.detach(), "w": weight.detach()})
    with torch.no_grad():
        param.add_(100.0)
        weight.mul_(-1.0)
    loaded = _store(raw, server_round=2).load("personal")
    assert torch.equal(loaded["v"], torch.tensor([4.0, 5.0, 6.0]))
    assert torch.equal(loaded["w"], torch.full((2, 2), 5.0))
    loaded["v"].add_(1.0)  # the caller's own: stepping it in place changes nothing stored
    again = _store(raw, server_round=2).load("personal")
    assert torch.equal(again["v"], torch.tensor([4.0, 5.0, 6.0]))
    if backend == "directory":  # the file holds the 3 values, not the 12 of the buffer
        saved = torch.load(raw.path("personal"), weights_only=True)
        assert saved["v"].untyped_storage().nbytes() == 3 * 4
