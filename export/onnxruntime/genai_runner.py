"""A :class:`Runner` over onnxruntime-genai: the runtime apps on Android, iOS and Windows use.

It loads an export directory (``genai_config.json`` + ``model.onnx`` + tokenizer files) with
``onnxruntime_genai.Model`` and drives a ``Generator``: ``append_tokens`` feeds a chunk and
``get_output`` returns the last position's logits, or every appended position's where the caller
scores them (``all_logits`` of the split head, :mod:`export.onnxruntime.last_logits`; ``logits``
of an older graph), so the pipeline's perplexity, parity, greedy and latency checks measure the
artifact the way an app runs it.
:func:`genai_greedy` is onnxruntime-genai's own greedy search (``generate_next_token``).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import numpy as np
import torch

from export.onnxruntime.last_logits import ALL, ASK, LAST, split_head_io
from export.onnxruntime.verify_rows import VERIFY, has_verify_rows, require_exact_rows
from export.decoding.runtime import Runner, RunnerError

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"


def _load_model(directory: Path, threads: int | None, *, graph: bytes | None = None):
    """(og.Model, genai_config dict); ``threads`` overrides the session's intra-op threads
    through ``Config.overlay`` (the file stays as shipped). ``graph``: the decoder graph to load
    from memory instead of its file (:func:`_scoring_graph`; its weights still come from the
    folder). onnxruntime-genai keeps a pointer to those bytes, not a copy: the caller holds them
    as long as the model."""
    import onnxruntime_genai as og

    directory = Path(directory)
    cfg_path = directory / GENAI_CONFIG
    if not cfg_path.is_file():
        raise RunnerError(f"{directory} is not an onnxruntime-genai model: {GENAI_CONFIG} is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
        config = og.Config(str(directory))
        if graph is not None:
            config.add_model_data(cfg["model"]["decoder"]["filename"], graph)
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": int(threads), "inter_op_num_threads": 1}}}}))
        return og.Model(config), cfg
    except Exception as exc:
        raise RunnerError(f"onnxruntime-genai could not load {directory}: {type(exc).__name__}: {exc}") from None


def _warn_on_saturating_int8(directory: Path) -> None:
    """The same warning :class:`~export.onnxruntime.runner.OnnxRuntimeRunner` gives: a u8s8 export
    (its manifest says) loaded on a CPU whose int8 GEMM saturates it. A directory without our
    manifest (the model builder's) says nothing about its int8 format, and gets no warning."""
    from export.onnxruntime.int8_format import warn_if_saturates
    from export.onnxruntime.runner import MANIFEST

    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return
    fmt = (manifest.get("quantization") or {}).get("int8_format") or {}
    warn_if_saturates(fmt.get("format"), str(directory))


def _graph_inputs(graph: bytes) -> list[str]:
    import onnx

    return [i.name for i in onnx.load_model_from_string(graph).graph.input]


def _scoring_graph(model_file: Path) -> bytes | None:
    """The decoder graph with the split head (:mod:`export.onnxruntime.last_logits`), weights left
    in their external file, with ``return_all_logits`` a plain input instead of an initializer that
    defaults to false; None for a graph without the split head (read from the graph itself, so a
    folder our manifest did not write is judged the same way).

    onnxruntime-genai feeds a model only the inputs its session lists, and an ONNX Runtime session
    does not list an overridable initializer, so ``Generator.set_model_input`` cannot reach the
    shipped default; as a plain input it can, and the runner flips it per call. Every other node,
    weight and default is the shipped graph's: a call that asks for the last position computes
    what an app computes."""
    import onnx

    try:
        proto = onnx.load(str(model_file), load_external_data=False)
    except Exception:  # not a graph protobuf reads: onnxruntime-genai will say what is wrong
        return None
    g = proto.graph
    if not split_head_io([i.name for i in g.input], [o.name for o in g.output]):
        return None
    for t in [t for t in g.initializer if t.name in (ASK, VERIFY)]:  # the verification input likewise
        g.initializer.remove(t)
    return proto.SerializeToString()


class GenaiRunner(Runner):
    """An export directory run by ``onnxruntime_genai`` (CPU). ``max_seq_len`` is the search
    ``max_length`` its KV buffers are sized for (``genai_config.json``'s, unless given)."""

    runtime = "onnxruntime-genai"

    def __init__(self, directory: Path, *, max_seq_len: int | None = None, intra_op_threads: int | None = None):
        import onnxruntime_genai as og

        self.path = Path(directory)
        self.threads = int(intra_op_threads or torch.get_num_threads())
        cfg_path = self.path / GENAI_CONFIG
        try:
            decoder = json.loads(cfg_path.read_text())["model"]["decoder"]["filename"]
        except (OSError, ValueError, KeyError, TypeError):
            decoder = None  # _load_model says what is wrong with the folder
        #: the split head: onnxruntime-genai allocates one row of ``logits`` per call (its pruned
        #: mode), and every position comes from ``all_logits`` when this runner asks for them
        self._graph = _scoring_graph(self.path / decoder) if decoder else None
        self.last_logits = self._graph is not None
        self.model, self.config = _load_model(self.path, self.threads, graph=self._graph)
        #: fed to every call by reference (set_model_input keeps the array's buffer): flipped per call
        self._ask = np.array(False)
        #: the verification input, where the graph has one (fed true only by speculative_runner()'s calls)
        self._verify = np.array(False)
        self._verify_input = self._graph is not None and has_verify_rows(_graph_inputs(self._graph))
        self._verifying = False
        self._og = og
        self.max_seq_len = int(max_seq_len or self.config["search"]["max_length"])
        #: onnxruntime-genai prefills in chunks of search.chunk_size and then returns only the last
        #: chunk's logits, so a longer input is appended a chunk at a time here (every position kept)
        self.prefill_chunk = int(self.config["search"].get("chunk_size") or 0) or None
        self._gen = None
        #: the buffer length a generation asked for (reserve); None: max_seq_len
        self._reserved: int | None = None
        _warn_on_saturating_int8(self.path)
        self.reset()

    #: reserve() rounds up to a multiple of this, so similar generations share a buffer size
    RESERVE_STEP = 256

    def reserve(self, positions: int) -> None:
        """Size the next generator's KV buffers (``max_length``) to ``positions``, rounded up, instead of
        ``max_seq_len``: onnxruntime-genai allocates one max-length buffer for past and present per layer
        (SmolLM2 at 8192 positions: 377 MB of cache for a 135M model, at 512: 24 MB). An app sets
        ``max_length`` per generation the same way. The hint is used by the next generator only."""
        step = self.RESERVE_STEP
        self._reserved = min(self.max_seq_len, max(step, -(-int(positions) // step) * step))

    def reset(self) -> None:
        self._gen = None
        self._pos = 0

    def _generator(self):
        if self._gen is None:
            params = self._og.GeneratorParams(self.model)
            # the hint serves the generation it was given for: the next one after a reset without one gets max_seq_len
            params.set_search_options(max_length=self._reserved or self.max_seq_len, do_sample=False)
            self._reserved = None
            self._gen = self._og.Generator(self.model, params)
            if self.last_logits:
                self._gen.set_model_input(ASK, self._ask)
            if self._verify_input:
                self._gen.set_model_input(VERIFY, self._verify)
        return self._gen

    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        ids = self.checked_ids(ids)
        return self.in_chunks(ids, self.prefill_chunk, all_logits, self._append)

    def _append(self, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        t = int(ids.numel())
        gen = self._generator()
        head = LAST
        try:
            if self.last_logits:
                self._ask[...] = bool(all_logits)
                head = ALL if all_logits else LAST
            if self._verify_input:
                self._verify[...] = self._verifying and all_logits and 1 < t <= (self.verify_tokens or 0)
            gen.append_tokens(ids.to(torch.int32).numpy())
            logits = gen.get_output(head)
        except Exception as exc:
            raise RunnerError(f"onnxruntime-genai failed running {self.path}: {type(exc).__name__}: {exc}") from None
        self._pos += t
        logits = np.asarray(logits, dtype=np.float32).reshape(-1, logits.shape[-1])[-t:]
        if not all_logits:  # a copy of the last row: a view would keep the call's positions x vocab logits alive
            return torch.from_numpy(np.array(logits[-1:]))
        return torch.from_numpy(np.ascontiguousarray(logits))

    def speculative_runner(self) -> "GenaiRunner":
        """This model with the graph's verification input true for calls of 2 to ``verify_tokens`` tokens that
        ask for every position (export/onnxruntime/verify_rows.py): their rows are one-token calls' logits, bit
        for bit; the cache is cut back with ``rewind_to``. Refused for an export without ``verify_tokens``."""
        if self._verifying:
            return self
        from export.onnxruntime.runner import MANIFEST

        try:
            most = int(json.loads((self.path / MANIFEST).read_text())["verify"]["max_tokens"])
        except (OSError, ValueError, KeyError, TypeError):
            most = 0
        if not self._verify_input or not most:
            raise RunnerError(f"{self.path.name} has no verification input ({VERIFY}); export it with "
                              "export.onnxruntime.verify_tokens (for example 5) to decode speculatively")
        other = copy.copy(self)
        other._ask, other._verify = np.array(False), np.array(False)  # its own generator's buffers
        other._verifying, other.verify_tokens, other.draft_policy = True, most, None
        other.reset()
        require_exact_rows(other, self.path.name)
        return other

    def truncate(self, n: int) -> bool:
        """onnxruntime-genai's ``Generator.rewind_to(n)``: the KV buffers keep their first ``n`` positions."""
        if not 0 < n <= self._pos:
            return super().truncate(n)
        try:
            self._generator().rewind_to(n)
        except Exception as exc:  # a model type genai cannot rewind: the caller feeds the context again
            log.info("onnxruntime-genai cannot rewind %s: %s", self.path, exc)
            return False
        self._pos = n
        return True

    def size_bytes(self) -> int:
        from export.onnxruntime.runner import onnx_files

        return sum(f.stat().st_size for f in onnx_files(self.path / self.config["model"]["decoder"]["filename"]))

    def describe(self) -> dict:
        import onnxruntime_genai as og

        return {"runtime": self.runtime, "model": str(self.path), "onnxruntime_genai": og.__version__,
                "max_seq_len": self.max_seq_len, "provider": "cpu", "intra_op_threads": self.threads}

    def close(self) -> None:
        self._gen = None
        self.model = None
        self._graph = None  # after the model: onnxruntime-genai read the graph from these bytes


def genai_greedy(directory: Path, prompt_ids, max_new_tokens: int, *, model=None) -> list[int]:
    """onnxruntime-genai's own greedy search: ``append_tokens(prompt)`` then
    ``generate_next_token`` until ``max_new_tokens`` (or its EOS / max_length)."""
    import onnxruntime_genai as og

    model = model or _load_model(Path(directory), None)[0]
    prompt = [int(t) for t in prompt_ids]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + max_new_tokens, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    out: list[int] = []
    while not gen.is_done() and len(out) < max_new_tokens:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out
