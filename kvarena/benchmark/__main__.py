"""``python -m kvarena.benchmark cp ...``: the benchmarks that need a launcher (torchrun)."""

import sys

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "cp":
        sys.exit("usage: torchrun --nproc-per-node N -m kvarena.benchmark cp [options] (for everything else: kvarena bench)")
    from kvarena.benchmark.cp import main

    sys.exit(main(sys.argv[2:]))
