"""Fuzz ``load_config`` with generated pipeline YAMLs, valid and broken.

Configs are drawn from the pipeline's own JSON Schema (every stage kind, every block), then
mutated: wrong types, unknown keys, out-of-range and huge numbers, wrong nesting. Every one
must be accepted or rejected with a :class:`ConfigError` whose problems each name a YAML path
that exists in the document (up to a missing or unknown last key): never another exception.
"""

from __future__ import annotations

import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimize.config import json_schema, load_config
from optimize.errors import ConfigError

#: values of the wrong type, size or shape, for any slot
NASTY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "8da4w", "llama", "executorch", "pydoc", "stages.0", "../x", "a" * 300]),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)

# the tiny random model used when a draw keeps the model valid (for the model checks)
MODEL = {"source": "random", "config": {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}}


#: fields whose free-form strings must be real to be valid (anything else is drawn generically)
STRINGS = {
    "target": st.sampled_from([None, "executorch", "onnxruntime"]),
    "corpus": st.just("pydoc"),
    "tokenizer": st.just("smollm2-135m"),
}
SKIP = {"output_dir", "path", "cache_dir", "marker", "teacher"}  # filesystem, or a whole second model


class _Gen:
    """Draw a valid value for a JSON-Schema node (within bounds, real enums), for mutating later."""

    def __init__(self, draw, schema: dict):
        self.draw, self.defs = draw, schema.get("$defs", {})

    def chance(self, p: float) -> bool:
        return self.draw(st.integers(0, 99)) < p * 100

    def resolve(self, node: dict) -> dict:
        while "$ref" in node:
            node = self.defs[node["$ref"].split("/")[-1]]
        return node

    def value(self, node: dict, key: str = "", depth: int = 0):
        if key in STRINGS:
            return self.draw(STRINGS[key])
        node = self.resolve(node)
        if "default" in node and self.chance(0.3):
            return node["default"]
        options = node.get("oneOf") or node.get("anyOf")
        if options:
            return self.value(self.draw(st.sampled_from(options)), key, depth + 1)
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return self.draw(st.sampled_from(node["enum"]))
        kind = node.get("type")
        if kind == "object" or "properties" in node:
            return self.obj(node, depth) if depth < 6 else {}
        if kind == "array":
            item = node.get("items", {})
            return [self.value(item, key, depth + 1) for _ in range(self.draw(st.integers(0, 2)))]
        if kind == "integer":
            lo = node.get("minimum", node.get("exclusiveMinimum", -1) + 1)
            hi = node.get("maximum", node.get("exclusiveMaximum", lo + 1025) - 1)
            return self.draw(st.integers(int(lo), int(min(hi, lo + 1024))))
        if kind == "number":
            lo = node.get("minimum", node.get("exclusiveMinimum", 0.0))
            hi = node.get("maximum", node.get("exclusiveMaximum", lo + 10.0))
            return self.draw(st.floats(lo, hi, exclude_min="exclusiveMinimum" in node,
                                       exclude_max="exclusiveMaximum" in node, allow_nan=False))
        if kind == "boolean":
            return self.draw(st.booleans())
        if kind == "null":
            return None
        return self.draw(st.sampled_from(["x", "blocks", "lm_head"]))

    def obj(self, node: dict, depth: int) -> dict:
        props, required = node.get("properties", {}), set(node.get("required", []))
        return {key: self.value(sub, key, depth + 1) for key, sub in props.items()
                if key not in SKIP and (key in required or self.chance(0.35))}


