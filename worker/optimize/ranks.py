"""The ranks of one optimize worker: N processes on one machine (started by ``torch.distributed.run``) that
train one policy together, so a base model too big for one GPU can be trained.

Rank 0, the *leader*, is the Celery worker: it alone talks to the broker, the proxy and the bucket. The
other ranks, the *followers*, hold no connection to anything but the leader: they wait for the leader to
announce a trainer call (``collective``), receive its arguments, and run the same call, so every rank
takes part in the call's collectives. Between steps a follower waits on the command group, whose timeout
is long (an idle run is not a failure); the collectives inside a call use the worker's
``ASYNCGRPO_RANK_TIMEOUT_S``, so a rank that hangs fails the step instead of holding it forever.

Sharding (``shard``): the frozen base model is sharded with FSDP2, each decoder layer then the root, in the
base dtype (``model.dtype``: the trainer must compute what generators compute, or every rollout's
rescoring ratio drifts from 1); LoRA is applied before sharding and its parameters are left out of FSDP
(``ignored_params``), replicated on every rank. They are well under 1 % of a model's parameters, and
replicating them keeps one state for every N: gradients are summed across ranks once per update
(``sum_tensors``) before clipping, every rank applies the same AdamW update, and version files are written
from rank 0's copy exactly as a single-device worker writes them. A version saved by 2 ranks loads into 1
and back with nothing to gather or re-shard, so resuming on another N cannot lose state. Tied input and
output embeddings stay tied: both live in the root's FSDP group (only decoder layers get their own).

A rank's death: ``torch.distributed.run`` stops the other ranks when one exits; a collective in flight on a
survivor fails (``RankLost``), and the leader hands its task back to the queue and stops (see
``worker.process.tasks``), so the worker's unit restarts the whole group. Nothing half-written is
published: version files are written only after the update, by the leader, through the usual manifest path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger()

_IDLE_TIMEOUT = timedelta(days=30)  # a follower may wait this long for the leader's next call
BUILD = "build"  # the leader built its trainer: followers build theirs from the run config it sends
STOP = "stop"  # the leader is exiting: followers exit too


class RankLost(RuntimeError):
    """A collective failed: another rank of this worker died or hung; the worker must restart as a whole."""


@dataclass
class Ranks:
    """This process's place among the ranks of its optimize worker (one rank, 0 of 1, without torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    commands: Any = None  # the gloo group calls are announced on (long timeout); None with one rank

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def device(self, setting: str) -> str:
        """The device of this rank for the worker's ``ASYNCGRPO_DEVICE``: each rank its own local GPU."""
        if not self.distributed or setting == "cpu":
            return setting
        if setting == "auto" and not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{self.local_rank}"

    # ---- the leader's calls, as the followers receive them ----

    def announce(self, name: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """Leader: tell every follower to run ``name(*args, **kwargs)`` now."""
        self._broadcast([name, args, kwargs or {}])

    def receive(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        """Follower: the leader's next call (waits as long as the leader is idle)."""
        box: list[Any] = [None, None, None]
        self._broadcast(box)
        return box[0], box[1], box[2]

    def _broadcast(self, box: list[Any]) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self.commands)
        except (RuntimeError, dist.DistError) as error:
            raise RankLost(f"rank {self.rank}: the leader's call could not be exchanged: {error}") from error

    # ---- reductions inside a call ----

    def sum_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` in place across ranks (one flat all-reduce: LoRA gradients, once per update)."""
        if not self.distributed or not tensors:
            return
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        self._all_reduce(flat)
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    def sum_floats(self, values: list[float], device: torch.device) -> list[float]:
        """``values`` summed across ranks, in float64 (loss and figure sums of an update)."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        self._all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (small Python objects: per-sample results of a call)."""
        if not self.distributed:
            return [value]
        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, value, group=self.commands)
        except (RuntimeError, dist.DistError) as error:
            raise RankLost(f"rank {self.rank}: results could not be gathered: {error}") from error
        return gathered

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        except (RuntimeError, dist.DistError) as error:
            raise RankLost(f"rank {self.rank}: an all-reduce failed: {error}") from error


def join(timeout_s: float, device: str, world: int, local_rank: int) -> Ranks:
    """Join this worker's ``world`` ranks (one rank needs no process group). ``world`` and ``local_rank`` are
    what ``torch.distributed.run`` set for this process (the rendezvous reads the rest). Once per process: the
    caller keeps the answer (``worker.process.runtime.WorkerRuntime.join_ranks``); a second join is refused.

    ``timeout_s`` bounds every collective inside a call; the wait for the leader's next call has no such
    bound. GPUs: NCCL between the ranks of this machine for tensors, gloo for the announced calls."""
    if world == 1:
        return Ranks()
    if dist.is_initialized():
        raise RuntimeError("this process already joined its ranks: keep the Ranks that join returned")
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    commands = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    joined = Ranks(rank=dist.get_rank(), world=world, local_rank=local_rank, commands=commands)
    log.info("optimize.ranks_joined", rank=joined.rank, world=world, backend=dist.get_backend(), timeout_s=timeout_s)
    return joined


def shard(model: torch.nn.Module, layers: list[torch.nn.Module], ranks: Ranks, dtype: torch.dtype) -> None:
    """Shard the frozen base of ``model`` (LoRA already applied) with FSDP2 across ``ranks``: each decoder
    layer, then the root; the trainable (LoRA) parameters stay out of FSDP, replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (ranks.world,))
    lora = {parameter for parameter in model.parameters() if parameter.requires_grad}
    # Compute in the base dtype (see the module docstring); a gradient that FSDP reduces is reduced in fp32.
    precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        mine = {parameter for parameter in layer.parameters() if parameter in lora}
        fully_shard(layer, mesh=mesh, mp_policy=precision, ignored_params=mine)
    fully_shard(model, mesh=mesh, mp_policy=precision, ignored_params=lora)


P = ParamSpec("P")
R = TypeVar("R")


def collective(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """A trainer method every rank runs together: on the leader of several ranks it first announces the call
    (its name and arguments) to the followers, who run it too (``follow``). The owner has a ``ranks``."""

    @functools.wraps(method)
    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        ranks: Ranks = self.ranks
        if not ranks.distributed:
            return method(self, *args, **kwargs)
        if ranks.leader:
            ranks.announce(method.__name__, args, kwargs)
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as error:
            if isinstance(error, RankLost) or not collective_failed(error):
                raise
            raise RankLost(f"rank {ranks.rank}: {method.__name__} failed in a collective: {error}") from error
        finally:
            # FSDP keeps the root's parameters gathered after a forward; the leader alone reading its state
            # (writing a version) would reshard them on it alone, and the next call's collectives would then
            # no longer pair up across ranks. Every call ends with every parameter sharded, on every rank.
            reshard(self.model)

    return call


def collective_failed(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed (a peer died or timed out), not a bug of the call."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(marker in text for marker in ("gloo", "NCCL", "c10d", "Connection closed by peer"))


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered FSDP parameter of ``model`` (no communication)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def follow(ranks: Ranks, build: Callable[[str], Any]) -> int:
    """A follower's life: build the trainer when the leader does (``build`` takes the run config's JSON), then
    run each call it announces, until it stops. Returns the exit status."""
    trainer: Any = None
    while True:
        name, args, kwargs = ranks.receive()
        if name == STOP:
            log.info("optimize.follower_stopping", rank=ranks.rank)
            _part()
            return 0
        if name == BUILD:
            trainer = build(*args)
            continue
        if trainer is None:
            raise RankLost(f"rank {ranks.rank}: the leader called {name} before building its trainer")
        try:
            getattr(trainer, name)(*args, **kwargs)
        except RankLost:
            raise
        except Exception as error:  # the leader meets the same error on the same inputs, and reports it
            log.warning("optimize.follower_call_failed", rank=ranks.rank, call=name, error=str(error))


def leave(ranks: Ranks) -> None:
    """Leader, at exit: let the followers go (they would otherwise wait for the next call)."""
    if ranks.distributed and ranks.leader:
        try:
            ranks.announce(STOP)
        except RankLost as error:
            log.warning("optimize.followers_gone", error=str(error))
    _part()


def _part() -> None:
    """Destroy this process's process group, so its transport threads are joined before the interpreter exits
    (left running, their C++ destructors aborted the process at exit, now and then)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
