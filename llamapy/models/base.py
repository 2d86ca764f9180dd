"""What every architecture shares: hyper-parameters read from the GGUF keys, the tensor spec and
its checks (llama.cpp's `llama_model::load_hparams` / `load_tensors` with `create_tensor`, and
`llama_hparams`; MLX-LM's `models/base.py`).

Key names come from gguf-py's `Keys` and tensor names from its `TENSOR_NAMES`; an architecture's
tensor spec is checked against gguf-py's `MODEL_TENSORS` for it, so a typo in a module fails its
tests rather than a load. Per-layer metadata arrays (`feed_forward_length`, `head_count`,
`head_count_kv`) are kept per layer, as llama.cpp's `get_key_or_arr` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, Keys

from ..types import GGUFError, UnsupportedError

if TYPE_CHECKING:
    from ..model.loader import ModelWeights
    from ..tensor import Tensor
    from .inputs import GraphInputs

ROPE_NORM = 0  # llama.cpp's LLAMA_ROPE_TYPE_NORM: rotates adjacent pairs
ROPE_NEOX = 2  # LLAMA_ROPE_TYPE_NEOX: rotates the two halves of a head

_REQUIRED = object()
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS


class KeyReader:
    """Typed access to `{arch}.*` keys (llama_model_loader::get_key / get_key_or_arr): a missing
    required key, a wrong type or an array of the wrong length is one GGUFError naming the key."""

    def __init__(self, md: Mapping[str, Any], arch: str) -> None:
        self.md = md
        self.arch = arch

    def name(self, template: str) -> str:
        return template.format(arch=self.arch)

    def has(self, template: str) -> bool:
        return self.name(template) in self.md

    def _convert(self, k: str, v: Any, kind: type) -> Any:
        if isinstance(v, bool) and kind is not bool:
            raise GGUFError(f"key {k!r} has value {v!r}, expected {kind.__name__}")
        try:
            out = kind(v)
        except (TypeError, ValueError, OverflowError):
            raise GGUFError(f"key {k!r} has value {v!r}, expected {kind.__name__}") from None
        if kind is float and not math.isfinite(out):
            raise GGUFError(f"key {k!r} has value {v!r}, expected a finite number")
        return out

    def get(self, template: str, default: Any = _REQUIRED, kind: type = int) -> Any:
        k = self.name(template)
        if k not in self.md:
            if default is _REQUIRED:
                raise GGUFError(f"missing key {k!r}")
            return default
        v = self.md[k]
        if _is_array(v):
            raise GGUFError(f"key {k!r} is an array, expected one {kind.__name__}")
        return self._convert(k, v, kind)

    def get_arr(self, template: str, n: int, default: Any = _REQUIRED, kind: type = int) -> tuple[Any, ...]:
        """A per-layer value: one scalar for every layer, or an array of exactly `n`."""
        k = self.name(template)
        if k not in self.md:
            if default is _REQUIRED:
                raise GGUFError(f"missing key {k!r}")
            return tuple(default for _ in range(n)) if not _is_array(default) else tuple(default)
        v = self.md[k]
        if not _is_array(v):
            return (self._convert(k, v, kind),) * n
        if len(v) != n:
            raise GGUFError(f"key {k!r} has {len(v)} values, expected one per layer ({n})")
        return tuple(self._convert(k, x, kind) for x in v)


def _labels(r: KeyReader) -> tuple[str, ...]:
    k = r.name(Keys.Classifier.OUTPUT_LABELS)
    v = r.md.get(k, ())
    if not _is_array(v) or not all(isinstance(x, str) for x in v) or len(v) > MAX_EXPERTS:
        raise GGUFError(f"key {k!r} must be an array of at most {MAX_EXPERTS} strings")
    return tuple(v)


def _is_array(v: Any) -> bool:
    return hasattr(v, "__len__") and not isinstance(v, (str, bytes))


@dataclass(frozen=True)
class HParams:
    """Hyper-parameters of a model (llama_hparams). Per-layer values are tuples of n_layer."""

    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_ff_arr: tuple[int, ...]
    n_head_arr: tuple[int, ...]
    n_head_kv_arr: tuple[int, ...]
    head_dim: int  # n_embd_head_k
    head_dim_v: int  # n_embd_head_v
    n_rot: int
    rms_eps: float
    rope_freq_base: float
    rope_freq_scale: float = 1.0
    rope_type: int = ROPE_NORM
    # sliding-window attention (llama.cpp's n_swa, is_swa_impl, rope_freq_base_train_swa)
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    attn_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    # YaRN rope (llama.cpp's cparams): (n_ctx_orig_yarn, ext_factor, attn_factor, beta_fast,
    # beta_slow), () without YaRN
    rope_yarn: tuple[float, ...] = ()
    # mixture of experts (llama.cpp's n_expert, n_expert_used, n_ff_exp, expert_weights_scale)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_scale: float = 0.0  # 0 or 1: the router's weights are not scaled
    # the model's own pooling of embeddings (llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last,
    # 4 rank), what `embedding` uses without --pooling
    pooling_type: int = 0
    # a reranker's classifier outputs (`{arch}.classifier.output_labels`: Qwen3-Reranker's "yes",
    # "no"); its head `cls.output` has one row each (one when the file names none, as llama.cpp)
    cls_labels: tuple[str, ...] = ()

    # the first layer's values: what llamapy reports and what uniform models use throughout
    @property
    def n_ff(self) -> int:
        return self.n_ff_arr[0]

    @property
    def n_head(self) -> int:
        return self.n_head_arr[0]

    @property
    def n_cls_out(self) -> int:
        return len(self.cls_labels) or 1

    @property
    def n_head_kv(self) -> int:
        return self.n_head_kv_arr[0]

    @property
    def n_embd_gqa(self) -> int:
        return self.n_embd_k_gqa(0)

    def n_embd_k_gqa(self, il: int) -> int:
        return self.n_head_kv_arr[il] * self.head_dim

    def n_embd_v_gqa(self, il: int) -> int:
        return self.n_head_kv_arr[il] * self.head_dim_v

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def rope_base(self, il: int) -> float:
        """llama_model::get_rope_freq_base: sliding-window layers have their own base."""
        return self.rope_freq_base_swa if self.is_swa(il) else self.rope_freq_base

    def rope_scale(self, il: int) -> float:
        return self.rope_freq_scale_swa if self.is_swa(il) else self.rope_freq_scale

    def validate(self) -> None:
        if not 0 < self.n_layer <= 4096:
            raise GGUFError(f"block_count {self.n_layer} out of range")
        if not 0 < self.n_embd <= 1 << 20 or self.n_vocab <= 0:
            raise GGUFError(f"embedding_length {self.n_embd} or vocabulary {self.n_vocab} out of range")
        for il in range(self.n_layer):
            h, hkv = self.n_head_arr[il], self.n_head_kv_arr[il]
            if h <= 0 or hkv <= 0 or h % hkv or h > 1 << 16:
                raise GGUFError(f"layer {il}: attention.head_count {h} is not a multiple of head_count_kv {hkv}")
            if not 0 < self.n_ff_arr[il] <= 1 << 22:
                raise GGUFError(f"layer {il}: feed_forward_length {self.n_ff_arr[il]} out of range")
        if not 0 < self.head_dim <= 4096 or not 0 < self.head_dim_v <= 4096:
            raise GGUFError(f"attention.key_length / value_length {self.head_dim}/{self.head_dim_v} out of range")
        if self.n_rot <= 0 or self.n_rot > self.head_dim or self.n_rot % 2:
            raise GGUFError(f"rope.dimension_count {self.n_rot} invalid for head size {self.head_dim}")
        if not (0 < self.rms_eps < 1):
            raise GGUFError(f"rms epsilon {self.rms_eps} out of range")
        if self.rope_freq_base <= 0 or self.rope_freq_base_swa <= 0:
            raise GGUFError("rope.freq_base must be positive")
        if self.n_swa < 0 or (self.swa_layers and len(self.swa_layers) != self.n_layer):
            raise GGUFError(f"attention.sliding_window {self.n_swa} or its pattern is invalid")
        if self.n_expert:
            if not 0 < self.n_expert <= MAX_EXPERTS:
                raise GGUFError(f"expert_count {self.n_expert} out of range (1..{MAX_EXPERTS})")
            if not 0 < self.n_expert_used <= self.n_expert:
                raise GGUFError(f"expert_used_count {self.n_expert_used} must be 1..expert_count ({self.n_expert})")
            if not 0 < self.n_ff_exp <= 1 << 22:
                raise GGUFError(f"expert_feed_forward_length {self.n_ff_exp} out of range")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an architecture reads: gguf-py's kind, block, suffix, numpy-order shape."""

    kind: MODEL_TENSOR
    shape: tuple[int, ...]
    bid: int | None = None
    suffix: str = "weight"
    required: bool = True

    @property
    def base(self) -> str:
        return TENSOR_NAMES[self.kind].format(bid=self.bid)

    @property
    def name(self) -> str:
        return f"{self.base}.{self.suffix}"

    @property
    def key(self) -> str:
        """The name inside a layer's dict: `attn_q` for a weight, `attn_q.bias` for a bias."""
        short = self.base.split(".", 2)[2] if self.bid is not None else self.base
        return short if self.suffix == "weight" else f"{short}.{self.suffix}"


