"""`moeinf bench e2e` with the decoding thread pinned to CPU 0 once a configuration's runtime is open (its I/O
threads, started before, keep every CPU): on this VM the disk's completion interrupts all land on CPU 1
(/proc/interrupts, virtio1-req.0), so a decoding thread there is interrupted by every read it overlaps.

    python e2e_pin.py CPU [bench e2e options]"""
import os
import sys

import moeinf

cpu = int(sys.argv.pop(1))


class PinnedMoE(moeinf.MoE):
    def __enter__(self):
        moe = super().__enter__()
        os.sched_setaffinity(0, {cpu})  # this thread only
        return moe

    def __exit__(self, *exc):
        os.sched_setaffinity(0, set(range(os.cpu_count())))
        return super().__exit__(*exc)


moeinf.MoE = PinnedMoE
from moeinf.cli import main  # noqa: E402

sys.exit(main(["bench", "e2e", *sys.argv[1:]]))
