"""Weight files we did not write: refuse pickles that ask for code, name damaged files.

``torch.load(weights_only=True)`` (ours, and transformers' for ``.bin`` folders) refuses a
pickle that references code instead of running it; :func:`unsafe_pickle_reason` turns that
refusal into a sentence. :func:`check_safetensors` reads each safetensors header (no tensor
data), so a truncated or damaged file is named before transformers fails somewhere inside.
"""

from __future__ import annotations

from pathlib import Path


def unsafe_pickle_reason(exc: BaseException) -> str | None:
    """If ``exc`` is ``torch.load(weights_only=True)`` refusing a pickle that asks for more than
    tensors (code to call on load), say what it asked for; else None."""
    text = str(exc)
    if "weights only load failed" not in text.lower() and "unpickl" not in type(exc).__name__.lower():
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), None)
    return "the pickle references code, not only tensors" + (f" ({detail})" if detail else "")


def check_safetensors(files: list[Path], error: type[Exception] = ValueError) -> None:
    """Read each safetensors header (cheap, no tensor data): a truncated or damaged file is named
    here rather than failing somewhere inside transformers."""
    from safetensors import safe_open

    for f in files:
        if f.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as exc:
            raise error(
                f"weights file {f} is damaged or truncated ({type(exc).__name__}: {exc}); "
                "copy or download it again"
            ) from None
