"""TorchChat: the Meta-layout ``model.pth`` + ``params.json`` its loaders accept, an AOTInductor
``.pt2`` and an ExecuTorch ``.pte``, each verified by loading it back.

The exporter is :class:`TorchChatExporter` (``exporter.py``). Where things live: the HF to Meta
key and RoPE layout in ``layout.py``; the reference Meta Llama that must reproduce the HF logits
in ``meta_llama.py``; AOTInductor packaging and its runner in ``aoti.py``; the generated run
instructions in ``runmd.py``. The ``.pte`` comes from :mod:`export.executorch`, through that
package's public names.
"""

from export.lazy import lazy_names

__all__ = ["AOTIRunner", "MetaLlamaRunner", "TorchChatExporter", "TorchChatOptions"]

__getattr__, __dir__ = lazy_names(__name__, {
    "TorchChatExporter": "exporter", "TorchChatOptions": "exporter",
    "MetaLlamaRunner": "meta_llama",
    "AOTIRunner": "aoti",
})
