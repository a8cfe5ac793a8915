"""Pipelined training in one process with seqpipe.Pipe (the same demo as `python -m seqpipe`).

    python examples/train_local.py --partitions 2 --chunks 8 --checkpoint except_last
"""
from seqpipe.demo import main

if __name__ == "__main__":
    main()
