"""The one-process engine: a thread per device, the mailbox between them, and
``Pipe.train_step``. It imports ``seqpipe.core``, never ``seqpipe.distributed``.
"""
