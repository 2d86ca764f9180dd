"""Model and Context: a loaded GGUF, and the state to evaluate it (llama.cpp's `llama_model`,
`llama_context`: `llama_model_load`, `llama_decode`).

The Context picks backends in priority order — GPU, then ACCEL, then CPU (the CPU last, the
fallback for every op) — creates the scheduler and runs every micro-batch through it. Graphs are
cached by shape `(n_tokens, n_outputs)`: the number of cells attended (llama.cpp's n_kv, the used
cells padded to 256) is the width of the mask's value, an input, so decoding one token at a time
builds and plans its graph once, at any length of history (llama.cpp rebuilds its graph when n_kv
grows).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .backend.cpu import CPUBackend
from .backend.interface import Backend, Buffer, BufferUsage, Device
from .backend.registry import Discovery, discover
from .model.gguf import GGUFFile
from .model.kv_cache import KVCache
from .model.loader import (
    ModelWeights,
    Placement,
    check_split_options,
    collect_weights,
    load_weights,
    override_devices,
    place_layers,
    select_devices,
    split_proportions,
    weight_devices,
)
from .model.control_vector import ControlVector, load_control_vector, read_control_vectors
from .model.lora import LoraAdapter, adapted, load_adapter, read_adapter, terms
from .model.tokenizer import Tokenizer
from .models import OUTPUTS, HParams, ModelGraph, UBatch, build_graph, read_hparams
from .sched.scheduler import Plan, Scheduler
from .tensor import Tensor
from .types import DeviceType, GGMLType, LlamapyError, OutOfMemoryError, UnsupportedError, block_size, row_nbytes


@dataclass
class ModelOptions:
    """Where the weights go (llama_model_params)."""

    n_gpu_layers: int | str = 0  # an int, "all" or "auto"
    override_tensor: Sequence[tuple[str, str]] = ()  # (regex, device name)
    tensor_split: Sequence[float] = ()
    main_gpu: int = 0  # checked against the GPUs; the layer split uses every GPU (-ts, else free memory)
    devices: Sequence[str] | None = None  # restrict to these device names
    lora: Sequence[tuple[str, float]] = ()  # LoRA adapters (path, scale): --lora, --lora-scaled
    # control vectors (path, strength) and the layers they apply to (--control-vector-layer-range)
    control_vectors: Sequence[tuple[str, float]] = ()
    control_vector_layers: tuple[int, int] | None = None


@dataclass
class ContextOptions:
    """How the model is evaluated (llama_context_params)."""

    n_ctx: int = 4096  # 0: the model's training context
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0  # 0: every core
    # f16 by default, as llama.cpp: with it the q8 path gives llama.cpp's logits for the same file
    # (bench/RESULTS.md, "op by op"); f32 doubles the cache, q8_0 / q4_0 (model/kv_cache.py) take
    # about a half / a quarter of f16
    type_k: GGMLType = GGMLType.F16
    type_v: GGMLType = GGMLType.F16
    no_kv_offload: bool = False
    op_offload: bool = True
    # CPU MUL_MAT: "q8" quantizes the activations as llama.cpp does (its numbers for the same
    # file); "f32" multiplies the weights with float32 activations (exactness studies)
    cpu_matmul: str = "q8"


@dataclass
class LoadInfo:
    """What the CLI reports about a load (llama.cpp's load log)."""

    file_size: int  # all files of a split model
    n_params: int
    type_counts: dict[str, int]
    file_type: str
    load_ms: float
    buffer_sizes: dict[str, int] = field(default_factory=dict)
    n_gpu_layers: int = 0
    i_gpu_start: int = 0
    ngl_reason: str = ""
    warnings: list[str] = field(default_factory=list)  # e.g. a repack cache that cannot be written
    # what -ot / --cpu-moe / --n-cpu-moe moved off the device -ngl gave: device -> (tensors, bytes)
    overridden: dict[str, tuple[int, int]] = field(default_factory=dict)
    n_files: int = 1  # a split model's files (llama-gguf-split)


class Model:
    """A GGUF model with its weights placed on devices (llama_model)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: ModelOptions | None = None,
        context_options: ContextOptions | None = None,
    ) -> None:
        """`context_options` say what the context will need, so that -ngl auto and the
        out-of-memory message can count the KV cache and compute buffers too."""
        # backends are imported first: imports are reported apart from the
        # load time, as llama.cpp's load time starts with the model file
        self.discovery: Discovery = discover()
        t0 = time.perf_counter()
        self.options = options or ModelOptions()
        self.fit_options = context_options or ContextOptions()
        self.path = Path(path)
        self.gguf = GGUFFile(self.path)
        md = self.gguf.metadata
        self.tokenizer = Tokenizer.from_metadata(md)
        self.params: HParams = read_hparams(md, self.tokenizer.n_vocab)
        self.arch = md.get("general.architecture")
        self.name = md.get("general.name", self.path.stem)
        self.devices = select_devices(self.discovery.devices(), self.options.devices)
        self.cpu = next(d for d in self.devices if d.type is DeviceType.CPU)
        self.gpus = [d for d in self.devices if d.type is DeviceType.GPU]
        check_split_options(self.options.tensor_split, self.options.main_gpu, self.gpus)
        # fixed before any weight is loaded: later fits (-ngl auto, error messages) see the same
        # split, not one skewed by what this model already holds
        self.split = split_proportions(self.gpus, self.options.tensor_split, self.cpu)
        self.adapters: list[LoraAdapter] = []
        self.control_vector: ControlVector | None = None
        try:
            for path_, scale in self.options.lora:
                self.adapters.append(read_adapter(path_, scale, self.arch, self.gguf))
            if self.options.control_vectors:
                self.control_vector = read_control_vectors(self.options.control_vectors, self.params.n_embd,
                                                           self.params.n_layer, self.options.control_vector_layers)  # fmt: skip
        except LlamapyError:
            self.free()
            raise
        self.weights: ModelWeights = collect_weights(self.gguf, self.params, apart=adapted(self.adapters))
        self.overrides = override_devices(self.options.override_tensor, self.discovery, self.devices)
        # why the context should run without op offload ("" = it may): set by -ngl auto
        self.op_offload_off = ""
        ngl, reason = self._resolve_ngl(self.options.n_gpu_layers)
        self.placement = self._place(ngl)
        where = weight_devices(self.weights, self.placement, self.overrides)
        try:
            load_weights(self.gguf, self.weights, self.placement, where, self.fit_options.cpu_matmul)
        except OutOfMemoryError as e:
            fit = self.max_layers_that_fit(op_offload=False)  # a context falls back to it
            raise OutOfMemoryError(
                f"-ngl {self.placement.n_gpu_layers} does not fit ({e}); at most {fit} layers would fit"
            ) from None
        by_name = {t.name: dev for t, dev in where.items()}
        try:
            for ad in self.adapters:  # each pair beside the matrix it adapts
                load_adapter(ad, by_name, self.fit_options.cpu_matmul)
            if self.control_vector is not None:  # each layer's direction on that layer's device
                load_control_vector(self.control_vector, self.placement.layer_device)
        except LlamapyError as e:
            self.free()
            if isinstance(e, OutOfMemoryError):
                raise OutOfMemoryError(f"the LoRA adapters and control vector do not fit beside the model ({e})") from None
            raise
        self.info = LoadInfo(
            file_size=self.gguf.total_size,
            n_files=len(self.gguf.splits) + 1,
            n_params=sum(t.n_elements for t in self.gguf.tensors.values()),
            type_counts=self.gguf.describe_types(),
            file_type=_file_type_name(md.get("general.file_type")),
            load_ms=(time.perf_counter() - t0) * 1e3,
            buffer_sizes={b.name: b.nbytes for b in self.weights.buffers},
            n_gpu_layers=self.placement.n_gpu_layers,
            i_gpu_start=self.placement.i_gpu_start,
            ngl_reason=reason,
            warnings=[n for b in self.weights.buffers if (n := getattr(b, "cache_note", None))],
            overridden=self._overridden(where),
        )

    def _overridden(self, where: dict[Tensor, Device]) -> dict[str, tuple[int, int]]:
        by_layer = weight_devices(self.weights, self.placement)
        out: dict[str, tuple[int, int]] = {}
        for t, dev in where.items():
            if by_layer[t] is not dev:
                n, size = out.get(dev.name, (0, 0))
                out[dev.name] = (n + 1, size + t.nbytes)
        return out

    # -- devices and -ngl -------------------------------------------------------------------

    def _place(self, ngl: int) -> Placement:
        return place_layers(self.params.n_layer, ngl, self.cpu, self.gpus, self.split)

    def _resolve_ngl(self, ngl: int | str) -> tuple[int, str]:
        n_total = self.params.n_layer + 1
        if ngl == "all":
            return n_total, ""
        if ngl == "auto":
            if not self.gpus:
                return 0, "-ngl auto: no GPU, every layer stays on the CPU"
            n = self.max_layers_that_fit()
            margins = ", ".join(f"{d.name} {self.margin(d) / 2**20:.0f} MiB" for d in self.gpus)
            reason = f"-ngl auto: {n}/{n_total} layers fit the free GPU memory (margin: {margins})"
            if n < n_total and self.params.n_expert:
                k = self._experts_to_cpu()
                if k is not None:
                    return n_total, f"{reason}; all of them with the experts of the first {k} on the CPU (as --n-cpu-moe {k})"
            n, note = self._fit_without_op_offload(n)
            return n, f"{reason}; {note}" if note else reason
        return int(ngl), ""

    def _experts_to_cpu(self) -> int | None:
        """-ngl auto on a mixture of experts: the fewest first layers whose experts, kept in host
        memory, let every layer's attention and router fit the GPUs (llama.cpp's fit moves experts
        before layers: attention runs every token, an expert only when chosen). Sets the
        overrides; None when even all the experts on the CPU leave too little room."""
        from .model.loader import expert_overrides

        user = list(self.overrides)
        free = {d.name: d.memory()[0] - self.margin(d) for d in self.gpus}
        for k in range(1, self.params.n_layer + 1):
            self.overrides = user + [(p, self.cpu) for p, _ in expert_overrides(k)]
            need = self.device_bytes(self.params.n_layer + 1)
            if all(need[n] <= free[n] for n in need if n in free):
                return k
        self.overrides = user
        return None

    def _fit_without_op_offload(self, n: int) -> tuple[int, str]:
        """-ngl auto: when op offload's compute buffers cost layers, more layers win (they speed
        up every token; op offload only the prompt) and op offload is turned off."""
        n_total = self.params.n_layer + 1
        if not self.fit_options.op_offload or n >= n_total:
            return n, ""
        n_without = self.max_layers_that_fit(op_offload=False)
        if n_without <= n:
            return n, ""
        self.op_offload_off = f"op offload off: its compute buffers leave room for {n} layers, {n_without} without"
        return n_without, f"{n_without}/{n_total} without op offload, which is turned off (as --no-op-offload)"

    @staticmethod
    def margin(dev: Device) -> int:
        """Memory left free on a device for what llamapy does not plan (driver, CuPy's pool)."""
        return 0 if dev.name.startswith("TEST") else 512 * 2**20

    def device_bytes(self, ngl: int, op_offload: bool | None = None) -> dict[str, int]:
        """Bytes each device needs at -ngl `ngl`: weights, KV cache and compute buffers (with op
        offload as the context options say, unless `op_offload` is given)."""
        from .model.fit import device_bytes

        o = self.fit_options
        pl = self._place(ngl)
        n_ctx = o.n_ctx if o.n_ctx > 0 else self.params.n_ctx_train
        kv_devices = [pl.cpu if o.no_kv_offload else pl.layer_device[il] for il in range(self.params.n_layer)]
        where = weight_devices(self.weights, pl, self.overrides)
        return device_bytes(
            self.params, self.weights, where, kv_devices, self.devices, n_ctx,
            min(o.n_ubatch, o.n_batch), o.type_k, o.type_v,
            o.op_offload if op_offload is None else op_offload,
        )  # fmt: skip

    def max_layers_that_fit(self, op_offload: bool | None = None) -> int:
        """The largest -ngl whose weights, KV cache and compute buffers fit every GPU's free
        memory minus its margin (op offload as in `device_bytes`)."""
        free = {d.name: d.memory()[0] - self.margin(d) for d in self.gpus}
        for b in self.weights.buffers:  # what this model already holds would be given back
            if b.name in free:
                free[b.name] += b.nbytes
        best = 0
        for ngl in range(1, self.params.n_layer + 2):
            need = self.device_bytes(ngl, op_offload)
            if all(need[k] <= free[k] for k in need if k in free):
                best = ngl
            else:
                break
        return best

    def free(self) -> None:
        """Release the weights' buffers, the adapters' and the files' mappings (idempotent)."""
        if hasattr(self, "weights"):
            self.weights.free()
        for ad in self.adapters:
            ad.free()
        if self.control_vector is not None:
            self.control_vector.free()
        self.gguf.close()


class Context:
    """Evaluation state: the KV cache, the scheduler and the graph cache (llama_context)."""

    def __init__(self, model: Model, options: ContextOptions | None = None) -> None:
        self.model = model
        self.options = o = options or ContextOptions()
        p = model.params
        self.n_ctx = o.n_ctx if o.n_ctx > 0 else p.n_ctx_train
        self.n_batch = min(o.n_batch, self.n_ctx)
        self.n_ubatch = min(o.n_ubatch, self.n_batch)
        pl = model.placement
        kv_devices = [pl.cpu if o.no_kv_offload else pl.layer_device[il] for il in range(p.n_layer)]
        self._check_host_memory(kv_devices)
        try:
            self.kv = KVCache.create(
                self.n_ctx, [p.n_embd_k_gqa(il) for il in range(p.n_layer)], kv_devices, o.type_k, o.type_v,
                [p.n_embd_v_gqa(il) for il in range(p.n_layer)],
            )
        except OutOfMemoryError as e:
            raise self._oom(f"KV cache for -c {self.n_ctx}: {e}") from None
        if os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0").strip() in ("", "0"):  # llama.cpp's switch
            self.kv.set_rotation(p.head_dim, p.head_dim_v)
        self.backends: list[Backend] = [d.init_backend() for d in model.devices]
        for be in self.backends:
            be.set_n_threads(o.n_threads)
            if hasattr(be, "set_cpu_matmul"):  # CPU (and BLAS) products, CUDA's GPU plans
                be.set_cpu_matmul(o.cpu_matmul)
        self.sched = Scheduler(self.backends, op_offload=o.op_offload and not model.op_offload_off)
        # what the context changed to fit the memory (the CLI logs it); "" = nothing
        self.fit_note = ""
        self._graphs: dict[tuple[int, int, str, tuple[float, ...]], ModelGraph] = {}
        # each adapter's scale here (llama_set_adapter_lora); 0 leaves it out of the graphs
        self.lora_scales: tuple[float, ...] = tuple(ad.scale for ad in model.adapters)
        self._invariant: bool | None = None  # batch_invariant(), worked out on first use
        self.compute_buffers: list[Buffer] = []
        self.freed = False
        self.compute_sizes = self._reserve_compute()

    def _check_host_memory(self, kv_devices: Sequence[Device]) -> None:
        """A -c too large for the host fails here, with the figures, not in the allocator."""
        o = self.options
        p = self.model.params
        self._check_cache_types(kv_devices)
        need = self.n_ctx * sum(
            row_nbytes(o.type_k, p.n_embd_k_gqa(il)) + row_nbytes(o.type_v, p.n_embd_v_gqa(il))
            for il, d in enumerate(kv_devices) if d.type is not DeviceType.GPU
        )  # fmt: skip
        free = self.model.cpu.memory()[0]
        if free and need > free:
            raise OutOfMemoryError(
                f"-c {self.n_ctx} needs {need / 2**20:.0f} MiB of host memory for the KV cache, "
                f"only {free / 2**20:.0f} MiB are available"
            )

    def _check_cache_types(self, kv_devices: Sequence[Device]) -> None:
        """A quantized cache needs heads of whole Q8_0/Q4_0 blocks (llama.cpp's check), and runs
        on the host and TEST devices (the CUDA kernels read f32/f16 caches only)."""
        o = self.options
        p = self.model.params
        for t, name, width in ((o.type_k, "-ctk", p.head_dim), (o.type_v, "-ctv", p.head_dim_v)):
            if t in (GGMLType.F32, GGMLType.F16):
                continue
            blck = block_size(t)[0]
            if width % blck:
                raise UnsupportedError(
                    f"{name} {t.name.lower()}: the head size {width} is not a multiple of {t.name}'s block of {blck}"
                )
            if any(d.name.startswith("CUDA") for d in kv_devices):
                raise UnsupportedError(f"{name} {t.name.lower()}: a quantized KV cache on CUDA is not supported (use -nkvo)")

    def _reserve_compute(self) -> dict[str, int]:
        """Plan the worst-case graph (a full micro-batch over the whole context) and reserve
        each device's compute buffer from its memory (ggml_backend_sched_reserve).

        When the buffers do not fit with op offload (which puts the prompt's host-weight ops and
        their intermediates on a GPU), the context falls back to running without it — a smaller
        GPU reservation — and says so in `fit_note`; when they still do not fit, the error
        names the -ngl and -ub that would."""
        n = self.n_ubatch
        try:
            return self._alloc_compute()
        except OutOfMemoryError as e:
            first = e
        if self.sched.op_offload:
            self.sched.set_op_offload(False)
            try:
                sizes = self._alloc_compute()
            except OutOfMemoryError:
                pass
            else:
                self.fit_note = f"op offload turned off: with it the compute buffers do not fit ({first})"
                return sizes
        ub = self._ubatch_that_fits()
        self.free()
        hint = f", or -ub {ub} at this -ngl" if ub else ""
        raise self._oom(f"compute buffers for -ub {n}, -c {self.n_ctx}: {first}", hint) from None

    def _alloc_compute(self) -> dict[str, int]:
        """Reserve the planned compute buffers; on OutOfMemoryError none stays allocated."""
        from .model.fit import with_plan_arenas

        # (the GPU plans' arena: the fit's figure)
        # every adapter applied: a scale set later from 0 must not outgrow the buffers
        every = tuple(s or 1.0 for s in self.lora_scales)
        sizes = with_plan_arenas(self.sched, lambda n: self.graph(n, n, scales=every).graph, self.n_ubatch)
        try:
            for be in self.backends:
                size = sizes.get(be.name, 0)
                buft = be.device.buffer_type()
                if size and not buft.is_host:
                    self.compute_buffers.append(buft.alloc_buffer(size, BufferUsage.COMPUTE))
                limit = getattr(be.device, "limit_memory_pool", None)
                if limit is not None:  # CUDA: the pool may not grow past what was planned
                    limit(size)
        except OutOfMemoryError:
            for b in self.compute_buffers:
                b.free()
            self.compute_buffers.clear()
            raise
        return sizes

    def _ubatch_that_fits(self) -> int | None:
        """The largest smaller -ub whose compute buffers fit what the weights and KV cache left."""
        from .model.fit import largest_ubatch_that_fits

        free = {be.name: be.device.memory()[0] for be in self.backends if not be.device.buffer_type().is_host}
        if not free:
            return None
        m = self.model
        return largest_ubatch_that_fits(
            m.params, m.weights, self.kv, m.devices, self.n_ctx, self.n_ubatch, free, self.sched.op_offload
        )

    def _oom(self, what: str, hint: str = "") -> OutOfMemoryError:
        ngl = self.model.placement.n_gpu_layers
        fit = self.model.max_layers_that_fit(op_offload=False)  # the context falls back to it
        return OutOfMemoryError(f"-ngl {ngl} does not fit ({what}); at most {fit} layers would fit{hint}")

    def free(self) -> None:
        """Release the KV cache, the compute buffers and every cached graph and plan (whose
        nodes reference the weights) — idempotent."""
        self.freed = True
        self.kv.free()
        for b in self.compute_buffers:
            b.free()
        self.compute_buffers.clear()
        for g in self._graphs.values():  # their compiled plans hold the cache and the weights
            self.sched.forget(g.graph)
        self._graphs.clear()

    # -- graphs ---------------------------------------------------------------------------

    def set_lora_scales(self, scales: Sequence[float]) -> None:
        """Each loaded adapter's scale for the next micro-batches (llama_set_adapter_lora; 0:
        not applied); graphs are cached per set of scales."""
        scales = tuple(float(s) for s in scales)
        if len(scales) != len(self.model.adapters) or not all(np.isfinite(scales)):
            raise LlamapyError(f"expected {len(self.model.adapters)} finite LoRA scales, got {list(scales)}")
        self.lora_scales = scales

    def graph(self, n_tokens: int, n_outputs: int, output: str = "logits",
              scales: tuple[float, ...] | None = None) -> ModelGraph:  # fmt: skip
        scales = self.lora_scales if scales is None else scales
        key = (n_tokens, n_outputs, output, scales)
        g = self._graphs.pop(key, None)
        if g is None:
            if len(self._graphs) > 16:  # prompt tails of many sizes: keep the cache small
                # least recently used first (a hit moves its graph to the end): the decode
                # shapes a server reuses every step outlive its one-off prompt shapes
                for old in list(self._graphs.values())[:8]:
                    self.sched.forget(old.graph)
                self._graphs = dict(list(self._graphs.items())[8:])
            cv = self.model.control_vector
            g = build_graph(self.model.params, self.model.weights, self.kv, n_tokens, n_outputs, output,
                            terms(self.model.adapters, scales), cv.tensors if cv is not None else None)  # fmt: skip
        self._graphs[key] = g
        return g

    def batch_invariant(self) -> bool:
        """Whether a token's logits are the same bits in any batch (alone, beside other
        sequences' tokens, in a prompt chunk of any size): every node of a full micro-batch runs
        on the CPU backend in the 8-bit mode and every MUL_MAT on the per-block q8 kernels (no
        float32 tiles + sgemm, no BLAS, no GPU), whose numbers do not depend on the row count;
        attention's three passes do not either (ops.c). The engine then puts decode tokens and
        prompt chunks in one micro-batch (llama-server's update_slots)."""
        if self._invariant is None:
            self._invariant = self._check_invariant()
        return self._invariant

    def _check_invariant(self) -> bool:
        from .backend.qmatmul import QMatrix
        from .tensor import Op

        n = self.n_ubatch
        plan = self.sched.reserve(self.graph(n, n).graph)
        for split in plan.splits:
            be = self.backends[split.backend]
            if type(be) is not CPUBackend or be.cpu_matmul != "q8":
                return False
            for node in split.nodes:
                if node.op is not Op.MUL_MAT:
                    continue
                r = node.src[0].root()
                value = r.buffer.storage(r) if r.buffer is not None and r.buffer.buft.is_host else None
                if not isinstance(value, QMatrix) or any(value.path(k, True) != "q8" for k in (1, n)):
                    return False
        return True

    def plan(self, n_tokens: int, n_outputs: int | None = None) -> Plan:
        """Plan (without running) the graph of a batch of n_tokens."""
        return self.sched.reserve(self.graph(n_tokens, n_outputs or n_tokens).graph)

    # -- decoding -------------------------------------------------------------------------

    def decode(
        self,
        tokens: Sequence[int] | np.ndarray,
        pos: Sequence[int] | np.ndarray,
        seq: Sequence[int] | np.ndarray | int = 0,
        logits: Sequence[bool] | np.ndarray | None = None,
        output: str = "logits",
    ) -> np.ndarray:
        """Evaluate a batch (llama_decode): returns the logits (n_outputs, n_vocab) of the
        tokens whose `logits` flag is set (default: only the last token) — with `output` "embd",
        their embeddings (n_outputs, n_embd) instead (the output norm's rows, not pooled); "rank",
        a reranker's scores of them (n_outputs, n_cls_out)."""
        if self.freed:
            raise LlamapyError("decode: this context was freed (its Llama is closed)")
        toks = np.asarray(tokens, np.int32)
        n = len(toks)
        if n == 0:
            raise LlamapyError("decode: empty batch")
        positions = np.asarray(pos, np.int64)
        seqs = np.array([seq] * n, np.int64) if type(seq) is int or np.isscalar(seq) else np.asarray(seq, np.int64)
        if toks.ndim != 1 or positions.shape != (n,) or seqs.shape != (n,):
            raise LlamapyError(f"decode: {n} tokens need {n} positions and sequence ids")
        if logits is not None:
            want = np.zeros(n, bool)
            want[:] = np.asarray(logits, bool)
        n_vocab = self.model.params.n_vocab
        if output != "logits" and output not in OUTPUTS:
            raise LlamapyError(f"decode: output {output!r}: expected one of {', '.join(OUTPUTS)}")
        # the bounds as Python ints (a decode step's one token: no array reductions)
        t, p, q = toks.tolist(), positions.tolist(), seqs.tolist()
        if min(t) < 0 or max(t) >= n_vocab:
            raise LlamapyError(f"token id out of range [0, {n_vocab})")
        if min(q) < 0 or min(p) < 0:
            raise LlamapyError("decode: sequence ids and positions must be >= 0")
        # all or nothing: a batch the cache cannot hold is refused before any cell changes, and
        # a failure half-way (an error, Ctrl-C) frees the cells this call took
        if n <= self.n_ubatch:
            # one micro-batch (every decode step): its own find_slot refuses it before any cell
            # changes, and it frees its own cells; no slices to make
            out_ids = np.array([n - 1], np.int32) if logits is None else np.flatnonzero(want).astype(np.int32)
            rows = self._decode_ubatch(toks, positions, seqs, out_ids, output)
            return rows if rows is not None else self._no_rows(output)
        if logits is None:
            want = np.zeros(n, bool)
            want[-1] = True
        # several: the check for them all first, and the map of what was free to undo
        self.kv.find_slot(n)
        was_free = self.kv.pos < 0
        out: list[np.ndarray] = []
        try:
            for u0 in range(0, n, self.n_ubatch):
                u1 = min(n, u0 + self.n_ubatch)
                ids = np.flatnonzero(want[u0:u1]).astype(np.int32)
                rows = self._decode_ubatch(toks[u0:u1], positions[u0:u1], seqs[u0:u1], ids, output)
                if rows is not None:
                    out.append(rows)
        except BaseException:
            self.kv.release(np.flatnonzero(was_free))
            raise
        # one micro-batch's rows (a prompt's last token) are a fresh array already (the executor
        # copies its exports out of its arena; run_nodes computes them): not copied again
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else self._no_rows(output)

    def _no_rows(self, output: str) -> np.ndarray:
        p = self.model.params
        return np.zeros((0, {"logits": p.n_vocab, "embd": p.n_embd, "rank": p.n_cls_out}[output]), np.float32)

    def _decode_ubatch(
        self, toks: np.ndarray, pos: np.ndarray, seq: np.ndarray, out_ids: np.ndarray, output: str = "logits"
    ) -> np.ndarray | None:
        """One micro-batch; `out_ids`: its rows whose logits (or `output`) are wanted."""
        n = len(toks)
        n_outputs = len(out_ids)
        # the graph always produces at least one row; unwanted ones are dropped below
        ids = out_ids if n_outputs else np.array([n - 1], np.int32)
        idx = self.kv.find_slot(n, seq)
        self.kv.commit(idx, pos, seq)
        try:
            g = self.graph(n, len(ids), output)
            result = self.sched.compute(g.graph, g.inputs.values(UBatch(toks, pos, seq, idx, ids, self.kv.n_kv(idx))))
        except BaseException:
            self.kv.release(idx)
            raise
        return result[g.logits] if n_outputs else None


_FILE_TYPES = {
    0: "all F32", 1: "mostly F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K",
    25: "IQ4_NL - 4.5 bpw", 30: "IQ4_XS - 4.25 bpw", 32: "BF16", 38: "MXFP4 MoE",
}  # fmt: skip


def _file_type_name(ft: int | None) -> str:
    return "unknown" if ft is None else _FILE_TYPES.get(int(ft), f"type {ft}")
