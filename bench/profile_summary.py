"""Summarise a py-spy `--format raw` profile of a runner: where one PPO iteration's time goes.

    bench/.venv-trl/bin/py-spy record -r 200 -f raw -o bench/out/prof/hf_ppo.txt -- \
        python bench/run_hf_ppo.py --row-dir bench/out/models/b8-r32-h64 --iters 20 --no-floor
    python bench/profile_summary.py bench/out/prof/hf_ppo.txt [--root _run_epoch] [--top 40]

Only samples under `--root` (a function name: `_run_epoch` for hf_ppo's Trainer loop, `PPOTrainer.train` for the
peer) count, so start-up and model loading are left out. Prints each function's inclusive share, then the
self-time of the hottest leaves.
"""

from __future__ import annotations

import argparse
from collections import Counter


def frame_name(frame: str) -> str:
    if " (" not in frame:
        return frame
    func, where = frame.split(" (", 1)
    return f"{func} ({where.split(':')[0].split('/')[-1]})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--root", default="_run_epoch")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--grep", default=None, help="print the callers (3 frames up) of frames containing this text")
    a = p.parse_args()
    total, incl, leaves, callers = 0, Counter(), Counter(), Counter()
    for line in open(a.profile):
        stack, n = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        roots = [i for i, f in enumerate(frames) if a.root in f]
        if not roots:
            continue
        frames = frames[roots[0]:]
        n = int(n)
        total += n
        for name in {frame_name(f) for f in frames}:
            incl[name] += n
        leaves[frame_name(frames[-1])] += n
        if a.grep:
            for i, f in enumerate(frames):
                if a.grep in f:
                    callers[" <- ".join(frame_name(x) for x in frames[max(0, i - 3):i + 1][::-1])] += n
                    break
    print(f"{total} samples under {a.root}")
    for name, n in incl.most_common(a.top):
        print(f"{100 * n / total:5.1f}%  {name}")
    print("\nself time:")
    for name, n in leaves.most_common(15):
        print(f"{100 * n / total:5.1f}%  {name}")
    for name, n in callers.most_common(10):
        print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
