"""Graph inputs that fill themselves from the micro-batch and the KV cache (llama.cpp's
`llm_graph_input_*` with `set_input(ubatch)`: inp_tokens, inp_pos, inp_out_ids, and the KV
inputs — the cells a batch's K/V rows go to and the masks, one per attention kind).

A graph builder asks for the inputs it uses (`g.kq_mask(swa=True)` creates the sliding-window
mask only for a model that has one); the context then calls `values(ubatch)` and gets every
input's array, without knowing which architecture built the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..graph import Graph
from ..tensor import Tensor, TensorFlag
from ..types import GGMLType

if TYPE_CHECKING:
    from ..model.kv_cache import KVCache
    from ..model.lora import LoraTerm


@dataclass
class UBatch:
    """One micro-batch (llama_ubatch): tokens, positions, sequences, the cache cells they take
    and the batch rows whose logits are wanted."""

    tokens: np.ndarray  # (T,) int32
    pos: np.ndarray  # (T,) int64
    seq: np.ndarray  # (T,) int64
    kv_idx: np.ndarray  # (T,) int64
    out_ids: np.ndarray  # (n_outputs,) int32
    n_kv: int


def _input(name: str, shape: tuple[int, ...], t: GGMLType = GGMLType.I32) -> Tensor:
    return Tensor(name, shape, t, flags=TensorFlag.INPUT)


@dataclass
class GraphInputs:
    """The inputs of one graph shape `(n_tokens, n_outputs)`; `kv` is the cache whose tensors
    the graph stores to and reads from; `gf` is the graph being built, for builders that fix the
    order of some nodes early (llm_graph_context's `gf`). The graph's K/V views span all of the
    cache's `kv.size` cells; a micro-batch attends to the first `UBatch.n_kv` of them, its masks' width
    (ops.flash_attn_ext), so one graph serves every length of history."""

    kv: KVCache
    n_tokens: int
    n_outputs: int
    tokens: Tensor = field(init=False)  # (T,) token ids
    pos: Tensor = field(init=False)  # (T,) positions
    kv_idx: Tensor = field(init=False)  # (T,) cache cells the new K/V rows go to
    out_ids: Tensor = field(init=False)  # (n_outputs,) rows of the batch whose logits are wanted
    masks: dict[int, Tensor] = field(init=False, default_factory=dict)  # window (0: none) -> (T, N)
    gf: Graph = field(init=False, default_factory=Graph)
    # matrix name -> the applied LoRA adapters' terms for it (model/lora.py; layers.mm applies them)
    lora: Mapping[str, tuple[LoraTerm, ...]] = field(default_factory=dict)
    # layer -> the control vector's direction added to its output (model/control_vector.py)
    cvec: Mapping[int, Tensor] = field(default_factory=dict)
    _read: frozenset[Tensor] | None = field(init=False, default=None, repr=False)  # those the built graph reads

    def __post_init__(self) -> None:
        T = self.n_tokens
        self.tokens = _input("inp_tokens", (T,))
        self.pos = _input("inp_pos", (T,))
        self.kv_idx = _input("inp_kv_idx", (T,), GGMLType.I64)
        self.out_ids = _input("inp_out_ids", (self.n_outputs,))

    def kq_mask(self, n_swa: int = 0) -> Tensor:
        """The (T, kv.size) mask, whose values are (T, n_kv): causal over the batch's sequences,
        and with `n_swa` > 0 hiding cells `n_swa` or more positions back
        (llm_graph_input_attn_kv_iswa's second mask)."""
        m = self.masks.get(n_swa)
        if m is None:
            m = _input("kq_mask_swa" if n_swa else "kq_mask", (self.n_tokens, self.kv.size), GGMLType.F32)
            self.masks[n_swa] = m
        return m

    @property
    def select_outputs(self) -> bool:
        """Whether the last layer keeps only the rows whose logits are wanted."""
        return self.n_outputs < self.n_tokens

    def values(self, ub: UBatch) -> dict[Tensor, np.ndarray]:
        """The value of every input the graph reads (e.g. no out_ids when every row is an
        output) for this micro-batch (set_input)."""
        read = self._read
        if read is None:  # (the graph is complete by its first micro-batch)
            read = self._read = frozenset(
                t for t in (self.tokens, self.pos, self.kv_idx, self.out_ids, *self.masks.values()) if self.gf.has(t)
            )
        out: dict[Tensor, np.ndarray] = {}
        if self.tokens in read:
            out[self.tokens] = ub.tokens.astype(np.int32, copy=False)
        if self.pos in read:
            out[self.pos] = ub.pos.astype(np.int32)
        if self.kv_idx in read:
            out[self.kv_idx] = ub.kv_idx.astype(np.int64, copy=False)
        if self.out_ids in read:
            out[self.out_ids] = ub.out_ids.astype(np.int32, copy=False)
        for n_swa, t in self.masks.items():
            if t in read:
                out[t] = self.kv.mask(ub.n_kv, ub.pos, ub.seq, n_swa)
        return out
