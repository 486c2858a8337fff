"""One trial of a ``kvweave eval`` plan, alone, with its own prefill (no shared prefill): the same sample as
the plan's row, for checking whether a row's answer is the method's or the run's.

    KVWEAVE_DATA=../shared/data python benchmarks/eval_one_trial.py --task code --context 8192 --trials 6 \\
        --trial 2 --methods "depthweave;depthweave:protect_names=2"

Prints one JSON line per method: its score, prediction and compression.
"""

from __future__ import annotations

import argparse
import json

from kvweave.eval import runner
from kvweave.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--trials", type=int, default=6, help="the plan's trial count (it sets the depths)")
    parser.add_argument("--trial", type=int, required=True, help="which trial of the plan to run")
    parser.add_argument("--methods", required=True, help="method specs separated by ';'")
    args = parser.parse_args()
    if not 0 <= args.trial < args.trials:
        parser.error(f"--trial {args.trial} is not a trial of a {args.trials}-trial plan")
    model, tokenizer = load_model(args.model)
    config = runner.EvalConfig(
        model=args.model,
        tasks=[args.task],
        contexts=[args.context],
        methods=args.methods.split(";"),
        trials=args.trials,
    )
    for trial in runner.plan(config):
        if trial.trial != args.trial:
            continue
        row = runner.run_trial(model, tokenizer, config, trial, config.sample(trial, tokenizer))
        print(
            json.dumps({k: row[k] for k in ("method", "trial", "score", "prediction", "compression")}),
            flush=True,
        )


if __name__ == "__main__":
    main()
