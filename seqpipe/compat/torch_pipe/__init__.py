"""A stand-in for ``torch.distributed.pipeline.sync``, removed from PyTorch in 2.4.

Code written for torch's ``Pipe`` ports by changing its imports —
``torch.distributed.pipeline.sync`` becomes ``seqpipe.compat.torch_pipe``, submodules
included::

    from seqpipe.compat.torch_pipe import NoChunk, Pipe, WithDevice
    from seqpipe.compat.torch_pipe.skip import Namespace, pop, skippable, stash
    from seqpipe.compat.torch_pipe.utils import partition_model

    model = Pipe(model, chunks=8)           # layers already on their devices
    output = model(x).local_value()         # forward returns an RRef-like LocalRRef

``torch.distributed.rpc.init_rpc`` is not needed (a call to it may stay). See
``docs/migration.md`` for what behaves differently and why.
"""
from __future__ import annotations

from seqpipe.compat.torch_pipe import microbatch, skip, utils
from seqpipe.compat.torch_pipe.microbatch import NoChunk
from seqpipe.compat.torch_pipe.pipe import Pipe, PipeSequential, WithDevice
from seqpipe.compat.torch_pipe.rref import LocalRRef
from seqpipe.core.flags import is_checkpointing, is_recomputing

__all__ = ["Pipe", "WithDevice", "PipeSequential", "LocalRRef", "NoChunk", "is_checkpointing",
           "is_recomputing", "microbatch", "skip", "utils"]
