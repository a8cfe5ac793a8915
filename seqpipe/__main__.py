"""``python -m seqpipe``: run the pipelined training demo (see ``seqpipe.demo``)."""
from seqpipe.demo import main

if __name__ == "__main__":
    main()
