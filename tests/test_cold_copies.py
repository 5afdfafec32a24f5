"""How many copies of the operands a timing rotates through so that each op reads its own
operands from HBM (measure.timing): sized by each op's bytes, not by all the ops' together."""

from __future__ import annotations

import torch

from gemmtune.measure.timing import cold_copies, copies_for_each, copies_to_exceed_l2

MIB = 1 << 20
L2 = 50 * MIB


def test_each_op_gets_copies_enough_for_its_own_bytes():
    # An 8 MiB MXFP4 weight beside a 32 MiB bf16 one: sized by the sum (40 MiB), 3 sets would
    # keep the MXFP4 weight's 24 MiB in L2; each op's own bytes need 13 sets.
    assert copies_to_exceed_l2(40 * MIB, L2) == 3
    assert copies_for_each([8 * MIB, 32 * MIB], L2) == 13
    assert 13 * 8 * MIB >= 2 * L2
    # No more than all the sets fit in memory, and at least 2.
    assert copies_for_each([1 << 30, 1 << 30], L2) == 2
    assert copies_for_each([MIB, 1 << 30], L2, max_total_bytes=4 << 30) == 3


def test_cold_copies_sizes_the_sets_by_each_ops_tensors():
    x = torch.zeros(16, dtype=torch.uint8)
    small = torch.zeros(MIB, dtype=torch.uint8)
    large = torch.zeros(8 * MIB, dtype=torch.uint8)
    by_op = cold_copies((x, small, large), per_op=((0, 1), (0, 2)))
    assert len(by_op) == copies_for_each([MIB + 16, 8 * MIB + 16])
    assert len(by_op) > len(cold_copies((x, small, large)))
    assert by_op[0][1] is small and by_op[1][1] is not small and torch.equal(by_op[1][1], small)