class Architecture:
    """One model family: its hyper-parameters, tensors and graph (llama.cpp's llama_model_<arch>).

    A subclass sets `name` / `gguf_arch` / `rope_type` and overrides `read_extra`, `layer_tensors`
    and `build`. The shared parts here read what nearly every transformer has.
    """

    name: str = ""
    gguf_arch: MODEL_ARCH
    rope_type: int = ROPE_NORM
    rope_scalings: tuple[str, ...] = ("none", "linear")
    rank_softmax = False  # a reranker's scores go through a softmax (llama.cpp: qwen3's)

    # -- hyper-parameters ---------------------------------------------------------------------

    def hparams(self, md: Mapping[str, Any], n_vocab: int) -> HParams:
        r = KeyReader(md, self.name)
        n_layer = r.get(Keys.LLM.BLOCK_COUNT)
        if not 0 < n_layer <= 4096:
            raise GGUFError(f"block_count {n_layer} out of range")
        n_embd = r.get(Keys.LLM.EMBEDDING_LENGTH)
        n_head_arr = r.get_arr(Keys.Attention.HEAD_COUNT, n_layer)
        n_head_kv_arr = r.get_arr(Keys.Attention.HEAD_COUNT_KV, n_layer, n_head_arr)
        if n_head_arr[0] <= 0 or n_embd <= 0:
            raise GGUFError(f"invalid head_count {n_head_arr[0]} / embedding_length {n_embd}")
        head_dim = r.get(Keys.Attention.KEY_LENGTH, n_embd // n_head_arr[0])
        scaling = r.get(Keys.Rope.SCALING_TYPE, "none", str)
        if scaling not in self.rope_scalings:
            raise UnsupportedError(
                f"rope scaling {scaling!r} is not supported for {self.name} ({', '.join(self.rope_scalings)} are)"
            )
        factor = r.get(Keys.Rope.SCALING_FACTOR, 0.0, float)
        fields: dict[str, Any] = dict(
            arch=self.name,
            n_layer=n_layer,
            n_embd=n_embd,
            n_vocab=n_vocab,
            n_ctx_train=r.get(Keys.LLM.CONTEXT_LENGTH, 2048),
            n_ff_arr=r.get_arr(Keys.LLM.FEED_FORWARD_LENGTH, n_layer),
            n_head_arr=n_head_arr,
            n_head_kv_arr=n_head_kv_arr,
            head_dim=head_dim,
            head_dim_v=r.get(Keys.Attention.VALUE_LENGTH, n_embd // n_head_arr[0]),
            n_rot=r.get(Keys.Rope.DIMENSION_COUNT, head_dim),
            rms_eps=r.get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5, float),
            rope_freq_base=r.get(Keys.Rope.FREQ_BASE, 10000.0, float),
            rope_freq_scale=1.0 / factor if scaling in ("linear", "yarn") and factor > 0 else 1.0,
            rope_type=self.rope_type,
            pooling_type=r.get(Keys.LLM.POOLING_TYPE, 0),
            cls_labels=_labels(r),
        )
        if not 0 <= fields["pooling_type"] <= 4:
            raise GGUFError(f"pooling_type {fields['pooling_type']} out of range (0 to 4)")
        if not r.get(Keys.Attention.CAUSAL, True, bool):  # an encoder's: every graph here is causal
            raise UnsupportedError(f"{r.name(Keys.Attention.CAUSAL)} = false: llamapy runs causal attention only")
        self.read_extra(r, fields)
        p = HParams(**fields)
        p.validate()
        self.check(p)
        return p

    def read_extra(self, r: KeyReader, fields: dict[str, Any]) -> None:
        """Architecture-specific keys (llama_model_<arch>::load_arch_hparams)."""

    def check(self, p: HParams) -> None:
        """Constraints of this architecture's graph on the hyper-parameters."""

    # -- tensors --------------------------------------------------------------------------

    def tensors(self, p: HParams) -> list[TensorSpec]:
        """Every tensor, in load order (llama_model_<arch>::load_arch_tensors)."""
        e, v = p.n_embd, p.n_vocab
        spec = [
            TensorSpec(MODEL_TENSOR.TOKEN_EMBD, (v, e)),
            TensorSpec(MODEL_TENSOR.OUTPUT_NORM, (e,)),
            TensorSpec(MODEL_TENSOR.OUTPUT, (v, e), required=False),  # absent: tied to token_embd
        ]
        for il in range(p.n_layer):
            spec += self.layer_tensors(p, il)
        allowed = set(MODEL_TENSORS[self.gguf_arch])
        for s in spec:
            assert s.kind in allowed, f"{self.name}: {s.kind.name} is not one of gguf-py's tensors for it"
        return spec

    def layer_tensors(self, p: HParams, il: int) -> list[TensorSpec]:
        raise NotImplementedError

    # -- graph ----------------------------------------------------------------------------

    def build(self, p: HParams, w: ModelWeights, g: GraphInputs) -> Tensor:
        """The logits node of one micro-batch's graph (llm_build_<arch>)."""
        raise NotImplementedError


def attn_tensors(
    p: HParams, il: int, *, bias: bool = False, qk_norm: bool = False, post_norm: bool = False
) -> list[TensorSpec]:
    """The attention block's tensors (llama.cpp's create_tensor_qkv + wo), with optional Q/K/V
    biases, per-head Q/K norms and a norm after the block."""
    e, q = p.n_embd, p.n_head_arr[il] * p.head_dim
    kv_k, kv_v = p.n_embd_k_gqa(il), p.n_embd_v_gqa(il)
    T = MODEL_TENSOR
    spec = [
        TensorSpec(T.ATTN_NORM, (e,), il),
        TensorSpec(T.ATTN_Q, (q, e), il),
        TensorSpec(T.ATTN_K, (kv_k, e), il),
        TensorSpec(T.ATTN_V, (kv_v, e), il),
        TensorSpec(T.ATTN_OUT, (e, p.n_head_arr[il] * p.head_dim_v), il),
    ]
    if bias:
        spec += [TensorSpec(T.ATTN_Q, (q,), il, "bias"), TensorSpec(T.ATTN_K, (kv_k,), il, "bias"),
                 TensorSpec(T.ATTN_V, (kv_v,), il, "bias")]  # fmt: skip
    if qk_norm:
        spec += [TensorSpec(T.ATTN_Q_NORM, (p.head_dim,), il), TensorSpec(T.ATTN_K_NORM, (p.head_dim,), il)]
    if post_norm:
        spec.append(TensorSpec(T.ATTN_POST_NORM, (e,), il))
    return spec


def ffn_tensors(p: HParams, il: int, *, norm: MODEL_TENSOR = MODEL_TENSOR.FFN_NORM,
                post_norm: bool = False) -> list[TensorSpec]:  # fmt: skip
    """A gated feed-forward block's tensors: norm, gate, up, down (and an optional post-norm)."""
    e, ff = p.n_embd, p.n_ff_arr[il]
    T = MODEL_TENSOR
    spec = [
        TensorSpec(norm, (e,), il),
        TensorSpec(T.FFN_GATE, (ff, e), il),
        TensorSpec(T.FFN_UP, (ff, e), il),
        TensorSpec(T.FFN_DOWN, (e, ff), il),
    ]
    if post_norm:
        spec.append(TensorSpec(T.FFN_POST_NORM, (e,), il))
    return spec


def read_experts(r: KeyReader, fields: dict[str, Any], required: bool) -> None:
    """The mixture-of-experts keys (llama_model::load_hparams' expert_count, expert_used_count;
    the family's expert_feed_forward_length, by default n_ff / n_expert_used as qwen3moe's):
    into `fields`. Expert groups (DeepSeek-V3's routing) are refused, not ignored."""
    n_expert = r.get(Keys.LLM.EXPERT_COUNT, 0)
    if required and n_expert <= 0:
        raise GGUFError(f"{r.arch} needs {r.name(Keys.LLM.EXPERT_COUNT)!r} > 0 (got {n_expert})")
    if n_expert <= 0:
        return
    used = set(r.get_arr(Keys.LLM.EXPERT_USED_COUNT, fields["n_layer"], 0))
    if len(used) != 1:
        raise UnsupportedError(f"{r.name(Keys.LLM.EXPERT_USED_COUNT)!r} differs between layers")
    if r.get(Keys.LLM.EXPERT_GROUP_COUNT, 0) > 1:
        raise UnsupportedError("expert groups (expert_group_count > 1) are not supported")
    n_used = used.pop()
    ff = fields["n_ff_arr"][0]
    fields.update(n_expert=n_expert, n_expert_used=n_used,
                  n_ff_exp=r.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, ff // n_used if n_used > 0 else 0),
                  expert_weights_scale=r.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0, float))  # fmt: skip


