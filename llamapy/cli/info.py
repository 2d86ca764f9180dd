"""`llamapy info` (gguf-dump: metadata and tensors) and `llamapy devices` (every backend
registry and device, PASS/FAIL after a tiny op, as tinygrad's device listing)."""

from __future__ import annotations

import sys
from typing import Any

import typer

from ..types import DeviceType
from . import app, common


def _short(value: object, limit: int = 80) -> str:
    if isinstance(value, list):
        head = ", ".join(repr(v) for v in value[:5])
        return f"[{head}{', …' if len(value) > 5 else ''}] ({len(value)} items)"
    if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:
        arr = value
        head = ", ".join(str(v) for v in arr[:5].tolist())  # type: ignore[index,union-attr]
        return f"[{head}{', …' if len(arr) > 5 else ''}] ({len(arr)} items)"  # type: ignore[arg-type]
    s = repr(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


@app.command(short_help="a GGUF's metadata and tensors (gguf-dump)")
def info(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    full: bool = typer.Option(False, "--full", help="print long values in full"),
) -> None:
    """List a GGUF's metadata and tensors (works on vocabulary-only files of any architecture)."""
    import re

    from ..model.gguf import GGUFFile
    from ..model.loader import FFN_EXPS_REGEX

    path = common.resolve_model(model, model_opt)
    gf = GGUFFile(path)
    out = sys.stdout
    md = gf.metadata
    out.write(f"* File: {path}  (GGUF v{gf.version}, {gf.size / 2**20:.2f} MiB, alignment {gf.alignment})\n")
    for i, part in enumerate(gf.splits, 2):
        out.write(f"* Split {i} of {len(gf.splits) + 1}: {part.path}  ({part.size / 2**20:.2f} MiB)\n")
    out.write(f"* Metadata: {len(md)} key/value pairs\n")
    for i, key in enumerate(md, 1):
        value = md[key]
        text = repr(value) if full else _short(value)
        out.write(f"  {i:4d}: {md.type_name(key):<22} {key} = {text}\n")
    out.write(f"* Tensors: {len(gf.tensors)}\n")
    for i, t in enumerate(gf.tensors.values(), 1):
        dims = " x ".join(str(d) for d in t.ne)
        where = f" in split {gf.splits.index(f) + 2}" if (f := gf.file_of(t.name)) is not gf else ""
        out.write(f"  {i:4d}: {t.type.name:<6} {t.name:<32} {dims:<20} {t.nbytes / 2**20:9.3f} MiB @ {t.offset}{where}\n")
    arch = md.get("general.architecture")
    n_expert = md.get(f"{arch}.expert_count")
    if n_expert:
        exps = sum(t.nbytes for t in gf.tensors.values() if re.search(FFN_EXPS_REGEX, t.name))
        out.write(f"* Experts: {n_expert}, {md.get(f'{arch}.expert_used_count')} used per token; expert tensors "
                  f"{exps / 2**20:.2f} of {gf.total_size / 2**20:.2f} MiB (what --cpu-moe keeps in host memory)\n")  # fmt: skip
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(gf.describe_types().items()))
    if counts:
        out.write(f"* Tensor types: {counts}\n")
    out.flush()


def _memory(p: Any) -> str:
    """Free/total device memory; for the host, MemAvailable (what the host-memory checks use)."""
    if not p.memory_total:
        return "host memory"
    word = "available" if p.type is DeviceType.CPU else "free"
    return f"{p.memory_free / 2**20:.0f}/{p.memory_total / 2**20:.0f} MiB {word}"


@app.command(short_help="every backend and device, PASS or FAIL")
def devices(ray: str = common.RAY) -> None:
    """List every backend registry and device: type, memory, PASS or FAIL with the reason."""
    common.use_ray(ray, check=False)  # a cluster that cannot be used is listed as FAIL
    from ..backend.registry import discover

    disc = discover()
    out = sys.stdout
    for st in disc.statuses:
        if st.registry is None:
            out.write(f"{st.name.upper():<6} registry  FAIL  {st.error}\n")
            continue
        devs = st.registry.devices()
        out.write(f"{st.registry.name:<6} registry  {len(devs)} device(s)  ({st.source})\n")
        for d in devs:
            p = d.props()
            mem = _memory(p)
            try:
                d.self_test()
                status = "PASS"
            except Exception as e:  # noqa: BLE001 - the listing reports, never crashes
                status = f"FAIL  {type(e).__name__}: {e}".splitlines()[0]
            out.write(f"  {d.name:<8} {d.type.name:<6} {mem:<28} {p.description:<40} {status}\n")
    from ..backend import native, qmatmul

    impl = qmatmul.kernels()
    if impl == "c":
        why = f"  ({native.variant()}; built: {', '.join(native.built())})"
    else:
        why = f"  (C kernels: {native.error()})"
    out.write(f"CPU kernels: {impl}{why}\n")
    out.flush()
