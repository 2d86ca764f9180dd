"""GGUF -> hyper-parameters and weights placed on devices (llama.cpp's src/llama-model.cpp:
`load_hparams`, `load_tensors`).

`-ngl` decides where weights live — and only that; the scheduler then follows the weights. The
rule is llama.cpp's: `i_gpu_start = max(n_layer + 1 - ngl, 0)`; repeating layers `il >=
i_gpu_start` and the output layer (index `n_layer`) go to the GPU; the input embedding always
stays on the CPU (a GET_ROWS of a few rows gains nothing from a GPU). A tied output (no
`output.weight`) is a second copy of `token_embd` in the output layer's buffer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..backend.interface import Buffer, BufferUsage, Device
from ..tensor import Tensor, TensorFlag
from ..types import SUPPORTED_TYPES, GGMLType, GGUFError, OutOfMemoryError, UnsupportedError
from .gguf import GGUFFile

SUPPORTED_ARCHS = ("llama",)

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


@dataclass(frozen=True)
class LlamaParams:
    """Hyper-parameters of a llama model (llama_hparams)."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_freq_base: float
    rope_freq_scale: float = 1.0
    rope_type: int = 0  # 0 = normal (llama), 2 = neox

    @property
    def n_embd_gqa(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_metadata(cls, md: Any, n_vocab: int) -> LlamaParams:
        arch = md.get("general.architecture")
        if arch is None:
            raise GGUFError("missing key 'general.architecture'")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedError(f"unsupported architecture {arch!r} (llamapy runs: {', '.join(SUPPORTED_ARCHS)})")

        def key(name: str, default: Any = None, kind: type = int) -> Any:
            k = f"{arch}.{name}"
            if k not in md:
                if default is None:
                    raise GGUFError(f"missing key {k!r}")
                return default
            v = md[k]
            if hasattr(v, "__len__") and not isinstance(v, str):
                v = v[0] if len(v) else default  # per-layer arrays: llamapy needs them uniform
            try:
                return kind(v)
            except (TypeError, ValueError):
                raise GGUFError(f"key {k!r} has value {v!r}, expected {kind.__name__}") from None

        n_embd = key("embedding_length")
        n_head = key("attention.head_count")
        if n_head <= 0 or n_embd <= 0:
            raise GGUFError(f"invalid head_count {n_head} / embedding_length {n_embd}")
        n_head_kv = key("attention.head_count_kv", n_head)
        head_dim = key("attention.key_length", n_embd // n_head)
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        factor = float(md.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
        freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
        if scaling not in ("none", "linear", "llama3"):
            raise UnsupportedError(f"rope scaling {scaling!r} is not supported (none, linear, llama3 are)")
        p = cls(
            n_layer=key("block_count"),
            n_embd=n_embd,
            n_ff=key("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_rot=key("rope.dimension_count", head_dim),
            n_vocab=n_vocab,
            n_ctx_train=key("context_length", 2048),
            rms_eps=key("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_freq_base=key("rope.freq_base", 10000.0, float),
            rope_freq_scale=freq_scale,
        )
        p.validate()
        return p

    def validate(self) -> None:
        if not 0 < self.n_layer <= 4096:
            raise GGUFError(f"block_count {self.n_layer} out of range")
        if self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise GGUFError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.head_dim * self.n_head != self.n_embd:
            raise GGUFError(f"head_dim {self.head_dim} x {self.n_head} heads != embedding_length {self.n_embd}")
        if self.n_rot <= 0 or self.n_rot > self.head_dim or self.n_rot % 2:
            raise GGUFError(f"rope.dimension_count {self.n_rot} invalid for head_dim {self.head_dim}")
        if self.n_ff <= 0 or self.n_vocab <= 0 or not (0 < self.rms_eps < 1):
            raise GGUFError("feed_forward_length, vocabulary or rms epsilon out of range")


@dataclass
class Placement:
    """Where each layer's weights live: index n_layer is the output layer."""

    layer_device: list[Device]  # n_layer + 1 entries
    n_gpu_layers: int
    i_gpu_start: int
    cpu: Device


def place_layers(
    n_layer: int, ngl: int, cpu: Device, gpus: Sequence[Device], tensor_split: Sequence[float] = (), main_gpu: int = 0
) -> Placement:
    """llama.cpp's rule: the last `ngl` of the n_layer+1 layers (the output counts as one) go to
    the GPUs, spread over them in contiguous runs in the ratio `tensor_split`."""
    n_total = n_layer + 1
    if ngl < 0 or ngl > n_total:
        ngl = n_total  # clamp, as llama.cpp does
    if not gpus:
        ngl = 0
    i_gpu_start = max(n_total - ngl, 0)
    devices: list[Device] = [cpu] * n_total
    if ngl:
        if tensor_split and any(x > 0 for x in tensor_split[: len(gpus)]):
            weights = [float(x) for x in tensor_split[: len(gpus)]] + [0.0] * (len(gpus) - len(tensor_split))
        else:
            weights = [0.0] * len(gpus)
            weights[min(max(main_gpu, 0), len(gpus) - 1)] = 1.0
        total = sum(weights)
        bounds = []  # cumulative fractions, as llama.cpp's `splits`
        acc = 0.0
        for w in weights:
            acc += w / total
            bounds.append(acc)
        for il in range(i_gpu_start, n_total):
            frac = (il - i_gpu_start) / ngl
            g = next((i for i, b in enumerate(bounds) if frac < b), len(gpus) - 1)
            devices[il] = gpus[g]
    return Placement(devices, ngl, i_gpu_start, cpu)


@dataclass
class ModelWeights:
    tok_embd: Tensor
    output_norm: Tensor
    output: Tensor
    layers: list[dict[str, Tensor]]
    rope_freqs: Tensor | None
    buffers: list[Buffer] = field(default_factory=list)
    placement: Placement | None = None
    tied_output: bool = False

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers.clear()


def _weight(gf: GGUFFile, name: str, expect: tuple[int, ...] | None) -> Tensor:
    info = gf.tensors.get(name)
    if info is None:
        raise GGUFError(f"missing tensor {name!r}")
    if info.type not in SUPPORTED_TYPES:
        raise UnsupportedError(f"tensor {name!r} has quant type {info.type.name}, which llamapy does not support")
    if expect is not None and tuple(info.shape) != expect:
        raise GGUFError(f"tensor {name!r} has shape {list(info.ne)}, expected {list(reversed(expect))}")
    return Tensor(name, tuple(info.shape), info.type, flags=TensorFlag.WEIGHT)


FUSED_FROM = "fused_from"  # Tensor.params key: the GGUF tensors a fused weight concatenates


def _fuse(layer: dict[str, Tensor], il: int, parts: tuple[str, ...], name: str) -> None:
    """Replace matrices that multiply the same input by one whose rows are theirs, stacked:
    one MUL_MAT instead of several (llama.cpp's wqkv / ffn_gate_up when a model ships them).
    Only matrices of one type can share a buffer of quantized blocks."""
    ts = [layer[k] for k in parts]
    if len({t.type for t in ts}) != 1:
        return
    rows = sum(t.shape[0] for t in ts)
    fused = Tensor(f"blk.{il}.{name}.weight", (rows, ts[0].shape[1]), ts[0].type, flags=TensorFlag.WEIGHT)
    fused.params[FUSED_FROM] = tuple(t.name for t in ts)
    for k in parts:
        del layer[k]
    layer[name] = fused


def collect_weights(gf: GGUFFile, p: LlamaParams, fuse: bool = True) -> ModelWeights:
    """Tensor descriptors for every llama weight, shapes checked against the hyper-parameters."""
    e, q, kv, ff = p.n_embd, p.n_head * p.head_dim, p.n_embd_gqa, p.n_ff
    tok = _weight(gf, "token_embd.weight", (p.n_vocab, e))
    layers = []
    for il in range(p.n_layer):
        shapes = {
            "attn_norm": (e,), "attn_q": (q, e), "attn_k": (kv, e), "attn_v": (kv, e),
            "attn_output": (e, q), "ffn_norm": (e,), "ffn_gate": (ff, e), "ffn_up": (ff, e),
            "ffn_down": (e, ff),
        }  # fmt: skip
        layer = {k: _weight(gf, f"blk.{il}.{k}.weight", s) for k, s in shapes.items()}
        if fuse:
            _fuse(layer, il, ("attn_q", "attn_k", "attn_v"), "attn_qkv")
            _fuse(layer, il, ("ffn_gate", "ffn_up"), "ffn_gate_up")
        layers.append(layer)
    extra = [n for n in gf.tensors if n.startswith(f"blk.{p.n_layer}.")]
    if extra:
        raise GGUFError(f"tensor {extra[0]!r} beyond block_count {p.n_layer}")
    tied = "output.weight" not in gf.tensors
    if tied:
        output = Tensor("output.weight", tok.shape, tok.type, flags=TensorFlag.WEIGHT)
    else:
        output = _weight(gf, "output.weight", (p.n_vocab, e))
    rope_freqs = None
    if "rope_freqs.weight" in gf.tensors:
        rope_freqs = _weight(gf, "rope_freqs.weight", (p.n_rot // 2,))
    return ModelWeights(tok, _weight(gf, "output_norm.weight", (e,)), output, layers, rope_freqs, tied_output=tied)


class ConcatRows:
    """The bytes of a fused weight: its parts' rows stacked, materialized only when a backend
    asks for the array (a backend whose cache already holds the prepared weight never does)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate(self.parts)
        return out if dtype is None else out.astype(dtype)


def cache_key(path: Path) -> str:
    """Identifies a model file for caches of prepared weights: path, size, modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]


def weight_devices(
    w: ModelWeights, placement: Placement, overrides: Sequence[tuple[str, Device]] = ()
) -> dict[Tensor, Device]:
    """Which device holds each weight: the layer rule, then `-ot REGEX=DEVICE` overrides."""
    n_layer = len(w.layers)
    where: dict[Tensor, Device] = {}
    # the input embedding stays on the CPU whatever -ngl says
    where[w.tok_embd] = placement.cpu
    for il, layer in enumerate(w.layers):
        for t in layer.values():
            where[t] = placement.layer_device[il]
    for t in (w.output_norm, w.output):
        where[t] = placement.layer_device[n_layer]
    if w.rope_freqs is not None:
        where[w.rope_freqs] = placement.layer_device[n_layer]
    for t in where:
        names = (t.name, *t.params.get(FUSED_FROM, ()))
        for pattern, dev in overrides:
            if any(re.search(pattern, n) for n in names):
                where[t] = dev
                break
    return where


def load_weights(gf: GGUFFile, w: ModelWeights, placement: Placement, where: dict[Tensor, Device],
                 cpu_matmul: str = "q8") -> None:
    """Allocate one weights buffer per device and set every tensor from the mapped file
    (host matrices laid out for the `cpu_matmul` mode, ContextOptions.cpu_matmul).

    On OutOfMemoryError everything allocated so far is freed before the error propagates.
    """
    by_dev: dict[str, tuple[Device, list[Tensor]]] = {}
    for t, dev in where.items():
        by_dev.setdefault(dev.name, (dev, []))[1].append(t)
    # a tied output in the embedding's own buffer is the same bytes: counted and stored once
    shared_output = w.tied_output and where[w.output] is where[w.tok_embd]
    try:
        for dev, tensors in by_dev.values():
            buft = dev.buffer_type()
            size = sum(buft.alloc_size(t) for t in tensors if not (shared_output and t is w.output))
            buf = buft.alloc_buffer(size, BufferUsage.WEIGHTS)
            w.buffers.append(buf)
            buf.use_cache(cache_key(gf.path), cpu_matmul)
            for t in tensors:
                if shared_output and t is w.output:
                    t.buffer = buf
                    buf._store[t] = buf.storage(w.tok_embd)
                    buf._raw[t] = buf.raw(w.tok_embd)
                    continue
                buf.alloc_tensor(t)
                if FUSED_FROM in t.params:
                    buf.set(t, ConcatRows([gf.tensor_bytes(n) for n in t.params[FUSED_FROM]]))  # type: ignore[arg-type]
                    continue
                src = "token_embd.weight" if (t is w.output and w.tied_output) else t.name
                buf.set(t, gf.tensor_bytes(src))
            buf.finish_loading()
    except OutOfMemoryError:
        w.free()
        for t in where:
            t.buffer = None
        raise
    w.placement = placement
