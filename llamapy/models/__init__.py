"""The architecture registry (llama.cpp's `llm_arch` switch over src/models/<arch>.cpp; MLX-LM's
`models/<type>.py` found by name): `general.architecture` -> the module that reads its
hyper-parameters, names its tensors and builds its graph. Adding one: docs/adding-a-model.md.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import ops
from ..graph import Graph
from ..tensor import Tensor
from ..types import GGUFError, UnsupportedError
from .base import Architecture, HParams
from .inputs import GraphInputs, UBatch

if TYPE_CHECKING:
    from ..model.kv_cache import KVCache
    from ..model.lora import LoraTerm
    from ..model.loader import ModelWeights

# general.architecture -> module under llamapy.models
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3moe",
    "gemma3": "gemma3",
    "gpt-oss": "gptoss",
}

__all__ = ["ARCHITECTURES", "OUTPUTS", "Architecture", "GraphInputs", "HParams", "ModelGraph", "UBatch",
           "architecture", "build_graph", "read_hparams"]  # fmt: skip


def architecture(name: Any) -> Architecture:
    """The module object for an architecture name, or one UnsupportedError naming it."""
    if name is None:
        raise GGUFError("missing key 'general.architecture'")
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise UnsupportedError(
            f"unsupported architecture {name!r} (llamapy runs: {', '.join(ARCHITECTURES)})"
        )
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[name]}").ARCH  # type: ignore[no-any-return]


def read_hparams(md: Mapping[str, Any], n_vocab: int) -> HParams:
    """The hyper-parameters of the file's architecture (llama_model::load_hparams)."""
    return architecture(md.get("general.architecture")).hparams(md, n_vocab)


@dataclass
class ModelGraph:
    """A built graph, its inputs (which fill themselves from a micro-batch) and its result."""

    graph: Graph
    inputs: GraphInputs
    logits: Tensor  # (n_outputs, V); else what build_graph's `output` says

    @property
    def n_tokens(self) -> int:
        return self.inputs.n_tokens

    @property
    def n_outputs(self) -> int:
        return self.inputs.n_outputs


OUTPUTS = ("logits", "embd", "rank")  # what a graph ends at


def build_graph(
    p: HParams, w: ModelWeights, kv: KVCache, n_tokens: int, n_outputs: int, output: str = "logits",
    lora: Mapping[str, tuple[LoraTerm, ...]] | None = None, cvec: Mapping[int, Tensor] | None = None,
) -> ModelGraph:
    """The graph of one micro-batch shape, for whichever architecture `p` is. `output`: "logits";
    "embd", the output norm's rows (the model's embeddings, llama.cpp's `t_embd`; the output
    matrix is not in the graph); "rank", a reranker's scores of those rows (n_outputs, n_cls_out):
    its classifier head `cls.output`, then a softmax where the architecture has one
    (build_pooling's LLAMA_POOLING_TYPE_RANK). `lora`: the applied adapters' terms per matrix
    (model/lora.py's `terms`); `cvec`: a control vector's direction per layer."""
    g = GraphInputs(kv, n_tokens, n_outputs, lora=lora or {}, cvec=cvec or {})
    arch = architecture(p.arch)
    out = arch.build(p, w, g)
    if output != "logits":
        out = _source_named(out, "result_norm")  # (n_outputs, E)
    if output == "rank":
        if w.cls_out is None:
            raise UnsupportedError("pooling 'rank' needs a classifier head (cls.output), which this file does not have")
        out = ops.mul_mat(w.cls_out, out, "result_embd_pooled")  # (n_outputs, n_cls_out)
        if arch.rank_softmax:
            out = ops.soft_max(out, name="result_embd_pooled_softmax")
    return ModelGraph(g.gf.output(out), g, out)


def _source_named(root: Tensor, name: str) -> Tensor:
    """The nearest of `root`'s sources (breadth first) called `name`: every architecture names
    its final norm `result_norm`, as llama.cpp's callbacks do."""
    todo, seen = deque([root]), {id(root)}
    while todo:
        t = todo.popleft()
        if t.name == name:
            return t
        for s in t.src:
            if id(s) not in seen:
                seen.add(id(s))
                todo.append(s)
    raise UnsupportedError(f"{name!r} is not in this graph: it has no embeddings output")
