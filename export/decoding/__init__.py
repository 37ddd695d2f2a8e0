"""Decoding: the loops that turn a runner's logits into tokens, one copy that every runtime package uses.

Why a package: every runtime's runner is a :class:`~export.decoding.runtime.Runner`, and the same
plain and speculative loops, drafters, draft policy and sampling drive each of them, so they live
together here rather than among the shared floor's other modules. Where things live:

- ``runtime.py``: the ``Runner`` interface, ``EagerRunner`` and plain decoding (``greedy_generate``,
  ``generate_ids``, ``argmax_ids``).
- ``sampling.py``: ``Sampling`` and ``TokenSampler`` (one draw per emitted token).
- ``speculative.py``: ``speculative_generate``, the loop that verifies several drafted tokens a call.
- ``drafters.py``: what that loop verifies (``NgramDrafter``, ``ModelDrafter``, ``HybridDrafter``).
- ``draft_policy.py``: ``DraftLength``, how many drafted tokens a step verifies.
- ``text_stream.py``: ``TextStream``, generated ids as text in whole characters.

Callers import the submodules (``from export.decoding.runtime import Runner``); this package
imports nothing on its own.
"""
