"""How much memory a placement needs on each device, before anything is allocated (the role of
llama.cpp's `llama_params_fit` / `-fit`: dry runs of the model, KV cache and compute buffers).

Weights and the KV cache are summed tensor by tensor; the compute buffers come from planning the
worst-case graph (a full micro-batch attending to the whole context) with the real scheduler
over *dry* buffers — buffers that carry a buffer type but hold nothing — so the figure is the
one `Context` will reserve. Planning works on copies of the weight descriptors: the model's own
tensors keep their buffers throughout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ..backend.interface import Buffer, BufferUsage, Device
from ..sched.alloc import plan_offsets
from ..graph import Graph
from ..sched.scheduler import Scheduler, split_exports
from ..tensor import Tensor
from ..types import GGMLType
from ..models import HParams, build_graph
from .kv_cache import KVCache
from .loader import ModelWeights


def kv_describe(p: HParams, n_ctx: int, type_k: GGMLType, type_v: GGMLType) -> KVCache:
    """The KV cache's tensors for a model, without memory."""
    n = p.n_layer
    return KVCache.describe(n_ctx, [p.n_embd_k_gqa(il) for il in range(n)], n, type_k, type_v,
                            [p.n_embd_v_gqa(il) for il in range(n)])  # fmt: skip


class DryBuffer(Buffer):
    """A buffer that only says where tensors would live."""

    def set(self, t: Tensor, data: np.ndarray) -> None:  # pragma: no cover - never called
        raise RuntimeError("a dry buffer holds no data")

    def get(self, t: Tensor) -> np.ndarray:  # pragma: no cover - never called
        raise RuntimeError("a dry buffer holds no data")


def compute_sizes(
    params: HParams,
    weights: ModelWeights,
    kv: KVCache,
    devices: Sequence[Device],
    n_ctx: int,
    n_ubatch: int,
    op_offload: bool = True,
) -> dict[str, int]:
    """Compute-buffer bytes per device name for the worst-case micro-batch graph."""
    n_tokens = min(n_ubatch, n_ctx)
    sched = Scheduler([d.init_backend() for d in devices], op_offload=op_offload)
    return with_plan_arenas(sched, lambda n: build_graph(params, weights, kv, n, n).graph, n_tokens)


def with_plan_arenas(sched: Scheduler, graph_of: Callable[[int], Graph], n_tokens: int) -> dict[str, int]:
    """Compute bytes per backend for the worst-case micro-batch graph `graph_of(n_tokens)` (and,
    where a backend makes GPU plans, the decode step's `graph_of(1)` too): the scheduler's compute
    buffer, and on a backend whose splits compile into GPU plans (`plan_arena_bytes`: CUDA) the
    one arena its plans share, as large as the largest — sized by `gpu_plan.arena_bytes`, the
    compiler's own passes, so the prompt products' f16 scratches count — alone when every split
    of the backend is a plan, else on top of the scheduler's buffer (a refused split's values,
    node by node, live beside the arena)."""
    gpu_plans = any(hasattr(be, "plan_arena_bytes") for be in sched.backends)
    plans = [sched.reserve(graph_of(n)) for n in dict.fromkeys((n_tokens, 1) if gpu_plans else (n_tokens,))]
    sizes = dict(plans[0].compute_sizes)
    for bi, be in enumerate(sched.backends):
        arena_of = getattr(be, "plan_arena_bytes", None)
        if arena_of is None:
            continue
        arenas = [arena_of(s.nodes, split_exports(p, si), plan_offsets) for p in plans for si, s in enumerate(p.splits)
                  if s.backend == bi]  # fmt: skip
        if arenas:
            refused = None in arenas
            sizes[be.name] = max(a or 0 for a in arenas) + (sizes.get(be.name, 0) if refused else 0)
    return sizes


def _dry_weights(weights: ModelWeights, where: dict[Tensor, Device]) -> tuple[ModelWeights, dict[str, Buffer]]:
    """Copies of the weight descriptors, each in a dry buffer of its planned device: planning
    never touches the model's own tensors (which a running context may be using)."""
    dry: dict[str, Buffer] = {}

    def shadow(t: Tensor) -> Tensor:
        dev = where[t]
        if dev.name not in dry:
            dry[dev.name] = DryBuffer(dev.buffer_type(), 0, BufferUsage.WEIGHTS)
        return dataclasses.replace(t, buffer=dry[dev.name])

    w = weights
    shadowed = ModelWeights(shadow(w.tok_embd), shadow(w.output_norm), shadow(w.output),
                            [{k: shadow(t) for k, t in layer.items()} for layer in w.layers],
                            shadow(w.rope_freqs) if w.rope_freqs is not None else None, tied_output=w.tied_output)
    return shadowed, dry


def device_bytes(
    params: HParams,
    weights: ModelWeights,
    where: dict[Tensor, Device],
    kv_devices: Sequence[Device],
    devices: Sequence[Device],
    n_ctx: int,
    n_ubatch: int,
    type_k: GGMLType = GGMLType.F16,
    type_v: GGMLType = GGMLType.F16,
    op_offload: bool = True,
) -> dict[str, int]:
    """Weights + KV cache + compute buffers, in bytes, per device name."""
    need: dict[str, int] = {}
    for t, dev in where.items():
        if not (t is weights.output and weights.tied_output and where[weights.tok_embd] is dev):
            need[dev.name] = need.get(dev.name, 0) + dev.buffer_type().alloc_size(t)
    dry_weights, _ = _dry_weights(weights, where)
    kv = kv_describe(params, n_ctx, type_k, type_v)
    for il, dev in enumerate(kv_devices):
        for t in (kv.k[il], kv.v[il]):
            t.buffer = DryBuffer(dev.buffer_type(), 0, BufferUsage.ANY)
            need[dev.name] = need.get(dev.name, 0) + dev.buffer_type().alloc_size(t)
    for name, size in compute_sizes(params, dry_weights, kv, devices, n_ctx, n_ubatch, op_offload).items():
        need[name] = need.get(name, 0) + size
    return need


def largest_ubatch_that_fits(
    params: HParams,
    weights: ModelWeights,
    kv: KVCache,
    devices: Sequence[Device],
    n_ctx: int,
    n_ubatch: int,
    free: dict[str, int],
    op_offload: bool = False,
) -> int | None:
    """The largest power-of-two `-ub` below `n_ubatch` whose compute buffers fit `free` (bytes
    per device name) on every device that has its own memory, or None: what the out-of-memory
    message suggests when the weights and KV cache fit but the compute buffers do not."""
    u = 1
    while u * 2 < n_ubatch:
        u *= 2
    while u >= 1:
        sizes = compute_sizes(params, weights, kv, devices, n_ctx, u, op_offload)
        if all(sizes.get(name, 0) <= room for name, room in free.items()):
            return u
        u //= 2
    return None
