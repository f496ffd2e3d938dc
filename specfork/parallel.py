"""Tensor parallelism over torch.distributed, sharded as Megatron-LM, vLLM and SGLang shard a
Llama: q|k|v and gate|up split by output rows (column parallel: each rank computes its own
heads and MLP columns, no communication), o and down split by input columns (row parallel:
partial sums, one all-reduce each), the vocabulary head split by rows (its logits gathered
on rank 0). Every rank holds 1/N of the KV heads (with their query heads), of the weights and
a block pool of its own KV heads (as evenly as they split: 3 KV heads over 2 ranks are 1 and
2). The token embedding is replicated: the residual stream is whole on every
rank after each all-reduce.

Control stays on rank 0, the driver: the engine, scheduler, drafters and the KV-tree metadata
(forks, copy-on-write, release) run there, once. Each forward it broadcasts what the forward
needs (tokens, positions, the step's AttnMeta) and every pool operation that moves data (a
CoW block copy); the other ranks apply them to their own pools, so a fork stays O(1) on every
rank and no rank decides anything by itself (adaptive drafting decides from timings, which
differ per rank: deciding on every rank would diverge, then hang).

Ranks come from `torchrun --nproc-per-node N` (RANK/WORLD_SIZE in the environment: ranks > 0
serve the driver from `from_pretrained` and exit when it stops) or are spawned here (gloo on
127.0.0.1). Activations move through shared memory between CPU ranks of one host
(`specfork/shm_comm.py`), over NCCL between GPUs, else over gloo; commands always go over gloo.
"""
from __future__ import annotations

import argparse
import atexit
import copy
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from specfork.errors import SpecforkError
from specfork.shm_comm import GroupComm, ShmComm

# A rank waits this long for one collective of a forward (a live peer answers in microseconds;
# a dead one closes its socket, which ends the wait at once) ...
STEP_TIMEOUT = timedelta(minutes=10)
# ... and this long for the driver's next command: a server may idle for days. Starting: a rank
# that died before it connected is only noticed when this runs out.
IDLE_TIMEOUT = timedelta(days=365)
START_TIMEOUT = timedelta(minutes=2)
# a launcher's variables (torchrun's) that would mislead a rank we spawn ourselves
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class RankFailed(RuntimeError):
    """A rank died or its connection broke: the model is gone on every rank."""


