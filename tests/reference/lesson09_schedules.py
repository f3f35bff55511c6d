#!/usr/bin/env python3
"""Lesson 09 reference values: the op order of PyTorch's own pipeline schedules.

torch.distributed.pipelining computes each rank's order of actions when a schedule is built
(`pipeline_order`), before anything runs; this script builds the schedules on stand-in stages
(no process group, no model) and records every rank's order:

- ScheduleInterleaved1F1B (Megatron-LM's interleaved 1F1B: warm-up 2 (p - r - 1) + (v - 1) p,
  micro-batches through each chunk in groups of p) for p ranks of v chunks each;
- ScheduleInterleavedZeroBubble with one chunk per rank, which is ZB-H1 (Qi et al. 2024,
  section 2.1): PyTorch writes the split backward as I (BACKWARD_INPUT) and W (BACKWARD_WEIGHT).

An action is written as lesson 09's to_string() writes an Op: "F3", "B0", "I2", "W1", with the
rank's chunk first when it holds several ("1F0"). Run with the venv's PyTorch (2.x; 1.13 has no
torch.distributed.pipelining):

    ~/.cache/dtc-course/venv/bin/python tests/reference/lesson09_schedules.py

writes tests/reference/lesson09_schedules.json, which tests/lesson09/schedule_test.cpp reads.
"""
import json
import pathlib

import torch
from torch.distributed.pipelining import schedules

OUT = pathlib.Path(__file__).with_suffix(".json")
LETTER = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


class StandInStage:
    """What a schedule's constructor reads of a stage: its place in the pipeline."""

    def __init__(self, p: int, rank: int, index: int, n: int):
        self.group_size, self.group_rank = p, rank
        self.stage_index, self.num_stages = index, n
        self.is_first, self.is_last = index == 0, index == n - 1
        self.stage_index_to_group_rank = {i: i % p for i in range(n)}
        self.has_backward = True
        self.submod = torch.nn.Linear(1, 1)


def order(cls, p: int, v: int, m: int, rank: int) -> str:
    stages = [StandInStage(p, rank, c * p + rank, p * v) for c in range(v)]
    schedule = cls(stages, m, loss_fn=lambda out, target: out)
    ops = []
    for action in schedule.pipeline_order[rank]:
        if action is None:  # an idle slot of PyTorch's timetable
            continue
        chunk = f"{action.stage_index // p}" if v > 1 else ""
        ops.append(f"{chunk}{LETTER[action.computation_type.name]}{action.microbatch_index}")
    return " ".join(ops)


def main() -> None:
    cases = []
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 2, 4), (2, 3, 6), (3, 2, 6), (4, 3, 12)]:
        cases.append({"schedule": "interleaved", "stages": p, "chunks": v, "micro_batches": m,
                      "ranks": [order(schedules.ScheduleInterleaved1F1B, p, v, m, r)
                                for r in range(p)]})
    for p, m in [(4, 8), (2, 4), (3, 6), (4, 4), (2, 8)]:
        cases.append({"schedule": "zb-h1", "stages": p, "chunks": 1, "micro_batches": m,
                      "ranks": [order(schedules.ScheduleInterleavedZeroBubble, p, 1, m, r)
                                for r in range(p)]})
    OUT.write_text(json.dumps({"torch": torch.__version__, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases, PyTorch {torch.__version__}")


if __name__ == "__main__":
    main()
