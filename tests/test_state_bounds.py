"""Stored state that cannot poison its owner (issue 27, items 4 and 5, client side).

- ``load_matching`` refuses stored values beyond ``STATE_BOUND`` times the model's scale,
  with one warning line, for every algorithm's state keys; honest state, zero-initialised
  included, loads.
- ``personal-reset`` from the server: the round starts from the personal init, and what it
  saves is what the next round starts from.
- An unreadable newest state file: the client resumes from ``<key>.prev`` and says so.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from helpers import BASE, job_for, node_context

from pflower.client_app import build_client_app
from pflower.context_store import ContextStore, Scope, ScopedStore, open_store, scope_job
from pflower.strategies import measured
from pflower.strategies.apfl import ALPHA_KEY, V_KEY, APFLClient
from pflower.strategies.client import PERSONAL
from pflower.strategies.ditto import V_KEY as DITTO_V
from pflower.strategies.l2gd import LOCAL_MODEL, L2GDClient
from pflower.strategies.scaffold import CLIENT_CONTROL
from pflower.task.split import get_tensors
from pflower.task.state import STATE_BOUND, DirectoryStore, load_matching
from pflower.wire import PERSONAL_RESET, RUN_TAG

LOGGER = "flwr.pflower"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _whole_model(job):
    return get_tensors(job.model, [n for n, _ in job.model.named_parameters()])


def _zeros(job):
    return {n: torch.zeros_like(p) for n, p in zip(job.split.shared, job.shared_params())}


#: every algorithm's stored state key and the template its client half matches it against
KEYS = {
    "fedalt-personal": ({"algorithm": "fedalt"}, PERSONAL, lambda job: job.init_personal),
    "pflego-personal": (
        {"algorithm": "pflego", "model": "pflego-mlp"},
        PERSONAL,
        lambda job: job.init_personal,
    ),
    "apfl-v": ({"algorithm": "apfl"}, V_KEY, _whole_model),
    "ditto-v": ({"algorithm": "ditto"}, DITTO_V, _whole_model),
    "l2gd-local-model": ({"algorithm": "l2gd", "fraction-train": 1.0}, LOCAL_MODEL, _whole_model),
    "scaffold-control": ({"algorithm": "scaffold"}, CLIENT_CONTROL, _zeros),
}


@pytest.mark.parametrize("value", [1e30, 2 * STATE_BOUND, -2 * STATE_BOUND])
@pytest.mark.parametrize("which", sorted(KEYS))
def test_stored_values_far_beyond_the_model_scale_are_refused(which, value, caplog):
    """The reported failure: a finite 1e30 state was loaded, and its owner's replies were
    dropped every round after. Every key is refused with one line naming it."""
    overrides, key, template = KEYS[which]
    job = job_for(overrides)
    honest = {n: t.clone() for n, t in template(job).items()}
    stored = {n: torch.ones_like(t) for n, t in honest.items()}
    for t in stored.values():  # one coordinate each: a negative one hides below a max of 1
        t.view(-1)[0] = value
    job.store.save(key, stored)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert job.load(key, honest) is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and repr(key) in lines[0] and "beyond 1e+04" in lines[0], lines
    assert f"{abs(value):.3g}" in lines[0]
    assert job.restored is False


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, -1])
def test_one_non_finite_stored_value_is_refused(bad, where, caplog):
    """A single NaN or Inf anywhere in a stored tensor (first or last coordinate) is refused
    with one line, and the rest of an otherwise honest state does not hide it."""
    job = job_for({"algorithm": "apfl"})
    honest = _whole_model(job)
    tampered = {n: t.clone() for n, t in honest.items()}
    name = max(tampered, key=lambda n: tampered[n].numel())
    tampered[name].view(-1)[where] = bad
    job.store.save(V_KEY, tampered)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert job.load(V_KEY, honest) is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "NaN or Inf" in lines[0], lines


@pytest.mark.parametrize("which", sorted(KEYS))
def test_honest_state_inside_the_bound_loads(which, caplog):
    """The bound is max(1, template, shared parameters) x 1e4: an honest state, one that
    starts at zero (Scaffold's c_i) included, and one 1e3 times larger still load."""
    overrides, key, template = KEYS[which]
    job = job_for(overrides)
    honest = template(job)
    for value in (0.0, 1e-3, 1e3, 0.99 * STATE_BOUND):
        job.store.save(key, {n: torch.full_like(t, value) for n, t in honest.items()})
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            stored = job.load(key, honest)
        assert stored is not None, value
    assert not _warnings(caplog)


def test_the_bound_follows_the_scale_of_the_model():
    """A model whose parameters are large (a regression on raw targets) keeps a large
    state: the shared parameters just received set the scale."""
    job = job_for({"algorithm": "fedalt"})
    big = {n: torch.full_like(t, 5 * STATE_BOUND) for n, t in job.init_personal.items()}
    job.store.save(PERSONAL, big)
    assert job.load(PERSONAL, job.init_personal) is None
    with torch.no_grad():
        job.shared_params()[0].fill_(10.0)  # scale 10: bound 1e5
    assert job.load(PERSONAL, job.init_personal) is not None


def test_the_shared_scale_is_computed_only_for_a_state_beyond_the_templates_bound():
    """``load_matching`` asks for the scale (a pass over every shared parameter) only when
    the state is beyond STATE_BOUND x the template's own magnitude."""
    store = ContextStore(RecordDict())
    template = {"w": torch.ones(3)}
    asked = []

    def scale():
        asked.append(True)
        return 10.0

    store.save("k", {"w": torch.full((3,), 0.5 * STATE_BOUND)})
    assert load_matching(store, "k", template, scale=scale) is not None
    assert not asked
    store.save("k", {"w": torch.full((3,), 5 * STATE_BOUND)})  # within 10 x the bound
    assert load_matching(store, "k", template, scale=scale) is not None
    assert asked == [True]
    store.save("k", {"w": torch.full((3,), 50 * STATE_BOUND)})
    assert load_matching(store, "k", template, scale=scale) is None


def test_apfl_with_a_huge_v_starts_afresh():
    """APFL's two keys: a huge v alone is enough for a fresh start of both."""
    job = job_for({"algorithm": "apfl"})
    half = APFLClient()
    half.train(job, {"lr": 0.05, "apfl-round": 1})
    assert half._state(job) is not None  # what one honest round stores loads
    v = job.store.load(V_KEY)
    job.store.save(V_KEY, {n: torch.full_like(t, 1e30) for n, t in v.items()})
    assert half._state(job) is None
    assert job.store.load(ALPHA_KEY) is not None


def test_l2gd_with_a_huge_local_model_starts_from_the_average():
    """L2GD's first visit starts from x_bar; a refused x_m is a first visit."""
    job = job_for({"algorithm": "l2gd", "fraction-train": 1.0})
    x_bar = _whole_model(job)
    job.store.save(LOCAL_MODEL, {n: torch.full_like(t, 1e30) for n, t in x_bar.items()})
    assert L2GDClient()._local_model(job) is None


# --- personal-reset from the server ------------------------------------------------------

SCOPE = Scope("exp", "fedalt", "mlp", "digits", "0/4", "abc")


def _scoped(raw, server_round, reset=False):
    return ScopedStore(raw, SCOPE, run="r1", server_round=server_round, reset=reset)


def test_a_reset_round_loads_nothing_and_the_next_round_loads_what_it_saved():
    raw = ContextStore(RecordDict())
    _scoped(raw, 1).save(PERSONAL, {"w": torch.full((3,), 7.0)})
    _scoped(raw, 1).save("other", {"c": torch.full((2,), 7.0)})
    reset = _scoped(raw, 2, reset=True)
    assert reset.load(PERSONAL) is None and reset.load("other") is None
    assert _scoped(raw, 2).load(PERSONAL)["w"][0] == 7.0  # without the reset: loaded
    reset.save(PERSONAL, {"w": torch.full((3,), 1.0)})
    assert torch.equal(_scoped(raw, 3).load(PERSONAL)["w"], torch.ones(3))


def test_scope_job_reads_personal_reset_from_a_training_message_only(caplog):
    job = job_for({"algorithm": "fedalt"})
    config = {"server-round": 2, RUN_TAG: "r1"}
    scope_job(job, config, training=True)
    job.save_personal()
    job.store.save(PERSONAL, {n: t + 1.0 for n, t in job.init_personal.items()})
    scope_job(job, {**config, "server-round": 3}, training=True)
    assert job.store.load(PERSONAL) is not None
    with caplog.at_level(logging.INFO, logger=LOGGER):
        scope_job(job, {**config, "server-round": 3, PERSONAL_RESET: True}, training=True)
        assert job.store.load(PERSONAL) is None
        assert job.restore_personal() is False
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["personal-reset from the server: starting this round from the personal init"]
    scope_job(job, {**config, "server-round": 3, PERSONAL_RESET: True}, training=False)
    assert job.store.load(PERSONAL) is not None  # an evaluation never discards state


def _train_message(shared: ArrayRecord, server_round: int, reset: bool = False) -> Message:
    config = {"server-round": server_round, "lr": 0.1, "lr-scale": 1.0, "phase": "train"}
    config[RUN_TAG] = "the-run"
    if reset:
        config[PERSONAL_RESET] = True
    content = RecordDict({"arrays": shared, "config": ConfigRecord(config)})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def test_a_node_wedged_by_its_stored_head_recovers_after_a_personal_reset(task_identity, caplog):
    """FedAlt, a stored head 1e3 times its init (inside the load bound): its reply
    is huge round after round; after the server's personal-reset the node trains from the
    init, and the next round (no reset) continues from what the reset round saved."""
    overrides = {**BASE, "algorithm": "fedalt", "max-train-samples": 64}
    context = node_context()
    probe = job_for(overrides, state=context.state)
    scope = Scope.of(probe.cfg, 0, 4, probe.init_personal)
    raw = open_store(context.state, {})
    scale = max(float(t.abs().max()) for t in probe.init_personal.values())
    wedged = {n: 1e3 * t for n, t in probe.init_personal.items()}  # max 1e3 * scale
    ScopedStore(raw, scope, run="the-run", server_round=1).save(PERSONAL, wedged)
    shared = ArrayRecord(get_tensors(probe.model, probe.split.shared))
    before = {n: a.numpy() for n, a in shared.items()}
    app = build_client_app(overrides)

    def step(reply: Message) -> float:
        after = reply.content["arrays"]
        return float(np.sqrt(sum(((after[n].numpy() - before[n]) ** 2).sum() for n in before)))

    stuck = app(_train_message(shared, 2), context)
    assert stuck.content["metrics"]["personal-restored"] == 1.0
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reset = app(_train_message(shared, 2, reset=True), context)
    assert reset.content["metrics"]["personal-restored"] == 0.0
    assert "personal-reset from the server" in caplog.text
    assert step(stuck) > 10 * step(reset)  # the wedged head made the reply huge
    saved = ScopedStore(raw, scope, run="the-run", server_round=3).load(PERSONAL)
    assert all(saved[n].abs().max() < 10 * scale for n in saved)  # the init's, trained
    nxt = app(_train_message(shared, 3), context)
    assert nxt.content["metrics"]["personal-restored"] == 1.0  # continues the reset's state
    assert step(nxt) < 10 * step(reset)


# --- an unreadable newest file ------------------------------------------------------------


def test_an_unreadable_newest_file_resumes_from_prev_and_says_so(tmp_path, caplog):
    raw = DirectoryStore(tmp_path)
    _scoped(raw, 1).save(PERSONAL, {"w": torch.full((3,), 1.0)})
    _scoped(raw, 2).save(PERSONAL, {"w": torch.full((3,), 2.0)})
    (tmp_path / "personal.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        stored = _scoped(raw, 3).load(PERSONAL)
    assert torch.equal(stored["w"], torch.ones(3))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert f"'personal' in {tmp_path} is unreadable" in lines[0]
    assert "resumed from the previous version 'personal.prev' of round 1" in lines[0]
    assert "re-initialising" not in lines[0]


def test_unreadable_newest_and_no_previous_version_says_re_initialising(tmp_path, caplog):
    raw = DirectoryStore(tmp_path)
    (tmp_path / "personal.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _scoped(raw, 3).load(PERSONAL) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "re-initialising" in lines[0], lines


# --- measured: public, for a ClientApp of one's own ---------------------------------------


def test_measured_is_public_and_keeps_only_finite_numbers():
    assert measured({"a": 1.0, "b": float("nan"), "c": "text", "d": True, "n": 3}) == {
        "a": 1.0,
        "n": 3,
    }
