"""An export row on a device it was not measured on: does it fit, and how fast would it decode?

Memory is **measured** on this host in a child process (:mod:`optimize.footprint.memory`), and
what the artifact adds over the interpreter and runtime (``model_rss_bytes``) is compared with the
device's usable memory, or the memory model's figure for the same where that is larger (the
device's runtime build packs and allocates its own way; the model has held within 10% of every
measured peak); the artifact's bytes with the device's storage budget.

Decode speed is **predicted** (and every field and message says so). Decoding one token reads the
weights once (every Linear, lm_head included; the embedding only as one row, so the embedding
table is left out where it is stored apart from lm_head) and the KV cache up to the current
position. The host's measured decode rate gives the fraction of its bandwidth ceiling this artifact
reaches here::

    host_fraction = host_decode_tok_s x bytes_per_token(host context) / host_copy_bandwidth

and the device is assumed to reach the same fraction of its own practical bandwidth
(theoretical x practical_fraction, the quantity a copy measures)::

    predicted_decode_tok_s(p) = host_fraction x device_bandwidth / bytes_per_token(p)

What this ignores, stated in the report's notes: compute (a device whose cores are slower than
the host's may be compute-bound, not bandwidth-bound: e.g. int4 unpacking on A55 cores), threads
(the host's fraction is for ``checks.latency.threads`` threads), caches (a model whose weights fit
the host's last-level cache reads them faster than DRAM: its fraction exceeds 1 and is capped at 1,
which makes the prediction the device's bandwidth ceiling), and the kernels each ISA gets
(dotprod/i8mm on arm64 vs AVX-512 VNNI here).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from optimize.footprint.memory import kv_cache_bytes
from optimize.footprint.price import model_shapes
from optimize.gates_config import GateResult

MIB = 2**20

METHOD = ("bandwidth scaling: predicted tok/s = (host decode tok/s x bytes per token / host copy bandwidth) "
          "x device practical bandwidth / bytes per token; bytes per token = the artifact's weights read per "
          "decoded token (lm_head included, the embedding table excluded where stored apart) + the KV cache "
          "up to the position")


class DevicePrediction(BaseModel):
    """One export row on one device: memory and storage from measured figures, decode predicted."""

    device: str
    kind: str
    # ---- memory (measured here, compared with the device)
    usable_memory_bytes: int
    model_rss_bytes: int | None = Field(None, description="measured on this host: peak RSS minus the interpreter's")
    predicted_model_rss_bytes: int | None = Field(
        None, description="the memory model's figure for the same (predicted peak minus the interpreter): the gate "
        "holds the larger of the two against the device, since the device's runtime build is not this host's")
    fits_memory: bool | None = None
    storage_bytes: int
    artifact_bytes: int | None = None
    fits_storage: bool | None = None
    # ---- decode (predicted)
    method: str = METHOD
    host_bandwidth_gb_s: float | None = Field(None, description="measured: this host's copy bandwidth")
    device_bandwidth_gb_s: float = Field(description="the device's theoretical bandwidth x practical_fraction")
    weight_bytes_per_token: int | None = Field(None, description="estimated from the artifact: weights read per token")
    weight_bytes_by_scheme: dict[str, int] | None = Field(
        None, description="the Linear weights a token reads, by the scheme the exported graph computes them in "
        "(fp32 / 8da8w / 8da4w): which precisions the bytes per token are made of")
    kv_bytes_per_token: int | None = Field(None, description="KV cache read per token at the host's decode context")
    context_tokens: int | None = Field(None, description="mean position of the host's decode measurement")
    host_decode_tok_s: float | None = Field(None, description="measured on this host (checks.latency)")
    host_fraction_of_ceiling: float | None = Field(
        None, description="host decode tok/s x bytes per token / host bandwidth, as measured (may exceed 1 in cache)")
    predicted_decode_tok_s: float | None = Field(None, description="PREDICTED on the device at the host's context")
    predicted_decode_tok_s_at_max_seq_len: float | None = Field(
        None, description="PREDICTED on the device with the KV cache full (max_seq_len)")
    notes: list[str] = Field(default_factory=list)


# ---- bytes per token --------------------------------------------------------------------------


def _bytes_per_elem(scheme: str | None, row: int) -> float:
    s = (scheme or "fp32").lower()
    if s in ("fp32", "float32"):
        return 4.0
    if s in ("fp16", "bf16", "float16", "bfloat16"):
        return 2.0
    if "4" in s:
        return 0.5 + 4.0 / 32  # int4 with a float32 scale per group of 32 (the project's default group)
    return 1.0 + 4.0 / max(row, 1)  # int8 with a float32 scale per row


def embedding_stored_apart(details: dict, tied: bool, runtime: str) -> bool:
    """Whether the artifact keeps the embedding table as its own tensor (a lookup, one row read per
    token) besides what lm_head reads. Untied models always do; a tied pair is stored twice in a
    single .pte and once in ExecuTorch's external model.ptd; in ONNX Runtime's fused graph it is
    shared (fp32, or a quantized table "shared with lm_head") unless the lookup was quantized apart
    from a per-token int8 lm_head (``GatherBlockQuantized`` over its own table)."""
    if not tied:
        return True
    if runtime.startswith("onnxruntime"):
        emb = str((details.get("quantization") or {}).get("embedding") or "fp32")
        return "GatherBlockQuantized" in emb and "shared" not in emb
    note = (details.get("weights") or {}).get("tied_embedding") or ""
    if runtime == "executorch" or note:
        return note.startswith("stored twice")
    return False


def _table_bytes(config: Any, details: dict) -> int:
    """The embedding table's bytes at the precision the export stored it in (0: shape unknown)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0) or 0)
    if not vocab or not hidden:
        return 0
    scheme = (details.get("quantization") or {}).get("embedding")
    return int(vocab * hidden * _bytes_per_elem(scheme if isinstance(scheme, str) else None, hidden))


