"""Drop-in replacements for the two pipeline libraries seqpipe succeeds.

* :mod:`seqpipe.compat.torchgpipe` stands in for ``torchgpipe`` (``GPipe``, ``skip``,
  ``balance``, ``batchnorm``, ``is_checkpointing``, ``is_recomputing``).
* :mod:`seqpipe.compat.torch_pipe` stands in for ``torch.distributed.pipeline.sync``, removed
  from PyTorch in 2.4 (``Pipe``, ``WithDevice``, ``skip``, ``utils.partition_model``).

Porting is an import change: ``torchgpipe`` becomes ``seqpipe.compat.torchgpipe`` and
``torch.distributed.pipeline.sync`` becomes ``seqpipe.compat.torch_pipe``, submodules included.
Both run on seqpipe's engine, so the behaviour is seqpipe's wherever the peers fell short
(see ``docs/migration.md`` for every difference). Checkpoints the peers saved load with
``load_state_dict`` into the compat classes.

Nothing is imported here: each stand-in is imported on its own, so using one costs nothing of
the other.
"""
from __future__ import annotations

__all__ = ["torchgpipe", "torch_pipe"]
