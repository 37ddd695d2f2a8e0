"""The rules an int4 group size must follow, in one place for every quantizer and exporter.

int4 weights are quantized in groups of input channels, one scale (and zero point) each:

- a Linear's group size must be a whole multiple of 32, because XNNPACK's blockwise 4-bit
  kernels work on 32-channel blocks;
- it must divide the ``in_features`` of every Linear quantized with it (a partial group has
  no kernel);
- an int4 embedding table's group size must be even (two int4 values pack into one byte)
  and divide the embedding width.

Each check returns ``None`` or one sentence saying what is wrong and what would work, so
pydantic validators, the stages' pre-flight checks, the stages themselves and the
ExecuTorch exporter all say the same thing. ``targets`` is the leaf package, so ``optimize``
and ``export`` can both import this.
"""

from __future__ import annotations

from typing import Mapping

#: XNNPACK's blockwise 4-bit kernels need groups that are whole multiples of 32 input channels
GROUP_MULTIPLE = 32
#: group sizes suggested when one does not fit
COMMON_GROUP_SIZES = (32, 64, 128, 256)


def group_size_error(group_size: int) -> str | None:
    """Why ``group_size`` cannot be an int4 Linear group size on XNNPACK, or None."""
    if group_size <= 0 or group_size % GROUP_MULTIPLE:
        ok = ", ".join(str(g) for g in COMMON_GROUP_SIZES)
        return (
            f"group_size={group_size} is not a multiple of {GROUP_MULTIPLE}: XNNPACK's 4-bit kernels need "
            f"whole {GROUP_MULTIPLE}-channel blocks (typical: {ok})"
        )
    return None


def embedding_group_size_error(group_size: int) -> str | None:
    """Why ``group_size`` cannot group an int4 embedding table, or None."""
    if group_size <= 0 or group_size % 2:
        return f"embedding_group_size={group_size} must be even (two int4 values pack into a byte)"
    return None


def fitting_group_sizes(widths: Mapping[str, int] | list[int]) -> list[int]:
    """The common group sizes that divide every width."""
    values = list(widths.values()) if isinstance(widths, Mapping) else list(widths)
    return [g for g in COMMON_GROUP_SIZES if all(w % g == 0 for w in values)]


def undivided(group_size: int, widths: Mapping[str, int]) -> list[str]:
    """Names (of ``name -> in_features``) whose width ``group_size`` does not divide."""
    return [n for n, w in widths.items() if w % group_size]


def widths_error(group_size: int, widths: Mapping[str, int], key: str = "group_size") -> str | None:
    """Why ``group_size`` cannot group the Linears ``widths`` (``name -> in_features``), or None.

    ``key`` is the option's name in the message (``group_size``, ``stages.0.group_size``...)."""
    odd = undivided(group_size, widths)
    if not odd:
        return None
    fits = fitting_group_sizes(widths)
    examples = ", ".join(f"{n} (in_features={widths[n]})" for n in odd[:3])
    return (
        f"{key}={group_size} does not divide the in_features of {len(odd)} layer(s), e.g. {examples}; "
        f"group sizes that fit every layer: {', '.join(map(str, fits)) if fits else 'none of ' + str(list(COMMON_GROUP_SIZES))}"
        + ("" if fits else " (keep the odd layers in higher precision)")
    )


def embedding_width_error(group_size: int, width: int, key: str = "embedding_group_size") -> str | None:
    """Why ``group_size`` cannot group an embedding table ``width`` wide, or None."""
    even = embedding_group_size_error(group_size)
    if even:
        return even.replace("embedding_group_size", key, 1)
    if width % group_size:
        fits = [g for g in COMMON_GROUP_SIZES if width % g == 0]
        return (
            f"{key}={group_size} does not divide the embedding width {width}; "
            f"choose one that does (e.g. {fits[0] if fits else 2})"
        )
    return None