def weight_bytes_per_token(artifact_bytes: int, config: Any, details: dict, runtime: str, tied: bool) -> int:
    """Weights a decoded token reads: the artifact minus the embedding table when it is stored apart
    from lm_head (an estimate from the artifact's size, not a per-tensor reading)."""
    table = _table_bytes(config, details)
    if not embedding_stored_apart(details, tied, runtime) or not table:
        return int(artifact_bytes)
    return int(max(artifact_bytes - table, artifact_bytes * 0.05))


def packed_copy_bytes(artifact_bytes: int, config: Any, details: dict, runtime: str, tied: bool) -> int:
    """What the runtime holds beside the artifact's bytes once loaded, for the memory model
    (:func:`optimize.footprint.memory.predicted_peak`): XNNPACK packs every delegated weight into its own
    layout (a .pte's weights read per token, again); in ONNX Runtime MLAS packs every MatMul's
    constant weights (``MatMul``, ``MatMulInteger``, ``MatMulNBits``) into its own layout while the
    artifact's pages stay resident (the weights read per token, again: 127 MiB measured against
    132 priced for SmolLM2 W8A8), and a tied fp32 table, which lm_head reads transposed, gets one
    more copy (the tiny test Llama's 12 MiB table: 33 MiB measured at load, 36 priced). A table
    stored once in ExecuTorch's model.ptd counts once more here, as the table stored twice did in
    the artifact."""
    if runtime == "executorch":
        packed = weight_bytes_per_token(artifact_bytes, config, details, runtime, tied)
        if tied and ((details.get("weights") or {}).get("tied_embedding") or "").startswith("stored once"):
            # the table stored once in model.ptd saves storage, not memory: the lookup keeps its own
            # copy (measured: the same peak as the single .pte with the table twice, docs/devices.md)
            packed += _table_bytes(config, details)
        return packed
    if not runtime.startswith("onnxruntime"):
        return 0
    packed = weight_bytes_per_token(artifact_bytes, config, details, runtime, tied)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if tied and ((details.get("quantization") or {}).get("embedding") or "fp32") in ("fp32", "float32", "none"):
        vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        hidden = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0) or 0)
        packed += 4 * vocab * hidden  # lm_head reads the table transposed: a folded copy, then packed
    return packed


# ---- the prediction ---------------------------------------------------------------------------


