"""Worker processes for tensor parallelism: rank 0 schedules and samples, the others follow.

Rank 0 is the engine's own process. It starts ``tp - 1`` worker processes (fresh interpreters),
hands them the full weights once (a file in shared memory that each maps), and every rank keeps
only its slice
(:func:`infer_lab.model.tensor_parallel.shard_model`). From then on each forward on rank 0 first
sends the step's inputs — token ids, positions and the flattened batch (slot mapping, block tables,
context lengths) — down a pipe to every worker, and all ranks run the same forward, meeting in the
all-reduces and the logits all-gather (``torch.distributed``: gloo on CPU, NCCL on CUDA). Each
rank writes and reads its own KV heads in its own paged cache, with the same block tables.

The step inputs travel by pipe rather than by a collective so that an idle worker can wake up
once a second to see whether rank 0 is still alive: a worker whose parent is gone exits, a
worker that dies makes rank 0 raise :class:`WorkerDiedError` on its next step (and the
collectives carry a timeout), so nothing hangs and no process is orphaned.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from typing import Any

import torch
import torch.distributed as dist

from infer_lab import settings
from infer_lab.cache.paged import PagedAttentionContext, PagedKVCache
from infer_lab.model.config import ModelConfig
from infer_lab.model.tensor_parallel import TensorParallelTransformer, check_tp_size, shard_model
from infer_lab.model.transformer import Transformer

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
START_TIMEOUT_S = 300.0  # loading and sharding the weights in every worker


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot go on without it."""


@dataclass
class _CacheSpec:
    key: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype


class TensorParallelDriver(TensorParallelTransformer):
    """Rank 0's model: every forward is mirrored on the workers before it runs here."""

    tp_workers: TensorParallelWorkers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                ctx: Any = None, *, last_only: bool = False) -> torch.Tensor:
        self.tp_workers.send_forward(input_ids, positions, ctx, last_only)
        return super().forward(input_ids, positions, ctx, last_only=last_only)


class TensorParallelWorkers:
    """Rank 0's handle on the worker processes: start, mirror each step, shut down."""

    _active: TensorParallelWorkers | None = None

    def __init__(self, procs: list[Any], pipes: list[Any], device: torch.device) -> None:
        self.procs, self.pipes, self.device = procs, pipes, device
        self.caches: dict[int, _CacheSpec] = {}
        self.closed = False

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, model: Transformer, tp: int, backend: str | None = None
              ) -> TensorParallelDriver:
        """Shard ``model`` in place as rank 0 of ``tp`` and start the other ranks."""
        check_tp_size(model.config, tp)
        if cls._active is not None and not cls._active.closed:
            raise RuntimeError("one tensor-parallel engine per process at a time: shut the "
                               "other down first")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        device = model.device
        # One GPU per rank where there are enough (NCCL); otherwise every rank on rank 0's device
        # over gloo, which also takes CUDA tensors (how the one-GPU machine runs tp 2).
        spread = device.type == "cuda" and torch.cuda.device_count() >= tp
        backend = backend or settings.TP_BACKEND.get() or (
            "nccl" if spread else "gloo")
        worker_device = [f"cuda:{r}" if spread else str(device) for r in range(tp)]
        init = f"tcp://127.0.0.1:{_free_port()}"
        tmp, weights = _weights_file(model)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = dict(os.environ, INFER_LAB_TP_AUTHKEY=authkey.hex())
        procs = [subprocess.Popen(
            [sys.executable, "-m", "infer_lab.engine.tensor_parallel", str(rank), str(tp), init,
             backend, worker_device[rank], weights, f"{listener.address[0]}:{listener.address[1]}",
             str(os.getpid())], env=env) for rank in range(1, tp)]
        workers = cls(procs, [None] * (tp - 1), device)
        try:
            workers._accept(listener)
            dist.init_process_group(backend, init_method=init, rank=0, world_size=tp,
                                    timeout=COLLECTIVE_TIMEOUT)
            for i in range(tp - 1):
                workers._expect(i, "ready", START_TIMEOUT_S)
        except BaseException:
            workers.shutdown()
            raise
        finally:
            listener.close()
            shutil.rmtree(tmp, ignore_errors=True)
        driver = shard_model(model, 0, tp)
        driver.__class__ = TensorParallelDriver
        driver.tp_workers = workers
        cls._active = workers
        atexit.register(workers.shutdown)
        return driver  # type: ignore[return-value]

    def _accept(self, listener: Listener) -> None:
        """Take each worker's connection, failing fast if a worker dies before it calls."""
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.extend(
            listener.accept() for _ in self.procs), daemon=True)
        thread.start()
        waited = 0.0
        while thread.is_alive():
            thread.join(1.0)
            waited += 1.0
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or waited > START_TIMEOUT_S:
                why = (f"exited with code {dead[0].returncode}" if dead else
                       f"did not connect within {START_TIMEOUT_S:.0f} s")
                raise WorkerDiedError(f"a tensor-parallel worker {why} while starting")
        for conn in done:
            rank = conn.recv()[1]
            self.pipes[rank - 1] = conn

    # ------------------------------------------------------------------ steps
    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, ctx: Any,
                     last_only: bool) -> None:
        self.check_alive()
        batch = backend = cache_spec = None
        if ctx is not None:
            if not isinstance(ctx, PagedAttentionContext):
                raise TypeError(f"tensor parallelism runs the paged backend, not "
                                f"{type(ctx).__name__}")
            batch, backend = _to_cpu(ctx.batch), ctx.backend
            cache_spec = self._cache_spec(ctx.cache)
        msg = ("forward", input_ids.cpu(), None if positions is None else positions.cpu(),
               cache_spec, batch, backend, last_only)
        self._broadcast(msg)

    def copy_blocks(self, cache: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
        """Mirror a copy-on-write of blocks (rank 0 copies its own cache itself)."""
        if pairs:
            self._broadcast(("copy", self._cache_spec(cache), list(pairs)))

    def _cache_spec(self, cache: PagedKVCache) -> _CacheSpec:
        spec = self.caches.get(id(cache))
        if spec is None:
            spec = _CacheSpec(id(cache), cache.num_blocks, cache.block_size, cache.kv.dtype)
            self.caches[id(cache)] = spec
        return spec

    def _broadcast(self, msg: tuple) -> None:
        # Plain pickle: torch's own reductions for multiprocessing would pass shared-memory file
        # descriptors, which only work between a parent and children it started itself.
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for i, (pipe, p) in enumerate(zip(self.pipes, self.procs)):
            try:
                pipe.send_bytes(payload)
            except (BrokenPipeError, ConnectionError, EOFError, OSError) as e:
                raise WorkerDiedError(f"tensor-parallel worker {i + 1} is gone "
                                      f"(exit code {p.poll()})") from e

    def check_alive(self) -> None:
        if self.closed:
            raise WorkerDiedError("the tensor-parallel workers were shut down")
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise WorkerDiedError(f"tensor-parallel worker {i + 1} exited with code "
                                      f"{p.returncode}")

    def _expect(self, i: int, what: str, timeout: float) -> None:
        pipe, proc, waited = self.pipes[i], self.procs[i], 0.0
        while not pipe.poll(1.0):
            waited += 1.0
            if proc.poll() is not None:
                raise WorkerDiedError(f"tensor-parallel worker {i + 1} exited with code "
                                      f"{proc.returncode} before it was {what}")
            if waited >= timeout:
                raise WorkerDiedError(f"tensor-parallel worker {i + 1} not {what} after "
                                      f"{timeout:.0f} s")
        reply = pipe.recv()
        if reply[0] != what:
            raise WorkerDiedError(f"tensor-parallel worker {i + 1} failed:\n{reply[1]}")

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        for pipe in self.pipes:
            with contextlib.suppress(Exception):
                pipe.send_bytes(pickle.dumps(("stop",)))
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for pipe in self.pipes:
            with contextlib.suppress(Exception):
                pipe.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if TensorParallelWorkers._active is self:
            TensorParallelWorkers._active = None


def _weights_file(model: Transformer) -> tuple[str, str]:
    """The weights go to the workers once, through a file in memory (/dev/shm where there is
    one) that each maps; workers are fresh interpreters (no fork of a threaded process, and no
    re-import of the caller's script as multiprocessing's spawn would do)."""
    tmp = tempfile.mkdtemp(prefix="infer-lab-tp-", dir="/dev/shm" if os.path.isdir(
        "/dev/shm") else None)
    weights = os.path.join(tmp, "weights.pt")
    torch.save({"config": model.config, "dtype": model.dtype,
                "state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}, weights)
    return tmp, weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(batch: Any) -> Any:
    """A copy of a dataclass of tensors with every tensor on the CPU (to pickle it cheaply)."""
    import dataclasses

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return type(batch)(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                          for k, v in fields.items()})


def _to_device(batch: Any, device: torch.device) -> Any:
    import dataclasses

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return type(batch)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                          for k, v in fields.items()})


