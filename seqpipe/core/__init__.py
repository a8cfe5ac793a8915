"""What both engines share: the stage runner and action dispatch, micro-batches,
checkpointing, split backward, gradient sinks, RNG, streams, seeding and argument checks.

It imports no engine (``seqpipe.local``, ``seqpipe.distributed``) and not the face
(``seqpipe.pipe``); ``tests/test_layout.py`` checks it.
"""