def predict(device: Any, *, memory: Any, host_decode_tok_s: float | None, host_bandwidth: float | None,
            context_tokens: int | None, weight_bytes: int | None, config: Any, max_seq_len: int | None,
            weight_bytes_by_scheme: dict[str, int] | None = None) -> DevicePrediction:
    """Put one export row's figures on ``device`` (a :class:`targets.devices.DeviceProfile`).

    ``memory`` is the row's :class:`~optimize.footprint.memory.MemoryFootprint` (or None), ``host_bandwidth``
    bytes/s, ``weight_bytes`` from :func:`weight_bytes_per_token`."""
    dev_bw = device.bandwidth.practical_gb_s * 1e9
    p = DevicePrediction(device=device.name, kind=device.kind, usable_memory_bytes=device.usable_bytes,
                         storage_bytes=device.storage_bytes, device_bandwidth_gb_s=round(dev_bw / 1e9, 2),
                         host_bandwidth_gb_s=round(host_bandwidth / 1e9, 2) if host_bandwidth else None,
                         host_decode_tok_s=host_decode_tok_s, weight_bytes_per_token=weight_bytes,
                         weight_bytes_by_scheme=weight_bytes_by_scheme, context_tokens=context_tokens)
    if memory is not None:
        p.model_rss_bytes = memory.model_rss_bytes
        p.artifact_bytes = memory.artifact_bytes
        if memory.predicted_peak_rss_bytes is not None and memory.interpreter_rss_bytes is not None:
            p.predicted_model_rss_bytes = max(0, memory.predicted_peak_rss_bytes - memory.interpreter_rss_bytes)
    if p.model_rss_bytes is not None:
        p.fits_memory = max(p.model_rss_bytes, p.predicted_model_rss_bytes or 0) <= p.usable_memory_bytes
    if p.artifact_bytes is not None:
        p.fits_storage = p.artifact_bytes <= p.storage_bytes
    p.notes.append("memory: measured on this host in a child process (peak RSS minus the Python interpreter and "
                   "runtime libraries); a device's allocator, page size and runtime build differ")
    if not (host_decode_tok_s and host_bandwidth and weight_bytes and context_tokens is not None):
        p.notes.append("decode not predicted: needs the host's measured decode rate (checks.latency) and the "
                       "artifact's size")
        return p
    kv_at = (lambda n: kv_cache_bytes(config, n, "float32", positions=n)) if config is not None else (lambda n: 0)
    p.kv_bytes_per_token = int(kv_at(context_tokens))
    host_bpt = weight_bytes + p.kv_bytes_per_token
    raw = host_decode_tok_s * host_bpt / host_bandwidth
    p.host_fraction_of_ceiling = round(raw, 4)
    frac = min(raw, 1.0)
    if raw > 1.0:
        p.notes.append(f"the host decodes at {raw:.2f}x its copy-bandwidth ceiling: the weights "
                       f"({weight_bytes / MIB:.1f} MiB) stay in its caches; the fraction is capped at 1, so the "
                       "prediction is the device's bandwidth ceiling")
    p.predicted_decode_tok_s = round(frac * dev_bw / host_bpt, 2)
    if max_seq_len:
        p.predicted_decode_tok_s_at_max_seq_len = round(frac * dev_bw / (weight_bytes + kv_at(max_seq_len)), 2)
    p.notes.append("decode: PREDICTED from bandwidth, not measured on the device; compute-bound cores, thread "
                   "counts and ISA-specific kernels are not modelled")
    return p


def bytes_by_scheme(config: Any, details: dict) -> dict[str, int] | None:
    """The Linear weights a decoded token reads, by scheme, from an ExecuTorch row's exported graph
    (``quantization.exported_linear``: the majority scheme and every other scheme's module names) and
    the model's shapes. None for a row without that record (other runtimes)."""
    graph = (details.get("quantization") or {}).get("exported_linear") or {}
    if not graph.get("counts"):
        return None
    linears = model_shapes(config)[0]
    scheme_of = {name: s for s, names in (graph.get("modules") or {}).items() for name in names}
    out: dict[str, float] = {}
    for name, (o, i) in linears.items():
        s = scheme_of.get(name, graph["majority"])
        out[s] = out.get(s, 0.0) + o * i * _bytes_per_elem(s, i)
    return {s: int(b) for s, b in out.items()}


def predict_from_another(source: DevicePrediction, target: DevicePrediction) -> float | None:
    """``target``'s decode rate PREDICTED from ``source``'s measured efficiency: the fraction of the
    bandwidth ceiling one recipe reaches on a host, applied to another recipe's bytes per token on the
    same host (``optimize fit`` does this for recipes it has not exported). None where either lacks
    the figures. Compare it with ``target.host_decode_tok_s`` to check the model
    (bench/predict_decode.py)."""
    frac = source.host_fraction_of_ceiling
    bw = target.host_bandwidth_gb_s or source.host_bandwidth_gb_s
    if frac is None or not bw or target.weight_bytes_per_token is None:
        return None
    bpt = target.weight_bytes_per_token + (target.kv_bytes_per_token or 0)
    return round(min(frac, 1.0) * bw * 1e9 / bpt, 2)



