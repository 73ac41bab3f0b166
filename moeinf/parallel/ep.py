"""Expert parallelism on torch.distributed: every rank holds a share of the experts, rank 0 leads.

    torchrun --nproc-per-node 2 -m moeinf serve MODEL --device-cache 60%

Each rank builds the same offloaded model (dense weights replicated, its own engine, tiers and cache) and
owns the experts of an owner map (`moeinf.parallel.placement`). Rank 0 runs the model; the other ranks run
`follow`, a loop that serves their experts. One MoE layer on rank 0:

    route -> plan (rank 0's predictors, for every rank)
      -> broadcast   hidden states, routing, the plan and the batch EAM to every rank
      -> compute     each rank its own experts' (token, slot) rows, prefetching and evicting its own cache
      -> send back   each rank's rows to rank 0 (point to point)
      -> combine     rank 0 reduces all rows exactly as on one machine (`ExpertOutputs.result`)

Every (token, slot) row is computed by one rank with the same `Dispatch` (same row order, so the same
matmul blocking) as a single process would use, and rank 0 sums the rows itself, so the logits are
`torch.equal` to a single-process run: no collective ever adds two floats. Tensors travel as bytes
(any dtype), control messages as JSON (no pickle).

A rank that dies ends the others: gloo reports a closed connection at the next exchange, which becomes
`EPError` on rank 0 (one line from the CLI) and a one-line exit on the followers; `ep_timeout` bounds a
rank that hangs without dying.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..hf.adapters import ADAPTERS
from ..policy import EvictionContext, Key
from ..spec import spec_for
from .placement import balanced, round_robin

log = logging.getLogger(__name__)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
OP_LAYER, OP_CONTROL = 1, 2
HEADER = 9  # int64 fields of a layer header: op, layer, T, k, H, hidden dtype, weight dtype, plan, budget


class EPError(RuntimeError):
    """An expert-parallel rank stopped answering (died, or hung past `ep_timeout`)."""


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) when not launched by it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_follower() -> bool:
    rank, size = world()
    return size > 1 and rank > 0


def is_leader() -> bool:
    rank, size = world()
    return size > 1 and rank == 0


def init_group(timeout_s: float) -> None:
    """Join the process group of torchrun's environment (gloo on CPU, NCCL is not used: tensors are
    exchanged from host memory)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


