"""The architecture matrix as a test: each family through load, ptq_int8, smoothquant, awq,
rmsnorm, resume and both exporters (see ``tests/architecture_matrix.py``, which also writes
the README's support table). The rule, not a frozen table: every cell passes its check or is
a clear refusal with a message; no crash, no silently wrong result."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("architecture_matrix", Path(__file__).with_name("architecture_matrix.py"))
matrix = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("architecture_matrix", matrix)
_spec.loader.exec_module(matrix)

# ExecuTorch lowering dominates (tens of seconds per family on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


#: families whose ExecuTorch cell (a lowering, fp32 logits against eager) a stricter test already proves on the same
#: tiny shape: tests/export/executorch/test_llm.py (qwen2, qwen3, phi3, mixtral: two blocks, 1e-4, chunked calls)
#: and test_exporter.py (llama: fp32 parity to 1e-4 and greedy); the matrix script still fills their cells
EXECUTORCH_PROVEN_ELSEWHERE = {"llama", "qwen2", "qwen3", "phi3", "mixtral"}


@pytest.mark.parametrize("arch", matrix.ARCHS)
def test_every_cell_passes_or_is_a_clear_refusal(arch, tiny_config, tmp_path):
    columns = [c for c in matrix.COLUMNS if not (c == "executorch" and arch in EXECUTORCH_PROVEN_ELSEWHERE)]
    cells = matrix.ArchRun(arch, matrix.matrix_config(tiny_config(arch)), tmp_path).run(columns)
    assert list(cells) == columns
    bad = {col: cell.note for col, cell in cells.items() if cell.status == matrix.FAIL}
    assert not bad, f"{arch}: " + "\n".join(f"{c}: {n}" for c, n in bad.items())
    for col, cell in cells.items():
        if cell.status in (matrix.REFUSED, matrix.LATE):
            assert len(cell.note) > 20, f"{arch}/{col}: a refusal must say why ({cell.note!r})"
    assert (cells["load"].status == matrix.REFUSED) == (arch == "bert"), cells["load"]


def test_table_marks_each_status(tmp_path):
    C = matrix.Cell
    results = {"x": {c: C(matrix.PASS) for c in matrix.COLUMNS}}
    results["x"]["awq"] = C(matrix.REFUSED, "no fold layout")
    results["x"]["rmsnorm"] = C(matrix.NA, "no LayerNorm")
    results["x"]["executorch"] = C(matrix.LATE, "ExportError: late")
    results["x"]["onnxruntime"] = C(matrix.FAIL, "crash: KeyError\ntraceback")
    table = matrix.markdown(results)
    assert "| x | ✅ | ✅ | ✅ | ⛔<sup>1</sup> | n/a | ✅ | ⚠️<sup>2</sup> | ❌<sup>3</sup> |" in table
    assert "1. no fold layout" in table and "3. crash: KeyError" in table and "traceback" not in table
