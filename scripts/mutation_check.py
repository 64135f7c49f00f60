"""A small mutation check of the semi-sync layer: does a plausible one-line bug fail a test?

    .venv/bin/python scripts/mutation_check.py            # every mutant (a few minutes)
    .venv/bin/python scripts/mutation_check.py -k divide  # the mutants whose name has "divide"

Each mutant below changes one line of ``torchtitan/experiments/fault_tolerance`` (or of a
core piece it relies on: fault tolerance, checkpoint checksums) the way a plausible bug would
(a sign, a missing division, a branch taken the wrong way). The script copies the repository's
files as they are in the working tree to a scratch folder, applies one mutant there, runs the
mutant's unit tests against that copy (the semi-sync ones unless it names others; ``-x``: the
first failure kills the mutant) and reports which mutants every test let through ("survived").
The working tree is never touched. Not part of CI: run it after changing the sync layer or its
tests. Exit status 1 when a mutant survives that is not listed in ``ACCEPTED`` with the reason
it may.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torchtitan/experiments/fault_tolerance"
#: The unit tests a mutant of the sync layer must fail.
TESTS = [
    "tests/unit_tests/test_semi_sync.py",
    "tests/unit_tests/test_sync_averaging.py",
    "tests/unit_tests/test_async_diloco.py",
    "tests/unit_tests/test_dylu_probe.py",
    "tests/unit_tests/test_transport.py",
    "tests/unit_tests/test_compression.py",
    "tests/unit_tests/test_outer_optimizer.py",
    "tests/unit_tests/test_lineage.py",
    "tests/unit_tests/test_peer_watch.py",
    "tests/unit_tests/test_replica_timeouts.py",
    "tests/unit_tests/test_ft_manager.py",
    "tests/unit_tests/test_outer_passes.py",
    "tests/unit_tests/test_exact_division.py",
    "tests/unit_tests/test_step_clock.py",
    "tests/unit_tests/test_torchft_oracle.py",
    "tests/unit_tests/test_engine_schedule.py",
]
#: Failure detection and the replicate group's timeouts live in the core's fault tolerance.
CORE_FT = "torchtitan/components/ft"
#: The checksums of every checkpoint (the semi-sync state's included), and their tests.
CHECKSUMS = "torchtitan/components/checksums.py"
CHECKPOINT_TESTS = ("tests/unit_tests/test_checkpoint.py",)
TIMEOUT_S = 600
#: The sparse codec's own tests, the all-gather's and the averaging property over gloo groups.
SPARSE_TESTS = (
    "tests/unit_tests/test_sparse_codec.py",
    "tests/unit_tests/test_compression.py",
    "tests/unit_tests/test_sync_averaging.py",
)

#: The arithmetic groups compare or apply alike, under every kernel set, and the outer
#: optimizers' own tests.
HOST_ARITHMETIC = (
    "tests/unit_tests/test_host_arithmetic.py",
    "tests/unit_tests/test_outer_optimizer.py",
)
#: Two real groups on different kernels (a few seconds each).
MIXED_HOSTS = (
    "tests/unit_tests/test_semi_sync.py",
    "tests/integration_tests/test_mixed_hosts.py::"
    "test_groups_on_different_cpu_kernels_start_from_one_model_and_agree_at_every_sync[diloco-1]",
    "tests/integration_tests/test_mixed_hosts.py::"
    "test_the_initial_model_comes_from_the_kernels_most_groups_run",
)

#: nccl's semantics (issue 63): the fake nccl group's tests and the replicate group's timeouts.
NCCL_TESTS = (
    "tests/unit_tests/test_nccl_semantics.py",
    "tests/unit_tests/test_replica_timeouts.py",
)

#: What a reviewer's mutants of this layer must fail: the unit tests, the arithmetic under
#: every kernel set and two real groups on different kernels.
FRESH_REVIEW_TESTS = (*TESTS, *HOST_ARITHMETIC, *MIXED_HOSTS[1:])


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    #: The unit tests it must fail.
    tests: tuple[str, ...] = tuple(TESTS)


#: The unit tests a mutant of sites of groups must fail.
SITE_TESTS = (
    "tests/unit_tests/test_site_link.py",
    "tests/unit_tests/test_job_config.py",
    "tests/unit_tests/test_ft_manager.py",
    "tests/unit_tests/test_async_diloco.py",
    "tests/unit_tests/test_ft_launcher.py",
)

MUTANTS = [
    Mutant(
        "sites: the highest-numbered live group leads instead of the lowest",
        f"{PACKAGE}/sync/site_link.py",
        "previous, self.leader = self.leader, min(members, key=tft.replica_number)",
        "previous, self.leader = self.leader, max(members, key=tft.replica_number)",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: followers take the leader's result over +0.0 (a -0.0 comes back +0.0)",
        f"{PACKAGE}/sync/site_link.py",
        "tensor.fill_(-0.0)  # x + -0.0 is x, bit for bit (also -0.0)",
        "tensor.fill_(0.0)  # x + -0.0 is x, bit for bit (also -0.0)",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: the header's sync number and quorum size travel swapped",
        f"{PACKAGE}/sync/site_link.py",
        "values = [float(self.committed), self.number, self.groups, self.bytes_sent, squares]",
        "values = [float(self.committed), self.groups, self.number, self.bytes_sent, squares]",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: a leader that healed from another site does not tell its site",
        f"{PACKAGE}/join/protocol.py",
        "site.share_quorum(self._peer_loaded)",
        "site.share_quorum(False)",
        tests=("tests/unit_tests/test_site_link.py", "tests/integration_tests/test_sites.py"),
    ),
    Mutant(
        "sites: a follower that missed the result settles as holding the site's state",
        f"{PACKAGE}/sync/quorum.py",
        "holds = not self.agree_in_group(int(not holds))",
        "holds = True",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: a group healed with fragment 0's sync in flight does not await it",
        f"{PACKAGE}/method_state.py",
        "if in_flight >= 0 or arrived:",
        "if in_flight > 0 or arrived:",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: async DiLoCo weighs a site by one group's tokens",
        f"{PACKAGE}/methods/async_diloco.py",
        "tokens = self.sync.site_tokens(steps * self.tokens_per_step)",
        "tokens = steps * self.tokens_per_step",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: a group's number in its site is its site's number",
        f"{PACKAGE}/job_config.py",
        "replica_id=ft.replica_id % ft.groups_per_site,",
        "replica_id=ft.replica_id // ft.groups_per_site,",
        tests=SITE_TESTS,
    ),
    Mutant(
        "sites: the launcher's SITE:G names group SITE of site G",
        f"{PACKAGE}/launch/launcher.py",
        "return int(site) * groups_per_site + int(group)",
        "return int(group) * groups_per_site + int(site)",
        tests=SITE_TESTS,
    ),
    Mutant(
        "ft: a Manager that steps down forgets its step",
        "torchtitan/components/ft/manager.py",
        "self._pending_step = {k: int(v) for k, v in self._manager.state_dict().items()}",
        "self._pending_step = None",
        tests=SITE_TESTS,
    ),
    Mutant(
        "engine: DiLoCo's pseudo-gradient has the wrong sign",
        f"{PACKAGE}/methods/periodic.py",
        "torch.sub(state.global_copy[name], local)",
        "torch.sub(local, state.global_copy[name])",
    ),
    Mutant(
        "engine: DiLoCo's pseudo-gradient is all-reduced in the model's own storage",
        f"{PACKAGE}/methods/periodic.py",
        "torch.sub(state.global_copy[name], local)",
        "torch.sub(state.global_copy[name], local, out=local)",
    ),
    Mutant(
        "engine: DiLoCo's outer step is taken after a failed sync too",
        f"{PACKAGE}/methods/periodic.py",
        "        if decision.committed:\n            self._keep(index, decision.delivered)\n",
        "        if True:\n            self._keep(index, decision.delivered)\n",
    ),
    Mutant(
        "engine: fragment_update_alpha mixes in the global copy's share",
        f"{PACKAGE}/methods/periodic.py",
        "local.lerp_(own[name], self.alpha)",
        "local.lerp_(own[name], 1 - self.alpha)",
    ),
    Mutant(
        "engine: Streaming DiLoCo syncs the first fragment at every sync point",
        f"{PACKAGE}/methods/global_copy.py",
        "return self.sync.current_step() % len(self.fragments)",
        "return 0",
    ),
    Mutant(
        "engine: fragment_sync_delay is ignored (the all-reduce starts at the sync point)",
        f"{PACKAGE}/methods/outer_loop.py",
        "self._local_step == self.steps_this_period() - self.delay",
        "self._local_step == self.steps_this_period()",
    ),
    Mutant(
        "engine: a group joining a delayed Streaming DiLoCo sync applies it at once",
        f"{PACKAGE}/methods/outer_loop.py",
        "if self.delay or self.applies_next:",
        "if self.applies_next:",
    ),
    Mutant(
        "engine: async DiLoCo's sync is applied at its own sync point",
        f"{PACKAGE}/methods/outer_loop.py",
        "        self.decide_sync()\n        self._local_step = 0\n        if self.applies_next:\n"
        "            self.start_sync(quorums)",
        "        if self.applies_next:\n            self.start_sync(quorums)\n"
        "        self.decide_sync()\n        self._local_step = 0",
    ),
    Mutant(
        "engine: LocalSGD's average replaces the model after a failed sync too",
        f"{PACKAGE}/methods/periodic.py",
        "        if self.take_verdict(0).committed:\n            for p, (mean, _)",
        "        if self.take_verdict(0).committed or True:\n            for p, (mean, _)",
    ),
    Mutant(
        "engine: a replayed average is read from the start for every tensor",
        f"{PACKAGE}/methods/outer_passes.py",
        "views[name] = flat[offset : offset + numel]",
        "views[name] = flat[:numel]",
        tests=(*TESTS, "tests/unit_tests/test_heal_history.py"),
    ),
    Mutant(
        "engine: a healing peer's outer momentum is not taken",
        f"{PACKAGE}/methods/global_copy.py",
        '        self.outer.load_state_dict(saved["outer_optimizer"])',
        "        pass",
    ),
    Mutant(
        "engine: the heal history's basis is the global copy after the outer step",
        f"{PACKAGE}/methods/periodic.py",
        "            self._keep(index, decision.delivered)\n"
        "            self.measure_outer_step(grads.values())\n"
        "            state.passes.step(grads)",
        "            state.passes.step(grads)\n"
        "            self._keep(index, decision.delivered)\n"
        "            self.measure_outer_step(grads.values())",
        tests=(*TESTS, "tests/unit_tests/test_heal_history.py"),
    ),
    Mutant(
        "engine: the heal history keeps every sync under fragment 0",
        f"{PACKAGE}/methods/global_copy.py",
        "HistoryEntry.of(number, index, delivered, basis, divisor)",
        "HistoryEntry.of(number, 0, delivered, basis, divisor)",
        tests=(*TESTS, "tests/unit_tests/test_heal_history.py"),
    ),
    Mutant(
        "engine: a sync loaded as arrived is kept as what this process's transfers delivered",
        f"{PACKAGE}/methods/async_diloco.py",
        "delivered = self.buffer[:-1] if self.loaded else decision.delivered",
        "delivered = decision.delivered",
        tests=(*TESTS, "tests/unit_tests/test_heal_history.py"),
    ),
    Mutant(
        "transport: an average is not divided by the number of groups",
        f"{PACKAGE}/transport/sync_transport.py",
        "divide_by = manager.num_participants() if average else 1",
        "divide_by = 1",
    ),
    Mutant(
        "transport: an average is divided by 2, whatever the number of groups",
        f"{PACKAGE}/transport/sync_transport.py",
        "divide_by = manager.num_participants() if average else 1",
        "divide_by = 2 if average else 1",
    ),
    Mutant(
        "transport: a healing group sends its own values instead of zeros",
        f"{PACKAGE}/transport/sync_transport.py",
        "tensor.zero_()  # a healing group sends nothing",
        "pass  # a healing group sends nothing",
    ),
    Mutant(
        "transport: an exact tensor travels compressed",
        f"{PACKAGE}/transport/sync_transport.py",
        "self._submit(tensor.view(-1), divide_by, exact=True)",
        "self._submit(tensor.view(-1), divide_by, exact=False)",
    ),
    Mutant(
        "transport: error-feedback residuals are kept after a failed sync",
        f"{PACKAGE}/transport/sync_transport.py",
        "            if committed:\n                self.residuals.commit()",
        "            if True:\n                self.residuals.commit()",
    ),
    Mutant(
        "async DiLoCo: the local copy follows the global one with the wrong sign",
        f"{PACKAGE}/methods/outer_passes.py",
        "followed = torch.add(local, torch.sub(glob, piece.start, out=scratch.t1),",
        "followed = torch.add(local, torch.sub(piece.start, glob, out=scratch.t1),",
    ),
    Mutant(
        "async DiLoCo: a restart leaves the period's start where it was",
        f"{PACKAGE}/methods/async_diloco.py",
        "            self.period_start[name].copy_(self.global_copy[name])\n"
        "            local_tensor(p.data).copy_(",
        "            local_tensor(p.data).copy_(",
    ),
    Mutant(
        "agreement: a tie counts as a majority",
        f"{PACKAGE}/sync/quorum.py",
        "2 * counts[top] > len(digests)",
        "2 * counts[top] >= len(digests)",
    ),
    Mutant(
        "agreement: the majority steps back instead of the minority",
        f"{PACKAGE}/join/exchange.py",
        "        if minority:\n            events.DIFFERS_FROM_MAJORITY",
        "        if not minority:\n            events.DIFFERS_FROM_MAJORITY",
    ),
    Mutant(
        "DyLU: the learning rate follows the group's own step count",
        f"{PACKAGE}/trainer.py",
        "        if not self.dynamic:\n            self.lr_scheduler.step()",
        "        if True:\n            self.lr_scheduler.step()",
    ),
    Mutant(
        "async DiLoCo: a failed in-flight sync is checkpointed as arrived",
        f"{PACKAGE}/methods/async_diloco.py",
        "self.arrived = not agree(int(sync.sync_failed()))",
        "self.arrived = True",
    ),
    Mutant(
        "heal: a running group keeps its error-feedback residuals",
        f"{PACKAGE}/join/protocol.py",
        "self.sync.reset_error_feedback()  # owed for state this group no longer has",
        "pass  # owed for state this group no longer has",
    ),
    Mutant(
        "heal: async DiLoCo keeps its error-feedback residuals",
        f"{PACKAGE}/methods/async_diloco.py",
        "        self.sync.reset_error_feedback()\n        for state in self._states:",
        "        pass\n        for state in self._states:",
    ),
    Mutant(
        "restart: error-feedback residuals are not loaded from the checkpoint",
        f"{PACKAGE}/method_state.py",
        '                residuals.load(i, mine[f"fragment_{i}"])',
        "                pass",
    ),
    Mutant(
        "DyLU: training may end in the middle of a period",
        f"{PACKAGE}/trainer.py",
        "return self.training_done() and self.algorithm.local_step() == 0",
        "return self.training_done()",
    ),
    Mutant(
        "async DiLoCo: the checkpoint asks the group but not its Manager whether a sync failed",
        f"{PACKAGE}/methods/async_diloco.py",
        "self.arrived = not agree(int(sync.sync_failed()))",
        "self.arrived = not agree(0)",
    ),
    Mutant(
        "DyLU's probe: the timed steps include the first",
        f"{PACKAGE}/methods/dylu.py",
        "        self._warm = True\n        if self._planned_from < taken:",
        "        self._warm = True\n        if False:",
    ),
    Mutant(
        "DyLU's probe: the rest of the first period is planned as a whole period",
        f"{PACKAGE}/join/speeds.py",
        "        rest = self.period - taken",
        "        rest = self.period",
    ),
    Mutant(
        "async DiLoCo: eager_share's own share assumes two groups",
        f"{PACKAGE}/methods/async_diloco.py",
        "1 / max(1, self.sync.num_participants())",
        "1 / 2",
    ),
    Mutant(
        "transport: a wait never asks whether a peer of the sync is gone",
        f"{PACKAGE}/transport/sync_transport.py",
        "if peers is None or len(self._participants) < 2:",
        "if True:",
    ),
    Mutant(
        "runner: an abandoned collective still reports and stages when it returns",
        f"{PACKAGE}/transport/runner.py",
        "if lane.gate.closed:  # the sync ended without this collective: touch nothing shared",
        "if False:",
    ),
    Mutant(
        "shapes: groups whose ranks match pass whatever else differs",
        f"{PACKAGE}/transport/shapes.py",
        "if other == mine:",
        "if other.ranks == mine.ranks:",
    ),
    Mutant(
        "heal pieces: one piece more than allowed is queued",
        f"{PACKAGE}/heal/pieces.py",
        "if self._in_use < self.in_flight:",
        "if self._in_use <= self.in_flight:",
    ),
    Mutant(
        "timeouts: c10d's watchdog is no longer than torchft's own timer",
        f"{CORE_FT}/timeouts.py",
        "return 2 * self.operation + WATCHDOG_MARGIN",
        "return self.operation",
    ),
    Mutant(
        "FTManager: a heal's sender waits for no write of the state",
        f"{CORE_FT}/manager.py",
        "self._written = torch.accelerator.current_stream().record_event()",
        "self._written = None",
    ),
    Mutant(
        "collective: a sync's wait names its timeout (torchft then synchronizes the device)",
        f"{PACKAGE}/transport/collective.py",
        "    wait_delivered(work, pg, timeout)\n",
        "    work.wait(timeout)\n",
    ),
    Mutant(
        "codecs: a block's scale is divided by a Python number (CUDA: a reciprocal)",
        f"{PACKAGE}/transport/codecs.py",
        "divide_(scales, self.qmax)",
        "scales.div_(self.qmax)",
    ),
    Mutant(
        "passes: the token-weighted sums are not divided by the tokens' total",
        f"{PACKAGE}/methods/outer_passes.py",
        "        if divisor == 1:\n            return None",
        "        if divisor >= 1:\n            return None",
    ),
    Mutant(
        "passes: the local start is not moved to the global copy after the outer step",
        f"{PACKAGE}/methods/outer_passes.py",
        "                torch.sub(piece.glob, piece.start, out=piece.out)\n"
        "            piece.start.copy_(piece.glob)\n",
        "                torch.sub(piece.glob, piece.start, out=piece.out)\n",
    ),
    Mutant(
        "passes: the global copy's digest is kept after the copy changed",
        f"{PACKAGE}/methods/outer_passes.py",
        "if self._hashes is None or self._hashes[0] != self._versions():",
        "if self._hashes is None:",
    ),
    Mutant(
        "passes: the eager start steps the optimizer's own momentum, not a copy",
        f"{PACKAGE}/methods/outer_passes.py",
        "out=piece.start, momentum_out=scratch.t1,",
        "out=piece.start, momentum_out=None,",
    ),
    Mutant(
        "async DiLoCo: a failed sync's buffer carries the next sync",
        f"{PACKAGE}/methods/async_diloco.py",
        "reuse = decided.buffer if decided is not None and decided.sums is not None else None",
        "reuse = decided.buffer if decided is not None else None",
    ),
    Mutant(
        "DyLU: a process's first inner step counts in its measured speed",
        f"{PACKAGE}/methods/dylu.py",
        "        self.plan.skip_warm_up(self._local_step, self.clock)\n",
        "",
    ),
    Mutant(
        "checkpoint: a bytes item (train state, data position) loads without its checksum",
        CHECKSUMS,
        "        self.reader.check(read_item)\n        self.planner.load_bytes(read_item, value)",
        "        self.planner.load_bytes(read_item, value)",
        tests=CHECKPOINT_TESTS,
    ),
    Mutant(
        "non-finite: only NaN fails a sync, an inf passes",
        f"{PACKAGE}/transport/collective.py",
        "return bool(torch.isfinite(torch.linalg.vector_norm(t, ord=math.inf)))",
        "return not bool(torch.isnan(torch.linalg.vector_norm(t, ord=math.inf)))",
    ),
    Mutant(
        "restart: every transfer reads a loaded residual from its start (3+ transfers)",
        f"{PACKAGE}/transport/residuals.py",
        "return loaded[key.offset : key.offset + numel]",
        "return loaded[:numel]",
    ),
    Mutant(
        "restart: a checkpoint puts every transfer's residual at the fragment's start",
        f"{PACKAGE}/transport/residuals.py",
        "out[start : start + residual.numel()] = residual.reshape(-1).cpu()",
        "out[: residual.numel()] = residual.reshape(-1).cpu()",
    ),
    Mutant(
        "residuals: a quorum's start drops what a checkpoint staged for its undecided sync",
        f"{PACKAGE}/transport/residuals.py",
        "            if loaded or fragment not in self._staged_by_checkpoint:",
        "            if True:",
    ),
    Mutant(
        "residuals: a newer sync's residuals merge into a checkpoint's staged ones",
        f"{PACKAGE}/transport/residuals.py",
        "        if key.fragment in self._staged_by_checkpoint:  # that sync is void: a newer one",
        "        if False:  # that sync is void: a newer one",
    ),
    Mutant(
        "residuals: a spare of another size is reused as a transfer's residual buffer",
        f"{PACKAGE}/transport/residuals.py",
        "            and spare.shape == like.shape\n",
        "",
    ),
    Mutant(
        "residuals: a commit recycles the residuals it just made owed",
        f"{PACKAGE}/transport/residuals.py",
        "            self._retire(fragment, self._owed.get(fragment, {}))\n            self._owed",
        "            self._retire(fragment, staged)\n            self._owed",
    ),
    # Ten bugs in the one residual store, by a reviewer who had not seen the tests.
    Mutant(
        "residuals: a transfer takes a residual of another size left at its offset",
        f"{PACKAGE}/transport/residuals.py",
        "        if own is not None and own.numel() == numel:",
        "        if own is not None:",
    ),
    Mutant(
        "residuals: a transfer ending where a loaded residual ends is not covered",
        f"{PACKAGE}/transport/residuals.py",
        "key.offset + numel <= loaded.numel()",
        "key.offset + numel < loaded.numel()",
    ),
    Mutant(
        "residuals: a sync's stage keeps only its last transfer's residual",
        f"{PACKAGE}/transport/residuals.py",
        "self._staged.setdefault(key.fragment, {})[key.offset] = residual",
        "self._staged[key.fragment] = {key.offset: residual}",
    ),
    Mutant(
        "residuals: a failed sync keeps what a checkpoint staged for it",
        f"{PACKAGE}/transport/residuals.py",
        "if loaded or fragment not in self._staged_by_checkpoint:",
        "if fragment not in self._staged_by_checkpoint:",
    ),
    Mutant(
        "residuals: a loaded residual is the caller's tensor, later a buffer the store writes",
        f"{PACKAGE}/transport/residuals.py",
        "segments = {0: flat.detach().reshape(-1).clone()}",
        "segments = {0: flat.detach().reshape(-1)}",
    ),
    Mutant(
        "residuals: a checkpoint saves the owed residuals as the staged ones",
        f"{PACKAGE}/transport/residuals.py",
        "for start, residual in self.segments(fragment, staged).items():",
        "for start, residual in self.segments(fragment).items():",
    ),
    Mutant(
        "residuals: a decay below 1 is ignored (the whole residual is added)",
        f"{PACKAGE}/transport/residuals.py",
        "if self.decay == 1:\n            return x.add_(residual)",
        "if self.decay:\n            return x.add_(residual)",
        SPARSE_TESTS,
    ),
    Mutant(
        "transport: an exact transfer takes a place among the fragment's values",
        f"{PACKAGE}/transport/sync_transport.py",
        (
            "        if exact:\n            feedback = None\n        else:\n"
            "            self._offset += numel\n"
        ),
        "        if exact:\n            feedback = None\n        self._offset += numel\n",
    ),
    Mutant(
        "transport: a failed sync keeps what a checkpoint staged for it (end_sync)",
        f"{PACKAGE}/transport/sync_transport.py",
        "            else:\n                self.residuals.discard()",
        "            else:\n                self.residuals.discard(loaded=False)",
    ),
    Mutant(
        "transport: a transfer whose checkpointed residual does not fit still corrects with it",
        f"{PACKAGE}/transport/sync_transport.py",
        "                manager.report_error(e)\n                feedback = None\n",
        "                manager.report_error(e)\n",
    ),
    Mutant(
        "sparse: a decode that adds to a sum overwrites the kept positions instead",
        f"{PACKAGE}/transport/codecs.py",
        "decoded = torch.gather(blocks, 1, index).add_(decoded)",
        "decoded = decoded.clone()",
        SPARSE_TESTS,
    ),
    Mutant(
        "sparse: a kept value's quantization error is not owed",
        f"{PACKAGE}/transport/codecs.py",
        "dropped.scatter_(1, index, kept - decoded)",
        "dropped.scatter_(1, index, torch.zeros_like(kept))",
        SPARSE_TESTS,
    ),
    Mutant(
        "sparse: a level is the mean of all kept magnitudes, not of its bin's",
        f"{PACKAGE}/transport/codecs.py",
        "means = sums / counts.clamp(min=1)",
        "means = sums.sum(dim=1, keepdim=True) / self.keep",
        SPARSE_TESTS,
    ),
    Mutant(
        "sparse: an index gets log2(chunk) bits rounded down",
        f"{PACKAGE}/transport/codecs.py",
        "self.index_bits = math.ceil(math.log2(chunk))",
        "self.index_bits = int(math.log2(chunk))",
        SPARSE_TESTS,
    ),
    Mutant(
        "sparse all-gather: every encoding is added to what the tensor held",
        f"{PACKAGE}/transport/collective.py",
        "codec.decode_into(packed, numel, out, accumulate=i > 0, scratch=scratch)",
        "codec.decode_into(packed, numel, out, accumulate=True, scratch=scratch)",
        SPARSE_TESTS,
    ),
    Mutant(
        "sparse all-gather: a rank counts its encoding sent to itself too",
        f"{PACKAGE}/transport/collective.py",
        "stats.bytes_sent = (n - 1) * mine.numel()",
        "stats.bytes_sent = n * mine.numel()",
        SPARSE_TESTS,
    ),
    Mutant(
        "error feedback: the residual's decay is not applied",
        f"{PACKAGE}/transport/residuals.py",
        "return x.add_(residual * self.decay)",
        "return x.add_(residual)",
        SPARSE_TESTS,
    ),
    Mutant(
        "sync quorum: a method's state is not registered for heals",
        f"{PACKAGE}/sync/quorum.py",
        "        self.ft.register_state_dict_fn(key, load, save)\n",
        "        pass\n",
    ),
    Mutant(
        "DyLU cap: a corrected period's 2 x period leaves out the steps before it was timed",
        f"{PACKAGE}/methods/dylu.py",
        "        self.steps = agree(min(2 * self.period, steps))",
        "        self.steps = agree(steps)",
    ),
    Mutant(
        "DyLU cap: the probe's plan of the rest leaves out the steps taken before it",
        f"{PACKAGE}/methods/dylu.py",
        "min(2 * self.period - taken, steps)",
        "min(2 * self.period, steps)",
    ),
    # ---- bits the groups agree on (docs/design.md): the same on every CPU's kernels --------
    Mutant(
        "outer step: SGD's update contracted to a fused multiply-add (add with alpha)",
        f"{PACKAGE}/methods/outer_optimizer.py",
        "torch.sub(param, step, out=param if out is None else out)",
        "torch.add(param, direction, alpha=-lr, out=param if out is None else out)",
        HOST_ARITHMETIC,
    ),
    Mutant(
        "outer step: Nesterov's direction contracted to a fused multiply-add",
        f"{PACKAGE}/methods/outer_optimizer.py",
        "direction = torch.mul(updated, momentum, out=scratch).add_(grad)",
        "direction = grad.add(updated, alpha=momentum)",
        HOST_ARITHMETIC,
    ),
    Mutant(
        "outer step: Delayed Nesterov's direction contracted to a fused multiply-add",
        f"{PACKAGE}/methods/outer_optimizer.py",
        "return scaled.add_(pulled_by * weight), new_momentum",
        "return scaled.add_(pulled_by, alpha=weight), new_momentum",
        HOST_ARITHMETIC,
    ),
    Mutant(
        "outer step: the token-weighted sums divided by multiplying with the reciprocal",
        f"{PACKAGE}/methods/outer_passes.py",
        "            torch.div(piece.source, divide_by, out=piece.source)",
        "            piece.source.mul_(1.0 / divide_by)",
        HOST_ARITHMETIC,
    ),
    Mutant(
        "initial model: a new job's group keeps the one its host drew",
        f"{PACKAGE}/join/exchange.py",
        "differs_from_first=bool(own is not None and first.has_digest and own != first.digest),",
        "differs_from_first=False,",
        MIXED_HOSTS,
    ),
    Mutant(
        "initial model: a new job's groups stop over their hosts' draws, as over a bug",
        f"{PACKAGE}/join/exchange.py",
        "if found.disagree and start_up is not None and all(m.role == FRESH for m in members):",
        "if False:",
        MIXED_HOSTS,
    ),
    Mutant(
        "initial model: the source is the lowest replica id, whatever most groups run",
        f"{PACKAGE}/join/exchange.py",
        "return min((m for m in members if hosts[m.host()] == most), key=lambda m: m.replica)",
        "return min(members, key=lambda m: m.replica)",
        MIXED_HOSTS,
    ),
    Mutant(
        "initial model: the source is the highest replica id of the commonest host",
        f"{PACKAGE}/join/exchange.py",
        "return min((m for m in members if hosts[m.host()] == most), key=lambda m: m.replica)",
        "return max((m for m in members if hosts[m.host()] == most), key=lambda m: m.replica)",
        MIXED_HOSTS,
    ),
    Mutant(
        "initial model: a group whose checkpoints were rejected starts as a new job's",
        f"{PACKAGE}/join/protocol.py",
        "restarted = true_step > 0 or self.train_state.step > 0 or bool(heal_in_full)",
        "restarted = true_step > 0 or self.train_state.step > 0",
        MIXED_HOSTS,
    ),
    Mutant(
        "member record: a group's host is not sent",
        f"{PACKAGE}/join/exchange.py",
        "        mine.give_host(Host.this())\n",
        "",
        MIXED_HOSTS,
    ),
    # ---- issue 62: behaviours of failure detection, shapes, heals, DyLU and the planner ----
    Mutant(
        "peer watch: a sync watches the quorum without knowing its own group's key",
        f"{PACKAGE}/sync/quorum.py",
        "            self.heartbeat if members else 0,\n",
        "            0,\n",
        ("tests/unit_tests/test_peer_watch.py",),
    ),
    Mutant(
        "non-finite: the last transfer of a sync decides whether it was finite",
        f"{PACKAGE}/transport/sync_transport.py",
        "            found = found or work.non_finite",
        "            found = work.non_finite",
        ("tests/unit_tests/test_transport.py",),
    ),
    Mutant(
        "timeouts: the longest operation is the heal's piece, not the longer of it and a sync",
        f"{CORE_FT}/timeouts.py",
        "        return max(self.collective, self.heal)",
        "        return self.heal",
        ("tests/unit_tests/test_replica_timeouts.py",),
    ),
    Mutant(
        "heal pieces: the oldest piece leaves the queue without being waited for",
        f"{PACKAGE}/heal/pieces.py",
        "            self._queued.popleft().wait(self.timeout)",
        "            self._queued.popleft()",
        ("tests/unit_tests/test_replica_timeouts.py",),
    ),
    Mutant(
        "shapes: the wire dtype's code leaves out the sparse chunk",
        f"{PACKAGE}/transport/shapes.py",
        'PSEUDO_GRAD_DTYPES.index("sparse") | bits << 4 | keep << 8 | chunk << 32',
        'PSEUDO_GRAD_DTYPES.index("sparse") | bits << 4 | keep << 8',
        ("tests/unit_tests/test_semi_sync.py",),
    ),
    Mutant(
        "shapes: the layout key flattens the fragments' tensors into one list",
        f"{PACKAGE}/transport/shapes.py",
        "            [tuple(local_tensor(p).shape) for p in fragment.parameters()] for fragment in "
        "fragments",
        "            tuple(local_tensor(p).shape) for fragment in fragments for p in "
        "fragment.parameters()",
        ("tests/unit_tests/test_semi_sync.py",),
    ),
    Mutant(
        "report: a delayed sync's time is the applying step's alone",
        f"{PACKAGE}/report/sync_reporter.py",
        "        self.seconds += time.perf_counter() - self._clock",
        "        self.seconds = time.perf_counter() - self._clock",
        ("tests/unit_tests/test_semi_sync.py", "tests/unit_tests/test_async_diloco.py"),
    ),
    Mutant(
        "planner: --ranks-per-group 0 passes the check",
        f"{PACKAGE}/plan.py",
        "    if args.ranks_per_group < 1:",
        "    if args.ranks_per_group < 0:",
        ("tests/unit_tests/test_plan.py",),
    ),
    Mutant(
        "planner: the quorum timeout is sized on an int8 sync",
        f"{PACKAGE}/plan.py",
        '    slowest = plan.sync_s("float32")',
        '    slowest = plan.sync_s("int8")',
        ("tests/unit_tests/test_plan.py",),
    ),
    Mutant(
        "digest: a piece's chunk taken from its element index, not its word index",
        "torchtitan/tools/digest.py",
        "        index = first // _CHUNK",
        "        index = start // _CHUNK",
        ("tests/unit_tests/test_semi_sync.py", "tests/unit_tests/test_outer_passes.py"),
    ),
    Mutant(
        "replay: the average divided by a Python number (a reciprocal on CUDA)",
        f"{PACKAGE}/heal/history.py",
        "            divide_(flat, self.scale)",
        "            flat.div_(self.scale)",
        ("tests/unit_tests/test_exact_division.py",),
    ),
    Mutant(
        "DyLU: the period's clock starts before the sync quorum, its wait counted as steps",
        f"{PACKAGE}/methods/async_diloco.py",
        "        if quorums.sync_quorum():  # healed: this group's progress is a peer's now\n"
        "            self.start_transfer()\n"
        "        else:\n"
        "            self._in_flight = InFlightSync.start(\n"
        "                self.sync, index, buffer, steps, tokens, scaled=True\n"
        "            )\n"
        "            self.plan.begin(self.clock())\n",
        "        self.plan.begin(self.clock())\n"
        "        if quorums.sync_quorum():  # healed: this group's progress is a peer's now\n"
        "            self.start_transfer()\n"
        "        else:\n"
        "            self._in_flight = InFlightSync.start(\n"
        "                self.sync, index, buffer, steps, tokens, scaled=True\n"
        "            )\n",
        ("tests/unit_tests/test_async_diloco.py",),
    ),
    Mutant(
        "DyLU: a period that ends before a late probe keeps the probe's one-step estimate",
        f"{PACKAGE}/methods/dylu.py",
        "                self.plan.measure(self._local_step, self.clock())",
        "                pass",
        ("tests/unit_tests/test_async_diloco.py", "tests/unit_tests/test_dylu_probe.py"),
    ),
    Mutant(
        "sparse: with kept zeros the bins start at zero, not the smallest nonzero magnitude",
        f"{PACKAGE}/transport/codecs.py",
        "        base = torch.where(keeps_zeros, torch.where(nonzero, top, hi).amin(dim=1, "
        "keepdim=True), lo)",
        "        base = lo",
        SPARSE_TESTS,
    ),
    Mutant(
        "checkpoint: an inner step equal to the period loads",
        f"{PACKAGE}/method_state.py",
        "        if not loop.applies_next and step >= loop.period:",
        "        if not loop.applies_next and step > loop.period:",
        ("tests/unit_tests/test_semi_sync.py",),
    ),
    # ---- ten written by a reviewer who had not seen the tests (issue 62's check) -------
    Mutant(
        "outer step: plain momentum's update scaled in place, into the buffer",
        f"{PACKAGE}/methods/outer_optimizer.py",
        "step = direction.mul_(lr) if temporary else torch.mul(direction, lr, out=scratch)",
        "step = direction.mul_(lr) if momentum != 0 else torch.mul(direction, lr, out=scratch)",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "Delayed Nesterov: a window's last step weighs the momentum by 1 - N c",
        f"{PACKAGE}/methods/outer_optimizer.py",
        "weight = momentum * (1.0 - c * (delay - 1))",
        "weight = momentum * (1.0 - c * delay)",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "passes: eager_share scales the pseudo-gradient to be sent in place",
        f"{PACKAGE}/methods/outer_passes.py",
        "grad = pseudo if share == 1.0 else torch.mul(pseudo, share, out=scratch.grad)",
        "grad = pseudo if share == 1.0 else pseudo.mul_(share)",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "Delayed Nesterov: the eager estimate after a step takes that step's window position",
        f"{PACKAGE}/methods/outer_passes.py",
        "piece.start, step=self.number + self.stepping,",
        "piece.start, step=self.number,",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "initial model: the job stops one start-up quorum early",
        f"{PACKAGE}/join/exchange.py",
        "if start_up.initial_models_differed > MAX_INITIAL_MODEL_ROUNDS:",
        "if start_up.initial_models_differed >= MAX_INITIAL_MODEL_ROUNDS:",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "initial model: the source is the highest replica id (a reviewer's)",
        f"{PACKAGE}/join/exchange.py",
        "return min((m for m in members if hosts[m.host()] == most), key=lambda m: m.replica)",
        "return max((m for m in members if hosts[m.host()] == most), key=lambda m: m.replica)",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "quorum findings: shapes_differ and differs_from_first swapped",
        f"{PACKAGE}/join/exchange.py",
        "replay_failed, replayed, full, shapes_differ, differs_from_first = (",
        "replay_failed, replayed, full, differs_from_first, shapes_differ = (",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "member record: the kernels and the GPU packed in each other's place",
        f"{PACKAGE}/sync/quorum.py",
        "return _pack(self.machine), version, _pack(self.kernels), _pack(self.gpu)",
        "return _pack(self.machine), version, _pack(self.gpu), _pack(self.kernels)",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "exact division: divided() multiplies by the reciprocal",
        "torchtitan/tools/exact_division.py",
        "return torch.div(tensor, divisor_like(tensor, divisor))",
        "return tensor * (1.0 / divisor)",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "initial model: a rejected-checkpoint group is fresh (a reviewer's)",
        f"{PACKAGE}/join/protocol.py",
        "restarted = true_step > 0 or self.train_state.step > 0 or bool(heal_in_full)",
        "restarted = true_step > 0 or self.train_state.step > 0",
        FRESH_REVIEW_TESTS,
    ),
    Mutant(
        "nccl: the replicate group's backend keeps c10d's teardown on an error",
        f"{CORE_FT}/build.py",
        '"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",',
        '"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",',
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: the replicate group signals flight-recorder dumps (the monitor ends the process)",
        f"{CORE_FT}/build.py",
        '"TORCH_NCCL_DUMP_ON_TIMEOUT": "0",',
        '"TORCH_NCCL_DUMP_ON_TIMEOUT": "1",',
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: fault tolerance keeps the heartbeat monitor of the first group",
        "torchtitan/distributed/parallel_dims.py",
        'if ft.enable and device.type == "cuda":',
        'if ft.enable and device.type == "cpu":',
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a wait goes through torchft's wrapper (a device-wide sync, a timer left armed)",
        f"{CORE_FT}/delivery.py",
        "    inner = tft.backend_work(work)",
        "    inner = work",
        (*NCCL_TESTS, "tests/unit_tests/test_transport.py"),
    ),
    Mutant(
        "nccl: a wait trusts a collective whose work recorded an error",
        f"{CORE_FT}/delivery.py",
        "            inner.wait(FINISHED)",
        "            pass",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a wait with a timeout returns before the result has landed",
        f"{CORE_FT}/delivery.py",
        "            inner.wait(limit)",
        "            inner.wait()",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a wait without a timeout returns before the result has landed",
        f"{CORE_FT}/delivery.py",
        "while not inner.is_completed() and tft.group_generation(pg) is generation:",
        "while False:",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a collective whose group torchft aborted meanwhile counts as delivered",
        f"{CORE_FT}/delivery.py",
        "    if tft.group_generation(pg) is not generation:",
        "    if False:",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: the quorum's exchange waits without its timeout",
        f"{PACKAGE}/sync/quorum.py",
        "all_reduce_across_groups(manager, buffer, average=False, timeout=timeout)",
        "all_reduce_across_groups(manager, buffer, average=False)",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: an all-reduce across groups (a quorum's exchange, a step's gradients) is read "
        "after wait() alone",
        f"{CORE_FT}/delivery.py",
        "wait_delivered(pg.allreduce([tensor], options), pg, timeout)",
        "pg.allreduce([tensor], options).wait()",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: DyLU's probe exchanges on the training stream",
        f"{PACKAGE}/join/speeds.py",
        "            with side_stream(on):\n                run()",
        "            run()",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a group's ranks decide on the device's group",
        f"{PACKAGE}/sync/quorum.py",
        "found = torch.tensor(values, dtype=torch.int64)",
        "found = torch.tensor(values, dtype=torch.int64, device=self.device)",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: the in-group wait covers one operation after the quorum, not two",
        f"{PACKAGE}/sync/quorum.py",
        "return timedelta(seconds=quorum_s + 2 * longest) + WATCHDOG_MARGIN",
        "return timedelta(seconds=quorum_s + longest) + WATCHDOG_MARGIN",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a sync's all-reduce bypasses the transport (as torchft's fp8 path did)",
        f"{PACKAGE}/sync/quorum.py",
        "        return self.transport.allreduce(\n            self.ft.manager, tensor,",
        "        return self.ft.manager.allreduce(tensor) or self.transport.allreduce(\n"
        "            self.ft.manager, tensor,",
    ),
    Mutant(
        "nccl: a step's gradients are read after torchft's all-reduce wait() alone",
        f"{CORE_FT}/manager.py",
        "if not all_reduce_across_groups(self.manager, flat, average=True):",
        "if not self.manager.allreduce(flat).wait():",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a heal's point-to-point pairing keeps the rendezvous's timeout",
        f"{CORE_FT}/build.py",
        "store.set_timeout(timeouts.operation)",
        "store.set_timeout(timeouts.rendezvous)",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a heal piece cut off by a peer's death is loaded",
        f"{PACKAGE}/heal/pieces.py",
        "wait_delivered(self.work, self.pg, timeout)",
        "self.work.wait() if timeout is None else self.work.wait(timeout)",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: each thread of a heal queues its own pieces in flight",
        f"{PACKAGE}/heal/pieces.py",
        "if self._in_use < self.in_flight:",
        "if self._in_use < 3 * self.in_flight:",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl: a sender answers several joiners one after another",
        f"{PACKAGE}/heal/checkpoint_transport.py",
        "    if len(jobs) <= 1:",
        "    if True:",
        NCCL_TESTS,
    ),
    Mutant(
        "gpu check: the nccl semantics tests run only where named cuda, not whole",
        "scripts/gpu_check_runs.py",
        "               NCCL_SEMANTICS]  # fmt: skip",
        "               ]  # fmt: skip",
        (
            "tests/integration_tests/test_gpu_check.py::"
            "test_the_nccl_semantics_tests_run_whole_and_last_with_their_figures",
        ),
    ),
    # A reviewer's ten, written without the tests: four were the mutants above (the exception
    # unchecked, the heal piece, the store's timeout, the exchange read after wait() alone);
    # one restored an environment scoped around each build, which the process now sets once.
    Mutant(
        "nccl review: side_stream never makes its stream current",
        f"{CORE_FT}/streams.py",
        "with torch.cuda.device(device), torch.cuda.stream(stream):",
        "with torch.cuda.device(device):",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl review: the in-group wait uses the shorter of the heal and sync timeouts",
        f"{PACKAGE}/sync/quorum.py",
        "longest = max(heal_s, collective_s)",
        "longest = min(heal_s, collective_s)",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl review: the in-group decision runs on the default (device) group",
        f"{PACKAGE}/sync/quorum.py",
        "dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.host_group)",
        "dist.all_reduce(found, op=dist.ReduceOp.MAX)",
        NCCL_TESTS,
    ),
    Mutant(
        "nccl review: one failed answer of several sent at once is ignored",
        f"{PACKAGE}/heal/checkpoint_transport.py",
        "    if errors:\n        raise errors[0]",
        "    if len(errors) > 1:\n        raise errors[0]",
        NCCL_TESTS,
    ),
    Mutant(
        "launcher review: a crash gets one line and a reported error torchrun's report",
        "torchtitan/tools/loopback_torchrun.py",
        "failure.exitcode > 0 and not os.path.isfile(failure.error_file)",
        "failure.exitcode > 0 and os.path.isfile(failure.error_file)",
        ("tests/unit_tests/test_loopback_torchrun.py",),
    ),
    Mutant(
        "launcher: a rank's reported error ends in torchrun's traceback",
        "torchtitan/tools/loopback_torchrun.py",
        "stop = _reported_stop(e)",
        "stop = None",
        ("tests/unit_tests/test_loopback_torchrun.py",),
    ),
    # Ten bugs written for the layers refactor by a reviewer who had not seen the tests, and
    # two more for what review found.
    Mutant(
        "transport: a transfer's offset is the size of the one before, not the sum (3+)",
        f"{PACKAGE}/transport/sync_transport.py",
        "            self._offset += numel",
        "            self._offset = numel",
    ),
    Mutant(
        "residuals: a transfer adds what the undecided sync staged, not what is owed",
        f"{PACKAGE}/transport/residuals.py",
        "        segments = self._owed.get(key.fragment)",
        "        segments = self._staged.get(key.fragment)",
    ),
    Mutant(
        (
            "outer_loop: last_outcome takes the stepped squares twice, so the "
            "pseudo-gradient norm is never reported"
        ),
        f"{PACKAGE}/methods/outer_loop.py",
        "return dataclasses.replace(self._outcome, pseudo_grad_squares=squares)",
        (
            "return dataclasses.replace(self._outcome, "
            "pseudo_grad_squares=self.take_stepped_squares())"
        ),
    ),
    Mutant(
        "protocol: a group joining at a sync point reports no wait for the others",
        f"{PACKAGE}/join/protocol.py",
        "            self.sync.joined_sync(joined.waited_s)\n",
        "",
    ),
    Mutant(
        "exchange: a quorum that checked no digests keeps the last quorum's agreement",
        f"{PACKAGE}/join/exchange.py",
        "self.agreement = None if not verdict.digests else",
        "self.agreement = self.agreement if not verdict.digests else",
    ),
    Mutant(
        (
            "heal: a refused peer's shape mismatch is not kept in shape_refused, so the "
            "group does not stop at its quorum"
        ),
        f"{PACKAGE}/heal/exchange.py",
        "self.shape_refused = why",
        "pass",
        (
            "tests/integration_tests/test_failure_detection.py::"
            "test_a_group_restarted_with_another_shape_is_refused_before_its_heal",
        ),
    ),
    Mutant(
        "heal: a reported replay failure is not cleared, so every later quorum fails it again",
        f"{PACKAGE}/heal/exchange.py",
        'self.replay_failed = ""\n        self.drop_basis(problem)',
        "self.drop_basis(problem)",
        ("tests/unit_tests/test_heal_history.py",),
    ),
    Mutant(
        (
            "exchange: a start-up quorum's record is made as a running group's, so its "
            "pending speed probe is not cancelled"
        ),
        f"{PACKAGE}/join/exchange.py",
        "mine.step_us = self.speeds.step_us(mine.role)",
        "mine.step_us = self.speeds.step_us(RUNNING)",
    ),
    Mutant(
        "quorum: agree_in_group ignores the group's other ranks (each rank decides alone)",
        f"{PACKAGE}/sync/quorum.py",
        "return value if self.rank is None else self.rank.most([value])[0]",
        "return value",
    ),
    Mutant(
        "piece_workers: a piece's t1 temporary shares the grad scratch buffer",
        f"{PACKAGE}/methods/piece_workers.py",
        't1=get(f"t1 {dtype}", numel, dtype),',
        't1=get(f"grad {dtype}", numel, dtype),',
    ),
    Mutant(
        "global copy: a replay's outer step is measured as a sync's norm",
        f"{PACKAGE}/methods/global_copy.py",
        "        state.passes.step(state.views(average))",
        "        self.measure_outer_step(state.views(average).values())\n"
        "        state.passes.step(state.views(average))",
        ("tests/unit_tests/test_heal_history.py",),
    ),
    Mutant(
        (
            "transport: a checkpoint's residual of another size stops training instead of "
            "failing the sync"
        ),
        f"{PACKAGE}/transport/sync_transport.py",
        (
            "            except ValueError as e:  # a checkpoint's residuals of another "
            "size: the sync fails\n                manager.report_error(e)"
        ),
        (
            "            except ValueError:  # a checkpoint's residuals of another size: the "
            "sync fails\n                raise"
        ),
    ),
    Mutant(
        "train: a custom module's run_instead(argv) is ignored, its command line run as typed",
        "torchtitan/train.py",
        'if module is not None and hasattr(module, "run_instead"):',
        'if module is not None and hasattr(module, "run_instead_"):',
        ("tests/unit_tests/test_ft_launcher.py",),
    ),
    # Ten more from a reviewer who had not seen the tests (issue 64: the sync's record and
    # the quorum rounds), and one for what their tests showed.
    Mutant(
        "quorum: a decision numbers its sync one off (a commit one ahead, a failure at its own)",
        f"{PACKAGE}/sync/quorum.py",
        "self.current_step() + (0 if committed else 1),",
        "self.current_step() + (1 if committed else 0),",
    ),
    Mutant(
        "quorum: a failed sync's decision keeps what its transfers delivered",
        f"{PACKAGE}/sync/quorum.py",
        "transport.delivered() if committed and transport.keep_delivered else [],",
        "transport.delivered() if transport.keep_delivered else [],",
    ),
    Mutant(
        "rounds: a quorum its members do not use is dropped without being closed",
        "torchtitan/components/ft/manager.py",
        "        if self.size:\n            self._skip(self.size)\n",
        "        if self.size:\n            self.size = 0\n",
    ),
    Mutant(
        "rounds: the wait is bounded by quorum_timeout_s, not the caller's timeout",
        "torchtitan/components/ft/manager.py",
        "rounds = QuorumRounds(self, needed, start + self._timeout_s)",
        "rounds = QuorumRounds(self, needed, start + self.quorum_timeout_s)",
    ),
    Mutant(
        "rounds: the wait's length is not kept, so join_quorum returns 0",
        "torchtitan/components/ft/manager.py",
        "rounds.waited = waited = self.watchdog.end()",
        "waited = self.watchdog.end()",
    ),
    Mutant(
        "rounds: an error in the caller's block other than the core's leaves the watchdog running",
        "torchtitan/components/ft/manager.py",
        "            except BaseException:\n                self.watchdog.end()\n",
        "            except FaultToleranceError:\n                self.watchdog.end()\n",
    ),
    Mutant(
        "protocol: a heal in an earlier sync quorum is reported for every later one",
        f"{PACKAGE}/join/protocol.py",
        "        self._peer_loaded = False\n        site = self.sync.site\n",
        "        site = self.sync.site\n",
    ),
    Mutant(
        "speeds: the probe's quorum is formed as a sync's",
        f"{PACKAGE}/join/speeds.py",
        "with self.method.sync.probe_rounds() as rounds:",
        "with self.method.sync.sync_rounds() as rounds:",
    ),
    Mutant(
        "async_diloco: a loaded sync's bytes leave out its token count",
        f"{PACKAGE}/methods/async_diloco.py",
        "bytes_sent=self.buffer.numel() * 4,",
        "bytes_sent=self.buffer[:-1].numel() * 4,",
    ),
    Mutant(
        "async_diloco: a loaded sync keeps the transport's squares (0) for its average",
        f"{PACKAGE}/methods/async_diloco.py",
        "compression_s=None, squares=None",
        "compression_s=None",
    ),
    Mutant(
        "protocol: a peer's state loaded in a sync quorum is not told as a heal",
        f"{PACKAGE}/join/protocol.py",
        "        self._peer_loaded = True\n",
        "",
    ),
    Mutant(
        "passes: a pass that does not step keeps hashes it never took as the digest",
        f"{PACKAGE}/methods/outer_passes.py",
        "            self._run(pieces, body, steps=False)",
        "            self._run(pieces, body)",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "Delayed Nesterov on pieces: the step count does not move",
        f"{PACKAGE}/methods/outer_passes.py",
        '            self.group["step"] = self.number + 1',
        "            pass",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "passes: the eager estimate after a first step takes the gradient as momentum",
        f"{PACKAGE}/methods/outer_passes.py",
        "first=piece.name in self.first and not self.stepping,",
        "first=piece.name in self.first,",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "Delayed Nesterov on pieces: the estimate after a window's first end reads no momentum",
        f"{PACKAGE}/methods/outer_passes.py",
        "            no_momentum = no_momentum and not self.last\n",
        "",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "piece_workers: a bf16 state's step temporary is fp32",
        f"{PACKAGE}/methods/piece_workers.py",
        'step=get(f"step {dtype}", numel, dtype),',
        'step=get(f"step {dtype}", numel, torch.float32),',
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "piece_workers: an accelerator's pass is cut in the host's small pieces",
        f"{PACKAGE}/methods/piece_workers.py",
        'return PASS_PIECE_VALUES if device.type == "cpu" else DEVICE_PIECE_VALUES',
        "return PASS_PIECE_VALUES",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "passes: a first step's momentum buffer is the optimizer's before the pass succeeds",
        f"{PACKAGE}/methods/outer_passes.py",
        "                    buffer = torch.empty_like(glob)",
        '                    buffer = outer.state[glob]["momentum_buffer"] = '
        "torch.empty_like(glob)",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "passes: an outer optimizer they cannot step is refused only at the first step",
        f"{PACKAGE}/methods/outer_passes.py",
        "        check_outer(outer)\n",
        "",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "passes: an average of another size is cut as if it fitted",
        f"{PACKAGE}/methods/outer_passes.py",
        "            if values[name].numel() != numel:",
        "            if values[name].numel() > numel:",
        ("tests/unit_tests/test_outer_passes.py",),
    ),
    Mutant(
        "Delayed Nesterov on pieces: the estimate after a window's end reads no momentum (c > 0)",
        f"{PACKAGE}/methods/outer_passes.py",
        "no_momentum = no_momentum and not self.last",
        "no_momentum = no_momentum and self.last",
    ),
    Mutant(
        "passes: finish shifts the local copy by start - global (a reviewer's)",
        f"{PACKAGE}/methods/outer_passes.py",
        "piece.local.add_(torch.sub(piece.glob, piece.start, out=scratch.t1))",
        "piece.local.add_(torch.sub(piece.start, piece.glob, out=scratch.t1))",
    ),
    Mutant(
        "async DiLoCo: a restart gives the model the global copy, keeps the old start "
        "(a reviewer's)",
        f"{PACKAGE}/methods/async_diloco.py",
        "            self.period_start[name].copy_(self.global_copy[name])\n"
        "            local_tensor(p.data).copy_(self.period_start[name], "
        "non_blocking=self.non_blocking)",
        "            local_tensor(p.data).copy_(self.global_copy[name], "
        "non_blocking=self.non_blocking)",
    ),
    Mutant(
        "Delayed Nesterov: the momentum buffer is allocated before the first window end "
        "(a reviewer's)",
        f"{PACKAGE}/methods/outer_optimizer.py",
        "if last and momentum is None:",
        "if momentum is None:",
    ),
    Mutant(
        "Delayed Nesterov on pieces: an estimate-only pass counts a step (a reviewer's)",
        f"{PACKAGE}/methods/outer_passes.py",
        "        if self.stepping:\n            for name, buffers in self.buffers.items():",
        "        if True:\n            for name, buffers in self.buffers.items():",
    ),
    Mutant(
        "runner: an abandoned lane's gate stays open, so its thread issues the next collective",
        f"{PACKAGE}/transport/runner.py",
        "            lane.gate.close()\n",
        "",
    ),
    Mutant(
        "collective: a gate is not held around the issue of an all-gather",
        f"{PACKAGE}/transport/collective.py",
        "    issuing = contextlib.nullcontext if gate is None else gate.issuing",
        "    issuing = contextlib.nullcontext",
    ),
    Mutant(
        "core: a committed step counts no tokens",
        "torchtitan/trainer.py",
        "        self.tokens_seen += tokens",
        "        self.tokens_seen += 0",
        ("tests/unit_tests/test_checkpoint.py",),
    ),
    Mutant(
        "transport: a failed transfer is not reported before the next bucket is sent",
        f"{PACKAGE}/transport/sync_transport.py",
        "        self._report_failures()\n        if self._manager.errored() is not None:",
        "        if self._manager.errored() is not None:",
    ),
    Mutant(
        "transport: a failed transfer is not reported when it is waited for",
        f"{PACKAGE}/transport/sync_transport.py",
        "                    self._abandon(gone)\n        self._report_failures()",
        "                    self._abandon(gone)",
    ),
    Mutant(
        "transport: a transfer past its timeout is reported without naming the field",
        f"{PACKAGE}/transport/sync_transport.py",
        "            if _timed_out(error):\n                sent_as",
        "            if False:\n                sent_as",
    ),
    Mutant(
        "transport: a timeout is not kept as the sync's (a reviewer's)",
        f"{PACKAGE}/transport/sync_transport.py",
        "                if self.timed_out is None:",
        "                if self.timed_out is not None:",
    ),
    Mutant(
        "transport: failures are reported only when peers are watched (a reviewer's)",
        f"{PACKAGE}/transport/sync_transport.py",
        "                    self._abandon(gone)\n        self._report_failures()",
        "                    self._abandon(gone)\n            self._report_failures()",
    ),
    Mutant(
        "runner: an abandoned collective that returns whole still stages (a reviewer's)",
        f"{PACKAGE}/transport/runner.py",
        "            if lane.gate.closed:  # the sync ended",
        "            if lane.gate.closed and error is not None:  # the sync ended",
    ),
    Mutant(
        "runner: abandon() leaves the collective under way (a reviewer's)",
        f"{PACKAGE}/transport/runner.py",
        "            jobs = [lane.current] if lane.current is not None else []",
        "            jobs = []",
    ),
    Mutant(
        "collective: a float32 all-reduce is issued through a closed gate (a reviewer's)",
        f"{PACKAGE}/transport/collective.py",
        "            with issuing():\n                work = pg.allreduce([tensor], opts)",
        "            work = pg.allreduce([tensor], opts)",
    ),
    Mutant(
        "FTManager: start() ignores the heal transport it is given (a reviewer's)",
        "torchtitan/components/ft/manager.py",
        "        self._manager = self._build_manager(checkpoint_transport)",
        "        self._manager = self._build_manager(None)",
        ("tests/unit_tests/test_ft_manager.py",),
    ),
]

#: Mutants that may survive the unit tests, with the reason (each is caught elsewhere, or is
#: equivalent to the original). Empty until a run shows one.
ACCEPTED: dict[str, str] = {}


def copy_tree(target: Path) -> None:
    """The files of the repository as they are in the working tree, tracked ones and new ones
    not ignored (a module not committed yet that a tracked one imports), into ``target``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def run_tests(tree: Path, tests: Sequence[str]) -> tuple[bool, float, str]:
    """(whether every one of ``tests`` passed, seconds, the last lines of the output) for
    ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-p", "no:xdist", *tests]  # fmt: skip
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - start, f"timed out after {TIMEOUT_S} s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    # What failed, for the report: pytest's summary line of the first failure, else the end.
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR tests"))][:1]
    tail = "\n".join(failed or lines[-3:])
    return done.returncode == 0, time.monotonic() - start, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="run only the mutants whose name contains this")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m.name]
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as scratch:
        tree = Path(scratch)
        copy_tree(tree)
        # The copy is what the tests import: the package of the copy, not the installed one.
        probe = subprocess.run(
            [sys.executable, "-c", "import torchtitan; print(torchtitan.__file__)"],
            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert probe.stdout.strip().startswith(str(tree)), probe.stdout
        # Every test a chosen mutant must fail passes unmutated (each file once, in order).
        tests = list(dict.fromkeys(t for m in chosen for t in m.tests)) or TESTS
        passed, seconds, tail = run_tests(tree, tests)
        if not passed:
            print(f"the unmutated tests fail ({seconds:.0f} s):\n{tail}")
            return 2
        print(f"unmutated: the tests pass in {seconds:.0f} s")
        survivors = []
        for mutant in chosen:
            path = tree / mutant.file
            text = path.read_text()
            if text.count(mutant.original) != 1:
                print(f"STALE  {mutant.name}: its line is not in {mutant.file} exactly once")
                survivors.append(mutant.name)
                continue
            path.write_text(text.replace(mutant.original, mutant.mutated))
            try:
                passed, seconds, tail = run_tests(tree, mutant.tests)
            finally:
                path.write_text(text)
            verdict = "SURVIVED" if passed else "killed"
            print(f"{verdict:8s} {mutant.name} ({seconds:.0f} s)")
            if not passed:
                print(f"         by {tail[:300]}")
            if passed:
                survivors.append(mutant.name)
                if mutant.name in ACCEPTED:
                    print(f"         accepted: {ACCEPTED[mutant.name]}")
    unaccepted = [name for name in survivors if name not in ACCEPTED]
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed; "
          f"{len(unaccepted)} survivor(s) not accepted")  # fmt: skip
    return 1 if unaccepted else 0


if __name__ == "__main__":
    sys.exit(main())