def _worker_main(rank: int, tp: int, init: str, backend: str, device: str, weights: str,
                 address: str, parent: int) -> None:
    """One worker: build its slice, then mirror rank 0's forwards until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    torch.set_num_threads(max(1, torch.get_num_threads() // tp))
    host, port = address.rsplit(":", 1)
    pipe = Client((host, int(port)), authkey=settings.TP_AUTHKEY.get())
    pipe.send(("hello", rank))
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp,
                                timeout=COLLECTIVE_TIMEOUT)
        saved = torch.load(weights, mmap=True, weights_only=False)
        model = Transformer.empty(saved["config"], dev, saved["dtype"])
        model.load_state_dict(saved["state"], strict=True)
        del saved
        model = shard_model(model, rank, tp)
        model.eval()
        pipe.send(("ready",))
    except Exception:  # report to rank 0 rather than leave it waiting
        pipe.send(("error", traceback.format_exc(limit=3)))
        return
    caches: dict[int, PagedKVCache] = {}
    with torch.inference_mode():
        while True:
            if not pipe.poll(1.0):
                if os.getppid() != parent:
                    break  # rank 0 is gone: do not outlive it
                continue
            try:
                msg = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):
                break
            if msg[0] == "stop":
                break
            if msg[0] == "copy":
                _cache(caches, msg[1], model.config, dev).copy_blocks(msg[2])
                continue
            _, ids, pos, spec, batch, be, last_only = msg
            ctx = None
            if batch is not None:
                cache = _cache(caches, spec, model.config, dev)
                ctx = PagedAttentionContext(cache, _to_device(batch, dev), backend=be)
            model(ids.to(dev), None if pos is None else pos.to(dev), ctx, last_only=last_only)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _cache(caches: dict[int, PagedKVCache], spec: _CacheSpec, cfg: ModelConfig,
           device: torch.device) -> PagedKVCache:
    cache = caches.get(spec.key)
    if cache is None:
        cache = PagedKVCache(cfg, spec.num_blocks, spec.block_size, device, spec.dtype)
        caches[spec.key] = cache
    return cache


if __name__ == "__main__":
    r, n, init_, be_, dev_, w_, addr_, parent_ = sys.argv[1:9]
    _worker_main(int(r), int(n), init_, be_, dev_, w_, addr_, int(parent_))