def precision_overlap(a: DevicePrediction, b: DevicePrediction) -> float | None:
    """How alike two recipes' Linear bytes per token are in the kernels that read them: the sum over
    precisions of the smaller share (1: the same mix, 0: nothing in common). None where either lacks
    ``weight_bytes_by_scheme``."""
    ma, mb = a.weight_bytes_by_scheme, b.weight_bytes_by_scheme
    if not ma or not mb or not sum(ma.values()) or not sum(mb.values()):
        return None
    ta, tb = sum(ma.values()), sum(mb.values())
    return round(sum(min(ma.get(k, 0) / ta, mb.get(k, 0) / tb) for k in sorted(set(ma) | set(mb))), 4)  # one summing order in every process


def nearest_source(target: DevicePrediction, sources: list[DevicePrediction]) -> DevicePrediction | None:
    """Of the ``sources`` with a measured fraction of the ceiling, the one whose bytes per token are read
    at the most similar precisions (:func:`precision_overlap`; the first on a tie). The fraction is
    the kernels' efficiency, and it differs by precision (on a 2-core Zen 4 an int4 body reaches
    0.75-0.78 of the ceiling, int8 with an fp32 head 0.84-0.90): predicting from the most alike recipe
    brought the worst error from 15.7-17.7% to 8.5-10.1% (bench/predict_decode.py)."""
    measured = [s for s in sources if s.host_fraction_of_ceiling is not None]
    if not measured:
        return None
    return max(measured, key=lambda s: precision_overlap(s, target) or 0.0)

# ---- gates ------------------------------------------------------------------------------------


def _mib(b: int | None) -> str:
    return "–" if b is None else (f"{b / MIB:.1f} MiB" if b < 10 * 2**30 else f"{b / 2**30:.2f} GiB")


def device_gates(p: DevicePrediction, memory: Any, decode_budget: float | None) -> list:
    """The device's limits as gates on one export row: measured memory within the usable memory,
    the artifact within the storage budget, and (with a budget) the predicted decode rate:
    :class:`~optimize.gates_config.GateResult` each."""
    out = []
    if p.model_rss_bytes is None:
        why = getattr(memory, "error", None) or "checks.memory is off"
        out.append(GateResult(metric="device.memory", goal={"max_bytes": p.usable_memory_bytes}, value=None,
                              baseline=None, ok=False,
                              message=f"peak memory was not measured ({why}), so it cannot be checked against "
                              f"{p.device}'s usable {_mib(p.usable_memory_bytes)}"))
    else:
        ok = bool(p.fits_memory)
        pred = p.predicted_model_rss_bytes
        higher = pred is not None and pred > p.model_rss_bytes
        also = "" if pred is None else (f"; the memory model predicts {_mib(pred)}"
                                        + (", the larger, which is what is held against the device" if higher else ""))
        out.append(GateResult(
            metric="device.memory", goal={"max_bytes": p.usable_memory_bytes},
            value=float(max(p.model_rss_bytes, pred or 0)), baseline=None, ok=ok,
            message=(f"peak RSS measured on this host {_mib(p.model_rss_bytes)} for the artifact (child peak "
                     f"{_mib(memory.peak_rss_bytes)} - {_mib(memory.interpreter_rss_bytes)} interpreter and runtime"
                     f"{also}) {'fits' if ok else 'does NOT fit'} {p.device}'s usable memory "
                     f"{_mib(p.usable_memory_bytes)}")))
    if p.artifact_bytes is not None:
        ok = bool(p.fits_storage)
        out.append(GateResult(
            metric="device.storage", goal={"max_bytes": p.storage_bytes}, value=float(p.artifact_bytes), baseline=None,
            ok=ok, message=(f"artifact {_mib(p.artifact_bytes)} {'fits' if ok else 'does NOT fit'} {p.device}'s "
                            f"storage budget {_mib(p.storage_bytes)}")))
    if decode_budget is not None:
        v = p.predicted_decode_tok_s
        if v is None:
            out.append(GateResult(metric="device.decode_tok_s_predicted", goal={"threshold": decode_budget}, value=None,
                                  baseline=None, ok=False,
                                  message=f"decode on {p.device} was not predicted (no host decode rate measured), "
                                  f"so the budget >= {decode_budget:g} tok/s cannot pass"))
        else:
            ok = v >= decode_budget
            out.append(GateResult(
                metric="device.decode_tok_s_predicted", goal={"threshold": decode_budget}, value=v, baseline=None, ok=ok,
                message=(f"predicted decode on {p.device} {v:.1f} tok/s (bandwidth-scaled from {p.host_decode_tok_s:.1f} "
                         f"tok/s measured on this host) {'meets' if ok else 'misses'} the budget >= {decode_budget:g} "
                         "tok/s (predicted, not measured on the device)")))
    return out
