"""The pytest layer in a multi-rank run (``torchrun --nproc-per-node N -m pytest``).

Every rank is a whole pytest run. Each check uses this rank's goldens (records
``<golden>.rank<r>-of-<w>.h5``; compares with it, or with a single-device ``<golden>.h5``), then
posts its verdict to the process group's key-value store; rank 0 waits for every rank's verdict
of that check, with a timeout, and fails its own test when any rank failed, naming the first
divergence across ranks. At the end ranks > 0 post their session (the JSON an xdist worker sends)
and rank 0 merges them and prints the one summary. Only the store is used, never a collective, so
a rank that failed, or died, costs the others at most the timeout, never a hang.

Imported on the first check (torch is loaded by then), never at pytest start-up.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest
import torch

from ..api.rank_summary import MergedVerdict, RankVerdict, default_store, error_verdict, exchange, verdict_of
from ..distributed.ranks import RankInfo, rank_golden_path, rank_info, resolve_golden_path
from .session import CheckRecord, GuardSession

if TYPE_CHECKING:
    from ..report.report import Report

SESSION_KEY = "activation_guard/session"
OK_STATUSES = ("passed", "written", "deferred")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class RankContext:
    """This rank's place, the store verdicts travel through, and how long rank 0 waits."""

    info: RankInfo
    store: Any
    timeout: float
    checks: Counter[tuple[str, str | None]] = field(default_factory=Counter)

    @property
    def follower(self) -> bool:
        """Ranks > 0 send their results to rank 0, which reports."""
        return self.info.rank != 0

    def golden_paths(self, path: Path, *, updating: bool = False) -> tuple[Path, Path]:
        """(the golden a record writes, the golden a compare reads) for a check's plain path.
        ``updating``: goldens are being written (``--ag-update``): ranks write theirs at their own
        pace, so the ranks' files are not held to one kind yet."""
        compare, _ = resolve_golden_path(path, self.info, agree=not updating)
        return rank_golden_path(path, self.info), Path(compare)

    def gate(self, session: GuardSession, nodeid: str, name: str | None, run: Callable[[], Any],
             last_report: Callable[[], Report | None]) -> Any:
        """Run one check on this rank, post its verdict, and on rank 0 fail unless every rank passed."""
        __tracebackhide__ = True
        self.checks[(nodeid, name)] += 1
        tag = f"check/{nodeid}/{name or ''}/{self.checks[(nodeid, name)]}"
        before = len(session.records)
        failed = None
        try:
            out = run()
        except BaseException as e:
            rec = session.records[before] if len(session.records) > before else None
            merged = self._exchange(self._verdict(rec, last_report(), e), tag)
            if merged is None or isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if not isinstance(e, pytest.fail.Exception):
                if hasattr(e, "add_note"):
                    e.add_note(merged.message())
                raise
            failed = f"{e.msg}\n\n{merged.message()}"
        if failed is not None:  # rank 0's own failure, with every rank's verdict (outside the except: one text)
            pytest.fail(failed, pytrace=False)
        rec = session.records[before] if len(session.records) > before else None
        merged = self._exchange(self._verdict(rec, last_report(), None), tag)
        if merged is not None and not merged.ok:
            pytest.fail(f"activation_guard: this check passed on rank 0 but not on every rank of "
                        f"{self.info.world_size}:\n{merged.message()}", pytrace=False)
        return out

    def _verdict(self, rec: CheckRecord | None, report: Report | None, exc: BaseException | None) -> RankVerdict:
        info = self.info
        if rec is not None:
            rec.rank = info.rank
            if rec.status == "diverged" and report is not None:
                return verdict_of(report, info)
            layers = 0 if report is None else report.live_count
            if rec.status in OK_STATUSES:
                return RankVerdict(info.rank, info.world_size, True, rec.golden, layers)
            first_line = (rec.message or "").splitlines()[0] if rec.message else ""
            return RankVerdict(info.rank, info.world_size, False, rec.golden, layers,
                               error=f"{rec.status}: {first_line}"[:600])
        if isinstance(exc, pytest.fail.Exception):
            return RankVerdict(info.rank, info.world_size, False, error=str(exc.msg).splitlines()[0][:600])
        return error_verdict(exc or RuntimeError("no verdict"), info)

    def _exchange(self, verdict: RankVerdict, tag: str) -> MergedVerdict | None:
        try:
            return exchange(verdict, tag=tag, timeout=self.timeout, store=self.store)
        except RuntimeError as e:  # the store itself is gone: say so, never hang or hide the check's outcome
            raise RuntimeError(f"activation_guard: could not exchange this check's verdict between ranks: {e}") \
                from e

    # ------------------------------------------------------------------ end of session
    def send_session(self, session: GuardSession) -> None:
        """Ranks > 0: post this rank's checks and bookkeeping for rank 0 to merge."""
        self.store.set(f"{SESSION_KEY}/{self.info.rank}", session.to_worker_output())

    def merge_sessions(self, session: GuardSession) -> None:
        """Rank 0: wait (up to the timeout) for every other rank's session and merge it."""
        keys = {r: f"{SESSION_KEY}/{r}" for r in range(1, self.info.world_size)}
        with contextlib.suppress(RuntimeError):  # a silent rank: reported as lost below
            self.store.wait(list(keys.values()), datetime.timedelta(seconds=self.timeout))
        for r, k in keys.items():
            raw = self.store.get(k).decode("utf-8") if self.store.check([k]) else None
            session.merge_worker_output(raw, f"rank {r}")


def rank_context(session: GuardSession) -> RankContext | None:
    """The session's :class:`RankContext` once a check runs in a multi-rank process group, else None."""
    if session.ranks is not None:
        return session.ranks  # type: ignore[no-any-return]
    info = rank_info()
    if info is None or info.world_size == 1:
        return None
    session.ranks = RankContext(info, default_store(), session.settings.rank_timeout)
    return session.ranks  # type: ignore[no-any-return]


@contextlib.contextmanager
def process_group(timeout: float) -> Iterator[Any]:
    """The default process group under torchrun: created from torchrun's environment when the run
    has none (gloo; nccl too when CUDA is available, each rank on the GPU of its ``LOCAL_RANK``,
    made its current device) and destroyed on exit; an existing one is used as is. None outside
    torchrun without a process group."""
    dist = torch.distributed
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    if not all(k in os.environ for k in TORCHRUN_ENV):
        yield None
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    extra: dict[str, Any] = {}
    local = os.environ.get("LOCAL_RANK", "")
    if torch.cuda.is_available() and local.isdigit() and int(local) < torch.cuda.device_count():
        # one GPU per rank, as torchrun lays them out: without it every rank's "cuda" is cuda:0
        # and NCCL refuses two ranks on one device
        torch.cuda.set_device(int(local))
        extra["device_id"] = torch.device("cuda", int(local))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **extra)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
