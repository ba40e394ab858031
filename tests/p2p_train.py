"""Each of 2 gloo ranks sends to the other and then receives from it (``isend`` then ``irecv``, as a
pipeline schedule's first exchange does), under the statistics task; run by
``test_collective_overlap.py`` as ``torchrun --nproc-per-node 2 p2p_train.py OUT``.  gloo's
point-to-point works have no future: a probe that waited for the send at its call would block both
ranks (each in a send the other has not posted the receive of); the group's timeout turns that into
an error instead of a hang.  Each rank writes ``OUT/result{rank}.json``: what it received."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from dispatchprobe import DispatchProbe
from parallel_models import run_and_end


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    peer = 1 - rank
    sent, received = torch.full((4,), rank + 1.0), torch.zeros(4)
    probe = DispatchProbe(task="statistics", dump_path=os.path.join(out, "run"))
    with probe:
        works = [dist.isend(sent, peer), dist.irecv(received, peer)]
        for work in works:
            work.wait()
        doubled = received * 2
    probe.step()
    probe.close()
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump({"received": received.tolist(), "doubled": doubled.tolist()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
