"""spark-submit entry point of the joiner: ``spark-submit spark/photon_join.py --dc dc-a --logs ... --out ...``.
Takes the same options as ``photon join``; the Spark master and resources come from spark-submit."""

import sys

from photon.cli import main

if __name__ == "__main__":
    sys.argv = ["photon", "join", *sys.argv[1:]]
    main()