def check_shardable(cfg, world: int) -> None:
    """One line for a model that does not split over `world` ranks: each rank needs a KV head
    of its own (we do not replicate KV heads as vLLM does past their count: that stores each
    on several ranks, and KV memory per rank is what tensor parallelism is for here)."""
    if world < 1:
        raise SpecforkError(f"--tensor-parallel must be >= 1, got {world}")
    kvh = cfg.num_key_value_heads
    if kvh < world:
        raise SpecforkError(f"--tensor-parallel {world}: the target has {kvh} KV heads, fewer "
                            f"than ranks (use at most {kvh})")


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's share of n units (KV heads, MLP columns): as even as it gets,
    contiguous (3 KV heads over 2 ranks: 1 and 2)."""
    return rank * n // world, (rank + 1) * n // world


def shard_plan(cfg, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """Rank `rank`'s share of each sharded matrix, by module name (q_proj, ...): (dim, start,
    end); dim 0 (rows) for q, k, v (its KV heads and their query heads), gate and up, dim 1
    (columns) for o and down. Cuts `cfg` down to that rank's model, which `Model` builds from.
    Everything else (embedding, norms, head) is whole here (`wrap` splits the head)."""
    check_shardable(cfg, world)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    G = cfg.num_attention_heads // cfg.num_key_value_heads          # query heads per KV head
    h0, h1 = share(cfg.num_key_value_heads, rank, world)
    i0, i1 = share(cfg.intermediate_size, rank, world)
    cfg.head_dim = D
    cfg.num_attention_heads, cfg.num_key_value_heads = (h1 - h0) * G, h1 - h0
    cfg.intermediate_size = i1 - i0
    return {"q_proj": (0, h0 * G * D, h1 * G * D), "k_proj": (0, h0 * D, h1 * D),
            "v_proj": (0, h0 * D, h1 * D), "o_proj": (1, h0 * G * D, h1 * G * D),
            "gate_proj": (0, i0, i1), "up_proj": (0, i0, i1), "down_proj": (1, i0, i1)}


def _cut(name: str, t, plan: dict, rank: int):
    """This rank's part of checkpoint tensor `name` (a torch tensor or a safetensors slice),
    None for a bias it does not hold (a column-split matrix's bias is added on rank 0 only);
    and, for a column-split weight, its whole rows' absmax (int8 scales)."""
    parts = name.split(".")
    mod = parts[-2] if len(parts) > 1 else ""
    if mod not in plan:
        return t[:], None
    dim, a, b = plan[mod]
    if parts[-1] == "bias":
        return (t[a:b] if dim == 0 else (t[:] if rank == 0 else None)), None
    if dim == 0:
        return t[a:b], None
    whole = t[:]
    return whole[:, a:b].clone(), whole.abs().amax(dim=1)


def shard_hf(hf, rank: int, world: int) -> None:
    """Cut a loaded transformers Llama down to rank `rank`'s share in place (each part a copy
    of its own, so the whole matrices are freed): for checkpoints `load_shard` cannot read
    slice by slice."""
    plan = shard_plan(hf.config, rank, world)
    for name, mod in hf.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short not in plan:
            continue
        w, absmax = _cut(f"{name}.weight", mod.weight.data, plan, rank)
        mod.weight.data = w.clone() if absmax is None else w
        if absmax is not None:
            mod.tp_absmax = absmax
        if mod.bias is not None:
            bias, _ = _cut(f"{name}.bias", mod.bias.data, plan, rank)
            if bias is None:
                mod.bias = None
            else:
                mod.bias.data = bias.clone()


def _safetensors(src: str) -> list[str] | None:
    """The safetensors files of a local checkpoint directory (None: not such a directory)."""
    import glob
    if not os.path.isdir(src):
        return None
    files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    return files or None


def load_shard(spec: dict, rank: int, world: int):
    """(transformers model holding only rank `rank`'s share, tokenizer): built on the meta
    device from the cut config, then filled with slices read from the safetensors files, so a
    rank never holds the whole model (a 70B checkpoint over 8 ranks: 1/8 of its layers each).
    Checkpoints that are not safetensors files load whole, then `shard_hf` cuts them."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from safetensors import safe_open

    from specfork.loader import load_hf, load_tokenizer, resolve
    dev = _local_device(spec["device"], rank)
    src = resolve(spec["target"])
    files = _safetensors(src)
    if files is None:
        hf, tok = load_hf(spec["target"], dtype=spec["dtype"], device="cpu")
        shard_hf(hf, rank, world)
        return hf.to(dev), tok
    dtype = spec["dtype"] or (torch.bfloat16 if dev.startswith("cuda") else torch.float32)
    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    plan = shard_plan(cfg, rank, world)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state, absmax = {}, {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                t, amax = _cut(name, st.get_slice(name), plan, rank)
                if t is not None:
                    state[name] = t.to(dev, dtype)
                if amax is not None:
                    absmax[name.rsplit(".", 1)[0]] = amax
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    del state
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    left = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if left or unexpected:
        raise SpecforkError(f"{src}: checkpoint does not match its config "
                            f"(missing {left[:3]}, unexpected {unexpected[:3]})")
    for name, amax in absmax.items():
        hf.get_submodule(name).tp_absmax = amax
    # buffers computed at init (RoPE frequencies) were made on the meta device
    with torch.device("cpu"):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(cfg).to(dev)
    try:
        hf.generation_config = GenerationConfig.from_pretrained(src, local_files_only=True)
    except OSError:
        pass
    return hf.eval(), load_tokenizer(spec["target"])


class RowParallel:
    """o or down over this rank's input columns: a partial product, summed over ranks."""

    def __init__(self, lin, comm):
        self.lin, self.comm = lin, comm

    def __call__(self, a: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        return self.comm.all_reduce_(self.lin(a, bulk))

    def add_to(self, x: torch.Tensor, a: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        return x + self(a, bulk)

    def __getattr__(self, name):                      # packed_bytes, nbytes, w, ...
        return getattr(self.lin, name)


class VocabParallelHead:
    """lm_head over this rank's vocabulary rows; the logits are gathered whole on rank 0
    (ceil(V / N) rows per rank, the last rank's padded). Other ranks get their own rows only:
    nothing reads them."""

    def __init__(self, lin, vocab: int, world: int, comm):
        self.lin, self.vocab, self.world, self.comm = lin, vocab, world, comm
        self.rows = -(-vocab // world)

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        y = self.lin(x, bulk)                                     # [T, rows of this rank]
        if y.shape[1] < self.rows:
            y = F.pad(y, (0, self.rows - y.shape[1]))
        parts = self.comm.gather(y)
        return y if parts is None else torch.cat(parts, 1)[:, :self.vocab]

    def __getattr__(self, name):
        return getattr(self.lin, name)


def wrap(model, rank: int, world: int, comm) -> None:
    """Make a `Model` built from a `shard_hf` model one rank of the whole: o and down sum over
    ranks, the head keeps this rank's vocabulary rows (in the model's weight format)."""
    from specfork.model import Linear
    from specfork.weights import HEAD_FORMAT, QuantLinear
    for ly, blk in zip(model.layers, model.hf.model.layers):
        if model.weights == "int8":           # on the whole rows' grid, as at N = 1
            ly.o, ly.down = (QuantLinear(m.weight, m.bias, "int8", m.tp_absmax)
                             for m in (blk.self_attn.o_proj, blk.mlp.down_proj))
        ly.o, ly.down = RowParallel(ly.o, comm), RowParallel(ly.down, comm)
    full = model.hf.lm_head.weight
    n = -(-model.vocab_size // world)
    w = full.data[rank * n:(rank + 1) * n]                         # a view: no copy
    if rank and full is not model.hf.model.embed_tokens.weight:   # untied: keep only our rows
        w = full.data = w.clone()
    bias = model.hf.lm_head.bias
    b = None if bias is None else bias.data[rank * n:(rank + 1) * n]
    if model.weights != "float32":
        head = QuantLinear(w, b, HEAD_FORMAT[model.weights])
    else:
        head = Linear(w, b, pack=model.pack, min_rows=model.packed_min_rows)
        head.exact = model.rows_exact
    model.lm_head = VocabParallelHead(head, model.vocab_size, world, comm)


def _threads(world: int) -> None:
    """Each rank on its share of this machine's cores (one process per rank on a host)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // world))


def _groups(device: str, rank: int, world: int, one_host: bool):
    """(comm, command group) after init: the forward's collectives go through shared memory
    between CPU ranks of one host (`specfork/shm_comm.py`; SPECFORK_TP_SHM=0: over gloo), over
    NCCL between GPUs, else over gloo; commands always over gloo."""
    ctl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if str(device).startswith("cuda"):
        return GroupComm(dist.new_group(backend="nccl", timeout=STEP_TIMEOUT)), ctl
    steps = dist.new_group(backend="gloo", timeout=STEP_TIMEOUT)
    if one_host and shm_ok():
        return ShmComm(rank, world, ctl, fallback=steps), ctl
    return GroupComm(steps), ctl


def shm_ok() -> bool:
    """Shared-memory collectives: on x86 (its stores are seen in order, which the protocol
    relies on), unless SPECFORK_TP_SHM=0."""
    import platform
    return (platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("SPECFORK_TP_SHM", "1") != "0")


def _local_device(device: str | None, rank: int) -> str:
    """This rank's device: its own GPU of its host (torchrun's LOCAL_RANK), else the CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    return f"cuda:{local}" if device.startswith("cuda") else "cpu"


def load_rank(spec: dict, rank: int, world: int, comm):
    """(this rank's Model, tokenizer) for `spec` (target, dtype, device, weights, kv_cache)."""
    from specfork.model import Model
    hf, tok = load_shard(spec, rank, world)
    model = Model(hf, weights=spec["weights"], kv_cache=spec["kv_cache"])
    wrap(model, rank, world, comm)
    return model, tok


def rank_bytes(model, pool) -> dict:
    """What one rank holds, measured from its tensors: weights (each storage once, packed and
    low-bit copies included) and the K/V of `pool`."""
    seen, w = set(), 0
    for t in model.hf.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            w += t.nbytes
    for lin in model.linears():
        w += lin.packed_bytes + (lin.nbytes if hasattr(lin, "fmt") else 0)
    return {"weights": w, "kv": pool.k.nbytes + pool.v.nbytes}


def _to(obj, dev):
    """A copy of a command with its tensors on `dev`: the CPU before it is sent (a pickled
    CUDA tensor would land on GPU 0 of every rank), then each rank's own GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, dev) for x in obj)
    if hasattr(obj, "__dict__"):
        new = copy.copy(obj)
        for k, v in vars(obj).items():
            setattr(new, k, _to(v, dev))
        return new
    return obj


def serve_driver(model, ctl, rank: int) -> None:
    """A rank > 0: apply the driver's commands to this rank's model and pools until it stops."""
    pools = {}
    dev = model.device
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctl)
        dropped, op, args = box[0]
        for pid in dropped:
            pools.pop(pid, None)
        if op == "stop":
            return
        if op == "forward":
            tokens, positions, pid, meta, idx, capture = _to(args, dev) if dev.type != "cpu" \
                else args
            model.forward(tokens, positions, pools[pid], meta, logits_idx=idx, capture=capture)
        elif op == "pool":
            pid, num_blocks, block_size = args
            pools[pid] = model.make_pool(num_blocks=num_blocks, block_size=block_size)
        elif op == "pool_op":
            pid, name, a = args
            getattr(pools[pid], name)(*_to(a, dev))
        elif op == "bytes":
            dist.gather_object(rank_bytes(model, pools[args]), None, dst=0, group=ctl)
        elif op == "calibrate":
            model.calibrate_kv(args)
        else:
            raise RuntimeError(f"rank {rank}: unknown command {op!r}")


class Driver:
    """Rank 0's model: the sharded `Model` of rank 0, whose forward, pools and KV calibration
    run on every rank in step. Everything else reads through to the local model."""

    def __init__(self, model, world: int, ctl, procs: list | None = None):
        self._model, self.world, self._ctl = model, world, ctl
        self._procs = procs or []              # spawned ranks, Popen (none under torchrun)
        self._ids = itertools.count()
        self._dropped: list[int] = []          # pools collected since the last command
        self._head = None
        self.failed: str | None = None
        self.on_rank_exit = None               # serve: stop when a rank dies
        self._closed = False                   # close() was called
        if self._procs:
            threading.Thread(target=self._watch, daemon=True, name="specfork-tp-watch").start()
        atexit.register(self.close)

    def __getattr__(self, name):
        return getattr(self._model, name)

    @property
    def lm_head(self):
        """The whole head, for drafters that borrow it (EAGLE-1): drafters run on rank 0 only,
        so it must not be the gathered one (made on first use; a view when tied)."""
        if self._head is None:
            from specfork.model import Linear
            hf = self._model.hf.lm_head
            self._head = Linear(hf.weight, hf.bias)
        return self._head

    # -- commands ------------------------------------------------------------------------
    def _send(self, op: str, args=None, local=None):
        """Send a command, then run rank 0's own part of it, `local()`, under one guard: an
        interrupt between the two would leave the other ranks inside the command's
        collectives while rank 0 sends its next command (or "stop") on the control group."""
        if self.failed:
            raise RankFailed(self.failed)
        dropped, self._dropped = self._dropped, []

        def command():
            dist.broadcast_object_list([(dropped, op, args)], src=0, group=self._ctl)
            return None if local is None else local()
        return self._guard(command)

    def _guard(self, fn):
        """fn(), with a broken peer turned into one clear error on every later call too."""
        try:
            return fn()
        except BaseException as e:
            if isinstance(e, RankFailed):
                raise
            # anything that leaves rank 0 mid-step (a dead peer, Ctrl-C) leaves the ranks out
            # of step for good: stop them all
            dead = [f"rank {i + 1} exited with code {p.poll()}"
                    for i, p in enumerate(self._procs) if p.poll() is not None]
            why = "; ".join(dead) or (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.failed = f"tensor parallelism stopped: {why}"
            self._kill()
            if isinstance(e, RuntimeError):
                raise RankFailed(self.failed) from None
            raise

    def forward(self, tokens, positions, pool, meta, logits_idx=None, head=None, capture=None):
        if head is not None:
            raise SpecforkError("a vocabulary-subset head is a draft model's: the "
                                "tensor-parallel target has none")
        cmd = (tokens, positions, pool.tp_id, meta, logits_idx, capture)
        return self._send("forward", cmd if tokens.device.type == "cpu" else _to(cmd, "cpu"),
                          lambda: self._model.forward(tokens, positions, pool, meta,
                                                      logits_idx=logits_idx, capture=capture))

    def make_pool(self, num_blocks=None, max_bytes=None, block_size=None):
        """A pool of this rank's KV heads, mirrored on every rank (same block ids)."""
        pool = self._model.make_pool(num_blocks=num_blocks, max_bytes=max_bytes,
                                     block_size=block_size)
        pool.tp_id = next(self._ids)
        self._send("pool", (pool.tp_id, pool.num_blocks, pool.block_size))
        pid = pool.tp_id
        pool.mirror = lambda name, *a: self._send("pool_op", (pid, name, _to(a, "cpu")))
        weakref.finalize(pool, self._dropped.append, pid)
        return pool

    def rank_bytes(self, pool) -> list[dict]:
        """Per rank, the bytes of its weights and of its copy of `pool` (`rank_bytes`)."""
        out = [None] * self.world
        self._send("bytes", pool.tp_id, lambda: dist.gather_object(
            rank_bytes(self._model, pool), out, dst=0, group=self._ctl))
        return out

    def calibrate_kv(self, ids: list[int]) -> None:
        self._send("calibrate", ids,                     # a no-op on every rank unless TurboQuant
                   lambda: self._model.calibrate_kv(ids))

    # -- lifetime -------------------------------------------------------------------------
    def _watch(self) -> None:
        """A spawned rank that dies while rank 0 waits for work (a server between requests)
        would only be noticed at the next request: tell, and stop."""
        done = threading.Event()
        first = []

        def wait(r, p):
            p.wait()
            first.append(r)
            done.set()

        for r, p in enumerate(self._procs, 1):
            threading.Thread(target=wait, args=(r, p), daemon=True).start()
        done.wait()
        if self._closed:
            return
        r = first[0]
        if not self.failed:
            self.failed = (f"tensor parallelism stopped: rank {r} exited with code "
                           f"{self._procs[r - 1].poll()}")
        self._kill()                              # the others would wait on it forever
        if self.on_rank_exit is not None:
            self.on_rank_exit()

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.failed and dist.is_initialized():
                self._send("stop")
        except RuntimeError:
            pass
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, addr: str, spec: dict) -> None:
    """A spawned rank: `python -m specfork.parallel` (a fresh interpreter, so nothing of the
    caller's main module is imported again, as multiprocessing's spawn would)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is rank 0's to handle
    _threads(world)
    try:
        dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=world,
                                timeout=START_TIMEOUT)
        comm, ctl = _groups(spec["device"], rank, world, True)
        model, _ = load_rank(spec, rank, world, comm)
        serve_driver(model, ctl, rank)
    except Exception as e:                             # rank 0 went away, or loading failed
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"specfork: tensor-parallel rank {rank}: {msg}", file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()


def start(world: int, spec: dict):
    """(Driver, tokenizer) over `world` ranks for `spec` (target, dtype, device, weights,
    kv_cache). Under torchrun (WORLD_SIZE set) this process is one rank: rank 0 gets the
    Driver, any other rank serves rank 0 here and exits when it stops. Otherwise ranks
    1..world-1 are spawned on this machine."""
    from transformers import AutoConfig

    from specfork.loader import resolve
    check_shardable(AutoConfig.from_pretrained(resolve(spec["target"]), local_files_only=True),
                    world)                                       # before any process starts
    if _local_device(spec["device"], 0).startswith("cuda") and \
            torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        raise SpecforkError(f"--tensor-parallel {world}: one GPU per rank, and this machine "
                            f"has {torch.cuda.device_count()}")
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    procs = []
    if env_world > 1:
        if env_world != world:
            raise SpecforkError(f"--tensor-parallel {world} under torchrun with {env_world} "
                                "processes: they must match")
        rank = int(os.environ["RANK"])
        _threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=START_TIMEOUT)
    else:
        rank = 0
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        addr = f"tcp://127.0.0.1:{_free_port()}"
        arg = json.dumps({**spec, "dtype": None if spec["dtype"] is None
                          else str(spec["dtype"]).removeprefix("torch.")})
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
        procs = [subprocess.Popen([sys.executable, "-m", "specfork.parallel", str(r),
                                   str(world), addr, arg], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, env=env) for r in range(1, world)]
        _threads(world)
        try:
            dist.init_process_group("gloo", init_method=addr, rank=0, world_size=world,
                                    timeout=START_TIMEOUT)
        except BaseException:
            for p in procs:
                p.kill()
            raise
    try:
        one_host = not env_world > 1 or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) == world
        comm, ctl = _groups(spec["device"], rank, world, one_host)
        model, tok = load_rank(spec, rank, world, comm)
    except BaseException:
        for p in procs:
            p.kill()
        dist.destroy_process_group()
        raise
    if rank:
        serve_driver(model, ctl, rank)
        dist.destroy_process_group()
        sys.exit(0)
    return Driver(model, world, ctl, procs), tok


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="one spawned tensor-parallel rank (internal)")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("addr")
    p.add_argument("spec")
    a = p.parse_args()
    spec = json.loads(a.spec)
    spec["dtype"] = None if spec["dtype"] is None else getattr(torch, spec["dtype"])
    _worker(a.rank, a.world, a.addr, spec)