# --- transport ------------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _broadcast_tensor(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank 0 sends `t`; the others receive a tensor of `shape` and `dtype`."""
    if dist.get_rank() == 0:
        assert t is not None
        buf = _bytes(t)
    else:
        buf = torch.empty(int(np.prod(shape)) * dtype.itemsize, dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return buf.view(dtype).reshape(shape)


def _send_json(obj: Any, dst: int | None = None) -> None:
    """Broadcast (dst None, from rank 0) or send a JSON message."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    if dst is None:
        dist.broadcast(size, src=0)
        dist.broadcast(payload, src=0)
    else:
        dist.send(size, dst)
        dist.send(payload, dst)


def _recv_json(src: int | None = None) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    if src is None:
        dist.broadcast(size, src=0)
    else:
        dist.recv(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    if src is None:
        dist.broadcast(payload, src=0)
    else:
        dist.recv(payload, src)
    return json.loads(bytes(payload.numpy()).decode())


# --- placement ------------------------------------------------------------------------------------------
def make_owner(placement: str, num_layers: int, num_experts: int, ranks: int,
               eams: np.ndarray | None) -> np.ndarray:
    """The owner map `[L, E]`: `balanced` on the EAMC's traced load when there is one, else round-robin."""
    if placement == "balanced" and eams is not None and eams.size:
        return balanced(eams.sum(axis=0), None, ranks)
    return round_robin(num_layers, num_experts, ranks)


def owned_rows(dispatch: Any, layer: int, owner: np.ndarray, rank: int) -> tuple[list[int], torch.Tensor]:
    """The experts of `dispatch` that `rank` owns (increasing id) and their (token, slot) rows, in the
    order both sides of an exchange agree on."""
    experts = [e for e in dispatch.groups if owner[layer, e] == rank]
    rows = [dispatch.rows(e) for e in experts]
    return experts, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


# --- rank 0 ---------------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """Bytes rank 0 exchanged with the other ranks (payloads; headers excluded)."""

    sent: int = 0
    received: int = 0
    layers: int = 0


@dataclass
class RemoteExperts:
    """Rank 0's side: ships one layer's work to the other ranks and collects their rows."""

    owner: np.ndarray  # [L, E] rank of each expert
    ranks: int
    traffic: Traffic = field(default_factory=Traffic)
    closed: bool = False

    def owned(self, layer: int, expert: int) -> bool:
        return bool(self.owner[layer, expert] == 0)

    def send_layer(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, plan: list[tuple[Key, float]] | None, budget: int | None,
                   cur_eam: np.ndarray) -> None:
        """Broadcast what every rank needs to compute and prefetch its share of `layer`."""
        tokens, top_k = top_k_index.shape
        plan = plan or []
        header = torch.tensor([OP_LAYER, layer, tokens, top_k, hidden_states.shape[-1],
                               DTYPES.index(hidden_states.dtype), DTYPES.index(top_k_weights.dtype),
                               len(plan), -1 if budget is None else budget], dtype=torch.int64)
        keys = torch.tensor([key for key, _ in plan], dtype=torch.int64).reshape(-1, 2)
        priorities = torch.tensor([p for _, p in plan], dtype=torch.float64)
        eam = torch.from_numpy(np.ascontiguousarray(cur_eam, dtype=np.float32))
        with _failures("rank 0 could not reach the expert ranks"):
            dist.broadcast(header, src=0)
            for t in (hidden_states, top_k_index.to(torch.int64), top_k_weights, keys, priorities, eam):
                _broadcast_tensor(t, tuple(t.shape), t.dtype)
        self.traffic.sent += sum(_bytes(t).numel() for t in (hidden_states, top_k_index, top_k_weights))
        self.traffic.layers += 1

    def collect(self, layer: int, outputs: Any) -> None:
        """Receive every other rank's rows of `layer` into `outputs` (an `ExpertOutputs`)."""
        for rank in range(1, self.ranks):
            _, rows = owned_rows(outputs.dispatch, layer, self.owner, rank)
            if rows.numel() == 0:
                continue
            with _failures(f"expert rank {rank} stopped answering"):
                meta = torch.zeros(2, dtype=torch.int64)
                dist.recv(meta, rank)
                dtype = DTYPES[int(meta[1])]
                buf = torch.empty(int(meta[0]) * dtype.itemsize, dtype=torch.uint8)
                dist.recv(buf, rank)
            values = buf.view(dtype).reshape(rows.numel(), -1)
            outputs.put(rows, values)
            self.traffic.received += buf.numel()

    def control(self, message: dict[str, Any]) -> list[Any]:
        """Send a control message to every rank; collect their JSON replies."""
        with _failures("an expert rank stopped answering"):
            dist.broadcast(torch.tensor([OP_CONTROL] + [0] * (HEADER - 1), dtype=torch.int64), src=0)
            _send_json(message)
            return [_recv_json(rank) for rank in range(1, self.ranks)]

    def stats(self) -> dict[str, Any]:
        ranks = self.control({"op": "stats"})
        return {"ranks": self.ranks, "bytes_sent": self.traffic.sent, "bytes_received": self.traffic.received,
                "layers": self.traffic.layers, "rank_stats": ranks}

    def reset(self) -> None:
        self.control({"op": "reset"})
        self.traffic = Traffic()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.control({"op": "close"})
            except EPError as exc:
                log.warning("closing the expert ranks: %s", exc)


def launch(model_dir: Path, config: Any) -> Any:
    """`build_runtime(model_dir, config)`; launched by torchrun as rank 0, with the other ranks holding
    their share of the experts (`attach`)."""
    from ..builder import build_runtime

    runtime = build_runtime(model_dir, config)
    if is_leader():
        try:
            attach(runtime, str(model_dir), config)
        except BaseException:
            runtime.close()
            raise
    return runtime


def attach(runtime: Any, model_dir: str, config: Any) -> RemoteExperts:
    """Rank 0: tell the other ranks to build `model_dir` with `config`, and route experts through them."""
    spec = spec_for(runtime.store.index.model_type)
    if spec.adapter in ADAPTERS:
        raise EPError(f"expert parallelism does not serve {spec.family} models: their adapter's combine "
                      "(moeinf.hf.adapters) takes no expert outputs from other ranks; run on one process")
    init_group(config.ep_timeout)
    ranks = dist.get_world_size()
    offloader = runtime.offloader
    eams = offloader.predictor.current.eams if offloader.predictor is not None else None
    owner = make_owner(config.ep_placement, offloader.num_layers, offloader.num_experts, ranks, eams)
    remote = RemoteExperts(owner, ranks)
    replies = remote.control({"op": "build", "model_dir": os.path.abspath(model_dir),
                              "config": asdict(config), "owner": owner.tolist()})
    for rank, reply in enumerate(replies, 1):
        if reply.get("error"):
            raise EPError(f"expert rank {rank} could not build the model: {reply['error']}")
    offloader.remote = remote
    atexit.register(release_followers)
    log.info("expert parallelism: %d ranks, rank 0 owns %d of %d experts", ranks, int((owner == 0).sum()),
             owner.size)
    return remote


_released = False


def release_followers(timeout_s: float = 300.0) -> None:
    """Rank 0, at the end of its command: let the other ranks exit (they wait in `follow`, or in the
    rendezvous when the command never built a model)."""
    global _released
    if _released or not is_leader():
        return
    _released = True
    init_group(timeout_s)
    try:
        RemoteExperts(np.zeros((0, 0), dtype=np.int64), dist.get_world_size()).control({"op": "exit"})
    except EPError as exc:
        log.warning("releasing the expert ranks: %s", exc)


class _failures:
    """Turn a failed exchange (gloo: closed connection, timeout) into `EPError` with `what`."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, _tb: Any) -> bool:
        if exc is not None and isinstance(exc, (RuntimeError, dist.DistBackendError)) \
                and not isinstance(exc, EPError):
            raise EPError(f"{self.what}: {' '.join(str(exc).split())[:300]}") from exc
        return False


# --- ranks 1.. ------------------------------------------------------------------------------------------
class Follower:
    """A rank's side: its own offloaded model (dense replicated), cache and experts; serves layers."""

    def __init__(self, runtime: Any, owner: np.ndarray, rank: int) -> None:
        from ..runtime.experts import OffloadedExperts

        self.runtime = runtime
        self.owner = owner
        self.rank = rank
        modules = [m for m in runtime.model.modules() if isinstance(m, OffloadedExperts)]
        self.kernels = {m.layer: m.kernel for m in modules}

    def layer(self, header: list[int]) -> None:
        from ..kernels.moe import Dispatch, ExpertOutputs

        _, layer, tokens, top_k, hidden, hdtype, wdtype, n_plan, budget = header
        hidden_states = _broadcast_tensor(None, (tokens, hidden), DTYPES[hdtype])
        top_k_index = _broadcast_tensor(None, (tokens, top_k), torch.int64)
        top_k_weights = _broadcast_tensor(None, (tokens, top_k), DTYPES[wdtype])
        keys = _broadcast_tensor(None, (n_plan, 2), torch.int64).tolist()
        priorities = _broadcast_tensor(None, (n_plan,), torch.float64).tolist()
        offloader = self.runtime.offloader
        eam_shape = (offloader.num_layers, offloader.num_experts)
        cur_eam = _broadcast_tensor(None, eam_shape, torch.float32).numpy()
        kernel = self.kernels[layer]
        cache = self.runtime.cache
        with torch.inference_mode():
            dispatch = Dispatch(top_k_index, offloader.num_experts, stable=kernel.stable)
            experts, rows = owned_rows(dispatch, layer, self.owner, self.rank)
            needed = [(layer, e) for e in experts]
            if layer == 0:
                cache.new_pass()

            def context(keep: frozenset[Key]) -> EvictionContext:
                return EvictionContext(cur_eam=cur_eam, layer=layer, protected=keep)

            mine = [((int(l_), int(e)), p) for (l_, e), p in zip(keys, priorities, strict=True)
                    if self.owner[l_, e] == self.rank]
            if mine:
                cache.prefetch(mine, context(frozenset(needed)), max_new=None if budget < 0 else budget)
            outputs = ExpertOutputs(hidden_states, top_k_weights, dispatch)
            for (_, expert), tensors in cache.acquire(needed, context):
                outputs.compute(expert, kernel, tensors)
            if not needed:
                return
            values = outputs.take(rows)
        dist.send(torch.tensor([values.numel(), DTYPES.index(values.dtype)], dtype=torch.int64), 0)
        dist.send(_bytes(values), 0)


def follow() -> int:
    """The loop of ranks 1..: build what rank 0 asks for, serve its layers, exit when told (or when rank 0
    is gone). Returns the process exit code."""
    from ..builder import build_runtime
    from ..config import OffloadConfig

    rank, _ = world()
    init_group(float(os.environ.get("MOEINF_EP_TIMEOUT", "300")))
    follower: Follower | None = None
    try:
        while True:
            header = torch.zeros(HEADER, dtype=torch.int64)
            dist.broadcast(header, src=0)
            fields = header.tolist()
            if fields[0] == OP_LAYER:
                assert follower is not None, "a layer before the model was built"
                follower.layer(fields)
                continue
            message = _recv_json()
            op = message["op"]
            reply: dict[str, Any] = {}
            if op == "build":
                if follower is not None:
                    follower.runtime.close()
                try:
                    config = OffloadConfig.from_dict(message["config"])
                    runtime = build_runtime(Path(message["model_dir"]), config)
                    follower = Follower(runtime, np.asarray(message["owner"]), rank)
                except Exception as exc:  # reported to rank 0, which raises it for the user
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
            elif op == "stats":
                reply = follower.runtime.stats_dict() if follower is not None else {}
            elif op == "reset" and follower is not None:
                follower.runtime.reset_stats()
            elif op == "close" and follower is not None:
                follower.runtime.close()
                follower = None
            _send_json(reply, dst=0)
            if op == "exit":
                return 0
    except (RuntimeError, dist.DistBackendError) as exc:
        print(f"moeinf rank {rank}: rank 0 is gone ({' '.join(str(exc).split())[:200]}); exiting",
              file=sys.stderr)
        return 1
    finally:
        if follower is not None:
            follower.runtime.close()


# --- one machine ----------------------------------------------------------------------------------------
FOLLOW = "import sys\nfrom moeinf.parallel import ep\nsys.exit(ep.follow())\n"


def spawn_local(ranks: int, rank0: list[str], *, threads: int = 1, timeout_s: float = 300.0,
                **popen: Any) -> list[subprocess.Popen]:
    """Start `ranks` processes on this machine with torchrun's environment (loopback rendezvous): rank 0
    runs `python *rank0`, the others `follow`. For tests and benchmarks; users run torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOEINF_EP_TIMEOUT=str(timeout_s),
                   OMP_NUM_THREADS=str(threads))
        argv = rank0 if rank == 0 else ["-c", FOLLOW]
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, text=True, **popen))
    return procs
