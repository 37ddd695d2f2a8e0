"""The user's tasks of every output type scored in every runtime the project ships to: the tiny Llama
exported once to each (fp32), each runtime's requests against eager's on the same model.

Tolerances: summed log-likelihoods within 2e-3 nats of eager's (fp32 kernels of another runtime over
up to 48 tokens; eager itself equals lm-eval's HFLM to 1e-4, test_tasks_user.py), greedy flags and
generated strings identical (the greedy tokens are the same)."""

from __future__ import annotations

import pytest

from export.decoding.runtime import EagerRunner
from optimize.tasks.data import missing_packages
from tests.optimize.tasks.user_tasks import TASKS, requests_by_type, write_user_tasks

pytestmark = [pytest.mark.skipif(bool(missing_packages()), reason="; ".join(missing_packages())),
              pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_LEN = 48
TOL = 2e-3


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny Llama as a .pte (with forward_all), an ONNX Runtime directory (run by ONNX Runtime and
    by onnxruntime-genai), and TorchChat's model.pth (its own Transformer)."""
    from export.base import get_exporter
    from targets.sources import RandomSource, load_model
    from tests.conftest import TINY_LLAMA

    loaded = load_model(RandomSource(config={**TINY_LLAMA, "initializer_range": 0.2}, seed=0))
    model, tok = loaded.model.eval(), loaded.tokenizer
    root = tmp_path_factory.mktemp("runtimes")
    quiet = lambda *a, **k: None  # noqa: E731
    runners = {}
    pte = get_exporter("executorch").export(model, tok, root / "et", {"max_seq_len": 64, "scoring_method": True},
                                            log=quiet)
    runners["executorch"] = lambda: get_exporter("executorch").load(pte.artifact)
    ort = get_exporter("onnxruntime").export(model, tok, root / "ort", {"max_seq_len": 64}, log=quiet)
    runners["onnxruntime"] = lambda: get_exporter("onnxruntime").load(ort.artifact)
    runners["onnxruntime-genai"] = lambda: get_exporter("onnxruntime").load(root / "ort")
    tc = get_exporter("torchchat").export(model, tok, root / "tc", {"max_seq_len": 64, "pte": False, "pt2": False},
                                          log=quiet)
    runners["torchchat"] = lambda: get_exporter("torchchat").load(tc.artifact)
    return model, tok, runners, write_user_tasks(root / "my_tasks")


def _answers(lm, reqs):
    return {"loglikelihood": lm.loglikelihood(reqs["loglikelihood"], disable_tqdm=True),
            "rolling": lm.loglikelihood_rolling(reqs["loglikelihood_rolling"], disable_tqdm=True),
            "generate": lm.generate_until(reqs["generate_until"], disable_tqdm=True)}


@pytest.mark.parametrize("runtime", ["executorch", "onnxruntime", "onnxruntime-genai", "torchchat"])
def test_every_output_type_in_the_runtime_equals_eager(exported, runtime):
    from optimize.tasks.adapter import RunnerLM

    model, tok, runners, folder = exported
    reqs = requests_by_type(TASKS, [folder])
    want = _answers(RunnerLM(EagerRunner(model), tok, max_length=MAX_LEN), reqs)
    runner = runners[runtime]()
    lm = RunnerLM(runner, tok, max_length=MAX_LEN)
    got = _answers(lm, reqs)
    assert lm.runner.runtime.startswith(runtime.split("-")[0])
    ll = max(abs(a[0] - b[0]) for a, b in zip(got["loglikelihood"], want["loglikelihood"]))
    assert ll < TOL, f"{runtime}: max |runtime - eager| = {ll:.3g} nats"
    assert [a[1] for a in got["loglikelihood"]] == [b[1] for b in want["loglikelihood"]]
    rolled = max(abs(a - b) for a, b in zip(got["rolling"], want["rolling"]))
    assert rolled < TOL, f"{runtime}: rolling max |runtime - eager| = {rolled:.3g} nats"
    assert got["generate"] == want["generate"] and any(got["generate"])
    assert lm.stats["generated"] > 0 and lm.stats["tokens"] > 0
