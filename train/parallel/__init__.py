"""Training past one device: tensor, pipeline and expert parallelism with FSDP2 on one ``DeviceMesh``.

Everything here is PyTorch's own machinery (DTensor, ``torch.distributed.tensor.parallel``,
``torch.distributed.pipelining``, functional collectives), composed the way torchtitan composes
it: the layout is checked before anything is built (:mod:`.layout`), one mesh is built from it
(:mod:`.mesh`), a pipeline split comes first (:mod:`.pipeline`), then the tensor split
(:mod:`.tensor`) and the expert split (:mod:`.experts`), and FSDP2 shards what is left over the
data-parallel dimension last. :mod:`.grad_norm` clips over all of it.
"""