def moe_tensors(p: HParams, il: int, n_ff: int) -> list[TensorSpec]:
    """A mixture-of-experts block's tensors (the experts stacked: llama.cpp's ffn_*_exps of
    {n_embd, n_ff, n_expert}): norm, router, and each expert's gate, up and down."""
    e, x = p.n_embd, p.n_expert
    T = MODEL_TENSOR
    return [
        TensorSpec(T.FFN_NORM, (e,), il),
        TensorSpec(T.FFN_GATE_INP, (x, e), il),
        TensorSpec(T.FFN_GATE_EXP, (x, n_ff, e), il),
        TensorSpec(T.FFN_UP_EXP, (x, n_ff, e), il),
        TensorSpec(T.FFN_DOWN_EXP, (x, e, n_ff), il),
    ]


def read_swa_pattern(r: KeyReader, n_layer: int, n_pattern: int) -> tuple[bool, ...]:
    """`attention.sliding_window_pattern` (llama_model::load_swa_pattern): a per-layer array, or
    a period (every n-th layer global), `n_pattern` by default."""
    k = r.name(Keys.Attention.SLIDING_WINDOW_PATTERN)
    v = r.md.get(k)
    if v is not None and _is_array(v):
        return tuple(bool(x) for x in r.get_arr(Keys.Attention.SLIDING_WINDOW_PATTERN, n_layer, kind=int))
    n = r.get(Keys.Attention.SLIDING_WINDOW_PATTERN, n_pattern)
    if n < 0:
        raise GGUFError(f"key {k!r} has value {n}, expected >= 0")
    return swa_pattern(n_layer, n)


def swa_pattern(n_layer: int, n_pattern: int, dense_first: bool = False) -> tuple[bool, ...]:
    """Which layers use the sliding window (llama_hparams::set_swa_pattern): with a pattern of n,
    every n-th layer is global (the last of each group, or the first when dense_first)."""
    if dense_first:
        return tuple(n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer))
    return tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer))

