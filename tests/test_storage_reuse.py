"""A storage whose memory is freed while its object lives on (FSDP2 resizes its unsharded
parameters' storage to 0 after the forward and back before the backward) no longer vouches for
the address it held: a new tensor given that address is measured, not served the statistics
or saved values of the tensor that was there."""

from __future__ import annotations

import torch

from dispatchprobe import DispatchProbe, load


N = 16384      # 64 KiB: a block the host allocator often hands to the next request of its size


def _record_reuse(path, task: str, tries: int = 32):
    """Records ``mul`` of a tensor whose storage is then resized to 0 (its memory freed, its
    storage object kept, as FSDP2 does to its unsharded parameters), then ``mul`` of a new tensor
    of other values; tried until the new tensor is given the freed address.  Returns the index of
    that try and the new tensor's value."""
    held = []
    with DispatchProbe(task=task, dump_path=str(path)) as probe:
        for i in range(tries):
            p = torch.arange(N, dtype=torch.float32)      # the unsharded parameter
            torch.mul(p, 1)                               # its statistics (and values) cached by address
            freed = p.data_ptr()
            p.untyped_storage().resize_(0)
            q = torch.full((N,), 5.0 + i)
            torch.mul(q, 1)
            held += [p, q]                                # every storage lives through the step
            if q.data_ptr() == freed:
                break
        probe.step()
    assert q.data_ptr() == freed, f"the allocator never gave a new tensor the freed address in {tries} tries"
    return i, 5.0 + i


def test_reused_address_is_measured(tmp_path):
    for task in ("statistics", "tensor"):
        i, fill = _record_reuse(tmp_path / task, task)
        part = load(tmp_path / task).part(0, 0)
        muls = [r for r in part.records if r["op"] == "aten.mul.Tensor"]
        assert len(muls) == 2 * (i + 1), task
        first, second = (r["inputs"][0] for r in muls[-2:])
        assert first["stats"]["max"] == N - 1 and first["stats"]["min"] == 0.0, task
        assert second["stats"]["max"] == fill and second["stats"]["min"] == fill, task
        if task == "tensor":
            assert first["data"] != second["data"]
            assert (part.tensor(second["data"]) == fill).all()
