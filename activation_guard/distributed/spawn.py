"""Run a function on N ranks of a fresh CPU process group (gloo), from a plain pytest run or a script.

So a CI without GPUs or ``torchrun`` can gate parallelism refactors::

    from activation_guard.distributed.spawn import run_distributed

    def check_tp(width: int) -> dict:        # module level: every rank imports it by name
        rank = torch.distributed.get_rank()  # the default process group is initialized
        ...
        return {"rank": rank, "ok": report.ok}

    def test_tp():
        assert all(r["ok"] for r in run_distributed(check_tp, world_size=2, args=(16,)))

Each rank is a fresh ``python -m activation_guard.distributed.spawn`` subprocess that imports ``fn`` by module
and name (with the caller's ``sys.path``), joins a gloo group through a ``FileStore`` in a temporary
folder (no port to find, nothing left behind), calls ``fn(*args, **kwargs)`` and returns its
value as JSON. Arguments and results travel as JSON, never pickle. The call returns the ranks'
values in rank order, or raises :class:`DistributedRunError` carrying every failed rank's
traceback and output. It never hangs: once a rank fails the others get ``grace`` seconds (to fail
on their own, typically a peer-closed error) and are then killed; past ``timeout`` all are.

Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` as under torchrun,
and ``OMP_NUM_THREADS`` = cores // world_size unless set, so ranks do not oversubscribe the CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Callable

OUTPUT_TAIL = 4000  # characters of a failed rank's output kept in the error


class DistributedRunError(RuntimeError):
    """One or more ranks failed. ``failures`` maps rank -> its error text with traceback,
    ``outputs`` rank -> the tail of its stdout and stderr."""

    def __init__(self, message: str, failures: dict[int, str], outputs: dict[int, str]):
        super().__init__(message)
        self.failures = failures
        self.outputs = outputs


class DistributedTimeout(DistributedRunError):
    """The ranks did not all finish within ``timeout``."""


def _locate(fn: Callable[..., Any] | str) -> tuple[str, str, str | None]:
    if isinstance(fn, str):
        module, sep, qualname = fn.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"run_distributed: a function given by name is 'module:qualname', got {fn!r}")
        return module, qualname, None
    mod_name, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(mod_name, str) or not isinstance(qual, str):
        raise TypeError(f"run_distributed needs a function, got {fn!r}")
    module, qualname = mod_name, qual
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_distributed: {qualname} is not a module-level function; each rank imports the "
                        "function by name, so define it at the top level of a module")
    code = getattr(fn, "__code__", None)
    return module, qualname, None if code is None else code.co_filename


def _json_or_error(what: str, value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise TypeError(f"run_distributed {what} must be JSON values (they travel to the ranks as JSON): {e}") from None


def run_distributed(
    fn: Callable[..., Any] | str,
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    grace: float = 10.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``fn`` is a module-level function (or ``"module:qualname"``); ``args``, ``kwargs`` and its
    return value are JSON values. The process group's own timeout is ``timeout`` too, so a rank
    blocked in a collective whose peer died also gives up by itself. ``env`` adds environment
    variables for the ranks.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be a positive int, got {world_size!r}")
    if timeout <= 0 or grace < 0:
        raise ValueError(f"run_distributed: timeout must be > 0 and grace >= 0, got {timeout!r}, {grace!r}")
    module, qualname, file = _locate(fn)
    a = _json_or_error("args", list(args))
    kw = _json_or_error("kwargs", dict(kwargs or {}))
    work = tempfile.mkdtemp(prefix="ag-dist-")
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        base_env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        base_env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [base_env.get("PYTHONPATH")])])
        base_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
        base_env.update(env or {})
        for rank in range(world_size):
            spec = {
                "module": module, "qualname": qualname, "file": file, "sys_path": list(sys.path),
                "rank": rank, "world_size": world_size, "backend": backend, "timeout": timeout,
                "store": os.path.join(work, "store"), "args": a, "kwargs": kw,
                "result": os.path.join(work, f"result{rank}.json"),
            }
            spec_path = os.path.join(work, f"spec{rank}.json")
            with open(spec_path, "w", encoding="utf-8") as f:
                json.dump(spec, f)
            renv = dict(base_env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world_size))
            log = open(os.path.join(work, f"out{rank}.txt"), "wb")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "activation_guard.distributed.spawn", spec_path],
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=renv, cwd=os.getcwd()))
        order, stopped, timed_out = _wait_all(procs, timeout, grace)
        for log in logs:
            log.close()
        return _collect(work, procs, order, stopped, timed_out, timeout, grace)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        shutil.rmtree(work, ignore_errors=True)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float, grace: float) -> tuple[list[int], list[int], bool]:
    """Wait for the ranks (a thread per process, no polling); return the ranks in exit order,
    the ranks killed, and whether the overall timeout fired."""
    q: queue.Queue[int] = queue.Queue()
    def watch(rank: int, p: subprocess.Popen[bytes]) -> None:
        p.wait()
        q.put(rank)

    for rank, p in enumerate(procs):
        threading.Thread(target=watch, args=(rank, p), daemon=True).start()
    deadline = time.monotonic() + timeout
    order: list[int] = []
    failed_at: float | None = None
    timed_out = False
    while len(order) < len(procs):
        now = time.monotonic()
        until = deadline if failed_at is None else min(deadline, failed_at + grace)
        try:
            rank = q.get(timeout=max(0.0, until - now))
        except queue.Empty:
            timed_out = until == deadline
            break
        order.append(rank)
        if procs[rank].returncode != 0 and failed_at is None:
            failed_at = time.monotonic()
    stopped = [r for r in range(len(procs)) if r not in order]
    for r in stopped:
        procs[r].kill()
        procs[r].wait()
    return order, stopped, timed_out


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return text[-OUTPUT_TAIL:]


def _collect(work: str, procs: list[subprocess.Popen[bytes]], order: list[int], stopped: list[int],
             timed_out: bool, timeout: float, grace: float) -> list[Any]:
    n = len(procs)
    outputs = {r: _tail(os.path.join(work, f"out{r}.txt")) for r in range(n)}
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    for r in range(n):
        try:
            with open(os.path.join(work, f"result{r}.json"), encoding="utf-8") as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = None
        if r in stopped:
            why = f"still running after {timeout:g} s" if timed_out else f"killed {grace:g} s after another rank failed"
            failures[r] = why
        elif isinstance(res, dict) and res.get("ok") is True:
            values[r] = res.get("value")
        elif isinstance(res, dict):
            failures[r] = f"{res.get('error')}\n{res.get('traceback', '')}".rstrip()
        else:
            failures[r] = f"exited with code {procs[r].returncode} without a result"
    if not failures:
        for r in range(n):
            if outputs[r].strip():
                sys.stderr.write(f"--- rank {r} output ---\n{outputs[r]}\n")
        return [values[r] for r in range(n)]
    # the rank that failed first is the likely cause; later failures are often its consequence
    ranked = [r for r in order if r in failures] + [r for r in stopped if r not in order]
    head = failures[ranked[0]].splitlines()[0] if failures[ranked[0]] else ""
    lines = [f"run_distributed: {len(failures)} of {n} ranks failed; first: rank {ranked[0]}: {head}"]
    for r in ranked:
        lines.append(f"--- rank {r}: {failures[r]}")
        if outputs[r].strip():
            lines.append(f"--- rank {r} output (tail) ---\n{outputs[r].rstrip()}")
    cls = DistributedTimeout if timed_out else DistributedRunError
    raise cls("\n".join(lines), failures, outputs)


# --------------------------------------------------------------------------- rank side


def _load(module: str, qualname: str, file: str | None) -> Callable[..., Any]:
    mod: Any
    if module == "__main__" and file:
        mod = _load_file("__ag_main__", file)
    else:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            if not file:
                raise
            mod = _load_file(module, file)  # e.g. pytest's --import-mode=importlib names
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _load_file(name: str, file: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _rank_main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    rank, world = int(spec["rank"]), int(spec["world_size"])
    try:
        import torch
        import torch.distributed as dist

        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        fn = _load(spec["module"], spec["qualname"], spec.get("file"))
        store = dist.FileStore(spec["store"], world)
        dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=float(spec["timeout"])))
        try:
            value = fn(*spec["args"], **spec["kwargs"])
        finally:
            dist.destroy_process_group()
        out = json.dumps({"ok": True, "value": value}, allow_nan=True)
    except BaseException as e:  # reported to the caller, who decides
        out = json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        code = 1
    else:
        code = 0
    tmp = spec["result"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(out)
    os.replace(tmp, spec["result"])
    return code


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
