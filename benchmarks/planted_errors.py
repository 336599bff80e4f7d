"""Plant one error at a time into an update rule and check that a test fails.

Each entry below changes one coefficient, sign, order, weight or state rule of one
algorithm (in a copy of the repository: the working tree is never touched), runs that
algorithm's tests there and records which tests failed. An entry that no test catches is a
hole in the suite. Writes a Markdown table (and JSON) under ``benchmarks/results/``.

    python benchmarks/planted_errors.py               # every entry, ~10 min on 2 cores
    python benchmarks/planted_errors.py --only apfl   # entries whose name starts with apfl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
S = "pflower/strategies/"
T = "tests/"
EXACT = [f"{T}test_exact_rounds.py", f"{T}test_bring_your_own.py"]
PRIVACY = f"{T}test_privacy.py::"
DEFENCE = f"{T}test_default_defence.py"
HISTORY = f"{T}test_node_history.py"
LOCKOUT = f"{T}test_lockout.py"
#: issue 46 items 1, 2, 8: decisions local to the reply, the sensitivity end to end, the sample
DPR = f"{T}test_dp_release.py::"
SENSITIVITY = DPR + "test_one_clients_replies_move_each_rounds_pre_noise_sum_by_at_most_the_clip"
#: the claim and evaluation tests of issue 45 (the files' other tests take ~10 minutes)
B, C = f"{T}test_bounds.py::", f"{T}test_bad_clients.py::"
CLAIMS = [
    B + "test_claims_are_capped_against_a_pool_that_liars_cannot_move_out_of_the_honest_range",
    B + "test_max_num_examples_is_an_absolute_cap_and_start_up_claims_are_first_claims",
    B + "test_a_liars_claim_in_a_two_node_federation_is_capped_and_the_honest_node_kept",
    B + "test_low_claims_do_not_seed_the_update_norm_reference",
    C + "test_a_lie_about_num_examples_is_capped_never_dropped",
    C + "test_start_up_answers_that_are_no_counts_are_ignored_and_a_lie_is_bounded",
]
#: issue 50: the warm SuperExec's supervision, the resumed run
WARM, RESUME = f"{T}test_warm_exec.py::", f"{T}test_checkpoint.py::"
UP = f"{T}test_deploy_kit.py::test_up_starts_every_dead_process_again_with_the_command_it_was_"
UP += "started_with"
EVALUATION = [
    C + "test_a_low_evaluation_claim_in_a_two_node_federation_moves_accuracy_by_its_share",
    C + "test_a_high_evaluation_claim_moves_the_pooled_accuracy_by_its_bounded_share",
    C + "test_a_loss_below_zero_is_dropped_and_a_huge_one_counts_at_most_c_times_an_honest_one",
    C + "test_a_client_cannot_write_megabytes_or_infinity_into_the_results",
]


@dataclass
class Plant:
    name: str
    path: str
    edits: list[tuple[str, str]]  # (exact old text, new text), each old text unique
    tests: list[str]

    def apply(self, text: str) -> tuple[str, str | None]:
        """``text`` with the edits made, and None; or, where an old text does not occur
        exactly once (the code moved on: the entry must be rewritten), why not."""
        for old, new in self.edits:
            if text.count(old) != 1:
                return text, f"{old!r} occurs {text.count(old)} times in {self.path}"
            text = text.replace(old, new)
        return text, None


PLANTS = [
    # --- figures from files (issue 63) ------------------------------------------------------
    Plant(
        "figures: a README figure changed in the prose alone (not its results file's)",
        "README.md",
        [("`pflower run .` gave 96.90 / 33.43", "`pflower run .` gave 96.80 / 33.43")],
        [f"{T}test_figures.py"],
    ),
    # --- shared votes: copies of one vector count as one reply (issue 60) ------------------
    Plant(
        "shared votes: every reply votes 1 (copies outvote the honest replies)",
        S + "combine.py",
        [("        votes = 1.0 / same\n", "        votes = np.ones(n)\n")],
        [DEFENCE],
    ),
    Plant(
        "shared votes: a round with copies left to FFGG's geometric median",
        S + "combine.py",
        [("                or clip.last_shared\n", "")],
        [DEFENCE],
    ),
    Plant(
        "shared votes: the copies' weights not split in the mean",
        S + "combine.py",
        [("w_hat = w_hat * votes / float((w_hat * votes).sum())", "w_hat = w_hat")],
        [DEFENCE],
    ),
    Plant(
        "shared votes: the centre's geometric median unweighted by the votes",
        S + "combine.py",
        [
            (
                "gamma = space.geometric_median(gamma, weights=votes)",
                "gamma = space.geometric_median(gamma)",
            )
        ],
        [DEFENCE],
    ),
    Plant(
        "shared votes: the radius the lower median of the replies, not of the votes",
        S + "combine.py",
        [
            (
                "tau = self.factor * lower_median_of(d, votes)\n        self.rho",
                "tau = self.factor * lower_median_of(d)\n        self.rho",
            )
        ],
        [DEFENCE],
    ),
    # --- node history: a node's clipping record weighs its say (issue 60) ------------------
    Plant(
        "node history: every node trusted whatever its standing",
        S + "combine.py",
        [
            (
                "out[i] = min(1.0, float(np.median(record)) / TRUST_LEVEL)",
                "out[i] = 1.0",
            )
        ],
        [HISTORY],
    ),
    Plant(
        "node history: the standing's mean instead of its median",
        S + "combine.py",
        [("float(np.median(record)) / TRUST_LEVEL", "float(np.mean(record)) / TRUST_LEVEL")],
        [HISTORY],
    ),
    Plant(
        "node history: every record remembered, not one entry a round",
        S + "combine.py",
        [("    if main:  # one entry per round", "    if True:  # one entry per round")],
        [HISTORY],
    ),
    Plant(
        "node history: the whole record kept, not the last 8",
        S + "combine.py",
        [("            del record[:-STANDING_ROUNDS]\n", "")],
        [HISTORY],
    ),
    Plant(
        "node history: a new node's record not padded",
        S + "combine.py",
        [("                record = record + [1.0] * (MIN_STANDING - len(record))\n", "")],
        [HISTORY],
    ),
    Plant(
        "node history: the trust left out of the algorithm's mean",
        S + "combine.py",
        [
            (
                "if self.last_shared or self.last_distrusted or self.last_far:",
                "if self.last_shared or self.last_far:",
            )
        ],
        [HISTORY],
    ),
    Plant(
        "node history: a round of distrusted nodes passes unclipped when nothing is far",
        S + "combine.py",
        [
            (
                "if not self.last_shared and not self.last_distrusted and (d <= tau",
                "if not self.last_shared and (d <= tau",
            )
        ],
        [HISTORY],
    ),
    Plant(
        "node history: a round with a distrusted node left to FFGG's geometric median",
        S + "combine.py",
        [("(rnd.trust < RULE_DISTRUST).any())", "(rnd.trust < 0).any())")],
        [HISTORY],
    ),
    Plant(
        "node history: a far-off reply weighs in its round's mean",
        S + "combine.py",
        [("if self.history and far.any() and", "if False and")],
        [HISTORY],
    ),
    Plant(
        "node history: an established node's far-off reply cut too (no probation)",
        S + "combine.py",
        [("far = (reach < FAR_OFF) & self.on_probation(nodes, n)", "far = reach < FAR_OFF")],
        [HISTORY],
    ),
    Plant(
        "node history: the standing records the clip with the claim's share, not the reach",
        S + "combine.py",
        [("        self.last_c = reach\n", "        self.last_c = c\n")],
        [HISTORY],
    ),
    # --- no lockout: a round whose replies show the model was taken (issue 60) -------------
    Plant(
        "lockout: a taken round is never judged (its attackers' replies applied)",
        "pflower/strategies/settle.py",
        [("        if not self.enabled or size <= kept:", "        if True:")],
        [LOCKOUT],
    ),
    Plant(
        "lockout: a taken round's kept replies applied all the same",
        "pflower/strategies/server.py",
        [('            updates, metrics["applied"] = [], 0', '            metrics["applied"] = 0')],
        [LOCKOUT],
    ),
    Plant(
        "lockout: a taken round keeps the taken theta instead of going back",
        "pflower/strategies/settle.py",
        [("            rnd.taken = back\n", "            rnd.taken = (rnd.number, sent)\n")],
        [LOCKOUT],
    ),
    # --- the default defence (issue 45) -------------------------------------------------
    Plant(
        "default defence: FFGG's rule (geometric median) taken under DP too",
        "pflower/strategies/pipeline.py",
        [
            (
                "rules = RUN_DEFAULTS.resolved(defaults) if privacy.on else app",
                "rules = app",
            ),
        ],
        [DEFENCE],
    ),
    Plant(
        "default defence: robust-aggregator = none gives FFGG its default rule",
        "pflower/strategies/__init__.py",
        [
            (
                '"robust": robust_aggregator(cfg) or False,',
                '"robust": robust_aggregator(cfg),',
            ),
        ],
        [f"{T}test_bring_your_own.py"],
    ),
    Plant(
        "default defence: a rule the run names takes FFGG's small-round clip",
        "pflower/settings.py",
        [
            (
                'if defence and self.dp == "none" and self.robust_aggregator == "auto":',
                'if defence and self.dp == "none":',
            )
        ],
        [f"{T}test_attacks.py", DEFENCE],
    ),
    Plant(
        "default defence: FFGG's rule runs in rounds of 3-4 replies (7.53 points at 4)",
        "pflower/strategies/combine.py",
        [
            (
                "self.rule.inputs(len(vectors)) < MIN_RULE_INPUTS",
                "self.rule.inputs(len(vectors)) < 3",
            ),
        ],
        [DEFENCE],
    ),
    Plant(
        "default defence: bucketing counts its inputs, not its buckets",
        S + "aggregators.py",
        [("return self.base.inputs(self.buckets(n))", "return n")],
        [DEFENCE],
    ),
    Plant(
        "default defence: buckets keep their size below min_buckets bucket means",
        S + "aggregators.py",
        [("if buckets >= self.min_buckets and self.base.max_byzantine(buckets) >= f:", "if True:")],
        [DEFENCE, f"{T}test_aggregators.py"],
    ),
    Plant(
        "default defence: buckets kept where their means no longer tolerate f",
        S + "aggregators.py",
        [
            (
                "if buckets >= self.min_buckets and self.base.max_byzantine(buckets) >= f:",
                "if buckets >= self.min_buckets:",
            )
        ],
        [DEFENCE, f"{T}test_aggregators.py"],
    ),
    Plant(
        "default defence: a checkpoint's bucket size of 0 refused against 1",
        "pflower/checkpoint.py",
        [('if key == "robust-bucket-size" and value in (0, 1):', "if False:")],
        [f"{T}test_checkpoint.py"],
    ),
    Plant(
        "default defence: the clip beside a rule leaves its buckets at full size",
        S + "combine.py",
        [
            (
                'min_buckets = MIN_RULE_INPUTS if cfg.robust_small_rounds == "clip" else 1',
                "min_buckets = 1",
            )
        ],
        [DEFENCE],
    ),
    Plant(
        "default defence: FFGG's geometric median without buckets (clean mnist-5c -0.78)",
        S + "ffgg.py",
        [
            (
                '    "robust_bucket_size": 2,\n    "robust_small_rounds": "clip",',
                '    "robust_small_rounds": "clip",',
            )
        ],
        [DEFENCE, f"{T}test_attacks.py"],
    ),
    Plant(
        "default defence: FFGG's small rounds left to the rule (robust-small-rounds ignored)",
        S + "ffgg.py",
        [('    "robust_small_rounds": "clip",\n', "")],
        [DEFENCE],
    ),
    Plant(
        "default defence: FFGG takes BR-FFGG's bucketed median (honest clients lost 4.70)",
        S + "ffgg.py",
        [
            (
                'FFGG_DEFENCE = {\n    "robust_aggregator": "geometric-median",',
                "FFGG_DEFENCE = {\n    **BR_FFGG_DEFAULTS,",
            )
        ],
        [DEFENCE, f"{T}test_attacks.py"],
    ),
    Plant(
        "default defence: BR-FFGG built by hand inherits FFGG's small-round clipping",
        S + "ffgg.py",
        [("    defence = {}\n", "")],
        [f"{T}test_strategy_defaults.py"],
    ),
    Plant(
        "robust rules: L2GD's mean of the x_m around the rule",
        "pflower/strategies/l2gd.py",
        [
            (
                "if not self.pipeline.combine.exact_mean:",
                "if not self.pipeline.combine.exact_mean and self.robust is None:",
            ),
        ],
        [DEFENCE],
    ),
    Plant(
        "default defence: a large claim's reply clipped to tau, not tau x w_m / w_i",
        S + "combine.py",
        [
            (
                "c = np.minimum(1.0, tau * share / np.maximum(d, 1e-300))",
                "c = np.minimum(1.0, tau / np.maximum(d, 1e-300))",
            )
        ],
        [DEFENCE],
    ),
    Plant(
        "default defence: before a round of 3, small rounds unclipped (RunFailed at 1 a round)",
        S + "combine.py",
        [("if nodes is None or population < MIN_SPREAD_REPLIES:", "if True:")],
        [DEFENCE],
    ),
    Plant(
        "default defence: the first reply of a small-round federation applied unclipped",
        S + "combine.py",
        [("clip.threshold(node, norm, 0.0)", 'clip.threshold(node, norm, float("inf"))')],
        [DEFENCE],
    ),
    Plant(
        "default defence: a 2-node federation clipped as if it could outvote one node",
        S + "combine.py",
        [("population < MIN_SPREAD_REPLIES:", "population < 0:")],
        [DEFENCE],
    ),
    Plant(
        "default defence: the fast path accepts replies up to 2 tau from the mean",
        S + "combine.py",
        [("and (d <= tau * share).all():", "and (d <= 2 * tau * share).all():")],
        [DEFENCE],
    ),
    Plant(
        "default defence: 1- and 2-reply rounds clipped to 100 rho, not growth x rho",
        S + "combine.py",
        [
            (
                "return np.full(len(norms), self.growth * rho)",
                "return np.full(len(norms), 100 * rho)",
            )
        ],
        [DEFENCE],
    ),
    Plant(
        "default defence: pre-training rounds not clipped (the plain mean)",
        "pflower/strategies/server.py",
        [
            (
                "if self.pipeline.combine.exact_mean:",
                "if self.pipeline.combine.exact_mean or (self.clipping is not None and "
                "self.robust is None):",
            ),
        ],
        [DEFENCE],
    ),
    Plant(
        "robust rules: f lowered by the nodes without a kept reply (a failure lets one in)",
        "pflower/strategies/combine.py",
        [
            (
                "        if not self.rule.problem(len(vectors), self.byzantine):\n"
                "            return robust_combine(self.rule, vectors, self.byzantine, center)\n",
                "        f = max(0, self.byzantine - max(0, len(rnd.asked) - len(vectors)))\n"
                "        if not self.rule.problem(len(vectors), f):\n"
                "            return robust_combine(self.rule, vectors, f, center)\n",
            ),
        ],
        [DEFENCE],
    ),
    Plant(
        "robust rules: a round the rule cannot take is the plain mean, not the clip",
        "pflower/strategies/combine.py",
        [
            (
                "        rnd.fell_back += 1\n        if step is None:",
                "        rnd.fell_back += 1\n        return mean(vectors, weights, center)\n"
                "        if step is None:",
            ),
        ],
        [
            DEFENCE,
            B + "test_a_round_that_cannot_tolerate_f_falls_back_to_the_clip_not_a_weaker_rule",
        ],  # fmt: skip
    ),
    Plant(
        "replies: a node's second reply in a round kept",
        "pflower/strategies/admit.py",
        [
            (
                "elif node in seen:",
                "elif node in seen and False:",
            ),
        ],
        [DEFENCE],
    ),
    Plant(
        "local DP: the bound is max(K R, allowance), not the allowance",
        "pflower/strategies/bound.py",
        [
            (
                "bound = self.local_dp.reply_norm_allowance(size, eps, sent)",
                "bound = max(limit.bound(norms, weights, provisional_scale(current, factor)), "
                "self.local_dp.reply_norm_allowance(size, eps, sent))",
            ),
        ],
        [DEFENCE],
    ),
    # --- APFL ---------------------------------------------------------------------------
    Plant(
        "apfl: v step without the alpha factor",
        S + "apfl.py",
        [
            (
                "t.add_(g, alpha=-eta)",
                "t.add_(g / a.detach().clamp_min(1e-3), alpha=-eta)",
            )
        ],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: v_bar mixed the other way round ((1 - alpha) v + alpha w)",
        S + "apfl.py",
        [("return torch.lerp(w, v, alpha)", "return torch.lerp(v, w, alpha)")],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: v trained on a device copy, not brought back (a GPU's v never learns)",
        S + "apfl.py",
        [
            (
                "                if v[n] is not given[n]:\n"
                "                    given[n].copy_(v[n])\n",
                "                pass\n",
            )
        ],
        [T + "test_apfl.py"],
    ),
    Plant(
        "apfl: alpha step with a factor 2",
        S + "apfl.py",
        [("a -= eta * grads[-1]", "a -= 2 * eta * grads[-1]")],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: alpha step with the wrong sign",
        S + "apfl.py",
        [("a -= eta * grads[-1]", "a += eta * grads[-1]")],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: w updated before v_bar is formed (order inside a step)",
        S + "apfl.py",
        [
            (
                "            loss_bar = self._mixed_loss(job, v, a, w_bar, x, y)\n",
                "            if train_w:\n"
                "                with torch.no_grad():\n"
                "                    for p, g in zip(params.values(), g_w):\n"
                "                        p.add_(g, alpha=-eta)\n"
                "            loss_bar = self._mixed_loss(job, v, a, w_bar, x, y)\n",
            ),
            (
                "                        p.add_(g, alpha=-eta)\n                for t",
                "                        pass\n                for t",
            ),
        ],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: v_bar mixes the moving w_i under apfl-mix-with = global (issue 47's collapse)",
        S + "apfl.py",
        [("w_bar = received if mix_received else w_now", "w_bar = w_now")],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: the evaluation's v alone (local-part) is the personalized mixture",
        S + "apfl.py",
        [
            (
                "alone = training.evaluate(_Mixture(job.model, v), job.test_loader, job.device)",
                "alone = pers",
            )
        ],
        [T + "test_apfl.py"],
    ),
    Plant(
        "apfl: the alpha summary's min is the mean (a collapse to 0 would not show)",
        "pflower/strategies/history.py",
        [('for stat in ("mean", "min", "max"):', 'for stat in ("mean", "mean", "max"):')],
        [T + "test_wire.py"],
    ),
    Plant(
        "apfl: step size decays with the local step only (not the global t)",
        S + "apfl.py",
        [("cfg.apfl_lr_decay ** (first_step + k)", "cfg.apfl_lr_decay**k")],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "apfl: server mean weighted by data size (paper: unweighted)",
        S + "apfl.py",
        [("weighted=self.weighted)", "weighted=True)")],
        [T + "test_exact_rounds.py", T + "test_apfl.py"],
    ),
    # --- PFLEGO -------------------------------------------------------------------------
    Plant(
        "pflego: pflego-freeze-body ignored (the body trains: no random-features baseline)",
        S + "pflego.py",
        [("        if self.freeze_body:", "        if False:")],
        [T + "test_pflego.py"],
    ),
    Plant(
        "pflego: a client without a stored head evaluated with the unfitted init",
        S + "pflego.py",
        [
            (
                "        if not job.restore_personal():\n            self.new_client(job)\n",
                "        self.restore_head(job)\n",
            )
        ],
        [T + "test_pflego.py"],
    ),
    Plant(
        "pflego: head step size doubled",
        S + "pflego.py",
        [("rate = float(config[HEAD_LR])", "rate = 2 * float(config[HEAD_LR])")],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: no I/r in the head step",
        S + "pflego.py",
        [("self.server_optimizer.lr * self.num_nodes / r", "self.server_optimizer.lr")],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: no I/r_t in the server step",
        S + "pflego.py",
        [
            ("scale = self.num_nodes / len(updates)", "scale = 1.0"),
            ("mass = self.num_nodes / len(updates) * sum(sizes)", "mass = sum(sizes)"),
        ],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: global alpha normalised over the sampled clients",
        "pflower/strategies/pflego.py",
        [
            (
                ("            total = self.num_train_total or float(sum(sizes))\n            mass"),
                ("            total = float(sum(sizes))\n            mass"),
            ),
            (
                (
                    "            total = self.num_train_total or float(sum(sizes))\n"
                    "            scale"
                ),
                ("            total = float(sum(sizes))\n            scale"),
            ),
        ],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: sampled alpha unweighted",
        S + "pflego.py",
        [
            (
                'if self.alpha == "sampled":\n'
                "            gradient = self.combine([u.tensors for u in updates], sizes)",
                'if self.alpha == "sampled":\n'
                "            gradient = self.combine("
                "[u.tensors for u in updates], [1.0] * len(sizes))",
            )
        ],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: g_theta taken after the head step (3)",
        S + "pflego.py",
        [
            (
                "        job.save_personal()\n        record = to_record(",
                "        g_theta = training.full_gradient(job.model, shared, job.train_loader, "
                "job.device)\n        job.save_personal()\n        record = to_record(",
            )
        ],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: eq. (5)'s alpha_i ignored when pflego-head-alpha is on",
        S + "pflego.py",
        [
            (
                "rate *= job.num_train / float(config.get(TOTAL_EXAMPLES, job.num_train))",
                "rate *= 1.0",
            )
        ],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: head gradient summed instead of averaged",
        S + "pflego.py",
        [("alpha=-lr / n)", "alpha=-lr)")],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    Plant(
        "pflego: head steps at lr instead of personal-lr (beta)",
        S + "pflego.py",
        [("head.bias, job.personal_lr, steps)", "head.bias, job.lr, steps)")],
        [T + "test_exact_pflego.py", T + "test_pflego.py"],
    ),
    # --- FedAlt / FedSim ----------------------------------------------------------------
    Plant(
        "fedalt: server mean unweighted",
        S + "fedalt.py",
        [("weighted=self.weighted)", "weighted=False)")],
        [T + "test_exact_rounds.py", T + "test_fedalt.py"],
    ),
    Plant(
        "fedalt: u phase before the v phase",
        S + "fedalt.py",
        [
            (
                "        personal = job.sgd(\n            job.personal_params(),",
                "        shared = job.sgd(job.shared_params(), lr=job.lr)\n"
                "        personal = job.sgd(\n            job.personal_params(),",
            ),
            (
                "        )\n        shared = job.sgd(job.shared_params(), lr=job.lr)\n",
                "        )\n",
            ),
        ],
        [T + "test_exact_rounds.py", T + "test_fedalt.py"],
    ),
    Plant(
        "fedsim: personal part stepped at lr, not personal-lr",
        S + "fedalt.py",
        [
            (
                '{"params": job.personal_params(), "lr": job.personal_lr}',
                '{"params": job.personal_params(), "lr": lr}',
            )
        ],
        [T + "test_exact_rounds.py", T + "test_fedalt.py"],
    ),
    Plant(
        "fedalt: stateful clients restart v from the init every round",
        S + "fedalt.py",
        [
            (
                "        if job.cfg.stateful:\n            job.restore_personal()\n        else:\n",
                "        if job.cfg.stateful:\n            self.new_client(job)\n        else:\n",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_fedalt.py", T + "test_isolation.py"],
    ),
    # --- FFGG ---------------------------------------------------------------------------
    Plant(
        "ffgg: weighting options swapped",
        S + "ffgg.py",
        [
            (
                "weights = [u.num_examples if self.weighted else 1.0 for u in updates]",
                "weights = [1.0 if self.weighted else u.num_examples for u in updates]",
            )
        ],
        [T + "test_bring_your_own.py", T + "test_exact_rounds.py", T + "test_ffgg.py"],
    ),
    Plant(
        "ffgg: w not re-drawn each round (stateless by default)",
        S + "ffgg.py",
        [
            (
                "message's seed\n            reset_personal(job)\n",
                "message's seed\n            pass\n",
            )
        ],
        [T + "test_isolation.py", T + "test_ffgg.py"],
    ),
    Plant(
        "ffgg: gradient of the summed loss instead of the mean",
        "pflower/task/train.py",
        [
            (
                "return float(total) / max(1, n), [g / max(1, n) for g in grads]",
                "return float(total) / max(1, n), grads",
            )
        ],
        [T + "test_bring_your_own.py", T + "test_linear.py", T + "test_ffgg.py"],
    ),
    Plant(
        "ffgg: conjugate-gradient step length halved",
        "pflower/task/train.py",
        [("            alpha = rs / curvature", "            alpha = 0.5 * rs / curvature")],
        [T + "test_bring_your_own.py", T + "test_linear.py", T + "test_ffgg.py"],
    ),
    Plant(
        "local-ffgg: theta step at the old w (order of the pair)",
        "pflower/task/train.py",
        [
            (
                "for params, lr in ((first, lr_first), (second, lr_second))",
                "for params, lr in ((second, lr_second), (first, lr_first))",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_ffgg.py"],
    ),
    Plant(
        "local-ffgg: delta with the wrong sign",
        S + "ffgg.py",
        [
            (
                "delta = {n: start[n] - end[n] for n in job.split.shared}",
                "delta = {n: end[n] - start[n] for n in job.split.shared}",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_ffgg.py"],
    ),
    # --- baselines ----------------------------------------------------------------------
    Plant(
        "fedavg / local-gd: mean of returned weights unweighted",
        S + "server.py",
        [
            (
                "weights = [u.num_examples if weighted else 1.0 for u in updates]",
                "weights = [1.0 for u in updates]",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_wire.py"],
    ),
    # --- the papers' baselines: FedProx, Ditto, FedBABU -------------------------------------
    Plant(
        "fedprox: the anchor moves with the iterate (no pull toward w^t)",
        S + "fedprox.py",
        [("received = [p.detach().clone() for p in params]", "received = params")],
        [T + "test_exact_rounds.py"],
    ),
    Plant(
        "fedprox: the proximal gradient's sign flipped (mu (w^t - w))",
        "pflower/task/train.py",
        [("p.grad.add_(p.detach() - a, alpha=mu)", "p.grad.add_(a - p.detach(), alpha=mu)")],
        [T + "test_exact_rounds.py"],
    ),
    Plant(
        "fedprox: mu/2 taken as the weight (gradient mu/2 (w - w^t))",
        "pflower/task/train.py",
        [("p.grad.add_(p.detach() - a, alpha=mu)", "p.grad.add_(p.detach() - a, alpha=mu / 2)")],
        [T + "test_exact_rounds.py"],
    ),
    Plant(
        "ditto: the regulariser pulls toward the locally updated w_k, not the received w^t",
        S + "ditto.py",
        [
            (
                "        self.restore_v(job, received)\n",
                "        received = {n: p.detach().clone() for n, p in job.params.items()}\n"
                "        self.restore_v(job, received)\n",
            )
        ],
        [T + "test_exact_rounds.py"],
    ),
    Plant(
        "ditto: a new client's v starts from its locally updated w_k",
        S + "ditto.py",
        [("        self.restore_v(job, received)\n", "        self.restore_v(job)\n")],
        [T + "test_exact_rounds.py"],
    ),
    Plant(
        "ditto: the reply taken after the personal steps (v_k leaves the client)",
        S + "ditto.py",
        [
            ("        reply = job.shared_record()  #", "        #"),
            ("        return reply, {", "        return job.shared_record(), {"),
        ],
        [T + "test_exact_rounds.py", T + "test_papers_baselines.py"],
    ),
    Plant(
        "ditto: the personal model is not kept between rounds",
        S + "ditto.py",
        [("        job.store.save(V_KEY,", "        (lambda *a: None)(V_KEY,")],
        [T + "test_exact_rounds.py", T + "test_papers_baselines.py"],
    ),
    Plant(
        "fedbabu: the head trained with the body",
        S + "fedbabu.py",
        [
            (
                "        self.new_client(job)\n        result = job.sgd(job.shared_params(), "
                "lr=job.lr)\n        return job.shared_record()",
                "        self.new_client(job)\n        result = job.sgd("
                "list(job.model.parameters()), lr=job.lr)\n        return job.shared_record()",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_papers_baselines.py"],
    ),
    Plant(
        "fedbabu: the head drawn without orthogonal rows",
        S + "fedbabu.py",
        [
            (
                "torch.nn.init.orthogonal_(flat, generator=generator)",
                "flat.normal_(generator=generator)",
            )
        ],
        [T + "test_papers_baselines.py"],
    ),
    Plant(
        "fedbabu: pre-training trains the head",
        S + "fedbabu.py",
        [
            (
                "        result = job.sgd(job.shared_params(), lr=job.lr)\n"
                "        return job.record_of(",
                "        result = job.sgd(list(job.model.parameters()), lr=job.lr)\n"
                "        return job.record_of(",
            )
        ],
        [T + "test_papers_baselines.py"],
    ),
    Plant(
        "fedbabu: fine-tuning takes the head only whatever fedbabu-finetune says",
        S + "fedbabu.py",
        [('if job.cfg.fedbabu_finetune == "head":', "if True:")],
        [T + "test_papers_baselines.py"],
    ),
    Plant(
        "scaffold: |S|/N factor dropped from the c update",
        S + "scaffold.py",
        [("share = kept / max(self.num_nodes, kept)", "share = 1.0")],
        [T + "test_exact_rounds.py", T + "test_baselines_linear.py"],
    ),
    Plant(
        "scaffold: option II without 1/(K eta)",
        S + "scaffold.py",
        [("scale = 1.0 / (result.steps * lr)", "scale = 1.0 / lr")],
        [T + "test_exact_rounds.py", T + "test_baselines_linear.py"],
    ),
    Plant(
        "scaffold: correction c_i - c instead of c - c_i",
        S + "scaffold.py",
        [
            (
                "correction=[ci_g - ci for ci_g, ci in zip(c, c_i)]",
                "correction=[ci - ci_g for ci_g, ci in zip(c, c_i)]",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_baselines_linear.py"],
    ),
    Plant(
        "l2gd: a averaging steps mixed as a * beta",
        S + "l2gd.py",
        [("MIX: 1.0 - (1.0 - beta) ** a", "MIX: min(1.0, a * beta)")],
        [T + "test_exact_rounds.py", T + "test_baselines_linear.py"],
    ),
    Plant(
        "l2gd: local step alpha / M without 1/(1 - p)",
        S + "l2gd.py",
        [("LR: alpha / (m * (1 - self.p))", "LR: alpha / m")],
        [T + "test_exact_rounds.py", T + "test_baselines_linear.py"],
    ),
    # --- robust rules -------------------------------------------------------------------
    Plant(
        "krum: n - f - 1 neighbours",
        S + "aggregators.py",
        [("neighbours = X.shape[0] - f - 2", "neighbours = X.shape[0] - f - 1")],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "bucketing: base rule on the raw inputs (no buckets)",
        S + "aggregators.py",
        [
            (
                "return self.base.aggregate(means, min(f, means.shape[0]))",
                "return self.base.aggregate(X, min(f, means.shape[0]))",
            )
        ],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "trimmed mean: floor(beta N) trimmed",
        S + "aggregators.py",
        [("return math.ceil(self.beta * n)", "return math.floor(self.beta * n)")],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "median: lower middle value for even N",
        S + "aggregators.py",
        [("low, high = (n - 1) // 2, n // 2", "low, high = (n - 1) // 2, (n - 1) // 2")],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "geometric median: weights 1/d^2",
        S + "aggregators.py",
        [
            (
                "new = 1.0 / np.maximum(space.distances(w), self.eps)",
                "new = 1.0 / np.maximum(space.distances(w), self.eps) ** 2",
            )
        ],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "geometric median: the Gram matrix of differences from the first input (a huge one)",
        S + "aggregators.py",
        [("_difference_gram(X, _lower_median_norm_row(X))", "_difference_gram(X, 0)")],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "geometric median: Gram distances without the cross term's factor 2",
        S + "aggregators.py",
        [("np.diag(self.Y) - 2.0 * Yg + gamma @ Yg", "np.diag(self.Y) - Yg + gamma @ Yg")],
        [T + "test_exact_robust.py", T + "test_aggregators.py", DEFENCE],
    ),
    Plant(
        "centered clipping: no running centre across calls",
        S + "aggregators.py",
        [("        self.center = v\n", "        self.center = None\n")],
        [T + "test_exact_robust.py", T + "test_aggregators.py"],
    ),
    Plant(
        "alie: mu + z sigma",
        "pflower/testbed/attacks.py",
        [("return honest.mean(dim=0) - z * std", "return honest.mean(dim=0) + z * std")],
        [T + "test_attacks.py"],
    ),
    Plant(
        "apfl: outputs mixing without the (1 - alpha) factor on w's logits",
        S + "apfl.py",
        [
            (
                "criterion(_mix(alpha, out_v, out_w), y)",
                "criterion(alpha * out_v + out_w, y)",
            )
        ],
        [T + "test_exact_apfl.py", T + "test_apfl.py"],
    ),
    Plant(
        "ipm: +epsilon mu",
        "pflower/testbed/attacks.py",
        [("return -epsilon * honest.mean(dim=0)", "return epsilon * honest.mean(dim=0)")],
        [T + "test_attacks.py"],
    ),
    # --- the strongest known attacks and the backdoor (issue 60) -------------------------
    Plant(
        "min-sum: bounded by the largest pairwise distance (Min-Max's limit)",
        "pflower/testbed/attacks.py",
        [
            (
                'limit = pairwise.max() if objective == "min-max" else pairwise.sum(dim=1).max()',
                "limit = pairwise.max()",
            )
        ],
        [T + "test_attacks.py"],
    ),
    Plant(
        "min-max: mu + gamma p (towards the honest spread's far side)",
        "pflower/testbed/attacks.py",
        [("return (mu - good * p).to(honest.dtype)", "return (mu + good * p).to(honest.dtype)")],
        [T + "test_attacks.py"],
    ),
    Plant(
        "step bound: a bounded round recorded at its unbounded norm (attackers raise H)",
        S + "combine.py",
        [("                size, bounded = limit, True\n", "                bounded = True\n")],
        [T + "test_step_bound.py"],
    ),
    Plant(
        "step bound: c x the largest applied norm, not the median",
        S + "combine.py",
        [
            (
                "limit = self.factor * float(np.median(history))",
                "limit = self.factor * float(np.max(history))",
            )
        ],
        [T + "test_step_bound.py"],
    ),
    Plant(
        "step bound: FFGG's default defence without it (Min-Sum at 2 of 10 lost 10.4)",
        S + "ffgg.py",
        [('    "robust_step_bound": 2.0,\n', "")],
        [T + "test_step_bound.py"],
    ),
    Plant(
        "step bound: a rule given by hand takes FFGG's default bound",
        S + "pipeline.py",
        [("        own = given is not None\n", "        own = False\n")],
        [T + "test_step_bound.py"],
    ),
    Plant(
        "backdoor: the probe never sees an evaluation",
        "pflower/testbed/backdoor.py",
        [("training.evaluate = _probed_evaluate\n", "_ = _probed_evaluate\n")],
        [T + "test_backdoor.py"],
    ),
    Plant(
        "backdoor: the poisoned examples keep their labels",
        "pflower/testbed/backdoor.py",
        [("    y[chosen] = target\n", "    y[chosen] = y[chosen]\n")],
        [T + "test_backdoor.py"],
    ),
    Plant(
        "backdoor: the probe counts the target class's own examples as successes",
        "pflower/testbed/backdoor.py",
        [("    other = y.long() != target\n", "    other = y.long() >= 0\n")],
        [T + "test_backdoor.py"],
    ),
    Plant(
        "backdoor: the trigger in the top-left corner on the probe's side",
        "pflower/testbed/backdoor.py",
        [
            (
                "    return TensorDataset(stamp(x, input_shape, side, value), "
                "torch.full_like(y, target))",
                "    x = torch.flip(stamp(torch.flip(x.reshape(len(x), *input_shape), (-1, -2)), "
                "input_shape, side, value), (-1, -2)).reshape(x.shape)\n"
                "    return TensorDataset(x, torch.full_like(y, target))",
            )
        ],
        [T + "test_backdoor.py"],
    ),
    # --- claims and evaluation metrics (issue 45) ---------------------------------------
    Plant(
        "claims: the cap's pool is the round's claims only",
        "pflower/strategies/bound.py",
        [
            (
                "pool = {**self.claimed, **known}",
                "pool = {}",
            ),
        ],
        CLAIMS,
    ),
    Plant(
        "claims: the cap from the pool's upper median (a high liar raises it)",
        "pflower/strategies/bound.py",
        [
            (
                "return self.factor * lower_median(list(pool.values())) if pool else math.inf",
                "return self.factor * sorted(pool.values())[len(pool) // 2] if pool else math.inf",
            ),
        ],
        CLAIMS,
    ),
    Plant(
        "claims: a node weighs more than its first claim",
        "pflower/strategies/bound.py",
        [
            (
                "weight = min(claim, first, cap)",
                "weight = min(claim, cap)",
            ),
        ],
        CLAIMS,
    ),
    Plant(
        "claims: a claim above the cap drops the reply (before issue 45)",
        "pflower/strategies/bound.py",
        [
            (
                "u = replace(u, metrics={**u.metrics, NUM_EXAMPLES: weight})",
                "continue",
            ),
        ],
        CLAIMS,
    ),
    Plant(
        "claims: weighed before the norm bound, a capped reply dropped (issue 45's order)",
        "pflower/strategies/bound.py",
        [
            (
                (
                    "        if self.norm.factor and updates and not self.replies_alone:\n"
                    "            updates = self.norms(rnd, updates)\n"
                    "        return self.weigh_claims(rnd, updates) if self.weigh else updates\n"
                ),
                (
                    "        updates = self.weigh_claims(rnd, updates)\n"
                    "        if self.norm.factor and updates and not self.replies_alone:\n"
                    "            updates = self.norms(rnd, updates)\n"
                    "        return updates\n"
                ),
            ),
            (
                "u = replace(u, metrics={**u.metrics, NUM_EXAMPLES: weight})",
                "continue",
            ),
        ],
        CLAIMS,
    ),
    Plant(
        "claims: the mean weighs the claim, not the bounded weight",
        "pflower/strategies/bound.py",
        [
            (
                "u = replace(u, metrics={**u.metrics, NUM_EXAMPLES: weight})",
                "pass",
            ),
        ],
        CLAIMS,
    ),
    Plant(
        "claims: PFLEGO's sum_j N_j of the start-up claims as claimed",
        S + "pflego.py",
        [("sum(min(n, cap) for node, n in", "sum(n for node, n in")],
        CLAIMS,
    ),
    Plant(
        "evaluation: rows pooled by their claims, not the bounded weights",
        "pflower/strategies/bound.py",
        [
            (
                "metrics = {**metrics, NUM_EXAMPLES: weight}",
                "metrics = metrics",
            ),
        ],
        EVALUATION,
    ),
    Plant(
        "evaluation: losses pooled unclipped",
        S + "history.py",
        [("ceilings[key] = LOSS_CLIP * lower_median(values)", "ceilings[key] = math.inf")],
        EVALUATION,
    ),
    Plant(
        "evaluation: losses clipped at c x the round's largest (a liar raises it)",
        S + "history.py",
        [
            (
                "ceilings[key] = LOSS_CLIP * lower_median(values)",
                "ceilings[key] = LOSS_CLIP * max(values)",
            )
        ],
        EVALUATION,
    ),
    Plant(
        "evaluation: a loss below 0 accepted",
        "pflower/wire.py",
        [("if is_loss(key) and value < 0:", "if is_loss(key) and value < -1e300:")],
        EVALUATION,
    ),
    Plant(
        "async-ffgg: no fair share (every idle node drawn, however many updates it made)",
        S + "async_ffgg.py",
        [
            (
                "eligible = [n for n in idle if self.fair.eligible(n)]",
                "eligible = list(idle)",
            )
        ],
        [T + "test_async_fairness.py"],
    ),
    Plant(
        "async-ffgg: the fair share over every trainable node, not the live ones",
        S + "async_ffgg.py",
        [
            (
                "self.fair.earn(nodes, len(nodes) - len(down))",
                "self.fair.earn(nodes, len(nodes))",
            )
        ],
        [T + "test_async_fairness.py"],
    ),
    Plant(
        "async-ffgg: no clip (each gradient applied at the norm it was sent)",
        S + "async_ffgg.py",
        [
            (
                "clip = min(1.0, limit / norm) if norm > 0 else 1.0",
                "clip = 1.0",
            )
        ],
        [T + "test_async_fairness.py"],
    ),
    Plant(
        "async-ffgg and small rounds: the recent-norm clip at the pool's largest norm",
        "pflower/strategies/bound.py",
        [
            (
                "return self.factor * lower_median([*others, norm])",
                "return self.factor * max([*others, norm])",
            ),
        ],
        [T + "test_async_fairness.py", DEFENCE],
    ),
    Plant(
        "async-ffgg: failed replies counted one by one, not by distinct node",
        S + "async_ffgg.py",
        [("self._failing.add(node)", "self._failing.add((node, len(self._failing)))")],
        [T + "test_async_fairness.py"],
    ),
    Plant(
        "pseudo-gradient with the wrong sign (weights-returning strategies)",
        S + "combine.py",
        [
            (
                "np.subtract(c.astype(np.float64), out[k], out=out[k])",
                "np.subtract(out[k], c.astype(np.float64), out=out[k])",
            )
        ],
        [T + "test_exact_rounds.py", T + "test_wire.py"],
    ),
    # --- differential privacy (issue 46) ------------------------------------------------
    Plant(
        "privacy: a round that kept no reply leaves the parameters unchanged, not counted",
        "pflower/strategies/server.py",
        [
            (
                "if updates or (self.central_dp and back is None) else None",
                "if updates else None",
            ),
        ],
        [PRIVACY + "test_a_round_that_keeps_no_reply_is_released_with_noise_and_counted"],
    ),
    Plant(
        "privacy: q from the population of the first round (nodes left or joined)",
        "pflower/strategies/privacy.py",
        [
            (
                "self.check(nodes, population)",
                "self.check(nodes)",
            ),
        ],
        [PRIVACY + "test_the_server_accounts_each_round_with_the_nodes_it_sampled_from"],
    ),
    Plant(
        "privacy: the fixed-size sample accounted as a Poisson one",
        S + "privacy.py",
        [
            (
                "return events.SampledWithoutReplacementDpEvent(population, sample, gaussian)",
                "return events.PoissonSampledDpEvent(q, gaussian)",
            )
        ],
        [
            PRIVACY + "test_each_accountant_against_a_direct_computation",
            PRIVACY + "test_the_sweeps_calibration_is_what_the_docs_say",
        ],
    ),
    Plant(
        "privacy: Poisson add/remove accounted at z / 2 (replace-one's multiplier)",
        S + "privacy.py",
        [
            (
                "events.GaussianDpEvent(noise / 2 if sampling == FIXED else noise)",
                "events.GaussianDpEvent(noise / 2)",
            )
        ],
        [
            PRIVACY + "test_poisson_sampling_is_what_the_server_does",
            PRIVACY + "test_each_accountant_against_a_direct_computation",
        ],
    ),
    Plant(
        "privacy: the run's epsilon by RDP only (not the tighter accountant)",
        S + "privacy.py",
        [
            (
                "return min(epsilons(noise, ledger, delta, sampling, amplified).values())",
                "return epsilons(noise, ledger, delta, sampling, amplified)[RDP]",
            )
        ],
        [
            PRIVACY + "test_calibration_uses_the_tighter_accountant",
            PRIVACY + "test_poisson_sampling_is_what_the_server_does",
        ],
    ),
    Plant(
        "privacy: Poisson sampling draws a fixed-size sample",
        "pflower/strategies/nodes.py",
        [
            (
                "if train and self.poisson:",
                "if False:",
            ),
        ],
        [PRIVACY + "test_poisson_sampling_is_what_the_server_does"],
    ),
    Plant(
        "privacy: the Poisson mean divides by the clients drawn, not the expected size",
        S + "privacy.py",
        [
            (
                "m = max(sampled, len(vectors)) if self.sampling == FIXED else self.divisor",
                "m = max(sampled, len(vectors))",
            )
        ],
        [PRIVACY + "test_the_poisson_mean_divides_by_the_expected_size"],
    ),
    Plant(
        "privacy: adaptive clipping's count noise always Flower's m / 20",
        S + "privacy.py",
        [("return max(sample / 20, noise)", "return sample / 20")],
        [
            PRIVACY
            + "test_adaptive_clipping_with_a_large_noise_runs_with_the_count_noise_it_needs",
            PRIVACY + "test_adaptive_clipping_at_a_large_noise_completes_a_run",
        ],
    ),
    Plant(
        "privacy: the central mean's noise skipped",
        S + "privacy.py",
        [
            (
                "std = compute_stdv(noise, self.clip, m)\n        if std > 0:",
                "std = compute_stdv(noise, self.clip, m)\n        if False:",
            )
        ],
        [
            PRIVACY + "test_the_canary_estimate_stays_below_the_bound_and_catches_a_missing_noise",
            PRIVACY + "test_central_noise_has_the_stated_scale",
        ],
    ),
    Plant(
        "privacy: the canaries' null cosine std 1/d instead of 1/sqrt(d)",
        S + "privacy.py",
        [("(0.0, 1 / math.sqrt(dimension))", "(0.0, 1 / dimension)")],
        [PRIVACY + "test_the_canary_estimate_stays_below_the_bound_and_catches_a_missing_noise"],
    ),
    Plant(
        "privacy: the Gaussian pair's epsilon one way only",
        S + "privacy.py",
        [
            (
                "return max(gaussian_pair_delta(eps, p, q), gaussian_pair_delta(eps, q, p))"
                " > delta",
                "return gaussian_pair_delta(eps, p, q) > delta",
            )
        ],
        [PRIVACY + "test_the_gaussian_pair_epsilon_integrates_unequal_variances"],
    ),
    # --- central DP: one reply decides about itself alone (issue 46 items 1, 2, 8) -------
    Plant(
        "dp release: the update-norm bound decides under central DP",
        "pflower/strategies/bound.py",
        [
            (
                "if self.norm.factor and updates and not self.replies_alone:",
                "if self.norm.factor and updates:",
            ),
        ],
        [
            SENSITIVITY + "[fedavg]",
            SENSITIVITY + "[scaffold]",
            DPR + "test_under_central_dp_no_norm_reference_or_claim_median_decides_about_a_reply",
            DPR + "test_one_reply_cannot_get_others_dropped_by_moving_the_norm_reference",
        ],
    ),
    Plant(
        "dp release: the claim bound's median cap under central DP",
        "pflower/strategies/bound.py",
        [
            (
                "relative=not self.replies_alone",
                "relative=True",
            ),
        ],
        [DPR + "test_under_central_dp_no_norm_reference_or_claim_median_decides_about_a_reply"],
    ),
    Plant(
        "dp release: the central mean divides by the replies kept",
        S + "privacy.py",
        [
            (
                "m = max(sampled, len(vectors)) if self.sampling == FIXED else self.divisor",
                "m = len(vectors) if self.sampling == FIXED else self.divisor",
            )
        ],
        [SENSITIVITY + "[fedavg]", SENSITIVITY + "[ffgg]"],
    ),
    Plant(
        "dp release: PFLEGO's alpha-weighted sum under central DP",
        "pflower/strategies/pflego.py",
        [
            (
                "if not self.pipeline.combine.weighted:",
                "if not self.pipeline.combine.weighted and not self.central_dp:",
            ),
        ],
        [SENSITIVITY + "[pflego]", DPR + "test_the_server_step_takes_the_release_alone[pflego]"],
    ),
    Plant(
        "dp release: Scaffold's c moves by the replies kept, not the planned sample",
        S + "scaffold.py",
        [
            (
                "kept = self.privacy.divisor if self.central_dp else len(updates)",
                "kept = len(updates)",
            )
        ],
        [DPR + "test_scaffolds_control_moves_by_the_planned_sample_not_the_replies_kept"],
    ),
    Plant(
        "dp release: FFGG's split diagnostic (update norms) released under central DP",
        S + "ffgg.py",
        [
            (
                "        if self.central_dp:\n            norms = []",
                "        if False:\n            norms = []",
            )
        ],
        [
            SENSITIVITY + "[ffgg]",
            DPR + "test_under_central_dp_no_norm_reference_or_claim_median_decides_about_a_reply",
        ],
    ),
    Plant(
        "dp release: the clients' grad-norm averaged into the round's metrics under central DP",
        S + "server.py",
        [
            (
                "        if self.central_dp:\n            rows = [",
                "        if False:\n            rows = [",
            )
        ],
        [
            SENSITIVITY + "[ffgg]",
            DPR + "test_under_central_dp_no_norm_reference_or_claim_median_decides_about_a_reply",
        ],
    ),
    Plant(
        "dp release: the logs name the node of a dropped reply under dp",
        "pflower/strategies/server.py",
        [
            (
                "names_nodes=self.privacy is None,",
                "names_nodes=True,",
            ),
        ],
        [
            SENSITIVITY + "[fedavg]",
            DPR + "test_under_dp_the_sample_is_secret_and_no_output_or_message_reveals_it",
        ],
    ),
    Plant(
        "dp release: results.json keeps the secret sample's seed under dp",
        "pflower/report/results.py",
        [
            (
                'if self.sampling is None or self.cfg.dp == "none" or not',
                'if True or self.sampling is None or self.cfg.dp == "none" or not',
            )
        ],
        [DPR + "test_under_dp_the_sample_is_secret_and_no_output_or_message_reveals_it"],
    ),
    Plant(
        "dp release: a seeded sample accounted with amplification",
        "pflower/strategies/privacy.py",
        [
            (
                "self.start(population, len(nodes), rounds, amplified=secret, rate=rate)",
                "self.start(population, len(nodes), rounds, amplified=True, rate=rate)",
            ),
        ],
        [DPR + "test_under_dp_a_seeded_sample_is_accounted_without_amplification"],
    ),
    Plant(
        "dp release: the sample drawn from the run's public seed under dp",
        "pflower/strategies/__init__.py",
        [
            (
                '"sample_seed": cfg.sample_seed,',
                '"sample_seed": cfg.seed,',
            ),
        ],
        [DPR + "test_under_dp_the_sample_is_secret_and_no_output_or_message_reveals_it"],
    ),
    Plant(
        "dp release: local DP's allowance without the reply's own float rounding",
        S + "privacy.py",
        [("return allowance + eps * (sent_norm + allowance)", "return allowance")],
        [
            PRIVACY + "test_every_update_is_clipped_to_the_bound[ffgg-local]",
            PRIVACY + "test_every_update_is_clipped_to_the_bound[fedalt+pretrain-local]",
        ],
    ),
    # --- who is sampled (issue 45 items 6, 7) -------------------------------------------
    Plant(
        "sampling: sample-seed -1 draws from random.Random(-1), not a secret",
        S + "nodes.py",
        [("    if sample_seed < 0:\n        seed = ", "    if sample_seed < -1:\n        seed = ")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "sampling: the app samples from the public seed (sample_seed = cfg.seed)",
        "pflower/strategies/__init__.py",
        [
            (
                '"sample_seed": cfg.sample_seed,',
                '"sample_seed": cfg.seed,',
            ),
        ],
        [T + "test_sampling.py"],
    ),
    Plant(
        "sampling: the secret stream restarts from its seed after a checkpoint",
        S + "nodes.py",
        [("        self._counter, self.gauss_next = counter, gauss_next", "        pass")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "sampling: experiments leave sample-seed at the secret default",
        "pflower/experiment/grid.py",
        [("            config.setdefault(SAMPLE_SEED, seed)\n", "")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "handshake: a duplicate partition id refuses the later node only",
        S + "nodes.py",
        [("                for node in group:\n", "                for node in group[1:]:\n")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "handshake: num-partitions not compared",
        S + "nodes.py",
        [("        if partitions is not None:\n", "        if False:\n")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "handshake: the model fingerprint leaves out the classes' code",
        "pflower/task/fingerprint.py",
        [('        "classes": classes,\n', "")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "handshake: the model fingerprint leaves out the module repr",
        "pflower/task/fingerprint.py",
        [('        "repr": repr(model),\n', "")],
        [T + "test_sampling.py"],
    ),
    Plant(
        "handshake: an ignored data-path is not told apart",
        "pflower/task/fingerprint.py",
        [('    return f"{kind} (data-path ignored)" if data_path else kind', "    return kind")],
        [T + "test_sampling.py"],
    ),
    # --- the Flower boundary (issue 48) ---------------------------------------------------
    Plant(
        "flower boundary: a grid not recognised takes the fast path (no window, no deadline)",
        "pflower/strategies/exchange.py",
        [
            (
                "if window or engine in (grids.DEPLOYMENT, grids.OTHER):",
                "if window or engine in (grids.DEPLOYMENT,):",
            ),
        ],
        [T + "test_flower_boundary.py"],
    ),
    Plant(
        "flower boundary: a warm SuperExec task that fails exits without its traceback",
        "pflower/deploy/warm_exec.py",
        [("        traceback.print_exc()\n        return 1", "        return 1")],
        [T + "test_flower_boundary.py"],
    ),
    Plant(
        "flower boundary: the dispatcher fallback catches RuntimeError only",
        "pflower/flower/dispatch.py",
        [
            (
                "    except (AttributeError, KeyError, TypeError) as err:  # Flower's link",
                "    except RuntimeError as err:  # Flower's link",
            )
        ],
        [T + "test_flower_boundary.py"],
    ),
    Plant(
        "flower boundary: a hook the warm SuperExec wraps is not checked at its start",
        "pflower/flower/superexec.py",
        [
            (
                '    "push_task_output",\n    "get_all_nested_objects",\n)',
                '    "get_all_nested_objects",\n)',
            )
        ],
        [T + "test_flower_boundary.py"],
    ),
    Plant(
        "flower boundary: the kit waits for a word Flower does not say",
        "pflower/flower/texts.py",
        [('ACTIVATED = "SuperNode ID:"', 'ACTIVATED = "SuperNode id:"')],
        [T + "test_flower_boundary.py"],
    ),
    Plant(
        "flower boundary: a moved connection writer crashes the kit (not refused by name)",
        "pflower/flower/cli.py",
        [
            (
                "        connection = typing.SuperLinkConnection\n"
                "    except (ImportError, AttributeError) as err:",
                "        connection = typing.SuperLinkConnection\n"
                "    except AttributeError as err:",
            )
        ],
        [T + "test_flower_boundary.py"],
    ),
    # --- crashes: the warm SuperExec, down, resume (issue 50) -----------------------------
    Plant(
        "crashes: a zygote that died is not started again at the next task (broken pipe)",
        "pflower/deploy/warm_exec.py",
        [
            (
                "                self._restart(self.zygote_ended() or "
                '"no longer reading its tasks")\n                self.conn.send(task)',
                "                raise",
            )
        ],
        [WARM + "test_a_killed_zygote_is_started_again_and_runs_the_next_task"],
    ),
    Plant(
        "crashes: a zygote that died is not started again at the poll (reconcile)",
        "pflower/deploy/warm_exec.py",
        [
            (
                "            if how is not None:\n                self._restart(how)",
                "            pass",
            )
        ],
        [WARM + "test_a_killed_zygote_is_started_again_and_runs_the_next_task"],
    ),
    Plant(
        "crashes: a task's child killed by a signal is reaped in silence, never answered for",
        "pflower/deploy/warm_exec.py",
        [("        if not os.WIFSIGNALED(status):\n", "        if True:\n")],
        [WARM + "test_a_killed_task_is_said_answered_for_and_the_next_task_runs"],
    ),
    Plant(
        "crashes: a reply cut off mid-push is left to the SuperNode, which waits for it forever",
        "pflower/deploy/warm_exec.py",
        [
            (
                "    if reply is not None:\n        stored, lacking = flower.complete_push(",
                "    if reply is not None:\n        return ''\n        stored, lacking = "
                "flower.complete_push(",
            )
        ],
        [WARM + "test_a_reply_cut_off_mid_push_is_pushed_whole_by_the_zygote"],
    ),
    Plant(
        "crashes: a cut-off push finished without the objects the SuperNode still lacks",
        "pflower/flower/superexec.py",
        [
            (
                "        lacking = [object_id for object_id in to_push if object_id not in sent]",
                "        lacking = [object_id for object_id in to_push if object_id in sent]",
            )
        ],
        [WARM + "test_a_reply_cut_off_mid_push_is_pushed_whole_by_the_zygote"],
    ),
    Plant(
        "crashes: a child keeps its reply's objects under ids the SuperNode does not ask for",
        "pflower/flower/superexec.py",
        [('        "objects": {object_id: obj', '        "objects": {object_id[::-1]: obj')],
        [WARM + "test_a_task_child_notes_its_message_and_its_reply_push"],
    ),
    Plant(
        "crashes: down's SIGTERM to the process and to its group at once (a second SIGTERM)",
        "pflower/deploy/processes.py",
        [("    _wait_gone([pid], timeout)\n", "")],
        [
            f"{T}test_deploy_kit.py::test_stop_tree_lets_the_process_sign_off_before_its_children_stop"
        ],
    ),
    Plant(
        "crashes: resume-from read against the working directory, not where the outputs went",
        "pflower/server_app.py",
        [
            (
                "resume_from = str(report.resolve(cfg.resume_from, fab_hash))",
                "resume_from = cfg.resume_from",
            )
        ],
        [RESUME + "test_a_run_from_a_fab_resumes_from_a_relative_run_directory"],
    ),
    Plant(
        "crashes: a round's wire bytes stamped after its checkpoint is written",
        "pflower/server_app.py",
        [("        stamp(server_round)\n        result = ", "        result = ")],
        [RESUME + "test_killed_after_round_k_and_resumed_equals_the_uninterrupted_run"],
    ),
    Plant(
        "crashes: up starts a dead SuperLink or gateway with the command it would build now",
        "pflower/deploy/federation.py",
        [('                start(command=list(entry["command"]))\n', "                start()\n")],
        [UP],
    ),
    Plant(
        "crashes: up starts a dead SuperNode afresh (not warm as it was, not its config)",
        "pflower/deploy/federation.py",
        [("                recorded[i] = Recorded.of(self.entries, i)\n", "")],
        [UP],
    ),
    Plant(
        "crashes: up leaves a dead SuperNode's warm SuperExec running beside nothing",
        "pflower/deploy/federation.py",
        [
            (
                "                self.stop(label)  # its warm SuperExec",
                "                # its warm SuperExec",
            )
        ],
        [UP],
    ),
    # --- the first hour (issue 49) ------------------------------------------------------------
    Plant(
        "first hour: pflower run adds no federation where the user names none",
        "pflower/launch.py",
        [
            (
                "    if not (args.superlink or args.federation or args.federation_config):",
                "    if False:",
            )
        ],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: pflower run leaves Flower's environment as the shell has it",
        "pflower/launch.py",
        [
            (
                "    return with_own_bin({**FLOWER_ENV, **environ})",
                "    return with_own_bin(environ)",
            )
        ],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: a record inside a traceback ends it (its lines leak onto the console)",
        "pflower/launch.py",
        [
            (
                "            self.in_traceback = self.in_traceback and plain != body",
                "            self.in_traceback = False",
            )
        ],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: a user's own keys are checked as pflower's",
        "pflower/launch.py",
        [("        merged = {k: v for k, v in merged.items() if k in pflowers}", "        pass")],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: an algorithm the app's ServerApp does not serve is let through",
        "pflower/launch.py",
        [
            (
                "        if serves is not None and algorithm is not None and algorithm not in",
                "        if False and",
            )
        ],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: a reply lacking the personal part names no fix",
        "pflower/wire.py",
        [("    if lacking and set(got.items()) < set(expected.items()):", "    if False:")],
        [T + "test_library_page.py"],
    ),
    Plant(
        "first hour: the 'train loss –' note is said every round",
        "pflower/server_app.py",
        [
            (
                "            note = None if noted else report.loss_note(entry, strategy.algorithm)",
                "            note = report.loss_note(entry, strategy.algorithm)",
            )
        ],
        [T + "test_outputs.py"],
    ),
    Plant(
        "first hour: Flower's boxed SuperLink error is read line by line (never matches)",
        "pflower/launch.py",
        [("            if boxed:\n", "            if False:\n")],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: a SuperLink log without an error line is taken as it is (no probe)",
        "pflower/flower/cli.py",
        [("    if not errors:  # Flower 1.41 sends", "    if False:  # Flower 1.41 sends")],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: a default ~/.flwr another Flower wrote stops pflower run (no own home)",
        "pflower/launch.py",
        [
            (
                '        if args.superlink is None and "FLWR_HOME" not in os.environ:',
                "        if False:",
            )
        ],
        [T + "test_launch.py"],
    ),
    Plant(
        "first hour: labels.png's tallest bar touches the frame",
        "pflower/report/plots.py",
        [("        with_headroom(ax)\n", "")],
        [T + "test_outputs.py"],
    ),
]


def copy_tree(dst: Path) -> None:
    """Every file git tracks (the docs, the examples and the results files too: tests read
    them, and a test that cannot find its page fails whatever was planted, which counted as a
    catch while only the package, the tests and pyproject.toml were copied)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if not src.is_file():  # deleted in the working tree
            continue
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / name)


