"""Semi-sync training's events (``torchtitan.tools.events``) and their console lines; every
field is listed in ``docs/design.md`` ("Events"). ``sync``: the torchft Manager step a sync makes
(a failed sync is retried under the same number); ``step``: the training step of the event.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.tools.events import EventKind


def _sync_line(v: dict[str, Any], _: bool) -> str:
    norm = v["pseudo_grad_norm"]
    weighted = ""
    if v.get("tokens") is not None:
        share = "n/a" if v["weight"] is None else f"{v['weight']:.3f}"
        weighted = f"  inner_steps {v['inner_steps']}  tokens {v['tokens']}  weight {share}"
    compressed = ""
    if v.get("compression_s") is not None:
        compressed = f"  {v['pseudo_grad_dtype']} (compression {v['compression_s'] * 1000:.0f} ms)"
    return (
        f"[semi-sync] step {v['step']} sync: {v['method']} fragment {v['fragment']}/"
        f"{v['fragments']}  {'committed' if v['committed'] else 'NOT committed'}  "
        f"time {v['seconds'] * 1000:.0f} ms  sent {v['bytes_sent'] / 2**20:.2f} MiB  "
        f"groups {v['groups']}  quorum {v['quorum_id']}  "
        f"pseudo_grad_norm {'n/a' if norm is None else f'{norm:.4f}'}  sync #{v['sync']}  "
        f"quorum_wait {v['quorum_wait_s']:.2f}s{weighted}{compressed}"
    )


#: One sync, in the step whose ``optimizer.step()`` completed it. ``seconds``: time in torchft's
#: sync hooks; ``bytes_sent``: this rank's all-reduced payload (with a compressed
#: ``pseudo_grad_dtype``: what it really sent, payload and scales, both phases);
#: ``compression_s``: seconds compressing and decompressing (None: uncompressed);
#: ``quorum_wait_s``: time in the sync's quorum; ``pseudo_grad_norm``: None for LocalSGD or an
#: uncommitted sync; ``agreement``: ``"agree"``/``"disagree"`` if the quorum compared digests,
#: else None. Async DiLoCo decides at a sync point the sync started at the previous one:
#: ``inner_steps``/``tokens``: this group's part of it, ``weight``: its share of all groups'
#: tokens (None: not committed); all None for the other methods (equal weights).
SYNC = EventKind("semi_sync.sync", _sync_line)

#: With ``metrics.log_param_digest``: digest of the global parameters after a committed sync.
GLOBAL_DIGEST = EventKind("semi_sync.global_digest", "global_digest sync {sync}: {digest}")
#: With ``metrics.log_param_digest``: digest of the final model (after the last step).
FINAL_DIGEST = EventKind("semi_sync.final_digest", "final_digest: {digest}")


def _final_model_line(v: dict[str, Any], _: bool) -> str:
    if v["closing_sync_steps"]:
        note = f" (after a closing sync of the last {v['closing_sync_steps']} steps)"
    elif v["dropped_inner_steps"] is not None:
        dropped = v["dropped_inner_steps"]
        note = f" (the local progress of the last {dropped} inner step(s) is dropped)"
    else:
        note = ""
    if v["solo_syncs"]:
        shared = v["last_shared_sync"]
        since = "no sync shared" if shared is None else f"the last shared sync is #{shared}"
        lineage = f"; {v['solo_syncs']} sync(s) committed alone ({since})"
    else:
        lineage = ""
    return (
        f"[semi-sync] final model: the global parameters of sync #{v['sync']}{note}{lineage}; "
        f"digest {v['digest']}"
    )


#: After the last step every group holds the global parameters of sync ``sync``. LocalSGD:
#: ``closing_sync_steps`` inner steps averaged by a closing sync (0: none). DiLoCo:
#: ``dropped_inner_steps`` inner steps not in the final model (None: none, no sync in flight).
#: ``last_shared_sync``: the last sync committed with other groups (None: none); ``solo_syncs``:
#: those committed alone since, the first at ``solo_since`` (``time.time()``); ``digest``: of the
#: final model (this rank's shards).
FINAL_MODEL = EventKind("semi_sync.final_model", _final_model_line)

#: The kinds of :data:`OUTER_STATE`'s figures, in the order its line names them.
OUTER_STATE_KINDS = ("global_copy", "period_start", "momentum", "buffers")


def _outer_state_line(v: dict[str, Any], _: bool) -> str:
    held = [
        f"{kind.replace('_', ' ')} {v[kind + '_mib']:.1f} MiB"
        for kind in OUTER_STATE_KINDS
        if v.get(kind + "_mib") is not None
    ]
    return (
        f"[semi-sync] {v['method']} memory of this rank beside the model: {', '.join(held)} "
        f"({v['over_params']:.2f} x the parameters' {v['params_mib']:.1f} MiB)"
    )


#: After the last step, MiB the method held on this rank besides the model and inner optimizer,
#: by kind (None: not held): global copies, async DiLoCo's period start, outer optimizer state
#: (``momentum``; Delayed Nesterov's window sum too) and ``buffers``, the most a running sync
#: holds (pseudo-gradient; async DiLoCo's all-reduce buffer and staging). ``over_params``: their
#: sum over the parameters' bytes (``params_mib``, this rank's shards).
OUTER_STATE = EventKind("semi_sync.outer_state", _outer_state_line)

#: The group committed syncs alone since its last shared one: its final model is a lineage of
#: its own (the launcher names the job's model).
FINISHED_ALONE = EventKind(
    "semi_sync.finished_alone",
    lambda v, _: (
        f"[semi-sync] this group finished ALONE: {v['solo_syncs']} sync(s) committed without "
        "any other group since "
        + ("the start" if v["last_shared_sync"] is None else f"sync #{v['last_shared_sync']}")
        + "; its final model is its own, not necessarily the job's (see the launcher's summary "
        "or docs/fault_tolerance.md, 'Which final model')"
    ),
    logging.WARNING,
)

#: DyLU: this group's periods now take ``steps`` inner steps (of ``period`` for the fastest
#: group), from its speed and the fastest group's in their last periods (0: not measured).
INNER_STEPS_PLANNED = EventKind(
    "semi_sync.inner_steps_planned",
    "[semi-sync] DyLU: periods now take {steps}/{period} inner steps (this group "
    "{ms_per_step:.1f} ms per step, the fastest {fastest_ms_per_step:.1f} ms)",
)

#: DyLU's speed probe planned the rest of a new job's first period, from inner step
#: ``planned_at`` (the group trained on while the probe's quorum formed).
SPEED_PROBE = EventKind(
    "semi_sync.speed_probe",
    "[semi-sync] DyLU speed probe after inner step {after}, planned at step {planned_at}: "
    "the first period takes {steps}/{period} inner steps (this group {ms_per_step:.1f} ms "
    "per step, the fastest {fastest_ms_per_step:.1f} ms)",
)

#: A (re)started group has started its Manager and asks for its first quorum.
ASKING_FOR_QUORUM = EventKind(
    "semi_sync.asking_for_quorum",
    "[semi-sync] asking for a quorum: a new or restarted job meets all its groups, a running "
    "job is joined at its next sync",
)


def _healed_line(v: dict[str, Any], _: bool) -> str:
    line = (
        f"[semi-sync] healed from a live peer (replica group {v['peer']}) at sync #{v['sync']}, "
        f"train step {v['step']}, inner step {v['inner_step']}/{v['period']}"
    )
    if v.get("transfer") == "replay":
        line += (
            f", replaying {v['replayed_syncs']} missed sync(s) onto its own checkpoint "
            f"({v['bytes_received'] / 2**20:.2f} MiB received)"
        )
    elif v.get("transfer") == "full":
        line += f", the full state ({v['bytes_received'] / 2**20:.1f} MiB received"
        line += f": {v['full_because']})" if v.get("full_because") else ")"
    if v["case"] == "newer_checkpoint":
        return f"{line}: a restarted group with a newer checkpoint"
    if v["case"] == "initial_model":
        return f"{line}: the new job's one initial model"
    if v["case"] in ("join_sync", "replay"):
        return (
            f"{line}: joined the running job at its sync point {v['waited_s']:.1f}s after "
            "asking; taking part in this sync"
        )
    return line


#: This group took replica group ``peer``'s state before sync ``sync``, at inner step
#: ``inner_step`` of ``period``. ``case``: ``running`` (a running group that was behind),
#: ``join_sync`` (a starting group healed from the running job at its sync point and takes part
#: in that sync; ``waited_s`` since it asked), ``newer_checkpoint`` (a starting group healed from
#: one with a newer checkpoint), ``initial_model`` (a new job's group took the first group's
#: initial model: its own host drew other bits), ``replay`` (as ``join_sync``, but replaying the
#: syncs it missed onto its own checkpoint). ``transfer``: ``replay`` (``replayed_syncs`` syncs
#: missed since its checkpoint) or ``full`` (every state; ``full_because``: why not a replay);
#: ``bytes_received``: the tensors' bytes; ``receive_s``: request to last arrival (a replay's
#: outer steps overlap).
HEALED = EventKind("semi_sync.healed", _healed_line)

#: This rank's heal history first holds ``syncs`` syncs (its capacity): its memory cost.
HEAL_HISTORY_KEPT = EventKind(
    "semi_sync.heal_history_kept",
    "[semi-sync] heal history: the averages of the last {syncs} syncs kept, {mib:.2f} MiB of "
    "CPU memory on this rank (fault_tolerance.heal_history_syncs)",
)

#: A joiner's replay of its missed syncs failed on arrival (``problem``): nobody commits this
#: sync, and the group heals in full at the next one.
REPLAY_FAILED = EventKind(
    "semi_sync.replay_failed",
    "[semi-sync] the replay of the missed syncs failed ({problem}): this sync is not "
    "committed, and this group heals in full at the next one",
)

#: A starting group is in the job: ``groups`` in its quorum, sync ``sync`` next.
IN_JOB = EventKind(
    "semi_sync.in_job",
    "[semi-sync] in the job with {groups} group(s): sync #{sync} next, train step {step}, "
    "inner step {inner_step}/{period}",
)

#: A starting group's checkpoint is at or beyond the running groups' step: it is dropped.
CHECKPOINT_AHEAD = EventKind(
    "semi_sync.checkpoint_ahead",
    "[semi-sync] this group's checkpoint is at or beyond the running groups' step: it is "
    "dropped; this group heals from them at their next sync",
    logging.WARNING,
)

#: The checkpoint was taken while ``fragment``'s sync was in flight: that sync is dropped.
IN_FLIGHT_SYNC_DROPPED = EventKind(
    "semi_sync.in_flight_sync_dropped",
    "[semi-sync] the checkpoint was taken while fragment {fragment}'s sync was in flight; that "
    "sync is dropped and the fragment restarts from its global parameters",
    logging.WARNING,
)

#: No DiLoCo state was loaded with the model: the global parameters start as the loaded model.
GLOBAL_FROM_LOADED_MODEL = EventKind(
    "semi_sync.global_from_loaded_model",
    "[semi-sync] no DiLoCo state was loaded: the global parameters start as the loaded model, "
    "the outer momentum at zero",
)

#: The agreement check before sync ``sync`` found this group in the minority (``digests``: the
#: distinct digests seen, hex): nobody commits the sync and this group heals at the next one.
DIFFERS_FROM_MAJORITY = EventKind(
    "semi_sync.differs_from_majority",
    lambda v, _: (
        f"[semi-sync] this group's global parameters differ from the majority's before sync "
        f"#{v['sync']} ({'; '.join(v['groups'])}): healing from a majority group at the next "
        "sync"
    ),
    logging.ERROR,
)
#: The agreement check before sync ``sync`` found another group in the minority: nobody
#: commits the sync and that group heals at the next one.
MINORITY_ELSEWHERE = EventKind(
    "semi_sync.minority_elsewhere",
    lambda v, _: (
        f"[semi-sync] a group's global parameters differ from the majority's before sync "
        f"#{v['sync']} ({'; '.join(v['groups'])}): this sync is dropped, that group heals at "
        "the next one"
    ),
    logging.WARNING,
)


def _initial_models_line(v: dict[str, Any], _: bool) -> str:
    line = (
        f"[semi-sync] the groups' initial models differ ({'; '.join(v['groups'])}): their "
        "hosts draw other bits from the same seed; "
        + (
            f"this group takes replica group {v['source']}'s in the next quorum"
            if v["takes_it"]
            else f"every group starts from replica group {v['source']}'s"
        )
    )
    if v["same_host"]:
        line += (
            f". Replica group(s) {', '.join(map(str, v['same_host']))} run the same kind of "
            "host as the source: not the kernels; check that every group runs the same config "
            "and training.seed"
        )
    return line


#: A new job's groups built other initial models from the same seed (their hosts' kernels
#: draw other bits): each whose model differs from replica group ``source``'s takes that one
#: (``takes_it``: this group does) in the next quorum, as a heal from a peer. ``same_host``:
#: the replica ids among them that run the source's kind of host (another cause).
INITIAL_MODELS_DIFFER = EventKind(
    "semi_sync.initial_models_differ", _initial_models_line, logging.WARNING
)

#: The groups of a quorum run different torch minor versions (said once per mix).
TORCH_VERSIONS_DIFFER = EventKind(
    "semi_sync.torch_versions_differ",
    lambda v, _: (
        f"[semi-sync] the replica groups run different torch versions ({'; '.join(v['groups'])})"
        ": the global parameters are computed alike on any, but install one version everywhere "
        "to rule it out if they ever disagree"
    ),
    logging.WARNING,
)

#: A sync carried inf or NaN: in this group's pseudo-gradient (``origin`` "this group", ``group``
#: its replica id) or only in the average ("another group", None). Every group fails the sync;
#: nothing of it reaches the global parameters or an error-feedback residual.
NON_FINITE = EventKind(
    "semi_sync.non_finite",
    lambda v, _: (
        f"[semi-sync] sync #{v['sync']}: fragment {v['fragment']}'s pseudo-gradient was not "
        f"finite in {v['origin']}"
        + (f" (replica group {v['group']})" if v["group"] is not None else "")
        + ": the sync is dropped by every group"
    ),
    logging.ERROR,
)

#: A collective of sync ``sync`` ran past ``fault_tolerance.sync_collective_timeout_s``
#: (``message`` names the field and the payload); ``in_a_row``: such syncs in a row.
COLLECTIVE_TIMEOUT = EventKind(
    "semi_sync.collective_timeout",
    "[semi-sync] sync #{sync} NOT committed: {message}",
    logging.ERROR,
)

#: The lighthouse dropped a group of sync ``sync``'s quorum mid-transfer: the sync ended then,
#: not at ``sync_collective_timeout_s`` (``message``: the group, how long the transfers ran).
PEER_GONE = EventKind(
    "semi_sync.peer_gone",
    "[semi-sync] sync #{sync} NOT committed: {message}",
    logging.WARNING,
)

#: No checkpoint of this group passed its checksums (``problem``: the newest one's first bad
#: file): the group starts without one and heals in full from a peer at its first quorum.
OWN_CHECKPOINT_REJECTED = EventKind(
    "semi_sync.own_checkpoint_rejected",
    "[semi-sync] no checkpoint of this group passed its checksums ({problem}): it starts "
    "without one and heals in full from a peer",
    logging.WARNING,
)

#: Sites of groups: ``leader`` (a group's number in site ``site``) carries the site's syncs from
#: this sync point on, since ``previous`` is not in the site's last step quorum (``groups``).
SITE_LEADER = EventKind(
    "semi_sync.site_leader",
    "[semi-sync] site {site}: group {leader} carries the site's syncs now (group {previous} "
    "is gone; {groups} group(s) in the site)",
    logging.WARNING,
)

#: A group of site ``site`` lacks the result of the site's last sync (its leader's share did
#: not arrive, or the leader healed from another site): it heals from a group of its site at the
#: next step (its site Manager's step stays at ``site_step``, the others' move one up).
SITE_FELL_BEHIND = EventKind(
    "semi_sync.site_fell_behind",
    "[semi-sync] site {site}: group {group} lacks the site's last sync and heals from its site "
    "at the next step",
    logging.WARNING,
)
