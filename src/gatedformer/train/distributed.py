"""Data-parallel training on ``torch.distributed``: the process group, ranks and the few collectives
the training loop needs.

A process started by ``torchrun`` finds ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment;
:func:`setup` then joins the process group (``gloo`` on CPU, ``nccl`` on CUDA with device
``cuda:LOCAL_RANK``) and the loop wraps the model in ``DistributedDataParallel``. A plain process, or
``torchrun`` with one process, is world 1: no process group is made and every helper here is a no-op,
so single-process runs compute exactly what they computed before.

How the work is split:

* Each rank reads its own contiguous block of ``data.batch_size / world`` batch columns
  (``LMStream(..., shard=(rank, world))``), so the global batch equals the single-process batch.
  Every rank sees windows of the same length, so the mean of the per-rank mean losses is the global
  mean, and the gradients DDP averages across ranks are the single-process gradients.
* Rank 0 alone evaluates (on the whole split), logs, writes checkpoints and results; the other ranks
  wait for it at the next collective.

Random numbers: every rank builds the model from ``train.seed``, so all replicas start equal (DDP also
broadcasts rank 0's weights). When world > 1, each rank then reseeds its generator with
:func:`rank_seed` ``(train.seed, rank)``, so dropout masks differ between ranks. Checkpoints store every
rank's RNG state (gathered to rank 0, a list indexed by rank) and every rank's carried recurrent state,
so a resumed run on the same number of processes continues bit for bit on every rank.
"""

from __future__ import annotations

import atexit
import inspect
import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gatedformer.errors import ConfigError

# Other ranks wait this long at a collective while rank 0 evaluates or writes a checkpoint.
TIMEOUT = timedelta(hours=1)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a data-parallel run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_ranks() -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from torchrun's environment; ``(0, 1, 0)`` for a plain process."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not any(name in os.environ for name in names):
        return 0, 1, 0
    try:
        rank, world, local = (int(os.environ.get(name, "0" if name != "WORLD_SIZE" else "1")) for name in names)
    except ValueError:
        raise ConfigError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers; launch with torchrun, which sets them"
        ) from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(f"bad launcher environment RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}; "
                          "launch with torchrun, which sets them")
    return rank, world, local


def launched_by_torchrun() -> bool:
    """Whether this process is one of several started by torchrun."""
    return env_ranks()[1] > 1


def is_main_process() -> bool:
    """Rank 0 of a distributed run, or a plain process: the one that prints and writes."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return env_ranks()[0] == 0


def rank_seed(seed: int, rank: int) -> int:
    """The generator seed of ``rank`` after the model is built (distinct per rank, fixed per run)."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63 - 1)


def setup(batch_size: int, device: torch.device, seed: int = 0) -> DistContext:
    """Join the process group torchrun prepared (once per process) and return this rank's context.

    ``device`` is what ``train.device`` resolved to; under torchrun a CUDA device becomes
    ``cuda:LOCAL_RANK``. Raises a :class:`ConfigError` if ``batch_size`` does not split evenly.
    """
    rank, world, local = env_ranks()
    if world == 1:
        return DistContext(device=device)
    if batch_size % world:
        raise ConfigError(
            f"data.batch_size={batch_size} does not divide among {world} processes; the global batch is split "
            f"evenly across them, so use a multiple of {world} (or another --nproc_per_node)"
        )
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; run a single process instead of torchrun")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if local >= visible:
            raise ConfigError(
                f"torchrun started a process with LOCAL_RANK={local} but this node has {visible} CUDA device(s); "
                f"use --nproc_per_node {visible} or fewer (one process per GPU), or train.device=cpu"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        except (ValueError, RuntimeError) as err:  # e.g. RANK set by hand without MASTER_ADDR, or no rendezvous
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise ConfigError(f"could not join the process group of {world} processes ({first}); launch with "
                              "torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT") from None
        atexit.register(teardown)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise ConfigError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, but the "
                          f"environment says {rank} of {world}; launch with torchrun")
    return DistContext(rank, world, local, device)


