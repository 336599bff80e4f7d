"""Experiment files (``pflower.experiment``): a bad file fails at load naming what is wrong,
a finished run is never run again, and one command leaves every run's outputs, the summary
table and the comparison plots."""

from __future__ import annotations

import csv
import json
import os

import pytest

from pflower import experiment
from pflower.experiment import ExperimentError, execute, finished, load, write_summary

TINY = """
[experiment]
nodes = 3
seeds = [0, 1]
workers = 2
baseline = "FedAvg"

[base]
dataset = "digits"
num-server-rounds = 2
pretrain-rounds = 0
evaluate-every = 1
fraction-train = 1.0
finetune-epochs = 1

[[run]]
name = "FedAvg"
algorithm = "fedavg"
split = "none"

[[run]]
name = "FedAlt"
algorithm = "fedalt"
grid = { split = ["head", "input"] }
"""


def write(tmp_path, text: str, name: str = "exp.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_file_expands_to_named_runs_with_their_configs(tmp_path):
    exp = load(write(tmp_path, TINY), out=tmp_path / "out")
    assert exp.labels == ["FedAvg", "FedAlt split=head", "FedAlt split=input"]
    assert len(exp.runs) == 6
    run = next(r for r in exp.runs if r.label == "FedAlt split=input" and r.seed == 1)
    assert run.config["split"] == "input" and run.config["seed"] == 1
    assert run.config["algorithm"] == "fedalt" and run.config["dataset"] == "digits"
    assert run.directory(exp.out) == tmp_path / "out" / "runs" / "FedAlt_split=input" / "seed-1"
    only = load(write(tmp_path, TINY), only=["FedAlt"], seeds=[3], overrides={"lr": 0.1})
    assert only.labels == ["FedAlt split=head", "FedAlt split=input"]
    assert {r.seed for r in only.runs} == {3} and all(r.config["lr"] == 0.1 for r in only.runs)


@pytest.mark.parametrize(
    "edit, named",
    [
        # a run-config key: the run, the key and the rule, from pflower.config
        (
            ('[[run]]\nname = "FedAvg"', '[[run]]\nname = "FedAvg"\nlrr = 0.1'),
            ["'FedAvg'", "'lrr'", "unknown key"],
        ),
        (
            ("finetune-epochs = 1", 'finetune-epochs = 1\npartitioner = "pathologic"'),
            ["'partitioner'", "'pathologic'", "'pathological'"],
        ),
        (
            ('grid = { split = ["head", "input"] }', 'grid = { split = ["head", "inptu"] }'),
            ["'FedAlt split=inptu'", "'split'", "'inptu'"],
        ),
        # the experiment's own keys and tables
        (("nodes = 3", "nodes = 3\nworkerz = 2"), ["'workerz'", "allowed", "workers"]),
        (("nodes = 3", "nodes = 0"), ["'nodes'", ">= 1"]),
        (("nodes = 3", "nodes = 3\nthreads = 0"), ["'threads'", ">= 1"]),
        (("seeds = [0, 1]", "seeds = []"), ["'seeds'", "non-empty"]),
        (("[base]", "[bsae]"), ["[bsae]", "[base]"]),
        (('baseline = "FedAvg"', 'baseline = "FedAvgg"'), ["'baseline'", "'FedAvgg'"]),
        (("finetune-epochs = 1", "finetune-epochs = 1\nseed = 3"), ["'seed'", "seeds"]),
        (
            ('name = "FedAlt"\nalgorithm', 'name = "FedAlt"\nsplit = "head"\nalgorithm'),
            ["'FedAlt'", "'split'", "its own grid"],
        ),
        (  # a key both set by a run and varied by the shared grid
            ("finetune-epochs = 1", 'finetune-epochs = 1\n\n[grid]\nsplit = ["head", "input"]'),
            ["'FedAvg'", "'split'", "also in [grid]"],
        ),
        (
            (
                'name = "FedAlt"\nalgorithm = "fedalt"\ngrid = { split = ["head", "input"] }',
                'name = "FedAvg"\nalgorithm = "fedalt"\nsplit = "head"',
            ),
            ["'FedAvg'", "more than once"],
        ),
    ],
)
def test_a_bad_file_fails_at_load_naming_the_key(tmp_path, edit, named):
    old, new = edit
    assert old in TINY
    with pytest.raises(ExperimentError) as err:
        load(write(tmp_path, TINY.replace(old, new, 1)))
    for part in named:
        assert part in str(err.value), (part, str(err.value))


def test_the_command_refuses_a_bad_file_before_running_anything(tmp_path, capsys):
    path = write(tmp_path, TINY.replace("fraction-train = 1.0", "fraction-train = 1.5"))
    assert experiment.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'fraction-train'" in err and "1.5" in err
    assert not (tmp_path / "out").exists()


def _mark(run, exp) -> int:
    return (run.directory(exp.out) / "run.json").stat().st_mtime_ns


def test_runs_resume_and_summarize(tmp_path):
    """One execute runs everything (two worker processes) and writes the summary; a second
    runs nothing; a changed key or a lost run.json reruns exactly those runs."""
    path = write(tmp_path, TINY)
    exp = load(path, out=tmp_path / "out")
    rows = execute(exp, progress=False)
    assert len(rows) == 6 and all(finished(r, exp) for r in exp.runs)
    marks = {(r.label, r.seed): _mark(r, exp) for r in exp.runs}

    text = write_summary(exp, rows)
    for name in ("summary.csv", "table.md", "curves.png", "clients.png"):
        assert (exp.out / name).stat().st_size > 0, name
    lines = [line for line in text.splitlines() if line.startswith("| FedA")]
    assert [line.split(" | ")[0] for line in lines] == [
        "| FedAvg",
        "| FedAlt split=head",
        "| FedAlt split=input",
    ]
    with open(exp.out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6
    fedavg = [r for r in table if r["label"] == "FedAvg"]
    # FedAvg's own personalized model is its global one: it hurts no client against itself
    assert all(r["hurt-vs-baseline"] == "0" for r in fedavg)
    assert all(float(r["train-bytes-down-per-round"]) > 0 for r in table)
    # the head split leaves the head at home: fewer bytes each way than the whole model
    head = next(r for r in table if r["label"] == "FedAlt split=head")
    assert float(head["train-bytes-up-per-round"]) < float(fedavg[0]["train-bytes-up-per-round"])

    again = execute(load(path, out=tmp_path / "out"), progress=False)
    assert len(again) == 6
    assert marks == {(r.label, r.seed): _mark(r, exp) for r in exp.runs}

    lost = next(r for r in exp.runs if r.label == "FedAvg" and r.seed == 1)
    (lost.directory(exp.out) / "run.json").unlink()
    changed = load(path, out=tmp_path / "out", overrides={"lr": 0.02}, only=["FedAlt"])
    assert not any(finished(r, changed) for r in changed.runs)  # lr changed: not the same run
    exp = load(path, out=tmp_path / "out")
    assert [r for r in exp.runs if not finished(r, exp)] == [lost]
    execute(exp, progress=False)
    rerun = {(r.label, r.seed) for r in exp.runs if _mark(r, exp) != marks[r.label, r.seed]}
    assert rerun == {(lost.label, lost.seed)}


def test_a_run_writes_its_report_files(tmp_path):
    """One run's outputs: the plots, results.json with bytes on the wire, config.json with
    the seed and what produced the run, the console log of the worker."""
    exp = load(write(tmp_path, TINY), out=tmp_path / "out", only=["FedAlt split=head"], seeds=[0])
    (run,) = exp.runs
    (row,) = execute(exp, progress=False)
    out = run.directory(exp.out)
    for name in ("accuracy.png", "clients.png", "labels.png", "clients.csv", "log.txt"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    first = results["rounds"][0]
    assert first["wire"]["train-down"] > 0 and first["wire"]["train-up"] > 0
    assert first["wire"]["evaluate-down"] > 0 and first["wire"].get("evaluate-up", 0) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["seed"] == 0 and config["run-config"]["split"] == "head"
    produced = config["produced-by"]
    assert {"pflower", "flwr", "torch", "python", "git-commit", "machine"} <= set(produced)
    log = (out / "log.txt").read_text()
    assert "round 2/2 |" in log  # the compact round line went to the run's log, not the bar
    assert "Aggregated MetricRecord" not in log  # Flower's raw dicts are left out
    assert row["seconds-per-round"] > 0 and row["cpu-seconds"] > 0
    # one torch thread per run unless asked (runs go side by side)
    with open(os.path.join(row["path"], "run.json")) as f:
        assert json.load(f)["torch-threads"] == 1
    assert os.path.basename(row["path"]) == "seed-0"


ATTACKED = """
[experiment]
nodes = 5
seeds = [0]
workers = 1
pivot = ["attack"]
pivot-metric = "honest-accuracy"
columns = ["honest-accuracy"]

[attacks.nan-40]
fraction = 0.4
node-config = { byzantine = "nan" }

[base]
dataset = "digits"
algorithm = "fedavg"
split = "none"
num-server-rounds = 2
evaluate-every = 2
fraction-train = 1.0

[[run]]
name = "FedAvg"
grid = { attack = ["none", "nan-40"] }

[[run]]
name = "FedAvg held out"
holdout-fraction = 0.4
"""


def test_attacks_pivot_and_held_out_clients(tmp_path):
    """An [attacks] table makes partitions 0 .. f-1 Byzantine (their NaN replies are dropped
    and counted); honest-accuracy pools the other clients' test examples, recomputed here
    from clients.csv; the pivot table has one column per attack; a run with held-out
    clients reports the trained and the new ones apart; a changed attack reruns the run."""
    path = write(tmp_path, ATTACKED)
    exp = load(path, out=tmp_path / "out")
    assert exp.labels == ["FedAvg attack=none", "FedAvg attack=nan-40", "FedAvg held out"]
    assert "attack" not in experiment.run_config(exp.runs[1], exp)  # not a run-config key
    rows = {r["label"]: r for r in execute(exp, progress=False)}
    clean, attacked = rows["FedAvg attack=none"], rows["FedAvg attack=nan-40"]
    assert clean["dropped-replies"] == 0 and attacked["dropped-replies"] == 2 * 2

    def pooled(row, keep):
        with open(os.path.join(row["path"], "clients.csv")) as f:
            clients = [c for c in csv.DictReader(f) if keep(int(float(c["partition-id"])))]
        n = sum(float(c["num-test"]) for c in clients)
        return sum(float(c["personal-accuracy"]) * float(c["num-test"]) for c in clients) / n

    assert attacked["honest-accuracy"] == pytest.approx(pooled(attacked, lambda p: p >= 2))
    assert clean["honest-accuracy"] == pytest.approx(clean["personal-accuracy"])
    held = rows["FedAvg held out"]
    assert held["personal-accuracy-new"] == pytest.approx(pooled(held, lambda p: p >= 3))
    assert held["personal-accuracy-trained"] == pytest.approx(pooled(held, lambda p: p < 3))

    text = write_summary(exp, list(rows.values()))
    pivot = text[text.index("honest-accuracy % by attack") :].splitlines()
    assert pivot[2] == "| run | none | nan-40 | – |"
    cells = pivot[4].split(" | ")
    assert pivot[4].startswith("| FedAvg |") and pivot[4].endswith("| – |")
    # the table prints two decimals
    assert float(cells[2].split(" ± ")[0]) == pytest.approx(
        100 * attacked["honest-accuracy"], abs=0.005
    )

    edited = ATTACKED.replace('byzantine = "nan"', 'byzantine = "inf"')
    again = load(write(tmp_path, edited), out=tmp_path / "out")
    assert [r.label for r in again.runs if not finished(r, again)] == ["FedAvg attack=nan-40"]
    bad = ATTACKED.replace('byzantine = "nan"', 'byzantine = "nann"')
    with pytest.raises(ExperimentError, match=r"\[attacks.nan-40\].*'nann'"):
        load(write(tmp_path, bad))
    with pytest.raises(ExperimentError, match=r"'attack' = 'nan-4'.*allowed"):
        load(write(tmp_path, ATTACKED.replace('"none", "nan-40"', '"none", "nan-4"')))


def test_a_grid_value_that_is_a_table_sets_keys_that_go_together(tmp_path):
    text = TINY.replace(
        'grid = { split = ["head", "input"] }',
        "grid = { data = [{ lr = 0.1, local-epochs = 2 }, { lr = 0.2, local-epochs = 1 }] }",
    )
    exp = load(write(tmp_path, text), out=tmp_path / "out")
    assert exp.labels == ["FedAvg", "FedAlt lr=0.1 local-epochs=2", "FedAlt lr=0.2 local-epochs=1"]
    run = next(r for r in exp.runs if r.label == "FedAlt lr=0.2 local-epochs=1")
    assert run.config["lr"] == 0.2 and run.config["local-epochs"] == 1 and "data" not in run.config
    with pytest.raises(ExperimentError, match="'seed': not here"):
        load(write(tmp_path, text.replace("{ lr = 0.1,", "{ seed = 1, lr = 0.1,")))
    with pytest.raises(ExperimentError, match="'lr': set and also by a grid value"):
        load(write(tmp_path, text.replace('algorithm = "fedalt"', 'algorithm = "fedalt"\nlr = 1')))


COMPUTE = """
[experiment]
nodes = 3
seeds = [0]
workers = 2

[base]
dataset = "digits"
num-server-rounds = 2
evaluate-every = 2
fraction-train = 1.0
finetune-epochs = 1

[[run]]
name = "FedAvg"
algorithm = "fedavg"
split = "none"

[[run]]
name = "FedAlt"
algorithm = "fedalt"
split = "head"
pretrain-rounds = 1
num-server-rounds = 1

[[run]]
name = "PFLEGO"
algorithm = "pflego"
split = "head"
"""


def test_the_table_shows_each_methods_client_compute(tmp_path):
    """Client compute next to bytes on the wire: the examples each method's clients took
    through the model over the run, pre-training included, per client; recomputed here from
    each client's training-set size and what the method does in a round (every client
    trains every round): FedAvg one epoch a round; FedAlt one pre-training epoch, then an
    epoch on v and one on u; PFLEGO a feature pass and the exact gradient's pass a round."""
    exp = load(write(tmp_path, COMPUTE), out=tmp_path / "out")
    rows = {r["label"]: r for r in execute(exp, progress=False)}
    passes = {"FedAvg": 1 + 1, "FedAlt": 1 + 2, "PFLEGO": 2 + 2}  # over the run's 2 rounds
    for label, row in rows.items():
        with open(os.path.join(row["path"], "clients.csv")) as f:
            total = sum(float(c["num-train"]) for c in csv.DictReader(f))
        results = json.loads((exp.out / "runs" / label / "seed-0" / "results.json").read_text())
        per_round = [r["train"]["examples-processed"] for r in results["rounds"]]
        assert len(per_round) == 2 and sum(per_round) == pytest.approx(passes[label] * total)
        assert row["examples-processed"] == pytest.approx(passes[label] * total), label
        assert row["examples-per-client"] == pytest.approx(passes[label] * total / 3), label

    text = write_summary(exp, list(rows.values()))
    head = next(line for line in text.splitlines() if line.startswith("| run |"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    at = columns.index("examples / client")
    assert columns[at + 1] == "MB down / round"  # next to the bytes on the wire
    for label, row in rows.items():
        line = next(x for x in text.splitlines() if x.startswith(f"| {label} |"))
        cell = [c.strip() for c in line.strip("|").split("|")][at]
        assert cell == f"{row['examples-per-client']:.0f} ± 0", (label, cell)
    with open(exp.out / "summary.csv") as f:
        assert "examples-per-client" in next(csv.reader(f))


def test_plateau_delta_is_the_last_fifth_of_the_run():
    """The plateau rule's number, by hand: 10 rounds, evaluated every 2nd; the window starts
    at round 8, so the delta is round 10's accuracy minus round 8's."""
    from pflower.experiment.rows import plateau_of
    from pflower.experiment.tables import _plateau_mark

    accuracy = {2: 0.5, 4: 0.6, 6: 0.7, 8: 0.8, 10: 0.85}
    rounds = [
        {"round": n, "evaluate": {"personal-accuracy": accuracy[n]} if n in accuracy else {}}
        for n in range(1, 11)
    ]
    assert plateau_of(rounds)["plateau-delta"] == pytest.approx(0.85 - 0.8)
    rounds[7]["evaluate"] = {}  # no evaluation at round 8: the latest before it, round 6
    assert plateau_of(rounds)["plateau-delta"] == pytest.approx(0.85 - 0.7)
    only_last = [{"round": n, "evaluate": {}} for n in range(1, 10)]
    only_last.append({"round": 10, "evaluate": {"personal-accuracy": 0.9}})
    assert plateau_of(only_last)["plateau-delta"] is None  # nothing to compare with
    assert _plateau_mark([0.004, 0.003, 0.006]) == " ✓"  # 0.43 points
    assert _plateau_mark([0.004, 0.003, 0.009]) == " ↑"  # 0.53 points, rising
    assert _plateau_mark([-0.004, -0.003, -0.009]) == " ↓"  # falling: past its best
    assert _plateau_mark([None]) == ""