def run_plant(plant: Plant, work: Path, pytest_args: list[str]) -> dict:
    target = work / plant.path
    original = target.read_text()
    text, stale = plant.apply(original)
    if stale:
        return {"name": plant.name, "caught_by": [], "errors": [], "stale": stale, "seconds": 0.0}
    target.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--tb=no",
                "-rf",
                *pytest_args,
                *plant.tests,
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        target.write_text(original)
    failed = sorted(set(re.findall(r"^FAILED (\S+)", out.stdout, flags=re.M)))
    errors = re.findall(r"^ERROR (\S+)", out.stdout, flags=re.M)
    return {
        "name": plant.name,
        "caught_by": failed,
        "errors": errors,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the entries whose name starts with this")
    parser.add_argument(
        "--out",
        default=None,
        help="write <out>.md and <out>.json (default: benchmarks/results/planted_errors for "
        "every entry; with --only, the table is printed and nothing is written)",
    )
    parser.add_argument(
        "--progress",
        type=Path,
        default=None,
        help="a JSON-lines file each entry's result is appended to as it ends; entries "
        "already in it are not run again (a long run that stopped resumes where it was)",
    )
    parser.add_argument(
        "--pytest-args",
        default="",
        help="more pytest arguments for every entry, e.g. '-n 0' on a box whose other core "
        "is busy (the suite's addopts run two workers)",
    )
    args = parser.parse_args()
    if args.out is None and not args.only:  # a subset never overwrites the whole table
        args.out = str(ROOT / "benchmarks/results/planted_errors")
    plants = [p for p in PLANTS if p.name.startswith(args.only)]
    done: dict[str, dict] = {}
    if args.progress and args.progress.exists():
        for line in args.progress.read_text().splitlines():
            row = json.loads(line)
            if not row.get("stale"):  # a stale entry may have been rewritten since: run again
                done[row["name"]] = row
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        copy_tree(work)
        check = subprocess.run(
            [sys.executable, "-c", "import pflower; print(pflower.__file__)"],
            cwd=work,
            env={**os.environ, "PYTHONPATH": str(work)},
            capture_output=True,
            text=True,
        )
        assert check.stdout.strip().startswith(str(work)), check.stdout  # the copy is tested
        for i, plant in enumerate(plants, 1):
            if plant.name in done:
                rows.append(done[plant.name])
                continue
            row = run_plant(plant, work, args.pytest_args.split())
            rows.append(row)
            if args.progress:
                with args.progress.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
            mark = "STALE" if row.get("stale") else "caught" if row["caught_by"] else "MISSED"
            print(f"[{i}/{len(plants)}] {mark}: {plant.name} ({row['seconds']} s)", flush=True)
    lines = ["| # | planted error | caught by (failing tests) |", "|---|---|---|"]
    for i, row in enumerate(rows, 1):
        # one entry per test function: "file::function (k cases)"
        cases: dict[str, int] = {}
        for test in row["caught_by"]:
            name = test.removeprefix("tests/").split("[")[0]
            cases[name] = cases.get(name, 0) + 1
        shown = [f"`{n}`" + (f" ({k} cases)" if k > 1 else "") for n, k in cases.items()]
        cell = ", ".join(shown[:3]) + (f" +{len(shown) - 3} more" if len(shown) > 3 else "")
        name = row["name"].replace("|", "\\|")  # a pipe would end the cell
        if row.get("stale"):
            cell = f"**not applied**: {row['stale']}"
        lines.append(f"| {i} | {name} | {cell or '**none**'} |")
    missed = sum(not r["caught_by"] for r in rows)
    stale = sum(bool(r.get("stale")) for r in rows)
    lines.append("")
    lines.append(
        f"{len(rows) - missed} of {len(rows)} planted errors caught"
        + (f" ({stale} entries no longer apply to the code: rewrite them)." if stale else ".")
    )
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        out.with_suffix(".md").write_text(table + "\n")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
