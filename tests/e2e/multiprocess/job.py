"""One training job, run by `tests/e2e/test_multi_process.py` in one process with 4 CPU devices
(`--name one --cpu-devices 4`) and in each of 2 processes with 2 (`--coordinator ...`).

It trains both variants for 20 steps on a mesh over every device, loads an LM checkpoint
(its own, or the other job's) onto a data=2,model=2 mesh and generates from it, and writes
what it saw to `OUT/<name>.json` (process 0 only). With `--die-in DIR` it then runs
`kvjax train --task lm` into DIR, the same LM training, in which process 0 (the one that
also serves the job's coordination) kills itself (SIGKILL) after step 12: a process of a
job dying in the middle, at a known step. With
`--resume DIR` it then waits for `DIR.ended` to appear (the killed job is over) and
finishes that run, writing its losses to `OUT/resumed.json`.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from kvjax import distributed

STEPS = 20
KILLED_AT = 12  # process 0 dies after this step
# `kvjax train --task lm --preset tiny --steps 20 --batch-size 8 --save-every 5` asks for these.
LM_OPTIONS = dict(steps=STEPS, warmup_steps=2, batch_size=8, save_every=5, preset="tiny",
                  model_overrides={"num_encoder_layers": 0}, progress=False, seed=0)
LM_COMMAND = ["train", "--task", "lm", "--preset", "tiny", "--steps", "20", "--batch-size", "8",
              "--save-every", "5", "--no-progress"]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]  # 5: filled up to 6
NEW_TOKENS = 8


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--name", required=True)  # of the JSON file and the run directories
    parser.add_argument("--text", required=True)  # the LM's training text
    parser.add_argument("--load", default=None)  # generate from this job's LM, not our own
    parser.add_argument("--die-in", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--cpu-devices", type=int, required=True)
    args = parser.parse_args(argv)
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           cpu_devices=args.cpu_devices)
    out = Path(args.out)
    report = run(out, args)
    if distributed.is_primary():
        (out / f"{args.name}.json").write_text(json.dumps(report))
    if args.die_in:
        train_and_die(args)
    if args.resume:
        (out / "resumed.json").write_text(json.dumps(resume(Path(args.resume), args.text)))


def run(out: Path, args) -> dict:
    import jax

    from kvjax import parallel
    from kvjax.train import tasks, trainer

    mesh = parallel.make_mesh()  # data=4, over both processes where there are two
    report = {"processes": jax.process_count(), "devices": jax.device_count(),
              "rows": str(parallel.local_rows(8, mesh))}
    lm = tasks.train_lm(out / f"{args.name}-lm", data_files=[args.text], mesh=mesh,
                        **LM_OPTIONS)
    config, train_config, task = translate_variant()
    translate = trainer.train(config, train_config, task, out / f"{args.name}-translate",
                              mesh=mesh)
    for variant, result in (("lm", lm), ("translate", translate)):
        report[variant] = {"losses": result.losses, "metrics": result.metrics}
    if args.load:  # the other job runs at the same time: wait for its checkpoint
        wait_for(out / f"{args.load}.json")
    report["generated"] = generated(out / f"{args.load or args.name}-lm")
    return report


def generated(directory: Path) -> dict:
    """The checkpoint in `directory` loaded onto a data=2,model=2 mesh: where its params
    went, and the greedy tokens and their log-probabilities it makes there."""
    import jax

    from kvjax import checkpoint, decode, parallel
    from kvjax import model as M

    mesh = parallel.make_mesh("data=2,model=2")
    config, _, params = checkpoint.load_for_sampling(directory, mesh)
    wanted = parallel.state_shardings(params, mesh)
    placed = all(leaf.sharding == sharding for leaf, sharding in
                 zip(jax.tree.leaves(params), jax.tree.leaves(wanted), strict=True))
    split = sum(not leaf.is_fully_addressable for leaf in jax.tree.leaves(params))
    out = decode.generate(M.build_model(config), params, PROMPTS, max_new_tokens=NEW_TOKENS,
                          return_logprobs=True)
    return {"placed": placed, "not_fully_addressable": split, "tokens": out.tokens.tolist(),
            "logprobs": out.logprobs.tolist()}


def resume(directory: Path, text: str) -> dict:
    from kvjax import checkpoint, parallel
    from kvjax.train import tasks

    ended = directory.with_name(directory.name + ".ended")
    wait_for(ended)
    saved = checkpoint.latest_step(directory)
    result = tasks.train_lm(directory, data_files=[text], mesh=parallel.make_mesh(),
                            resume=True, **LM_OPTIONS)
    return {"saved": saved, "losses": result.losses}


def wait_for(path: Path, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def train_and_die(args) -> None:
    import jax

    from kvjax import cli, parallel

    shard_batch, built = parallel.shard_batch, []

    def shard_batch_or_die(batch, mesh):  # called once a step, before it
        built.append(batch)
        if jax.process_index() == 0 and len(built) > KILLED_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return shard_batch(batch, mesh)

    parallel.shard_batch = shard_batch_or_die
    sys.exit(cli.main([*LM_COMMAND, "--data", args.text, "--out", args.die_in,
                       "--coordinator", args.coordinator, "--num-processes",
                       str(args.num_processes), "--process-id", str(args.process_id)]))


class _IdTokenizer:
    @staticmethod
    def encode(ids):
        return list(ids)


def translate_variant():
    from kvjax import model as M
    from kvjax.tokenizer import train_tokenizer
    from kvjax.train import data, tasks
    from kvjax.train.config import TrainConfig, TrainTask

    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog.\n" * 40], 300)
    pairs = data.reverse_task(96, seq_len=5, vocab_low=4, vocab_high=14, seed=0)
    arrays = tasks.translation_arrays(_IdTokenizer, pairs, max_len=6)
    task = TrainTask(name="translate", tokenizer=tokenizer,
                     train={k: v[:80] for k, v in arrays.items()},
                     val={k: v[80:] for k, v in arrays.items()})
    # Dropout on: its masks must not depend on which process builds which rows.
    config = M.preset("tiny", vocab_size=tokenizer.vocab_size, num_encoder_layers=1,
                      dropout=0.1)
    train_config = TrainConfig(steps=STEPS, batch_size=8, learning_rate=3e-3, warmup_steps=2,
                               eval_every=STEPS, eval_batches=1, save_every=10,
                               keep_checkpoints=1, progress=False)
    return config, train_config, task


if __name__ == "__main__":
    main(sys.argv[1:])
