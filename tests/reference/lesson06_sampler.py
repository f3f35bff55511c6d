#!/usr/bin/env python3
"""Lesson 06 reference values: what PyTorch's own torch.utils.data.DistributedSampler yields.

For a few dataset sizes, world sizes, seeds and epochs, with and without shuffle and drop_last,
records every rank's indices, and the raw torch.randperm of a CPU generator seeded alike (the
permutation the sampler shuffles with). Run with either PyTorch; the file records which:

    ~/.cache/dtc-course/venv/bin/python tests/reference/lesson06_sampler.py

writes tests/reference/lesson06_sampler.json, which tests/lesson06/sampler_test.cpp reads.
(Debian's python3 with torch 1.13 gives the same permutations: checked when this was written.)
"""
import json
import pathlib

import torch
from torch.utils.data import DistributedSampler

OUT = pathlib.Path(__file__).with_suffix(".json")


def main() -> None:
    cases = []
    for size, world in [(10, 3), (11, 2), (7, 4), (12, 3), (3, 4), (23, 3)]:
        for shuffle in (True, False):
            for drop_last in (False, True):
                for seed, epoch in [(0, 0), (0, 1), (5, 2)]:
                    if drop_last and size < world:
                        continue  # PyTorch: no samples at all
                    ranks = []
                    for rank in range(world):
                        s = DistributedSampler(range(size), num_replicas=world, rank=rank,
                                               shuffle=shuffle, seed=seed, drop_last=drop_last)
                        s.set_epoch(epoch)
                        ranks.append(list(s))
                    cases.append({"size": size, "world": world, "shuffle": shuffle,
                                  "drop_last": drop_last, "seed": seed, "epoch": epoch,
                                  "num_samples": len(ranks[0]), "ranks": ranks})
    perms = []
    for n, seed in [(10, 0), (10, 1), (100, 3), (1000, 42), (5000, 7)]:
        g = torch.Generator()
        g.manual_seed(seed)
        perms.append({"n": n, "seed": seed, "perm": torch.randperm(n, generator=g).tolist()})
    OUT.write_text(json.dumps({"generated_by": "tests/reference/lesson06_sampler.py",
                               "torch_version": torch.__version__, "cases": cases,
                               "randperm": perms}) + "\n")
    print(f"wrote {OUT}: {len(cases)} sampler cases, {len(perms)} permutations")


if __name__ == "__main__":
    main()
