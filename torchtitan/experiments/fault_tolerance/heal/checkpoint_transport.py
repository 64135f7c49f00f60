"""torchft's process-group checkpoint transport, with one request from the joiner before the
peer sends: what is sent, and what the joiner does with it, is ``exchange``'s.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ProcessGroup

from torchtitan.components.ft.streams import side_stream
from torchtitan.experiments.fault_tolerance.heal.exchange import (
    HEAL_KEY,
    HealAnswer,
    HealExchange,
    HealTransferError,
)
from torchtitan.experiments.fault_tolerance.heal.history import (
    BASIS_SLOTS,
    HistoryEntry,
    ReplayBasis,
)
from torchtitan.experiments.fault_tolerance.heal.pieces import PiecewiseGroup

#: The process-group tag of the joiner's request (torchft's transport uses 1 and up).
_REQUEST_TAG = 0
#: A replay's first payload's tag, the next counting up: clear of torchft's (1, 2, one per tensor).
_PAYLOAD_TAG = 1 << 20
#: A request's first slot when the joiner refuses the heal (another shape): nothing is sent.
_REFUSED = 0x5EA1_0BAD


def all_at_once(jobs: list[Callable[[], None]], device: torch.device) -> None:
    """Run ``jobs`` at the same time, each on a thread and a stream of its own (one alone on
    this thread); raise the first error any of them raised, once all have ended."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            with side_stream(device):
                job()
        except BaseException as e:  # raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def build_history_transport(exchange: HealExchange) -> Callable[..., Any]:
    """The factory ``FTManager.start`` takes: heals answered and received through this rank's
    ``exchange``."""
    from torchft.checkpointing.pg_transport import PGTransport

    class HistoryTransport(PGTransport):
        def metadata(self) -> str:
            """What torchft hands a joiner before it heals from this rank: its shape."""
            shape = exchange.shape
            return super().metadata() if shape is None else shape.to_text()

        def send_checkpoint(
            self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
        ) -> None:
            # Every joiner's request first (a few numbers each), then one send per distinct
            # answer to all the joiners it is for, as torchft sends one state to all of them;
            # distinct answers at once, so that no joiner's first piece waits for another's
            # whole transfer (each piece's wait is bounded by the heal's timeout).
            answers: dict[str, tuple[HealAnswer, list[int]]] = {}
            with self._pg.heal():
                for dst in dst_ranks:
                    request = torch.zeros(BASIS_SLOTS, dtype=torch.int64, device=self._device)
                    self._pg.recv([request], dst, tag=_REQUEST_TAG).wait(timeout)
                    if int(request[0]) == _REFUSED:  # its collectives cannot pair with ours
                        continue
                    basis = ReplayBasis.from_tensor(request)
                    answer = exchange.answer(basis, step, state_dict)
                    answers.setdefault(repr(answer.key), (answer, []))[1].append(dst)
                all_at_once(
                    [functools.partial(self._send_answer, answer, dsts, step, timeout)
                     for answer, dsts in answers.values()],
                    self._device,
                )  # fmt: skip

        def _send_answer(
            self, answer: HealAnswer, dsts: list[int], step: int, timeout: timedelta
        ) -> None:
            super().send_checkpoint(dsts, step, answer.state, timeout)
            self._send_payloads(dsts, answer.payloads, timeout)

        def _send_payloads(
            self, dsts: list[int], payloads: list[torch.Tensor], timeout: timedelta
        ) -> None:
            works = []
            for i, payload in enumerate(payloads):
                t = payload.to(self._device).contiguous()
                works += [self._pg.send([t], dst, tag=_PAYLOAD_TAG + i) for dst in dsts]
                if t.data_ptr() != payload.data_ptr():  # a copy: let it go before the next
                    for work in works:
                        work.wait(timeout)
                    works = []
            for work in works:
                work.wait(timeout)

        def recv_checkpoint(
            self, src_rank: int, metadata: str, step: int, timeout: timedelta
        ) -> Any:
            with self._pg.heal():
                started = time.perf_counter()
                refused = exchange.refusal(metadata)
                if refused:  # tell the peer (it waits for a request), take nothing
                    request = torch.zeros(BASIS_SLOTS, dtype=torch.int64, device=self._device)
                    request[0] = _REFUSED
                    self._pg.send([request], src_rank, tag=_REQUEST_TAG).wait(timeout)
                    exchange.refused(refused)
                    raise HealTransferError(f"heal refused: {refused}")
                request = exchange.basis.to_tensor(self._device)
                self._pg.send([request], src_rank, tag=_REQUEST_TAG).wait(timeout)
                state = super().recv_checkpoint(src_rank, metadata, step, timeout)
                entries = state["user"].get(HEAL_KEY, {}).get("entries", [])
                specs = [spec for e in entries for spec in HistoryEntry.payload_specs(e)]
                payloads = self._receive_payloads(src_rank, specs, timeout)
                return exchange.received(state, payloads, started)

        def _receive_payloads(
            self, src_rank: int, specs: list[tuple[int, torch.dtype]], timeout: timedelta
        ) -> Iterator[torch.Tensor]:
            """The payloads in order, each received while the ones before it are replayed. Into
            host memory (gloo) every receive is posted at once, so the peer sends at the link's
            pace (the joiner keeps every payload in its history anyway); on an accelerator, two
            at most (torchft's nccl wait synchronizes the device: transfer and replay alternate)."""
            window = len(specs) if self._device.type == "cpu" else 2
            posted: deque[tuple[torch.Tensor, Any]] = deque()

            def failed(i: int, e: Exception) -> HealTransferError:
                return HealTransferError(
                    f"payload {i + 1} of {len(specs)} of the replay did not arrive: {e}"
                )

            ahead = 0  # the next payload to post
            for i in range(len(specs)):
                while ahead < len(specs) and ahead - i < window:
                    numel, dtype = specs[ahead]
                    try:
                        t = torch.empty(numel, dtype=dtype, device=self._device)
                        posted.append((t, self._pg.recv([t], src_rank, tag=_PAYLOAD_TAG + ahead)))
                    except Exception as e:
                        raise failed(ahead, e) from e
                    ahead += 1
                t, work = posted.popleft()
                try:
                    work.wait(timeout)
                except Exception as e:
                    raise failed(i, e) from e
                yield t.to("cpu")

    def build(pg: ProcessGroup, timeout: timedelta, device: torch.device) -> Any:
        # Both ends of every heal in bounded pieces (heal.pieces: c10d's watchdog counts an
        # operation from its queueing, and torchft queues a whole state's sends at once).
        return HistoryTransport(PiecewiseGroup(pg, timeout), timeout=timeout, device=device)

    return build
