"""``python -m seqpipe``: run the pipelined training demo (see ``seqpipe.demo``).

Ctrl-C ends it with one line and exit status 130 (128 + SIGINT, as a shell reports it).
"""
import sys

from seqpipe.demo import main

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("seqpipe: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