def _slots(node, path=()):
    """Every (container, key) in a document, for picking what to break."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield node, k
            yield from _slots(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield node, i
            yield from _slots(v, path + (i,))


def _mutate(draw, doc: dict) -> None:
    """One breakage at a random place: a wrong value, a dropped key, an unknown key, a wrong
    nesting (a scalar wrapped in a list or a mapping, a mapping flattened to a scalar)."""
    slots = list(_slots(doc))
    if not slots:
        return
    container, key = draw(st.sampled_from(slots))
    how = draw(st.sampled_from(["value", "value", "drop", "unknown", "wrap_list", "wrap_dict", "huge"]))
    if how == "value":
        container[key] = draw(NASTY)
    elif how == "drop" and isinstance(container, dict):
        del container[key]
    elif how == "unknown" and isinstance(container, dict):
        container[draw(st.sampled_from(["bogus", "Stages", "kind2", "group-size", "1"]))] = draw(NASTY)
    elif how == "wrap_list":
        container[key] = [container[key]]
    elif how == "wrap_dict":
        container[key] = {"value": container[key]}
    elif how == "huge":
        container[key] = draw(st.sampled_from([10**30, -(10**30), 1e308, float("inf"), float("nan"), "9" * 400]))


@st.composite
def pipelines(draw, max_mutations: int = 3, keep_model: float = 0.8):
    """A pipeline document: valid from the schema (every stage kind can appear), then 0..n breakages."""
    schema = json_schema()
    gen = _Gen(draw, schema)
    doc = gen.obj(schema, 0)
    doc["version"] = 1
    if gen.chance(keep_model) or not isinstance(doc.get("model"), dict) or "config" not in doc["model"]:
        doc["model"] = {**MODEL, "config": dict(MODEL["config"])}
    kinds = list(schema["properties"]["stages"]["items"]["discriminator"]["mapping"])
    stage_items = schema["properties"]["stages"]["items"]["discriminator"]["mapping"]
    doc["stages"] = [{**gen.obj(gen.resolve({"$ref": stage_items[k]}), 1), "kind": k}
                     for k in draw(st.lists(st.sampled_from(kinds), max_size=3))]
    for _ in range(draw(st.integers(0, max_mutations))):
        _mutate(draw, doc)
    return doc


def _check_outcome(doc: dict, **kw) -> None:
    try:
        load_config(doc, **kw)
    except ConfigError as exc:
        assert exc.problems, "a ConfigError must list its problems"
        for path, msg in exc.problems:
            assert isinstance(msg, str) and msg.strip(), (path, msg)
            _assert_names_a_yaml_path(doc, path)


def _assert_names_a_yaml_path(doc: dict, path: str) -> None:
    """Every part of the path but the last exists in the document (the last may be a key that
    is missing or unknown)."""
    assert path, f"problem without a YAML path in {doc}"
    node = doc
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise AssertionError(f"problem path {path!r}: {'.'.join(parts[: i + 1])!r} is not in the document")


def _settings(n: int):
    """CI: ``n`` fixed examples (derandomized: the same every run). FUZZ_SCALE=k explores k*n fresh ones."""
    scale = int(os.environ.get("FUZZ_SCALE", "0"))
    return settings(max_examples=n * max(scale, 1), deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=scale == 0)


FAST = _settings(150)


@FAST
@given(pipelines())
@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_fuzzed_dicts_are_accepted_or_config_errors(doc):
    _check_outcome(doc, check_model=False)


@_settings(80)
@given(pipelines(max_mutations=12))
def test_heavily_broken_dicts_are_config_errors(doc):
    _check_outcome(doc, check_model=False)


JUNK = st.one_of(st.none(), st.sampled_from(["", "!!python/object/apply:os.system ['true']", "[1, 2", "- a\n- b",
                                              "\t:", "~", "version: 1\nversion: 2", "a: &x [*x]"]))


@_settings(60)
@given(doc=pipelines(), junk=JUNK)
def test_fuzzed_yaml_files_are_accepted_or_config_errors(tmp_path_factory, doc, junk):
    """Through a real file: YAML parsing, relative paths, and text that is not a mapping."""
    path = tmp_path_factory.mktemp("fuzz") / "p.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True) if junk is None else junk)
    try:
        load_config(path, check_model=False)
    except ConfigError as exc:
        assert exc.problems
        for p, msg in exc.problems:
            assert isinstance(p, str) and msg  # the root ('') is fine for a file that is not a mapping


@pytest.mark.slow
@_settings(40)
@given(pipelines(max_mutations=1, keep_model=0.9), st.sampled_from([None, "executorch", "onnxruntime", "nope"]))
def test_fuzzed_configs_with_model_checks(doc, target):
    """The pre-flight model checks (config read, every stage's check_model, the exporter's)
    also answer with ConfigErrors only; here ``model.config`` itself is sometimes fuzzed."""
    if target is not None:
        doc["target"] = target
    _check_outcome(doc, check_model=True)


@_settings(40)
@given(st.dictionaries(
    st.sampled_from(["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                     "intermediate_size", "vocab_size", "head_dim", "model_type", "tie_word_embeddings"]),
    NASTY, max_size=3))
def test_fuzzed_model_config_values_give_config_errors(bad):
    doc = {"version": 1, "model": {**MODEL, "config": {**MODEL["config"], **bad}},
           "stages": [{"kind": "ptq_int8"}, {"kind": "rmsnorm"}, {"kind": "gqa", "num_key_value_heads": 1}]}
    _check_outcome(doc, check_model=True)
