"""The collectives of a tensor-parallel forward between ranks on one host, through shared memory.

A decode step of the embedded model makes 61 collectives of a few KiB each; over gloo on
loopback most of the step went to the transport's wake-ups (N = 2 on this 2-core Xeon: 93.8 ms
per forward over gloo, 37.2 ms this way, 31.0 ms in one process; `python eval/bench_tp.py`,
results/tp_cpu.md). Here each rank copies its tensor into its
own slot of a shared segment, publishes a sequence number, and spins (yielding the core) until
every rank has published; then every rank sums the slots in rank order, so all ranks get the
same bits. Two slot sets alternate: a rank can be at most one collective ahead of another
(finishing collective k needs every rank to have entered it), so collective k + 1 never
overwrites what a slow rank still reads of k.

Only small tensors (a step's activations, up to MAX_BYTES per rank) take this path; larger
ones (a long prompt's rows) go over gloo. A peer that dies stops a wait within about a second
(its process is gone or a zombie) with an error instead of spinning forever.
"""
from __future__ import annotations

import mmap
import os
import time

import torch
import torch.distributed as dist

MAX_BYTES = 256 << 10        # per rank per collective; larger goes over gloo
_HEADER = 4096               # flags [2, world] int64, then pids [world] int64 (world <= 128)
CHECK_EVERY = 0.5            # seconds of waiting between checks that the peers live


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class ShmComm:
    """Sum-all-reduce and gather-to-rank-0 among `world` ranks of one host. Built collectively
    over `ctl` (a gloo group): rank 0 makes an anonymous memory file (memfd), every rank maps it
    through rank 0's /proc fd entry, so nothing is left behind whatever way the processes end."""

    def __init__(self, rank: int, world: int, ctl, fallback):
        self.rank, self.world, self.fallback = rank, world, fallback
        size = _HEADER + 2 * world * MAX_BYTES
        box, own = [None], None
        if rank == 0:                  # an anonymous file: no name in /dev/shm to leave behind
            own = os.memfd_create("specfork-tp")
            os.ftruncate(own, size)
            box = [f"/proc/{os.getpid()}/fd/{own}"]
        try:
            dist.broadcast_object_list(box, src=0, group=ctl)
            fd = os.open(box[0], os.O_RDWR) if rank else own
            try:
                self.mm = mmap.mmap(fd, size)
            finally:
                if rank:
                    os.close(fd)
            dist.barrier(group=ctl)    # every rank has mapped it
        finally:
            if own is not None:
                os.close(own)
        self.flags = memoryview(self.mm)[:_HEADER].cast("q")     # [2 * world] then pids
        self.flags[2 * world + rank] = os.getpid()
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=_HEADER,
                                     count=2 * world * MAX_BYTES).view(2, world, MAX_BYTES)
        self.seq = 0
        dist.barrier(group=ctl)
        self.pids = [self.flags[2 * world + r] for r in range(world)]

    def _publish(self, t: torch.Tensor) -> int:
        self.seq += 1
        nb = t.numel() * t.element_size()
        self.data[self.seq % 2, self.rank, :nb].copy_(t.contiguous().view(-1).view(torch.uint8))
        self.flags[(self.seq % 2) * self.world + self.rank] = self.seq
        return nb

    def _wait(self, ranks) -> None:
        """Until each of `ranks` has published this collective."""
        base, seq, flags = (self.seq % 2) * self.world, self.seq, self.flags
        start = time.monotonic()
        last = start
        for r in ranks:
            spins = 0
            while flags[base + r] < seq:
                spins += 1
                if spins > 64:
                    os.sched_yield()
                    if spins % 1024 == 0 and time.monotonic() - last > CHECK_EVERY:
                        last = time.monotonic()
                        dead = [i for i, p in enumerate(self.pids) if not _alive(p)]
                        if dead:
                            raise RuntimeError(f"tensor-parallel rank {dead[0]} is gone")

    def _slot(self, r: int, t: torch.Tensor, nb: int) -> torch.Tensor:
        return self.data[self.seq % 2, r, :nb].view(t.dtype).view(t.shape)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over ranks, in place; the same bits on every rank."""
        if t.numel() * t.element_size() > MAX_BYTES:
            dist.all_reduce(t, group=self.fallback)
            return t
        nb = self._publish(t)
        self._wait(range(self.world))
        t.copy_(self._slot(0, t, nb))
        for r in range(1, self.world):
            t.add_(self._slot(r, t, nb))
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) on rank 0, in rank order; None elsewhere (large
        tensors: on every rank, over gloo)."""
        if t.numel() * t.element_size() > MAX_BYTES:
            parts = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(parts, t.contiguous(), group=self.fallback)
            return parts
        nb = self._publish(t)
        if self.rank:
            return None
        self._wait(range(1, self.world))
        return [t] + [self._slot(r, t, nb).clone() for r in range(1, self.world)]


class GroupComm:
    """The same two collectives over a process group (NCCL between GPUs, or gloo across hosts)."""

    def __init__(self, group):
        self.group = group

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts
