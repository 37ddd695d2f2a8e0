"""The ONNX Runtime :class:`Runner`: one CPU session serves prefill and decode by feeding each
call's ``present.*`` back as the next call's ``past_key_values.*``. It loads any graph with
that signature: ours (the fused onnxruntime-genai-style graph, which takes no ``position_ids``,
or the torch.onnx one), or optimum-onnx's ``text-generation-with-past``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from export.decoding.runtime import Runner, RunnerError
from export.onnxruntime.int8_format import warn_if_saturates
from export.onnxruntime.last_logits import ALL, ASK, LAST, split_head_io
from export.onnxruntime.verify_rows import VERIFY, has_verify_rows, require_exact_rows

MANIFEST = "manifest.json"
GRAPH_LEVELS = ("disable", "basic", "extended", "all")


def onnx_files(path: Path) -> list[Path]:
    """The .onnx file and the external-data files its initializers reference."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    locs = sorted({e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"})
    return [Path(path)] + [Path(path).parent / loc for loc in locs]


def _past_dims(name: str, shape: list, hint: dict) -> tuple:
    """(kv_heads, head_dim) of one past input: from the graph, or where the graph leaves them
    symbolic (the model builder names head_dim ``kv_cache_dim``) from ``hint``: the manifest's
    ``kv_cache`` or the ``genai_config.json`` beside the model."""
    heads, dim = shape[1], shape[3]
    try:
        layer = int(name.split(".")[1])
        heads = heads if isinstance(heads, int) else hint["kv_heads"][layer]
        dim = dim if isinstance(dim, int) else hint["head_dim"][layer]
    except (KeyError, IndexError, ValueError, TypeError):
        pass
    return heads, dim


def _layout_hint(path: Path, manifest: dict) -> dict:
    if manifest.get("kv_cache"):
        return manifest["kv_cache"]
    genai = path.parent / "genai_config.json"
    try:
        dec = json.loads(genai.read_text())["model"]["decoder"]
        n = int(dec["num_hidden_layers"])
        return {"kv_heads": [int(dec["num_key_value_heads"])] * n, "head_dim": [int(dec["head_size"])] * n}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


class OnnxRuntimeRunner(Runner):
    """An exported ``.onnx`` on ORT's CPU execution provider; holds ``present.*`` between calls
    and feeds them back as ``past_key_values.*``, so prefill and decode share one session."""

    runtime = "onnxruntime"

    def __init__(self, path: Path, *, intra_op_threads: int | None = None, graph_optimization_level: str | None = None,
                 max_seq_len: int | None | Literal["manifest"] = "manifest"):
        import onnxruntime as ort

        self.path = Path(path)
        if not self.path.is_file():
            raise RunnerError(f"ONNX model not found: {self.path}")
        manifest = {}
        mpath = self.path.parent / MANIFEST
        if mpath.is_file():
            try:
                manifest = json.loads(mpath.read_text())
            except ValueError as exc:
                raise RunnerError(f"corrupt manifest {mpath}: {exc}") from None
        sess_defaults = manifest.get("session", {})
        threads = intra_op_threads if intra_op_threads is not None else sess_defaults.get("intra_op_threads", 0)
        self.threads = int(threads) or torch.get_num_threads()
        level = graph_optimization_level or sess_defaults.get("graph_optimization_level", "all")
        if level not in GRAPH_LEVELS:
            raise RunnerError(f"graph_optimization_level must be one of {', '.join(GRAPH_LEVELS)}; got {level!r}")
        self.graph_optimization_level = level
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[level]
        so.log_severity_level = 3
        #: the export's own session config entries (e.g. mlas.disable_kleidiai): what it was verified with
        self.config_entries = {str(k): str(v) for k, v in (sess_defaults.get("config_entries") or {}).items()}
        for key, value in self.config_entries.items():
            so.add_session_config_entry(key, value)
        try:
            self.session = ort.InferenceSession(str(self.path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise RunnerError(f"ONNX Runtime could not load {self.path}: {type(exc).__name__}: {exc}") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = {"input_ids", "attention_mask"} - set(inputs)
        if missing:
            raise RunnerError(f"{self.path} is not a KV-cache LM export: missing inputs {sorted(missing)}")
        self._position_ids = "position_ids" in inputs
        self._past_names = [n for n in inputs if n.startswith("past_key_values.")]
        self._present_names = ["present." + n[len("past_key_values."):] for n in self._past_names]
        hint = _layout_hint(self.path, manifest)
        dims = {n: _past_dims(n, inputs[n].shape, hint) for n in self._past_names}
        if any(not isinstance(v, int) for hd in dims.values() for v in hd):
            raise RunnerError(f"{self.path}: past_key_values heads/head_dim are not static in the graph and no "
                              f"manifest beside it gives them")
        self._empty = {n: np.zeros((1, dims[n][0], 0, dims[n][1]), dtype=np.float32) for n in self._past_names}
        self._out_names = [o.name for o in self.session.get_outputs()]
        #: ``logits`` holds the last position and ``all_logits`` every position on request
        #: (:mod:`export.onnxruntime.last_logits`); an older graph returns every position in ``logits``
        self.last_logits = split_head_io([i.name for i in self.session.get_overridable_initializers()],
                                         self._out_names)
        #: the graph's verification input (export/onnxruntime/verify_rows.py) and the most tokens a
        #: verification call takes; fed true only by speculative_runner()'s verification calls
        self._verify_input = has_verify_rows([i.name for i in self.session.get_overridable_initializers()])
        self._verify_max = int((manifest.get("verify") or {}).get("max_tokens") or 0) or None
        self._verifying = False
        self.max_seq_len = manifest.get("max_seq_len") if max_seq_len == "manifest" else max_seq_len
        #: a longer input is fed in calls of at most this many tokens (None: one call; exports before
        #: the option have none)
        self.prefill_chunk = int(manifest["prefill_chunk"]) if manifest.get("prefill_chunk") else None
        self.manifest = manifest
        fmt = (manifest.get("quantization") or {}).get("int8_format") or {}
        warn_if_saturates(fmt.get("format"), str(self.path))
        self.reset()

    def reset(self) -> None:
        self._past = dict(self._empty)
        self._pos = 0

    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        ids = self.checked_ids(ids)
        return self.in_chunks(ids, self.prefill_chunk, all_logits, self._run)

    def _run(self, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        t = int(ids.numel())
        feeds = {
            "input_ids": ids.numpy().reshape(1, t),
            "attention_mask": np.ones((1, self._pos + t), dtype=np.int64),
            **self._past,
        }
        if self._position_ids:
            feeds["position_ids"] = np.arange(self._pos, self._pos + t, dtype=np.int64).reshape(1, t)
        if self._verify_input:
            feeds[VERIFY] = np.array(self._verifying and all_logits and 1 < t <= (self.verify_tokens or 0))
        head = self._head(feeds, all_logits)
        try:
            outs = self.session.run([head, *self._present_names], feeds)
        except Exception as exc:
            raise RunnerError(f"ONNX Runtime failed running {self.path}: {type(exc).__name__}: {exc}") from None
        self._past = dict(zip(self._past_names, outs[1:]))
        self._pos += t
        logits = outs[0][0]
        if not all_logits:  # a copy of the last row: a view would keep the call's positions x vocab logits alive
            return torch.from_numpy(np.array(logits[-1:], dtype=np.float32))
        return torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))

    def _head(self, feeds: dict, all_logits: bool) -> str:
        """The logits output to fetch; asks the graph for every position where the caller needs them."""
        if not self.last_logits:
            return LAST
        feeds[ASK] = np.array(bool(all_logits))
        return ALL if all_logits else LAST

    def forward_each(self, rests: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The choices of one context as one batch on the graph's batch axis: the past repeated per
        choice, the choices right-padded (causal attention keeps a pad from reaching back), every
        row at the same positions; the past is left as it was. None before anything is cached, and for
        the fused graph: ORT's GroupQueryAttention takes a batch above 1 only without a past."""
        if self._pos == 0 or len(rests) < 2 or "GroupQueryAttention" in (self.manifest.get("ops") or {}):
            return None
        padded, lengths = self.checked_rows(rests)
        k, longest = padded.shape
        feeds = {"input_ids": padded.numpy(), "attention_mask": np.ones((k, self._pos + longest), dtype=np.int64),
                 **{n: np.repeat(a, k, axis=0) for n, a in self._past.items()}}
        if self._position_ids:
            feeds["position_ids"] = np.tile(np.arange(self._pos, self._pos + longest, dtype=np.int64), (k, 1))
        try:
            logits = self.session.run([self._head(feeds, True)], feeds)[0]
        except Exception as exc:
            raise RunnerError(f"ONNX Runtime failed running {self.path} on a batch of {k}: "
                              f"{type(exc).__name__}: {exc}") from None
        return [torch.from_numpy(np.ascontiguousarray(logits[i, : lengths[i]], dtype=np.float32)) for i in range(k)]

    def speculative_runner(self) -> "OnnxRuntimeRunner":
        """This graph with its verification input fed true for calls of 2 to ``verify_tokens`` tokens that ask for
        every position: each row attends as a one-token call does, so its logits are that call's, bit for bit
        (export/onnxruntime/verify_rows.py); prefill and single steps run as always. Refused for an export
        without ``verify_tokens``."""
        if self._verifying:
            return self
        if not self._verify_input or not self._verify_max:
            raise RunnerError(f"{self.path.name} has no verification input ({VERIFY}); export it with "
                              "export.onnxruntime.verify_tokens (for example 5) to decode speculatively")
        other = copy.copy(self)
        other._verifying, other.verify_tokens, other.draft_policy = True, self._verify_max, None
        other.reset()
        require_exact_rows(other, self.path.name)
        return other

    def truncate(self, n: int) -> bool:
        """Slice the past arrays to their first ``n`` positions (exact: the next call's mask and
        positions cover ``0..n`` only); a graph whose past does not hold every position answers False."""
        if not 0 < n <= self._pos:
            return super().truncate(n)
        if any(a.shape[2] != self._pos for a in self._past.values()):
            return False
        self._past = {k: np.ascontiguousarray(a[:, :, :n, :]) for k, a in self._past.items()}
        self._pos = n
        return True

    def size_bytes(self) -> int:
        """The .onnx plus every external-data file it references."""
        return sum(f.stat().st_size for f in onnx_files(self.path))

    def describe(self) -> dict:
        return {
            "runtime": self.runtime,
            "model": str(self.path),
            "providers": self.session.get_providers(),
            "intra_op_threads": self.threads,
            "inter_op_threads": 1,
            "graph_optimization_level": self.graph_optimization_level,
            "session_config_entries": self.config_entries,
            "max_seq_len": self.max_seq_len,
            "quantization": self.manifest.get("quantization", {}).get("mode", "unknown"),
        }

    def close(self) -> None:
        self.session = None