def teardown() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def seed_rank(ctx: DistContext, seed: int) -> None:
    """Give each rank its own random stream (dropout masks); nothing changes in a single process."""
    if ctx.enabled:
        torch.manual_seed(rank_seed(seed, ctx.rank))


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` wrapped in DistributedDataParallel when there are several ranks, else ``model``."""
    if not ctx.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Buffers are equal on every rank and never trained: no need to sync them before every forward.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def _comm_device(ctx: DistContext) -> torch.device:
    return ctx.device if ctx.device.type == "cuda" else torch.device("cpu")


def mean_over_ranks(ctx: DistContext, value: torch.Tensor) -> float:
    """The mean of a scalar tensor over all ranks (its plain value in a single process)."""
    if not ctx.enabled:
        return value.item()
    total = value.detach().to(_comm_device(ctx), torch.float64).reshape(1)
    dist.all_reduce(total)
    return total.item() / ctx.world


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """Whether ``flag`` is true on at least one rank, so that every rank takes the same branch."""
    if not ctx.enabled:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=_comm_device(ctx))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def broadcast_floats(ctx: DistContext, values: list[float]) -> list[float]:
    """Rank 0's ``values`` on every rank."""
    if not ctx.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=_comm_device(ctx))
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# Per-rank state in checkpoints: RNG states and the recurrent state carried between windows


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"rng_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["rng_cpu"])
    if device.type == "cuda" and "rng_cuda" in state:
        torch.cuda.set_rng_state(state["rng_cuda"], device)


def gather_rank_states(ctx: DistContext, carry: Any) -> list[dict[str, Any]] | None:
    """Every rank's RNG states and carried state, on rank 0 (``None`` elsewhere and in a single process).

    A collective: every rank must call it.
    """
    if not ctx.enabled:
        return None
    mine = {"rng": rng_state(ctx.device), "carry": _to_cpu(carry)}
    gathered: list[Any] | None = [None] * ctx.world if ctx.is_main else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def _to_cpu(state: Any) -> Any:
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    return type(state)(_to_cpu(item) for item in state)


def checkpoint_parts(ctx: DistContext, trainer_state: dict[str, Any], carry: Any,
                     ranks: list[dict[str, Any]] | None) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """What rank 0 saves: the trainer state, the carry and extra meta, with every rank's part added."""
    if ranks is None:
        return trainer_state, carry, {}
    trainer_state = {**trainer_state, "ranks": [part["rng"] for part in ranks]}
    return trainer_state, [part["carry"] for part in ranks], {"world_size": ctx.world}


def restore_rank_state(ctx: DistContext, trainer_state: dict[str, Any], meta: dict[str, Any], carry: Any,
                       seed: int) -> Any:
    """Set this rank's RNG from a checkpoint and return its carried state.

    A checkpoint written by the same number of processes restores every rank exactly. Another number of
    processes still resumes (the data and the global batch do not depend on it), but dropout masks and
    any carried recurrent state start afresh, so the numbers drift from an uninterrupted run.
    """
    saved_world = int(meta.get("world_size", 1))
    states = trainer_state.get("ranks") or [{k: v for k, v in trainer_state.items() if k.startswith("rng_")}]
    carries = carry if saved_world > 1 else [carry]
    if saved_world == ctx.world and len(states) == ctx.world:
        set_rng_state(states[ctx.rank], ctx.device)
        return carries[ctx.rank]
    if ctx.is_main:
        warnings.warn(
            f"resuming on {ctx.world} process(es) from a checkpoint written by {saved_world}: dropout masks and "
            "carried recurrent state restart, so the numbers will differ slightly from an uninterrupted run",
            stacklevel=2,
        )
    torch.manual_seed(rank_seed(seed + int(meta.get("step", 0)), ctx.rank))
    return None
