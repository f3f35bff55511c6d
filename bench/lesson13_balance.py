#!/usr/bin/python3
"""Load balance over training, with and without balancing: lesson 13's program, one chart.

    /usr/bin/python3 bench/lesson13_balance.py --binary build/bin/lesson13_solution \\
        [--steps 100 --lr 3e-4 --experts 8 --top-k 2] [--json-out lessons/13_moe/balance.json]
        [--svg lessons/13_moe/balance.svg]
    /usr/bin/python3 bench/lesson13_balance.py --replot lessons/13_moe/balance.json

(/usr/bin/python3: Debian's, which has matplotlib.)

Runs the program on one process (the expert-parallel runs make the same choices: the lesson's
tests prove it) once per balancing setting, with --json, and draws each run's
`expert_imbalance` per step (the busiest expert's choices over the mean, max over layers: 1 is
perfect balance, E/k means every token on the same k experts) and its loss. Every number on the
chart is the program's own output; the settings and the program's arguments are saved beside it.
"""
import argparse
import json
import pathlib
import subprocess
import sys

SETTINGS = [
    ("no balancing", ["--balance", "none"]),
    ("aux loss 0.01 (Switch)", ["--balance", "aux", "--aux-loss-coef", "0.01"]),
    ("aux loss 0.1", ["--balance", "aux", "--aux-loss-coef", "0.1"]),
    ("expert bias 0.01, sigmoid (DeepSeek-V3)",
     ["--score-func", "sigmoid", "--route-norm", "--balance", "bias", "--bias-rate", "0.01"]),
]


def last_json(text):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def plot(r, svg):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in r["runs"]:
        steps = range(1, len(run["expert_imbalance"]) + 1)
        a1.plot(steps, run["expert_imbalance"], label=run["label"], linewidth=1.2)
        a2.plot(steps, run["losses"], label=run["label"], linewidth=1.2)
    c = r["config"]
    a1.axhline(1.0, color="grey", linewidth=0.6, linestyle=":")
    a1.set_ylim(0.9, c["experts"] / c["top_k"] + 0.2)
    a1.set_xlabel("step")
    a1.set_ylabel("busiest expert / mean (max over layers)")
    a1.set_title(f"{c['experts']} experts, top-{c['top_k']}, lr {c['lr']:g}", fontsize=10)
    a1.legend(fontsize=7, loc="center right")
    a2.set_xlabel("step")
    a2.set_ylabel("loss (cross-entropy + balancing terms)")
    a2.set_title("loss", fontsize=10)
    fig.tight_layout()
    fig.savefig(svg, metadata={"Date": None})
    print(f"  chart: {svg}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="build/bin/lesson13_solution")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--extra", default="", help="more program flags, e.g. '--layers 2'")
    ap.add_argument("--json-out", default="lessons/13_moe/balance.json")
    ap.add_argument("--svg", default="lessons/13_moe/balance.svg")
    ap.add_argument("--replot", help="draw --svg from this --json-out of an earlier run, and stop")
    a = ap.parse_args()
    if a.replot:
        plot(json.loads(pathlib.Path(a.replot).read_text()), a.svg)
        return 0
    config = {"experts": a.experts, "top_k": a.top_k, "lr": a.lr, "steps": a.steps,
              "extra": a.extra}
    runs = []
    for label, flags in SETTINGS:
        cmd = [a.binary, "--experts", str(a.experts), "--top-k", str(a.top_k), "--lr",
               str(a.lr), "--steps", str(a.steps), *a.extra.split(), *flags, "--json"]
        print("$", " ".join(cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        j = last_json(p.stdout)
        if p.returncode != 0 or j is None:
            print(p.stdout[-2000:] + p.stderr[-2000:])
            return 1
        imb = j["expert_imbalance"]
        print(f"  {label:<42} imbalance step 1 {imb[0]:.2f}, last {imb[-1]:.2f}, mean of the "
              f"last 20 {sum(imb[-20:]) / len(imb[-20:]):.2f}; loss {j['losses'][-1]:.4f}")
        runs.append({"label": label, "args": cmd[1:], "expert_imbalance": imb,
                     "losses": j["losses"], "router_counts_last": j["router_counts"][-1]})
    result = {"generated_by": "bench/lesson13_balance.py", "config": config, "runs": runs}
    pathlib.Path(a.json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"  data: {a.json_out}")
    plot(result, a.svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
